"""What the rest of Lightning sees of the package (issue: Lightning's own tests run with ``DataStatesIO`` as default).

Each test reproduces one difference that Lightning's test modules found, through a real Trainer:

- a Trainer without the plugin carries nothing of ours (``test_callback_connector.py``: callbacks are Lightning's own);
- a save outside the training loop leaves no thread running (Lightning's leftover-thread check after each test), nor
  does ``AsyncCheckpointIO(DataStatesIO())`` once fit ended;
- the ``datastates/*`` rows reach the loggers only at the steps where Lightning logs (``test_log_every_n_steps``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from lightning_datastates import DataStatesCallback, DataStatesIO
from tests.conftest import BNModel, every_step_checkpoint, make_loader, make_trainer, quiet_trainer
from tests.script_support import datastates_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ours(trainer: L.Trainer) -> list[DataStatesCallback]:
    return [callback for callback in trainer.callbacks if isinstance(callback, DataStatesCallback)]


@pytest.fixture
def new_threads_of_ours() -> Callable[[], list[str]]:
    """The threads of this package started since the test began and still running (threads that other tests in the
    same worker left behind, with plugins they never tore down, are not this test's)."""
    before = set(threading.enumerate())
    return lambda: datastates_threads(since=before)


# ---------------------------------------------------------------------------------------------- the callback list
def test_a_trainer_without_the_plugin_sees_nothing_of_the_package(tmp_path, caplog):
    DataStatesIO()  # a plugin made elsewhere in the process installs its hooks: they must leave this Trainer alone
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "c"))
    with caplog.at_level(logging.INFO):
        trainer = quiet_trainer(str(tmp_path), [TorchCheckpointIO()], callbacks=[checkpoint], max_steps=2)
    assert _ours(trainer) == []
    assert "entry point" not in caplog.text
    trainer.fit(BNModel(width=16), make_loader(n=16))
    assert _ours(trainer) == [] and trainer.callbacks[-1] is checkpoint  # checkpoint callbacks stay last


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "in-AsyncCheckpointIO"])
def test_a_trainer_given_the_plugin_gets_one_callback_first(tmp_path, wrapped):
    plugin = DataStatesIO()
    trainer = make_trainer(str(tmp_path), AsyncCheckpointIO(plugin) if wrapped else plugin)
    assert len(_ours(trainer)) == 1 and trainer.callbacks[0] is _ours(trainer)[0]
    trainer.fit(BNModel(width=16), make_loader(n=16))
    assert len(_ours(trainer)) == 1  # fit's own attachment of callbacks adds none


def test_a_callback_passed_explicitly_is_the_only_one(tmp_path):
    explicit = DataStatesCallback()
    trainer = make_trainer(str(tmp_path), DataStatesIO(), callbacks=[explicit])
    assert _ours(trainer) == [explicit]


def test_a_plugin_set_on_the_strategy_after_init_gets_its_callback_at_fit(tmp_path):
    trainer = make_trainer(str(tmp_path), None, callbacks=[every_step_checkpoint(str(tmp_path / "c"))], max_steps=3)
    assert _ours(trainer) == []
    plugin = DataStatesIO()
    trainer.strategy.checkpoint_io = plugin
    trainer.fit(BNModel(width=16), make_loader(n=16))
    assert len(_ours(trainer)) == 1
    assert {stats.path.rsplit("/", 1)[-1] for stats in plugin.stats} >= {"last.ckpt"}


# ---------------------------------------------------------------------------------------------- threads
def test_a_save_outside_the_training_loop_leaves_no_thread_running(tmp_path, new_threads_of_ours):
    plugin = DataStatesIO()
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[every_step_checkpoint(str(tmp_path / "c"))], max_steps=3)
    trainer.fit(BNModel(width=16), make_loader(n=16))
    assert new_threads_of_ours() == []  # the end of fit tears the plugin down
    path = tmp_path / "after_fit.ckpt"
    trainer.save_checkpoint(path)
    assert (
        new_threads_of_ours() == []
    )  # as TorchCheckpointIO: the call returns with the file committed, nothing running
    assert torch.load(path, weights_only=False)["global_step"] == 3
    plugin.save_checkpoint({"state_dict": {"w": torch.ones(4)}}, str(tmp_path / "plain.ckpt"))  # the plugin alone
    assert new_threads_of_ours() == []


def test_async_checkpoint_io_around_the_plugin_leaves_no_thread_after_fit(tmp_path, new_threads_of_ours):
    plugin = DataStatesIO()
    trainer = make_trainer(
        str(tmp_path), AsyncCheckpointIO(plugin), callbacks=[every_step_checkpoint(str(tmp_path / "c"))], max_steps=4
    )
    trainer.fit(BNModel(width=16), make_loader(n=32))
    assert new_threads_of_ours() == []
    assert (tmp_path / "c" / "last.ckpt").exists()


# ---------------------------------------------------------------------------------------------- loggers
class _RecordingLogger(Logger):
    """Every ``log_metrics`` call, in order: (step, keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, set[str]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, set(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


@pytest.mark.parametrize("log_every_n_steps", [1, 3])
def test_checkpoint_rows_reach_the_loggers_only_where_lightning_logs(tmp_path, log_every_n_steps):
    logger = _RecordingLogger()
    trainer = make_trainer(
        str(tmp_path),
        DataStatesIO(),
        callbacks=[every_step_checkpoint(str(tmp_path / "c"), save_last=False)],
        logger=logger,
        log_every_n_steps=log_every_n_steps,
        max_steps=10,
    )
    trainer.fit(BNModel(width=16), make_loader(n=80))
    lightning_steps = [step for step, keys in logger.calls if "train_loss" in keys]
    assert lightning_steps == list(range(log_every_n_steps - 1, 10, log_every_n_steps))
    ours = [(step, keys) for step, keys in logger.calls if any(key.startswith("datastates/") for key in keys)]
    during = [step for step, keys in ours if "datastates/blocked_s" in keys and step <= lightning_steps[-1]]
    assert during, "no checkpoint row during training"
    assert set(during) <= set(lightning_steps)  # a row at a step where Lightning logs, never between
    assert "datastates/checkpoints" in ours[-1][1]  # the totals, once, at the end
    logged = sum(1 for _, keys in ours if "datastates/blocked_s" in keys)
    assert logged == 10  # every checkpoint's row is sent, none twice


# ---------------------------------------------------------------------------------------------- warnings
def test_our_warnings_show_as_one_line_without_a_source_line(tmp_path):
    script = tmp_path / "warn.py"
    script.write_text(
        "import warnings\n"
        "from lightning_datastates import DataStatesIO\n"
        "from lightning_datastates.snapshot.backpressure import BackPressureWarning\n"
        "DataStatesIO()\n"
        "warnings.warn('storage is slow', BackPressureWarning)\n"
        "warnings.warn('not ours', UserWarning)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = done.stderr.splitlines()
    assert "lightning_datastates: BackPressureWarning: storage is slow" in lines
    assert not any("warnings.warn('storage is slow'" in line for line in lines)  # no source line of ours
    assert any(line.endswith("UserWarning: not ours") for line in lines)  # other warnings as Python shows them


def test_lightning_cli_help_for_the_plugin_is_plain_text():
    done = subprocess.run(
        [sys.executable, "examples/cli.py", "fit", "--trainer.plugins.help", "lightning_datastates.DataStatesIO"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "--trainer.plugins.host_cache" in done.stdout
    assert "``" not in done.stdout and ":class:" not in done.stdout
