"""Checkpoint metrics: per-checkpoint rows in a real CSVLogger, aggregates, the summary line, and no logger at all."""

from __future__ import annotations

import csv
import math
import os

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_datastates import DataStatesIO, SnapshotStats
from lightning_datastates.metrics import PREFIX, checkpoint_metrics, summary_line
from tests.conftest import BNModel, make_loader, make_trainer

PER_CHECKPOINT = ("blocked_s", "bytes", "copy_MB_per_s", "flush_MB_per_s", "durable_s", "arena_occupancy")


def _fit(tmp_path, logger, **kwargs):
    plugin = DataStatesIO()
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[checkpoints], max_epochs=1, logger=logger, **kwargs)
    trainer.fit(BNModel(width=64), make_loader(n=64, batch_size=8))  # 8 steps: checkpoints at 2, 4, 6, 8
    files = sorted(str(p) for p in (tmp_path / "ckpt").iterdir())
    return plugin, files


def _rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(os.path.join(logger.log_dir, "metrics.csv")) as handle:
        return list(csv.DictReader(handle))


def test_every_checkpoint_is_logged_with_plausible_values(tmp_path, capsys):
    logger = CSVLogger(str(tmp_path / "logs"), name="run")
    plugin, files = _fit(tmp_path, logger)
    assert len(files) == 4
    rows = _rows(logger)
    per_checkpoint = [r for r in rows if r.get(PREFIX + "bytes")]
    assert len(per_checkpoint) == 4
    # Bytes are each file's size; the values arrive in save order, like the files' steps.
    assert [int(float(r[PREFIX + "bytes"])) for r in per_checkpoint] == [os.path.getsize(f) for f in files]
    for row in per_checkpoint:
        values = {name: float(row[PREFIX + name]) for name in PER_CHECKPOINT}
        assert values["blocked_s"] >= 0
        assert values["durable_s"] > 0
        assert values["copy_MB_per_s"] > 0 and values["flush_MB_per_s"] > 0
        assert 0 <= values["arena_occupancy"] <= 1
    # Logged at Lightning's own step numbers, never past the last step.
    assert all(0 <= int(r["step"]) <= 8 for r in per_checkpoint)

    # Aggregates, logged once at the end, agree with the rows and with the plugin's own stats.
    (final,) = [r for r in rows if r.get(PREFIX + "checkpoints")]
    assert float(final[PREFIX + "checkpoints"]) == 4
    assert float(final[PREFIX + "bytes_total"]) == sum(os.path.getsize(f) for f in files)
    blocked = [float(r[PREFIX + "blocked_s"]) for r in per_checkpoint]
    assert math.isclose(float(final[PREFIX + "blocked_s_max"]), max(blocked), rel_tol=1e-9)
    assert math.isclose(float(final[PREFIX + "blocked_s_mean"]), sum(blocked) / 4, rel_tol=1e-9)
    assert sorted(blocked) == sorted(s.blocked_s for s in plugin.stats)

    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lightning_datastates:")]
    assert len(summary) == 1
    assert "4 checkpoint(s)" in summary[0] and "training blocked" in summary[0]


def test_no_logger_logs_nothing_and_still_summarises(tmp_path, capsys):
    plugin, files = _fit(tmp_path, logger=False)
    assert len(files) == 4 and all(s.state == "committed" for s in plugin.stats)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no log directory of any kind
    assert "lightning_datastates: 4 checkpoint(s)" in capsys.readouterr().out


def test_a_second_fit_logs_only_its_own_checkpoints(tmp_path):
    plugin = DataStatesIO()
    for run in ("a", "b"):
        logger = CSVLogger(str(tmp_path / "logs"), name=run)
        checkpoints = ModelCheckpoint(dirpath=str(tmp_path / run), every_n_train_steps=4, save_top_k=-1)
        trainer = make_trainer(str(tmp_path), plugin, callbacks=[checkpoints], max_epochs=1, logger=logger)
        trainer.fit(BNModel(width=32), make_loader(n=64, batch_size=8))
        rows = _rows(logger)
        assert len([r for r in rows if r.get(PREFIX + "bytes")]) == 2, run
        (final,) = [r for r in rows if r.get(PREFIX + "checkpoints")]
        assert float(final[PREFIX + "checkpoints"]) == 2, run


def test_checkpoint_metrics_from_stats():
    stats = SnapshotStats("p", total_bytes=4_000_000, payload_bytes=3_000_000, started_at=0.0)
    stats.save_call_s, stats.barrier_wait_s, stats.copy_s, stats.durable_s = 0.01, 0.02, 0.5, 2.0
    values = checkpoint_metrics(stats, arena_occupancy=0.25)
    assert values == pytest.approx(
        {
            "datastates/blocked_s": 0.03,
            "datastates/bytes": 4e6,
            "datastates/copy_MB_per_s": 6.0,
            "datastates/flush_MB_per_s": 2.0,
            "datastates/durable_s": 2.0,
            "datastates/arena_occupancy": 0.25,
        }
    )
    # Not yet copied: no throughput is made up.
    pending = checkpoint_metrics(SnapshotStats("p", 10, 10, 0.0))
    assert set(pending) == {"datastates/blocked_s", "datastates/bytes"}


def _zero_totals() -> dict[str, float]:
    """The aggregates of the summary line, all zero (the counts left to each test)."""
    names = ("blocked_s_mean", "blocked_s_max", "durable_s_mean", "durable_s_max", "copy_MB_per_s_mean")
    return dict.fromkeys((*names, "flush_MB_per_s_mean", "arena_occupancy_max", "bytes_total"), 0.0)


def test_summary_line_names_failures():
    totals = _zero_totals()
    line = summary_line({**totals, "checkpoints": 0.0, "failed": 2.0})
    assert line.startswith("lightning_datastates: 0 checkpoint(s)") and "2 FAILED" in line
    assert "CheckpointFlushError" in line
    # With on_flush_error="warn" no CheckpointFlushError was raised: the line must not send the user looking for one.
    warned = summary_line({**totals, "checkpoints": 0.0, "failed": 2.0}, "warn")
    assert "2 FAILED" in warned and "CheckpointFlushError" not in warned and "warnings" in warned


def test_summary_line_says_why_saves_are_missing_from_the_count():
    """10 saves, one of them superseded (a ``last.ckpt`` saved again before its earlier save was written): the line
    counts 9 checkpoints and says what became of the tenth."""
    totals = {**_zero_totals(), "failed": 0.0}
    line = summary_line({**totals, "checkpoints": 9.0, "superseded": 1.0})
    assert "9 checkpoint(s)" in line and "1 not written: a newer save or a removal of the same file came first" in line
