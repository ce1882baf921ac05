"""The storage seam: one writer per backend behind one small interface.

Call order, per checkpoint:
  1) ``writer.begin(path, total_bytes)`` on the training thread, at capture (so a bad path fails at once);
  2) ``session.write_range(offset, data)`` any number of times, from several writer threads at once, in any
     order, never overlapping;
  3) exactly one of ``session.complete()`` (the commit: afterwards, and only afterwards, the file is visible
     under ``path``, whole) or ``session.abort()`` (nothing becomes visible; safe to call more than once).

The commit lives in ``complete``: a backend must never publish a partially written checkpoint.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import BinaryIO

#: Leftovers whose writer cannot be asked whether it is alive (a temporary file of another host, an S3 upload with
#: no marker) are removed by :meth:`StorageWriter.clean_stale` once they are this old.
DEFAULT_STALE_AGE_S = 3600.0


class WriteSession(ABC):
    """One checkpoint being written; see the module docstring for the call order."""

    path: str
    #: Whether ``write_range`` returns at memory speed (the bytes land in the page cache or a local buffer), so that
    #: writing straight from training tensors holds them only for moments (see ``write/through.py``).
    fast_writes: bool = False
    #: With direct I/O: ranges whose memory address and file offset agree modulo this many bytes are written straight
    #: from that memory (no bounce copy), so the engine places its arena blocks to match. None: any address will do.
    direct_alignment: int | None = None

    @abstractmethod
    def write_range(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at byte ``offset`` of the file (thread-safe)."""

    def write_checksummed_range(self, offset: int, data: memoryview, crc: int) -> None:
        """:meth:`write_range`, for bytes whose CRC-32 the caller already knows; a session that keeps checksums uses
        it instead of reading the bytes again (see :mod:`~lightning_datastates.write.checksums`), others ignore it."""
        self.write_range(offset, data)

    @abstractmethod
    def complete(self) -> None:
        """Make the file durable and visible under its final name, atomically."""

    @abstractmethod
    def abort(self) -> None:
        """Discard everything written; the final name keeps whatever it held before."""


class StorageWriter(ABC):
    """A storage backend: starts write sessions and removes or checks committed files."""

    @abstractmethod
    def begin(self, path: str, total_bytes: int) -> WriteSession:
        """Start writing a checkpoint of ``total_bytes`` bytes that will be published at ``path``."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a committed file exists at ``path``."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Remove the committed file at ``path``; a missing file is not an error."""

    @abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """A binary file object reading the committed file at ``path``."""

    def fingerprint(self, path: str) -> Hashable | None:
        """A cheap token that changes whenever the committed file at ``path`` is replaced or changed (metadata
        only, no data read); None where this backend cannot tell (then a copy held in memory is never served in
        place of the file), or when nothing is at ``path``.
        """
        return None

    @abstractmethod
    def clean_stale(self, directory: str, max_age_s: float = DEFAULT_STALE_AGE_S) -> list[str]:
        """Remove what crashed runs left directly in ``directory``; return the paths (or URLs) removed.

        Leftovers are temporary files and, on S3, open multipart uploads. Those of a dead process on this host go at
        once; those whose writer cannot be asked (another host, no marker) once older than ``max_age_s`` seconds.
        This process's own writes in flight and committed checkpoints are never touched. Missing directories are
        fine (nothing to clean).
        """
