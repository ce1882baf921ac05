"""ModelCheckpoint, the tuners and OnExceptionCheckpoint behave exactly as with Lightning's synchronous default.

Each scenario runs twice, identically seeded: once with ``TorchCheckpointIO`` and once with ``DataStatesIO`` (copies
and writes slowed down, so that files are still pending when Lightning looks at the directory), and compares what a
user can observe: the file set, symlinks, ``best_model_path`` / ``last_model_path`` / ``best_k_models``, resumed
and validated results, and the loaded contents of every file.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.tuner import Tuner

from lightning_datastates import DataStatesIO
from tests.conftest import (
    BNModel,
    assert_bit_equal,
    every_step_checkpoint,
    file_mismatches,
    make_loader,
    quiet_trainer,
    recording_plugin,
    temp_files,
)


def _relative(value: Any, root: str) -> Any:
    """``value`` with the run's root directory cut out of every string (the two runs live in different dirs)."""
    if isinstance(value, str):
        return value.replace(root, "<root>")
    if isinstance(value, dict):
        return {_relative(k, root): _relative(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_relative(v, root) for v in value)
    return value


def _checkpoint_callbacks(root: str) -> list[ModelCheckpoint]:
    return [
        # Top-k by a metric, plus last.ckpt written as a copy.
        ModelCheckpoint(
            dirpath=os.path.join(root, "topk"),
            monitor="train_loss",
            save_top_k=2,
            every_n_train_steps=1,
            save_last=True,
        ),
        # A constant name (versions -v1, -v2 chosen through fs.exists) and last.ckpt as a symlink.
        ModelCheckpoint(
            dirpath=os.path.join(root, "fixed"),
            filename="fixed",
            monitor="train_loss",
            mode="max",
            save_top_k=3,
            every_n_train_steps=2,
            save_last="link",
        ),
        # Two callbacks in one directory, both linking their last checkpoint: the second links last-v1.ckpt, since a
        # link to a file still being written counts as existing, as it would once that file is committed.
        *[
            ModelCheckpoint(
                dirpath=os.path.join(root, "shared"),
                filename=f"{name}-{{step}}",
                every_n_train_steps=every,
                save_top_k=-1,
                save_last="link",
            )
            for name, every in (("a", 1), ("b", 4))
        ],
    ]


def _observe(root: str, callbacks: list[ModelCheckpoint]) -> dict[str, Any]:
    """What a user sees of a run: files, link targets, and each ModelCheckpoint's bookkeeping."""
    seen: dict[str, Any] = {}
    for callback in callbacks:
        directory = str(callback.dirpath)
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            seen[_relative(path, root)] = os.readlink(path) if os.path.islink(path) else "file"
        seen[_relative(directory, root) + ":state"] = _relative(
            {
                "best_model_path": callback.best_model_path,
                "last_model_path": callback.last_model_path,
                "best_k_models": {k: float(v) for k, v in callback.best_k_models.items()},
                "kth_best_model_path": callback.kth_best_model_path,
            },
            root,
        )
    return seen


def _run(root: str, plugin: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Fit, resume from "last" for one more epoch, validate "best"; return observations, metrics and final state."""
    torch.manual_seed(0)
    callbacks = _checkpoint_callbacks(root)
    trainer = quiet_trainer(root, [plugin], callbacks=list(callbacks), max_epochs=2)
    trainer.fit(BNModel(width=64), make_loader())
    first = _observe(root, callbacks)

    torch.manual_seed(1)
    callbacks = _checkpoint_callbacks(root)
    trainer = quiet_trainer(root, [plugin], callbacks=list(callbacks), max_epochs=3)
    model = BNModel(width=64)
    trainer.fit(model, make_loader(), ckpt_path="last")
    resumed = _observe(root, callbacks)
    metrics = trainer.validate(model, make_loader(n=16, seed=1), ckpt_path="best", verbose=False)
    return {"after fit": first, "after resume": resumed}, {"validate best": metrics}, model.state_dict()


@pytest.mark.slow
def test_model_checkpoint_matches_synchronous_run(tmp_path, slow_copies):
    sync_root, ours_root = str(tmp_path / "sync"), str(tmp_path / "ours")
    expected, expected_metrics, expected_state = _run(sync_root, TorchCheckpointIO())
    actual, metrics, state = _run(ours_root, DataStatesIO(chunk_size="64KiB", eager_copy_size="1KiB"))

    assert any("fixed-v" in name for name in expected["after fit"])  # the scenario exercises versioning
    assert actual == expected
    assert metrics == expected_metrics
    assert_bit_equal(state, expected_state, "state after resuming from last")
    assert temp_files(ours_root) == []
    for name, kind in actual["after resume"].items():
        if kind == "file":
            ours = torch.load(name.replace("<root>", ours_root), weights_only=False)
            theirs = torch.load(name.replace("<root>", sync_root), weights_only=False)
            assert_bit_equal(_relative(ours, ours_root), _relative(theirs, sync_root), name)


# ------------------------------------------------------------------------------------------------ tuners
class TunableModel(BNModel):
    """BNModel whose learning rate and batch size the tuners may change."""

    def __init__(self) -> None:
        super().__init__(width=32)
        self.lr = 1e-2
        self.batch_size = 2

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> Any:
        return make_loader(n=64, batch_size=self.batch_size)

    def val_dataloader(self) -> Any:
        return make_loader(n=16, seed=1)


def _tune(root: str, plugin: Any) -> tuple[float, int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TunableModel()
    trainer = quiet_trainer(root, [plugin], max_epochs=1)
    tuner = Tuner(trainer)
    finder = tuner.lr_find(model, min_lr=1e-4, max_lr=1.0, num_training=8)
    batch_size = tuner.scale_batch_size(model, mode="power", steps_per_trial=1, max_trials=3)
    return finder.suggestion(), batch_size, {k: v.clone() for k, v in model.state_dict().items()}


def test_tuners_restore_and_leave_no_file(tmp_path, slow_copies):
    """lr_find and scale_batch_size save, load right away and remove: same results, nothing left behind."""
    expected = _tune(str(tmp_path / "sync"), TorchCheckpointIO())
    ours_root = str(tmp_path / "ours")
    plugin = DataStatesIO(chunk_size="64KiB", eager_copy_size="1KiB")
    actual = _tune(ours_root, plugin)
    saved = sorted(os.path.basename(s.path).split("_")[0] for s in plugin.stats)
    assert saved == [".lr", ".scale"], saved  # both tuners saved through the plugin
    assert actual[:2] == expected[:2]
    assert_bit_equal(actual[2], expected[2], "state restored by the tuners")
    assert sorted(os.listdir(ours_root)) == sorted(os.listdir(tmp_path / "sync"))
    assert not [n for n in os.listdir(ours_root) if n.endswith(".ckpt")]
    assert temp_files(ours_root) == []


# ------------------------------------------------------------------------------------------------ exceptions
def test_every_returned_save_is_complete_when_fit_raises(tmp_path, slow_copies, gated_writer):
    """An exception in training_step: the files saved so far, and OnExceptionCheckpoint's, are whole on disk."""
    gated_writer.delay_s = 0.002  # writes still pending when the exception comes
    torch.manual_seed(0)
    plugin = recording_plugin()
    directory = str(tmp_path / "ckpt")
    callbacks = [every_step_checkpoint(directory), OnExceptionCheckpoint(directory)]
    trainer = quiet_trainer(str(tmp_path), [plugin], callbacks=callbacks, max_epochs=2)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer.fit(BNModel(fail_at_step=5), make_loader())
    assert os.path.join(directory, "on_exception.ckpt") in plugin.recorded
    assert len(plugin.recorded) == 7  # five steps, last.ckpt, on_exception.ckpt
    assert file_mismatches(plugin) == []
    assert temp_files(str(tmp_path)) == []
