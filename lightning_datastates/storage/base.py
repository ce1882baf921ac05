"""The storage seam: one writer per backend behind one small interface, for writing and reading checkpoints.

Call order, per checkpoint written:
  1) ``writer.begin(path, total_bytes)`` on the training thread, at capture (so a bad path fails at once);
  2) ``session.write_range(offset, data)`` any number of times, from several writer threads at once, in any
     order, never overlapping;
  3) exactly one of ``session.complete()`` (the commit: afterwards, and only afterwards, the file is visible
     under ``path``, whole) or ``session.abort()`` (nothing becomes visible; safe to call more than once).

The commit lives in ``complete``: a backend must never publish a partially written checkpoint.

Reading a committed checkpoint (on the thread that loads, usually the training thread; see
:mod:`~lightning_datastates.load.reader`), the first that the backend offers:
  1) ``writer.open_local(path, read_ahead=...)``: a local file with a real descriptor, which the reader verifies
     through a mapping and torch maps (``mmap=True``): local files themselves; S3 objects fetched into an in-memory
     file. None where the backend has none;
  2) ``writer.read_bytes(path)``: the whole file in memory (verified there, loaded from there);
  3) ``writer.open_read(path)``: a stream (unverified loads where whole reads are no faster,
     :attr:`StorageWriter.prefers_whole_reads`; the command line's metadata-only ``inspect``).

The read operations are methods of the writer rather than a reader class beside it (as fsspec's file systems
override ``cat_file`` and keep the default elsewhere): a backend's reads share its client, settings and path rules
(the S3 writer's connection pools, retries and timeouts), and the plugin keeps one object per protocol.

A writer may be built once per protocol and reused (the plugin keeps one): for many paths, saves, loads and clean-ups,
from several threads at once (the training thread begins, loads and cleans while writer threads write).
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from lightning_datastates.config import DEFAULT_STALE_AGE_S
from lightning_datastates.records.session import WriteSession
from lightning_datastates.records.stamp import TAIL_BYTES, SaveStamp, parse_stamp

__all__ = ["DirectoryEntry", "StorageWriter", "read_stamp", "write_file"]


@dataclass(frozen=True)
class DirectoryEntry:
    """One entry of a listed directory: its ``name`` (no path), whether it is a directory (a common prefix on object
    stores), and when it was last modified (seconds since the epoch; None where the backend does not say)."""

    name: str
    is_directory: bool
    modified_s: float | None


class StorageWriter(ABC):
    """A storage backend: starts write sessions, reads, checks and removes committed files, cleans leftovers."""

    #: Whether a load that does not verify checksums still reads the whole file with :meth:`read_bytes` (where that is
    #: faster than streaming through :meth:`open_read`: S3's concurrent ranged GETs); else it streams (no second copy
    #: of the file in memory).
    prefers_whole_reads: bool = False

    @abstractmethod
    def begin(self, path: str, total_bytes: int) -> WriteSession:
        """Start writing a checkpoint of ``total_bytes`` bytes that will be published at ``path``."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a committed file exists at ``path``."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Remove the file at ``path``, or the directory tree there, in whatever order the backend lists it; missing
        is not an error. A checkpoint is removed through :func:`~lightning_datastates.storage.removal.
        remove_checkpoint`, which orders a directory's removal so that a crash leaves no torn checkpoint.

        Raises:
            OSError: something could not be removed (the error names it).
        """

    def remove_files(self, directory: str, names: Sequence[str]) -> None:
        """Remove the files ``names`` directly in ``directory`` (files only: a sharded checkpoint's shards, its
        metadata, markers), in any order; missing ones are not an error. The default removes one at a time through
        :meth:`remove`; a backend that deletes several files in one request overrides it (S3: ``DeleteObjects``).

        Raises:
            OSError: a file could not be removed (the first such error, once every other file was tried).
        """
        first: OSError | None = None
        for name in names:
            try:
                self.remove(f"{directory.rstrip('/')}/{name}")
            except OSError as exc:
                first = first or exc
        if first is not None:
            raise first

    def create_marker(self, path: str) -> None:
        """Create an empty file at ``path`` whose name is all it says (a sharded save's in-flight marker): visible to
        every process once this returns, and durable no later than the next file committed in the same directory,
        which is all that orders it before the files it marks. By default a committed empty file (durable at once);
        a backend with a cheaper way that keeps this promise overrides it (local files: no fsync).

        Raises:
            OSError: the file could not be created (the error names the path).
        """
        write_file(self, path, b"")

    @abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """A binary file object reading the committed file at ``path``, as a stream (nothing read ahead of need)."""

    def open_local(self, path: str, *, read_ahead: bool = False) -> BinaryIO | None:
        """The committed file at ``path`` as an open local file with a real descriptor (the caller closes it), ready
        to be mapped; None (the default) where this backend has none, then :meth:`read_bytes` or :meth:`open_read`.

        ``read_ahead``: the caller is about to read all of it (a backend may ask the kernel to read ahead).

        Raises:
            FileNotFoundError: nothing at ``path``.
        """
        return None

    def read_bytes(self, path: str) -> bytes | bytearray:
        """All bytes of the committed file at ``path``; by default read through :meth:`open_read`.

        Raises:
            FileNotFoundError: nothing at ``path``.
        """
        with self.open_read(path) as stream:
            return stream.read()

    def read_tail(self, path: str, nbytes: int) -> bytes:
        """The last ``nbytes`` bytes of the committed file at ``path`` (all of it where it is shorter): where a file
        keeps its save stamp (:mod:`~lightning_datastates.records.stamp`). By default read through
        :meth:`open_read`; a backend with a cheaper way overrides it (one ranged request).

        Raises:
            FileNotFoundError: nothing at ``path``.
            IsADirectoryError: a directory is at ``path`` (a sharded checkpoint).
        """
        with self.open_read(path) as stream:
            size = stream.seek(0, os.SEEK_END)
            stream.seek(max(0, size - nbytes))
            return bytes(stream.read())

    def copy_shape(self, window_bytes: int, streams: int) -> tuple[int, int]:
        """How a copy of a whole file into this backend is best cut (the local tier's replication): bytes per
        ``write_range`` and calls in flight at once, given the caller's defaults. The default keeps them; a backend
        whose sessions transfer fixed pieces overrides it (S3: one part per call, ``max_concurrent_parts`` at once)."""
        return window_bytes, streams

    def fingerprint(self, path: str) -> Hashable | None:
        """A cheap token that changes whenever the committed file at ``path`` is replaced or changed (metadata
        only, no data read); None where this backend cannot tell (then a copy held in memory is never served in
        place of the file), or when nothing is at ``path`` (callers that must tell the two apart ask :meth:`exists`).
        """
        return None

    def list_directory(self, path: str) -> list[DirectoryEntry]:
        """The entries directly in ``path`` (hidden ones included); empty if there is no such directory.

        Used to find what dead sharded saves left in checkpoint directories. The default lists nothing: a backend
        that cannot list is never cleaned that way.
        """
        return []

    def check_directory(self, directory: str) -> None:
        """At setup, before the first save (the callback's, for each ``ModelCheckpoint`` directory): raise if no
        checkpoint can be written in ``directory``, so that a wrong directory fails the run before it trains, not at
        its first save. The default checks a local path: no existing part of it is a file (the missing directories
        are made at the first save); other paths are not checked. A backend with its own check overrides it (S3: the
        bucket exists and credentials are found).

        Raises:
            NotADirectoryError: a part of the local path is a file (the message names it and the fix).
        """
        if "://" in directory and not directory.startswith("file://"):
            return
        probe = os.path.abspath(directory.removeprefix("file://"))
        while not os.path.exists(probe):  # the nearest part that exists: the save makes the rest
            parent = os.path.dirname(probe)
            if parent == probe:
                return
            probe = parent
        if not os.path.isdir(probe):
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"cannot write checkpoints in {directory}: {probe} is a file, not a directory; choose another "
                "checkpoint directory (ModelCheckpoint(dirpath=...)) or move the file",
            )

    @abstractmethod
    def clean_stale(self, directory: str, max_age_s: float = DEFAULT_STALE_AGE_S) -> list[str]:
        """Remove what crashed runs left directly in ``directory``; return the paths (or URLs) removed.

        Leftovers are temporary files and, on S3, open multipart uploads. Those of a dead process on this host go at
        once; those whose writer cannot be asked (another host, no marker) once older than ``max_age_s`` seconds.
        This process's own writes in flight and committed checkpoints are never touched. Missing directories are
        fine (nothing to clean).
        """


def write_file(writer: StorageWriter, path: str, data: bytes) -> None:
    """Write a small file through ``writer``: durable and visible at once, or not at all."""
    session = writer.begin(path, len(data))
    try:
        session.write_range(0, memoryview(data))
        session.complete()
    except BaseException:
        session.abort()
        raise


def read_stamp(writer: StorageWriter, path: str) -> SaveStamp | None:
    """The save stamp of the committed file at ``path`` (:mod:`~lightning_datastates.records.stamp`): None where it
    carries none (written by plain Lightning or an older release) or is a directory (a sharded checkpoint).

    Raises:
        FileNotFoundError: nothing at ``path``.
        OSError: storage could not be read (``S3WriteError`` on S3).
    """
    try:
        return parse_stamp(writer.read_tail(path, TAIL_BYTES))
    except IsADirectoryError:
        return None
