"""The engine's threads: one copier and ``writer_threads`` writers, started on demand, ending when idle.

Call order:
  1) :meth:`EngineThreads.start_missing` on the training thread, inside capture, with the pending checkpoints' lock
     held (:mod:`~lightning_datastates.snapshot.pending`): starts the threads that are not running;
  2) :meth:`EngineThreads.retire_if_idle` on each engine thread whenever its queue stayed empty for
     :data:`~lightning_datastates.records.tasks.POLL_S`: whether to end now;
  3) :meth:`EngineThreads.stop` on the training thread (the engine's close, after a drain): wakes them (a
     :data:`~lightning_datastates.records.tasks.WAKE` in each queue) and joins them all: a save outside the training
     loop closes the engine before it returns, so this takes about a thread switch, not a poll interval.

Threads are ordinary (non-daemon) threads: at interpreter exit they finish every pending checkpoint and then end by
themselves, so a script that returns right after ``fit`` still leaves complete files.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("lightning_datastates")

#: Idle threads end after this long without work (they are started again by the next capture).
IDLE_EXIT_S = 10.0

#: Opt-in (off by default): add this to the nice value of the copier and writer threads (Linux sets it per thread), so
#: that where cores are scarce the training thread gets the CPU first. An integer from 1 to 19; unset or 0: unchanged.
THREAD_NICE_ENV = "LIGHTNING_DATASTATES_THREAD_NICE"


class EngineThreads:
    """The running copier and writer threads (see the module docstring for the call order).

    Args:
        lock: the pending checkpoints' lock. Capture registers a checkpoint and queues it under it, and a thread
            decides to end under it, so no thread ends between the two.
        busy: called with ``lock`` held: whether any checkpoint is pending (then no thread ends).
    """

    def __init__(self, lock: threading.Lock, busy: Callable[[], bool]) -> None:
        self._lock = lock
        self._busy = busy
        self._threads: list[threading.Thread] = []
        self._closing = False

    @property
    def running(self) -> list[threading.Thread]:
        """The threads started and not yet retired (a copy)."""
        with self._lock:
            return list(self._threads)

    def start_missing(self, copier: Callable[[], None], writer: Callable[[], None], writer_count: int) -> None:
        """Training thread, with the lock held: start the copier (running ``copier``) and the ``writer_count``
        writers (each running ``writer``) that are not running."""
        self._threads = [t for t in self._threads if t.is_alive()]
        names = {t.name for t in self._threads}
        wanted = {"datastates-copier": copier}
        wanted.update({f"datastates-writer-{i}": writer for i in range(writer_count)})
        for name, target in wanted.items():
            if name not in names:
                thread = threading.Thread(target=_run_lowered, args=(target,), name=name, daemon=False)
                thread.start()
                self._threads.append(thread)

    def retire_if_idle(self, own_queue: queue.Queue[Any], idle_since: float) -> bool:
        """Engine thread: whether it should end: nothing pending and the engine closing, the interpreter exiting, or
        idle for :data:`IDLE_EXIT_S`. Decided and deregistered under the lock, so a capture that starts now sees the
        thread gone and starts a new one."""
        with self._lock:
            if self._busy() or _holds_work(own_queue):
                return False
            idle_too_long = time.monotonic() - idle_since > IDLE_EXIT_S
            if not (self._closing or idle_too_long or not threading.main_thread().is_alive()):
                return False
            current = threading.current_thread()
            if current in self._threads:
                self._threads.remove(current)
            return True

    def stop(self, wake: Callable[[], None] | None = None) -> None:
        """Training thread, once nothing is pending: end every thread and wait for it; ``wake`` puts a
        :data:`~lightning_datastates.records.tasks.WAKE` in each thread's queue, so that none waits out its poll
        interval. Later captures start them again."""
        with self._lock:
            self._closing = True
            threads, self._threads = self._threads, []
        if wake is not None and threads:
            wake()
        for thread in threads:
            thread.join()
        with self._lock:
            self._closing = False


def _holds_work(own_queue: queue.Queue[Any]) -> bool:
    """Whether ``own_queue`` holds anything but wake-ups (read under the queue's own lock)."""
    with own_queue.mutex:
        return any(item is not None for item in own_queue.queue)


def _run_lowered(target: Callable[[], None]) -> None:
    """The body of an engine thread: ``target``, at the priority :data:`THREAD_NICE_ENV` asks for."""
    lower_thread_priority()
    target()


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
