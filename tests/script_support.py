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
import socket
import subprocess
import sys
import threading
from typing import Any

import torch

from lightning_datastates import DataStatesIO
from lightning_datastates.plugin import _path_str

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
        reference = os.path.join(self.reference_dir, os.path.basename(_path_str(path)))
        torch.save(expected, reference + ".tmp")  # plain synchronous save of the copy, renamed when whole
        os.replace(reference + ".tmp", reference)


def datastates_threads() -> list[str]:
    """Names of this process's live engine threads."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("datastates-"))


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON, atomically (a reader never sees half a report)."""
    with open(path + ".tmp", "w") as handle:
        json.dump(data, handle)
    os.replace(path + ".tmp", path)


def free_port() -> int:
    """A TCP port free on loopback right now (for MASTER_PORT: parallel test runs must not collide)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a launched script: this checkout first on the path, quiet, single-threaded torch."""
    env = dict(os.environ)
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
