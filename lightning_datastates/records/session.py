"""The write side of the storage seam: one checkpoint file being written, whatever the backend.

Every backend's :meth:`~lightning_datastates.storage.base.StorageWriter.begin` returns one (the call order is in
:mod:`~lightning_datastates.storage.base`). It lives on the floor because every stage hands it on: the job holds its
session (:mod:`~lightning_datastates.records.job`), the checksumming wrapper is one
(:mod:`~lightning_datastates.records.checksums`), and the writer threads write into it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class WriteSession(ABC):
    """One checkpoint being written; see :mod:`~lightning_datastates.storage.base` for the call order."""

    path: str
    #: Whether ``write_range`` returns at memory speed (the bytes land in the page cache or a local buffer), so that
    #: writing straight from training tensors holds them only for moments (see ``records/through.py``).
    fast_writes: bool = False
    #: With direct I/O: ranges whose memory address and file offset agree modulo this many bytes are written straight
    #: from that memory (no bounce copy), so the engine places its arena blocks to match. None: any address will do.
    direct_alignment: int | None = None

    @abstractmethod
    def write_range(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at byte ``offset`` of the file (thread-safe)."""

    def write_checksummed_range(self, offset: int, data: memoryview, crc: int) -> None:
        """:meth:`write_range`, for bytes whose CRC-32 the caller already knows; a session that keeps checksums uses
        it instead of reading the bytes again (see :mod:`~lightning_datastates.records.checksums`), others ignore it."""
        self.write_range(offset, data)

    def date(self, modified_ns: int) -> None:  # noqa: B027 - optional: a no-op where files carry no settable time
        """Give the file the modification time ``modified_ns`` (ns since the epoch) at :meth:`complete`, instead of
        the time the session began (a copy keeps its original's date); backends that cannot date a file ignore it
        (S3 dates an object by its upload)."""

    @abstractmethod
    def complete(self) -> None:
        """Make the file durable and visible under its final name, atomically."""

    @abstractmethod
    def abort(self) -> None:
        """Discard everything written; the final name keeps whatever it held before."""
