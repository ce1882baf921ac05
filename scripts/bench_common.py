"""What the local benchmark scripts share: their command line and their checkpoint of random float32 tensors."""

from __future__ import annotations

import argparse
import os
import tempfile

import torch


def parse_args(doc: str, rounds: int) -> tuple[argparse.Namespace, str]:
    """``[DIR] [--mib N] [--rounds N]`` parsed; return the arguments and the directory (a new temporary one if none)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=None)
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size in MiB")
    parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args()
    return args, args.directory or tempfile.mkdtemp(prefix="datastates-bench-")


def random_checkpoint(mib: int) -> dict:
    """A checkpoint of ``mib`` MiB: 16 float32 tensors of random values under ``state_dict``, and an epoch."""
    return {"state_dict": {f"w{i}": torch.randn(mib * 2**18 // 16) for i in range(16)}, "epoch": 0}


def evict_from_page_cache(path: str) -> None:
    """Write back and drop ``path``'s pages from the page cache, so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
