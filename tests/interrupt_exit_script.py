"""A run stopped by Ctrl+C whose process then takes a while to end, launched by tests/test_interrupt_drain.py:
``python tests/interrupt_exit_script.py OUT``.

Trains until stopped, checkpointing every step into ``OUT/ckpt``. ``fit`` sits in a ``try``/``finally`` whose cleanup
prints ``cleaning up`` and then waits (at most a minute) for the file ``OUT/go``: as a script that removes a large
temporary directory, or an interpreter that waits for threads, takes time after Lightning's shutdown. A Ctrl+C in that
time must not kill the process by the signal.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import DataStatesIO
from tests.conftest import BNModel, make_loader
from tests.script_support import endless_fit_trainer, slowed_steps

#: The longest the cleanup waits for the test's go-ahead.
CLEANUP_TIMEOUT_S = 60


def main() -> None:
    out = sys.argv[1]
    # Ctrl+C as in a terminal, whatever the test runner's process left inherited (see tests/exit_script.py).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{step}", every_n_train_steps=1)
    trainer = endless_fit_trainer(out, DataStatesIO(host_cache="64MiB"), [checkpoint])
    try:
        trainer.fit(slowed_steps(BNModel)(width=64), make_loader(n=64))
    finally:
        print("cleaning up", flush=True)
        deadline = time.monotonic() + CLEANUP_TIMEOUT_S
        while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("cleaned up", flush=True)


if __name__ == "__main__":
    main()
