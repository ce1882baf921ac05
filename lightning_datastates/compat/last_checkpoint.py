"""``fit(ckpt_path="last")`` that resumes from a whole checkpoint, locally and at a URL (S3, other fsspec protocols).

Checked against lightning 2.5.6 and 2.6.6 (the same code in both): the checkpoint connector resolves ``"last"`` in its
private ``_CheckpointConnector._parse_ckpt_path``, from each ``ModelCheckpoint``'s private ``_find_last_checkpoints``
and each ``OnExceptionCheckpoint``'s ``ckpt_path``, and takes the candidate with the newest
``get_filesystem(path).modified(path)``, before any hook of ours runs. Four things go wrong:

- ``_find_last_checkpoints`` lists the directory with fsspec, which names remote files without their protocol
  (``bucket/run/last.ckpt``), and ``os.path.normpath`` keeps it so: the connector looks for that path on the local
  disk, finds nothing, warns that there is no last checkpoint and trains from scratch
  (Lightning-AI/pytorch-lightning#18261);
- a sharded checkpoint is a directory, and on S3 a directory has no modification time (``IsADirectoryError``);
- a sharded ``last.ckpt/`` whose first save was killed in flight holds no ``meta.pt``: Lightning picks it all the
  same (locally it exists and has a modification time), the cleanup at setup removes it as a leftover, and the load
  fails with ``ValueError: ... does not point to a valid checkpoint``;
- with ``save_last="link"``, ``last.ckpt`` is a symbolic link made as soon as the save call returns: a run killed
  before the file it names was committed (or, with a local tier, replicated) leaves it dangling, Lightning finds no
  last checkpoint and trains from scratch;
- the newest checkpoint is not always a last one, nor the one with the newest modification time: a run killed after
  a top-k save and before the ``last.ckpt`` of that step resumes from an older state, and the writes of overlapping
  saves end in any order (a file's date is its write's end, S3's the start of its upload, to the second).

:func:`resolve_last_checkpoint` wraps ``_parse_ckpt_path`` so that, for a Trainer the given predicate accepts (one
whose checkpoints go through the plugin), ``"last"`` is resolved by :func:`newest_last_checkpoint`: the newest whole
checkpoint by save stamp (:mod:`~lightning_datastates.records.stamp`), among the last checkpoints and, where last
checkpoints are saved, every checkpoint of the ``ModelCheckpoint`` directories, remote ones with their protocol; a
file counts as it is (it is committed whole or not at all), a link as the file it names, a directory only if it holds
a checkpoint once the cleanup at setup has run (:func:`~lightning_datastates.records.names.holds_checkpoint`), dated
by its ``meta.pt`` or commit record, and with a local tier a local copy where it is the one to read. Where candidates
exist but none is whole, training starts from scratch with a warning, as Lightning does when it finds no last
checkpoint. Every rank resolves the same way, before rank 0's cleanup at setup changes anything (the strategy's
process group forms in between). Everything else goes to Lightning's own method unchanged, and so does ``"last"``
with no candidate at all.

Call order: :func:`resolve_last_checkpoint` when a plugin is made (before any ``fit``), any thread, idempotent; the
wrapper runs where Lightning calls the method, on the training thread of every rank.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.utilities import rank_zero_warn

from lightning_datastates.records.leftovers import parse_leftover_name, writer_gone
from lightning_datastates.records.names import COMMIT_RECORD_NAME, LIGHTNING_META_NAME, PENDING_SUFFIX, holds_checkpoint
from lightning_datastates.records.stamp import SaveStamp, order_key

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

#: Marks the wrapper, so that it is installed once.
_WRAPPED = "_lightning_datastates_resolves_last"


@dataclass(frozen=True)
class LastOptions:
    """What the plugin tells the resolution of ``"last"``: its ``stale_after_s`` (``max_age_s``); ``stamp_of(path)``,
    the save stamp of the file at ``path`` through the plugin's storage (None where it carries none; raises
    ``FileNotFoundError`` where nothing is there); and with a local tier, the local copies of a persistent directory's
    checkpoints that are the ones to read (persistent path -> order key,
    :func:`~lightning_datastates.records.stamp.order_key`)."""

    max_age_s: float
    stamp_of: Callable[[str], SaveStamp | None]
    local_copies: Callable[[str], dict[str, tuple[int, str]]] | None = None


def resolve_last_checkpoint(prepare: Callable[[Trainer], LastOptions | None]) -> None:
    """Wrap ``_CheckpointConnector._parse_ckpt_path`` (once per process) so that ``ckpt_path="last"`` resumes from
    the newest whole checkpoint for the Trainers that use the plugin (see the module docstring). ``prepare(trainer)``
    runs first: for such a Trainer it readies its ``ModelCheckpoint``s (their file systems, with the plugin's options)
    and gives the plugin's :class:`LastOptions`; None for any other Trainer, left to Lightning."""
    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, _WRAPPED, False):
        return

    def parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        options = prepare(self.trainer) if ckpt_path == "last" else None
        if options is not None:
            found = newest_last_checkpoint(self.trainer, options)
            if found is not NO_CANDIDATE:
                if found is None:
                    fn = state_fn.value
                    rank_zero_warn(
                        f'.{fn}(ckpt_path="last") is set, but no checkpoint is whole (a run died saving it). No '
                        "checkpoint will be loaded."
                    )
                return found
        return original(self, state_fn, ckpt_path, model_provided=model_provided, model_connected=model_connected)

    setattr(parse_ckpt_path, _WRAPPED, True)
    _CheckpointConnector._parse_ckpt_path = parse_ckpt_path  # type: ignore[method-assign]


class _NoCandidate:
    """:func:`newest_last_checkpoint` found no last checkpoint at all, whole or not: Lightning's own method decides."""


NO_CANDIDATE: Any = _NoCandidate()


def newest_last_checkpoint(trainer: Trainer, options: LastOptions) -> Any:
    """The checkpoint ``ckpt_path="last"`` resumes from, with its protocol: the newest whole one, by save stamp
    (:mod:`~lightning_datastates.records.stamp`), among the Trainer's last checkpoints (``last.ckpt`` and its
    versions in each ``ModelCheckpoint``'s directory, and each ``OnExceptionCheckpoint``'s file) and, where a
    ``ModelCheckpoint`` saves last checkpoints (``save_last``) or one exists, every checkpoint in those directories: a
    run killed after a top-k save and before the ``last.ckpt`` of the same step (or before any) resumes from the top-k
    file, which is newer, and a ``last.ckpt`` link that leads nowhere does not count. None (with a warning by the
    caller) where candidates exist but none is whole; :data:`NO_CANDIDATE` where there is no candidate at all (then
    Lightning's own method decides, and warns that there is no last checkpoint). A ``ModelCheckpoint`` without
    ``dirpath`` is looked at where Lightning's setup will derive it.

    With ``options.local_copies`` (a local tier), a checkpoint counts where its local copy is the one to read
    (:func:`~lightning_datastates.tiered.copies.choose_copy`): one durable locally whose replication a dead run did not
    finish is found all the same (its persistent path is returned; the plugin loads its local copy)."""
    candidates: dict[str, Any] = {}
    directories: dict[str, Any] = {}
    local: dict[str, tuple[int, str]] = {}  # persistent path -> the order key of its local copy, where that counts
    lasts: set[str] = set()
    every_checkpoint = False
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        path = getattr(callback, "ckpt_path", None) if isinstance(callback, OnExceptionCheckpoint) else None
        if path:  # as Lightning reads it
            candidates[str(path)] = get_filesystem(path)
            lasts.add(str(path))
    for callback in (cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)):
        fs = callback._fs
        directory = _checkpoint_dir(callback, trainer)
        every_checkpoint = every_checkpoint or bool(callback.save_last)
        if directory is not None:
            # Our writers change storage behind this file system's listing cache (filled by ModelCheckpoint's own
            # listings, at setup): a checkpoint written since would not be listed.
            fs.invalidate_cache(directory)
            directories[directory] = fs
            if options.local_copies is not None:
                local.update({p: key for p, key in options.local_copies(directory).items() if p not in local})
        for path in callback._find_last_checkpoints(trainer):
            path = _with_protocol(fs, path)
            candidates[path] = fs
            lasts.add(path)
        lasts.update(p for p in local if _is_last_name(callback, p))
    if lasts or local:
        every_checkpoint = True  # a last checkpoint exists: the newest of all resumes
    if every_checkpoint:
        for directory, fs in directories.items():
            candidates.update({_with_protocol(fs, entry): fs for entry in _checkpoints_in(fs, directory)})
        candidates.update({path: directories.get(path.rsplit("/", 1)[0]) for path in local if path not in candidates})
    if not candidates and not lasts:
        return NO_CANDIDATE
    dated = {}
    for path, fs in candidates.items():
        # A local copy counts only where it is the one to read: the same save as the persistent file or a newer one.
        key = local.get(path) or _order(fs, path, options)
        if key is not None:
            dated[path] = key
    newest = max(dated, key=dated.__getitem__, default=None)
    if newest is not None and lasts:
        # save_last="link": a link stands for the file it names (a local copy of it where the link leads nowhere).
        targets = {p: os.path.realpath(p) if os.path.islink(p) else p for p in lasts}
        broken = sorted(p for p in lasts if targets[p] not in dated and p not in dated)
        stands_for = set(lasts) | set(targets.values())
        if broken:
            rank_zero_warn(
                f'ckpt_path="last": {", ".join(broken)} is not whole (a run died saving it, or a link leads nowhere); '
                f"resuming from the newest whole checkpoint, {newest}"
            )
        elif newest not in stands_for:
            rank_zero_warn(
                f'ckpt_path="last": resuming from {newest}, which is newer than the last checkpoint '
                f"({', '.join(sorted(lasts))}): the run died before it saved the last checkpoint of that step"
            )
    return newest


def _order(fs: Any, path: str, options: LastOptions) -> tuple[int, str] | None:
    """The order key of the whole checkpoint at ``path`` on its own storage (the persistent tier): a file by its save
    stamp (its modification time where it carries none), a sharded checkpoint's directory by its ``meta.pt`` (see
    :func:`_modified_s`); None where nothing whole is there."""
    if fs is None:
        return None
    if not (_is_local(fs) and os.path.isdir(path)):
        try:
            stamp = options.stamp_of(path)
        except IsADirectoryError:
            pass
        except FileNotFoundError:
            if _is_local(fs) or not fs.isdir(path):  # on S3 a directory is a prefix: no object at its name
                return None
        except OSError:
            if _is_link(fs, path):
                return None  # a link that leads nowhere (a loop, through a file): no checkpoint there
            raise
        else:
            if stamp is not None:
                return order_key(stamp, None)
    modified = _modified_s(fs, path, options.max_age_s)
    if modified is None:
        return None
    if fs.isdir(
        path
    ):  # a sharded checkpoint: its meta.pt carries the save's stamp (none where completed from a record)
        with contextlib.suppress(OSError):
            stamp = options.stamp_of(f"{path.rstrip('/')}/{LIGHTNING_META_NAME}")
            if stamp is not None:
                return order_key(stamp, None)
    return order_key(None, modified)


def _checkpoint_dir(callback: ModelCheckpoint, trainer: Trainer) -> str | None:
    """``callback``'s directory: its ``dirpath``, or, before its setup derives that (from the logger or
    ``default_root_dir``), the directory Lightning's ``_find_last_checkpoints`` looks in (its private
    ``__resolve_ckpt_dir``); None where this Lightning has no such method."""
    if callback.dirpath is not None:
        return str(callback.dirpath)
    resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)
    return None if resolve is None else str(resolve(trainer))


def _is_last_name(callback: ModelCheckpoint, path: str) -> bool:
    """Whether ``path`` is named as ``callback``'s last checkpoints are (``last.ckpt``, ``last-v1.ckpt``): the rule of
    Lightning's ``ModelCheckpoint._find_last_checkpoints``."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    stem, extension = os.path.splitext(name)
    pattern = rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}(-(\d+))?"
    return extension == callback.FILE_EXTENSION and re.match(pattern, stem) is not None


def _with_protocol(fs: Any, path: str) -> str:
    return path if _is_local(fs) else fs.unstrip_protocol(path)


def _exists(fs: Any, path: str) -> bool:
    fs.invalidate_cache(path)  # our writers change storage behind this file system's listing cache
    return bool(fs.exists(path))


def _is_link(fs: Any, path: str) -> bool:
    """Whether ``path`` is a symbolic link on the local disk (``save_last="link"``; only local paths are linked)."""
    return _is_local(fs) and os.path.islink(path)


def _checkpoints_in(fs: Any, directory: str) -> list[str]:
    """The ``*.ckpt`` entries of ``directory`` (files, or sharded checkpoints' directories), as ``fs`` names them."""
    try:
        return [path for path in fs.ls(directory, detail=False) if path.rstrip("/").endswith(".ckpt")]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def _modified_s(fs: Any, path: str, max_age_s: float) -> float | None:
    """When the checkpoint at ``path`` was last written (a sharded directory: its ``meta.pt``, or the commit record
    of a switch to a new checkpoint that a dead run left half-way, which the cleanup at setup finishes before any
    load), in seconds since the epoch; None if there is no whole checkpoint there. ``path`` was just found to exist
    (by :func:`_exists`, or listed): it is not asked again (on S3 a request each)."""
    try:
        return _modified_or_fail(fs, path, max_age_s)
    except FileNotFoundError:
        return None  # gone since it was found
    except OSError:
        if _is_link(fs, path):
            return None  # a link that leads nowhere (a loop, through a file): no checkpoint there
        raise


def _modified_or_fail(fs: Any, path: str, max_age_s: float) -> float | None:
    if fs.isdir(path):
        entries = {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry for entry in fs.ls(path, detail=True)}
        fs.invalidate_cache(path)  # the cleanup at setup may change it before the load, which may share this cache
        if not holds_checkpoint(entries):
            return None
        if LIGHTNING_META_NAME not in entries and not _completed_at_setup(entries, max_age_s):
            return None
        dated_by = LIGHTNING_META_NAME if LIGHTNING_META_NAME in entries else COMMIT_RECORD_NAME
        path = f"{path.rstrip('/')}/{dated_by}"
    return float(fs.modified(path).timestamp())


def _completed_at_setup(entries: dict[str, Any], max_age_s: float) -> bool:
    """Whether the cleanup at setup completes a directory holding ``entries`` (fsspec's listing, by name) and no
    ``meta.pt``: only where every in-flight marker's writer is gone by the cleanup's own rule (a dead process of this
    host, another host's once ``max_age_s`` old). Otherwise the directory stays as it is, and loading it would fail."""
    now = time.time()
    for name, entry in entries.items():
        marker = parse_leftover_name(name, PENDING_SUFFIX)
        if marker is None:
            continue
        modified = _entry_modified_s(entry)
        age_s = None if modified is None else now - modified
        if not writer_gone(marker.owner, age_s, max_age_s, tracks_own_writes=False):
            return False
    return True


def _entry_modified_s(entry: dict[str, Any]) -> float | None:
    """An fsspec listing entry's modification time in seconds since the epoch (local ``mtime``, S3
    ``LastModified``); None where the listing gives none."""
    stamp = entry.get("mtime", entry.get("LastModified"))
    if stamp is None:
        return None
    return float(stamp.timestamp()) if hasattr(stamp, "timestamp") else float(stamp)
