"""Cut a checkpoint's storages into copy chunks: a pure plan, testable without threads or devices.

A chunk is what the copier moves into one arena block in one go and a writer flushes from it. Storages larger
than ``chunk_bytes`` are split across chunks (so a checkpoint larger than the arena streams through it);
small storages are packed together into one chunk (so ten thousand tiny tensors cost tens of copies, not ten
thousand).

For direct I/O, a piece that may hold a whole disk block is placed in its block so that its bytes sit at the same
position modulo ``phase_bytes`` in memory as in the file (arena blocks start on page boundaries): its aligned
middle is then written straight from the arena, with no bounce copy (see :mod:`~lightning_datastates.storage.local`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_datastates.alignment import align_up
from lightning_datastates.records.layout import StorageRecord

#: Pieces packed into one block start on this boundary (cheap memcpy, and matches torch's record alignment).
PIECE_ALIGNMENT_BYTES = 64


@dataclass(frozen=True)
class Piece:
    """``nbytes`` bytes of storage ``key`` from ``source_offset``: at ``block_offset`` in the chunk's block and at
    ``file_offset`` in the file."""

    key: int
    source_offset: int
    nbytes: int
    block_offset: int
    file_offset: int


@dataclass(frozen=True)
class Chunk:
    """Pieces sharing one arena block of ``block_bytes`` bytes."""

    pieces: tuple[Piece, ...]
    block_bytes: int


def plan_chunks(records: Iterable[StorageRecord], chunk_bytes: int, phase_bytes: int | None = None) -> list[Chunk]:
    """Cut ``records`` (in the given order) into chunks of at most ``chunk_bytes`` bytes each.

    With ``phase_bytes`` (a power of two, at most ``chunk_bytes``), every piece of at least that size (the only ones
    that can hold a whole disk block) starts at a block offset congruent to its file offset modulo ``phase_bytes``
    (at most ``phase_bytes`` of padding each).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if phase_bytes is not None and not (phase_bytes & (phase_bytes - 1) == 0 and phase_bytes <= chunk_bytes):
        raise ValueError(f"phase_bytes must be a power of two up to chunk_bytes ({chunk_bytes}), got {phase_bytes}")
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    filled = 0

    def close_chunk() -> None:
        nonlocal pieces, filled
        if pieces:
            chunks.append(Chunk(tuple(pieces), filled))
        pieces, filled = [], 0

    for record in records:
        done = 0
        while done < record.nbytes:
            file_offset = record.offset + done
            # Only a piece that can hold a whole disk block is placed in phase.
            phase = phase_bytes if phase_bytes is not None and record.nbytes - done >= phase_bytes else None
            start = _in_phase(filled, file_offset, phase) if phase else align_up(filled, PIECE_ALIGNMENT_BYTES)
            if start >= chunk_bytes:
                close_chunk()
                start = _in_phase(0, file_offset, phase) if phase else 0
            take = min(record.nbytes - done, chunk_bytes - start)
            pieces.append(Piece(record.key, done, take, start, file_offset))
            filled = start + take
            done += take
    close_chunk()
    return chunks


def _in_phase(filled: int, file_offset: int, phase_bytes: int) -> int:
    """The first block offset from ``filled`` that is congruent to ``file_offset`` modulo ``phase_bytes``."""
    return filled + (file_offset - filled) % phase_bytes
