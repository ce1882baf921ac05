"""Sharded checkpoints side by side: ``python -m lightning_datastates.benchmark.sharded --world 2``.

Each method (:data:`~lightning_datastates.benchmark.sharded_worker.SHARDED_METHODS`) trains the same sharded GPT on
the same tokens over ``--world`` processes (CPU with gloo, or one GPU per rank), each method in fresh processes, with
``ModelCheckpoint(every_n_train_steps=N, save_top_k=-1)``; see :mod:`lightning_datastates.benchmark.sharded_worker`.

Columns, from each rank's step times (the slowest rank counts, as training waits for it):

- **loop s**: the steps after warm-up, the step of the last save's barrier included, the final drain not;
- **overhead**: loop time against ``none``;
- **blocked / ckpt**: per checkpoint, what the step that saved and the next one (its barrier) took beyond the median
  step without a checkpoint; the median over checkpoints, and its ratio to ``sync``;
- **CPU s / ckpt**: per checkpoint, the CPU time (every thread of the rank's process, from the first timed step until
  ``fit`` returned) beyond ``none``'s; the rank that used the most. Where training keeps every core busy (a CPU
  machine), this is roughly what the background copy, checksums and writes take from training, and it shows in
  blocked time although no thread waits; a GPU node's spare cores absorb it;
- **extra host memory**: peak resident memory beyond ``none``'s, as a multiple of the rank's shard bytes (model and
  optimizer state).

Below the table, DataStatesIO's own account: per checkpoint, the slowest rank's save call and barrier wait, the
median over checkpoints. The training thread waited that long; the rest of its blocked time is the background copy
and write competing with training for the same cores (on a CPU machine, where training uses every core). Then its
host arena: size, peak use, and resident pages after ``fit`` (``mincore``; the arena's own peak, since it gives no
page back while open). The peak RSS of a process moves by tens of MB from run to run with what training holds at its
peak; the arena's resident pages are the part of the extra memory DataStatesIO holds, measured exactly.

Writes the table to stdout and ``sharded-benchmark.md``, every measurement to ``sharded-benchmark.json`` (``--out``).
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
from typing import Any

from lightning_datastates.benchmark.choices import MODELS
from lightning_datastates.benchmark.sharded_worker import SHARDED_METHODS, WARMUP_STEPS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_datastates.benchmark.sharded",
        description="Train one sharded model under each checkpointing method in turn and compare what each costs.",
    )
    parser.add_argument("--world", type=int, default=2, help="ranks (processes) (default 2)")
    parser.add_argument("--model", choices=list(MODELS), default="10M", help="GPT size (default 10M)")
    parser.add_argument("--steps", type=int, default=18, help="training steps (default 18)")
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    parser.add_argument("--methods", default=",".join(SHARDED_METHODS), help=f"subset of {SHARDED_METHODS}")
    parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator (default cpu)")
    parser.add_argument("--dir", help="where checkpoints go (default: a new temporary directory, removed after)")
    parser.add_argument("--out", default=".", help="where the report goes (default: current directory)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one method, every rank
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(args.methods) - set(SHARDED_METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {', '.join(SHARDED_METHODS)}")
    if args.steps < WARMUP_STEPS + 2 * args.every:
        parser.error(f"--steps must be at least {WARMUP_STEPS + 2 * args.every} (warm-up and two checkpoints)")
    return args


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's figures from its ranks' results (see the module docstring)."""
    loop_s = max(sum(rank["step_s"][WARMUP_STEPS:]) for rank in ranks)
    blocked: list[float] = []
    saved = ranks[0]["saved_steps"]
    touched = set(saved) | {s + 1 for s in saved}
    for step in saved:
        if step < WARMUP_STEPS or step + 1 >= len(ranks[0]["step_s"]):
            continue
        per_rank = []
        for rank in ranks:
            durations = rank["step_s"]
            quiet = statistics.median(d for i, d in enumerate(durations) if i >= WARMUP_STEPS and i not in touched)
            per_rank.append(durations[step] + durations[step + 1] - 2 * quiet)
        blocked.append(max(0.0, max(per_rank)))
    return {
        "loop_s": loop_s,
        "blocked_s": statistics.median(blocked) if blocked else None,
        "checkpoints": len(saved),
        "peak_rss_bytes": max(rank["peak_rss_bytes"] for rank in ranks),
        "cpu_s": [rank["cpu_s"] for rank in ranks],
        "shard_bytes": max(rank["shard_bytes"] for rank in ranks),
        "params": ranks[0]["params"],
        "waited_s": _waited_s(ranks),
        "arena": max((rank.get("arena") or {} for rank in ranks), key=lambda a: a.get("peak_used_bytes", 0)) or None,
    }


def _waited_s(ranks: list[dict[str, Any]]) -> dict[str, float] | None:
    """DataStatesIO's own account (see the module docstring); None for the other methods."""
    accounts = [rank.get("engine") or [] for rank in ranks]
    if not all(accounts) or len({len(a) for a in accounts}) != 1:
        return None
    per_checkpoint = list(zip(*accounts, strict=True))
    return {
        key: statistics.median(max(figures[key] for figures in checkpoint) for checkpoint in per_checkpoint)
        for key in ("save_call_s", "barrier_wait_s")
    }


def cpu_per_checkpoint_s(row: dict[str, Any], none: dict[str, Any]) -> float:
    """CPU seconds per checkpoint beyond ``none``'s, rank by rank; the largest (see the module docstring)."""
    checkpoints = max(1, row["checkpoints"])
    return max(cpu - base for cpu, base in zip(row["cpu_s"], none["cpu_s"], strict=True)) / checkpoints


def report(table: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown table."""
    none, sync = table.get("none"), table.get("sync")
    params = next(iter(table.values()))["params"] / 1e6 if table else 0
    lines = [
        f"Sharded: {args.model} GPT ({params:.1f}M parameters), ModelParallelStrategy over {args.world} ranks "
        f"({args.accelerator}), {args.steps} steps, a checkpoint every {args.every}.",
        "",
        "| method | loop s | overhead vs none | blocked / ckpt | blocked vs sync | CPU s / ckpt "
        "| extra host memory (x shard bytes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, row in table.items():
        overhead = f"{row['loop_s'] / none['loop_s'] - 1:+.1%}" if none else "-"
        blocked = "-" if row["blocked_s"] is None else f"{row['blocked_s'] * 1e3:.0f} ms"
        versus = "-"
        if sync and row["blocked_s"] is not None and sync["blocked_s"]:
            versus = f"{row['blocked_s'] / sync['blocked_s']:.2f}x"
        cpu = "-" if none is None or row is none else f"{cpu_per_checkpoint_s(row, none):.2f}"
        extra = f"{(row['peak_rss_bytes'] - none['peak_rss_bytes']) / row['shard_bytes']:.2f}x" if none else "-"
        lines.append(f"| {method} | {row['loop_s']:.2f} | {overhead} | {blocked} | {versus} | {cpu} | {extra} |")
    waited = table.get("datastates", {}).get("waited_s")
    if waited:
        lines += [
            "",
            f"DataStatesIO's training thread waited, per checkpoint: save call {waited['save_call_s'] * 1e3:.0f} ms, "
            f"barrier {waited['barrier_wait_s'] * 1e3:.0f} ms (the slowest rank; median over checkpoints).",
        ]
    arena, datastates = table.get("datastates", {}).get("arena"), table.get("datastates")
    if arena and datastates:
        size_mib, peak_mib = arena["size_bytes"] / 2**20, arena["peak_used_bytes"] / 2**20
        share = arena["peak_used_bytes"] / datastates["shard_bytes"]
        resident = arena.get("resident_bytes")
        held = (
            ""
            if resident is None
            else (f", {resident / 2**20:.0f} MiB resident ({resident / datastates['shard_bytes']:.2f}x)")
        )
        lines.append(
            f"Its host arena: {size_mib:.0f} MiB, at most {peak_mib:.0f} MiB in use ({share:.2f}x shard bytes){held}; "
            "the rank with the highest peak."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every method, then report; the exit status."""
    args = parse_args(argv)
    if args.worker:
        from lightning_datastates.benchmark.sharded_worker import run_rank  # torch and Lightning: the ranks only

        run_rank(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    base = args.dir or tempfile.mkdtemp(prefix="datastates-sharded-")
    table: dict[str, dict[str, Any]] = {}
    raw: dict[str, list[dict[str, Any]]] = {}
    try:
        for method in args.methods:
            directory, result = os.path.join(base, method), os.path.join(base, f"{method}-result")
            command = [sys.executable, "-m", "lightning_datastates.benchmark.sharded", "--worker", method]
            command += ["--result", result, "--dir", directory, "--world", str(args.world), "--model", args.model]
            command += ["--steps", str(args.steps), "--every", str(args.every), "--accelerator", args.accelerator]
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            subprocess.run(command, env=env, check=True)
            raw[method] = [_read(os.path.join(result, f"rank{rank}.json")) for rank in range(args.world)]
            table[method] = summarize(raw[method])
            print(_progress_line(method, table[method]), flush=True)  # kept if a time limit ends the run later
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    text = report(table, args)
    print("\n" + text)
    with open(os.path.join(args.out, "sharded-benchmark.md"), "w") as out:
        out.write(text + "\n")
    with open(os.path.join(args.out, "sharded-benchmark.json"), "w") as out:
        json.dump({"args": vars(args), "table": table, "ranks": raw}, out, indent=1)
    return 0


def _progress_line(method: str, figures: dict[str, Any]) -> str:
    """One method's main figures, printed as soon as its run ended (the table comes once every method ran)."""
    blocked = figures["blocked_s"]
    blocked_text = "-" if blocked is None else f"{blocked * 1e3:.0f} ms"
    return f"{method}: loop {figures['loop_s']:.2f} s, blocked per checkpoint {blocked_text}"


def _read(path: str) -> dict[str, Any]:
    with open(path) as handle:
        return json.load(handle)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
