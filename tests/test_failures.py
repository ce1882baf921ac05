"""Failures are loud, raised once on the training thread, and never cost a file or Lightning's teardown."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_datastates import CheckpointCaptureError, CheckpointFlushError, DataStatesIO
from lightning_datastates.plugin import pipeline_of
from tests.conftest import (
    BNModel,
    GatedWriter,
    every_step_checkpoint,
    in_background,
    make_loader,
    make_trainer,
    temp_files,
)


def _small(seed: int) -> dict:
    return {"state_dict": {"w": torch.full((1000,), float(seed))}, "epoch": seed}


def test_failed_write_raises_once_naming_the_path(tmp_path, gated_writer):
    plugin = in_background(DataStatesIO())
    paths = [str(tmp_path / name) for name in ("a.ckpt", "b.ckpt", "c.ckpt")]
    plugin.save_checkpoint(_small(0), paths[0])
    plugin.drain()
    gated_writer.fail_on_write = gated_writer.writes + 1  # the first write of b.ckpt fails
    plugin.save_checkpoint(_small(1), paths[1])
    plugin.drain()
    with pytest.raises(CheckpointFlushError) as raised:
        plugin.save_checkpoint(_small(2), paths[2])
    assert raised.value.path == paths[1] and paths[1] in str(raised.value)
    assert isinstance(raised.value.__cause__, OSError) and "injected" in str(raised.value.__cause__)
    # Reported once: nothing more to raise, and later checkpoints succeed.
    pipeline_of(plugin).raise_pending_failure()
    plugin.save_checkpoint(_small(2), paths[2])
    plugin.drain()
    pipeline_of(plugin).raise_pending_failure()
    assert os.path.exists(paths[0]) and not os.path.exists(paths[1]) and os.path.exists(paths[2])
    assert temp_files(str(tmp_path)) == []
    plugin.teardown()


def test_failed_write_keeps_the_previous_file_of_that_path(tmp_path, gated_writer):
    plugin = in_background(DataStatesIO())
    path = str(tmp_path / "last.ckpt")
    plugin.save_checkpoint(_small(1), path)
    plugin.drain()
    gated_writer.fail_on_write = gated_writer.writes + 2
    plugin.save_checkpoint(_small(2), path)
    plugin.drain()
    with pytest.raises(CheckpointFlushError):
        pipeline_of(plugin).raise_pending_failure()
    assert torch.load(path, weights_only=True)["epoch"] == 1
    plugin.teardown()


def test_unpicklable_checkpoint_raises_at_save_and_writes_nothing(tmp_path):
    plugin = DataStatesIO()
    with pytest.raises(CheckpointCaptureError, match="cannot be pickled"):
        plugin.save_checkpoint(
            {"state_dict": {}, "hook": lambda x: x, "lock": threading.Lock()}, str(tmp_path / "x.ckpt")
        )
    assert os.listdir(tmp_path) == []
    plugin.teardown()


def test_directory_as_path_is_a_clear_error(tmp_path):
    plugin = DataStatesIO()
    with pytest.raises(CheckpointFlushError, match="is a directory"):
        plugin.save_checkpoint(_small(1), str(tmp_path))
    plugin.teardown()


def test_unknown_protocol_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no usable fsspec file system for 'nosuchproto'"):
        DataStatesIO().save_checkpoint(_small(1), "nosuchproto://bucket/x.ckpt")


def test_misspelt_storage_option_is_a_clear_error(tmp_path):
    pytest.importorskip("s3fs")
    with pytest.raises(ValueError, match="'endpoint'.*did you mean 'endpoint_url'.*storage_options"):
        DataStatesIO(storage_options={"endpoint": "http://127.0.0.1:1"}).save_checkpoint(_small(1), "s3://b/x.ckpt")


class _ExceptionSpy(Callback):
    def __init__(self) -> None:
        self.exceptions: list[BaseException] = []

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.exceptions.append(exception)


def test_background_failure_in_fit_raises_once_and_teardown_runs(tmp_path, monkeypatch):
    writer = GatedWriter(fail_on_write=5)
    monkeypatch.setattr("lightning_datastates.pipeline.writer_for", lambda path, storage_options=None, **_: writer)
    spy = _ExceptionSpy()
    plugin = DataStatesIO()
    trainer = make_trainer(
        str(tmp_path), plugin, callbacks=[every_step_checkpoint(str(tmp_path / "ckpt"), save_last=False), spy]
    )
    with pytest.raises(CheckpointFlushError) as raised:
        trainer.fit(BNModel(), make_loader())
    assert "ckpt" in raised.value.path
    assert spy.exceptions == [raised.value]  # Lightning's exception path ran: on_exception hooks...
    assert trainer.state.status.value == "interrupted"
    # ...and the strategy's teardown, which tears the plugin down
    assert pipeline_of(plugin).engine._threads.running == []
    assert not os.path.exists(raised.value.path)
    for name in os.listdir(tmp_path / "ckpt"):  # every file that exists is whole
        torch.load(tmp_path / "ckpt" / name, weights_only=True)
    pipeline_of(plugin).raise_pending_failure()  # nothing left to raise: reported exactly once
    assert temp_files(str(tmp_path)) == []


def test_exception_in_training_step_drains_pending_writes(tmp_path, monkeypatch):
    writer = GatedWriter(delay_s=0.01)  # slow storage: writes are pending when the step raises
    monkeypatch.setattr("lightning_datastates.pipeline.writer_for", lambda path, storage_options=None, **_: writer)
    plugin = DataStatesIO(chunk_size="64KiB")
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[every_step_checkpoint(str(tmp_path / "ckpt"))])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(BNModel(fail_at_step=5), make_loader())
    latest = {s.path: s.state for s in plugin.stats}  # superseded saves of last.ckpt end "cancelled"
    assert latest and set(latest.values()) == {"committed"}
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == sorted([f"epoch=0-step={i}.ckpt" for i in range(1, 6)] + ["last.ckpt"])
    for name in names:
        assert torch.load(tmp_path / "ckpt" / name, weights_only=True)["global_step"] >= 1


_EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from lightning_datastates import DataStatesIO
    from lightning_datastates.storage.local import LocalWriter, LocalWriteSession

    class SlowSession(LocalWriteSession):
        def write_range(self, offset, data):
            time.sleep(0.05)  # storage slower than the script: the write is pending at exit
            super().write_range(offset, data)

    class SlowWriter(LocalWriter):
        def begin(self, path, total_bytes):
            s = super().begin(path, total_bytes)
            return SlowSession(s.path, s.temp_path, s._fd)

    import lightning_datastates.pipeline as pipeline_module
    from lightning_datastates.plugin import pipeline_of
    pipeline_module.writer_for = lambda path, storage_options=None, **_: SlowWriter()
    plugin = DataStatesIO(chunk_size="1MiB")
    in_training_loop = type("InTrainingLoop", (), {"in_training_loop": True, "lazy_predicate": lambda self: None})
    pipeline_of(plugin).attach(in_training_loop())
    plugin.save_checkpoint({"w": torch.arange(4 * 2**20, dtype=torch.float32)}, sys.argv[1])
    print("pending at exit:", pipeline_of(plugin).is_pending(sys.argv[1]), flush=True)
    """
)


def test_interpreter_exit_finishes_pending_writes(tmp_path):
    path = str(tmp_path / "exit.ckpt")
    result = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, path], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pending at exit: True" in result.stdout
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], torch.arange(4 * 2**20, dtype=torch.float32))
    assert temp_files(str(tmp_path)) == []


def test_views_of_one_storage_as_different_dtypes_raise_capture_error(tmp_path):
    """torch.save itself refuses these; the plugin says so at the save call and writes nothing."""
    x = torch.randn(16)
    plugin = DataStatesIO()
    with pytest.raises(CheckpointCaptureError, match="view the same data"):
        plugin.save_checkpoint({"a": x, "b": x.view(torch.int32)}, str(tmp_path / "alias.ckpt"))
    assert os.listdir(tmp_path) == []
    plugin.teardown()
