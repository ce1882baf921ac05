"""The training thread's half of a sharded save: what a rank decides alone, with no collective and no tensor data read.

:func:`stage_shard` makes DCP's local plan of the rank's state (DCP's default planner: the local shards of DTensors,
plain tensors, pickled objects), resolves each item as DCP's writer would, and plans the rank's file
(:mod:`~lightning_datastates.sharded.layout`). The committer later plans the checkpoint with DCP from what was staged
here (:mod:`~lightning_datastates.sharded.dcp_writer`).

The saves of one fit repeat the same state: same keys, same shards. Two caches, one per saver, keep what does not
change: :class:`~lightning_datastates.sharded.layout.ArchivePlans` (the file's placement of the tensors) and
:class:`LocalPlans` (DCP's local plan, whose computation for every DTensor shard is most of the staging's cost
otherwise). Both are keyed by every input their result depends on, never by the object's identity alone.

Not thread-safe: the training thread of one rank only.
"""

from __future__ import annotations

import io
import math
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from lightning_datastates.compat.torch import local_shard
from lightning_datastates.sharded.dcp_writer import ShardFileName, StagedShard, item_key, shard_file_name
from lightning_datastates.sharded.layout import ArchivePlans, ShardFilePlan, plan_shard_file


class LocalPlans:
    """DCP's local plan of the previous save, reused while the state's structure (:func:`_structure`) is the same.

    A DTensor's write item is computed from its key, its global shape, its device mesh and placements, and the
    properties of its local tensor (dtype, layout, whether it requires grad, pinned memory); a plain tensor's from its
    key, shape and the same properties; any other object's from its key alone. The structure holds exactly these,
    and the grad mode (it decides whether DCP's ``to_local()`` requires grad). A state holding anything else (a
    ``ShardedTensor``, another tensor subclass) is planned every time.
    """

    def __init__(self) -> None:
        self._structure: list[tuple[Any, ...]] | None = None
        self._plan: SavePlan | None = None
        #: Plans served from the cache (for tests and diagnostics).
        self.hits = 0

    def plan(self, planner: DefaultSavePlanner) -> SavePlan:
        """:func:`local_plan` of ``planner`` (set up), or the same plan kept from the previous save."""
        structure = _structure(planner.state_dict)
        if structure is not None and self._plan is not None and structure == self._structure:
            self.hits += 1
            # The items are the same; the mapping from flat keys to the state dict's nesting is this save's own.
            return replace(self._plan, planner_data=planner.mappings if planner.flatten_state_dict else None)
        plan = local_plan(planner)
        self._structure, self._plan = structure, plan
        return plan


def stage_shard(
    state: dict[str, Any], rank: int, plans: ArchivePlans, local_plans: LocalPlans | None = None
) -> tuple[StagedShard, ShardFilePlan | None]:
    """DCP's local plan of ``state`` for ``rank`` and the plan of the rank's file, None when the rank holds no item
    (the caller hands the file's plan to the engine).

    Raises:
        LayoutUnsupported: torch refused to plan a tensor's archive.
    """
    planner = DefaultSavePlanner()
    # DCP's coordinator is rank 0 of the group it plans over; the committer's group spans every rank in order.
    planner.set_up_planner(state, storage_meta=None, is_coordinator=rank == 0)
    local = local_plan(planner) if local_plans is None else local_plans.plan(planner)
    name = _new_file_name(rank)
    plan = replace(local, storage_data=ShardFileName(name))
    if not plan.items:
        return StagedShard(plan, name, {}), None
    payloads = [_payload(_resolve(planner, item)) for item in plan.items]
    shard = plan_shard_file(payloads, plans.alignment, plans)
    extents = {item_key(item.index): extent for item, extent in zip(plan.items, shard.extents, strict=True)}
    return StagedShard(plan, name, extents), shard


def local_plan(planner: DefaultSavePlanner) -> SavePlan:
    """DCP's local plan (the planner is set up), each replicated DTensor item kept by one of the ranks holding it.

    The ranks that hold the same local shard of a DTensor differ only in their coordinates on the mesh dimensions it
    is replicated over (HSDP's replica groups, tensor parallelism's replicated norms and biases). DCP plans such an
    item on each of them and its coordinator keeps one; our files are planned and written before that choice, so
    each would copy and write it. Instead every holder makes the same choice alone, with no exchange: the items of
    each mesh and placements are dealt to its replicas by size (:func:`deal_by_size`), so that replica groups share
    the writing as DCP's own choice would have them. DCP's planning then finds each of these items once.
    Replicas on meshes of their own (a DTensor on a submesh, replicated by a parallelism outside it), plain tensors
    and pickled objects stay on every rank that holds them: a rank cannot tell alone which others do.
    """
    plan = planner.create_local_plan()
    groups: dict[tuple[Any, ...], list[int]] = {}  # item positions by (mesh, placements): a handful of groups
    for position, item in enumerate(plan.items):
        obj = planner.state_dict.get(item.index.fqn)
        if isinstance(obj, DTensor):
            groups.setdefault((obj.device_mesh, obj.placements), []).append(position)
    dropped: set[int] = set()
    for (mesh, placements), positions in groups.items():
        replica = replica_position(mesh.get_coordinate(), [mesh.size(d) for d in range(mesh.ndim)], placements)
        if replica is None:  # not on the mesh: DCP plans nothing for it either
            dropped.update(positions)
            continue
        index, count = replica
        if count > 1:
            items = [plan.items[p] for p in positions]
            writers = deal_by_size([(_item_order(item), _chunk_bytes(item)) for item in items], count)
            dropped.update(p for p, writer in zip(positions, writers, strict=True) if writer != index)
    if not dropped:
        return plan
    return replace(plan, items=[item for p, item in enumerate(plan.items) if p not in dropped])


def replica_position(
    coordinate: Sequence[int] | None, mesh_shape: Sequence[int], placements: Sequence[Any]
) -> tuple[int, int] | None:
    """Among the ranks of a mesh holding the same local shard of a DTensor placed by ``placements``, the position of
    the rank at ``coordinate`` and how many they are: its coordinates and the mesh's sizes on the dimensions the
    tensor is replicated over, read as one number in mixed radix (pure). None when the rank is not on the mesh."""
    if coordinate is None:
        return None
    index, count = 0, 1
    for dimension, placement in enumerate(placements):
        if placement.is_replicate():
            index = index * mesh_shape[dimension] + coordinate[dimension]
            count *= mesh_shape[dimension]
    return index, count


def deal_by_size(items: Sequence[tuple[Any, int]], count: int) -> list[int]:
    """The replica (0 to ``count - 1``) that writes each of ``items``, ``(order key, bytes)`` in any order: largest
    first (ties by key), each to the replica with the fewest bytes so far (ties to the lowest). Pure, and the same on
    every rank given the same items, which the replicas of one shard hold."""
    loads = [0] * count
    writers = [0] * len(items)
    for position in sorted(range(len(items)), key=lambda p: (-items[p][1], items[p][0])):
        writer = min(range(count), key=lambda r: (loads[r], r))
        writers[position] = writer
        loads[writer] += max(items[position][1], 1)
    return writers


def _item_order(item: WriteItem) -> tuple[str, tuple[int, ...]]:
    return item.index.fqn, tuple(item.index.offset or ())


def _chunk_bytes(item: WriteItem) -> int:
    """The bytes of a tensor item's chunk (what DCP's own deduplication weighs)."""
    data = item.tensor_data
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


def failed_staging(rank: int, error: BaseException) -> StagedShard:
    """The stand-in for a staging that raised ``error``: it makes the collective planning fail on every rank."""
    return StagedShard(SavePlan([]), _new_file_name(rank), {}, error)


def _new_file_name(rank: int) -> str:
    """The name of ``rank``'s file for a new save: its token is new, so no save overwrites another's file."""
    return shard_file_name(rank, uuid.uuid4().hex[:12])


def _structure(state_dict: dict[str, Any]) -> list[tuple[Any, ...]] | None:
    """What DCP's local plan of the flat ``state_dict`` depends on (see :class:`LocalPlans`); None if not known."""
    structure: list[tuple[Any, ...]] = [(torch.is_grad_enabled(),)]
    for fqn, obj in state_dict.items():
        if isinstance(obj, DTensor):
            if type(obj) is not DTensor:
                return None
            local = local_shard(obj)  # its local tensor, without to_local()'s autograd cost
            key = (fqn, obj.shape, obj.device_mesh, obj.placements, obj.dtype, obj.requires_grad, local.layout)
            structure.append((*key, local.dtype, local.is_pinned()))
        elif isinstance(obj, torch.Tensor):
            if type(obj) not in _PLAIN_TENSORS:
                return None
            structure.append((fqn, obj.shape, obj.dtype, obj.layout, obj.requires_grad, obj.is_pinned()))
        elif hasattr(obj, "__create_write_items__"):
            return None
        else:
            structure.append((fqn,))
    return structure


def _resolve(planner: DefaultSavePlanner, item: WriteItem) -> torch.Tensor | io.BytesIO:
    """``planner.resolve_data(item)``, the same tensor without DCP's per-item cost where that is known to hold.

    For a tensor item DCP looks the object up and, for a DTensor, returns ``to_local()``: an autograd function per
    item, most of the staging's time once the local plan is cached (thousands of items in an LLM's state). A DTensor
    of exactly that type, without partial placements, whose local tensor is a plain tensor, resolves to that local
    tensor (the same storage, offset, shape and strides); a plain tensor to itself. Anything else (bytes, a
    ``ShardedTensor``, another subclass) goes through DCP.
    """
    if item.type != WriteItemType.BYTE_IO:
        obj = planner.state_dict.get(item.index.fqn)
        if type(obj) is DTensor:
            local = local_shard(obj)
            if type(local) in _PLAIN_TENSORS and not any(p.is_partial() for p in obj.placements):
                return local
        elif type(obj) in _PLAIN_TENSORS and (item.index.offset is None or not any(item.index.offset)):
            return cast(torch.Tensor, obj)
    return planner.resolve_data(item)


#: Tensor types that :func:`_resolve` takes as they are.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _payload(data: torch.Tensor | io.BytesIO) -> torch.Tensor | bytes:
    """What goes into the file for one resolved item: the tensor itself (its archive is planned), or the bytes."""
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    return data.detach()
