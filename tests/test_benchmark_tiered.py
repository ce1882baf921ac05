"""The benchmark's ``tiered`` method (``DataStatesIO(local_tier=...)``): end to end at moto's S3 server (``--moto``),
and its figures, table, gates and choice of methods on given records.

No test here judges a measured time against a threshold (shared, noisy machines): the run must report every figure,
finite; the gates are tested on given figures.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from argparse import Namespace
from typing import Any

import pytest

from lightning_datastates.benchmark import command, report, tiered_report
from lightning_datastates.benchmark.choices import DEFAULT_METHODS, METHODS
from tests.s3_server import require_s3

#: The tiered figures the report must give for a run with ``--resume``.
TIERED_FIGURES = ("durable_p50_s", "persistent_durable_p50_s", "repl_Bps", "repl_vs_raw", "local_vs_raw",
                  "train_vs_single", "fit_vs_single", "resume_local_s", "resume_persistent_s")  # fmt: skip
TIERS_COLUMNS = ("local durable p50 s", "persistent durable p50 s", "replicated", "repl MB/s", "repl vs raw",
                 "after training", "local vs raw", "train vs single", "resume local s",
                 "resume persistent s")  # fmt: skip


@pytest.mark.slow
def test_short_benchmark_at_moto_runs_single_tier_and_tiered_side_by_side(tmp_path: Any) -> None:
    require_s3()
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "lightning_datastates.benchmark", "--short", "--steps", "6", "--moto", "--resume",
         "--methods", "datastates,tiered", "--no-plot", "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"benchmark failed:\n{result.stdout}\n{result.stderr}"
    saved = json.loads((out / "benchmark.json").read_text())
    table = saved["table"]
    assert list(table) == ["datastates", "tiered"]
    tiered = table["tiered"]
    for key in TIERED_FIGURES:
        assert math.isfinite(tiered[key]) and tiered[key] > 0, (key, tiered)
    assert tiered["replicated"] == tiered["checkpoints"] == 2  # 6 steps, every 3: both copies reached S3
    assert math.isfinite(table["datastates"]["durable_p50_s"])
    part_bytes, concurrency = saved["s3_transfer"]  # the raw upload used the plugin's S3 writer's shape
    assert part_bytes >= 5 * 2**20 and concurrency >= 1
    assert saved["raw_write_Bps_by_kind"]["upload"] and saved["local_raw_write_Bps"]
    checkpoints = saved["last_round_runs"]["tiered"]["checkpoints"]
    assert all(c["path"].startswith("s3://") and c["persistent_durable"] > c["durable"] for c in checkpoints)
    markdown = (out / "benchmark.md").read_text()
    tiers = markdown[markdown.index("Tiers:") :]
    for column in TIERS_COLUMNS:
        assert f"| {column} |" in tiers, column
    assert "| tiered |" in tiers and "raw upload to the target" in markdown
    # The temporary local tier goes with the run (no --keep).
    local_tier = re.search(r"local tier in (\S+)", result.stdout)
    assert local_tier is not None and not os.path.exists(local_tier.group(1))


def _checkpoint(start: float, durable: float, persistent: float | None, nbytes: int = 100) -> dict[str, Any]:
    return {"start": start, "call_s": 0.01, "barrier_s": 0.0, "flush_start": start, "copy_end": start + 0.05,
            "durable": durable, "persistent_durable": persistent, "bytes": nbytes, "replicated_bytes": nbytes,
            "replication": "committed" if persistent is not None else "cancelled"}  # fmt: skip


def test_replication_rate_counts_each_copy_from_when_the_one_before_it_ended() -> None:
    # Copies run one after another: the second is durable locally at 2.0 but starts when the first ends, at 3.0.
    checkpoints = [_checkpoint(0.0, 1.0, 3.0), _checkpoint(1.5, 2.0, 4.0), _checkpoint(6.0, 6.5, 7.5)]
    rates = tiered_report.replication_rates(checkpoints)
    expected = [(1.0, 50.0), (3.0, 100.0), (6.5, 100.0)]
    assert len(rates) == len(expected) and all(rate == pytest.approx(e) for rate, e in zip(rates, expected))
    # One that did not reach the persistent tier counts no rate, and holds no later copy back.
    assert tiered_report.replication_rates([_checkpoint(0.0, 1.0, None), _checkpoint(1.5, 2.0, 3.0)]) == [(2.0, 100.0)]


def test_tiered_figures_against_the_raw_throughput_of_each_tier() -> None:
    run = {"train_s": 10.0, "fit_s": 11.0, "peak_rss_bytes": 1, "peak_gpu_bytes": None,
           "checkpoints": [_checkpoint(0.0, 0.5, 1.5), _checkpoint(2.0, 2.5, 3.0)], "steps": [[0.0, 1.0], [1.0, 2.4]],
           "resume": {"local_s": 0.2, "persistent_s": 0.8}}  # fmt: skip
    row = report.summarize_run(run, raw_bps=200.0, local_raw_bps=400.0)
    assert row["persistent_durable_p50_s"] == pytest.approx(1.25)
    assert row["repl_Bps"] == pytest.approx(150.0) and row["repl_vs_raw"] == pytest.approx(0.75)
    assert row["repl_after_vs_raw"] == pytest.approx(1.0)  # the second copy started after the last step: 200 B/s
    assert row["local_vs_raw"] == pytest.approx(0.5 / (100 / 400.0))  # 0.5 s against 0.25 s for a raw write
    assert row["flush_vs_raw"] == pytest.approx(row["flush_Bps"] / 400.0)  # tiered flushes to its local tier
    assert row["replicated"] == 2 and row["resume_local_s"] == 0.2 and row["resume_persistent_s"] == 0.8
    single_tier = dict(run, checkpoints=[{**_checkpoint(0, 1, 2), "replication": None}])
    assert "repl_Bps" not in report.summarize_run(single_tier, 1.0)
    single = {"train_s": 8.0, "fit_s": 11.0, "peak_rss_bytes": 1, "peak_gpu_bytes": None}
    rounds = [{"datastates": single, "tiered": row}, {"datastates": dict(single, train_s=12.5), "tiered": row}]
    table = report.combine(rounds)
    assert table["tiered"]["train_vs_single"] == pytest.approx((10 / 8 + 10 / 12.5) / 2)  # paired by round
    text = report.markdown(table, "header")
    assert "| tiered | 0.50 | 1.25 | 2/2 | 0 | 0.75 | 1.00 | 2.00 |" in text


def test_tiered_gates_are_ratios_and_fail_without_a_figure(capsys: Any) -> None:
    table = {"tiered": {"train_vs_single": 0.9, "local_vs_raw": 1.3, "repl_vs_raw": 0.95}}
    gates = {"max_train_vs_single": 1.0, "max_local_vs_raw": None, "min_repl_vs_raw": 0.9}
    assert tiered_report.tier_gates(table, Namespace(**gates))
    assert not tiered_report.tier_gates(table, Namespace(**dict(gates, max_local_vs_raw=1.2)))
    assert "= 1.300 (max 1.2) FAILED" in capsys.readouterr().out
    assert not tiered_report.tier_gates({"tiered": {}}, Namespace(**gates))
    assert "no figure to compare" in capsys.readouterr().err


def test_tiered_joins_the_default_methods_only_with_a_slow_target(capsys: Any) -> None:
    assert command.parse_args([]).methods == list(DEFAULT_METHODS) and "tiered" not in DEFAULT_METHODS
    assert command.parse_args(["--local-tier", "/nvme"]).methods == list(METHODS)
    # At S3 DCP cannot write (local paths only): skipped, saying why.
    assert command.parse_args(["--moto"]).methods == [m for m in METHODS if m != "dcp"]
    assert "dcp skipped at an s3:// target" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        command.parse_args(["--moto", "--dir", "/tmp/x"])
    with pytest.raises(SystemExit):
        command.parse_args(["--methods", "datastates", "--max-train-vs-single", "1.0"])
