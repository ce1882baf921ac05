"""Archive structures that passed the layout planner's self-check, and the archives later plans splice into.

:class:`VerifiedStructures` is :func:`~lightning_datastates.capture.layout.plan_layout`'s cache: a plan whose
structure equals a verified one skips the self-check and the archive index, and an archive kept here takes a new
``data.pkl`` in place of torch's zip writer (see the module docstring of :mod:`~lightning_datastates.capture.layout`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from lightning_datastates.capture.segments import cut_ranges, replace_range
from lightning_datastates.records.layout import CRC_FIELD_BYTES, CheckpointLayout, ChecksumSlot


class VerifiedStructures:
    """Archive structures that passed :func:`plan_layout`'s self-check, most recent first (a few: the structures
    one training run alternates between); the archives planned from them that later plans splice into; and whether
    the fast path (:mod:`~lightning_datastates.capture.skeleton`) matched ``torch.save`` here.

    A structure is the file size, the holes, where each metadata segment lies, and every metadata byte except the
    payloads of records that are not storages (``data.pkl``, ``version``, the serialization id, ...) and their CRC-32
    fields. torch's zip reader finds each record through the headers and the central directory, all of which are in
    those bytes (it also reads the ``version`` records, whose content says nothing about where records lie), so a
    plan whose structure equals a verified one places every record where that one did: its check would pass, and
    its checksum slots are the same. Thread-safe.
    """

    def __init__(self, capacity: int = 4, fast_path: bool = True) -> None:
        self._capacity = capacity
        #: Whether :func:`plan_layout` may take the fast path with this cache (off: only to measure torch's plan).
        self.fast_path = fast_path
        self._entries: collections.OrderedDict[tuple[Any, ...], tuple[bytes, tuple[ChecksumSlot, ...]]]
        self._entries = collections.OrderedDict()
        # Archives to splice into, by template key: the layout, where its data.pkl starts, and its structure's key
        # in _entries (a template lives as long as its structure, dropped with it in add(): one order of use, one
        # capacity).
        self._templates: dict[tuple[Any, ...], tuple[CheckpointLayout, int, tuple[Any, ...]]] = {}
        self._lock = threading.Lock()
        #: Plans that found their structure here (for tests and diagnostics), and how many of them were spliced.
        self.hits = 0
        self.spliced = 0
        #: The fast path's first archive was compared with ``torch.save``'s and was the same.
        self.confirmed = False
        #: Why the fast path's archive differed from ``torch.save``'s (it is not taken again); None if it did not.
        self.refused: str | None = None

    @property
    def fast_path_open(self) -> bool:
        """Whether :func:`plan_layout` takes the fast path with this cache: allowed, and not refused."""
        return self.fast_path and self.refused is None

    def settle(self, difference: str | None) -> None:
        """Record the comparison of the fast path's archive with ``torch.save``'s (None: the same)."""
        with self._lock:
            self.confirmed, self.refused = difference is None, difference

    def splice(self, key: tuple[Any, ...], data_pkl: bytes) -> CheckpointLayout | None:
        """The archive kept under ``key`` (see :func:`~lightning_datastates.capture.layout._template_key`) with
        ``data_pkl`` in place of its ``data.pkl``; None if none is kept."""
        with self._lock:
            entry = self._templates.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(entry[2], last=False)
            self.hits += 1
            self.spliced += 1
        layout, data_offset, _ = entry
        return replace(layout, metadata=replace_range(layout.metadata, data_offset, data_pkl))

    def keep_template(self, key: tuple[Any, ...], layout: CheckpointLayout, structure: tuple[Any, ...]) -> None:
        """Keep ``layout`` (planned from a ``data.pkl`` and storages of ``key``, of the verified structure whose
        :func:`structure_key` is ``structure``) for later plans to splice into, while that structure is kept."""
        data_offset = next((slot.data_offset for slot in layout.checksums if slot.name.endswith("/data.pkl")), None)
        with self._lock:
            if data_offset is not None and structure in self._entries:
                self._templates[key] = (layout, data_offset, structure)

    def find(
        self, segments: tuple[tuple[int, bytes], ...], holes: list[tuple[int, int]], size: int
    ) -> tuple[ChecksumSlot, ...] | None:
        """The checksum slots of the verified structure equal to this plan's; None if there is none."""
        key = structure_key(segments, holes, size)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key, last=False)
        if entry is None:
            return None
        structure, slots = entry
        if _structural_bytes(segments, slots, holes) != structure:
            return None
        with self._lock:
            self.hits += 1
        return slots

    def add(
        self,
        segments: tuple[tuple[int, bytes], ...],
        holes: list[tuple[int, int]],
        size: int,
        slots: tuple[ChecksumSlot, ...],
    ) -> None:
        """Remember a structure that passed the self-check, with its checksum slots."""
        key, entry = structure_key(segments, holes, size), (_structural_bytes(segments, slots, holes), slots)
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key, last=False)
            while len(self._entries) > self._capacity:
                evicted, _ = self._entries.popitem()
                # A template lives as long as its structure.
                for stale in [k for k, template in self._templates.items() if template[2] == evicted]:
                    del self._templates[stale]


def structure_key(
    segments: Iterable[tuple[int, bytes | bytearray]], holes: list[tuple[int, int]], size: int
) -> tuple[Any, ...]:
    """Where everything lies: the file size, the holes and each metadata segment's span (cheap to compare)."""
    return size, tuple(holes), tuple((offset, len(data)) for offset, data in segments)


def _structural_bytes(
    segments: tuple[tuple[int, bytes], ...], slots: tuple[ChecksumSlot, ...], holes: list[tuple[int, int]]
) -> bytes:
    """The metadata bytes without the payloads and CRC-32 fields of the records that are not storages: the bytes
    that may differ between saves of one structure. (The storages' CRC-32 fields, which torch leaves as
    placeholders under ``skip_data``, stay in: comparing more bytes than needed only costs a check.)"""
    storage_payloads = set(holes)
    volatile = [
        (start, nbytes)
        for slot in slots
        if (slot.data_offset, slot.nbytes) not in storage_payloads
        for start, nbytes in ((slot.data_offset, slot.nbytes), *((field, CRC_FIELD_BYTES) for field in slot.crc_fields))
    ]
    return b"".join(data for _, data in cut_ranges(segments, volatile))
