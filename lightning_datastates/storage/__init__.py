"""Storage backends behind the :class:`~lightning_datastates.storage.base.StorageWriter` seam."""

from __future__ import annotations

from typing import Any

from lightning_datastates.config import DirectIO
from lightning_datastates.storage.base import StorageWriter
from lightning_datastates.storage.generic import GenericWriter, protocol_of
from lightning_datastates.storage.local import LocalWriter, is_local_path, local_path

__all__ = [
    "GenericWriter",
    "LocalWriter",
    "StorageWriter",
    "fsspec_storage_options",
    "is_local_path",
    "local_path",
    "writer_for",
    "writer_kind",
]


def writer_kind(path: str) -> str:
    """Which writer :func:`writer_for` builds for ``path``: ``""`` for a local path, else its protocol. Paths of one
    kind share a writer (with the same settings)."""
    if is_local_path(path):
        return ""
    protocol = protocol_of(path)
    assert protocol is not None  # a path that is not local has a protocol
    return protocol


def writer_for(path: str, storage_options: dict[str, Any] | None = None, direct_io: DirectIO = False) -> StorageWriter:
    """The storage writer for ``path``'s protocol: POSIX for local paths, our multipart driver for ``s3://`` and
    ``s3a://`` (``storage_options`` may also hold its settings, see :data:`~lightning_datastates.storage.s3.TUNABLES`),
    fsspec for any other protocol. ``direct_io`` (``"auto"``, True or False) asks local writes to use ``O_DIRECT``
    (see :class:`LocalWriter`).

    Raises:
        ValueError: the protocol is unknown to fsspec, or s3fs is missing (the message names the package to install).
    """
    protocol = writer_kind(path)
    if not protocol:
        return LocalWriter(direct_io=direct_io)
    if protocol in ("s3", "s3a"):
        from lightning_datastates.storage.s3 import S3Writer  # imports s3fs only when a writer is built

        try:
            return S3Writer.from_storage_options(storage_options)
        except ImportError as exc:
            raise ValueError(
                f"cannot write checkpoints to {path!r}: s3fs is not installed; pip install lightning-datastates[s3]"
            ) from exc
    try:
        return GenericWriter(protocol, storage_options)
    except (ImportError, ValueError, TypeError) as exc:  # TypeError: a misspelt storage_options key
        raise ValueError(
            f"cannot write checkpoints to {path!r}: no usable fsspec file system for {protocol!r}:// ({exc}). "
            "Install its fsspec package (s3fs, gcsfs, adlfs, ...), fix the URL, or check the keys of "
            "DataStatesIO(storage_options=...)."
        ) from exc


def fsspec_storage_options(path: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The options to open ``path``'s file system with fsspec (for a reader of our files, such as DCP's, and for
    ``ModelCheckpoint``): the plugin's ``storage_options``; for S3 without the writer's own settings
    (:data:`~lightning_datastates.storage.s3.TUNABLES`), which s3fs would pass on to botocore and fail on, and with
    botocore's timeouts at its ``timeout_s`` (see :func:`~lightning_datastates.storage.s3.client.shared_options`)."""
    if writer_kind(path) in ("s3", "s3a"):
        from lightning_datastates.storage.s3.client import shared_filesystem_options  # imports no s3fs

        return shared_filesystem_options(storage_options)
    return dict(storage_options or {})
