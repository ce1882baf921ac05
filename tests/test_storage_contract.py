"""The storage contract: one suite that every ``StorageWriter`` passes, run on every backend (local, local with
direct I/O, fsspec's memory file system through the generic writer, S3 on a loopback moto server).

To add a backend, add a harness factory to ``HARNESSES``: it builds the writer and says how to read a committed
object, how to plant an existing one, and how to list what an unfinished write leaves behind. What is specific to one
backend lives in its own file (tests/test_local_storage.py, tests/test_s3.py, tests/test_generic_storage.py, ...).
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_datastates.records.leftovers import TEMP_SUFFIX
from lightning_datastates.storage import LocalWriter, StorageWriter

JOIN_S = 30.0


# ---------------------------------------------------------------------------------------------------- harnesses
@dataclass
class Harness:
    """What the contract suite needs to know about one backend."""

    writer: StorageWriter
    path: Callable[[str], str]  # name -> path inside this test's scratch space
    read: Callable[[str], bytes | None]  # committed content, None when absent
    put: Callable[[str, bytes], None]  # plant a committed object (an earlier checkpoint)
    leftovers: Callable[[], list]  # whatever unfinished writes left behind (temp files, pending uploads)


def _local_harness(tmp_path: Path) -> Harness:
    root = tmp_path / "ckpts"
    root.mkdir()

    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if os.path.isfile(path) else None

    def put(path: str, data: bytes) -> None:
        Path(path).write_bytes(data)

    def leftovers() -> list:
        return sorted(str(p) for p in tmp_path.rglob("*") if p.name.endswith(TEMP_SUFFIX) or p.name.startswith("."))

    return Harness(LocalWriter(), lambda name: str(root / name), read, put, leftovers)


def _local_direct_harness(tmp_path: Path) -> Harness:
    """The POSIX writer with direct I/O asked for (O_DIRECT where the file system takes it, else buffered)."""
    local = _local_harness(tmp_path)
    local.writer = LocalWriter(direct_io=True)
    return local


def _memory_harness(tmp_path: Path) -> Harness:
    """fsspec's in-memory file system through the generic writer (a stand-in for gcs://, az://, ...)."""
    import fsspec

    from lightning_datastates.storage import GenericWriter

    fs = fsspec.filesystem("memory")
    root = f"/{tmp_path.name}"
    fs.makedirs(root, exist_ok=True)

    def read(path: str) -> bytes | None:
        stripped = fs._strip_protocol(path)
        return fs.cat_file(stripped) if fs.isfile(stripped) else None

    def put(path: str, data: bytes) -> None:
        fs.pipe_file(fs._strip_protocol(path), data)

    def leftovers() -> list:
        spools = [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("datastates-spool-")]
        return sorted(p for p in fs.find(root) if p.endswith(TEMP_SUFFIX)) + spools

    return Harness(GenericWriter("memory"), lambda name: f"memory://{root}/{name}", read, put, leftovers)


def _s3_harness(tmp_path: Path) -> Harness:
    """A real S3 API (moto's server on loopback) through the S3 multipart writer; skipped without s3fs/moto."""
    from tests.s3_server import fresh_bucket, shared_server

    env = fresh_bucket(shared_server())
    from lightning_datastates.storage.s3 import S3Writer

    writer = S3Writer(env.storage_options, retries=1, timeout_s=10)
    root = f"{tmp_path.name}/ckpts"
    return Harness(
        writer,
        lambda name: env.url(f"{root}/{name}"),
        lambda path: env.read(env.key_of(path)),
        lambda path, data: env.put(env.key_of(path), data),
        env.open_uploads,
    )


HARNESSES = {
    "local": _local_harness,
    "local-direct": _local_direct_harness,
    "memory": _memory_harness,
    "s3": _s3_harness,
}


@pytest.fixture(params=list(HARNESSES))
def harness(request, tmp_path) -> Harness:
    h = HARNESSES[request.param](tmp_path)
    yield h
    assert h.leftovers() == [], "a test left temporary objects behind"


def _ranges(total: int, rng: random.Random) -> list[tuple[int, int]]:
    """Cut [0, total) into contiguous ranges of random sizes."""
    cuts, position = [], 0
    while position < total:
        size = min(total - position, rng.choice([1, 7, 64, 1000, 4096, 65536, rng.randint(1, 200_000)]))
        cuts.append((position, size))
        position += size
    return cuts


def _write_in_threads(session, data: bytes, rng: random.Random, threads: int = 4) -> None:
    ranges = _ranges(len(data), rng)
    rng.shuffle(ranges)
    view = memoryview(data)
    errors: list[BaseException] = []

    def work(mine: list[tuple[int, int]]) -> None:
        try:
            for offset, size in mine:
                session.write_range(offset, view[offset : offset + size])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(ranges[i::threads],)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(JOIN_S)
    assert not any(w.is_alive() for w in workers)
    assert errors == []


# ---------------------------------------------------------------------------------------------------- the contract
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parallel_out_of_order_ranges_then_complete(harness: Harness, seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(rng.choice([1, 4096, 1_000_003, 3 * 1024**2]))
    path = harness.path("epoch=0-step=10.ckpt")
    session = harness.writer.begin(path, len(data))
    assert session.path == path
    _write_in_threads(session, data, rng)
    assert harness.read(path) is None and not harness.writer.exists(path), "visible before complete"
    session.complete()
    assert harness.read(path) == data
    assert harness.writer.exists(path)
    assert harness.leftovers() == [], "complete left the temporary object behind"


def test_ranges_may_come_from_slices_of_a_larger_buffer(harness: Harness) -> None:
    arena = bytearray(range(256)) * 64
    path = harness.path("slices.ckpt")
    session = harness.writer.begin(path, 300)
    session.write_range(100, memoryview(arena)[1000:1200])  # a slice not starting at the buffer's start
    session.write_range(0, memoryview(arena)[5:105])
    session.complete()
    assert harness.read(path) == bytes(arena[5:105]) + bytes(arena[1000:1200])


def test_final_path_appears_only_at_complete(harness: Harness) -> None:
    path = harness.path("new.ckpt")
    session = harness.writer.begin(path, 10)
    assert not harness.writer.exists(path)
    session.write_range(0, memoryview(b"0123456789"))
    assert not harness.writer.exists(path)
    session.complete()
    assert harness.read(path) == b"0123456789"


def test_overwrite_keeps_old_content_until_complete(harness: Harness) -> None:
    path = harness.path("last.ckpt")
    harness.put(path, b"old checkpoint")
    session = harness.writer.begin(path, 20)
    session.write_range(0, memoryview(b"N" * 20))
    assert harness.read(path) == b"old checkpoint"
    session.complete()
    assert harness.read(path) == b"N" * 20


def test_overwrite_with_a_shorter_file_leaves_no_old_tail(harness: Harness) -> None:
    path = harness.path("last.ckpt")
    harness.put(path, b"x" * 5000)
    session = harness.writer.begin(path, 3)
    session.write_range(0, memoryview(b"abc"))
    session.complete()
    assert harness.read(path) == b"abc"


def test_abort_leaves_the_old_file_intact(harness: Harness) -> None:
    path = harness.path("last.ckpt")
    harness.put(path, b"precious")
    session = harness.writer.begin(path, 1 << 16)
    session.write_range(0, memoryview(os.urandom(1 << 16)))
    session.abort()
    assert harness.read(path) == b"precious"
    assert harness.leftovers() == [], "abort left the temporary object behind"
    session.abort()  # safe to call more than once
    assert harness.read(path) == b"precious"


def test_abort_of_a_new_path_publishes_nothing(harness: Harness) -> None:
    path = harness.path("never.ckpt")
    session = harness.writer.begin(path, 8)
    session.write_range(0, memoryview(b"12345678"))
    session.abort()
    assert not harness.writer.exists(path)
    assert harness.read(path) is None


def test_abort_before_any_write(harness: Harness) -> None:
    session = harness.writer.begin(harness.path("empty.ckpt"), 100)
    session.abort()
    assert not harness.writer.exists(harness.path("empty.ckpt"))


def test_concurrent_sessions_for_one_path_publish_the_last_completed(harness: Harness) -> None:
    path = harness.path("same.ckpt")
    first = harness.writer.begin(path, 5)
    second = harness.writer.begin(path, 6)
    second.write_range(0, memoryview(b"second"))
    first.write_range(0, memoryview(b"first"))
    first.complete()
    assert harness.read(path) == b"first"
    second.complete()
    assert harness.read(path) == b"second"


def test_aborting_one_session_does_not_disturb_another(harness: Harness) -> None:
    path = harness.path("same.ckpt")
    kept = harness.writer.begin(path, 4)
    dropped = harness.writer.begin(path, 4)
    kept.write_range(0, memoryview(b"keep"))
    dropped.write_range(0, memoryview(b"drop"))
    dropped.abort()
    kept.complete()
    assert harness.read(path) == b"keep"


def test_many_paths_in_parallel(harness: Harness) -> None:
    rng = random.Random(5)
    payloads = {harness.path(f"epoch={i}.ckpt"): rng.randbytes(rng.randint(1, 300_000)) for i in range(6)}
    sessions = {path: harness.writer.begin(path, len(data)) for path, data in payloads.items()}
    for path, data in payloads.items():
        _write_in_threads(sessions[path], data, rng, threads=3)
    for session in sessions.values():
        session.complete()
    for path, data in payloads.items():
        assert harness.read(path) == data


def test_remove_deletes_and_ignores_missing(harness: Harness) -> None:
    path = harness.path("gone.ckpt")
    session = harness.writer.begin(path, 3)
    session.write_range(0, memoryview(b"abc"))
    session.complete()
    harness.writer.remove(path)
    assert not harness.writer.exists(path) and harness.read(path) is None
    harness.writer.remove(path)  # already gone: not an error
    harness.writer.remove(harness.path("never-existed.ckpt"))


def test_remove_files_deletes_the_named_files_of_a_directory_only(harness: Harness) -> None:
    """What a sharded commit removes: some files of one directory; a missing name is not an error."""
    directory = harness.path("sharded.ckpt")
    if "://" not in directory:
        os.makedirs(directory)  # object stores have no directories to make
    for name in ("a", "b", "kept"):
        harness.put(f"{directory}/{name}", name.encode())
    harness.put(harness.path("a"), b"outside")  # the same name beside the directory
    harness.writer.remove_files(directory, ["a", "b", "never-existed"])
    assert [harness.read(f"{directory}/{name}") for name in ("a", "b", "kept")] == [None, None, b"kept"]
    assert harness.read(harness.path("a")) == b"outside"
    harness.writer.remove_files(directory, [])
    harness.writer.remove_files(directory, ["a"])  # already gone
    assert not harness.writer.exists(f"{directory}/a") and harness.writer.exists(f"{directory}/kept")


def test_create_marker_makes_an_empty_file_visible_at_once_and_leaves_nothing_else(harness: Harness) -> None:
    """A sharded save's in-flight marker: an empty file, in a directory that may not exist yet (local)."""
    marker = harness.path("sharded.ckpt/.commit.host.1.token.datastates-pending")
    harness.writer.create_marker(marker)
    assert harness.read(marker) == b"" and harness.writer.exists(marker)
    harness.writer.create_marker(marker)  # again: still one empty file
    assert [e.name for e in harness.writer.list_directory(harness.path("sharded.ckpt"))] == [os.path.basename(marker)]
    harness.writer.remove_files(harness.path("sharded.ckpt"), [os.path.basename(marker)])  # as the commit does
    assert harness.read(marker) is None


def test_clean_stale_on_a_clean_directory_removes_nothing(harness: Harness) -> None:
    path = harness.path("kept.ckpt")
    harness.put(path, b"data")
    assert harness.writer.clean_stale(os.path.dirname(path)) == []
    assert harness.read(path) == b"data"


def test_list_directory_shows_files_and_subdirectories_with_their_times(harness: Harness) -> None:
    """What the cleanup of dead sharded saves lists: names directly in a directory, subdirectories marked."""
    directory = os.path.dirname(harness.path("x.ckpt"))
    harness.put(harness.path("a.ckpt"), b"a")
    if "://" not in directory:
        os.makedirs(harness.path("sharded.ckpt"))  # object stores have no directories to make
    harness.put(harness.path("sharded.ckpt/__0_t.distcp"), b"shard")
    harness.put(harness.path("sharded.ckpt/meta.pt"), b"")
    entries = {e.name: e for e in harness.writer.list_directory(directory)}
    assert set(entries) == {"a.ckpt", "sharded.ckpt"}
    assert not entries["a.ckpt"].is_directory and entries["sharded.ckpt"].is_directory
    assert entries["a.ckpt"].modified_s is not None and abs(entries["a.ckpt"].modified_s - time.time()) < 600
    inside = sorted(e.name for e in harness.writer.list_directory(harness.path("sharded.ckpt")))
    assert inside == ["__0_t.distcp", "meta.pt"]
    assert harness.writer.list_directory(harness.path("missing")) == []


# ---------------------------------------------------------------------------------------------------- the read side
def test_every_read_operation_returns_the_committed_bytes_and_a_missing_file_raises(harness: Harness) -> None:
    data = random.Random(7).randbytes(300_000)
    path = harness.path("read.ckpt")
    harness.put(path, data)
    assert bytes(harness.writer.read_bytes(path)) == data
    with harness.writer.open_read(path) as stream:
        assert stream.read() == data
    local = harness.writer.open_local(path, read_ahead=True)  # None: this backend has no local file to offer
    if local is not None:
        with local:
            assert os.fstat(local.fileno()).st_size == len(data) and local.read() == data
    missing = harness.path("missing.ckpt")
    with pytest.raises(FileNotFoundError):
        harness.writer.read_bytes(missing)
    if local is not None:
        with pytest.raises(FileNotFoundError):
            harness.writer.open_local(missing)


def test_one_writer_serves_many_threads_saving_loading_and_removing(harness: Harness) -> None:
    """The plugin keeps one writer per protocol: it must take sessions, reads, checks and removals from several
    threads at once, for many paths."""
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        rng = random.Random(worker)
        try:
            for round_ in range(3):
                path = harness.path(f"w{worker}-r{round_}.ckpt")
                data = rng.randbytes(rng.randint(1, 100_000))
                session = harness.writer.begin(path, len(data))
                session.write_range(0, memoryview(data))
                session.complete()
                assert harness.writer.exists(path) and bytes(harness.writer.read_bytes(path)) == data
                harness.writer.remove(path)
                assert not harness.writer.exists(path)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(JOIN_S)
    assert not any(w.is_alive() for w in workers)
    assert errors == []


def test_remove_files_by_default_tries_every_file_then_raises_the_first_error(tmp_path: Path) -> None:
    """The default of backends without a batch removal: one refusal does not leave the other files behind."""

    class Refusing(LocalWriter):
        def remove(self, path: str) -> None:
            if path.endswith("/b"):
                raise PermissionError(13, "refused (injected)", path)
            super().remove(path)

    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(b"x")
    with pytest.raises(PermissionError, match="refused"):
        Refusing().remove_files(str(tmp_path), ["a", "b", "c"])
    assert sorted(os.listdir(tmp_path)) == ["b"]
