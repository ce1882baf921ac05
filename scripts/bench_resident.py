"""Load time of a checkpoint served from the host arena (serve_from_memory) vs read from local storage.

    PYTHONPATH=$PWD python scripts/bench_resident.py [DIR] [--mib 512] [--rounds 5]

One DataStatesIO saves the checkpoint (its arena is sized to hold it) and then loads it again: the load is served
from the arena. The other loads read the same file from storage: DataStatesIO's storage load with and without CRC
verification, and plain ``torch.load(path)``; "warm": right after an untimed load (the file is in the page
cache), "cold": the file evicted from the page cache first (``fsync`` then ``POSIX_FADV_DONTNEED``; the served load
does not read the file, so its two columns measure the same thing). Every timed load ends by reading every byte of
every loaded tensor. Prints the median of ``--rounds`` and each time divided by the served load's warm time.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_common import evict_from_page_cache, parse_args, random_checkpoint

from lightning_datastates import DataStatesIO
from lightning_datastates.plugin import pipeline_of


def _timed(load: Callable[[], Any], path: str | None = None, cold: bool = False) -> float:
    """Seconds of one load; ``cold``: ``path`` evicted from the page cache first, else loaded once untimed."""
    if cold and path is not None:
        evict_from_page_cache(path)
    elif path is not None:
        _timed(load)  # warm: the file (and the allocator) as a load just left them
    started = time.perf_counter()
    loaded = load()
    for tensor in loaded["state_dict"].values():
        tensor.sum()  # every byte read: a lazily mapped load pays for its page faults here
    return time.perf_counter() - started


def main() -> None:
    args, directory = parse_args(__doc__, rounds=5)
    path = os.path.join(directory, "model.ckpt")
    checkpoint = random_checkpoint(args.mib)
    resident = DataStatesIO(host_cache=f"{args.mib + 64}MiB")
    # Host tensors to a local file would be written straight from the tensors (write-through), never via the arena;
    # a checkpoint from a GPU, or bound for S3 or direct I/O, goes through the arena as this one does.
    resident.config = dataclasses.replace(resident.config, write_through=False)
    resident.save_checkpoint(checkpoint, path)  # outside fit: returns once committed; its image stays in the arena
    del checkpoint
    from_storage, unverified = DataStatesIO(), DataStatesIO(verify_checksums=False)
    methods: dict[str, Callable[[], Any]] = {
        "DataStatesIO load served from memory": lambda: resident.load_checkpoint(path, weights_only=True),
        "DataStatesIO load from storage (verify_checksums)": lambda: from_storage.load_checkpoint(path),
        "DataStatesIO load from storage (no verification)": lambda: unverified.load_checkpoint(path),
        "torch.load(path)": lambda: torch.load(path, weights_only=True),
    }
    for load in methods.values():
        _timed(load)  # warm: page cache filled, first-call costs paid
    counters = pipeline_of(resident).engine.resident.counters  # type: ignore[union-attr]
    hits_before = counters.hits
    times: dict[tuple[str, bool], list[float]] = {(name, cold): [] for name in methods for cold in (False, True)}
    for round_ in range(args.rounds):
        names = list(methods)
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:  # rotate the order
            for cold in (False, True):
                times[(name, cold)].append(_timed(methods[name], path, cold))
    assert counters.hits == hits_before + 3 * args.rounds, "the served load went to storage"
    mib = os.path.getsize(path) / 2**20
    median = {key: statistics.median(values) for key, values in times.items()}
    served = median[("DataStatesIO load served from memory", False)]
    print(f"{mib:.0f} MiB file in {directory}, {os.cpu_count()} CPUs, median of {args.rounds}, every byte touched")
    print("| load | warm s | warm MiB/s | warm / served | cold s | cold MiB/s | cold / served |")
    print("|---|---|---|---|---|---|---|")
    for name in methods:
        warm, cold = median[(name, False)], median[(name, True)]
        print(
            f"| {name} | {warm:.3f} | {mib / warm:.0f} | {warm / served:.2f}x "
            f"| {cold:.3f} | {mib / cold:.0f} | {cold / served:.2f}x |"
        )
    resident.teardown()
    os.unlink(path)


if __name__ == "__main__":
    main()
