"""Plan the byte layout of a ``torch.save``-compatible checkpoint file without touching tensor data.

``plan_layout(checkpoint)`` runs ``torch.save`` under :func:`torch.serialization.skip_data` into a small
in-memory sink. torch then writes every byte of the zip archive except the storage payloads, and seeks over
the space each payload takes (a "hole"). The result is a
:class:`~lightning_datastates.records.layout.CheckpointLayout`: the metadata bytes with their file offsets
(``data.pkl`` is among them, so the non-tensor part of the checkpoint is snapshotted here, at once), and one
:class:`~lightning_datastates.records.layout.StorageRecord` per storage with the offset where its bytes belong.
Writing the metadata and then every storage's bytes at its offset, in any order, yields the same file ``torch.save``
would have written, loadable by plain ``torch.load``.

``skip_data`` is a prototype API and the hole/record correspondence relies on torch's zip writer, so every
plan is self-checked against torch's own zip reader (:func:`_check_layout`); when the check fails,
:class:`~lightning_datastates.capture.segments.LayoutUnsupported` tells the caller to fall back to a plain
``torch.save``, whose bytes :func:`plan_serialized_layout` turns into a layout as well.

Saves during training repeat the same structure (the same storages in the same order, a ``data.pkl`` of the same
length), so the plan differs only in content, never in where anything lies.
:class:`~lightning_datastates.capture.verified.VerifiedStructures` remembers the structures already checked; a plan
whose structural bytes (every byte except the payloads of the records that are not storages, such as ``data.pkl``, and
their CRC-32 fields) equal one of them skips the self-check and the archive index.

The fast path (:func:`plan_layout`, with a :class:`VerifiedStructures`): most of ``torch.save``'s time is its Python
pickling of each tensor, so :mod:`~lightning_datastates.capture.skeleton` pickles ``data.pkl`` as torch would, in a
fraction of the time, and the archive around it comes from torch's own zip writer, or, for a ``data.pkl`` of a length
seen before with the same storage sizes, from an earlier plan with the new ``data.pkl`` spliced in. The first such
archive is compared byte for byte with ``torch.save``'s; a difference turns the fast path off.

Checksums: under ``skip_data`` torch cannot know the payloads' CRC-32s, so the layout leaves every non-empty
record's CRC-32 fields (central directory entry and data descriptor) out of the metadata and lists them as
:class:`~lightning_datastates.records.layout.ChecksumSlot` s; the writer computes and fills them
(:mod:`~lightning_datastates.records.checksums`). Metadata, payloads and CRC fields tile the file exactly. The byte
arithmetic on the metadata segments is :mod:`~lightning_datastates.capture.segments`'s.

This module is pure: no threads, no files, no devices beyond reading tensor metadata.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator
from typing import Any

import torch

from lightning_datastates.archive import ArchiveFormatError, read_archive_index
from lightning_datastates.capture.segments import LayoutUnsupported, cut_ranges
from lightning_datastates.capture.skeleton import PickledSkeleton, pickle_skeleton
from lightning_datastates.capture.verified import VerifiedStructures, structure_key
from lightning_datastates.compat.torch import (
    TorchArchiveReader,
    current_storage_alignment,
    open_archive_writer,
    recording_pickle_module,
    records_after_pickle,
    save_storage_alignment,
    skip_data,
    storage_identity,
)
from lightning_datastates.records.layout import CRC_FIELD_BYTES, CheckpointLayout, ChecksumSlot, StorageRecord
from lightning_datastates.streams import SegmentReader


@contextlib.contextmanager
def storage_alignment(alignment: int | None) -> Iterator[None]:
    """Within the block, ``torch.save`` starts every storage's data at a multiple of ``alignment`` bytes (None:
    torch's setting as it is, 64 by default).

    torch keeps this setting process-wide (:func:`~lightning_datastates.compat.torch.save_storage_alignment`), so a
    ``torch.save`` another thread runs at the same moment is padded the same way (its file stays valid). The block
    is short (pickling the skeleton) and holds a lock, so two plans never restore each other's value.
    """
    if alignment is None:
        yield
        return
    with _ALIGNMENT_LOCK, save_storage_alignment(alignment):
        yield


_ALIGNMENT_LOCK = threading.Lock()


def plan_layout(
    checkpoint: Any, alignment: int | None = None, verified: VerifiedStructures | None = None
) -> tuple[CheckpointLayout, list[torch.UntypedStorage]]:
    """Plan the file layout of ``torch.save(checkpoint)``; return it with the storages, indexed by record key.

    With ``alignment``, every storage's data starts at a file offset that is a multiple of it (see
    :func:`storage_alignment`). With ``verified``, a plan of a structure checked before skips the self-check (and
    a new structure is remembered there once checked), and the fast path below is taken.

    The archive comes from one of three sources, fastest first:

    1. with ``verified``, the checkpoint's ``data.pkl`` pickled by :mod:`~lightning_datastates.capture.skeleton`
       (torch's pickling, reproduced) and spliced into an archive planned before for a ``data.pkl`` of the same
       length and the same storage sizes (:meth:`VerifiedStructures.splice`): torch's zip writer places every record
       by names and lengths alone, so only ``data.pkl``'s bytes differ (and torch's serialization id, a fingerprint it
       only logs on load, stays the one of the earlier archive);
    2. that ``data.pkl`` written with its storages' records by torch's own zip writer, in ``torch.save``'s record
       order; the first time per ``verified``, also planned by ``torch.save`` itself and compared byte for byte (a
       difference turns the fast path off for good, :attr:`VerifiedStructures.refused`);
    3. ``torch.save`` itself under ``skip_data``: without ``verified``, for checkpoints the fast path does not
       reproduce (:class:`~lightning_datastates.capture.skeleton.SkeletonUnsupported`), and after a refusal. torch's
       own ``persistent_id`` names each storage's record key, and a pickler base class
       (:func:`~lightning_datastates.compat.torch.recording_pickle_module`) writes down which storage got which key.

    Pickling errors propagate as ``torch.save`` raises them (the caller decides what they mean).

    Raises:
        LayoutUnsupported: torch refused ``skip_data`` for this checkpoint (quantized tensors, storage-less
            backends), or the plan failed its self-check.
    """
    skeleton = _pickle_or_none(checkpoint) if verified is not None and verified.fast_path_open else None
    if skeleton is None:
        sink, storages = _archive_by_torch(checkpoint, alignment)
        return _layout_of_archive(sink, storages, alignment, verified), storages
    assert verified is not None  # a skeleton is pickled only with a cache to splice into
    template = _template_key(skeleton, alignment)
    spliced = verified.splice(template, skeleton.data)
    if spliced is not None:
        return spliced, skeleton.storages
    sink, storages = _archive_of_skeleton(skeleton, alignment), skeleton.storages
    if not verified.confirmed:
        reference, reference_storages = _archive_by_torch(checkpoint, alignment)
        difference = _archive_difference(sink, storages, reference, reference_storages)
        verified.settle(difference)
        if difference is not None:
            return _layout_of_archive(reference, reference_storages, alignment, verified), reference_storages
    layout = _layout_of_archive(sink, storages, alignment, verified)
    verified.keep_template(template, layout, sink.structure())
    return layout, storages


def _pickle_or_none(checkpoint: Any) -> PickledSkeleton | None:
    """The checkpoint's ``data.pkl`` by the fast path; None when it does not reproduce the checkpoint, or pickling
    fails (``torch.save`` then raises the error as it is)."""
    try:
        return pickle_skeleton(checkpoint)
    except Exception:  # noqa: BLE001 - SkeletonUnsupported, or an object that cannot be pickled: torch decides
        return None


def _archive_by_torch(checkpoint: Any, alignment: int | None) -> tuple[_LayoutSink, list[torch.UntypedStorage]]:
    """The archive ``torch.save`` writes under ``skip_data``, and its storages by record key."""
    sink = _LayoutSink()
    storages_by_key: dict[int, torch.UntypedStorage] = {}
    with skip_data(), storage_alignment(alignment):
        # torch.save needs only write() and flush() of its target.
        torch.save(checkpoint, sink, pickle_module=recording_pickle_module(storages_by_key))  # type: ignore[arg-type]
    return sink, [storages_by_key[key] for key in range(len(storages_by_key))]


def _archive_of_skeleton(skeleton: PickledSkeleton, alignment: int | None) -> _LayoutSink:
    """The archive torch's zip writer makes of ``skeleton``, its records in ``torch.save``'s order, the storages'
    data skipped (as under ``skip_data``)."""
    sink = _LayoutSink()
    with storage_alignment(alignment), open_archive_writer(sink) as archive:
        archive.write_record("data.pkl", skeleton.data, len(skeleton.data))
        for name, content in records_after_pickle():
            archive.write_record(name, content, len(content))
        for key, storage in enumerate(skeleton.storages):
            archive.write_record_metadata(f"data/{key}", storage.nbytes())
    return sink


def _archive_difference(
    sink: _LayoutSink,
    storages: list[torch.UntypedStorage],
    reference: _LayoutSink,
    reference_storages: list[torch.UntypedStorage],
) -> str | None:
    """How the fast path's archive differs from ``torch.save``'s; None when they are the same bytes, the same holes
    and the same storages under the same keys."""
    if [storage_identity(s) for s in storages] != [storage_identity(s) for s in reference_storages]:
        return f"{len(storages)} storages numbered otherwise than torch's {len(reference_storages)}"
    if (sink.holes, sink.size) != (reference.holes, reference.size):
        return f"an archive of {sink.size} bytes where torch's has {reference.size}, or its holes elsewhere"
    ours, torchs = sink.segments, reference.segments
    if ours != torchs:
        at = next((o for (o, a), (_, b) in zip(ours, torchs, strict=False) if a != b), min(len(ours), len(torchs)))
        return f"bytes that differ from torch's from the metadata segment at {at}"
    return None


def _template_key(skeleton: PickledSkeleton, alignment: int | None) -> tuple[Any, ...]:
    """What torch's zip writer places records by: the length of ``data.pkl``, every storage's size (the names and
    the other records follow from them) and the storage alignment."""
    effective = current_storage_alignment() if alignment is None else alignment
    return len(skeleton.data), tuple(storage.nbytes() for storage in skeleton.storages), effective


def _layout_of_archive(
    sink: _LayoutSink, storages: list[torch.UntypedStorage], alignment: int | None, verified: VerifiedStructures | None
) -> CheckpointLayout:
    """The layout of the archive in ``sink`` (its storages by record key): self-checked, unless ``verified`` holds
    its structure."""
    records = _match_records(sink.holes, storages)
    if alignment is not None and any(r.offset % alignment for r in records if r.nbytes):
        raise LayoutUnsupported(f"torch did not align the records to {alignment} bytes")
    segments = tuple(sink.segments)
    slots = None if verified is None else verified.find(segments, sink.holes, sink.size)
    if slots is None:
        _check_layout(CheckpointLayout(metadata=segments, records=records, total_bytes=sink.size))
        slots = _checksum_slots(SegmentReader(segments, sink.size).read_at, sink.size)
        holes = {(r.offset, r.nbytes) for r in records if r.nbytes}
        if not holes <= {(slot.data_offset, slot.nbytes) for slot in slots}:
            raise LayoutUnsupported("a storage's hole is not exactly one record of the archive")
        if verified is not None:
            verified.add(segments, sink.holes, sink.size, slots)
    return CheckpointLayout(_without_fields(segments, slots), records, sink.size, slots)


def plan_serialized_layout(data: bytes) -> CheckpointLayout:
    """The layout of a file already serialized (by a plain ``torch.save``): all of it is metadata, except the
    CRC-32 fields, which the writer recomputes (torch's CRC option is process-wide and may be off).

    Raises:
        LayoutUnsupported: ``data`` is not a readable zip archive.
    """
    view = memoryview(data)
    slots = _checksum_slots(lambda offset, nbytes: view[offset : offset + nbytes], len(data))
    return CheckpointLayout(_without_fields(((0, data),), slots), (), len(data), slots)


def _checksum_slots(read_at: Any, size: int) -> tuple[ChecksumSlot, ...]:
    """One slot per non-empty record of the archive (empty records keep their CRC-32 of 0 in the metadata)."""
    try:
        index = read_archive_index(read_at, size)
    except ArchiveFormatError as exc:
        raise LayoutUnsupported(f"the planned archive does not parse: {exc}") from exc
    return tuple(ChecksumSlot(r.name, r.data_offset, r.nbytes, r.crc_fields) for r in index if r.nbytes)


def _without_fields(
    segments: tuple[tuple[int, bytes], ...], slots: tuple[ChecksumSlot, ...]
) -> tuple[tuple[int, bytes], ...]:
    """``segments`` with the bytes of every CRC-32 field of ``slots`` cut out (those the writer fills)."""
    return cut_ranges(segments, [(field, CRC_FIELD_BYTES) for slot in slots for field in slot.crc_fields])


def _match_records(holes: list[tuple[int, int]], storages: list[torch.UntypedStorage]) -> tuple[StorageRecord, ...]:
    """Pair torch's holes (one per non-empty storage, in key order) with the recorded storages."""
    nonempty = [k for k, s in enumerate(storages) if s.nbytes() > 0]
    if len(nonempty) != len(holes):
        raise LayoutUnsupported(f"{len(holes)} holes for {len(nonempty)} non-empty storages")
    offsets: dict[int, int] = {}
    for key, (offset, length) in zip(nonempty, holes, strict=True):
        if length != storages[key].nbytes():
            raise LayoutUnsupported(f"hole of {length} bytes for storage {key} of {storages[key].nbytes()} bytes")
        offsets[key] = offset
    return tuple(StorageRecord(k, offsets.get(k, 0), s.nbytes()) for k, s in enumerate(storages))


def _check_layout(layout: CheckpointLayout) -> None:
    """Ask torch's own zip reader where each record's data starts and compare with the plan."""
    try:
        reader = TorchArchiveReader(SegmentReader(layout.metadata, layout.total_bytes))
        names = reader.record_names()
        for record in layout.records:
            name = f"data/{record.key}"
            if name not in names:
                raise LayoutUnsupported(f"record {name} missing from the planned archive")
            if record.nbytes and reader.record_offset(name) != record.offset:
                raise LayoutUnsupported(
                    f"record {name}: torch reads it at {reader.record_offset(name)}, planned at {record.offset}"
                )
    except LayoutUnsupported:
        raise
    except Exception as exc:
        raise LayoutUnsupported(f"the planned archive does not parse: {exc!r}") from exc


class _LayoutSink:
    """A seekable write-only file that records written bytes and the holes torch seeks over."""

    def __init__(self) -> None:
        self._segments: list[tuple[int, bytearray]] = []
        self.holes: list[tuple[int, int]] = []
        self.position = 0
        self.size = 0

    @property
    def segments(self) -> list[tuple[int, bytes]]:
        """The written bytes as ``(file_offset, bytes)``, contiguous writes coalesced (fewer, larger writes later);
        a copy each time: read it once, when torch is done."""
        return [(offset, bytes(data)) for offset, data in self._segments]

    def write(self, data: Any) -> int:
        chunk = memoryview(data).cast("B")
        last = self._segments[-1] if self._segments else None
        if last is not None and last[0] + len(last[1]) == self.position:
            last[1].extend(chunk)  # in place: torch writes each header in several small pieces
        else:
            self._segments.append((self.position, bytearray(chunk)))
        self.position += len(chunk)
        self.size = max(self.size, self.position)
        return len(chunk)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self.position + offset, io.SEEK_END: self.size + offset}[whence]
        if target > self.position and target > self.size:
            self.holes.append((self.position, target - self.position))  # torch skipped a storage's payload
        self.position = target
        self.size = max(self.size, self.position)
        return self.position

    def tell(self) -> int:
        return self.position

    def structure(self) -> tuple[Any, ...]:
        """The :func:`~lightning_datastates.capture.verified.structure_key` of the archive written so far (without
        copying its bytes)."""
        return structure_key(self._segments, self.holes, self.size)

    def flush(self) -> None:
        pass
