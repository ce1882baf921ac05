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

Tiered checkpoints: ``--dir s3://bucket/prefix`` checkpoints to S3 (the ``AWS_*`` variables say where and as whom),
``--moto`` to moto's S3 server started for the run on a loopback port (a persistent tier slower than the local disk),
and the method ``tiered`` (``DataStatesIO(local_tier=...)``, the local tier under ``--local-tier``) runs beside the
single-tier ``datastates`` on that target; ``--resume`` times a load of its last checkpoint from each tier. Its gates
``--max-train-vs-single``, ``--max-local-vs-raw`` and ``--min-repl-vs-raw`` are ratios too
(:mod:`~lightning_datastates.benchmark.tiered_report`).

:func:`main` runs on the main thread of the parent process: 1) the places
(:func:`~lightning_datastates.benchmark.targets.prepared_target`: the target, moto's server, the local tier)
2) :func:`~lightning_datastates.benchmark.runner.run_rounds` (one worker subprocess per method and round) 3) the report
4) the plot 5) the gates. In a worker (the hidden ``--worker METHOD``) it hands over to
:func:`~lightning_datastates.benchmark.worker.worker_main` instead.
"""

from __future__ import annotations

import argparse
import os

from lightning_datastates.benchmark.choices import DEFAULT_METHODS, LOCAL_ONLY, METHODS, MODELS
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
from lightning_datastates.benchmark.targets import is_s3, prepared_target
from lightning_datastates.benchmark.tiered_report import add_tier_gates, check_tier_gates, tier_gates


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
    parser.add_argument(
        "--dir",
        help="where checkpoints go: a directory or s3://bucket/prefix (default: a new temporary directory; "
        "with --moto s3://datastates-bench/run-<time>)",
    )
    parser.add_argument(
        "--moto",
        action="store_true",
        help="checkpoint to moto's S3 server, started on a free loopback port for the run: a persistent tier slower "
        "than the local disk (needs pip install 'moto[server]' s3fs boto3)",
    )
    parser.add_argument(
        "--local-tier",
        metavar="DIR",
        help="the local tier of the tiered method (default: a new temporary directory; TMPDIR picks the disk)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="tiered: also time a load of the last checkpoint from the local tier and from the persistent one",
    )
    parser.add_argument("--out", default=".", help="where benchmark.md/.json/.png go (default: current directory)")
    parser.add_argument(
        "--methods",
        help=f"comma-separated subset of {', '.join(METHODS)} (default: all but tiered, which joins them with "
        "--moto, an s3:// --dir or a --local-tier)",
    )
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator (default auto)")
    parser.add_argument("--short", action="store_true", help="tiny model, few steps: a CI regression check")
    parser.add_argument(
        "--max-blocked-vs-sync",
        type=float,
        help="exit 1 if DataStatesIO's median blocked time per checkpoint exceeds this times TorchCheckpointIO's",
    )
    add_tier_gates(parser)
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
    slow_target = args.moto or is_s3(args.dir) or args.local_tier is not None
    listed = args.methods or ",".join(METHODS if slow_target else DEFAULT_METHODS)
    args.methods = [m.strip() for m in listed.split(",") if m.strip()]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if args.moto and args.dir and not is_s3(args.dir):
        parser.error(f"--moto saves to s3://: --dir must be s3://bucket/prefix or left out, got {args.dir}")
    if (args.moto or is_s3(args.dir)) and not args.worker:
        for method in [m for m in args.methods if m in LOCAL_ONLY]:
            print(f"benchmark: {method} skipped at an s3:// target: {LOCAL_ONLY[method]}")
            args.methods.remove(method)
    if not 1 <= args.every <= args.steps:
        parser.error(f"--every must be between 1 and --steps ({args.steps}), got {args.every}")
    datastates_options(args.datastates)  # fail early on a malformed pair
    if args.max_blocked_vs_sync is not None and not {"torch", "datastates"} <= set(args.methods):
        parser.error("--max-blocked-vs-sync needs the methods torch and datastates")
    check_tier_gates(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every method ``--rounds`` times, report, plot, apply the gate; the exit status."""
    args = parse_args(argv)
    if args.worker:
        from lightning_datastates.benchmark.worker import worker_main  # torch and Lightning: the workers only

        return worker_main(args)
    os.makedirs(args.out, exist_ok=True)
    with prepared_target(args, tiered="tiered" in args.methods) as target:
        measured = run_rounds(args, target)
    rounds = [
        {
            method: summarize_run(run, measured.raw_of_round(index), measured.local_raw_of_round(index))
            for method, run in runs.items()
        }
        for index, runs in enumerate(measured.runs)
    ]
    table = combine(rounds)
    report = markdown(table, header_line(args, measured, table))
    print("\n" + report)
    write_reports(args.out, args, report, measured, rounds, table)
    png = os.path.join(args.out, "benchmark.png")
    if not args.no_plot and plot_timeline(measured.runs[-1] if measured.runs else {}, png):
        print(f"timeline: {png}")
    passed = tier_gates(table, args)
    if args.max_blocked_vs_sync is not None and not blocked_gate(table, args.max_blocked_vs_sync):
        return 1
    return 0 if passed else 1
