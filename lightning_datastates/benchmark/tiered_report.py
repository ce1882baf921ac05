"""The report's figures for the ``tiered`` method (``DataStatesIO(local_tier=...)``), its table, and its gates.

Pure functions over the workers' JSON results, run in the parent process after the last round (main thread);
:mod:`~lightning_datastates.benchmark.report` calls them. Each ``tiered`` checkpoint record has, beside the common
fields, ``durable`` (the commit on the local tier), ``persistent_durable`` (the commit at the persistent path, None
where the copy did not commit), ``replication`` (``committed``, ``cancelled`` or ``failed``) and ``replicated_bytes``.

The table "Tiers" (rows ``datastates``, single tier to the target, and ``tiered``; each figure the median over rounds):

- ``local durable p50 s``: from the save call until the local commit (``tiered``).
- ``persistent durable p50 s``: from the save call until the checkpoint is committed at the target: the
  persistent commit of ``tiered``, the only commit of ``datastates``.
- ``replicated``: checkpoints committed at the persistent path / checkpoints saved.
- ``repl MB/s``: per copy, its bytes over the time from its start until its persistent commit; a copy starts at the
  later of its local commit and the previous copy's persistent commit (the copies run one after another, each
  cut into parts in flight at once); the median over copies. ``repl vs raw``: that over the target's raw throughput
  in the same round (an ``s3://`` target: one object of a checkpoint's size uploaded from memory by boto3 with the
  plugin's part size and parts in flight; a directory: a file written and fsynced, the faster of the page cache and
  ``O_DIRECT``). ``after training``: the same for the copies that started after the last training step (typically
  the last checkpoint's): where the target's server shares the machine's cores (moto on a small host), the copies
  made during training share them with training too, and the raw upload, measured between the runs, did not.
- ``local vs raw``: per checkpoint, its local durable time over the time a raw write of its bytes takes on the local
  tier (written and fsynced, the faster of the page cache and ``O_DIRECT``, in the same round); the median.
- ``train vs single``, ``fit vs single``: per round, ``tiered``'s ``train s`` (``fit s``) over ``datastates``'s;
  the median over rounds.
- ``resume local s``, ``resume persistent s`` (``--resume``): after training, loads of the last checkpoint by a new
  ``DataStatesIO``, with the local tier (it reads the local copy) and without one (it reads the target), the local
  files dropped from the page cache first; the faster of two loads each, alternating
  (:mod:`~lightning_datastates.benchmark.resume`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

_MB = 1e6
#: The gates on the tiered figures: option, key in the table, what it compares, whether the figure is a maximum.
_GATES = (
    ("max_train_vs_single", "train_vs_single", "tiered train s / datastates train s", True),
    ("max_local_vs_raw", "local_vs_raw", "tiered local durable / raw write of the local tier", True),
    ("min_repl_vs_raw", "repl_vs_raw", "tiered replication / raw throughput of the target", False),
)


def replication_rates(checkpoints: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Each copy committed at the persistent path: when it started, and its bytes per second (see ``repl MB/s`` in the
    module docstring)."""
    rates: list[tuple[float, float]] = []
    previous_end: float | None = None
    # The replicator takes the copies in the order of their local commits.
    for c in sorted((c for c in checkpoints if c.get("durable") is not None), key=lambda c: c["durable"]):
        if c.get("persistent_durable") is None:
            continue
        begin = c["durable"] if previous_end is None else max(c["durable"], previous_end)
        if c["persistent_durable"] > begin:
            rates.append((begin, c["replicated_bytes"] / (c["persistent_durable"] - begin)))
        previous_end = c["persistent_durable"]
    return rates


def tier_figures(run: dict[str, Any], raw_bps: float | None, local_raw_bps: float | None) -> dict[str, Any]:
    """The tiered figures of one run of one round (empty for a method without a local tier)."""
    checkpoints = [c for c in run["checkpoints"] if c.get("replication") is not None]
    if not checkpoints:
        return {}
    row: dict[str, Any] = {"replicated": sum(c["replication"] == "committed" for c in checkpoints)}
    persistent = [c["persistent_durable"] - c["start"] for c in checkpoints if c.get("persistent_durable") is not None]
    if persistent:
        row["persistent_durable_p50_s"] = statistics.median(persistent)
    rates = replication_rates(checkpoints)
    if rates:
        row["repl_Bps"] = statistics.median(rate for _, rate in rates)
        # Copies that started once the training loop had ended share the machine with nothing of the run's.
        loop_end = run["steps"][-1][1] if run.get("steps") else None
        after = [rate for begin, rate in rates if loop_end is not None and begin >= loop_end]
        if raw_bps:
            row["repl_vs_raw"] = row["repl_Bps"] / raw_bps
            if after:
                row["repl_after_vs_raw"] = statistics.median(after) / raw_bps
    local = [(c["durable"] - c["start"]) * local_raw_bps / c["bytes"] for c in checkpoints
             if local_raw_bps and c.get("durable") is not None and c["bytes"]]  # fmt: skip
    if local:
        row["local_vs_raw"] = statistics.median(local)
    resume = run.get("resume") or {}
    for tier in ("local", "persistent"):
        if resume.get(f"{tier}_s") is not None:
            row[f"resume_{tier}_s"] = resume[f"{tier}_s"]
    return row


def pair_with_single(rounds: list[dict[str, dict[str, Any]]], table: dict[str, dict[str, Any]]) -> None:
    """``train_vs_single`` and ``fit_vs_single`` of the ``tiered`` row: per round against ``datastates``, then the
    median (paired by round, as the overheads against ``none``)."""
    if "tiered" not in table or "datastates" not in table:
        return
    for key, seconds in (("train_vs_single", "train_s"), ("fit_vs_single", "fit_s")):
        table["tiered"][key] = statistics.median(r["tiered"][seconds] / r["datastates"][seconds] for r in rounds)


def tiers_markdown(table: dict[str, dict[str, Any]]) -> str:
    """The table "Tiers" (see the module docstring); empty without a ``tiered`` row."""
    if "tiered" not in table:
        return ""

    def f(row: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
        value = row.get(key)
        return "-" if value is None else format(value * scale, fmt)

    cols = ["method", "local durable p50 s", "persistent durable p50 s", "replicated", "repl MB/s", "repl vs raw",
            "after training", "local vs raw", "train vs single", "fit vs single", "resume local s",
            "resume persistent s"]  # fmt: skip
    lines = ["Tiers:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for method in ("datastates", "tiered"):
        row = table.get(method)
        if row is None:
            continue
        tiered = method == "tiered"
        replicated = f"{row['replicated']:g}/{row.get('checkpoints', 0):g}" if "replicated" in row else "-"
        cells = [
            method, f(row, "durable_p50_s", ".2f") if tiered else "-",
            f(row, "persistent_durable_p50_s" if tiered else "durable_p50_s", ".2f"), replicated,
            f(row, "repl_Bps", ".0f", 1 / _MB), f(row, "repl_vs_raw", ".2f"), f(row, "repl_after_vs_raw", ".2f"),
            f(row, "local_vs_raw", ".2f"),
            f(row, "train_vs_single", ".3f"), f(row, "fit_vs_single", ".3f"), f(row, "resume_local_s", ".2f"),
            f(row, "resume_persistent_s", ".2f"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def add_tier_gates(parser: argparse.ArgumentParser) -> None:
    """The command-line options of the tiered gates (ratios within one run, never absolute times)."""
    for option, _, what, is_max in _GATES:
        bound = "exceeds" if is_max else "is below"
        parser.add_argument(f"--{option.replace('_', '-')}", type=float, metavar="R",
                            help=f"exit 1 if {what} {bound} R (median of rounds)")  # fmt: skip


def check_tier_gates(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fail the command line where a tiered gate lacks the methods it compares."""
    for option, key, _, _ in _GATES:
        if getattr(args, option) is None:
            continue
        needed = {"tiered", "datastates"} if key == "train_vs_single" else {"tiered"}
        if not needed <= set(args.methods):
            parser.error(f"--{option.replace('_', '-')} needs the methods {' and '.join(sorted(needed))}")


def tier_gates(table: dict[str, dict[str, Any]], args: argparse.Namespace) -> bool:
    """Whether every tiered gate asked for holds; a verdict line per gate on stdout (stderr where the run has no
    figure to judge: that fails)."""
    passed = True
    for option, key, what, is_max in _GATES:
        limit = getattr(args, option, None)
        if limit is None:
            continue
        value = table.get("tiered", {}).get(key)
        if value is None:
            print(f"gate: {what}: no figure to compare", file=sys.stderr)
            passed = False
            continue
        ok = value <= limit if is_max else value >= limit
        passed = passed and ok
        print(f"gate: {what} = {value:.3f} ({'max' if is_max else 'min'} {limit}) {'OK' if ok else 'FAILED'}")
    return passed
