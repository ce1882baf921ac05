"""``PositionedReader``: the seek/tell part of the in-memory binary readers torch is handed to read from."""

from __future__ import annotations

import io


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
