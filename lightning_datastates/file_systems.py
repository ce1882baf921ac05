"""The file systems a Trainer's ``ModelCheckpoint``s list, check and link their files through, made with the plugin's
``storage_options`` (an S3 endpoint, credentials): the same store the plugin writes to. Lightning makes its own without
them (Lightning's side of the package: callback and plugin; see ``docs/design.md``, "Lightning facts").

Training thread, before Lightning resolves ``ckpt_path="last"`` and at the callback's setup (before
``ModelCheckpoint``'s own); idempotent.
"""

from __future__ import annotations

from typing import Any

import fsspec
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates.compat.lightning import use_file_system
from lightning_datastates.storage import fsspec_storage_options, writer_kind


def adopt_file_systems(trainer: Any, storage_options: dict[str, Any] | None) -> None:
    """Have each of ``trainer``'s ``ModelCheckpoint``s whose directory is remote use a file system made with
    ``storage_options`` (see the module docstring)."""
    # Even without options: on S3, ours has the timeouts of storage_options' timeout_s (a silent endpoint fails in
    # about a minute; Lightning's waits minutes).
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if not isinstance(callback, ModelCheckpoint) or dirpath is None or "://" not in str(dirpath):
            continue
        protocol = writer_kind(str(dirpath))
        use_file_system(callback, fsspec.filesystem(protocol, **fsspec_storage_options(str(dirpath), storage_options)))
