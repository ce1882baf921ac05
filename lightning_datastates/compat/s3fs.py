"""Private s3fs (and fsspec async) internals the S3 writer relies on.

Each was checked against s3fs 2026.9.0 (with fsspec 2026.9.0 and aiobotocore 3.10.0), the version the tests run on;
pyproject allows ``s3fs>=2024.1``, and the releases in between were not read one by one. A release that changes one
of these breaks the tests of the S3 writer (tests/test_s3.py), and this file is what to fix.

The S3 writer sends botocore requests itself, on s3fs's event loop, through s3fs's client (its credentials, endpoint
and session handling), with s3fs's own retry loop reduced to one attempt so that the writer's retries are the only
ones (see docs/design.md, "Why our own S3 writer").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


def call_s3(fs: Any, method: str, **kwargs: Any) -> Awaitable[Any]:
    """One call of the aiobotocore S3 client method ``method`` (``"upload_part"``, ...) through ``fs``.

    ``S3FileSystem._call_s3(method, *akwarglist, **kwargs)`` (private; checked on s3fs 2026.9.0): a coroutine that
    opens the session if needed, adds s3fs's request defaults and runs the method in s3fs's retry loop
    (``_error_wrapper``) of ``fs.retries`` attempts (see :func:`one_attempt_per_call`).
    """
    return fs._call_s3(method, **kwargs)


def one_attempt_per_call(fs: Any) -> None:
    """Make :func:`call_s3` on ``fs`` (an instance of its own, not shared) a single attempt.

    ``S3FileSystem.retries`` (a class attribute, 5 in s3fs 2026.9.0) is the number of attempts of s3fs's
    ``_error_wrapper`` around every ``_call_s3``; set on the instance, it overrides the class's (checked on s3fs
    2026.9.0).
    """
    fs.retries = 1


def event_loop(fs: Any) -> asyncio.AbstractEventLoop:
    """The event loop that ``fs`` (a synchronous ``S3FileSystem``) runs its coroutines on, in fsspec's IO thread.

    ``AsyncFileSystem.loop`` (checked on s3fs 2026.9.0 with fsspec 2026.9.0): for a file system made with
    ``asynchronous=False`` (the default, which the writer requires), fsspec's process-wide loop, where coroutines of
    :func:`call_s3` must run; it raises ``RuntimeError`` in a forked child (the writer builds new file systems there).
    """
    return fs.loop


def strip_protocol(fs: Any, path: str) -> str:
    """``path`` as ``bucket/key``, without ``s3://`` or ``s3a://`` (``S3FileSystem._strip_protocol``, a classmethod
    of fsspec's that s3fs overrides; checked on s3fs 2026.9.0)."""
    return str(fs._strip_protocol(path))
