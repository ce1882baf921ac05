"""What a run does at its first use of a checkpoint directory with a local tier: finish what an earlier run of this
node left (``docs/design.md``, "Tiered checkpoints", recovery).

1. The temporary files of the local writes a dead run was killed in go (the leftover rule of
   :mod:`~lightning_datastates.records.leftovers`), and so do replica notes of older releases.
2. Each local copy marked as not replicated by a writer that is gone (a dead process; or this process, where the
   marker's save is no longer in flight: writes given up by a second Ctrl-C) is decided by the rule of
   :func:`~lightning_datastates.tiered.copies.choose_copy`: replicated where it is the newest save of its name (its
   replication registered as pending, so that loads, removals and drains see it), dropped where the persistent file
   holds the same save (its replication ended, the marker did not) or a newer one (another run or node wrote it), or
   where it is damaged. A marker naming another save than the copy holds marks a write that never committed here. A
   copy whose checkpoint ``ModelCheckpoint`` had asked to remove (:meth:`TierLayout.mark_unwanted
   <lightning_datastates.tiered.layout.TierLayout.mark_unwanted>`) goes, with its persistent file, once a newer
   checkpoint is whole on either tier; else it is the newest there is and is replicated.
3. A replicated copy whose persistent file is gone (the user deleted it, or its storage is not mounted) goes, with a
   warning: it is never brought back as if it were the newest.
4. The retention applies; and other local tiers this host used (:func:`note_tier_used`) that hold copies of the same
   directory a dead run did not replicate are named in a warning (they would be orphaned silently otherwise).

Training thread; once per directory and run (and again after an abandon).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Protocol

from lightning_datastates.errors import CheckpointCorruptError, ConfigError
from lightning_datastates.load.reader import verify_checkpoint
from lightning_datastates.records.leftovers import this_process, writer_gone
from lightning_datastates.records.stamp import SAVE_SEQUENCE
from lightning_datastates.snapshot.pending import PendingReplication
from lightning_datastates.storage.base import read_stamp
from lightning_datastates.tiered.copies import Choice, CopyFacts, Presence, choose_copy, local_facts, persistent_facts
from lightning_datastates.tiered.layout import TierLayout, is_shortened
from lightning_datastates.tiered.replicator import Replication
from lightning_datastates.tiered.retention import local_copies

if TYPE_CHECKING:
    from lightning_datastates.config import DataStatesConfig
    from lightning_datastates.snapshot.engine import SnapshotEngine
    from lightning_datastates.storage.base import StorageWriter
    from lightning_datastates.storage.local import LocalWriter
    from lightning_datastates.tiered.replicator import Replicator

log = logging.getLogger("lightning_datastates")

#: Suffix of the replica notes older releases kept beside replicated copies (the save stamp replaced them).
LEGACY_NOTE_SUFFIX = ".datastates-replica"
#: Local tiers remembered per host (most recent last), for the warning of step 4.
_REMEMBERED_TIERS = 32


class TierHost(Protocol):
    """What the recovery asks of the local tier (:class:`~lightning_datastates.tiered.tiers.TieredCheckpoints`)."""

    layout: TierLayout
    live_markers: set[str]
    local_writer: LocalWriter

    @property
    def config(self) -> DataStatesConfig:
        """The plugin's settings."""

    def writer_for(self, path: str) -> StorageWriter:
        """The pipeline's storage writer of ``path``."""

    def replicator_of(self, engine: SnapshotEngine) -> Replicator:
        """The tier's replicator."""

    def prune(self, directory: str) -> None:
        """The retention of a local directory."""


def recover(tiers: TierHost, engine: SnapshotEngine, persistent_directory: str) -> list[str]:
    """Recover ``persistent_directory``'s local directory (see the module docstring); the local copies queued for
    replication."""
    base = persistent_directory.rstrip("/")
    directory = tiers.layout.local_dir(persistent_directory)
    if directory is None:
        _warn_other_tiers(tiers.layout.root, persistent_directory)
        return []
    tiers.writer_for(directory).clean_stale(directory, tiers.config.stale_after_s)
    for name in os.listdir(directory):
        if name.endswith(LEGACY_NOTE_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
    adopted = []
    markers = tiers.layout.markers(directory)
    for name, entries in markers.items():
        here = this_process()
        given_up = [marker for marker, parsed in entries if parsed.owner == here and marker not in tiers.live_markers]
        dead = given_up + [
            marker
            for marker, parsed in entries
            if parsed.owner != here
            and writer_gone(parsed.owner, _age_s(marker), tiers.config.stale_after_s, tracks_own_writes=False)
        ]
        local_path, persistent_path = os.path.join(directory, name), f"{base}/{name}"
        if dead and _recover_copy(tiers, engine, local_path, persistent_path, dead, directory, ours=given_up == dead):
            adopted.append(local_path)
    _drop_orphans(tiers, directory, base, set(tiers.layout.markers(directory)))
    tiers.prune(directory)
    _warn_other_tiers(tiers.layout.root, persistent_directory)
    return adopted


def _recover_copy(
    tiers: TierHost,
    engine: SnapshotEngine,
    local_path: str,
    persistent_path: str,
    dead: list[str],
    directory: str,
    ours: bool,
) -> bool:
    """Step 2 for one name, whose markers ``dead`` have no writer any more (``ours``: all of this process, which gave
    their copies up: a failed copy, a second Ctrl-C); True where its replication is queued."""
    layout = tiers.layout
    local = local_facts(tiers.local_writer, local_path)
    if local.presence is not Presence.PRESENT:
        # Killed before its first commit here: nothing to replicate. Unless a torn marker with a shortened name lost
        # the name of the copy it marks among several: left as it is (and the copies it may mark, see _drop_orphans).
        layout.unmark([marker for marker in dead if not (is_shortened(marker) and layout.stamp_in(marker) is None)])
        return False
    SAVE_SEQUENCE.observe(local.stamp)
    matching = [marker for marker in dead if layout.stamp_in(marker) in (None, local.stamp)]
    layout.unmark([marker for marker in dead if marker not in matching])  # writes that never committed here
    if not matching:
        return False
    try:
        if not ours:  # this process wrote it (and checksummed every byte then): read back only what another left
            verify_checkpoint(tiers.writer_for(local_path), local_path)
    except (CheckpointCorruptError, OSError) as exc:  # damaged: never copied over the persistent file
        log.warning(
            "lightning_datastates: not replicating %s, which a dead run did not: it is damaged (%s)", local_path, exc
        )
        layout.unmark(matching)
        return False
    persistent = persistent_facts(tiers.writer_for(persistent_path), persistent_path)
    SAVE_SEQUENCE.observe(persistent.stamp)
    if any(layout.unwanted(marker) for marker in matching) and _newer_whole(tiers, directory, persistent_path, local):
        log.info(
            "lightning_datastates: removing %s and %s: ModelCheckpoint had removed that checkpoint, and a newer one is "
            "whole",
            local_path,
            persistent_path,
        )
        layout.unmark(matching)
        if persistent.presence is Presence.PRESENT and persistent.key <= local.key:
            tiers.writer_for(persistent_path).remove(persistent_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local_path)
        return False
    decision = choose_copy(local, True, persistent)
    if decision.choice is Choice.PERSISTENT:
        log.warning(
            "lightning_datastates: not replicating %s, which a dead run did not, and removing it: %s (%s)",
            local_path,
            persistent_path,
            decision.reason,
        )
        layout.unmark(matching)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local_path)
        return False
    if local.stamp is not None and local.stamp == persistent.stamp:
        layout.unmark(matching)  # replicated; the run died before its marker went
        return False
    log.warning(
        "lightning_datastates: replicating %s to %s, which a dead run did not (%s)",
        local_path,
        persistent_path,
        decision.reason,
    )
    entry = PendingReplication(persistent_path)
    engine.pending.register_commit(entry)
    tiers.replicator_of(engine).adopt(Replication(entry, local_path, matching))
    return True


def _newer_whole(tiers: TierHost, directory: str, persistent_path: str, local: CopyFacts) -> bool:
    """Whether a checkpoint newer than ``local`` (of ``persistent_path``) is whole on either tier of its directory."""
    name = os.path.basename(persistent_path)
    if any(key > local.key for other, key in local_copies(directory).items() if other != name):
        return True
    base = persistent_path.rsplit("/", 1)[0]
    writer = tiers.writer_for(persistent_path)
    try:
        entries = writer.list_directory(base)
    except Exception:  # noqa: BLE001 - cannot tell: keep the copy (it is replicated, nothing is lost)
        return False
    for entry in entries:
        if entry.is_directory or entry.name == name or entry.name.startswith(".") or not entry.name.endswith(".ckpt"):
            continue
        with contextlib.suppress(Exception):
            facts = CopyFacts(Presence.PRESENT, read_stamp(writer, f"{base}/{entry.name}"), entry.modified_s)
            if facts.key > local.key:
                return True
    return False


def _drop_orphans(tiers: TierHost, directory: str, base: str, marked: set[str]) -> None:
    """Step 3: the replicated local copies whose persistent file is gone go (with a warning); ``marked``: the names
    markers stand for (a copy whose name begins with one may be what a torn marker with a shortened name marks)."""
    for name in local_copies(directory):
        if any(name.startswith(prefix) for prefix in marked):
            continue
        local_path, persistent_path = os.path.join(directory, name), f"{base}/{name}"
        decision = choose_copy(
            local_facts(tiers.local_writer, local_path),
            False,
            persistent_facts(tiers.writer_for(persistent_path), persistent_path),
        )
        if decision.choice is Choice.NONE:
            log.warning(
                "lightning_datastates: removing %s, the local copy of %s: %s",
                local_path,
                persistent_path,
                decision.reason,
            )
            with contextlib.suppress(FileNotFoundError):
                os.unlink(local_path)


# ---------------------------------------------------------------------------------------------- other local tiers
def note_tier_used(root: str) -> None:
    """Remember that this host used the local tier at ``root`` (a small list in the user's cache directory,
    ``$XDG_CACHE_HOME/lightning-datastates/local-tiers.json``), for the warning of step 4. Best effort: a cache that
    cannot be written is passed over silently."""
    path = _registry_path()
    roots = [r for r in _remembered(path) if r != root] + [root]
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = f"{path}.{os.getpid()}.tmp"
        with open(temp, "w") as file:
            json.dump(roots[-_REMEMBERED_TIERS:], file)
        os.replace(temp, path)


def _warn_other_tiers(root: str, persistent_directory: str) -> None:
    """Step 4: name the other local tiers of this host holding copies of ``persistent_directory`` that a dead run
    did not replicate."""
    own = os.path.realpath(root)
    for other in _remembered(_registry_path()):
        if other == own or not os.path.isdir(other):
            continue
        try:
            directory = TierLayout(other).local_dir(persistent_directory)
        except (ConfigError, OSError):
            continue
        if directory is None:
            continue
        names = sorted(
            name
            for name, entries in TierLayout.markers(directory).items()
            if any(
                writer_gone(parsed.owner, _age_s(marker), 0.0, tracks_own_writes=False) for marker, parsed in entries
            )
        )
        if names:
            log.warning(
                "lightning_datastates: the local tier %s, which a run on this host used before, holds %d checkpoint(s) "
                "of %s that were never copied there (%s): run once with local_tier=%r to copy them, or delete %s if "
                "they are not needed",
                other,
                len(names),
                persistent_directory,
                ", ".join(names),
                other,
                directory,
            )


def _registry_path() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "lightning-datastates", "local-tiers.json")


def _remembered(path: str) -> list[str]:
    try:
        with open(path) as file:
            roots = json.load(file)
    except (OSError, ValueError):
        return []
    return [r for r in roots if isinstance(r, str)] if isinstance(roots, list) else []


def _age_s(path: str) -> float | None:
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None
