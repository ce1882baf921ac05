"""The copies of committed local checkpoints to their persistent paths, behind training.

A local copy is replicated once its local commit is done: the writer thread that committed it calls
:meth:`Replicator.settled` (the job's ``on_settled`` hook, before the job finishes, so before a newer save of the same
file can replace it) and that opens the committed file there and then; the copy reads that very version, whatever
happens to the name afterwards. A copy recovered from a dead run comes through :meth:`Replicator.adopt`.

One coordinator thread (``datastates-replicator``) takes the copies in order, so that the saves of one file land on
the persistent tier in the order they were made; each copy is cut into windows written by a few threads at once
(``datastates-replicate_N``, as many as the persistent backend wants in flight: :meth:`StorageWriter.copy_shape
<lightning_datastates.storage.base.StorageWriter.copy_shape>`). Each window's bytes come from the host arena while the
checkpoint is still there (the resident image the snapshot left, :meth:`ResidentCache.lease
<lightning_datastates.load.resident.ResidentCache.lease>`, of this very version), else from the local file; they are
copied into a window buffer of the thread's (bounded memory: one window per thread) and written to the persistent
session, which commits last (S3: ``CompleteMultipartUpload``; POSIX: ``fsync`` and rename). A newer copy of the same
file, durable locally, cancels an older one still waiting or in flight: only the newest is worth the bandwidth.

Every copy ends its :class:`~lightning_datastates.snapshot.pending.PendingReplication` through
:meth:`PendingCheckpoints.finish <lightning_datastates.snapshot.pending.PendingCheckpoints.finish>`: committed, failed
(its error a ``CheckpointFlushError`` naming both paths, raised once by the plugin; the local copy stays marked, so
the next run replicates it) or cancelled. Removals held back for it follow, as for any save.

Threads: the coordinator and the window threads are ordinary threads that end once the queue is empty (at interpreter
exit a copy in flight is finished, as the engine's writes are); :meth:`Replicator.close` waits for that.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lightning_datastates.errors import CheckpointFlushError
from lightning_datastates.load.resident import ResidentCache
from lightning_datastates.records.job import JobState, SnapshotJob, SnapshotStats
from lightning_datastates.records.session import WriteSession
from lightning_datastates.snapshot.pending import PendingCheckpoints, PendingReplication
from lightning_datastates.storage.base import StorageWriter

log = logging.getLogger("lightning_datastates")


@dataclass(eq=False)
class Replication:
    """One local copy to replicate: its pending entry (``entry.path`` is the persistent path), the local copy, the
    markers to remove once replicated, the save's stats (None for a copy recovered from a dead run).

    ``local_state`` and the open file (``fd``, its ``fingerprint`` and ``size``) are set on the writer thread by
    :meth:`Replicator.settled`, or by :meth:`Replicator.adopt`.
    """

    entry: PendingReplication
    local_path: str
    markers: list[str]
    stats: SnapshotStats | None = None
    local_state: JobState = JobState.COMMITTED
    fd: int | None = None
    fingerprint: Hashable | None = None
    size: int = 0
    modified_ns: int | None = None  # the local copy's date (its save's): the persistent copy gets it too
    open_error: OSError | None = None
    _bytes_lock: threading.Lock = field(default_factory=threading.Lock)

    def add_replicated(self, nbytes: int) -> None:
        """Count ``nbytes`` more on the persistent tier (any window thread)."""
        if self.stats is not None:
            with self._bytes_lock:
                self.stats.replicated_bytes += nbytes


@dataclass
class ReplicationCounters:
    """Bytes replicated from the host arena (the snapshot's resident image) and from the local file."""

    from_memory_bytes: int = 0
    from_file_bytes: int = 0


class _Cancelled(Exception):
    """The copy was cancelled (a newer copy of the file, an abandon): abort it."""


def file_fingerprint(fd: int) -> Hashable:
    """The fingerprint of the file open at ``fd``, in the form ``LocalWriter.fingerprint`` gives for its path."""
    info = os.fstat(fd)
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


class Replicator:
    """Copies of committed local checkpoints to their persistent paths: one ordered coordinator, windows in
    parallel (see the module docstring).

    Args:
        writer_for: the storage writer of a persistent path (the pipeline's, one per protocol).
        resident: the engine's resident cache now (None before the arena exists, or without ``serve_from_memory``).
        pending: the registry the entries are finished in.
        window_bytes: bytes per window (the persistent backend may choose others).
        streams: windows in flight at once (likewise).
        after_commit: called on the coordinator thread once a copy is committed: it removes the copy's markers
            (``item.markers``) and applies the retention of the local tier; its failures are logged (the markers are
            removed then).
        unmark: removes markers (those of a copy that was cancelled, or whose local write failed).
        keep: called with the markers of a copy that stays marked for a later recovery (its copy failed, or was given
            up by an abandon).
    """

    def __init__(
        self,
        writer_for: Callable[[str], StorageWriter],
        resident: Callable[[], ResidentCache | None],
        pending: PendingCheckpoints,
        window_bytes: int,
        streams: int,
        after_commit: Callable[[Replication], None],
        unmark: Callable[[list[str]], None],
        keep: Callable[[list[str]], None],
    ) -> None:
        self._writer_for = writer_for
        self._resident = resident
        self._pending = pending
        self._window_bytes = window_bytes
        self._streams = streams
        self._after_commit = after_commit
        self._unmark = unmark
        self._keep = keep
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: deque[Replication] = deque()
        self._current: Replication | None = None
        self._thread: threading.Thread | None = None
        self.counters = ReplicationCounters()

    # ------------------------------------------------------------------ writer thread, training thread
    def settled(self, item: Replication, job: SnapshotJob) -> None:
        """The local write of ``item`` ended (``job``'s ``on_settled`` hook, on the writer thread that committed or
        aborted it): open the committed file now, and queue the copy."""
        item.local_state = job.state
        item.stats = job.stats
        if job.state is JobState.COMMITTED:
            self._open(item)
        self._queue_or_end(item)

    def adopt(self, item: Replication) -> None:
        """Queue the copy of a local checkpoint that a dead run did not replicate (training thread, at recovery)."""
        self._open(item)
        self._queue_or_end(item)

    def _queue_or_end(self, item: Replication) -> None:
        try:
            self._submit(item)
        except BaseException as exc:  # noqa: BLE001 - no thread could start: the entry fails, or drains would hang
            item.open_error = OSError(f"cannot start the replicator thread: {exc!r}")
            self._replicate(item)

    def close(self) -> None:
        """Wait until every queued copy has ended and the threads are gone (they start again on the next copy)."""
        with self._idle:
            while self._thread is not None:
                self._idle.wait()

    def _open(self, item: Replication) -> None:
        try:
            item.fd = os.open(item.local_path, os.O_RDONLY | os.O_CLOEXEC)
            info = os.fstat(item.fd)
            item.fingerprint = file_fingerprint(item.fd)
            item.size, item.modified_ns = info.st_size, info.st_mtime_ns
        except OSError as exc:
            item.open_error = exc

    def _submit(self, item: Replication) -> None:
        """Queue ``item``; start the coordinator if none runs.

        Raises:
            RuntimeError: the thread could not be started (``item`` is not queued then).
        """
        with self._lock:
            if item.local_state is JobState.COMMITTED:
                # A newer copy of the file is durable locally: older ones still queued are not worth uploading any
                # more. The one in flight goes on: where copies take longer than the time between saves, cancelling it
                # would leave the persistent file never updated.
                for older in self._queue:
                    if older.entry.path == item.entry.path:
                        older.entry.cancel_requested = True
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="datastates-replicator")
                thread.start()  # under the lock: it takes its first item only once this hold ends
                self._thread = thread
            self._queue.append(item)

    # ------------------------------------------------------------------ coordinator thread
    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    # Ends once the queue is empty; the lock makes that and _submit's "no thread, start one" exclusive.
                    self._thread = self._current = None
                    self._idle.notify_all()
                    return
                item = self._current = self._queue.popleft()
            try:
                self._replicate(item)
            except BaseException:  # _replicate ends its entry itself; the copies after it must still run
                log.exception("lightning_datastates: replicating %s", item.entry.path)

    def _replicate(self, item: Replication) -> None:
        """Copy ``item`` (or not: its local write failed, or it was cancelled), then end its entry."""
        entry = item.entry
        try:
            if item.local_state is not JobState.COMMITTED:
                # Nothing whole to copy; the local write's own failure is reported as that save's.
                outcome = JobState.FAILED if item.local_state is JobState.FAILED else JobState.CANCELLED
            elif item.open_error is not None:
                raise item.open_error
            elif entry.cancel_requested:
                outcome = JobState.CANCELLED
            else:
                outcome = self._copy(item)
        except BaseException as exc:  # noqa: BLE001 - that copy's failure, reported once through its entry
            outcome = JobState.FAILED
            entry.error = CheckpointFlushError(
                f"replicating {item.local_path} to {entry.path} failed: {exc!r}. The local copy is whole and stays; "
                "the next run on this node replicates it",
                entry.path,
            )
            entry.error.__cause__ = exc
        finally:
            if item.fd is not None:
                os.close(item.fd)
                item.fd = None
        self._settle(item, outcome)

    def _settle(self, item: Replication, outcome: JobState) -> None:
        entry = item.entry
        entry.state = outcome
        stats = item.stats
        if stats is not None:
            if outcome is JobState.COMMITTED:
                stats.persistent_durable_s = time.perf_counter() - stats.started_at
            stats.replication = outcome.value
        try:
            if outcome is JobState.COMMITTED:
                self._after_commit(item)
            elif entry.keep_marker or (outcome is JobState.FAILED and entry.error is not None):
                self._keep(item.markers)  # a copy that failed stays marked for a recovery, and so does one abandoned
            else:
                self._unmark(item.markers)
        except Exception:  # a marker or a copy left on the local tier is no loss
            log.exception("lightning_datastates: after replicating %s", entry.path)
        finally:
            self._pending.finish(entry)  # whatever happened: waits and drains must end

    def _copy(self, item: Replication) -> JobState:
        """Write ``item``'s local file to its persistent path; COMMITTED, or CANCELLED.

        Raises:
            Exception: a read or write failed (the session is aborted first).
        """
        writer = self._writer_for(item.entry.path)
        window, streams = writer.copy_shape(self._window_bytes, self._streams)
        session = writer.begin(item.entry.path, item.size)
        try:
            offsets = list(range(0, item.size, window))
            workers = max(1, min(streams, len(offsets)))
            buffers: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
            for _ in range(workers):
                buffers.put(bytearray(min(window, item.size)))
            stop = threading.Event()  # a window failed: the others stop

            def one_window(offset: int) -> None:
                if stop.is_set() or item.entry.cancel_requested:
                    return
                buffer = buffers.get()
                try:
                    self._window(item, session, offset, min(window, item.size - offset), buffer)
                except BaseException:
                    stop.set()
                    raise
                finally:
                    buffers.put(buffer)

            if workers == 1:
                for offset in offsets:
                    one_window(offset)
            else:
                with ThreadPoolExecutor(workers, thread_name_prefix="datastates-replicate") as pool:
                    for done in [pool.submit(one_window, offset) for offset in offsets]:
                        done.result()
            if item.entry.cancel_requested:
                raise _Cancelled
            if item.modified_ns is not None:
                session.date(item.modified_ns)
            session.complete()
        except _Cancelled:
            _abort(session, item)
            return JobState.CANCELLED
        except BaseException:
            _abort(session, item)
            raise
        return JobState.COMMITTED

    def _window(self, item: Replication, session: WriteSession, offset: int, nbytes: int, buffer: bytearray) -> None:
        """Copy ``[offset, offset + nbytes)`` of ``item`` into ``buffer`` (from the arena if it still holds this
        version, else from the file) and write it to ``session``."""
        view = memoryview(buffer)[:nbytes]
        resident = self._resident()
        reader = None if resident is None else resident.lease(item.local_path, item.fingerprint)
        if reader is not None:
            try:
                reader.seek(offset)
                got = reader.readinto(view)
            finally:
                reader.close()
            with self._lock:
                self.counters.from_memory_bytes += got
        else:
            got = 0
            assert item.fd is not None
            while got < nbytes:
                read = os.preadv(item.fd, [view[got:]], offset + got)
                if read == 0:
                    break
                got += read
            with self._lock:
                self.counters.from_file_bytes += got
        if got != nbytes:
            raise OSError(f"{item.local_path} ended at byte {offset + got}, {nbytes - got} bytes early")
        session.write_range(offset, view)
        item.add_replicated(nbytes)


def _abort(session: WriteSession, item: Replication) -> None:
    try:
        session.abort()
    except Exception:
        log.exception("lightning_datastates: could not abort the copy of %s to %s", item.local_path, item.entry.path)
