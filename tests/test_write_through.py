"""Write-through: lazy chunks of host tensors written straight to the file until the barrier (records/through.py).

It applies to page-cache writes only: local files with ``direct_io=False`` (or where the file system refuses direct
I/O), and the generic fsspec spool.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from typing import Any

import torch

from lightning_datastates import DataStatesIO
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.records.through import WriteThrough
from lightning_datastates.storage.local import LocalWriter, LocalWriteSession
from tests.conftest import assert_bit_equal, in_background

MiB = 2**20


def _checkpoint(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {f"w{i}": torch.randn(MiB, generator=generator) for i in range(4)},  # 4 MiB each
        "small": torch.arange(7),
        "epoch": seed,
    }


def _payload_bytes(checkpoint: dict) -> int:
    return sum(t.untyped_storage().nbytes() for t in checkpoint["state_dict"].values())


def test_save_outside_the_loop_writes_host_tensors_without_copying_them(tmp_path):
    checkpoint = _checkpoint()
    plugin = DataStatesIO(direct_io=False)
    plugin.save_checkpoint(checkpoint, str(tmp_path / "a.ckpt"))
    assert_bit_equal(torch.load(tmp_path / "a.ckpt", weights_only=True), checkpoint)
    # Only the small eager tensor went through the arena; the 16 MiB of weights went straight to the file.
    assert pipeline_of(plugin).engine.sharing_counters.copied_bytes < 64 * 1024
    plugin.teardown()


def test_arena_path_when_write_through_is_off_or_writes_are_slow(tmp_path):
    checkpoint = _checkpoint()
    arena_only = DataStatesIO(direct_io=False)
    arena_only.config = dataclasses.replace(arena_only.config, write_through=False)
    plugins = [("off", arena_only)]
    direct_io = DataStatesIO()  # the default: O_DIRECT writes wait for the device, so they are not "fast"
    probe = pipeline_of(direct_io).writer_for(str(tmp_path / "probe.ckpt")).begin(str(tmp_path / "probe.ckpt"), 0)
    probe.abort()
    if not probe.fast_writes:
        plugins.append(("direct", direct_io))  # the file system takes O_DIRECT
    for name, plugin in plugins:
        plugin.save_checkpoint(checkpoint, str(tmp_path / f"{name}.ckpt"))
        assert_bit_equal(torch.load(tmp_path / f"{name}.ckpt", weights_only=True), checkpoint)
        assert pipeline_of(plugin).engine.sharing_counters.copied_bytes >= _payload_bytes(checkpoint), name
        plugin.teardown()


class _HeldWriter(LocalWriter):
    """A local writer (fast writes, so write-through applies) whose first large write waits for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.writes_after_barrier = 0
        self.barrier_returned = threading.Event()

    def begin(self, path: str, total_bytes: int) -> LocalWriteSession:
        session = super().begin(path, total_bytes)
        writer = self

        class _Session(LocalWriteSession):
            def write_range(self, offset: int, data: memoryview) -> None:
                if data.nbytes >= 256 * 1024 and not writer.entered.is_set():
                    writer.entered.set()
                    writer.release.wait(timeout=30)
                super().write_range(offset, data)

        return _Session(session.path, session.temp_path, session._fd)  # type: ignore[arg-type]


def _save_with_first_chunk_held(tmp_path, monkeypatch) -> tuple[DataStatesIO, _HeldWriter, dict, dict]:
    """A lazy save inside the (simulated) training loop, through one writer thread that holds its first chunk.

    The copier takes chunks from the back only once the writer holds the first one: on a loaded machine it could
    otherwise take every chunk before the writer starts (correct, but then nothing is written through).
    """
    writer = _HeldWriter()
    monkeypatch.setattr("lightning_datastates.pipeline.writer_for", lambda path, storage_options=None, **_: writer)
    take_last = WriteThrough.take_last

    def take_last_once_the_writer_holds_a_chunk(self: WriteThrough) -> Any:
        writer.entered.wait(timeout=30)
        return take_last(self)

    monkeypatch.setattr(WriteThrough, "take_last", take_last_once_the_writer_holds_a_chunk)
    plugin = in_background(DataStatesIO(chunk_size="1MiB", writer_threads=1, direct_io=False), lazy=True)
    checkpoint = _checkpoint()
    expected = copy.deepcopy(checkpoint)
    plugin.save_checkpoint(checkpoint, str(tmp_path / "a.ckpt"))
    return plugin, writer, checkpoint, expected


def test_barrier_waits_for_chunks_in_flight_and_copies_the_rest(tmp_path, monkeypatch):
    plugin, writer, checkpoint, expected = _save_with_first_chunk_held(tmp_path, monkeypatch)
    assert writer.entered.wait(timeout=30), "no chunk was written from the training tensors"

    barrier = threading.Thread(target=pipeline_of(plugin).barrier)
    barrier.start()
    barrier.join(timeout=0.5)
    # The one writer is inside a chunk it reads from the training tensors: the barrier must not return yet.
    assert barrier.is_alive()
    writer.release.set()
    barrier.join(timeout=30)
    assert not barrier.is_alive()
    for tensor in checkpoint["state_dict"].values():
        tensor.zero_()  # the optimizer step: after the barrier the state may change
    plugin.drain()
    assert_bit_equal(torch.load(tmp_path / "a.ckpt", weights_only=True), expected)
    copied = pipeline_of(plugin).engine.sharing_counters.copied_bytes - expected["small"].untyped_storage().nbytes()
    # One chunk went straight to the file; the chunks nobody had started were copied into the arena at the barrier.
    assert MiB <= _payload_bytes(expected) - copied <= 2 * MiB
    plugin.teardown()


def test_in_the_loop_the_copier_takes_chunks_from_the_back_without_waiting_for_the_barrier(tmp_path, monkeypatch):
    plugin, writer, checkpoint, expected = _save_with_first_chunk_held(tmp_path, monkeypatch)
    assert writer.entered.wait(timeout=30)
    small = expected["small"].untyped_storage().nbytes()
    # The one writer holds the first chunk (from the tensors); no barrier yet: the copier copies the rest anyway.
    deadline = time.monotonic() + 30
    while pipeline_of(plugin).engine.sharing_counters.copied_bytes - small < _payload_bytes(expected) - MiB:
        assert time.monotonic() < deadline, "the copier waited instead of copying from the back"
        time.sleep(0.01)
    writer.release.set()
    pipeline_of(plugin).barrier()
    for tensor in checkpoint["state_dict"].values():
        tensor.zero_()
    plugin.drain()
    assert_bit_equal(torch.load(tmp_path / "a.ckpt", weights_only=True), expected)
    copied = pipeline_of(plugin).engine.sharing_counters.copied_bytes - small
    assert copied == _payload_bytes(expected) - MiB  # none twice
    plugin.teardown()
