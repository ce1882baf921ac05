"""What a sharded save that never committed leaves on storage, and how the next run removes or completes it.

While a sharded save is in flight, rank 0 keeps a marker in its directory, named like every leftover of this package
(``.commit.<host>.<pid>.<token>.datastates-pending``, :mod:`~lightning_datastates.records.leftovers`), and removes
it once the checkpoint is committed or discarded. It is written before any other rank learns the directory
(:class:`~lightning_datastates.sharded.saver.ShardedSaver`), so that every file of the save lands after it. A
directory with a marker whose writer is gone (by the same rule as temporary files: a dead process of this host at
once, another host's once ``stale_after_s`` old) holds a save that died in flight. Rank 0 switches a directory to a
new checkpoint through a commit record (:mod:`~lightning_datastates.sharded.publish`), so the directory holds one
whole checkpoint or can be completed into one: with ``meta.pt``, the checkpoint ``.metadata`` describes (the one held
before, or the new one), and only the files it does not name are removed; without ``meta.pt`` but with the record, the
switch died half-way and is completed from the record, then cleaned the same way; with neither, it is no checkpoint
at all and is removed whole. The open uploads the dead ranks left in it go first (S3). Every backend that lists
directories is cleaned this way (local, S3, other fsspec:
:meth:`~lightning_datastates.storage.base.StorageWriter.list_directory`). A directory holding a removal marker
(:mod:`~lightning_datastates.storage.removal`) whose writer is gone was being removed when its writer died: its
removal is finished, whatever it still holds.
"""

from __future__ import annotations

import logging
import time

from lightning_datastates.records.leftovers import leftover_name, parse_leftover_name, writer_gone
from lightning_datastates.records.names import DCP_METADATA_NAME, LIGHTNING_META_NAME, PENDING_SUFFIX, REMOVING_SUFFIX
from lightning_datastates.sharded.dcp_writer import join_path
from lightning_datastates.sharded.publish import complete_or_keep, files_named
from lightning_datastates.storage.base import DirectoryEntry, StorageWriter
from lightning_datastates.storage.removal import finish_removal, is_removal_marker

log = logging.getLogger("lightning_datastates")


def mark_pending(writer: StorageWriter, directory: str) -> str:
    """Create this process's marker in ``directory`` and return its path: visible to every rank at once, durable
    before any file of the save is (:meth:`~lightning_datastates.storage.base.StorageWriter.create_marker`)."""
    marker = join_path(directory, leftover_name("commit", PENDING_SUFFIX))
    writer.create_marker(marker)
    return marker


def clean_leftovers(writer: StorageWriter, directory: str, max_age_s: float) -> list[str]:
    """Remove everything dead runs left in ``directory``: temporary files and open uploads
    (:meth:`~lightning_datastates.storage.base.StorageWriter.clean_stale`), then the sharded saves that died in flight
    in its subdirectories (:func:`clean_sharded_leftovers`); the paths removed. The plugin's cleanup at setup and the
    ``clean`` command both come here."""
    removed = writer.clean_stale(directory, max_age_s=max_age_s)
    return removed + clean_sharded_leftovers(writer, directory, max_age_s)


def clean_sharded_leftovers(writer: StorageWriter, parent: str, max_age_s: float) -> list[str]:
    """Remove what dead sharded saves left in the subdirectories of ``parent``; the paths removed.

    A subdirectory that cannot be cleaned (a storage error) is logged and left for the next run, which finds its
    marker again: what it holds is never taken for a checkpoint, so training need not stop for it.
    """
    removed: list[str] = []
    now = time.time()
    for entry in writer.list_directory(parent):
        if not entry.is_directory:
            continue
        directory = join_path(parent, entry.name)
        try:
            removed += _clean_directory(writer, directory, max_age_s, now)
        except Exception as exc:  # noqa: BLE001 - logged; the marker stays, the next run tries again
            log.warning("lightning_datastates: could not clean the dead sharded save in %s (%r); kept", directory, exc)
    if removed:
        log.info("lightning_datastates: removed %d leftover(s) of sharded saves that died in %s", len(removed), parent)
    return removed


def _clean_directory(writer: StorageWriter, directory: str, max_age_s: float, now: float) -> list[str]:
    """Clean ``directory`` if it holds a sharded save that died (a marker whose writer is gone); the paths removed."""
    entries = {e.name: e for e in writer.list_directory(directory)}
    markers = {
        n: m
        for n in entries
        if (m := parse_leftover_name(n, PENDING_SUFFIX) or parse_leftover_name(n, REMOVING_SUFFIX)) is not None
    }
    if not markers:
        return []
    ages = {n: _age_s(entries[n], now) for n in markers}
    if not all(writer_gone(m.owner, ages[n], max_age_s, tracks_own_writes=False) for n, m in markers.items()):
        return []  # a live process still saves or removes here
    writer.clean_stale(directory, max_age_s)  # the dead ranks' open uploads (S3), temporary files
    if any(is_removal_marker(name) for name in markers):
        # A removal died half-way (storage/removal.py): whatever it left is no checkpoint any more; finish it.
        log.info("lightning_datastates: finishing the removal of %s, which a dead run left half-way", directory)
        return finish_removal(writer, directory, list(entries.values()))
    return _settle(writer, directory, entries)


def _settle(writer: StorageWriter, directory: str, entries: dict[str, DirectoryEntry]) -> list[str]:
    """Leave the directory of a dead save (``entries``: what it holds, by name) one whole checkpoint, or remove it
    (see the module docstring); the paths removed."""
    if LIGHTNING_META_NAME not in entries:
        try:
            completed = complete_or_keep(writer, directory, set(entries))
        except Exception as exc:  # noqa: BLE001 - keep everything rather than guess
            log.warning("lightning_datastates: cannot complete the commit in %s (%r); kept as it is", directory, exc)
            return []
        if not completed:
            writer.remove(directory)
            return [directory]
        log.info("lightning_datastates: completed the commit of %s, which a dead run left half-way", directory)
        entries = {entry.name: entry for entry in writer.list_directory(directory)}
    try:
        keep = set(files_named(bytes(writer.read_bytes(join_path(directory, DCP_METADATA_NAME)))))
    except Exception as exc:  # noqa: BLE001 - keep everything rather than guess
        log.warning("lightning_datastates: cannot read %s (%r); leftovers there kept", directory, exc)
        return []
    keep |= {DCP_METADATA_NAME, LIGHTNING_META_NAME}
    leftovers = sorted(set(entries) - keep)
    markers = [name for name in leftovers if parse_leftover_name(name, PENDING_SUFFIX) is not None]
    files = [name for name in leftovers if name not in markers and not entries[name].is_directory]
    for name in leftovers:
        if entries[name].is_directory:  # not a save's, but no checkpoint's either
            writer.remove(join_path(directory, name))
    # In few requests (S3: one per thousand files), the markers last: a cleanup that fails or dies before the end
    # leaves the directory marked, so that the next run takes it up again.
    writer.remove_files(directory, files)
    writer.remove_files(directory, markers)
    return [join_path(directory, name) for name in leftovers]


def _age_s(entry: DirectoryEntry, now: float) -> float | None:
    return None if entry.modified_s is None else now - entry.modified_s
