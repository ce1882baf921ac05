"""Load checkpoints written by :class:`~lightning_datastates.DataStatesIO` (or by anything else torch can read).

The storage says how it can be read (see :mod:`~lightning_datastates.storage.base`): as a local file with a real
descriptor (``open_local``: local files, S3 objects fetched into memory), whole into memory (``read_bytes``), or as a
stream (``open_read``). This module knows no backend.

Local files: with ``verify_checksums`` (the default) every record is checked against its CRC-32 first, in parallel
threads over a read-only mapping (:mod:`~lightning_datastates.load.integrity`), which also brings the whole file
into the page cache; then ``torch.load(mmap=True)`` maps the *same open file* (through ``/proc/self/fd``, so a
file replaced meanwhile cannot slip in between check and load) and the tensors are backed by those pages (copy-on-write:
writing to a loaded tensor copies its page, the file is never changed). Without verification, the kernel is asked
to read the file ahead (``POSIX_FADV_WILLNEED``) before the mapped load.

S3: the object is fetched with concurrent ranged GETs (``max_concurrent_parts`` at once, ``read_range_bytes``
each) straight into an anonymous in-memory file (``memfd_create``), verified there, and mapped by torch the same
way: one copy of the bytes in host memory, no second copy into tensors. Other protocols are read whole through
their storage writer's file system, with the plugin's ``storage_options``, and loaded from that buffer in place.

Where ``/proc/self/fd`` or ``memfd_create`` are missing (not Linux), files are loaded through their file object and
S3 objects from a ``bytearray``: slower, same results. ``map_location`` and ``weights_only`` behave as in
``torch.load``; a damaged file raises :class:`~lightning_datastates.errors.CheckpointCorruptError` and never loads.
"""

from __future__ import annotations

import logging
import os
from typing import IO, Any, BinaryIO, cast

import torch

from lightning_datastates.compat.lightning import path_as_given
from lightning_datastates.load.integrity import IntegrityReport, verify_buffer, verify_open_file
from lightning_datastates.storage.base import StorageWriter
from lightning_datastates.streams import BufferReader

log = logging.getLogger("lightning_datastates")

#: The first bytes of a zip archive (every torch file since torch 1.6, and every file this package writes).
_ZIP_MAGIC = b"PK\x03\x04"


def load_checkpoint(
    writer: StorageWriter,
    path: str,
    map_location: Any = None,
    weights_only: bool | None = None,
    verify_checksums: bool = True,
) -> Any:
    """``torch.load`` the committed checkpoint at ``path``; ``map_location`` and ``weights_only`` as torch.

    See the module docstring for how each storage is read.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointCorruptError: with ``verify_checksums``, a record does not match its CRC-32 (names the record).
    """
    file = _open_local(writer, path, read_ahead=not verify_checksums)  # read ahead while torch unpickles
    if file is not None:
        with file:
            if verify_checksums:
                _note_unchecked(verify_open_file(file, path))
            return load_open_file(file, map_location, weights_only)
    _require(writer, path)
    if verify_checksums or writer.prefers_whole_reads:
        buffer = writer.read_bytes(path)
        if verify_checksums:
            _note_unchecked(verify_buffer(buffer, path))
        # torch reads storages with readinto straight from the buffer: no second full copy (BytesIO would make one).
        return torch.load(cast(IO[bytes], BufferReader(buffer)), map_location=map_location, weights_only=weights_only)
    with writer.open_read(path) as stream:
        return torch.load(stream, map_location=map_location, weights_only=weights_only)


def load_open_file(file: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
    """``torch.load`` the open local ``file`` (a real file with a descriptor, positioned anywhere).

    A zip-format file is mapped (``mmap=True``) through ``/proc/self/fd/N``: the very file that is open, even if its
    name now points elsewhere or nowhere. Elsewhere, or for torch's legacy format, it is read through ``file``.
    """
    file.seek(0)
    magic = file.read(len(_ZIP_MAGIC))
    file.seek(0)
    fd_path = f"/proc/self/fd/{file.fileno()}"
    if magic == _ZIP_MAGIC and os.path.exists(fd_path):
        return torch.load(fd_path, map_location=map_location, weights_only=weights_only, mmap=True)
    return torch.load(file, map_location=map_location, weights_only=weights_only)


def verify_checkpoint(writer: StorageWriter, path: str) -> IntegrityReport:
    """Check every record of the committed checkpoint at ``path`` against its CRC-32, without unpickling it.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointCorruptError: a record does not match its CRC-32, or the archive is damaged.
    """
    file = _open_local(writer, path, read_ahead=False)
    if file is not None:
        with file:
            return verify_open_file(file, path)
    _require(writer, path)
    return verify_buffer(writer.read_bytes(path), path)


def _open_local(writer: StorageWriter, path: str, read_ahead: bool) -> BinaryIO | None:
    """``writer.open_local(path)``, with the message of a missing file the same for every storage (Lightning's)."""
    try:
        return writer.open_local(path, read_ahead=read_ahead)
    except FileNotFoundError as exc:
        raise missing_checkpoint(path) from exc


def _require(writer: StorageWriter, path: str) -> None:
    if not writer.exists(path):
        raise missing_checkpoint(path)


def missing_checkpoint(path: str) -> FileNotFoundError:
    """The error for no checkpoint at ``path``, worded as Lightning's ``TorchCheckpointIO`` words it: naming the path
    as the caller gave it (``Checkpoint file not found: not existing``), then the absolute path looked at, where the
    two differ (a relative path: the working directory it was resolved against)."""
    given = path_as_given(path)
    where = "" if given == path else f" (looked for {path})"
    return FileNotFoundError(f"Checkpoint file not found: {given}{where}")


def _note_unchecked(report: IntegrityReport) -> None:
    if report.legacy_format:
        log.warning(
            "lightning_datastates: %s is in torch's legacy (non-zip) format, which carries no CRC-32; loaded "
            "unverified",
            report.path,
        )
    if report.unchecked:
        log.warning(
            "lightning_datastates: %d record(s) of %s carry no CRC-32 (written by torch.save with its CRC option "
            "off, or by lightning-datastates 0.1) and were loaded unverified",
            len(report.unchecked),
            report.path,
        )
