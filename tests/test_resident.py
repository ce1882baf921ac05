"""A checkpoint still whole in the host arena is loaded from memory, never stale, never torn, never over budget.

Every load here is compared with what ``torch.load`` reads from the file itself; the counters of the resident
cache (``hits``, ``misses``, ``evictions``) say whether memory or storage served it.

Checkpoints reach the arena when their bytes come from a GPU, or go to storage whose writes are not fast (S3,
direct I/O, gated test writers); host tensors written to a local page cache skip the arena (write-through,
records/through.py) and are read back from the page cache instead. So most tests here mark local writes as slow
(``arena_path``), which routes every byte through the arena as on those targets; the last test checks the default.
"""

from __future__ import annotations

import io
import os
import random
import sys
import threading
import time

import fsspec
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import ConfigError, DataStatesIO
from lightning_datastates.copy.arena import HostArena
from lightning_datastates.load.resident import ResidentCounters
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.storage.local import PositionalFileSession
from lightning_datastates.streams import SegmentReader
from tests.conftest import (
    BNModel,
    assert_bit_equal,
    every_step_checkpoint,
    in_background,
    make_loader,
    make_trainer,
    quiet_trainer,
)
from tests.s3_server import require_s3, s3_endpoint_fixture, s3_fixture  # noqa: F401 - registers the s3 fixtures
from tests.test_configs import ROOT, _plugin, _run_cli
from tests.test_sharing import HoldWritesDuringSaves

KiB, MiB = 1024, 1024**2


@pytest.fixture(autouse=True)
def arena_path(request, monkeypatch):
    """Local writes count as slow (as S3 or direct I/O): lazy chunks go through the arena, not straight to the file."""
    if "write_through_default" not in request.keywords:
        monkeypatch.setattr(PositionalFileSession, "fast_writes", property(lambda self: False))


@pytest.mark.write_through_default
def test_with_write_through_every_checkpoint_loads_exactly_from_memory_or_storage(tmp_path) -> None:
    """Chunks written straight from the tensors leave the arena image incomplete (loaded from storage); chunks the
    copier took first keep it whole (served). Which way each checkpoint goes depends on timing; both must be exact."""
    plugin = DataStatesIO(direct_io=False)  # page-cache writes: write-through applies
    _, _, directory = _fit(tmp_path, plugin)
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        assert_bit_equal(plugin.load_checkpoint(path, weights_only=False), _from_file(path))
    counters = _counters(plugin)
    assert counters.hits + counters.misses == len(os.listdir(directory)) > 1
    plugin.teardown()


def _counters(plugin: DataStatesIO) -> ResidentCounters:
    assert pipeline_of(plugin).engine.resident is not None
    return pipeline_of(plugin).engine.resident.counters


def _fit(tmp_path, plugin: DataStatesIO, callbacks=None, width: int = 256, **kwargs):
    torch.manual_seed(0)
    directory = str(tmp_path / "ckpt")
    callbacks = callbacks if callbacks is not None else [every_step_checkpoint(directory)]
    trainer = make_trainer(str(tmp_path), plugin, callbacks=callbacks, max_epochs=1, **kwargs)
    model = BNModel(width=width)
    trainer.fit(model, make_loader())
    return trainer, model, directory


def _from_file(path: str):
    return torch.load(path, map_location="cpu", weights_only=False)


def _image_bytes(plugin: DataStatesIO, path: str) -> bytes:
    reader = pipeline_of(plugin).engine.open_resident(path)
    assert reader is not None, f"{path} is not served from memory"
    with reader:
        return reader.read()


def _checkpoint(seed: int, nbytes: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(nbytes // 4, generator=generator), "step": seed, "name": f"ckpt-{seed}"}


# ---------------------------------------------------------------------------------------------------- served
def test_after_fit_the_newest_checkpoint_loads_from_memory_exactly(tmp_path) -> None:
    plugin = DataStatesIO()
    trainer, model, directory = _fit(tmp_path, plugin)
    newest = os.path.join(directory, f"epoch=0-step={trainer.global_step}.ckpt")
    last = os.path.join(directory, "last.ckpt")

    hits = _counters(plugin).hits
    trainer.validate(model, make_loader(), ckpt_path="last", verbose=False)
    assert _counters(plugin).hits == hits + 1  # the Trainer's own restore went through memory

    for path in (newest, last):
        loaded = plugin.load_checkpoint(path, weights_only=False)
        assert_bit_equal(loaded, _from_file(path), os.path.basename(path))
    assert _counters(plugin).hits == hits + 3 and _counters(plugin).misses == 0
    # Loaded tensors own their memory: nothing points into the arena (which later saves reuse).
    arena = pipeline_of(plugin).engine.arena
    assert arena is not None
    start, end = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.size_bytes
    tensor = plugin.load_checkpoint(newest, weights_only=False)["state_dict"]["net.0.weight"]
    assert not start <= tensor.untyped_storage().data_ptr() < end
    plugin.teardown()


def _assert_reads_match(plugin: DataStatesIO, path: str, expected: bytes) -> None:
    """The whole image equals the file; so do reads at random places and sizes (gaps and segment edges)."""
    assert _image_bytes(plugin, path) == expected
    reader = pipeline_of(plugin).engine.open_resident(path)
    assert reader is not None
    rng = random.Random(0)
    with reader:
        for _ in range(200):
            offset, nbytes = rng.randrange(len(expected)), rng.choice([1, 3, 64, 4095, 70_000])
            reader.seek(offset)
            assert reader.read(nbytes) == expected[offset : offset + nbytes], f"bytes {offset}+{nbytes}"


def test_image_bytes_equal_the_local_file(tmp_path) -> None:
    plugin = DataStatesIO()
    _, _, directory = _fit(tmp_path, plugin)
    path = os.path.join(directory, "last.ckpt")
    with open(path, "rb") as file:
        _assert_reads_match(plugin, path, file.read())
    plugin.teardown()


def test_image_bytes_equal_the_file_on_an_fsspec_filesystem(tmp_path) -> None:
    plugin = DataStatesIO()
    root = f"memory://{tmp_path.name}/ckpt"
    _fit(tmp_path, plugin, callbacks=[every_step_checkpoint(root)])
    path = f"{root}/last.ckpt"
    with fsspec.open(path, "rb") as file:
        expected = file.read()
    _assert_reads_match(plugin, path, expected)
    hits = _counters(plugin).hits
    assert_bit_equal(
        plugin.load_checkpoint(path, weights_only=False), torch.load(io.BytesIO(expected), weights_only=False)
    )
    assert _counters(plugin).hits == hits + 1
    fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)
    plugin.teardown()


def test_image_bytes_equal_the_s3_object(s3) -> None:
    require_s3()
    plugin = DataStatesIO(storage_options={**s3.storage_options, "part_size_bytes": 5 * MiB})
    path = s3.url("run/a.ckpt")
    checkpoint = _checkpoint(1, 7 * MiB)  # two parts
    plugin.save_checkpoint(checkpoint, path)  # outside fit: returns once committed
    _assert_reads_match(plugin, path, s3.read("run/a.ckpt"))
    hits = _counters(plugin).hits
    assert_bit_equal(plugin.load_checkpoint(path, weights_only=False), checkpoint)
    assert _counters(plugin).hits == hits + 1
    s3.put("run/a.ckpt", _serialized(_checkpoint(2, 64 * KiB)))  # replaced behind our back: the ETag changes
    assert_bit_equal(plugin.load_checkpoint(path, weights_only=False), _checkpoint(2, 64 * KiB))
    assert _counters(plugin).misses == 1
    plugin.teardown()


def _serialized(checkpoint: dict) -> bytes:
    buffer = io.BytesIO(b"")
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------------- never stale
def test_a_file_replaced_after_its_commit_is_read_from_storage(tmp_path) -> None:
    plugin = DataStatesIO()
    _, _, directory = _fit(tmp_path, plugin)
    path = os.path.join(directory, "last.ckpt")
    replacement = {"state_dict": {"w": torch.arange(5.0)}, "epoch": 99}
    torch.save(replacement, path + ".tmp")
    os.replace(path + ".tmp", path)  # an atomic replacement by someone else
    misses = _counters(plugin).misses
    assert_bit_equal(plugin.load_checkpoint(path, weights_only=False), replacement)
    assert _counters(plugin).misses == misses + 1
    assert_bit_equal(plugin.load_checkpoint(path, weights_only=False), replacement)  # the image is gone for good
    plugin.teardown()


def test_a_removed_checkpoint_is_not_served(tmp_path) -> None:
    plugin = DataStatesIO()
    _, _, directory = _fit(tmp_path, plugin)
    path = os.path.join(directory, "last.ckpt")
    plugin.remove_checkpoint(path)
    hits = _counters(plugin).hits
    with pytest.raises(FileNotFoundError, match="last.ckpt"):
        plugin.load_checkpoint(path)
    assert _counters(plugin).hits == hits
    plugin.teardown()


def test_serve_from_memory_false_never_serves_and_frees_every_block(tmp_path) -> None:
    plugin = DataStatesIO(serve_from_memory=False)
    trainer, model, directory = _fit(tmp_path, plugin)
    path = os.path.join(directory, "last.ckpt")
    assert pipeline_of(plugin).engine.resident is None and pipeline_of(plugin).engine.open_resident(path) is None
    assert pipeline_of(plugin).engine.arena is not None and pipeline_of(plugin).engine.arena.used_bytes == 0
    assert_bit_equal(plugin.load_checkpoint(path, weights_only=False), _from_file(path))
    trainer.validate(model, make_loader(), ckpt_path="last", verbose=False)
    plugin.teardown()


# ---------------------------------------------------------------------------------------------------- bounded
def test_a_checkpoint_larger_than_the_arena_streams_through_it_and_is_read_from_storage(tmp_path) -> None:
    plugin = DataStatesIO(host_cache="1MiB", chunk_size="128KiB")
    _, _, directory = _fit(tmp_path, plugin, width=512)  # about 3.5 MB per checkpoint
    path = os.path.join(directory, "last.ckpt")
    assert os.path.getsize(path) > pipeline_of(plugin).engine.arena.size_bytes  # type: ignore[union-attr]
    assert pipeline_of(plugin).engine.open_resident(path) is None
    assert _counters(plugin).published == 0 and _counters(plugin).evictions > 0
    assert_bit_equal(plugin.load_checkpoint(path, weights_only=False), _from_file(path))
    plugin.teardown()


def test_later_checkpoints_evict_older_ones_which_load_from_storage(tmp_path) -> None:
    plugin = DataStatesIO(host_cache="3MiB", chunk_size="128KiB")  # about three checkpoints of this model
    trainer, _, directory = _fit(tmp_path, plugin)
    first = os.path.join(directory, "epoch=0-step=1.ckpt")
    newest = os.path.join(directory, f"epoch=0-step={trainer.global_step}.ckpt")
    counters = _counters(plugin)
    misses, hits = counters.misses, counters.hits
    assert_bit_equal(plugin.load_checkpoint(first, weights_only=False), _from_file(first))
    assert_bit_equal(plugin.load_checkpoint(newest, weights_only=False), _from_file(newest))
    assert (counters.misses, counters.hits) == (misses + 1, hits + 1)
    assert counters.evictions > 0
    plugin.teardown()


def test_two_checkpoints_sharing_one_host_copy_are_both_served(tmp_path, gated_writer) -> None:
    plugin = DataStatesIO()
    directory = str(tmp_path / "ckpt")
    top = ModelCheckpoint(
        dirpath=directory, filename="best-{step}", monitor="train_loss", save_top_k=1, every_n_train_steps=1
    )
    # The gate holds writes while a step's saves are captured, so last.ckpt always follows the top-k file's copy.
    callbacks = [HoldWritesDuringSaves(gated_writer.gate), top, every_step_checkpoint(directory, save_top_k=0)]
    torch.manual_seed(0)
    trainer = quiet_trainer(str(tmp_path), [plugin], callbacks=callbacks, max_epochs=1)
    trainer.fit(BNModel(), make_loader())
    assert pipeline_of(plugin).engine.sharing_counters.shared_bytes > 0
    best, last = top.best_model_path, os.path.join(directory, "last.ckpt")
    hits = _counters(plugin).hits
    for path in (best, last):
        assert_bit_equal(plugin.load_checkpoint(path, weights_only=False), _from_file(path), os.path.basename(path))
    assert _counters(plugin).hits == hits + 2
    plugin.teardown()


def test_retained_checkpoints_never_make_on_arena_full_skip(tmp_path) -> None:
    plugin = in_background(DataStatesIO(host_cache="1MiB", on_arena_full="skip"), lazy=True)
    for index in range(3):
        path = str(tmp_path / f"{index}.ckpt")
        pipeline = pipeline_of(plugin)
        stats = pipeline.engine.capture(_checkpoint(index, 700 * KiB), path, pipeline.writer_for(path), lambda s: True)
        pipeline.engine.wait_copies()
        pipeline.engine.wait_path(path)
        assert stats.state == "committed"
    assert _counters(plugin).evictions >= 1
    plugin.teardown()


def test_a_leased_image_is_not_evicted_the_allocation_waits_for_the_lease(tmp_path) -> None:
    # Chunks of 256 KiB; the first checkpoint leaves 124 KiB free: the second one's first chunk needs its blocks.
    plugin = DataStatesIO(host_cache="1MiB", chunk_size="256KiB")
    first, second = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    plugin.save_checkpoint(_checkpoint(1, 900 * KiB), first)
    with open(first, "rb") as file:
        expected = file.read()
    reader = pipeline_of(plugin).engine.open_resident(first)
    assert reader is not None
    saver = threading.Thread(target=plugin.save_checkpoint, args=(_checkpoint(2, 700 * KiB), second))
    saver.start()
    resident = pipeline_of(plugin).engine.resident
    assert resident is not None
    while first in resident.published_paths():  # the save evicts what it can; the leased image is doomed instead
        assert saver.is_alive(), "the save finished without the leased image's space"
        time.sleep(0.01)
    assert saver.is_alive()  # still waiting: it needs the leased blocks
    with reader:
        assert reader.read() == expected  # intact: nothing wrote over the leased blocks
    saver.join(timeout=60)
    assert not saver.is_alive()
    assert_bit_equal(plugin.load_checkpoint(second, weights_only=False), _checkpoint(2, 700 * KiB))
    assert_bit_equal(plugin.load_checkpoint(first, weights_only=False), _checkpoint(1, 900 * KiB))  # from storage
    assert second in resident.published_paths() and first not in resident.published_paths()
    plugin.teardown()


# ---------------------------------------------------------------------------------------------------- units
def test_arena_asks_reclaim_oldest_first_then_waits_until_woken() -> None:
    arena = HostArena(4 * 4096)
    held = [arena.allocate(4096) for _ in range(4)]
    given: list = []
    evictable = list(held[:2])

    def reclaim():
        if not evictable:
            return None
        given.append(evictable.pop(0))
        return [given[-1]] if len(given) != 1 else []  # the first eviction frees nothing (a shared block)

    arena.reclaim = reclaim
    block = arena.allocate(4096)  # first call lets go of nothing, the second gives a block back
    assert given == held[:2] and block.offset == held[1].offset
    with pytest.raises(TimeoutError):
        arena.allocate(2 * 4096, timeout_s=0.05)  # nothing left to reclaim: it waits (and times out)
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(arena.allocate(4096)))
    waiter.start()
    evictable.append(held[2])
    arena.wake()  # something became evictable: the waiter asks again
    waiter.join(timeout=30)
    assert result and result[0].offset == held[2].offset


def test_segment_reader_zero_fills_only_the_gaps() -> None:
    segments = [(2, b"ab"), (6, bytearray(b"cdef"))]
    reader = SegmentReader(segments, 12)
    target = bytearray(b"\xff" * 12)
    assert reader.readinto(target) == 12 and bytes(target) == b"\0\0ab\0\0cdef\0\0"
    reader.seek(3)
    assert reader.read(4) == b"b\0\0c" and reader.read_at(7, 2) == b"de" and reader.read() == b"f\0\0"


def test_serve_from_memory_is_validated_and_read_from_a_lightning_cli_yaml(tmp_path, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="serve_from_memory must be True or False"):
        DataStatesIO(serve_from_memory="yes")  # type: ignore[arg-type]
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # SmallGPT and TokenData, as examples/cli.py uses them
    monkeypatch.setattr(sys, "argv", ["cli.py"])
    override = tmp_path / "resident.yaml"
    override.write_text(
        "trainer:\n  plugins:\n    - class_path: lightning_datastates.DataStatesIO\n"
        "      init_args:\n        serve_from_memory: false\n"
    )
    cli = _run_cli(
        tmp_path, "local.yaml", "--config", str(override), f"--trainer.callbacks.init_args.dirpath={tmp_path}"
    )
    plugin = _plugin(cli)
    assert plugin.config.serve_from_memory is False and pipeline_of(plugin).engine.resident is None


def test_segment_reader_copies_large_writable_segments_exactly() -> None:
    """Large copies from writable buffers (the arena) take torch's parallel copy; the bytes are the same."""
    first, second = bytearray(os.urandom(3 * MiB)), bytearray(os.urandom(2 * MiB + 5))
    reader = SegmentReader([(0, first), (3 * MiB + 7, second)], 5 * MiB + 12)
    target = bytearray(b"\xff" * (5 * MiB + 12))
    assert reader.readinto(target) == len(target)
    assert target == first + bytes(7) + second
