"""The rounds: each method trained once per round, each in a fresh subprocess, and the raw throughput of the target.

Runs in the parent process (``python -m lightning_datastates.benchmark``), on its main thread, and never imports
torch: each training run is a worker subprocess (:mod:`lightning_datastates.benchmark.worker`) that trains the same
GPT-style model on the same synthetic tokens under one method; the parent waits for it, reads its JSON, and then, once
per round, writes one file of a checkpoint's size to the same target to measure what the storage itself can do.
Every other round runs the methods in reverse order, so that a drift of a shared machine's speed does not favour the
methods that run first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

#: The raw-throughput probe writes in calls of this size (a large sequential write, as a checkpoint's flush is).
_RAW_CHUNK_BYTES = 64 * 2**20


@dataclass
class Measurements:
    """What :func:`run_rounds` measured: every worker's result, and the target's raw write throughput."""

    #: Per round, each method's run (the worker's JSON), in the order the methods were asked for.
    runs: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    #: Per round (where a checkpoint had bytes): the faster of ``buffered`` and ``direct``, bytes per second.
    raw_write_Bps: list[float] = field(default_factory=list)
    #: Per kind of write (``buffered``, ``direct``): its bytes per second in each round that measured it.
    raw_write_Bps_by_kind: dict[str, list[float]] = field(default_factory=lambda: {"buffered": [], "direct": []})
    #: The model's parameter count, as the last worker reported it.
    params: int = 0

    def raw_of_round(self, index: int) -> float | None:
        """The raw throughput of round ``index`` (from 0); None where none was measured."""
        return self.raw_write_Bps[index] if len(self.raw_write_Bps) > index else None


def raw_write_throughput(directory: str, nbytes: int, direct: bool = False) -> float | None:
    """Bytes per second of writing ``nbytes`` sequentially into a new file in ``directory`` (64 MiB ``write``
    calls) and fsyncing it; the file is removed afterwards.

    ``direct``: with ``O_DIRECT`` from a page-aligned buffer (``nbytes`` rounded up to whole 4 KiB blocks), as a
    tool such as ``fio --direct=1`` measures a device; None where the file system refuses it.
    """
    size = min(nbytes, _RAW_CHUNK_BYTES)
    buffer = mmap.mmap(-1, -(-size // 4096) * 4096)  # anonymous mappings are page-aligned
    buffer.write(os.urandom(size))
    block = memoryview(buffer)
    if direct:
        nbytes = -(-nbytes // 4096) * 4096
    path = os.path.join(directory, f".raw-write-{os.getpid()}.bin")
    elapsed: float | None = None
    try:
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0), 0o600)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, block[: min(left, len(block))])
            os.fsync(fd)
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - started  # before the unlink: only the write and the fsync are timed
    except OSError:
        if not direct:
            raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        block.release()
        buffer.close()
    return None if elapsed is None else nbytes / elapsed


def method_order(methods: list[str], round_index: int) -> list[str]:
    """The order in which round ``round_index`` (from 0) runs ``methods``: as given, reversed in every other round.

    The speed of a shared machine drifts over minutes; in a fixed order the methods that run late in each round
    would pay for a slowdown more often than those that run early, and paired overheads would be biased. An even
    number of rounds balances the two orders exactly.
    """
    return list(methods) if round_index % 2 == 0 else list(reversed(methods))


def _spawn(args: argparse.Namespace, method: str, directory: str, result_path: str) -> dict[str, Any]:
    """Run ``method`` in a worker subprocess (checkpoints into ``directory``) and wait for it; its JSON result."""
    command = [sys.executable, "-m", "lightning_datastates.benchmark", "--worker", method, "--result", result_path,
               "--model", args.model, "--steps", str(args.steps), "--every", str(args.every), "--dir", directory,
               "--accelerator", args.accelerator]  # fmt: skip
    if args.selftest_wait_durable:
        command.append("--selftest-wait-durable")
    for option in args.datastates:
        command += ["--datastates", option]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"method {method} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    with open(result_path) as result:
        run: dict[str, Any] = json.load(result)
    return run


def run_rounds(args: argparse.Namespace) -> Measurements:
    """Run every method of ``args.methods`` ``args.rounds`` times (checkpoints under ``args.dir``, else a temporary
    directory, removed with the checkpoints unless ``args.keep``); a line on stdout per run."""
    measured = Measurements()
    base = args.dir or tempfile.mkdtemp(prefix="datastates-bench-")
    os.makedirs(base, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="datastates-bench-results-")
    print(
        f"benchmark: GPT {args.model}, {args.steps} steps, a checkpoint every {args.every}, {args.rounds} round(s), "
        f"methods {', '.join(args.methods)}; checkpoints in {base}"
    )
    try:
        for index in range(args.rounds):
            runs: dict[str, dict[str, Any]] = {}
            for method in method_order(args.methods, index):
                directory = os.path.join(base, f"r{index}-{method}")
                runs[method] = _spawn(args, method, directory, os.path.join(scratch, f"{index}-{method}.json"))
                measured.params = runs[method]["params"]
                nbytes = max((c["bytes"] for c in runs[method]["checkpoints"]), default=0)
                if not args.keep:
                    shutil.rmtree(directory, ignore_errors=True)
                if nbytes and len(measured.raw_write_Bps) <= index:  # same bytes, same target, same round
                    by_kind = {
                        k: raw_write_throughput(base, nbytes, direct=k == "direct")
                        for k in measured.raw_write_Bps_by_kind
                    }
                    for kind, bps in by_kind.items():
                        if bps is not None:
                            measured.raw_write_Bps_by_kind[kind].append(bps)
                    measured.raw_write_Bps.append(max(bps for bps in by_kind.values() if bps is not None))
                blocked = [c["call_s"] + c["barrier_s"] for c in runs[method]["checkpoints"]]
                print(
                    f"  round {index + 1} {method:<10} train {runs[method]['train_s']:6.2f} s, "
                    f"blocked p50 {(statistics.median(blocked) * 1e3 if blocked else 0):8.1f} ms"
                )
            measured.runs.append({m: runs[m] for m in args.methods})  # reported in the order asked for
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.dir and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return measured
