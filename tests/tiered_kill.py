"""A tiered run that SIGKILLs itself at one seam of the replication, launched by tests/test_tiered_crash.py.

``python tests/tiered_kill.py DIRPATH LOCAL_TIER SEAM WIDTH NAME [ENDPOINT]``: trains ``BNModel(width=WIDTH)`` with
``DataStatesIO(local_tier=LOCAL_TIER, chunk_size="64KiB", writer_threads=2)``, a ``ModelCheckpoint`` saving every
step plus ``last.ckpt`` into ``DIRPATH`` (a local directory, or ``s3://bucket/run`` on the moto server at
``ENDPOINT``, with 5 MiB parts), and kills itself with ``SIGKILL`` at ``SEAM`` of the replication of the first
checkpoint saved as ``NAME`` (:data:`KILL_NAME`, or ``last.ckpt``; patched here only):

* ``before``: in ``Replicator.settled`` before the copy is queued (the local copy is committed and marked, its
  replication never started), while the training thread is held between the engine's capture and the return of
  the save (a fast local commit, or a slow training thread: the copy must have been marked before its capture);
* ``during``: at the start of the copy's second ``Replicator._window`` call (on S3 a multipart upload is open then:
  the checkpoint is several parts);
* ``after``: in ``TieredCheckpoints._after_commit``, once the copy is committed on the persistent tier (before its
  replica note is written and its markers removed).

Before that checkpoint is saved, every earlier one is committed on both tiers (``drain()``): with the default name,
each seam kills the run with step 2's ``last.ckpt`` to resume from, and the saves after step 3's (its ``last.ckpt``,
later steps) in flight or marked; with ``last.ckpt``, before the first ``last.ckpt`` is on the persistent tier.

With ``TIERED_KILL_LINK=1`` the run saves ``save_last="link"`` (local ``DIRPATH`` only), and ``before`` holds the
training thread after Lightning linked ``last.ckpt`` to ``NAME`` instead of after the capture; the settled hook waits
for that link before it kills: the kill leaves ``last.ckpt`` linked to a file the persistent tier does not hold.

Each kill is announced on stdout first (``killing at <seam>: <path>``). A run that reaches its last step without
meeting its seam exits with status 3: the test then fails, rather than check a crash that never happened.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import DataStatesIO
from lightning_datastates.snapshot.engine import SnapshotEngine
from lightning_datastates.tiered.replicator import Replicator
from lightning_datastates.tiered.tiers import TieredCheckpoints
from tests.conftest import BNModel, every_step_checkpoint, make_loader, make_trainer

#: The checkpoint whose replication each seam kills by default: step 3's, so that earlier ones may be replicated (and
#: pruned) first, and a file the resumed run does not save again (it saves ``epoch=0-step=3-v1.ckpt`` if it trains
#: step 3).
KILL_NAME = "epoch=0-step=3.ckpt"
#: Enough steps for every seam to be met; the run exits with status 3 at the end if it was not.
MAX_STEPS = 8
#: Part size on S3 (the smallest S3 allows): a checkpoint of ``BNModel(width=768)`` with AdamW is two parts.
PART_SIZE = "5MiB"

#: How long ``before`` holds the training thread after the capture: far longer than a local write of these files.
_HOLD_S = 30.0

_lock = threading.Lock()
_kill_name = KILL_NAME  # NAME, set by main()
#: save_last="link" (TIERED_KILL_LINK=1): the link last.ckpt is made after the save call returns.
LINK = os.environ.get("TIERED_KILL_LINK") == "1"


def _die(seam: str, path: str) -> None:
    print(f"killing at {seam}: {path}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _is_target(item: Any) -> bool:
    return os.path.basename(item.local_path) == _kill_name


def install_seam(seam: str) -> None:
    """Patch the tiered classes so that this process kills itself at ``seam`` (see the module docstring)."""
    if seam == "before":
        original_capture = SnapshotEngine.capture
        original_settled = Replicator.settled
        original_link = ModelCheckpoint._link_checkpoint
        linked = threading.Event()

        def capture_and_hold(self: SnapshotEngine, checkpoint: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            stats = original_capture(self, checkpoint, path, *args, **kwargs)
            if os.path.basename(path) == _kill_name and not LINK:
                time.sleep(_HOLD_S)  # the local commit lands meanwhile, and its settled hook kills the process
            return stats

        def link_and_hold(trainer: Any, filepath: str, linkpath: str) -> None:
            original_link(trainer, filepath, linkpath)
            if os.path.basename(filepath) == _kill_name:
                linked.set()
                time.sleep(_HOLD_S)  # likewise, with last.ckpt linked to that file

        SnapshotEngine.capture = capture_and_hold  # type: ignore[method-assign]
        ModelCheckpoint._link_checkpoint = staticmethod(link_and_hold)  # type: ignore[method-assign,assignment]

        def settled_then_die(self: Replicator, item: Any, job: Any) -> None:
            if _is_target(item):
                if LINK and not linked.wait(_HOLD_S):
                    print(f"last.ckpt was never linked to {_kill_name}", flush=True)
                    os._exit(4)  # the test then fails, rather than check a state the kill was to leave
                _die(seam, item.local_path)  # the local commit is done (settled follows it), the copy not queued
            original_settled(self, item, job)

        Replicator.settled = settled_then_die  # type: ignore[method-assign]
    elif seam == "during":
        original_window = Replicator._window
        windows = [0]

        def window_then_die(self: Replicator, item: Any, *args: Any, **kwargs: Any) -> None:
            if _is_target(item):
                with _lock:  # the windows of one copy run on several threads
                    windows[0] += 1
                    second = windows[0] == 2
                if second:
                    _die(seam, item.entry.path)  # the session is open (S3: the multipart upload), a window in
            original_window(self, item, *args, **kwargs)

        Replicator._window = window_then_die  # type: ignore[method-assign]
    elif seam == "after":
        original_after = TieredCheckpoints._after_commit

        def after_then_die(self: TieredCheckpoints, item: Any) -> None:
            if _is_target(item):
                _die(seam, item.entry.path)  # committed on the persistent tier, still marked locally
            original_after(self, item)

        TieredCheckpoints._after_commit = after_then_die  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown seam {seam!r}")


class _DrainedBeforeTheKilledSave(DataStatesIO):
    """DataStatesIO that waits, before the first save of ``NAME``, until every earlier checkpoint is on both tiers.

    Without it the state at the kill would depend on the machine's load: the ``last.ckpt`` of each step may be
    replaced by the next one before its local write ends, and none be committed to resume from.
    """

    drained = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if os.path.basename(os.fspath(path)) == _kill_name and not self.drained:
            self.drain()
            self.drained = True
        super().save_checkpoint(checkpoint, path, storage_options)


def storage_options(endpoint: str | None) -> dict[str, Any] | None:
    """The plugin's options for the moto server at ``endpoint`` (None for a local persistent tier)."""
    if endpoint is None:
        return None
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
        "part_size_bytes": PART_SIZE,
        "retries": 1,
        "timeout_s": 20,
    }


def main() -> None:
    """Train until the seam kills this process (see the module docstring)."""
    global _kill_name
    dirpath, local_tier, seam, width, _kill_name = sys.argv[1:6]
    endpoint = sys.argv[6] if len(sys.argv) > 6 else None
    install_seam(seam)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    plugin = _DrainedBeforeTheKilledSave(
        local_tier=local_tier, chunk_size="64KiB", writer_threads=2, storage_options=storage_options(endpoint)
    )
    trainer = make_trainer(
        os.path.dirname(local_tier),
        plugin,
        callbacks=[every_step_checkpoint(dirpath, save_last="link" if LINK else True)],
        max_epochs=-1,
        max_steps=MAX_STEPS,
    )
    trainer.fit(BNModel(width=int(width)), make_loader(n=64))
    print(f"the run ended without meeting its seam {seam!r}", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
