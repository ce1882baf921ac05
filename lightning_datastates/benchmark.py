"""Benchmark: DataStatesIO against its peers, side by side, on the same model, data and checkpoint interval.

Run ``python -m lightning_datastates.benchmark`` (``--help`` for the options). Each round trains the same GPT-style
model on the same synthetic tokens once per method, each in a fresh subprocess (clean peak RSS, no cross-talk),
with one torch compute thread (the other cores are left to checkpointing, as a GPU node leaves its CPU free) and
``ModelCheckpoint(every_n_train_steps=N, save_top_k=-1)``:

=============  ====================================================================================================
method         what saves
=============  ====================================================================================================
``none``       nothing (checkpointing disabled): the reference for overheads
``torch``      Lightning's ``TorchCheckpointIO`` (synchronous; no fsync: the benchmark fsyncs each file afterwards
               on a helper thread, timed separately)
``async``      Lightning's ``AsyncCheckpointIO`` around ``TorchCheckpointIO`` (clone on the training thread, write
               on one thread, then the benchmark's fsync on that same thread, timed separately)
``dcp``        ``torch.distributed.checkpoint.async_save`` (no process group: ``no_dist=True``) with a reused
               ``DefaultStager`` (pinned memory where CUDA is present; staging on its own thread) and
               ``FileSystemWriter(sync_files=True)``; training waits for staging to finish before the optimizer step
``datastates`` :class:`~lightning_datastates.DataStatesIO` with its defaults
=============  ====================================================================================================

Columns of the report (one row per method; each figure is the median over ``--rounds`` of that round's value):

- ``train s``: seconds from the start of ``fit`` until the last training step ended, including that step's save
  call (a synchronous save is in it, a background flush still running is not). ``overhead`` compares it with
  ``none`` of the same round (``fit overhead`` likewise ``fit s``), median over rounds. Every other round runs
  the methods in reverse order, so that a drift of a shared machine's speed does not favour the methods that run
  first.
- ``quiet overhead``: measured inside the run itself, robust to other load on a shared machine: the training
  loop's time (first step start to last step end) over (number of steps x the median duration of the steps that
  overlap no checkpoint activity: save call, copy or flush), minus 1. ``none`` shows the natural step-time spread.
- ``fit s``: seconds of the whole ``trainer.fit`` call, including the final wait for pending writes.
- ``blocked p50/max ms``: per checkpoint, the training thread's time inside ``CheckpointIO.save_checkpoint``
  plus its waits at the method's barriers (DataStatesIO: ``on_before_optimizer_step`` and the other barrier hooks;
  dcp: the wait for staging before the optimizer step); median and largest checkpoint of the round.
- ``durable p50 s``: per checkpoint, seconds from the save call until the file is on storage: DataStatesIO and dcp
  until their own commit (both fsync); torch and async until the benchmark's fsync of the written file returned.
- ``fsync p50 s``: torch and async only: how long that fsync took (part of ``durable``).
- ``flush MB/s``: file bytes / (durable time - flush start), median over checkpoints; the flush starts at the save
  call (torch, dcp, datastates: serialization, staging and copy stream into the write) or when the writer thread
  picks the file up (async). ``vs raw``: that over the raw throughput of the target measured in the same round:
  one file of the same size written sequentially in 64 MiB ``write`` calls, then ``fsync``, once through the page
  cache and once with ``O_DIRECT`` (where the file system takes it); the faster of the two counts.
- ``peak RSS GB``: the subprocess's peak resident memory during the measured fit (Linux: reset after the
  warm-up); ``extra/ckpt``: (peak RSS - peak RSS of ``none``) / checkpoint size, i.e. host memory beyond model
  and optimizer in units of one checkpoint.
- ``extra GPU GB`` (CUDA only): ``torch.cuda.max_memory_allocated`` - that of ``none``.

Outputs: the table on stdout and in ``benchmark.md``, every measurement in ``benchmark.json``, and a timeline
``benchmark.png`` (needs matplotlib: ``pip install 'lightning-datastates[bench]'``) of each method's steps and each
checkpoint's copy and flush phases, in ``--out``.

``--short`` runs a small model (6M parameters) for a few steps (well under two minutes on two cores); with
``--max-blocked-vs-sync R`` the exit status is 1 when DataStatesIO's median blocked time per checkpoint exceeds
``R`` times TorchCheckpointIO's in the same run (a ratio, never an absolute time: CI machines differ).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import mmap
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import lightning as L
import torch
import yaml  # type: ignore[import-untyped]  # PyYAML comes with lightning; no stubs needed here
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO

from lightning_datastates._gpt import GPT
from lightning_datastates.plugin import DataStatesIO

SEED = 1234
METHODS = ("none", "torch", "async", "dcp", "datastates")
#: GPT shapes by approximate parameter count: (vocab, dim, layers, heads, seq_len, batch_size).
MODELS: dict[str, tuple[int, int, int, int, int, int]] = {
    "3M": (4096, 256, 3, 4, 32, 2),
    "6M": (16384, 256, 2, 4, 32, 2),  # --short: few tensors, 70 MB checkpoints
    "10M": (8192, 384, 4, 6, 64, 2),
    "40M": (32768, 512, 8, 8, 64, 2),
    "125M": (50304, 768, 12, 12, 256, 4),
    "350M": (50304, 1024, 24, 16, 256, 4),
    "1.3B": (50304, 2048, 24, 16, 512, 4),
    "2.7B": (50304, 2560, 32, 32, 512, 2),
    "6.7B": (50304, 4096, 32, 32, 512, 1),
}
_MB = 1e6
_RAW_CHUNK_BYTES = 64 * 2**20


# ---------------------------------------------------------------------------------------------------- worker side
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
        """A step's compute ended (a save at this step, called later, extends it: see :func:`_saved`)."""
        self.recorder.steps[-1][1] = time.perf_counter()


def _saved(recorder: Recorder, record: dict[str, Any], start: float) -> None:
    end = time.perf_counter()
    record["call_s"] = end - start
    if recorder.steps:
        recorder.steps[-1][1] = max(recorder.steps[-1][1], end)


def _fsync_path(path: str) -> float:
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
    """A helper thread that fsyncs files after a baseline wrote them (the baselines do not fsync)."""

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
            if _is_local(path):
                record["fsync_s"] = _fsync_path(path)
            record["durable"] = time.perf_counter()


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


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
        _saved(self.recorder, record, start)
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
        if _is_local(os.fspath(path)):
            record["fsync_s"] = _fsync_path(os.fspath(path))
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
        _saved(self.recorder, record, start)


class DcpAsyncIO(CheckpointIO):
    """Benchmark-only: ``torch.distributed.checkpoint.async_save`` as a CheckpointIO (each checkpoint a directory).

    No process group (``no_dist=True``); one ``DefaultStager`` reused across saves, pinned where CUDA is present,
    staging on its own thread. Training must not change the state before staging ended: :class:`DcpBarrier` waits
    for it in ``on_before_optimizer_step``. Saves only: loading is not benchmarked.
    """

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.recorder = recorder
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(cuda, False, True, cuda))
        self.staging: list[tuple[Any, dict[str, Any]]] = []
        self.uploads: list[Any] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Start an asynchronous DCP save of ``checkpoint`` into the directory ``path``."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import async_save

        start = time.perf_counter()
        path = os.fspath(path)
        record = self.recorder.new_checkpoint(path, start)
        record["flush_start"] = start
        writer = FileSystemWriter(path, sync_files=True)
        response: Any = async_save(
            checkpoint, checkpoint_id=path, storage_writer=writer, async_stager=self.stager, no_dist=True
        )
        staged, uploaded = (
            (response.staging_completion, response.upload_completion)
            if hasattr(response, "staging_completion")
            else (None, response)
        )

        def durable(_: Any) -> None:
            record["durable"] = record["written"] = time.perf_counter()

        def copied(_: Any) -> None:
            record["copy_end"] = time.perf_counter()

        uploaded.add_done_callback(durable)
        if staged is None:
            record["copy_end"] = time.perf_counter()
        else:
            staged.add_done_callback(copied)
            self.staging.append((staged, record))
        self.uploads.append(uploaded)
        _saved(self.recorder, record, start)

    def wait_staging(self) -> None:
        """Barrier: wait until no staging still reads the training state."""
        while self.staging:
            staged, record = self.staging.pop(0)
            if not staged.done():
                start = time.perf_counter()
                staged.result()
                self.recorder.waited(record, start, time.perf_counter())
            staged.result()  # raise a staging failure

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        """Not benchmarked."""
        raise NotImplementedError("the dcp benchmark method only saves")

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint directory."""
        shutil.rmtree(os.fspath(path), ignore_errors=True)

    def teardown(self) -> None:
        """Wait for every upload (end of fit), then close the stager."""
        self.wait_staging()
        for upload in self.uploads:
            upload.result()
        self.uploads = []
        self.stager.close()


class DcpBarrier(Callback):
    """Waits for DCP's staging before the optimizer changes the state it reads."""

    def __init__(self, io: DcpAsyncIO) -> None:
        self.io = io

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        """The barrier."""
        self.io.wait_staging()


class BenchDataStatesIO(DataStatesIO):
    """DataStatesIO, timed; ``wait_durable`` (a self-test knob) makes each save wait for its commit, to prove the
    blocked-time gate fails when the lazy path is broken."""

    def __init__(self, recorder: Recorder, wait_durable: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.recorder, self.wait_durable = recorder, wait_durable
        self._records: dict[int, dict[str, Any]] = {}
        self._last: dict[str, Any] | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Capture and return (or, with ``wait_durable``, wait for the commit)."""
        start = time.perf_counter()
        record = self.recorder.new_checkpoint(os.fspath(path), start)
        record["flush_start"] = start
        super().save_checkpoint(checkpoint, path, storage_options)
        if self.wait_durable:
            self.engine.wait_path(os.fspath(path))
        self._records[id(self.stats[-1])] = record
        self._last = record
        _saved(self.recorder, record, start)

    def barrier(self) -> float:
        """The plugin's barrier, timed for the timeline (its engine attributes the wait to a checkpoint)."""
        start = time.perf_counter()
        waited = super().barrier()
        if waited > 0:
            self.recorder.waited(None, start, time.perf_counter())
        return waited

    def finish_records(self) -> None:
        """Copy the engine's per-checkpoint figures into the records (after fit)."""
        for stats in self.stats:
            record = self._records.get(id(stats))
            if record is None:
                continue
            if stats.state != "committed":
                raise RuntimeError(f"DataStatesIO checkpoint {stats.path} ended {stats.state}")
            record["barrier_s"] = stats.barrier_wait_s
            record["copy_end"] = stats.started_at + (stats.copy_s or 0.0)
            record["written"] = record["durable"] = stats.started_at + (stats.durable_s or 0.0)


def _make_model(model: str) -> GPT:
    vocab, dim, layers, heads, seq_len, _ = MODELS[model]
    return GPT(vocab, dim, layers, heads, seq_len)


def _trainer(steps: int, callbacks: list[Callback], plugin: Any | None, accelerator: str) -> L.Trainer:
    return L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=callbacks,
        plugins=[plugin] if plugin is not None else None,
        num_sanity_val_steps=0,
    )


def run_method(method: str, model: str, steps: int, every: int, directory: str, accelerator: str,
               wait_durable: bool = False, options: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Worker: train ``model`` for ``steps`` steps under ``method`` (one of :data:`METHODS`); the measurements.

    ``options`` are keyword arguments of :class:`~lightning_datastates.DataStatesIO` (method ``datastates``).
    """
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    batch_size = MODELS[model][5]
    seq_len = MODELS[model][4]
    vocab = MODELS[model][0]
    tokens = torch.randint(vocab, (steps * batch_size, seq_len + 1), generator=torch.Generator().manual_seed(SEED))
    loader: Any = torch.utils.data.DataLoader(tokens, batch_size=batch_size)  # type: ignore[arg-type]
    # Warm-up: first-call costs (kernels, allocator, imports) land on no measured step.
    L.seed_everything(SEED, verbose=False)
    _trainer(2, [], None, accelerator).fit(_make_model(model), loader)
    gc.collect()
    reset_peak_rss()  # the warm-up's model and optimizer are gone: they must not set the peak
    L.seed_everything(SEED, verbose=False)
    gpt = _make_model(model)
    recorder = Recorder()
    callbacks: list[Callback] = [StepClock(recorder)]
    plugin: Any = None
    fsyncer = Fsyncer()
    if method == "torch":
        plugin = BenchTorchIO(recorder, fsyncer)
    elif method == "async":
        plugin = BenchAsyncIO(recorder)
    elif method == "dcp":
        plugin = DcpAsyncIO(recorder)
        callbacks.append(DcpBarrier(plugin))
    elif method == "datastates":
        plugin = BenchDataStatesIO(recorder, wait_durable, **(options or {}))
    elif method != "none":
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if plugin is not None:
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=every, save_top_k=-1))
    cuda = torch.cuda.is_available() and accelerator in ("auto", "gpu", "cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = _trainer(steps, callbacks, plugin, accelerator)
    started = time.perf_counter()
    trainer.fit(gpt, loader)
    fit_end = time.perf_counter()
    fsyncer.close()
    if isinstance(plugin, BenchDataStatesIO):
        plugin.finish_records()
    rss = peak_rss_bytes()
    for record in recorder.checkpoints:
        record["bytes"] = _size_of(record["path"])
        for key in ("start", "copy_end", "flush_start", "written", "durable"):
            if record.get(key) is not None:
                record[key] -= started
    return {
        "method": method,
        "params": sum(p.numel() for p in gpt.parameters()),
        "fit_s": fit_end - started,
        "train_s": recorder.steps[-1][1] - started,
        "steps": [[a - started, b - started] for a, b in recorder.steps],
        "waits": [[a - started, b - started] for a, b in recorder.waits],
        "checkpoints": recorder.checkpoints,
        "peak_rss_bytes": rss,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }


def reset_peak_rss() -> bool:
    """Reset this process's peak resident memory to its current value (Linux); False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """Peak resident memory since :func:`reset_peak_rss` (Linux ``VmHWM``), else since the process started."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS: a fallback


def _size_of(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path) if os.path.exists(path) else 0


# ---------------------------------------------------------------------------------------------------- parent side
def raw_write_throughput(directory: str, nbytes: int, direct: bool = False) -> float | None:
    """Bytes per second of writing ``nbytes`` sequentially into a new file in ``directory`` (64 MiB ``write``
    calls) and fsyncing it; the file is removed afterwards.

    ``direct``: with ``O_DIRECT`` from a page-aligned buffer (``nbytes`` rounded up to whole 4 KiB blocks), as a
    tool such as ``fio --direct=1`` measures a device; None where the file system refuses it.
    """
    size = min(nbytes, _RAW_CHUNK_BYTES)
    buffer = mmap.mmap(-1, -(-size // 4096) * 4096)  # anonymous mappings are page-aligned
    buffer.write(os.urandom(size))
    block = memoryview(buffer)
    if direct:
        nbytes = -(-nbytes // 4096) * 4096
    path = os.path.join(directory, f".raw-write-{os.getpid()}.bin")
    elapsed: float | None = None
    try:
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0), 0o600)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, block[: min(left, len(block))])
            os.fsync(fd)
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - started  # before the unlink: only the write and the fsync are timed
    except OSError:
        if not direct:
            raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        block.release()
        buffer.close()
    return None if elapsed is None else nbytes / elapsed


def quiet_step_overhead(steps: list[list[float]], checkpoints: list[dict[str, Any]]) -> float | None:
    """The training loop's time over ``len(steps)`` times the median *quiet* step, minus 1; None without 2 quiet steps.

    A quiet step overlaps no checkpoint activity (save call, copy or flush). Measured inside one run, this
    overhead does not move when other processes load the machine differently from one run to the next.
    """
    busy = [
        (c["start"], max(c["start"] + c["call_s"], c.get("copy_end") or 0.0, c.get("durable") or 0.0))
        for c in checkpoints
    ]
    quiet = [b - a for a, b in steps if not any(a < end and start < b for start, end in busy)]
    if len(quiet) < 2 or not steps:
        return None
    return (steps[-1][1] - steps[0][0]) / (statistics.median(quiet) * len(steps)) - 1


def summarize_run(run: dict[str, Any], raw_bps: float | None) -> dict[str, Any]:
    """One method's figures for one round (see the module docstring for their meaning)."""
    row: dict[str, Any] = {"train_s": run["train_s"], "fit_s": run["fit_s"], "peak_rss_bytes": run["peak_rss_bytes"]}
    row["peak_gpu_bytes"] = run["peak_gpu_bytes"]
    cks = run["checkpoints"]
    quiet = quiet_step_overhead(run.get("steps", []), cks)
    if quiet is not None:
        row["quiet_overhead"] = quiet
    if not cks:
        return row
    blocked = [c["call_s"] + c["barrier_s"] for c in cks]
    row.update(blocked_p50_s=statistics.median(blocked), blocked_max_s=max(blocked), checkpoints=len(cks))
    row["bytes"] = statistics.median(c["bytes"] for c in cks)
    durable = [c["durable"] - c["start"] for c in cks if c.get("durable") is not None]
    if durable:
        row["durable_p50_s"] = statistics.median(durable)
    fsyncs = [c["fsync_s"] for c in cks if c.get("fsync_s") is not None]
    if fsyncs:
        row["fsync_p50_s"] = statistics.median(fsyncs)
    rates = [c["bytes"] / (c["durable"] - c["flush_start"]) for c in cks if c.get("durable") is not None]
    if rates:
        row["flush_Bps"] = statistics.median(rates)
        if raw_bps:
            row["flush_vs_raw"] = row["flush_Bps"] / raw_bps
    return row


def combine(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Median over rounds of every per-round figure, per method; overheads (paired by round) and memory ratios
    against ``none``."""
    table: dict[str, dict[str, Any]] = {}
    for method in rounds[0]:
        keys = {k for r in rounds for k in r[method]}
        table[method] = {}
        for key in sorted(keys):
            values = [r[method][key] for r in rounds if r[method].get(key) is not None]
            if values:
                table[method][key] = statistics.median(values)
    none = table.get("none")
    for method, row in table.items():
        if none is not None and method != "none":
            # Paired: each round against that round's own run without checkpoints, then the median. A shared
            # machine drifts over minutes; a ratio of medians would mix a slow round of one with a fast of the other.
            for key, seconds in (("overhead", "train_s"), ("fit_overhead", "fit_s")):
                row[key] = statistics.median(r[method][seconds] / r["none"][seconds] - 1 for r in rounds)
            if row.get("bytes"):
                row["extra_rss_per_ckpt"] = (row["peak_rss_bytes"] - none["peak_rss_bytes"]) / row["bytes"]
            if row.get("peak_gpu_bytes") is not None and none.get("peak_gpu_bytes") is not None:
                row["extra_gpu_bytes"] = row["peak_gpu_bytes"] - none["peak_gpu_bytes"]
    return table


def markdown(table: dict[str, dict[str, Any]], header: str) -> str:
    """The report as a markdown table (see the module docstring for the columns)."""

    def f(row: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
        value = row.get(key)
        return "-" if value is None else format(value * scale, fmt)

    gpu = any(row.get("extra_gpu_bytes") is not None for row in table.values())
    cols = ["method", "train s", "overhead", "quiet overhead", "fit s", "fit overhead", "blocked p50 ms",
            "blocked max ms",
            "durable p50 s", "fsync p50 s", "flush MB/s", "vs raw", "peak RSS GB", "extra/ckpt"]  # fmt: skip
    if gpu:
        cols.append("extra GPU GB")
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for method, row in table.items():
        cells = [
            method, f(row, "train_s", ".2f"), f(row, "overhead", "+.1%"), f(row, "quiet_overhead", "+.1%"),
            f(row, "fit_s", ".2f"),
            f(row, "fit_overhead", "+.1%"), f(row, "blocked_p50_s", ".1f", 1e3), f(row, "blocked_max_s", ".1f", 1e3),
            f(row, "durable_p50_s", ".2f"), f(row, "fsync_p50_s", ".2f"), f(row, "flush_Bps", ".0f", 1 / _MB),
            f(row, "flush_vs_raw", ".2f"), f(row, "peak_rss_bytes", ".2f", 1e-9), f(row, "extra_rss_per_ckpt", ".2f"),
        ]  # fmt: skip
        if gpu:
            cells.append(f(row, "extra_gpu_bytes", ".2f", 1e-9))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_timeline(runs: dict[str, dict[str, Any]], path: str) -> bool:
    """Draw each method's steps, blocked waits and each checkpoint's copy and flush phases; False without
    matplotlib (a message says how to install it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("timeline skipped: matplotlib is not installed (pip install 'lightning-datastates[bench]')")
        return False
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.4 * len(runs) + 1), sharex=True, squeeze=False)
    for ax, (method, run) in zip(axes[:, 0], runs.items(), strict=True):
        for i, (a, b) in enumerate(run["steps"]):
            ax.broken_barh([(a, b - a)], (2, 0.8), color="0.55" if i % 2 else "0.75")
        for c in run["checkpoints"]:
            blocked = (c["start"], c["call_s"])
            ax.broken_barh([blocked], (2, 0.8), color="tab:red")
            if c.get("copy_end") is not None:
                ax.broken_barh([(c["start"], c["copy_end"] - c["start"])], (1, 0.8), color="tab:orange")
            if c.get("durable") is not None:
                ax.broken_barh([(c["flush_start"], c["durable"] - c["flush_start"])], (0, 0.8), color="tab:blue")
        for a, b in run["waits"]:
            ax.broken_barh([(a, b - a)], (2, 0.8), color="darkred")
        ax.set_yticks([0.4, 1.4, 2.4], ["flush", "copy", "steps"])
        ax.set_ylabel(method, rotation=0, ha="right", va="center")
    axes[-1, 0].set_xlabel("seconds since fit started (red: training blocked by a checkpoint)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_datastates.benchmark",
        description="Train one model under each checkpointing method in turn and compare what each costs.",
    )
    parser.add_argument("--model", choices=list(MODELS), help="GPT size (default 40M; 6M with --short)")
    parser.add_argument("--steps", type=int, help="training steps per run (default 16; 12 with --short)")
    parser.add_argument("--every", type=int, help="checkpoint every N steps (default 4; 3 with --short)")
    parser.add_argument("--rounds", type=int, help="repeats; figures are medians over them (default 3; 1 --short)")
    parser.add_argument("--dir", help="target directory for checkpoints (default: a new temporary directory)")
    parser.add_argument("--out", default=".", help="where benchmark.md/.json/.png go (default: current directory)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator (default auto)")
    parser.add_argument("--short", action="store_true", help="tiny model, few steps: a CI regression check")
    parser.add_argument(
        "--max-blocked-vs-sync",
        type=float,
        help="exit 1 if DataStatesIO's median blocked time per checkpoint exceeds this times TorchCheckpointIO's",
    )
    parser.add_argument(
        "--datastates",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a DataStatesIO argument for the datastates method, e.g. writer_threads=2 (repeatable)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG timeline")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one method, write JSON to --result
    parser.add_argument("--result", help=argparse.SUPPRESS)
    # Self-test of the gate (benchmark only): DataStatesIO waits for durability inside save_checkpoint.
    parser.add_argument("--selftest-wait-durable", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = args.model or ("6M" if args.short else "40M")
    args.steps = args.steps or (12 if args.short else 16)
    args.every = args.every or (3 if args.short else 4)
    args.rounds = args.rounds or (1 if args.short else 3)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if not 1 <= args.every <= args.steps:
        parser.error(f"--every must be between 1 and --steps ({args.steps}), got {args.every}")
    _options(args.datastates)  # fail early on a malformed pair
    if args.max_blocked_vs_sync is not None and not {"torch", "datastates"} <= set(args.methods):
        parser.error("--max-blocked-vs-sync needs the methods torch and datastates")
    return args


def _options(pairs: list[str]) -> dict[str, Any]:
    """``["writer_threads=2", "chunk_size=32MiB", "serve_from_memory=false"]`` ->
    ``{"writer_threads": 2, "chunk_size": "32MiB", "serve_from_memory": False}``: values read as in a yaml config."""
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--datastates expects NAME=VALUE, got {pair!r}")
        options[name.strip()] = yaml.safe_load(value) if value.strip() else ""
    return options


def _worker_main(args: argparse.Namespace) -> int:
    result = run_method(
        args.worker,
        args.model,
        args.steps,
        args.every,
        args.dir,
        args.accelerator,
        args.selftest_wait_durable,
        _options(args.datastates),
    )
    with open(args.result, "w") as out:
        json.dump(result, out)
    return 0


def _spawn(args: argparse.Namespace, method: str, directory: str, result_path: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "lightning_datastates.benchmark", "--worker", method, "--result", result_path,
               "--model", args.model, "--steps", str(args.steps), "--every", str(args.every), "--dir", directory,
               "--accelerator", args.accelerator]  # fmt: skip
    if args.selftest_wait_durable:
        command.append("--selftest-wait-durable")
    for option in args.datastates:
        command += ["--datastates", option]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"method {method} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    with open(result_path) as result:
        run: dict[str, Any] = json.load(result)
    return run


def method_order(methods: list[str], round_index: int) -> list[str]:
    """The order in which round ``round_index`` (from 0) runs ``methods``: as given, reversed in every other round.

    The speed of a shared machine drifts over minutes; in a fixed order the methods that run late in each round
    would pay for a slowdown more often than those that run early, and paired overheads would be biased. An even
    number of rounds balances the two orders exactly.
    """
    return list(methods) if round_index % 2 == 0 else list(reversed(methods))


def main(argv: list[str] | None = None) -> int:
    """Run every method ``--rounds`` times, report, plot, apply the gate; the exit status."""
    args = parse_args(argv)
    if args.worker:
        return _worker_main(args)
    os.makedirs(args.out, exist_ok=True)
    base = args.dir or tempfile.mkdtemp(prefix="datastates-bench-")
    os.makedirs(base, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="datastates-bench-results-")
    rounds: list[dict[str, dict[str, Any]]] = []
    last_runs: dict[str, dict[str, Any]] = {}
    raw: list[float] = []  # per round: the faster of buffered and direct writes
    raw_by_kind: dict[str, list[float]] = {"buffered": [], "direct": []}
    params = 0
    print(
        f"benchmark: GPT {args.model}, {args.steps} steps, a checkpoint every {args.every}, {args.rounds} round(s), "
        f"methods {', '.join(args.methods)}; checkpoints in {base}"
    )
    try:
        for index in range(args.rounds):
            runs: dict[str, dict[str, Any]] = {}
            for method in method_order(args.methods, index):
                directory = os.path.join(base, f"r{index}-{method}")
                runs[method] = _spawn(args, method, directory, os.path.join(scratch, f"{index}-{method}.json"))
                params = runs[method]["params"]
                nbytes = max((c["bytes"] for c in runs[method]["checkpoints"]), default=0)
                if not args.keep:
                    shutil.rmtree(directory, ignore_errors=True)
                if nbytes and len(raw) <= index:  # same bytes, same target, same round
                    measured = {k: raw_write_throughput(base, nbytes, direct=k == "direct") for k in raw_by_kind}
                    for kind, bps in measured.items():
                        if bps is not None:
                            raw_by_kind[kind].append(bps)
                    raw.append(max(bps for bps in measured.values() if bps is not None))
                blocked = [c["call_s"] + c["barrier_s"] for c in runs[method]["checkpoints"]]
                print(
                    f"  round {index + 1} {method:<10} train {runs[method]['train_s']:6.2f} s, "
                    f"blocked p50 {(statistics.median(blocked) * 1e3 if blocked else 0):8.1f} ms"
                )
            runs = {m: runs[m] for m in args.methods}  # reported in the order asked for
            rounds.append({m: summarize_run(r, raw[index] if len(raw) > index else None) for m, r in runs.items()})
            last_runs = runs
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.dir and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    table = combine(rounds)
    sizes = [row["bytes"] for row in table.values() if row.get("bytes")]
    raw_text = "-"
    if raw:
        kinds = ", ".join(f"{k} {statistics.median(v) / _MB:.0f}" for k, v in raw_by_kind.items() if v)
        raw_text = f"{statistics.median(raw) / _MB:.0f} MB/s (the faster of {kinds}: 'vs raw' is against it)"
    header = (
        f"GPT {args.model} ({params / 1e6:.1f}M parameters), {args.steps} steps, checkpoint every {args.every} "
        f"({(statistics.median(sizes) if sizes else 0) / 1e9:.2f} GB), median of {args.rounds} round(s); "
        f"raw write+fsync of the target: {raw_text}; {os.cpu_count()} CPUs, 1 training thread"
    )
    report = markdown(table, header)
    print("\n" + report)
    with open(os.path.join(args.out, "benchmark.md"), "w") as out:
        out.write(report)
    with open(os.path.join(args.out, "benchmark.json"), "w") as out:
        json.dump({"args": vars(args), "raw_write_Bps": raw, "raw_write_Bps_by_kind": raw_by_kind, "table": table,
                   "rounds": rounds, "last_round_runs": last_runs}, out, indent=1)  # fmt: skip
    if not args.no_plot and plot_timeline(last_runs, os.path.join(args.out, "benchmark.png")):
        print(f"timeline: {os.path.join(args.out, 'benchmark.png')}")
    if args.max_blocked_vs_sync is not None:
        ours, sync = table["datastates"].get("blocked_p50_s"), table["torch"].get("blocked_p50_s")
        if ours is None or not sync:
            print("gate: no checkpoints to compare", file=sys.stderr)
            return 1
        ratio = ours / sync
        verdict = "OK" if ratio <= args.max_blocked_vs_sync else "FAILED"
        print(f"gate: DataStatesIO blocked / TorchCheckpointIO blocked = {ratio:.3f} (max {args.max_blocked_vs_sync}) "
              f"{verdict}")  # fmt: skip
        if verdict != "OK":
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
