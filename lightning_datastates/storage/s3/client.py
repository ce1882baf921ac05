"""S3 requests with our retries and timeouts, the s3fs file systems they go through, and what their errors mean.

Each :class:`S3Client` owns two s3fs file systems built from the same ``storage_options``: ``fs``, s3fs's usual
(shared, cached by s3fs) instance, for metadata and plain reads, and a data file system of its own with s3fs's and
botocore's retries off and our timeouts, for the requests retried here (so ``retries=1`` means one retry, not
1 x 5 x 5). Requests run on s3fs's event loop: :meth:`S3Client.run` from any thread but the loop's, and waits;
:meth:`S3Client.with_retries` on the loop itself.

Timeouts (why two limits): a silent endpoint must be found in seconds, yet a part upload or a ranged GET moving many
megabytes over a slow link legitimately takes minutes. So ``timeout_s`` bounds *silence*: botocore's
``connect_timeout`` and ``read_timeout`` (aiohttp's ``sock_connect`` and ``sock_read``: connecting, then the wait for
the answer once the request body is sent, and every pause within the answer), and the whole attempt of a request
that moves no data (LIST, HEAD, DELETE, Create multipart, ...). A request moving ``n`` bytes (a part, a small file's
``PutObject``, a ranged GET, the commit of an ``n``-byte object) may take
``timeout_s + n * max_concurrent_parts / min_bytes_per_s`` per attempt (``min_bytes_per_s``: the slowest link
tolerated, which the requests in flight share): the guard against a server that stops reading the body (no socket
timeout covers a stalled send) or trickles.

Every retry is logged (WARNING) as it happens, naming the request, the endpoint, the attempt and the wait; the final
error names the endpoint, the attempts, the time they took and the ``storage_options`` keys that change them.

s3fs is imported when a client is built, so this module imports without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from lightning_datastates.compat.s3fs import call_s3, event_loop, one_attempt_per_call, strip_protocol
from lightning_datastates.errors import ConfigError
from lightning_datastates.storage.generic import FSSPEC_KEYS, declared_options, reject_unknown_options

log = logging.getLogger("lightning_datastates")

#: Settings of the writer itself, accepted in ``storage_options`` beside the s3fs options.
TUNABLES = ("part_size_bytes", "max_concurrent_parts", "retries", "timeout_s", "min_bytes_per_s", "read_range_bytes")

#: Defaults of the request settings: a silent endpoint fails a request after ``worst_case_s()`` = 4 attempts of 10 s
#: and backoffs of at most 1.5, 3 and 6 s, 50.5 s in all (about 47 s on average).
DEFAULT_RETRIES = 3
DEFAULT_TIMEOUT_S = 10.0
#: The slowest link tolerated, 2 MiB/s (16 Mbit/s): with 8 parts of 16 MiB at once, a part may take 74 s per attempt.
DEFAULT_MIN_BYTES_PER_S = 2 * 1024**2


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
#: Backoff before retry n (0-based): min(1 s * 2**n, 10 s), times a jitter of 0.5 to 1.5 (AWS's SDKs start at 1 s
#: too): a throttled or restarting service gets seconds, not the tenths of a second that only add load.
_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 10.0
_MAX_JITTER = 1.5
_RETRYABLE_CODES = {
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "XAmzContentSHA256Mismatch",
    "BadDigest",
}
#: Errors (matched by name: botocore and aiohttp are imported by s3fs, not here) that mean the endpoint said nothing
#: in time: botocore's ``connect_timeout`` and ``read_timeout``, and aiohttp's errors under them.
_TIMEOUT_ERRORS = {"ConnectTimeoutError", "ReadTimeoutError", "SocketTimeoutError", "ServerTimeoutError"}
#: botocore errors (matched by name: botocore is imported by s3fs, not here) that no retry can fix.
_PERMANENT_ERRORS = {
    "ParamValidationError",
    "NoCredentialsError",
    "PartialCredentialsError",
    "NoRegionError",
    "UnknownServiceError",
    "InvalidConfigError",
}


#: Where botocore looks for credentials, for the error that says none (or only some) were found.
CREDENTIALS_HINT = (
    "give an access key ID and a secret access key: the AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY environment "
    "variables, storage_options key and secret, or a profile (storage_options profile, or AWS_PROFILE) in "
    "~/.aws/credentials (AWS_SHARED_CREDENTIALS_FILE) or ~/.aws/config (AWS_CONFIG_FILE)"
)
#: Fixes for botocore errors raised before any request is sent (matched by name, as :data:`_PERMANENT_ERRORS`).
_LOCAL_ERROR_HINTS = {
    "NoCredentialsError": "no AWS credentials were found; " + CREDENTIALS_HINT,
    "PartialCredentialsError": "only part of the AWS credentials was found; " + CREDENTIALS_HINT,
    "NoRegionError": "no AWS region is set: AWS_DEFAULT_REGION, or storage_options client_kwargs region_name",
}


class S3WriteError(OSError):
    """An S3 request for a checkpoint failed; the message names the ``s3://`` path, the cause is chained."""


class S3NotFoundError(S3WriteError, FileNotFoundError):
    """The bucket, the object or the upload does not exist."""


# ---------------------------------------------------------------------------------------------------- the client
class S3Client:
    """s3fs file systems for one set of ``storage_options``, and requests with ``retries``, ``timeout_s`` and
    ``min_bytes_per_s`` (see the module docstring).

    Thread model: :meth:`run` and :meth:`submit` from any thread but the event loop's (several at once);
    :meth:`call` and :meth:`with_retries` build coroutines that run on the loop.
    """

    def __init__(
        self,
        storage_options: dict[str, Any],
        *,
        retries: int,
        timeout_s: float,
        min_bytes_per_s: int = DEFAULT_MIN_BYTES_PER_S,
        concurrency: int = 1,
    ) -> None:
        self.retries = retries
        self.timeout_s = timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        #: Transfers in flight at once (``max_concurrent_parts``), sharing the link of ``min_bytes_per_s``.
        self.concurrency = concurrency
        #: Where requests go, for messages: the endpoint URL, or AWS and its region.
        self.endpoint = endpoint_of(storage_options)
        self.fs, self._data_fs = _filesystems(storage_options, timeout_s)
        self.loop = event_loop(self._data_fs)

    def call(self, method: str, **kwargs: Any) -> Awaitable[Any]:
        """One attempt of an S3 request on the event loop (s3fs's and botocore's own retries are off)."""
        return call_s3(self._data_fs, method, **kwargs)

    def attempt_limit_s(self, nbytes: int = 0) -> float:
        """The longest one attempt of a request moving ``nbytes`` may take (see :func:`attempt_limit_s`)."""
        return attempt_limit_s(self.timeout_s, nbytes, self.min_bytes_per_s, self.concurrency)

    def worst_case_s(self, nbytes: int = 0) -> float:
        """The longest a request moving ``nbytes`` may take before it fails (see :func:`worst_case_s`)."""
        return worst_case_s(self.retries, self.timeout_s, nbytes, self.min_bytes_per_s, self.concurrency)

    async def with_retries(self, what: str, attempt: Callable[[], Awaitable[Any]], *, nbytes: int = 0) -> Any:
        """Run ``attempt()`` (a request moving ``nbytes``: a part's, a range's, a small file's) with a limit per
        attempt of :meth:`attempt_limit_s`, retrying transient failures with exponential backoff and jitter; each
        retry is logged as a WARNING as it happens (request, endpoint, attempt n of m, the error, the wait).

        Raises:
            S3WriteError: ``"{what} failed: ..."``, chained to the last failure (:class:`S3NotFoundError` for a
                missing bucket, object or upload); after a failure of the transport (no answer, no connection) it
                names the endpoint, the attempts, their time and the ``storage_options`` keys that change them.
        """
        attempts = self.retries + 1
        started = time.monotonic()
        for number in range(1, attempts + 1):
            try:
                return await asyncio.wait_for(attempt(), self.attempt_limit_s(nbytes))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # classified below, always re-raised in the end
                if number == attempts or not retryable(exc):
                    raise self._failure(what, exc, number, time.monotonic() - started, nbytes) from exc
                delay = backoff_s(number - 1) * (0.5 + random.random() * (_MAX_JITTER - 0.5))
                log.warning(
                    "lightning_datastates: %s: attempt %d of %d at %s failed (%s); retrying in %.1f s",
                    what,
                    number,
                    attempts,
                    self.endpoint,
                    self._problem(exc, nbytes),
                    delay,
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _problem(self, exc: BaseException, nbytes: int) -> str:
        """What went wrong in one attempt, in a message."""
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):  # our limit (distinct classes before Python 3.11)
            if nbytes:  # a transfer that went on too long (the endpoint stopped reading, or trickles)
                transfer_s = self.attempt_limit_s(nbytes) - self.timeout_s
                return (
                    f"no answer within timeout_s + the time of {nbytes / 2**20:.1f} MiB at min_bytes_per_s shared by "
                    f"{self.concurrency} transfer(s) ({self.timeout_s:g} s + {transfer_s:.1f} s)"
                )
            return f"no answer within timeout_s ({self.timeout_s:g} s)"
        if timed_out(exc):  # botocore's: silence for timeout_s while connecting or waiting for the answer
            return f"no answer within timeout_s ({self.timeout_s:g} s)"
        return describe(exc)

    def _failure(self, what: str, exc: BaseException, attempts: int, elapsed_s: float, nbytes: int) -> S3WriteError:
        """The error that ends a request: what failed, why, and (after a failure of the transport) where, after how
        many attempts and how long, and which settings change that."""
        kind = S3NotFoundError if isinstance(exc, FileNotFoundError) else S3WriteError
        tries = f"{attempts} attempt{'s' if attempts > 1 else ''} over {elapsed_s:.1f} s"
        if client_error(exc) is not None:  # the service answered: its refusal (with the fix) or a server error
            where = f" ({tries} at {self.endpoint})" if attempts > 1 else ""
            return kind(f"{what} failed: {describe(exc)}{where}")
        if type(exc).__name__ in _PERMANENT_ERRORS:  # nothing was sent (no credentials, ...): the network is not it
            return kind(f"{what} failed: {describe(exc)}")
        if not timed_out(exc):  # refused or reset connections: waiting longer per attempt would not help
            settings = "retries"
        elif nbytes and isinstance(exc, (TimeoutError, asyncio.TimeoutError)):  # our limit of a transfer
            settings = "timeout_s / min_bytes_per_s / retries"
        else:
            settings = "timeout_s / retries"
        return kind(
            f"{what} failed: {self._problem(exc, nbytes)} from {self.endpoint} ({tries}); check storage_options "
            f"endpoint_url and the network, or raise storage_options {settings}"
        )

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
        nbytes: int = 0,
    ) -> Any:
        """Run a request on the event loop from the calling thread (never the loop's) and wait for it.

        ``missing_ok``: a missing bucket, object or upload returns None. ``retry=False``: ``attempt`` retries on its
        own (its parts call :meth:`with_retries`). ``nbytes``: the bytes the request moves (see :meth:`with_retries`).
        """

        async def request() -> Any:
            if retry:
                return await self.with_retries(what, attempt, nbytes=nbytes)
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


def shared_options(options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """The s3fs options of the file system shared with every fsspec user of the same store (our metadata requests,
    ``ModelCheckpoint``'s listing and ``ckpt_path="last"``, DCP's reader): ``options`` (without :data:`TUNABLES`) with
    botocore's connect and read timeouts at ``timeout_s`` and botocore's retries off, so that s3fs's own attempts (5)
    bound a silent endpoint to about ``5 * timeout_s``, not botocore's 60 s times its retries times s3fs's. A
    ``config_kwargs`` of the user's overrides ours. Pure; equal options give equal results, so s3fs's instance cache
    hands every user the same instance (one listing cache to invalidate)."""
    config: dict[str, Any] = {"connect_timeout": timeout_s, "read_timeout": timeout_s, "retries": {"max_attempts": 0}}
    config.update(options.get("config_kwargs") or {})
    return {**options, "config_kwargs": config}


def shared_filesystem_options(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`shared_options` of a plugin's ``storage_options`` (its ``timeout_s``, or the default where it is not a
    positive number: the writer reports that when it is made)."""
    options, tunables = split_tunables(storage_options)
    timeout_s = tunables.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        timeout_s = DEFAULT_TIMEOUT_S
    return shared_options(options, float(timeout_s))


def _filesystems(options: dict[str, Any], timeout_s: float) -> tuple[Any, Any]:
    """``(shared, data)`` file systems for ``options``: ``shared`` is s3fs's cached instance for
    :func:`shared_options`, used for metadata; ``data`` is a new one, with s3fs's and botocore's retries off and our
    timeouts, for the requests we retry ourselves. A ``config_kwargs`` of the user's overrides ours."""
    s3fs = import_s3fs()
    shared = s3fs.S3FileSystem(**shared_options(options, timeout_s))
    # read_timeout is aiohttp's sock_read: it starts once the body is sent and restarts at every byte received, so it
    # bounds the silence of the endpoint, never the time a slow transfer takes (see the module docstring).
    config = {"connect_timeout": timeout_s, "read_timeout": timeout_s, "retries": {"max_attempts": 0}}
    config.update(options.get("config_kwargs") or {})
    data = s3fs.S3FileSystem(**{**options, "config_kwargs": config, "skip_instance_cache": True})
    one_attempt_per_call(data)  # this instance is ours alone
    return shared, data


# ---------------------------------------------------------------------------------------------------- budget (pure)
def attempt_limit_s(timeout_s: float, nbytes: int, min_bytes_per_s: int, concurrency: int = 1) -> float:
    """The longest one attempt of a request moving ``nbytes`` may take: ``timeout_s``, plus the time ``nbytes`` take
    over a link of ``min_bytes_per_s`` shared by ``concurrency`` such transfers."""
    return timeout_s + nbytes * concurrency / min_bytes_per_s


def backoff_s(number: int) -> float:
    """The backoff before retry ``number`` (0-based), before its jitter (x 0.5 to 1.5)."""
    return min(_BACKOFF_S * 2**number, _MAX_BACKOFF_S)


def worst_case_s(
    retries: int,
    timeout_s: float,
    nbytes: int = 0,
    min_bytes_per_s: int = DEFAULT_MIN_BYTES_PER_S,
    concurrency: int = 1,
) -> float:
    """The longest a request moving ``nbytes`` may take before it fails: every attempt out of time, every backoff at
    its longest (an endpoint that never answers costs this much per request)."""
    waits = sum(backoff_s(number) * _MAX_JITTER for number in range(retries))
    return (retries + 1) * attempt_limit_s(timeout_s, nbytes, min_bytes_per_s, concurrency) + waits


# ---------------------------------------------------------------------------------------------------- options
def endpoint_of(options: dict[str, Any]) -> str:
    """Where the requests of ``options`` go, for messages: ``endpoint_url`` (in ``storage_options``, its
    ``client_kwargs``, or the ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` variables botocore reads), else AWS S3
    and its region."""
    client_kwargs = options.get("client_kwargs") or {}
    url = (
        options.get("endpoint_url")
        or client_kwargs.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if url:
        return str(url)
    region = client_kwargs.get("region_name") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return f"AWS S3 ({region})" if region else "AWS S3 (its default region)"


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


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a timeout: our limit of an attempt, or botocore's or
    aiohttp's (no answer in time)."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):  # distinct classes before Python 3.11
            return True
        if any(cls.__name__ in _TIMEOUT_ERRORS for cls in type(exc).__mro__):
            return True
        exc = exc.__cause__  # type: ignore[assignment]
        seen += 1
    return False


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
    hint = _LOCAL_ERROR_HINTS.get(type(exc).__name__)
    if hint is not None:
        return f"{type(exc).__name__}: {exc}: {hint}"
    return f"{type(exc).__name__}: {exc}"  # timeouts are told by S3Client, which knows its limits
