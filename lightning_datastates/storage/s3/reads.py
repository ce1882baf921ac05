"""Whole objects read with concurrent ranged GETs: into a ``bytearray``, or into an anonymous in-memory file.

The object is cut into ranges of :func:`range_bytes_for` bytes, ``max_concurrent_parts`` GETs in flight at once,
each retried on its own and written straight into the target memory. Every range is read with ``If-Match`` on the
ETag seen first, so an object replaced meanwhile is read again instead of coming back torn.

:func:`fetch_into_memfd` reads into an in-memory file (``memfd_create``), which the loader verifies and torch maps
like a local file: one copy of the bytes in host memory, none into tensors.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import mmap
import os
from collections.abc import Callable
from typing import Protocol

from lightning_datastates.storage.s3.client import S3Client, S3WriteError, error_code
from lightning_datastates.storage.s3.parts import MiB

log = logging.getLogger("lightning_datastates")

#: Largest ranged GET :func:`range_bytes_for` picks by itself (``read_range_bytes`` unset).
MAX_AUTO_RANGE_BYTES = 256 * MiB
#: Smallest ranged GET :func:`range_bytes_for` picks by itself.
MIN_AUTO_RANGE_BYTES = 8 * MiB
#: ``allocate(size)``: a writable byte view of exactly ``size`` bytes to read an object of that size into.
Allocate = Callable[[int], memoryview]


class ReadsInto(Protocol):
    """What :func:`fetch_into_memfd` reads from (the S3 writer)."""

    def read_into(self, path: str, allocate: Allocate) -> int:
        """Fetch the whole object at ``path`` into ``allocate(size)``; return the size."""


def range_bytes_for(size: int, max_concurrent_parts: int, read_range_bytes: int | None) -> int:
    """Bytes per ranged GET for an object of ``size`` bytes: ``read_range_bytes`` if given; otherwise enough ranges to
    fill the window of ``max_concurrent_parts`` once, at least 8 MiB and at most :data:`MAX_AUTO_RANGE_BYTES`."""
    if read_range_bytes is not None:
        return read_range_bytes
    return max(MIN_AUTO_RANGE_BYTES, min(MAX_AUTO_RANGE_BYTES, math.ceil(size / max_concurrent_parts)))


def read_into(
    client: S3Client, path: str, allocate: Allocate, *, max_concurrent_parts: int, read_range_bytes: int | None
) -> int:
    """Fetch the whole object at ``path`` into ``allocate(size)`` with concurrent ranged GETs; return the size.

    An object replaced while it is read is read again (``allocate`` is called again), up to ``client.retries`` times.

    Raises:
        S3NotFoundError: nothing at ``path`` (a ``FileNotFoundError``).
        S3WriteError: a request failed (after retries).
    """
    bucket, key = client.split(path)
    for attempt in range(client.retries + 1):
        head = client.run(f"reading {path}", lambda: client.call("head_object", Bucket=bucket, Key=key))
        size, etag = int(head["ContentLength"]), str(head["ETag"])
        target = allocate(size)
        step = range_bytes_for(size, max_concurrent_parts, read_range_bytes)
        try:
            client.run(
                f"reading {path}",
                functools.partial(_read_ranges, client, path, bucket, key, etag, target, step, max_concurrent_parts),
                retry=False,  # each range retries on its own
            )
            return size
        except S3WriteError as exc:
            if error_code(exc) != "PreconditionFailed" or attempt == client.retries:
                raise
            log.info("lightning_datastates: %s changed while it was read; reading it again", path)
    raise AssertionError("unreachable")


def read_tail(client: S3Client, path: str, nbytes: int) -> bytes:
    """The last ``nbytes`` bytes of the object at ``path`` (all of it where it is shorter): one GET of a suffix range.

    Raises:
        S3NotFoundError: nothing at ``path`` (a ``FileNotFoundError``).
        S3WriteError: the request failed (after retries).
    """
    bucket, key = client.split(path)

    async def get() -> bytes:
        response = await client.call("get_object", Bucket=bucket, Key=key, Range=f"bytes=-{nbytes}")
        body = response["Body"]
        try:
            data = bytes(await body.read())
        finally:
            body.close()
        return data[-nbytes:]  # a server that ignores Range answers the whole object

    try:
        return bytes(client.run(f"reading the end of {path}", get, nbytes=nbytes))
    except S3WriteError as exc:
        if error_code(exc) == "InvalidRange":  # S3 refuses any range of an empty object (416)
            return b""
        raise


def read_bytes(client: S3Client, path: str, *, max_concurrent_parts: int, read_range_bytes: int | None) -> bytearray:
    """The whole object at ``path`` in a new ``bytearray`` (see :func:`read_into`)."""
    buffers: list[bytearray] = []

    def allocate(size: int) -> memoryview:
        buffers[:] = [bytearray(size)]
        return memoryview(buffers[0])

    read_into(client, path, allocate, max_concurrent_parts=max_concurrent_parts, read_range_bytes=read_range_bytes)
    return buffers[0]


def fetch_into_memfd(source: ReadsInto, path: str) -> int:
    """Fetch the object at ``path`` into a new anonymous in-memory file; return its descriptor (the caller closes
    it). The bytes live in host memory (shmem), counted against this process's memory limits like any allocation.
    Linux only (``os.memfd_create``).

    Raises:
        S3NotFoundError: nothing at ``path``.
        S3WriteError: a request failed (after retries).
    """
    fd = os.memfd_create("datastates-load", os.MFD_CLOEXEC)
    mappings: list[mmap.mmap] = []  # one per attempt, the current one last
    try:

        def allocate(size: int) -> memoryview:
            # A retry after the object changed starts over in the same file: emptied, then sized again. The failed
            # attempt's mapping is not closed here: views of it may live on (in the traceback of the error that ended
            # it) and would make close() fail; nothing writes to it any more (its reads were cancelled and awaited),
            # and it is closed with the others at the end.
            os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
            if size == 0:
                return memoryview(bytearray())
            mappings.append(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
            return memoryview(mappings[-1])

        source.read_into(path, allocate)
    except BaseException:
        os.close(fd)
        raise
    finally:
        for mapping in mappings:
            try:
                mapping.close()
            except BufferError:  # a range's view not yet collected: the mapping goes with it (same pages anyway)
                pass
    return fd


async def _read_ranges(
    client: S3Client,
    path: str,
    bucket: str,
    key: str,
    etag: str,
    target: memoryview,
    step: int,
    max_concurrent_parts: int,
) -> None:
    size = target.nbytes
    if size == 0:
        return
    semaphore = asyncio.Semaphore(max_concurrent_parts)

    async def read_range(start: int, stop: int) -> None:
        async with semaphore:
            await client.with_retries(
                f"reading bytes {start}-{stop - 1} of {path}",
                lambda: _get_range(client, bucket, key, etag, target[start:stop], start),
                nbytes=stop - start,
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


async def _get_range(client: S3Client, bucket: str, key: str, etag: str, target: memoryview, start: int) -> None:
    stop = start + target.nbytes
    response = await client.call("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", IfMatch=etag)
    body = response["Body"]
    try:
        # A server that ignores Range answers the whole object from its first byte: these bytes would land at
        # ``start`` unnoticed without a CRC check. Only the range asked for is taken.
        answered = str(response.get("ContentRange") or "")
        if not answered.startswith(f"bytes {start}-{stop - 1}/"):
            raise OSError(f"asked for bytes {start}-{stop - 1}, the server answered {answered or 'the whole object'}")
        position = 0
        while position < target.nbytes:
            chunk = await body.read(min(4 * MiB, target.nbytes - position))
            if not chunk:
                raise OSError(f"connection closed after {position} of {target.nbytes} bytes")
            target[position : position + len(chunk)] = chunk
            position += len(chunk)
    finally:
        body.close()
