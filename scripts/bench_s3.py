"""Upload and load times of one checkpoint file through S3Writer vs plain s3fs, against moto's server on loopback.

    python3 scripts/bench_s3.py                       # 256 MiB, parts of 8 and 64 MiB, windows 1/4/8/16, 3 repeats
    python3 scripts/bench_s3.py --size-mib 64 --repeats 1

The server runs as its own process (``moto_server``), so it does not share the client's GIL. Every figure is the
median of ``--repeats`` runs. Upload: ``S3Writer`` fed from a bytes buffer by 4 threads in 64 MiB ranges (as the
engine's writer threads feed it), begin to complete, vs ``fs.pipe_file(key, data)`` with s3fs's defaults. Load:
``reader.load_checkpoint`` (concurrent ranged GETs into an in-memory file, CRC-32 check, mapped ``torch.load``) vs
``torch.load(fs.open(path, "rb"))``. For each part size, boto3's own multipart transfer (``upload_fileobj`` from
memory, parts of that size, as many at once as the widest window): the raw upload the benchmark's ``repl vs raw``
is measured against (python -m lightning_datastates.benchmark --moto). Loopback moto is CPU-bound (the server
parses and stores every byte, the client SHA-256-signs every payload over plain HTTP), so absolute numbers say little
about real S3; the comparison between drivers on the same machine is the point.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from lightning_datastates.load.reader import load_checkpoint
from lightning_datastates.storage.s3 import S3Writer
from tests.s3_server import MotoProcess, S3Env

MiB = 1024**2
FEED_BYTES = 64 * MiB
FEED_THREADS = 4


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process used so far."""
    if pid == os.getpid():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Timing:
    """Median wall time of repeated runs, with the CPU seconds the client and the server spent per run."""

    server_pid = 0

    def __init__(self, run: Callable[[], None], repeats: int, between: Callable[[], None]) -> None:
        walls, client, server = [], [], []
        for _ in range(repeats):
            between()
            cpu0, srv0, started = _cpu_s(os.getpid()), _cpu_s(self.server_pid), time.perf_counter()
            run()
            walls.append(time.perf_counter() - started)
            client.append(_cpu_s(os.getpid()) - cpu0)
            server.append(_cpu_s(self.server_pid) - srv0)
        self.wall_s = statistics.median(walls)
        self.client_cpu_s = statistics.median(client)
        self.server_cpu_s = statistics.median(server)

    def row(self, size_mib: int) -> str:
        return f"{self.wall_s:.2f} | {size_mib / self.wall_s:.0f} | {self.client_cpu_s:.2f} | {self.server_cpu_s:.2f}"


def _upload_with_writer(writer: S3Writer, path: str, data: bytes) -> None:
    session = writer.begin(path, len(data))
    view = memoryview(data)
    ranges = [(offset, min(FEED_BYTES, len(data) - offset)) for offset in range(0, len(data), FEED_BYTES)]

    def feed(mine: list[tuple[int, int]]) -> None:
        for offset, size in mine:
            session.write_range(offset, view[offset : offset + size])

    threads = [threading.Thread(target=feed, args=(ranges[i::FEED_THREADS],)) for i in range(FEED_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    session.complete()


def _upload_with_boto3(client: Any, bucket: str, key: str, data: bytes, part_bytes: int, concurrency: int) -> None:
    """boto3's managed multipart upload of ``data`` from memory (its classic transfer manager, threads)."""
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(
        multipart_threshold=part_bytes,
        multipart_chunksize=part_bytes,
        max_concurrency=concurrency,
        use_threads=True,
        preferred_transfer_client="classic",
    )
    client.upload_fileobj(io.BytesIO(data), bucket, key, Config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--part-mib", type=int, nargs="+", default=[8, 64])
    parser.add_argument(
        "--range-mib", type=int, nargs="+", default=[0, 16], help="ranged GET sizes for loads (0: the automatic size)"
    )
    parser.add_argument("--skip-upload", action="store_true", help="only the load comparison")
    args = parser.parse_args()

    server = MotoProcess().start()
    assert server.process is not None
    Timing.server_pid = server.process.pid
    try:
        env = S3Env(server.endpoint)
        env.client.create_bucket(Bucket=env.bucket)
        import s3fs

        fs = s3fs.S3FileSystem(**env.storage_options, skip_instance_cache=True)
        size = args.size_mib * MiB
        data = os.urandom(size)
        key, path = "bench/upload.bin", env.url("bench/upload.bin")

        def clean() -> None:
            for stale in env.keys("bench/"):
                env.client.delete_object(Bucket=env.bucket, Key=stale)

        print(
            f"# {args.size_mib} MiB, median of {args.repeats}, moto_server subprocess on {server.endpoint}, "
            f"{os.cpu_count()} CPUs"
        )
        print("| upload | part size | window | wall s | MiB/s | client CPU s | server CPU s |")
        print("|---|---|---|---|---|---|---|")
        fs.pipe_file(f"{env.bucket}/bench/warmup.bin", data[:MiB])  # build the client
        if args.skip_upload:
            args.part_mib = []
        if args.part_mib:
            baseline = Timing(lambda: fs.pipe_file(f"{env.bucket}/{key}", data), args.repeats, clean)
            print(f"| s3fs pipe_file (defaults) | 50 MiB | 1 | {baseline.row(args.size_mib)} |")
        for part_mib in args.part_mib:
            window = max(args.concurrency)
            upload = functools.partial(_upload_with_boto3, env.client, env.bucket, key, data, part_mib * MiB, window)
            timing = Timing(upload, args.repeats, clean)
            print(f"| boto3 upload_fileobj (from memory) | {part_mib} MiB | {window} | {timing.row(args.size_mib)} |")
            for window in args.concurrency:
                writer = S3Writer(env.storage_options, part_size_bytes=part_mib * MiB, max_concurrent_parts=window)
                # Each writer owns its clients: build them and run each multipart call once, untimed (botocore
                # loads them lazily).
                _upload_with_writer(writer, env.url("bench/warmup.bin"), data[: writer.part_size_bytes + 1])
                upload = functools.partial(_upload_with_writer, writer, path, data)
                timing = Timing(upload, args.repeats, clean)
                assert env.client.head_object(Bucket=env.bucket, Key=key)["ContentLength"] == size
                print(f"| S3Writer | {part_mib} MiB | {window} | {timing.row(args.size_mib)} |")

        # Load: a real checkpoint file of the same size.
        clean()
        buffer = io.BytesIO()
        torch.save({"state_dict": {"w": torch.randn(size // 4)}}, buffer)
        ckpt_key, ckpt_path = "bench/model.ckpt", env.url("bench/model.ckpt")
        checkpoint_bytes = buffer.getvalue()
        env.put(ckpt_key, checkpoint_bytes)
        env.put("bench/warmup.bin", b"w" * MiB)
        del buffer
        mib = round(len(checkpoint_bytes) / MiB)
        print()
        print("| load | window (range size) | wall s | MiB/s | client CPU s | server CPU s |")
        print("|---|---|---|---|---|---|")

        def plain() -> None:
            with fs.open(f"{env.bucket}/{ckpt_key}", "rb") as stream:
                torch.load(stream, weights_only=True)

        print(f"| torch.load(fs.open(path, 'rb')) | - | {Timing(plain, args.repeats, lambda: None).row(mib)} |")
        for window in args.concurrency:
            for range_mib in args.range_mib:
                range_bytes = range_mib * MiB if range_mib else None
                writer = S3Writer(env.storage_options, max_concurrent_parts=window, read_range_bytes=range_bytes)
                writer.exists(ckpt_path)  # build this writer's clients, untimed
                writer.read_bytes(env.url("bench/warmup.bin"))
                ranges = f"{window} ({writer.range_bytes_for(len(checkpoint_bytes)) / MiB:.0f} MiB)"
                load = functools.partial(load_checkpoint, writer, ckpt_path, weights_only=True)
                full = Timing(load, args.repeats, lambda: None)
                print(f"| DataStatesIO load (ranged GETs, memfd, mapped) | {ranges} | {full.row(mib)} |")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
