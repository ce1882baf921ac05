"""One method's measured training run: the body of each worker subprocess, and its peak-memory probes.

:mod:`lightning_datastates.benchmark.runner` starts ``python -m lightning_datastates.benchmark --worker METHOD
--result PATH ...`` once per method and round (clean peak RSS, no cross-talk between methods);
:func:`worker_main` runs :func:`run_method` on that process's main thread, which is Lightning's training thread, with
one torch compute thread (the other cores are left to checkpointing, as a GPU node leaves its CPU free), and writes
the measurements as JSON to ``PATH``. Times in the result are seconds since ``fit`` started.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import resource
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_datastates._gpt import GPT
from lightning_datastates.benchmark.choices import MODELS, SEED
from lightning_datastates.benchmark.methods import BenchDataStatesIO, plugin_for
from lightning_datastates.benchmark.options import datastates_options
from lightning_datastates.benchmark.recording import Fsyncer, Recorder, StepClock, is_local
from lightning_datastates.benchmark.resume import time_resume
from lightning_datastates.benchmark.targets import is_s3


def _make_model(model: str) -> GPT:
    vocab, dim, layers, heads, seq_len, _ = MODELS[model]
    return GPT(vocab, dim, layers, heads, seq_len)


def _trainer(steps: int, callbacks: list[Callback], plugin: Any | None, accelerator: str) -> L.Trainer:
    on_gpu = torch.cuda.is_available() and accelerator in ("auto", "gpu", "cuda")
    return L.Trainer(
        accelerator=accelerator,
        devices=1,
        # On a GPU as LLMs train there (fp32 weights and Adam moments in the checkpoint either way).
        precision="bf16-mixed" if on_gpu else "32-true",
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
               wait_durable: bool = False, options: dict[str, Any] | None = None, local_tier: str | None = None,
               resume: bool = False) -> dict[str, Any]:  # fmt: skip
    """Worker: train ``model`` for ``steps`` steps under ``method`` (one of
    :data:`~lightning_datastates.benchmark.choices.METHODS`); the measurements.

    Checkpoints go to ``directory`` (a directory or an ``s3://`` prefix) through
    ``ModelCheckpoint(every_n_train_steps=every, save_top_k=-1)``. ``options`` are keyword arguments of
    :class:`~lightning_datastates.DataStatesIO` (methods ``datastates`` and ``tiered``); ``local_tier`` is the local
    tier of ``tiered``, and ``resume`` times loads of its last checkpoint from each tier after the fit
    (:mod:`~lightning_datastates.benchmark.resume`).
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
    fsyncer = Fsyncer()
    plugin, method_callbacks = plugin_for(method, recorder, fsyncer, wait_durable, options, local_tier)
    callbacks: list[Callback] = [StepClock(recorder), *method_callbacks]
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
        if "bytes" not in record:  # tiered: set from the plugin's own figures (its local copies may be gone)
            record["bytes"] = _size_of(record["path"])
        for key in ("start", "copy_end", "flush_start", "written", "durable", "persistent_durable"):
            if record.get(key) is not None:
                record[key] -= started
    resumed = None
    if resume and local_tier is not None and recorder.checkpoints:
        last = recorder.checkpoints[-1]
        resumed = time_resume(last["path"], last["local_path"], local_tier, options or {})
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
        "s3_transfer": _s3_transfer(directory, options or {}),
        "resume": resumed,
    }


def worker_main(args: argparse.Namespace) -> int:
    """``--worker METHOD --result PATH``: run one method as the parsed command line says; its JSON into ``PATH``."""
    result = run_method(
        args.worker,
        args.model,
        args.steps,
        args.every,
        args.dir,
        args.accelerator,
        args.selftest_wait_durable,
        datastates_options(args.datastates),
        args.local_tier,
        args.resume,
    )
    with open(args.result, "w") as out:
        json.dump(result, out)
    return 0


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


def resident_bytes(address: int, nbytes: int) -> int | None:
    """How many bytes of the memory range ``[address, address + nbytes)`` are resident, whole pages counted
    (``mincore``, Linux and other Unixes); None where that cannot be asked. Pages of anonymous memory stay resident
    once written until the memory is freed (no swap), so for a buffer that frees nothing this is also its peak."""
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    length = address + nbytes - start
    pages = (length + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if mincore(start, length, vector) != 0:
        return None
    return sum(entry & 1 for entry in vector) * page


def process_cpu_s() -> float:
    """CPU seconds (user and system) every thread of this process has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _s3_transfer(directory: str, options: dict[str, Any]) -> list[int] | None:
    """At an ``s3://`` target: the part size and the parts in flight of the plugin's S3 writer with these
    ``options`` (the parent's raw upload uses the same); else None."""
    if not is_s3(directory):
        return None
    from lightning_datastates.storage.s3.writer import S3Writer  # s3fs: only at an s3:// target

    writer = S3Writer.from_storage_options(options.get("storage_options"))
    return list(writer.copy_shape(writer.part_size_bytes, writer.max_concurrent_parts))


def _size_of(path: str) -> int:
    if not is_local(path):
        import fsspec  # comes with Lightning; the s3fs behind it reads the AWS_* variables

        fs, stripped = fsspec.core.url_to_fs(path)
        fs.invalidate_cache()  # the listing cached before the save does not have the new file
        try:
            return int(fs.du(stripped))
        except FileNotFoundError:
            return 0
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return os.path.getsize(path) if os.path.exists(path) else 0
