"""Shared pieces for the Trainer-level tests: a small BatchNorm model, bit-exact comparison, fault injection."""

from __future__ import annotations

import atexit
import copy
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import DataStatesIO
from lightning_datastates.copy import copier as copier_module
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.storage.local import TEMP_SUFFIX, LocalWriter, LocalWriteSession
from lightning_datastates.write import loop as write_loop_module

_O_TMPFILE = getattr(os, "O_TMPFILE", None)

# A local tier is remembered in the user's cache directory (tiered/recovery.py, note_tier_used): the tests' tiers go to
# a cache directory of this test process's own, removed at its exit; the processes it launches inherit it (and keep it:
# a test may set another).
if "LIGHTNING_DATASTATES_TESTS_CACHE" not in os.environ:
    os.environ["XDG_CACHE_HOME"] = os.environ["LIGHTNING_DATASTATES_TESTS_CACHE"] = tempfile.mkdtemp(
        prefix="lightning-datastates-tests-cache-"
    )
    atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)


class BNModel(L.LightningModule):
    """MLP with BatchNorm (buffers change in every training forward), AdamW and a per-step LR scheduler."""

    def __init__(self, width: int = 256, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, width),
            torch.nn.BatchNorm1d(width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 1),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.hparams.fail_at_step is not None and self.global_step == self.hparams.fail_at_step:
            raise RuntimeError("boom in training_step")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_loader(n: int = 64, batch_size: int = 8, seed: int = 0) -> torch.utils.data.DataLoader:
    """Deterministic synthetic regression data."""
    generator = torch.Generator().manual_seed(seed)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(n, 32, generator=generator), torch.randn(n, 1, generator=generator)
    )
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)


def make_trainer(tmp_dir: str, plugin: Any | None, callbacks: list[Any] | None = None, **kwargs: Any) -> L.Trainer:
    """A quiet CPU Trainer checkpointing into ``tmp_dir`` (two epochs unless told otherwise)."""
    return quiet_trainer(tmp_dir, [plugin] if plugin is not None else [], callbacks, **{"max_epochs": 2, **kwargs})


def every_step_checkpoint(dirpath: str, **kwargs: Any) -> ModelCheckpoint:
    """ModelCheckpoint saving every train step, all kept, plus last.ckpt."""
    options: dict[str, Any] = dict(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1, save_last=True)
    options.update(kwargs)
    return ModelCheckpoint(**options)


class RecordingDataStatesIO(DataStatesIO):
    """DataStatesIO that first records a synchronous deep copy of every checkpoint, keyed by path.

    The copy is taken on the training thread at the moment of the save call: the reference every file must equal.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: dict[str, Any] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.recorded[os.fspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def storage_bytes(storage: torch.UntypedStorage) -> bytes:
    """All bytes of a host ``storage``, as the copier and the writers see them."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()


def assert_bit_equal(actual: Any, expected: Any, where: str = "checkpoint") -> None:
    """Recursively compare containers and tensors; tensors must match in dtype, shape and every byte."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        a = actual.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        b = expected.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        assert torch.equal(a, b), f"{where}: tensor bytes differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected a dict, got {type(actual).__name__}"
        assert list(actual.keys()) == list(expected.keys()), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_bit_equal(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), f"{where}: {actual!r} != {expected!r}"
        for index, (a_item, e_item) in enumerate(zip(actual, expected)):
            assert_bit_equal(a_item, e_item, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def dead_pid() -> int:
    """The pid of a process of this host that has ended (leftovers naming it belong to a dead writer)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def temp_files(directory: str) -> list[str]:
    """Temporary files of in-flight (or crashed) writes under ``directory``."""
    found = []
    for root, _, names in os.walk(directory):
        found += [os.path.join(root, n) for n in names if n.endswith(TEMP_SUFFIX)]
    return found


@pytest.fixture
def slow_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every host copy, and every write straight from host tensors, take 2 ms longer: they then reliably
    outlast a training step of these tiny models.

    Real copies of large models take longer than a step; this recreates that at precise points (the copier, and the
    writer taking a write-through chunk's source bytes), without touching the logic under test.
    """
    original = copier_module.CpuCopier.copy_pieces
    original_host_bytes = write_loop_module._host_bytes

    def slow_copy(self: Any, block: torch.Tensor, pieces: Any, sources: Any, mark: Any) -> dict[int, Any]:
        crcs = {}
        for piece in pieces:  # each piece 2 ms later
            time.sleep(0.002)
            crcs.update(original(self, block, [piece], sources, mark))  # the CRCs computed on the way, as without
        return crcs

    def slow_host_bytes(storage: torch.UntypedStorage, offset: int, nbytes: int) -> memoryview:
        time.sleep(0.002)
        return original_host_bytes(storage, offset, nbytes)

    monkeypatch.setattr(copier_module.CpuCopier, "copy_pieces", slow_copy)
    monkeypatch.setattr(write_loop_module, "_host_bytes", slow_host_bytes)


class GatedWriter(LocalWriter):
    """LocalWriter whose sessions hold every ``write_range`` until ``gate`` is set (or fail on the Nth write)."""

    def __init__(self, fail_on_write: int | None = None, delay_s: float = 0.0) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on_write = fail_on_write
        self.delay_s = delay_s
        self.writes = 0
        self._lock = threading.Lock()

    def begin(self, path: str, total_bytes: int) -> LocalWriteSession:
        session = super().begin(path, total_bytes)
        writer = self

        class _Session(LocalWriteSession):
            # Gated or delayed writes model slow storage: lazy chunks go through the arena, never straight from the
            # training tensors (a barrier would wait for the gate).
            fast_writes = False

            def write_range(self, offset: int, data: memoryview) -> None:
                writer.gate.wait(timeout=30)
                if writer.delay_s:
                    time.sleep(writer.delay_s)
                with writer._lock:
                    writer.writes += 1
                    failing = writer.writes == writer.fail_on_write
                if failing:
                    raise OSError(28, "No space left on device (injected)")
                super().write_range(offset, data)

        return _Session(session.path, session.temp_path, session._fd)  # type: ignore[arg-type]


@pytest.fixture
def refused_unnamed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every ``O_TMPFILE`` open fail as on a file system without unnamed files (NFS); returns the directories
    it was tried in, one entry per try. Other opens are untouched."""
    tried: list[str] = []
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if _O_TMPFILE is not None and flags & _O_TMPFILE == _O_TMPFILE:
            tried.append(os.fspath(path))
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    return tried


@pytest.fixture
def gated_writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedWriter]:
    """Route the plugin's local writes through a :class:`GatedWriter` (faults at a precise point)."""
    writer = GatedWriter()
    monkeypatch.setattr("lightning_datastates.pipeline.writer_for", lambda path, storage_options=None, **_: writer)
    yield writer
    writer.gate.set()  # a test that failed with the gate closed must not hold the writer threads (and exit)


class BackgroundOwner:
    """Stands in for the callback inside fit's training loop, for tests of the plugin on its own.

    With it, saves return before the flush (as during training); ``lazy=True`` also lets every tensor be copied
    after the save call returns (the test then calls ``pipeline_of(plugin).barrier()`` itself where the callback
    would).
    """

    in_training_loop = True

    def __init__(self, lazy: bool = False) -> None:
        self.lazy = lazy

    def lazy_predicate(self) -> Any:
        return (lambda storage: True) if self.lazy else None


def in_background(plugin: DataStatesIO, lazy: bool = False) -> DataStatesIO:
    """``plugin`` driven as inside a training loop (see :class:`BackgroundOwner`)."""
    pipeline_of(plugin).attach(BackgroundOwner(lazy))
    return plugin


# ---------------------------------------------------------------------------------------------------------- features
def file_mismatches(plugin: RecordingDataStatesIO, removed: Any = ()) -> list[str]:
    """Every recorded checkpoint compared with its file; one message per file that differs (or is missing).

    ``removed``: paths that were deliberately removed (top-k); they must be absent.
    """
    failures = [f"{os.path.basename(p)}: not removed" for p in removed if os.path.exists(p)]
    for path, expected in plugin.recorded.items():
        if path in removed:
            continue
        if not os.path.exists(path):
            failures.append(f"{os.path.basename(path)}: missing")
            continue
        loaded = torch.load(path, map_location="cpu", weights_only=False)
        try:
            assert_bit_equal(loaded, expected, os.path.basename(path))
        except AssertionError as exc:
            failures.append(str(exc))
    return failures


def quiet_trainer(tmp_dir: str, plugins: list[Any], callbacks: list[Any] | None = None, **kwargs: Any) -> L.Trainer:
    """Like :func:`make_trainer`, with any list of plugins (a precision plugin next to the CheckpointIO)."""
    options: dict[str, Any] = dict(
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_dir,
        accelerator="cpu",
        deterministic=True,
    )
    options.update(kwargs)
    return L.Trainer(plugins=plugins, callbacks=callbacks, **options)


def recording_plugin() -> RecordingDataStatesIO:
    """A recording plugin with small chunks: many copies per checkpoint, still running at the next barrier."""
    return RecordingDataStatesIO(chunk_size="64KiB", eager_copy_size="1KiB")


#: Tests that `.ci/run` runs alone, after the others have run two at a time (pytest-xdist): each either occupies both
#: cores by itself (two or four real ranks training) or asserts an order of events that another test's load could
#: change (a copy still running at a barrier, a broken variant that must be caught, a stall noticed within seconds).
#: Not here, although long: the DDP runs of test_strategies.py and the arena-full skip test mostly wait for writes
#: slowed on purpose (20% and 12% of one core, measured with /usr/bin/time), and their assertions are about files,
#: names and skips, which a slower step does not change.
SERIAL_MODULES = frozenset(
    {
        "test_sharded.py",
        "test_contract.py",
        "test_s3.py",
        "test_faults_s3.py",
        "test_write_through.py",
        "test_crash_trial.py",
    }
)
SERIAL_TESTS = frozenset(
    {
        "test_benchmark.py::test_sharded_benchmark_runs_every_method_over_two_ranks",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`SERIAL_MODULES` and :data:`SERIAL_TESTS` ``serial``."""
    for item in items:
        module = item.path.name
        if module in SERIAL_MODULES or f"{module}::{item.name}" in SERIAL_TESTS:
            item.add_marker(pytest.mark.serial)
