"""Writer for any other fsspec protocol (memory://, gcs://, az://, hdfs://, ...).

Ranges arrive out of order from several threads, which most remote file systems cannot take, so they are
spooled into a local temporary file with ``os.pwrite``. The commit uploads the spool under a hidden temporary
name beside the target and moves it onto the final name: object stores copy server-side (the final object
appears whole or not at all), file-system-like backends rename. Nothing partial is ever visible under the final
name, and an earlier checkpoint there stays intact until the move.

Temporary objects are named as local temporary files (``.<name>.<host>.<pid>.<token>.datastates-tmp``) and cleaned by
the same rule (see :mod:`~lightning_datastates.records.leftovers`).
"""

from __future__ import annotations

import difflib
import inspect
import os
import posixpath
import tempfile
import time
from collections.abc import Hashable
from typing import Any, BinaryIO

import fsspec
from fsspec.core import split_protocol

from lightning_datastates.config import DEFAULT_STALE_AGE_S
from lightning_datastates.errors import ConfigError
from lightning_datastates.records.leftovers import (
    TEMP_SUFFIX,
    leftover_name,
    parse_leftover_name,
    writer_gone,
)
from lightning_datastates.storage.base import DirectoryEntry, StorageWriter
from lightning_datastates.storage.local import PositionalFileSession


class GenericWriteSession(PositionalFileSession):
    """One checkpoint spooled locally, published by upload + move at ``complete``."""

    def __init__(self, fs: Any, path: str, remote_path: str) -> None:
        fd, self._spool_path = tempfile.mkstemp(prefix="datastates-spool-")
        super().__init__(path, fd)
        self._fs = fs
        self._remote_path = remote_path
        directory, name = posixpath.split(remote_path)
        self._remote_temp = posixpath.join(directory, leftover_name(name, TEMP_SUFFIX))

    def complete(self) -> None:
        """Upload the spool under a temporary name, then move it onto the final name."""
        with self._lock:
            self._close_spool()
            try:
                parent = posixpath.dirname(self._remote_path)
                if parent:
                    self._fs.makedirs(parent, exist_ok=True)
                self._fs.put_file(self._spool_path, self._remote_temp)
                self._fs.mv(self._remote_temp, self._remote_path)
            except BaseException:
                self._remove_remote_temp()
                raise
            finally:
                _unlink_quietly(self._spool_path)

    def abort(self) -> None:
        """Drop the spool and any uploaded temporary object."""
        with self._lock:
            self._close_spool()
            _unlink_quietly(self._spool_path)
            self._remove_remote_temp()

    def _close_spool(self) -> None:
        fd = self._take_fd()
        if fd is not None:
            os.close(fd)

    def _remove_remote_temp(self) -> None:
        try:
            if self._fs.exists(self._remote_temp):
                self._fs.rm(self._remote_temp)
        except Exception:  # noqa: BLE001 - best effort; clean_stale removes it later
            pass


class GenericWriter(StorageWriter):
    """Writes checkpoints through any fsspec file system; see the module docstring.

    Args:
        protocol: the fsspec protocol (``"memory"``, ``"gcs"``, ...).
        storage_options: keyword arguments for ``fsspec.filesystem(protocol, ...)``.
    """

    def __init__(self, protocol: str, storage_options: dict[str, Any] | None = None) -> None:
        self.protocol = protocol
        check_storage_options(protocol, storage_options or {})
        self.fs = fsspec.filesystem(protocol, **(storage_options or {}))

    def _strip(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def begin(self, path: str, total_bytes: int) -> GenericWriteSession:
        """Start spooling a checkpoint for ``path``."""
        remote = self._strip(path)
        if self.fs.isdir(remote):
            raise IsADirectoryError(f"{path} is a directory; a checkpoint file path was expected")
        return GenericWriteSession(self.fs, path, remote)

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return bool(self.fs.exists(self._strip(path)))

    def open_read(self, path: str) -> BinaryIO:
        """Open ``path`` for reading through fsspec."""
        return self.fs.open(self._strip(path), "rb")

    def fingerprint(self, path: str) -> Hashable | None:
        """fsspec's ``ukey`` of ``path`` (a hash of its info: size, time stamps, checksum where the backend has
        one), asked afresh (the listing cache dropped first); None if it is missing or the backend cannot say."""
        remote = self._strip(path)
        try:
            self.fs.invalidate_cache(remote)
            return str(self.fs.ukey(remote))
        except Exception:  # noqa: BLE001 - missing, or no ukey for this backend: never serve from memory
            return None

    def remove(self, path: str) -> None:
        """Remove ``path`` (recursively for directories); missing is fine."""
        remote = self._strip(path)
        if self.fs.exists(remote):
            self.fs.rm(remote, recursive=True)

    def list_directory(self, path: str) -> list[DirectoryEntry]:
        """The entries of ``path`` as fsspec lists them (the listing cache dropped first)."""
        remote = self._strip(path)
        self.fs.invalidate_cache(remote)
        try:
            entries = self.fs.ls(remote, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [
            DirectoryEntry(posixpath.basename(e["name"].rstrip("/")), e.get("type") == "directory", _modified_time(e))
            for e in entries
            if e["name"].rstrip("/") != remote.rstrip("/")
        ]

    def clean_stale(self, directory: str, max_age_s: float = DEFAULT_STALE_AGE_S) -> list[str]:
        """Remove temporary objects of dead processes on this host, and others (another host's; one named without
        its writer) once older than ``max_age_s``."""
        remote = self._strip(directory)
        try:
            entries = self.fs.ls(remote, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        removed = []
        now = time.time()
        for entry in entries:
            name = entry["name"]
            basename = posixpath.basename(name)
            if not basename.endswith(TEMP_SUFFIX):
                continue
            leftover = parse_leftover_name(basename, TEMP_SUFFIX)  # None: named without its writer (older versions)
            modified = _modified_time(entry)
            age_s = None if modified is None else now - modified
            # This writer does not track its sessions: any temporary object of this process may be one in flight.
            if writer_gone(None if leftover is None else leftover.owner, age_s, max_age_s, tracks_own_writes=False):
                self.fs.rm(name)
                removed.append(name)
        return removed


#: Keys fsspec's own layer takes for every file system (passed on through ``**kwargs``, so no signature shows them).
FSSPEC_KEYS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"})


def declared_options(cls: type) -> set[str]:
    """Keyword options the ``__init__`` methods of ``cls`` and its bases declare (``*args``/``**kwargs`` excluded)."""
    accepted: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for name, parameter in inspect.signature(init).parameters.items():
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and name != "self":
                accepted.add(name)
    return accepted - {"args", "kwargs", "storage_options"}


def reject_unknown_options(options: dict[str, Any], accepted: set[str], owner: str, suggest: set[str]) -> None:
    """Raise for the first key of ``options`` not in ``accepted``, suggesting the closest of ``suggest``.

    Raises:
        ConfigError: naming the key, ``owner`` (what would have taken it), the closest name, and the fix.
    """
    for key in options:
        if key not in accepted:
            close = difflib.get_close_matches(key, sorted(suggest), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"storage_options key {key!r} is not an option of {owner}{hint}; fix DataStatesIO(storage_options=...)"
            )


def check_storage_options(protocol: str, options: dict[str, Any]) -> None:
    """Reject option names the protocol's file system does not take (fsspec would ignore them silently).

    Raises:
        ConfigError: naming the unknown key, the closest accepted one, and ``storage_options``.
    """
    cls = fsspec.get_filesystem_class(protocol)
    declared = declared_options(cls)
    if not declared:
        return  # the file system declares nothing: it takes any option
    accepted = declared | FSSPEC_KEYS
    reject_unknown_options(options, accepted, f"{cls.__name__} for {protocol}://", accepted)


def protocol_of(path: str) -> str | None:
    """The fsspec protocol of ``path`` (None for a plain local path)."""
    return split_protocol(path)[0]


def _modified_time(entry: dict[str, Any]) -> float | None:
    for key in ("mtime", "created", "LastModified", "last_modified"):
        value = entry.get(key)
        if value is None:
            continue
        return value.timestamp() if hasattr(value, "timestamp") else float(value)
    return None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
