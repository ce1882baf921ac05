"""The timestamps of one measured fit: the recorder, the step clock, and the fsync helper of the baselines.

All of it runs in a worker subprocess (:mod:`lightning_datastates.benchmark.worker`). The :class:`Recorder` is written
from several threads: the training thread (steps, save calls, barrier waits), the checkpointing methods' own threads
(``async``'s writer, DCP's staging and upload callbacks) and the :class:`Fsyncer`'s thread; the worker reads it after
``fit`` returned and every one of them finished. Times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class Recorder:
    """Timestamps (``time.perf_counter``, seconds) of one fit: steps, checkpoints, barrier waits."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: list[list[float]] = []  # [start, end]
        self.checkpoints: list[dict[str, Any]] = []
        self.waits: list[tuple[float, float]] = []  # barrier waits of the training thread

    def new_checkpoint(self, path: str, start: float) -> dict[str, Any]:
        """Register a checkpoint saved to ``path`` from ``start``; the returned dict is filled in as it goes."""
        record: dict[str, Any] = {"path": path, "start": start, "call_s": 0.0, "barrier_s": 0.0}
        with self.lock:
            self.checkpoints.append(record)
        return record

    def waited(self, record: dict[str, Any] | None, start: float, end: float) -> None:
        """The training thread waited at a barrier from ``start`` to ``end``, for ``record`` (if known)."""
        with self.lock:
            self.waits.append((start, end))
            if record is not None:
                record["barrier_s"] += end - start


class StepClock(Callback):
    """Records when each training step starts and ends (its end moves past a save call made at that step)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """A step starts."""
        now = time.perf_counter()
        self.recorder.steps.append([now, now])

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        """A step's compute ended (a save at this step, called later, extends it: see :func:`mark_saved`)."""
        self.recorder.steps[-1][1] = time.perf_counter()


def mark_saved(recorder: Recorder, record: dict[str, Any], start: float) -> None:
    """The save call that began at ``start`` returns now (training thread): its duration, and the step's new end."""
    end = time.perf_counter()
    record["call_s"] = end - start
    if recorder.steps:
        recorder.steps[-1][1] = max(recorder.steps[-1][1], end)


def is_local(path: str) -> bool:
    """Whether ``path`` is on a local file system (the benchmark fsyncs only those)."""
    return "://" not in path or path.startswith("file://")


def fsync_path(path: str) -> float:
    """fsync ``path`` (a file, or every file under a directory); the seconds it took."""
    started = time.perf_counter()
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in paths:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - started


class Fsyncer:
    """A helper thread that fsyncs files after a baseline wrote them (the baselines do not fsync).

    1) :meth:`submit` on the training thread after each save 2) the fsyncs on the ``bench-fsync`` thread, in order
    3) :meth:`close` on the training thread after ``fit``: waits for all of them.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="bench-fsync", daemon=True)
        self._thread.start()

    def submit(self, path: str, record: dict[str, Any]) -> None:
        """fsync ``path`` in the background; set ``record['fsync_s']`` and ``record['durable']``."""
        self._queue.put((path, record))

    def close(self) -> None:
        """Wait for every submitted fsync."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (task := self._queue.get()) is not None:
            path, record = task
            if is_local(path):
                record["fsync_s"] = fsync_path(path)
            record["durable"] = time.perf_counter()
