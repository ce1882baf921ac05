"""In-memory binary readers: ``PositionedReader`` (seek and tell) and ``BufferReader`` (reads a buffer in place)."""

from __future__ import annotations

import io
from typing import Any


class PositionedReader(io.RawIOBase):
    """A seekable, read-only raw stream of ``size`` bytes; subclasses implement ``readinto`` at ``_position``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = size
        self._position = 0

    def readable(self) -> bool:
        """Always True."""
        return True

    def seekable(self) -> bool:
        """Always True."""
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move to ``offset`` from the start, the current position or the end (``whence`` as ``io``)."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        """The current position."""
        return self._position


class BufferReader(PositionedReader):
    """A seekable binary reader over a buffer, without copying it (``io.BytesIO`` copies a bytearray).

    What torch loads from (a fetched checkpoint) and what botocore sends (an S3 part's body in the host arena: it
    takes bytes or a file, not a memoryview).
    """

    def __init__(self, buffer: bytes | bytearray | memoryview) -> None:
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
        """Release this reader's view of the buffer (the buffer itself stays as it is)."""
        self._view.release()
        super().close()
