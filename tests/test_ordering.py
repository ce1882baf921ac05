"""Ordering and bounds of the plugin on its own: pending loads, removals, repeated saves, small arenas."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lightning_datastates import CheckpointFlushError, DataStatesIO
from lightning_datastates.plugin import pipeline_of
from tests.conftest import GatedWriter, assert_bit_equal, in_background, temp_files


def _checkpoint(seed: int, megabytes: int = 4) -> dict:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(megabytes * 2**18, generator=generator)  # 4 bytes each
    return {
        "state_dict": {
            "weight": weight,
            "tied": weight,
            "view": weight[10:20],
            "bias": torch.randn(7, generator=generator),
        },
        "epoch": seed,
        "hyper_parameters": {"name": f"run-{seed}", "sizes": (1, 2, 3)},
    }


def _release_later(writer: GatedWriter, delay_s: float = 0.3) -> threading.Timer:
    timer = threading.Timer(delay_s, writer.gate.set)
    timer.start()
    return timer


def test_load_of_pending_path_waits_for_its_write(tmp_path, gated_writer):
    plugin = in_background(DataStatesIO())
    path = str(tmp_path / "a.ckpt")
    gated_writer.gate.clear()
    expected = _checkpoint(1)
    plugin.save_checkpoint(expected, path)
    assert pipeline_of(plugin).is_pending(path) and not os.path.exists(path)
    _release_later(gated_writer)
    loaded = plugin.load_checkpoint(path, weights_only=True)
    assert_bit_equal(loaded, expected)
    assert loaded["state_dict"]["weight"].data_ptr() == loaded["state_dict"]["tied"].data_ptr()  # still tied
    plugin.teardown()


def test_remove_of_pending_path_leaves_nothing(tmp_path, gated_writer):
    plugin = in_background(DataStatesIO())
    path = str(tmp_path / "a.ckpt")
    gated_writer.gate.clear()
    plugin.save_checkpoint(_checkpoint(1), path)
    _release_later(gated_writer)
    plugin.remove_checkpoint(path)
    plugin.drain()
    assert os.listdir(tmp_path) == []
    plugin.teardown()


def test_remove_waits_for_the_newer_checkpoint_to_land(tmp_path, gated_writer):
    """Top-k: the old best is deleted only once the newer checkpoint is committed."""
    plugin = in_background(DataStatesIO())
    first, second = str(tmp_path / "first.ckpt"), str(tmp_path / "second.ckpt")
    plugin.save_checkpoint(_checkpoint(1), first)
    plugin.drain()
    gated_writer.gate.clear()
    plugin.save_checkpoint(_checkpoint(2), second)
    plugin.remove_checkpoint(first)  # returns at once: no wait for the other path
    assert os.path.exists(first)  # still the only complete checkpoint on disk
    assert not pipeline_of(plugin).counts_as_existing(first, os.path.exists(first))  # ModelCheckpoint sees it removed
    gated_writer.gate.set()
    plugin.drain()
    assert not os.path.exists(first)
    assert_bit_equal(torch.load(second, weights_only=True), _checkpoint(2))
    plugin.teardown()


def test_remove_is_dropped_when_the_newer_checkpoint_fails(tmp_path, gated_writer):
    plugin = in_background(DataStatesIO())
    first, second = str(tmp_path / "first.ckpt"), str(tmp_path / "second.ckpt")
    plugin.save_checkpoint(_checkpoint(1), first)
    plugin.drain()
    gated_writer.fail_on_write = gated_writer.writes + 1
    plugin.save_checkpoint(_checkpoint(2), second)
    plugin.remove_checkpoint(first)
    plugin.drain()
    with pytest.raises(CheckpointFlushError):
        pipeline_of(plugin).raise_pending_failure()
    assert not os.path.exists(second)
    assert_bit_equal(torch.load(first, weights_only=True), _checkpoint(1))  # the last good checkpoint is kept
    plugin.teardown()


def test_saves_to_one_path_land_in_order(tmp_path, gated_writer):
    plugin = in_background(DataStatesIO())
    path = str(tmp_path / "last.ckpt")
    gated_writer.gate.clear()
    for seed in range(5):
        plugin.save_checkpoint(_checkpoint(seed), path)
    gated_writer.gate.set()
    plugin.drain()
    assert_bit_equal(torch.load(path, weights_only=True), _checkpoint(4))
    assert temp_files(str(tmp_path)) == []
    plugin.teardown()


def test_many_checkpoints_in_flight(tmp_path, gated_writer):
    """Storage slower than saves: checkpoints queue up, host memory stays within the arena (back-pressure)."""
    plugin = in_background(DataStatesIO(host_cache="16MiB", writer_threads=3))
    paths = [str(tmp_path / f"c{i}.ckpt") for i in range(12)]
    gated_writer.gate.clear()
    _release_later(gated_writer, delay_s=0.5)  # the arena fills up before storage moves at all
    most_pending = 0
    for seed, path in enumerate(paths):
        plugin.save_checkpoint(_checkpoint(seed), path)
        most_pending = max(most_pending, sum(pipeline_of(plugin).is_pending(p) for p in paths))
    assert most_pending >= 3
    plugin.drain()
    for seed, path in enumerate(paths):
        assert_bit_equal(torch.load(path, weights_only=True), _checkpoint(seed), path)
    arena = pipeline_of(plugin).engine.arena
    assert arena is not None and arena.peak_used_bytes <= arena.size_bytes == 16 * 2**20
    plugin.teardown()


def test_arena_smaller_than_one_checkpoint_streams(tmp_path):
    plugin = in_background(DataStatesIO(host_cache="1MiB", chunk_size="128KiB"))
    path = str(tmp_path / "big.ckpt")
    expected = _checkpoint(3, megabytes=8)
    plugin.save_checkpoint(expected, path)
    plugin.drain()
    arena = pipeline_of(plugin).engine.arena
    assert arena is not None and arena.size_bytes == 2**20
    assert arena.peak_used_bytes <= arena.size_bytes
    assert_bit_equal(torch.load(path, weights_only=True), expected)
    plugin.teardown()


def test_without_callback_everything_is_copied_before_save_returns(tmp_path, gated_writer):
    """Outside a Trainer nothing guarantees a barrier: the save call must snapshot every tensor itself."""
    plugin = in_background(DataStatesIO(eager_copy_size="1KiB"))
    path = str(tmp_path / "a.ckpt")
    checkpoint = _checkpoint(5)
    expected = {k: (v.copy() if isinstance(v, dict) else v) for k, v in checkpoint.items()}
    expected["state_dict"] = {k: v.clone() for k, v in checkpoint["state_dict"].items()}
    gated_writer.gate.clear()
    plugin.save_checkpoint(checkpoint, path)
    checkpoint["state_dict"]["weight"].add_(1.0)  # mutate right after the call returns
    checkpoint["hyper_parameters"]["name"] = "changed"  # and the containers too
    gated_writer.gate.set()
    plugin.drain()
    loaded = torch.load(path, weights_only=True)
    assert_bit_equal(loaded["state_dict"]["weight"], expected["state_dict"]["weight"])
    assert loaded["hyper_parameters"]["name"] == "run-5"
    plugin.teardown()


def test_teardown_stops_threads_and_plugin_restarts(tmp_path):
    plugin = in_background(DataStatesIO())
    plugin.save_checkpoint(_checkpoint(1), str(tmp_path / "a.ckpt"))
    threads = pipeline_of(plugin).engine._threads.running
    plugin.teardown()
    assert threads and not any(t.is_alive() for t in threads)
    assert pipeline_of(plugin).engine._threads.running == []
    plugin.save_checkpoint(_checkpoint(2), str(tmp_path / "b.ckpt"))
    plugin.teardown()
    assert_bit_equal(torch.load(str(tmp_path / "b.ckpt"), weights_only=True), _checkpoint(2))


def test_outside_a_training_loop_save_returns_once_committed(tmp_path, gated_writer):
    """Used on its own (or after fit) the plugin behaves like TorchCheckpointIO: the file exists on return."""
    plugin = DataStatesIO()
    path = str(tmp_path / "now.ckpt")
    gated_writer.gate.clear()
    _release_later(gated_writer, delay_s=0.2)
    plugin.save_checkpoint(_checkpoint(7), path)
    assert not pipeline_of(plugin).is_pending(path) and temp_files(str(tmp_path)) == []
    assert_bit_equal(torch.load(path, weights_only=True), _checkpoint(7))
    gated_writer.fail_on_write = gated_writer.writes + 1
    try:
        plugin.save_checkpoint(_checkpoint(8), path)
    except Exception as exc:  # noqa: BLE001 - checked below
        failure = exc
    assert type(failure).__name__ == "CheckpointFlushError" and path in str(failure)  # raised at the call itself
    assert_bit_equal(torch.load(path, weights_only=True), _checkpoint(7))
    plugin.teardown()
