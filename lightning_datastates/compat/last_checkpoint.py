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

import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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

#: Stamps read at once by the resolution of "last" (one request each on S3).
_READS_IN_FLIGHT = 8
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

    def resumable(self, path: str) -> bool:
        """Whether the checkpoint at ``path`` may be resumed from: not a weights-only file (by its stamp; a file
        without one, or that cannot be read now, counts)."""
        try:
            stamp = self.stamp_of(path)
        except OSError:
            return True
        return stamp is None or stamp.resumable


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
    versions in each ``ModelCheckpoint``'s directory, and each ``OnExceptionCheckpoint``'s file that exists) and, in
    the directory of each ``ModelCheckpoint`` that saves last checkpoints (``save_last``) or holds one and does not
    save weights only, every checkpoint saved for resuming (its stamp says so: not a weights-only file): a run killed
    after a top-k save and before the ``last.ckpt`` of the same step (or before any) resumes from the top-k file,
    which is newer, and a ``last.ckpt`` link that leads nowhere does not count. None (with a warning by the caller)
    where candidates exist but none is whole; :data:`NO_CANDIDATE` where there is no candidate at all (then
    Lightning's own method decides, and warns that there is no last checkpoint). A ``ModelCheckpoint`` without
    ``dirpath`` is looked at where Lightning's setup will derive it. The stamps are read a few at a time (one
    request each on S3).

    With ``options.local_copies`` (a local tier), a checkpoint counts where its local copy is the one to read
    (:func:`~lightning_datastates.tiered.copies.choose_copy`): one durable locally whose replication a dead run did not
    finish is found all the same (its persistent path is returned; the plugin loads its local copy)."""
    candidates: dict[str, Any] = {}
    local: dict[str, tuple[int, str]] = {}  # persistent path -> the order key of its local copy, where that counts
    lasts: set[str] = set()
    every_checkpoint: set[str] = set()  # candidates that count only as full checkpoints (not weights only)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        path = getattr(callback, "ckpt_path", None) if isinstance(callback, OnExceptionCheckpoint) else None
        if path and _exists(get_filesystem(path), str(path)):  # as Lightning reads it, where it fired
            candidates[str(path)] = get_filesystem(path)
            lasts.add(str(path))
    for callback in (cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)):
        fs = callback._fs
        directory = _checkpoint_dir(callback, trainer)
        copies: dict[str, tuple[int, str]] = {}
        if directory is not None:
            # Our writers change storage behind this file system's listing cache (filled by ModelCheckpoint's own
            # listings, at setup): a checkpoint written since would not be listed.
            fs.invalidate_cache(directory)
            if options.local_copies is not None:
                copies = options.local_copies(directory)
                local.update(copies)
        own_lasts = {_with_protocol(fs, path) for path in callback._find_last_checkpoints(trainer)}
        own_lasts |= {path for path in copies if _is_last_name(callback, path)}
        candidates.update(dict.fromkeys(own_lasts, fs))
        lasts |= own_lasts
        if directory is not None and (callback.save_last or own_lasts) and not callback.save_weights_only:
            others = {_with_protocol(fs, entry) for entry in _checkpoints_in(fs, directory)} | set(copies)
            others -= own_lasts
            candidates.update({path: fs for path in others if path not in candidates})
            every_checkpoint |= others
    if not candidates:
        return NO_CANDIDATE
    dated = _dated(candidates, local, every_checkpoint, options)
    # On a tie (a last.ckpt link and the file it names, one save), the last checkpoint: what Lightning itself takes.
    newest = max(dated, key=lambda path: (dated[path], path in lasts), default=None)
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
                f'ckpt_path="last": resuming from {newest}, which was saved after the last checkpoint '
                f"({', '.join(sorted(lasts))}): the run died before it saved the last checkpoint of that step"
            )
    return newest


def _dated(
    candidates: dict[str, Any],
    local: dict[str, tuple[int, str]],
    full_only: set[str],
    options: LastOptions,
) -> dict[str, tuple[int, str]]:
    """The whole ones of ``candidates`` (path -> its file system), each with its order key: its local copy's where
    that is the one to read (``local``), else its own (:func:`_order`); those in ``full_only`` only where their stamp
    does not mark them weights only. A few at a time (the reads are one request each on S3)."""

    def key_of(path: str) -> tuple[int, str] | None:
        if path in local:
            return local[path] if path not in full_only or options.resumable(path) else None
        return _order(candidates[path], path, options, full_only=path in full_only)

    paths = sorted(candidates)
    with ThreadPoolExecutor(max_workers=min(_READS_IN_FLIGHT, max(1, len(paths)))) as pool:
        keys = dict(zip(paths, pool.map(key_of, paths), strict=True))
    return {path: key for path, key in keys.items() if key is not None}


def _order(fs: Any, path: str, options: LastOptions, full_only: bool = False) -> tuple[int, str] | None:
    """The order key of the whole checkpoint at ``path`` on its own storage (the persistent tier): by the save stamp
    of the file that stands for it (the file itself; a sharded checkpoint's ``meta.pt``, or the commit record a switch
    left half-way, which the cleanup at setup completes: :func:`_dated_file`), by that file's modification time where
    it carries none; None where nothing whole is there, or (``full_only``) where the stamp says weights only."""
    if fs is None:
        return None
    try:
        dated_by = _dated_file(fs, path, options.max_age_s)
    except FileNotFoundError:
        return None  # gone since it was found
    except OSError:
        if _is_link(fs, path):
            return None  # a link that leads nowhere (a loop, through a file): no checkpoint there
        raise
    if dated_by is None:
        return None
    try:
        stamp = options.stamp_of(dated_by)
    except FileNotFoundError:
        return None
    if stamp is not None:
        return None if full_only and not stamp.resumable else order_key(stamp, None)
    return order_key(None, float(fs.modified(dated_by).timestamp()))


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


def _dated_file(fs: Any, path: str, max_age_s: float) -> str | None:
    """The file that stands for the checkpoint at ``path`` (which was found: listed, or asked): ``path`` itself for a
    file; for a sharded checkpoint's directory its ``meta.pt``, or the commit record of a switch to a new checkpoint
    that a dead run left half-way, which the cleanup at setup finishes before any load; None where there is no whole
    checkpoint there.

    Raises:
        FileNotFoundError: nothing at ``path`` any more.
        OSError: storage could not be asked (a link that leads nowhere among them).
    """
    if not fs.isdir(path):
        if _is_local(fs):
            os.stat(path)  # through a link: a dangling one, or a loop, raises
        return path
    entries = {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry for entry in fs.ls(path, detail=True)}
    fs.invalidate_cache(path)  # the cleanup at setup may change it before the load, which may share this cache
    if not holds_checkpoint(entries):
        return None
    if LIGHTNING_META_NAME not in entries and not _completed_at_setup(entries, max_age_s):
        return None
    return f"{path.rstrip('/')}/{LIGHTNING_META_NAME if LIGHTNING_META_NAME in entries else COMMIT_RECORD_NAME}"


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
