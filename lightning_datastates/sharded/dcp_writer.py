"""The seam between ``torch.distributed.checkpoint`` and the snapshot engine: a DCP ``StorageWriter`` whose
``write_data`` captures the rank's shard file lazily and whose ``finish`` keeps the metadata for a later commit.

DCP drives it, on the training thread of every rank, inside ``torch.distributed.checkpoint.save``:
  1) ``reset`` and ``set_up_storage_writer`` (every rank);
  2) ``prepare_local_plan`` (every rank), then ``prepare_global_plan`` (coordinator): each rank's items go to one file,
     ``__<rank>_<token>.distcp``; the token is new for every save, so a save into a directory that holds a committed
     checkpoint never overwrites that checkpoint's files;
  3) ``write_data`` (every rank): plan the file (:mod:`~lightning_datastates.sharded.layout`), hand it to the capture
     callback (the engine copies and writes it in the background) and answer at once with each item's extent, known
     from the plan;
  4) ``finish`` (coordinator): the ``.metadata`` DCP's reader needs, pickled now and written only once every rank's
     file is durable (:mod:`~lightning_datastates.sharded.commit`): DCP's own writer would publish it here, before a
     lazy copy has even started.

Planning collectives run on the training thread, as in Lightning's synchronous sharded save; nothing here starts a
collective from another thread.
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from lightning_datastates.compat.torch import dcp_storage_info
from lightning_datastates.sharded.layout import ArchivePlans, ShardFilePlan, plan_shard_file

#: DCP's suffix of data files.
SHARD_SUFFIX = ".distcp"
#: DCP's name of the file that makes a directory a checkpoint for its reader.
DCP_METADATA_NAME = ".metadata"

#: ``capture(plan, file_path)``: snapshot one shard file (training thread; returns once training may go on).
ShardCapture = Callable[[ShardFilePlan, str], None]


@dataclass(frozen=True)
class ShardFileName:
    """``SavePlan.storage_data`` of one rank: the name of its file inside the checkpoint directory."""

    name: str


def shard_file_name(rank: int, token: str) -> str:
    """The file of ``rank`` for the save named ``token``."""
    return f"__{rank}_{token}{SHARD_SUFFIX}"


def join_path(directory: str, name: str) -> str:
    """``name`` inside ``directory``, for local paths and URLs alike."""
    return f"{directory.rstrip('/')}/{name}"


class LazyShardWriter(StorageWriter):
    """A DCP ``StorageWriter`` for one save into ``path`` (see the module docstring for the call order).

    After ``save`` returns, :attr:`shard_path` is this rank's file (None if DCP gave it no item: replicated state is
    saved by one rank only) and, on the coordinator, :attr:`metadata_bytes` the pickled ``.metadata`` and
    :attr:`file_names` every rank's file.
    """

    def __init__(self, path: str, capture: ShardCapture, plans: ArchivePlans) -> None:
        super().__init__()
        self.path = path
        self.token = uuid.uuid4().hex[:12]
        self.save_id = uuid.uuid4().hex
        self._capture = capture
        self._plans = plans
        self.rank = 0
        self.is_coordinator = False
        self.shard_path: str | None = None
        self.metadata_bytes: bytes | None = None
        self.file_names: tuple[str, ...] = ()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins (DCP passes the ``checkpoint_id`` given to ``save``, if any)."""
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Learn this rank's role (DCP passes ``rank`` by keyword on torch >= 2.6)."""
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add locally: the coordinator names the files."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: one file per rank, named for this save."""
        return [
            replace(plan, storage_data=ShardFileName(shard_file_name(i, self.token))) for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Plan this rank's file, start its lazy capture, and answer with each item's extent (already known)."""
        name = plan.storage_data.name
        payloads = [_payload(planner.resolve_data(item)) for item in plan.items]
        results: list[WriteResult] = []
        if plan.items:
            shard = plan_shard_file(payloads, self._plans.alignment, self._plans)
            self.shard_path = join_path(self.path, name)
            self._capture(shard, self.shard_path)
            results = [
                WriteResult(
                    index=item.index,
                    size_in_bytes=extent.length,
                    storage_data=dcp_storage_info(name, extent.offset, extent.length),
                )
                for item, extent in zip(plan.items, shard.extents, strict=True)
            ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: keep the complete ``.metadata`` (pickled, as DCP's reader unpickles it) for the commit."""
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        metadata.storage_meta = self.storage_meta()
        self.metadata_bytes = pickle.dumps(metadata)
        self.file_names = tuple(sorted({result.storage_data.relative_path for rank in results for result in rank}))

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint's path and this save's id, as DCP's own writer records them."""
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any path: the plugin picked the storage already."""
        return True


def _payload(data: torch.Tensor | io.BytesIO) -> torch.Tensor | bytes:
    """What goes into the file for one resolved item: the tensor itself (its archive is planned), or the bytes."""
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    return data.detach()
