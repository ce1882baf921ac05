"""Storage writers: one contract suite for every ``StorageWriter``, then what is specific to ``LocalWriter``.

To add a backend, add a harness factory to ``HARNESSES``: it builds the writer and says how to read a committed
object, how to plant an existing one, and how to list what an unfinished write leaves behind.
"""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import lightning_datastates
from lightning_datastates.storage import LocalWriter, StorageWriter, writer_for
from lightning_datastates.storage.local import FOREIGN_TEMP_AGE_S, TEMP_SUFFIX, _host_tag

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


def test_clean_stale_on_a_clean_directory_removes_nothing(harness: Harness) -> None:
    path = harness.path("kept.ckpt")
    harness.put(path, b"data")
    assert harness.writer.clean_stale(os.path.dirname(path)) == []
    assert harness.read(path) == b"data"


# ---------------------------------------------------------------------------------------------------- LocalWriter
@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpts"
    directory.mkdir()
    return directory


def _temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.name.endswith(TEMP_SUFFIX))


def test_local_temp_file_lives_beside_the_final_name(ckpt_dir: Path) -> None:
    path = ckpt_dir / "epoch=1.ckpt"
    session = LocalWriter().begin(str(path), 4)
    temp = Path(session.temp_path)
    assert temp.parent == ckpt_dir  # same directory: same file system, atomic rename
    assert temp.name.startswith(".epoch=1.ckpt.") and temp.name.endswith(TEMP_SUFFIX)
    assert f".{_host_tag()}.{os.getpid()}." in temp.name
    assert not temp.name.endswith(".ckpt")  # never picked up by *.ckpt globs
    assert temp.exists()
    session.write_range(0, memoryview(b"abcd"))
    session.complete()
    assert not temp.exists()
    assert _temp_files(ckpt_dir) == []


def test_local_begin_creates_missing_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "c" / "x.ckpt"
    session = LocalWriter().begin(str(path), 1)
    session.write_range(0, memoryview(b"z"))
    session.complete()
    assert path.read_bytes() == b"z"


def test_local_accepts_file_urls_and_relative_paths(tmp_path: Path, monkeypatch) -> None:
    writer = writer_for(f"file://{tmp_path}/u.ckpt")
    assert isinstance(writer, LocalWriter)
    session = writer.begin(f"file://{tmp_path}/u.ckpt", 2)
    session.write_range(0, memoryview(b"ok"))
    session.complete()
    assert (tmp_path / "u.ckpt").read_bytes() == b"ok"
    assert writer.exists(f"file://{tmp_path}/u.ckpt")
    monkeypatch.chdir(tmp_path)
    session = writer.begin("rel.ckpt", 3)
    session.write_range(0, memoryview(b"rel"))
    session.complete()
    assert (tmp_path / "rel.ckpt").read_bytes() == b"rel"
    writer.remove(f"file://{tmp_path}/u.ckpt")
    assert not (tmp_path / "u.ckpt").exists()


def test_local_committed_file_permissions_follow_the_umask(ckpt_dir: Path) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    path = ckpt_dir / "perm.ckpt"
    session = LocalWriter().begin(str(path), 1)
    session.write_range(0, memoryview(b"p"))
    session.complete()
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_local_begin_on_a_directory_raises(ckpt_dir: Path) -> None:
    (ckpt_dir / "dir.ckpt").mkdir()
    with pytest.raises(IsADirectoryError):
        LocalWriter().begin(str(ckpt_dir / "dir.ckpt"), 10)
    assert _temp_files(ckpt_dir) == []


def test_local_begin_under_a_regular_file_raises(ckpt_dir: Path) -> None:
    (ckpt_dir / "file").write_bytes(b"x")
    with pytest.raises((NotADirectoryError, FileExistsError)):
        LocalWriter().begin(str(ckpt_dir / "file" / "x.ckpt"), 10)
    with pytest.raises((NotADirectoryError, FileExistsError)):
        LocalWriter().begin(str(ckpt_dir / "file" / "sub" / "x.ckpt"), 10)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_local_begin_in_a_read_only_directory_raises_permission_error(ckpt_dir: Path) -> None:
    ckpt_dir.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            LocalWriter().begin(str(ckpt_dir / "x.ckpt"), 10)
    finally:
        ckpt_dir.chmod(0o755)


def test_local_session_cannot_be_used_after_it_ended(ckpt_dir: Path) -> None:
    writer = LocalWriter()
    done = writer.begin(str(ckpt_dir / "a.ckpt"), 1)
    done.write_range(0, memoryview(b"a"))
    done.complete()
    with pytest.raises(RuntimeError):
        done.write_range(0, memoryview(b"b"))
    with pytest.raises(RuntimeError):
        done.complete()
    done.abort()  # after a commit: must not remove the committed file
    assert (ckpt_dir / "a.ckpt").read_bytes() == b"a"

    aborted = writer.begin(str(ckpt_dir / "b.ckpt"), 1)
    aborted.abort()
    with pytest.raises(RuntimeError):
        aborted.write_range(0, memoryview(b"b"))
    with pytest.raises(RuntimeError):
        aborted.complete()
    assert not (ckpt_dir / "b.ckpt").exists()
    assert _temp_files(ckpt_dir) == []


def test_local_abort_after_failed_complete_removes_the_temp_file(ckpt_dir: Path) -> None:
    # complete fails at the rename (the final name became a non-empty directory meanwhile)
    path = ckpt_dir / "c.ckpt"
    session = LocalWriter().begin(str(path), 1)
    session.write_range(0, memoryview(b"c"))
    path.mkdir()
    (path / "inside").write_bytes(b"i")
    with pytest.raises(OSError):
        session.complete()
    session.abort()
    assert _temp_files(ckpt_dir) == []
    assert (path / "inside").read_bytes() == b"i"


def test_local_long_but_valid_file_name(ckpt_dir: Path) -> None:
    name_max = os.pathconf(ckpt_dir, "PC_NAME_MAX")
    name = "m" * (name_max - 30) + ".ckpt"
    (ckpt_dir / name).write_bytes(b"")  # the final name itself is valid here
    (ckpt_dir / name).unlink()
    session = LocalWriter().begin(str(ckpt_dir / name), 1)
    session.write_range(0, memoryview(b"L"))
    session.complete()
    assert (ckpt_dir / name).read_bytes() == b"L"


# ---------------------------------------------------------------------------------------------------- clean_stale
def _temp_name(final: str, pid: int, host: str | None = None, token: str = "0123abcd") -> str:
    return f".{final}.{host or _host_tag()}.{pid}.{token}{TEMP_SUFFIX}"


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait(JOIN_S)
    return child.pid


@pytest.fixture
def live_child():
    child = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    yield child
    child.stdin.close()
    child.wait(JOIN_S)


def test_clean_stale_removes_temps_of_dead_processes_only(ckpt_dir: Path, live_child) -> None:
    dead = ckpt_dir / _temp_name("epoch=1.ckpt", _dead_pid())
    live = ckpt_dir / _temp_name("epoch=2.ckpt", live_child.pid)
    parent = ckpt_dir / _temp_name("epoch=3.ckpt", os.getppid())
    mine = ckpt_dir / _temp_name("epoch=4.ckpt", os.getpid())
    unrelated = [
        ckpt_dir / "epoch=0.ckpt",
        ckpt_dir / ".hidden",
        ckpt_dir / f"plain{TEMP_SUFFIX}",  # suffix, but not our naming scheme
        ckpt_dir / f".x.{_host_tag()}.notapid.0123abcd{TEMP_SUFFIX}",
        ckpt_dir / f".x.{_host_tag()}.1.ZZZZZZZZ{TEMP_SUFFIX}",
    ]
    for file in [dead, live, parent, mine, *unrelated]:
        file.write_bytes(b"partial")

    removed = LocalWriter().clean_stale(str(ckpt_dir))

    assert removed == [str(dead)]
    assert not dead.exists()
    for file in [live, parent, mine, *unrelated]:
        assert file.exists(), file.name


def test_clean_stale_removes_old_temps_of_other_hosts_only(ckpt_dir: Path) -> None:
    old = ckpt_dir / _temp_name("a.ckpt", 12345, host="other-node-7")
    recent = ckpt_dir / _temp_name("b.ckpt", 12346, host="other-node-7")
    for file in (old, recent):
        file.write_bytes(b"partial")
    long_ago = time.time() - FOREIGN_TEMP_AGE_S - 60
    os.utime(old, (long_ago, long_ago))
    removed = LocalWriter().clean_stale(str(ckpt_dir))
    assert removed == [str(old)]
    assert recent.exists()


def test_clean_stale_keeps_an_in_flight_session_of_this_process(ckpt_dir: Path) -> None:
    writer = LocalWriter()
    session = writer.begin(str(ckpt_dir / "inflight.ckpt"), 2)
    assert writer.clean_stale(str(ckpt_dir)) == []
    session.write_range(0, memoryview(b"ok"))
    session.complete()
    assert (ckpt_dir / "inflight.ckpt").read_bytes() == b"ok"


def test_clean_stale_accepts_missing_directories_and_file_urls(tmp_path: Path) -> None:
    writer = LocalWriter()
    assert writer.clean_stale(str(tmp_path / "missing")) == []
    (tmp_path / "file").write_bytes(b"")
    assert writer.clean_stale(str(tmp_path / "file")) == []
    dead = tmp_path / _temp_name("u.ckpt", _dead_pid())
    dead.write_bytes(b"")
    assert writer.clean_stale(f"file://{tmp_path}") == [str(dead)]


# ---------------------------------------------------------------------------------------------------- remove
def test_local_remove_files_trees_and_missing(tmp_path: Path) -> None:
    writer = LocalWriter()
    file = tmp_path / "f.ckpt"
    file.write_bytes(b"x")
    writer.remove(str(file))
    assert not file.exists()

    tree = tmp_path / "sharded.ckpt"  # sharded strategies write a directory
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "shard_0").write_bytes(b"0")
    (tree / ".metadata").write_bytes(b"m")
    writer.remove(str(tree))
    assert not tree.exists()

    writer.remove(str(tmp_path / "missing.ckpt"))
    writer.remove(str(tmp_path / "missing" / "deeper.ckpt"))
    assert tmp_path.exists()


def test_local_remove_of_a_symlink_keeps_its_target(tmp_path: Path) -> None:
    writer = LocalWriter()
    target_dir = tmp_path / "real"
    target_dir.mkdir()
    (target_dir / "keep").write_bytes(b"k")
    link_dir = tmp_path / "last-dir.ckpt"
    link_dir.symlink_to(target_dir, target_is_directory=True)
    target_file = tmp_path / "epoch=3.ckpt"
    target_file.write_bytes(b"3")
    link_file = tmp_path / "last.ckpt"  # save_last="link"
    link_file.symlink_to(target_file)

    writer.remove(str(link_dir))
    writer.remove(str(link_file))
    assert not link_dir.is_symlink() and not link_file.is_symlink()
    assert (target_dir / "keep").read_bytes() == b"k"
    assert target_file.read_bytes() == b"3"


# ---------------------------------------------------------------------------------------------------- RLIMIT_FSIZE
_FSIZE_SCRIPT = textwrap.dedent(
    """
    import errno, json, os, resource, sys, types

    # Import only the storage subpackage: the package __init__ pulls in lightning and torch (seconds).
    package = types.ModuleType("lightning_datastates")
    package.__path__ = [sys.argv[2]]
    sys.modules["lightning_datastates"] = package
    from lightning_datastates.storage.local import LocalWriter

    directory = sys.argv[1]
    writer = LocalWriter()
    committed = os.path.join(directory, "good.ckpt")
    session = writer.begin(committed, 1000)
    session.write_range(0, memoryview(b"g" * 1000))
    session.complete()

    limit = 64 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    results = {}
    for case, (offset, size) in {"past": (100_000, 4096), "straddling": (limit - 1000, 8192)}.items():
        target = committed if case == "past" else os.path.join(directory, "new.ckpt")
        session = writer.begin(target, offset + size)
        session.write_range(0, memoryview(b"x" * 4096))  # inside the limit: fine
        try:
            session.write_range(offset, memoryview(b"y" * size))
        except OSError as exc:
            results[case] = exc.errno
            session.abort()
        else:
            results[case] = None
            session.abort()
    print(json.dumps(results))
    """
)


def test_local_write_past_rlimit_fsize_raises_efbig_and_abort_cleans_up(ckpt_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _FSIZE_SCRIPT, str(ckpt_dir), os.path.dirname(lightning_datastates.__file__)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr  # SIGXFSZ is ignored by Python: an error, not a kill
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert results == {"past": errno.EFBIG, "straddling": errno.EFBIG}
    assert (ckpt_dir / "good.ckpt").read_bytes() == b"g" * 1000  # the earlier checkpoint is intact
    assert not (ckpt_dir / "new.ckpt").exists()
    assert _temp_files(ckpt_dir) == []
