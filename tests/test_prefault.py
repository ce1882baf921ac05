"""The host arena's pages are mapped in ahead of the copies, off the training thread, where nothing pins them.

Residency is read from the kernel (``mincore``): an anonymous page never written is not resident. The tests with the
real ``madvise`` are skipped where the host cannot map pages ahead (Linux before 5.14, other systems).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading

import pytest
import torch

from lightning_datastates.alignment import PAGE_ALIGNMENT_BYTES
from lightning_datastates.capture.admission import prepare_arena
from lightning_datastates.config import DataStatesConfig
from lightning_datastates.copy import prefault
from lightning_datastates.copy.arena import HostArena
from lightning_datastates.plugin import pipeline_of
from tests.conftest import (
    BNModel,
    RecordingDataStatesIO,
    every_step_checkpoint,
    file_mismatches,
    make_loader,
    make_trainer,
)
from tests.test_arena_preparation import SteppedPinner

MiB = 2**20


def _fresh_pages(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory no one has written: an anonymous mapping of its own (an allocator may hand out memory
    it used before, already mapped)."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def _can_map_ahead() -> bool:
    if prefault.DEFAULT_POPULATE is None:
        return False
    probe = _fresh_pages(4 * PAGE_ALIGNMENT_BYTES)
    return prefault.DEFAULT_POPULATE(probe.data_ptr(), probe.numel()) == 0


needs_map_ahead = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _can_map_ahead(),
    reason="this host cannot map pages ahead (madvise MADV_POPULATE_WRITE: Linux 5.14 and later)",
)


def _resident_pages(memory: torch.Tensor) -> int:
    """How many of the pages of ``memory`` (page-aligned) the kernel has mapped."""
    pages = -(-memory.numel() // PAGE_ALIGNMENT_BYTES)
    vector = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(memory.data_ptr(), memory.numel(), vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector)


@needs_map_ahead
def test_pages_are_mapped_ahead_and_bytes_already_written_are_kept() -> None:
    """The copier may write into the arena while its pages are mapped ahead: a page written first keeps its bytes
    (``MADV_POPULATE_WRITE`` maps, it never writes)."""
    memory = _fresh_pages(3 * prefault.PREFAULT_PIECE_BYTES // 2)  # one piece and a half
    assert _resident_pages(memory) == 0
    written = torch.arange(PAGE_ALIGNMENT_BYTES * 5, dtype=torch.int32).view(torch.uint8)[: PAGE_ALIGNMENT_BYTES * 5]
    at = prefault.PREFAULT_PIECE_BYTES - 2 * PAGE_ALIGNMENT_BYTES  # across the boundary between the two pieces
    memory[at : at + written.numel()].copy_(written)
    mapping = prefault.ArenaPrefault(memory)
    assert mapping.done.wait(30)
    assert mapping.populated_bytes == memory.numel()
    assert _resident_pages(memory) == memory.numel() // PAGE_ALIGNMENT_BYTES
    assert torch.equal(memory[at : at + written.numel()], written)
    assert not memory[:at].any() and not memory[at + written.numel() :].any()


@needs_map_ahead
def test_only_the_pages_of_the_first_checkpoints_are_mapped_ahead() -> None:
    """As many checkpoints as the default arena holds (two): the rest of a larger ``host_cache`` is mapped as copies
    first write it, so its memory is not taken before it is used."""
    request = 8 * MiB
    prepared = prepare_arena(DataStatesConfig(host_cache=64 * MiB), request)
    arena = prepared.arena
    assert arena.wait_prefaulted(30) == 2 * request
    mapped = arena.buffer[: 2 * request]
    assert _resident_pages(mapped) == mapped.numel() // PAGE_ALIGNMENT_BYTES
    arena.close()


@needs_map_ahead
def test_an_arena_whose_written_blocks_are_freed_maps_one_checkpoint_ahead() -> None:
    """Where written checkpoints leave the arena at once (sharded saves, ``serve_from_memory=False``), the next copy
    reuses the same blocks: only one checkpoint's pages are mapped ahead, not the two the resident cache keeps."""
    request = 8 * MiB
    for config, keeps_written in (
        (DataStatesConfig(host_cache=64 * MiB), False),
        (DataStatesConfig(host_cache=64 * MiB, serve_from_memory=False), True),
    ):
        arena = prepare_arena(config, request, keeps_written).arena
        # What the thread mapped (whether the rest is resident depends on what the allocator reused: not asserted).
        assert arena.wait_prefaulted(30) == request
        arena.close()


class _GatedPopulate:
    """Maps nothing; each call records its thread and waits until the test opens the gate."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[int, int, str]] = []

    def __call__(self, address: int, nbytes: int) -> int:
        self.calls.append((address, nbytes, threading.current_thread().name))
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return 0


def test_the_arena_is_mapped_on_a_thread_of_its_own_and_a_close_stops_it(monkeypatch) -> None:
    """Making the arena returns while the first piece is still being mapped (the training thread never maps), and a
    close ends the mapping after the piece in progress."""
    populate = _GatedPopulate()
    monkeypatch.setattr(prefault, "DEFAULT_POPULATE", populate)
    monkeypatch.setattr(prefault, "PREFAULT_PIECE_BYTES", MiB)
    arena = HostArena(8 * MiB, pinner=None, prefault_bytes=4 * MiB)  # returns with the first piece in progress
    assert populate.entered.wait(30)
    assert arena.prefaulted_bytes == 0
    arena.close()
    populate.gate.set()
    assert arena.wait_prefaulted(30) == MiB  # the piece in progress, no other
    assert populate.calls == [(arena.buffer.data_ptr(), MiB, "datastates-arena-prefault")]


def test_a_host_that_refuses_leaves_the_pages_to_the_copies(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(prefault, "DEFAULT_POPULATE", lambda address, nbytes: calls.append(nbytes) or 22)  # EINVAL
    arena = HostArena(4 * MiB, pinner=None, prefault_bytes=4 * MiB)
    assert arena.wait_prefaulted(30) == 0 and len(calls) == 1
    block = arena.allocate(MiB)
    arena.tensor(block).fill_(7)  # the arena works as before: pages mapped as they are written
    assert int(arena.tensor(block).sum()) == 7 * MiB
    arena.close()


def test_a_pinned_arena_is_not_mapped_ahead_twice(monkeypatch) -> None:
    """Page-locking maps the pages itself (cudaHostRegister faults them in)."""
    calls: list[int] = []
    monkeypatch.setattr(prefault, "DEFAULT_POPULATE", lambda address, nbytes: calls.append(nbytes) or 0)
    pinner = SteppedPinner()
    pinner.allow(64)
    arena = HostArena(4 * MiB, pinner=pinner, prefault_bytes=4 * MiB)
    assert arena.wait_pinned(30)
    assert arena.wait_prefaulted(0) == 0 and calls == []
    arena.close()


@needs_map_ahead
def test_a_trainer_maps_the_arena_ahead_of_its_first_checkpoint(tmp_path) -> None:
    """The arena made after the first optimizer step is mapped in by the time checkpoints come (two checkpoints'
    worth from its start), and every file still equals the state at its save call."""
    at_first_save: list[int] = []

    class Probe(RecordingDataStatesIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            if not at_first_save:
                arena = pipeline_of(self).engine.arena
                # The probe waits (the plugin never does): mapping a small arena takes milliseconds.
                at_first_save.append(0 if arena is None else arena.wait_prefaulted(30))
                self.first_arena = arena
            super().save_checkpoint(checkpoint, path, storage_options)

    plugin = Probe(chunk_size="1MiB")
    checkpoints = every_step_checkpoint(str(tmp_path / "ckpt"), every_n_train_steps=4, save_last=False)
    trainer = make_trainer(str(tmp_path), plugin, [checkpoints], max_epochs=1)
    trainer.fit(BNModel(width=512), make_loader(n=128, batch_size=8))
    arena = plugin.first_arena
    # the arena the first save used, mapped ahead
    assert arena is pipeline_of(plugin).engine.arena and at_first_save[0] > 0
    mapped = arena.buffer[: at_first_save[0]]
    assert _resident_pages(mapped) == mapped.numel() // PAGE_ALIGNMENT_BYTES
    assert not file_mismatches(plugin)
