"""Switching a sharded checkpoint directory to a new checkpoint (sharded/publish.py): a process killed at any step of
the switch, or a storage error there, leaves the directory one whole checkpoint (the one it held, or the new one) once
the next run's cleanup has been through it; never a mix, never neither."""

from __future__ import annotations

import io
import os
import signal
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_datastates.records.names import COMMIT_RECORD_NAME, DCP_METADATA_NAME, LIGHTNING_META_NAME
from lightning_datastates.sharded.commit import ShardedCommitter, ShardedSave
from lightning_datastates.sharded.dcp_writer import plan_checkpoint
from lightning_datastates.sharded.layout import ArchivePlans
from lightning_datastates.sharded.leftovers import clean_sharded_leftovers, mark_pending
from lightning_datastates.sharded.publish import (
    decode_record,
    encode_record,
    switch_to_record,
    write_commit_record,
)
from lightning_datastates.sharded.staging import stage_shard
from lightning_datastates.snapshot.pending import PendingCheckpoints
from lightning_datastates.storage import LocalWriter
from tests.conftest import assert_bit_equal, dead_pid
from tests.s3_server import (  # noqa: F401 - the *_fixture imports register the fixtures
    s3_endpoint_fixture,
    s3_fixture,
)
from tests.test_sharded_parts import _write

#: The storage operations of a commit, in order: the record written, ``meta.pt`` removed, ``.metadata`` and
#: ``meta.pt`` written, the record removed.
SWITCH_STEPS = 5


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((16, 8), float(step))}}


def _saved(directory: str, step: int, plans: ArchivePlans) -> SimpleNamespace:
    """This step's shard file written into ``directory`` (not committed); what its commit needs."""
    staged, shard = stage_shard(_state(step), 0, plans)
    assert shard is not None
    _write(shard, os.path.join(directory, staged.file_name))
    planned = plan_checkpoint(staged, directory, None)
    assert planned is not None
    meta = io.BytesIO()
    torch.save({"global_step": step}, meta)
    return SimpleNamespace(staged=staged, planned=planned, meta_bytes=meta.getvalue(), file=staged.file_name)


def _committed(directory: str, step: int, plans: ArchivePlans) -> SimpleNamespace:
    saved = _saved(directory, step, plans)
    writer = LocalWriter()
    write_commit_record(writer, directory, saved.planned.metadata_bytes, saved.meta_bytes)
    switch_to_record(writer, directory, saved.planned.metadata_bytes, saved.meta_bytes)
    return saved


def _checkpoint_step(directory: str) -> int:
    """The step of the whole checkpoint ``directory`` holds: its ``meta.pt`` and its tensors agree, and it holds
    nothing else."""
    meta = torch.load(os.path.join(directory, LIGHTNING_META_NAME), weights_only=True)
    step = meta["global_step"]
    target = {"model": {"w": torch.zeros(16, 8)}}
    dcp.load(target, checkpoint_id=directory, no_dist=True)
    assert_bit_equal(target, _state(step), f"tensors of the checkpoint of step {step}")
    metadata = dcp.FileSystemReader(directory).read_metadata()
    named = {info.relative_path for info in metadata.storage_data.values()}
    assert set(os.listdir(directory)) == named | {DCP_METADATA_NAME, LIGHTNING_META_NAME}
    return step


class _FaultyWriter(LocalWriter):
    """Runs ``fault`` just before its ``at``-th write or removal (counted from 0): a kill, or storage refusing it."""

    def __init__(self, at: int, fault: Callable[[int], None]) -> None:
        super().__init__()
        self._operations = 0
        self._at = at
        self._fault = fault

    def _count(self) -> None:
        self._operations += 1
        if self._operations - 1 == self._at:
            self._fault(self._at)

    def begin(self, path, total_bytes):  # type: ignore[no-untyped-def]
        self._count()
        return super().begin(path, total_bytes)

    def remove(self, path: str) -> None:
        self._count()
        super().remove(path)


def _die(_: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _refuse(operation: int) -> None:
    raise OSError(f"injected failure of storage operation {operation}")


def test_a_commit_record_holds_both_files_and_refuses_what_is_not_one():
    assert decode_record(encode_record(b"metadata", b"meta")) == (b"metadata", b"meta")
    assert decode_record(encode_record(b"", b"")) == (b"", b"")
    record = encode_record(b"metadata", b"meta")
    for broken in (b"", b"something else entirely", record[:12], record[: -len(b"meta") - 3]):
        with pytest.raises(ValueError):
            decode_record(broken)


@pytest.mark.parametrize("killed_before", range(SWITCH_STEPS + 1))
def test_a_process_killed_during_the_switch_leaves_one_whole_checkpoint(tmp_path, killed_before):
    """Step 1 committed in ``last.ckpt``; the commit of step 2 into it is killed before each of its storage operations
    in turn (a forked process, SIGKILL; the last case dies after the switch, before its leftovers were removed). The
    next run's cleanup leaves step 1 where the kill came before ``meta.pt`` was removed, step 2 from then on."""
    directory = tmp_path / "last.ckpt"
    directory.mkdir()
    plans = ArchivePlans(None)
    _committed(str(directory), 1, plans)
    second = _saved(str(directory), 2, plans)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        try:
            mark_pending(LocalWriter(), str(directory))  # as rank 0 does before the save's files are written
            writer = _FaultyWriter(killed_before, _die)
            write_commit_record(writer, str(directory), second.planned.metadata_bytes, second.meta_bytes)
            switch_to_record(writer, str(directory), second.planned.metadata_bytes, second.meta_bytes)
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) == (killed_before < SWITCH_STEPS)
    clean_sharded_leftovers(LocalWriter(), str(tmp_path), max_age_s=3600)
    assert _checkpoint_step(str(directory)) == (1 if killed_before < 2 else 2)


@pytest.mark.parametrize("fails_at", range(SWITCH_STEPS))
def test_a_storage_error_during_the_commit_never_loses_the_checkpoint_held(tmp_path, fails_at):
    """Rank 0's commit (ShardedCommitter._publish) when storage refuses one of its operations: a failure before the
    record is durable removes this save's files at once (the directory keeps step 1, settled); one after it keeps the
    directory, the record and the marker, and the next run's cleanup leaves it a whole checkpoint: step 1 if
    ``meta.pt`` was still there, step 2 otherwise."""
    directory = tmp_path / "last.ckpt"
    directory.mkdir()
    plans = ArchivePlans(None)
    first = _committed(str(directory), 1, plans)
    second = _saved(str(directory), 2, plans)
    writer = _FaultyWriter(fails_at, _refuse)
    committer = ShardedCommitter(None, 0, PendingCheckpoints(), lambda path: None, lambda path: writer)
    marker = mark_pending(LocalWriter(), str(directory))
    save = ShardedSave(str(directory), None, second.staged, second.meta_bytes, marker)
    error, settled = committer._publish(save, second.planned, (second.file,))
    assert error is not None and f"injected failure of storage operation {fails_at}" in error
    assert settled == (fails_at == 0)
    if settled:  # nothing of this save is left; the earlier checkpoint is whole as it was
        assert sorted(os.listdir(directory)) == sorted(
            [DCP_METADATA_NAME, LIGHTNING_META_NAME, first.file, os.path.basename(marker)]
        )
        os.remove(marker)
        assert _checkpoint_step(str(directory)) == 1
        return
    _as_the_next_run_finds_it(marker)
    clean_sharded_leftovers(LocalWriter(), str(tmp_path), max_age_s=3600)
    assert _checkpoint_step(str(directory)) == (1 if fails_at < 2 else 2)


@pytest.mark.parametrize("first_stops_at", [2, 3])  # meta.pt removed; .metadata or meta.pt not written
@pytest.mark.parametrize("next_fails_at", [None, 0, 4])  # none; finishing the earlier switch; its own record
def test_the_next_save_after_a_switch_stopped_half_way_finishes_it_first(tmp_path, first_stops_at, next_fails_at):
    """The save of step 2 stops half-way (the directory holds no ``meta.pt``, only step 2's record); the next save of
    the directory (step 3), in the same run, first finishes step 2's switch from its record and then commits itself.
    If storage fails it again, nothing is removed, and the next run's cleanup still leaves a whole checkpoint."""
    directory = tmp_path / "last.ckpt"
    directory.mkdir()
    plans = ArchivePlans(None)
    _committed(str(directory), 1, plans)
    second, third = _saved(str(directory), 2, plans), _saved(str(directory), 3, plans)
    writers: list[LocalWriter] = [_FaultyWriter(first_stops_at, _refuse)]
    committer = ShardedCommitter(None, 0, PendingCheckpoints(), lambda path: None, lambda path: writers[0])
    markers = [mark_pending(LocalWriter(), str(directory))]
    save = ShardedSave(str(directory), None, second.staged, second.meta_bytes, markers[0])
    assert committer._publish(save, second.planned, (second.file,))[1] is False
    assert not (directory / LIGHTNING_META_NAME).exists()
    writers[0] = LocalWriter() if next_fails_at is None else _FaultyWriter(next_fails_at, _refuse)
    markers.append(mark_pending(LocalWriter(), str(directory)))
    save = ShardedSave(str(directory), None, third.staged, third.meta_bytes, markers[1])
    error, settled = committer._publish(save, third.planned, (third.file,))
    # Settled unless finishing step 2's switch failed (then nothing may be removed); a failure of step 3's own record
    # comes after step 2 was finished: step 3's files go, as from any whole checkpoint.
    assert (error is None) == (next_fails_at is None) and settled == (next_fails_at != 0)
    if settled:
        os.remove(markers[1])  # as the committer does
        step = torch.load(directory / LIGHTNING_META_NAME, weights_only=True)["global_step"]
        assert step == (3 if next_fails_at is None else 2)  # whole in this run already
    for marker in markers:
        if os.path.exists(marker):
            _as_the_next_run_finds_it(marker)
    clean_sharded_leftovers(LocalWriter(), str(tmp_path), max_age_s=3600)
    assert _checkpoint_step(str(directory)) == (3 if next_fails_at is None else 2)


@pytest.mark.parametrize("lost", ["everything", "the shard files"])
def test_a_directory_emptied_after_a_switch_stopped_half_way_takes_the_next_save(tmp_path, lost):
    """Step 2's switch stops half-way; then the directory loses its files (removed by hand, or an S3 server that lost
    them): nothing can be finished, and the next save of the directory commits instead of failing for the rest of
    the run."""
    directory = tmp_path / "last.ckpt"
    directory.mkdir()
    plans = ArchivePlans(None)
    _committed(str(directory), 1, plans)
    second = _saved(str(directory), 2, plans)
    writers: list[LocalWriter] = [_FaultyWriter(2, _refuse)]
    committer = ShardedCommitter(None, 0, PendingCheckpoints(), lambda path: None, lambda path: writers[0])
    save = ShardedSave(str(directory), None, second.staged, second.meta_bytes, None)
    assert committer._publish(save, second.planned, (second.file,))[1] is False
    kept = {COMMIT_RECORD_NAME} if lost == "the shard files" else set()
    for name in set(os.listdir(directory)) - kept:
        os.remove(directory / name)
    writers[0] = LocalWriter()
    for step in (3, 4):
        saved = _saved(str(directory), step, plans)
        save = ShardedSave(str(directory), None, saved.staged, saved.meta_bytes, None)
        assert committer._publish(save, saved.planned, (saved.file,)) == (None, True)
        assert _checkpoint_step(str(directory)) == step


def test_a_commit_record_naming_a_missing_shard_file_is_kept_as_it_is(tmp_path):
    """A record whose shard files are not all there was not written by a commit of this package as it should be:
    the cleanup changes nothing rather than make a checkpoint of it."""
    directory = tmp_path / "last.ckpt"
    directory.mkdir()
    second = _saved(str(directory), 2, ArchivePlans(None))
    write_commit_record(LocalWriter(), str(directory), second.planned.metadata_bytes, second.meta_bytes)
    os.remove(directory / second.file)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process: its marker, then gone
        mark_pending(LocalWriter(), str(directory))
        os._exit(0)
    os.waitpid(child, 0)
    before = sorted(os.listdir(directory))
    assert clean_sharded_leftovers(LocalWriter(), str(tmp_path), max_age_s=3600) == []
    assert sorted(os.listdir(directory)) == before and COMMIT_RECORD_NAME in before


@pytest.mark.parametrize("done", range(SWITCH_STEPS + 1))
def test_on_s3_the_cleanup_leaves_one_whole_checkpoint_after_a_switch_stopped_anywhere(tmp_path, s3, done):
    """The same switch of ``last.ckpt`` from step 1 to step 2 on S3 (moto), stopped after ``done`` of its storage
    operations by a run that died (its marker left, naming a dead process): the next run's cleanup, through the S3
    writer (listing, the record read back, single-key and batch deletes, PUTs), leaves step 1 where ``meta.pt`` had
    not been removed yet, step 2 from then on, and nothing else in the directory."""
    from lightning_datastates.records.leftovers import host_tag
    from lightning_datastates.storage.s3 import S3Writer

    local = tmp_path / "local" / "last.ckpt"
    local.mkdir(parents=True)
    plans = ArchivePlans(None)
    _committed(str(local), 1, plans)
    second = _saved(str(local), 2, plans)
    prefix = f"publish-{done}/run/last.ckpt"
    s3.upload(local, prefix)
    writer, url = S3Writer(s3.storage_options, retries=1, timeout_s=10), s3.url(prefix)
    metadata_bytes, meta_bytes = second.planned.metadata_bytes, second.meta_bytes
    steps = [
        lambda: write_commit_record(writer, url, metadata_bytes, meta_bytes),
        lambda: writer.remove_files(url, [LIGHTNING_META_NAME]),
        lambda: s3.put(f"{prefix}/{DCP_METADATA_NAME}", metadata_bytes),
        lambda: s3.put(f"{prefix}/{LIGHTNING_META_NAME}", meta_bytes),
        lambda: writer.remove_files(url, [COMMIT_RECORD_NAME]),
    ]
    assert len(steps) == SWITCH_STEPS
    for step in steps[:done]:
        step()
    s3.put(f"{prefix}/.commit.{host_tag()}.{dead_pid()}.deadbeef.datastates-pending", b"")
    clean_sharded_leftovers(writer, s3.url(f"publish-{done}/run"), max_age_s=3600)
    assert _checkpoint_step(str(s3.download(prefix, tmp_path / "read" / "last.ckpt"))) == (1 if done < 2 else 2)


def _as_the_next_run_finds_it(marker: str) -> None:
    """Give this process's marker the pid of a process that is gone, as a later run sees it."""
    os.rename(marker, marker.replace(f".{os.getpid()}.", f".{dead_pid()}."))
