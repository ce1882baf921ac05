"""The checkpointing methods under comparison, each a timed ``CheckpointIO`` (plus the callbacks some need).

=============  ====================================================================================================
method         what saves
=============  ====================================================================================================
``none``       nothing (checkpointing disabled): the reference for overheads
``torch``      Lightning's ``TorchCheckpointIO`` (synchronous; no fsync: the benchmark fsyncs each file afterwards
               on a helper thread, timed separately)
``async``      Lightning's ``AsyncCheckpointIO`` around ``TorchCheckpointIO`` (clone on the training thread, write
               on one thread, then the benchmark's fsync on that same thread, timed separately)
``dcp``        ``torch.distributed.checkpoint.async_save`` (no process group: ``no_dist=True``) with a reused
               ``DefaultStager`` (pinned memory where CUDA is present; staging on its own thread; a new one per save
               where torch closes it after staging, as 2.11 does) and ``FileSystemWriter(sync_files=True)``;
               training waits for staging to finish before the optimizer step
``datastates`` :class:`~lightning_datastates.DataStatesIO` with its defaults
``tiered``     the same with ``local_tier``: each checkpoint committed on a local directory first, then copied to
               the target behind training (``durable`` is the local commit; ``persistent_durable`` the commit at
               the target)
=============  ====================================================================================================

Everything here runs in a worker subprocess (:mod:`lightning_datastates.benchmark.worker`): ``save_checkpoint`` on
the training thread, the rest on the threads each class names. Each save fills one record of the
:class:`~lightning_datastates.benchmark.recording.Recorder`: ``start``, ``call_s`` and ``barrier_s`` (the training
thread's time), ``copy_end`` (the state was captured), ``flush_start``, ``written`` and ``durable``.
"""

from __future__ import annotations

import os
import queue
import time
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO

from lightning_datastates.benchmark.choices import METHODS
from lightning_datastates.benchmark.dcp import DcpAsyncIO, DcpBarrier
from lightning_datastates.benchmark.recording import Fsyncer, Recorder, fsync_path, is_local, mark_saved
from lightning_datastates.config import DataStatesConfig
from lightning_datastates.pipeline import CheckpointPipeline
from lightning_datastates.plugin import DataStatesIO, pipeline_of


class BenchTorchIO(TorchCheckpointIO):
    """Lightning's default, timed; each written file is fsynced afterwards on a helper thread (timed apart)."""

    def __init__(self, recorder: Recorder, fsyncer: Fsyncer) -> None:
        super().__init__()
        self.recorder, self.fsyncer = recorder, fsyncer

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save synchronously; the whole call blocks training."""
        start = time.perf_counter()
        record = self.recorder.new_checkpoint(os.fspath(path), start)
        record["flush_start"] = start
        super().save_checkpoint(checkpoint, path, storage_options)
        record["copy_end"] = record["written"] = time.perf_counter()
        mark_saved(self.recorder, record, start)
        self.fsyncer.submit(os.fspath(path), record)


class _WrittenTorchIO(TorchCheckpointIO):
    """The inner CheckpointIO of ``async``: writes, then fsyncs on the same (writer) thread, both timed."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.pending: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``path`` and fsync it (runs on AsyncCheckpointIO's thread)."""
        record = self.pending.get()
        record["flush_start"] = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        record["written"] = time.perf_counter()
        if is_local(os.fspath(path)):
            record["fsync_s"] = fsync_path(os.fspath(path))
        record["durable"] = time.perf_counter()


class BenchAsyncIO(AsyncCheckpointIO):
    """Lightning's ``AsyncCheckpointIO``, timed: the save call clones the tensors; the write runs on its thread."""

    def __init__(self, recorder: Recorder) -> None:
        self.inner = _WrittenTorchIO(recorder)
        super().__init__(self.inner)
        self.recorder = recorder

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Clone and submit (blocks training for the clone)."""
        start = time.perf_counter()
        path = kwargs.get("path", args[1] if len(args) > 1 else "")
        record = self.recorder.new_checkpoint(os.fspath(path), start)
        self.inner.pending.put(record)
        super().save_checkpoint(*args, **kwargs)
        record["copy_end"] = time.perf_counter()
        mark_saved(self.recorder, record, start)


class BenchPipeline(CheckpointPipeline):
    """The plugin's pipeline with its barrier timed for the timeline (training thread, from the callback)."""

    def __init__(self, config: DataStatesConfig, recorder: Recorder) -> None:
        super().__init__(config)
        self.recorder = recorder

    def barrier(self) -> float:
        """The plugin's barrier, timed for the timeline (its engine attributes the wait to a checkpoint)."""
        start = time.perf_counter()
        waited = super().barrier()
        if waited > 0:
            self.recorder.waited(None, start, time.perf_counter())
        return waited


class BenchDataStatesIO(DataStatesIO):
    """DataStatesIO (with ``local_tier`` among the ``options``: the ``tiered`` method), timed; ``wait_durable`` (a
    self-test knob) makes each save wait for its commit, to prove the blocked-time gate fails when the lazy path is
    broken.

    1) :meth:`save_checkpoint` and the pipeline's barrier (:class:`BenchPipeline`) on the training thread
    2) :meth:`finish_records` after ``fit``.
    """

    def __init__(self, recorder: Recorder, wait_durable: bool = False, **options: Any) -> None:
        self.recorder, self.wait_durable = recorder, wait_durable  # before the plugin's __init__ makes the pipeline
        super().__init__(**options)
        self._records: dict[int, dict[str, Any]] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Capture and return (or, with ``wait_durable``, wait for the commit)."""
        start = time.perf_counter()
        record = self.recorder.new_checkpoint(os.fspath(path), start)
        record["flush_start"] = start
        super().save_checkpoint(checkpoint, path, storage_options)
        if self.wait_durable:
            pipeline_of(self).engine.wait_path(os.fspath(path))
        self._records[id(self.stats[-1])] = record
        mark_saved(self.recorder, record, start)

    def _new_pipeline(self, config: DataStatesConfig) -> CheckpointPipeline:
        return BenchPipeline(config, self.recorder)

    def finish_records(self) -> None:
        """Wait for every copy to the persistent tier (``tiered``), then copy the engine's per-checkpoint figures into
        the records (after fit)."""
        self.drain()
        for stats in self.stats:
            record = self._records.get(id(stats))
            if record is None:
                continue
            if stats.state != "committed" or stats.replication == "failed":
                raise RuntimeError(f"DataStatesIO checkpoint {stats.path} ended {stats.state} ({stats.replication})")
            record["barrier_s"] = stats.barrier_wait_s
            record["copy_end"] = stats.started_at + (stats.copy_s or 0.0)
            record["written"] = record["durable"] = stats.started_at + (stats.durable_s or 0.0)
            if stats.replication is not None:
                # tiered: ``path`` is the local copy (local_keep may have removed it by now), ``durable`` its commit.
                record.update(local_path=stats.path, bytes=stats.total_bytes, replication=stats.replication,
                              replicated_bytes=stats.replicated_bytes)  # fmt: skip
                durable_s = stats.persistent_durable_s
                record["persistent_durable"] = None if durable_s is None else stats.started_at + durable_s


def plugin_for(
    method: str,
    recorder: Recorder,
    fsyncer: Fsyncer,
    wait_durable: bool = False,
    options: dict[str, Any] | None = None,
    local_tier: str | None = None,
) -> tuple[CheckpointIO | None, list[Callback]]:
    """The timed CheckpointIO of ``method`` (None for ``none``) and the callbacks it needs beside ``ModelCheckpoint``.

    ``wait_durable`` applies to ``datastates`` only, ``options`` (keyword arguments of
    :class:`~lightning_datastates.DataStatesIO`) to ``datastates`` and ``tiered``, ``local_tier`` (required) to
    ``tiered``.
    """
    if method == "none":
        return None, []
    if method == "torch":
        return BenchTorchIO(recorder, fsyncer), []
    if method == "async":
        return BenchAsyncIO(recorder), []
    if method == "dcp":
        dcp = DcpAsyncIO(recorder)
        return dcp, [DcpBarrier(dcp)]
    if method == "datastates":
        return BenchDataStatesIO(recorder, wait_durable, **(options or {})), []
    if method == "tiered":
        if local_tier is None:
            raise ValueError("the tiered method needs a local tier")
        return BenchDataStatesIO(recorder, False, **{**(options or {}), "local_tier": local_tier}), []
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
