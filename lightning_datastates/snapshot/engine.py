"""The snapshot engine: capture on the training thread, copy on a copier thread, write and commit on writer threads.

The steps of a checkpoint, and where each lives:

1. **capture** (training thread, :meth:`SnapshotEngine.capture`): plan the file layout
   (:mod:`~lightning_datastates.capture.planning` over :mod:`~lightning_datastates.capture.layout`; the non-tensor
   skeleton is pickled there and then), admit the checkpoint into the host arena
   (:mod:`~lightning_datastates.capture.admission`), open a write session, cut the storages into chunks
   (:mod:`~lightning_datastates.records.chunks`), sharing earlier copies of the same state
   (:mod:`~lightning_datastates.copy.sharing`), register the checkpoint (:mod:`~lightning_datastates.snapshot.pending`)
   and hand it to the copier. It returns once the storages that may change before the next barrier (and small host
   storages) are in host memory (:func:`~lightning_datastates.capture.planning.eager_record_keys`).
2. **copy** (copier thread, :mod:`~lightning_datastates.copy.loop`): every other storage into the host arena, chunk by
   chunk, while training goes on; lazy chunks of host tensors may instead be written straight from them
   (:mod:`~lightning_datastates.records.through`). A barrier (:meth:`SnapshotEngine.wait_copies`) waits for this step.
3. **write** (writer threads, :mod:`~lightning_datastates.write.loop`): each chunk at its offsets, then its block is
   freed (or, with ``serve_from_memory``, handed to the resident cache, :mod:`~lightning_datastates.load.resident`).
4. **commit** (writer threads): once the last byte is written the file is committed, and the checkpoint finished
   (:mod:`~lightning_datastates.snapshot.pending`: deferred removals, failures to report, waiters).

Threads (:mod:`~lightning_datastates.snapshot.threads`) are ordinary (non-daemon) threads: at interpreter exit they
finish every pending checkpoint and then end by themselves, so a script that returns right after ``fit`` still leaves
complete files. :meth:`SnapshotEngine.abandon` (a second Ctrl-C while the writes drain) cancels every pending
checkpoint instead: the threads abort them after the storage call each is in, and end as after a drain.

No Lightning and no file formats here: the layout comes from :mod:`~lightning_datastates.capture.layout`, the bytes
go to a :class:`~lightning_datastates.storage.base.StorageWriter`.
"""

from __future__ import annotations

import io
import logging
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_datastates.capture.admission import (
    PreparedArena,
    admit,
    arena_request_bytes,
    open_arena,
    prepare_arena,
    skipped_stats,
)
from lightning_datastates.capture.planning import LayoutPlanner, eager_record_keys, plan_lazy_copy
from lightning_datastates.config import DataStatesConfig
from lightning_datastates.copy.arena import HostArena
from lightning_datastates.copy.copier import CopierSet
from lightning_datastates.copy.loop import CopyLoop
from lightning_datastates.copy.pinning import cuda_device_of
from lightning_datastates.copy.sharing import SharedCopies, SharingCounters
from lightning_datastates.load.resident import ResidentCache
from lightning_datastates.records.checksums import checksummed
from lightning_datastates.records.chunks import plan_chunks
from lightning_datastates.records.job import JobState, SnapshotJob, SnapshotStats
from lightning_datastates.records.layout import CheckpointLayout
from lightning_datastates.records.stamp import SaveStamp
from lightning_datastates.records.tasks import WAKE, WriteQueue
from lightning_datastates.snapshot.backpressure import BackPressureWarning, describe_back_pressure
from lightning_datastates.snapshot.pending import PendingCheckpoints
from lightning_datastates.snapshot.threads import EngineThreads
from lightning_datastates.storage.base import StorageWriter
from lightning_datastates.write.loop import WriteLoop

log = logging.getLogger("lightning_datastates")

#: Stats of this many recent checkpoints are kept.
_HISTORY_LENGTH = 1000
#: Back-pressure shorter than this is not worth a warning (it still counts in ``blocked_s``).
_BACK_PRESSURE_REPORTED_S = 0.01

#: :meth:`SnapshotEngine.abandon` waits at most this long for the storage calls in progress (a range being written, a
#: session being aborted) before it returns; a call that takes longer (an unreachable store) ends by itself.
ABANDON_WAIT_S = 10.0

#: Which storages the caller lets the engine copy lazily (after the save call returned, before the next barrier).
LazyPredicate = Callable[[torch.UntypedStorage], bool]


@dataclass(frozen=True)
class _DataPath:
    """What the first capture sets up, sized by its checkpoint: the arena, and the loops of the threads over it."""

    arena: HostArena
    resident: ResidentCache | None
    copier: CopyLoop
    writers: WriteLoop


@dataclass(frozen=True)
class Abandoned:
    """What :meth:`SnapshotEngine.abandon` gave up: the ``paths`` of the pending saves (files and sharded
    directories, oldest first; not the files whose commit had begun, which landed whole), and those of the files still
    in a storage call when it returned (``unfinished``: their temporary file or upload goes once that call returns,
    or, if the process ends first, with ``clean`` or the next run's cleanup, which remove what dead writers left)."""

    paths: list[str]
    unfinished: list[str]


class SnapshotEngine:
    """Owns the host arena, the copier and writer threads, and every pending checkpoint.

    Thread model: every public method is called from the training thread; the steps after capture run on the engine's
    own threads (see the module docstring).
    """

    def __init__(self, config: DataStatesConfig) -> None:
        self.config = config
        self.history: deque[SnapshotStats] = deque(maxlen=_HISTORY_LENGTH)
        self._pending = PendingCheckpoints()
        self._threads = EngineThreads(self._pending.lock, self._pending.busy_locked)
        self._copiers = CopierSet()
        self._sharing = SharedCopies()  # lazy copies open to later checkpoints of the same state
        self._write_queue: WriteQueue = queue.Queue()
        # The copier thread waits on it for write-through chunks (records/through.py) and new captures.
        self._copier_wake = threading.Condition()
        self._data_path: _DataPath | None = None  # set up by the first capture
        self._prepared: PreparedArena | None = None  # an arena made before the first capture, for it
        self._layouts = LayoutPlanner(config.storage_alignment)
        self._warned_back_pressure = False
        self._warned_pageable = False

    @property
    def arena(self) -> HostArena | None:
        """The host arena (None until :meth:`prepare_arena` or the first capture)."""
        if self._data_path is None:
            return None if self._prepared is None else self._prepared.arena
        return self._data_path.arena

    @property
    def resident(self) -> ResidentCache | None:
        """With ``serve_from_memory``, the cache of committed checkpoints still in the arena (set up with it)."""
        return None if self._data_path is None else self._data_path.resident

    # ------------------------------------------------------------------ capture
    def prepare_arena(self, request_bytes: int, serve_loads: bool = True, cuda_device: int | None = None) -> None:
        """Make the host arena now, for checkpoints asking about ``request_bytes``, so that its page-locking (for
        copies from ``cuda_device``; None: state on the CPU, no page-locking) is done, on a thread of its own, before
        the first capture; the first capture takes it, or replaces it if it asks for more (capture/admission.py).
        Once: nothing to do after the first call or capture. ``serve_loads``: whether the captures will keep their
        files in the arena for loading (as :meth:`capture_planned`'s)."""
        if self._data_path is None and self._prepared is None:
            self._prepared = prepare_arena(self.config, request_bytes, serve_loads, cuda_device)

    def prepare_planning(self, sample: Any) -> None:
        """Compare the layout planner's fast path with ``torch.save`` on ``sample`` (the training state) now, so that
        the first capture does not (:meth:`~lightning_datastates.capture.planning.LayoutPlanner.confirm_fast_path`).
        Training thread."""
        self._layouts.confirm_fast_path(sample)

    def capture(
        self,
        checkpoint: dict[str, Any],
        path: str,
        writer: StorageWriter,
        lazy: LazyPredicate | None,
        awaits_commit: bool = False,
        on_settled: Callable[[SnapshotJob], None] | None = None,
        persistent_path: str | None = None,
        stamp: SaveStamp | None = None,
    ) -> SnapshotStats:
        """Snapshot ``checkpoint`` for ``path`` and return once training may go on.

        Storages for which ``lazy`` answers True are copied in the background, or written straight from host memory
        (the caller guarantees a barrier, :meth:`wait_copies`, before they can change); all others are in host memory
        when this returns. With ``lazy=None`` everything is.

        Lazy chunks of host tensors bound for fast storage are written straight from the tensors by writer threads
        (records/through.py). Normally the copier copies the same job's chunks into the arena from the last one
        backwards meanwhile, so that little is left to copy when the barrier comes. With ``awaits_commit`` the caller
        changes nothing before this checkpoint is committed (no barrier comes first): then the copier leaves every
        such chunk to the writers, and the checkpoint is written without any copy. Such a save is never skipped by
        ``on_arena_full="skip"``. ``on_settled`` becomes the job's hook (see :class:`SnapshotJob`): called on a writer
        thread once the file is committed or aborted; never for a skipped save. ``persistent_path``: ``path`` is the
        local copy of that checkpoint, replicated there after its commit (the stats say so from the start).
        ``stamp``: the save's stamp, written into the file (:meth:`CheckpointLayout.stamped
        <lightning_datastates.records.layout.CheckpointLayout.stamped>`) and kept in its stats.

        Raises:
            CheckpointCaptureError: the checkpoint cannot be pickled (nothing was written).
            OSError: the write could not be started (bad path, permissions).
        """
        started_at = time.perf_counter()
        layout, storages = self._layouts.plan(checkpoint)
        return self.capture_planned(
            layout,
            storages,
            path,
            writer,
            lazy,
            awaits_commit,
            started_at,
            on_settled=on_settled,
            persistent_path=persistent_path,
            stamp=stamp,
        )

    def capture_planned(
        self,
        layout: CheckpointLayout,
        storages: list[torch.UntypedStorage],
        path: str,
        writer: StorageWriter,
        lazy: LazyPredicate | None,
        awaits_commit: bool = False,
        started_at: float | None = None,
        serve_loads: bool = True,
        on_settled: Callable[[SnapshotJob], None] | None = None,
        persistent_path: str | None = None,
        stamp: SaveStamp | None = None,
        whole_checkpoint: bool = True,
    ) -> SnapshotStats:
        """:meth:`capture` of a file whose layout the caller planned: ``layout``, and ``storages`` indexed by its
        record keys (the shard files of a distributed checkpoint, :mod:`~lightning_datastates.sharded`: not a
        ``whole_checkpoint``, which removals wait for as the saves after a file, see :class:`SnapshotJob`).
        ``started_at`` is when the save call began (now if None). Without ``serve_loads`` the file's arena blocks go
        back to the arena once written, even with ``serve_from_memory``: for a file no load of this plugin reads.
        Same contract and errors as :meth:`capture`."""
        started_at = time.perf_counter() if started_at is None else started_at
        if stamp is not None:
            layout = layout.stamped(stamp)
        devices = {s.device for s in storages if s.nbytes() > 0}
        data_path = self._open_data_path(arena_request_bytes(layout), serve_loads, cuda_device_of(devices))
        may_skip = lazy is not None and not awaits_commit
        in_flight, held_bytes = self._pending.in_flight, self.held_arena_bytes
        admission = admit(layout, data_path.arena, self.config, may_skip, in_flight, held_bytes)
        if admission.waited_s and not awaits_commit:  # a save inside the training loop waited for storage
            self._warn_back_pressure(admission.waited_s)
        if admission.skip_reason is not None:
            stats = skipped_stats(path, layout, started_at, admission.skip_reason)
            self.history.append(stats)
            self._pending.note_skipped(path)
            return stats
        chunk_bytes = max(4096, min(self.config.chunk_size, data_path.arena.size_bytes // 4))
        eager_keys = eager_record_keys(layout.records, storages, lazy, self.config.eager_copy_size)
        # Writer threads checksum what they write and fill each record's CRC-32 (records/checksums.py).
        session = checksummed(writer.begin(path, layout.total_bytes), layout.checksums)
        # Direct I/O: pieces sit in their arena block as in the file, modulo the disk block, so that writes need no
        # bounce copy (records/chunks.py); chunks are cut from the arena, which is page-aligned, so blocks of a disk
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
                marks=self._copiers.marks(devices),
                stats=SnapshotStats(
                    path,
                    layout.total_bytes,
                    layout.payload_bytes,
                    started_at,
                    persistent_path=persistent_path,
                    replication=None if persistent_path is None else "pending",
                    stamp=stamp,
                ),
                outstanding=2,  # the copy, and the metadata write
                on_ready=data_path.writers.schedule_commit,
                on_settled=on_settled,
                whole_checkpoint=whole_checkpoint and persistent_path is None,
            )
        except BaseException:
            session.abort()  # nothing was scheduled: leave no temporary file behind
            raise
        with self._pending.lock:
            # Threads first (starting one can fail): nothing is registered yet, so a failure leaves no job
            # behind. Registering and queueing under the same lock means no thread retires in between.
            try:
                self._threads.start_missing(data_path.copier.run, data_path.writers.run, self.config.writer_threads)
            except BaseException:
                session.abort()
                raise
            self._pending.register_locked(job)
            if lazy is not None:
                lazy_records = [r for r in layout.records if r.key not in eager_keys]
                through = self.config.write_through and session.fast_writes
                wake = self._copier_wake
                plan_lazy_copy(
                    job, lazy_records, storages, self._sharing, chunk_bytes, phase_bytes, through, wake, awaits_commit
                )
            if data_path.resident is not None and serve_loads:
                data_path.resident.register(job, writer)
            self.history.append(job.stats)
            data_path.copier.submit(job)
        data_path.copier.wake()  # a copier waiting for write-through chunks copies this eager part now
        (job.eager_copied if lazy is not None else job.copied).wait()
        if job.stats.arena_wait_s and not awaits_commit:  # the copy this call waited for waited for a flush
            self._warn_back_pressure(job.stats.arena_wait_s)
        return job.stats

    def _open_data_path(self, request_bytes: int, serve_loads: bool, cuda_device: int | None) -> _DataPath:
        """The arena and the loops over it; the first call sets them up, sized for ``request_bytes`` (``serve_loads``:
        whether the first capture keeps its file in the arena for loading; ``cuda_device``: where its copies come
        from, None for the CPU)."""
        if self._data_path is None:
            arena, resident = open_arena(self.config, request_bytes, self._prepared, serve_loads, cuda_device)
            self._prepared = None
            retire = self._threads.retire_if_idle
            writers = WriteLoop(self._write_queue, arena, resident, self._sharing, self._pending.finish, retire)
            copier = CopyLoop(arena, self._copiers, self._sharing, self._write_queue, self._copier_wake, retire)
            self._data_path = _DataPath(arena, resident, copier, writers)
        elif cuda_device is not None and not self._data_path.arena.page_locking and not self._warned_pageable:
            # The arena outlives a fit: one made for state on the CPU cannot be page-locked later (its memory is not a
            # mapping kept out of forked children), so copies from a GPU go through pageable memory, said once.
            self._warned_pageable = True
            log.warning(
                "lightning_datastates: checkpoints copied from GPU %d go through pageable host memory (correct, "
                "slower): the host arena is not page-locked (it was made for state on the CPU, by an earlier fit of "
                "this plugin or a first checkpoint without GPU tensors, or page-locking was refused). A new "
                "DataStatesIO for this fit gets a page-locked arena.",
                cuda_device,
            )
        return self._data_path

    # ------------------------------------------------------------------ barrier
    def wait_copies(self, attribute: bool = True) -> float:
        """Barrier: return once no pending snapshot still reads training state; the seconds waited.

        With ``attribute`` the wait is added to the newest waited-for snapshot's ``barrier_wait_s``.
        """
        self._sharing.close_window()  # the caller mutates state next: later captures may not share earlier copies
        waiting = self._pending.copying()
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
            if any(job.stats.arena_wait_s for job in waiting):
                self._warn_back_pressure(waited)  # a copy training waited for had waited for a flush
        return waited

    def _warn_back_pressure(self, waited_s: float) -> None:
        """Training thread: training waited ``waited_s`` for storage; say so once (snapshot/backpressure.py), unless
        the wait is too short to matter."""
        if self._warned_back_pressure or self.arena is None or waited_s < _BACK_PRESSURE_REPORTED_S:
            return
        self._warned_back_pressure = True
        message = describe_back_pressure(waited_s, list(self.history)[-8:], self.arena.size_bytes)
        warnings.warn(message, BackPressureWarning, stacklevel=2)

    # ------------------------------------------------------------------ pending checkpoints
    @property
    def pending(self) -> PendingCheckpoints:
        """The registry of pending work: this engine's files, and the sharded commits that register there too."""
        return self._pending

    def wait_path(self, path: str) -> None:
        """Wait until the pending checkpoint of ``path``, if any, is committed or dropped."""
        self._pending.wait_path(path)

    def remove_after_pending(self, path: str, remove: Callable[[], None], also: tuple[str, ...] = ()) -> None:
        """Remove ``path`` (by calling ``remove``) once every checkpoint captured so far is committed, and then the
        pending write of ``path`` (and of the paths in ``also``: its local copy) cancelled and ended.

        ModelCheckpoint removes the old top-k file right after saving the new one; deleting it before the new
        one is durable would leave no checkpoint if the new write failed or the process died, and so would cancelling
        its own pending write before then. If one of the awaited checkpoints fails (or one failed already and is not
        yet reported), the file is kept (see :meth:`PendingCheckpoints.defer_removal
        <lightning_datastates.snapshot.pending.PendingCheckpoints.defer_removal>`).
        """
        paths = (path, *also)

        def drop_images_then_remove() -> None:
            if self.resident is not None:
                for name in paths:
                    self.resident.drop_path(name)  # a load after the removal must not find the file in memory
            remove()

        self._pending.defer_removal(path, drop_images_then_remove, also)

    def drain(self) -> None:
        """Wait until every pending checkpoint is committed or dropped."""
        self._pending.drain()

    def abandon(self, wait_s: float = ABANDON_WAIT_S) -> Abandoned:
        """Training thread: give up every pending checkpoint now (the user asked to, with a second Ctrl-C while they
        drained) and wait, at most ``wait_s``, until the engine's threads aborted them.

        Checkpoints committed earlier stay whole. Each pending file is cancelled
        (:meth:`PendingCheckpoints.abandon <lightning_datastates.snapshot.pending.PendingCheckpoints.abandon>`, which
        also drops the removals held back for them): the copier copies nothing more of it, writers skip its tasks and
        stop between the pieces of a chunk, and the writer that takes its commit aborts the session (temporary file
        removed, S3 upload aborted). A file whose commit already began lands whole; a sharded directory whose shard
        file is cancelled is not published. Afterwards :meth:`close` (or interpreter exit) ends the threads without a
        long wait.
        """
        entries = self._pending.abandon()
        jobs = [entry for entry in entries if isinstance(entry, SnapshotJob)]
        for job in jobs:
            if job.write_through is not None:
                job.write_through.close()  # the copier stops waiting for writers to take these chunks
        with self._copier_wake:
            self._copier_wake.notify_all()  # a copier waiting for writers sees the jobs stopped now
        deadline = time.monotonic() + wait_s
        unfinished = [job.path for job in jobs if not job.finished.wait(max(0.0, deadline - time.monotonic()))]
        landed = {id(job) for job in jobs if job.state is JobState.COMMITTED}  # their commit had begun: whole
        return Abandoned([entry.path for entry in entries if id(entry) not in landed], unfinished)

    def close(self) -> None:
        """Drain, then stop the threads. The engine starts them again if it is used later."""
        self.drain()
        self._threads.stop(self._wake_threads)

    def _wake_threads(self) -> None:
        """Training thread, at :meth:`close`: one wake-up per writer thread and one for the copier (see
        :mod:`~lightning_datastates.snapshot.threads`)."""
        if self._data_path is None:
            return
        for _ in range(self.config.writer_threads):
            self._write_queue.put(WAKE)
        self._data_path.copier.wake_to_end()

    # ------------------------------------------------------------------ arena and resident cache
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
