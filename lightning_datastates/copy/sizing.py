"""The default size of the host arena: one rule, pure, written down.

With ``host_cache=None`` the arena is sized from the first checkpoint it serves:

- it holds :data:`CHECKPOINTS_HELD` checkpoints (two): one can be copied while the previous one is still being
  flushed, so a checkpoint that comes before the previous flush ended does not stall training (double buffering, as
  DataStates-LLM's host ring);
- at least :data:`MIN_ARENA_BYTES`, so that tiny checkpoints are not cut into tiny chunks;
- at most half the memory available when it is sized (``MemAvailable``): the rest stays for the training process,
  its data loaders and the page cache. A checkpoint larger than that streams through the arena in chunks (the copy
  then waits for the flush, chunk by chunk);
- never below :data:`FLOOR_BYTES`, whatever the host reports.

A user's ``host_cache`` overrides the rule entirely. Where the state is on the CPU the pages of the checkpoints that
routinely sit in the arena together (:func:`checkpoints_mapped_ahead`) are mapped in (resident) shortly after the arena
is made, by a thread of its own (copy/prefault.py), and the rest of the arena only once a copy first writes it; where
it is on a GPU the whole arena is page-locked (resident) shortly after it is made.
"""

from __future__ import annotations

import os

#: Checkpoints the default arena holds: the one being copied and the one still being flushed.
CHECKPOINTS_HELD = 2
#: The default arena is at least this large.
MIN_ARENA_BYTES = 64 * 1024**2
#: Whatever the host reports, the arena is never smaller than this (a few chunks).
FLOOR_BYTES = 16 * 1024**2


def default_arena_bytes(checkpoint_bytes: int, available_bytes: int | None) -> int:
    """The arena size for checkpoints of ``checkpoint_bytes`` on a host with ``available_bytes`` free (None: unknown,
    no bound); see the module docstring."""
    wanted = max(CHECKPOINTS_HELD * checkpoint_bytes, MIN_ARENA_BYTES)
    if available_bytes is None:
        return wanted
    return max(min(wanted, available_bytes // 2), FLOOR_BYTES)


def available_memory_bytes() -> int | None:
    """Memory the kernel could give this process now without swapping (``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def checkpoints_mapped_ahead(keeps_written: bool) -> int:
    """How many checkpoints' worth of arena pages to map in ahead of the copies where the state is on the CPU (pure).

    :data:`CHECKPOINTS_HELD` where written checkpoints stay in the arena (``serve_from_memory``: the newest one is kept
    for loading, so the next copy lands beside it); one where blocks are freed once written (sharded saves, whose
    files DCP's reader reads from storage, or ``serve_from_memory=False``): the next copy reuses the same blocks (free
    space is handed out lowest offset first), and the rest is mapped only if a copy overlaps a flush. Mapping ahead
    what no copy writes would only add resident memory: a whole checkpoint's shards per rank.
    """
    return CHECKPOINTS_HELD if keeps_written else 1
