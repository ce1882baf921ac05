"""Snapshot contract in a real Trainer: every file equals, bit for bit, the state at its save call."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from lightning_datastates.snapshot.engine import SnapshotEngine
from lightning_datastates.write import loop as write_loop_module
from tests.conftest import (
    BNModel,
    RecordingDataStatesIO,
    every_step_checkpoint,
    file_mismatches,
    make_loader,
    make_trainer,
    temp_files,
)

#: How local files are written: direct I/O from the arena (the default), page-cache writes straight from the host
#: tensors until the barrier (write-through), or page-cache writes of every byte via the arena.
MODES = {
    "direct": {"direct_io": "auto", "write_through": True},
    "write-through": {"direct_io": False, "write_through": True},
    "arena-only": {"direct_io": False, "write_through": False},
}


def _fit_recording(
    tmp_path: str, every_n_train_steps: int, save_last: bool = True, mode: str = "direct"
) -> RecordingDataStatesIO:
    torch.manual_seed(0)
    # Small chunks: many copies per checkpoint, so copies are still running when the optimizer step comes.
    plugin = RecordingDataStatesIO(chunk_size="64KiB", eager_copy_size="1KiB")
    plugin.config = dataclasses.replace(plugin.config, **MODES[mode])
    checkpoint_dir = os.path.join(tmp_path, "ckpt")
    trainer = make_trainer(
        tmp_path,
        plugin,
        callbacks=[every_step_checkpoint(checkpoint_dir, every_n_train_steps=every_n_train_steps, save_last=save_last)],
    )
    trainer.fit(BNModel(), make_loader())
    return plugin


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("every_n_train_steps", [1, 2])
def test_every_file_equals_state_at_save(tmp_path, slow_copies, every_n_train_steps, mode):
    plugin = _fit_recording(str(tmp_path), every_n_train_steps, mode=mode)
    assert len(plugin.recorded) >= 8
    # Copies really overlapped training (otherwise this test would prove nothing about laziness).
    assert any(s.barrier_wait_s > 0 for s in plugin.stats), "no checkpoint was still copying at a barrier"
    assert file_mismatches(plugin) == []
    assert temp_files(str(tmp_path)) == []


@pytest.mark.parametrize("mode", list(MODES))
def test_contract_check_fails_without_barrier(tmp_path, slow_copies, monkeypatch, mode):
    """The same check against a broken plugin that skips the wait: it must catch torn snapshots.

    Without ``save_last`` (one file a step) the check does not depend on how a step's files share their copy.
    """
    monkeypatch.setattr(SnapshotEngine, "wait_copies", lambda self, attribute=True: 0.0)
    if mode == "write-through":
        # Writers read a chunk's bytes from the live tensors when they write it: 2 ms (slow_copies) often ends before
        # the next optimizer step on an idle machine, and then even a plugin without a barrier writes correct files.
        # 200 ms outlasts any step of this model, so the first chunks the writers take are read after the step.
        host_bytes = write_loop_module._host_bytes

        def slower_host_bytes(storage: torch.UntypedStorage, offset: int, nbytes: int) -> memoryview:
            time.sleep(0.2)
            return host_bytes(storage, offset, nbytes)

        monkeypatch.setattr(write_loop_module, "_host_bytes", slower_host_bytes)
    plugin = _fit_recording(str(tmp_path), 1, save_last=False, mode=mode)
    failures = file_mismatches(plugin)
    assert failures, "a plugin that never waits for its copies produced only correct files: the check is blind"
    assert any("state_dict" in f or "optimizer_states" in f for f in failures)
