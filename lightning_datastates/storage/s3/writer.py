"""The S3 writer: begins upload sessions, reads, checks and removes objects, cleans up after crashed runs.

It ties together the part plan (:mod:`~lightning_datastates.storage.s3.parts`), the upload session
(:mod:`~lightning_datastates.storage.s3.session`), the client (:mod:`~lightning_datastates.storage.s3.client`), the
ranged reads (:mod:`~lightning_datastates.storage.s3.reads`), the deletion of a directory's files
(:mod:`~lightning_datastates.storage.s3.deletes`) and the upload markers
(:mod:`~lightning_datastates.storage.s3.markers`).

One writer serves many paths, saves, loads and threads: it owns its client (two s3fs file systems and their
connection pools), rebuilt in a forked child (s3fs file systems are not fork-safe), and the set of buckets it has
seen exist.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Hashable, Sequence
from typing import Any, BinaryIO

from lightning_datastates.config import DEFAULT_STALE_AGE_S, Size, parse_size
from lightning_datastates.errors import ConfigError
from lightning_datastates.storage.base import DirectoryEntry, StorageWriter
from lightning_datastates.storage.s3 import deletes, reads
from lightning_datastates.storage.s3.client import (
    DEFAULT_MIN_BYTES_PER_S,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    ERROR_HINTS,
    S3Client,
    S3NotFoundError,
    check_s3_options,
    split_tunables,
)
from lightning_datastates.storage.s3.markers import OPEN_UPLOADS, clean_stale_uploads, write_marker
from lightning_datastates.storage.s3.parts import MiB, plan_parts
from lightning_datastates.storage.s3.session import S3WriteSession


class S3Writer(StorageWriter):
    """Writes checkpoints to ``s3://`` (and ``s3a://``) with a multipart driver of its own (see
    :mod:`~lightning_datastates.storage.s3`), and reads them back with concurrent ranged GETs.

    Args:
        storage_options: keyword arguments for ``s3fs.S3FileSystem`` (``endpoint_url``, ``key``, ``secret``, ...).
            Without them s3fs reads the standard AWS variables, ``AWS_ENDPOINT_URL`` included.
        part_size_bytes: bytes per part (int or ``"64MiB"``; default 16 MiB), clamped to S3's limits.
        max_concurrent_parts: parts uploaded (or ranges read) at once per checkpoint (default 8).
        retries: retries of each request after its first attempt, with exponential backoff from 1 s (default 3);
            each retry is logged as a warning.
        timeout_s: the longest the endpoint may stay silent in an attempt: to connect, to begin its answer once the
            request was sent, and between bytes of the answer; also the whole attempt of a request that moves no data
            (a listing, a HEAD, a DELETE, ...). Default 10 s: a never-answering endpoint fails a request in about a
            minute with the default ``retries`` (:meth:`S3Client.worst_case_s`).
        min_bytes_per_s: the slowest link tolerated, in bytes per second (int or ``"2MiB"``; default 2 MiB): an
            attempt moving ``n`` bytes (a part, a ranged GET) may take
            ``timeout_s + n * max_concurrent_parts / min_bytes_per_s`` (the parts in flight share the link).
        read_range_bytes: bytes per ranged GET when loading (int or ``"64MiB"``); default None: the object split
            evenly over ``max_concurrent_parts`` ranges, each at least 8 MiB and at most 256 MiB.

    Raises:
        ConfigError: a setting or a ``storage_options`` key is invalid.
        ImportError: s3fs is not installed.
    """

    #: Concurrent ranged GETs beat s3fs's buffered stream even when nothing is verified.
    prefers_whole_reads = True

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        *,
        part_size_bytes: Size = 16 * MiB,
        max_concurrent_parts: int = 8,
        retries: int = DEFAULT_RETRIES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        min_bytes_per_s: Size = DEFAULT_MIN_BYTES_PER_S,
        read_range_bytes: Size | None = None,
    ) -> None:
        self.part_size_bytes = parse_size(part_size_bytes, "part_size_bytes")
        self.read_range_bytes = None if read_range_bytes is None else parse_size(read_range_bytes, "read_range_bytes")
        self.max_concurrent_parts = _check_int(max_concurrent_parts, "max_concurrent_parts", 1, 1000)
        self.retries = _check_int(retries, "retries", 0, 100)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ConfigError(f"timeout_s must be a positive, finite number of seconds (such as 10), got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.min_bytes_per_s = parse_size(min_bytes_per_s, "min_bytes_per_s")
        self.storage_options = dict(storage_options or {})
        check_s3_options(self.storage_options)
        self._lock = threading.Lock()  # guards the client (rebuilt after a fork) and the known buckets
        self._pid = os.getpid()
        self._client = self._new_client()
        #: Buckets known to exist: the check costs one request per bucket and writer.
        self._known_buckets: set[str] = set()
        #: Whether the service takes ``DeleteObjects`` requests (learned at the first refusal).
        self._delete_support = deletes.DeleteSupport()

    @classmethod
    def from_storage_options(cls, storage_options: dict[str, Any] | None) -> S3Writer:
        """A writer from ``DataStatesIO(storage_options=...)``: the :data:`TUNABLES` keys set the writer, the rest
        go to s3fs."""
        options, tunables = split_tunables(storage_options)
        return cls(options, **tunables)

    @property
    def client(self) -> S3Client:
        """This writer's client; a new one in a forked child (the parent's event loop and connections are not
        there)."""
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._client = os.getpid(), self._new_client()
                self._known_buckets.clear()
            return self._client

    @property
    def fs(self) -> Any:
        """s3fs's shared file system for these ``storage_options`` (metadata and plain reads)."""
        return self.client.fs

    def _new_client(self) -> S3Client:
        return S3Client(
            self.storage_options,
            retries=self.retries,
            timeout_s=self.timeout_s,
            min_bytes_per_s=self.min_bytes_per_s,
            concurrency=self.max_concurrent_parts,
        )

    # ------------------------------------------------------------------ writing
    def copy_shape(self, window_bytes: int, streams: int) -> tuple[int, int]:
        """One part per ``write_range`` (uploaded in place from the caller's buffer), ``max_concurrent_parts`` at
        once: each call returns once its part is stored, so fewer calls in flight would leave the link idle."""
        return self.part_size_bytes, self.max_concurrent_parts

    def begin(self, path: str, total_bytes: int) -> S3WriteSession:
        """Plan the parts and, for a file of more than one part, create the multipart upload and start writing its
        marker.

        Raises:
            S3WriteError: the upload cannot be started (no such bucket, no access, endpoint down).
            ValueError: ``path`` names no key, or the file is too large for S3.
        """
        client = self.client
        bucket, key = client.split(path)
        if not key:
            raise ValueError(f"{path} names a bucket, not an object; a checkpoint file path was expected")
        plan = plan_parts(total_bytes, self.part_size_bytes)
        self._check_bucket(client, bucket, path)
        upload_id, marker = None, None
        if plan.multipart:
            response = client.run(
                f"starting the upload of {path}",
                lambda: client.call("create_multipart_upload", Bucket=bucket, Key=key),
            )
            upload_id = str(response["UploadId"])
            OPEN_UPLOADS.add(upload_id)
            marker = write_marker(client, path, bucket, key, upload_id)
        return S3WriteSession(client, self.max_concurrent_parts, path, bucket, key, plan, upload_id, marker)

    def check_directory(self, directory: str) -> None:
        """At setup: the bucket of ``directory`` exists and the credentials are found (one ``HeadBucket`` request, with
        the writer's retries and timeouts; the bucket is then known, the first save does not ask again).

        Raises:
            S3NotFoundError: no such bucket (the message says to create it or fix the URL).
            S3WriteError: the request failed: no credentials (the message says where they come from), access denied,
                an endpoint that does not answer.
        """
        client = self.client
        bucket, _ = client.split(directory)
        self._check_bucket(client, bucket, directory)

    def _check_bucket(self, client: S3Client, bucket: str, path: str) -> None:
        """Fail at the save call, not in the background, when the bucket does not exist (checked once per bucket).

        Raises:
            S3NotFoundError: no such bucket (the message says to create it or fix the URL).
        """
        with self._lock:
            if bucket in self._known_buckets:
                return
        try:
            client.run(f"checking the bucket of {path}", lambda: client.call("head_bucket", Bucket=bucket))
        except S3NotFoundError as exc:
            raise S3NotFoundError(
                f"cannot write {path}: bucket {bucket!r} does not exist; {ERROR_HINTS['NoSuchBucket']}"
            ) from exc.__cause__
        with self._lock:
            self._known_buckets.add(bucket)

    # ------------------------------------------------------------------ committed objects
    def exists(self, path: str) -> bool:
        """Whether an object (or a "directory" prefix) exists at ``path``; asks S3 (a HEAD, then a listing of one
        key), not a listing cache, with this writer's timeout and retries.

        Raises:
            S3WriteError: a request failed (after retries).
        """
        client = self.client
        bucket, key = client.split(path)
        key = key.rstrip("/")
        if not key:
            client.invalidate(path)
            return bool(client.fs.exists(client.strip(path)))  # a bucket
        if self._head(path, bucket, key) is not None:
            return True
        prefix = key + "/"
        page = client.run(
            f"listing {path}/",
            lambda: client.call("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1),
            missing_ok=True,
        )
        return bool(page and page.get("Contents"))

    def fingerprint(self, path: str) -> Hashable | None:
        """ETag, size and modification time of the object at ``path`` (one HEAD request); None if it is missing."""
        head = self._head(path, *self.client.split(path))
        return None if head is None else (str(head["ETag"]), int(head["ContentLength"]), str(head.get("LastModified")))

    def _head(self, path: str, bucket: str, key: str) -> dict[str, Any] | None:
        """The ``HeadObject`` answer for ``key`` (of ``path``), with this writer's timeout and retries; None if there
        is no such object."""
        client = self.client
        head: dict[str, Any] | None = client.run(
            f"looking up {path}", lambda: client.call("head_object", Bucket=bucket, Key=key), missing_ok=True
        )
        return head

    def remove(self, path: str) -> None:
        """Delete the object at ``path`` and every object under ``path/`` (sharded checkpoints); missing is fine.

        Raises:
            S3WriteError: a request failed, or S3 refused to delete some objects (the first named).
        """
        client = self.client
        if not client.split(path)[1]:
            raise ValueError(f"refusing to remove the whole bucket {path}")
        deletes.delete_tree(client, path, self._delete_support)

    def remove_files(self, directory: str, names: Sequence[str]) -> None:
        """Delete the objects ``directory/name``: files only, so without the listing :meth:`remove` makes for a
        directory; one ``DeleteObjects`` request per 1000 keys (see :mod:`~lightning_datastates.storage.s3.deletes`);
        missing ones are fine. A sharded commit removes its files this way.

        Raises:
            S3WriteError: a request failed, or S3 refused to delete some objects (the first named).
        """
        deletes.delete_files(self.client, directory, names, self._delete_support)

    def list_directory(self, path: str) -> list[DirectoryEntry]:
        """The objects and common prefixes directly under ``path/`` (one ``ListObjectsV2`` per 1000 entries).

        Raises:
            S3WriteError: a listing request failed (after retries).
        """
        client = self.client
        bucket, key = client.split(path)
        prefix = key.rstrip("/") + "/" if key else ""

        async def listing() -> list[DirectoryEntry]:
            entries: list[DirectoryEntry] = []
            token: dict[str, str] = {}
            while True:
                page = await client.call("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", **token)
                for common in page.get("CommonPrefixes", []):
                    entries.append(DirectoryEntry(common["Prefix"][len(prefix) :].rstrip("/"), True, None))
                for item in page.get("Contents", []):
                    modified = item.get("LastModified")
                    stamp = None if modified is None else float(modified.timestamp())
                    entries.append(DirectoryEntry(item["Key"][len(prefix) :], False, stamp))
                if not page.get("IsTruncated"):
                    return [e for e in entries if e.name]
                token = {"ContinuationToken": page["NextContinuationToken"]}

        return client.run(f"listing {path}", listing, missing_ok=True) or []

    def clean_stale(self, directory: str, max_age_s: float = DEFAULT_STALE_AGE_S) -> list[str]:
        """Abort the open multipart uploads that crashed runs left for keys directly in ``directory``; return their
        ``s3://`` paths (see :func:`~lightning_datastates.storage.s3.markers.clean_stale_uploads`)."""
        return clean_stale_uploads(self.client, directory, max_age_s)

    # ------------------------------------------------------------------ reading
    def open_read(self, path: str) -> BinaryIO:
        """A buffered s3fs file reading ``path`` (:meth:`read_bytes` is the fast way to load a whole file)."""
        client = self.client
        client.invalidate(path)
        return client.fs.open(client.strip(path), "rb")

    def open_local(self, path: str, *, read_ahead: bool = False) -> BinaryIO | None:
        """The object at ``path`` fetched with concurrent ranged GETs into an anonymous in-memory file (Linux's
        ``memfd_create``), open for reading; None where that does not exist (then :meth:`read_bytes`).

        Raises:
            S3NotFoundError: nothing at ``path`` (a ``FileNotFoundError``).
            S3WriteError: a request failed (after retries).
        """
        if not hasattr(os, "memfd_create"):
            return None
        return os.fdopen(reads.fetch_into_memfd(self, path), "rb")

    def read_tail(self, path: str, nbytes: int) -> bytes:
        """The last ``nbytes`` bytes of the object at ``path`` (one ranged GET).

        Raises:
            S3NotFoundError: nothing at ``path`` (a ``FileNotFoundError``).
            S3WriteError: the request failed (after retries).
        """
        return reads.read_tail(self.client, path, nbytes)

    def read_bytes(self, path: str) -> bytearray:
        """The whole object at ``path`` in a new ``bytearray`` (concurrent ranged GETs, see :meth:`read_into`).

        Raises:
            S3NotFoundError: nothing at ``path`` (a ``FileNotFoundError``).
            S3WriteError: a request failed (after retries).
        """
        return reads.read_bytes(
            self.client, path, max_concurrent_parts=self.max_concurrent_parts, read_range_bytes=self.read_range_bytes
        )

    def read_into(self, path: str, allocate: reads.Allocate) -> int:
        """Fetch the whole object at ``path`` into ``allocate(size)`` (a writable byte view of exactly ``size``
        bytes) with concurrent ranged GETs, ``max_concurrent_parts`` at once, of :meth:`range_bytes_for` bytes each;
        return the size. An object replaced meanwhile is read again (``allocate`` is called again).

        Raises:
            S3NotFoundError: nothing at ``path`` (a ``FileNotFoundError``).
            S3WriteError: a request failed (after retries).
        """
        return reads.read_into(
            self.client,
            path,
            allocate,
            max_concurrent_parts=self.max_concurrent_parts,
            read_range_bytes=self.read_range_bytes,
        )

    def range_bytes_for(self, size: int) -> int:
        """Bytes per ranged GET for an object of ``size`` bytes (see
        :func:`~lightning_datastates.storage.s3.reads.range_bytes_for`)."""
        return reads.range_bytes_for(size, self.max_concurrent_parts, self.read_range_bytes)


def _check_int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an int from {low} to {high}, got {value!r}")
    return value
