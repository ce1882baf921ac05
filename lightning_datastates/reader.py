"""Load checkpoints written by :class:`~lightning_datastates.DataStatesIO` (or by anything else torch can read).

Local files go straight to ``torch.load`` by path (torch reads them with its own C++ reader); other protocols
are read through their storage writer's file system, with the plugin's ``storage_options``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _load as pl_load

from lightning_datastates.storage import LocalWriter, StorageWriter, local_path


def load_checkpoint(writer: StorageWriter, path: str, map_location: Any = None, weights_only: bool | None = None) -> Any:
    """``torch.load`` the committed checkpoint at ``path``; ``map_location`` and ``weights_only`` as torch.

    Raises:
        FileNotFoundError: nothing at ``path``.
    """
    if not writer.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    if isinstance(writer, LocalWriter):
        return pl_load(local_path(path), map_location=map_location, weights_only=weights_only)
    with writer.open_read(path) as stream:
        return torch.load(stream, map_location=map_location, weights_only=weights_only)
