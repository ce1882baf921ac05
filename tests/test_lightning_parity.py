"""Behaviour Lightning's own tests expect of a ``CheckpointIO``, checked through a real Trainer with ``DataStatesIO``.

* A listing of the checkpoint directory while a write is in flight shows committed checkpoints only (Lightning's
  ``test_model_checkpoint.py::test_none_monitor_not_alternating`` lists ``dirpath`` during training): local writes go
  to an unnamed file (``O_TMPFILE``) that gets its name only at the commit. Where the file system refuses unnamed
  files, writes fall back to a named hidden temporary file, decided once per directory.
* A missing checkpoint raises ``FileNotFoundError`` naming the path as the caller gave it, as ``TorchCheckpointIO``
  does (Lightning's ``test_checkpoint_connector.py::test_hpc_restore_attempt`` matches its message).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import TorchCheckpointIO

import lightning_datastates
from lightning_datastates import DataStatesCallback, DataStatesIO
from lightning_datastates.records.leftovers import TEMP_SUFFIX, parse_leftover_name, this_process
from lightning_datastates.storage import LocalWriter
from tests.conftest import BNModel, GatedWriter, make_loader, quiet_trainer
from tests.test_storage_contract import JOIN_S

O_TMPFILE = getattr(os, "O_TMPFILE", None)


def _takes_unnamed_files(directory: Path) -> bool:
    """Whether ``directory``'s file system and this kernel make unnamed files that ``/proc/self/fd`` can link."""
    if O_TMPFILE is None or not os.path.isdir("/proc/self/fd"):
        return False
    try:
        os.close(os.open(directory, O_TMPFILE | os.O_WRONLY, 0o600))
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------------------ a write in flight
def _listing_while_a_save_is_held(tmp_path: Path, writer: GatedWriter) -> tuple[list[str], list[str]]:
    """Fit three steps with a checkpoint per step; the save of step 2 is held at its first write (the gate) while a
    callback lists the directory, after that save call returned. Returns that listing and the final one."""
    dirpath = tmp_path / "ckpts"
    listed: list[str] = []

    class ListWhileAWriteIsHeld(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                plugin.drain()  # step 1's checkpoint is committed
                writer.gate.clear()  # step 2's save (at this batch's end) is held inside its first write
            elif batch_idx == 2:
                listed.extend(sorted(os.listdir(dirpath)))
                writer.gate.set()

    plugin = DataStatesIO()
    checkpoint = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    # The plugin's callback passed explicitly (harmless where the plugin adds it itself): the barriers, and saves in
    # the training loop that return before their commit.
    callbacks = [DataStatesCallback(), checkpoint, ListWhileAWriteIsHeld()]
    trainer = quiet_trainer(str(tmp_path), [plugin], callbacks, max_steps=3, limit_train_batches=3)
    trainer.fit(BNModel(width=64), make_loader(n=24))
    return listed, sorted(os.listdir(dirpath))


def test_a_listing_during_a_write_in_flight_shows_committed_checkpoints_only(tmp_path, gated_writer) -> None:
    if not _takes_unnamed_files(tmp_path):
        pytest.skip("this file system takes no O_TMPFILE files: see the fallback test")
    listed, final = _listing_while_a_save_is_held(tmp_path, gated_writer)
    # Step 2's write is in flight (held at the gate): its file is not there, nor any temporary name.
    assert listed == ["step=1.ckpt"]
    assert final == ["step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]


def test_where_unnamed_files_are_refused_writes_use_a_named_temporary_file(
    tmp_path, gated_writer, refused_unnamed
) -> None:
    listed, final = _listing_while_a_save_is_held(tmp_path, gated_writer)
    assert refused_unnamed == [str(tmp_path / "ckpts")]  # refused once: the directory's later saves ask no more
    temporary = [name for name in listed if name.startswith(".")]
    assert [n for n in listed if not n.startswith(".")] == ["step=1.ckpt"]
    assert len(temporary) == 1 and temporary[0].endswith(TEMP_SUFFIX)
    leftover = parse_leftover_name(temporary[0], TEMP_SUFFIX)
    assert leftover is not None and leftover.name == "step=2.ckpt" and leftover.owner == this_process()
    assert final == ["step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]


def test_a_direct_io_write_to_an_unnamed_file_commits_the_same_bytes(tmp_path) -> None:
    if not _takes_unnamed_files(tmp_path):
        pytest.skip("this file system takes no O_TMPFILE files")
    payload = os.urandom(3 * 65536 + 123)  # whole aligned blocks go through O_DIRECT, the tail through the cache
    session = LocalWriter(direct_io=True).begin(str(tmp_path / "d.ckpt"), len(payload))
    if not session.direct_io:  # type: ignore[attr-defined]
        session.abort()
        pytest.skip("this file system refuses O_DIRECT")
    try:
        session.write_range(0, memoryview(payload))
        assert os.listdir(tmp_path) == []
    except BaseException:
        session.abort()
        raise
    session.complete()
    assert os.listdir(tmp_path) == ["d.ckpt"]
    assert (tmp_path / "d.ckpt").read_bytes() == payload


def test_a_link_refused_at_the_commit_fails_that_save_loudly_and_later_saves_there_use_named_files(
    tmp_path, monkeypatch
) -> None:
    if not _takes_unnamed_files(tmp_path):
        pytest.skip("this file system takes no O_TMPFILE files")
    real_link = os.link

    def refusing_link(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    writer = LocalWriter()
    session = writer.begin(str(tmp_path / "a.ckpt"), 1)
    session.write_range(0, memoryview(b"a"))
    monkeypatch.setattr(os, "link", refusing_link)
    with pytest.raises(OSError, match=r"cannot name the written file of .*a\.ckpt") as raised:
        session.complete()
    assert raised.value.errno == errno.EPERM
    session.abort()
    monkeypatch.setattr(os, "link", real_link)
    assert os.listdir(tmp_path) == []

    later = writer.begin(str(tmp_path / "b.ckpt"), 1)  # named at once: visible while in flight
    assert os.listdir(tmp_path) == [os.path.basename(later.temp_path)]  # type: ignore[attr-defined]
    later.write_range(0, memoryview(b"b"))
    later.complete()
    assert os.listdir(tmp_path) == ["b.ckpt"]


_KILLED_MID_WRITE = textwrap.dedent(
    """
    import os, sys, types

    # Import only the storage subpackage: the package __init__ pulls in lightning and torch (seconds).
    package = types.ModuleType("lightning_datastates")
    package.__path__ = [sys.argv[2]]
    sys.modules["lightning_datastates"] = package
    from lightning_datastates.storage.local import LocalWriter

    session = LocalWriter().begin(os.path.join(sys.argv[1], "a.ckpt"), 8192)
    session.write_range(0, memoryview(b"x" * 4096))
    print("written", flush=True)
    sys.stdin.read()  # killed here, mid-write
    """
)


def test_a_writer_killed_mid_write_leaves_nothing_in_the_directory(tmp_path) -> None:
    if not _takes_unnamed_files(tmp_path):
        pytest.skip("this file system takes no O_TMPFILE files")
    package_dir = os.path.dirname(lightning_datastates.__file__)
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_MID_WRITE, str(tmp_path), package_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "written"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(JOIN_S)  # generous bound: only "does not hang"
    assert child.returncode == -signal.SIGKILL
    assert os.listdir(tmp_path) == []


# -------------------------------------------------------------------------------------------- a missing checkpoint
def _missing_checkpoint_message(tmp_path: Path, plugin: Any, ckpt_path: str) -> str:
    trainer = quiet_trainer(str(tmp_path), [plugin], max_steps=1)
    with pytest.raises(FileNotFoundError) as raised:
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return str(raised.value)


@pytest.mark.parametrize("ckpt_path", ["relative/missing.ckpt", "not existing"])
def test_a_missing_checkpoint_is_named_as_the_caller_gave_it(tmp_path, monkeypatch, ckpt_path: str) -> None:
    monkeypatch.chdir(tmp_path)
    lightning_message = _missing_checkpoint_message(tmp_path, TorchCheckpointIO(), ckpt_path)
    ours = _missing_checkpoint_message(tmp_path, DataStatesIO(), ckpt_path)
    assert lightning_message == f"Checkpoint file not found: {ckpt_path}"
    # Lightning's message, then where it was looked for (the working directory a relative path was resolved against).
    assert ours == f"{lightning_message} (looked for {tmp_path / ckpt_path})"
