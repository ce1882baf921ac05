"""Plan one rank's shard file of a ``torch.distributed.checkpoint`` (DCP) save: the layout DCP's own reader reads.

DCP's ``FileSystemReader`` finds each item of a rank's ``.distcp`` file by ``(relative_path, offset, length)`` in the
checkpoint's ``.metadata``, and reads a tensor item with ``torch.load`` of those bytes, a byte item as they are. So
the file is a sequence of independent pieces: for each tensor, the archive ``torch.save(tensor)`` writes; for each
byte item, its bytes. :func:`plan_shard_file` plans every tensor's archive with
:func:`~lightning_datastates.capture.layout.plan_layout` (no tensor data touched) and places the pieces one after
the other, the tensors' first and the byte items' after them, each starting at a multiple of the alignment, into one
:class:`~lightning_datastates.records.layout.CheckpointLayout`: the snapshot engine then copies and writes it as
it does a single-file checkpoint, lazily, and the offsets DCP's metadata needs are known before any byte is copied.

A tensor that views part of a larger storage is saved with that whole storage, as ``torch.save`` does (``torch.load``
rebuilds the same view); DCP's own writer clones such tensors first, which would copy on the training thread.

Several items that are the same view of the same storage (tied weights: the token embedding and the output layer of
a GPT are two keys of one parameter) would get byte-identical archives: the file holds that archive once, and every
such item's extent points to it. DCP's reader reads each item by its own ``(offset, length)``, so two items may share
one; the copy into the host arena and the write are then done once, where DCP's own writer does both twice.

This module is pure: no threads, no files, no devices beyond reading tensor metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from lightning_datastates.alignment import align_up
from lightning_datastates.capture.layout import plan_layout
from lightning_datastates.capture.segments import joined_segments, with_metadata_checksums
from lightning_datastates.capture.verified import VerifiedStructures
from lightning_datastates.compat.torch import storage_identity
from lightning_datastates.records.layout import CheckpointLayout, ChecksumSlot, StorageRecord

#: Where each piece starts in the file when no storage alignment is set (torch's own record alignment).
DEFAULT_PIECE_ALIGNMENT = 64


@dataclass(frozen=True)
class PieceExtent:
    """Where one DCP item lies in the shard file: ``length`` bytes from ``offset``."""

    offset: int
    length: int


@dataclass(frozen=True)
class ShardFilePlan:
    """The layout of one rank's shard file, its storages (indexed by record key), and each item's extent (in the
    order of the items given; items that are the same view of one storage share theirs)."""

    layout: CheckpointLayout
    storages: list[torch.UntypedStorage]
    extents: tuple[PieceExtent, ...]


@dataclass(frozen=True)
class _TensorRun:
    """The pieces of a sequence of tensors placed from offset 0, each distinct tensor with one storage (record key =
    its index among the distinct ones; an alias shares the extent of the tensor it repeats): what
    :func:`plan_shard_file` puts first in a file, the same for every save of the same shards."""

    metadata: tuple[tuple[int, bytes], ...]
    records: tuple[StorageRecord, ...]
    checksums: tuple[ChecksumSlot, ...]
    extents: tuple[PieceExtent, ...]
    end: int


class ArchivePlans:
    """Archive layouts already planned, by tensor signature: the saves of one run repeat the same shards. Also the
    placement of a whole sequence of such tensors in a file, by the sequence of their signatures.

    ``torch.save`` of a plain tensor pickles only its dtype, shape, strides, storage offset, its storage's size and
    device, and ``requires_grad``; two tensors equal in all of these get byte-identical archives (but for the payload,
    its CRC-32 fields, which the writer fills, and torch's random serialization id), so a layout planned and
    self-checked for one serves the other. Tensor subclasses and tensors with Python attributes are planned each
    time. Not thread-safe: one per saver, used on the training thread.
    """

    def __init__(self, alignment: int | None, verified: VerifiedStructures | None = None) -> None:
        self.alignment = alignment
        self._verified = verified
        self._layouts: dict[tuple[object, ...], CheckpointLayout] = {}
        self._runs: dict[tuple[object, ...], _TensorRun] = {}
        #: Plans served from the cache (for tests and diagnostics): archives, and whole runs of tensors.
        self.hits = 0
        self.run_hits = 0

    def plan(self, tensor: torch.Tensor) -> tuple[CheckpointLayout, list[torch.UntypedStorage]]:
        """The layout of ``torch.save(tensor)`` and its storages (see :func:`plan_layout`)."""
        key = _signature(tensor)
        layout = None if key is None else self._layouts.get(key)
        if layout is not None:
            self.hits += 1
            return layout, [tensor.untyped_storage()]
        layout, storages = plan_layout(tensor, self.alignment, self._verified)
        # Each archive's layout stays as planned (nothing splices it later): its metadata records' CRCs go in now.
        layout = with_metadata_checksums(layout)
        if key is not None and len(storages) == 1:
            self._layouts[key] = layout
        return layout, storages

    def run(self, key: tuple[object, ...]) -> _TensorRun | None:
        """The run planned for tensors of these signatures, if any."""
        run = self._runs.get(key)
        if run is not None:
            self.run_hits += 1
        return run

    def keep_run(self, key: tuple[object, ...], run: _TensorRun) -> None:
        """Keep ``run`` for later saves of tensors of these signatures (a run or two differ per fit: a few kept)."""
        if len(self._runs) >= _RUNS_KEPT:
            self._runs.clear()
        self._runs[key] = run


#: How many runs of tensors :class:`ArchivePlans` keeps (one per distinct state: model and optimizer, per fit).
_RUNS_KEPT = 4


def _signature(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """What ``torch.save`` pickles of a plain tensor; None for anything else (planned every time)."""
    if type(tensor) is not torch.Tensor or tensor.__dict__ or tensor.is_conj() or tensor.is_neg():
        return None
    if tensor.layout != torch.strided or tensor.is_quantized:
        return None
    storage = tensor.untyped_storage()
    return (
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        storage.nbytes(),
        str(storage.device),
        tensor.requires_grad,
    )


def plan_shard_file(
    items: Sequence[torch.Tensor | bytes], alignment: int | None = None, plans: ArchivePlans | None = None
) -> ShardFilePlan:
    """Plan the file holding ``items`` (a tensor as ``torch.save`` archives it, bytes as they are): the tensors in
    their order, then the byte items in theirs; the extents are given in the order of ``items``.

    Every piece starts at a multiple of ``alignment`` (64 without one), and with ``alignment`` every storage's data
    inside an archive does too (so direct I/O needs no bounce buffer). ``plans`` (for the same ``alignment``) keeps
    the archives planned by earlier saves, and the placement of the tensors: a save whose tensors have the
    signatures of an earlier save's (a byte item's content may change) reuses it whole.

    Raises:
        LayoutUnsupported: torch refused to plan a tensor's archive (see
            :func:`~lightning_datastates.capture.layout.plan_layout`).
    """
    plans = ArchivePlans(alignment) if plans is None else plans
    if plans.alignment != alignment:
        raise ValueError(f"archive plans for alignment {plans.alignment} used with alignment {alignment}")
    piece_alignment = alignment or DEFAULT_PIECE_ALIGNMENT
    tensors = [item for item in items if isinstance(item, torch.Tensor)]
    signatures = tuple(_signature(tensor) for tensor in tensors)
    aliases = _aliases(tensors, signatures)
    distinct = [tensor for tensor, alias in zip(tensors, aliases, strict=True) if alias is None]
    cacheable = None not in signatures
    # Which tensors repeat which is part of the key: the same signatures without the tie are another placement.
    key = (signatures, aliases)
    run = plans.run(key) if cacheable else None
    if run is not None:
        storages = [tensor.untyped_storage() for tensor in distinct]
    else:
        run, storages = _plan_tensor_run(tensors, aliases, piece_alignment, plans)
        if cacheable and len(storages) == len(distinct):
            plans.keep_run(key, run)
    metadata = list(run.metadata)
    tensor_extents = iter(run.extents)
    extents: list[PieceExtent] = []
    position = run.end
    for item in items:  # the byte items after the tensors, in their order
        if isinstance(item, torch.Tensor):
            extents.append(next(tensor_extents))
            continue
        start = _next_piece(position, piece_alignment, metadata)
        if item:
            metadata.append((start, bytes(item)))
        extents.append(PieceExtent(start, len(item)))
        position = start + len(item)
    layout = CheckpointLayout(tuple(sorted(metadata)), run.records, position, run.checksums)
    return ShardFilePlan(layout, storages, tuple(extents))


def _plan_tensor_run(
    tensors: Sequence[torch.Tensor], aliases: Sequence[int | None], piece_alignment: int, plans: ArchivePlans
) -> tuple[_TensorRun, list[torch.UntypedStorage]]:
    """Place the archives of ``tensors`` one after the other from offset 0, an alias (see :func:`_aliases`) at the
    archive of the tensor it repeats; their storages by record key."""
    metadata: list[tuple[int, bytes]] = []
    records: list[StorageRecord] = []
    checksums: list[ChecksumSlot] = []
    storages: list[torch.UntypedStorage] = []
    extents: list[PieceExtent] = []
    position = 0
    for tensor, alias in zip(tensors, aliases, strict=True):
        if alias is not None:
            extents.append(extents[alias])
            continue
        start = _next_piece(position, piece_alignment, metadata)
        layout, tensor_storages = plans.plan(tensor)
        metadata.extend((start + offset, data) for offset, data in layout.metadata)
        records.extend(StorageRecord(len(storages) + r.key, start + r.offset, r.nbytes) for r in layout.records)
        checksums.extend(_shifted(slot, start) for slot in layout.checksums)
        storages.extend(tensor_storages)
        extents.append(PieceExtent(start, layout.total_bytes))
        position = start + layout.total_bytes
    # One segment from each archive's payload to the next one's (the padding between them included): a few write
    # requests per archive instead of one per segment.
    run = _TensorRun(joined_segments(metadata), tuple(records), tuple(checksums), tuple(extents), position)
    return run, storages


def _aliases(
    tensors: Sequence[torch.Tensor], signatures: Sequence[tuple[object, ...] | None]
) -> tuple[int | None, ...]:
    """For each tensor, the index of the first earlier one that is the same view of the same storage (equal
    signature, one storage: ``torch.save`` writes byte-identical archives for the two), else None. Tensors without a
    signature (subclasses, ...) are never aliases: nothing says what their archives hold."""
    first: dict[tuple[object, ...], int] = {}
    aliases: list[int | None] = []
    for index, (tensor, signature) in enumerate(zip(tensors, signatures, strict=True)):
        if signature is None:
            aliases.append(None)
            continue
        view = (storage_identity(tensor.untyped_storage()), *signature)
        aliases.append(first.get(view))
        first.setdefault(view, index)
    return tuple(aliases)


def _next_piece(position: int, piece_alignment: int, metadata: list[tuple[int, bytes]]) -> int:
    """Where the piece after ``position`` starts; the zeros up to there (no one reads them) go into ``metadata``."""
    start = align_up(position, piece_alignment)
    if start > position:
        metadata.append((position, bytes(start - position)))
    return start


def _shifted(slot: ChecksumSlot, start: int) -> ChecksumSlot:
    return replace(
        slot, data_offset=start + slot.data_offset, crc_fields=tuple(start + field for field in slot.crc_fields)
    )
