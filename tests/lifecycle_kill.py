"""Runs that SIGKILL themselves at one chosen point of the checkpoint lifecycle, launched by
tests/test_lifecycle_faults.py: ``python tests/lifecycle_kill.py SCENARIO PERSISTENT_DIR LOCAL_TIER``.

Each scenario drives a ``DataStatesIO(local_tier=LOCAL_TIER)`` as inside a training loop (saves return before their
flush), saving small checkpoints ``{"global_step": n, "w": <tensor of n>}`` into ``PERSISTENT_DIR``, holds the
replication where the scenario needs it (a fake at one precise point: ``Replicator._copy``), and kills itself
(``os.kill(os.getpid(), SIGKILL)``, announced as ``killing: <why>`` on stdout) with:

* ``overtaken``: ``last.ckpt`` of step 0 replicated; step 1's copy held while step 2 is saved and committed locally;
  then step 1's copy goes on and commits, and the run dies as step 2's copy begins (fault A of issue 39: step 2 is the
  newest checkpoint, durable locally only).
* ``over-a-link``: ``last.ckpt`` of step 5 committed locally, killed as its copy begins (``PERSISTENT_DIR/last.ckpt``
  is a link an earlier run left, to an older checkpoint: fault E).
* ``top-k-only``: ``epoch=0-step=2.ckpt``, ``-step=4``, ``-step=6`` committed locally, none replicated, no
  ``last.ckpt`` (fault F).
* ``long-name``: a checkpoint whose name is so long that its marker's own name is shortened (the whole name is only
  in the marker's content) committed locally, killed as its copy begins.
* ``removal-held``: ``epoch=0-step=1.ckpt`` and ``-step=2.ckpt`` committed locally, none replicated, and step 1
  removed (as ``ModelCheckpoint``'s top-k does; the removal waits for step 2 to be persistent): the next run must not
  replicate step 1 back.

A scenario that ends without its kill exits with status 3 (the test then fails rather than check a crash that never
happened).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from lightning_datastates import DataStatesIO
from lightning_datastates.tiered.replicator import Replicator
from tests.conftest import in_background

#: Hang guard for the waits below (a local commit of these files takes milliseconds).
_WAIT_S = 60.0


def state(step: int) -> dict[str, Any]:
    """The checkpoint of ``step``: its number, and a tensor that says it too; with optimizer states, as a checkpoint
    a run resumes from holds (a weights-only one is no candidate of ``ckpt_path="last"``)."""
    return {"global_step": step, "w": torch.full((16384,), float(step)), "optimizer_states": []}


def _die(why: str) -> None:
    print(f"killing: {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_local_commits(plugin: DataStatesIO, count: int) -> None:
    """Wait until ``count`` saves are committed on the local tier."""
    deadline = time.monotonic() + _WAIT_S
    while sum(s.durable_s is not None for s in plugin.stats) < count:
        if time.monotonic() > deadline:
            print(f"only {sum(s.durable_s is not None for s in plugin.stats)} local commits", flush=True)
            os._exit(4)
        time.sleep(0.005)


def _hold_copies(hold: Any) -> None:
    """Route every replication through ``hold(item, calls)`` first (``calls``: how many copies began, this one
    included)."""
    original = Replicator._copy
    calls = [0]
    lock = threading.Lock()

    def copy(self: Replicator, item: Any) -> Any:
        with lock:
            calls[0] += 1
            call = calls[0]
        hold(item, call)
        return original(self, item)

    Replicator._copy = copy  # type: ignore[method-assign]


def overtaken(plugin: DataStatesIO, persistent: str) -> None:
    path = os.path.join(persistent, "last.ckpt")
    plugin.save_checkpoint(state(0), path)
    plugin.drain()  # step 0 on both tiers
    first_in, release = threading.Event(), threading.Event()

    def hold(item: Any, call: int) -> None:
        if call == 1:
            first_in.set()
            release.wait(_WAIT_S)  # step 1's copy waits while step 2 is saved
        elif call == 2:
            _die("step 2's copy begins; step 1's is committed")

    _hold_copies(hold)
    plugin.save_checkpoint(state(1), path)
    first_in.wait(_WAIT_S)
    plugin.save_checkpoint(state(2), path)
    _wait_local_commits(plugin, 3)
    release.set()


def over_a_link(plugin: DataStatesIO, persistent: str) -> None:
    _hold_copies(lambda item, call: _die("last.ckpt of step 5 committed locally, its copy begins"))
    plugin.save_checkpoint(state(5), os.path.join(persistent, "last.ckpt"))


def top_k_only(plugin: DataStatesIO, persistent: str) -> None:
    _hold_copies(lambda item, call: threading.Event().wait())  # nothing reaches the persistent tier
    for step in (2, 4, 6):
        plugin.save_checkpoint(state(step), os.path.join(persistent, f"epoch=0-step={step}.ckpt"))
    _wait_local_commits(plugin, 3)
    _die("three top-k checkpoints committed locally, none replicated")


def removal_held(plugin: DataStatesIO, persistent: str) -> None:
    _hold_copies(lambda item, call: threading.Event().wait())  # nothing reaches the persistent tier
    for step in (1, 2):
        plugin.save_checkpoint(state(step), os.path.join(persistent, f"epoch=0-step={step}.ckpt"))
    plugin.remove_checkpoint(os.path.join(persistent, "epoch=0-step=1.ckpt"))  # held back: step 2 is not persistent
    _wait_local_commits(plugin, 2)
    _die("step 1 removed while step 2 was durable locally only")


#: A checkpoint name whose replication marker's own name is shortened to fit the file system's limit.
LONG_NAME = "epoch=0-step=7-" + "-".join(f"metric_{i}=0.{i:04d}" for i in range(14)) + ".ckpt"


def long_name(plugin: DataStatesIO, persistent: str) -> None:
    _hold_copies(lambda item, call: _die("a checkpoint with a long name committed locally, its copy begins"))
    plugin.save_checkpoint(state(7), os.path.join(persistent, LONG_NAME))


SCENARIOS = {
    "overtaken": overtaken,
    "over-a-link": over_a_link,
    "top-k-only": top_k_only,
    "removal-held": removal_held,
    "long-name": long_name,
}


def main() -> None:
    scenario, persistent, local_tier = sys.argv[1:4]
    torch.set_num_threads(1)
    plugin = in_background(DataStatesIO(local_tier=local_tier, chunk_size="64KiB"))
    SCENARIOS[scenario](plugin, persistent)
    time.sleep(_WAIT_S)  # the kill comes from another thread meanwhile
    print("the scenario ended without its kill", flush=True)
    os._exit(3)


if __name__ == "__main__":
    main()
