"""Real faults with nothing lost: SIGKILL mid-checkpoint, a file-size limit (disk full), slow and flaky storage.

The SIGKILL trials run in CI (30 by default); for a longer soak set ``DATASTATES_KILL_TRIALS`` (e.g. 1000) and
optionally ``DATASTATES_KILL_SEED``. Each test prints its figures (``-s`` shows them).
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

from lightning_datastates import CheckpointFlushError, DataStatesIO
from tests.conftest import (
    BNModel,
    GatedWriter,
    RecordingDataStatesIO,
    assert_bit_equal,
    every_step_checkpoint,
    make_loader,
    make_trainer,
    temp_files,
)
from tests.kill_trainer import checkpoint_digest, ref_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_TRIALS = int(os.environ.get("DATASTATES_KILL_TRIALS", "30"))
KILL_SEED = int(os.environ.get("DATASTATES_KILL_SEED", str(int(time.time()))))
#: A hang guard for subprocess answers, not a performance threshold.
ANSWER_TIMEOUT_S = 300


class KillServer:
    """The fork server of tests/kill_trainer.py, driven line by line."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", "kill_trainer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert json.loads(self._read_line()) == {"ready": True}

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return json.loads(self._read_line())

    def _read_line(self) -> str:
        assert self.process.stdout is not None
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            assert selector.select(ANSWER_TIMEOUT_S), "the kill server did not answer (hang guard)"
        line = self.process.stdout.readline()
        assert line, f"the kill server died (exit {self.process.poll()})"
        return line

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def verify_directory(directory: str) -> dict[str, int]:
    """Every file under a final ``.ckpt`` name loads and equals the state recorded for its step; return its steps."""
    steps = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".ckpt"):
            continue
        loaded = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=False)
        step = int(loaded["global_step"])
        reference = ref_path(directory, name, step)
        assert os.path.exists(reference), f"{name}: no state was recorded for step {step}"
        with open(reference) as inp:
            expected = json.load(inp)["digest"]
        assert checkpoint_digest(loaded) == expected, f"{name}: differs from the state of step {step}"
        steps[name] = step
    return steps


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing(tmp_path):
    rng = random.Random(KILL_SEED)
    server = KillServer()
    figures = {"trials": 0, "kills": 0, "files_checked": 0, "killed_mid_write": 0, "no_checkpoint_yet": 0}
    try:
        for trial in range(KILL_TRIALS):
            directory = str(tmp_path / f"trial{trial}")
            os.makedirs(directory)
            t0 = time.monotonic()
            answer = server.ask(cmd="trial", dir=directory, seed=trial, delay_s=rng.uniform(0.0, 1.0))
            t1 = time.monotonic()
            assert answer["killed"], f"trial {trial}: the run ended before the kill: {answer}"
            figures["trials"] += 1
            figures["kills"] += 1
            figures["killed_mid_write"] += bool(answer["temp_files"])
            steps = verify_directory(directory)
            figures["files_checked"] += len(steps)
            numbered = {name: step for name, step in steps.items() if name != "last.ckpt"}
            if not numbered:
                figures["no_checkpoint_yet"] += 1
                continue
            newest = max(numbered, key=numbered.get)  # the newest complete checkpoint resumes training
            resumed = server.ask(cmd="resume", dir=directory, ckpt=os.path.join(directory, newest), steps=1)
            assert resumed["exit"] == 0 and resumed["global_step"] == numbered[newest] + 1, resumed
            assert temp_files(directory) == [], "the next run did not remove the killed run's temporary files"
            after = verify_directory(directory)  # the resumed run's own checkpoint is whole and right too
            figures["files_checked"] += len(after)
            assert any(step == numbered[newest] + 1 for step in after.values())
            print(f"trial {t1-t0:.2f} ran {answer['ran_s']:.2f} verify+resume {time.monotonic()-t1:.2f} files {len(steps)}")
    finally:
        server.close()
    print(f"\nSIGKILL fault suite (seed {KILL_SEED}): {figures}")
    assert figures["trials"] == KILL_TRIALS
