"""S3 writer: our own multipart driver on s3fs's async client.

Commit protocol: ``begin`` creates a multipart upload; the file is cut into parts of fixed byte ranges
``[i*P, (i+1)*P)``; ``write_range`` (any order, several threads) uploads every part its range holds whole straight
from the caller's memory (the host arena: no copy) and returns once those parts are stored; the bytes of parts it
covers only in part are copied into per-part pieces, and the moment such a part has all its bytes its
``upload_part`` is scheduled. Part uploads run on s3fs's event loop, at most ``max_concurrent_parts`` at a time;
``complete`` waits for every part and sends ``CompleteMultipartUpload`` with the ETags in part order. S3 shows
nothing under the key before that call and the whole object after it, so it is the commit. ``abort`` (and any
failure) sends ``AbortMultipartUpload``: an open upload is invisible but billed.
A file of at most one part (an empty one too) is sent as one ``PutObject`` at ``complete`` instead.

Leftovers: S3 lists open multipart uploads with neither host nor process, so each upload gets a small hidden
*marker* object beside its key, ``.<name>.<host>.<pid>.<token>.datastates-upload`` holding the UploadId, written
right after ``CreateMultipartUpload`` and deleted once the upload is completed or aborted. ``clean_stale`` aborts
the uploads whose marker names a dead process of this host at once, and other uploads (another host, or a writer
killed before its marker landed) once older than ``max_age_s``.

Why not s3fs's own writer (see DESIGN.md, storage facts): ``with fs.open(p, "wb")`` commits what was written
when the block raises, and so does a garbage-collected file; its parts go one at a time; ``pipe_file`` wants
``bytes`` and fixed 50 MiB parts. Retries and timeouts are ours: the file system used for data has s3fs's and
botocore's retries turned off, so ``retries=1`` means one retry, not 1 x 5 x 5.

Memory: a session holds only copies of partly received parts not yet uploaded, plus the bodies of the parts being
sent; a part's body is assembled when its last byte arrives. Whole parts are read from the caller's buffer in place,
which the caller keeps until ``write_range`` returns (the engine frees an arena block only then). ``write_range``
also waits (back-pressure) while more than ``2 * max_concurrent_parts`` complete parts are queued for upload; it
never waits for incomplete parts.

s3fs is imported when an :class:`S3Writer` is built, so this module imports without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import os
import random
import re
import threading
import uuid
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, BinaryIO

import fsspec.asyn

from lightning_datastates.config import Size, parse_size
from lightning_datastates.errors import ConfigError
from lightning_datastates.storage.base import DEFAULT_STALE_AGE_S, StorageWriter, WriteSession
from lightning_datastates.storage.generic import FSSPEC_KEYS, declared_options, reject_unknown_options
from lightning_datastates.storage.local import _host_tag, _pid_alive
from lightning_datastates.streams import BufferReader

log = logging.getLogger("lightning_datastates")

MiB = 1024**2
#: S3's limits: parts of 5 MiB to 5 GiB (the last may be smaller), at most 10,000 parts, objects up to 5 TiB.
MIN_PART_BYTES = 5 * MiB
MAX_PART_BYTES = 5 * 1024**3
MAX_PARTS = 10_000
MAX_OBJECT_BYTES = 5 * 1024**4
#: Open multipart uploads whose writer cannot be asked are aborted by ``clean_stale`` once this old (by default).
STALE_UPLOAD_AGE_S = DEFAULT_STALE_AGE_S
#: Suffix of the marker objects naming the process behind an open multipart upload (see the module docstring).
UPLOAD_MARKER_SUFFIX = ".datastates-upload"
_MARKER_PATTERN = re.compile(
    r"^\.(?P<name>.+)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.(?P<token>[0-9a-f]{8})" + re.escape(UPLOAD_MARKER_SUFFIX) + "$"
)
#: Fixes to suggest for S3 error codes that a user can act on.
_ERROR_HINTS = {
    "NoSuchBucket": "create the bucket or fix the bucket name in the checkpoint URL",
    "AccessDenied": "check the credentials (storage_options key/secret or the AWS_* variables) and the bucket policy",
    "InvalidAccessKeyId": "check the credentials (storage_options key/secret or the AWS_* variables)",
    "SignatureDoesNotMatch": "check the credentials (storage_options key/secret or the AWS_* variables)",
}
#: Settings of the writer itself, accepted in ``storage_options`` beside the s3fs options.
TUNABLES = ("part_size_bytes", "max_concurrent_parts", "retries", "timeout_s", "read_range_bytes")
#: Largest ranged GET :meth:`S3Writer.range_bytes_for` picks by itself (``read_range_bytes`` unset).
MAX_AUTO_RANGE_BYTES = 256 * MiB
#: s3fs options that would break the synchronous driver.
_REJECTED_KEYS = {"asynchronous", "loop"}
_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 10.0
_RETRYABLE_CODES = {
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "XAmzContentSHA256Mismatch",
    "BadDigest",
}

#: botocore errors (matched by name: botocore is imported by s3fs, not here) that no retry can fix.
_PERMANENT_ERRORS = {
    "ParamValidationError",
    "NoCredentialsError",
    "PartialCredentialsError",
    "NoRegionError",
    "UnknownServiceError",
    "InvalidConfigError",
}

#: Multipart uploads this process has open: ``clean_stale`` never aborts them, however old.
_OPEN_UPLOADS: set[str] = set()
_OPEN_UPLOADS_LOCK = threading.Lock()
#: (data file system, bucket) pairs known to exist: the bucket check costs one request per bucket and process.
_KNOWN_BUCKETS: set[tuple[int, str]] = set()


class S3WriteError(OSError):
    """An S3 request for a checkpoint failed; the message names the ``s3://`` path, the cause is chained."""


class S3NotFoundError(S3WriteError, FileNotFoundError):
    """The bucket, the object or the upload does not exist."""


# ---------------------------------------------------------------------------------------------------- part plan
@dataclass(frozen=True)
class PartPlan:
    """How a file of ``total_bytes`` is cut into parts: part ``i`` holds bytes ``[i*part_bytes, (i+1)*part_bytes)``."""

    total_bytes: int
    part_bytes: int
    count: int

    @property
    def multipart(self) -> bool:
        """Whether the file goes up as a multipart upload (more than one part) rather than one ``PutObject``."""
        return self.count > 1

    def length(self, index: int) -> int:
        """Bytes in part ``index`` (the last one may be shorter)."""
        return min(self.part_bytes, self.total_bytes - index * self.part_bytes)


def plan_parts(total_bytes: int, part_size_bytes: int) -> PartPlan:
    """Cut ``total_bytes`` into parts of about ``part_size_bytes``, within S3's limits.

    The part size is clamped to [5 MiB, 5 GiB] and grown (to whole MiB) when the file would need more than
    10,000 parts.

    Raises:
        ValueError: the file is larger than S3's 5 TiB object limit, or ``total_bytes`` is negative.
    """
    if total_bytes < 0:
        raise ValueError(f"total_bytes must be >= 0, got {total_bytes}")
    if total_bytes > MAX_OBJECT_BYTES:
        raise ValueError(f"a checkpoint of {total_bytes} bytes is larger than S3's 5 TiB object limit")
    part = min(max(part_size_bytes, MIN_PART_BYTES), MAX_PART_BYTES)
    if math.ceil(total_bytes / part) > MAX_PARTS:
        part = math.ceil(math.ceil(total_bytes / MAX_PARTS) / MiB) * MiB
    return PartPlan(total_bytes, part, max(1, math.ceil(total_bytes / part)))


# ---------------------------------------------------------------------------------------------------- session
_OPEN, _COMPLETING, _COMPLETED, _ABORTED = "open", "completing", "completed", "aborted"


class S3WriteSession(WriteSession):
    """One checkpoint going up to S3; see the module docstring.

    Thread model: ``write_range`` from several writer threads at once; ``complete`` or ``abort`` from one thread
    after the last ``write_range`` returned; part uploads run as tasks on s3fs's event loop.
    """

    def __init__(
        self,
        writer: S3Writer,
        path: str,
        bucket: str,
        key: str,
        plan: PartPlan,
        upload_id: str | None,
        marker: UploadMarker | None = None,
    ):
        self.path = path
        self.bucket = bucket
        self.key = key
        self.plan = plan
        self.upload_id = upload_id
        self.marker = marker
        self._writer = writer
        self._loop = writer.loop
        self._cond = threading.Condition()
        self._state = _OPEN
        self._pieces: dict[int, list[tuple[int, bytes]]] = {}  # part -> (offset in part, bytes) received so far
        self._received = [0] * plan.count
        self._futures: dict[int, concurrent.futures.Future[str | None]] = {}
        self._etags: dict[int, str] = {}
        self._queued = 0  # parts scheduled for upload and not yet finished
        self._error: BaseException | None = None  # first failed part
        self._aborting = False  # read by part tasks on the event loop
        self._tasks: set[asyncio.Task[Any]] = set()  # part tasks running on the loop (touched only there)
        self._semaphore = asyncio.Semaphore(writer.max_concurrent_parts)  # binds to the loop at first use

    # ------------------------------------------------------------------ writer threads
    def write_range(self, offset: int, data: memoryview) -> None:
        """Upload every part that ``data`` holds whole straight from ``data`` (no copy) and return once they are
        stored; copy the bytes of parts it covers only in part into their pieces, and schedule every part those
        complete.

        Raises:
            S3WriteError: a part upload failed (naming the path and the part).
            RuntimeError: the session already ended.
            ValueError: the range lies outside the file or overlaps bytes already written.
        """
        view = memoryview(data).cast("B")
        end = offset + view.nbytes
        if offset < 0 or end > self.plan.total_bytes:
            raise ValueError(f"{self.path}: range [{offset}, {end}) outside a file of {self.plan.total_bytes} bytes")
        self._wait_for_room()
        part_bytes = self.plan.part_bytes
        position = offset
        ready: list[tuple[int, bytes | bytearray | memoryview]] = []
        borrowed: list[int] = []  # parts sent from the caller's memory: waited for before returning
        while position < end:
            index = position // part_bytes
            stop = min(end, (index + 1) * part_bytes)
            length = self.plan.length(index)
            whole = position == index * part_bytes and stop - position == length and self.plan.multipart
            # A partial piece is copied: the caller reuses its buffer as soon as this returns.
            piece = view[position - offset : stop - offset] if whole else bytes(view[position - offset : stop - offset])
            with self._cond:
                self._check_open()
                self._received[index] += len(piece)
                if self._received[index] > length:
                    raise ValueError(f"{self.path}: overlapping writes in part {index + 1}")
                if whole:
                    ready.append((index, piece))
                    borrowed.append(index)
                else:
                    self._pieces.setdefault(index, []).append((position - index * part_bytes, piece))  # type: ignore[arg-type]
                    if self._received[index] == length and self.plan.multipart:
                        ready.append((index, _assemble(length, self._pieces.pop(index))))
            position = stop
        for index, body in ready:
            self._schedule(index, body)
        if borrowed:
            with self._cond:
                futures = [self._futures[i] for i in borrowed if i in self._futures]
            concurrent.futures.wait(futures)  # bounded: every attempt has a timeout; abort cancels them
            with self._cond:
                self._raise_part_error()
                self._check_open()

    def _wait_for_room(self) -> None:
        """Back-pressure: wait while too many complete parts are queued (those always finish, by timeouts)."""
        with self._cond:
            while self._queued > 2 * self._writer.max_concurrent_parts and self._error is None:
                self._check_open()
                self._cond.wait(1.0)
            self._raise_part_error()
            self._check_open()

    def _schedule(self, index: int, body: bytes | bytearray | memoryview) -> None:
        with self._cond:
            if self._state == _ABORTED:
                return  # aborted meanwhile: the part would only be refused
            self._queued += 1
            upload = self._upload_part(index, body, self.upload_id)
            future = asyncio.run_coroutine_threadsafe(upload, self._loop)
            self._futures[index] = future
        # Outside the lock: a future already done runs the callback right here, and the callback takes the lock.
        future.add_done_callback(lambda done: self._part_done(index, done))

    # ------------------------------------------------------------------ event loop
    async def _upload_part(self, index: int, body: bytes | bytearray | memoryview, upload_id: str | None) -> str | None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            async with self._semaphore:  # the window of concurrent parts
                if self._aborting:
                    return None
                number = index + 1
                response = await self._writer._with_retries(
                    f"uploading part {number}/{self.plan.count} of {self.path}",
                    lambda: self._writer._call(
                        "upload_part",
                        Bucket=self.bucket,
                        Key=self.key,
                        UploadId=upload_id,
                        PartNumber=number,
                        # botocore takes bytes or a file, not a memoryview: a reader over the caller's memory, new
                        # for every attempt (a retry reads from the start).
                        Body=BufferReader(body) if isinstance(body, memoryview) else body,
                    ),
                )
                return str(response["ETag"])
        finally:
            self._tasks.discard(task)

    def _part_done(self, index: int, future: concurrent.futures.Future[str | None]) -> None:
        with self._cond:
            self._queued -= 1
            if not future.cancelled():
                error = future.exception()
                if error is not None:
                    if self._error is None and not self._aborting:
                        self._error = error
                        self._aborting = True  # the commit cannot happen now: queued parts need not be sent
                elif future.result() is not None:
                    self._etags[index] = future.result()  # type: ignore[assignment]
            self._cond.notify_all()

    async def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # ------------------------------------------------------------------ commit / abort
    def complete(self) -> None:
        """Wait for every part, then ``CompleteMultipartUpload`` (or one ``PutObject`` for a small file).

        Raises:
            S3WriteError: a part or the commit failed; the upload is aborted and nothing became visible.
            RuntimeError: the session already ended.
        """
        with self._cond:
            if self._state != _OPEN:
                raise RuntimeError(f"{self.path}: session already ended")
            self._state = _COMPLETING
            futures = list(self._futures.values())
        try:
            missing = self.plan.total_bytes - sum(self._received)
            if missing:
                raise S3WriteError(f"{self.path}: {missing} bytes were never written; not committing")
            if not self.plan.multipart:
                body = _assemble(self.plan.total_bytes, self._pieces.pop(0, []))
                self._writer._run(
                    f"uploading {self.path}",
                    lambda: self._writer._call("put_object", Bucket=self.bucket, Key=self.key, Body=body),
                )
            else:
                concurrent.futures.wait(futures)  # bounded: every attempt of every part has a timeout
                with self._cond:
                    self._raise_part_error()
                    parts = [{"PartNumber": i + 1, "ETag": self._etags[i]} for i in range(self.plan.count)]
                self._writer._run(
                    f"committing {self.path}",
                    lambda: self._writer._call(
                        "complete_multipart_upload",
                        Bucket=self.bucket,
                        Key=self.key,
                        UploadId=self.upload_id,
                        MultipartUpload={"Parts": parts},
                    ),
                )
                _forget_upload(self.upload_id)
                self._drop_marker()
            with self._cond:
                self._state = _COMPLETED
        except BaseException:
            with self._cond:
                self._state = _ABORTED
                self._cond.notify_all()
            try:
                self._abort_upload()
            except Exception:  # the failure that stopped the commit is the one to raise
                log.exception(
                    "lightning_datastates: could not abort the multipart upload of %s (its parts are stored, and "
                    "billed, until aborted); the next run's setup aborts it once an hour old",
                    self.path,
                )
            raise
        finally:
            self._pieces.clear()
            self._writer._invalidate(self.path)

    def abort(self) -> None:
        """Stop and cancel part uploads, then ``AbortMultipartUpload``; safe to call more than once.

        Raises:
            S3WriteError: the abort request failed (the open upload is removed later by ``clean_stale``).
        """
        with self._cond:
            if self._state in (_ABORTED, _COMPLETED):
                return  # after a commit, abort must not touch the committed object
            self._state = _ABORTED
            self._pieces.clear()
            self._cond.notify_all()
        self._abort_upload()

    def _abort_upload(self) -> None:
        self._aborting = True  # queued parts return at once; failures from here on are expected
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is None:
            return
        with self._cond:
            futures = list(self._futures.values())
        # Parts still running would land after the abort (S3 then keeps them, billed): cancel them and wait.
        fsspec.asyn.sync(self._loop, self._cancel_tasks)
        concurrent.futures.wait(futures, timeout=self._writer.timeout_s)
        try:
            # Run as its own task on the loop: an interrupted caller (or cancelled part tasks) cannot stop it.
            self._writer._run(
                f"aborting the upload of {self.path}",
                lambda: self._writer._call(
                    "abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id
                ),
                missing_ok=True,
            )
        except S3WriteError as exc:
            raise S3WriteError(
                f"{exc}; multipart upload {upload_id} stays open until clean_stale removes it (once this process "
                f"ended, or after {STALE_UPLOAD_AGE_S / 3600:g} h from another host)"
            ) from exc.__cause__
        else:
            self._drop_marker()  # only once the upload is gone: the marker tells clean_stale whose upload it is
        finally:
            _forget_upload(upload_id)
            with self._cond:
                self._futures.clear()

    def _drop_marker(self) -> None:
        """Delete the upload's marker (best effort: ``clean_stale`` removes markers left behind)."""
        marker, self.marker = self.marker, None
        if marker is None:
            return
        try:
            marker.written.result(timeout=self._writer.timeout_s)
            self._writer._run(
                f"removing the upload marker of {self.path}",
                lambda: self._writer._call("delete_object", Bucket=self.bucket, Key=marker.key),
                missing_ok=True,
            )
        except Exception:
            log.warning("lightning_datastates: could not remove the upload marker of %s", self.path, exc_info=True)

    # ------------------------------------------------------------------ helpers (call with the lock held)
    def _check_open(self) -> None:
        if self._state != _OPEN:
            raise RuntimeError(f"write to {self.path} after its session ended")

    def _raise_part_error(self) -> None:
        if self._error is not None:
            raise S3WriteError(str(self._error)) from self._error


def _assemble(length: int, pieces: list[tuple[int, bytes]]) -> bytes | bytearray:
    """A part's body from its pieces (no copy when one piece is the whole part)."""
    if len(pieces) == 1 and len(pieces[0][1]) == length:
        return pieces[0][1]
    body = bytearray(length)
    for offset, piece in pieces:
        body[offset : offset + len(piece)] = piece
    return body


@dataclass
class UploadMarker:
    """The marker object of one multipart upload; ``written`` completes once its ``PutObject`` ended."""

    key: str
    written: concurrent.futures.Future[Any]


def marker_key(key: str) -> str:
    """The key of the marker object for an upload to ``key`` by this process."""
    directory, _, name = key.rpartition("/")
    marker = f".{name}.{_host_tag()}.{os.getpid()}.{uuid.uuid4().hex[:8]}{UPLOAD_MARKER_SUFFIX}"
    return f"{directory}/{marker}" if directory else marker


@dataclass(frozen=True)
class MarkerInfo:
    """A marker found by ``clean_stale``: which host and process opened upload ``upload_id``."""

    key: str
    host: str
    pid: int
    upload_id: str
    modified: datetime | None


def _writer_gone(marker: MarkerInfo | None, age_s: float | None, max_age_s: float) -> bool:
    """Whether the writer of an upload (or marker) is certainly or presumably gone.

    This host's processes can be asked (this process itself calls only when it no longer writes the upload);
    others count as gone once the upload is older than ``max_age_s`` (an unknown age counts as old).
    """
    if marker is not None and marker.host == _host_tag():
        return marker.pid == os.getpid() or not _pid_alive(marker.pid)
    return age_s is None or age_s > max_age_s


def _forget_upload(upload_id: str | None) -> None:
    with _OPEN_UPLOADS_LOCK:
        _OPEN_UPLOADS.discard(upload_id or "")


# ---------------------------------------------------------------------------------------------------- writer
class S3Writer(StorageWriter):
    """Writes checkpoints to ``s3://`` (and ``s3a://``) with a multipart driver of its own; see the module docstring.

    Args:
        storage_options: keyword arguments for ``s3fs.S3FileSystem`` (``endpoint_url``, ``key``, ``secret``, ...).
            Without them s3fs reads the standard AWS variables, ``AWS_ENDPOINT_URL`` included.
        part_size_bytes: bytes per part (int or ``"64MiB"``; default 16 MiB), clamped to S3's limits.
        max_concurrent_parts: parts uploaded (or ranges read) at once per checkpoint (default 8).
        retries: retries of each request after its first attempt, with exponential backoff (default 3).
        timeout_s: limit of one attempt of one request (default 120 s).
        read_range_bytes: bytes per ranged GET when loading (int or ``"64MiB"``); default None: the object split
            evenly over ``max_concurrent_parts`` ranges, each at least 8 MiB and at most 256 MiB.
    """

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        *,
        part_size_bytes: Size = 16 * MiB,
        max_concurrent_parts: int = 8,
        retries: int = 3,
        timeout_s: float = 120.0,
        read_range_bytes: Size | None = None,
    ) -> None:
        self.part_size_bytes = parse_size(part_size_bytes, "part_size_bytes")
        self.read_range_bytes = None if read_range_bytes is None else parse_size(read_range_bytes, "read_range_bytes")
        self.max_concurrent_parts = _check_int(max_concurrent_parts, "max_concurrent_parts", 1, 1000)
        self.retries = _check_int(retries, "retries", 0, 100)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.storage_options = dict(storage_options or {})
        check_s3_options(self.storage_options)
        self.fs, self._data_fs = _filesystems(self.storage_options, self.timeout_s)
        self.loop = self._data_fs.loop

    @classmethod
    def from_storage_options(cls, storage_options: dict[str, Any] | None) -> S3Writer:
        """A writer from ``DataStatesIO(storage_options=...)``: the :data:`TUNABLES` keys set the writer, the rest
        go to s3fs."""
        options = dict(storage_options or {})
        tunables = {name: options.pop(name) for name in TUNABLES if name in options}
        return cls(options, **tunables)

    # ------------------------------------------------------------------ StorageWriter
    def begin(self, path: str, total_bytes: int) -> S3WriteSession:
        """Plan the parts and, for a file of more than one part, create the multipart upload.

        Raises:
            S3WriteError: the upload cannot be started (no such bucket, no access, endpoint down).
            ValueError: ``path`` names no key, or the file is too large for S3.
        """
        bucket, key = self._split(path)
        if not key:
            raise ValueError(f"{path} names a bucket, not an object; a checkpoint file path was expected")
        plan = plan_parts(total_bytes, self.part_size_bytes)
        self._check_bucket(bucket, path)
        upload_id, marker = None, None
        if plan.multipart:
            response = self._run(
                f"starting the upload of {path}",
                lambda: self._call("create_multipart_upload", Bucket=bucket, Key=key),
            )
            upload_id = str(response["UploadId"])
            with _OPEN_UPLOADS_LOCK:
                _OPEN_UPLOADS.add(upload_id)
            marker = self._write_marker(path, bucket, key, upload_id)
        return S3WriteSession(self, path, bucket, key, plan, upload_id, marker)

    def _check_bucket(self, bucket: str, path: str) -> None:
        """Fail at the save call, not in the background, when the bucket does not exist (checked once per bucket).

        Raises:
            S3NotFoundError: no such bucket (the message says to create it or fix the URL).
        """
        known = (id(self._data_fs), bucket)
        if known in _KNOWN_BUCKETS:
            return
        try:
            self._run(f"checking the bucket of {path}", lambda: self._call("head_bucket", Bucket=bucket))
        except S3NotFoundError as exc:
            raise S3NotFoundError(
                f"cannot write {path}: bucket {bucket!r} does not exist; {_ERROR_HINTS['NoSuchBucket']}"
            ) from exc.__cause__
        _KNOWN_BUCKETS.add(known)

    def _write_marker(self, path: str, bucket: str, key: str, upload_id: str) -> UploadMarker:
        """Start writing the marker of a new upload (not waited for here: it overlaps the first parts)."""
        marker = marker_key(key)
        request = self._with_retries(
            f"recording the upload of {path}",
            lambda: self._call("put_object", Bucket=bucket, Key=marker, Body=upload_id.encode()),
        )
        return UploadMarker(marker, asyncio.run_coroutine_threadsafe(request, self.loop))

    def exists(self, path: str) -> bool:
        """Whether an object (or a "directory" prefix) exists at ``path``; asks S3, not a listing cache."""
        self._invalidate(path)
        return bool(self.fs.exists(self._strip(path)))

    def fingerprint(self, path: str) -> Hashable | None:
        """ETag, size and modification time of the object at ``path`` (one HEAD request); None if it is missing."""
        bucket, key = self._split(path)
        try:
            head = self._run(f"looking up {path}", lambda: self._call("head_object", Bucket=bucket, Key=key))
        except S3NotFoundError:
            return None
        return (str(head["ETag"]), int(head["ContentLength"]), str(head.get("LastModified")))

    def remove(self, path: str) -> None:
        """Delete the object at ``path`` and every object under ``path/`` (sharded checkpoints); missing is fine.

        Raises:
            S3WriteError: a delete request failed.
        """
        bucket, key = self._split(path)
        if not key:
            raise ValueError(f"refusing to remove the whole bucket {path}")
        key = key.rstrip("/")
        try:
            self._run(f"removing {path}", lambda: self._call("delete_object", Bucket=bucket, Key=key), missing_ok=True)
            self._run(f"removing {path}/", lambda: self._delete_prefix(bucket, key + "/"), missing_ok=True)
        finally:
            self._invalidate(path)

    def open_read(self, path: str) -> BinaryIO:
        """A buffered s3fs file reading ``path`` (:meth:`read_bytes` is the fast way to load a whole file)."""
        self._invalidate(path)
        return self.fs.open(self._strip(path), "rb")

    def clean_stale(self, directory: str, max_age_s: float = STALE_UPLOAD_AGE_S) -> list[str]:
        """Abort the open multipart uploads that crashed runs left for keys directly in ``directory``; return their
        ``s3://`` paths.

        An upload whose marker names a process of this host that is dead (or this process, which no longer writes
        it) is aborted at once; any other upload not of this process once it is older than ``max_age_s``. Markers
        whose upload is gone are removed by the same rules.
        """
        bucket, prefix = self._split(directory)
        prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        try:
            uploads = self._run(f"listing open uploads in {directory}", lambda: self._list_uploads(bucket, prefix))
            markers = self._run(f"listing upload markers in {directory}", lambda: self._list_markers(bucket, prefix))
        except S3NotFoundError:
            return []  # no such bucket: nothing to clean
        now = datetime.now(timezone.utc)
        with _OPEN_UPLOADS_LOCK:
            ours = set(_OPEN_UPLOADS)
        writer_of = {marker.upload_id: marker for marker in markers}
        removed, aborted = [], set()
        for upload in uploads:
            key, upload_id, initiated = upload["Key"], upload["UploadId"], upload.get("Initiated")
            if "/" in key[len(prefix) :] or upload_id in ours:
                continue
            marker = writer_of.get(upload_id)
            age_s = None if initiated is None else (now - initiated).total_seconds()
            if not _writer_gone(marker, age_s, max_age_s):
                continue
            self._run(
                f"aborting the stale upload of s3://{bucket}/{key}",
                functools.partial(self._call, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id),
                missing_ok=True,
            )
            aborted.add(upload_id)
            removed.append(f"s3://{bucket}/{key}")
        still_open = {upload["UploadId"] for upload in uploads} - aborted
        for marker in markers:
            if marker.upload_id in still_open or marker.upload_id in ours:
                continue
            age_s = None if marker.modified is None else (now - marker.modified).total_seconds()
            if _writer_gone(marker, age_s, max_age_s):
                self._run(
                    f"removing the upload marker s3://{bucket}/{marker.key}",
                    functools.partial(self._call, "delete_object", Bucket=bucket, Key=marker.key),
                    missing_ok=True,
                )
        return removed

    async def _list_markers(self, bucket: str, prefix: str) -> list[MarkerInfo]:
        """The upload markers directly under ``prefix``, with the UploadId each one holds."""
        found: list[tuple[str, Any, re.Match[str]]] = []
        token: dict[str, str] = {}
        while True:
            page = await self._call("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", **token)
            for item in page.get("Contents", []):
                match = _MARKER_PATTERN.match(item["Key"][len(prefix) :])
                if match is not None:
                    found.append((item["Key"], item.get("LastModified"), match))
            if not page.get("IsTruncated"):
                break
            token = {"ContinuationToken": page["NextContinuationToken"]}

        async def read(key: str) -> str:
            response = await self._call("get_object", Bucket=bucket, Key=key)
            try:
                return (await response["Body"].read()).decode("ascii", "replace").strip()
            finally:
                response["Body"].close()

        bodies = await asyncio.gather(*(read(key) for key, _, _ in found), return_exceptions=True)
        markers = []
        for (key, modified, match), body in zip(found, bodies, strict=True):
            if isinstance(body, BaseException):
                continue  # removed meanwhile (its writer finished): nothing to decide
            markers.append(MarkerInfo(key, match["host"], int(match["pid"]), body, modified))
        return markers

    # ------------------------------------------------------------------ fast load
    def read_bytes(self, path: str) -> bytearray:
        """The whole object at ``path`` in a new ``bytearray`` (concurrent ranged GETs, see :meth:`read_into`).

        Raises:
            S3NotFoundError: nothing at ``path`` (a ``FileNotFoundError``).
            S3WriteError: a request failed (after retries).
        """
        buffers: list[bytearray] = []

        def allocate(size: int) -> memoryview:
            buffers[:] = [bytearray(size)]
            return memoryview(buffers[0])

        self.read_into(path, allocate)
        return buffers[0]

    def read_into(self, path: str, allocate: Callable[[int], memoryview]) -> int:
        """Fetch the whole object at ``path`` into ``allocate(size)`` (a writable byte view of exactly ``size``
        bytes) with concurrent ranged GETs, ``max_concurrent_parts`` at once, of :meth:`range_bytes_for` bytes each;
        return the size.

        Every range is read with ``If-Match`` on the ETag seen first, so an object replaced meanwhile is read
        again (``allocate`` is called again) instead of coming back torn.

        Raises:
            S3NotFoundError: nothing at ``path`` (a ``FileNotFoundError``).
            S3WriteError: a request failed (after retries).
        """
        bucket, key = self._split(path)
        for attempt in range(self.retries + 1):
            head = self._run(f"reading {path}", lambda: self._call("head_object", Bucket=bucket, Key=key))
            size, etag = int(head["ContentLength"]), str(head["ETag"])
            target = allocate(size)
            try:
                self._run(
                    f"reading {path}",
                    functools.partial(self._read_ranges, path, bucket, key, etag, target),
                    retry=False,  # each range retries on its own
                )
                return size
            except S3WriteError as exc:
                if _error_code(exc) != "PreconditionFailed" or attempt == self.retries:
                    raise
                log.info("lightning_datastates: %s changed while it was read; reading it again", path)
        raise AssertionError("unreachable")

    def range_bytes_for(self, size: int) -> int:
        """Bytes per ranged GET for an object of ``size`` bytes: the ``read_range_bytes`` setting if given;
        otherwise enough ranges to fill the window once, at least 8 MiB and at most :data:`MAX_AUTO_RANGE_BYTES`."""
        if self.read_range_bytes is not None:
            return self.read_range_bytes
        return max(8 * MiB, min(MAX_AUTO_RANGE_BYTES, math.ceil(size / self.max_concurrent_parts)))

    async def _read_ranges(self, path: str, bucket: str, key: str, etag: str, target: memoryview) -> None:
        size = target.nbytes
        if size == 0:
            return
        step = self.range_bytes_for(size)
        semaphore = asyncio.Semaphore(self.max_concurrent_parts)

        async def read_range(start: int, stop: int) -> None:
            async with semaphore:
                await self._with_retries(
                    f"reading bytes {start}-{stop - 1} of {path}",
                    lambda: self._get_range(bucket, key, etag, target[start:stop], start),
                )

        tasks = [asyncio.ensure_future(read_range(s, min(s + step, size))) for s in range(0, size, step)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises the first failure
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _get_range(self, bucket: str, key: str, etag: str, target: memoryview, start: int) -> None:
        stop = start + target.nbytes
        response = await self._call(
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", IfMatch=etag
        )
        body = response["Body"]
        try:
            position = 0
            while position < target.nbytes:
                chunk = await body.read(min(4 * MiB, target.nbytes - position))
                if not chunk:
                    raise OSError(f"connection closed after {position} of {target.nbytes} bytes")
                target[position : position + len(chunk)] = chunk
                position += len(chunk)
        finally:
            body.close()

    # ------------------------------------------------------------------ requests
    def _call(self, method: str, **kwargs: Any) -> Awaitable[Any]:
        """One attempt of an S3 request on the event loop (s3fs's and botocore's own retries are off)."""
        return self._data_fs._call_s3(method, **kwargs)

    async def _with_retries(self, what: str, attempt: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``attempt()`` with a timeout, retrying transient failures with exponential backoff and jitter.

        Raises:
            S3WriteError: ``"{what} failed: ..."``, chained to the last failure.
        """
        for number in range(self.retries + 1):
            try:
                return await asyncio.wait_for(attempt(), self.timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # classified below, always re-raised in the end
                if number == self.retries or not _retryable(exc):
                    kind = S3NotFoundError if isinstance(exc, FileNotFoundError) else S3WriteError
                    raise kind(f"{what} failed: {_describe(exc)}") from exc
                delay = min(_BACKOFF_S * 2**number, _MAX_BACKOFF_S) * (0.5 + random.random())
                log.debug("lightning_datastates: %s failed (%r); retrying in %.2f s", what, exc, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _run(
        self,
        what: str,
        attempt: Callable[[], Awaitable[Any]],
        *,
        missing_ok: bool = False,
        retry: bool = True,
    ) -> Any:
        """Run a request on the event loop from the calling thread (never the loop's) and wait for it."""

        async def request() -> Any:
            if retry:
                return await self._with_retries(what, attempt)
            return await attempt()

        # A task of its own, shielded: cancelling the waiter (or part tasks) leaves it running to its end.
        future = asyncio.run_coroutine_threadsafe(request(), self.loop)
        try:
            return future.result()
        except S3NotFoundError:
            if missing_ok:
                return None
            raise

    async def _delete_prefix(self, bucket: str, prefix: str) -> None:
        token: dict[str, str] = {}
        while True:
            listing = await self._call("list_objects_v2", Bucket=bucket, Prefix=prefix, **token)
            keys = [{"Key": item["Key"]} for item in listing.get("Contents", [])]
            if keys:
                await self._call("delete_objects", Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            if not listing.get("IsTruncated"):
                return
            token = {"ContinuationToken": listing["NextContinuationToken"]}

    async def _list_uploads(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        uploads: list[dict[str, Any]] = []
        markers: dict[str, str] = {}
        while True:
            page = await self._call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            uploads += page.get("Uploads", [])
            if not page.get("IsTruncated"):
                return uploads
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def list_open_uploads(self, directory: str) -> list[dict[str, Any]]:
        """Every open multipart upload under ``directory`` (recursively), as S3 lists them."""
        bucket, prefix = self._split(directory)
        prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        return self._run(f"listing open uploads in {directory}", lambda: self._list_uploads(bucket, prefix))

    # ------------------------------------------------------------------ paths and caches
    def _strip(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    def _invalidate(self, path: str) -> None:
        # Our requests bypass s3fs's listing cache; Lightning's ModelCheckpoint may share this instance.
        self.fs.invalidate_cache(self._strip(path))


def import_s3fs() -> Any:
    """The ``s3fs`` module.

    Raises:
        ImportError: s3fs is not installed (the message names the extra to install).
    """
    try:
        import s3fs
    except ImportError as exc:
        raise ImportError(f"s3:// checkpoints need s3fs ({exc}): pip install lightning-datastates[s3]") from exc
    return s3fs


def check_s3_options(options: dict[str, Any]) -> None:
    """Reject keys ``s3fs.S3FileSystem`` would not understand (they would be passed on and ignored, or fail late).

    Raises:
        ConfigError: naming the key, the closest accepted one, and ``storage_options``.
    """
    s3fs = import_s3fs()
    for key in options:
        if key in _REJECTED_KEYS:
            raise ConfigError(f"storage_options key {key!r} is not supported for s3://; remove it from storage_options")
    accepted = declared_options(s3fs.S3FileSystem) | FSSPEC_KEYS | {"profile"}  # profile: passed to the session
    reject_unknown_options(
        options,
        accepted,
        f"s3fs.S3FileSystem nor of the S3 writer ({', '.join(TUNABLES)})",
        accepted | set(TUNABLES),
    )


# ---------------------------------------------------------------------------------------------------- file systems
_FILESYSTEMS: dict[str, tuple[Any, Any]] = {}
_FILESYSTEMS_LOCK = threading.Lock()
_MAX_CACHED = 16


def _filesystems(options: dict[str, Any], timeout_s: float) -> tuple[Any, Any]:
    """``(shared, data)`` file systems for ``options``: ``shared`` is s3fs's usual (cached) instance, used for
    metadata; ``data`` is ours alone, with s3fs's and botocore's retries off and our timeouts, for the requests we
    retry ourselves. Both are cached per process: building a client costs tens of milliseconds."""
    s3fs = import_s3fs()

    cache_key = f"{os.getpid()}|{timeout_s}|{sorted(options.items())!r}"
    with _FILESYSTEMS_LOCK:
        cached = _FILESYSTEMS.get(cache_key)
        if cached is not None:
            return cached
        shared = s3fs.S3FileSystem(**options)
        config = {"connect_timeout": min(timeout_s, 10.0), "read_timeout": timeout_s, "retries": {"max_attempts": 0}}
        config.update(options.get("config_kwargs") or {})
        data = s3fs.S3FileSystem(**{**options, "config_kwargs": config, "skip_instance_cache": True})
        data.retries = 1  # one attempt per _call_s3: S3Writer retries (instance attribute; this instance is ours)
        if len(_FILESYSTEMS) >= _MAX_CACHED:
            _FILESYSTEMS.pop(next(iter(_FILESYSTEMS)))
        _FILESYSTEMS[cache_key] = (shared, data)
        return shared, data


def clear_filesystem_cache() -> None:
    """Forget the cached s3fs instances (tests: a fresh client per test)."""
    with _FILESYSTEMS_LOCK:
        _FILESYSTEMS.clear()
        _KNOWN_BUCKETS.clear()


# ---------------------------------------------------------------------------------------------------- errors
def _client_error(exc: BaseException) -> Any:
    """The botocore ``ClientError`` behind ``exc`` (s3fs translates it into an ``OSError`` and chains it)."""
    seen = 0
    while exc is not None and seen < 5:
        if getattr(exc, "response", None) is not None:
            return exc
        exc = exc.__cause__  # type: ignore[assignment]
        seen += 1
    return None


def _error_code(exc: BaseException) -> str | None:
    error = _client_error(exc)
    return None if error is None else error.response.get("Error", {}).get("Code")


def _retryable(exc: BaseException) -> bool:
    """Server-side and transport failures are retried; a refusal (4xx: no bucket, no access, ...) is not."""
    error = _client_error(exc)
    if error is not None:
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or status in (408, 429) or error.response.get("Error", {}).get("Code") in _RETRYABLE_CODES
    permanent = type(exc).__name__ in _PERMANENT_ERRORS  # bad parameters, no credentials: retrying cannot help
    bug = isinstance(exc, (TypeError, ValueError, AttributeError, KeyError)) and not isinstance(exc, OSError)
    return not (permanent or bug)  # retried: connection refused or reset, timeouts, truncated bodies


def _describe(exc: BaseException) -> str:
    error = _client_error(exc)
    if error is not None:
        info = error.response.get("Error", {})
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        hint = _ERROR_HINTS.get(str(info.get("Code")))
        return f"{info.get('Code')} (HTTP {status}): {info.get('Message') or exc}" + (f"; {hint}" if hint else "")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):  # distinct classes before Python 3.11
        return "no answer within timeout_s"
    return f"{type(exc).__name__}: {exc}"


def _check_int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an int from {low} to {high}, got {value!r}")
    return value
