"""Pending work, one registry for every save, whatever the strategy: checkpoints captured and not yet finished,
failed and not yet reported, and removals held back for them.

Two kinds of save register here: the engine's :class:`~lightning_datastates.records.job.SnapshotJob` (a file the
engine copies and writes: a single-file checkpoint, or one rank's shard file) and a :class:`PendingCommit` (a sharded
checkpoint's directory, published by :mod:`~lightning_datastates.sharded.commit` once every rank's shard file is
durable). Both are waited for, reported and hold back removals the same way, so the plugin asks one registry whatever
the strategy.

Call order:
  1) :meth:`PendingCheckpoints.before_save` on the training thread, before a save writes anything at its path;
  2) :meth:`PendingCheckpoints.register_locked` (a job, inside capture, with the lock held: the same hold queues the
     checkpoint for the copier, and threads decide to end under it too) or :meth:`PendingCheckpoints.register_commit`
     (a sharded save, once staged), on the training thread;
  3) the queries and waits (``is_pending``, ``wait_path``, ``cancel_path``, ``defer_removal``, ``drain``,
     ``pop_failure``, ...) on the training thread, any time;
  4) :meth:`PendingCheckpoints.finish` once per entry, after its commit or abort: on a writer thread (a job) or the
     committer thread (a commit). It carries out the removals the entry was the last to hold back, on that thread.
  5) :meth:`PendingCheckpoints.abandon` on the training thread, only when the user gives up on the writes in flight
     (a second Ctrl-C while they drain, :mod:`~lightning_datastates.progress`): every pending file is cancelled and
     every removal held back is dropped; the entries still finish through 4) as their threads abort them.

Saves of one file land in order: a new save of a file still pending commits only after the pending one finished. The
pending one is cancelled (coalesced: only the newer is worth writing), unless it itself follows a cancelled save: so a
file saved again faster than storage takes it still lands at least every second save (``docs/design.md``, "The
checkpoint lifecycle", invariant 5). Commits of one directory are published in order by their committer and never
cancelled.

A removal (:meth:`PendingCheckpoints.defer_removal`) never cancels a write that may still be needed: it waits until
every save registered before it has landed, and only then cancels the removed file's own pending write, if any, and
removes the file once that write has ended. An entry a removal waits for that is cancelled because a newer save of the
same path superseded it hands the wait on to that newer save (:attr:`SnapshotJob.later`); one that fails or is
skipped keeps the file (it may be the newest checkpoint there is).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_datastates.errors import CheckpointFlushError
from lightning_datastates.records.job import JobState, SnapshotJob

log = logging.getLogger("lightning_datastates")

#: How a save that failed or was skipped stands: the removals waiting for it are dropped.
_NOT_COMMITTED = (JobState.FAILED, JobState.SKIPPED)


@dataclass(eq=False)
class PendingCommit:
    """A sharded checkpoint's directory, registered until its committer published or discarded it.

    ``state`` and ``error`` are set by the committer thread before :meth:`PendingCheckpoints.finish`: ``state`` whether
    the directory became the checkpoint (``COMMITTED``; ``FAILED`` or ``SKIPPED`` drop the removals waiting for it),
    ``error`` the failure to report on this rank (None where it was reported another way: this rank's own shard file
    or staging).
    """

    path: str
    state: JobState = JobState.WRITING
    error: CheckpointFlushError | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    settled: bool = False
    successor: Any = None  # never superseded: commits of one directory land in order
    #: The next entry registered under the same path while this one was pending (a removal waiting for this one, if
    #: it is cancelled, waits for that one instead).
    later: Any = None
    #: Its place among the saves registered (set at registration): what "a save after that file" means for removals.
    order: int = -1


@dataclass(eq=False)
class PendingReplication(PendingCommit):
    """A checkpoint written to the local tier (``local_tier``), registered under its persistent path until its copy
    there is committed (:mod:`~lightning_datastates.tiered`): waits, removals held back and failures of the persistent
    path go through it as through any pending save. Registered with :meth:`PendingCheckpoints.register_commit` and
    finished by the replicator thread, which sets ``state`` and ``error`` first.

    ``cancel_requested`` (set by :meth:`PendingCheckpoints.abandon`, or by the replicator when a newer copy of the same
    file became durable locally): the replicator stops between windows and aborts the upload. ``keep_marker``: the
    local copy stays marked as not replicated, for the next run (set by an abandon).
    """

    cancel_requested: bool = False
    keep_marker: bool = False


def flush_error(entry: SnapshotJob | PendingCommit) -> CheckpointFlushError:
    """The error to raise for a failed ``entry``, its cause chained."""
    if isinstance(entry.error, CheckpointFlushError):
        return entry.error
    error = CheckpointFlushError(f"writing checkpoint {entry.path} failed: {entry.error!r}", entry.path)
    error.__cause__ = entry.error
    return error


class PendingCheckpoints:
    """Every save registered and not yet finished, in order, and what waits for them (see the module docstring)."""

    def __init__(self) -> None:
        #: Guards everything here; capture holds it while it registers and queues a checkpoint.
        self.lock = threading.Lock()
        #: Not yet finished, in registration order.
        self.active: list[SnapshotJob | PendingCommit] = []
        self._latest_by_path: dict[str, SnapshotJob | PendingCommit] = {}
        self._failures: deque[SnapshotJob | PendingCommit] = deque()  # failed, not yet reported
        # path -> a removal held back until the saves before it landed (and then its file's own pending write ended)
        self._deferred_removals: dict[str, _Removal] = {}
        # path -> set once the removal of path that a finishing entry carries out is done
        self._running_removals: dict[str, threading.Event] = {}
        self._orders = itertools.count()
        # path -> (order of its latest save, whether that save failed or was skipped): which saves came after a file
        # a removal is asked for, and whether that file was written at all (until its removal ran).
        self._saves: dict[str, tuple[int, bool]] = {}
        # Removals right after a save that was skipped (or a sharded save not committed) keep their file, until the
        # next capture.
        self._skipped_since_last_capture = False
        # Entries given up by abandon() and not yet finished; removals asked for after it keep their file until the
        # next capture (the checkpoint that was to replace them may be one of those given up).
        self._abandoned: dict[int, SnapshotJob | PendingCommit] = {}  # by id(): entries compare by identity here
        self._abandoned_since_last_capture = False

    # ------------------------------------------------------------------ training thread
    def before_save(self, path: str) -> None:
        """Before a save writes anything at ``path``: drop a removal of ``path`` still held back (the new checkpoint
        replaces what it would delete, as a synchronous save after the removal would), and wait for one a finishing
        entry carries out right now, so that it cannot delete the new save's files."""
        with self.lock:
            self._deferred_removals.pop(path, None)
            running = self._running_removals.get(path)
        if running is not None:
            running.wait()

    def register_commit(self, commit: PendingCommit) -> None:
        """Register a sharded save's directory until its committer calls :meth:`finish`."""
        with self.lock:
            self._deferred_removals.pop(commit.path, None)
            # The skip flag stays: a sharded save whose own file was skipped registers its commit all the same.
            predecessor = self._latest_by_path.get(commit.path)
            if predecessor is not None and not predecessor.finished.is_set():
                predecessor.later = commit
            commit.order = next(self._orders)
            self._saves[commit.path] = (commit.order, False)
            self._latest_by_path[commit.path] = commit
            self.active.append(commit)

    def register_locked(self, job: SnapshotJob) -> None:
        """Register ``job`` (call with :attr:`lock` held); a pending save of the same path is superseded by it."""
        self._deferred_removals.pop(job.path, None)  # saved again: the new file replaces the old one anyway
        self._skipped_since_last_capture = False
        self._abandoned_since_last_capture = False
        predecessor = self._latest_by_path.get(job.path)
        if isinstance(predecessor, SnapshotJob) and not predecessor.finished.is_set():
            # The new save commits only after the pending one ended, so that saves of one path land in order. The
            # pending one is coalesced away, unless it follows a cancelled save itself: at least every second lands.
            if predecessor.follows_cancelled:
                job.follows_cancelled = False
            else:
                predecessor.cancel_requested = True
                job.follows_cancelled = True
            predecessor.successor = predecessor.later = job
            job.outstanding += 1
        job.order = next(self._orders)
        self._saves[job.path] = (job.order, False)
        self._latest_by_path[job.path] = job
        self.active.append(job)

    def busy_locked(self) -> bool:
        """Whether any of the engine's checkpoints is pending (call with :attr:`lock` held)."""
        return any(isinstance(entry, SnapshotJob) for entry in self.active)

    def note_skipped(self, path: str | None = None) -> None:
        """A save (of ``path``) was skipped (``on_arena_full="skip"``), or raised before it was registered: removals
        keep their file until the next capture (the checkpoint that was to replace it was not written)."""
        with self.lock:
            self._skipped_since_last_capture = True
            if path is not None:
                self._saves[path] = (next(self._orders), True)

    def in_flight(self) -> list[SnapshotJob]:
        """Checkpoints captured and not yet committed or dropped, oldest first."""
        with self.lock:
            return [job for job in self.active if isinstance(job, SnapshotJob) and not job.finished.is_set()]

    def copying(self) -> list[SnapshotJob]:
        """Checkpoints whose sources are still read (a barrier waits for them), oldest first."""
        with self.lock:
            return [job for job in self.active if isinstance(job, SnapshotJob) and not job.copied.is_set()]

    def is_pending(self, path: str) -> bool:
        """Whether a save of ``path`` is registered but not yet committed (or dropped)."""
        with self.lock:
            job = self._latest_by_path.get(path)
        return job is not None and not job.finished.is_set()

    def wait_path(self, path: str) -> None:
        """Wait until the pending save of ``path``, if any, is committed or dropped (for a directory, the latest
        registered: its committer publishes them in order)."""
        with self.lock:
            job = self._latest_by_path.get(path)
        if job is not None:
            job.finished.wait()

    def defer_removal(self, path: str, remove: Callable[[], None], also: tuple[str, ...] = ()) -> None:
        """Call ``remove`` once every save registered so far is settled, and the pending writes of ``path`` and of
        ``also`` (the local tier's copy of it) are cancelled and ended; now if nothing is pending (on the caller's
        thread), else on the thread that finishes the last of them.

        Keep the file instead (with a warning) where it may be the newest checkpoint there is: a save after it failed
        or was skipped, and none of the saves after it that this removal waits for lands. Saves before the file do
        not count, nor a file whose own latest save failed (there is nothing of it to keep). The removed file's own
        pending write is cancelled only once every other save before the removal landed (see the module docstring).

        Raises:
            Exception: whatever ``remove`` raised, where it ran now (on the caller's thread).
        """
        with self.lock:
            saves = [self._saves[p] for p in (path, *also) if p in self._saves]
            file_order = max((order for order, _ in saves), default=-1)
            written = not saves or not all(failed for _, failed in saves)
            reason = self._reason_to_keep(file_order) if written else None
            if reason is not None:
                log.warning("lightning_datastates: keeping %s, which was to be removed: %s", path, reason)
                return
            own = [
                e for p in (path, *also) if (e := self._latest_by_path.get(p)) is not None and not e.finished.is_set()
            ]
            waiting = [entry for entry in self.active if not entry.settled and entry not in own]
            newer = written and any(entry.order > file_order and _whole(entry) for entry in waiting)
            removal = _Removal(waiting, remove, own, (path, *also), file_order, awaits_newer=newer)
            due = self._advance(path, removal)
        if due:
            try:
                remove()
            finally:
                with self.lock:
                    self._forget(removal.paths)

    def _reason_to_keep(self, file_order: int) -> str | None:
        """Why a removal of a file saved at ``file_order`` (-1: not by this process), asked for now, keeps it (call
        with :attr:`lock` held); None if it may go ahead once the saves before it landed."""
        failed = [job.path for job in self._failures if job.order > file_order]
        if failed:  # a newer checkpoint already failed (not yet reported)
            return (
                f"a newer write failed ({', '.join(failed)}, raised as CheckpointFlushError). Delete it by hand once a "
                "newer checkpoint is saved, if you do not need it"
            )
        if self._skipped_since_last_capture:  # the checkpoint that was to replace it was skipped
            return "a newer save was skipped or failed"
        if self._abandoned_since_last_capture:  # the checkpoint that was to replace it may have been given up
            return "the writes in flight were abandoned"
        return None

    def _advance(self, path: str, removal: _Removal) -> bool:
        """Move ``removal`` of ``path`` on as far as it goes now (call with :attr:`lock` held): held back while it
        waits; once the saves before it settled, dropped (with a warning) where it awaited saves after its file and
        none of them landed; else its own pending writes cancelled (a sharded directory's commit is waited for, never
        cancelled) and waited for; True once nothing is left to wait for (the caller runs it, outside the lock), and
        then it is no longer held here."""
        if not removal.waiting and not removal.cancelling and removal.awaits_newer and not removal.newer_landed:
            self._deferred_removals.pop(path, None)
            log.warning(
                "lightning_datastates: keeping %s, which was to be removed, because every save after it failed or was "
                "skipped (%s)",
                path,
                ", ".join(removal.newer_failed) or "none landed",
            )
            return False
        if not removal.waiting and not removal.cancelling and removal.own:
            removal.cancelling = True
            for entry in removal.own:
                if isinstance(entry, (SnapshotJob, PendingReplication)):
                    entry.cancel_requested = True
            removal.waiting = [entry for entry in removal.own if not entry.settled]
        if removal.waiting:
            self._deferred_removals[path] = removal
            return False
        self._deferred_removals.pop(path, None)
        return True

    def is_removal_deferred(self, path: str) -> bool:
        """Whether ``path`` is removed already as far as the caller knows, but kept until earlier writes land (or
        being removed right now by the thread that finished the last of them)."""
        with self.lock:
            return path in self._deferred_removals or path in self._running_removals

    def drain(self) -> None:
        """Wait until every pending checkpoint is committed or dropped; after :meth:`abandon`, sharded commits it gave
        up on are not waited for (their exchange may wait for ranks that are gone; what they leave is a dead writer's,
        for ``clean`` and the next run's cleanup)."""
        while True:
            active = self.outstanding()
            if not active:
                return
            for job in active:
                job.finished.wait()

    def outstanding(self) -> list[SnapshotJob | PendingCommit]:
        """What :meth:`drain` waits for now, oldest first: every registered entry but the sharded commits given up by
        :meth:`abandon`."""
        with self.lock:
            return [e for e in self.active if not (isinstance(e, PendingCommit) and id(e) in self._abandoned)]

    def abandon(self) -> list[SnapshotJob | PendingCommit]:
        """Training thread: give up every pending save now; return them, oldest first.

        Every pending file is cancelled: its writer threads skip what is left of it and abort its session (the
        temporary file removed, an S3 multipart upload aborted), unless its commit already began (then it lands
        whole). A sharded commit is left to its committer: its own shard file cancelled, it is not published. Every
        removal held back behind pending saves is dropped, and removals asked for until the next capture keep their
        file: an older good checkpoint is never removed because a newer one was given up. The entries still end
        through :meth:`finish`: a cancelled file is no failure; one that failed before is still reported.
        """
        with self.lock:
            entries = list(self.active)
            for entry in entries:
                if isinstance(entry, SnapshotJob):
                    entry.cancel_requested = True
                elif isinstance(entry, PendingReplication):
                    # Its upload is aborted; the local copy stays, marked, and the next run replicates it.
                    entry.cancel_requested = entry.keep_marker = True
            self._abandoned.update((id(entry), entry) for entry in entries)
            self._abandoned_since_last_capture = True
            kept = sorted(self._deferred_removals)  # their files stay: their own writes, if any, go on or are given up
            self._deferred_removals.clear()
        if kept:
            log.warning(
                "lightning_datastates: keeping %s, which %s to be removed once the abandoned writes landed",
                ", ".join(kept),
                "was" if len(kept) == 1 else "were",
            )
        return entries

    def pop_failure(self, path: str | None = None) -> SnapshotJob | PendingCommit | None:
        """The oldest failed, not yet reported save (of ``path`` if given); it counts as reported now (raise
        :func:`flush_error` of it)."""
        with self.lock:
            for job in self._failures:
                if path is None or job.path == path:
                    self._failures.remove(job)
                    return job
        return None

    def warn_failures(self) -> None:
        """Log each failed, not yet reported checkpoint as a warning (``on_flush_error="warn"``); it counts as
        reported."""
        while (job := self.pop_failure()) is not None:
            log.warning("lightning_datastates: %s; training goes on (on_flush_error='warn')", flush_error(job))

    def unreported_failures(self) -> list[SnapshotJob | PendingCommit]:
        """Failed saves not yet reported, oldest first (they stay unreported)."""
        with self.lock:
            return list(self._failures)

    # ------------------------------------------------------------------ writer and committer threads
    def finish(self, job: SnapshotJob | PendingCommit) -> None:
        """``job`` is committed, failed or cancelled (its state set): carry out the removals it was the last to hold
        back, deregister it, let waiters through, and let the next save of its path commit. A second call for the same
        entry does nothing (an entry ended early on the training thread, whose own thread then ends it too)."""
        with self.lock:
            if job.finished.is_set() or job not in self.active:
                return
        for path, removal, done in self._settle_removals(job):
            try:
                removal.remove()
            except Exception:
                log.exception("lightning_datastates: could not remove %s (a top-k removal); delete it by hand", path)
            finally:
                with self.lock:
                    self._running_removals.pop(path, None)
                    self._forget(removal.paths)
                done.set()
        with self.lock:
            self.active.remove(job)
            if self._latest_by_path.get(job.path) is job:
                del self._latest_by_path[job.path]
            successor = job.successor
            job.finished.set()
        if successor is not None:
            successor.release()  # the next save of this path may commit now

    def _forget(self, paths: tuple[str, ...]) -> None:
        """The files at ``paths`` were removed: what their saves were no longer matters (call with :attr:`lock`)."""
        for path in paths:
            if path not in self._latest_by_path:
                self._saves.pop(path, None)

    def _settle_removals(self, job: SnapshotJob | PendingCommit) -> list[tuple[str, _Removal, threading.Event]]:
        """Mark ``job`` settled; return the deferred removals it was the last to hold back, each registered as running.

        A job that failed (or a commit skipped) drops the removals waiting for it: the file to remove may be the last
        good checkpoint. A job cancelled because a newer save of its path superseded it hands their wait on to that
        save.
        """
        due = []
        with self.lock:
            # Settled and failed in one hold of the lock: a removal asked for in between would find the job neither
            # waited for nor failed, and delete what may be the last good checkpoint.
            job.settled = True
            self._abandoned.pop(id(job), None)
            if job.error is not None:
                self._failures.append(job)
            if isinstance(job, PendingCommit) and job.state in _NOT_COMMITTED:
                self._skipped_since_last_capture = True  # the next removals keep their file, as after a skipped save
            if job.state in _NOT_COMMITTED and self._saves.get(job.path, (None,))[0] == job.order:
                self._saves[job.path] = (job.order, True)  # nothing of this save to keep
            for path, removal in list(self._deferred_removals.items()):
                if job not in removal.waiting:
                    continue
                removal.waiting.remove(job)
                if not removal.cancelling and job.order > removal.file_order and _whole(job):
                    # A save after the removed file: the file may go once one of those landed.
                    landed = _landed(job)
                    if landed is None:
                        removal.newer_failed.append(job.path)
                    elif landed is job or landed.settled:
                        removal.newer_landed = True
                    elif landed not in removal.own and landed not in removal.waiting:
                        removal.waiting.append(landed)  # superseded: the newer save of that path replaces the file
                if self._advance(path, removal):
                    done = self._running_removals[path] = threading.Event()
                    due.append((path, removal, done))
        return due


@dataclass(eq=False)
class _Removal:
    """A removal held back (:meth:`PendingCheckpoints.defer_removal`): ``remove`` runs once ``waiting`` is empty,
    unless it awaited saves after the removed file and none of them landed (then the file is kept).

    ``own``: the pending entries of the removed file itself (and of its local copy), cancelled only once every other
    save registered before the removal settled; ``cancelling`` is set then, and ``waiting`` holds them until they end.
    """

    waiting: list[SnapshotJob | PendingCommit]
    remove: Callable[[], None]
    own: list[SnapshotJob | PendingCommit]
    #: The removed file's path, and its local copy's.
    paths: tuple[str, ...]
    #: The order of the removed file's latest save (-1: not saved by this process).
    file_order: int
    #: Whether saves after the removed file were pending when it was asked for: one of them must land first.
    awaits_newer: bool = False
    newer_landed: bool = False
    newer_failed: list[str] = field(default_factory=list)
    cancelling: bool = False


def _whole(entry: SnapshotJob | PendingCommit) -> bool:
    """Whether ``entry`` is a checkpoint on its own (a sharded directory's commit, a replication, a single file; not a
    shard file or a local tier's copy): what a removal waits for to land."""
    return not isinstance(entry, SnapshotJob) or entry.whole_checkpoint


def _landed(entry: SnapshotJob | PendingCommit) -> SnapshotJob | PendingCommit | None:
    """What a removal waiting for the settled ``entry`` waits for now: ``entry`` itself where it was committed (or
    cancelled for good: a removal of its own file, an abandon); the newer save of its path that superseded it, where
    it was cancelled for one (that one, or the one after it, is the checkpoint that replaces the removed file); None
    where it failed or was skipped (the removed file is kept)."""
    while entry.state is JobState.CANCELLED and entry.later is not None:
        entry = entry.later
        if not entry.settled:
            return entry
    return None if entry.state in _NOT_COMMITTED else entry
