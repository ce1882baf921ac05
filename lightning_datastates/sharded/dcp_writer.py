"""The seam between ``torch.distributed.checkpoint`` (DCP) and the snapshot engine, in two halves: what a rank can
decide alone runs on its training thread; DCP's collectives run later on the committer thread, over a gloo group.

Training thread of every rank (:mod:`~lightning_datastates.sharded.staging`, no collective): DCP's local plan of the
rank's state and the plan of its file ``__<rank>_<token>.distcp``, with every item's extent (a
:class:`StagedShard`); the engine copies and writes the file lazily. The token is new for every save, so a save into
a directory that holds a committed checkpoint never overwrites that checkpoint's files.

Committer thread of every rank (:func:`plan_checkpoint`, in save order on every rank): DCP's own ``save`` runs with
an empty state dict, :class:`StagedPlanner` (it answers with the staged local plan) and :class:`StagedShardWriter`
(it answers ``write_data`` with the extents already known). DCP gathers the local plans on the coordinator, which
deduplicates replicated items and builds the global metadata, and returns each rank its final plan; DCP calls, in
this order: ``reset``, ``set_up_storage_writer``, ``prepare_local_plan`` (every rank), ``prepare_global_plan``
(coordinator), ``write_data`` (every rank), ``finish`` (coordinator: the pickled ``.metadata``, written only once
every rank's file is durable, :mod:`~lightning_datastates.sharded.commit`).

Why split: DCP's planning is two collectives whose cost (pickling every rank's plan, waiting for the slowest rank)
the training thread would otherwise pay at every save, as in DCP's own ``async_save``, which plans in the background
too. The price: the staging happens before the coordinator chooses which rank writes an item several ranks hold. For
a replicated DTensor the staging chooses alone (:func:`~lightning_datastates.sharded.staging.local_plan`); a plain
tensor or pickled object every rank holds is copied and written by each of them, the metadata refers to one copy,
and the commit removes a file none of whose items was chosen.
"""

from __future__ import annotations

import os
import pickle
import uuid
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from lightning_datastates.compat.torch import dcp_storage_info
from lightning_datastates.sharded.layout import PieceExtent

#: DCP's suffix of data files.
SHARD_SUFFIX = ".distcp"
#: DCP's name of the file that makes a directory a checkpoint for its reader.


@dataclass(frozen=True)
class ShardFileName:
    """``SavePlan.storage_data`` of one rank: the name of its file inside the checkpoint directory."""

    name: str


@dataclass(frozen=True)
class StagedShard:
    """What the committer needs of this rank's part of one save, as its training thread staged it.

    ``plan`` is DCP's local plan (its ``storage_data`` the file's name), ``extents`` each item's place in the file by
    its key (:func:`item_key`). ``error`` is set when staging failed on this rank: the collective planning then fails
    on every rank, so that no rank waits for this one. No tensor is referenced: the engine holds what it copies.
    """

    plan: SavePlan
    file_name: str
    extents: dict[tuple[str, tuple[int, ...] | None], PieceExtent]
    error: BaseException | None = None


@dataclass(frozen=True)
class CheckpointPlan:
    """What the coordinator keeps of DCP's global planning: the pickled ``.metadata`` and the files it refers to."""

    metadata_bytes: bytes
    file_names: tuple[str, ...]


def shard_file_name(rank: int, token: str) -> str:
    """The file of ``rank`` for the save named ``token``."""
    return f"__{rank}_{token}{SHARD_SUFFIX}"


def join_path(directory: str, name: str) -> str:
    """``name`` inside ``directory``, for local paths and URLs alike."""
    return f"{directory.rstrip('/')}/{name}"


def plan_checkpoint(staged: StagedShard, path: str, group: Any) -> CheckpointPlan | None:
    """Committer thread, every rank in save order: DCP's global planning of the save into ``path`` over ``group``
    (None: one process, no collectives). The coordinator gets the :class:`CheckpointPlan`, every other rank None.

    Raises:
        torch.distributed.checkpoint.api.CheckpointException: planning failed on some rank (on every rank alike).
    """
    from torch.distributed.checkpoint.state_dict_saver import save

    writer = StagedShardWriter(path, staged)
    save({}, storage_writer=writer, planner=StagedPlanner(staged), process_group=group, no_dist=group is None)
    return writer.checkpoint_plan


class StagedPlanner(DefaultSavePlanner):
    """DCP's default planner whose local plan is the one staged on the training thread (the state dict it is given
    on the committer thread is empty: the coordinator's global planning needs the plans alone)."""

    def __init__(self, staged: StagedShard) -> None:
        super().__init__()
        self._staged = staged

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        """Keep the role only."""
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        """The staged plan; a staging error fails the planning on every rank."""
        if self._staged.error is not None:
            raise RuntimeError(f"staging failed on this rank: {self._staged.error!r}") from self._staged.error
        self.plan = self._staged.plan
        return self.plan


class StagedShardWriter(StorageWriter):
    """DCP's ``StorageWriter`` for one staged save into ``path`` (see the module docstring for the call order).

    Nothing is written here: the engine writes the rank's file, the committer ``.metadata``. After DCP's ``save``,
    :attr:`checkpoint_plan` holds, on the coordinator, the metadata and the files it refers to.
    """

    def __init__(self, path: str, staged: StagedShard) -> None:
        super().__init__()
        self.path = path
        self.save_id = uuid.uuid4().hex
        self._staged = staged
        self.checkpoint_plan: CheckpointPlan | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins (DCP passes the ``checkpoint_id`` given to ``save``, if any)."""
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the file's name was chosen when staging."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The staged plan names its file already."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: each rank keeps the file it named."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Answer with the extent of each item DCP kept for this rank (the engine writes the file)."""
        name = self._staged.file_name
        results = []
        for item in plan.items:
            extent = self._staged.extents[item_key(item.index)]
            info = dcp_storage_info(name, extent.offset, extent.length)
            results.append(WriteResult(index=item.index, size_in_bytes=extent.length, storage_data=info))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: keep the complete ``.metadata`` (pickled, as DCP's reader unpickles it) for the commit."""
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        metadata.storage_meta = self.storage_meta()
        names = tuple(sorted({result.storage_data.relative_path for rank in results for result in rank}))
        self.checkpoint_plan = CheckpointPlan(pickle.dumps(metadata), names)

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint's path and this save's id, as DCP's own writer records them."""
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any path: the plugin picked the storage already."""
        return True


def item_key(index: MetadataIndex) -> tuple[str, tuple[int, ...] | None]:
    """An item's identity across DCP's planning (the index hint may be rewritten by the coordinator)."""
    return index.fqn, None if index.offset is None else tuple(index.offset)
