"""Timed resumes (``--resume``): the last checkpoint of a ``tiered`` run loaded from the local tier, and from the
persistent one.

Runs in the ``tiered`` worker subprocess after its fit (:mod:`~lightning_datastates.benchmark.worker`, main thread;
every copy to the persistent tier has ended). Each load is made by a new :class:`~lightning_datastates.DataStatesIO`,
as a restarted job would: its host arena is empty, so nothing is served from the memory of the run that saved. With
the local tier it reads the local copy (the plugin checks first that the persistent file is still the one it was
replicated as: a stat, or a HEAD on S3); without one it reads the persistent path. Before each load the local files
(and a persistent file on a local file system) are dropped from the page cache, so that both read from storage;
objects on moto's server stay wherever that server keeps them.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from lightning_datastates.benchmark.recording import is_local
from lightning_datastates.plugin import DataStatesIO

#: Loads per tier, alternating local and persistent; the fastest of each counts (first-call costs and a moment of
#: other load on a shared machine do not).
_REPEATS = 2


def drop_from_page_cache(path: str) -> None:
    """Ask the kernel to drop the cached pages of the file ``path``, or of every file under the directory ``path``
    (``POSIX_FADV_DONTNEED``: clean pages only, and the checkpoints were fsynced); nothing where that cannot be
    asked."""
    if not hasattr(os, "posix_fadvise"):
        return
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in paths:
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_resume(path: str, local_copy: str, local_tier: str, options: dict[str, Any]) -> dict[str, Any]:
    """Seconds to load the checkpoint ``path`` (its persistent path) with a new plugin: ``local_s`` with the local tier
    ``local_tier`` (None where its local copy ``local_copy`` is gone: nothing local to time), ``persistent_s``
    without one. ``options``: the other keyword arguments of the plugin, as the run had them."""
    single_tier = {name: value for name, value in options.items() if name not in ("local_tier", "local_keep")}
    tiers = {"local": {**single_tier, "local_tier": local_tier}, "persistent": single_tier}
    if not os.path.exists(local_copy):
        del tiers["local"]
    seconds: dict[str, list[float]] = {tier: [] for tier in tiers}
    for _ in range(_REPEATS):
        for tier, plugin_options in tiers.items():
            drop_from_page_cache(local_tier)
            if is_local(path) and os.path.exists(path):
                drop_from_page_cache(path)
            plugin = DataStatesIO(**plugin_options)
            started = time.perf_counter()
            state = plugin.load_checkpoint(path)
            seconds[tier].append(time.perf_counter() - started)
            plugin.teardown()
            del state
            gc.collect()
    return {f"{tier}_s": min(seconds[tier]) if seconds.get(tier) else None for tier in ("local", "persistent")}
