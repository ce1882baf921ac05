"""POSIX writer for local disks and parallel file systems (Lustre, GPFS, NFS).

Commit protocol: write a temporary file in the *same directory* (same file system, so the rename is atomic
and, on Lustre, the file inherits the directory's striping), ``fsync`` it, ``os.replace`` it onto the final
name, ``fsync`` the directory so the rename itself survives a power loss. Ranges are written with
``os.pwrite`` from several threads at once.

The temporary file has no name while it is written, where the file system allows (Linux ``O_TMPFILE``: ext4, XFS,
btrfs, tmpfs, Lustre >= 2.10, ...): a listing of the directory shows committed checkpoints only, as after a
synchronous ``torch.save``, and a crash leaves nothing (an unnamed inode is freed). ``complete`` gives it its
temporary name (``linkat`` through ``/proc/self/fd``, after the file's ``fsync``) just before the rename, so that a
re-save of ``last.ckpt`` still replaces the old file atomically. Where ``O_TMPFILE`` is refused (NFS, FUSE, older
kernels, no ``/proc``; decided once per directory, quietly) the temporary file is created under its name at
``begin``, as before.

Direct I/O (``LocalWriter(direct_io="auto" or True)``, as ``DataStatesIO(direct_io=...)`` sets it): whole aligned
blocks of every range go through a second, ``O_DIRECT`` descriptor of the temporary file (of an unnamed one,
opened again through ``/proc/self/fd``); see :mod:`~lightning_datastates.storage.direct_io`. The commit is the same
either way.

Temporary names are ``.<name>.<host>.<pid>.<token>.datastates-tmp``: hidden, never matching ``*.ckpt``, and telling
:meth:`LocalWriter.clean_stale` which process left them (see :mod:`~lightning_datastates.records.leftovers`). A
named temporary file is left only by a crash of a write that fell back to a name, between the link and the rename of
a commit, or by an older version of this package.

Loads map the committed file itself (:meth:`LocalWriter.open_local`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Hashable
from typing import Any, BinaryIO

from lightning_datastates.alignment import PAGE_ALIGNMENT_BYTES, align_up
from lightning_datastates.config import DEFAULT_STALE_AGE_S, DirectIO
from lightning_datastates.records.leftovers import (
    TEMP_SUFFIX,
    leftover_name,
    parse_leftover_name,
    writer_gone,
)
from lightning_datastates.records.session import WriteSession
from lightning_datastates.storage.base import DirectoryEntry, StorageWriter
from lightning_datastates.storage.direct_io import direct_io_suits, no_direct_io, open_direct, write_all, write_direct
from lightning_datastates.storage.unnamed import (
    link_unnamed,
    open_unnamed,
    out_of_space_named,
    unwritable_directory_named,
)

log = logging.getLogger("lightning_datastates")

#: Longest file name most POSIX file systems accept.
MAX_NAME_BYTES = 255


def is_local_path(path: str) -> bool:
    """Whether ``path`` names a local file (a plain path or a ``file://`` URL)."""
    return "://" not in path or path.startswith("file://")


def local_path(path: str) -> str:
    """``path`` without a ``file://`` prefix."""
    return path[len("file://") :] if path.startswith("file://") else path


class PositionalFileSession(WriteSession):
    """A session whose ranges go into an open local file with ``os.pwrite`` (thread-safe, any order).

    Subclasses publish the file in ``complete`` and discard it in ``abort``; :meth:`_take_fd` hands the
    descriptor over exactly once, so a range written after the session ended fails loudly.
    """

    def __init__(self, path: str, fd: int, direct_fd: int | None = None, warn_refused: bool = True) -> None:
        self.path = path
        self._fd: int | None = fd
        self._direct_fd = direct_fd
        self._warn_refused = warn_refused  # a refused O_DIRECT write warns (True), or is only logged at debug level
        self._retired_fds: list[int] = []
        self._lock = threading.Lock()

    @property
    def direct_io(self) -> bool:
        """Whether whole aligned blocks are (still) written with ``O_DIRECT``."""
        return self._direct_fd is not None

    @property
    def fast_writes(self) -> bool:  # type: ignore[override]
        """Buffered writes land in the page cache at memory speed; direct ones wait for the device."""
        return self._direct_fd is None

    @property
    def direct_alignment(self) -> int | None:  # type: ignore[override]
        """``PAGE_ALIGNMENT_BYTES`` while whole aligned blocks go through ``O_DIRECT``; else None."""
        return None if self._direct_fd is None else PAGE_ALIGNMENT_BYTES

    def write_range(self, offset: int, data: memoryview) -> None:
        """``pwrite`` all of ``data`` at ``offset`` (retrying short writes); with direct I/O, its whole aligned
        blocks through the ``O_DIRECT`` descriptor.

        Raises:
            OSError: as ``os.pwrite``; a full disk, an exceeded quota or file-size limit say so and name the path.
        """
        fd = self._fd
        if fd is None:
            raise RuntimeError(f"write to {self.path} after its session ended")
        view = memoryview(data).cast("B")
        start = align_up(offset)
        stop = (offset + view.nbytes) // PAGE_ALIGNMENT_BYTES * PAGE_ALIGNMENT_BYTES
        direct_fd = self._direct_fd
        with out_of_space_named(self.path):
            if direct_fd is None or stop <= start:
                write_all(fd, view, offset)
                return
            if start > offset:
                write_all(fd, view[: start - offset], offset)
            try:
                write_direct(direct_fd, view[start - offset : stop - offset], start)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                no_direct_io(os.path.dirname(self.path) or ".", exc, self._warn_refused)
                with self._lock:  # several writers may be refused at once: the descriptor is retired exactly once
                    if self._direct_fd == direct_fd:
                        self._direct_fd = None  # other threads may still use the descriptor: closed with the session
                        self._retired_fds.append(direct_fd)
                write_all(fd, view[start - offset : stop - offset], start)
            if stop < offset + view.nbytes:
                write_all(fd, view[stop - offset :], stop)

    def _take_fd(self) -> int | None:
        """The open descriptor, or None if already taken (call with ``_lock`` held); closes the direct one."""
        fd, self._fd = self._fd, None
        direct_fd, self._direct_fd = self._direct_fd, None
        for extra in [direct_fd, *self._retired_fds]:
            if extra is not None:
                os.close(extra)
        self._retired_fds.clear()
        return fd


class LocalWriteSession(PositionalFileSession):
    """A checkpoint being written to a temporary file beside its final name.

    ``temp_path`` is the temporary file's name: where it is (a named file), or, for an unnamed file (``O_TMPFILE``,
    told by its link count of zero), the name :meth:`complete` links it under just before the rename.
    """

    def __init__(
        self, path: str, temp_path: str, fd: int, direct_fd: int | None = None, warn_refused: bool = True
    ) -> None:
        super().__init__(path, fd, direct_fd, warn_refused)
        self.temp_path = temp_path
        self._dated_ns = time.time_ns()  # at the save call (begin runs on the training thread, at capture)
        # One fstat per session: the descriptor itself says whether it still needs a name (no flag to pass along).
        self.unnamed = os.fstat(fd).st_nlink == 0

    def date(self, modified_ns: int) -> None:
        """The file is dated ``modified_ns`` (ns since the epoch) at :meth:`complete`, not when this session began."""
        self._dated_ns = modified_ns

    def _set_date(self, fd: int) -> None:
        """Date the file by its save, not by its last write: the writes of overlapping saves end in any order, and
        what goes by modification time (Lightning's "last" among several, the newest whole checkpoint after a
        crash, the local tier's retention) must see the saves' order, as with synchronous saves. Best effort: only
        the file's owner may set a time (a mount that gives new files a fixed owner refuses it), and a checkpoint
        dated by its last write is still whole."""
        try:
            os.utime(fd, ns=(self._dated_ns, self._dated_ns))
        except OSError as exc:
            log.debug("lightning_datastates: cannot date %s by its save (%s)", self.path, exc)

    def complete(self) -> None:
        """fsync the file, date it by its save (:meth:`date`), give an unnamed file its temporary name, rename it
        onto the final name, fsync the directory.

        Raises:
            OSError: the fsync (a full disk says so and names the path), the link or the rename failed; nothing is
                published then (:meth:`abort` removes what is left).
        """
        with self._lock:
            fd = self._take_fd()
            if fd is None:
                raise RuntimeError(f"{self.path}: session already ended")
            try:
                # The bytes are durable before the name points at them. With delayed allocation (NFS, XFS, ...) a
                # full disk is reported only here.
                with out_of_space_named(self.path):
                    os.fsync(fd)
                # After the fsync: until then the writes keep a named temporary file young for clean_stale.
                self._set_date(fd)
                if self.unnamed:
                    link_unnamed(fd, self.temp_path, self.path)  # needs the descriptor open: before the close
                    self.unnamed = False  # named now: an abort after a failed rename removes the name
            finally:
                os.close(fd)
            os.replace(self.temp_path, self.path)  # atomic: readers see the old file or the new one, whole
            try:
                _fsync_directory(os.path.dirname(self.path) or ".")  # make the link and the rename durable
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"{self.path} was published, but fsync of its directory failed ({exc.strerror}): "
                    "the rename may not survive a power loss",
                ) from exc

    def abort(self) -> None:
        """Close the temporary file (an unnamed one vanishes with its descriptor) and delete its name, if it has one
        (a named file, or an unnamed one whose commit failed after the link); the final name is untouched."""
        with self._lock:
            fd = self._take_fd()
            if fd is not None:
                os.close(fd)
            if self.unnamed:
                return  # never linked: nothing has its name
            try:
                os.unlink(self.temp_path)
            except FileNotFoundError:
                pass


class LocalWriter(StorageWriter):
    """Writes checkpoints to a POSIX file system; see the module docstring.

    Args:
        direct_io: ``"auto"`` or True: write whole aligned blocks with ``O_DIRECT`` where the file system allows it,
            else through the page cache (``"auto"`` quietly, and only on the file systems :func:`direct_io_suits`
            names; True with a warning once per directory); False (default): through the page cache.
    """

    #: A class default too: subclasses with their own ``__init__`` need not call this one.
    direct_io: DirectIO = False

    def __init__(self, direct_io: DirectIO = False) -> None:
        self.direct_io = direct_io

    def begin(self, path: str, total_bytes: int) -> LocalWriteSession:
        """Create the directory if needed and open a fresh temporary file beside ``path``: unnamed where the file
        system allows (see the module docstring), else under its temporary name."""
        path = local_path(path)
        if os.path.isdir(path):
            raise IsADirectoryError(
                errno.EISDIR,
                f"{path} is a directory; a checkpoint file path was expected: remove the directory or choose a file "
                "name (ModelCheckpoint's filename, or Trainer.save_checkpoint('dir/name.ckpt'))",
            )
        directory = os.path.dirname(path) or "."
        temp_path = os.path.join(directory, leftover_name(os.path.basename(path), TEMP_SUFFIX, MAX_NAME_BYTES))
        with unwritable_directory_named(directory):
            os.makedirs(directory, exist_ok=True)
            fd = open_unnamed(directory)
            named = fd is None
            if fd is None:
                fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        warn = self.direct_io is True
        try:
            wanted = warn or (self.direct_io == "auto" and direct_io_suits(directory))
            # An unnamed file is opened again through its descriptor's /proc link (open_unnamed checked it exists).
            reopen = temp_path if named else f"/proc/self/fd/{fd}"
            direct_fd = open_direct(reopen, directory, warn) if wanted else None
        except BaseException:  # EMFILE, ENOMEM, ...: leave neither a descriptor nor the temporary file behind
            os.close(fd)
            if named:
                with contextlib.suppress(OSError):
                    os.unlink(temp_path)
            raise
        return LocalWriteSession(path, temp_path, fd, direct_fd, warn)

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return os.path.exists(local_path(path))

    def create_marker(self, path: str) -> None:
        """An empty file, made by one ``open``, with no fsync. What orders it before the files it marks: on a file
        system with one journal for all metadata (ext4, XFS), any fsync commits every earlier namespace operation,
        this create among them, and every file of the save is fsynced before it is renamed into place; an NFS server
        commits a create before it answers. Elsewhere (btrfs, Lustre with directories striped over several metadata
        targets) a power loss in that window can leave the save's files unmarked: never a checkpoint (no ``meta.pt``),
        but left to the user. A durable marker costs two fsyncs and a directory fsync, each tens of milliseconds
        while an earlier checkpoint's writes keep the disk busy, on the training thread."""
        path = local_path(path)
        directory = os.path.dirname(path) or "."
        with unwritable_directory_named(directory):
            os.makedirs(directory, exist_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666))

    def open_read(self, path: str) -> BinaryIO:
        """Open ``path`` for reading."""
        return open(local_path(path), "rb")

    def open_local(self, path: str, *, read_ahead: bool = False) -> BinaryIO:
        """The file at ``path`` itself, open for reading; with ``read_ahead``, the kernel is asked to read all of it
        ahead (``POSIX_FADV_WILLNEED``: it reads while torch unpickles).

        Raises:
            FileNotFoundError: nothing at ``path``.
        """
        file = open(local_path(path), "rb")
        if read_ahead and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
            except BaseException:
                file.close()
                raise
        return file

    def read_tail(self, path: str, nbytes: int) -> bytes:
        """The last ``nbytes`` bytes of the file at ``path`` (through a symbolic link; one ``pread``).

        Raises:
            FileNotFoundError: nothing at ``path`` (or a link that leads nowhere).
            IsADirectoryError: a directory is at ``path``.
        """
        fd = os.open(local_path(path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            return os.pread(fd, min(nbytes, info.st_size), max(0, info.st_size - nbytes))
        finally:
            os.close(fd)

    def fingerprint(self, path: str) -> Hashable | None:
        """Device, inode, size and modification time of ``path`` (one ``stat``); None if it is missing.

        A commit renames a new inode onto the name, so any replacement changes the inode (or, for an in-place
        write, the size or nanosecond mtime).
        """
        try:
            st = os.stat(local_path(path))
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def remove(self, path: str) -> None:
        """Delete ``path`` (a file, or a directory tree); missing is fine.

        Raises:
            OSError: something could not be removed (the error names it): a removal never fails silently.
        """
        path = local_path(path)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, onerror=_missing_is_fine)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def list_directory(self, path: str) -> list[DirectoryEntry]:
        """The entries of the local directory ``path`` (symbolic links are not followed)."""
        try:
            with os.scandir(local_path(path)) as entries:
                return [
                    DirectoryEntry(e.name, e.is_dir(follow_symlinks=False), e.stat(follow_symlinks=False).st_mtime)
                    for e in entries
                ]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def clean_stale(self, directory: str, max_age_s: float = DEFAULT_STALE_AGE_S) -> list[str]:
        """Remove named temporary files of dead processes on this host, and of other hosts once ``max_age_s`` old
        (unnamed ones need no cleaning: a crash frees them)."""
        directory = local_path(directory)
        try:
            names = os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return []  # nothing there, or nothing we may clean (writing there then fails with the fix named)
        removed = []
        now = time.time()
        for name in names:
            leftover = parse_leftover_name(name, TEMP_SUFFIX)
            if leftover is None:
                continue
            full = os.path.join(directory, name)
            try:
                age_s = now - os.stat(full).st_mtime
            except FileNotFoundError:
                continue
            # This writer does not track its sessions: any temporary file of this process may be one in flight.
            if writer_gone(leftover.owner, age_s, max_age_s, tracks_own_writes=False):
                try:
                    os.unlink(full)
                    removed.append(full)
                except FileNotFoundError:
                    pass
        return removed


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _missing_is_fine(function: Any, path: str, exc_info: Any) -> None:
    """``shutil.rmtree``'s error handler: an entry already gone (another remover) is fine; anything else raises."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
