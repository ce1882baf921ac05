"""Local load time of DataStatesIO.load_checkpoint vs torch.load(path), same file, warm and cold page cache.

    python3 scripts/bench_load.py [DIR] [--mib 512] [--rounds 3]

Every timed load ends by reading every byte of every loaded tensor (a sum per tensor), so a mapped load that has not
yet faulted its pages in pays for them inside the timing, as a real restore would. "cold" evicts the file from the
page cache first (``POSIX_FADV_DONTNEED`` after ``fsync``; clean pages only, no root needed), "warm" loads it right
after a load. The file is written by DataStatesIO (CRC-32s present), so the verified load checks every record.
Prints the median of ``--rounds`` and the ratio torch.load time / DataStatesIO time (goal of issue 4: >= 1.0).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_common import evict_from_page_cache, parse_args, random_checkpoint

from lightning_datastates import DataStatesIO


def _touch(loaded: Any) -> None:
    for tensor in loaded["state_dict"].values():
        tensor.sum()  # every byte read


def _time(load: Callable[[], Any], path: str, cold: bool) -> float:
    if cold:
        evict_from_page_cache(path)
    else:
        _touch(load())  # warm: the file is in the page cache
    started = time.perf_counter()
    _touch(load())
    return time.perf_counter() - started


def main() -> None:
    args, directory = parse_args(__doc__, rounds=3)
    path = os.path.join(directory, "model.ckpt")
    checkpoint = random_checkpoint(args.mib)
    writer = DataStatesIO()
    writer.save_checkpoint(checkpoint, path)
    writer.teardown()
    del checkpoint
    verified, unverified = DataStatesIO(), DataStatesIO(verify_checksums=False)
    methods: dict[str, Callable[[], Any]] = {
        "torch.load(path)": lambda: torch.load(path, weights_only=True),
        "torch.load(path, mmap=True)": lambda: torch.load(path, weights_only=True, mmap=True),
        "DataStatesIO load (verify_checksums)": lambda: verified.load_checkpoint(path, weights_only=True),
        "DataStatesIO load (no verification)": lambda: unverified.load_checkpoint(path, weights_only=True),
    }
    mib = os.path.getsize(path) / 2**20
    print(f"{mib:.0f} MiB file in {directory}, {os.cpu_count()} CPUs, median of {args.rounds}, every byte touched")
    results: dict[tuple[str, bool], float] = {}
    for cold in (False, True):
        times: dict[str, list[float]] = {name: [] for name in methods}
        for round_ in range(args.rounds):
            names = list(methods)
            names = names[round_ % len(names) :] + names[: round_ % len(names)]  # rotate the order
            for name in names:
                times[name].append(_time(methods[name], path, cold))
        for name, values in times.items():
            results[(name, cold)] = statistics.median(values)
    print("| load | warm s | warm MiB/s | cold s | cold MiB/s |")
    print("|---|---|---|---|---|")
    for name in methods:
        warm, cold_s = results[(name, False)], results[(name, True)]
        print(f"| {name} | {warm:.3f} | {mib / warm:.0f} | {cold_s:.3f} | {mib / cold_s:.0f} |")
    for name in list(methods)[2:]:
        for cold in (False, True):
            ratio = results[("torch.load(path)", cold)] / results[(name, cold)]
            print(f"{name} vs torch.load(path), {'cold' if cold else 'warm'}: {ratio:.2f}x")
    os.unlink(path)


if __name__ == "__main__":
    main()
