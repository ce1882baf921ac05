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
  last checkpoint and trains from scratch.

:func:`resolve_last_checkpoint` wraps ``_parse_ckpt_path`` so that, for a Trainer the given predicate accepts (one
whose checkpoints go through the plugin), ``"last"`` is resolved by :func:`newest_last_checkpoint`: the same
candidates, remote ones with their protocol, a file as it is (a file is committed whole or not at all), a directory
only if it holds a checkpoint once the cleanup at setup has run (:func:`~lightning_datastates.records.names.
holds_checkpoint`), dated by its ``meta.pt`` or commit record, a dangling link as the file it names where the local
tier holds that file and as a checkpoint not whole otherwise. Where candidates exist but none is whole, the newest
whole checkpoint of the ``ModelCheckpoint`` directories is taken instead, with a warning; where there is none either,
training starts from scratch with Lightning's warning, as Lightning does when it finds no last checkpoint. Every rank
resolves the same way, before rank 0's cleanup at setup changes anything (the strategy's process group forms in
between). Everything else goes to Lightning's own method unchanged, and so does ``"last"`` with no candidate at all.

Call order: :func:`resolve_last_checkpoint` when a plugin is made (before any ``fit``), any thread, idempotent; the
wrapper runs where Lightning calls the method, on the training thread of every rank.
"""

from __future__ import annotations

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

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

#: Links followed at most from a last checkpoint's link (Linux's own limit for one path).
_MAX_LINKS = 40
#: Marks the wrapper, so that it is installed once.
_WRAPPED = "_lightning_datastates_resolves_last"


@dataclass(frozen=True)
class LastOptions:
    """What the plugin tells the resolution of ``"last"``: its ``stale_after_s`` (``max_age_s``), and with a local tier
    the local copies of a persistent directory's checkpoints (persistent path -> the copy's modification time)."""

    max_age_s: float
    local_copies: Callable[[str], dict[str, float]] | None = None


def resolve_last_checkpoint(prepare: Callable[[Trainer], LastOptions | None]) -> None:
    """Wrap ``_CheckpointConnector._parse_ckpt_path`` (once per process) so that ``ckpt_path="last"`` resumes from a
    whole checkpoint for the Trainers that use the plugin (see the module docstring). ``prepare(trainer)`` runs first:
    for such a Trainer it readies its ``ModelCheckpoint``s (their file systems, with the plugin's options) and gives
    the plugin's :class:`LastOptions`; None for any other Trainer, left to Lightning."""
    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, _WRAPPED, False):
        return

    def parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        options = prepare(self.trainer) if ckpt_path == "last" else None
        if options is not None:
            found = newest_last_checkpoint(self.trainer, options.max_age_s, options.local_copies)
            if found is not NO_CANDIDATE:
                if found is None:
                    fn = state_fn.value
                    rank_zero_warn(
                        f'.{fn}(ckpt_path="last") is set, but no last checkpoint is whole (a run died saving it) and '
                        "no other checkpoint was found. No checkpoint will be loaded."
                    )
                return found
        return original(self, state_fn, ckpt_path, model_provided=model_provided, model_connected=model_connected)

    setattr(parse_ckpt_path, _WRAPPED, True)
    _CheckpointConnector._parse_ckpt_path = parse_ckpt_path  # type: ignore[method-assign]


class _NoCandidate:
    """:func:`newest_last_checkpoint` found no last checkpoint at all, whole or not: Lightning's own method decides."""


NO_CANDIDATE: Any = _NoCandidate()


def newest_last_checkpoint(
    trainer: Trainer, max_age_s: float, local_copies: Callable[[str], dict[str, float]] | None = None
) -> Any:
    """The newest whole one of the Trainer's last checkpoints (``last.ckpt`` and its versions in each
    ``ModelCheckpoint``'s directory, and each ``OnExceptionCheckpoint``'s file), with its protocol; where some exist
    but none is whole, or a ``last.ckpt`` link that leads nowhere was made after the newest whole one, the newest
    whole checkpoint in those directories, with a warning (None if there is none either); :data:`NO_CANDIDATE` if
    there is no last checkpoint at all. ``max_age_s``: the plugin's ``stale_after_s``, which tells whether the cleanup
    at setup will complete a directory whose switch a dead run left half-way. A ``ModelCheckpoint`` without
    ``dirpath`` is looked at where Lightning's setup will derive it.

    With ``local_copies`` (a local tier), a checkpoint counts where either tier holds it, dated by its local copy
    where there is one (:func:`_whole_and_dated`): a last checkpoint durable on the local tier whose replication a
    dead run did not finish is found all the same (its persistent path is returned; the plugin loads its local
    copy)."""
    candidates: dict[str, Any] = {}
    directories: dict[str, Any] = {}
    local: dict[str, float] = {}  # persistent path -> its local copy's modification time
    dangling: dict[str, float] = {}  # a last.ckpt link to a file neither tier holds -> when it was made
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        path = getattr(callback, "ckpt_path", None) if isinstance(callback, OnExceptionCheckpoint) else None
        if path:  # as Lightning reads it
            candidates[str(path)] = get_filesystem(path)
    checkpoint_callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    for callback in checkpoint_callbacks:
        fs = callback._fs
        directory = _checkpoint_dir(callback, trainer)
        if directory is not None:
            # Our writers change storage behind this file system's listing cache (filled by ModelCheckpoint's own
            # listings, at setup): a last checkpoint written since would not be listed.
            fs.invalidate_cache(directory)
            directories[directory] = fs
        if local_copies is not None and directory is not None:
            copies = local_copies(directory)
            local.update(copies)
            for path in copies:
                if _is_last_name(callback, path):
                    candidates[path] = fs
    for callback in checkpoint_callbacks:  # once every local copy is known (callbacks may share a directory)
        fs = callback._fs
        for path in callback._find_last_checkpoints(trainer):
            path = _with_protocol(fs, path)
            candidates[path] = fs
            if not _is_link(fs, path):
                continue
            # save_last="link": the link replaced whatever file had this name (a local copy of that file is not
            # this checkpoint), and it is made as soon as the save call returns: a run killed before the file it
            # names was committed (or, with a local tier, replicated) leaves it dangling. It then stands for the
            # file it names where the local tier holds that, else for a last checkpoint that is not whole.
            local.pop(path, None)
            target = _dangling_link_target(path)
            if target in local:
                del candidates[path]
                candidates[target] = fs
            elif target is not None:
                dangling[path] = os.lstat(path).st_mtime
    found = {path: fs for path, fs in candidates.items() if path in local or path in dangling or _exists(fs, path)}
    if not found:
        return NO_CANDIDATE
    dated = _whole_and_dated(found, max_age_s, local)
    newest = max(dated, key=dated.__getitem__, default=None)
    # A dangling link newer than every whole last checkpoint: its save was the newest, and the newest whole
    # checkpoint of the directories may be newer than those (save_last="link" after a run that saved last.ckpt).
    broken = sorted(path for path, stamp in dangling.items() if newest is None or stamp > dated[newest])
    if newest is not None and not broken:
        return newest
    others = {
        _with_protocol(fs, entry): fs
        for directory, fs in directories.items()
        for entry in _checkpoints_in(fs, directory)
    }
    others.update({path: directories.get(path.rsplit("/", 1)[0]) for path in local})
    # The candidates were dated above (one request each on S3): not again. Those outside the directories (an
    # OnExceptionCheckpoint's file) count as well.
    others = {path: fs for path, fs in others.items() if path not in found}
    whole = {**_whole_and_dated(others, max_age_s, local), **dated}
    fallback = max(whole, key=whole.__getitem__, default=None)
    if fallback is not None:
        rank_zero_warn(
            f'ckpt_path="last": the newest last checkpoint is not whole ({", ".join(broken or sorted(found))}: a run '
            f"died saving it); resuming from the newest whole checkpoint instead, {fallback}"
        )
    return fallback


def _whole_and_dated(candidates: dict[str, Any], max_age_s: float, local: dict[str, float]) -> dict[str, float]:
    """The candidates holding a whole checkpoint on either tier, each with when it was saved: its local copy's time
    where the local tier holds one (``local``, by persistent path: the time of its save), else the persistent
    file's. A persistent copy is dated by its copy, in the order the local writes ended (S3: by its upload's start),
    which is not always the saves' order."""
    dated = {}
    for path, fs in candidates.items():
        if path in local:
            dated[path] = local[path]
        elif fs is not None and (stamp := _modified_s(fs, path, max_age_s)) is not None:
            dated[path] = stamp
    return dated


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


def _dangling_link_target(path: str) -> str | None:
    """Where the local symbolic link ``path`` leads when nothing is there (a dangling link: the end of its chain of
    links, named from the link's directory as ModelCheckpoint named it; a loop: one of its links); else None."""
    if os.path.exists(path):
        return None
    target = path
    for _ in range(_MAX_LINKS):
        try:
            name = os.readlink(target)
        except OSError:  # not a link: the missing end of the chain (or a path through a file)
            return target
        target = os.path.normpath(os.path.join(os.path.dirname(target), name))
    return target


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
