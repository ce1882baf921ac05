"""The snapshot engine: capture on the training thread, copy on a copier thread, flush on writer threads.

``capture`` (training thread) plans the file layout (the non-tensor skeleton is pickled there and then), opens
a write session, copies the storages that may change before the next barrier (or are tiny) and returns; the
copier thread moves every other storage into the host arena, chunk by chunk, while training goes on; writer
threads write each chunk at its offset, free its block, and commit the file when the last byte is written.

Threads are ordinary (non-daemon) threads: at interpreter exit they finish every pending checkpoint and then
end by themselves, so a script that returns right after ``fit`` still leaves complete files.

No Lightning and no file formats here: the layout comes from :mod:`~lightning_datastates.layout`, the bytes go
to a :class:`~lightning_datastates.storage.base.StorageWriter`.
"""

from __future__ import annotations

import io
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from lightning_datastates.checksums import checksummed
from lightning_datastates.config import DataStatesConfig
from lightning_datastates.errors import CheckpointCaptureError
from lightning_datastates.layout import CheckpointLayout, plan_layout, plan_serialized_layout
from lightning_datastates.snapshot.arena import HostArena
from lightning_datastates.snapshot.chunks import Chunk, plan_chunks
from lightning_datastates.snapshot.copier import CopierSet
from lightning_datastates.snapshot.job import JobState, SnapshotJob, SnapshotStats
from lightning_datastates.storage.base import StorageWriter

log = logging.getLogger("lightning_datastates")

#: How often idle threads look whether they should end (engine closed, or interpreter exiting).
_POLL_S = 0.1
#: Idle threads end after this long without work (they are started again by the next capture).
_IDLE_EXIT_S = 10.0
#: Stats of this many recent checkpoints are kept.
_HISTORY_LENGTH = 1000

LazyPredicate = Callable[[torch.UntypedStorage], bool]


class SnapshotEngine:
    """Owns the host arena, the copier and writer threads, and every pending checkpoint.

    Thread model: ``capture``, ``wait_copies``, ``wait_path``, ``cancel_path``, ``drain``, ``pop_failure`` and
    ``close`` are called from the training thread; everything else runs on the engine's own threads.
    """

    def __init__(self, config: DataStatesConfig) -> None:
        self.config = config
        self.arena: HostArena | None = None
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

    # ------------------------------------------------------------------ training thread
    def capture(
        self, checkpoint: dict[str, Any], path: str, writer: StorageWriter, lazy: LazyPredicate | None
    ) -> SnapshotStats:
        """Snapshot ``checkpoint`` for ``path`` and return once training may go on.

        Storages for which ``lazy`` answers True are copied in the background (the caller guarantees a barrier,
        :meth:`wait_copies`, before they can change); all others are in host memory when this returns. With
        ``lazy=None`` everything is.

        Raises:
            CheckpointCaptureError: the checkpoint cannot be pickled (nothing was written).
            OSError: the write could not be started (bad path, permissions).
        """
        started_at = time.perf_counter()
        layout, storages = self._plan(checkpoint)
        # One snapshot copies at a time (the arena is not split between them). The wait is part of this save
        # call's time, so it is not also counted as a barrier wait of the earlier snapshot.
        self.wait_copies(attribute=False)
        arena = self._ensure_arena(layout.payload_bytes)
        chunk_bytes = max(4096, min(self.config.chunk_bytes, arena.size_bytes // 4))
        eager_keys = {
            r.key
            for r in layout.records
            if lazy is None or r.nbytes <= self.config.eager_copy_bytes or not lazy(storages[r.key])
        }
        devices = {s.device for s in storages if s.nbytes() > 0}
        # Writer threads checksum what they write and fill each record's CRC-32 (checksums.py).
        session = checksummed(writer.begin(path, layout.total_bytes), layout.checksums)
        try:
            job = SnapshotJob(
                path=path,
                layout=layout,
                session=session,
                sources=storages,
                eager_chunks=plan_chunks((r for r in layout.records if r.key in eager_keys), chunk_bytes),
                lazy_chunks=plan_chunks((r for r in layout.records if r.key not in eager_keys), chunk_bytes),
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
            predecessor = self._latest_by_path.get(path)
            if predecessor is not None and not predecessor.finished.is_set():
                # A newer save of the same path supersedes the pending one; it commits only after that one ended.
                predecessor.cancel_requested = True
                predecessor.successor = job
                job.outstanding += 1
            self._latest_by_path[path] = job
            self._active.append(job)
            self.history.append(job.stats)
            self._copy_queue.put(job)  # the copier queues the metadata write: one hand-over, nothing half-queued
        (job.eager_copied if lazy is not None else job.copied).wait()
        return job.stats

    def wait_copies(self, attribute: bool = True) -> float:
        """Barrier: return once no pending snapshot still reads training state; the seconds waited.

        With ``attribute`` the wait is added to the newest waited-for snapshot's ``barrier_wait_s``.
        """
        with self._lock:
            waiting = [job for job in self._active if not job.copied.is_set()]
        if not waiting:
            return 0.0
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
        with self._lock:
            if self._failures:  # a newer checkpoint already failed (not yet reported): keep this one
                log.warning("lightning_datastates: keeping %s, which was to be removed: a newer write failed", path)
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

    # ------------------------------------------------------------------ capture helpers
    def _plan(self, checkpoint: dict[str, Any]) -> tuple[CheckpointLayout, list[torch.UntypedStorage]]:
        """The out-of-order layout; failing that, the checkpoint serialized by a plain ``torch.save`` now."""
        try:
            return plan_layout(checkpoint)
        except Exception as reason:  # LayoutUnsupported, skip_data refused, or an object that cannot be pickled
            buffer = io.BytesIO()
            try:
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
                    "with a plain torch.save into host memory during the save call instead (slower, still correct).",
                    reason,
                )
                self._warned_fallback = True
            return plan_serialized_layout(buffer.getvalue()), []

    def _ensure_arena(self, payload_bytes: int) -> HostArena:
        if self.arena is None:
            size = self.config.arena_bytes_for(payload_bytes)
            # Pinned memory lets the CUDA copy engine write straight into the arena, asynchronously.
            self.arena = HostArena(size, pin_memory=torch.cuda.is_available())
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
        idle_since = time.monotonic()
        while True:
            try:
                job = self._copy_queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._retire_if_idle(self._copy_queue, idle_since):
                    return
                continue
            self._copy_job(job)
            idle_since = time.monotonic()

    def _copy_job(self, job: SnapshotJob) -> None:
        self._write_queue.put(("metadata", job))
        try:
            for chunk in job.eager_chunks:
                self._copy_chunk(job, chunk)
            job.eager_copied.set()
            for chunk in job.lazy_chunks:
                self._copy_chunk(job, chunk)
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread, never lost
            job.fail(exc)
        finally:
            job.mark_copied()
            job.release()  # the copy's share of the outstanding work

    def _copy_chunk(self, job: SnapshotJob, chunk: Chunk) -> None:
        if job.stopped:
            return  # failed or superseded: the bytes would never be committed
        assert self.arena is not None and job.sources is not None
        block = self.arena.allocate(chunk.block_bytes)  # back-pressure: waits for writers to free space
        try:
            destination = self.arena.tensor(block)
            for piece in chunk.pieces:
                storage = job.sources[piece.key]
                source = _byte_view(storage)[piece.source_offset : piece.source_offset + piece.nbytes]
                target = destination[piece.block_offset : piece.block_offset + piece.nbytes]
                self._copiers.for_device(storage.device).copy(target, source, job.marks.get(storage.device))
        except BaseException:
            self.arena.free(block)
            raise
        job.add_outstanding()
        self._write_queue.put(("chunk", job, chunk, block))

    # ------------------------------------------------------------------ writer threads
    def _write_loop(self) -> None:
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
                if not job.stopped:
                    if kind == "metadata":
                        for offset, data in job.layout.metadata:
                            job.session.write_range(offset, memoryview(data))
                    else:
                        self._write_chunk(job, task[2], task[3])
            except BaseException as exc:  # noqa: BLE001 - reported on the training thread, never lost
                job.fail(exc)
            finally:
                if kind == "chunk":
                    assert self.arena is not None
                    self.arena.free(task[3])
                job.release()

    def _write_chunk(self, job: SnapshotJob, chunk: Chunk, block: Any) -> None:
        assert self.arena is not None
        view = self.arena.memoryview(block)
        for piece in chunk.pieces:
            job.session.write_range(piece.file_offset, view[piece.block_offset : piece.block_offset + piece.nbytes])

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
            except Exception:  # noqa: BLE001 - the primary failure (or the cancel) is what matters
                log.exception("lightning_datastates: could not remove the temporary file of %s", job.path)
            job.state = JobState.FAILED if job.error is not None else JobState.CANCELLED
        job.stats.state = job.state.value
        job.stats.durable_s = time.perf_counter() - job.stats.started_at
        if job.error is not None:
            log.debug("lightning_datastates: writing %s failed", job.path, exc_info=job.error)
        for path, remove in self._settle_removals(job):
            try:
                remove()
            except Exception:  # noqa: BLE001 - a file left behind is logged; it costs no checkpoint
                log.exception("lightning_datastates: could not remove %s", path)
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


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat ``uint8`` tensor over all of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
