"""Storage backends behind the :class:`~lightning_datastates.storage.base.StorageWriter` seam."""

from __future__ import annotations

from lightning_datastates.storage.base import StorageWriter, WriteSession
from lightning_datastates.storage.local import LocalWriter, is_local_path, local_path

__all__ = ["LocalWriter", "StorageWriter", "WriteSession", "is_local_path", "local_path", "writer_for"]


def writer_for(path: str) -> StorageWriter:
    """The storage writer for ``path``'s protocol.

    Raises:
        NotImplementedError: the protocol has no writer yet (only local paths and ``file://`` for now).
    """
    if is_local_path(path):
        return LocalWriter()
    raise NotImplementedError(
        f"lightning_datastates cannot write {path!r} yet: only local paths (and file://) are supported. "
        "Use a local or mounted directory (Lustre, NFS), or Lightning's TorchCheckpointIO for this target."
    )
