"""The GPU path's host-side behaviours, on the CPU: the arena is sized to hold more than one checkpoint where memory
allows, it is never allocated or page-locked on the training thread, and back-pressure is said once.

Pinning is injected at its one seam (``copy.pinning.default_pinner``): a pinner that blocks until the test lets it
go shows whether anything on the training thread waits for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_datastates import DataStatesIO
from lightning_datastates.alignment import PAGE_ALIGNMENT_BYTES
from lightning_datastates.capture.admission import PREPARED_TOLERANCE, PreparedArena, state_request_bytes
from lightning_datastates.config import DataStatesConfig
from lightning_datastates.copy import copier, pinning, sizing
from lightning_datastates.copy.arena import HostArena
from lightning_datastates.pipeline import CheckpointPipeline
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.records.job import JobState, SnapshotStats
from lightning_datastates.snapshot.backpressure import BackPressureWarning, describe_back_pressure
from lightning_datastates.strategies import gathers_full_state
from tests.conftest import BNModel, assert_bit_equal, every_step_checkpoint, in_background, make_loader, make_trainer

MiB = 2**20
GiB = 2**30


# ------------------------------------------------------------------------------------------------ default size
def test_default_arena_holds_two_checkpoints_when_memory_allows() -> None:
    assert sizing.default_arena_bytes(4 * GiB, available_bytes=125 * GiB) == 2 * 4 * GiB


def test_default_arena_is_bounded_by_half_the_available_memory() -> None:
    assert sizing.default_arena_bytes(4 * GiB, available_bytes=10 * GiB) == 5 * GiB  # streams beyond that
    assert sizing.default_arena_bytes(4 * GiB, available_bytes=6 * GiB) == 3 * GiB  # less than one checkpoint


def test_default_arena_has_a_minimum_and_a_floor() -> None:
    assert sizing.default_arena_bytes(1 * MiB, available_bytes=125 * GiB) == sizing.MIN_ARENA_BYTES
    assert sizing.default_arena_bytes(4 * GiB, available_bytes=2 * MiB) == sizing.FLOOR_BYTES
    assert sizing.default_arena_bytes(4 * GiB, available_bytes=None) == 8 * GiB


def test_plugin_default_arena_follows_the_rule(tmp_path) -> None:
    plugin = in_background(DataStatesIO())
    checkpoint = {"w": torch.randn(12 * MiB)}  # 48 MiB of float32: two of them exceed the 64 MiB minimum
    plugin.save_checkpoint(checkpoint, str(tmp_path / "a.ckpt"))
    plugin.drain()
    arena = pipeline_of(plugin).engine.arena
    assert arena is not None and arena.size_bytes >= 2 * 48 * MiB
    plugin.teardown()


# ------------------------------------------------------------------------------------------------ pinning
class BlockingPinner:
    """Pins nothing; records the thread it runs on and holds until ``release`` is set (or 20 s pass)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []
        self.timed_out = False
        self.unpinned: list[int] = []

    def pin(self, address: int, nbytes: int) -> None:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        self.timed_out = not self.release.wait(20)

    def unpin(self, address: int) -> None:
        self.unpinned.append(address)


def test_arena_is_pinned_off_the_calling_thread_and_usable_before() -> None:
    pinner = BlockingPinner()
    arena = HostArena(4 * MiB, pinner=pinner)  # returns although the pinner blocks
    assert pinner.entered.wait(10)
    block = arena.allocate(MiB)  # the arena works, pageable, while the pinning goes on
    arena.tensor(block).fill_(7)
    assert not arena.pinned
    pinner.release.set()
    assert arena.wait_pinned(10)
    pieces = pinning.cut_at_pin_boundaries(arena.buffer.data_ptr(), arena.size_bytes)
    # One call per piece: two where the mapping happens to straddle a multiple of PIN_PIECE_BYTES.
    assert pinner.threads == ["datastates-arena-pin"] * len(pieces) and not pinner.timed_out
    del arena  # the finalizer unpins before the memory goes
    assert pinner.unpinned == [address for address, _ in pieces]


def test_training_never_waits_for_pinning(tmp_path, monkeypatch) -> None:
    pinner = BlockingPinner()
    monkeypatch.setattr(pinning, "default_pinner", lambda cuda_device: pinner)
    plugin = in_background(DataStatesIO(host_cache="32MiB"), lazy=True)
    checkpoint = {"w": torch.randn(MiB), "step": torch.tensor(3)}
    expected = {k: v.clone() for k, v in checkpoint.items()}
    path = str(tmp_path / "a.ckpt")
    plugin.save_checkpoint(checkpoint, path)  # would block here if the arena were pinned on this thread
    pipeline_of(plugin).barrier()  # ...or here, if the copy waited for the pinning
    checkpoint["w"].add_(1)  # training goes on
    plugin.drain()
    assert pinner.entered.is_set() and not pinner.release.is_set()  # all of the above ran while pinning held
    pinner.release.set()
    assert_bit_equal(torch.load(path, weights_only=True), expected)
    assert threading.main_thread().name not in pinner.threads and not pinner.timed_out
    plugin.teardown()


def test_the_pinner_follows_the_devices_of_the_state() -> None:
    assert pinning.cuda_device_of([torch.device("cpu")]) is None
    assert pinning.cuda_device_of([torch.device("cpu"), torch.device("cuda", 1)]) == 1
    assert pinning.default_pinner(None) is None


def test_cpu_training_on_a_host_with_a_gpu_neither_pins_nor_touches_cuda(tmp_path, monkeypatch) -> None:
    """The arena is page-locked for copies from a GPU only: a CPU run on a GPU host must not initialize CUDA (its
    context takes GPU memory, and Lightning then refuses to fork). Here the host "has" a GPU that any CUDA call
    fails on."""

    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA was used for a CPU run")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    monkeypatch.setattr(pinning, "CudaHostRegister", no_cuda)
    checkpoints = every_step_checkpoint(str(tmp_path / "ckpt"), every_n_train_steps=2)
    plugin = DataStatesIO()
    trainer = make_trainer(str(tmp_path), plugin, [checkpoints], accelerator="cpu", max_steps=4)
    trainer.fit(BNModel(), make_loader())
    arena = pipeline_of(plugin).engine.arena
    assert arena is not None and not arena.pinned and os.listdir(tmp_path / "ckpt")
    plugin.teardown()


def test_copies_from_a_gpu_into_an_arena_made_for_cpu_state_are_said_once(tmp_path, monkeypatch, caplog) -> None:
    """The arena outlives a fit: a plugin whose first checkpoint was on the CPU keeps a pageable arena. A later
    checkpoint from a GPU (stood in for by CPU tensors the device rule calls GPU 0) still goes through it, said once."""
    from lightning_datastates.snapshot import engine as engine_module

    plugin = in_background(DataStatesIO(host_cache="8MiB"))
    plugin.save_checkpoint({"w": torch.ones(1024)}, str(tmp_path / "cpu.ckpt"))
    monkeypatch.setattr(engine_module, "cuda_device_of", lambda devices: 0)
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        for index in range(2):
            plugin.save_checkpoint({"w": torch.full((1024,), float(index))}, str(tmp_path / f"gpu{index}.ckpt"))
    plugin.drain()
    said = [r for r in caplog.records if "go through pageable host memory" in r.getMessage()]
    assert len(said) == 1 and not pipeline_of(plugin).engine.arena.page_locking
    assert torch.equal(torch.load(tmp_path / "gpu1.ckpt", weights_only=True)["w"], torch.full((1024,), 1.0))
    plugin.teardown()


class SteppedPinner:
    """Pins nothing; each call waits until the test allows one more piece (``allow``), and the call numbered
    ``fail_at`` (from 0) raises instead, as a driver that refuses."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.allowed = threading.Semaphore(0)
        self.fail_at = fail_at
        self.calls = 0
        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[int] = []
        self.threads: list[str] = []

    def allow(self, pieces: int = 1) -> None:
        for _ in range(pieces):
            self.allowed.release()

    def pin(self, address: int, nbytes: int) -> None:
        self.threads.append(threading.current_thread().name)
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise OSError("cudaHostRegister failed (injected)")
        if not self.allowed.acquire(timeout=20):
            raise TimeoutError("the test never allowed this piece")
        self.pinned.append((address, nbytes))

    def unpin(self, address: int) -> None:
        self.unpinned.append(address)


def _wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_cut_at_pin_boundaries(monkeypatch) -> None:
    monkeypatch.setattr(pinning, "PIN_PIECE_BYTES", MiB)
    page = PAGE_ALIGNMENT_BYTES
    assert pinning.cut_at_pin_boundaries(MiB - page, 2 * MiB + 2 * page) == [
        (MiB - page, page),
        (MiB, MiB),
        (2 * MiB, MiB),
        (3 * MiB, page),
    ]
    assert pinning.cut_at_pin_boundaries(MiB, MiB) == [(MiB, MiB)]  # exactly one piece: not cut
    assert pinning.cut_at_pin_boundaries(MiB + 5, 10) == [(MiB + 5, 10)]
    assert pinning.cut_at_pin_boundaries(MiB, 0) == []
    # A device copy into the arena is issued in the same spans, as offsets from its target.
    assert copier.pin_spans(2 * MiB - 100, 300) == [(0, 100), (100, 200)]
    assert copier.pin_spans(2 * MiB, 300) == [(0, 300)]


def test_arena_is_pinned_piece_by_piece_in_address_order(monkeypatch) -> None:
    """Each piece is locked by a call of its own, so the arena's start is pinned (and copies into it take the pinned
    path) long before its end; all on the pinning thread."""
    monkeypatch.setattr(pinning, "PIN_PIECE_BYTES", MiB)
    pinner = SteppedPinner()
    arena = HostArena(4 * MiB, pinner=pinner)  # returns at once: no piece is allowed yet
    pieces = pinning.cut_at_pin_boundaries(arena.buffer.data_ptr(), arena.size_bytes)
    assert len(pieces) >= 4 and arena.pinned_bytes == 0 and not arena.pinned
    pinner.allow()
    assert _wait_until(lambda a=arena: a.pinned_bytes == pieces[0][1])  # the first piece is locked, the rest not
    assert not arena.pinned and pinner.pinned == pieces[:1]
    pinner.allow(len(pieces) - 1)
    assert arena.wait_pinned(10) and arena.pinned_bytes == arena.size_bytes
    assert pinner.pinned == pieces and set(pinner.threads) == {"datastates-arena-pin"}
    del arena  # the finalizer unpins every piece before the memory goes
    assert pinner.unpinned == [address for address, _ in pieces]


def test_a_release_during_pinning_waits_for_the_current_piece_only() -> None:
    """Discarding an arena whose pinning still runs (a prepared arena too small for the first checkpoint) waits for
    one piece, not for the whole arena: no piece is locked after the release."""
    pinner = SteppedPinner()
    address, nbytes = 7 * pinning.PIN_PIECE_BYTES, 8 * pinning.PIN_PIECE_BYTES  # a range of 8 pieces (none is mapped)
    locking = pinning.ArenaPinning(address, nbytes, pinner)
    pinner.allow()
    assert _wait_until(lambda: pinner.calls == 2)  # the second piece is being locked
    released = threading.Thread(target=locking.release)
    released.start()
    released.join(0.2)
    assert released.is_alive()  # waits for the piece in progress...
    pinner.allow()
    released.join(10)
    assert not released.is_alive() and locking.done.is_set()  # ...and for nothing more
    first, second = address, address + pinning.PIN_PIECE_BYTES
    assert pinner.calls == 2 and pinner.unpinned == [first, second] and locking.pinned_bytes == 0
    assert not locking.pinned


def test_a_release_on_the_pinning_thread_unpins_once_the_piece_in_progress_ended() -> None:
    """A garbage collection on the pinning thread may release the arena between two pieces: nothing waits there (it
    would wait for itself), and every piece locked is still unpinned, the one in progress included."""
    piece = pinning.PIN_PIECE_BYTES

    class ReleasedWhileLocking(SteppedPinner):
        def pin(self, address: int, nbytes: int) -> None:
            super().pin(address, nbytes)
            if self.calls == 2:
                locking.release()  # as a finalizer run by a collection on this thread would

    pinner = ReleasedWhileLocking()
    locking = pinning.ArenaPinning(3 * piece, 8 * piece, pinner)
    pinner.allow(8)
    assert locking.done.wait(10) and _wait_until(lambda: len(pinner.unpinned) == 2)
    assert pinner.calls == 2 and pinner.unpinned == [3 * piece, 4 * piece] and locking.pinned_bytes == 0


def test_a_release_by_a_collection_while_the_pinning_thread_holds_its_lock_does_not_deadlock() -> None:
    """Any allocation may start a garbage collection, which may run the arena's finalizer (release) on the pinning
    thread while that thread holds the pinning's lock: it must neither deadlock nor leave a piece locked."""
    piece = pinning.PIN_PIECE_BYTES

    class ReleasingList(list):
        def append(self, item) -> None:  # type: ignore[no-untyped-def]
            locking.release()  # as a collection started by the allocation of the item would
            super().append(item)

    pinner = SteppedPinner()
    locking = pinning.ArenaPinning(3 * piece, 4 * piece, pinner)
    locking._locked = ReleasingList()
    pinner.allow(4)
    assert locking.done.wait(10), "the pinning thread deadlocked on its own lock"
    assert _wait_until(lambda: pinner.unpinned == [3 * piece])  # the piece locked during the release: unpinned too
    assert pinner.calls == 1 and locking.pinned_bytes == 0


def test_an_unpin_that_fails_does_not_keep_the_other_pieces_locked(caplog) -> None:
    class FailingFirstUnpin(SteppedPinner):
        def unpin(self, address: int) -> None:
            super().unpin(address)
            if len(self.unpinned) == 1:
                raise RuntimeError("cudaHostUnregister failed (injected)")

    piece = pinning.PIN_PIECE_BYTES
    pinner = FailingFirstUnpin()
    locking = pinning.ArenaPinning(3 * piece, 3 * piece, pinner)
    pinner.allow(3)
    assert locking.done.wait(10) and locking.pinned
    locking.release()
    assert pinner.unpinned == [3 * piece, 4 * piece, 5 * piece] and "could not unpin" in caplog.text


def test_a_failing_piece_leaves_the_pieces_before_it_pinned(caplog) -> None:
    pinner = SteppedPinner(fail_at=2)
    piece = pinning.PIN_PIECE_BYTES
    locking = pinning.ArenaPinning(3 * piece, 4 * piece, pinner)
    pinner.allow(2)
    assert locking.done.wait(10) and not locking.pinned
    assert locking.pinned_bytes == 2 * piece  # the rest of the range stays pageable
    assert f"{2 * piece} of {4 * piece} bytes locked" in caplog.text
    locking.release()
    assert pinner.unpinned == [3 * piece, 4 * piece] and pinner.calls == 3


class RecordingPinner(BlockingPinner):
    """Pins nothing at once; records each range it was asked to pin."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[tuple[int, int]] = []

    def pin(self, address: int, nbytes: int) -> None:
        self.threads.append(threading.current_thread().name)
        self.pinned.append((address, nbytes))
        self.entered.set()


class FirstSaveProbe(DataStatesIO):
    """Records, at its first save call, the arena the engine holds and whether its pinning had begun."""

    probed: tuple[HostArena | None, bool] | None = None
    pinner: RecordingPinner

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if self.probed is None:
            self.probed = (pipeline_of(self).engine.arena, self.pinner.entered.is_set())
        super().save_checkpoint(checkpoint, path, storage_options)


@pytest.mark.parametrize("host_cache", [None, "64MiB"])
def test_arena_is_made_and_pinned_before_the_first_save(tmp_path, monkeypatch, host_cache) -> None:
    """The arena is made once the state's size is known (the first optimizer step; at train start with a host
    cache), so that its pinning runs during training; the first save copies into that same arena."""
    pinner = RecordingPinner()
    monkeypatch.setattr(pinning, "default_pinner", lambda cuda_device: pinner)
    plugin = FirstSaveProbe(host_cache=host_cache)
    plugin.pinner = pinner
    checkpoints = every_step_checkpoint(str(tmp_path / "ckpt"), every_n_train_steps=3, save_last=False)
    made_at_first_batch: list[bool] = []

    class ArenaAtFirstBatch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 0:
                made_at_first_batch.append(pipeline_of(plugin).engine.arena is not None)

    trainer = make_trainer(str(tmp_path), plugin, [checkpoints, ArenaAtFirstBatch()], max_epochs=1)
    trainer.fit(BNModel(), make_loader())
    assert plugin.probed is not None
    arena_at_first_save, pinning_begun = plugin.probed
    assert arena_at_first_save is not None and pinning_begun  # made, and its pinning under way, before the save
    assert pipeline_of(plugin).engine.arena is arena_at_first_save  # ... and the first checkpoint took it
    assert pinner.pinned == pinning.cut_at_pin_boundaries(
        arena_at_first_save.buffer.data_ptr(), arena_at_first_save.size_bytes
    )
    assert threading.main_thread().name not in pinner.threads
    assert made_at_first_batch == [host_cache is not None]  # a host cache's size is known at train start
    if host_cache is None:  # the default rule, applied to the state: two of its checkpoints at least
        assert arena_at_first_save.size_bytes >= sizing.MIN_ARENA_BYTES
    assert len(os.listdir(tmp_path / "ckpt")) == 2 and not pipeline_of(plugin).engine.pending.unreported_failures()


def test_a_prepared_arena_too_small_for_the_first_checkpoint_is_made_again(tmp_path, monkeypatch) -> None:
    """An estimate that falls short (another callback saves large tensors) costs a new arena at the first save, as
    without the preparation; the old one is let go off the training thread, even while its pinning still runs."""
    pinner = BlockingPinner()
    monkeypatch.setattr(pinning, "default_pinner", lambda cuda_device: pinner)
    plugin = in_background(DataStatesIO())
    pipeline_of(plugin).prepare_arena(MiB)  # the default rule's minimum: 64 MiB
    prepared = pipeline_of(plugin).engine.arena
    assert prepared is not None and pinner.entered.wait(10)
    checkpoint = {"w": torch.randn(12 * MiB)}  # 48 MiB: two of them do not fit
    path = str(tmp_path / "a.ckpt")
    plugin.save_checkpoint(checkpoint, path)  # would block if the old arena's unpinning waited here
    plugin.drain()
    arena = pipeline_of(plugin).engine.arena
    assert arena is not None and arena is not prepared and arena.size_bytes >= 2 * 48 * MiB
    assert not pinner.release.is_set() and pinner.unpinned == []  # all of the above ran while pinning held
    pinner.release.set()
    assert _wait_until(lambda: prepared.buffer.data_ptr() in pinner.unpinned)  # the old arena unpinned, then dropped
    assert_bit_equal(torch.load(path, weights_only=True), checkpoint)
    plugin.teardown()


def test_a_prepared_arena_serves_a_first_checkpoint_up_to_the_tolerance() -> None:
    arena = HostArena(MiB)
    prepared = PreparedArena(arena, request_bytes=16 * MiB)
    default, sized = DataStatesConfig(), DataStatesConfig(host_cache="1MiB")
    assert prepared.serves(16 * MiB, default) and prepared.serves(17 * MiB, default)  # within 1/16
    assert not prepared.serves(int(16 * MiB * (1 + PREPARED_TOLERANCE)) + 1, default)
    assert prepared.serves(64 * MiB, sized)  # a user's host_cache is the size whatever the checkpoint


def test_a_prepared_arena_not_page_locked_does_not_serve_copies_from_a_gpu() -> None:
    config = DataStatesConfig(host_cache="1MiB")
    unpinned, pinned = PreparedArena(HostArena(MiB), MiB), PreparedArena(HostArena(MiB), MiB, cuda_device=0)
    assert unpinned.serves(MiB, config) and not unpinned.serves(MiB, config, cuda_device=0)
    assert pinned.serves(MiB, config, cuda_device=0) and pinned.serves(MiB, config)  # CPU state: pinned is no harm


def test_state_request_counts_each_storage_once() -> None:
    weight = torch.zeros(MiB // 4)  # 1 MiB
    tied = weight.view(-1)  # the same storage (tied embeddings)
    other = torch.zeros(MiB // 4, dtype=torch.float64)  # 2 MiB
    padding = 3 * 2 * PAGE_ALIGNMENT_BYTES  # two storages, as arena_request_bytes pads a planned checkpoint
    assert state_request_bytes([weight, tied, other]) == 3 * MiB + padding


def test_failed_pinning_leaves_a_pageable_arena(caplog) -> None:
    class RefusingPinner(BlockingPinner):
        def pin(self, address: int, nbytes: int) -> None:
            raise OSError("cudaHostRegister failed (injected)")

    arena = HostArena(MiB, pinner=RefusingPinner())
    assert not arena.wait_pinned(10)
    assert "could not page-lock the host arena" in caplog.text
    arena.allocate(1024)


# ------------------------------------------------------------------------------------------------ back-pressure
def _back_pressured_saves(tmp_path, gated_writer, count: int) -> list[warnings.WarningMessage]:
    """``count`` saves of 4 MiB into a 1 MiB arena while storage is stalled for a moment: every copy waits for a
    flush, and the barrier after each save waits for the copy."""
    plugin = in_background(DataStatesIO(host_cache="1MiB", chunk_size="256KiB"), lazy=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(count):
            gated_writer.gate.clear()
            threading.Timer(0.2, gated_writer.gate.set).start()
            checkpoint = {"w": torch.full((MiB,), float(i))}
            plugin.save_checkpoint(checkpoint, str(tmp_path / f"c{i}.ckpt"))
            assert pipeline_of(plugin).barrier() > 0  # training waited: the copy needed space held by the stalled flush
        plugin.drain()
    plugin.teardown()
    for i in range(count):
        assert_bit_equal(torch.load(tmp_path / f"c{i}.ckpt", weights_only=True), {"w": torch.full((MiB,), float(i))})
    return [w for w in caught if issubclass(w.category, BackPressureWarning)]


def test_back_pressure_is_warned_once_with_the_fixes(tmp_path, gated_writer) -> None:
    warned = _back_pressured_saves(tmp_path, gated_writer, count=3)
    assert len(warned) == 1
    message = str(warned[0].message)
    for fact in ("back-pressure", "host arena", "host_cache", "less often", "faster storage"):
        assert fact in message


def test_no_back_pressure_warning_when_storage_keeps_up(tmp_path) -> None:
    plugin = in_background(DataStatesIO(host_cache="64MiB"), lazy=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            plugin.save_checkpoint({"w": torch.full((MiB,), float(i))}, str(tmp_path / f"c{i}.ckpt"))
            plugin.drain()  # storage is done before the next barrier
            pipeline_of(plugin).barrier()
    plugin.teardown()
    assert not [w for w in caught if issubclass(w.category, BackPressureWarning)]


def test_back_pressure_message_names_the_measured_figures() -> None:
    recent = [
        SnapshotStats("a", 4 * 10**9, 4 * 10**9, started_at=float(t), durable_s=4.0, state=JobState.COMMITTED.value)
        for t in (0, 1.25, 2.5)
    ]
    message = describe_back_pressure(1.5, recent, arena_bytes=8 * 10**9)
    assert "waited 1.50 s" in message
    assert "checkpoints of 4.00 GB" in message and "saved every 1.25 s" in message
    assert "durable at 1.00 GB/s from the save call (4.00 s each)" in message and "(2.0 checkpoint(s))" in message


def test_back_pressure_inside_the_save_call_is_warned(tmp_path, gated_writer) -> None:
    """Everything copied during the save call (no lazy copies, as with manual optimization): the call itself waits for
    arena space that a stalled flush holds."""
    plugin = in_background(DataStatesIO(host_cache="1MiB", chunk_size="256KiB"))
    gated_writer.gate.clear()
    threading.Timer(0.2, gated_writer.gate.set).start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.save_checkpoint({"w": torch.ones(MiB)}, str(tmp_path / "a.ckpt"))
        plugin.drain()
    plugin.teardown()
    assert len([w for w in caught if issubclass(w.category, BackPressureWarning)]) == 1


def test_no_back_pressure_warning_for_a_wait_that_did_not_block_training(tmp_path, gated_writer, slow_copies) -> None:
    """A copy that waited for space but finished before any barrier blocked nobody; a later barrier that waits for an
    ordinary (slow) copy is no back-pressure either."""
    plugin = in_background(DataStatesIO(host_cache="8MiB", chunk_size="1MiB"), lazy=True)
    gated_writer.gate.clear()
    threading.Timer(0.3, gated_writer.gate.set).start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.save_checkpoint({"w": torch.ones(4 * MiB)}, str(tmp_path / "a.ckpt"))  # 16 MiB through 8 MiB
        plugin.drain()  # its copy waited for the stalled flush; no barrier came meanwhile
        assert plugin.stats[-1].arena_wait_s > 0
        many = {f"t{i}": torch.full((32 * 1024,), float(i)) for i in range(20)}  # 20 x 128 KiB, 2 ms each to copy
        plugin.save_checkpoint(many, str(tmp_path / "b.ckpt"))
        assert pipeline_of(plugin).barrier() > 0  # training waits for the slow copy, not for storage
        plugin.drain()
    plugin.teardown()
    assert plugin.stats[-1].arena_wait_s == 0
    assert not [w for w in caught if issubclass(w.category, BackPressureWarning)]


def test_a_forked_child_does_not_inherit_the_pinned_arena() -> None:
    """Pages locked for DMA would be copied into every forked child (a data loader's workers): the arena's range is
    excluded from fork before it is locked."""
    pinner = BlockingPinner()
    pinner.release.set()
    arena = HostArena(4 * MiB, pinner=pinner)
    assert arena.wait_pinned(10)
    start = arena.buffer.data_ptr()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: is any mapping still covering the arena's first page?
        with open("/proc/self/maps") as maps:
            mapped = any(int(a, 16) <= start < int(b, 16) for a, b in (line.split()[0].split("-") for line in maps))
        os.write(write, b"1" if mapped else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    assert answer == b"0"
    with open("/proc/self/maps") as maps:  # ...while the parent keeps it
        assert any(int(a, 16) <= start < int(b, 16) for a, b in (line.split()[0].split("-") for line in maps))


class _BufferedModel(BNModel):
    """BNModel with a buffer its checkpoints do not hold (``persistent=False``)."""

    def __init__(self) -> None:
        super().__init__(width=64)
        self.register_buffer("scratch", torch.zeros(MiB), persistent=False)


@pytest.mark.parametrize("weights_only", [False, True])
def test_arena_estimate_counts_what_the_checkpoints_hold(tmp_path, weights_only) -> None:
    """Parameters and persistent buffers; the optimizer's state unless every ModelCheckpoint saves weights only."""
    requests: list[int] = []

    class RecordingPipeline(CheckpointPipeline):
        def prepare_arena(self, request_bytes: int, cuda_device: int | None = None) -> None:
            requests.append(request_bytes)
            super().prepare_arena(request_bytes, cuda_device)

    class Recording(DataStatesIO):
        def _new_pipeline(self, config: DataStatesConfig) -> CheckpointPipeline:
            return RecordingPipeline(config)

    checkpoints = every_step_checkpoint(str(tmp_path / "ckpt"), save_weights_only=weights_only, save_last=False)
    trainer = make_trainer(str(tmp_path), Recording(), [checkpoints], max_epochs=1)
    model = _BufferedModel()
    trainer.fit(model, make_loader())
    expected = list(model.parameters()) + [b for name, b in model.named_buffers() if not name.endswith("scratch")]
    if not weights_only:
        expected += [v for state in trainer.optimizers[0].state.values() for v in state.values() if torch.is_tensor(v)]
    assert requests == [state_request_bytes(expected)]


def test_no_arena_before_the_first_save_where_rank_zero_saves_gathered_state() -> None:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    assert gathers_full_state(FSDPStrategy()) and gathers_full_state(ModelParallelStrategy())
    assert not gathers_full_state(DDPStrategy())


def test_no_arena_before_the_first_save_without_a_checkpoint_callback(tmp_path, monkeypatch) -> None:
    plugin = DataStatesIO()
    trainer = make_trainer(str(tmp_path), plugin, max_epochs=1, enable_checkpointing=False)
    trainer.fit(BNModel(), make_loader())
    assert pipeline_of(plugin)._engine is None or pipeline_of(plugin).engine.arena is None
