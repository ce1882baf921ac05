"""Load checkpoints written by :class:`~lightning_datastates.DataStatesIO` (or by anything else torch can read).

Local files go straight to ``torch.load`` by path (torch reads them with its own C++ reader); S3 objects are
fetched whole with concurrent ranged GETs and read by torch from that buffer in place; other protocols are read
through their storage writer's file system, with the plugin's ``storage_options``.
"""

from __future__ import annotations

from typing import IO, Any, cast

import torch
from lightning.fabric.utilities.cloud_io import _load as pl_load

from lightning_datastates.storage import LocalWriter, StorageWriter, local_path
from lightning_datastates.storage.s3 import S3Writer
from lightning_datastates.streams import PositionedReader


def load_checkpoint(
    writer: StorageWriter, path: str, map_location: Any = None, weights_only: bool | None = None
) -> Any:
    """``torch.load`` the committed checkpoint at ``path``; ``map_location`` and ``weights_only`` as torch.

    Raises:
        FileNotFoundError: nothing at ``path``.
    """
    if not writer.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    if isinstance(writer, LocalWriter):
        return pl_load(local_path(path), map_location=map_location, weights_only=weights_only)
    if isinstance(writer, S3Writer):
        # torch reads storages with readinto straight from the buffer: no second full copy (BytesIO would make one).
        buffer = cast(IO[bytes], BufferReader(writer.read_bytes(path)))  # a binary reader is all torch.load needs
        return torch.load(buffer, map_location=map_location, weights_only=weights_only)
    with writer.open_read(path) as stream:
        return torch.load(stream, map_location=map_location, weights_only=weights_only)


class BufferReader(PositionedReader):
    """A seekable binary reader over a ``bytearray`` without copying it (``io.BytesIO`` copies a bytearray)."""

    def __init__(self, buffer: bytearray) -> None:
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
