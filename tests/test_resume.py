"""Resuming from a DataStatesIO checkpoint reproduces the uninterrupted run, with or without the plugin."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import DataStatesIO
from tests.conftest import BNModel, assert_bit_equal, make_loader, make_trainer


def _final_state(model: BNModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fit(tmp_path: str, plugin, max_epochs: int, ckpt_path: str | None = None) -> BNModel:
    torch.manual_seed(0)
    model = BNModel()
    callback = ModelCheckpoint(dirpath=os.path.join(tmp_path, "ckpt"), save_top_k=-1, every_n_epochs=1)
    trainer = make_trainer(tmp_path, plugin, callbacks=[callback], max_epochs=max_epochs)
    trainer.fit(model, make_loader(), ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("resume_with_plugin", [True, False], ids=["with-plugin", "without-plugin"])
def test_resume_from_epoch_end_reproduces_uninterrupted_run(tmp_path, slow_copies, resume_with_plugin):
    reference = _final_state(_fit(str(tmp_path / "full"), DataStatesIO(), max_epochs=3))

    first = str(tmp_path / "first")
    _fit(first, DataStatesIO(), max_epochs=1)
    saved = sorted(os.listdir(os.path.join(first, "ckpt")))
    assert saved == ["epoch=0-step=8.ckpt"]

    resumed_plugin = DataStatesIO() if resume_with_plugin else None
    resumed = _fit(first, resumed_plugin, max_epochs=3, ckpt_path=os.path.join(first, "ckpt", saved[0]))
    assert_bit_equal(_final_state(resumed), reference, "resumed state_dict")


def test_load_from_checkpoint_and_weights_only(tmp_path):
    torch.manual_seed(0)
    plugin = DataStatesIO()
    trainer = make_trainer(str(tmp_path), plugin, max_epochs=1, enable_checkpointing=False)
    model = BNModel(width=64)
    trainer.fit(model, make_loader())
    path = str(tmp_path / "manual.ckpt")
    trainer.save_checkpoint(path)  # after fit: committed when the call returns, no drain needed

    restored = BNModel.load_from_checkpoint(path, map_location="cpu")
    assert_bit_equal(restored.state_dict(), model.state_dict(), "load_from_checkpoint")
    plain = torch.load(path, map_location="cpu", weights_only=True)
    assert plain["global_step"] == trainer.global_step
    via_plugin = plugin.load_checkpoint(path, map_location=torch.device("meta"), weights_only=True)
    assert all(t.device.type == "meta" for t in via_plugin["state_dict"].values())


def test_files_do_not_reference_this_package(tmp_path):
    """Plain Lightning files: nothing in the pickle needs lightning_datastates to load."""
    import zipfile

    plugin = DataStatesIO()
    trainer = make_trainer(str(tmp_path), plugin, max_epochs=1, enable_checkpointing=False)
    trainer.fit(BNModel(width=64), make_loader())
    path = str(tmp_path / "plain.ckpt")
    trainer.save_checkpoint(path)
    plugin.drain()
    with zipfile.ZipFile(path) as archive:
        pickle_names = [n for n in archive.namelist() if n.endswith("data.pkl")]
        assert len(pickle_names) == 1
        payload = archive.open(pickle_names[0]).read()  # a stored (uncompressed) record: no CRC check needed here
    assert b"lightning_datastates" not in payload
