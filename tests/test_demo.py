"""The demo runs end to end in fast mode: three fits, the report, and its own bit-for-bit verification."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_fast_runs_and_verifies(tmp_path: str) -> None:
    # A subprocess: the demo sets torch's thread count and logging levels, which must not leak into other tests.
    result = subprocess.run(
        [sys.executable, "-m", "lightning_datastates.demo", "--fast", "--dir", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"demo failed:\n{result.stdout}\n{result.stderr}"
    out = result.stdout
    for expected in ("summary", "no checkpointing", "TorchCheckpointIO", "DataStatesIO", "verify: OK"):
        assert expected in out, f"{expected!r} missing from the demo's output:\n{out}"
    assert out.count(".ckpt") == 3  # 12 steps, a checkpoint every 4
    # Never silent for long: each run says when it starts and ends (and, in a longer run, every few seconds).
    for label in ("run 1 of 3 (no checkpointing)", "run 2 of 3 (TorchCheckpointIO)", "run 3 of 3 (DataStatesIO)"):
        assert f"{label}: training 12 steps ..." in out and f"{label}: 12 steps in " in out, out
    assert os.listdir(tmp_path) == []  # the run directory is removed without --keep


@pytest.mark.slow
def test_demo_keep_leaves_plain_checkpoints(tmp_path: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_datastates.demo",
            "--fast",
            "--steps",
            "4",
            "--every",
            "2",
            "--dir",
            str(tmp_path),
            "--keep",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"demo failed:\n{result.stdout}\n{result.stderr}"
    (run_dir,) = os.listdir(tmp_path)
    for method in ("torch", "datastates"):
        names = sorted(os.listdir(os.path.join(tmp_path, run_dir, method)))
        assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"], (method, names)
