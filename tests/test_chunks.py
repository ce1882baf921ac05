"""Chunk planning: every payload byte lands in exactly one piece, pieces fit their blocks, blocks fit chunk_bytes."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_datastates.records.chunks import PIECE_ALIGNMENT_BYTES, Chunk, Piece, plan_chunks
from lightning_datastates.records.layout import StorageRecord


def _records(sizes: list[int], start: int = 64, alignment: int = 64) -> list[StorageRecord]:
    """Records laid out like torch's: increasing offsets, each aligned, with a gap of headers between them."""
    records, offset = [], start
    for key, size in enumerate(sizes):
        records.append(StorageRecord(key, offset if size else 0, size))
        offset = -(-(offset + size + 50) // alignment) * alignment
    return records


def _check_plan(
    records: list[StorageRecord], chunks: list[Chunk], chunk_bytes: int, phase_bytes: int | None = None
) -> None:
    """All invariants of a chunk plan (with ``phase_bytes``: pieces of a phase or more are in phase)."""
    by_key = {r.key: r for r in records}
    covered: dict[int, list[tuple[int, int]]] = {r.key: [] for r in records}
    for chunk in chunks:
        assert chunk.pieces, "an empty chunk"
        assert 0 < chunk.block_bytes <= chunk_bytes
        spans = []
        for piece in chunk.pieces:
            assert piece.nbytes > 0, "a zero-size piece"
            if phase_bytes is None:
                assert piece.block_offset % PIECE_ALIGNMENT_BYTES == 0
            elif piece.nbytes >= phase_bytes:
                assert piece.block_offset % phase_bytes == piece.file_offset % phase_bytes, "out of phase"
            assert piece.block_offset + piece.nbytes <= chunk.block_bytes
            record = by_key[piece.key]
            assert 0 <= piece.source_offset and piece.source_offset + piece.nbytes <= record.nbytes
            assert piece.file_offset == record.offset + piece.source_offset
            covered[piece.key].append((piece.source_offset, piece.nbytes))
            spans.append((piece.block_offset, piece.block_offset + piece.nbytes))
        spans.sort()
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), "pieces overlap in a block"
        assert chunk.block_bytes == spans[-1][1], "block_bytes is the end of the last piece"
    for key, pieces in covered.items():
        pieces.sort()
        position = 0
        for source_offset, nbytes in pieces:
            assert source_offset == position, (
                f"record {key}: byte {position} covered {'twice' if source_offset < position else 'never'}"
            )
            position += nbytes
        assert position == by_key[key].nbytes, f"record {key}: {position} of {by_key[key].nbytes} bytes covered"


def _byte_owner_map(records: list[StorageRecord], chunks: list[Chunk]) -> dict[tuple[int, int], int]:
    """(key, byte) -> how many pieces carry that byte; an independent, byte-by-byte coverage check."""
    counts: dict[tuple[int, int], int] = {}
    for chunk in chunks:
        for piece in chunk.pieces:
            for b in range(piece.source_offset, piece.source_offset + piece.nbytes):
                counts[(piece.key, b)] = counts.get((piece.key, b), 0) + 1
    return counts


@pytest.mark.parametrize("seed", range(40))
def test_random_records_are_covered_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    chunk_bytes = rng.choice([1, 7, 63, 64, 65, 100, 128, 1000, 4096, 5000, 1 << 16])
    sizes = [
        rng.choice(
            [
                0,
                rng.randint(1, 10),
                rng.randint(1, 200),
                rng.randint(1, 3 * chunk_bytes + 5),
                min(10_000, 100 * chunk_bytes),
            ]
        )
        for _ in range(rng.randint(0, 60))
    ]
    records = _records(sizes)
    chunks = plan_chunks(records, chunk_bytes)
    _check_plan(records, chunks, chunk_bytes)
    assert sum(p.nbytes for c in chunks for p in c.pieces) == sum(sizes)


@pytest.mark.parametrize("seed", range(5))
def test_every_byte_exactly_once_byte_by_byte(seed: int) -> None:
    rng = random.Random(1000 + seed)
    chunk_bytes = rng.choice([64, 100, 256])
    records = _records([rng.randint(0, 700) for _ in range(25)])
    counts = _byte_owner_map(records, plan_chunks(records, chunk_bytes))
    expected = {(r.key, b) for r in records for b in range(r.nbytes)}
    assert set(counts) == expected
    assert set(counts.values()) <= {1}


def test_plan_copies_bytes_to_the_right_file_offsets() -> None:
    # Simulate copier + writer: source bytes -> block -> file, and compare with the direct placement.
    rng = random.Random(99)
    sizes = [rng.randint(0, 3000) for _ in range(30)]
    records = _records(sizes)
    sources = {r.key: bytes(rng.randrange(256) for _ in range(r.nbytes)) for r in records}
    total = max(r.offset + r.nbytes for r in records)
    expected = bytearray(total)
    for r in records:
        expected[r.offset : r.offset + r.nbytes] = sources[r.key]
    written = bytearray(total)
    for chunk in plan_chunks(records, 1024):
        block = bytearray(chunk.block_bytes)
        for p in chunk.pieces:
            block[p.block_offset : p.block_offset + p.nbytes] = sources[p.key][
                p.source_offset : p.source_offset + p.nbytes
            ]
        for p in chunk.pieces:
            written[p.file_offset : p.file_offset + p.nbytes] = block[p.block_offset : p.block_offset + p.nbytes]
    assert written == expected


@pytest.mark.parametrize("seed", range(20))
def test_phased_plans_keep_every_invariant(seed: int) -> None:
    rng = random.Random(500 + seed)
    phase_bytes = rng.choice([64, 512, 4096])
    chunk_bytes = rng.choice([phase_bytes, 3 * phase_bytes, 5000, 1 << 16])
    if chunk_bytes < phase_bytes:
        chunk_bytes = phase_bytes
    sizes = [rng.choice([0, rng.randint(1, 300), rng.randint(1, 3 * chunk_bytes + 5)]) for _ in range(40)]
    records = _records(sizes, start=rng.randrange(64, 8192, 64))
    chunks = plan_chunks(records, chunk_bytes, phase_bytes)
    _check_plan(records, chunks, chunk_bytes, phase_bytes)
    counts = _byte_owner_map(records, chunks)
    assert set(counts) == {(r.key, b) for r in records for b in range(r.nbytes)} and set(counts.values()) <= {1}


def test_a_big_record_starts_in_phase_and_continues_on_block_boundaries() -> None:
    record = StorageRecord(1, 1024 + 64, 20_000)  # at 1088 in the file: 1088 bytes past a 4 KiB boundary
    chunks = plan_chunks([_records([100])[0], record], 8192, phase_bytes=4096)
    first, *rest = chunks
    assert first.pieces[1] == Piece(1, 0, 8192 - 1088, 1088, 1088)  # after the small record, padded into phase
    assert [(p.source_offset, p.block_offset, p.file_offset % 4096) for c in rest for p in c.pieces] == [
        (7104, 0, 0),
        (15296, 0, 0),
    ]
    with pytest.raises(ValueError, match="phase_bytes"):
        plan_chunks([record], 4096, phase_bytes=3000)


def test_big_record_is_split_into_full_chunks() -> None:
    record = StorageRecord(0, 1024, 10_000)
    chunks = plan_chunks([record], 4096)
    assert [c.block_bytes for c in chunks] == [4096, 4096, 1808]
    assert [c.pieces for c in chunks] == [
        (Piece(0, 0, 4096, 0, 1024),),
        (Piece(0, 4096, 4096, 0, 1024 + 4096),),
        (Piece(0, 8192, 1808, 0, 1024 + 8192),),
    ]


def test_small_records_are_packed_into_one_chunk_at_aligned_offsets() -> None:
    records = _records([10] * 20)
    chunks = plan_chunks(records, 4096)
    assert len(chunks) == 1
    assert [p.block_offset for p in chunks[0].pieces] == [64 * i for i in range(20)]
    assert [p.key for p in chunks[0].pieces] == list(range(20))
    assert chunks[0].block_bytes == 64 * 19 + 10


def test_ten_thousand_tiny_records_make_few_chunks() -> None:
    records = _records([4] * 10_000)
    chunks = plan_chunks(records, 64 * 1024)
    assert len(chunks) == -(-10_000 // 1024)  # 1024 aligned 64-byte slots per 64 KiB block
    _check_plan(records, chunks, 64 * 1024)


def test_record_after_a_partial_chunk_starts_aligned_and_fills_the_rest() -> None:
    records = [StorageRecord(0, 64, 10), StorageRecord(1, 192, 500)]
    chunks = plan_chunks(records, 256)
    assert chunks[0].pieces == (Piece(0, 0, 10, 0, 64), Piece(1, 0, 192, 64, 192))
    assert chunks[0].block_bytes == 256
    assert chunks[1].pieces == (Piece(1, 192, 256, 0, 384),)
    assert chunks[2].pieces == (Piece(1, 448, 52, 0, 640),)


def test_chunk_not_a_multiple_of_the_alignment() -> None:
    # 100-byte chunks: after a 10-byte piece the next aligned slot (64) leaves 36 bytes.
    records = [StorageRecord(0, 0, 10), StorageRecord(1, 64, 50), StorageRecord(2, 128, 3)]
    chunks = plan_chunks(records, 100)
    _check_plan(records, chunks, 100)
    assert chunks[0].pieces == (Piece(0, 0, 10, 0, 0), Piece(1, 0, 36, 64, 64))
    assert chunks[1].pieces[0] == Piece(1, 36, 14, 0, 100)


def test_chunk_smaller_than_the_alignment() -> None:
    records = _records([5, 0, 17, 3])
    chunks = plan_chunks(records, 8)
    _check_plan(records, chunks, 8)
    assert all(len(c.pieces) == 1 for c in chunks)  # no second aligned slot fits in 8 bytes


def test_zero_size_records_produce_no_pieces() -> None:
    assert plan_chunks([StorageRecord(0, 0, 0), StorageRecord(1, 0, 0)], 4096) == []
    records = [StorageRecord(0, 0, 0), StorageRecord(1, 64, 8), StorageRecord(2, 0, 0)]
    chunks = plan_chunks(records, 4096)
    assert [p.key for c in chunks for p in c.pieces] == [1]


def test_no_records_no_chunks() -> None:
    assert plan_chunks([], 4096) == []


def test_records_keep_the_given_order_and_accept_any_iterable() -> None:
    records = _records([100, 200, 300])
    reordered = [records[2], records[0], records[1]]
    chunks = plan_chunks(iter(reordered), 4096)  # a generator, as the engine passes
    assert [p.key for c in chunks for p in c.pieces] == [2, 0, 1]


def test_exact_fit_does_not_leave_an_empty_chunk() -> None:
    chunks = plan_chunks([StorageRecord(0, 0, 4096), StorageRecord(1, 4096, 4096)], 4096)
    assert len(chunks) == 2 and all(c.block_bytes == 4096 for c in chunks)


@pytest.mark.parametrize("chunk_bytes", [0, -1, -4096])
def test_non_positive_chunk_bytes_is_rejected(chunk_bytes: int) -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks(_records([10]), chunk_bytes)
