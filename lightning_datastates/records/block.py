"""A block of the host arena, and what the copier learned of the bytes it copied into one.

The arena (:mod:`~lightning_datastates.copy.arena`) hands out :class:`Block` s; a chunk is copied into one
(:mod:`~lightning_datastates.copy.copier`, which returns the :data:`PieceCrcs` it computed on the way), written from it
(:mod:`~lightning_datastates.write.loop`), and may be retained afterwards to serve loads
(:mod:`~lightning_datastates.load.resident`). Pure records.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_datastates.alignment import align_up

#: Block offset of a piece in its arena block -> (its size, the CRC-32 the copier computed while copying it).
PieceCrcs = dict[int, tuple[int, int]]


@dataclass(frozen=True)
class Block:
    """A byte range ``[offset, offset + nbytes)`` of the arena; ``nbytes`` is what the caller asked for."""

    offset: int
    nbytes: int

    @property
    def reserved_bytes(self) -> int:
        """Bytes the block occupies in the arena (``nbytes`` rounded up to whole pages: direct I/O writes straight
        from the arena)."""
        return align_up(max(self.nbytes, 1))
