"""One host copy serves several checkpoints of the same state (top-k file and ``last.ckpt`` of one step).

Two saves between the same two barriers see the same values in every lazily copied storage: by the lazy
contract such a storage changes only after the next barrier. So when a checkpoint is captured while an earlier
one's lazy copy of the same storage is still in the arena (or not yet made), the new checkpoint *follows* the
earlier one's chunks instead of copying the storage again: when a writer has written the earlier checkpoint's
chunk, it writes the same block bytes at the follower's own file offsets, then frees the block. One device copy,
one arena block, two files. Only the metadata (``data.pkl``) and the offsets differ between the files.

A storage is followed only if none of the chunks holding it has been freed yet; otherwise the new checkpoint
copies it itself (still correct, just not shared). A chunk that has followers is copied even if its own job was
cancelled or failed, because the followers need its bytes; if its copy fails, its followers fail with it.

Thread model: ``offer`` and ``follow`` run on the training thread (inside capture); ``must_copy`` and
``abandon`` on the copier thread; ``take_followers`` on writer threads. One lock orders them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_datastates.compat.torch import storage_identity
from lightning_datastates.records.chunks import Chunk
from lightning_datastates.records.job import SnapshotJob
from lightning_datastates.records.layout import StorageRecord


@dataclass(frozen=True)
class FollowerWrite:
    """``nbytes`` bytes at ``block_offset`` of a shared chunk's block, written at ``file_offset`` of the follower."""

    block_offset: int
    nbytes: int
    file_offset: int


@dataclass
class _SharedChunk:
    """A lazy chunk of a source job that later jobs may follow, until it is sealed (its block freed)."""

    chunk: Chunk  # held so its id (the lookup key) cannot be reused while the entry exists
    queued: bool = False  # in the arena, its write queued: a writer serves the followers
    sealed: bool = False
    followers: dict[int, tuple[SnapshotJob, list[FollowerWrite]]] = field(default_factory=dict)  # by id(job)


@dataclass
class _SharedStorage:
    """Where a storage's bytes are being copied: the source job's chunks and pieces holding them."""

    storage: torch.UntypedStorage  # held so its identity (the lookup key) cannot be reused while shared
    job: SnapshotJob
    pieces: list[tuple[Chunk, Any]]  # (chunk, Piece) of ``job.lazy_chunks`` covering the storage


@dataclass
class SharingCounters:
    """Bytes moved by copies into the arena versus bytes served to followers from another job's blocks."""

    copied_bytes: int = 0
    shared_bytes: int = 0


class SharedCopies:
    """Lazy copies captured since the last barrier, open for later checkpoints to follow (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storages: dict[int, _SharedStorage] = {}  # storage identity -> where it is being copied
        self._chunks: dict[int, _SharedChunk] = {}  # id(chunk) -> sharing state, for every offered chunk
        self.counters = SharingCounters()

    # ------------------------------------------------------------------ training thread
    def follow(
        self,
        job: SnapshotJob,
        records: list[StorageRecord],
        storages: list[torch.UntypedStorage],
    ) -> set[int]:
        """Make ``job`` follow earlier copies of ``records``' storages where possible; return the keys followed.

        Each followed chunk adds one unit of outstanding work to ``job``, released once its bytes are written.
        """
        followed: set[int] = set()
        with self._lock:
            for record in records:
                shared = self._storages.get(storage_identity(storages[record.key]))
                if shared is None or shared.job is job or record.nbytes == 0:
                    continue
                states = [self._chunks.get(id(chunk)) for chunk, _ in shared.pieces]
                if any(state is None or state.sealed for state in states):
                    continue  # partly freed (or skipped) already: copy it ourselves
                for state, (_, piece) in zip(states, shared.pieces, strict=True):
                    assert state is not None
                    entry = state.followers.get(id(job))
                    if entry is None:
                        entry = state.followers[id(job)] = (job, [])
                        job.add_outstanding()
                    entry[1].append(
                        FollowerWrite(piece.block_offset, piece.nbytes, record.offset + piece.source_offset)
                    )
                self.counters.shared_bytes += record.nbytes
                followed.add(record.key)
        return followed

    def offer(self, job: SnapshotJob, storages: list[torch.UntypedStorage]) -> None:
        """Open ``job``'s lazy chunks to later checkpoints (until the next :meth:`close_window`)."""
        with self._lock:
            by_key: dict[int, list[tuple[Chunk, Any]]] = {}
            for chunk in job.lazy_chunks:
                self._chunks[id(chunk)] = _SharedChunk(chunk)
                for piece in chunk.pieces:
                    by_key.setdefault(piece.key, []).append((chunk, piece))
            for key, pieces in by_key.items():
                self._storages[storage_identity(storages[key])] = _SharedStorage(storages[key], job, pieces)

    def close_window(self) -> None:
        """A barrier: lazily copied storages may change from now on, so no later checkpoint may follow them.

        Chunks that already have followers keep their state until written (see :meth:`take_followers`).
        """
        with self._lock:
            self._storages.clear()
            self._chunks = {key: state for key, state in self._chunks.items() if state.followers and not state.sealed}

    # ------------------------------------------------------------------ copier thread
    def must_copy(self, job: SnapshotJob, chunk: Chunk) -> bool:
        """Whether ``chunk`` must still be copied: its job goes on, or followers wait for its bytes.

        A chunk nobody needs is sealed here, so no checkpoint starts following it.
        """
        with self._lock:
            state = self._chunks.get(id(chunk))
            if state is None:
                return not job.stopped
            if job.stopped and not state.followers:
                state.sealed = True
                self._chunks.pop(id(chunk), None)
                return False
            return True

    def count_copied(self, nbytes: int) -> None:
        """Account ``nbytes`` copied into the arena."""
        with self._lock:
            self.counters.copied_bytes += nbytes

    def abandon(self, job: SnapshotJob, error: BaseException) -> list[tuple[SnapshotJob, BaseException]]:
        """``job``'s copy ended early: seal its chunks never copied; return their followers with the error."""
        orphans = []
        with self._lock:
            for chunk in job.lazy_chunks:
                state = self._chunks.get(id(chunk))
                if state is not None and not state.sealed and not state.queued:
                    state.sealed = True
                    orphans += [(follower, error) for follower, _ in state.followers.values()]
                    state.followers.clear()
                    self._chunks.pop(id(chunk), None)
        return orphans

    def mark_queued(self, chunk: Chunk) -> None:
        """``chunk``'s bytes are in the arena and its write is queued: its followers will be served by a writer."""
        with self._lock:
            state = self._chunks.get(id(chunk))
            if state is not None:
                state.queued = True

    # ------------------------------------------------------------------ writer threads
    def take_followers(self, chunk: Chunk) -> list[tuple[SnapshotJob, list[FollowerWrite]]]:
        """Seal ``chunk`` (its block is about to be freed) and return who still needs its bytes."""
        with self._lock:
            state = self._chunks.pop(id(chunk), None)
            if state is None:
                return []
            state.sealed = True
            return list(state.followers.values())
