"""A run stopped by Ctrl+C while checkpoints are being written, launched by tests/test_interrupt_drain.py:
``python tests/interrupt_script.py OUT``.

Trains until stopped (about a minute at most), with DataStatesIO checkpointing every step through ModelCheckpoint,
which keeps the two newest (``monitor="step"``): each save asks for the removal of an older file, held back until the
newer writes land. Writes are slowed (each range waits :data:`WRITE_DELAY_S`, one writer thread), so several
checkpoints are in flight whenever the test sends SIGINT; the Trainer shows its tqdm bar, so the drain bar shows too.
Each returned save prints ``saved <n>`` and has its reference in ``OUT/ref`` (tests/script_support.py); checkpoints
go to ``OUT/ckpt``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.conftest import BNModel, make_loader
from tests.script_support import SaveCountingIO, endless_fit_trainer, slow_local_writes, slowed_steps

#: Each written range waits this long: a checkpoint of the model below (about 3 MiB, in 64 KiB chunks and a few
#: hundred metadata ranges) takes a few seconds to write.
WRITE_DELAY_S = 0.01


def main() -> None:
    out = sys.argv[1]
    # Ctrl+C as in a terminal, whatever the test runner's process left inherited (see tests/exit_script.py).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    slow_local_writes(WRITE_DELAY_S)
    torch.manual_seed(0)
    plugin = SaveCountingIO(
        os.path.join(out, "ref"), chunk_size="64KiB", eager_copy_size="1KiB", writer_threads=1, host_cache="64MiB"
    )
    checkpoint = ModelCheckpoint(
        dirpath=os.path.join(out, "ckpt"),
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=2,
        monitor="step",
        mode="max",
    )
    trainer = endless_fit_trainer(out, plugin, [checkpoint], enable_progress_bar=True)
    trainer.fit(slowed_steps(BNModel)(width=512), make_loader(n=64))
    print("fit returned", flush=True)


if __name__ == "__main__":
    main()
