"""Which local copies go once replicated: the local tier keeps, per directory, the newest ``local_keep`` checkpoints
and, beside them, the copy of each last checkpoint (``last.ckpt``, ``last-v1.ckpt``: the state a resume reads, which
would otherwise take one of the ``local_keep`` places from a top-k checkpoint of the same step); with
``local_keep=0`` no copy stays once replicated. Every copy not yet replicated stays, whatever its age.

Newest by save stamp (:mod:`~lightning_datastates.records.stamp`), read from each copy itself: the order the saves
were made in, which the copies' modification times do not always keep. Pure in its decision (:func:`copies_to_prune`),
one ``unlink`` per copy in its action (:func:`prune_local`). The caller holds the lock that orders marking (a save)
against pruning, so that a copy being saved again, marked before its write, is never taken.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Collection

from lightning_datastates.records.stamp import TAIL_BYTES, SaveStamp, order_key, parse_stamp

#: What ``ModelCheckpoint`` names its last checkpoints (``CHECKPOINT_NAME_LAST``, versions ``-v1``): not counted by
#: ``local_keep``.
_LAST_NAME = re.compile(r"last(-v\d+)?\.ckpt\Z")


def is_last_name(name: str) -> bool:
    """Whether ``name`` is one of ``ModelCheckpoint``'s last checkpoint names (``last.ckpt``, ``last-v1.ckpt``)."""
    return _LAST_NAME.match(name) is not None


def copies_to_prune(copies: dict[str, tuple[int, str]], keep: int, marked: Collection[str]) -> list[str]:
    """The names of ``copies`` (name -> order key, newest largest) to remove: beyond the newest ``keep`` checkpoints,
    not a last checkpoint's copy (unless ``keep`` is 0), not ``marked`` (not yet replicated); oldest first. Marked
    copies count towards ``keep``: they are the newest checkpoints too. Pure."""
    counted = sorted((n for n in copies if keep == 0 or not is_last_name(n)), key=copies.__getitem__, reverse=True)
    return sorted((name for name in counted[keep:] if name not in marked), key=copies.__getitem__)


def local_copies(local_directory: str) -> dict[str, tuple[int, str]]:
    """The checkpoint copies in ``local_directory``: regular files named ``*.ckpt`` (no hidden file, link or
    directory), with their order keys (the save stamp each carries; the modification time for one without)."""
    found: dict[str, tuple[int, str]] = {}
    try:
        entries = list(os.scandir(local_directory))
    except FileNotFoundError:
        return found
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(".ckpt"):
            continue
        with contextlib.suppress(FileNotFoundError):
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode):
                found[entry.name] = order_key(_stamp_of(entry.path, info.st_size), info.st_mtime)
    return found


def prune_local(local_directory: str, keep: int, marked: Collection[str]) -> list[str]:
    """Remove the replicated copies of ``local_directory`` beyond the newest ``keep``; the paths removed."""
    removed = []
    for name in copies_to_prune(local_copies(local_directory), keep, marked):
        path = os.path.join(local_directory, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def _stamp_of(path: str, size: int) -> SaveStamp | None:
    with open(path, "rb") as file:
        file.seek(max(0, size - TAIL_BYTES))
        return parse_stamp(file.read())
