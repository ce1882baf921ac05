"""Resume after a crash: training is killed (SIGKILL) mid-run, then resumed from the last committed checkpoint.

    python examples/resume_after_crash.py [--fast] [--dir DIR]

A checkpoint is published under its name only once complete and durable, so whatever moment the process dies,
``last.ckpt`` is either the previous complete checkpoint or the new complete one, never a torn file. The second
run removes the temporary file the dead one may have left and goes on with ``fit(ckpt_path="last")``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

MAX_STEPS = 12


def _step_of(path: str) -> int:
    """The global step of the checkpoint at ``path``; -1 while there is none (it appears only once complete)."""
    if not os.path.exists(path):
        return -1
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])


def train(directory: str, fast: bool, kill_at: int | None) -> None:
    """One training process: resume from ``last.ckpt`` if there is one; die at step ``kill_at`` if given."""
    # Imported here: the parent process only starts children and reads files, and starts faster without them.
    import lightning as L
    from gpt_data import small_gpt
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_datastates import DataStatesIO

    class KillAt(Callback):
        """SIGKILL this process (no cleanup of any kind) at the end of step ``step``, a checkpoint in flight, once
        ``last.ckpt`` of step ``step - 3`` or later is durable (so that there is one to resume from)."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            if trainer.global_step == self.step:
                # On a loaded machine the flush of an earlier checkpoint may still run here: wait for it (a hang
                # guard of 5 minutes), the newest checkpoint stays in flight.
                last = os.path.join(directory, "last.ckpt")
                deadline = time.monotonic() + 300
                while _step_of(last) < self.step - 3 and time.monotonic() < deadline:
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)

    L.seed_everything(0, verbose=False)
    model, data = small_gpt(fast)
    checkpoints = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=MAX_STEPS,
        plugins=[DataStatesIO(host_cache="256MiB")],
        callbacks=[checkpoints] + ([KillAt(kill_at)] if kill_at is not None else []),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resume = os.path.exists(os.path.join(directory, "last.ckpt"))
    trainer.fit(model, datamodule=data, ckpt_path="last" if resume else None)
    print(f"trained to step {trainer.global_step}" + (" (resumed)" if resume else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="tiny model (for CI)")
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a new temporary one)")
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--kill-at", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="datastates-resume-")
    if args.train:
        train(directory, args.fast, args.kill_at)
        return

    child = [sys.executable, os.path.abspath(__file__), "--train", "--dir", directory] + (
        ["--fast"] if args.fast else []
    )
    first = subprocess.run([*child, "--kill-at", "7"], check=False)
    print(f"first run: killed by signal {-first.returncode}" if first.returncode < 0 else f"exit {first.returncode}")
    last = torch.load(os.path.join(directory, "last.ckpt"), map_location="cpu", weights_only=True)
    print(f"after the crash: {sorted(os.listdir(directory))}; last.ckpt is complete, at step {last['global_step']}")
    second = subprocess.run(child, check=True)
    assert second.returncode == 0
    final = torch.load(os.path.join(directory, "last.ckpt"), map_location="cpu", weights_only=True)
    print(f"after resuming: last.ckpt at step {final['global_step']}; files {sorted(os.listdir(directory))}")


if __name__ == "__main__":
    main()
