"""In-memory binary readers: ``PositionedReader`` (seek and tell), ``BufferReader`` (reads a buffer in place) and
``SegmentReader`` (a file assembled from byte segments)."""

from __future__ import annotations

import bisect
import io
from collections.abc import Sequence
from typing import Any

import torch

#: Copies of at least this many bytes go through torch: several threads, GIL released (1.7x a memoryview copy on
#: two cores, measured); smaller ones are not worth starting threads for.
_PARALLEL_COPY_BYTES = 1024**2


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


class SegmentReader(PositionedReader):
    """A read-only file of ``size`` bytes assembled from sorted, disjoint ``(offset, buffer)`` segments; the bytes
    no segment covers read as zeros.

    Serves a planned file (metadata segments, zeros where payloads go: torch's zip reader checks a plan) and a
    checkpoint held in the host arena (every byte covered). ``readinto`` copies each segment's part straight into
    the target and zero-fills only the gaps, so a large read inside one buffer is exactly one copy.
    """

    def __init__(self, segments: Sequence[tuple[int, Any]], size: int) -> None:
        super().__init__(size)
        self._segments = [(offset, memoryview(data).cast("B")) for offset, data in segments]
        self._starts = [offset for offset, _ in self._segments]

    def read_at(self, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` bytes from ``offset`` (the position moves there)."""
        index = bisect.bisect_right(self._starts, offset) - 1
        if index >= 0:  # fast path: inside one segment (zip headers and the central directory always are)
            start, data = self._segments[index]
            if offset + nbytes <= start + data.nbytes:
                self._position = offset + nbytes
                return bytes(data[offset - start : offset - start + nbytes])
        self.seek(offset)
        buffer = bytearray(max(0, nbytes))
        return bytes(buffer[: self.readinto(buffer)])

    def readinto(self, buffer: Any) -> int:
        """Copy up to ``len(buffer)`` bytes from the current position into ``buffer``."""
        count = max(0, min(memoryview(buffer).nbytes, self._size - self._position))
        view = memoryview(buffer).cast("B")[:count]
        start, end = self._position, self._position + count
        filled = start  # bytes before this are in the target already
        # Segments are sorted and disjoint: start from the last one beginning at or before `start`.
        index = max(0, bisect.bisect_right(self._starts, start) - 1)
        while index < len(self._segments):  # by index: slicing the tail on every read would be quadratic
            offset, data = self._segments[index]
            index += 1
            if offset >= end:
                break
            lo, hi = max(offset, start), min(offset + data.nbytes, end)
            if lo < hi:
                view[filled - start : lo - start] = bytes(lo - filled)  # a gap before this segment
                _copy(view[lo - start : hi - start], data[lo - offset : hi - offset])
                filled = hi
        view[filled - start :] = bytes(end - filled)
        self._position = end
        return count

    def close(self) -> None:
        """Drop the segments (the buffers themselves stay as they are)."""
        self._segments = []
        self._starts = []
        super().close()


def _copy(target: memoryview, source: memoryview) -> None:
    """``target[:] = source``; large copies from writable buffers (the host arena) by torch's parallel copy."""
    if target.nbytes >= _PARALLEL_COPY_BYTES and not source.readonly:
        # frombuffer wraps without copying; read-only sources (metadata bytes) would make torch warn.
        torch.frombuffer(target, dtype=torch.uint8).copy_(torch.frombuffer(source, dtype=torch.uint8))
    else:
        target[:] = source
