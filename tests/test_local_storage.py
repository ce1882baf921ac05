"""What is specific to ``LocalWriter``: temporary files beside the final name, POSIX errors, ``clean_stale`` by
process and host, removal of trees and links, the file-size limit. The contract every writer passes is in
tests/test_storage_contract.py.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import lightning_datastates
from lightning_datastates.config import DEFAULT_STALE_AGE_S
from lightning_datastates.records.leftovers import TEMP_SUFFIX, host_tag
from lightning_datastates.storage import LocalWriter, writer_for
from tests.conftest import dead_pid
from tests.test_storage_contract import JOIN_S


# ---------------------------------------------------------------------------------------------------- LocalWriter
@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpts"
    directory.mkdir()
    return directory


def _temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.name.endswith(TEMP_SUFFIX))


def test_local_temp_file_lives_beside_the_final_name(ckpt_dir: Path, refused_unnamed: list[str]) -> None:
    # A named temporary file (a file system without O_TMPFILE); an unnamed one gets this name at the commit.
    path = ckpt_dir / "epoch=1.ckpt"
    session = LocalWriter().begin(str(path), 4)
    temp = Path(session.temp_path)
    assert temp.parent == ckpt_dir  # same directory: same file system, atomic rename
    assert temp.name.startswith(".epoch=1.ckpt.") and temp.name.endswith(TEMP_SUFFIX)
    assert f".{host_tag()}.{os.getpid()}." in temp.name
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


def test_a_committed_file_is_dated_by_its_save_not_by_its_last_write(ckpt_dir: Path) -> None:
    """Two saves whose writes overlap and end in the opposite order: each file's modification time is when its save
    began, so anything that goes by modification time (Lightning's "last", the newest whole checkpoint after a
    crash) sees the saves' order."""
    writer = LocalWriter()
    before = time.time_ns()
    first = writer.begin(str(ckpt_dir / "epoch=0-step=1.ckpt"), 4)
    time.sleep(0.05)
    second = writer.begin(str(ckpt_dir / "epoch=0-step=2.ckpt"), 4)
    second.write_range(0, memoryview(b"bbbb"))
    second.complete()
    time.sleep(0.05)
    first.write_range(0, memoryview(b"aaaa"))  # the first save's last write ends after the second's commit
    first.complete()
    first_ns = os.stat(ckpt_dir / "epoch=0-step=1.ckpt").st_mtime_ns
    second_ns = os.stat(ckpt_dir / "epoch=0-step=2.ckpt").st_mtime_ns
    assert before <= first_ns < second_ns
    assert second_ns - first_ns >= 40_000_000  # the time between the two begins, not between the two commits


def test_a_file_that_cannot_be_dated_is_committed_all_the_same(ckpt_dir: Path, monkeypatch) -> None:
    """Only a file's owner may set its time (a mount that gives new files a fixed owner refuses it): the commit goes
    on, the file dated by its last write."""
    import lightning_datastates.storage.local as local_module

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(local_module.os, "utime", refused)
    session = LocalWriter().begin(str(ckpt_dir / "a.ckpt"), 4)
    session.write_range(0, memoryview(b"aaaa"))
    session.complete()
    assert (ckpt_dir / "a.ckpt").read_bytes() == b"aaaa"


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
    return f".{final}.{host or host_tag()}.{pid}.{token}{TEMP_SUFFIX}"


@pytest.fixture
def live_child():
    child = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    yield child
    child.stdin.close()
    child.wait(JOIN_S)


def test_clean_stale_removes_temps_of_dead_processes_only(ckpt_dir: Path, live_child) -> None:
    dead = ckpt_dir / _temp_name("epoch=1.ckpt", dead_pid())
    live = ckpt_dir / _temp_name("epoch=2.ckpt", live_child.pid)
    parent = ckpt_dir / _temp_name("epoch=3.ckpt", os.getppid())
    mine = ckpt_dir / _temp_name("epoch=4.ckpt", os.getpid())
    unrelated = [
        ckpt_dir / "epoch=0.ckpt",
        ckpt_dir / ".hidden",
        ckpt_dir / f"plain{TEMP_SUFFIX}",  # suffix, but not our naming scheme
        ckpt_dir / f".x.{host_tag()}.notapid.0123abcd{TEMP_SUFFIX}",
        ckpt_dir / f".x.{host_tag()}.1.ZZZZZZZZ{TEMP_SUFFIX}",
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
    long_ago = time.time() - DEFAULT_STALE_AGE_S - 60
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
    dead = tmp_path / _temp_name("u.ckpt", dead_pid())
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


def test_a_marker_is_made_without_fsync_and_the_next_commit_in_its_directory_syncs_the_directory(tmp_path, monkeypatch):
    """The in-flight marker is created on the training thread: no fsync there (tens of milliseconds while an earlier
    checkpoint's writes keep the disk busy). The next file committed in the directory fsyncs the directory, which
    makes the marker's entry durable before that file's."""
    synced: list[str] = []
    fsync = os.fsync

    def recorded(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    writer = LocalWriter()
    directory = tmp_path / "sharded.ckpt"
    writer.create_marker(str(directory / ".commit.host.1.token.datastates-pending"))
    assert synced == [] and (directory / ".commit.host.1.token.datastates-pending").read_bytes() == b""
    session = writer.begin(str(directory / "__0_token.distcp"), 3)
    session.write_range(0, memoryview(b"abc"))
    session.complete()
    assert synced[-1] == str(directory)
