"""Restore from local files: verified, then mapped by torch through the descriptor that was verified.

S3 loads (ranged GETs into an in-memory file) are tested in tests/test_s3.py and tests/test_integrity.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from lightning_datastates import DataStatesIO
from lightning_datastates.errors import CheckpointCorruptError
from lightning_datastates.load import reader as reader_module
from lightning_datastates.load.reader import load_checkpoint
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.storage import LocalWriter
from tests.conftest import assert_bit_equal, in_background


def _checkpoint(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(256, 1024, generator=generator)
    return {
        "state_dict": {"w": weight, "view": weight[3:5], "i": torch.arange(10, dtype=torch.int64)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0)}}}],
        "epoch": seed,
    }


def _save(plugin: DataStatesIO, checkpoint: dict, path: str) -> None:
    plugin.save_checkpoint(checkpoint, path)  # outside fit: returns once committed
    pipeline_of(plugin).raise_pending_failure()


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_round_trip_honors_weights_only_and_map_location(tmp_path, verify: bool) -> None:
    path = str(tmp_path / "a.ckpt")
    plugin = DataStatesIO(verify_checksums=verify)
    checkpoint = _checkpoint(1)
    _save(plugin, checkpoint, path)
    loaded = plugin.load_checkpoint(path, weights_only=True)
    assert_bit_equal(loaded, checkpoint)
    # Views keep sharing their storage, as with torch.load.
    assert loaded["state_dict"]["view"].untyped_storage().data_ptr() == loaded["state_dict"]["w"].data_ptr()
    meta = plugin.load_checkpoint(path, map_location="meta", weights_only=True)
    assert meta["state_dict"]["w"].device.type == "meta" and meta["epoch"] == 1
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.save({"f": _Unsafe()}, str(tmp_path / "unsafe.ckpt"))
        plugin.load_checkpoint(str(tmp_path / "unsafe.ckpt"), weights_only=True)
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        plugin.load_checkpoint(str(tmp_path / "missing.ckpt"))
    plugin.teardown()


class _Unsafe:
    """Not on torch's weights_only allowlist."""


@pytest.mark.parametrize("spelling", ["relative", "dotted", "link"])
def test_a_load_waits_for_the_pending_save_of_its_file_however_the_path_is_spelled(
    tmp_path, monkeypatch, gated_writer, spelling
) -> None:
    """Pending saves are keyed by the file, not by the string: a load of ``ck/a.ckpt``, ``./ck//a.ckpt`` or of a
    symbolic link to the file (``save_last="link"``) waits for the newer save still being written, and gets it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    path = str(tmp_path / "ck" / "a.ckpt")
    plugin = in_background(DataStatesIO(serve_from_memory=False))
    plugin.save_checkpoint({"v": torch.tensor([1.0])}, path)
    plugin.drain()
    gated_writer.gate.clear()  # the newer save's writes wait
    plugin.save_checkpoint({"v": torch.tensor([2.0])}, path)
    if spelling == "link":
        os.symlink(path, tmp_path / "ck" / "last.ckpt")
    name = {"relative": "ck/a.ckpt", "dotted": "./ck//a.ckpt", "link": "ck/last.ckpt"}[spelling]
    threading.Timer(0.3, gated_writer.gate.set).start()
    assert plugin.load_checkpoint(name, weights_only=True)["v"].item() == 2.0
    plugin.teardown()


#: Saves a checkpoint whose storages are tagged ``cuda:0``, as one saved from a GPU (in a process of its own: the
#: tagger is registered with torch for good).
_SAVE_AS_FROM_A_GPU = """
import sys, torch
torch.serialization.register_package(0, lambda obj: "cuda:0", lambda obj, location: None)
torch.save({"w": torch.arange(3.0)}, sys.argv[1])
"""


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_without_map_location_a_gpu_checkpoint_loads_onto_the_cpu_as_with_lightnings_own_io(tmp_path, verify) -> None:
    """Lightning's strategies call ``load_checkpoint(path)`` with no ``map_location`` and move the state themselves:
    its ``TorchCheckpointIO`` loads onto the CPU, so a GPU checkpoint loads on a host without a GPU, and the ranks of
    a multi-GPU run do not all load onto ``cuda:0``. The plugin does the same."""
    path = str(tmp_path / "gpu.ckpt")
    subprocess.run([sys.executable, "-c", _SAVE_AS_FROM_A_GPU, path], check=True)
    loaded = DataStatesIO(verify_checksums=verify).load_checkpoint(path, weights_only=True)
    assert loaded["w"].device.type == "cpu" and torch.equal(loaded["w"], torch.arange(3.0))


def test_a_file_replaced_after_verification_is_not_the_one_loaded(tmp_path, monkeypatch) -> None:
    """The load maps the descriptor that was verified; renaming another file onto the name meanwhile changes
    nothing (a load by name would pick up the newcomer, unverified)."""
    path = str(tmp_path / "a.ckpt")
    plugin = DataStatesIO()
    first, second = _checkpoint(1), _checkpoint(2)
    _save(plugin, first, path)
    _save(plugin, second, str(tmp_path / "b.ckpt"))
    verify = reader_module.verify_open_file

    def verify_then_replace(file, name):  # the race, made certain: the name moves right after the check
        report = verify(file, name)
        os.replace(str(tmp_path / "b.ckpt"), path)
        return report

    monkeypatch.setattr(reader_module, "verify_open_file", verify_then_replace)
    assert_bit_equal(load_checkpoint(LocalWriter(), path), first)
    monkeypatch.undo()
    assert_bit_equal(plugin.load_checkpoint(path), second)  # the name now holds the second checkpoint
    plugin.teardown()


def test_loaded_tensors_outlive_the_file_and_writing_them_leaves_the_file_unchanged(tmp_path) -> None:
    path = str(tmp_path / "a.ckpt")
    plugin = DataStatesIO()
    checkpoint = _checkpoint(3)
    _save(plugin, checkpoint, path)
    before = open(path, "rb").read()
    loaded = plugin.load_checkpoint(path)
    loaded["state_dict"]["w"].mul_(2)  # copy-on-write pages: the file keeps its bytes
    assert open(path, "rb").read() == before
    plugin.remove_checkpoint(path)  # top-k removal of a file whose tensors are in use
    _save(plugin, _checkpoint(4), path)  # and a new file under the same name
    assert torch.equal(loaded["state_dict"]["w"], checkpoint["state_dict"]["w"] * 2)
    assert torch.equal(loaded["state_dict"]["i"], checkpoint["state_dict"]["i"])
    plugin.teardown()


def test_a_flipped_byte_in_a_mapped_load_raises_and_the_legacy_format_loads_unverified(tmp_path, caplog) -> None:
    path = str(tmp_path / "a.ckpt")
    plugin = DataStatesIO()
    _save(plugin, _checkpoint(5), path)
    with open(path, "r+b") as file:  # a byte in the middle of the big tensor's data
        file.seek(os.path.getsize(path) // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointCorruptError, match="a.ckpt"):
        plugin.load_checkpoint(path)
    legacy = str(tmp_path / "legacy.ckpt")
    checkpoint = _checkpoint(6)
    torch.save(checkpoint, legacy, _use_new_zipfile_serialization=False)  # not a zip: read through the file
    assert_bit_equal(DataStatesIO(verify_checksums=False).load_checkpoint(legacy, weights_only=True), checkpoint)
    # With verification (the default) too: no CRC-32 to check, said, and loaded as torch.load loads it.
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        assert_bit_equal(plugin.load_checkpoint(legacy, weights_only=True), checkpoint)
    assert "legacy (non-zip) format" in caplog.text and "legacy.ckpt" in caplog.text
    plugin.teardown()
