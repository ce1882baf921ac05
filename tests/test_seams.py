"""Where single-file and sharded bookkeeping meet a crash, a removal or a resume: one test per fault found there.

- ``fit(ckpt_path="last")`` after a kill during the first ``last.ckpt`` flush of a sharded run (a torn local
  directory without ``meta.pt``) resumes from the newest whole checkpoint, or starts from scratch;
- a removal of a sharded checkpoint killed at any step leaves a whole checkpoint or a marked directory that the
  cleanup removes, never a directory Lightning takes for a checkpoint that DCP cannot read; a failed removal raises;
- a failure of the sharded committer outside its handled parts (a collective) is that save's failure: the removal
  held back for it is dropped, the error reaches training once, later saves fail at once;
- one cleanup per directory and run, whichever front door asks first.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_datastates.pipeline as pipeline_module
from lightning_datastates import DataStatesIO
from lightning_datastates.errors import CheckpointFlushError
from lightning_datastates.records.leftovers import host_tag
from lightning_datastates.records.names import DCP_METADATA_NAME, LIGHTNING_META_NAME, PENDING_SUFFIX, REMOVING_SUFFIX
from lightning_datastates.sharded.leftovers import clean_leftovers
from lightning_datastates.storage import LocalWriter
from tests.conftest import BNModel, dead_pid, every_step_checkpoint, make_loader, make_trainer
from tests.s3_server import s3_endpoint_fixture, s3_fixture  # noqa: F401 - fixtures
from tests.script_support import script_env
from tests.test_sharded_parts import _one_process_fit, _ShardedBNModel


def _sharded_checkpoint(directory, step: int = 3) -> dict[str, torch.Tensor]:
    """A whole sharded checkpoint in ``directory`` (DCP's files of one process, Lightning's ``meta.pt``); its state."""
    state = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8) + step, "b": torch.full((8,), float(step))}
    dcp.save({"state_dict": state}, checkpoint_id=str(directory), no_dist=True)
    torch.save({"global_step": step, "epoch": 0}, directory / LIGHTNING_META_NAME)
    return state


def _loads_whole(directory, expected: dict[str, torch.Tensor]) -> bool:
    target = {key: torch.zeros_like(value) for key, value in expected.items()}
    dcp.load({"state_dict": target}, checkpoint_id=str(directory), no_dist=True)
    return all(torch.equal(target[key], expected[key]) for key in expected)


# ---------------------------------------------------------------------------------------------- ckpt_path="last"
class _ResumedFrom(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.ckpt_path, self.global_step = trainer.ckpt_path, trainer.global_step


@pytest.mark.parametrize("whole_top_k", [True, False], ids=["a-whole-top-k", "nothing-whole"])
def test_resume_after_a_kill_during_the_first_last_ckpt_flush_takes_the_newest_whole_checkpoint(
    tmp_path, monkeypatch, whole_top_k
):
    """A sharded ``last.ckpt/`` whose first save was killed in flight holds shard files and the dead run's marker, no
    ``meta.pt``. Lightning alone picks it for ``ckpt_path="last"`` (it exists, locally, with a modification time);
    it must resume from the newest whole checkpoint instead, or start from scratch where none is whole."""
    directory = tmp_path / "ckpt"
    checkpoint = ModelCheckpoint(dirpath=str(directory), every_n_train_steps=2, save_top_k=-1, save_last=True)
    _one_process_fit(tmp_path, monkeypatch, DataStatesIO(), checkpoint, model=_ShardedBNModel)
    last = directory / "last.ckpt"
    # As a kill during its first flush leaves it: the dead run's marker, a shard file, no .metadata or meta.pt.
    for name in (LIGHTNING_META_NAME, DCP_METADATA_NAME):
        (last / name).unlink()
    (last / f".commit.{host_tag()}.{dead_pid()}.deadbeef{PENDING_SUFFIX}").write_bytes(b"")
    os.utime(last, None)  # the newest entry of the directory, as the save in flight was
    if not whole_top_k:
        for name in os.listdir(directory):
            if name != "last.ckpt":
                LocalWriter().remove(str(directory / name))
    resumed = _ResumedFrom()
    checkpoint = ModelCheckpoint(dirpath=str(directory), every_n_train_steps=2, save_top_k=-1, save_last=True)
    _one_process_fit(
        tmp_path, monkeypatch, DataStatesIO(), checkpoint, model=_ShardedBNModel, ckpt_path="last", callbacks=[resumed]
    )
    if whole_top_k:
        assert resumed.ckpt_path == str(directory / "epoch=0-step=4.ckpt") and resumed.global_step == 4
    else:
        assert resumed.ckpt_path is None and resumed.global_step == 0  # from scratch, as with no last checkpoint
    assert (last / LIGHTNING_META_NAME).exists()  # the new run's last.ckpt, whole


_KILLED_WITH_A_LINK = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import lightning as L
    from lightning_datastates import DataStatesIO
    from lightning_datastates.storage.local import LocalWriteSession
    from tests.conftest import BNModel, every_step_checkpoint, make_loader, make_trainer

    complete = LocalWriteSession.complete

    def held_complete(self):
        if self.path.endswith("epoch=0-step=3.ckpt"):
            threading.Event().wait()  # step 3's file is never committed: its write is in flight at the kill
        complete(self)

    LocalWriteSession.complete = held_complete

    class KillOnceLinked(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == 3:  # step 3 was saved and last.ckpt linked to it
                step_2 = os.path.join(directory, "epoch=0-step=2.ckpt")
                for _ in range(6000):  # the write of step 2 may still be in flight: it is to be whole at the kill
                    if os.path.exists(step_2):
                        break
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)

    directory = sys.argv[1]
    callbacks = [every_step_checkpoint(directory, save_last="link"), KillOnceLinked()]
    trainer = make_trainer(directory, DataStatesIO(), callbacks=callbacks, max_epochs=-1, max_steps=6)
    trainer.fit(BNModel(), make_loader())
    """
)


def test_a_run_killed_before_the_file_last_links_to_was_written_resumes_from_the_newest_whole_one(tmp_path):
    """``save_last="link"``: Lightning links ``last.ckpt`` as soon as the save call returns; a run killed before that
    file was committed leaves the link dangling. ``ckpt_path="last"`` resumes from the newest whole checkpoint with a
    warning (Lightning alone finds no last checkpoint and trains from scratch)."""
    directory = tmp_path / "ckpt"
    process = subprocess.run(
        [sys.executable, "-c", _KILLED_WITH_A_LINK, str(directory)], env=script_env(), check=False, timeout=120
    )
    assert process.returncode == -signal.SIGKILL
    link = directory / "last.ckpt"
    assert os.readlink(link) == "epoch=0-step=3.ckpt" and not link.exists()
    resumed = _ResumedFrom()
    callbacks = [every_step_checkpoint(str(directory), save_last="link"), resumed]
    trainer = make_trainer(str(directory), DataStatesIO(), callbacks=callbacks, max_epochs=-1, max_steps=4)
    with pytest.warns(UserWarning, match=r"last\.ckpt is not whole"):
        trainer.fit(BNModel(), make_loader(), ckpt_path="last")
    assert resumed.ckpt_path == str(directory / "epoch=0-step=2.ckpt") and resumed.global_step == 2
    assert os.readlink(link) == "epoch=0-step=4.ckpt" and link.exists()


def _link_layout(tmp_path, links: dict[str, str]) -> tuple[Any, Any]:
    """A checkpoint directory holding whole ``epoch=0-step=1.ckpt`` and ``epoch=0-step=2.ckpt`` (written 100 s ago)
    and the symbolic links ``links`` (name -> what it names), made now; a Trainer stand-in for the resolution of
    "last" with a ``ModelCheckpoint(save_last="link")`` there."""
    from types import SimpleNamespace

    directory = tmp_path / "ckpt"
    directory.mkdir()
    for step in (1, 2):
        torch.save({"global_step": step}, directory / f"epoch=0-step={step}.ckpt")
        stamp = time.time() - 100 + step
        os.utime(directory / f"epoch=0-step={step}.ckpt", (stamp, stamp))
    for name, target in links.items():
        os.symlink(target, directory / name)
    callback = ModelCheckpoint(dirpath=str(directory), save_last="link")
    return directory, SimpleNamespace(callbacks=[callback], checkpoint_callbacks=[callback])


def _options(local: dict[str, float] | None = None) -> Any:
    """What the plugin gives the resolution of "last" for local files: stamps read from them, and ``local`` as the
    local tier's copies that are the ones to read (persistent path -> when that copy was saved)."""
    from lightning_datastates.compat.last_checkpoint import LastOptions
    from lightning_datastates.records.stamp import order_key
    from lightning_datastates.storage.base import read_stamp

    copies = None if local is None else (lambda _: {path: order_key(None, t) for path, t in local.items()})
    return LastOptions(3600.0, lambda path: read_stamp(LocalWriter(), path), copies)


@pytest.mark.parametrize(
    "links",
    [
        {"last.ckpt": "/nonexistent/elsewhere.ckpt"},
        {"last.ckpt": "last-v1.ckpt", "last-v1.ckpt": "last.ckpt"},  # a loop
        {"last.ckpt": "epoch=0-step=2.ckpt/x"},  # through a file
        {"last.ckpt": "last-v1.ckpt", "last-v1.ckpt": "epoch=0-step=3.ckpt"},  # a chain to a file not written
    ],
    ids=["outside", "loop", "through-a-file", "chain"],
)
def test_last_takes_the_newest_whole_checkpoint_when_every_last_link_leads_nowhere(tmp_path, links):
    from lightning_datastates.compat.last_checkpoint import newest_last_checkpoint

    directory, trainer = _link_layout(tmp_path, links)
    with pytest.warns(UserWarning, match=r"last\.ckpt.* is not whole"):
        assert newest_last_checkpoint(trainer, _options()) == str(directory / "epoch=0-step=2.ckpt")


def test_last_follows_a_chain_of_links_to_the_local_tiers_copy(tmp_path):
    from lightning_datastates.compat.last_checkpoint import newest_last_checkpoint

    directory, trainer = _link_layout(tmp_path, {"last.ckpt": "last-v1.ckpt", "last-v1.ckpt": "epoch=0-step=3.ckpt"})
    step_3 = str(directory / "epoch=0-step=3.ckpt")
    # Copied locally a second before the links were made: the links stand for it, the newest checkpoint.
    local = {step_3: time.time() - 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # whole: no fallback, no warning
        assert newest_last_checkpoint(trainer, _options(local)) == step_3


def test_a_local_copy_of_a_file_a_last_link_replaced_is_not_taken_for_that_link(tmp_path):
    """The local tier still holds a copy of ``last.ckpt`` saved as a file (``save_last=True``) by an earlier run; a
    later run with ``save_last="link"`` replaced it by a link, and was killed before the file it names was written
    anywhere. That copy is not the link's checkpoint (it is older than what the link replaced it with): the newest
    whole checkpoint is taken, with a warning."""
    from lightning_datastates.compat.last_checkpoint import newest_last_checkpoint
    from lightning_datastates.plugin import _prepare_for_last

    directory, tier = tmp_path / "ckpt", tmp_path / "tier"
    plugin = DataStatesIO(local_tier=str(tier))
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[every_step_checkpoint(str(directory))], max_steps=3)
    trainer.fit(BNModel(), make_loader())
    os.unlink(directory / "last.ckpt")
    os.symlink("epoch=0-step=9.ckpt", directory / "last.ckpt")  # the later run's link; its file never written
    callback = ModelCheckpoint(dirpath=str(directory), save_last="link")
    resuming = make_trainer(str(tmp_path), DataStatesIO(local_tier=str(tier)), callbacks=[callback])
    with pytest.warns(UserWarning, match=r"last\.ckpt is not whole"):
        found = newest_last_checkpoint(resuming, _prepare_for_last(resuming))
    assert found == str(directory / "epoch=0-step=3.ckpt")


def test_last_takes_a_newer_whole_checkpoint_over_an_older_last_when_the_newest_last_link_leads_nowhere(tmp_path):
    """A run saved a whole ``last.ckpt``; a later run with ``save_last="link"`` got ``last-v1.ckpt`` and was killed
    before the file it links to was written: its newer whole checkpoints win over the older ``last.ckpt``."""
    from lightning_datastates.compat.last_checkpoint import newest_last_checkpoint

    directory, trainer = _link_layout(tmp_path, {"last-v1.ckpt": "epoch=0-step=3.ckpt"})
    torch.save({"global_step": 0}, directory / "last.ckpt")
    older = time.time() - 200
    os.utime(directory / "last.ckpt", (older, older))
    with pytest.warns(UserWarning, match=r"last-v1\.ckpt is not whole"):
        assert newest_last_checkpoint(trainer, _options()) == str(directory / "epoch=0-step=2.ckpt")
    os.unlink(directory / "last-v1.ckpt")  # without the link: still the newest whole checkpoint, newer than last.ckpt
    with pytest.warns(UserWarning, match=r"saved after the last checkpoint"):
        assert newest_last_checkpoint(trainer, _options()) == str(directory / "epoch=0-step=2.ckpt")


def test_last_dates_a_checkpoint_by_its_local_copy_where_the_local_tier_holds_one(tmp_path):
    """Persistent copies are dated by their copy (S3: by the upload's start), in the order the local writes ended:
    step 1's was copied after step 2's. Its local copy says when it was saved, and the newest whole one is step 2."""
    from lightning_datastates.compat.last_checkpoint import newest_last_checkpoint

    directory, trainer = _link_layout(tmp_path, {"last.ckpt": "epoch=0-step=3.ckpt"})
    step_1, step_2 = str(directory / "epoch=0-step=1.ckpt"), str(directory / "epoch=0-step=2.ckpt")
    copied_late = time.time() - 50
    os.utime(step_1, (copied_late, copied_late))
    local = {step_1: time.time() - 99, step_2: time.time() - 98}
    with pytest.warns(UserWarning, match=r"last\.ckpt is not whole"):
        assert newest_last_checkpoint(trainer, _options(local)) == step_2


def test_last_falls_back_to_an_on_exception_checkpoint_outside_the_checkpoint_directory(tmp_path):
    """An ``OnExceptionCheckpoint`` file (its own directory) is whole; the ``ModelCheckpoint`` directory holds only a
    newer link that leads nowhere: the fallback takes the whole file, not none."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    from lightning_datastates.compat.last_checkpoint import newest_last_checkpoint

    on_exception = OnExceptionCheckpoint(str(tmp_path / "exc"))
    os.makedirs(tmp_path / "exc")
    torch.save({"global_step": 5}, on_exception.ckpt_path)
    older = time.time() - 100
    os.utime(on_exception.ckpt_path, (older, older))
    os.makedirs(tmp_path / "ckpt")
    os.symlink("epoch=0-step=9.ckpt", tmp_path / "ckpt" / "last.ckpt")
    callback = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last="link")
    trainer = SimpleNamespace(callbacks=[on_exception, callback], checkpoint_callbacks=[callback])
    with pytest.warns(UserWarning, match=r"last\.ckpt is not whole"):
        assert newest_last_checkpoint(trainer, _options()) == on_exception.ckpt_path


def test_last_looks_for_whole_checkpoints_where_lightning_derives_the_directory(tmp_path):
    """``ModelCheckpoint()`` without ``dirpath``: before setup derives it (``default_root_dir/checkpoints`` here), a
    dangling link there falls back to the whole checkpoints beside it."""
    from types import SimpleNamespace

    from lightning_datastates.compat.last_checkpoint import newest_last_checkpoint

    directory, _ = _link_layout(tmp_path, {"last.ckpt": "epoch=0-step=3.ckpt"})
    directory.rename(tmp_path / "checkpoints")
    callback = ModelCheckpoint(save_last="link")
    trainer = SimpleNamespace(
        callbacks=[callback], checkpoint_callbacks=[callback], loggers=[], default_root_dir=str(tmp_path)
    )
    with pytest.warns(UserWarning, match=r"last\.ckpt is not whole"):
        found = newest_last_checkpoint(trainer, _options())
    assert found == str(tmp_path / "checkpoints" / "epoch=0-step=2.ckpt")


# ---------------------------------------------------------------------------------------------- removals
_REMOVE_AND_DIE = textwrap.dedent(
    """
    import os, signal, sys
    from lightning_datastates import DataStatesIO
    directory, kill_after = sys.argv[1], int(sys.argv[2])
    real_unlink, count = os.unlink, [0]

    def unlink(path, *args, **kwargs):  # the fault: this process dies right after its n-th file removal
        real_unlink(path, *args, **kwargs)
        count[0] += 1
        if count[0] == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    os.unlink = unlink
    DataStatesIO().remove_checkpoint(directory)
    """
)


@pytest.mark.parametrize("kill_after", [1, 2, 3, 4])
def test_a_removal_killed_after_any_file_leaves_no_torn_checkpoint_and_the_cleanup_finishes_it(tmp_path, kill_after):
    """A process removing a sharded checkpoint is SIGKILLed right after its n-th file removal. What it leaves must
    never be a directory Lightning takes for a checkpoint (``meta.pt``) that DCP cannot read, and the next run's
    cleanup (the same as ``python -m lightning_datastates clean``) must finish the removal."""
    directory = tmp_path / "epoch=0-step=3.ckpt"
    expected = _sharded_checkpoint(directory)
    (directory / "__1_0.distcp").write_bytes(os.urandom(4096))  # a second rank's file: more steps to stop between
    process = subprocess.run([sys.executable, "-c", _REMOVE_AND_DIE, str(directory), str(kill_after)], check=False)
    assert process.returncode == -signal.SIGKILL
    left = sorted(os.listdir(directory))
    if LIGHTNING_META_NAME in left:
        assert _loads_whole(directory, expected), f"a checkpoint to Lightning that DCP cannot read: {left}"
    removed = clean_leftovers(LocalWriter(), str(tmp_path), max_age_s=3600)
    assert not directory.exists(), f"the cleanup left {left} (removed {removed})"


def test_a_local_removal_that_fails_raises_and_leaves_the_directory_marked(tmp_path, monkeypatch):
    """A file that cannot be removed fails the removal, naming it (it used to be ignored), and what is left is no
    checkpoint: ``meta.pt`` went first, and the directory is marked for the cleanup."""
    directory = tmp_path / "epoch=0-step=3.ckpt"
    _sharded_checkpoint(directory)
    real_unlink = os.unlink

    def refuse_shards(path, *args, **kwargs):
        if str(path).endswith(".distcp"):
            raise PermissionError(13, "Permission denied (injected)", str(path))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse_shards)
    with pytest.raises(PermissionError, match="distcp"):
        DataStatesIO().remove_checkpoint(str(directory))
    left = os.listdir(directory)
    assert LIGHTNING_META_NAME not in left
    assert any(name.endswith(REMOVING_SUFFIX) for name in left)


def test_a_removal_on_s3_deletes_meta_pt_alone_first_and_a_stop_after_it_leaves_a_marked_non_checkpoint(
    s3, monkeypatch
):
    """On S3 a batch delete has no order: ``meta.pt`` must go in a request of its own, after the marker and before
    the rest. A storage error right after it leaves the prefix marked and without ``meta.pt``."""
    from lightning_datastates.records.names import holds_checkpoint
    from lightning_datastates.storage.s3 import S3WriteError, deletes

    for name in (DCP_METADATA_NAME, LIGHTNING_META_NAME, "__0_0.distcp", "__1_0.distcp"):
        s3.put(f"run/epoch=0-step=3.ckpt/{name}", b"x")
    requests: list[list[str]] = []
    real = deletes.delete_files

    def delete_files(client, directory, names, support):
        requests.append(sorted(names))
        if len(requests) == 2:
            raise S3WriteError("injected: the second delete request fails")
        return real(client, directory, names, support)

    monkeypatch.setattr(deletes, "delete_files", delete_files)
    plugin = DataStatesIO(storage_options=s3.storage_options)
    with pytest.raises(S3WriteError, match="injected"):
        plugin.remove_checkpoint(s3.url("run/epoch=0-step=3.ckpt"))
    assert requests[0] == [LIGHTNING_META_NAME]
    left = {key.rsplit("/", 1)[-1] for key in s3.keys("run/epoch=0-step=3.ckpt/")}
    assert LIGHTNING_META_NAME not in left and not holds_checkpoint(left)
    assert any(name.endswith(REMOVING_SUFFIX) for name in left)


# ---------------------------------------------------------------------------------------------- committer failures
def test_a_collective_that_fails_in_the_committer_fails_its_save_and_keeps_the_checkpoint_before_it(
    tmp_path, monkeypatch
):
    """The committer's verdict broadcast fails at the 3rd save (as a peer that died or timed out would make it). That
    save is not committed: ModelCheckpoint's removal of the 2nd checkpoint, held back behind it, must be dropped,
    training must get one CheckpointFlushError naming the rank and the collective, and later saves fail at once
    instead of waiting for a group that cannot be trusted."""
    real_broadcast = dist.broadcast_object_list
    calls = {"committer": 0}

    def broadcast(object_list, *args, **kwargs):
        # The committer's verdict: one text or None (DCP's planning broadcasts its plans on the same thread).
        verdict = len(object_list) == 1 and (object_list[0] is None or isinstance(object_list[0], str))
        if threading.current_thread().name == "datastates-sharded-commit" and verdict:
            calls["committer"] += 1
            if calls["committer"] >= 3:
                raise RuntimeError("Connection closed by peer (injected)")
        return real_broadcast(object_list, *args, **kwargs)

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    directory = tmp_path / "ckpt"
    checkpoint = ModelCheckpoint(
        dirpath=str(directory), every_n_train_steps=1, save_top_k=1, monitor="step", mode="max", save_last=False
    )
    with pytest.raises(CheckpointFlushError, match="rank 0 failed sharing rank 0's verdict") as raised:
        _one_process_fit(tmp_path, monkeypatch, DataStatesIO(), checkpoint, model=_StepLogging)
    assert "Connection closed by peer" in str(raised.value)
    assert calls["committer"] == 3  # the 4th save failed at once, without a collective
    kept = directory / "epoch=0-step=2.ckpt"
    assert (kept / LIGHTNING_META_NAME).exists(), sorted(os.listdir(directory))
    assert torch.load(kept / LIGHTNING_META_NAME, weights_only=False)["global_step"] == 2


class _StepLogging(_ShardedBNModel):
    def training_step(self, batch, batch_idx):
        self.log("step", float(self.global_step + 1))
        return super().training_step(batch, batch_idx)


# ---------------------------------------------------------------------------------------------- one cleanup per run
def test_a_sharded_fit_cleans_its_checkpoint_directory_once(tmp_path, monkeypatch):
    """The callback's setup and the first sharded save both want the directory clean: one scan (on S3, one LIST per
    subdirectory) is enough."""
    cleaned: list[str] = []
    real = pipeline_module.clean_leftovers

    def counting(writer, directory, max_age_s):
        cleaned.append(directory)
        return real(writer, directory, max_age_s)

    monkeypatch.setattr(pipeline_module, "clean_leftovers", counting)
    directory = tmp_path / "ckpt"
    checkpoint = ModelCheckpoint(dirpath=str(directory), every_n_train_steps=2, save_top_k=-1, save_last=True)
    _one_process_fit(tmp_path, monkeypatch, DataStatesIO(), checkpoint, model=_ShardedBNModel)
    assert cleaned == [str(directory)]


# ---------------------------------------------------------------------------------------------- from the review
def test_removing_a_link_to_a_checkpoint_removes_the_link_alone(tmp_path):
    """``save_last="link"``: ModelCheckpoint removes an older ``last`` link; the checkpoint it points to stays."""
    target = tmp_path / "epoch=0-step=3.ckpt"
    expected = _sharded_checkpoint(target)
    link = tmp_path / "last.ckpt"
    link.symlink_to(target.name)
    DataStatesIO().remove_checkpoint(str(link))
    assert not os.path.lexists(link)
    assert _loads_whole(target, expected) and (target / LIGHTNING_META_NAME).exists()


def test_a_sharded_save_not_committed_keeps_the_removals_asked_for_right_after_it():
    """A sharded save skipped (``on_arena_full="skip"``) or failed, whose commit ended before ModelCheckpoint asked to
    remove the checkpoint it was to replace: that checkpoint stays, as after a skipped single-file save."""
    from lightning_datastates.records.job import JobState
    from lightning_datastates.snapshot.pending import PendingCheckpoints, PendingCommit

    for state in (JobState.SKIPPED, JobState.FAILED):
        pending = PendingCheckpoints()
        commit = PendingCommit("ckpt/epoch=0-step=4.ckpt")
        pending.register_commit(commit)
        commit.state = state
        pending.finish(commit)
        removed: list[str] = []
        pending.defer_removal("ckpt/epoch=0-step=2.ckpt", functools.partial(removed.append, "step=2"))
        assert removed == [], state


def test_last_skips_a_half_switched_directory_that_the_cleanup_would_not_complete(tmp_path):
    """A ``last.ckpt/`` holding a commit record and no ``meta.pt`` counts only where the cleanup at setup will finish
    it: not while its marker names a writer that may be alive (here: this process)."""
    from types import SimpleNamespace

    from lightning_datastates.compat.last_checkpoint import newest_last_checkpoint
    from lightning_datastates.records.names import COMMIT_RECORD_NAME
    from lightning_datastates.sharded.leftovers import mark_pending

    directory = tmp_path / "ckpt"
    whole = directory / "epoch=0-step=2.ckpt"
    _sharded_checkpoint(whole, step=2)
    last = directory / "last.ckpt"
    last.mkdir()
    (last / COMMIT_RECORD_NAME).write_bytes(b"a record")
    marker = mark_pending(LocalWriter(), str(last))  # this process: alive
    callback = ModelCheckpoint(dirpath=str(directory))
    trainer = SimpleNamespace(callbacks=[callback], checkpoint_callbacks=[callback])
    with pytest.warns(UserWarning, match=r"last\.ckpt is not whole"):
        assert newest_last_checkpoint(trainer, _options()) == str(whole)
    os.unlink(marker)
    (last / f".commit.{host_tag()}.{dead_pid()}.deadbeef{PENDING_SUFFIX}").write_bytes(b"")
    assert newest_last_checkpoint(trainer, _options()) == str(last)
