"""Pending checkpoints: captured and not yet finished, failed and not yet reported, and removals held back for them.

Call order:
  1) :meth:`PendingCheckpoints.register_locked` on the training thread, inside capture, with the lock held (the same
     hold queues the checkpoint for the copier; threads decide to end under it too);
  2) the queries and waits (``is_pending``, ``wait_path``, ``cancel_path``, ``defer_removal``, ``drain``,
     ``pop_failure``, ...) on the training thread, any time;
  3) :meth:`PendingCheckpoints.finish` on a writer thread, once per checkpoint, after its commit or abort.

A save of a path that is still pending supersedes the pending one: that one is cancelled, and the new one commits
only after it finished, so saves of one path land in order.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from lightning_datastates.snapshot.job import JobState, SnapshotJob

log = logging.getLogger("lightning_datastates")


class PendingCheckpoints:
    """Every checkpoint captured and not yet finished, in capture order, and what waits for them."""

    def __init__(self) -> None:
        #: Guards everything here; capture holds it while it registers and queues a checkpoint.
        self.lock = threading.Lock()
        #: Not yet finished, in capture order.
        self.active: list[SnapshotJob] = []
        self._latest_by_path: dict[str, SnapshotJob] = {}
        self._failures: deque[SnapshotJob] = deque()  # failed, not yet reported
        # path -> (jobs to wait for, remove callable): removals held back until earlier checkpoints landed
        self._deferred_removals: dict[str, tuple[list[SnapshotJob], Callable[[], None]]] = {}
        self._skipped_since_last_capture = False  # removals right after a skipped save keep their file

    # ------------------------------------------------------------------ training thread
    def register_locked(self, job: SnapshotJob) -> None:
        """Register ``job`` (call with :attr:`lock` held); a pending save of the same path is superseded by it."""
        self._deferred_removals.pop(job.path, None)  # saved again: the new file replaces the old one anyway
        self._skipped_since_last_capture = False
        predecessor = self._latest_by_path.get(job.path)
        if predecessor is not None and not predecessor.finished.is_set():
            # A newer save of the same path supersedes the pending one; it commits only after that one ended.
            predecessor.cancel_requested = True
            predecessor.successor = job
            job.outstanding += 1
        self._latest_by_path[job.path] = job
        self.active.append(job)

    def busy_locked(self) -> bool:
        """Whether any checkpoint is pending (call with :attr:`lock` held)."""
        return bool(self.active)

    def note_skipped(self) -> None:
        """A save was skipped (``on_arena_full="skip"``): removals keep their file until the next capture."""
        with self.lock:
            self._skipped_since_last_capture = True

    def in_flight(self) -> list[SnapshotJob]:
        """Checkpoints captured and not yet committed or dropped, oldest first."""
        with self.lock:
            return [job for job in self.active if not job.finished.is_set()]

    def copying(self) -> list[SnapshotJob]:
        """Checkpoints whose sources are still read (a barrier waits for them), oldest first."""
        with self.lock:
            return [job for job in self.active if not job.copied.is_set()]

    def is_pending(self, path: str) -> bool:
        """Whether a checkpoint for ``path`` is captured but not yet committed (or dropped)."""
        with self.lock:
            job = self._latest_by_path.get(path)
        return job is not None and not job.finished.is_set()

    def wait_path(self, path: str) -> None:
        """Wait until the pending checkpoint of ``path``, if any, is committed or dropped."""
        with self.lock:
            job = self._latest_by_path.get(path)
        if job is not None:
            job.finished.wait()

    def cancel_path(self, path: str) -> None:
        """Drop the pending checkpoint of ``path`` (or let it finish if it is already committing) and wait."""
        with self.lock:
            job = self._latest_by_path.get(path)
        if job is not None and not job.finished.is_set():
            job.cancel_requested = True
            job.finished.wait()

    def defer_removal(self, path: str, remove: Callable[[], None]) -> None:
        """Call ``remove`` now if no checkpoint captured so far is still unsettled, else once they all are; keep the
        file instead (with a warning) if a newer checkpoint failed or was skipped, or if an awaited one fails."""
        with self.lock:
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
            waiting = [job for job in self.active if not job.settled]
            if waiting:
                self._deferred_removals[path] = (waiting, remove)
                return
        remove()

    def is_removal_deferred(self, path: str) -> bool:
        """Whether ``path`` is removed already as far as the caller knows, but kept until earlier writes land."""
        with self.lock:
            return path in self._deferred_removals

    def drain(self) -> None:
        """Wait until every pending checkpoint is committed or dropped."""
        while True:
            with self.lock:
                active = list(self.active)
            if not active:
                return
            for job in active:
                job.finished.wait()

    def pop_failure(self, path: str | None = None) -> SnapshotJob | None:
        """The oldest failed, not yet reported checkpoint (of ``path`` if given); it counts as reported now."""
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
            log.warning(
                "lightning_datastates: writing checkpoint %s failed: %r; training goes on (on_flush_error='warn')",
                job.path,
                job.error,
            )

    def unreported_failures(self) -> list[SnapshotJob]:
        """Failed checkpoints not yet reported, oldest first (they stay unreported)."""
        with self.lock:
            return list(self._failures)

    # ------------------------------------------------------------------ writer threads
    def finish(self, job: SnapshotJob) -> None:
        """``job`` is committed, failed or cancelled (its state set): carry out the removals it was the last to hold
        back, deregister it, let waiters through, and let the next save of its path commit."""
        for path, remove in self._settle_removals(job):
            try:
                remove()
            except Exception:
                log.exception("lightning_datastates: could not remove %s (a top-k removal); delete it by hand", path)
        with self.lock:
            if job.error is not None:
                self._failures.append(job)
            self.active.remove(job)
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
        with self.lock:
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
