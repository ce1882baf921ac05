"""Direct I/O for local writes: whole aligned blocks written with ``O_DIRECT``, bypassing the page cache.

``LocalWriter(direct_io="auto" or True)``, as ``DataStatesIO(direct_io=...)`` sets it (the plugin's default is
``"auto"``, which keeps network, FUSE and memory file systems on the page cache, see :func:`direct_io_suits`): the
temporary file is opened a second time with ``O_DIRECT`` (:func:`open_direct`), and the whole aligned blocks of every
range are written through that descriptor (:func:`write_direct`), bypassing the page cache (straight from memory whose
address agrees with the file offset modulo the block size, as the engine lays out its arena; through a small aligned
bounce buffer otherwise); the unaligned head and tail of a range and the metadata go through the buffered descriptor.
Where the file system refuses ``O_DIRECT`` (at open or at the first write) everything goes through the page cache:
silently with ``"auto"`` (a debug log), with a warning once per directory with ``True`` (:func:`no_direct_io`).

Why direct I/O by default: a checkpoint is written once and rarely read back through the page cache (loads of the
newest one are served from the host arena), so buffered writes only cost the kernel's copy into freshly allocated
page-cache pages, and their writeback. On a virtual machine whose host reclaims the guest's free memory (free page
reporting) those fresh pages are expensive: measured here, buffered writes of new files ran at 0.3 GB/s of system
CPU time while direct writes from the reused arena ran at device speed.

Offsets, lengths and memory addresses of direct writes are multiples of ``PAGE_ALIGNMENT_BYTES``: a whole page, so
that the partial pages written through the page cache never share a page with a direct write (64 KiB pages on some
ARM and POWER kernels), and a multiple of every common device's logical block size.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import re
import threading

from lightning_datastates.alignment import PAGE_ALIGNMENT_BYTES

log = logging.getLogger("lightning_datastates")

#: Size of the per-thread aligned buffer that direct writes from unaligned memory are copied through.
BOUNCE_BYTES = 8 * 1024**2
#: Directories already warned about for refusing direct I/O (one warning each per process).
_DIRECT_IO_WARNED: set[str] = set()
_BOUNCE = threading.local()
#: File system types ``direct_io="auto"`` writes to with ``O_DIRECT`` (see :func:`direct_io_suits`).
_DIRECT_IO_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "overlay", "lustre", "gpfs"}
)


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` all of ``data`` at ``offset``, retrying short writes."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


@functools.lru_cache(maxsize=256)
def direct_io_suits(directory: str) -> bool:
    """Whether ``direct_io="auto"`` writes into ``directory`` with ``O_DIRECT``: on file systems of local block
    devices and on parallel file systems (Lustre, GPFS), where large aligned writes go straight to the device; not
    on network and FUSE file systems (NFS, SMB, ...: each direct write becomes a synchronous request, slower than
    the client's own write-back), nor on tmpfs (memory either way). Unknown (no mount table): True, and a file
    system that refuses ``O_DIRECT`` still falls back to the page cache. Answered once per directory: the mount
    table is not read again on every save."""
    fstype = _file_system_type(os.path.realpath(directory))
    return fstype is None or fstype in _DIRECT_IO_FILE_SYSTEMS


def _file_system_type(path: str, mountinfo_path: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system mounted at the longest mount point containing ``path`` (Linux), or None."""
    try:
        with open(mountinfo_path, encoding="utf-8", errors="replace") as mountinfo:
            lines = mountinfo.readlines()
    except OSError:
        return None
    best, fstype = "", None
    for line in lines:
        fields = line.split()
        separator = fields.index("-", 6) if "-" in fields[6:] else len(fields)
        if separator + 1 >= len(fields):
            continue  # not a mountinfo line
        # Octal escapes (\040 for a space) in the mount point; the type follows the "-" separator.
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, fstype = mount_point, fields[separator + 1]
    return fstype


def open_direct(temp_path: str, directory: str, warn: bool) -> int | None:
    """A second, ``O_DIRECT`` descriptor of the new temporary file at ``temp_path`` (its name, or for an unnamed file
    its descriptor's ``/proc/self/fd/N``, which opens the same inode again); None if refused (warned once with
    ``warn``)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        no_direct_io(directory, OSError(errno.EOPNOTSUPP, "O_DIRECT does not exist on this platform"), warn)
        return None
    try:
        return os.open(temp_path, os.O_WRONLY | flag | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        no_direct_io(directory, exc, warn)
        return None


def no_direct_io(directory: str, exc: OSError, warn: bool) -> None:
    """Say once per directory that it refuses direct I/O: a warning if it was asked for, else a debug log."""
    if directory in _DIRECT_IO_WARNED:
        return
    _DIRECT_IO_WARNED.add(directory)
    log.log(
        logging.WARNING if warn else logging.DEBUG,
        "lightning_datastates: the file system of %s refuses direct I/O (O_DIRECT: %s); checkpoints there are "
        "written through the page cache instead (still fsynced and atomic). direct_io='auto' or False silences this.",
        directory,
        exc.strerror or exc,
    )


def _address(view: memoryview) -> int | None:
    """The memory address of a writable ``view``'s first byte; None for read-only memory."""
    if view.readonly or not view.nbytes:
        return None
    holder = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder


def write_direct(fd: int, view: memoryview, offset: int) -> None:
    """Write ``view`` (a whole number of aligned blocks) at the aligned ``offset`` through an ``O_DIRECT``
    descriptor: straight from ``view`` when its address is aligned (and the kernel can map it for the device), else
    through this thread's bounce buffer."""
    address = _address(view)
    if address is not None and address % PAGE_ALIGNMENT_BYTES == 0:
        try:
            write_all(fd, view, offset)
            return
        except OSError as exc:
            # Memory the kernel cannot map for the device's DMA (some drivers' page-locked host buffers) fails with
            # EFAULT: rewrite the whole range (same bytes, same offsets) through the bounce buffer, plain memory.
            if exc.errno != errno.EFAULT:
                raise
    bounce = getattr(_BOUNCE, "buffer", None)
    if bounce is None:
        bounce = _BOUNCE.buffer = mmap.mmap(-1, BOUNCE_BYTES)  # anonymous mappings are page-aligned
    target = memoryview(bounce)
    try:
        for start in range(0, view.nbytes, BOUNCE_BYTES):
            piece = view[start : start + BOUNCE_BYTES]
            target[: piece.nbytes] = piece
            write_all(fd, target[: piece.nbytes], offset + start)
    finally:
        target.release()
