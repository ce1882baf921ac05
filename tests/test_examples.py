"""Every example in examples/ runs to the end in its fast mode, in a subprocess, as a user would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3_server import s3_endpoint_fixture, s3_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(*args: str, cwd: Path) -> str:
    # This checkout first on the path, as for the tests themselves (the package may also be installed elsewhere).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
def test_train_gpt(tmp_path):
    out = _run(str(EXAMPLES / "train_gpt.py"), "--fast", "--dir", str(tmp_path), cwd=tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    assert "loads with torch.load: global_step=8" in out
    assert "lightning_datastates: 2 checkpoint(s)" in out
    metrics = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    assert "datastates/bytes" in metrics and "datastates/blocked_s" in metrics


@pytest.mark.slow
def test_resume_after_crash(tmp_path):
    out = _run(str(EXAMPLES / "resume_after_crash.py"), "--fast", "--dir", str(tmp_path), cwd=tmp_path)
    assert "first run: killed by signal 9" in out
    # Killed at the end of step 7, with step 6's checkpoint in flight or just committed: last.ckpt is whole either way.
    assert re.search(r"last\.ckpt is complete, at step [46]\n", out), out
    assert "trained to step 12 (resumed)" in out
    assert "after resuming: last.ckpt at step 12" in out
    assert not [name for name in os.listdir(tmp_path) if not name.endswith(".ckpt")]  # the dead run's temp files


@pytest.mark.slow
def test_s3_checkpoints(tmp_path, s3):
    out = _run(str(EXAMPLES / "s3_checkpoints.py"), s3.url("run"), "--fast", cwd=tmp_path)
    assert s3.keys("run/") == ["run/epoch=0-step=4.ckpt", "run/epoch=0-step=8.ckpt"]
    assert f"loaded {s3.url('run/epoch=0-step=8.ckpt')}: global_step=8" in out


@pytest.mark.slow
def test_lightning_cli_with_a_config(tmp_path):
    _run(
        str(EXAMPLES / "cli.py"),
        "fit",
        "--config",
        str(ROOT / "configs" / "local.yaml"),
        "--trainer.max_steps=4",
        "--trainer.accelerator=cpu",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.plugins.init_args.host_cache=64MiB",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
        "--trainer.callbacks.init_args.every_n_train_steps=2",
        cwd=tmp_path,
    )
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
