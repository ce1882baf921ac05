"""Deleting files of one directory on S3: one ``DeleteObjects`` request per 1000 keys, one ``DeleteObject`` for a
single key, and one per key for a service that takes no ``DeleteObjects`` request as botocore sends it.

Call order: :meth:`~lightning_datastates.storage.s3.writer.S3Writer.remove_files` calls :func:`delete_files` from
any thread but the event loop's (the sharded committer, the training thread); each request runs on the loop through
:meth:`~lightning_datastates.storage.s3.client.S3Client.run`, with the client's timeout and retries per request, and
the caller waits.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_datastates.storage.s3.client import S3Client, S3WriteError, describe, error_code, retryable

log = logging.getLogger("lightning_datastates")

#: The most keys one ``DeleteObjects`` request may name.
DELETE_BATCH = 1000
#: What a service answers to a ``DeleteObjects`` request it cannot take: not implemented, or, since botocore 1.36
#: sends a CRC-32 checksum instead of ``Content-MD5``, older S3-compatible stores (MinIO, Ceph RGW) that require
#: the MD5. Such a service gets one ``DeleteObject`` per key.
NO_BATCH_DELETE_CODES = frozenset({"NotImplemented", "MissingContentMD5", "InvalidRequest"})


@dataclass
class DeleteSupport:
    """What one writer learned of its service: whether it takes ``DeleteObjects`` (until it answers that it does
    not)."""

    batches: bool = True


def delete_files(client: S3Client, directory: str, names: Sequence[str], support: DeleteSupport) -> None:
    """Delete the objects ``directory/name`` (files, not prefixes); missing ones are fine.

    Every batch is tried, then the keys S3 refused for good are raised together; a request that fails (after its
    retries) is raised at once.

    Raises:
        S3WriteError: a request failed, or S3 refused to delete some objects (the first named, with its code and
            message). Keys refused for a while (``SlowDown``, ``InternalError``) are sent again, alone, with the
            client's retries.
    """
    bucket, key = client.split(directory)
    prefix = key.rstrip("/") + "/" if key else ""
    keys = [prefix + name for name in names]
    refused: list[dict[str, Any]] = []
    try:
        _delete_keys(client, bucket, keys, support, refused)
    finally:
        client.invalidate(directory)
    if refused:
        raise S3WriteError(f"removing {len(keys)} file(s) of {directory} failed: {describe(_DeleteRefused(refused))}")


def delete_tree(client: S3Client, path: str, support: DeleteSupport) -> None:
    """Delete the object at ``path`` and every object under ``path/`` (a sharded checkpoint's directory); missing
    is fine. Each page of the listing (1000 keys) is deleted before the next is asked for.

    Raises:
        S3WriteError: a request failed, or S3 refused to delete some objects (the first named): a directory that
            could not be removed whole is never reported removed.
    """
    bucket, key = client.split(path)
    key = key.rstrip("/")
    refused: list[dict[str, Any]] = []
    try:
        _delete_one(client, bucket, key)
        token: dict[str, str] = {}
        while True:
            page = client.run(f"listing {path}/", _lister(client, bucket, key + "/", token), missing_ok=True) or {}
            _delete_keys(client, bucket, [item["Key"] for item in page.get("Contents", [])], support, refused)
            if not page.get("IsTruncated"):
                break
            token = {"ContinuationToken": page["NextContinuationToken"]}
    finally:
        client.invalidate(path)
    if refused:
        raise S3WriteError(f"removing {path} failed: {describe(_DeleteRefused(refused))}")


def _lister(client: S3Client, bucket: str, prefix: str, token: dict[str, str]) -> Callable[[], Awaitable[Any]]:
    """One listing request of the keys under ``prefix``, from ``token`` on."""
    return lambda: client.call("list_objects_v2", Bucket=bucket, Prefix=prefix, **token)


def _delete_keys(
    client: S3Client, bucket: str, keys: list[str], support: DeleteSupport, refused: list[dict[str, Any]]
) -> None:
    """Delete ``keys``, in batches where the service takes them; what S3 refused for good goes into ``refused``."""
    for start in range(0, len(keys), DELETE_BATCH):
        batch = keys[start : start + DELETE_BATCH]
        if len(batch) > 1 and support.batches:
            if _delete_batch(client, bucket, batch, refused):
                continue
            log.info("lightning_datastates: s3://%s takes no DeleteObjects; deleting one object at a time", bucket)
            support.batches = False
        for one in batch:
            _delete_one(client, bucket, one)


def _delete_one(client: S3Client, bucket: str, key: str) -> None:
    client.run(
        f"removing s3://{bucket}/{key}", lambda: client.call("delete_object", Bucket=bucket, Key=key), missing_ok=True
    )


def _delete_batch(client: S3Client, bucket: str, batch: list[str], refused: list[dict[str, Any]]) -> bool:
    """One ``DeleteObjects`` request for ``batch``; what S3 refused for good goes into ``refused``. False when the
    service takes no such request (nothing was deleted)."""
    pending = list(batch)  # the retries of a transient refusal send only the keys refused

    async def attempt() -> bool:
        request = {"Objects": [{"Key": k} for k in pending], "Quiet": True}
        try:
            response = await client.call("delete_objects", Bucket=bucket, Delete=request)
        except Exception as exc:
            if error_code(exc) in NO_BATCH_DELETE_CODES:
                return False
            raise
        errors = [e for e in response.get("Errors", []) if e.get("Code") != "NoSuchKey"]  # Quiet: errors only
        transient = [e for e in errors if "Key" in e and retryable(_DeleteRefused([e]))]
        refused.extend(e for e in errors if e not in transient)
        pending[:] = [e["Key"] for e in transient]
        if transient:
            raise _DeleteRefused(transient)  # retried by the client, as a failed request is
        return True

    return client.run(f"removing {len(batch)} file(s) from s3://{bucket}", attempt, missing_ok=True) is not False


class _DeleteRefused(OSError):
    """S3 answered a ``DeleteObjects`` request but refused some of its keys: the first refusal, in the shape of a
    botocore error (``response``), so that the client's retry rule and messages treat it as any other."""

    def __init__(self, refused: list[dict[str, Any]]) -> None:
        first = refused[0]
        code, message, key = first.get("Code"), first.get("Message"), first.get("Key")
        super().__init__(f"{len(refused)} object(s) not deleted, the first {key}: {code} {message}")
        self.response = {"Error": {"Code": code, "Message": f"{key}: {message}"}, "ResponseMetadata": {}}
