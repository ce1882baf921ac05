"""The CUDA path: pinned arena, copy stream ordered after the compute stream, barrier on the copies.

Skipped without a GPU (CI has none); run by ``scripts/gpu_check.sh`` whenever a GPU machine is available.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_datastates import DataStatesCallback, DataStatesIO
from lightning_datastates.copy.arena import address_view
from lightning_datastates.plugin import pipeline_of
from tests.conftest import (
    BNModel,
    RecordingDataStatesIO,
    assert_bit_equal,
    every_step_checkpoint,
    make_loader,
    make_trainer,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: GPU clock cycles of ``torch.cuda._sleep``: a fraction of a second on any current GPU, far longer than a save call's
#: planning, so that the kernel queued behind it is still in flight when the copy is issued.
_SLEEP_CYCLES = 500_000_000


def _queue_behind_a_sleep(write) -> None:
    """Queue ``write`` (the last kernel producing the state) behind a sleeping kernel on the compute stream, and check
    that it is still in flight: a copy that did not wait for the compute stream (the event recorded at capture) would
    read the state from before it."""
    torch.cuda._sleep(_SLEEP_CYCLES)
    write()
    assert not torch.cuda.current_stream().query(), "the GPU finished the queued kernels before the save call"


class _AllLazy:
    """Stands in for the callback: every storage may be copied lazily (the test calls the barrier itself)."""

    in_training_loop = True

    def lazy_predicate(self):
        return lambda storage: True


def test_copy_is_ordered_after_queued_kernels_and_before_mutation(tmp_path):
    plugin = DataStatesIO(host_cache="2GiB")
    pipeline_of(plugin).attach(_AllLazy())
    weight = torch.zeros(64 * 2**20, device="cuda")  # 256 MiB
    for round_ in range(3):
        weight.fill_(float(round_))
        for _ in range(20):
            weight.mul_(1.0001)
        expected = weight.cpu()  # synchronizes: the reference
        on_device = expected.cuda()  # from pageable memory: synchronous
        weight.zero_()
        # The state's values come from a kernel still queued at the save call: the copy must wait for it (event on
        # the compute stream); one that did not would write zeros.
        _queue_behind_a_sleep(lambda values=on_device: weight.add_(values))
        path = str(tmp_path / f"r{round_}.ckpt")
        plugin.save_checkpoint({"w": weight}, path)
        pipeline_of(plugin).barrier()  # what on_before_optimizer_step does
        weight.add_(1000.0)  # the "optimizer step": must not leak into the file
        plugin.drain()
        assert torch.equal(torch.load(path, weights_only=True, map_location="cpu")["w"], expected)
    arena = pipeline_of(plugin).engine.arena
    # Page-locked in the background (cudaHostRegister of the pageable buffer), never on the training thread.
    assert arena is not None and arena.wait_pinned(60) and arena.buffer.is_pinned()
    plugin.teardown()


@pytest.mark.parametrize("eager_copy_size", [1, "64KiB"], ids=["tiny-threshold", "default"])
def test_many_small_tensors_in_one_chunk_are_all_copied_after_queued_kernels(tmp_path, monkeypatch, eager_copy_size):
    """The copier issues a chunk's copies together and synchronizes once: every piece must still come after the
    kernels queued before the save, and before the mutation after the barrier. Small device tensors are lazy with
    any ``eager_copy_size`` (the save call does not wait for their copies)."""
    from lightning_datastates.snapshot import engine

    eager_parts: list[set[int]] = []
    split = engine.eager_record_keys
    monkeypatch.setattr(engine, "eager_record_keys", lambda *args: eager_parts.append(split(*args)) or eager_parts[-1])
    plugin = DataStatesIO(host_cache="1GiB", eager_copy_size=eager_copy_size)
    pipeline_of(plugin).attach(_AllLazy())
    tensors = [torch.zeros(1000 + 37 * i, device="cuda") for i in range(300)]  # packed into one chunk
    big = torch.zeros(32 * 2**20, device="cuda")
    for tensor in tensors:
        tensor.fill_(1.0)
    for _ in range(20):
        big.mul_(1.0001)

    def last_writes() -> None:
        for index, tensor in enumerate(tensors):
            tensor.add_(float(index))

    _queue_behind_a_sleep(last_writes)  # the last writes of the state, still in flight at the save call
    path = str(tmp_path / "small.ckpt")
    plugin.save_checkpoint({f"t{i}": t for i, t in enumerate(tensors)}, path)
    pipeline_of(plugin).barrier()
    for tensor in tensors:
        tensor.add_(1000.0)  # the "optimizer step"
    plugin.drain()
    loaded = torch.load(path, weights_only=True, map_location="cpu")
    for index, tensor in enumerate(tensors):
        assert torch.equal(loaded[f"t{index}"], torch.full((tensor.numel(),), 1.0 + index)), index
    assert eager_parts == [set()]
    plugin.teardown()


def test_trainer_on_gpu_every_file_equals_state_at_save(tmp_path):
    torch.manual_seed(0)
    plugin = RecordingDataStatesIO(chunk_size="4MiB")
    trainer = make_trainer(
        str(tmp_path),
        plugin,
        callbacks=[every_step_checkpoint(str(tmp_path / "ckpt"))],
        accelerator="gpu",
        devices=1,
        deterministic=False,
    )
    # The plugin adds the callback: without it every save would wait for its commit, and this test would pass
    # without anything lazy.
    assert any(isinstance(callback, DataStatesCallback) for callback in trainer.callbacks)
    trainer.fit(BNModel(width=2048), make_loader(n=256, batch_size=32))
    assert len(plugin.recorded) >= 16
    for path, expected in plugin.recorded.items():
        assert_bit_equal(torch.load(path, map_location="cpu", weights_only=False), expected, os.path.basename(path))


def test_no_extra_gpu_memory(tmp_path):
    plugin = DataStatesIO()
    pipeline_of(plugin).attach(_AllLazy())
    weight = torch.randn(32 * 2**20, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    plugin.save_checkpoint({"w": weight}, str(tmp_path / "m.ckpt"))
    pipeline_of(plugin).barrier()
    plugin.drain()
    assert torch.cuda.max_memory_allocated() == before  # no device-side staging copy
    plugin.teardown()


def test_trainer_on_gpu_copies_the_first_checkpoint_into_an_arena_pinned_beforehand(tmp_path):
    """The arena is made after the first optimizer step and page-locked (cudaHostRegister) in the background, so the
    first checkpoint is copied into pinned memory, the same arena as every later one."""
    at_first_save: list[bool] = []

    class Probe(RecordingDataStatesIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            if not at_first_save:
                arena = pipeline_of(self).engine.arena
                # The probe waits (the plugin never does): pinning a small arena takes milliseconds.
                at_first_save.append(arena is not None and arena.wait_pinned(30) and arena.buffer.is_pinned())
                self.first_arena = arena
            super().save_checkpoint(checkpoint, path, storage_options)

    plugin = Probe(chunk_size="4MiB")
    checkpoints = every_step_checkpoint(str(tmp_path / "ckpt"), every_n_train_steps=4, save_last=False)
    trainer = make_trainer(str(tmp_path), plugin, [checkpoints], accelerator="gpu", devices=1, deterministic=False)
    trainer.fit(BNModel(width=2048), make_loader(n=256, batch_size=32))
    assert at_first_save == [True] and pipeline_of(plugin).engine.arena is plugin.first_arena
    for path, expected in plugin.recorded.items():
        assert_bit_equal(torch.load(path, map_location="cpu", weights_only=False), expected, os.path.basename(path))


def test_chunks_are_in_flight_on_the_copy_stream_and_the_file_is_exact(tmp_path, monkeypatch):
    """The copier queues several chunks' copies on its stream before the first ends (copy/loop.py), and the file
    still equals the state at the save call, although the state changes right after the barrier."""
    from lightning_datastates.copy import loop as copy_loop

    most_in_flight = [0]
    start_chunk = copy_loop.CopyLoop._copy_chunk

    def recording_copy_chunk(self, job, chunk):
        start_chunk(self, job, chunk)
        most_in_flight[0] = max(most_in_flight[0], len(self._started))

    monkeypatch.setattr(copy_loop.CopyLoop, "_copy_chunk", recording_copy_chunk)
    plugin = DataStatesIO(host_cache="2GiB", chunk_size="32MiB")
    pipeline_of(plugin).attach(_AllLazy())
    weight = torch.randn(128 * 2**20, device="cuda")  # 512 MiB: 16 chunks
    # copies into pageable memory would end at once: pin
    pipeline_of(plugin).prepare_arena(weight.nbytes, weight.device.index)
    assert pipeline_of(plugin).engine.arena is not None and pipeline_of(plugin).engine.arena.wait_pinned(60)
    _save_then_step_then_check(plugin, weight, str(tmp_path / "inflight.ckpt"))
    assert most_in_flight[0] > 1
    plugin.teardown()


def test_arena_pinned_in_pieces_takes_copies_that_span_pieces_bit_exact(tmp_path, monkeypatch):
    """The arena is page-locked piece by piece (cudaHostRegister per piece, copy/pinning.py); every piece is then
    pinned for the driver, and chunks whose blocks span several pieces (copies cut at the pieces' boundaries) land
    bit-exact, although the state changes right after the barrier."""
    from lightning_datastates.copy import pinning

    monkeypatch.setattr(pinning, "PIN_PIECE_BYTES", 2**20)  # 1 MiB pieces: every 8 MiB chunk spans at least 8
    plugin = DataStatesIO(host_cache="64MiB", chunk_size="8MiB")
    pipeline_of(plugin).attach(_AllLazy())
    weight = torch.randn(6 * 2**20, device="cuda")  # 24 MiB
    pipeline_of(plugin).prepare_arena(weight.nbytes, weight.device.index)
    arena = pipeline_of(plugin).engine.arena
    assert arena is not None and arena.wait_pinned(60) and arena.pinned_bytes == arena.size_bytes
    base = arena.buffer.data_ptr()
    for address, _ in pinning.cut_at_pin_boundaries(base, arena.size_bytes):
        # A tensor whose storage starts at the piece: is_pinned() asks the driver about its storage's first byte (a
        # slice of the buffer would ask about the buffer's, piece 0's, every time).
        piece = torch.frombuffer(address_view(address, 1), dtype=torch.uint8)
        assert piece.is_pinned(), f"piece at offset {address - base} is not pinned"
    _save_then_step_then_check(plugin, weight, str(tmp_path / "pieces.ckpt"))
    plugin.teardown()


def _save_then_step_then_check(plugin: DataStatesIO, weight: torch.Tensor, path: str) -> None:
    """Save ``weight`` lazily, change it right after the barrier (the "optimizer step"), and check that the file holds
    the value at the save call."""
    expected = weight.cpu()
    plugin.save_checkpoint({"w": weight}, path)
    pipeline_of(plugin).barrier()
    weight.add_(1.0)
    plugin.drain()
    assert torch.equal(torch.load(path, weights_only=True, map_location="cpu")["w"], expected)


def test_the_save_calls_fast_pickling_reproduces_torch_save_for_cuda_tensors():
    """The fast path names a CUDA storage's location with a new string each time, as torch does (the pickle's memo
    compares identities): its first plan is compared with torch.save's and must be taken (confirmed, not refused),
    and the next one spliced."""
    from lightning_datastates.capture.layout import plan_layout
    from lightning_datastates.capture.skeleton import pickle_skeleton
    from lightning_datastates.capture.verified import VerifiedStructures

    weights = torch.randn(64, 64, device="cuda")
    checkpoint = {
        "w": weights,
        "w_t": weights.t(),
        "b": torch.zeros(64, device="cuda"),
        "step": 1,
        "cpu": torch.ones(3),
    }
    verified = VerifiedStructures()
    plan_layout(checkpoint, verified=verified)
    checkpoint["step"] = 2
    plan_layout(checkpoint, verified=verified)
    assert (verified.confirmed, verified.refused, verified.spliced) == (True, None, 1)
    assert b"cuda:" in pickle_skeleton(checkpoint).data
