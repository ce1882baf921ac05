"""The copiers: a chunk's pieces land in the arena block, byte for byte, with the CRC-32 of each large host piece.

The CPU copier copies by address, small pieces with the GIL held and large ones window by window; these tests
compare the block with the sources and every CRC with zlib's, over piece sizes on both sides of each threshold.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lightning_datastates import DataStatesIO
from lightning_datastates.copy.copier import (
    COPY_WINDOW_BYTES,
    GIL_HELD_COPY_BYTES,
    ChunkCopy,
    Copied,
    CopierSet,
    CpuCopier,
    byte_range,
    copy_host_bytes,
)
from lightning_datastates.copy.loop import IN_FLIGHT_CHUNKS
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.records.chunks import Piece, plan_chunks
from lightning_datastates.records.layout import StorageRecord
from tests.conftest import assert_bit_equal, in_background, storage_bytes

SIZES = [0, 1, 63, 4096, GIL_HELD_COPY_BYTES, GIL_HELD_COPY_BYTES + 1, COPY_WINDOW_BYTES, 3 * COPY_WINDOW_BYTES + 77]


def _random_storage(nbytes: int, seed: int) -> torch.UntypedStorage:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).untyped_storage()


def _raw(storage: torch.UntypedStorage, start: int = 0, nbytes: int | None = None) -> bytes:
    return storage_bytes(storage)[start : None if nbytes is None else start + nbytes]


@pytest.mark.parametrize("nbytes", SIZES)
def test_copy_host_bytes_copies_and_checksums_large_ranges(nbytes: int) -> None:
    source, target = _random_storage(nbytes, nbytes), torch.zeros(nbytes + 16, dtype=torch.uint8)
    crc = copy_host_bytes(target.data_ptr() + 8, source.data_ptr(), nbytes)
    assert target[8 : 8 + nbytes].numpy().tobytes() == _raw(source)
    assert not target[:8].any() and not target[8 + nbytes :].any(), "wrote outside the range"
    # Small ranges are copied with the GIL held and checksummed by the writer threads (a CRC would release it).
    assert crc == (None if nbytes <= GIL_HELD_COPY_BYTES else zlib.crc32(_raw(source)))


@pytest.mark.parametrize(("offset", "nbytes"), [(0, 0), (0, 4000), (1, 1), (3, 3997), (4000, 0)])
def test_byte_range_views_exactly_the_bytes_asked_for(offset: int, nbytes: int) -> None:
    """The device copiers read a piece's bytes through this view (made in one call, no slicing)."""
    storage = _random_storage(4000, 3)
    view = byte_range(storage, offset, nbytes)
    assert (
        view.dtype == torch.uint8
        and view.shape == (nbytes,)
        and view.untyped_storage().data_ptr() == storage.data_ptr()
    )
    assert view.numpy().tobytes() == _raw(storage, offset, nbytes)


def test_small_pieces_are_copied_without_a_crc_and_the_file_carries_theirs(tmp_path) -> None:
    """The save call waits for small tensors' copies, not their CRCs: the copier computes none for them (a CRC over
    5 KiB releases the GIL, and retaking it costs more than the copy) and the writers fill them in; the file then
    passes verification, which checks every record's CRC."""
    from lightning_datastates.load.integrity import verify_file

    small = {f"t{i}": torch.randn(64 * (i + 1)) for i in range(40)}  # 256 B .. 10 KiB: both sides of 5 KiB
    storages = [tensor.untyped_storage() for tensor in small.values()]
    records = [StorageRecord(key, key * GIL_HELD_COPY_BYTES, s.nbytes()) for key, s in enumerate(storages)]
    (chunk,) = plan_chunks(records, 1 << 22, 4096)
    block = torch.zeros(chunk.block_bytes, dtype=torch.uint8)
    assert CpuCopier().copy_pieces(block, chunk.pieces, storages, None) == {}
    checkpoint = {**small, "big": torch.randn(GIL_HELD_COPY_BYTES)}  # one CRC from the copier, 40 from writers
    path = str(tmp_path / "small.ckpt")
    plugin = in_background(DataStatesIO())
    plugin.save_checkpoint(checkpoint, path)
    plugin.drain()
    assert verify_file(path).complete
    assert_bit_equal(torch.load(path, weights_only=True), checkpoint)
    plugin.teardown()


def test_cpu_copier_copies_every_piece_of_a_chunk_with_the_crc_of_large_ones() -> None:
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
        large = {piece.block_offset for piece in chunk.pieces if piece.nbytes > GIL_HELD_COPY_BYTES}
        assert set(crcs) == large
        for piece in chunk.pieces:
            expected = _raw(storages[piece.key], piece.source_offset, piece.nbytes)
            assert block[piece.block_offset : piece.block_offset + piece.nbytes].numpy().tobytes() == expected
            if piece.block_offset in large:
                assert crcs[piece.block_offset] == (piece.nbytes, zlib.crc32(expected))


class _RecordingCopier:
    """Stands in for another device's copier: records what it is asked to copy, with which mark."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[Piece], object]] = []

    def mark(self) -> object:
        return "mark"

    def start_pieces(self, block: torch.Tensor, pieces: Any, sources: Any, mark: object) -> Copied:
        self.calls.append((list(pieces), mark))
        return Copied({})


def test_copier_set_hands_each_device_its_own_pieces_and_mark() -> None:
    large = GIL_HELD_COPY_BYTES + 3000  # host pieces larger than this get the copier's CRC-32
    storages = [_random_storage(large + 1000, 1), torch.empty(64, device="meta").untyped_storage()]
    storages.append(_random_storage(large, 2))
    second = large + 4096 - large % 4096
    pieces = (Piece(0, 1000, large, 0, 0), Piece(1, 0, 256, large + 8, 0), Piece(2, 0, large, second, 0))
    copiers, other = CopierSet(), _RecordingCopier()
    copiers._copiers[torch.device("meta")] = other  # type: ignore[assignment]
    block = torch.zeros(second + large, dtype=torch.uint8)
    marks = {torch.device("meta"): "meta mark", torch.device("cpu"): None}
    crcs = copiers.start_chunk(block, pieces, storages, marks).wait()
    assert other.calls == [([pieces[1]], "meta mark")]
    assert block[:large].numpy().tobytes() == _raw(storages[0], 1000, large)
    assert block[second:].numpy().tobytes() == _raw(storages[2])
    expected = {0: (large, zlib.crc32(_raw(storages[0], 1000, large))), second: (large, zlib.crc32(_raw(storages[2])))}
    assert crcs == expected


# ------------------------------------------------------------------------------------------------ chunks in flight
class DeferredCopier:
    """Stands in for a device copier whose copies end later (a DMA engine): ``start_pieces`` returns after 2 ms, and
    the bytes are read from the sources and land in the block only when the copy ends: at ``wait``, or when the test's
    "copy engine" (``advance``) gets to it. Records how many chunks were in flight at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: list[_DeferredCopy] = []
        self.most_in_flight = 0

    def mark(self) -> object:
        return None

    def start_pieces(self, block: torch.Tensor, pieces: Any, sources: Any, mark: object) -> _DeferredCopy:
        time.sleep(0.002)  # issuing copies takes a while, the GIL released: training goes on meanwhile
        copy = _DeferredCopy(self, block, list(pieces), list(sources))
        with self._lock:
            self._queued.append(copy)
            self.most_in_flight = max(self.most_in_flight, sum(not c.done for c in self._queued))
        return copy

    def advance(self) -> None:
        """End the oldest copy still queued, as a stream would (in order)."""
        with self._lock:
            pending = [c for c in self._queued if not c.done]
        if pending:
            pending[0].wait()


class _DeferredCopy:
    def __init__(self, copier: DeferredCopier, block: torch.Tensor, pieces: list[Piece], sources: list[Any]) -> None:
        self.copier, self.block, self.pieces, self.sources, self.done = copier, block, pieces, sources, False

    def ready(self) -> bool:
        return self.done

    def wait(self) -> dict[int, Any]:
        with self.copier._lock:
            if not self.done:
                CpuCopier().copy_pieces(self.block, self.pieces, self.sources, None)  # read the sources now
                self.done = True
        return {}  # no CRC-32s, as from a device: the writers compute them


@pytest.fixture
def deferred_copies() -> Iterator[DeferredCopier]:
    """A :class:`DeferredCopier` and a thread that ends its copies one by one, every 20 ms, until the test
    ends (a wait ends a copy at once too)."""
    copier, stop = DeferredCopier(), threading.Event()

    def copy_engine() -> None:
        while not stop.wait(0.02):
            copier.advance()

    engine = threading.Thread(target=copy_engine, name="test-copy-engine")
    engine.start()
    yield copier
    stop.set()


def _with_deferred_copies(plugin: DataStatesIO, copier: DeferredCopier) -> DataStatesIO:
    pipeline_of(plugin).engine._copiers._copiers[torch.device("cpu")] = copier  # type: ignore[assignment]
    return plugin


def test_chunks_in_flight_reach_the_file_as_they_were_at_the_save_call(tmp_path, deferred_copies) -> None:
    """Many chunks are started before the first ends; each is written only once its copy ended, the save call
    returns only once the eager chunks' copies ended, and the barrier only once every copy ended: the files equal
    the state at the save call although training changes it right after the save call (eager tensors) and right
    after the barrier (the rest)."""
    plugin = _with_deferred_copies(in_background(DataStatesIO(chunk_size="64KiB"), lazy=True), deferred_copies)
    expected = []
    state = {"big": torch.randn(2**20 // 4), "small": torch.randn(100), "more": torch.randn(3 * 2**16)}
    for round_ in range(3):
        path = str(tmp_path / f"r{round_}.ckpt")
        expected.append({k: v.clone() for k, v in state.items()})
        plugin.save_checkpoint(state, path)
        state["small"].add_(1.0)  # eager (at most eager_copy_size): may change once the save call returned
        pipeline_of(plugin).barrier()
        for tensor in state.values():
            tensor.add_(1.0)  # the optimizer step
    plugin.drain()
    for round_ in range(3):
        assert_bit_equal(torch.load(tmp_path / f"r{round_}.ckpt", weights_only=True), expected[round_])
    assert 1 < deferred_copies.most_in_flight <= IN_FLIGHT_CHUNKS  # several chunks in flight, never more
    plugin.teardown()


def test_chunks_in_flight_with_a_full_arena_and_stalled_storage(tmp_path, deferred_copies, gated_writer) -> None:
    """Chunks in flight hold arena space: when the arena is full while storage stalls, the copier hands them to the
    writers before it waits for space, and every file still equals its state."""
    plugin = DataStatesIO(host_cache="1MiB", chunk_size="64KiB")
    plugin = _with_deferred_copies(in_background(plugin, lazy=True), deferred_copies)
    gated_writer.gate.clear()
    threading.Timer(0.3, gated_writer.gate.set).start()  # storage stalls while the arena fills
    state = {"w": torch.randn(3 * 2**20 // 4)}  # 3 MiB: three times the arena
    expected = {"w": state["w"].clone()}
    plugin.save_checkpoint(state, str(tmp_path / "a.ckpt"))
    pipeline_of(plugin).barrier()
    state["w"].add_(1.0)
    plugin.drain()
    assert_bit_equal(torch.load(tmp_path / "a.ckpt", weights_only=True), expected)
    assert deferred_copies.most_in_flight > 1
    plugin.teardown()


def test_a_chunk_copy_waits_for_every_device_before_raising_one_failure() -> None:
    """A chunk's block is freed when its copy fails: every device's copies must have ended by then."""
    ended: list[str] = []

    class Failing:
        def ready(self) -> bool:
            return True

        def wait(self) -> dict[int, Any]:
            ended.append("failing")
            raise RuntimeError("copy failed (injected)")

    class Slow:
        def ready(self) -> bool:
            return False

        def wait(self) -> dict[int, Any]:
            ended.append("slow")
            return {}

    with pytest.raises(RuntimeError, match="injected"):
        ChunkCopy([Failing(), Slow()]).wait()
    assert ended == ["failing", "slow"]


def test_the_copy_is_timed_from_its_first_chunk_as_well_as_from_the_save_call(tmp_path, monkeypatch) -> None:
    """``copying_s`` (what a copy rate is computed from) starts when the copier issues the first chunk, after the save
    call's planning: shorter than ``copy_s`` by at least that planning."""
    from lightning_datastates.snapshot import engine

    plan = engine.SnapshotEngine.capture_planned

    def slow_planning(self, *args, **kwargs):
        time.sleep(0.2)  # stands in for the save call's planning, before any copy is issued
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(engine.SnapshotEngine, "capture_planned", slow_planning)
    plugin = in_background(DataStatesIO(host_cache="64MiB", chunk_size="1MiB"), lazy=True)
    plugin.save_checkpoint({"w": torch.randn(2**20)}, str(tmp_path / "a.ckpt"))  # 4 MiB: four chunks
    pipeline_of(plugin).barrier()
    plugin.drain()
    stats = plugin.stats[-1]
    assert stats.copy_s is not None and stats.copying_s is not None
    assert 0 < stats.copying_s <= stats.copy_s - 0.2
    plugin.teardown()
