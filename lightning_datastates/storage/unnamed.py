"""The local backend's file-system details: unnamed files (Linux ``O_TMPFILE``) and the errors that name the path and
the fix.

An unnamed file (``open_unnamed``) holds a checkpoint being written without a name in its directory: a listing during
the write shows committed checkpoints only, and a crash leaves nothing. At the commit it gets its hidden temporary name
(``link_unnamed``) just before the rename. Where a file system refuses either (NFS, FUSE, old kernels, no ``/proc``),
the directory is remembered and gets named temporary files (:mod:`~lightning_datastates.storage.local`). See
``docs/design.md``, "Commit protocols". Any thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator

log = logging.getLogger("lightning_datastates")

#: errno values of an ``O_TMPFILE`` open that mean "no unnamed files here" (file system, kernel before 3.11 which
#: reads the flag as opening the directory itself, sandbox): write a named temporary file instead.
_UNNAMED_REFUSALS = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL, errno.ENOSYS, errno.EPERM})
#: Directories whose file system refused an unnamed file (or its link at a commit): named temporary files there.
_UNNAMED_REFUSED: set[str] = set()


#: errno values meaning "no room for this file": disk full, quota exceeded, file-size limit (RLIMIT_FSIZE).
OUT_OF_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@contextlib.contextmanager
def unwritable_directory_named(directory: str) -> Iterator[None]:
    """Re-raise "cannot create a file in ``directory``" errors with the directory and the fix in the message."""
    try:
        yield
    except (FileExistsError, NotADirectoryError) as exc:  # makedirs: a component of the path is a file
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"cannot write checkpoints in {directory}: {file_in_the_way(directory)} is a file, not a directory; "
            "choose another checkpoint directory (ModelCheckpoint(dirpath=...)) or move the file",
        ) from exc
    except OSError as exc:
        fixes = {
            errno.EACCES: "make it writable for this user or choose another directory (ModelCheckpoint(dirpath=...))",
            errno.EPERM: "make it writable for this user or choose another directory (ModelCheckpoint(dirpath=...))",
            errno.EROFS: "choose a directory on a writable file system (ModelCheckpoint(dirpath=...))",
        }
        if exc.errno not in fixes:
            raise
        raise type(exc)(
            exc.errno, f"cannot write checkpoints in {directory}: {exc.strerror}; {fixes[exc.errno]}"
        ) from exc


@contextlib.contextmanager
def out_of_space_named(path: str) -> Iterator[None]:
    """Re-raise a full disk, exceeded quota or file-size limit as an ``OSError`` naming ``path`` and the fixes."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in OUT_OF_SPACE:
            raise
        raise OSError(
            exc.errno,
            f"{exc.strerror} while writing {path}: free space on its file system, raise the quota or the file-size "
            "limit (ulimit -f), or write checkpoints elsewhere",
        ) from exc


def open_unnamed(directory: str) -> int | None:
    """A new file without a name in ``directory``'s file system (``O_TMPFILE``), open for writing with mode
    ``0o666`` less the umask; None where unnamed files cannot be written there and later linked (no ``O_TMPFILE``,
    refused by the file system or the kernel, no ``/proc/self/fd`` to link through), decided once per directory.

    Raises:
        OSError: an error a named file would meet as well (permissions, read-only or full file system).
    """
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or directory in _UNNAMED_REFUSED:
        return None
    try:
        fd = os.open(directory, flag | os.O_WRONLY | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno not in _UNNAMED_REFUSALS:
            raise
        _refuse_unnamed(directory, exc)
        return None
    if not os.path.exists(f"/proc/self/fd/{fd}"):  # /proc not mounted: the file could never be linked
        os.close(fd)
        _refuse_unnamed(directory, OSError(errno.ENOENT, "/proc/self/fd is missing"))
        return None
    return fd


def _refuse_unnamed(directory: str, exc: OSError) -> None:
    """Remember that ``directory`` gets named temporary files (quietly: nothing changes for the user but the
    listing of a write in flight)."""
    _UNNAMED_REFUSED.add(directory)
    log.debug(
        "lightning_datastates: %s takes no unnamed files (O_TMPFILE: %s); writes there use a named temporary file",
        directory,
        exc.strerror or exc,
    )


def link_unnamed(fd: int, temp_path: str, path: str) -> None:
    """Give the unnamed file open at ``fd`` the name ``temp_path`` (``linkat`` of its ``/proc/self/fd`` link with
    ``AT_SYMLINK_FOLLOW``: no privilege needed, unlike ``AT_EMPTY_PATH``).

    Raises:
        OSError: the link failed (naming ``path`` and the cause); later writes into that directory use named files.
    """
    try:
        # CPython calls link(2) unless a directory descriptor is given, and link(2) links the /proc magic link
        # itself (EXDEV). Any descriptor makes it call linkat(2) with AT_SYMLINK_FOLLOW, and linkat ignores the
        # descriptor of an absolute source path: the file's own serves, no directory is opened.
        with out_of_space_named(path):  # a new directory entry may need a block
            os.link(f"/proc/self/fd/{fd}", temp_path, src_dir_fd=fd, follow_symlinks=True)
    except OSError as exc:
        if exc.errno in OUT_OF_SPACE:
            raise
        _refuse_unnamed(os.path.dirname(temp_path) or ".", exc)
        raise OSError(
            exc.errno,
            f"cannot name the written file of {path} ({exc.strerror}): the checkpoint is lost, later saves into its "
            "directory write a named temporary file instead",
        ) from exc


def file_in_the_way(directory: str) -> str:
    """The file among ``directory`` and its parents (makedirs' error names the path it tried, often below it);
    ``directory`` itself where none is a file. Below a file nothing exists, so it is the nearest parent that does."""
    probe = directory
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return directory
        probe = parent
    return probe if os.path.isfile(probe) else directory
