"""The command line of ``python -m lightning_datastates.benchmark`` (``--help`` for the options) and its run.

Each round trains the same GPT-style model on the same synthetic tokens once per method, each in a fresh subprocess
(clean peak RSS, no cross-talk), with one torch compute thread (the other cores are left to checkpointing, as a GPU
node leaves its CPU free) and ``ModelCheckpoint(every_n_train_steps=N, save_top_k=-1)``. The methods are described
in :mod:`lightning_datastates.benchmark.methods`, the columns of the report in
:mod:`lightning_datastates.benchmark.report`.

Outputs: the table on stdout and in ``benchmark.md``, every measurement in ``benchmark.json``, and a timeline
``benchmark.png`` (needs matplotlib: ``pip install 'lightning-datastates[bench]'``) of each method's steps and each
checkpoint's copy and flush phases, in ``--out``.

``--short`` runs a small model (6M parameters) for a few steps (well under two minutes on two cores); with
``--max-blocked-vs-sync R`` the exit status is 1 when DataStatesIO's median blocked time per checkpoint exceeds
``R`` times TorchCheckpointIO's in the same run (a ratio, never an absolute time: CI machines differ).

:func:`main` runs on the main thread of the parent process: 1) :func:`~lightning_datastates.benchmark.runner.run_rounds`
(one worker subprocess per method and round) 2) the report 3) the plot 4) the gate. In a worker (the hidden
``--worker METHOD``) it hands over to :func:`~lightning_datastates.benchmark.worker.worker_main` instead.
"""

from __future__ import annotations

import argparse
import os

from lightning_datastates.benchmark.choices import METHODS, MODELS
from lightning_datastates.benchmark.options import datastates_options
from lightning_datastates.benchmark.plot import plot_timeline
from lightning_datastates.benchmark.report import (
    blocked_gate,
    combine,
    header_line,
    markdown,
    summarize_run,
    write_reports,
)
from lightning_datastates.benchmark.runner import run_rounds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_datastates.benchmark",
        description="Train one model under each checkpointing method in turn and compare what each costs.",
    )
    parser.add_argument("--model", choices=list(MODELS), help="GPT size (default 40M; 6M with --short)")
    parser.add_argument("--steps", type=int, help="training steps per run (default 16; 12 with --short)")
    parser.add_argument("--every", type=int, help="checkpoint every N steps (default 4; 3 with --short)")
    parser.add_argument("--rounds", type=int, help="repeats; figures are medians over them (default 3; 1 --short)")
    parser.add_argument("--dir", help="target directory for checkpoints (default: a new temporary directory)")
    parser.add_argument("--out", default=".", help="where benchmark.md/.json/.png go (default: current directory)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator (default auto)")
    parser.add_argument("--short", action="store_true", help="tiny model, few steps: a CI regression check")
    parser.add_argument(
        "--max-blocked-vs-sync",
        type=float,
        help="exit 1 if DataStatesIO's median blocked time per checkpoint exceeds this times TorchCheckpointIO's",
    )
    parser.add_argument(
        "--datastates",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a DataStatesIO argument for the datastates method, e.g. writer_threads=2 (repeatable)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG timeline")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one method, write JSON to --result
    parser.add_argument("--result", help=argparse.SUPPRESS)
    # Self-test of the gate (benchmark only): DataStatesIO waits for durability inside save_checkpoint.
    parser.add_argument("--selftest-wait-durable", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = args.model or ("6M" if args.short else "40M")
    args.steps = args.steps or (12 if args.short else 16)
    args.every = args.every or (3 if args.short else 4)
    args.rounds = args.rounds or (1 if args.short else 3)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if not 1 <= args.every <= args.steps:
        parser.error(f"--every must be between 1 and --steps ({args.steps}), got {args.every}")
    datastates_options(args.datastates)  # fail early on a malformed pair
    if args.max_blocked_vs_sync is not None and not {"torch", "datastates"} <= set(args.methods):
        parser.error("--max-blocked-vs-sync needs the methods torch and datastates")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every method ``--rounds`` times, report, plot, apply the gate; the exit status."""
    args = parse_args(argv)
    if args.worker:
        from lightning_datastates.benchmark.worker import worker_main  # torch and Lightning: the workers only

        return worker_main(args)
    os.makedirs(args.out, exist_ok=True)
    measured = run_rounds(args)
    rounds = [
        {method: summarize_run(run, measured.raw_of_round(index)) for method, run in runs.items()}
        for index, runs in enumerate(measured.runs)
    ]
    table = combine(rounds)
    report = markdown(table, header_line(args, measured, table))
    print("\n" + report)
    write_reports(args.out, args, report, measured, rounds, table)
    png = os.path.join(args.out, "benchmark.png")
    if not args.no_plot and plot_timeline(measured.runs[-1] if measured.runs else {}, png):
        print(f"timeline: {png}")
    if args.max_blocked_vs_sync is not None and not blocked_gate(table, args.max_blocked_vs_sync):
        return 1
    return 0
