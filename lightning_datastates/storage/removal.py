"""Removing a checkpoint so that no crash or storage error leaves something that looks like one and is not.

A single file goes in one operation (``unlink``, ``DeleteObject``): a reader sees it whole or not at all. A sharded
checkpoint is a directory of many files, and no storage removes a directory atomically: removed in listing order, a
kill can leave ``.metadata``, ``meta.pt`` and one shard, a directory Lightning takes for a checkpoint and DCP cannot
read. So :func:`remove_checkpoint` removes a directory in this order:

1. a removal marker (``.commit.<host>.<pid>.<token>.datastates-removing``, named like every leftover of the package,
   :mod:`~lightning_datastates.records.leftovers`) is created in it: from here the directory is no checkpoint for this
   package (:func:`~lightning_datastates.records.names.holds_checkpoint`, which ``ckpt_path="last"`` asks), and the
   next run's cleanup, or ``python -m lightning_datastates clean``, finishes the removal once the marker's writer is
   gone (:mod:`~lightning_datastates.sharded.leftovers`);
2. ``meta.pt`` goes: from here the directory is no checkpoint for Lightning either;
3. every other file goes (S3: in one request per thousand), then any subdirectory;
4. the markers go, then the (now empty) directory.

A kill or a storage error in steps 2-4 leaves a marked directory, never a lie; one in step 1 leaves the checkpoint as
it was. Call order: any thread (the training thread, or the writer or committer thread that carries out a removal
held back for earlier saves), never two removals of one path at once.
"""

from __future__ import annotations

import os

from lightning_datastates.records.leftovers import leftover_name, parse_leftover_name
from lightning_datastates.records.names import LIGHTNING_META_NAME, PENDING_SUFFIX, REMOVING_SUFFIX
from lightning_datastates.storage.base import DirectoryEntry, StorageWriter
from lightning_datastates.storage.local import is_local_path, local_path


def remove_checkpoint(writer: StorageWriter, path: str) -> None:
    """Remove the checkpoint at ``path``, a file or a sharded checkpoint's directory (see the module docstring);
    nothing there is fine.

    Raises:
        OSError: a step failed (the S3 writer's errors are ``OSError`` too); what is left is marked for the cleanup.
    """
    if is_local_path(path) and os.path.islink(local_path(path)):
        writer.remove(path)  # a link (save_last="link") goes alone: never the checkpoint it points to
        return
    entries = writer.list_directory(path)
    if not entries:
        writer.remove(path)  # a file (one atomic operation), an empty directory, nothing, or a backend that cannot list
        return
    marker = leftover_name("commit", REMOVING_SUFFIX)
    writer.create_marker(_join(path, marker))
    finish_removal(writer, path, [*entries, DirectoryEntry(marker, is_directory=False, modified_s=None)])


def finish_removal(writer: StorageWriter, directory: str, entries: list[DirectoryEntry]) -> list[str]:
    """Steps 2-4 of the module docstring for ``directory``, which holds ``entries`` and is marked for removal (by this
    process, or by a dead one whose removal the cleanup finishes); the paths removed.

    Raises:
        OSError: a step failed; the directory stays marked.
    """
    names = {entry.name: entry for entry in entries}
    markers = [name for name in names if _is_marker(name)]
    files = [name for name, entry in names.items() if not entry.is_directory and name not in markers]
    if LIGHTNING_META_NAME in files:
        writer.remove_files(directory, [LIGHTNING_META_NAME])  # from here Lightning sees no checkpoint
    writer.remove_files(directory, [name for name in files if name != LIGHTNING_META_NAME])
    for name, entry in names.items():
        if entry.is_directory:  # not a save's, but no checkpoint's either
            writer.remove(_join(directory, name))
    writer.remove_files(directory, markers)  # last: until here a cleanup finds the directory again
    writer.remove(directory)
    return [_join(directory, name) for name in names]


def is_removal_marker(name: str) -> bool:
    """Whether ``name`` is the marker of a removal in progress (this or any process's)."""
    return parse_leftover_name(name, REMOVING_SUFFIX) is not None


def _is_marker(name: str) -> bool:
    return is_removal_marker(name) or parse_leftover_name(name, PENDING_SUFFIX) is not None


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"
