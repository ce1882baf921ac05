"""Every example in examples/ runs to the end in its fast mode, in a subprocess, as a user would run it; so does the
LightningCLI command of README.md, as written there."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3_server import s3_endpoint_fixture, s3_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(*args: str, cwd: Path, **extra_env: str) -> str:
    # This checkout first on the path, as for the tests themselves (the package may also be installed elsewhere).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra_env}
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr  # a rich progress bar sends prints to stderr


@pytest.mark.slow
def test_train_gpt(tmp_path):
    out = _run(str(EXAMPLES / "train_gpt.py"), "--fast", "--dir", str(tmp_path), cwd=tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    assert "loads with torch.load: global_step=8" in out
    assert "lightning_datastates: 2 checkpoint(s)" in out
    metrics = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    assert "datastates/bytes" in metrics and "datastates/blocked_s" in metrics


@pytest.mark.slow
def test_train_gpt_without_dir_removes_its_temporary_directory(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = _run(str(EXAMPLES / "train_gpt.py"), "--fast", cwd=tmp_path, TMPDIR=str(temp))
    assert "loads with torch.load: global_step=8" in out
    assert re.search(r"removing \S+datastates-example-\S+ \(\d+\.\d\d GB\): give --dir DIR to keep", out), out
    assert not [path.name for path in temp.iterdir() if path.name.startswith("datastates-example-")]


@pytest.mark.slow
def test_resume_after_crash(tmp_path):
    # No --dir: the example works in a temporary directory of its own, under this TMPDIR, and must remove it.
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = _run(str(EXAMPLES / "resume_after_crash.py"), "--fast", cwd=tmp_path, TMPDIR=str(temp))
    # Killed inside the commit of a checkpoint file (its fsync): every byte written, nothing durable or published.
    killed = re.search(r"killing the first run at step (\d+) in the fsync that begins a checkpoint's commit\n", out)
    assert killed, out
    step = int(killed.group(1))
    assert step == 6, killed.group(0)
    assert "first run: killed by signal 9" in out
    # The checkpoint in flight was never published (what else is there depends on the writer: a temporary file),
    # the one before is whole.
    crash = re.search(r"after the crash: \[(.*)\]\n", out)
    assert crash, out
    names = [name.strip("'") for name in crash.group(1).split(", ")]
    assert f"epoch=0-step={step}.ckpt" not in names and f"epoch=0-step={step - 2}.ckpt" in names, names
    # The resume used the newest whole checkpoint (every earlier one was committed before the kill).
    assert f"last.ckpt is complete, at step {step - 2};" in out
    assert f"second run starts at step {step - 2}\n" in out
    assert "trained to step 12 (resumed)" in out
    final = re.search(r"after resuming: last\.ckpt at step 12; files \[(.*)\]\n", out)
    assert final, out
    assert all(name.strip("'").endswith(".ckpt") for name in final.group(1).split(", ")), final.group(0)
    # Its temporary directory is gone (torch may leave caches of its own there, e.g. torchinductor_<user>).
    assert not [path.name for path in temp.iterdir() if path.name.startswith("datastates-resume-")]


@pytest.mark.slow
def test_s3_checkpoints(tmp_path, s3):
    out = _run(str(EXAMPLES / "s3_checkpoints.py"), s3.url("run"), "--fast", cwd=tmp_path)
    assert s3.keys("run/") == ["run/epoch=0-step=4.ckpt", "run/epoch=0-step=8.ckpt"]
    assert f"loaded {s3.url('run/epoch=0-step=8.ckpt')}: global_step=8" in out


def _readme_cli_commands() -> list[list[str]]:
    """The LightningCLI commands of README.md, as a user copies them (``python examples/cli.py fit ...``): a run, then
    the same run resumed with ``--ckpt_path last``."""
    readme = (ROOT / "README.md").read_text().splitlines()
    lines = [line for line in readme if line.startswith("python examples/cli.py")]
    assert len(lines) == 2, lines
    return [shlex.split(line) for line in lines]


@pytest.mark.slow
def test_the_readme_lightning_cli_commands_checkpoint_and_resume(tmp_path):
    # Run as in the README, but from another directory: the config's relative dirpath lands under the working
    # directory, and the command says where.
    first, second = _readme_cli_commands()
    python, script, *args = first
    assert python == "python" and script == "examples/cli.py"
    args = [str(ROOT / arg) if (ROOT / arg).is_file() else arg for arg in args]
    out = _run(str(ROOT / script), *args, cwd=tmp_path)
    directory = os.path.realpath(tmp_path / "checkpoints")
    assert sorted(os.listdir(directory)) == ["epoch=1-step=100.ckpt", "epoch=3-step=200.ckpt", "last.ckpt"]
    assert "lightning_datastates: 2 checkpoint(s)" in out, out
    assert f"checkpoints in {directory}: epoch=1-step=100.ckpt, epoch=3-step=200.ckpt, last.ckpt" in out, out
    # The second command resumes from last.ckpt (step 200): two more checkpoints, no -v1 copies of the first two.
    python, script, *args = second
    assert (python, script) == ("python", "examples/cli.py") and args[-2:] == ["--ckpt_path", "last"], second
    args = [str(ROOT / arg) if (ROOT / arg).is_file() else arg for arg in args]
    out = _run(str(ROOT / script), *args, cwd=tmp_path)
    assert f"Restored all states from the checkpoint at {directory}/last.ckpt" in out, out
    assert "lightning_datastates: 2 checkpoint(s)" in out, out
    steps = sorted(
        int(m[1]) for name in os.listdir(directory) if (m := re.fullmatch(r"epoch=\d+-step=(\d+)\.ckpt", name))
    )
    assert steps == [100, 200, 300, 400] and len(os.listdir(directory)) == 5, os.listdir(directory)
    assert re.fullmatch(r"epoch=\d+-step=400\.ckpt", os.readlink(os.path.join(directory, "last.ckpt")))
