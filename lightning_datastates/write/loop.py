"""The writer threads' loop: each takes tasks (:mod:`~lightning_datastates.records.tasks`) from one shared queue.

Per checkpoint, writer threads 1) write its metadata; 2) write each chunk at its file offsets, from its arena block
(then write the same bytes into every checkpoint that shares the chunk, :mod:`~lightning_datastates.copy.sharing`, and
free the block or hand it to the resident cache, :mod:`~lightning_datastates.load.resident`), or straight from the
training tensors (:mod:`~lightning_datastates.records.through`); 3) once its last outstanding work is released
(:meth:`~lightning_datastates.records.job.SnapshotJob.release`, which calls :meth:`WriteLoop.schedule_commit` on
whichever thread released it), commit the file, or abort it if the checkpoint failed or was cancelled (superseded,
or abandoned: :meth:`~lightning_datastates.snapshot.engine.SnapshotEngine.abandon`), and finish the checkpoint
(:meth:`~lightning_datastates.snapshot.pending.PendingCheckpoints.finish`).

Thread model: :meth:`WriteLoop.run` is the body of every writer thread; :meth:`WriteLoop.handle` runs there, once per
task. A failure while writing is recorded on the checkpoint (raised on the training thread later), never lost.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_datastates.copy.arena import HostArena, address_view
from lightning_datastates.copy.sharing import FollowerWrite, SharedCopies
from lightning_datastates.load.resident import ResidentCache
from lightning_datastates.records.block import Block, PieceCrcs
from lightning_datastates.records.chunks import Chunk
from lightning_datastates.records.job import JobState, SnapshotJob
from lightning_datastates.records.session import WriteSession
from lightning_datastates.records.tasks import (
    POLL_S,
    WAKE,
    Commit,
    WriteChunk,
    WriteMetadata,
    WriteQueue,
    WriteTask,
    WriteThroughChunk,
)

log = logging.getLogger("lightning_datastates")

#: ``bytes_at(block_offset, nbytes)``: the bytes a chunk's piece is written from (its arena block, or the tensors).
BytesAt = Callable[[int, int], memoryview]
#: Checkpoints that share a chunk, with the writes each needs from it.
Followers = list[tuple[SnapshotJob, list[FollowerWrite]]]


class WriteLoop:
    """Writer threads' work over the host arena (see the module docstring).

    Args:
        write_queue: the tasks, put by the copier thread (and commits, put here).
        arena: where chunks are written from; blocks are freed here.
        resident: with ``serve_from_memory``, keeps written blocks instead of freeing them.
        sharing: the chunks later checkpoints follow (written here into those too).
        finish: called once per checkpoint after its commit or abort (the pending checkpoints' bookkeeping).
        retire_if_idle: ``(own queue, idle since)``: whether the calling thread should end now.
    """

    def __init__(
        self,
        write_queue: WriteQueue,
        arena: HostArena,
        resident: ResidentCache | None,
        sharing: SharedCopies,
        finish: Callable[[SnapshotJob], None],
        retire_if_idle: Callable[[queue.Queue[Any], float], bool],
    ) -> None:
        self.queue = write_queue
        self._arena = arena
        self._resident = resident
        self._sharing = sharing
        self._finish = finish
        self._retire_if_idle = retire_if_idle

    def run(self) -> None:
        """The body of a writer thread: handle tasks until idle long enough (or the engine closes)."""
        idle_since = time.monotonic()
        while True:
            try:
                task = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                task = WAKE
            if task is WAKE:  # idle for POLL_S, or woken by the engine's close: end now if that is due
                if self._retire_if_idle(self.queue, idle_since):
                    return
                continue
            idle_since = time.monotonic()
            self.handle(task)

    def schedule_commit(self, job: SnapshotJob) -> None:
        """``job``'s last outstanding work ended (any thread): queue its commit."""
        self.queue.put(Commit(job))

    def handle(self, task: WriteTask) -> None:
        """Carry out one task; a write task releases its share of the job's outstanding work whatever happens.

        Raises:
            TypeError: ``task`` is not a write task (a bug: nothing of it was done).
        """
        if isinstance(task, Commit):
            self._commit(task.job)
            return
        if not isinstance(task, (WriteMetadata, WriteChunk, WriteThroughChunk)):
            raise TypeError(f"not a write task: {task!r}")
        job = task.job
        try:
            if isinstance(task, WriteThroughChunk):
                self._write_through(job, task.chunk)  # also when the job stopped: it may have followers
            elif job.stopped:
                pass
            elif isinstance(task, WriteMetadata):
                self._write_metadata(job)
            else:
                self._write_chunk(job, task.chunk, self._block_bytes(task.block), task.crcs)
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread, never lost
            job.fail(exc)
        finally:
            if isinstance(task, WriteChunk):
                followers = self._write_followers(task.chunk, self._block_bytes(task.block), task.crcs)
                self._retire_block(job, task.chunk, task.block, followers)
            job.release()

    def _block_bytes(self, block: Block) -> BytesAt:
        """``bytes_at(offset, nbytes)`` over an arena block."""
        return _slicer(self._arena.memoryview(block))

    def _write_metadata(self, job: SnapshotJob) -> None:
        """Write ``job``'s metadata ranges (the archive's headers and pickled skeleton); stops between them once the job
        stopped, as :meth:`_write_chunk` does."""
        for offset, data in job.layout.metadata:
            if job.stopped:
                return
            job.session.write_range(offset, memoryview(data))
            job.add_written(len(data))

    def _write_chunk(self, job: SnapshotJob, chunk: Chunk, bytes_at: BytesAt, crcs: PieceCrcs | None = None) -> None:
        """Write ``chunk``'s pieces into ``job``'s file, each from ``bytes_at(block_offset, nbytes)`` (its arena
        block, or the training tensors themselves), with the CRC-32 the copier computed where it did (``crcs``, by
        block offset). Stops between pieces once the job stopped (failed, superseded, abandoned): nothing more of
        it will be committed, and an abandon waits for the write in progress."""
        for piece in chunk.pieces:
            if job.stopped:
                return
            _write_piece(
                job.session, piece.file_offset, bytes_at(piece.block_offset, piece.nbytes), crcs, piece.block_offset
            )
            job.add_written(piece.nbytes)

    def _write_through(self, job: SnapshotJob, chunk: Chunk) -> None:
        """Write ``chunk`` (and its followers' copies) straight from the sources, unless a barrier came first (then
        the copier copies it into the arena)."""
        assert job.write_through is not None
        if not job.write_through.claim(chunk):
            return
        try:
            self._sharing.mark_queued(chunk)  # from here on this writer serves the chunk's followers
            if not self._sharing.must_copy(job, chunk):
                return
            assert job.sources is not None  # dropped only once no chunk is being written (the copy's end waits)
            views = {p.block_offset: _host_bytes(job.sources[p.key], p.source_offset, p.nbytes) for p in chunk.pieces}

            # Pieces and followers' writes are whole pieces of this chunk (copy/sharing.py): found by block offset.
            def bytes_at(offset: int, nbytes: int) -> memoryview:
                return views[offset][:nbytes]

            try:
                if not job.stopped:
                    self._write_chunk(job, chunk, bytes_at)
            except BaseException as exc:  # noqa: BLE001 - reported on the training thread, never lost
                job.fail(exc)
            for follower, _ in self._write_followers(chunk, bytes_at):
                follower.release()
        finally:
            job.write_through.done(chunk)

    def _write_followers(self, chunk: Chunk, bytes_at: BytesAt, crcs: PieceCrcs | None = None) -> Followers:
        """Write ``chunk``'s bytes (``bytes_at(block_offset, nbytes)``) into every checkpoint that shares it, at
        that checkpoint's own offsets; return those checkpoints (the caller releases them). Each write is a whole
        piece of the chunk (copy/sharing.py), so its CRC-32 in ``crcs`` (by block offset) holds for it too."""
        followers = self._sharing.take_followers(chunk)
        for follower, writes in followers:
            try:
                if not follower.stopped:
                    for write in writes:
                        data = bytes_at(write.block_offset, write.nbytes)
                        _write_piece(follower.session, write.file_offset, data, crcs, write.block_offset)
                        follower.add_written(write.nbytes)
            except BaseException as exc:  # noqa: BLE001 - reported on the training thread, never lost
                follower.fail(exc)
        return followers

    def _retire_block(self, job: SnapshotJob, chunk: Chunk, block: Block, followers: Followers) -> None:
        """``block`` is written: free it, or keep it for the checkpoints written from it (every job that did not
        stop holds the ranges it wrote), then release the followers. Retained before the release, so a follower's
        commit (on another writer thread) finds the block in its image."""
        try:
            if self._resident is None:
                self._arena.free(block)
            else:
                holders = [(job, [(p.block_offset, p.file_offset, p.nbytes) for p in chunk.pieces])]
                holders += [(f, [(w.block_offset, w.file_offset, w.nbytes) for w in writes]) for f, writes in followers]
                self._resident.retain(block, [(holder, ranges) for holder, ranges in holders if not holder.stopped])
        finally:
            for follower, _ in followers:
                follower.release()

    def _commit(self, job: SnapshotJob) -> None:
        """Complete ``job``'s file (or abort it: failed or cancelled), settle its resident image, finish it."""
        if not job.stopped:
            try:
                job.session.complete()
                job.state = JobState.COMMITTED
            except BaseException as exc:  # noqa: BLE001
                job.fail(exc)
        if job.state is not JobState.COMMITTED:
            try:
                job.session.abort()
            except Exception:
                log.exception(
                    "lightning_datastates: could not remove the temporary file of %s; the next run removes it at setup",
                    job.path,
                )
            job.state = JobState.FAILED if job.error is not None else JobState.CANCELLED
        if self._resident is not None:
            self._resident.settle(job)  # publish the image (or drop it) before anyone can see the job finished
        job.stats.state = job.state.value
        job.stats.durable_s = time.perf_counter() - job.stats.started_at
        if job.error is not None:
            log.debug("lightning_datastates: writing %s failed", job.path, exc_info=job.error)
        if job.on_settled is not None:
            try:
                job.on_settled(job)
            except Exception:
                log.exception("lightning_datastates: after writing %s", job.path)
        self._finish(job)


def _write_piece(
    session: WriteSession, file_offset: int, data: memoryview, crcs: PieceCrcs | None, block_offset: int
) -> None:
    """Write one piece at ``file_offset``, handing over its CRC-32 when the copier computed it for these bytes."""
    known = None if crcs is None else crcs.get(block_offset)
    if known is None or known[0] != data.nbytes:
        session.write_range(file_offset, data)
    else:
        session.write_checksummed_range(file_offset, data, known[1])


def _slicer(view: memoryview) -> BytesAt:
    """``bytes_at(offset, nbytes)`` over ``view``."""
    return lambda offset, nbytes: view[offset : offset + nbytes]


def _host_bytes(storage: torch.UntypedStorage, offset: int, nbytes: int) -> memoryview:
    """A memoryview of ``nbytes`` bytes of the host ``storage`` from ``offset`` (no copy; valid while it lives)."""
    return address_view(storage.data_ptr() + offset, nbytes)
