"""What the writer threads are asked to do: one small frozen record per task, dispatched by type.

Call order, per checkpoint: 1) :class:`WriteMetadata`, then :class:`WriteChunk` and :class:`WriteThroughChunk` tasks,
put by the copier thread (:mod:`~lightning_datastates.copy.loop`); 2) one :class:`Commit`, put by whichever thread
released the checkpoint's last outstanding work. Writer threads take them in any order
(:mod:`~lightning_datastates.write.loop`). :data:`POLL_S` bounds how long an engine thread waits on its queue at a time.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from lightning_datastates.records.block import Block, PieceCrcs
from lightning_datastates.records.chunks import Chunk
from lightning_datastates.records.job import SnapshotJob

#: How often idle threads look whether they should end (engine closed, or interpreter exiting): the copier and the
#: writers wait on their queue at most this long at a time (:mod:`~lightning_datastates.snapshot.threads`).
POLL_S = 0.1


@dataclass(frozen=True, eq=False)
class WriteMetadata:
    """Write ``job``'s non-tensor bytes (the pickled skeleton, headers, and the like) at their offsets."""

    job: SnapshotJob


@dataclass(frozen=True, eq=False)
class WriteChunk:
    """Write ``chunk`` of ``job`` from its arena ``block``, then serve the chunk's followers and retire the block;
    ``crcs``: the CRC-32s the copier computed on the way, by block offset."""

    job: SnapshotJob
    chunk: Chunk
    block: Block
    crcs: PieceCrcs


@dataclass(frozen=True, eq=False)
class WriteThroughChunk:
    """Write ``chunk`` of ``job`` straight from the training tensors, unless a barrier came first (then the copier
    copies it into the arena); see :mod:`~lightning_datastates.records.through`."""

    job: SnapshotJob
    chunk: Chunk


@dataclass(frozen=True, eq=False)
class Commit:
    """Every write of ``job`` ended: complete its session (or abort it) and finish the job."""

    job: SnapshotJob


#: Any task of the writers' queue.
WriteTask = WriteMetadata | WriteChunk | WriteThroughChunk | Commit
#: Put in an engine thread's queue to wake it when the engine closes: not a task; the thread looks whether to end at
#: once instead of at its next :data:`POLL_S` timeout.
WAKE = None
#: The queue the writer threads take tasks from (and :data:`WAKE`).
WriteQueue = queue.Queue[WriteTask | None]
