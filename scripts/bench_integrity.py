"""What checksums cost: DataStatesIO flush with and without CRC-32s, and load with and without verification.

Usage: python3 scripts/bench_integrity.py [DIR] [--mib 512] [--rounds 5]. Checksums are always written; for
comparison only, "bare" swaps the engine's checksumming session for the storage session itself (CRC fields stay
zero, chunks written whole), and "windows, no CRC" for one that writes in the same 1 MiB windows without
checksumming (the CRC-32's own cost). Flushes are timed from the save call to the commit
(``SnapshotStats.durable_s``); loads from the call to the returned dict, file in the page cache.
Variants alternate within each round. Prints medians.
"""

from __future__ import annotations

import os
import statistics
import time

from bench_common import parse_args, random_checkpoint

from lightning_datastates import DataStatesIO
from lightning_datastates.records.checksums import WINDOW_BYTES
from lightning_datastates.snapshot import engine as engine_module


class WindowedSession:
    """Writes like ChecksummingSession, in windows, without checksumming."""

    def __init__(self, inner) -> None:
        self.inner, self.path = inner, inner.path

    def write_range(self, offset, data) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, WINDOW_BYTES):
            self.inner.write_range(offset + start, view[start : start + WINDOW_BYTES])

    def complete(self) -> None:
        self.inner.complete()

    def abort(self) -> None:
        self.inner.abort()


def main() -> None:
    args, directory = parse_args(__doc__, rounds=5)
    checkpoint = random_checkpoint(args.mib)
    plugin, unverified = DataStatesIO(), DataStatesIO(verify_checksums=False)
    path = os.path.join(directory, "bench.ckpt")
    plugin.save_checkpoint(checkpoint, path)  # allocates the arena
    with_crc = engine_module.checksummed
    variants = {
        "with CRC-32": with_crc,
        "bare": lambda session, slots: session,
        "windows, no CRC": lambda session, slots: WindowedSession(session),
    }
    flush: dict[str, list[float]] = {name: [] for name in variants}
    load: dict[str, list[float]] = {"verified": [], "unverified": []}
    for round_ in range(args.rounds):
        for name in list(flush)[round_ % 3 :] + list(flush)[: round_ % 3]:
            engine_module.checksummed = variants[name]
            plugin.save_checkpoint(checkpoint, path)  # returns once committed
            flush[name].append(plugin.stats[-1].durable_s)
        engine_module.checksummed = with_crc
        plugin.save_checkpoint(checkpoint, path)
        for name in list(load)[round_ % 2 :] + list(load)[: round_ % 2]:
            started = time.perf_counter()
            (plugin if name == "verified" else unverified).load_checkpoint(path, weights_only=True)
            load[name].append(time.perf_counter() - started)
    plugin.teardown()
    mib = os.path.getsize(path) / 2**20
    os.unlink(path)
    print(f"{mib:.0f} MiB to {directory}, median of {args.rounds}, {os.cpu_count()} CPUs")
    for title, rows in (("flush", flush), ("load", load)):
        for name, times in rows.items():
            median = statistics.median(times)
            print(f"{title} {name:<16} {median:6.3f} s  {mib / median:7.0f} MiB/s")
    crc = statistics.median(flush["with CRC-32"])
    print(f"flush time with CRC-32 / bare: {crc / statistics.median(flush['bare']):.2f}x")
    print(f"flush time with CRC-32 / windows, no CRC: {crc / statistics.median(flush['windows, no CRC']):.2f}x")
    print(
        "load cost of verification: "
        f"{statistics.median(load['verified']) / statistics.median(load['unverified']):.2f}x time"
    )


if __name__ == "__main__":
    main()
