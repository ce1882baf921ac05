"""The companion callback: added by the plugin to its Trainer only (tests/test_trainer_neighbours.py), idle without the
plugin, harmless when passed twice."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_datastates import DataStatesCallback, DataStatesIO
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.storage.local import TEMP_SUFFIX
from tests.conftest import (
    BNModel,
    RecordingDataStatesIO,
    assert_bit_equal,
    every_step_checkpoint,
    make_loader,
    make_trainer,
)


def _ours(trainer) -> list[DataStatesCallback]:
    return [c for c in trainer.callbacks if isinstance(c, DataStatesCallback)]


def test_a_callback_passed_without_the_plugin_stays_idle(tmp_path):
    idle = DataStatesCallback()
    trainer = make_trainer(
        str(tmp_path), TorchCheckpointIO(), callbacks=[every_step_checkpoint(str(tmp_path / "c")), idle]
    )
    callbacks = _ours(trainer)
    assert callbacks == [idle]
    trainer.fit(BNModel(width=32), make_loader(n=16))
    assert callbacks[0]._pipeline is None
    assert "DataStatesCallback" not in str(torch.load(tmp_path / "c" / "last.ckpt", weights_only=True)["callbacks"])


def test_of_two_callbacks_passed_explicitly_the_first_drives_the_plugin(tmp_path, slow_copies):
    torch.manual_seed(0)
    explicit = DataStatesCallback()
    plugin = RecordingDataStatesIO(chunk_size="64KiB", eager_copy_size="1KiB")
    seen_owners = []

    class OwnerSpy(DataStatesCallback):  # observes who owns the plugin while training runs
        def on_train_start(self, trainer, pl_module):
            seen_owners.append(pipeline_of(plugin)._owner)

    trainer = make_trainer(
        str(tmp_path),
        plugin,
        callbacks=[every_step_checkpoint(str(tmp_path / "c")), explicit, OwnerSpy()],
        max_epochs=1,
    )
    assert len(_ours(trainer)) == 2  # explicit and spy: the plugin adds none where one is given
    trainer.fit(BNModel(), make_loader())
    assert seen_owners == [explicit]
    assert trainer.callbacks[0] is explicit  # moved first: its barriers precede other callbacks' hooks
    assert pipeline_of(plugin)._owner is None  # released at teardown
    for path, expected in plugin.recorded.items():
        assert_bit_equal(torch.load(path, weights_only=False), expected, os.path.basename(path))


def test_stale_temp_files_of_a_crashed_run_are_removed_at_start(tmp_path):
    directory = tmp_path / "c"
    directory.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    import re
    import socket

    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())
    stale = directory / f".epoch=0-step=3.ckpt.{host}.{dead_pid}.0123abcd{TEMP_SUFFIX}"
    stale.write_bytes(b"torn")
    unrelated = directory / "notes.txt"
    unrelated.write_text("keep me")
    plugin = DataStatesIO()
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[every_step_checkpoint(str(directory))], max_steps=1)
    trainer.fit(BNModel(width=32), make_loader(n=16))
    assert not stale.exists() and unrelated.exists()


def test_unplannable_checkpoint_falls_back_to_plain_torch_save(tmp_path, caplog):
    """Quantized tensors are refused by torch's skip_data: the checkpoint is still written, correctly."""
    quantized = torch.quantize_per_tensor(torch.randn(64), scale=0.1, zero_point=3, dtype=torch.qint8)
    checkpoint = {"state_dict": {"q": quantized, "w": torch.randn(100)}, "epoch": 1}
    plugin = DataStatesIO()
    path = str(tmp_path / "q.ckpt")
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        plugin.save_checkpoint(checkpoint, path)
    plugin.drain()
    assert "plain torch.save" in caplog.text
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["state_dict"]["q"].int_repr(), quantized.int_repr())
    assert_bit_equal(loaded["state_dict"]["w"], checkpoint["state_dict"]["w"])
    plugin.teardown()
