"""Pieces shared by the scripts that tests launch as real processes (DDP ranks, interrupted runs) and by their tests.

A script records, on disk, the state each checkpoint must hold: a deep copy taken on the training thread at the
save call, written to ``<out>/ref/<name>`` only once the save call *returned* (a reference exists exactly for the
saves the caller was told had succeeded). The test then compares every checkpoint file with its reference, bit
for bit.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import types
from collections.abc import Collection
from typing import Any

import torch

import lightning_datastates.callback as callback_module
import lightning_datastates.pipeline as pipeline_module
from lightning_datastates import DataStatesIO
from lightning_datastates.compat.lightning import checkpoint_path_str
from lightning_datastates.snapshot import threads as threads_module
from lightning_datastates.snapshot.engine import SnapshotEngine

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ReferenceRecordingIO(DataStatesIO):
    """DataStatesIO that writes a synchronous copy of every checkpoint to ``reference_dir`` once the save returned."""

    def __init__(self, reference_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reference_dir = reference_dir

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        expected = copy.deepcopy(checkpoint)  # the state at the save call, before training goes on
        super().save_checkpoint(checkpoint, path, storage_options)
        os.makedirs(self.reference_dir, exist_ok=True)
        reference = os.path.join(self.reference_dir, os.path.basename(checkpoint_path_str(path)))
        torch.save(expected, reference + ".tmp")  # plain synchronous save of the copy, renamed when whole
        os.replace(reference + ".tmp", reference)


class SaveCountingIO(ReferenceRecordingIO):
    """Prints ``saved <n>`` once each save returned (the test reads how many saves the run made)."""

    saves = 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        SaveCountingIO.saves += 1
        print(f"saved {SaveCountingIO.saves}", flush=True)


def slowed_steps(model_class: type[Any], delay_s: float = 0.05) -> type[Any]:
    """``model_class`` whose training steps take ``delay_s`` longer, as real ones do: the run is still training
    when a signal comes."""
    import time

    class SlowModel(model_class):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            time.sleep(delay_s)
            return super().training_step(batch, batch_idx)

    return SlowModel


def slow_local_writes(delay_s: float) -> None:
    """Make every range the plugin writes (to local paths) wait ``delay_s``: flushes then outlast a few steps."""
    from tests.conftest import GatedWriter

    writer = GatedWriter(delay_s=delay_s)
    pipeline_module.writer_for = lambda path, storage_options=None, **_: writer  # type: ignore[assignment]


def break_draining() -> None:
    """The broken variant: no drain, no teardown, no wait for a path, daemon threads (the tests must then fail)."""
    DataStatesIO.drain = lambda self: None  # type: ignore[method-assign]
    DataStatesIO.teardown = lambda self: None  # type: ignore[method-assign]
    SnapshotEngine.drain = lambda self: None  # type: ignore[method-assign]  # the callback's and the pipeline's too
    SnapshotEngine.close = lambda self: None  # type: ignore[method-assign]
    SnapshotEngine.wait_path = lambda self, path: None  # type: ignore[method-assign]
    callback_module.drain_on_interrupt = lambda trainer, engine, exception: False  # type: ignore[attr-defined]
    callback_module.drain_with_progress = lambda trainer, plugin: None  # type: ignore[attr-defined]
    daemon_threading = types.SimpleNamespace(**vars(threading))
    daemon_threading.Thread = lambda *a, **k: threading.Thread(*a, **{**k, "daemon": True})
    threads_module.threading = daemon_threading  # type: ignore[attr-defined]


def endless_fit_trainer(out: str, plugin: Any, callbacks: list[Any], max_steps: int = 1000, **kwargs: Any) -> Any:
    """The Trainer of a script's run: on the CPU, ``max_steps`` steps (by default until the script is stopped),
    no logger, validation or model summary, ``default_root_dir=out``; ``kwargs`` override (``enable_progress_bar``)."""
    import lightning as L

    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_steps": max_steps,
        "max_epochs": -1,
        "plugins": [plugin],
        "callbacks": callbacks,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "default_root_dir": out,
    }
    return L.Trainer(**{**settings, **kwargs})


def datastates_threads(since: Collection[threading.Thread] = ()) -> list[str]:
    """Names of this process's live threads of the package, those in ``since`` left out (threads that were running
    before a test began: other tests in the same worker may leave plugins they never tore down)."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("datastates-") and t not in since)


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON, atomically (a reader never sees half a report)."""
    with open(path + ".tmp", "w") as handle:
        json.dump(data, handle)
    os.replace(path + ".tmp", path)


#: Set by Lightning in the process of an in-process distributed fit (``LOCAL_RANK`` among them): a launched script
#: that inherited them would take itself for an already launched rank and never start the others.
_RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a launched script: this checkout first on the path, quiet, single-threaded torch, and no
    rank variables left by an earlier in-process distributed fit."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def launch(script: str, *args: str, **env: str) -> subprocess.Popen[str]:
    """Start ``tests/<script>`` with ``args`` in a new process (stdout piped, stderr merged into it)."""
    return subprocess.Popen(
        [sys.executable, os.path.join(REPO_ROOT, "tests", script), *args],
        env=script_env(**env),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_to_completion(script: str, *args: str, timeout_s: float, what: str, **env: str) -> str:
    """Run ``tests/<script>`` like :func:`launch` with a fresh ``MASTER_PORT``, wait for it, fail the test (naming
    ``what``, with the end of its output) if it hangs past ``timeout_s`` or exits non-zero; its output."""

    from tests.s3_server import free_port

    process = launch(script, *args, MASTER_PORT=str(free_port()), **env)
    output = output_of(process, timeout_s, what)
    assert process.returncode == 0, f"{what} run failed:\n{output[-4000:]}"
    return output


def output_of(process: subprocess.Popen[str], timeout_s: float, what: str) -> str:
    """The output of ``process`` once it ended; the test fails (naming ``what``, with the end of the output) if it
    runs past ``timeout_s`` (it is killed then)."""
    import pytest

    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"{what} run hung:\n{output[-4000:]}")
    return output
