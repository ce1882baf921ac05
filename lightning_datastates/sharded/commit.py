"""Commit sharded checkpoints: ``.metadata`` and ``meta.pt`` appear only once every rank's shard file is durable.

One :class:`ShardedCommitter` per rank runs a thread that takes this rank's saves in save order. For each it

1. plans the checkpoint with DCP (:func:`~lightning_datastates.sharded.dcp_writer.plan_checkpoint`: DCP's two
   planning collectives, from the plans every rank staged), which gives rank 0 the ``.metadata``; automatic garbage
   collection is paused meanwhile (:mod:`~lightning_datastates.gcpause`);
2. waits until the engine committed (or failed) this rank's shard file;
3. exchanges the outcome and the name of the file it wrote with every rank (``all_gather_object``);
4. on rank 0, if every rank succeeded: reads the names of the files of the checkpoint the directory holds (if any),
   switches the directory to the new checkpoint through a commit record (:mod:`~lightning_datastates.sharded.publish`:
   no crash or storage error leaves it without a whole checkpoint, the earlier one or this one), and removes the
   earlier files and this save's files the metadata does not refer to; if a rank failed, removes this save's files
   instead (the directory keeps what it held before);
5. shares rank 0's result (``broadcast_object_list``), so that each rank knows whether the checkpoint exists.

Every collective runs on a gloo group of its own, made at setup: a collective on the training process group from a
background thread can deadlock NCCL, and gloo carries a few bytes between threads of the same ranks safely.

Each save is registered, until its commit ends, in the registry of pending work the engine's files register in too
(:class:`~lightning_datastates.snapshot.pending.PendingCheckpoints`, as a :class:`~lightning_datastates.snapshot.
pending.PendingCommit`): waits, failures and removals held back behind pending saves (ModelCheckpoint's top-k, rank 0
only) work the same for single files and sharded directories. A save that is not committed, for whatever reason,
is that save's failure: the removals waiting for it are dropped (the file to remove may be the last good checkpoint),
and every rank reports it once, as one :class:`~lightning_datastates.errors.CheckpointFlushError` naming the rank that
failed and why (a rank whose own shard file or staging failed reports that failure instead, once). Rank 0 always
shares its verdict, whatever failed on it, so that no rank waits for a verdict that never comes.

Why a gloo group and not markers on storage: the exchange costs two small collectives per checkpoint and no storage
request, a failure reaches every rank at once, and there is nothing to poll or to clean up. A rank that dies leaves
the others waiting in the exchange until the group's timeout (:data:`DEFAULT_EXCHANGE_TIMEOUT`; a launcher such as
torchrun or SLURM usually ends the job first). A collective that fails or times out fails its save with the rank and
the collective named; the group cannot be trusted after that, so every later save of the run fails at once with the
same cause (the next run's cleanup removes what they left), instead of each waiting out the timeout again.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_datastates.errors import CheckpointFlushError
from lightning_datastates.gcpause import collection_paused
from lightning_datastates.records.job import JobState, SnapshotStats
from lightning_datastates.records.names import COMMIT_RECORD_NAME, DCP_METADATA_NAME, LIGHTNING_META_NAME
from lightning_datastates.sharded.dcp_writer import (
    CheckpointPlan,
    StagedShard,
    join_path,
    plan_checkpoint,
)
from lightning_datastates.sharded.publish import (
    complete_or_keep,
    files_named,
    switch_to_record,
    write_commit_record,
)
from lightning_datastates.snapshot.pending import PendingCheckpoints, PendingCommit
from lightning_datastates.storage.base import StorageWriter
from lightning_datastates.storage.local import is_local_path, local_path

log = logging.getLogger("lightning_datastates")

#: How an outcome that is a skip, not a failure, begins.
_SKIPPED = "skipped: "
#: How long a rank waits for the others in an exchange before the checkpoint counts as failed.
DEFAULT_EXCHANGE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class ShardedSave:
    """One rank's part of one sharded save, handed to the committer once the training thread staged it.

    ``shard`` is the engine's record of this rank's file (None when the rank wrote none), ``staged`` what DCP's
    planning needs of this rank; rank 0 also holds Lightning's ``meta.pt`` bytes.
    """

    path: str
    shard: SnapshotStats | None
    staged: StagedShard
    meta_bytes: bytes | None = None
    marker: str | None = None  # rank 0: the in-flight marker (sharded/leftovers.py), removed once settled


class ShardedCommitter:
    """Commits this rank's sharded saves in order on a thread of its own (see the module docstring).

    Thread model: :meth:`submit` on the training thread; the exchange and the commit on the committer thread, which
    ends each save with :meth:`PendingCheckpoints.finish <lightning_datastates.snapshot.pending.PendingCheckpoints.
    finish>` (waits and removals held back for it go through that registry).
    """

    def __init__(
        self,
        group: Any,
        rank: int,
        pending: PendingCheckpoints,
        wait_shard: Callable[[str], None],
        writer_for: Callable[[str], StorageWriter],
    ) -> None:
        self._group = group
        self._rank = rank
        self._pending = pending
        self._wait_shard = wait_shard
        self._writer_for = writer_for
        self._queue: queue.Queue[tuple[ShardedSave, PendingCommit]] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Why the exchange cannot be trusted any more (a collective failed or timed out): every later save fails at
        # once with it. The committer thread's own.
        self._broken: str | None = None
        # Rank 0: directories whose switch to a new checkpoint stopped half-way (a storage error after the commit
        # record was durable); the committer thread's own, finished at the next save of the directory.
        self._half_way: set[str] = set()

    # ------------------------------------------------------------------ training thread
    def submit(self, save: ShardedSave) -> None:
        """Register ``save`` as pending and queue its commit behind the earlier ones."""
        commit = PendingCommit(save.path)
        self._pending.register_commit(commit)
        with self._lock:
            self._queue.put((save, commit))
            if self._thread is None:
                # A daemon: the exchange may wait for a rank that died; the callback drains before fit returns.
                self._thread = threading.Thread(target=self._run, name="datastates-sharded-commit", daemon=True)
                self._thread.start()

    # ------------------------------------------------------------------ committer thread
    def _run(self) -> None:
        while True:
            with self._lock:
                # The thread ends once its queue is empty (it lived on after every fit before, one per fit); the lock
                # makes "empty, so end" and submit's "no thread, so start one" exclusive: no commit is left unserved,
                # and commits stay in order (a new thread starts only after this one took its last).
                if self._queue.empty():
                    self._thread = None
                    return
                save, commit = self._queue.get_nowait()
            try:
                self._commit(save, commit)
            except BaseException as exc:  # noqa: BLE001 - that save's failure, reported once on this rank
                log.error("lightning_datastates: committing %s failed on rank %d: %r", save.path, self._rank, exc)
                commit.state = JobState.FAILED
                if save.staged.error is None:  # a staging error was raised on the training thread already
                    commit.error = _not_committed(save.path, f"rank {self._rank} failed while committing it: {exc!r}")
                    commit.error.__cause__ = exc
            finally:
                self._pending.finish(commit)

    def _commit(self, save: ShardedSave, commit: PendingCommit) -> None:
        """Plan, exchange, publish (rank 0) and share the verdict of ``save``; set ``commit``'s state and error."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.api import CheckpointException

        # Reported once already, on this rank's training thread (its staging) or through its own file's failure.
        reported_here = save.staged.error is not None
        cause: BaseException | None = None  # this rank's own failure, chained to the one reported
        if self._broken is not None:
            self._fail(commit, save, self._broken, reported_here, None)
            return  # the marker stays: the next run's cleanup removes what this save left
        # Every rank plans every save, in the same order, even one that failed here: the others wait for it.
        planned: CheckpointPlan | None = None
        own_error: str | None = None
        try:
            # Thousands of plan objects built and dropped: no collection (and no promotion) on this thread for them.
            with collection_paused():
                planned = plan_checkpoint(save.staged, save.path, self._group)
        except CheckpointException as exc:  # a rank's planning failed: DCP reports it to every rank alike
            own_error = f"DCP could not plan it: {exc!r}"
        except BaseException as exc:  # noqa: BLE001 - a collective of the planning itself failed or timed out
            self._fail(commit, save, self._broken_by(f"DCP's planning of {save.path}", exc), reported_here, exc)
            return
        own_skipped = False
        written = None
        if save.shard is not None:
            written = save.staged.file_name
            self._wait_shard(save.shard.path)  # also after a failed planning: the file is removed once written
            if save.shard.state == JobState.SKIPPED.value:
                own_error, own_skipped = f"{_SKIPPED}its host arena was full (on_arena_full='skip')", True
            elif save.shard.state != JobState.COMMITTED.value:
                own_error, reported_here = f"its shard file {save.shard.path} was {save.shard.state}", True
                # Reported as this save's failure (keyed by its directory, which a save outside the training loop
                # waits for), unless a hook of the training thread reported the file's failure already.
                shard_failure = self._pending.pop_failure(save.shard.path)
                if shard_failure is not None:
                    own_error, reported_here = f"{own_error}: {shard_failure.error!r}", False
                    cause = shard_failure.error
        outcomes: list[tuple[str | None, str | None]] = [(None, None)] * dist.get_world_size(self._group)
        try:
            dist.all_gather_object(outcomes, (own_error, written), group=self._group)
        except BaseException as exc:  # noqa: BLE001 - this save's failure
            self._fail(
                commit, save, self._broken_by(f"exchanging the outcomes of {save.path}", exc), reported_here, exc
            )
            return
        failed = [(rank, error) for rank, (error, _) in enumerate(outcomes) if error is not None]
        files = tuple(sorted(name for _, name in outcomes if name is not None))
        verdict: list[str | None] = [None]
        if self._rank == 0:
            verdict[0] = self._settle(save, planned, files, failed)
        try:
            dist.broadcast_object_list(verdict, src=0, group=self._group)
        except BaseException as exc:  # noqa: BLE001 - this save's failure
            self._fail(
                commit, save, self._broken_by(f"sharing rank 0's verdict on {save.path}", exc), reported_here, exc
            )
            return
        if verdict[0] is None:
            commit.state = JobState.COMMITTED
            return
        # A checkpoint skipped by choice (on_arena_full="skip") is no failure: it is logged, as a skipped file is.
        skipped = bool(failed) and all(error.startswith(_SKIPPED) for _, error in failed)
        commit.state = JobState.SKIPPED if skipped else JobState.FAILED
        if skipped and self._rank == 0:
            log.warning("lightning_datastates: skipped sharded checkpoint %s: %s", save.path, verdict[0])
        # A rank that skipped its own file reports another rank's real failure all the same: it must stop too.
        if not skipped and not (reported_here and not own_skipped):
            commit.error = _not_committed(save.path, verdict[0])
            commit.error.__cause__ = cause

    def _settle(
        self, save: ShardedSave, planned: CheckpointPlan | None, files: tuple[str, ...], failed: list[tuple[int, str]]
    ) -> str | None:
        """Rank 0: publish the save, or discard it where a rank failed; then its marker (once the save is settled)
        and, for a save not committed, the directory if that left it empty. The verdict: None, or why the save was
        not committed. Whatever raises here becomes the verdict: no rank may wait for one that never comes."""
        settled = True
        verdict: str | None
        try:
            if failed:
                verdict = self._discard(save, files, failed)
            else:
                verdict, settled = self._publish(save, planned, files)
            if save.marker is not None and settled:
                self._remove_files(self._writer_for(save.path), save.path, [_name(save.marker)])
        except BaseException as exc:  # noqa: BLE001 - shared as the verdict
            log.error("lightning_datastates: committing %s failed: %r", save.path, exc)
            return f"rank 0 failed while committing it: {exc!r}"
        if verdict is not None and settled:
            _remove_if_no_checkpoint_left(save.path)  # the marker is gone: an empty directory goes too
        return verdict

    def _fail(
        self, commit: PendingCommit, save: ShardedSave, why: str, reported_here: bool, cause: BaseException | None
    ) -> None:
        """``save`` was not committed because of ``why``: reported on this rank unless it was already."""
        commit.state = JobState.FAILED
        if not reported_here:
            commit.error = _not_committed(save.path, why)
            commit.error.__cause__ = cause

    def _broken_by(self, doing: str, exc: BaseException) -> str:
        """The exchange is broken from now on: every later save fails at once with the text returned."""
        timeout_s = DEFAULT_EXCHANGE_TIMEOUT.total_seconds()
        self._broken = (
            f"rank {self._rank} failed {doing} with the other ranks (each collective waits at most {timeout_s:.0f} s "
            f"for them): {exc!r}"
        )
        log.error("lightning_datastates: %s", self._broken)
        return self._broken

    def _publish(
        self, save: ShardedSave, planned: CheckpointPlan | None, files: tuple[str, ...]
    ) -> tuple[str | None, bool]:
        """Rank 0, every shard durable: make the directory this checkpoint. The error text if that failed (None if
        not), and whether the save is settled (its marker may go): not when the switch stopped half-way, which the
        next run's cleanup of the marked directory completes or undoes (sharded/publish.py)."""
        assert planned is not None and save.meta_bytes is not None
        writer = self._writer_for(save.path)
        kept = (
            f"; the directory and its commit record are kept, and the next run's cleanup leaves it a whole checkpoint "
            f"(the one it held, or the one its record describes), as does the next save of {save.path} in this run"
        )
        try:
            if save.path in self._half_way:
                # An earlier save's switch of this directory stopped half-way: finish it from its record first, so
                # that this save starts from a whole checkpoint and never overwrites the only record of one.
                names = {entry.name for entry in writer.list_directory(save.path)}
                if LIGHTNING_META_NAME not in names and not _finished(writer, save.path, names):
                    # Its record is gone, or names shard files that are gone (removed by hand): nothing there can
                    # become a whole checkpoint again, so nothing is kept for it; this save makes the directory one.
                    log.warning("lightning_datastates: nothing to finish in %s; this save replaces it", save.path)
                self._half_way.discard(save.path)
            earlier = _files_of(writer, join_path(save.path, DCP_METADATA_NAME))
            write_commit_record(writer, save.path, planned.metadata_bytes, save.meta_bytes)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            log.error("lightning_datastates: committing %s failed: %r", save.path, exc)
            if save.path in self._half_way:
                # Its record may be the only way back to a whole checkpoint (or this save's, if the failed write
                # landed, which then needs this save's files): nothing is removed.
                return f"rank 0 could not write its metadata: {exc!r}{kept}", False
            # The directory holds what it held, whole: this save's files and record go.
            self._remove_files(writer, save.path, [*files, COMMIT_RECORD_NAME])
            return f"rank 0 could not write its metadata: {exc!r}", True
        try:
            switch_to_record(writer, save.path, planned.metadata_bytes, save.meta_bytes)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            log.error("lightning_datastates: committing %s failed half-way: %r", save.path, exc)
            self._half_way.add(save.path)
            return f"rank 0 could not write its metadata: {exc!r}{kept}", False
        # The files of the checkpoint replaced, and a file of this save that DCP chose none of the items of.
        self._remove_files(writer, save.path, sorted((set(earlier) | set(files)) - set(planned.file_names)))
        return None, True

    def _discard(self, save: ShardedSave, files: tuple[str, ...], failed: list[tuple[int, str]]) -> str:
        """Rank 0, a rank failed: remove this save's files (its marker goes after, with any settled save's); the
        directory keeps what it held. The error text."""
        self._remove_files(self._writer_for(save.path), save.path, files)
        return "; ".join(f"rank {rank} failed: {error}" for rank, error in failed)

    def _remove_files(self, writer: StorageWriter, directory: str, names: Any) -> None:
        names = list(names)
        if not names:
            return
        try:
            writer.remove_files(directory, names)  # one request for them all on S3
        except Exception as exc:  # noqa: BLE001 - a leftover file, never a wrong checkpoint
            log.warning("lightning_datastates: could not remove %s from %s: %r", names, directory, exc)


def _finished(writer: StorageWriter, directory: str, names: set[str]) -> bool:
    """:func:`complete_or_keep`, False also where the record names shard files that are gone (storage errors are
    raised: the directory may still be finished later)."""
    try:
        return complete_or_keep(writer, directory, names)
    except ValueError as exc:
        log.warning("lightning_datastates: the commit record of %s cannot be finished: %s", directory, exc)
        return False


def _files_of(writer: StorageWriter, metadata_path: str) -> list[str]:
    """The files the checkpoint of ``metadata_path`` (DCP's ``.metadata``) refers to; none if there is no such file."""
    if not writer.exists(metadata_path):
        return []
    return files_named(bytes(writer.read_bytes(metadata_path)))


def _remove_if_no_checkpoint_left(directory: str) -> None:
    """After a save's files were removed: the local ``directory`` if it holds nothing (an empty directory named like a
    checkpoint would trip a resume); no request to other storage (where a directory with no objects is none)."""
    if is_local_path(directory) and not os.path.exists(local_path(join_path(directory, LIGHTNING_META_NAME))):
        remove_empty_local_directory(directory)


def _not_committed(path: str, why: str) -> CheckpointFlushError:
    return CheckpointFlushError(f"checkpoint {path} was not committed: {why}", path)


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def remove_empty_local_directory(path: str) -> None:
    """Remove the local directory ``path`` if it is empty (a directory named like a checkpoint, holding none, would
    trip a resume); anything else, and any path not local, is left as it is."""
    if is_local_path(path):
        try:
            os.rmdir(local_path(path))
        except OSError:
            pass  # not empty (or gone): it keeps what it holds
