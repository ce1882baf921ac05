"""Private Lightning internals the package relies on, checked against lightning 2.6.6 (pyproject accepts 2.5 and 2.6).

Each reach into a name or attribute Lightning does not document is here, named for what it gives us; the rest of
the package calls these functions. Why the plugin needs each one: ``docs/design.md``, "Lightning facts".
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm as Tqdm
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

#: The path type of ``CheckpointIO``'s methods (``str`` or ``pathlib.Path``), private in
#: ``lightning.fabric.utilities.types`` (lightning 2.6.6); the plugin's signatures must match its base class.
CheckpointPath = _PATH

# ``Tqdm`` above: the tqdm subclass TQDMProgressBar draws its bars with (number formatting of Lightning's bars), from
# ``lightning.pytorch.callbacks.progress.tqdm_progress``, which the package does not export (lightning 2.6.6).


def unwrap_checkpoint_io(checkpoint_io: Any) -> Any:
    """The ``CheckpointIO`` inside any wrappers (``AsyncCheckpointIO``, ...) around ``checkpoint_io``.

    Checked against lightning 2.6.6: wrappers derive from the private ``_WrappingCheckpointIO`` and hold the wrapped
    plugin in ``checkpoint_io``.
    """
    while isinstance(checkpoint_io, _WrappingCheckpointIO):
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io


def wait_for_queued_saves(checkpoint_io: Any) -> None:
    """Return once every save that wrappers around the plugin (``AsyncCheckpointIO``) queued before this call has
    reached the plugin inside (its ``save_checkpoint`` returned). Caller: the training thread, before a removal or a
    load, which the wrapper hands on at once while its saves wait on its executor thread: a removal would otherwise
    not be held back behind the save queued before it (the new best checkpoint), and a load could read the file that
    save is about to replace.

    Checked against lightning 2.6.6: ``AsyncCheckpointIO`` saves through a private one-thread executor, ``_executor``
    (None until its first save and after its teardown), in submission order; a no-op submitted now runs after them.
    """
    while isinstance(checkpoint_io, _WrappingCheckpointIO):
        executor = getattr(checkpoint_io, "_executor", None)
        if executor is not None:
            try:
                executor.submit(lambda: None).result()
            except RuntimeError:  # shut down meanwhile (teardown): nothing is queued any more
                pass
        checkpoint_io = checkpoint_io.checkpoint_io


def override_file_exists(
    checkpoint_callback: ModelCheckpoint,
    counts_as_existing: Callable[[Any, bool], bool],
    unreachable: Callable[[Any, Exception], NoReturn] | None = None,
) -> None:
    """Make ``checkpoint_callback`` ask ``counts_as_existing(path, exists_on_storage)`` whether a file exists; where
    storage cannot be asked, ``unreachable(path, error)`` raises instead (if given).

    Checked against lightning 2.6.6: ``ModelCheckpoint`` picks the version suffix (``-v1``) of its files and of
    ``last.ckpt`` by calling ``self.file_exists(filepath, trainer)``, which asks its private file system ``_fs`` on
    global rank zero and reduces the answer over the ranks. The replacement keeps those two steps and puts
    ``counts_as_existing`` in between. Undo with :func:`restore_file_exists`.
    """

    def file_exists(callback: ModelCheckpoint, filepath: Any, trainer: Trainer) -> bool:
        local = False
        if trainer.is_global_zero:
            # The plugin's writers change storage behind this file system's listing cache (s3fs keeps one per
            # instance, and Lightning's instance is not the writers'): ask storage, not the cache.
            callback._fs.invalidate_cache(str(filepath))
            try:
                on_storage = callback._fs.exists(filepath)
            except Exception as exc:
                if unreachable is None:
                    raise
                unreachable(filepath, exc)
            local = bool(counts_as_existing(filepath, on_storage))
        return trainer.strategy.reduce_boolean_decision(local, all=False)

    checkpoint_callback.file_exists = types.MethodType(file_exists, checkpoint_callback)  # type: ignore[method-assign]


def use_file_system(checkpoint_callback: ModelCheckpoint, fs: Any) -> None:
    """Make ``checkpoint_callback`` list, check and link its files through ``fs``, now and after its own setup.

    Checked against lightning 2.6.6: ``ModelCheckpoint`` makes its private ``_fs`` with ``get_filesystem(dirpath)``,
    without options, in ``__init__`` and again in ``setup``, which lists the directory right after (its private
    ``__warn_if_dir_not_empty``), and lists, checks and links its checkpoints through it (``file_exists``,
    ``_find_last_checkpoints``). For S3 at a custom endpoint, or with credentials given only to the plugin, that file
    system asks AWS instead. So ``_fs`` is replaced now, and again as the first act of that listing, while the
    directory is the one ``fs`` was made for. Undo with :func:`restore_file_exists`.
    """
    dirpath = str(checkpoint_callback.dirpath)
    warn_if_dir_not_empty = checkpoint_callback._ModelCheckpoint__warn_if_dir_not_empty  # type: ignore[attr-defined]

    def listing_through_fs(directory: Any) -> None:
        if str(checkpoint_callback.dirpath) == dirpath:
            checkpoint_callback._fs = fs
        warn_if_dir_not_empty(directory)

    checkpoint_callback._fs = fs
    checkpoint_callback._ModelCheckpoint__warn_if_dir_not_empty = listing_through_fs  # type: ignore[attr-defined]


def restore_file_exists(checkpoint_callback: ModelCheckpoint) -> None:
    """Undo :func:`override_file_exists` and :func:`use_file_system` (the instance attributes go; the class's
    methods show again)."""
    checkpoint_callback.__dict__.pop("file_exists", None)
    checkpoint_callback.__dict__.pop("_ModelCheckpoint__warn_if_dir_not_empty", None)


def restored_signal_handlers(trainer: Trainer) -> dict[Any, Any]:
    """The signal handlers that ``trainer``'s teardown puts back (``_SignalConnector._original_handlers``: those of
    the start of fit, SIGINT's among them), to be changed in place; an empty dict where this Lightning keeps none."""
    handlers = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
    return handlers if isinstance(handlers, dict) else {}


def logging_step(trainer: Trainer) -> int:
    """The step the Trainer's loggers are at now, as ``LightningModule.log`` and ``LearningRateMonitor`` use it.

    Checked against lightning 2.6.6: the private counter ``fit_loop.epoch_loop._batches_that_stepped`` (batches
    whose optimizer stepped), which ``LearningRateMonitor`` logs at.
    """
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def fsdp_state_dict_type(strategy: Any) -> str:
    """``FSDPStrategy``'s ``state_dict_type`` (``"full"`` or ``"sharded"``).

    Checked against lightning 2.6.6: kept only in the private ``_state_dict_type``; ``"full"`` where it is missing.
    """
    return str(getattr(strategy, "_state_dict_type", "full"))


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """``ModelParallelStrategy``'s ``save_distributed_checkpoint`` setting.

    Checked against lightning 2.6.6: kept only in the private ``_save_distributed_checkpoint``; True (Lightning's
    default) where it is missing.
    """
    return bool(getattr(strategy, "_save_distributed_checkpoint", True))


class KeyedPath(str):
    """A local checkpoint path as the plugin keys it (absolute, normalized: see :func:`checkpoint_path_str`) that
    remembers how the caller spelled it, in :attr:`as_given`, for messages: Lightning's ``TorchCheckpointIO`` names
    the path it was given (``Checkpoint file not found: not existing``), and so must the plugin.

    Any string operation on it returns a plain ``str``: only the object :func:`checkpoint_path_str` returned, handed
    on as it is, carries the spelling (the pipeline hands it to the reader).
    """

    as_given: str

    def __new__(cls, keyed: str, as_given: str) -> KeyedPath:
        """``keyed`` is the string's value; ``as_given`` the caller's spelling."""
        self = super().__new__(cls, keyed)
        self.as_given = as_given
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (a path sent to other ranks) with its spelling."""
        return (KeyedPath, (str(self), self.as_given))


def path_as_given(path: str) -> str:
    """How the caller spelled ``path`` (a :class:`KeyedPath`), else ``path`` itself."""
    return path.as_given if isinstance(path, KeyedPath) else path


def checkpoint_path_str(path: CheckpointPath) -> str:
    """``path`` as the plugin keys it: a URL as a string (one that ``pathlib`` collapsed, ``s3:/b/k``, restored); a
    local path absolute and normalized, so that every spelling of one file (``ck/a.ckpt``, ``./ck//a.ckpt``, its
    absolute path) names the same pending save, and a write in the background lands where the save call meant even if
    the working directory changes meanwhile. Symbolic links are kept, not resolved: a save replaces the link itself,
    as a rename onto it does. A local path comes as a :class:`KeyedPath`, which remembers the caller's spelling for
    messages (:func:`path_as_given`)."""
    text = os.fspath(path)
    # pathlib collapses "s3://bucket/key" into "s3:/bucket/key" (FSDP and ModelParallel pass Paths): restore it.
    text = _COLLAPSED_URL.sub(r"\1://", text) if not isinstance(path, str) else text
    return text if "://" in text else KeyedPath(os.path.abspath(text), path_as_given(text))


_COLLAPSED_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+):/(?!/)")
