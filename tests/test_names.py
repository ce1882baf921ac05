"""The checkpoint directory ends exactly as a synchronous run leaves it: names, versions, top-k removals."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import DataStatesIO
from tests.conftest import BNModel, make_loader, make_trainer, temp_files


def _run(root: str, plugin) -> tuple[list[str], list[tuple[str, str]]]:
    torch.manual_seed(0)
    directory = os.path.join(root, "ckpt")
    callbacks = [
        # A constant name: every save after the first picks a version suffix (-v1, -v2...) through fs.exists.
        ModelCheckpoint(
            dirpath=directory,
            filename="fixed",
            monitor="train_loss",
            every_n_train_steps=1,
            save_top_k=-1,
            save_last=True,
        ),
        # Top-k by a metric: worse checkpoints are removed while newer ones may still be in flight.
        ModelCheckpoint(
            dirpath=directory,
            filename="{step}-{train_loss:.4f}",
            monitor="train_loss",
            save_top_k=2,
            every_n_train_steps=1,
            mode="max",
        ),
    ]
    trainer = make_trainer(root, plugin, callbacks=list(callbacks), max_epochs=2)  # Lightning extends the list
    trainer.fit(BNModel(), make_loader())
    paths = [(os.path.basename(c.best_model_path), os.path.basename(c.last_model_path)) for c in callbacks]
    return sorted(os.listdir(directory)), paths


@pytest.mark.slow
def test_directory_matches_synchronous_run(tmp_path, slow_copies):
    expected_names, expected_paths = _run(str(tmp_path / "sync"), None)
    names, paths = _run(str(tmp_path / "datastates"), DataStatesIO(chunk_size="64KiB"))
    assert any(name.startswith("fixed-v") for name in expected_names)  # the scenario exercises versioning
    assert names == expected_names
    assert paths == expected_paths
    assert temp_files(str(tmp_path)) == []
    for name in names:
        torch.load(tmp_path / "datastates" / "ckpt" / name, weights_only=True)
