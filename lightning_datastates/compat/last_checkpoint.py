"""``fit(ckpt_path="last")`` for checkpoints at a URL (S3, other fsspec protocols): Lightning alone does not find them.

Checked against lightning 2.5.6 and 2.6.6 (the same code in both): the checkpoint connector resolves ``"last"`` in its
private ``_CheckpointConnector._parse_ckpt_path``, from each ``ModelCheckpoint``'s private ``_find_last_checkpoints``
and each ``OnExceptionCheckpoint``'s ``ckpt_path``, and takes the candidate with the newest
``get_filesystem(path).modified(path)``. With a remote ``dirpath`` two steps fail:

- ``_find_last_checkpoints`` lists the directory with fsspec, which names remote files without their protocol
  (``bucket/run/last.ckpt``), and ``os.path.normpath`` keeps it so: the connector looks for that path on the local
  disk, finds nothing, warns that there is no last checkpoint and trains from scratch
  (Lightning-AI/pytorch-lightning#18261);
- a sharded checkpoint is a directory, and on S3 a directory has no modification time (``IsADirectoryError``).

:func:`resolve_last_at_urls` wraps ``_parse_ckpt_path`` so that, for a Trainer the given predicate accepts (one whose
checkpoints go through the plugin) and where some ``ModelCheckpoint`` writes to a non-local file system, ``"last"`` is
resolved by :func:`newest_last_checkpoint`: the same candidates, remote ones with their protocol, a directory dated by
its ``meta.pt`` (what makes it a checkpoint; one without it is none). Everything else goes to Lightning's own method
unchanged, and so does ``"last"`` when this finds no candidate (Lightning then warns as it does).

Call order: :func:`resolve_last_at_urls` when a plugin is made (before any ``fit``: Lightning resolves the path before
any callback hook runs), any thread, idempotent; the wrapper runs where Lightning calls the method, on the training
thread of every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from lightning_datastates.sharded.publish import COMMIT_RECORD_NAME, LIGHTNING_META_NAME

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

#: Marks the wrapper, so that it is installed once.
_WRAPPED = "_lightning_datastates_resolves_last_at_urls"


def resolve_last_at_urls(applies: Callable[[Trainer], bool]) -> None:
    """Wrap ``_CheckpointConnector._parse_ckpt_path`` (once per process) so that ``ckpt_path="last"`` finds the last
    checkpoint at a URL for the Trainers ``applies`` accepts (see the module docstring)."""
    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, _WRAPPED, False):
        return

    def parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        if ckpt_path == "last" and applies(self.trainer) and _writes_remotely(self.trainer):
            found = newest_last_checkpoint(self.trainer)
            if found is not None:
                return found
        return original(self, state_fn, ckpt_path, model_provided=model_provided, model_connected=model_connected)

    setattr(parse_ckpt_path, _WRAPPED, True)
    _CheckpointConnector._parse_ckpt_path = parse_ckpt_path  # type: ignore[method-assign]


def newest_last_checkpoint(trainer: Trainer) -> str | None:
    """The newest of the Trainer's last checkpoints (``last.ckpt`` and its versions in each ``ModelCheckpoint``'s
    directory, and each ``OnExceptionCheckpoint``'s file) that exists, with its protocol; None if there is none."""
    candidates: dict[str, Any] = {}
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        path = getattr(callback, "ckpt_path", None) if isinstance(callback, OnExceptionCheckpoint) else None
        if path:  # as Lightning reads it
            candidates[str(path)] = get_filesystem(path)
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            fs = callback._fs
            if callback.dirpath is not None:
                # Our writers change storage behind this file system's listing cache (filled by ModelCheckpoint's own
                # listings, at setup): a last checkpoint written since would not be listed.
                fs.invalidate_cache(str(callback.dirpath))
            for path in callback._find_last_checkpoints(trainer):
                candidates[path if _is_local(fs) else fs.unstrip_protocol(path)] = fs
    dated = {path: stamp for path, fs in candidates.items() if (stamp := _modified_s(fs, path)) is not None}
    return max(dated, key=lambda path: dated[path]) if dated else None


def _writes_remotely(trainer: Trainer) -> bool:
    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    return any(not _is_local(callback._fs) for callback in callbacks)


def _is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def _modified_s(fs: Any, path: str) -> float | None:
    """When the checkpoint at ``path`` was last written (a sharded directory: its ``meta.pt``, or the commit record
    of a switch to a new checkpoint that a dead run left half-way, which the cleanup at setup finishes before any
    load), in seconds since the epoch; None if there is no checkpoint there."""
    fs.invalidate_cache(path)  # our writers change storage behind this file system's listing cache
    if not fs.exists(path):
        return None
    if fs.isdir(path):
        dated_by = (f"{path.rstrip('/')}/{name}" for name in (LIGHTNING_META_NAME, COMMIT_RECORD_NAME))
        found = next((file for file in dated_by if fs.exists(file)), None)  # the record asked for only without meta.pt
        if found is None:
            return None
        path = found
    return float(fs.modified(path).timestamp())
