"""Integrity: every checkpoint carries a CRC-32 per record, zip tools agree, and a damaged file never loads.

Files are written by the plugin through the real engine and storage writers (local, S3 on a loopback moto server,
``memory://``), then damaged on purpose: one flipped byte in a committed file must raise an error naming the file
(and the record), never return wrong weights. The exhaustive test flips every byte of a small checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import shutil
import subprocess
import sys
import threading
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import lightning_datastates.records.checksums as checksums
from lightning_datastates import CheckpointCorruptError, DataStatesIO
from lightning_datastates.archive import ArchiveFormatError, read_archive_index
from lightning_datastates.capture.layout import plan_layout
from lightning_datastates.errors import ConfigError
from lightning_datastates.load.integrity import verify_buffer, verify_file
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.records.checksums import (
    WINDOW_BYTES,
    ChecksummingSession,
    combine_pieces,
    crc32,
    crc32_combine,
)
from lightning_datastates.records.session import WriteSession
from lightning_datastates.streams import BufferReader
from tests.conftest import (
    BNModel,
    assert_bit_equal,
    every_step_checkpoint,
    in_background,
    make_loader,
    make_trainer,
    storage_bytes,
)
from tests.s3_server import require_s3, s3_endpoint_fixture, s3_fixture  # noqa: F401 - fixtures

pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")


def _checkpoint(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {"w": torch.randn(300, 70, generator=generator), "b": torch.arange(7), "e": torch.empty(0)},
        "epoch": 3,
        "note": "x" * 100,
    }


def _save(path: str, checkpoint: dict[str, Any], lazy: bool = False, **settings: Any) -> None:
    """Save through the plugin with small chunks and several writers: records are split and written out of order."""
    options: dict[str, Any] = {
        "host_cache": "1MiB",
        "chunk_size": "8KiB",
        "writer_threads": 4,
        "eager_copy_size": "1KiB",
    }
    options.update(settings)
    plugin = DataStatesIO(**options)
    if lazy:
        in_background(plugin, lazy=True)
    plugin.save_checkpoint(checkpoint, path)
    pipeline_of(plugin).barrier()
    plugin.teardown()
    pipeline_of(plugin).raise_pending_failure()


@contextlib.contextmanager
def torch_crc_off() -> Iterator[None]:
    """torch's process-wide CRC option off for the block (as a user may set it), restored afterwards."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _records(data: bytes) -> list[Any]:
    return read_archive_index(lambda offset, nbytes: data[offset : offset + nbytes], len(data))


# ---------------------------------------------------------------------------------------------------- CRC math
def test_crc32_equals_zlib_with_isal_and_without(monkeypatch) -> None:
    rng = random.Random(1)
    data = rng.randbytes(5 * 1024**2 + 3)
    view = memoryview(bytearray(data))
    implementations = [crc32]
    monkeypatch.setitem(sys.modules, "isal", None)  # as where isal has no wheel: the import fails
    implementations.append(checksums._fastest_crc32())
    assert implementations[1] is zlib.crc32
    for implementation in implementations:
        for start, stop in ((0, 0), (0, 1), (7, 70_000), (0, len(data)), (1024**2, 4 * 1024**2 + 1)):
            assert implementation(view[start:stop]) == zlib.crc32(data[start:stop])
            assert implementation(view[start:stop], 0x1234) == zlib.crc32(data[start:stop], 0x1234)


def test_crc32_combine_equals_zlib_on_the_concatenation() -> None:
    rng = random.Random(0)
    for _ in range(300):
        a, b = rng.randbytes(rng.randint(0, 3000)), rng.randbytes(rng.randint(0, 3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = os.urandom(3 * 1024**2 + 17)
    cuts = sorted(rng.sample(range(1, len(big)), 40))
    pieces = [(s, e - s, zlib.crc32(big[s:e])) for s, e in zip([0, *cuts], [*cuts, len(big)])]
    rng.shuffle(pieces)
    assert combine_pieces(pieces) == zlib.crc32(big)
    with pytest.raises(ValueError, match="not contiguous"):
        combine_pieces(pieces[1:] if pieces[0][0] != 0 else pieces[:1] + pieces[2:])


class MemorySession(WriteSession):
    """A session into a bytearray (records the commit), for driving ChecksummingSession directly."""

    def __init__(self, size: int) -> None:
        self.path = "memory-session"
        self.data = bytearray(size)
        self.committed = False
        self.lock = threading.Lock()

    def write_range(self, offset: int, data: memoryview) -> None:
        with self.lock:
            self.data[offset : offset + len(data)] = data

    def complete(self) -> None:
        self.committed = True

    def abort(self) -> None:
        pass


def _session_and_pieces(checkpoint: Any) -> tuple[ChecksummingSession, MemorySession, list[tuple[int, bytes]]]:
    layout, storages = plan_layout(checkpoint)
    inner = MemorySession(layout.total_bytes)
    pieces = list(layout.metadata)
    for record in layout.records:
        raw = storage_bytes(storages[record.key])
        for start in range(0, record.nbytes, 1000):  # 1000-byte pieces: records split at odd places
            pieces.append((record.offset + start, raw[start : start + 1000]))
    return ChecksummingSession(inner, layout.checksums), inner, pieces


def test_pieces_written_out_of_order_from_threads_give_valid_crcs() -> None:
    session, inner, pieces = _session_and_pieces(_checkpoint())
    random.Random(1).shuffle(pieces)
    threads = [
        threading.Thread(target=lambda part=pieces[i::4]: [session.write_range(o, memoryview(d)) for o, d in part])
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    session.complete()
    assert inner.committed
    with zipfile.ZipFile(io.BytesIO(bytes(inner.data))) as archive:
        assert archive.testzip() is None
    assert verify_buffer(inner.data, "memory").complete


@pytest.mark.parametrize("direct_alignment", [None, 4096], ids=["page-cache", "direct"])
def test_writes_are_windowed_on_file_boundaries_for_the_page_cache_and_whole_for_direct_io(direct_alignment) -> None:
    """Page cache: 1 MiB windows ending on 1 MiB file offsets (checksummed while in the CPU cache, and never a
    partial block inside a range). Direct I/O: the device reads memory itself, so each range goes in one request."""
    checkpoint = {"big": torch.randn(3 * 1024**2 // 4 + 5)}
    layout, storages = plan_layout(checkpoint)
    inner = MemorySession(layout.total_bytes)
    inner.direct_alignment = direct_alignment
    calls: list[tuple[int, int]] = []
    real_write = inner.write_range
    inner.write_range = lambda offset, data: (calls.append((offset, len(data))), real_write(offset, data))  # type: ignore[method-assign]
    session = ChecksummingSession(inner, layout.checksums)
    for offset, data in layout.metadata:
        session.write_range(offset, memoryview(data))
    (record,) = [r for r in layout.records if r.nbytes]
    raw = storage_bytes(storages[record.key])
    calls.clear()
    session.write_range(record.offset, memoryview(raw))
    data_calls = [c for c in calls if c[1] != 4]  # without the CRC-32 fields written at the end
    if direct_alignment:
        assert data_calls == [(record.offset, record.nbytes)]
    else:
        assert len(data_calls) == 4 and all((o + n) % WINDOW_BYTES == 0 for o, n in data_calls[:-1])
        assert sum(n for _, n in data_calls) == record.nbytes
    session.complete()
    assert verify_buffer(inner.data, "memory").complete


def test_a_known_crc_is_taken_inside_a_record_and_ranges_across_records_are_checksummed() -> None:
    session, inner, pieces = _session_and_pieces(_checkpoint())
    metadata = len(plan_layout(_checkpoint())[0].metadata)  # the first pieces; the payload pieces follow
    for offset, data in pieces[metadata:]:  # every payload piece with the CRC its producer computed
        session.write_checksummed_range(offset, memoryview(data), zlib.crc32(data))
    for offset, data in pieces[:metadata]:  # no record inside: a "known" CRC is ignored, nothing is counted
        session.write_checksummed_range(offset, memoryview(data), 0xDEADBEEF)
    session.complete()
    assert verify_buffer(inner.data, "memory").complete
    # A range across two records (a metadata gap between them): its pieces are checksummed here, not taken on trust.
    layout, _ = plan_layout(_checkpoint())
    first, second = sorted((r for r in layout.records if r.nbytes), key=lambda r: r.offset)[:2]
    spanning = ChecksummingSession(MemorySession(layout.total_bytes), layout.checksums)
    spanning.write_checksummed_range(first.offset, memoryview(bytes(second.offset + 8 - first.offset)), 0xDEADBEEF)
    assert spanning._written[spanning._starts.index(first.offset)] == first.nbytes


def test_the_copier_crc_is_what_the_file_carries(tmp_path, monkeypatch) -> None:
    """Host tensors are checksummed by the copier while the bytes are in the CPU cache, and writers trust it: a wrong
    copier CRC makes a file that fails verification (so the writers really do not recompute it)."""
    from lightning_datastates.copy import copier as copier_module

    checkpoint = {**_checkpoint(), "big": torch.randn(300_000)}
    large_pieces = {"chunk_size": "256KiB", "host_cache": "4MiB"}  # the copier checksums pieces over 64 KiB only
    _save(str(tmp_path / "good.ckpt"), checkpoint, lazy=True, **large_pieces)
    assert verify_file(str(tmp_path / "good.ckpt")).complete
    real_copy = copier_module.CpuCopier.copy_pieces

    def wrong_crcs(self: Any, *args: Any) -> dict[int, tuple[int, int]]:
        return {offset: (nbytes, crc ^ 1) for offset, (nbytes, crc) in real_copy(self, *args).items()}

    monkeypatch.setattr(copier_module.CpuCopier, "copy_pieces", wrong_crcs)
    _save(str(tmp_path / "bad.ckpt"), checkpoint, lazy=True, **large_pieces)
    with pytest.raises(CheckpointCorruptError):
        verify_file(str(tmp_path / "bad.ckpt"))
    assert_bit_equal(torch.load(str(tmp_path / "bad.ckpt"), weights_only=True), checkpoint)  # the bytes are right


def test_commit_is_refused_when_a_record_was_not_written_whole() -> None:
    session, inner, pieces = _session_and_pieces(_checkpoint())
    payload = [p for p in pieces if len(p[1]) == 1000]
    for offset, data in pieces:
        if (offset, data) != payload[3]:
            session.write_range(offset, memoryview(data))
    with pytest.raises(RuntimeError, match=r"record archive/data/\d+ is incomplete"):
        session.complete()
    assert not inner.committed
    with pytest.raises(RuntimeError, match="written twice"):
        session.write_range(pieces[0][0], memoryview(pieces[0][1]))  # the first metadata segment: data.pkl again


# ---------------------------------------------------------------------------------------------------- written files
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("chunk_size", ["8KiB", "64MiB"], ids=["pieces", "whole"])
def test_plugin_files_carry_crcs_that_zip_tools_accept(tmp_path, lazy: bool, chunk_size: str) -> None:
    # 8 KiB chunks: records split into pieces written out of order by 4 threads. 64 MiB: a 3 MiB record in one
    # write, checksummed window by window.
    path = str(tmp_path / "a.ckpt")
    checkpoint = {**_checkpoint(), "big": torch.randn(3 * 1024**2 // 4)}
    _save(path, checkpoint, lazy=lazy, chunk_size=chunk_size, host_cache="16MiB")
    data = _read(path)
    for record in _records(data):
        assert record.crc32 == zlib.crc32(data[record.data_offset : record.end]), record.name
        assert record.descriptor_crc32 == (record.crc32 if record.nbytes else None), record.name
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    if shutil.which("unzip"):
        result = subprocess.run(["unzip", "-tq", path], capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
    report = verify_file(path)
    assert report.complete and report.verified == report.records == len(_records(data))
    assert_bit_equal(torch.load(path, weights_only=True), checkpoint)


def test_fallback_files_carry_crcs_even_with_torchs_crc_option_off(tmp_path, caplog) -> None:
    # Quantized tensors make the layout planner fall back to a plain torch.save; the user turned torch's CRC off.
    checkpoint = {"q": torch.quantize_per_tensor(torch.randn(50), 0.1, 3, torch.qint8), "w": torch.randn(40)}
    path = str(tmp_path / "q.ckpt")
    with torch_crc_off(), caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        _save(path, checkpoint)
    assert "plain torch.save" in caplog.text
    data = _read(path)
    assert all(r.crc32 == zlib.crc32(data[r.data_offset : r.end]) for r in _records(data))
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    assert verify_file(path).complete
    loaded = DataStatesIO().load_checkpoint(path, weights_only=False)
    assert torch.equal(loaded["q"].int_repr(), checkpoint["q"].int_repr()) and torch.equal(loaded["w"], checkpoint["w"])


# ---------------------------------------------------------------------------------------------------- damage
def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x10]))


def test_a_flipped_payload_byte_raises_naming_file_and_record(tmp_path) -> None:
    path = str(tmp_path / "a.ckpt")
    checkpoint = _checkpoint()
    _save(path, checkpoint)
    weights = next(r for r in _records(_read(path)) if r.nbytes == 300 * 70 * 4)
    _flip(path, weights.data_offset + 12345)
    with pytest.raises(CheckpointCorruptError) as caught:
        DataStatesIO().load_checkpoint(path)
    assert caught.value.path == path and caught.value.record == weights.short_name
    assert path in str(caught.value) and weights.short_name in str(caught.value)
    # The check is what stands between the damage and the user: without it the wrong weights load silently.
    loaded = DataStatesIO(verify_checksums=False).load_checkpoint(path)
    assert not torch.equal(loaded["state_dict"]["w"], checkpoint["state_dict"]["w"])


def test_a_zeroed_central_directory_crc_does_not_make_a_damaged_record_load(tmp_path) -> None:
    """A file written without CRC-32s has none anywhere; a record whose central directory CRC-32 alone is zero (its
    data descriptor still carries one) is damaged, not unchecked: the damage to its payload must not load."""
    path = str(tmp_path / "a.ckpt")
    _save(path, _checkpoint())
    weights = next(r for r in _records(_read(path)) if r.nbytes == 300 * 70 * 4)
    assert weights.descriptor_crc32 and len(weights.crc_fields) == 2  # central directory entry, then descriptor
    with open(path, "r+b") as file:
        file.seek(weights.crc_fields[0])
        file.write(bytes(4))
    _flip(path, weights.data_offset + 12345)
    with pytest.raises(CheckpointCorruptError, match="central directory entry carries no CRC-32"):
        DataStatesIO().load_checkpoint(path)


def _load_buffer(data: bytes) -> Any:
    verify_buffer(data, "flipped.ckpt")
    return torch.load(BufferReader(bytearray(data)), weights_only=True)


def test_every_single_byte_flip_raises_or_loads_the_exact_checkpoint() -> None:
    checkpoint = {"w": torch.randn(40), "i": torch.arange(9, dtype=torch.int16), "step": 5}
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)  # the same archive structure the plugin writes (tested above), but quick
    original = buffer.getvalue()
    inside_records = {i for r in _records(original) for i in range(r.data_offset, r.end)}
    outcomes = {"corrupt": 0, "other error": 0, "exact": 0}
    for position in range(len(original)):
        damaged = bytearray(original)
        damaged[position] ^= 0x01
        try:
            loaded = _load_buffer(bytes(damaged))
        except CheckpointCorruptError:
            outcomes["corrupt"] += 1
            continue
        except Exception:  # noqa: BLE001 - torch refusing a damaged header is fine: it is not a wrong answer
            assert position not in inside_records, f"byte {position} of a record passed the check"
            outcomes["other error"] += 1
            continue
        assert position not in inside_records, f"byte {position} of a record passed the check"
        assert_bit_equal(loaded, checkpoint, f"flip at byte {position}")
        outcomes["exact"] += 1
    assert outcomes["corrupt"] >= len(inside_records)
    print(f"{len(original)} positions: {outcomes}")


def test_a_damaged_archive_structure_raises_corrupt_error(tmp_path) -> None:
    path = str(tmp_path / "a.ckpt")
    _save(path, _checkpoint())
    data = _read(path)
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.ckpt").write_bytes(b"")
    for name, needle in (("cut.ckpt", "end-of-central-directory"), ("empty.ckpt", "empty")):
        with pytest.raises(CheckpointCorruptError, match=needle) as caught:
            DataStatesIO().load_checkpoint(str(tmp_path / name))
        assert str(tmp_path / name) in str(caught.value)


def test_files_without_crcs_load_with_a_warning_and_are_reported_unchecked(tmp_path, caplog) -> None:
    path = str(tmp_path / "nocrc.ckpt")
    with torch_crc_off():
        torch.save({"w": torch.randn(10)}, path)
    report = verify_file(path)
    assert not report.complete and "data/0" in report.unchecked
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        assert DataStatesIO().load_checkpoint(path)["w"].shape == (10,)
    assert "carry no CRC-32" in caplog.text


def test_verify_checksums_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="verify_checksums"):
        DataStatesIO(verify_checksums="yes")  # type: ignore[arg-type]


def test_resuming_from_a_damaged_checkpoint_fails_loudly(tmp_path) -> None:
    # A real Trainer: fit(ckpt_path=...) goes through the plugin's load, which refuses the damaged file.
    trainer = make_trainer(str(tmp_path), DataStatesIO(), [every_step_checkpoint(str(tmp_path / "ck"))], max_epochs=1)
    trainer.fit(BNModel(), make_loader())
    last = str(tmp_path / "ck" / "last.ckpt")
    weights = max(_records(_read(last)), key=lambda r: r.nbytes)
    _flip(last, weights.data_offset + weights.nbytes // 2)
    trainer = make_trainer(str(tmp_path), DataStatesIO(), max_epochs=2)
    with pytest.raises(CheckpointCorruptError, match=weights.short_name):
        trainer.fit(BNModel(), make_loader(), ckpt_path=last)


# ---------------------------------------------------------------------------------------------------- remote
def test_s3_objects_are_verified_on_load(s3) -> None:
    url = s3.url("run/a.ckpt")
    checkpoint = _checkpoint()
    _save(url, checkpoint, storage_options=s3.storage_options)
    data = bytearray(s3.read("run/a.ckpt"))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        assert archive.testzip() is None
    plugin = DataStatesIO(storage_options=s3.storage_options)
    assert_bit_equal(plugin.load_checkpoint(url), checkpoint)
    weights = max(_records(bytes(data)), key=lambda r: r.nbytes)
    data[weights.data_offset + 7] ^= 0x80
    s3.put("run/a.ckpt", bytes(data))
    with pytest.raises(CheckpointCorruptError, match=weights.short_name) as caught:
        plugin.load_checkpoint(url)
    assert caught.value.path == url


def test_generic_fsspec_files_are_verified_on_load() -> None:
    import fsspec

    url = "memory://integrity/a.ckpt"
    checkpoint = _checkpoint()
    _save(url, checkpoint)
    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat_file("/integrity/a.ckpt"))
    assert_bit_equal(DataStatesIO().load_checkpoint(url), checkpoint)
    weights = max(_records(bytes(data)), key=lambda r: r.nbytes)
    data[weights.data_offset] ^= 0x01
    fs.pipe_file("/integrity/a.ckpt", bytes(data))
    try:
        with pytest.raises(CheckpointCorruptError, match=weights.short_name):
            DataStatesIO().load_checkpoint(url)
    finally:
        fs.rm("/integrity", recursive=True)


# ---------------------------------------------------------------------------------------------------- zip64
def test_archive_index_reads_zip64_offsets_like_zipfile(tmp_path) -> None:
    # A 4.5 GiB hole (sparse: no disk space) before the archive puts every offset past 4 GiB: zip64 fields.
    path = tmp_path / "zip64.bin"
    with open(path, "wb") as handle:
        handle.truncate(4608 * 1024**2)
    with zipfile.ZipFile(path, "a") as archive:
        for index in range(3):
            archive.writestr(f"archive/data/{index}", os.urandom(1000 + index))
    with zipfile.ZipFile(path) as archive:
        expected = {info.filename: (info.header_offset, info.file_size, info.CRC) for info in archive.infolist()}
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size

        def read_at(offset: int, nbytes: int) -> bytes:
            return os.pread(handle.fileno(), nbytes, offset)

        records = read_archive_index(read_at, size)
    assert {r.name: (r.local_offset, r.nbytes, r.crc32) for r in records} == expected
    assert min(r.local_offset for r in records) > 2**32
    assert verify_file(str(path)).verified == 3


def test_archive_index_rejects_what_is_not_a_zip() -> None:
    with pytest.raises(ArchiveFormatError, match="too short"):
        _records(b"PK")
    with pytest.raises(ArchiveFormatError, match="end-of-central-directory"):
        _records(os.urandom(4096))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x", b"a" * 1000)
    data = buffer.getvalue()
    with pytest.raises(ArchiveFormatError, match="compressed"):
        _records(data)
