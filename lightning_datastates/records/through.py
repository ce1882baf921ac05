"""Write-through: lazy chunks of host tensors written to storage straight from the training state.

On a GPU the device-to-host copy is unavoidable; for tensors already in host memory the copy into the arena is a
memory pass of its own, on cores the training shares. Until the next barrier the training state does not change, so
a writer thread may write a lazy chunk of CPU storages directly from the tensors instead: no copy, no arena space.
The barrier ends that: from the moment it starts, no writer may start another chunk from the sources; chunks not yet
started are copied into the arena as usual (and written from there), and the barrier returns once the chunks being
written from the sources are done.

Writes run at storage speed, copies at memory speed: if the copier waited for the barrier, the barrier would find
most of a large checkpoint still to copy. So inside the training loop the copier does not wait: it copies chunks into
the arena from the last one backwards while the writers take chunks from the front, and they meet somewhere in the
middle; what the writers took was never copied. When no barrier can come before the commit (a save outside the
training loop, whose caller waits for the commit) the copier leaves every chunk to the writers.

:class:`WriteThrough` is the per-checkpoint gate that decides, chunk by chunk, who takes each chunk (a writer,
straight from the sources, or the copier, into the arena), so that no chunk is taken twice and none is read from the
sources after the barrier returned. All its state is guarded by one condition shared with the copier thread, which
waits on it.

Thread model: :meth:`WriteThrough.claim` and :meth:`WriteThrough.done` run on writer threads, :meth:`WriteThrough.close`
on the training thread (the barrier), :meth:`WriteThrough.take_last` on the copier thread.
"""

from __future__ import annotations

import enum
import threading

from lightning_datastates.records.chunks import Chunk

#: Lazy chunks that may be written through are cut at most this large: a barrier that arrives while they are being
#: written waits for the ones in flight, so each must take only milliseconds (8 MiB reach the page cache in ~3 ms).
WRITE_THROUGH_CHUNK_BYTES = 8 * 1024**2


class _ChunkState(enum.Enum):
    PENDING = "pending"  # nobody took it yet
    WRITING = "writing"  # a writer is writing it from the sources
    WRITTEN = "written"  # written from the sources (or skipped: its job stopped)
    COPIED = "copied"  # taken by the copier, into the arena


class WriteThrough:
    """Which of one checkpoint's lazy chunks are written from the sources, and which go through the arena.

    Args:
        chunks: the chunks that may be written through (all sources in host memory).
        condition: the condition the copier thread waits on; every change here notifies it.
        copier_races: the copier takes chunks from the back (into the arena) while writers take them from the front,
            so that a barrier finds little left to copy; False when no barrier can come before the commit (the
            writers then take every chunk, and nothing is copied).
    """

    def __init__(self, chunks: list[Chunk], condition: threading.Condition, copier_races: bool = True) -> None:
        self.chunks = chunks
        self.copier_races = copier_races
        self._cond = condition
        self._states = {id(chunk): _ChunkState.PENDING for chunk in chunks}
        self._open = True

    def claim(self, chunk: Chunk) -> bool:
        """Writer thread: True if ``chunk`` is now this caller's to write from the sources (the barrier has not
        started and nobody took the chunk); the caller must call :meth:`done` afterwards."""
        with self._cond:
            if not self._open or self._states[id(chunk)] is not _ChunkState.PENDING:
                return False
            self._states[id(chunk)] = _ChunkState.WRITING
            return True

    def done(self, chunk: Chunk) -> None:
        """Writer thread: ``chunk`` is no longer read from the sources."""
        with self._cond:
            self._states[id(chunk)] = _ChunkState.WRITTEN
            self._cond.notify_all()

    def close(self) -> None:
        """Training thread, at a barrier: no chunk may start being written from the sources any more."""
        with self._cond:
            self._open = False
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """Whether a barrier closed the gate."""
        with self._cond:
            return not self._open

    def take_last(self) -> Chunk | None:
        """Copier thread: the last chunk nobody took, now the copier's to copy into the arena; None if none is left."""
        with self._cond:
            for chunk in reversed(self.chunks):
                if self._states[id(chunk)] is _ChunkState.PENDING:
                    self._states[id(chunk)] = _ChunkState.COPIED
                    return chunk
            return None

    def take_unwritten(self) -> list[Chunk]:
        """Copier thread: every chunk nobody took, now the copier's (after a failure: they will never be written)."""
        with self._cond:
            taken = [chunk for chunk in self.chunks if self._states[id(chunk)] is _ChunkState.PENDING]
            for chunk in taken:
                self._states[id(chunk)] = _ChunkState.COPIED
            return taken

    def settled(self) -> bool:
        """Whether every chunk was written from the sources or taken by the copier (call with the condition held)."""
        return all(state in (_ChunkState.WRITTEN, _ChunkState.COPIED) for state in self._states.values())

    def in_flight(self) -> bool:
        """Whether a writer is reading the sources now (call with the condition held)."""
        return any(state is _ChunkState.WRITING for state in self._states.values())
