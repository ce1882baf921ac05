"""Deliberately broken variants of the plugin, to show that the contract tests can fail.

Not collected as tests. Load it as a pytest plugin and pick a variant through ``LDS_BROKEN``:

    LDS_BROKEN=barrier PYTHONPATH=$PWD python -m pytest -p tests.broken_variants tests/test_features.py

- ``barrier``: barriers return at once (training mutates state while copies still read it);
- ``always-lazy``: parameters and optimizer state are copied lazily under manual optimization too;
- ``drain``: nothing waits for pending writes (end of fit, exceptions, saves outside the loop, teardown);
- ``no-sharing``: checkpoints of the same step never share a host copy;
- ``write-through``: the copy of a checkpoint counts as done at once, while writers still write chunks straight from
  the training tensors, after barriers too;
- ``resident-free``: a written block goes back to the arena while a retained image still serves from it;
- ``resident-stale``: a retained image is served without checking that the file on storage is unchanged;
- ``resident-lease``: eviction ignores leases (a load's image can be overwritten while it is read).
"""

from __future__ import annotations

import collections
import os
import time

import pytest

from lightning_datastates.callback import DataStatesCallback
from lightning_datastates.copy.loop import CopyLoop
from lightning_datastates.copy.sharing import SharedCopies
from lightning_datastates.load import resident
from lightning_datastates.plugin import DataStatesIO
from lightning_datastates.records.job import SnapshotJob
from lightning_datastates.records.through import WriteThrough
from lightning_datastates.snapshot.engine import SnapshotEngine


@pytest.fixture(autouse=True)
def _broken_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    variant = os.environ.get("LDS_BROKEN", "")
    if variant == "barrier":
        monkeypatch.setattr(SnapshotEngine, "wait_copies", lambda self, attribute=True: 0.0)
    elif variant == "always-lazy":
        original = DataStatesCallback.lazy_predicate

        def lazy_predicate(self):
            module = self._trainer.lightning_module if self._trainer is not None else None
            if module is None or module.automatic_optimization:
                return original(self)
            module.automatic_optimization = True  # pretend: the guard for manual optimization is gone
            try:
                return original(self)
            finally:
                module.automatic_optimization = False

        monkeypatch.setattr(DataStatesCallback, "lazy_predicate", lazy_predicate)
    elif variant == "drain":
        monkeypatch.setattr(SnapshotEngine, "drain", lambda self: None)
        monkeypatch.setattr(SnapshotEngine, "wait_path", lambda self, path: None)
        monkeypatch.setattr(DataStatesIO, "teardown", lambda self: None)
    elif variant == "no-sharing":
        monkeypatch.setattr(SharedCopies, "follow", lambda self, job, records, storages: set())
    elif variant == "write-through":
        monkeypatch.setattr(CopyLoop, "_copy_unwritten", lambda self, job, through: None)
        monkeypatch.setattr(CopyLoop, "_wait_copier", lambda self, ready: None)
        monkeypatch.setattr(WriteThrough, "close", lambda self: None)
        monkeypatch.setattr(WriteThrough, "take_unwritten", lambda self: [])

        def mark_copied(self):  # as SnapshotJob.mark_copied, but the sources stay reachable for the writers
            self.stats.copy_s = time.perf_counter() - self.stats.started_at
            self.eager_copied.set()
            self.copied.set()

        monkeypatch.setattr(SnapshotJob, "mark_copied", mark_copied)
    elif variant == "resident-free":
        original_retain = resident.ResidentCache.retain

        def retain(self, block, holders):
            # Counts may go negative (evictions then never free the block a second time); once the images hold the
            # block it goes back to the arena at once, while they still point at it.
            self._refs = collections.defaultdict(int, self._refs)
            original_retain(self, block, holders)
            if block in self._refs:  # held (or the original freed it already)
                del self._refs[block]
                self._arena.free(block)

        monkeypatch.setattr(resident.ResidentCache, "retain", retain)
    elif variant == "resident-stale":
        monkeypatch.setattr(resident, "_fingerprint", lambda writer, path: "unchanged")
    elif variant == "resident-lease":
        original_reclaim = resident.ResidentCache._reclaim

        def reclaim(self):
            for image in self._order:
                image.leases = 0  # forget the loads reading them
            return original_reclaim(self)

        monkeypatch.setattr(resident.ResidentCache, "_reclaim", reclaim)
    elif variant:
        raise ValueError(f"unknown LDS_BROKEN variant {variant!r}")
