"""Demo: how long training waits for checkpoints with Lightning's ``TorchCheckpointIO`` and with ``DataStatesIO``.

Run ``python -m lightning_datastates.demo`` (``--help`` for the options; two to three minutes on a 2-core CPU, with a
progress line every few seconds; ``--fast``: a tiny model, seconds). It trains the same small GPT-style model
on the same synthetic tokens three times in one process, with a real ``lightning.Trainer`` and
``ModelCheckpoint(every_n_train_steps=...)``: without checkpointing, with ``TorchCheckpointIO`` and with
``DataStatesIO``. It prints what each checkpoint blocked training, how long DataStatesIO took to make each file
durable, and the end-to-end cost of each method, then checks that every DataStatesIO file loads with
``torch.load(weights_only=True)`` and holds, bit for bit, the same weights and optimizer state as the
TorchCheckpointIO file of the same step.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_datastates import DataStatesIO
from lightning_datastates._gpt import GPT

SEED = 1234
#: Model and batch shapes; ``--layers``/``--dim`` override the preset's.
PRESETS: dict[str, dict[str, int]] = {
    "fast": {"vocab": 512, "dim": 64, "layers": 2, "heads": 2, "seq_len": 32, "batch_size": 4},
    "small": {"vocab": 4096, "dim": 256, "layers": 4, "heads": 4, "seq_len": 64, "batch_size": 4},
    "medium": {"vocab": 8192, "dim": 512, "layers": 6, "heads": 8, "seq_len": 128, "batch_size": 2},
}


# ---------------------------------------------------------------------------------------------------- the runs
class TimedTorchCheckpointIO(TorchCheckpointIO):
    """Lightning's default CheckpointIO, timing each save: the training thread waits for all of it."""

    def __init__(self) -> None:
        super().__init__()
        self.saves: list[tuple[str, float]] = []  # (path, seconds blocked)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save as Lightning's default does, recording how long the call took."""
        started = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saves.append((os.fspath(path), time.perf_counter() - started))


@dataclass
class Run:
    """One fit: its wall time and, per checkpoint, (path, blocked seconds, seconds until durable or None)."""

    fit_s: float
    checkpoints: list[tuple[str, float, float | None]] = field(default_factory=list)


#: Seconds between two progress lines of a run (and one at its start and end).
PROGRESS_EVERY_S = 5.0


class Progress(L.Callback):
    """Prints where a run stands: a line when it starts, one every :data:`PROGRESS_EVERY_S` seconds (the step, the
    checkpoints saved so far, the time), and one when it ends, so that the demo is never silent for long (the
    Trainer's own bar is off: it would print over the report)."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label
        self._started = self._printed = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Say which run starts."""
        self._started = self._printed = time.perf_counter()
        print(f"{self.label}: training {trainer.max_steps} steps ...", flush=True)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Every few seconds: the step reached and the time so far."""
        now = time.perf_counter()
        if now - self._printed >= PROGRESS_EVERY_S:
            self._printed = now
            print(
                f"{self.label}: step {trainer.global_step}/{trainer.max_steps}, {now - self._started:.0f} s",
                flush=True,
            )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Say that the run's training ended (its checkpoints drain next)."""
        print(f"{self.label}: {trainer.global_step} steps in {time.perf_counter() - self._started:.0f} s", flush=True)


def make_model(shape: dict[str, int]) -> GPT:
    """A GPT of the preset ``shape`` (a dict from :data:`PRESETS`)."""
    return GPT(shape["vocab"], shape["dim"], shape["layers"], shape["heads"], shape["seq_len"])


def fit(
    shape: dict[str, int], steps: int, plugin: Any | None, dirpath: str | None, every: int, label: str | None = None
) -> Run:
    """Train a fresh, identically seeded model for ``steps`` steps; checkpoint into ``dirpath`` if given; with a
    ``label``, print the run's progress under it (:class:`Progress`)."""
    L.seed_everything(SEED, verbose=False)
    model = make_model(shape)
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(shape["vocab"], (steps * shape["batch_size"], shape["seq_len"] + 1), generator=generator)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=dirpath is not None,
        callbacks=[
            *([ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every, save_top_k=-1)] if dirpath else []),
            *([Progress(label)] if label else []),
        ],
        plugins=[plugin] if plugin is not None else None,
    )
    started = time.perf_counter()
    # A tensor is a map-style dataset (indexable, sized), though not annotated as one.
    trainer.fit(model, torch.utils.data.DataLoader(tokens, batch_size=shape["batch_size"]))  # type: ignore[arg-type]
    run = Run(time.perf_counter() - started)
    os.sync()  # leave no dirty pages behind to slow down the next run
    if isinstance(plugin, TimedTorchCheckpointIO):
        run.checkpoints = [(path, blocked, None) for path, blocked in plugin.saves]
    elif isinstance(plugin, DataStatesIO):
        for stats in plugin.stats:
            if stats.state != "committed":
                raise RuntimeError(f"DataStatesIO checkpoint {stats.path} ended {stats.state}")
            run.checkpoints.append((stats.path, stats.blocked_s, stats.durable_s))
    return run


def verify(torch_run: Run, datastates_run: Run) -> None:
    """Every DataStatesIO file loads with ``weights_only=True`` and equals the TorchCheckpointIO file of its step.

    Compares ``state_dict`` and ``optimizer_states`` bit for bit (the other entries name the run's directory).

    Raises:
        RuntimeError: a file is missing, differs, or a temporary file was left behind.
    """
    if len(torch_run.checkpoints) != len(datastates_run.checkpoints):
        raise RuntimeError(f"{len(torch_run.checkpoints)} vs {len(datastates_run.checkpoints)} checkpoints")
    for (torch_path, _, _), (ours_path, _, _) in zip(torch_run.checkpoints, datastates_run.checkpoints, strict=True):
        if os.path.basename(torch_path) != os.path.basename(ours_path):
            raise RuntimeError(f"checkpoint names differ: {torch_path} vs {ours_path}")
        ours = torch.load(ours_path, map_location="cpu", weights_only=True)
        reference = torch.load(torch_path, map_location="cpu", weights_only=True)
        for key in ("state_dict", "optimizer_states"):
            if not _bit_equal(ours[key], reference[key]):
                raise RuntimeError(f"{ours_path}: {key} differs from the TorchCheckpointIO file {torch_path}")
    directory = os.path.dirname(datastates_run.checkpoints[-1][0])
    leftovers = [name for name in os.listdir(directory) if not name.endswith(".ckpt")]
    if leftovers:
        raise RuntimeError(f"files left behind in {directory}: {leftovers}")


def _bit_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bit_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_bit_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# ---------------------------------------------------------------------------------------------------- the report
def report(baseline: Run, torch_run: Run, datastates_run: Run) -> None:
    """Print the per-checkpoint table and the summary."""
    print(f"\n{'checkpoint':<26} {'TorchCheckpointIO':>18} {'DataStatesIO':>13} {'DataStatesIO':>13}")
    print(f"{'':<26} {'blocked ms':>18} {'blocked ms':>13} {'flush s':>13}")
    for (path, torch_s, _), (_, ours_s, durable_s) in zip(
        torch_run.checkpoints, datastates_run.checkpoints, strict=False
    ):
        print(f"{os.path.basename(path):<26} {torch_s * 1e3:>18.1f} {ours_s * 1e3:>13.1f} {durable_s:>13.2f}")
    size_mb = os.path.getsize(datastates_run.checkpoints[-1][0]) / 1e6
    medians = {}
    print(f"\nsummary ({len(datastates_run.checkpoints)} checkpoints of {size_mb:.1f} MB per run)")
    print(f"{'method':<18} {'median blocked ms':>18} {'max blocked ms':>15} {'fit s':>8} {'overhead':>9}")
    print(f"{'no checkpointing':<18} {'-':>18} {'-':>15} {baseline.fit_s:>8.1f} {'-':>9}")
    for name, run in (("TorchCheckpointIO", torch_run), ("DataStatesIO", datastates_run)):
        blocked = [b for _, b, _ in run.checkpoints]
        medians[name] = statistics.median(blocked)
        overhead = 100 * (run.fit_s / baseline.fit_s - 1)
        row = f"{medians[name] * 1e3:>18.1f} {max(blocked) * 1e3:>15.1f} {run.fit_s:>8.1f} {overhead:>8.1f}%"
        print(f"{name:<18} {row}")
    ratio = medians["TorchCheckpointIO"] / medians["DataStatesIO"] if medians["DataStatesIO"] else math.inf
    print(f"median blocked time, TorchCheckpointIO / DataStatesIO: {ratio:.1f}x")
    print("(DataStatesIO fsyncs every file before publishing it; TorchCheckpointIO leaves it in the page cache.)")


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_datastates.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, help="train steps per run (default 40; 12 with --fast)")
    parser.add_argument("--every", type=int, help="checkpoint every N train steps (default 4)")
    parser.add_argument("--dir", help="where the run directory is made (default: the system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints (default: removed at the end)")
    parser.add_argument("--size", choices=["small", "medium"], default="medium", help="model preset (default medium)")
    parser.add_argument("--layers", type=int, help="transformer blocks (overrides the preset)")
    parser.add_argument("--dim", type=int, help="model width (overrides the preset)")
    parser.add_argument("--fast", action="store_true", help="tiny model and few steps, for CI")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for training (default 1: the other "
        "cores are left to checkpointing, as a GPU node leaves its CPU free)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Run]:
    """Run the three fits, print the report, verify the files; return the runs."""
    args = parse_args(argv)
    shape = dict(PRESETS["fast" if args.fast else args.size])
    shape.update({k: v for k, v in (("layers", args.layers), ("dim", args.dim)) if v is not None})
    steps = args.steps or (12 if args.fast else 40)
    every = args.every or 4
    if not 1 <= every <= steps:
        raise SystemExit(f"--every must be between 1 and --steps ({steps}), got {every}")
    torch.set_num_threads(args.threads)
    for name in ("lightning.pytorch", "lightning.fabric"):  # the Trainer's banners (GPU available, ...)
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")  # lightning 2.6 vs torch 2.13 deprecation noise
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="datastates-demo-", dir=args.dir)  # fresh; never removes what was there
    params = sum(p.numel() for p in make_model(shape).parameters())
    print(
        f"GPT: {params / 1e6:.1f}M parameters ({shape}); {steps} steps, a checkpoint every {every}; "
        f"{args.threads} training thread(s) of {os.cpu_count()} CPUs; files in {root}"
    )
    try:
        fit(shape, 2, None, None, every)  # warm-up: first-call costs land on no measured run
        runs = {
            "baseline": fit(shape, steps, None, None, every, "run 1 of 3 (no checkpointing)"),
            "torch": fit(
                shape,
                steps,
                TimedTorchCheckpointIO(),
                os.path.join(root, "torch"),
                every,
                "run 2 of 3 (TorchCheckpointIO)",
            ),
            "datastates": fit(
                shape, steps, DataStatesIO(), os.path.join(root, "datastates"), every, "run 3 of 3 (DataStatesIO)"
            ),
        }
        report(runs["baseline"], runs["torch"], runs["datastates"])
        verify(runs["torch"], runs["datastates"])
        print(
            f"verify: OK ({len(runs['datastates'].checkpoints)} DataStatesIO files load with weights_only=True and "
            "equal the TorchCheckpointIO files bit for bit)"
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return runs


if __name__ == "__main__":
    main()
