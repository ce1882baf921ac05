"""Which copy of a checkpoint is the one to read: the local tier's or the persistent one. One rule, used by loads, by
the resolution of ``ckpt_path="last"`` and by the recovery of a dead run's copies (``docs/design.md``, "The checkpoint
lifecycle").

Both copies of one save carry the same save stamp (:mod:`~lightning_datastates.records.stamp`: the replica is a byte
copy), so equal stamps prove the local copy holds what the persistent file holds. A local copy is read when

- it holds the same save as the persistent file (equal stamps), or
- it is marked as not yet replicated (a marker naming its stamp: its replication is pending, failed, or was cut short
  by a kill, and the next run's recovery finishes it) and is newer than the persistent file, or the persistent file is
  missing (never replicated yet).

Never otherwise: a local copy older than the persistent file, or of another lineage (another node or run wrote the
persistent path since), is stale; a replicated local copy whose persistent file is gone was deleted there by the user
(or that storage is not mounted): it is not brought back. Where the persistent storage cannot be asked, a marked
copy is read (it is this node's newest save) and an unmarked one is not (it cannot be shown current).

:func:`choose_copy` is pure; :func:`local_facts` and :func:`persistent_facts` read what it decides on.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass

from lightning_datastates.records.stamp import SaveStamp, order_key
from lightning_datastates.storage.base import StorageWriter, read_stamp

log = logging.getLogger("lightning_datastates")


class Presence(enum.Enum):
    """Whether a copy is there, as far as its storage says."""

    PRESENT = "present"
    MISSING = "missing"
    UNKNOWN = "unknown"  # the storage could not be asked


@dataclass(frozen=True)
class CopyFacts:
    """What is known of one copy: whether it is there, the save it holds (None: no stamp, or not read), and its
    modification time (seconds since the epoch; orders a file without a stamp)."""

    presence: Presence
    stamp: SaveStamp | None = None
    modified_s: float | None = None

    @property
    def key(self) -> tuple[int, str]:
        """Its order among checkpoints (:func:`~lightning_datastates.records.stamp.order_key`)."""
        return order_key(self.stamp, self.modified_s)


class Choice(enum.Enum):
    """Which copy to read."""

    LOCAL = "local"
    PERSISTENT = "persistent"
    NONE = "none"  # neither: no persistent file, and no local copy that may stand for it


@dataclass(frozen=True)
class Decision:
    """:func:`choose_copy`'s answer: the copy to read, and why (for the log)."""

    choice: Choice
    reason: str


MISSING = CopyFacts(Presence.MISSING)


def choose_copy(local: CopyFacts, marked: bool, persistent: CopyFacts) -> Decision:
    """Which copy of one checkpoint to read (see the module docstring): ``local`` (its facts; MISSING where the local
    tier holds none), ``marked`` (a marker names the local copy's stamp: not yet replicated), ``persistent``. Pure."""
    if local.presence is not Presence.PRESENT:
        if persistent.presence is Presence.MISSING:
            return Decision(Choice.NONE, "neither tier holds it")
        return Decision(Choice.PERSISTENT, "the local tier holds no copy")
    if persistent.presence is Presence.MISSING:
        if marked:
            return Decision(Choice.LOCAL, "the local copy is not replicated yet")
        return Decision(
            Choice.NONE,
            "the persistent file is gone (deleted, or its storage is not mounted) and the local copy was replicated "
            "to it before: it is not brought back",
        )
    if persistent.presence is Presence.UNKNOWN:
        if marked:
            return Decision(
                Choice.LOCAL, "the local copy is not replicated yet (the persistent storage cannot be asked)"
            )
        return Decision(
            Choice.PERSISTENT, "the persistent storage cannot be asked: the local copy cannot be shown current"
        )
    if local.stamp is not None and local.stamp == persistent.stamp:
        return Decision(Choice.LOCAL, "both copies hold the same save")
    if marked and local.key > persistent.key:
        return Decision(Choice.LOCAL, "the local copy is newer and not replicated yet")
    return Decision(Choice.PERSISTENT, "the persistent file holds another save (newer, or written by another run)")


def local_facts(writer: StorageWriter, path: str) -> CopyFacts:
    """The facts of the local copy at ``path`` (one read of its last bytes; its modification time where it carries no
    stamp). A copy that cannot be read counts as missing (a load would fail on it; the persistent copy is read)."""
    try:
        stamp = read_stamp(writer, path)
        return CopyFacts(Presence.PRESENT, stamp, None if stamp is not None else os.stat(path).st_mtime)
    except OSError:
        return MISSING


def persistent_facts(writer: StorageWriter, path: str) -> CopyFacts:
    """The facts of the persistent file at ``path``: its stamp (one ranged read; through a local symbolic link), or,
    for a file without one, its modification time; UNKNOWN where storage cannot be asked (an error other than "not
    found": S3 unreachable, permissions)."""
    try:
        stamp = read_stamp(writer, path)
    except FileNotFoundError:
        return MISSING
    except Exception as exc:  # noqa: BLE001 - S3 errors are not OSErrors; any failure means "cannot tell"
        log.debug("lightning_datastates: cannot read the stamp of %s: %r", path, exc)
        return CopyFacts(Presence.UNKNOWN)
    modified = None
    if stamp is None:
        modified = _modified_s(writer, path)
    return CopyFacts(Presence.PRESENT, stamp, modified)


def _modified_s(writer: StorageWriter, path: str) -> float | None:
    """The modification time of ``path`` from a listing of its directory (None where it gives none)."""
    directory, _, name = path.rstrip("/").rpartition("/")
    try:
        entries = writer.list_directory(directory or "/")
    except Exception:  # noqa: BLE001 - unknown: ordered as oldest
        return None
    return next((entry.modified_s for entry in entries if entry.name == name), None)
