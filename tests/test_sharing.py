"""Several checkpoints of one step (top-k files and ``last.ckpt``) share one host copy of the tensors."""

from __future__ import annotations

import os

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_datastates import DataStatesIO
from lightning_datastates.plugin import pipeline_of
from tests.conftest import (
    BNModel,
    assert_bit_equal,
    every_step_checkpoint,
    file_mismatches,
    in_background,
    make_loader,
    quiet_trainer,
    recording_plugin,
    temp_files,
)


class HoldWritesDuringSaves(Callback):
    """Holds every write from the end of a batch (before ModelCheckpoint saves) until the next batch starts.

    No chunk of the step's first checkpoint can then be written and freed before the step's other checkpoints are
    captured, so the sharing this test counts does not depend on thread timing.
    """

    def __init__(self, gate) -> None:
        self.gate = gate

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.gate.clear()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.gate.set()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # Not on_train_end: the plugin's callback drains there, possibly before this one runs, and would wait on
        # the closed gate.
        self.gate.set()


def test_checkpoints_of_one_step_share_one_host_copy(tmp_path, slow_copies, gated_writer):
    torch.manual_seed(0)
    plugin = recording_plugin()
    directory = str(tmp_path / "ckpt")
    callbacks = [
        HoldWritesDuringSaves(gated_writer.gate),
        every_step_checkpoint(directory),  # epoch=..-step=...ckpt and last.ckpt
        ModelCheckpoint(
            dirpath=directory, filename="best-{step}", monitor="train_loss", save_top_k=2, every_n_train_steps=1
        ),
    ]
    top_k = callbacks[-1]
    trainer = quiet_trainer(str(tmp_path), [plugin], callbacks=callbacks, max_epochs=1)
    trainer.fit(BNModel(), make_loader())

    steps = trainer.global_step
    saves = len(plugin.stats)
    assert saves > 2 * steps  # the step's file and last.ckpt every step, plus the top-k file when it improves
    removed = {p for p in plugin.recorded if os.path.basename(p).startswith("best-") and p not in top_k.best_k_models}
    assert removed  # top-k removals ran while the files they replace were still being written
    assert file_mismatches(plugin, removed) == []
    assert temp_files(str(tmp_path)) == []
    counters = pipeline_of(plugin).engine.sharing_counters
    # Every payload byte of every file was either copied into the arena or written from another file's copy.
    assert counters.copied_bytes + counters.shared_bytes == sum(s.payload_bytes for s in plugin.stats)
    # One copy per step, not one per file: the step's other files took their tensors from the first one's blocks.
    # (Only the small eager part - BatchNorm buffers, scalars - is copied per file: well under 10 % here.)
    step_payload = max(s.payload_bytes for s in plugin.stats)
    assert counters.copied_bytes < 1.1 * steps * step_payload
    assert counters.shared_bytes > 0.9 * (saves - steps) * step_payload


def test_follower_completes_when_the_shared_copy_is_cancelled(tmp_path, gated_writer):
    """Removing the first file while pending cancels it; the second file, which follows its copy, still lands."""
    plugin = in_background(DataStatesIO(chunk_size="64KiB"), lazy=True)
    generator = torch.Generator().manual_seed(0)
    checkpoint = {"state_dict": {"w": torch.randn(2**18, generator=generator), "b": torch.randn(3)}, "step": 1}
    first, second = str(tmp_path / "first.ckpt"), str(tmp_path / "second.ckpt")
    gated_writer.gate.clear()
    plugin.save_checkpoint(checkpoint, first)
    plugin.save_checkpoint({**checkpoint, "step": 2}, second)
    assert pipeline_of(plugin).engine.sharing_counters.shared_bytes == checkpoint["state_dict"]["w"].nbytes
    gated_writer.gate.set()
    plugin.remove_checkpoint(first)
    pipeline_of(plugin).barrier()
    plugin.drain()
    assert not os.path.exists(first)
    assert_bit_equal(torch.load(second, weights_only=True), {**checkpoint, "step": 2})
    plugin.teardown()


def test_no_sharing_across_a_barrier(tmp_path, gated_writer):
    """After a barrier the state may have changed: a later save copies again instead of following."""
    plugin = in_background(DataStatesIO(chunk_size="64KiB"), lazy=True)
    weight = torch.zeros(2**18)
    gated_writer.gate.clear()
    plugin.save_checkpoint({"w": weight}, str(tmp_path / "a.ckpt"))
    pipeline_of(plugin).barrier()  # what the callback does before the optimizer step
    weight.add_(1.0)
    plugin.save_checkpoint({"w": weight}, str(tmp_path / "b.ckpt"))
    assert pipeline_of(plugin).engine.sharing_counters.shared_bytes == 0
    gated_writer.gate.set()
    pipeline_of(plugin).barrier()
    plugin.drain()
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["w"].sum() == 0
    assert torch.equal(torch.load(tmp_path / "b.ckpt", weights_only=True)["w"], weight)
    plugin.teardown()
