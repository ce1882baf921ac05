"""storage_alignment: tensors at aligned file offsets, and direct I/O (O_DIRECT) for local writes, with fallback.

The storage contract suite also runs against the direct-I/O writer (the "local-direct" harness of
tests/test_storage_contract.py).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import mmap
import os
import random
import threading

import pytest
import torch
import torch.utils.serialization

from lightning_datastates import DataStatesIO
from lightning_datastates.alignment import PAGE_ALIGNMENT_BYTES
from lightning_datastates.archive import read_archive_index
from lightning_datastates.capture.layout import plan_layout
from lightning_datastates.errors import ConfigError
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.storage import direct_io as direct_io_module
from lightning_datastates.storage import local as local_module
from lightning_datastates.storage.local import LocalWriter, LocalWriteSession
from tests.conftest import assert_bit_equal, in_background


def _direct_io_works(directory: str) -> bool:
    """An independent probe: can a file in ``directory`` be opened with O_DIRECT and written one aligned block?"""
    path = os.path.join(directory, "probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    try:
        block = mmap.mmap(-1, PAGE_ALIGNMENT_BYTES)
        os.pwrite(fd, block, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def _direct_session(tmp_path) -> LocalWriteSession:
    """A session writing ``tmp_path/d.ckpt`` with O_DIRECT; the test is skipped where the file system refuses it."""
    session = LocalWriter(direct_io=True).begin(str(tmp_path / "d.ckpt"), 0)
    if not session.direct_io:
        session.abort()
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    return session


def _records(path: str):
    with open(path, "rb") as file:
        data = file.read()
    return [r for r in read_archive_index(lambda o, n: data[o : o + n], len(data)) if r.name.split("/")[-2] == "data"]


def _checkpoint() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "state_dict": {f"w{i}": torch.randn(1000 * i + 7, generator=generator) for i in range(1, 6)},
        "big": torch.randn(600_000, generator=generator),
        "step": torch.tensor(3),
        "epoch": 2,
    }


def test_storage_alignment_is_validated() -> None:
    assert DataStatesIO(storage_alignment="4KiB").config.storage_alignment == 4096
    assert DataStatesIO().config.storage_alignment is None
    for bad in (3000, 32, "lots", 2**30):
        with pytest.raises(ConfigError, match="storage_alignment"):
            DataStatesIO(storage_alignment=bad)


def test_direct_io_is_validated_and_reaches_the_local_writer(tmp_path) -> None:
    assert DataStatesIO().config.direct_io == "auto"
    for value in (True, False, "auto"):
        plugin = DataStatesIO(direct_io=value)
        writer = pipeline_of(plugin).writer_for(str(tmp_path / "x.ckpt"))
        assert isinstance(writer, LocalWriter) and writer.direct_io == value
    for bad in ("yes", 1, None, "AUTO"):
        with pytest.raises(ConfigError, match="direct_io must be 'auto'"):
            DataStatesIO(direct_io=bad)


def test_the_file_system_of_a_path_is_read_from_the_mount_table(tmp_path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / / rw - ext4 /dev/vda rw\n"
        "30 22 0:40 / /mnt/nfs rw shared:5 - nfs4 server:/export rw,vers=4.2\n"
        "31 30 0:41 / /mnt/nfs/scratch\\040space rw - lustre 10.0.0.1@tcp:/fs rw\n"
        "32 22 0:42 / /dev/shm rw - tmpfs tmpfs rw\n"
    )
    for path, expected in [
        ("/home/me/ckpt", "ext4"),
        ("/mnt/nfs", "nfs4"),
        ("/mnt/nfs/run/ckpt", "nfs4"),
        ("/mnt/nfs/scratch space/ckpt", "lustre"),
        ("/mnt/nfsother", "ext4"),
        ("/dev/shm/x", "tmpfs"),
    ]:
        assert direct_io_module._file_system_type(path, str(mountinfo)) == expected, path
    assert direct_io_module._file_system_type("/", str(tmp_path / "missing")) is None


@pytest.mark.parametrize("fstype", ["nfs4", "tmpfs", "fuse.gcsfuse"])
def test_auto_leaves_network_fuse_and_memory_file_systems_to_the_page_cache(tmp_path, monkeypatch, fstype) -> None:
    """Each direct write to NFS or a FUSE file system is a synchronous request: "auto" keeps the page cache there;
    ``direct_io=True`` still asks for O_DIRECT."""
    monkeypatch.setattr(direct_io_module, "_file_system_type", lambda path: fstype)
    direct_io_module.direct_io_suits.cache_clear()  # answered once per directory: forget answers from the real table
    try:
        for direct_io, expected in (("auto", False), (True, _direct_io_works(str(tmp_path)))):
            session = LocalWriter(direct_io=direct_io).begin(str(tmp_path / "x.ckpt"), 0)
            assert session.direct_io == expected, direct_io
            session.abort()
    finally:
        direct_io_module.direct_io_suits.cache_clear()


@pytest.mark.parametrize("direct_io", ["auto", False])
def test_default_writes_use_o_direct_where_the_file_system_takes_it(tmp_path, direct_io) -> None:
    session = (
        pipeline_of(DataStatesIO(direct_io=direct_io))
        .writer_for(str(tmp_path / "x.ckpt"))
        .begin(str(tmp_path / "x.ckpt"), 0)
    )
    try:
        expected = (
            direct_io == "auto" and direct_io_module.direct_io_suits(str(tmp_path)) and _direct_io_works(str(tmp_path))
        )
        assert session.direct_io == expected
        assert session.direct_alignment == (PAGE_ALIGNMENT_BYTES if expected else None)
        assert session.fast_writes == (not expected)  # write-through only through the page cache
    finally:
        session.abort()


def test_plan_aligns_every_record_and_leaves_torchs_setting_as_it_was() -> None:
    before = torch.utils.serialization.config.save.storage_alignment
    layout, _ = plan_layout(_checkpoint(), 4096)
    assert torch.utils.serialization.config.save.storage_alignment == before
    assert [r.offset % 4096 for r in layout.records if r.nbytes] == [0] * 7
    unaligned, _ = plan_layout(_checkpoint())
    assert any(r.offset % 4096 for r in unaligned.records if r.nbytes)  # the default (64) pads less


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_aligned_files_are_plain_torch_files_with_aligned_records(tmp_path, lazy: bool) -> None:
    path = str(tmp_path / "a.ckpt")
    plugin = DataStatesIO(storage_alignment=4096, chunk_size="256KiB", eager_copy_size="1KiB")
    if lazy:
        in_background(plugin, lazy=True)  # copies in the background, chunk by chunk, as in training
    checkpoint = _checkpoint()
    plugin.save_checkpoint(checkpoint, path)
    plugin.drain()
    pipeline_of(plugin).raise_pending_failure()
    records = _records(path)
    assert len(records) == 7 and all(r.data_offset % 4096 == 0 for r in records)
    assert_bit_equal(torch.load(path, weights_only=True), checkpoint)
    assert_bit_equal(plugin.load_checkpoint(path, weights_only=True), checkpoint)
    plugin.teardown()


def test_direct_session_writes_aligned_blocks_with_o_direct_from_any_memory(tmp_path) -> None:
    session = LocalWriter(direct_io=True).begin(str(tmp_path / "d.ckpt"), 0)
    assert session.direct_io == _direct_io_works(str(tmp_path))
    if not session.direct_io:
        session.abort()
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert fcntl.fcntl(session._direct_fd, fcntl.F_GETFL) & os.O_DIRECT
    data = os.urandom(3 * 1024**2 + 12345)
    source = bytearray(b"x" + data)  # offset by one byte: unaligned memory goes through the bounce buffer
    view = memoryview(source)[1:]
    rng = random.Random(0)
    cuts = sorted({0, len(data), *(rng.randrange(len(data)) for _ in range(40))})
    ranges = list(itertools.pairwise(cuts))
    rng.shuffle(ranges)
    threads = [
        threading.Thread(target=lambda mine: [session.write_range(a, view[a:b]) for a, b in mine], args=(ranges[i::3],))
        for i in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    session.write_range(0, memoryview(data)[:10])  # read-only memory, below one block: buffered
    session.complete()
    assert (tmp_path / "d.ckpt").read_bytes() == data


@pytest.mark.parametrize("direct_io", [True, "auto"])
def test_a_file_system_refusing_o_direct_at_open_falls_back(tmp_path, monkeypatch, caplog, direct_io) -> None:
    """Asked for (True): one warning per directory. By default ("auto"): quietly (a debug log)."""
    real_open = os.open

    def no_direct_open(path, flags, *args):  # a file system without O_DIRECT (as tmpfs before Linux 6.6)
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(local_module.os, "open", no_direct_open)
    monkeypatch.setattr(direct_io_module, "_DIRECT_IO_WARNED", set())
    plugin = DataStatesIO(storage_alignment=4096, direct_io=direct_io)
    checkpoint = _checkpoint()
    with caplog.at_level(logging.DEBUG, logger="lightning_datastates"):
        for name in ("a.ckpt", "b.ckpt"):
            plugin.save_checkpoint(checkpoint, str(tmp_path / name))
            pipeline_of(plugin).raise_pending_failure()
    said = [r for r in caplog.records if "direct I/O" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path) in said[0].getMessage() and "page cache" in said[0].getMessage()
    assert said[0].levelno == (logging.WARNING if direct_io is True else logging.DEBUG)
    for name in ("a.ckpt", "b.ckpt"):
        assert_bit_equal(torch.load(str(tmp_path / name), weights_only=True), checkpoint)
        assert all(r.data_offset % 4096 == 0 for r in _records(str(tmp_path / name)))  # aligned all the same
    plugin.teardown()


@pytest.mark.parametrize("storage_alignment", [None, 4096], ids=["torch-layout", "aligned-layout"])
def test_direct_writes_come_straight_from_the_arena_without_a_bounce_copy(tmp_path, monkeypatch, storage_alignment):
    """The engine places each piece in its arena block as in the file (modulo 4 KiB), so with torch's own 64-byte
    layout too the aligned blocks are written from the arena itself, not copied through the bounce buffer."""
    if not _direct_io_works(str(tmp_path)):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    direct_bytes = {"in place": 0, "bounced": 0, "metadata": 0}
    real_write_direct = local_module.write_direct

    def spy(fd: int, view: memoryview, offset: int) -> None:
        address = direct_io_module._address(view)  # None: read-only bytes, i.e. the layout's headers and padding
        kind = "metadata" if address is None else "in place" if address % 4096 == 0 else "bounced"
        direct_bytes[kind] += view.nbytes
        real_write_direct(fd, view, offset)

    monkeypatch.setattr(local_module, "write_direct", spy)  # where the session looks it up
    plugin = in_background(DataStatesIO(storage_alignment=storage_alignment, chunk_size="1MiB"), lazy=True)
    checkpoint = _checkpoint()
    plugin.save_checkpoint(checkpoint, str(tmp_path / "a.ckpt"))
    pipeline_of(plugin).barrier()
    plugin.drain()
    pipeline_of(plugin).raise_pending_failure()
    assert_bit_equal(torch.load(str(tmp_path / "a.ckpt"), weights_only=True), checkpoint)
    payload = sum(t.untyped_storage().nbytes() for t in (checkpoint["big"], *checkpoint["state_dict"].values()))
    assert direct_bytes["in place"] > 0.9 * payload and direct_bytes["bounced"] == 0, direct_bytes
    plugin.teardown()


def test_memory_the_device_cannot_map_is_written_through_the_bounce_buffer(tmp_path, monkeypatch) -> None:
    """Some drivers' page-locked host buffers fail O_DIRECT with EFAULT: those writes go through the bounce buffer."""
    session = _direct_session(tmp_path)
    direct_fd, real_pwrite, refused = session._direct_fd, os.pwrite, []

    def pwrite(fd, data, offset):  # any memory but this thread's bounce buffer acts as "driver memory"
        if fd == direct_fd and memoryview(data).obj is not getattr(direct_io_module._BOUNCE, "buffer", None):
            refused.append(offset)
            raise OSError(errno.EFAULT, "Bad address")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(local_module.os, "pwrite", pwrite)
    source = mmap.mmap(-1, 4 * 4096)  # page-aligned: tried in place first
    data = os.urandom(3 * 4096 + 100)
    source.write(data)
    view = memoryview(source)[: len(data)]
    session.write_range(0, view)
    session.complete()
    assert refused and (tmp_path / "d.ckpt").read_bytes() == data
    view.release()
    source.close()


def test_a_direct_descriptor_refused_by_two_writers_at_once_is_closed_once(tmp_path, monkeypatch) -> None:
    session = _direct_session(tmp_path)
    direct_fd, real_pwrite, real_close = session._direct_fd, os.pwrite, os.close
    both_inside = threading.Barrier(2, timeout=30)
    closes: list[int] = []

    def refusing_pwrite(fd, data, offset):  # both writers are refused before either falls back
        if fd == direct_fd:
            both_inside.wait()
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    def counting_close(fd):
        closes.append(fd)
        real_close(fd)

    monkeypatch.setattr(local_module.os, "pwrite", refusing_pwrite)
    monkeypatch.setattr(local_module.os, "close", counting_close)
    data = os.urandom(4 * 4096)
    halves = [(0, memoryview(data)[: 2 * 4096]), (2 * 4096, memoryview(data)[2 * 4096 :])]
    threads = [threading.Thread(target=session.write_range, args=half) for half in halves]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    session.complete()
    assert closes.count(direct_fd) == 1 and (tmp_path / "d.ckpt").read_bytes() == data


def test_a_direct_write_refused_midway_falls_back_to_buffered_writes(tmp_path, monkeypatch, caplog) -> None:
    session = _direct_session(tmp_path)
    direct_fd = session._direct_fd
    real_pwrite = os.pwrite

    def refusing_pwrite(fd, data, offset):  # e.g. a device whose logical block is larger than 4096
        if fd == direct_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(local_module.os, "pwrite", refusing_pwrite)
    monkeypatch.setattr(direct_io_module, "_DIRECT_IO_WARNED", set())
    data = os.urandom(5 * 4096 + 100)
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        session.write_range(100, memoryview(data)[100:])
        session.write_range(0, memoryview(data)[:100])
    assert not session.direct_io and any("direct I/O" in r.getMessage() for r in caplog.records)
    session.complete()
    assert (tmp_path / "d.ckpt").read_bytes() == data
    with pytest.raises(OSError):
        os.fstat(direct_fd)  # the retired descriptor was closed with the session
