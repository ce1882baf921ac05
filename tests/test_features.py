"""Lightning training features with DataStatesIO: every file equals, bit for bit, the state at its save call.

Each test runs a real CPU Trainer through one feature that mutates state at its own moment (``docs/design.md``,
"Where training waits"), with copies slowed down so that they are still running when training goes on, and compares
every committed file with the deep copy :class:`~tests.conftest.RecordingDataStatesIO` took synchronously at the save
call.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision

from tests.conftest import (
    BNModel,
    every_step_checkpoint,
    file_mismatches,
    make_loader,
    quiet_trainer,
    recording_plugin,
    temp_files,
)


def _fit(
    tmp_path: Any,
    model: Any,
    callbacks: list[Any] | None = None,
    plugins: list[Any] | None = None,
    val: bool = False,
    **trainer_kwargs: Any,
):
    """Fit ``model`` with a recording plugin and a checkpoint every step; return (plugin, trainer)."""
    torch.manual_seed(0)
    plugin = recording_plugin()
    directory = os.path.join(tmp_path, "ckpt")
    callbacks = [every_step_checkpoint(directory), *(callbacks or [])]
    trainer = quiet_trainer(str(tmp_path), [plugin, *(plugins or [])], callbacks=callbacks, **trainer_kwargs)
    trainer.fit(model, make_loader(), make_loader(n=16, seed=1) if val else None)
    return plugin, trainer


def _assert_contract(plugin, tmp_path: Any, minimum_files: int = 4) -> None:
    assert len(plugin.recorded) >= minimum_files
    assert file_mismatches(plugin) == []
    assert temp_files(str(tmp_path)) == []


def _copies_overlapped(plugin) -> bool:
    """Whether some copy was still running at a barrier (the scenario really exercised laziness)."""
    return any(s.barrier_wait_s > 0 for s in plugin.stats)


# ------------------------------------------------------------------------------------------------ models
class SGDModel(BNModel):
    """BNModel with plain SGD + momentum and no scheduler (for features that bring their own)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)


class PlateauModel(BNModel):
    """AdamW with a *tensor* learning rate, reduced by ReduceLROnPlateau after every step (``fill_`` in place)."""

    def configure_optimizers(self) -> Any:
        # foreach=False: torch refuses a tensor lr with the foreach implementation unless capturable.
        optimizer = torch.optim.AdamW(self.parameters(), lr=torch.tensor(1e-2), foreach=False)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "monitor": "train_loss"},
        }


class ManualModel(BNModel):
    """Manual optimization: ``self.optimizers()`` (a LightningOptimizer) or the raw torch optimizer."""

    def __init__(self, use_pl_optimizer: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.use_pl_optimizer = use_pl_optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers(use_pl_optimizer=self.use_pl_optimizer)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()  # with use_pl_optimizer=False no Lightning hook fires around this update
        self.lr_schedulers().step()
        self.log("train_loss", loss)
        return loss


class LBFGSModel(BNModel):
    """LBFGS: ``optimizer.step(closure)`` runs forward and backward several times per step."""

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3, history_size=4)


# ------------------------------------------------------------------------------------------------ tests
def test_gradient_accumulation_with_batchnorm(tmp_path, slow_copies):
    """Accumulation forwards update BatchNorm statistics between saves without an optimizer-step hook."""
    # Saves on accumulating batches too: every_n_train_steps counts optimizer steps, so save every batch by hand.
    saver = SaveEveryBatch(str(tmp_path / "by_batch"))
    plugin, trainer = _fit(tmp_path, BNModel(), callbacks=[saver], accumulate_grad_batches=3, max_epochs=2)
    assert trainer.global_step == 6  # 8 batches / 3 per step, rounded up per epoch
    assert len(saver.saved) == 16
    _assert_contract(plugin, tmp_path)
    assert _copies_overlapped(plugin)


class SaveEveryBatch(Callback):
    """Saves a checkpoint at the end of every training batch, whether or not the optimizer stepped."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.saved: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        path = os.path.join(self.directory, f"epoch={trainer.current_epoch}-batch={batch_idx}.ckpt")
        trainer.save_checkpoint(path)
        self.saved.append(path)


@pytest.mark.skipif(
    not hasattr(lightning_callbacks, "EMAWeightAveraging"), reason="EMAWeightAveraging is new in lightning 2.6"
)
def test_ema_weight_averaging_with_mid_epoch_validation(tmp_path, slow_copies):
    """EMA swaps averaged weights in at validation start and copies them over the model at train end."""
    val_checkpoint = ModelCheckpoint(
        dirpath=str(tmp_path / "val"), monitor="val_loss", save_top_k=-1, filename="{step}-{val_loss:.4f}"
    )
    plugin, _ = _fit(
        tmp_path,
        BNModel(),
        callbacks=[lightning_callbacks.EMAWeightAveraging(decay=0.5), val_checkpoint],
        val=True,
        val_check_interval=3,
        max_epochs=2,
    )
    assert any("current_model_state" in c for c in plugin.recorded.values())
    assert os.listdir(tmp_path / "val")  # checkpoints saved at validation end, right before the swap back
    _assert_contract(plugin, tmp_path)
    assert _copies_overlapped(plugin)


def test_stochastic_weight_averaging(tmp_path, slow_copies):
    """SWA averages at epoch end, swaps in its scheduler at epoch start and copies the average at train end."""
    swa = StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1, annealing_epochs=1)
    plugin, trainer = _fit(tmp_path, SGDModel(), callbacks=[swa], max_epochs=3)
    assert trainer.current_epoch >= 3
    _assert_contract(plugin, tmp_path)
    assert _copies_overlapped(plugin)


def test_reduce_lr_on_plateau_with_tensor_learning_rate(tmp_path, slow_copies):
    """The scheduler fills the lr tensor in place after the save, before the next optimizer step."""
    plugin, trainer = _fit(tmp_path, PlateauModel(), max_epochs=2)
    final_lr = trainer.optimizers[0].param_groups[0]["lr"]
    if not isinstance(final_lr, torch.Tensor):  # checked first: otherwise the test would pass without the hazard
        pytest.skip("this torch's ReduceLROnPlateau replaces a tensor learning rate with a float (no fill_)")
    assert float(final_lr) < 1e-2  # the tensor really was reduced
    saved_lrs = {float(c["optimizer_states"][0]["param_groups"][0]["lr"]) for c in plugin.recorded.values()}
    assert len(saved_lrs) > 1
    _assert_contract(plugin, tmp_path)


@pytest.mark.parametrize("use_pl_optimizer", [True, False], ids=["lightning-optimizer", "raw-optimizer"])
def test_manual_optimization(tmp_path, slow_copies, use_pl_optimizer):
    """Manual optimization may step an optimizer no hook sees: the snapshot must not rely on a barrier.

    With the raw optimizer Lightning does not count steps (``global_step`` stays 0), so ModelCheckpoint's
    ``every_n_train_steps`` never fires: a callback saves every batch instead.
    """
    saver = SaveEveryBatch(str(tmp_path / "by_batch"))
    plugin, trainer = _fit(tmp_path, ManualModel(use_pl_optimizer), callbacks=[saver], max_epochs=2)
    assert len(saver.saved) == 16
    assert trainer.global_step == (16 if use_pl_optimizer else 0)
    _assert_contract(plugin, tmp_path)


def test_lbfgs(tmp_path, slow_copies):
    """The barrier fires once per closure evaluation, before LBFGS updates parameters between evaluations."""
    plugin, _ = _fit(tmp_path, LBFGSModel(), max_epochs=1)
    assert any(c["optimizer_states"][0]["state"] for c in plugin.recorded.values())  # LBFGS history is saved
    _assert_contract(plugin, tmp_path)


def test_bf16_mixed_precision(tmp_path, slow_copies):
    plugin, trainer = _fit(tmp_path, BNModel(), precision="bf16-mixed", max_epochs=1)
    assert isinstance(trainer.precision_plugin, MixedPrecision) and trainer.precision_plugin.precision == "bf16-mixed"
    _assert_contract(plugin, tmp_path)
    assert _copies_overlapped(plugin)


def test_fp16_mixed_precision_with_grad_scaler_skipping_steps(tmp_path, slow_copies):
    """``precision="16-mixed"`` on CPU is silently turned into bf16 by Lightning; the plugin instance is not.

    A large initial scale makes the fp16 backward overflow, so GradScaler skips the first optimizer steps (the
    barrier hook still fires) while halving its scale, then steps for real.
    """
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22)
    precision = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    plugin, trainer = _fit(tmp_path, SGDModel(), plugins=[precision], max_epochs=2)
    assert trainer.precision_plugin is precision
    assert scaler.get_scale() < 2.0**22  # steps were skipped
    states = [c["optimizer_states"][0]["state"] for c in plugin.recorded.values()]
    assert not states[0] and states[-1]  # no momentum buffer while steps were skipped, one afterwards
    _assert_contract(plugin, tmp_path)


def test_weights_only_save_by_hand_during_and_after_fit(tmp_path, slow_copies):
    class SaveWeightsOnly(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            trainer.save_checkpoint(str(tmp_path / "weights" / f"w-{batch_idx}.ckpt"), weights_only=True)

    plugin, trainer = _fit(tmp_path, BNModel(), callbacks=[SaveWeightsOnly()], max_epochs=1)
    after = str(tmp_path / "weights" / "after-fit.ckpt")
    trainer.save_checkpoint(after, weights_only=True)
    assert os.path.exists(after)  # outside the loop the call returns once the file is committed
    weights_only_files = [p for p in plugin.recorded if os.path.dirname(p) == str(tmp_path / "weights")]
    assert len(weights_only_files) == 9
    assert all("optimizer_states" not in plugin.recorded[p] for p in weights_only_files)
    _assert_contract(plugin, tmp_path)


def test_fit_validate_fit_again(tmp_path, slow_copies):
    """The same Trainer and plugin through fit, validate (which saves) and a second fit."""

    class SaveAtValidationEnd(Callback):
        def on_validation_end(self, trainer, pl_module) -> None:
            if not trainer.training and not trainer.sanity_checking:
                trainer.save_checkpoint(str(tmp_path / "validate.ckpt"))

    plugin, trainer = _fit(tmp_path, BNModel(), callbacks=[SaveAtValidationEnd()], max_epochs=1)
    model = trainer.lightning_module
    trainer.validate(model, make_loader(n=16, seed=1))
    assert os.path.exists(tmp_path / "validate.ckpt")
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, make_loader())
    assert trainer.global_step == 16
    assert str(tmp_path / "validate.ckpt") in plugin.recorded
    _assert_contract(plugin, tmp_path, minimum_files=10)


def test_two_trainers_in_one_process(tmp_path, slow_copies):
    """Two Trainers, each with its plugin, fitting one after the other and then alternately."""
    first, first_trainer = _fit(tmp_path / "a", BNModel(), max_epochs=1)
    second, _ = _fit(tmp_path / "b", SGDModel(), max_epochs=1)
    first_trainer.fit_loop.max_epochs = 2
    first_trainer.fit(first_trainer.lightning_module, make_loader())
    for plugin, root in ((first, tmp_path / "a"), (second, tmp_path / "b")):
        _assert_contract(plugin, root)
    assert all(path.startswith(str(tmp_path / "a")) for path in first.recorded)
    assert all(path.startswith(str(tmp_path / "b")) for path in second.recorded)
