"""The copier thread's loop: captured checkpoints into the host arena, chunk by chunk, one checkpoint after another.

Per checkpoint, the copier thread 1) queues its metadata write and copies its eager chunks (the save call waits for
them); 2) queues its write-through chunks (:mod:`~lightning_datastates.write.through`) and copies its lazy chunks,
the last write-through chunk first, copying the eager part of newer captures in between (their save calls wait);
3) finishes the copy: the sources are read no more, barriers (``wait_copies``) pass. Each copied chunk goes to the
writers as a :class:`~lightning_datastates.write.tasks.WriteChunk`. A checkpoint without lazy chunks is finished at
once; one with lazy chunks waits until the lazy part of the one before it is copied.

Thread model: :meth:`CopyLoop.submit` and :meth:`CopyLoop.wake` run on the training thread (capture);
:meth:`CopyLoop.run` is the body of the copier thread, and everything else runs there. The wake condition is shared
with the write-through gates: writers notify it when they are done with a chunk, barriers when they close a gate.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from lightning_datastates.capture.chunks import Chunk
from lightning_datastates.copy.arena import HostArena
from lightning_datastates.copy.copier import CopierSet
from lightning_datastates.copy.sharing import SharedCopies
from lightning_datastates.snapshot.job import SnapshotJob
from lightning_datastates.snapshot.threads import POLL_S
from lightning_datastates.write.tasks import WriteChunk, WriteMetadata, WriteQueue, WriteThroughChunk
from lightning_datastates.write.through import WriteThrough


class CopyLoop:
    """The copier thread's work (see the module docstring).

    Args:
        arena: where chunks are copied to (an allocation waits for writers to free space: back-pressure).
        copiers: one copier per source device.
        sharing: the chunks later checkpoints follow (copied even for a stopped checkpoint while followed).
        write_queue: where copied chunks (and metadata and write-through chunks) go to the writers.
        wake: the condition the copier thread waits on for write-through chunks and new captures.
        retire_if_idle: ``(own queue, idle since)``: whether the calling thread should end now.
    """

    def __init__(
        self,
        arena: HostArena,
        copiers: CopierSet,
        sharing: SharedCopies,
        write_queue: WriteQueue,
        wake: threading.Condition,
        retire_if_idle: Callable[[queue.Queue[Any], float], bool],
    ) -> None:
        self._arena = arena
        self._copiers = copiers
        self._sharing = sharing
        self._write_queue = write_queue
        self._wake = wake
        self._retire_if_idle = retire_if_idle
        self._captured: queue.Queue[SnapshotJob] = queue.Queue()  # in capture order
        self._eager_done: deque[SnapshotJob] = deque()  # eager part copied, lazy part waiting

    # ------------------------------------------------------------------ training thread
    def submit(self, job: SnapshotJob) -> None:
        """Hand a captured ``job`` to the copier (the copier queues its metadata write: nothing half-queued)."""
        self._captured.put(job)

    def wake(self) -> None:
        """Wake the copier if it waits for write-through chunks: it copies the eager part of new captures then."""
        with self._wake:
            self._wake.notify_all()

    # ------------------------------------------------------------------ copier thread
    def run(self) -> None:
        """The body of the copier thread: copy captured jobs until idle long enough (or the engine closes)."""
        idle_since = time.monotonic()
        while True:
            if self._eager_done:
                job = self._eager_done.popleft()
            else:
                try:
                    job = self._captured.get(timeout=POLL_S)
                except queue.Empty:
                    if self._retire_if_idle(self._captured, idle_since):
                        return
                    continue
            self._copy_job(job)
            idle_since = time.monotonic()

    def _copy_job(self, job: SnapshotJob) -> None:
        if not job.eager_copied.is_set() and not self._copy_eager(job):
            return
        through = job.write_through
        try:
            if through is not None:
                for chunk in through.chunks:  # writers take them straight from the sources, unless a barrier comes
                    job.add_outstanding()
                    self._write_queue.put(WriteThroughChunk(job, chunk))
            held_back = set() if through is None else {id(chunk) for chunk in through.chunks}
            for chunk in job.lazy_chunks:
                if id(chunk) not in held_back:
                    self._copy_newer_eager()
                    self._copy_chunk(job, chunk)
            if through is not None:
                self._copy_unwritten(job, through)
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread, never lost
            job.fail(exc)
        finally:
            if through is not None:
                # Sources may be read only until the copy ends: stop writers from starting, wait for those writing.
                through.close()
                through.take_unwritten()  # on failure: never copied (their followers are failed by _finish_copy)
                self._wait_copier(lambda: not through.in_flight())
            self._finish_copy(job)

    def _copy_unwritten(self, job: SnapshotJob, through: WriteThrough) -> None:
        """Copy the chunks of ``through`` that writers did not take into the arena (as any lazy chunk), the last one
        first, while writers take chunks from the front. Without ``copier_races`` (nothing changes the sources before
        the commit) wait instead until the writers wrote them all, or until a barrier closed the gate."""
        while True:
            if not through.copier_races:
                self._wait_copier(lambda: through.settled() or through.closed)
            chunk = through.take_last()
            if chunk is None:
                return
            self._copy_newer_eager()
            self._copy_chunk(job, chunk)

    def _wait_copier(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()`` (checked with the wake condition held), copying the eager part of new captures
        meanwhile (their save calls wait for it)."""
        while True:
            self._copy_newer_eager()
            with self._wake:
                if ready():
                    return
                if self._captured.empty():
                    self._wake.wait(POLL_S)  # woken by writers, barriers and captures

    def _copy_eager(self, job: SnapshotJob) -> bool:
        """Queue ``job``'s metadata write and copy its eager chunks; False (and the copy finished) on failure."""
        self._write_queue.put(WriteMetadata(job))
        try:
            for chunk in job.eager_chunks:
                self._copy_chunk(job, chunk)
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread, never lost
            job.fail(exc)
            self._finish_copy(job)
            return False
        job.eager_copied.set()
        return True

    def _copy_newer_eager(self) -> None:
        """Between lazy chunks, copy the eager part of newly captured jobs: their save calls wait for it."""
        while True:
            try:
                job = self._captured.get_nowait()
            except queue.Empty:
                return
            if not self._copy_eager(job):
                continue
            if job.lazy_chunks:
                self._eager_done.append(job)  # its lazy part follows the current job's
            else:
                self._finish_copy(job)  # nothing lazy: its save call (or a barrier) need not wait any longer

    def _finish_copy(self, job: SnapshotJob) -> None:
        """``job``'s sources are read no more: fail followers of chunks it never copied, let barriers through."""
        error = job.error or RuntimeError(f"the copy of {job.path} ended early")
        for follower, cause in self._sharing.abandon(job, error):
            follower.fail(cause)
            follower.release()
        job.mark_copied()
        job.release()  # the copy's share of the outstanding work

    def _copy_chunk(self, job: SnapshotJob, chunk: Chunk) -> None:
        """Copy ``chunk`` into a new arena block and queue its write, unless nobody needs its bytes any more."""
        if not self._sharing.must_copy(job, chunk):
            return  # failed or superseded, and no other checkpoint follows it: the bytes would never be committed
        assert job.sources is not None
        waited_before = self._arena.waited_s  # only this thread allocates: the difference is this chunk's wait
        block = self._arena.allocate(chunk.block_bytes)  # back-pressure: waits for writers to free space
        job.stats.arena_wait_s += self._arena.waited_s - waited_before
        try:
            # The CRC-32s where the copier computed them on the way (host sources).
            crcs = self._copiers.copy_chunk(self._arena.tensor(block), chunk.pieces, job.sources, job.marks)
        except BaseException:
            self._arena.free(block)
            raise
        self._sharing.count_copied(sum(piece.nbytes for piece in chunk.pieces))
        job.add_outstanding()
        self._sharing.mark_queued(chunk)  # from here on a writer serves the chunk's followers
        self._write_queue.put(WriteChunk(job, chunk, block, crcs))
