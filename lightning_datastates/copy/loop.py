"""The copier thread's loop: captured checkpoints into the host arena, chunk by chunk, one checkpoint after another.

Per checkpoint, the copier thread 1) queues its metadata write and copies its eager chunks (the save call waits for
them); 2) queues its write-through chunks (:mod:`~lightning_datastates.records.through`) and copies its lazy chunks,
the last write-through chunk first, copying the eager part of newer captures in between (their save calls wait);
3) finishes the copy: the sources are read no more, barriers (``wait_copies``) pass. Each copied chunk goes to the
writers as a :class:`~lightning_datastates.records.tasks.WriteChunk`. A checkpoint without lazy chunks is finished at
once; one with lazy chunks waits until the lazy part of the one before it is copied.

Chunks in flight: a device copier returns once a chunk's copies are queued on its stream (copy/copier.py), so the
copier thread starts the next chunks' copies before the earlier ones end (up to :data:`IN_FLIGHT_CHUNKS`, and a
quarter of the arena), and hands each chunk to the writers once its copies ended, oldest first. The copy engine then
always has work queued, also while the copier thread waits for the GIL. Every started chunk is handed over (or
failed) before anything that needs its bytes or its sources: before a save call or a barrier is let through, before
the copier waits for space in the arena (the blocks of started chunks must reach the writers to be freed) or for
writers. Host copies end before ``start_chunk`` returns: their chunks go to the writers at once, as if copied
synchronously.

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
from dataclasses import dataclass
from typing import Any

from lightning_datastates.copy.arena import HostArena
from lightning_datastates.copy.copier import ChunkCopy, CopierSet
from lightning_datastates.copy.sharing import SharedCopies
from lightning_datastates.records.block import Block
from lightning_datastates.records.chunks import Chunk
from lightning_datastates.records.job import SnapshotJob
from lightning_datastates.records.tasks import POLL_S, WAKE, WriteChunk, WriteMetadata, WriteQueue, WriteThroughChunk
from lightning_datastates.records.through import WriteThrough

#: At most this many chunks are in flight at once (the one just started included): with 64 MiB chunks, about 5 ms of
#: copying on a 50 GB/s link, one GIL switch interval; few enough that the eager copies of a new save, queued on the
#: same stream behind them, wait little.
IN_FLIGHT_CHUNKS = 4
#: ... and they hold at most this fraction of the arena, so that writers always have the rest to work with.
IN_FLIGHT_ARENA_FRACTION = 0.25


@dataclass(frozen=True)
class _StartedChunk:
    """A chunk whose copies were started into ``block`` and not yet handed to the writers."""

    job: SnapshotJob
    chunk: Chunk
    block: Block
    copy: ChunkCopy


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
        self._captured: queue.Queue[SnapshotJob | None] = queue.Queue()  # in capture order (and WAKE)
        self._eager_done: deque[SnapshotJob] = deque()  # eager part copied, lazy part waiting
        self._started: deque[_StartedChunk] = deque()  # chunks in flight, oldest first

    # ------------------------------------------------------------------ training thread
    def submit(self, job: SnapshotJob) -> None:
        """Hand a captured ``job`` to the copier (the copier queues its metadata write: nothing half-queued)."""
        self._captured.put(job)

    def wake_to_end(self) -> None:
        """Training thread, at the engine's close: wake the copier if it waits for captures, so that it ends now."""
        self._captured.put(WAKE)

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
                    woken = self._captured.get(timeout=POLL_S)
                except queue.Empty:
                    woken = WAKE
                if woken is WAKE:  # idle for POLL_S, or woken by the engine's close: end now if that is due
                    if self._retire_if_idle(self._captured, idle_since):
                        return
                    continue
                job = woken
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
        self._retire_all()  # what the copier waits for may be writers waiting for these chunks
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
        self._retire_all()  # the save call waits for these bytes, not only for their copies to start
        job.eager_copied.set()
        return True

    def _copy_newer_eager(self) -> None:
        """Between lazy chunks, copy the eager part of newly captured jobs: their save calls wait for it."""
        while True:
            try:
                job = self._captured.get_nowait()
            except queue.Empty:
                return
            if job is WAKE:  # left by a close this thread did not wait for: not a capture
                continue
            if not self._copy_eager(job):
                continue
            if job.lazy_chunks:
                self._eager_done.append(job)  # its lazy part follows the current job's
            else:
                self._finish_copy(job)  # nothing lazy: its save call (or a barrier) need not wait any longer

    def _finish_copy(self, job: SnapshotJob) -> None:
        """``job``'s sources are read no more: fail followers of chunks it never copied, let barriers through."""
        self._retire_all()  # every started copy has ended (and its chunk reached the writers) before that
        error = job.error or RuntimeError(f"the copy of {job.path} ended early")
        for follower, cause in self._sharing.abandon(job, error):
            follower.fail(cause)
            follower.release()
        job.mark_copied()
        job.release()  # the copy's share of the outstanding work

    def _copy_chunk(self, job: SnapshotJob, chunk: Chunk) -> None:
        """Start copying ``chunk`` into a new arena block, unless nobody needs its bytes any more; hand the chunks
        whose copies ended to the writers (see "Chunks in flight" in the module docstring)."""
        if not self._sharing.must_copy(job, chunk):
            return  # failed or superseded, and no other checkpoint follows it: the bytes would never be committed
        assert job.sources is not None
        block = self._allocate(job, chunk.block_bytes)
        if job.stats.first_copy_at is None:
            job.stats.first_copy_at = time.perf_counter()  # after the save call's planning and any wait for space
        try:
            copy = self._copiers.start_chunk(self._arena.tensor(block), chunk.pieces, job.sources, job.marks)
        except BaseException:
            self._arena.free(block)
            raise
        self._started.append(_StartedChunk(job, chunk, block, copy))
        limit = int(self._arena.size_bytes * IN_FLIGHT_ARENA_FRACTION)
        while self._started and (
            self._oldest_ended()
            or len(self._started) >= IN_FLIGHT_CHUNKS
            or sum(started.block.reserved_bytes for started in self._started) > limit
        ):
            self._retire_oldest()

    def _oldest_ended(self) -> bool:
        """Whether the oldest started chunk's copies ended; True if asking failed (its wait then fails its own
        checkpoint, not the one being copied now)."""
        try:
            return self._started[0].copy.ready()
        except BaseException:  # noqa: BLE001 - raised again by the wait in _retire_oldest
            return True

    def _allocate(self, job: SnapshotJob, nbytes: int) -> Block:
        """An arena block of ``nbytes`` for ``job``'s chunk; a wait for space (back-pressure) counts in its stats."""
        waited_before = self._arena.waited_s  # only this thread allocates: the difference is this chunk's wait
        try:
            if self._started:
                try:
                    return self._arena.allocate(nbytes, timeout_s=0)
                except TimeoutError:
                    self._retire_all()  # the writers can free nothing of blocks they never got
            return self._arena.allocate(nbytes)  # back-pressure: waits for writers to free space
        finally:
            job.stats.arena_wait_s += self._arena.waited_s - waited_before

    def _retire_oldest(self) -> None:
        """Wait for the oldest started chunk's copies and queue its write; a failed copy fails its checkpoint."""
        started = self._started.popleft()
        job, chunk = started.job, started.chunk
        try:
            crcs = started.copy.wait()  # the CRC-32s where the copier computed them on the way (host sources)
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread, never lost
            self._arena.free(started.block)
            job.fail(exc)  # its chunks not yet copied are skipped; _finish_copy fails their followers
            return
        self._sharing.count_copied(sum(piece.nbytes for piece in chunk.pieces))
        job.add_outstanding()
        self._sharing.mark_queued(chunk)  # from here on a writer serves the chunk's followers
        self._write_queue.put(WriteChunk(job, chunk, started.block, crcs))

    def _retire_all(self) -> None:
        """Hand every started chunk to the writers (waiting for their copies), oldest first."""
        while self._started:
            self._retire_oldest()
