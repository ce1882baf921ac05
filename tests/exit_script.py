"""A run that ends abruptly, launched by tests/test_exit.py: ``python tests/exit_script.py OUT HOW``.

Trains a small model with DataStatesIO, checkpointing every step through ModelCheckpoint (all kept). Writes are
slowed (each range waits 30 ms) so several checkpoints are still being flushed when the run ends. ``HOW``:

* ``external``: keep training (about a minute); the test sends SIGINT, SIGTERM or SIGKILL after ``saved 3``;
* ``keyboard-interrupt`` / ``sys-exit``: a hook raises ``KeyboardInterrupt`` / calls ``sys.exit(3)`` at step 4;
* ``normal``: ``fit`` ends after 4 steps and the script returns at once.

Each returned save prints ``saved <n>``; each drain or teardown prints ``draining <k> pending`` (k = checkpoints not yet
committed when it began: the test checks that the end really had writes to finish). References of the saved
state are written to ``OUT/ref`` (see tests/script_support.py). ``BROKEN_EXIT=1`` runs the broken variant of
:func:`~tests.script_support.break_draining`, to show that the test catches lost checkpoints.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_datastates.plugin import pipeline_of
from tests.conftest import BNModel, make_loader
from tests.script_support import ReferenceRecordingIO, break_draining, slow_local_writes

WRITE_DELAY_S = 0.03


class CountingIO(ReferenceRecordingIO):
    """Prints ``saved <n>`` once each save returned, and how much was pending when a drain began."""

    saves = 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        CountingIO.saves += 1
        print(f"saved {CountingIO.saves}", flush=True)

    def drain(self) -> None:
        self._report_pending()
        super().drain()

    def teardown(self) -> None:
        self._report_pending()  # Lightning tears the strategy down (and this plugin) before on_fit_end
        super().teardown()

    def _report_pending(self) -> None:
        engine = pipeline_of(self)._engine
        pending = 0 if engine is None else len(engine._pending.active)
        print(f"draining {pending} pending", flush=True)


class SlowModel(BNModel):
    """Steps take a little while, as real ones do: the run is still training when the signal comes."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.05)
        return super().training_step(batch, batch_idx)


class Interrupter(Callback):
    """Ends the run from a hook at step ``at_step``."""

    def __init__(self, how: str, at_step: int = 4) -> None:
        self.how, self.at_step = how, at_step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.at_step:
            return
        if self.how == "keyboard-interrupt":
            raise KeyboardInterrupt
        if self.how == "sys-exit":
            sys.exit(3)


def main() -> None:
    out, how = sys.argv[1], sys.argv[2]
    # Ctrl+C as in a terminal: an ignored SIGINT inherited from the test runner's process (a worker left it so once,
    # cause not found) must not decide the outcome.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    slow_local_writes(WRITE_DELAY_S)
    if os.environ.get("BROKEN_EXIT") == "1":
        break_draining()
    torch.manual_seed(0)
    plugin = CountingIO(os.path.join(out, "ref"), chunk_size="16KiB", eager_copy_size="1KiB")
    checkpoint = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4 if how == "normal" else 1000,
        max_epochs=-1,
        plugins=[plugin],
        callbacks=[checkpoint, Interrupter(how)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=out,
    )
    trainer.fit(SlowModel(width=128), make_loader(n=64))
    print("fit returned", flush=True)


if __name__ == "__main__":
    main()
