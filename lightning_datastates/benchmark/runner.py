"""The rounds: each method trained once per round, each in a fresh subprocess, and the raw throughput of the target.

Runs in the parent process (``python -m lightning_datastates.benchmark``), on its main thread, and never imports
torch: each training run is a worker subprocess (:mod:`lightning_datastates.benchmark.worker`) that trains the same
GPT-style model on the same synthetic tokens under one method; the parent waits for it, reads its JSON, and then, once
per round, writes one file of a checkpoint's size to the same target (uploads one object to an ``s3://`` target), and to
the ``tiered`` method's local tier, to measure what the storage itself can do
(:mod:`~lightning_datastates.benchmark.targets`).
Every other round runs the methods in reverse order, so that a drift of a shared machine's speed does not favour the
methods that run first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from lightning_datastates.benchmark.targets import Target


@dataclass
class Measurements:
    """What :func:`run_rounds` measured: every worker's result, and the raw throughput of the target and of the
    local tier (see :mod:`~lightning_datastates.benchmark.targets`)."""

    #: Per round, each method's run (the worker's JSON), in the order the methods were asked for.
    runs: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    #: Per round (where a checkpoint had bytes): the target's fastest kind of raw write, bytes per second.
    raw_write_Bps: list[float] = field(default_factory=list)
    #: Per kind of raw write of the target (``buffered`` and ``direct``, or ``upload`` to S3): its bytes per second in
    #: each round that measured it.
    raw_write_Bps_by_kind: dict[str, list[float]] = field(default_factory=lambda: {"buffered": [], "direct": []})
    #: As ``raw_write_Bps`` and ``raw_write_Bps_by_kind``, for the local tier of the ``tiered`` method.
    local_raw_write_Bps: list[float] = field(default_factory=list)
    local_raw_write_Bps_by_kind: dict[str, list[float]] = field(default_factory=dict)
    #: An ``s3://`` target's part size and parts in flight (the plugin's S3 writer's, as a worker reported them).
    s3_transfer: list[int] | None = None
    #: The model's parameter count, as the last worker reported it.
    params: int = 0

    def raw_of_round(self, index: int) -> float | None:
        """The target's raw throughput in round ``index`` (from 0); None where none was measured."""
        return self.raw_write_Bps[index] if len(self.raw_write_Bps) > index else None

    def local_raw_of_round(self, index: int) -> float | None:
        """The local tier's raw throughput in round ``index`` (from 0); None where none was measured."""
        return self.local_raw_write_Bps[index] if len(self.local_raw_write_Bps) > index else None

    def add_raw(self, local: bool, by_kind: dict[str, float | None]) -> None:
        """One round's raw measurements of the target (or of the local tier): each kind, and the fastest."""
        kinds = self.local_raw_write_Bps_by_kind if local else self.raw_write_Bps_by_kind
        for kind, bps in by_kind.items():
            if bps is not None:
                kinds.setdefault(kind, []).append(bps)
        measured = [bps for bps in by_kind.values() if bps is not None]
        if measured:
            (self.local_raw_write_Bps if local else self.raw_write_Bps).append(max(measured))


def method_order(methods: list[str], round_index: int) -> list[str]:
    """The order in which round ``round_index`` (from 0) runs ``methods``: as given, reversed in every other round.

    The speed of a shared machine drifts over minutes; in a fixed order the methods that run late in each round
    would pay for a slowdown more often than those that run early, and paired overheads would be biased. An even
    number of rounds balances the two orders exactly.
    """
    return list(methods) if round_index % 2 == 0 else list(reversed(methods))


def _spawn(args: argparse.Namespace, method: str, directory: str, result_path: str) -> dict[str, Any]:
    """Run ``method`` in a worker subprocess (checkpoints into ``directory``; ``tiered``: its local tier is
    ``args.local_tier/<the run's name>``) and wait for it; its JSON result."""
    command = [sys.executable, "-m", "lightning_datastates.benchmark", "--worker", method, "--result", result_path,
               "--model", args.model, "--steps", str(args.steps), "--every", str(args.every), "--dir", directory,
               "--accelerator", args.accelerator]  # fmt: skip
    if method == "tiered":
        command += ["--local-tier", os.path.join(args.local_tier, run_name(directory))]
        if args.resume:
            command.append("--resume")
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


def run_name(directory: str) -> str:
    """The name of a run (``r0-datastates``) from its checkpoint directory or URL."""
    return directory.rstrip("/").rsplit("/", 1)[-1]


def _measure_raw(measured: Measurements, target: Target, run: dict[str, Any], index: int) -> None:
    """Once per round, after the first run that saved bytes: the raw throughput of the target and of the local tier
    for a checkpoint of that run's size (same bytes, same storage, same round)."""
    nbytes = max((c["bytes"] for c in run["checkpoints"]), default=0)
    if not nbytes or len(measured.raw_write_Bps) > index:
        return
    if run.get("s3_transfer"):
        measured.s3_transfer = run["s3_transfer"]
    measured.add_raw(False, target.raw_Bps(nbytes, measured.s3_transfer))
    if target.local_base is not None:
        measured.add_raw(True, target.local_raw_Bps(nbytes))


def run_rounds(args: argparse.Namespace, target: Target) -> Measurements:
    """Run every method of ``args.methods`` ``args.rounds`` times (checkpoints under ``target``, each run's removed
    after it unless ``args.keep``); a line on stdout per run."""
    measured = Measurements(raw_write_Bps_by_kind={kind: [] for kind in target.raw_kinds})
    scratch = tempfile.mkdtemp(prefix="datastates-bench-results-")
    local = f", local tier in {target.local_base}" if target.local_base else ""
    print(
        f"benchmark: GPT {args.model}, {args.steps} steps, a checkpoint every {args.every}, {args.rounds} round(s), "
        f"methods {', '.join(args.methods)}; checkpoints in {target.base}{local}"
    )
    try:
        for index in range(args.rounds):
            runs: dict[str, dict[str, Any]] = {}
            for method in method_order(args.methods, index):
                name = f"r{index}-{method}"
                runs[method] = _spawn(args, method, target.run_path(name), os.path.join(scratch, f"{name}.json"))
                measured.params = runs[method]["params"]
                if not args.keep:
                    target.remove(target.run_path(name))
                    if method == "tiered" and target.local_base is not None:
                        shutil.rmtree(os.path.join(target.local_base, name), ignore_errors=True)
                _measure_raw(measured, target, runs[method], index)
                blocked = [c["call_s"] + c["barrier_s"] for c in runs[method]["checkpoints"]]
                print(
                    f"  round {index + 1} {method:<10} train {runs[method]['train_s']:6.2f} s, "
                    f"blocked p50 {(statistics.median(blocked) * 1e3 if blocked else 0):8.1f} ms"
                )
            measured.runs.append({m: runs[m] for m in args.methods})  # reported in the order asked for
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return measured
