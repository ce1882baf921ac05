"""Where the local tier keeps the copy of each persistent checkpoint, and which copies are not yet replicated.

Every persistent directory (a ``ModelCheckpoint`` directory: ``s3://bucket/run``, ``/lustre/run/ckpts``) gets one
directory on the local tier, ``<local_tier>/<slug>-<hash>/``: ``slug`` is the directory's last component (for a
reader of the tier), ``hash`` the first 16 hex digits of the SHA-256 of its full name (two runs with the same last
component never share one). A file ``.datastates-tier.json`` there names the persistent directory; it is checked at
every use, so a copy is never replicated to the wrong place (a hand edit, a collision) and a reader of the local tier
can tell what each directory belongs to. The local copy of ``<persistent directory>/<name>`` is
``<local directory>/<name>``.

A save marks its local copy as not replicated before anything is written: a small file
``.<name>.<host>.<pid>.<token>.datastates-replicate`` beside it, holding the save's stamp (:meth:`TierLayout.mark`;
the copy it marks is the local file carrying that stamp, :mod:`~lightning_datastates.records.stamp`), and, once
``ModelCheckpoint`` asked for the checkpoint's removal, that the copy is not wanted (:meth:`TierLayout.mark_unwanted`)
(the leftover naming rule of
:mod:`~lightning_datastates.records.leftovers`, so that the owner can be told from the name), removed once the copy
at the persistent path is committed. A marker whose writer is gone is a replication a dead run did not finish: the
next run's recovery replicates that local copy (:mod:`~lightning_datastates.tiered.tiers`). Markers are created
without ``fsync``: the local copy's own commit (``fsync`` of the file and of the directory) comes after, so a copy that
survives a crash has its marker too, on the file systems that order metadata in their journal (ext4, XFS); a marker
lost otherwise costs that copy its replication, never a wrong file.

Thread model: every method may run on any thread; the caller orders marking against retention
(:class:`~lightning_datastates.tiered.tiers.TieredCheckpoints` holds a lock around both).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections import defaultdict

from lightning_datastates.errors import ConfigError
from lightning_datastates.records.leftovers import LeftoverName, leftover_name, parse_leftover_name
from lightning_datastates.records.stamp import SaveStamp
from lightning_datastates.storage.base import write_file
from lightning_datastates.storage.local import MAX_NAME_BYTES, LocalWriter

log = logging.getLogger("lightning_datastates")

#: Suffix of the markers of local copies not yet replicated.
REPLICATE_SUFFIX = ".datastates-replicate"
#: The file in each local directory naming its persistent directory.
TARGET_NAME = ".datastates-tier.json"
_FORMAT_VERSION = 1


def _marker_content(marker: str) -> dict[str, object]:
    """What a marker holds (:meth:`TierLayout.mark`); empty where it cannot be read (gone, empty: an older or torn
    one)."""
    try:
        with open(marker, "rb") as file:
            content = json.loads(file.read() or b"{}")
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def _marker_bytes(name: str, stamp: SaveStamp, unwanted: bool) -> bytes:
    return json.dumps({"name": name, "stamp": [stamp.sequence, stamp.run], "unwanted": unwanted}).encode()


def stamp_of_content(content: dict[str, object]) -> SaveStamp | None:
    """The stamp a marker's content (:func:`_marker_content`) names; None where it names none. Pure."""
    stamp = content.get("stamp")
    if isinstance(stamp, list) and len(stamp) == 2 and isinstance(stamp[0], int) and isinstance(stamp[1], str):
        return SaveStamp(stamp[0], stamp[1])
    return None


def _unshortened(marker_name: str, name: str, copies: list[str]) -> str:
    """The checkpoint name a marker named ``marker_name`` stands for, where its content (which holds the name) is
    lost: ``name`` (as the marker's own name gives it), or, where the marker's name was shortened to fit the file
    system's limit (:func:`~lightning_datastates.records.leftovers.leftover_name`: then exactly that long), the one
    entry of ``copies`` that begins with it; ``name`` itself where none or several do (a recovery then leaves the
    marker, and every copy it may mark, as they are)."""
    if len(marker_name.encode()) < MAX_NAME_BYTES or name in copies:
        return name
    matching = [copy for copy in copies if copy.startswith(name)]
    return matching[0] if len(matching) == 1 else name


def is_shortened(marker: str) -> bool:
    """Whether the marker at ``marker`` has a name shortened to fit the file system's limit (the checkpoint's name
    is then whole only in its content)."""
    return len(os.path.basename(marker).encode()) >= MAX_NAME_BYTES


def persistent_dir(path: str) -> str:
    """The directory of the persistent checkpoint path ``path`` (a URL or an absolute local path), no trailing
    slash."""
    if "://" in path:
        return path.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(path.rstrip("/")) or "/"


class TierLayout:
    """The local tier at ``root`` (an absolute local directory): one directory per persistent directory (see the
    module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._checked: set[str] = set()  # local directories whose target file was read or written by this process

    def local_dir(self, persistent_directory: str, create: bool = False) -> str | None:
        """The local directory of ``persistent_directory``; made (with its target file) when ``create``, else None
        where it does not exist.

        Raises:
            ConfigError: the directory exists but belongs to another persistent directory.
            OSError: it cannot be made (permissions, a file in the way, a full disk).
        """
        persistent_directory = persistent_directory.rstrip("/") or "/"
        slug = re.sub(r"[^A-Za-z0-9_.-]", "_", persistent_directory.rsplit("/", 1)[-1])[:40].lstrip(".") or "root"
        digest = hashlib.sha256(persistent_directory.encode()).hexdigest()[:16]
        directory = os.path.join(self.root, f"{slug}-{digest}")
        if directory in self._checked:
            return directory
        target = os.path.join(directory, TARGET_NAME)
        if os.path.exists(target):
            self._check_target(target, persistent_directory)
        elif create:
            os.makedirs(directory, exist_ok=True)
            document = {"persistent": persistent_directory, "version": _FORMAT_VERSION}
            write_file(LocalWriter(direct_io=False), target, json.dumps(document).encode())
        else:
            return None
        self._checked.add(directory)
        return directory

    def local_path(self, persistent_path: str, create: bool = False) -> str | None:
        """The local copy's path for ``persistent_path`` (whether or not the copy exists); None where its directory
        does not exist and ``create`` is False. Same errors as :meth:`local_dir`."""
        directory = self.local_dir(persistent_dir(persistent_path), create)
        if directory is None:
            return None
        return os.path.join(directory, persistent_path.rstrip("/").rsplit("/", 1)[-1])

    @staticmethod
    def mark(local_path: str, stamp: SaveStamp) -> str:
        """Mark the local copy at ``local_path`` as not replicated (before it is written); the marker's path.
        ``stamp`` is the save's: the marker marks the local file that carries it, not an older copy of the name.

        Raises:
            OSError: the marker cannot be created (it names the path).
        """
        directory, name = os.path.split(local_path)
        # A long name is shortened in the marker's own name (which must fit the file system's limit) and kept whole
        # inside it.
        marker = os.path.join(directory, leftover_name(name, REPLICATE_SUFFIX, MAX_NAME_BYTES))
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, _marker_bytes(name, stamp, unwanted=False))
        finally:
            os.close(fd)
        return marker

    @staticmethod
    def mark_unwanted(markers: list[str]) -> None:
        """Note in ``markers`` that their copy's checkpoint is to be removed (``ModelCheckpoint`` asked; the removal
        waits for newer checkpoints to be persistent): a run killed meanwhile has the next run's recovery drop that
        copy, not replicate it, once a newer checkpoint is whole on either tier. Rewritten in place: a marker torn by
        a crash here still marks its copy, which is then replicated as before the request (nothing lost). Missing
        markers are fine."""
        for marker in markers:
            content = _marker_content(marker)
            name, stamp = content.get("name"), stamp_of_content(content)
            if not isinstance(name, str) or stamp is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(marker, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
                try:
                    os.write(fd, _marker_bytes(name, stamp, unwanted=True))
                finally:
                    os.close(fd)

    @staticmethod
    def stamp_in(marker: str) -> SaveStamp | None:
        """The stamp of the save that made ``marker`` (see :meth:`mark`); None where it holds none (an older
        release's marker, or one torn by a crash: it then marks whatever copy is there)."""
        return stamp_of_content(_marker_content(marker))

    @staticmethod
    def unwanted(marker: str) -> bool:
        """Whether ``marker``'s checkpoint was to be removed (:meth:`mark_unwanted`)."""
        return _marker_content(marker).get("unwanted") is True

    @staticmethod
    def unmark(markers: list[str]) -> None:
        """Remove ``markers`` (missing ones are fine: a removal or the retention may have taken them). Best effort:
        a marker that cannot be removed is logged and stays (the next run replicates that copy once more)."""
        for marker in markers:
            try:
                os.unlink(marker)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("lightning_datastates: cannot remove %s (%s); the next run copies it again", marker, exc)

    @staticmethod
    def markers(local_directory: str) -> dict[str, list[tuple[str, LeftoverName]]]:
        """The markers in ``local_directory`` by the name of the checkpoint they mark: ``(path, parsed name)`` each."""
        found: dict[str, list[tuple[str, LeftoverName]]] = defaultdict(list)
        try:
            names = os.listdir(local_directory)
        except FileNotFoundError:
            return {}
        copies = [name for name in names if not name.startswith(".")]
        for name in names:
            parsed = parse_leftover_name(name, REPLICATE_SUFFIX)
            if parsed is not None:
                path = os.path.join(local_directory, name)
                whole = _marker_content(path).get("name")  # the name itself, where the marker's own is shortened
                if not (isinstance(whole, str) and whole):
                    whole = _unshortened(name, parsed.name, copies)  # a marker torn by a crash holds nothing
                found[whole].append((path, parsed))
        return dict(found)

    @staticmethod
    def persistent_of(local_directory: str) -> str | None:
        """The persistent directory that ``local_directory`` holds copies of (from its target file); None if it has
        none or cannot be read."""
        try:
            with open(os.path.join(local_directory, TARGET_NAME), "rb") as file:
                document = json.load(file)
        except (OSError, ValueError):
            return None
        persistent = document.get("persistent") if isinstance(document, dict) else None
        return persistent if isinstance(persistent, str) else None

    def _check_target(self, target: str, persistent_directory: str) -> None:
        found = self.persistent_of(os.path.dirname(target))
        if found != persistent_directory:
            raise ConfigError(
                f"the local tier directory {os.path.dirname(target)} holds copies of {found!r}, not of "
                f"{persistent_directory!r} (its {TARGET_NAME} says so): give local_tier another directory, or remove "
                "that one if its copies are not needed"
            )
