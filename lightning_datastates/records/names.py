"""The names that make a directory a sharded checkpoint, and those of the markers this package leaves in one.

A sharded checkpoint (FSDP, ModelParallel through DCP) is a directory named like a file (``epoch=0-step=2.ckpt/``):
DCP's :data:`DCP_METADATA_NAME` names the shard files, Lightning's :data:`LIGHTNING_META_NAME` makes the directory a
checkpoint for Lightning's load. The package adds, for moments, a commit record (:data:`COMMIT_RECORD_NAME`, while a
directory switches to a new checkpoint) and markers named like every leftover of the package
(``.commit.<host>.<pid>.<token><suffix>``): :data:`PENDING_SUFFIX` while a save is in flight there,
:data:`REMOVING_SUFFIX` while the directory is being removed. Pure constants, so that the Lightning compatibility
layer, the storage seam and the sharded saver can share them without importing each other.
"""

from __future__ import annotations

from collections.abc import Collection

#: DCP's metadata file in a sharded checkpoint directory (``torch.distributed.checkpoint.filesystem``'s name).
DCP_METADATA_NAME = ".metadata"
#: Lightning's file in a sharded checkpoint directory (``lightning.fabric.utilities.load._METADATA_FILENAME``): it
#: makes the directory a checkpoint for Lightning's load.
LIGHTNING_META_NAME = "meta.pt"
#: The commit record in a checkpoint directory while rank 0 switches it to a new checkpoint
#: (:mod:`~lightning_datastates.sharded.publish`). Neither DCP nor Lightning reads it; a committed checkpoint has
#: none.
COMMIT_RECORD_NAME = ".datastates-commit"
#: Suffix of the marker of a sharded save in flight (:mod:`~lightning_datastates.sharded.leftovers`).
PENDING_SUFFIX = ".datastates-pending"
#: Suffix of the marker of a checkpoint directory being removed (:mod:`~lightning_datastates.storage.removal`): from
#: the moment it exists the directory is no checkpoint, whatever it still holds, and a cleanup finishes the removal.
REMOVING_SUFFIX = ".datastates-removing"


def holds_checkpoint(names: Collection[str]) -> bool:
    """Whether a directory holding ``names`` is, or will be once the cleanup at setup has run, one whole sharded
    checkpoint: it has ``meta.pt`` (or the commit record of a switch that a dead run left half-way, which the cleanup
    finishes) and no removal marker (a removal that a dead run left half-way, which the cleanup finishes). Pure."""
    if any(name.endswith(REMOVING_SUFFIX) for name in names):
        return False
    return LIGHTNING_META_NAME in names or COMMIT_RECORD_NAME in names
