"""The report: each run's figures, their medians over rounds, the ratios to ``none``, the markdown table, the JSON,
and the blocked-time gate.

Pure functions over the workers' JSON results, run in the parent process after the last round (main thread).

Columns of the report (one row per method; each figure is the median over ``--rounds`` of that round's value):

- ``train s``: seconds from the start of ``fit`` until the last training step ended, including that step's save
  call (a synchronous save is in it, a background flush still running is not). ``overhead`` compares it with
  ``none`` of the same round (``fit overhead`` likewise ``fit s``), median over rounds. Every other round runs
  the methods in reverse order, so that a drift of a shared machine's speed does not favour the methods that run
  first.
- ``quiet overhead``: measured inside the run itself, robust to other load on a shared machine: the training
  loop's time (first step start to last step end) over (number of steps x the median duration of the steps that
  overlap no checkpoint activity: save call, copy or flush), minus 1. ``none`` shows the natural step-time spread.
- ``fit s``: seconds of the whole ``trainer.fit`` call, including the final wait for pending writes.
- ``blocked p50/max ms``: per checkpoint, the training thread's time inside ``CheckpointIO.save_checkpoint``
  plus its waits at the method's barriers (DataStatesIO: ``on_before_optimizer_step`` and the other barrier hooks;
  dcp: the wait for staging before the optimizer step); median and largest checkpoint of the round.
- ``1st/steady``: the first checkpoint's blocked time over the median of the later ones' (a first checkpoint that
  pays for setting up, such as a host buffer allocated or page-locked at that moment, shows here; the GPU target is
  at most 2).
- ``durable p50 s``: per checkpoint, seconds from the save call until the file is on storage: DataStatesIO and dcp
  until their own commit (both fsync); torch and async until the benchmark's fsync of the written file returned.
- ``fsync p50 s``: torch and async only: how long that fsync took (part of ``durable``).
- ``flush MB/s``: file bytes / (durable time - flush start), median over checkpoints; the flush starts at the save
  call (torch, dcp, datastates: serialization, staging and copy stream into the write) or when the writer thread
  picks the file up (async). ``vs raw``: that over the raw throughput of the target measured in the same round:
  one file of the same size written sequentially in 64 MiB ``write`` calls, then ``fsync``, once through the page
  cache and once with ``O_DIRECT`` (where the file system takes it); the faster of the two counts.
- ``peak RSS GB``: the subprocess's peak resident memory during the measured fit (Linux: reset after the
  warm-up); ``extra/ckpt``: (peak RSS - peak RSS of ``none``) / checkpoint size, i.e. host memory beyond model
  and optimizer in units of one checkpoint.
- ``extra GPU GB`` (CUDA only): ``torch.cuda.max_memory_allocated`` - that of ``none``.

The ``tiered`` method's row is read the same way, its flush being the one to its local tier (``durable``: the local
commit; ``vs raw``: against the raw write of the local tier); what it does beyond, the copies to the target, is in a
second table, "Tiers" (:mod:`~lightning_datastates.benchmark.tiered_report`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from lightning_datastates.benchmark.runner import Measurements
from lightning_datastates.benchmark.tiered_report import pair_with_single, tier_figures, tiers_markdown

_MB = 1e6


def quiet_step_overhead(steps: list[list[float]], checkpoints: list[dict[str, Any]]) -> float | None:
    """The training loop's time over ``len(steps)`` times the median *quiet* step, minus 1; None without 2 quiet steps.

    A quiet step overlaps no checkpoint activity (save call, copy, flush, or the copy to the persistent tier of
    ``tiered``). Measured inside one run, this overhead does not move when other processes load the machine
    differently from one run to the next.
    """
    ends = ("copy_end", "durable", "persistent_durable")
    busy = [(c["start"], max(c["start"] + c["call_s"], *(c.get(key) or 0.0 for key in ends))) for c in checkpoints]
    quiet = [b - a for a, b in steps if not any(a < end and start < b for start, end in busy)]
    if len(quiet) < 2 or not steps:
        return None
    return (steps[-1][1] - steps[0][0]) / (statistics.median(quiet) * len(steps)) - 1


def summarize_run(run: dict[str, Any], raw_bps: float | None, local_raw_bps: float | None = None) -> dict[str, Any]:
    """One method's figures for one round (see the module docstring for their meaning): ``raw_bps`` is the
    target's raw throughput in that round, ``local_raw_bps`` the local tier's (``tiered`` only)."""
    row: dict[str, Any] = {"train_s": run["train_s"], "fit_s": run["fit_s"], "peak_rss_bytes": run["peak_rss_bytes"]}
    row["peak_gpu_bytes"] = run["peak_gpu_bytes"]
    cks = run["checkpoints"]
    quiet = quiet_step_overhead(run.get("steps", []), cks)
    if quiet is not None:
        row["quiet_overhead"] = quiet
    if not cks:
        return row
    blocked = [c["call_s"] + c["barrier_s"] for c in cks]
    row.update(blocked_p50_s=statistics.median(blocked), blocked_max_s=max(blocked), checkpoints=len(cks))
    row["first_blocked_s"] = blocked[0]
    if len(blocked) > 1 and (steady := statistics.median(blocked[1:])) > 0:
        row["first_vs_steady"] = blocked[0] / steady
    row["bytes"] = statistics.median(c["bytes"] for c in cks)
    durable = [c["durable"] - c["start"] for c in cks if c.get("durable") is not None]
    if durable:
        row["durable_p50_s"] = statistics.median(durable)
    fsyncs = [c["fsync_s"] for c in cks if c.get("fsync_s") is not None]
    if fsyncs:
        row["fsync_p50_s"] = statistics.median(fsyncs)
    rates = [c["bytes"] / (c["durable"] - c["flush_start"]) for c in cks if c.get("durable") is not None]
    tiers = tier_figures(run, raw_bps, local_raw_bps)
    flushed_to = local_raw_bps if tiers else raw_bps  # the flush of tiered is the one to its local tier
    if rates:
        row["flush_Bps"] = statistics.median(rates)
        if flushed_to:
            row["flush_vs_raw"] = row["flush_Bps"] / flushed_to
    row.update(tiers)
    return row


def combine(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Median over rounds of every per-round figure, per method; overheads (paired by round) and memory ratios
    against ``none``."""
    table: dict[str, dict[str, Any]] = {}
    for method in rounds[0]:
        keys = {k for r in rounds for k in r[method]}
        table[method] = {}
        for key in sorted(keys):
            values = [r[method][key] for r in rounds if r[method].get(key) is not None]
            if values:
                table[method][key] = statistics.median(values)
    none = table.get("none")
    for method, row in table.items():
        if none is not None and method != "none":
            # Paired: each round against that round's own run without checkpoints, then the median. A shared
            # machine drifts over minutes; a ratio of medians would mix a slow round of one with a fast of the other.
            for key, seconds in (("overhead", "train_s"), ("fit_overhead", "fit_s")):
                row[key] = statistics.median(r[method][seconds] / r["none"][seconds] - 1 for r in rounds)
            if row.get("bytes"):
                row["extra_rss_per_ckpt"] = (row["peak_rss_bytes"] - none["peak_rss_bytes"]) / row["bytes"]
            if row.get("peak_gpu_bytes") is not None and none.get("peak_gpu_bytes") is not None:
                row["extra_gpu_bytes"] = row["peak_gpu_bytes"] - none["peak_gpu_bytes"]
    pair_with_single(rounds, table)
    return table


def markdown(table: dict[str, dict[str, Any]], header: str) -> str:
    """The report as a markdown table (see the module docstring for the columns)."""

    def f(row: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
        value = row.get(key)
        return "-" if value is None else format(value * scale, fmt)

    gpu = any(row.get("extra_gpu_bytes") is not None for row in table.values())
    cols = ["method", "train s", "overhead", "quiet overhead", "fit s", "fit overhead", "blocked p50 ms",
            "blocked max ms", "1st/steady",
            "durable p50 s", "fsync p50 s", "flush MB/s", "vs raw", "peak RSS GB", "extra/ckpt"]  # fmt: skip
    if gpu:
        cols.append("extra GPU GB")
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for method, row in table.items():
        cells = [
            method, f(row, "train_s", ".2f"), f(row, "overhead", "+.1%"), f(row, "quiet_overhead", "+.1%"),
            f(row, "fit_s", ".2f"),
            f(row, "fit_overhead", "+.1%"), f(row, "blocked_p50_s", ".1f", 1e3), f(row, "blocked_max_s", ".1f", 1e3),
            f(row, "first_vs_steady", ".2f"),
            f(row, "durable_p50_s", ".2f"), f(row, "fsync_p50_s", ".2f"), f(row, "flush_Bps", ".0f", 1 / _MB),
            f(row, "flush_vs_raw", ".2f"), f(row, "peak_rss_bytes", ".2f", 1e-9), f(row, "extra_rss_per_ckpt", ".2f"),
        ]  # fmt: skip
        if gpu:
            cells.append(f(row, "extra_gpu_bytes", ".2f", 1e-9))
        lines.append("| " + " | ".join(cells) + " |")
    tiers = tiers_markdown(table)
    return "\n".join(lines) + "\n" + ("\n" + tiers if tiers else "")


def header_line(args: argparse.Namespace, measured: Measurements, table: dict[str, dict[str, Any]]) -> str:
    """The line above the table: the model, the schedule, the checkpoint size, the raw throughput of the target (and
    of the local tier), the machine."""
    sizes = [row["bytes"] for row in table.values() if row.get("bytes")]
    if measured.s3_transfer:
        part, concurrency = measured.s3_transfer
        raw = f"raw upload to the target ({part / 2**20:g} MiB parts, {concurrency} at once, boto3 from memory)"
    else:
        raw = "raw write+fsync of the target"
    tiered = "tiered" in table
    used_by = "'vs raw' and 'repl vs raw' are" if tiered else "'vs raw' is"
    raw += ": " + _raw_text(measured.raw_write_Bps, measured.raw_write_Bps_by_kind, used_by)
    if measured.local_raw_write_Bps:
        by_kind = measured.local_raw_write_Bps_by_kind
        raw += "; raw write+fsync of the local tier: " + _raw_text(
            measured.local_raw_write_Bps, by_kind, "'local vs raw' and tiered's 'vs raw' are"
        )
    return (
        f"GPT {args.model} ({measured.params / 1e6:.1f}M parameters), {args.steps} steps, checkpoint every "
        f"{args.every} ({(statistics.median(sizes) if sizes else 0) / 1e9:.2f} GB), median of {args.rounds} round(s); "
        f"{raw}; {os.cpu_count()} CPUs, 1 training thread"
    )


def _raw_text(fastest: list[float], by_kind: dict[str, list[float]], used_by: str) -> str:
    """``1073 MB/s (the faster of buffered 638, direct 1073: 'vs raw' is against it)``, or ``-`` (``used_by``: who
    is)."""
    if not fastest:
        return "-"
    kinds = ", ".join(f"{k} {statistics.median(v) / _MB:.0f}" for k, v in by_kind.items() if v)
    which = f"the faster of {kinds}" if len(by_kind) > 1 else kinds
    return f"{statistics.median(fastest) / _MB:.0f} MB/s ({which}: {used_by} against it)"


def write_reports(
    out: str, args: argparse.Namespace, report: str, measured: Measurements,
    rounds: list[dict[str, dict[str, Any]]], table: dict[str, dict[str, Any]],
) -> None:  # fmt: skip
    """``benchmark.md`` (the table ``report``) and ``benchmark.json`` (every measurement) into the directory
    ``out``."""
    with open(os.path.join(out, "benchmark.md"), "w") as md:
        md.write(report)
    last_runs = measured.runs[-1] if measured.runs else {}
    with open(os.path.join(out, "benchmark.json"), "w") as js:
        json.dump({"args": vars(args), "raw_write_Bps": measured.raw_write_Bps,
                   "raw_write_Bps_by_kind": measured.raw_write_Bps_by_kind,
                   "local_raw_write_Bps": measured.local_raw_write_Bps,
                   "local_raw_write_Bps_by_kind": measured.local_raw_write_Bps_by_kind,
                   "s3_transfer": measured.s3_transfer, "table": table, "rounds": rounds,
                   "last_round_runs": last_runs}, js, indent=1)  # fmt: skip


def blocked_gate(table: dict[str, dict[str, Any]], max_ratio: float) -> bool:
    """Whether DataStatesIO's median blocked time per checkpoint is at most ``max_ratio`` times TorchCheckpointIO's
    (a ratio within one run, never an absolute time: machines differ); the verdict on stdout (stderr without
    checkpoints to compare)."""
    ours, sync = table["datastates"].get("blocked_p50_s"), table["torch"].get("blocked_p50_s")
    if ours is None or not sync:
        print("gate: no checkpoints to compare", file=sys.stderr)
        return False
    ratio = ours / sync
    verdict = "OK" if ratio <= max_ratio else "FAILED"
    print(f"gate: DataStatesIO blocked / TorchCheckpointIO blocked = {ratio:.3f} (max {max_ratio}) {verdict}")
    return verdict == "OK"
