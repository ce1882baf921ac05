"""Block alignment shared by the host arena, the chunk planner and direct I/O: one rule, one place."""

from __future__ import annotations

import mmap

#: Host blocks and direct-I/O requests are aligned to the page size, at least 4 KiB: kernels with 16 or 64 KiB pages
#: (some arm64 and POWER machines) map and pin memory in those units, and ``O_DIRECT`` accepts any multiple of the
#: logical block size (512 B or 4 KiB on today's disks).
PAGE_ALIGNMENT_BYTES = max(4096, mmap.PAGESIZE)


def align_up(nbytes: int, alignment: int = PAGE_ALIGNMENT_BYTES) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (nbytes + alignment - 1) & ~(alignment - 1)
