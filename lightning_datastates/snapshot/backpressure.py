"""Back-pressure, said once: when training waits because storage is slower than the checkpoints come.

Training can wait for storage in two places: a save call that finds too many checkpoints still in flight, and a
barrier whose snapshot is still copying because the host arena had no free space (the copy waited for a flush). Both
mean the same: checkpoints of this size come faster than storage takes them, and the arena is too small to absorb
the difference. The first time it happens the engine warns, on the training thread (only global rank 0 saves), with
what it measured and the three fixes; later occurrences only show in the metrics (``blocked_s``).

:func:`describe_back_pressure` is pure: it builds the message from the recent checkpoints' figures.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

from lightning_datastates.records.job import JobState, SnapshotStats


class BackPressureWarning(UserWarning):
    """Training waited for checkpoints to reach storage: storage is slower than the checkpoints come."""


def describe_back_pressure(waited_s: float, recent: Sequence[SnapshotStats], arena_bytes: int) -> str:
    """The warning for a wait of ``waited_s`` seconds, from ``recent`` checkpoints (oldest first) and the arena size.

    Names the measured rate to storage (bytes over save-to-durable time of the committed checkpoints), the interval
    between saves, how many checkpoints the arena holds, and the fixes.
    """
    rates = [s.total_bytes / s.durable_s for s in recent if s.state == JobState.COMMITTED.value and s.durable_s]
    sizes = [s.total_bytes for s in recent if s.total_bytes > 0]
    size = statistics.median(sizes) if sizes else 0
    starts = sorted(s.started_at for s in recent)
    intervals = [b - a for a, b in itertools.pairwise(starts) if b > a]
    facts = [f"training waited {waited_s:.2f} s for earlier checkpoints to reach storage (back-pressure)"]
    if size:
        facts.append(f"checkpoints of {size / 1e9:.2f} GB")
    if intervals:
        facts.append(f"saved every {statistics.median(intervals):.2f} s")
    if rates:
        rate = statistics.median(rates)
        flush_s = size / rate if rate and size else 0.0
        facts.append(f"durable at {rate / 1e9:.2f} GB/s from the save call ({flush_s:.2f} s each)")
    held = arena_bytes / size if size else 0.0
    facts.append(f"host arena {arena_bytes / 1e9:.2f} GB ({held:.1f} checkpoint(s))")
    return (
        "lightning_datastates: "
        + "; ".join(facts)
        + ". To stop waiting: give DataStatesIO a larger host_cache (room for the checkpoints written meanwhile), "
        "checkpoint less often (ModelCheckpoint every_n_train_steps / train_time_interval), or write to faster "
        "storage. Warned once; every wait is in the blocked_s metric."
    )
