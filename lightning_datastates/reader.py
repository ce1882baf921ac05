"""Load checkpoints written by :class:`~lightning_datastates.DataStatesIO` (or by anything else torch can read).

Local files go to ``torch.load`` through the file object they were verified through (a file replaced meanwhile
cannot slip in between); S3 objects are fetched whole with concurrent ranged GETs and read by torch from that
buffer in place; other protocols are read through their storage writer's file system, with the plugin's
``storage_options``. With ``verify_checksums`` (the default) every record is checked against its CRC-32 first
(:mod:`~lightning_datastates.integrity`): a damaged file raises instead of loading wrong weights.
"""

from __future__ import annotations

import logging
from typing import IO, Any, cast

import torch

from lightning_datastates.integrity import IntegrityReport, verify_buffer, verify_file, verify_open_file
from lightning_datastates.storage import LocalWriter, StorageWriter, local_path
from lightning_datastates.storage.s3 import S3Writer
from lightning_datastates.streams import PositionedReader

log = logging.getLogger("lightning_datastates")


def load_checkpoint(
    writer: StorageWriter,
    path: str,
    map_location: Any = None,
    weights_only: bool | None = None,
    verify_checksums: bool = True,
) -> Any:
    """``torch.load`` the committed checkpoint at ``path``; ``map_location`` and ``weights_only`` as torch.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointCorruptError: with ``verify_checksums``, a record does not match its CRC-32 (names the record).
    """
    if not writer.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    if isinstance(writer, LocalWriter):
        with open(local_path(path), "rb") as file:
            if verify_checksums:
                _note_unchecked(verify_open_file(file, path))
                file.seek(0)
            return torch.load(file, map_location=map_location, weights_only=weights_only)
    if isinstance(writer, S3Writer) or verify_checksums:
        buffer = read_whole(writer, path)
        if verify_checksums:
            _note_unchecked(verify_buffer(buffer, path))
        # torch reads storages with readinto straight from the buffer: no second full copy (BytesIO would make one).
        return torch.load(cast(IO[bytes], BufferReader(buffer)), map_location=map_location, weights_only=weights_only)
    with writer.open_read(path) as stream:
        return torch.load(stream, map_location=map_location, weights_only=weights_only)


def verify_checkpoint(writer: StorageWriter, path: str) -> IntegrityReport:
    """Check every record of the committed checkpoint at ``path`` against its CRC-32, without unpickling it.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointCorruptError: a record does not match its CRC-32, or the archive is damaged.
    """
    if not writer.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    if isinstance(writer, LocalWriter):
        return verify_file(local_path(path))
    return verify_buffer(read_whole(writer, path), path)


def read_whole(writer: StorageWriter, path: str) -> bytes | bytearray:
    """All bytes of the committed file at ``path`` (S3: concurrent ranged GETs)."""
    if isinstance(writer, S3Writer):
        return writer.read_bytes(path)
    with writer.open_read(path) as stream:
        return stream.read()


def _note_unchecked(report: IntegrityReport) -> None:
    if report.unchecked:
        log.warning(
            "lightning_datastates: %d record(s) of %s carry no CRC-32 (written by torch.save with its CRC option "
            "off, or by lightning-datastates 0.1) and were loaded unverified",
            len(report.unchecked),
            report.path,
        )


class BufferReader(PositionedReader):
    """A seekable binary reader over a buffer without copying it (``io.BytesIO`` copies a bytearray)."""

    def __init__(self, buffer: bytes | bytearray) -> None:
        self._view = memoryview(buffer)
        super().__init__(self._view.nbytes)

    def readinto(self, target: Any) -> int:
        """Copy up to ``len(target)`` bytes from the current position into ``target``."""
        out = memoryview(target).cast("B")
        count = max(0, min(out.nbytes, self._size - self._position))
        out[:count] = self._view[self._position : self._position + count]
        self._position += count
        return count

    def close(self) -> None:
        """Release the view of the buffer."""
        self._view.release()
        super().close()
