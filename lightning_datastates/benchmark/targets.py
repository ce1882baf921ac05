"""Where a benchmark run's checkpoints go, and what that storage can do by itself.

The *target* (``--dir``) is where ``ModelCheckpoint`` saves: a directory, or an ``s3://bucket/prefix``; ``--moto``
makes it a prefix on moto's S3 server, started on a loopback port for the run
(:mod:`~lightning_datastates.benchmark.moto`): a persistent tier slower than the local disk. The ``tiered`` method
commits each checkpoint on its *local tier* (``--local-tier``, default a new temporary directory) first, then
replicates it to the target.

The raw throughput of each, measured by :mod:`~lightning_datastates.benchmark.runner` with the bytes of one
checkpoint: a directory by :func:`raw_write_throughput` (one file written and fsynced, through the page cache and with
``O_DIRECT``); an ``s3://`` target by :func:`s3_upload_throughput` (one object uploaded from memory by boto3, with the
part size and the parts in flight of the plugin's S3 writer).

Runs in the parent process (main thread) and never imports torch; boto3 is imported for an ``s3://`` target only.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_datastates.benchmark.choices import MODELS
from lightning_datastates.benchmark.moto import MotoServer, missing_moto
from lightning_datastates.benchmark.options import datastates_options
from lightning_datastates.copy.sizing import available_memory_bytes

#: The raw-throughput probe writes in calls of this size (a large sequential write, as a checkpoint's flush is).
_RAW_CHUNK_BYTES = 64 * 2**20
#: The bucket ``--moto`` creates when ``--dir`` names none.
MOTO_BUCKET = "datastates-bench"
#: The kinds of raw measurement of a directory, and of an ``s3://`` target.
DIRECTORY_KINDS = ("buffered", "direct")
S3_KINDS = ("upload",)


def is_s3(path: str | None) -> bool:
    """Whether ``path`` is an ``s3://`` (or ``s3a://``) URL."""
    return bool(path) and str(path).startswith(("s3://", "s3a://"))


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``."""
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key.strip("/")


@dataclass
class Target:
    """The places of one benchmark: ``base`` (the target: a directory or an ``s3://`` prefix; each run writes under
    ``base/<run>``) and ``local_base`` (each ``tiered`` run's local tier is ``local_base/<run>``; None without one).

    ``storage_options``: the plugin's (``--datastates storage_options=...``), whose endpoint and keys the raw
    upload uses too. ``made``: temporary directories of this benchmark, removed at the end (unless ``--keep``).
    """

    base: str
    local_base: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)

    @property
    def s3(self) -> bool:
        """Whether the target is an ``s3://`` prefix."""
        return is_s3(self.base)

    @property
    def raw_kinds(self) -> tuple[str, ...]:
        """The kinds of raw measurement of the target (see :meth:`raw_Bps`)."""
        return S3_KINDS if self.s3 else DIRECTORY_KINDS

    def run_path(self, name: str) -> str:
        """Where the run ``name`` saves its checkpoints."""
        return f"{self.base.rstrip('/')}/{name}" if self.s3 else os.path.join(self.base, name)

    def remove(self, path: str) -> None:
        """Remove a run's checkpoints: the directory, or every object under the prefix."""
        if is_s3(path):
            bucket, prefix = split_s3(path)
            client = s3_client(self.storage_options)
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
                keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        else:
            shutil.rmtree(path, ignore_errors=True)

    def raw_Bps(self, nbytes: int, transfer: Sequence[int] | None) -> dict[str, float | None]:
        """Bytes per second the target takes ``nbytes`` at, by kind: ``buffered`` and ``direct`` for a directory
        (:func:`raw_write_throughput`), ``upload`` for S3 (:func:`s3_upload_throughput` with ``transfer``: the S3
        writer's part size and parts in flight, as the run's worker reported them)."""
        if not self.s3:
            return directory_raw_Bps(self.base, nbytes)
        if transfer is None:  # the worker reports the writer's shape for every run at an s3:// target
            return {"upload": None}
        part_bytes, concurrency = transfer
        url = self.run_path(f".raw-upload-{os.getpid()}")
        return {"upload": s3_upload_throughput(url, nbytes, part_bytes, concurrency, self.storage_options)}

    def local_raw_Bps(self, nbytes: int) -> dict[str, float | None]:
        """As :meth:`raw_Bps` for the local tier (a directory); empty without one."""
        if self.local_base is None:
            return {}
        return directory_raw_Bps(self.local_base, nbytes)


@contextlib.contextmanager
def prepared_target(args: argparse.Namespace, tiered: bool) -> Iterator[Target]:
    """The places of the benchmark ``args`` asks for, made ready: a temporary target directory where ``--dir`` is
    not given; with ``--moto`` the server started, its bucket made and the ``AWS_*`` variables that reach it set for
    the workers; where ``tiered``, the local tier (``--local-tier``, else a temporary directory), under which each
    tiered run gets its own: ``args.local_tier`` is set to it. Afterwards the server is stopped, the variables
    restored, and (unless ``--keep``) the temporary directories removed.

    Raises:
        SystemExit: ``--moto`` without moto's server or s3fs installed (the message says what to install).
    """
    options = dict(datastates_options(args.datastates).get("storage_options") or {})
    target = Target(base=args.dir or "", storage_options=options)
    server: MotoServer | None = None
    saved_env = dict(os.environ)
    try:
        if args.moto:
            if (missing := missing_moto()) is not None:
                raise SystemExit(missing)
            server = MotoServer(environment=moto_settings(args)).start()
            os.environ.update(server.environment())
            os.environ.pop("AWS_PROFILE", None)  # a profile's settings would win over the variables above
            target.base = args.dir or f"s3://{MOTO_BUCKET}/run-{time.strftime('%Y%m%d-%H%M%S')}"
            s3_client(options).create_bucket(Bucket=split_s3(target.base)[0])
        elif not target.base:
            target.base = tempfile.mkdtemp(prefix="datastates-bench-")
            target.made.append(target.base)
        if not target.s3:
            os.makedirs(target.base, exist_ok=True)
        if tiered:
            target.local_base = args.local_tier or tempfile.mkdtemp(prefix="datastates-bench-local-")
            if not args.local_tier:
                target.made.append(target.local_base)
            os.makedirs(target.local_base, exist_ok=True)
            args.local_tier = target.local_base  # the runs' local tiers are named after it (runner._spawn)
        yield target
    finally:
        if not args.keep:
            for directory in target.made:
                shutil.rmtree(directory, ignore_errors=True)
        if server is not None:
            server.kill()
        os.environ.clear()
        os.environ.update(saved_env)


def moto_settings(args: argparse.Namespace) -> dict[str, str]:
    """moto's settings for the run ``args`` asks for (a line on stdout says which): every object in memory where one
    run's checkpoints fit in a quarter of the memory available now, else moto's default (objects beyond 5 MiB in
    temporary files).

    A remote tier does not write to the local disk: moto's temporary files would, competing with the local tier's
    writes. Each run's objects are removed after it, so the server holds one run's at most; their size is estimated
    from the model's shape (weights and two Adam moments in fp32, 12 bytes per parameter).
    """
    vocab, dim, layers = MODELS[args.model][:3]
    run_bytes = (vocab * dim + layers * 12 * dim * dim) * 12 * (args.steps // args.every)
    size = f"a run's checkpoints: {run_bytes / 1e9:.1f} GB"
    available = available_memory_bytes()
    if available is not None and run_bytes * 4 > available:
        print(f"benchmark: moto keeps objects in temporary files ({size}, more than a quarter of the free memory)")
        return {}
    print(f"benchmark: moto keeps objects in memory ({size})")
    return {"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(run_bytes + 1)}


def s3_client(storage_options: dict[str, Any]) -> Any:
    """A boto3 S3 client: the endpoint and keys of ``storage_options`` (s3fs's names) where given, else the
    ``AWS_*`` variables (``AWS_ENDPOINT_URL`` included), as s3fs reads them."""
    import boto3  # type: ignore[import-untyped]  # untyped; in moto's server extra and s3fs's optional deps

    kwargs = {"region_name": (storage_options.get("client_kwargs") or {}).get("region_name")}
    for ours, theirs in (("endpoint_url", "endpoint_url"), ("key", "aws_access_key_id"),
                         ("secret", "aws_secret_access_key")):  # fmt: skip
        kwargs[theirs] = storage_options.get(ours)
    return boto3.client("s3", **{name: value for name, value in kwargs.items() if value is not None})


class _RepeatedBytes:
    """A readable stream of ``nbytes`` bytes, ``block`` over and over (what boto3 uploads from memory)."""

    def __init__(self, block: bytes, nbytes: int) -> None:
        self.block, self.left, self.offset = block, nbytes, 0

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all that is left for -1)."""
        size = self.left if size is None or size < 0 else min(size, self.left)
        out = bytearray()
        while len(out) < size:
            take = min(size - len(out), len(self.block) - self.offset)
            out += self.block[self.offset : self.offset + take]
            self.offset = (self.offset + take) % len(self.block)
        self.left -= size
        return bytes(out)


def s3_upload_throughput(
    url: str, nbytes: int, part_bytes: int, concurrency: int, storage_options: dict[str, Any]
) -> float:
    """Bytes per second of uploading ``nbytes`` from memory to the object ``url`` with boto3's multipart transfer
    (parts of ``part_bytes``, ``concurrency`` at once, as the plugin's S3 writer uploads), until the upload is
    complete; the object is removed afterwards."""
    from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]

    client = s3_client(storage_options)
    bucket, key = split_s3(url)
    config = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes,
                            max_concurrency=concurrency, use_threads=True,
                            preferred_transfer_client="classic")  # fmt: skip
    stream = _RepeatedBytes(os.urandom(min(nbytes, _RAW_CHUNK_BYTES)), nbytes)
    started = time.perf_counter()
    try:
        client.upload_fileobj(stream, bucket, key, Config=config)
        return nbytes / (time.perf_counter() - started)
    finally:
        client.delete_object(Bucket=bucket, Key=key)


def directory_raw_Bps(directory: str, nbytes: int) -> dict[str, float | None]:
    """:func:`raw_write_throughput` of ``directory`` for ``nbytes``, through the page cache (``buffered``) and with
    ``O_DIRECT`` (``direct``: None where the file system refuses it)."""
    return {kind: raw_write_throughput(directory, nbytes, direct=kind == "direct") for kind in DIRECTORY_KINDS}


def raw_write_throughput(directory: str, nbytes: int, direct: bool = False) -> float | None:
    """Bytes per second of writing ``nbytes`` sequentially into a new file in ``directory`` (64 MiB ``write``
    calls) and fsyncing it; the file is removed afterwards.

    ``direct``: with ``O_DIRECT`` from a page-aligned buffer (``nbytes`` rounded up to whole 4 KiB blocks), as a
    tool such as ``fio --direct=1`` measures a device; None where the file system refuses it.
    """
    size = min(nbytes, _RAW_CHUNK_BYTES)
    buffer = mmap.mmap(-1, -(-size // 4096) * 4096)  # anonymous mappings are page-aligned
    buffer.write(os.urandom(size))
    block = memoryview(buffer)
    if direct:
        nbytes = -(-nbytes // 4096) * 4096
    path = os.path.join(directory, f".raw-write-{os.getpid()}.bin")
    elapsed: float | None = None
    try:
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0), 0o600)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, block[: min(left, len(block))])
            os.fsync(fd)
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - started  # before the unlink: only the write and the fsync are timed
    except OSError:
        if not direct:
            raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        block.release()
        buffer.close()
    return None if elapsed is None else nbytes / elapsed
