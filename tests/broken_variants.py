"""Deliberately broken variants of the plugin, to show that the contract tests can fail.

Not collected as tests. Load it as a pytest plugin and pick a variant through ``LDS_BROKEN``:

    LDS_BROKEN=barrier PYTHONPATH=$PWD python -m pytest -p tests.broken_variants tests/test_features.py

- ``barrier``: barriers return at once (training mutates state while copies still read it);
- ``always-lazy``: parameters and optimizer state are copied lazily under manual optimization too;
- ``drain``: nothing waits for pending writes (end of fit, exceptions, saves outside the loop, teardown);
- ``no-sharing``: checkpoints of the same step never share a host copy;
- ``write-through``: the copy of a checkpoint counts as done at once, while writers still write chunks straight from
  the training tensors, after barriers too.
"""

from __future__ import annotations

import os
import time

import pytest

from lightning_datastates.callback import DataStatesCallback
from lightning_datastates.plugin import DataStatesIO
from lightning_datastates.snapshot.direct import WriteThrough
from lightning_datastates.snapshot.engine import SnapshotEngine
from lightning_datastates.snapshot.job import SnapshotJob
from lightning_datastates.snapshot.sharing import SharedCopies


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
        monkeypatch.setattr(SnapshotEngine, "_copy_unwritten", lambda self, job, through: None)
        monkeypatch.setattr(SnapshotEngine, "_wait_copier", lambda self, ready: None)
        monkeypatch.setattr(WriteThrough, "close", lambda self: None)
        monkeypatch.setattr(WriteThrough, "take_unwritten", lambda self: [])

        def mark_copied(self):  # as SnapshotJob.mark_copied, but the sources stay reachable for the writers
            self.stats.copy_s = time.perf_counter() - self.stats.started_at
            self.eager_copied.set()
            self.copied.set()

        monkeypatch.setattr(SnapshotJob, "mark_copied", mark_copied)
    elif variant:
        raise ValueError(f"unknown LDS_BROKEN variant {variant!r}")
