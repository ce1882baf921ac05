"""The copiers: a chunk's pieces land in the arena block, byte for byte, with the CRC-32 of each host piece.

The CPU copier copies by address, small pieces with the GIL held and large ones window by window; these tests
compare the block with the sources and every CRC with zlib's, over piece sizes on both sides of each threshold.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest
import torch

from lightning_datastates.capture.chunks import Piece, plan_chunks
from lightning_datastates.capture.layout import StorageRecord
from lightning_datastates.copy.copier import (
    COPY_WINDOW_BYTES,
    GIL_HELD_COPY_BYTES,
    CopierSet,
    CpuCopier,
    copy_host_bytes,
)
from tests.conftest import storage_bytes

SIZES = [0, 1, 63, 4096, GIL_HELD_COPY_BYTES, GIL_HELD_COPY_BYTES + 1, COPY_WINDOW_BYTES, 3 * COPY_WINDOW_BYTES + 77]


def _random_storage(nbytes: int, seed: int) -> torch.UntypedStorage:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).untyped_storage()


def _raw(storage: torch.UntypedStorage, start: int = 0, nbytes: int | None = None) -> bytes:
    return storage_bytes(storage)[start : None if nbytes is None else start + nbytes]


@pytest.mark.parametrize("nbytes", SIZES)
def test_copy_host_bytes_copies_and_checksums(nbytes: int) -> None:
    source, target = _random_storage(nbytes, nbytes), torch.zeros(nbytes + 16, dtype=torch.uint8)
    crc = copy_host_bytes(target.data_ptr() + 8, source.data_ptr(), nbytes)
    assert target[8 : 8 + nbytes].numpy().tobytes() == _raw(source)
    assert not target[:8].any() and not target[8 + nbytes :].any(), "wrote outside the range"
    assert crc == zlib.crc32(_raw(source))


def test_cpu_copier_copies_every_piece_of_a_chunk_with_its_crc() -> None:
    rng = random.Random(7)
    sizes = [rng.choice(SIZES[1:]) for _ in range(24)] + [rng.randint(1, 3000) for _ in range(24)]
    storages = [_random_storage(n, seed) for seed, n in enumerate(sizes)]
    offset, records = 0, []
    for key, n in enumerate(sizes):
        records.append(StorageRecord(key, offset, n))
        offset += -(-n // 64) * 64
    for chunk in plan_chunks(records, 1 << 20, 4096):
        block = torch.zeros(chunk.block_bytes, dtype=torch.uint8)
        crcs = CpuCopier().copy_pieces(block, chunk.pieces, storages, None)
        assert set(crcs) == {piece.block_offset for piece in chunk.pieces}
        for piece in chunk.pieces:
            expected = _raw(storages[piece.key], piece.source_offset, piece.nbytes)
            assert block[piece.block_offset : piece.block_offset + piece.nbytes].numpy().tobytes() == expected
            assert crcs[piece.block_offset] == (piece.nbytes, zlib.crc32(expected))


class _RecordingCopier:
    """Stands in for another device's copier: records what it is asked to copy, with which mark."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[Piece], object]] = []

    def mark(self) -> object:
        return "mark"

    def copy_pieces(self, block: torch.Tensor, pieces: Any, sources: Any, mark: object) -> dict[int, Any]:
        self.calls.append((list(pieces), mark))
        return {}


def test_copier_set_hands_each_device_its_own_pieces_and_mark() -> None:
    storages = [_random_storage(5000, 1), torch.empty(64, device="meta").untyped_storage(), _random_storage(100, 2)]
    pieces = (Piece(0, 1000, 3000, 0, 0), Piece(1, 0, 256, 3008, 0), Piece(2, 0, 100, 4096, 0))
    copiers, other = CopierSet(), _RecordingCopier()
    copiers._copiers[torch.device("meta")] = other  # type: ignore[assignment]
    block = torch.zeros(8192, dtype=torch.uint8)
    crcs = copiers.copy_chunk(block, pieces, storages, {torch.device("meta"): "meta mark", torch.device("cpu"): None})
    assert other.calls == [([pieces[1]], "meta mark")]
    assert block[:3000].numpy().tobytes() == _raw(storages[0], 1000, 3000)
    assert block[4096:4196].numpy().tobytes() == _raw(storages[2])
    assert crcs == {0: (3000, zlib.crc32(_raw(storages[0], 1000, 3000))), 4096: (100, zlib.crc32(_raw(storages[2])))}
