"""Which local copies go once replicated: the local tier keeps the newest ``local_keep`` checkpoints of each
directory, and every copy not yet replicated whatever its age.

Pure in its decision (:func:`copies_to_prune`), one ``unlink`` per copy in its action (:func:`prune_local`). The
caller holds the lock that orders marking (a save) against pruning, so that a copy being saved again, marked before
its write, is never taken.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Collection


def copies_to_prune(copies: dict[str, float], keep: int, marked: Collection[str]) -> list[str]:
    """The names of ``copies`` (name -> modification time) beyond the newest ``keep`` that are not ``marked`` (not
    yet replicated), oldest first. Marked copies count towards ``keep``: they are the newest checkpoints too."""
    newest_first = sorted(copies, key=lambda name: copies[name], reverse=True)
    return sorted((name for name in newest_first[keep:] if name not in marked), key=lambda name: copies[name])


def local_copies(local_directory: str) -> dict[str, float]:
    """The checkpoint copies in ``local_directory``: regular files named ``*.ckpt`` (no hidden file, link or
    directory), with their modification times (seconds since the epoch)."""
    found: dict[str, float] = {}
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
                found[entry.name] = info.st_mtime
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
