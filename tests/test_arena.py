"""The host arena: aligned blocks from one buffer, a coalescing free list, back-pressure and close."""

from __future__ import annotations

import itertools
import os
import random
import threading

import pytest
import torch

from lightning_datastates.alignment import PAGE_ALIGNMENT_BYTES
from lightning_datastates.copy.arena import ArenaClosed, HostArena
from lightning_datastates.records.block import Block

PAGE = PAGE_ALIGNMENT_BYTES
JOIN_S = 10.0  # generous: only a hang makes a join wait this long


def _spans_disjoint(blocks: list[Block]) -> bool:
    spans = sorted((b.offset, b.offset + b.reserved_bytes) for b in blocks)
    return all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))


class _Allocator(threading.Thread):
    """A thread that calls ``allocate`` and records the block or the exception."""

    def __init__(self, arena: HostArena, nbytes: int, timeout_s: float | None = None) -> None:
        super().__init__(daemon=True)
        self.arena, self.nbytes, self.timeout_s = arena, nbytes, timeout_s
        self.started_waiting = threading.Event()
        self.block: Block | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        self.started_waiting.set()
        try:
            self.block = self.arena.allocate(self.nbytes, timeout_s=self.timeout_s)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc


def _wait_until_blocked(arena: HostArena, thread: _Allocator, waiters: int = 1) -> None:
    """Wait until ``waiters`` threads sleep inside ``allocate`` on the arena's condition (polled, not timed)."""
    assert thread.started_waiting.wait(JOIN_S)
    for _ in range(10_000):
        with arena._cond:
            if len(arena._cond._waiters) >= waiters:  # type: ignore[attr-defined]  # CPython's Condition
                return
        if not thread.is_alive():
            return
        threading.Event().wait(0.001)
    raise AssertionError("the allocating thread never waited")


# ---------------------------------------------------------------------------------------------------- basics
def test_size_is_rounded_up_to_the_alignment() -> None:
    assert HostArena(1).size_bytes == PAGE
    assert HostArena(PAGE).size_bytes == PAGE
    assert HostArena(5 * PAGE + 1).size_bytes == 6 * PAGE
    arena = HostArena(3 * PAGE + 7)
    assert arena.buffer.numel() == arena.size_bytes == 4 * PAGE
    assert arena.buffer.dtype == torch.uint8 and not arena.pinned


def test_allocate_and_free_account_reserved_bytes() -> None:
    arena = HostArena(16 * PAGE)
    a = arena.allocate(100)
    assert (a.nbytes, a.reserved_bytes) == (100, PAGE)
    b = arena.allocate(PAGE + 1)
    assert b.reserved_bytes == 2 * PAGE
    c = arena.allocate(0)
    assert c.reserved_bytes == PAGE  # even an empty block occupies a slot: offsets stay distinct
    assert arena.used_bytes == 4 * PAGE
    assert _spans_disjoint([a, b, c])
    arena.free(b)
    assert arena.used_bytes == 2 * PAGE
    arena.free(a)
    arena.free(c)
    assert arena.used_bytes == 0


def test_block_offsets_are_aligned_and_disjoint() -> None:
    rng = random.Random(7)
    arena = HostArena(256 * PAGE)
    blocks = []
    while True:
        nbytes = rng.randint(1, 3 * PAGE)
        try:
            blocks.append(arena.allocate(nbytes, timeout_s=0))
        except TimeoutError:
            break
        if rng.random() < 0.3:
            arena.free(blocks.pop(rng.randrange(len(blocks))))
    assert blocks
    for block in blocks:
        assert block.offset % PAGE == 0
        assert block.reserved_bytes % PAGE == 0 and block.reserved_bytes >= block.nbytes
        assert block.offset + block.reserved_bytes <= arena.size_bytes
    assert _spans_disjoint(blocks)
    assert arena.used_bytes == sum(b.reserved_bytes for b in blocks)


def test_block_addresses_are_page_aligned() -> None:
    arena = HostArena(16 * 1024**2)
    block = arena.allocate(PAGE)
    assert (arena.buffer.data_ptr() + block.offset) % PAGE == 0


def test_too_large_request_raises_value_error_at_once() -> None:
    arena = HostArena(4 * PAGE)
    with pytest.raises(ValueError, match="does not fit"):
        arena.allocate(4 * PAGE + 1)
    whole = arena.allocate(4 * PAGE)  # exactly the size fits
    with pytest.raises(ValueError):
        arena.allocate(5 * PAGE)  # raised even while full, instead of waiting forever
    arena.free(whole)
    assert arena.used_bytes == 0


def test_timeout_raises_timeout_error_when_full() -> None:
    arena = HostArena(2 * PAGE)
    arena.allocate(PAGE)
    arena.allocate(PAGE)
    with pytest.raises(TimeoutError):
        arena.allocate(1, timeout_s=0)


# ---------------------------------------------------------------------------------------------------- coalescing
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_freeing_in_random_order_coalesces_to_one_full_block(seed: int) -> None:
    rng = random.Random(seed)
    arena = HostArena(64 * PAGE)
    blocks = []
    while arena.used_bytes < arena.size_bytes:
        free_pages = (arena.size_bytes - arena.used_bytes) // PAGE
        blocks.append(arena.allocate(rng.randint(1, min(3, free_pages) * PAGE), timeout_s=0))
    with pytest.raises(TimeoutError):
        arena.allocate(1, timeout_s=0)
    rng.shuffle(blocks)
    for block in blocks:
        arena.free(block)
    assert arena.used_bytes == 0
    whole = arena.allocate(arena.size_bytes, timeout_s=0)
    assert whole.offset == 0


def test_fragmented_arena_serves_a_request_only_when_contiguous_space_is_free() -> None:
    arena = HostArena(8 * PAGE)
    blocks = [arena.allocate(PAGE) for _ in range(8)]
    for block in blocks[::2]:  # free every other page: 4 pages free, none adjacent
        arena.free(block)
    with pytest.raises(TimeoutError):
        arena.allocate(2 * PAGE, timeout_s=0)
    arena.free(blocks[3])  # pages 2, 3, 4 now adjacent
    block = arena.allocate(3 * PAGE, timeout_s=0)
    assert block.offset == 2 * PAGE


# ---------------------------------------------------------------------------------------------------- back-pressure
def test_blocked_allocate_is_released_by_a_free_from_another_thread() -> None:
    arena = HostArena(4 * PAGE)
    held = [arena.allocate(PAGE) for _ in range(4)]
    waiter = _Allocator(arena, 2 * PAGE)
    waiter.start()
    _wait_until_blocked(arena, waiter)
    assert waiter.is_alive() and waiter.block is None

    arena.free(held[0])  # one page: not enough for two contiguous pages
    _wait_until_blocked(arena, waiter)
    assert waiter.is_alive() and waiter.block is None

    freer = threading.Thread(target=arena.free, args=(held[1],))  # adjacent page: now 2 contiguous
    freer.start()
    freer.join(JOIN_S)
    waiter.join(JOIN_S)
    assert not waiter.is_alive(), "allocate was not woken by free"
    assert waiter.error is None
    assert waiter.block is not None and waiter.block.offset == 0 and waiter.block.reserved_bytes == 2 * PAGE
    assert arena.used_bytes == 4 * PAGE


def test_many_threads_contend_without_exceeding_capacity() -> None:
    arena = HostArena(8 * PAGE)
    errors: list[BaseException] = []
    overlap = threading.Event()
    live: set[int] = set()
    live_lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(200):
                block = arena.allocate(rng.randint(1, 3 * PAGE), timeout_s=JOIN_S)
                pages = set(range(block.offset // PAGE, (block.offset + block.reserved_bytes) // PAGE))
                with live_lock:
                    if live & pages:
                        overlap.set()
                    live.update(pages)
                arena.tensor(block).fill_(seed)
                with live_lock:
                    live.difference_update(pages)
                arena.free(block)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * JOIN_S)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert errors == []
    assert not overlap.is_set(), "two live blocks overlapped"
    assert arena.used_bytes == 0
    assert arena.peak_used_bytes <= arena.size_bytes


# ---------------------------------------------------------------------------------------------------- close
def test_close_wakes_waiters_with_arena_closed() -> None:
    arena = HostArena(PAGE)
    arena.allocate(PAGE)
    waiters = [_Allocator(arena, PAGE) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    for count, waiter in enumerate(waiters, 1):
        _wait_until_blocked(arena, waiter, count)
    arena.close()
    for waiter in waiters:
        waiter.join(JOIN_S)
        assert not waiter.is_alive()
        assert isinstance(waiter.error, ArenaClosed)


def test_allocate_after_close_raises_even_with_space() -> None:
    arena = HostArena(4 * PAGE)
    block = arena.allocate(PAGE)
    arena.close()
    with pytest.raises(ArenaClosed):
        arena.allocate(PAGE)
    arena.free(block)  # writers still hand blocks back after close
    assert arena.used_bytes == 0


# ---------------------------------------------------------------------------------------------------- views
def test_tensor_and_memoryview_address_the_same_bytes() -> None:
    arena = HostArena(8 * PAGE)
    first = arena.allocate(100)
    block = arena.allocate(PAGE + 123)
    tensor = arena.tensor(block)
    view = arena.memoryview(block)
    assert tensor.dtype == torch.uint8 and tensor.numel() == block.nbytes
    assert len(view) == block.nbytes and view.format == "B" and not view.readonly
    assert tensor.data_ptr() == arena.buffer.data_ptr() + block.offset

    payload = os.urandom(block.nbytes)
    view[:] = payload
    assert bytes(tensor.numpy()) == payload
    assert bytes(arena.buffer[block.offset : block.offset + block.nbytes].numpy()) == payload
    tensor.fill_(0xAB)
    assert bytes(view) == b"\xab" * block.nbytes
    # neighbours untouched
    arena.tensor(first).fill_(1)
    assert bytes(view) == b"\xab" * block.nbytes
    assert bytes(arena.memoryview(first)) == b"\x01" * 100


def test_memoryview_works_with_os_pwrite(tmp_path) -> None:
    arena = HostArena(4 * PAGE)
    block = arena.allocate(3000)
    arena.tensor(block).copy_(torch.arange(3000) % 251)
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
    try:
        assert os.pwrite(fd, arena.memoryview(block), 10) == 3000
    finally:
        os.close(fd)
    data = (tmp_path / "out.bin").read_bytes()
    assert data[10:] == bytes((torch.arange(3000) % 251).to(torch.uint8).numpy())


def test_empty_block_views() -> None:
    arena = HostArena(PAGE)
    block = arena.allocate(0)
    assert arena.tensor(block).numel() == 0
    assert len(arena.memoryview(block)) == 0


# ---------------------------------------------------------------------------------------------------- accounting
def test_peak_used_bytes_tracks_the_maximum() -> None:
    arena = HostArena(16 * PAGE)
    assert arena.peak_used_bytes == 0
    a = arena.allocate(3 * PAGE)
    b = arena.allocate(PAGE + 1)
    assert arena.peak_used_bytes == 5 * PAGE
    arena.free(a)
    c = arena.allocate(PAGE)
    assert arena.used_bytes == 3 * PAGE
    assert arena.peak_used_bytes == 5 * PAGE  # not lowered by frees
    d = arena.allocate(8 * PAGE)
    assert arena.peak_used_bytes == 11 * PAGE
    for block in (b, c, d):
        arena.free(block)
    assert arena.used_bytes == 0 and arena.peak_used_bytes == 11 * PAGE
