"""S3 requests with our retries and timeouts, the s3fs file systems they go through, and what their errors mean.

Each :class:`S3Client` owns two s3fs file systems built from the same ``storage_options``: ``fs``, s3fs's usual
(shared, cached by s3fs) instance, for metadata and plain reads, and a data file system of its own with s3fs's and
botocore's retries off and our timeouts, for the requests retried here (so ``retries=1`` means one retry, not
1 x 5 x 5). Requests run on s3fs's event loop: :meth:`S3Client.run` from any thread but the loop's, and waits;
:meth:`S3Client.with_retries` on the loop itself.

s3fs is imported when a client is built, so this module imports without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from lightning_datastates.compat.s3fs import call_s3, event_loop, one_attempt_per_call, strip_protocol
from lightning_datastates.errors import ConfigError
from lightning_datastates.storage.generic import FSSPEC_KEYS, declared_options, reject_unknown_options

log = logging.getLogger("lightning_datastates")

#: Settings of the writer itself, accepted in ``storage_options`` beside the s3fs options.
TUNABLES = ("part_size_bytes", "max_concurrent_parts", "retries", "timeout_s", "read_range_bytes")


def split_tunables(storage_options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``DataStatesIO(storage_options=...)`` for ``s3://`` split into the s3fs options and the writer's own settings
    (:data:`TUNABLES`), which s3fs would pass on to botocore and fail on (pure; the input is not changed)."""
    options = dict(storage_options or {})
    tunables = {name: options.pop(name) for name in TUNABLES if name in options}
    return options, tunables


#: s3fs options that would break the synchronous driver.
_REJECTED_KEYS = {"asynchronous", "loop"}
#: Fixes to suggest for S3 error codes that a user can act on.
ERROR_HINTS = {
    "NoSuchBucket": "create the bucket or fix the bucket name in the checkpoint URL",
    "AccessDenied": "check the credentials (storage_options key/secret or the AWS_* variables) and the bucket policy",
    "InvalidAccessKeyId": "check the credentials (storage_options key/secret or the AWS_* variables)",
    "SignatureDoesNotMatch": "check the credentials (storage_options key/secret or the AWS_* variables)",
}
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


class S3WriteError(OSError):
    """An S3 request for a checkpoint failed; the message names the ``s3://`` path, the cause is chained."""


class S3NotFoundError(S3WriteError, FileNotFoundError):
    """The bucket, the object or the upload does not exist."""


# ---------------------------------------------------------------------------------------------------- the client
class S3Client:
    """s3fs file systems for one set of ``storage_options``, and requests with ``retries`` and ``timeout_s``.

    Thread model: :meth:`run` and :meth:`submit` from any thread but the event loop's (several at once);
    :meth:`call` and :meth:`with_retries` build coroutines that run on the loop.
    """

    def __init__(self, storage_options: dict[str, Any], *, retries: int, timeout_s: float) -> None:
        self.retries = retries
        self.timeout_s = timeout_s
        self.fs, self._data_fs = _filesystems(storage_options, timeout_s)
        self.loop = event_loop(self._data_fs)

    def call(self, method: str, **kwargs: Any) -> Awaitable[Any]:
        """One attempt of an S3 request on the event loop (s3fs's and botocore's own retries are off)."""
        return call_s3(self._data_fs, method, **kwargs)

    async def with_retries(self, what: str, attempt: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``attempt()`` with a timeout, retrying transient failures with exponential backoff and jitter.

        Raises:
            S3WriteError: ``"{what} failed: ..."``, chained to the last failure (:class:`S3NotFoundError` for a
                missing bucket, object or upload).
        """
        for number in range(self.retries + 1):
            try:
                return await asyncio.wait_for(attempt(), self.timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # classified below, always re-raised in the end
                if number == self.retries or not retryable(exc):
                    kind = S3NotFoundError if isinstance(exc, FileNotFoundError) else S3WriteError
                    raise kind(f"{what} failed: {describe(exc)}") from exc
                delay = min(_BACKOFF_S * 2**number, _MAX_BACKOFF_S) * (0.5 + random.random())
                log.debug("lightning_datastates: %s failed (%r); retrying in %.2f s", what, exc, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Start ``coroutine`` as a task of its own on the event loop; cancelling a waiter leaves it running."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(
        self,
        what: str,
        attempt: Callable[[], Awaitable[Any]],
        *,
        missing_ok: bool = False,
        retry: bool = True,
    ) -> Any:
        """Run a request on the event loop from the calling thread (never the loop's) and wait for it.

        ``missing_ok``: a missing bucket, object or upload returns None. ``retry=False``: ``attempt`` retries on its
        own (its parts call :meth:`with_retries`).
        """

        async def request() -> Any:
            if retry:
                return await self.with_retries(what, attempt)
            return await attempt()

        try:
            return self.submit(request()).result()
        except S3NotFoundError:
            if missing_ok:
                return None
            raise

    # ------------------------------------------------------------------ paths
    def strip(self, path: str) -> str:
        """``path`` as ``bucket/key``."""
        return strip_protocol(self.fs, path)

    def split(self, path: str) -> tuple[str, str]:
        """``(bucket, key)`` of ``path``."""
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    def invalidate(self, path: str) -> None:
        """Drop s3fs's listing cache for ``path``: our requests bypass it, and Lightning's ModelCheckpoint may share
        the instance."""
        self.fs.invalidate_cache(self.strip(path))


def _filesystems(options: dict[str, Any], timeout_s: float) -> tuple[Any, Any]:
    """``(shared, data)`` file systems for ``options``: ``shared`` is s3fs's usual instance (s3fs caches it per
    options), used for metadata; ``data`` is a new one, with s3fs's and botocore's retries off and our timeouts, for
    the requests we retry ourselves."""
    s3fs = import_s3fs()
    shared = s3fs.S3FileSystem(**options)
    config = {"connect_timeout": min(timeout_s, 10.0), "read_timeout": timeout_s, "retries": {"max_attempts": 0}}
    config.update(options.get("config_kwargs") or {})
    data = s3fs.S3FileSystem(**{**options, "config_kwargs": config, "skip_instance_cache": True})
    one_attempt_per_call(data)  # this instance is ours alone
    return shared, data


# ---------------------------------------------------------------------------------------------------- options
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


# ---------------------------------------------------------------------------------------------------- errors
def client_error(exc: BaseException) -> Any:
    """The botocore ``ClientError`` behind ``exc`` (s3fs translates it into an ``OSError`` and chains it)."""
    seen = 0
    while exc is not None and seen < 5:
        if getattr(exc, "response", None) is not None:
            return exc
        exc = exc.__cause__  # type: ignore[assignment]
        seen += 1
    return None


def error_code(exc: BaseException) -> str | None:
    """The S3 error code behind ``exc`` (``"NoSuchKey"``, ``"PreconditionFailed"``, ...), if any."""
    error = client_error(exc)
    return None if error is None else error.response.get("Error", {}).get("Code")


def retryable(exc: BaseException) -> bool:
    """Server-side and transport failures are retried; a refusal (4xx: no bucket, no access, ...) is not."""
    error = client_error(exc)
    if error is not None:
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or status in (408, 429) or error.response.get("Error", {}).get("Code") in _RETRYABLE_CODES
    permanent = type(exc).__name__ in _PERMANENT_ERRORS  # bad parameters, no credentials: retrying cannot help
    bug = isinstance(exc, (TypeError, ValueError, AttributeError, KeyError)) and not isinstance(exc, OSError)
    return not (permanent or bug)  # retried: connection refused or reset, timeouts, truncated bodies


def describe(exc: BaseException) -> str:
    """``exc`` in a message: the S3 error code, HTTP status, message and the fix where one is known."""
    error = client_error(exc)
    if error is not None:
        info = error.response.get("Error", {})
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        hint = ERROR_HINTS.get(str(info.get("Code")))
        where = f" (HTTP {status})" if status else ""  # none for a key a DeleteObjects request refused
        return f"{info.get('Code')}{where}: {info.get('Message') or exc}" + (f"; {hint}" if hint else "")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):  # distinct classes before Python 3.11
        return "no answer within timeout_s"
    return f"{type(exc).__name__}: {exc}"
