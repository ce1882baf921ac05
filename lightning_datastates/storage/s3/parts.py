"""How a checkpoint file is cut into multipart-upload parts, within S3's limits (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MiB = 1024**2
#: S3's limits: parts of 5 MiB to 5 GiB (the last may be smaller), at most 10,000 parts, objects up to 5 TiB.
MIN_PART_BYTES = 5 * MiB
MAX_PART_BYTES = 5 * 1024**3
MAX_PARTS = 10_000
MAX_OBJECT_BYTES = 5 * 1024**4


@dataclass(frozen=True)
class PartPlan:
    """How a file of ``total_bytes`` is cut into parts: part ``i`` holds bytes ``[i*part_bytes, (i+1)*part_bytes)``."""

    total_bytes: int
    part_bytes: int
    count: int

    @property
    def multipart(self) -> bool:
        """Whether the file goes up as a multipart upload (more than one part) rather than one ``PutObject``."""
        return self.count > 1

    def length(self, index: int) -> int:
        """Bytes in part ``index`` (the last one may be shorter)."""
        return min(self.part_bytes, self.total_bytes - index * self.part_bytes)


def plan_parts(total_bytes: int, part_size_bytes: int) -> PartPlan:
    """Cut ``total_bytes`` into parts of about ``part_size_bytes``, within S3's limits.

    The part size is clamped to [5 MiB, 5 GiB] and grown (to whole MiB) when the file would need more than
    10,000 parts.

    Raises:
        ValueError: the file is larger than S3's 5 TiB object limit, or ``total_bytes`` is negative.
    """
    if total_bytes < 0:
        raise ValueError(f"total_bytes must be >= 0, got {total_bytes}")
    if total_bytes > MAX_OBJECT_BYTES:
        raise ValueError(f"a checkpoint of {total_bytes} bytes is larger than S3's 5 TiB object limit")
    part = min(max(part_size_bytes, MIN_PART_BYTES), MAX_PART_BYTES)
    if math.ceil(total_bytes / part) > MAX_PARTS:
        part = math.ceil(math.ceil(total_bytes / MAX_PARTS) / MiB) * MiB
    return PartPlan(total_bytes, part, max(1, math.ceil(total_bytes / part)))
