"""Resume after a crash: training is killed (SIGKILL) while a checkpoint is being written, then resumed.

    python examples/resume_after_crash.py [--fast] [--dir DIR]

A checkpoint is published under its name only once complete and durable. So when the process dies with a write in
flight, that checkpoint simply does not exist yet, every earlier one is whole, and
``fit(ckpt_path="last")`` resumes from the newest whole ``last.ckpt``. The second run removes what the dead run left
(a temporary file) at its setup.

The crash is staged at the worst moment, the same on every machine: the first run is SIGKILLed from inside the
``fsync`` that begins a checkpoint's commit (every byte written, nothing durable or published yet), as a power cut
or the kernel's OOM killer could do at that instant. Without ``--dir`` everything happens in a temporary directory
that is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import stat
import subprocess
import sys
import tempfile
from typing import Any

import torch

MAX_STEPS = 12
EVERY = 2  # ModelCheckpoint saves every 2 steps, plus last.ckpt
KILL_AT = 6  # the step whose checkpoint the first run dies committing


def _step_of(path: str) -> int:
    """The global step of the checkpoint at ``path``."""
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])


def train(directory: str, fast: bool, kill_at: int | None) -> None:
    """One training process: resume from ``last.ckpt`` if there is one; with ``kill_at``, die in the commit of the
    first checkpoint saved at that step or later."""
    # Imported here: the parent process only starts children and reads files, and starts faster without them.
    import lightning as L
    from gpt_data import small_gpt
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_datastates import DataStatesIO

    real_fsync = os.fsync
    armed_at: list[int] = []  # the step whose checkpoint the crash hits, once armed

    def crash_in_commit(fd: int) -> None:
        """os.fsync, except that once armed, the fsync of a file (a checkpoint's, before it is renamed into place:
        nothing else is written while the crash is armed) kills the process."""
        if armed_at and stat.S_ISREG(os.fstat(fd).st_mode):
            print(
                f"killing the first run at step {armed_at[0]} in the fsync that begins a checkpoint's commit",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind
        real_fsync(fd)

    class CrashInCommit(DataStatesIO):
        """The plugin, armed to crash in the commit of the first checkpoint saved at step ``kill_at`` or later."""

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            step = int(checkpoint["global_step"])
            if kill_at is not None and step >= kill_at and not armed_at:
                # Every earlier checkpoint is committed first, so the one to resume from is known: step - EVERY.
                self.drain()
                armed_at.append(step)
                os.fsync = crash_in_commit  # from here on, the next commit of a checkpoint file is this one's
            super().save_checkpoint(checkpoint, path, storage_options)  # returns with the write in flight

    class ReportResume(Callback):
        """Print the step training starts from: the restored checkpoint's, when resuming."""

        def on_train_start(self, trainer: L.Trainer, *args: object) -> None:
            print(f"second run starts at step {trainer.global_step}", flush=True)

    L.seed_everything(0, verbose=False)
    model, data = small_gpt(fast)
    checkpoints = ModelCheckpoint(dirpath=directory, every_n_train_steps=EVERY, save_top_k=-1, save_last=True)
    resume = os.path.exists(os.path.join(directory, "last.ckpt"))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=MAX_STEPS,
        plugins=[CrashInCommit(host_cache="256MiB")],
        callbacks=[checkpoints, *([ReportResume()] if resume else [])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data, ckpt_path="last" if resume else None)
    print(f"trained to step {trainer.global_step}" + (" (resumed)" if resume else ""))


def demonstrate(directory: str, fast: bool) -> None:
    """Run the killed training, look at what it left, resume, look again."""
    child = [sys.executable, os.path.abspath(__file__), "--train", "--dir", directory] + (["--fast"] if fast else [])
    first = subprocess.run([*child, "--kill-at", str(KILL_AT)], check=False)
    if first.returncode != -signal.SIGKILL:
        raise SystemExit(f"the first run was to be killed by SIGKILL; it exited with status {first.returncode}")
    print(f"first run: killed by signal {-first.returncode}")
    print(f"after the crash: {sorted(os.listdir(directory))}")
    last = _step_of(os.path.join(directory, "last.ckpt"))
    print(f"last.ckpt is complete, at step {last}; the checkpoint in flight was never published")
    second = subprocess.run(child, check=False)
    if second.returncode != 0:
        raise SystemExit(f"the resumed run failed with exit status {second.returncode}")
    final = _step_of(os.path.join(directory, "last.ckpt"))
    print(f"after resuming: last.ckpt at step {final}; files {sorted(os.listdir(directory))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="tiny model (for CI)")
    parser.add_argument("--dir", default=None, help="checkpoint directory, kept (default: a temporary one, removed)")
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--kill-at", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        train(args.dir, args.fast, args.kill_at)
    elif args.dir is not None:
        demonstrate(args.dir, args.fast)
    else:
        with tempfile.TemporaryDirectory(prefix="datastates-resume-") as directory:
            demonstrate(directory, args.fast)


if __name__ == "__main__":
    main()
