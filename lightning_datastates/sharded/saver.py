"""One rank's sharded save: the training thread stages this rank's part (DCP's local plan, the plan of its file),
the engine copies and writes the file lazily, the committer plans the checkpoint with DCP over a gloo group and
publishes it once every rank's file is durable.

Call order (training thread of every rank, inside the strategy's ``save_checkpoint``): :meth:`ShardedSaver.save`,
whose first act is the one collective on the training thread: rank 0 marks the directory as holding a save in flight
and then broadcasts its path. Then, on engine threads, the copy and write of this rank's file; on the committer
thread, DCP's global planning, the exchange and the commit (:mod:`~lightning_datastates.sharded.commit`).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lightning_datastates.capture.verified import VerifiedStructures
from lightning_datastates.errors import CheckpointCaptureError
from lightning_datastates.interrupts import sigint_deferred
from lightning_datastates.records.job import SnapshotStats
from lightning_datastates.records.stamp import SAVE_SEQUENCE, stamp_bytes
from lightning_datastates.sharded.commit import ShardedCommitter, ShardedSave, remove_empty_local_directory
from lightning_datastates.sharded.dcp_writer import join_path
from lightning_datastates.sharded.layout import ArchivePlans
from lightning_datastates.sharded.leftovers import mark_pending
from lightning_datastates.sharded.staging import LocalPlans, failed_staging, stage_shard
from lightning_datastates.snapshot.engine import LazyPredicate, SnapshotEngine
from lightning_datastates.storage.base import StorageWriter
from lightning_datastates.storage.local import is_local_path, local_path


class SaverHost(Protocol):
    """What the saver needs from the plugin's :class:`~lightning_datastates.pipeline.CheckpointPipeline` (all on the
    training thread)."""

    @property
    def engine(self) -> SnapshotEngine:
        """The snapshot engine that copies and writes each rank's file."""

    def writer_for(self, path: str) -> StorageWriter:
        """The storage writer for ``path``."""

    def lazy_for_save(self) -> tuple[LazyPredicate | None, bool]:
        """Which storages may be copied after the save call, and whether the call waits for the commit."""

    def raise_pending_failure(self, path: str | None = None) -> None:
        """Raise the oldest unreported background failure (of ``path`` if given)."""

    def clean_once(self, directory: str) -> list[str]:
        """Remove what dead runs left in ``directory``, once per directory and run."""

    def wait_for_commit(self, path: str) -> None:
        """Return once the save of ``path`` is committed, raising its failure; the state is no longer read then."""


class ShardedSaver:
    """Saves this rank's part of sharded checkpoints (one per plugin and fit; see the module docstring).

    ``group`` is a gloo process group over every rank, made at setup for the committer's exchange.
    """

    def __init__(self, host: SaverHost, rank: int, group: Any, alignment: int | None) -> None:
        self._host = host
        self.rank = rank
        # The saves of one run repeat the same shards: their archives and DCP's local plan are planned once.
        self._plans = ArchivePlans(alignment, VerifiedStructures())
        self._local_plans = LocalPlans()
        self.committer = ShardedCommitter(group, rank, host.engine.pending, host.engine.wait_path, host.writer_for)

    def save(self, state: dict[str, Any], meta: dict[str, Any], path: str, broadcast: Callable[[Any], Any]) -> None:
        """Save ``state`` (tensors, sharded or not) in DCP's format into directory ``path``, and ``meta`` as
        Lightning's ``meta.pt`` (rank 0); return once training may go on (outside the training loop: once committed).

        ``path`` counts as rank 0 gives it: ``broadcast`` (the strategy's) sends rank 0's value to every rank. It is
        the only collective here; DCP's planning runs on the committer thread (see the module docstring). Every rank
        calls it once per save, whatever fails: a failure before it is sent through it (rank 0), one after it is handed
        to the committer, so that no rank waits for a save another rank gave up.

        Raises:
            CheckpointFlushError: an earlier background write failed (raised once; this save then fails on every rank).
            CheckpointCaptureError: rank 0 could not start this save (on the other ranks; rank 0 raises its own
                error, such as the meta that cannot be pickled or the directory that cannot be marked): nothing of it
                is left on storage.
            LayoutUnsupported: torch refused to plan a tensor's archive (the save fails on every rank; raised here).
        """
        started = time.perf_counter()
        host = self._host
        # No wait for an earlier save of this directory (last.ckpt at every step): each save writes files of its own,
        # and the committer publishes the saves in order, each removing the files of the one it replaces.
        path, marker, meta_bytes = self._announce(path, meta, broadcast)
        stats: SnapshotStats | None = None
        with sigint_deferred():  # Ctrl+C must not split a capture (see interrupts.py)
            try:
                host.raise_pending_failure()
                if self.rank != 0 and is_local_path(path):
                    _prepare_local_directory(local_path(path))
                writer = host.writer_for(path)
                lazy, awaits_commit = host.lazy_for_save()
                staged, shard = stage_shard(state, self.rank, self._plans, self._local_plans)
                if shard is not None:
                    file_path = join_path(path, staged.file_name)
                    # Not served from memory: DCP's reader reads shard files from storage. Blocks kept for loads
                    # that never come would keep a second checkpoint's worth of arena pages in use.
                    stats = host.engine.capture_planned(
                        shard.layout,
                        shard.storages,
                        file_path,
                        writer,
                        lazy,
                        awaits_commit,
                        serve_loads=False,
                        whole_checkpoint=False,  # a part of the directory's: its commit is the checkpoint
                    )
            except BaseException as exc:
                # The other ranks plan this save on their committer threads: this rank's committer joins them with
                # the failure, so that the save fails everywhere instead of leaving them waiting (and rank 0's
                # committer removes the marker).
                self.committer.submit(ShardedSave(path, None, failed_staging(self.rank, exc), meta_bytes, marker))
                raise
        if stats is not None:
            stats.save_call_s = time.perf_counter() - started
        self.committer.submit(ShardedSave(path, stats, staged, meta_bytes, marker))
        if awaits_commit:
            host.wait_for_commit(path)  # outside fit's training loop: as Lightning's own save does

    def _announce(
        self, path: str, meta: dict[str, Any], broadcast: Callable[[Any], Any]
    ) -> tuple[str, str | None, bytes | None]:
        """Every rank: the directory rank 0 names; rank 0 also: its in-flight marker there and ``meta.pt``'s bytes.

        Whatever only rank 0 does and may fail happens *before* the path reaches the other ranks: ``meta`` pickled,
        the first cleanup of the parent directory (before the marker, so that a dead run's marker in this very
        directory is gone first), the directory made and marked. So nothing of this save lands in the directory
        unmarked, and whatever a save that dies leaves there is found by the next run's cleanup
        (:mod:`~lightning_datastates.sharded.leftovers`). A rank 0 that fails sends its error instead of a go-ahead
        and removes the directory it made: every rank fails this save at once, and nothing of it is left.
        """
        marker: str | None = None
        meta_bytes: bytes | None = None
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                # A removal of this path held back behind pending saves (remove_checkpoint, then a new save of the
                # same path) must not run once this save has files there: dropped, or waited for if already running.
                self._host.engine.pending.before_save(path)
                meta_bytes = _serialized(meta)  # the non-tensor state as it is now
                self._host.clean_once(os.path.dirname(path.rstrip("/")) or ".")
                if is_local_path(path):
                    _prepare_local_directory(local_path(path))
                marker = mark_pending(self._host.writer_for(path), path)
            except BaseException as exc:  # noqa: BLE001 - sent to every rank (Ctrl+C too), raised below
                failure = exc
                remove_empty_local_directory(path)  # a directory named like a checkpoint would trip a resume
        path, error = broadcast((path, None if failure is None else repr(failure)))
        if failure is not None:
            raise failure
        if error is not None:
            raise CheckpointCaptureError(f"rank 0 could not start sharded checkpoint {path}: {error}")
        return path, marker, meta_bytes


def _prepare_local_directory(path: str) -> None:
    """As Lightning's sharded save: a single-file checkpoint at ``path`` makes way for the directory."""
    if os.path.isfile(path):
        os.unlink(path)
    os.makedirs(path, exist_ok=True)


def _serialized(meta: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    # Stamped as a single-file checkpoint is (records/stamp.py): what orders sharded checkpoints for "last".
    return stamp_bytes(buffer.getvalue(), SAVE_SEQUENCE.next())
