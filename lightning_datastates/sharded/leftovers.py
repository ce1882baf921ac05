"""What a sharded save that never committed leaves on local storage, and how the next run removes it.

While a sharded save is in flight, rank 0 keeps a marker in its directory, named like every leftover of this package
(``.commit.<host>.<pid>.<token>.datastates-pending``, :mod:`~lightning_datastates.storage.leftovers`), and removes it
once the checkpoint is committed or discarded. A directory with a marker whose writer is gone (by the same rule as
temporary files) holds a save that died in flight: without ``meta.pt`` it is no checkpoint at all and is removed
whole; with one, it still holds the checkpoint committed there before, and only the files that checkpoint's
``.metadata`` does not name are removed.

Local paths only (on S3 an uncommitted directory is a set of objects without ``meta.pt``; see docs/design.md).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import time

from lightning_datastates.sharded.commit import LIGHTNING_META_NAME
from lightning_datastates.sharded.dcp_writer import DCP_METADATA_NAME
from lightning_datastates.storage.leftovers import leftover_name, parse_leftover_name, writer_gone

log = logging.getLogger("lightning_datastates")

#: Suffix of the marker of a sharded save in flight.
PENDING_SUFFIX = ".datastates-pending"


def mark_pending(directory: str) -> str:
    """Create this process's marker in ``directory`` (local) and return its path."""
    marker = os.path.join(directory, leftover_name("commit", PENDING_SUFFIX))
    with open(marker, "wb"):
        pass
    return marker


def clean_sharded_leftovers(parent: str, max_age_s: float) -> list[str]:
    """Remove what dead sharded saves left in the subdirectories of local ``parent``; the paths removed."""
    try:
        entries = [entry for entry in os.scandir(parent) if entry.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    removed: list[str] = []
    now = time.time()
    for entry in entries:
        try:
            names = os.listdir(entry.path)
        except OSError:
            continue
        markers = {name: parsed for name in names if (parsed := parse_leftover_name(name, PENDING_SUFFIX)) is not None}
        if not markers:
            continue
        gone = [
            name
            for name, parsed in markers.items()
            if writer_gone(parsed.owner, _age_s(entry.path, name, now), max_age_s, tracks_own_writes=False)
        ]
        if len(gone) != len(markers):
            continue  # a live process still saves here
        removed += _remove_uncommitted(entry.path, names)
    if removed:
        log.info("lightning_datastates: removed %d leftover(s) of sharded saves that died in %s", len(removed), parent)
    return removed


def _remove_uncommitted(directory: str, names: list[str]) -> list[str]:
    if LIGHTNING_META_NAME not in names:
        shutil.rmtree(directory, ignore_errors=True)
        return [directory]
    try:
        with open(os.path.join(directory, DCP_METADATA_NAME), "rb") as handle:
            metadata = pickle.load(handle)
        keep = {info.relative_path for info in metadata.storage_data.values()}
    except Exception as exc:  # noqa: BLE001 - keep everything rather than guess
        log.warning("lightning_datastates: cannot read %s (%r); leftovers there kept", directory, exc)
        return []
    keep |= {DCP_METADATA_NAME, LIGHTNING_META_NAME}
    removed = []
    for name in names:
        if name not in keep:
            path = os.path.join(directory, name)
            try:
                os.unlink(path)
                removed.append(path)
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
    return removed


def _age_s(directory: str, name: str, now: float) -> float | None:
    try:
        return now - os.stat(os.path.join(directory, name)).st_mtime
    except FileNotFoundError:
        return None
