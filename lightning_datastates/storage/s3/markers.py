"""Open multipart uploads that crashed runs left, recognised by a marker object each, and their clean-up.

S3 lists open multipart uploads with neither host nor process, so each upload gets a small hidden *marker* object
beside its key, ``.<name>.<host>.<pid>.<token>.datastates-upload`` holding the UploadId (named as every leftover,
see :mod:`~lightning_datastates.records.leftovers`), written right after ``CreateMultipartUpload`` and deleted once the
upload is completed or aborted. :func:`clean_stale_uploads` aborts the uploads whose marker names a dead process of
this host at once, and other uploads (another host, or a writer killed before its marker landed) once older than
``max_age_s``; this process's uploads in flight (:data:`OPEN_UPLOADS`) never.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from lightning_datastates.records.leftovers import LeftoverOwner, leftover_name, parse_leftover_name, writer_gone
from lightning_datastates.storage.s3.client import S3Client, S3NotFoundError

#: Suffix of the marker objects naming the process behind an open multipart upload.
UPLOAD_MARKER_SUFFIX = ".datastates-upload"


class OpenUploads:
    """The multipart uploads this process has open (their UploadIds): ``clean_stale`` never aborts them.

    Process-wide on purpose (:data:`OPEN_UPLOADS`): a marker names a process, not a writer, and an upload of this
    process missing from the set counts as abandoned, so every writer of the process (several plugins, the command
    line, a writer built per call) must see every other's uploads. Locked: sessions begin and end on several threads.
    """

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def add(self, upload_id: str) -> None:
        """Record a new upload of this process."""
        with self._lock:
            self._ids.add(upload_id)

    def discard(self, upload_id: str | None) -> None:
        """Forget an upload once completed or aborted (or given up on)."""
        with self._lock:
            self._ids.discard(upload_id or "")

    def snapshot(self) -> frozenset[str]:
        """The uploads open now."""
        with self._lock:
            return frozenset(self._ids)


#: This process's open uploads (see :class:`OpenUploads` for why there is one per process).
OPEN_UPLOADS = OpenUploads()


@dataclass
class UploadMarker:
    """The marker object of one multipart upload; ``written`` completes once its ``PutObject`` ended."""

    key: str
    written: concurrent.futures.Future[Any]


@dataclass(frozen=True)
class MarkerInfo:
    """A marker found by ``clean_stale``: which process (``owner``) opened upload ``upload_id``."""

    key: str
    owner: LeftoverOwner
    upload_id: str
    modified: datetime | None


def marker_key(key: str) -> str:
    """The key of the marker object for an upload to ``key`` by this process."""
    directory, _, name = key.rpartition("/")
    marker = leftover_name(name, UPLOAD_MARKER_SUFFIX)
    return f"{directory}/{marker}" if directory else marker


def write_marker(client: S3Client, path: str, bucket: str, key: str, upload_id: str) -> UploadMarker:
    """Start writing the marker of a new upload to ``key`` (not waited for here: it overlaps the first parts)."""
    marker = marker_key(key)
    request = client.with_retries(
        f"recording the upload of {path}",
        lambda: client.call("put_object", Bucket=bucket, Key=marker, Body=upload_id.encode()),
    )
    return UploadMarker(marker, client.submit(request))


def drop_marker(client: S3Client, path: str, bucket: str, marker: UploadMarker) -> None:
    """Delete an upload's marker once its upload is gone (waits for its ``PutObject`` first).

    Raises:
        S3WriteError: the request failed (``clean_stale`` removes the marker later).
    """
    marker.written.result(timeout=client.worst_case_s())  # its PutObject ends by then, with all its retries
    client.run(
        f"removing the upload marker of {path}",
        lambda: client.call("delete_object", Bucket=bucket, Key=marker.key),
        missing_ok=True,
    )


def clean_stale_uploads(client: S3Client, directory: str, max_age_s: float) -> list[str]:
    """Abort the open multipart uploads that crashed runs left for keys directly in ``directory``; return their
    ``s3://`` paths.

    An upload whose marker names a process of this host that is dead (or this process, which no longer writes it)
    is aborted at once; any other upload not of this process once it is older than ``max_age_s``. Markers whose upload
    is gone are removed by the same rules.
    """
    bucket, prefix = client.split(directory)
    prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
    try:
        uploads = client.run(f"listing open uploads in {directory}", lambda: _list_uploads(client, bucket, prefix))
        markers = client.run(f"listing upload markers in {directory}", lambda: _list_markers(client, bucket, prefix))
    except S3NotFoundError:
        return []  # no such bucket: nothing to clean
    now = datetime.now(timezone.utc)
    ours = OPEN_UPLOADS.snapshot()
    owner_of = {marker.upload_id: marker.owner for marker in markers}
    removed, aborted = [], set()
    for upload in uploads:
        key, upload_id, initiated = upload["Key"], upload["UploadId"], upload.get("Initiated")
        if "/" in key[len(prefix) :] or upload_id in ours:
            continue
        age_s = None if initiated is None else (now - initiated).total_seconds()
        if not writer_gone(owner_of.get(upload_id), age_s, max_age_s, tracks_own_writes=True):
            continue
        client.run(
            f"aborting the stale upload of s3://{bucket}/{key}",
            functools.partial(client.call, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id),
            missing_ok=True,
        )
        aborted.add(upload_id)
        removed.append(f"s3://{bucket}/{key}")
    still_open = {upload["UploadId"] for upload in uploads} - aborted
    for marker in markers:
        if marker.upload_id in still_open or marker.upload_id in ours:
            continue
        age_s = None if marker.modified is None else (now - marker.modified).total_seconds()
        if writer_gone(marker.owner, age_s, max_age_s, tracks_own_writes=True):
            client.run(
                f"removing the upload marker s3://{bucket}/{marker.key}",
                functools.partial(client.call, "delete_object", Bucket=bucket, Key=marker.key),
                missing_ok=True,
            )
    return removed


async def _list_uploads(client: S3Client, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """Every open multipart upload under ``prefix`` (recursively), as S3 lists them."""
    uploads: list[dict[str, Any]] = []
    markers: dict[str, str] = {}
    while True:
        page = await client.call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
        uploads += page.get("Uploads", [])
        if not page.get("IsTruncated"):
            return uploads
        markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}


async def _list_markers(client: S3Client, bucket: str, prefix: str) -> list[MarkerInfo]:
    """The upload markers directly under ``prefix``, with the UploadId each one holds."""
    found: list[tuple[str, Any, LeftoverOwner]] = []
    token: dict[str, str] = {}
    while True:
        page = await client.call("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", **token)
        for item in page.get("Contents", []):
            leftover = parse_leftover_name(item["Key"][len(prefix) :], UPLOAD_MARKER_SUFFIX)
            if leftover is not None:
                found.append((item["Key"], item.get("LastModified"), leftover.owner))
        if not page.get("IsTruncated"):
            break
        token = {"ContinuationToken": page["NextContinuationToken"]}

    async def read(key: str) -> str:
        response = await client.call("get_object", Bucket=bucket, Key=key)
        try:
            return (await response["Body"].read()).decode("ascii", "replace").strip()
        finally:
            response["Body"].close()

    bodies = await asyncio.gather(*(read(key) for key, _, _ in found), return_exceptions=True)
    markers = []
    for (key, modified, owner), body in zip(found, bodies, strict=True):
        if isinstance(body, BaseException):
            continue  # removed meanwhile (its writer finished): nothing to decide
        markers.append(MarkerInfo(key, owner, body, modified))
    return markers
