"""One checkpoint on its way from the training state to storage, and what it cost.

States: ``COPYING`` -> (all chunks in the arena) -> ``WRITING`` -> ``COMMITTED``, or ``FAILED`` / ``CANCELLED``
at any point. Two events let other threads wait: ``copied`` (the sources are no longer read: training may
mutate them) and ``finished`` (committed, failed or cancelled: nothing of this job is pending any more).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_datastates.records.chunks import Chunk
from lightning_datastates.records.layout import CheckpointLayout
from lightning_datastates.records.session import WriteSession
from lightning_datastates.records.stamp import SaveStamp
from lightning_datastates.records.through import WriteThrough


class JobState(enum.Enum):
    """Where a snapshot job stands."""

    COPYING = "copying"
    WRITING = "writing"
    COMMITTED = "committed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"  # never started: on_arena_full="skip" and earlier checkpoints held the arena


@dataclass
class SnapshotStats:
    """What one checkpoint cost; times in seconds, from ``time.perf_counter``.

    ``blocked_s`` is the training thread's total wait for this checkpoint: inside ``save_checkpoint`` plus at
    barriers. ``copy_s`` runs from the save call until the last byte reached host memory; ``durable_s`` until
    the commit. ``first_copy_at`` is when the copier issued the first chunk's copy (None where no chunk was copied
    after the save call): :attr:`copying_s` is the copy itself, without the save call's planning.
    """

    path: str
    total_bytes: int
    payload_bytes: int
    started_at: float
    save_call_s: float = 0.0
    written_bytes: int = 0  # handed to storage so far (the drain progress bar reads it)
    barrier_wait_s: float = 0.0
    copy_s: float | None = None
    first_copy_at: float | None = None  # set by the copier thread, read once ``copied`` is set
    arena_wait_s: float = 0.0  # the copy's wait for arena space held by earlier checkpoints (back-pressure)
    durable_s: float | None = None
    state: str = JobState.COPYING.value
    # With a local tier (``DataStatesIO(local_tier=...)``): ``path`` is the local copy, ``durable_s`` its commit there,
    # and these follow the copy at the persistent path. ``replication``: None without a local tier, else "pending",
    # then "committed", "failed" or "cancelled"; ``persistent_durable_s`` from the save call until the persistent
    # commit (set with "committed").
    persistent_path: str | None = None
    replicated_bytes: int = 0
    persistent_durable_s: float | None = None
    replication: str | None = None
    #: The save's stamp, written into the file (None: a file that carries none, a sharded checkpoint's shard file).
    stamp: SaveStamp | None = None

    @property
    def final(self) -> bool:
        """Whether nothing more will change for this checkpoint on any tier: committed, failed or cancelled, and
        replicated (or not) where there is a local tier. Skipped saves are never final (nothing is written)."""
        return self.durable_s is not None and self.replication != "pending"

    @property
    def blocked_s(self) -> float:
        """Training time lost to this checkpoint."""
        return self.save_call_s + self.barrier_wait_s

    @property
    def copying_s(self) -> float | None:
        """From the first chunk's copy issued by the copier until the last byte reached host memory (waits for arena
        space between chunks included); None until copied, or where no chunk was copied after the save call. The
        copy's rate is ``payload_bytes / copying_s``, comparable with a plain device-to-host ``copy_``."""
        if self.copy_s is None or self.first_copy_at is None:
            return None
        return self.started_at + self.copy_s - self.first_copy_at


@dataclass
class SnapshotJob:
    """A checkpoint being copied and flushed; the engine owns every transition."""

    path: str
    layout: CheckpointLayout
    session: WriteSession
    sources: list[torch.UntypedStorage] | None
    eager_chunks: list[Chunk]
    marks: dict[torch.device, Any]
    stats: SnapshotStats
    lazy_chunks: list[Chunk] = field(default_factory=list)  # planned at registration, with the sharing of copies
    state: JobState = JobState.COPYING
    error: BaseException | None = None
    cancel_requested: bool = False
    eager_copied: threading.Event = field(default_factory=threading.Event)
    copied: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    # Work that must end before the commit: every write task, the copy itself, and the predecessor (a pending
    # save to the same path, which must finish first so saves to one path land in order).
    outstanding: int = 1
    successor: SnapshotJob | None = None
    #: The next entry registered under the same path while this one was pending (the successor; see
    #: :mod:`~lightning_datastates.snapshot.pending`): a removal waiting for this one waits for it if this one is
    #: cancelled.
    later: Any = None
    #: Registered while a save of the same path was pending and cancelled that one (coalesced): this one is not
    #: cancelled by the next save, so that a path saved again and again still lands at least every second save.
    follows_cancelled: bool = False
    #: Its place among the saves registered (set at registration, :mod:`~lightning_datastates.snapshot.pending`).
    order: int = -1
    #: Whether this file is a checkpoint on its own (the one a removal may wait for to land): not a shard file of a
    #: sharded checkpoint (its directory's commit is), nor the local tier's copy (its replication is).
    whole_checkpoint: bool = True
    settled: bool = False  # past its commit or abort: deferred removals no longer wait for it
    lock: threading.Lock = field(default_factory=threading.Lock)
    on_ready: Callable[[SnapshotJob], None] | None = None
    #: Called once on the writer thread after the commit or abort (``state`` and ``stats`` final), before the job
    #: finishes: so before a newer save of the same path can replace the file (the local tier's replicator opens the
    #: committed file here).
    on_settled: Callable[[SnapshotJob], None] | None = None
    write_through: WriteThrough | None = None  # lazy chunks writers may take straight from the sources

    @property
    def stopped(self) -> bool:
        """Failed or cancelled: remaining copies and writes are skipped."""
        return self.error is not None or self.cancel_requested

    def fail(self, exc: BaseException) -> None:
        """Record the first failure; later ones are consequences and are dropped."""
        with self.lock:
            if self.error is None:
                self.error = exc

    def add_written(self, nbytes: int) -> None:
        """Count ``nbytes`` more bytes handed to storage (writer threads call this concurrently)."""
        with self.lock:
            self.stats.written_bytes += nbytes

    def add_outstanding(self, count: int = 1) -> None:
        """Register ``count`` more pieces of work that must end before the commit."""
        with self.lock:
            self.outstanding += count

    def release(self) -> None:
        """One piece of work ended; the last one hands the job to ``on_ready`` for its commit."""
        with self.lock:
            self.outstanding -= 1
            ready = self.outstanding == 0
        if ready and self.on_ready is not None:
            self.on_ready(self)

    def mark_copied(self) -> None:
        """The sources will not be read again: drop them and let barriers through."""
        self.sources = None
        self.stats.copy_s = time.perf_counter() - self.stats.started_at
        if self.state is JobState.COPYING:
            self.state = JobState.WRITING
        self.eager_copied.set()
        self.copied.set()
