"""The drain progress bar: shown in the Trainer's bar style when writes are pending at the end of training, else silent.

Writes are held back by the ``gated_writer`` fixture until the bar is open (a fault injected at a precise point:
the bar's creation), so the bar is certain to have bytes left to show, without any timing assumption.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar

from lightning_datastates import DataStatesIO
from lightning_datastates import progress as progress_module
from lightning_datastates.pipeline import CheckpointPipeline
from tests.conftest import BNModel, make_loader, make_trainer


def _fit(tmp_path, gated_writer, monkeypatch, **trainer_kwargs):
    """Fit with every write held until the drain bar opens (or, with no bar, until the drain starts)."""
    gated_writer.gate.clear()
    opened: list[int] = []
    original_open_bar, original_drain = progress_module.open_bar, CheckpointPipeline.drain

    @contextmanager
    def open_bar_then_release(bar_callback, total_bytes):
        with original_open_bar(bar_callback, total_bytes) as bar:
            opened.append(total_bytes)
            gated_writer.gate.set()
            yield bar

    def drain_then_release(self):
        gated_writer.gate.set()  # no bar was opened: let the writes go
        original_drain(self)

    monkeypatch.setattr(progress_module, "open_bar", open_bar_then_release)
    monkeypatch.setattr(CheckpointPipeline, "drain", drain_then_release)  # the callback drains through it
    plugin = DataStatesIO()
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4, save_top_k=-1)
    trainer = make_trainer(
        str(tmp_path),
        plugin,
        callbacks=[checkpoints, *trainer_kwargs.pop("callbacks", [])],
        max_epochs=1,
        **trainer_kwargs,
    )
    trainer.fit(BNModel(width=32), make_loader(n=64, batch_size=8))
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert files == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    assert all(s.state == "committed" for s in plugin.stats)
    return opened, files


def test_tqdm_bar_shows_bytes_left(tmp_path, gated_writer, monkeypatch, capsys):
    opened, files = _fit(tmp_path, gated_writer, monkeypatch, enable_progress_bar=True, callbacks=[TQDMProgressBar()])
    assert len(opened) == 1 and 0 < opened[0] <= sum(os.path.getsize(tmp_path / "ckpt" / f) for f in files)
    out = capsys.readouterr().out
    assert progress_module.DESCRIPTION in out
    assert "100%" in out  # the bar ends full


def test_rich_bar_when_the_trainer_uses_rich(tmp_path, gated_writer, monkeypatch, capsys):
    pytest.importorskip("rich")
    opened, _ = _fit(tmp_path, gated_writer, monkeypatch, enable_progress_bar=True, callbacks=[RichProgressBar()])
    assert len(opened) == 1
    assert progress_module.DESCRIPTION in capsys.readouterr().out


def test_silent_without_progress_bar(tmp_path, gated_writer, monkeypatch, capsys):
    opened, _ = _fit(tmp_path, gated_writer, monkeypatch, enable_progress_bar=False)
    assert opened == []
    assert progress_module.DESCRIPTION not in capsys.readouterr().out
