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
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_datastates.pipeline import CheckpointPipeline
from lightning_datastates.plugin import pipeline_of
from tests.conftest import BNModel, make_loader
from tests.script_support import SaveCountingIO, break_draining, endless_fit_trainer, slow_local_writes, slowed_steps

WRITE_DELAY_S = 0.03


class CountingIO(SaveCountingIO):
    """Prints ``saved <n>`` once each save returned, and how much was pending when a drain began."""

    def _new_pipeline(self, config: Any) -> CheckpointPipeline:
        return CountingPipeline(config)  # the callback drains through the pipeline

    def teardown(self) -> None:
        _report_pending(pipeline_of(self))  # Lightning tears the strategy down (and this plugin) before on_fit_end
        super().teardown()


class CountingPipeline(CheckpointPipeline):
    """Prints how much was pending when a drain began."""

    def drain(self) -> None:
        _report_pending(self)
        super().drain()


def _report_pending(pipeline: CheckpointPipeline) -> None:
    engine = pipeline._engine
    pending = 0 if engine is None else len(engine._pending.active)
    print(f"draining {pending} pending", flush=True)


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
    trainer = endless_fit_trainer(out, plugin, [checkpoint, Interrupter(how)], max_steps=4 if how == "normal" else 1000)
    trainer.fit(slowed_steps(BNModel)(width=128), make_loader(n=64))
    print("fit returned", flush=True)


if __name__ == "__main__":
    main()
