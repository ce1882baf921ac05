"""The snapshot engine: capture on the training thread, copy on a copier thread, flush on writer threads.

``capture`` (training thread) plans the file layout (the non-tensor skeleton is pickled there and then), opens
a write session, copies the storages that may change before the next barrier (or are tiny) and returns; the
copier thread moves every other storage into the host arena, chunk by chunk, while training goes on; writer
threads write each chunk at its offset, free its block (or, with ``serve_from_memory``, hand it to the resident
cache, :mod:`~lightning_datastates.load.resident`), and commit the file when the last byte is written.

Threads are ordinary (non-daemon) threads: at interpreter exit they finish every pending checkpoint and then
end by themselves, so a script that returns right after ``fit`` still leaves complete files.

No Lightning and no file formats here: the layout comes from :mod:`~lightning_datastates.capture.layout`, the bytes go
to a :class:`~lightning_datastates.storage.base.StorageWriter`.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from lightning_datastates.alignment import PAGE_ALIGNMENT_BYTES
from lightning_datastates.capture.chunks import Chunk, plan_chunks
from lightning_datastates.capture.layout import (
    CheckpointLayout,
    StorageRecord,
    VerifiedStructures,
    plan_layout,
    plan_serialized_layout,
    storage_alignment,
)
from lightning_datastates.config import DataStatesConfig
from lightning_datastates.copy.arena import HostArena, address_view
from lightning_datastates.copy.copier import CopierSet, PieceCrcs
from lightning_datastates.copy.sharing import FollowerWrite, SharedCopies, SharingCounters
from lightning_datastates.errors import CheckpointCaptureError
from lightning_datastates.load.resident import ResidentCache
from lightning_datastates.snapshot.job import JobState, SnapshotJob, SnapshotStats
from lightning_datastates.storage.base import StorageWriter, WriteSession
from lightning_datastates.write.checksums import checksummed
from lightning_datastates.write.through import WRITE_THROUGH_CHUNK_BYTES, WriteThrough

log = logging.getLogger("lightning_datastates")

#: How often idle threads look whether they should end (engine closed, or interpreter exiting).
_POLL_S = 0.1
#: Idle threads end after this long without work (they are started again by the next capture).
_IDLE_EXIT_S = 10.0
#: Stats of this many recent checkpoints are kept.
_HISTORY_LENGTH = 1000
#: At most this many checkpoints per writer thread are in flight (captured, not yet committed or dropped): each holds
#: an open write session and its metadata; beyond it a save waits (or is skipped, with on_arena_full="skip").
_PENDING_PER_WRITER = 2

#: Opt-in (off by default): add this to the nice value of the copier and writer threads (Linux sets it per thread), so
#: that where cores are scarce the training thread gets the CPU first. An integer from 1 to 19; unset or 0: unchanged.
THREAD_NICE_ENV = "LIGHTNING_DATASTATES_THREAD_NICE"

LazyPredicate = Callable[[torch.UntypedStorage], bool]


class SnapshotEngine:
    """Owns the host arena, the copier and writer threads, and every pending checkpoint.

    Thread model: ``capture``, ``wait_copies``, ``wait_path``, ``cancel_path``, ``drain``, ``pop_failure`` and
    ``close`` are called from the training thread; everything else runs on the engine's own threads.
    """

    def __init__(self, config: DataStatesConfig) -> None:
        self.config = config
        self.arena: HostArena | None = None
        self.resident: ResidentCache | None = None  # with serve_from_memory, created with the arena
        self.history: deque[SnapshotStats] = deque(maxlen=_HISTORY_LENGTH)
        self._copiers = CopierSet()
        self._lock = threading.Lock()
        self._active: list[SnapshotJob] = []  # not yet finished, in capture order
        self._latest_by_path: dict[str, SnapshotJob] = {}
        self._failures: deque[SnapshotJob] = deque()  # failed, not yet reported
        # path -> (jobs to wait for, remove callable): removals held back until earlier checkpoints landed
        self._deferred_removals: dict[str, tuple[list[SnapshotJob], Callable[[], None]]] = {}
        self._copy_queue: queue.Queue[SnapshotJob] = queue.Queue()
        self._write_queue: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._warned_fallback = False
        # Saves of one training run repeat a few archive structures: planned again, they skip the self-check.
        self._verified_structures = VerifiedStructures()
        self._skipped_since_last_capture = False  # removals right after a skipped save keep their file
        self._sharing = SharedCopies()  # lazy copies open to later checkpoints of the same state
        self._eager_done: deque[SnapshotJob] = deque()  # copier thread: eager part copied, lazy part waiting
        # The copier thread waits on it for write-through chunks (write/through.py) and new captures.
        self._copier_wake = threading.Condition()

    # ------------------------------------------------------------------ training thread
    def capture(
        self,
        checkpoint: dict[str, Any],
        path: str,
        writer: StorageWriter,
        lazy: LazyPredicate | None,
        awaits_commit: bool = False,
    ) -> SnapshotStats:
        """Snapshot ``checkpoint`` for ``path`` and return once training may go on.

        Storages for which ``lazy`` answers True are copied in the background, or written straight from host memory
        (the caller guarantees a barrier, :meth:`wait_copies`, before they can change); all others are in host memory
        when this returns. With ``lazy=None`` everything is.

        Lazy chunks of host tensors bound for fast storage are written straight from the tensors by writer threads
        (write/through.py). Normally the copier copies the same job's chunks into the arena from the last one
        backwards meanwhile, so that little is left to copy when the barrier comes. With ``awaits_commit`` the caller
        changes nothing before this checkpoint is committed (no barrier comes first): then the copier leaves every
        such chunk to the writers, and the checkpoint is written without any copy. Such a save is never skipped by
        ``on_arena_full="skip"``.

        Raises:
            CheckpointCaptureError: the checkpoint cannot be pickled (nothing was written).
            OSError: the write could not be started (bad path, permissions).
        """
        started_at = time.perf_counter()
        layout, storages = self._plan(checkpoint)
        # Room for the padding of chunk planning too (pieces placed in phase for direct I/O, blocks rounded up to
        # pages), so that a checkpoint the size of the default arena fits in it whole and the copy never waits.
        arena = self._ensure_arena(layout.payload_bytes + (len(layout.records) + 1) * 2 * PAGE_ALIGNMENT_BYTES)
        skip_reason = self._admit(layout, arena, may_skip=lazy is not None and not awaits_commit)
        if skip_reason is not None:
            return self._skip(path, layout, started_at, skip_reason)
        chunk_bytes = max(4096, min(self.config.chunk_bytes, arena.size_bytes // 4))
        eager_keys = {
            r.key
            for r in layout.records
            if lazy is None or r.nbytes <= self.config.eager_copy_bytes or not lazy(storages[r.key])
        }
        devices = {s.device for s in storages if s.nbytes() > 0}
        # Writer threads checksum what they write and fill each record's CRC-32 (write/checksums.py).
        session = checksummed(writer.begin(path, layout.total_bytes), layout.checksums)
        # Direct I/O: pieces sit in their arena block as in the file, modulo the disk block, so that writes need no
        # bounce copy (capture/chunks.py); chunks are cut from the arena, which is page-aligned, so blocks of a disk
        # block.
        alignment = session.direct_alignment
        phase_bytes = alignment if alignment and alignment <= chunk_bytes else None
        try:
            job = SnapshotJob(
                path=path,
                layout=layout,
                session=session,
                sources=storages,
                eager_chunks=plan_chunks((r for r in layout.records if r.key in eager_keys), chunk_bytes, phase_bytes),
                lazy_chunks=[],  # planned below, with the sharing of earlier copies
                marks=self._copiers.marks(devices),
                stats=SnapshotStats(path, layout.total_bytes, layout.payload_bytes, started_at),
                outstanding=2,  # the copy, and the metadata write
                on_ready=self._schedule_commit,
            )
        except BaseException:
            session.abort()  # nothing was scheduled: leave no temporary file behind
            raise
        with self._lock:
            # Threads first (starting one can fail): nothing is registered yet, so a failure leaves no job
            # behind. Registering and queueing under the same lock means no thread retires in between.
            try:
                self._start_missing_threads()
            except BaseException:
                session.abort()
                raise
            self._deferred_removals.pop(path, None)  # saved again: the new file replaces the old one anyway
            self._skipped_since_last_capture = False
            predecessor = self._latest_by_path.get(path)
            if predecessor is not None and not predecessor.finished.is_set():
                # A newer save of the same path supersedes the pending one; it commits only after that one ended.
                predecessor.cancel_requested = True
                predecessor.successor = job
                job.outstanding += 1
            self._latest_by_path[path] = job
            if lazy is not None:
                lazy_records = [r for r in layout.records if r.key not in eager_keys]
                through = self.config.write_through and session.fast_writes
                if through:  # small chunks: a barrier waits for those being written (write/through.py)
                    chunk_bytes = min(chunk_bytes, WRITE_THROUGH_CHUNK_BYTES)
                job.lazy_chunks = self._plan_shared_lazy_copy(job, lazy_records, storages, chunk_bytes, phase_bytes)
                if through:
                    host_chunks = [c for c in job.lazy_chunks if _all_in_host_memory(c, storages)]
                    job.write_through = (
                        WriteThrough(host_chunks, self._copier_wake, copier_races=not awaits_commit)
                        if host_chunks
                        else None
                    )
            self._active.append(job)
            if self.resident is not None:
                self.resident.register(job, writer)
            self.history.append(job.stats)
            self._copy_queue.put(job)  # the copier queues the metadata write: one hand-over, nothing half-queued
        with self._copier_wake:
            self._copier_wake.notify_all()  # a copier waiting for write-through chunks copies this eager part now
        (job.eager_copied if lazy is not None else job.copied).wait()
        return job.stats

    def wait_copies(self, attribute: bool = True) -> float:
        """Barrier: return once no pending snapshot still reads training state; the seconds waited.

        With ``attribute`` the wait is added to the newest waited-for snapshot's ``barrier_wait_s``.
        """
        self._sharing.close_window()  # the caller mutates state next: later captures may not share earlier copies
        with self._lock:
            waiting = [job for job in self._active if not job.copied.is_set()]
        if not waiting:
            return 0.0
        for job in waiting:
            if job.write_through is not None:
                job.write_through.close()  # no more writes from the sources: the rest is copied into the arena
        started = time.perf_counter()
        for job in waiting:
            job.copied.wait()
        waited = time.perf_counter() - started
        if attribute:
            waiting[-1].stats.barrier_wait_s += waited  # the newest snapshot is the one training waited for
        return waited

    def is_pending(self, path: str) -> bool:
        """Whether a checkpoint for ``path`` is captured but not yet committed (or dropped)."""
        with self._lock:
            job = self._latest_by_path.get(path)
        return job is not None and not job.finished.is_set()

    def wait_path(self, path: str) -> None:
        """Wait until the pending checkpoint of ``path``, if any, is committed or dropped."""
        with self._lock:
            job = self._latest_by_path.get(path)
        if job is not None:
            job.finished.wait()

    def cancel_path(self, path: str) -> None:
        """Drop the pending checkpoint of ``path`` (or let it finish if it is already committing) and wait."""
        with self._lock:
            job = self._latest_by_path.get(path)
        if job is not None and not job.finished.is_set():
            job.cancel_requested = True
            job.finished.wait()

    def remove_after_pending(self, path: str, remove: Callable[[], None]) -> None:
        """Remove ``path`` (by calling ``remove``) once every checkpoint captured so far is committed.

        ModelCheckpoint removes the old top-k file right after saving the new one; deleting it before the new
        one is durable would leave no checkpoint if the new write failed or the process died. A pending write of
        ``path`` itself is cancelled first. If one of the awaited checkpoints fails (or one failed already and is
        not yet reported), the file is kept.
        """
        self.cancel_path(path)
        if self.resident is not None:
            self.resident.drop_path(path)  # at once, even if the file itself goes only later
        with self._lock:
            if self._failures:  # a newer checkpoint already failed (not yet reported): keep this one
                log.warning(
                    "lightning_datastates: keeping %s, which was to be removed: a newer write failed (raised as "
                    "CheckpointFlushError). Delete it by hand once a newer checkpoint is saved, if you do not need it.",
                    path,
                )
                return
            if self._skipped_since_last_capture:  # the checkpoint that was to replace it was skipped
                log.warning("lightning_datastates: keeping %s, which was to be removed: a newer save was skipped", path)
                return
            waiting = [job for job in self._active if not job.settled]
            if waiting:
                self._deferred_removals[path] = (waiting, remove)
                return
        remove()

    def is_removal_deferred(self, path: str) -> bool:
        """Whether ``path`` is removed already as far as the caller knows, but kept until earlier writes land."""
        with self._lock:
            return path in self._deferred_removals

    def drain(self) -> None:
        """Wait until every pending checkpoint is committed or dropped."""
        while True:
            with self._lock:
                active = list(self._active)
            if not active:
                return
            for job in active:
                job.finished.wait()

    def pop_failure(self, path: str | None = None) -> SnapshotJob | None:
        """The oldest failed, not yet reported checkpoint (of ``path`` if given); it counts as reported now."""
        with self._lock:
            for job in self._failures:
                if path is None or job.path == path:
                    self._failures.remove(job)
                    return job
        return None

    def warn_failures(self) -> int:
        """Log each failed, not yet reported checkpoint as a warning (``on_flush_error="warn"``); it counts as
        reported. Return how many were logged."""
        count = 0
        while (job := self.pop_failure()) is not None:
            log.warning(
                "lightning_datastates: writing checkpoint %s failed: %r; training goes on (on_flush_error='warn')",
                job.path,
                job.error,
            )
            count += 1
        return count

    def unreported_failures(self) -> list[SnapshotJob]:
        """Failed checkpoints not yet reported, oldest first (they stay unreported)."""
        with self._lock:
            return list(self._failures)

    def close(self) -> None:
        """Drain, then stop the threads. The engine starts them again if it is used later."""
        self.drain()
        with self._lock:
            self._closing = True
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()
        with self._lock:
            self._closing = False

    def open_resident(self, path: str) -> io.RawIOBase | None:
        """A reader over the committed checkpoint of ``path`` if it is still whole in the arena and the file on
        storage is unchanged since; None otherwise. Close it when done: until then its bytes stay in the arena."""
        return None if self.resident is None else self.resident.lease(path)

    def held_arena_bytes(self) -> int:
        """Arena bytes pending checkpoints (or loads reading retained ones) hold: retained checkpoints that an
        allocation may evict do not count."""
        if self.arena is None:
            return 0
        evictable = 0 if self.resident is None else self.resident.evictable_bytes()
        return max(0, self.arena.used_bytes - evictable)  # two readings: a block freed in between

    @property
    def sharing_counters(self) -> SharingCounters:
        """Bytes copied into the arena so far, and bytes written from another checkpoint's copy instead."""
        return self._sharing.counters

    # ------------------------------------------------------------------ capture helpers
    def _plan_shared_lazy_copy(
        self,
        job: SnapshotJob,
        lazy_records: list[StorageRecord],
        storages: list[torch.UntypedStorage],
        chunk_bytes: int,
        phase_bytes: int | None,
    ) -> list[Chunk]:
        """``job``'s lazy chunks: storages an earlier checkpoint of this barrier interval copies are followed
        instead (one host copy serves both files); the rest are planned, and offered to later checkpoints."""
        followed = self._sharing.follow(job, lazy_records, storages)
        job.lazy_chunks = plan_chunks((r for r in lazy_records if r.key not in followed), chunk_bytes, phase_bytes)
        self._sharing.offer(job, storages)
        return job.lazy_chunks

    def _plan(self, checkpoint: dict[str, Any]) -> tuple[CheckpointLayout, list[torch.UntypedStorage]]:
        """The out-of-order layout; failing that, the checkpoint serialized by a plain ``torch.save`` now."""
        try:
            return plan_layout(checkpoint, self.config.storage_alignment, self._verified_structures)
        except Exception as reason:  # noqa: BLE001 - LayoutUnsupported, skip_data refused, or an object that cannot be pickled
            buffer = io.BytesIO()
            try:
                with storage_alignment(self.config.storage_alignment):
                    torch.save(checkpoint, buffer)
            except Exception as exc:
                raise CheckpointCaptureError(
                    f"the checkpoint cannot be pickled: {exc!r}. Every value in the checkpoint dict "
                    "(hyperparameters, callback and datamodule state) must be picklable: remove or replace the "
                    "offending object (lambdas, open files, locks and generators are common culprits)."
                ) from exc
            if not self._warned_fallback:
                log.warning(
                    "lightning_datastates: cannot plan an out-of-order layout (%r); this checkpoint is serialized "
                    "with a plain torch.save into host memory during the save call instead (slower, still correct; "
                    "warned once). Tensors without plain storage (quantized, sparse) cause this: keep them out of the "
                    "checkpoint to save lazily.",
                    reason,
                )
                self._warned_fallback = True
            return plan_serialized_layout(buffer.getvalue()), []

    def _admit(self, layout: CheckpointLayout, arena: HostArena, may_skip: bool) -> str | None:
        """Bound the checkpoints in flight before a new one starts: None to go on, or why it is skipped.

        ``on_arena_full="wait"``: wait while too many checkpoints are in flight (the arena then makes the copy wait
        for space, back-pressure). ``"skip"``: skip this one instead of waiting, also when earlier checkpoints hold
        arena space this one needs; only saves inside the training loop (``may_skip``) are ever skipped, never a
        save the caller waits for.
        """
        limit = max(2, _PENDING_PER_WRITER * self.config.writer_threads)
        skip = may_skip and self.config.on_arena_full == "skip"
        while True:
            with self._lock:
                pending = [job for job in self._active if not job.finished.is_set()]
            if len(pending) < limit:
                break
            if skip:
                return f"{len(pending)} earlier checkpoints are still being written"
            pending[0].finished.wait()
        held = self.held_arena_bytes()  # retained checkpoints give their space up on demand
        if skip and held and arena.size_bytes - held < min(layout.payload_bytes, arena.size_bytes):
            return f"the host arena ({arena.size_bytes} bytes) holds {held} bytes of earlier checkpoints"
        return None

    def _skip(self, path: str, layout: CheckpointLayout, started_at: float, reason: str) -> SnapshotStats:
        """Record a checkpoint skipped by ``on_arena_full="skip"``: nothing is written, removals after it keep
        their file (the next capture ends that)."""
        stats = SnapshotStats(path, layout.total_bytes, layout.payload_bytes, started_at, state=JobState.SKIPPED.value)
        with self._lock:
            self.history.append(stats)
            self._skipped_since_last_capture = True
        log.warning(
            "lightning_datastates: skipped checkpoint %s (on_arena_full='skip'): %s; storage is slower than saves",
            path,
            reason,
        )
        return stats

    def _ensure_arena(self, payload_bytes: int) -> HostArena:
        if self.arena is None:
            size = self.config.arena_bytes_for(payload_bytes)
            # Pinned memory lets the CUDA copy engine write straight into the arena, asynchronously.
            self.arena = HostArena(size, pin_memory=torch.cuda.is_available())
            if self.config.serve_from_memory:
                self.resident = ResidentCache(self.arena)
            log.info("lightning_datastates: host arena of %.1f MiB allocated", self.arena.size_bytes / 2**20)
        return self.arena

    def _start_missing_threads(self) -> None:
        """Start the copier and writer threads that are not running (call with ``_lock`` held)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        names = {t.name for t in self._threads}
        wanted = {"datastates-copier": self._copy_loop}
        wanted.update({f"datastates-writer-{i}": self._write_loop for i in range(self.config.writer_threads)})
        for name, target in wanted.items():
            if name not in names:
                thread = threading.Thread(target=target, name=name, daemon=False)
                thread.start()
                self._threads.append(thread)

    def _retire_if_idle(self, own_queue: queue.Queue[Any], idle_since: float) -> bool:
        """Whether the calling thread should end: nothing pending and the engine closing, the interpreter
        exiting, or idle for a while. Decided and deregistered under the lock, so a capture that starts now
        sees the thread gone and starts a new one."""
        with self._lock:
            if self._active or not own_queue.empty():
                return False
            idle_too_long = time.monotonic() - idle_since > _IDLE_EXIT_S
            if not (self._closing or idle_too_long or not threading.main_thread().is_alive()):
                return False
            current = threading.current_thread()
            if current in self._threads:
                self._threads.remove(current)
            return True

    # ------------------------------------------------------------------ copier thread
    def _copy_loop(self) -> None:
        lower_thread_priority()
        idle_since = time.monotonic()
        while True:
            if self._eager_done:
                job = self._eager_done.popleft()
            else:
                try:
                    job = self._copy_queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if self._retire_if_idle(self._copy_queue, idle_since):
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
                    self._write_queue.put(("through", job, chunk))
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
        """Copier thread: wait until ``ready()`` (checked with the wake condition held), copying the eager part of
        new captures meanwhile (their save calls wait for it)."""
        while True:
            self._copy_newer_eager()
            with self._copier_wake:
                if ready():
                    return
                if self._copy_queue.empty():
                    self._copier_wake.wait(_POLL_S)  # woken by writers, barriers and captures

    def _copy_eager(self, job: SnapshotJob) -> bool:
        """Queue ``job``'s metadata write and copy its eager chunks; False (and the copy finished) on failure."""
        self._write_queue.put(("metadata", job))
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
                job = self._copy_queue.get_nowait()
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
        if not self._sharing.must_copy(job, chunk):
            return  # failed or superseded, and no other checkpoint follows it: the bytes would never be committed
        assert self.arena is not None and job.sources is not None
        block = self.arena.allocate(chunk.block_bytes)  # back-pressure: waits for writers to free space
        try:
            # The CRC-32s where the copier computed them on the way (host sources).
            crcs = self._copiers.copy_chunk(self.arena.tensor(block), chunk.pieces, job.sources, job.marks)
        except BaseException:
            self.arena.free(block)
            raise
        self._sharing.count_copied(sum(piece.nbytes for piece in chunk.pieces))
        job.add_outstanding()
        self._sharing.mark_queued(chunk)  # from here on a writer serves the chunk's followers
        self._write_queue.put(("chunk", job, chunk, block, crcs))

    # ------------------------------------------------------------------ writer threads
    def _write_loop(self) -> None:
        lower_thread_priority()
        idle_since = time.monotonic()
        while True:
            try:
                task = self._write_queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._retire_if_idle(self._write_queue, idle_since):
                    return
                continue
            idle_since = time.monotonic()
            kind, job = task[0], task[1]
            if kind == "commit":
                self._commit(job)
                continue
            try:
                if kind == "through":
                    self._write_through(job, task[2])  # also when the job stopped: it may have followers
                elif not job.stopped:
                    if kind == "metadata":
                        for offset, data in job.layout.metadata:
                            job.session.write_range(offset, memoryview(data))
                            job.add_written(len(data))
                    else:
                        self._write_chunk(job, task[2], self._block_bytes(task[3]), task[4])
            except BaseException as exc:  # noqa: BLE001 - reported on the training thread, never lost
                job.fail(exc)
            finally:
                if kind == "chunk":
                    followers = self._write_followers(task[2], self._block_bytes(task[3]), task[4])
                    self._retire_block(job, task[2], task[3], followers)
                job.release()

    def _block_bytes(self, block: Any) -> Callable[[int, int], memoryview]:
        """``bytes_at(offset, nbytes)`` over an arena block."""
        assert self.arena is not None
        return _slicer(self.arena.memoryview(block))

    def _write_chunk(
        self,
        job: SnapshotJob,
        chunk: Chunk,
        bytes_at: Callable[[int, int], memoryview],
        crcs: PieceCrcs | None = None,
    ) -> None:
        """Write ``chunk``'s pieces into ``job``'s file, each from ``bytes_at(block_offset, nbytes)`` (its arena
        block, or the training tensors themselves), with the CRC-32 the copier computed where it did (``crcs``, by
        block offset)."""
        for piece in chunk.pieces:
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

    def _write_followers(
        self, chunk: Chunk, bytes_at: Callable[[int, int], memoryview], crcs: PieceCrcs | None = None
    ) -> list[tuple[SnapshotJob, list[FollowerWrite]]]:
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

    def _retire_block(
        self, job: SnapshotJob, chunk: Chunk, block: Any, followers: list[tuple[SnapshotJob, list[FollowerWrite]]]
    ) -> None:
        """``block`` is written: free it, or keep it for the checkpoints written from it (every job that did not
        stop holds the ranges it wrote), then release the followers. Retained before the release, so a follower's
        commit (on another writer thread) finds the block in its image."""
        assert self.arena is not None
        try:
            if self.resident is None:
                self.arena.free(block)
            else:
                holders = [(job, [(p.block_offset, p.file_offset, p.nbytes) for p in chunk.pieces])]
                holders += [(f, [(w.block_offset, w.file_offset, w.nbytes) for w in writes]) for f, writes in followers]
                self.resident.retain(block, [(holder, ranges) for holder, ranges in holders if not holder.stopped])
        finally:
            for follower, _ in followers:
                follower.release()

    def _schedule_commit(self, job: SnapshotJob) -> None:
        self._write_queue.put(("commit", job))

    def _commit(self, job: SnapshotJob) -> None:
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
        if self.resident is not None:
            self.resident.settle(job)  # publish the image (or drop it) before anyone can see the job finished
        job.stats.state = job.state.value
        job.stats.durable_s = time.perf_counter() - job.stats.started_at
        if job.error is not None:
            log.debug("lightning_datastates: writing %s failed", job.path, exc_info=job.error)
        for path, remove in self._settle_removals(job):
            try:
                remove()
            except Exception:
                log.exception("lightning_datastates: could not remove %s (a top-k removal); delete it by hand", path)
        with self._lock:
            if job.error is not None:
                self._failures.append(job)
            self._active.remove(job)
            if self._latest_by_path.get(job.path) is job:
                del self._latest_by_path[job.path]
            successor = job.successor
            job.finished.set()
        if successor is not None:
            successor.release()  # the next save of this path may commit now

    def _settle_removals(self, job: SnapshotJob) -> list[tuple[str, Callable[[], None]]]:
        """Mark ``job`` settled; return the deferred removals it was the last to hold back.

        A failed job drops the removals waiting for it: the file to remove may be the last good checkpoint.
        """
        due = []
        with self._lock:
            job.settled = True
            for path, (waiting, remove) in list(self._deferred_removals.items()):
                if job not in waiting:
                    continue
                if job.state is JobState.FAILED:
                    del self._deferred_removals[path]
                    log.warning(
                        "lightning_datastates: keeping %s, which was to be removed, because writing %s failed",
                        path,
                        job.path,
                    )
                    continue
                waiting.remove(job)
                if not waiting:
                    del self._deferred_removals[path]
                    due.append((path, remove))
        return due


def lower_thread_priority() -> int:
    """Raise the calling thread's nice value by ``$LIGHTNING_DATASTATES_THREAD_NICE`` (see :data:`THREAD_NICE_ENV`);
    return the increment applied (0: unset, invalid, or not supported here)."""
    text = os.environ.get(THREAD_NICE_ENV, "").strip()
    if not text:
        return 0
    try:
        increment = int(text)
        if not 0 <= increment <= 19:
            raise ValueError(text)
    except ValueError:
        log.warning("lightning_datastates: ignoring %s=%r: expected an integer from 0 to 19", THREAD_NICE_ENV, text)
        return 0
    if increment == 0 or not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return 0
    try:
        tid = threading.get_native_id()
        # On Linux a thread id names one thread: only this thread's priority changes, not the process's.
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError as exc:
        log.warning("lightning_datastates: cannot lower the priority of %s: %s", threading.current_thread().name, exc)
        return 0
    return increment


def _write_piece(
    session: WriteSession, file_offset: int, data: memoryview, crcs: PieceCrcs | None, block_offset: int
) -> None:
    """Write one piece at ``file_offset``, handing over its CRC-32 when the copier computed it for these bytes."""
    known = None if crcs is None else crcs.get(block_offset)
    if known is None or known[0] != data.nbytes:
        session.write_range(file_offset, data)
    else:
        session.write_checksummed_range(file_offset, data, known[1])


def _slicer(view: memoryview) -> Callable[[int, int], memoryview]:
    """``bytes_at(offset, nbytes)`` over ``view``."""
    return lambda offset, nbytes: view[offset : offset + nbytes]


def _all_in_host_memory(chunk: Chunk, storages: list[torch.UntypedStorage]) -> bool:
    return all(storages[piece.key].device.type == "cpu" for piece in chunk.pieces)


def _host_bytes(storage: torch.UntypedStorage, offset: int, nbytes: int) -> memoryview:
    """A memoryview of ``nbytes`` bytes of the host ``storage`` from ``offset`` (no copy; valid while it lives)."""
    return address_view(storage.data_ptr() + offset, nbytes)
