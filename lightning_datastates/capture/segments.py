"""The metadata of a planned archive as ``(file_offset, bytes)`` segments, and what the planner does with them.

Cut byte ranges out (the CRC-32 fields the writer fills, the volatile bytes of a structure), replace bytes in place (a
new ``data.pkl`` spliced into an archive planned before), join adjacent segments, and fill the CRC-32 of the records
that lie wholly in the metadata (:func:`with_metadata_checksums`). Pure; a plan these checks refuse raises
:class:`LayoutUnsupported` (see :mod:`~lightning_datastates.capture.layout`).
"""

from __future__ import annotations

import bisect
import struct
import zlib
from collections.abc import Iterable
from dataclasses import replace

from lightning_datastates.records.layout import CheckpointLayout, ChecksumSlot


class LayoutUnsupported(Exception):
    """The out-of-order layout cannot be trusted for this checkpoint; write it with a plain ``torch.save``."""


def with_metadata_checksums(layout: CheckpointLayout) -> CheckpointLayout:
    """``layout`` with the CRC-32 of every record that lies wholly in its metadata (an archive's ``data.pkl``,
    ``byteorder``, ``version``, ...) put into the metadata now, and adjacent segments joined (pure).

    Why: those records' bytes are in the plan already, and their CRC-32 fields, left open for the writer, cut the
    metadata into many small segments, each its own write request. A shard file of a sharded save holds one archive
    per tensor, five such records each: planned this way the writer's requests for it fall by about four fifths, and
    only the payload records' fields are left to fill. Only for layouts whose metadata stays as planned: a plan that
    later splices a new ``data.pkl`` into a kept layout (single-file checkpoints,
    :class:`~lightning_datastates.capture.verified.VerifiedStructures`) would leave its CRC-32 stale.
    """
    segments = sorted(layout.metadata)
    starts = [offset for offset, _ in segments]
    filled: list[tuple[int, bytes]] = []
    open_slots: list[ChecksumSlot] = []
    for slot in layout.checksums:
        data = _metadata_bytes(segments, starts, slot.data_offset, slot.nbytes)
        if data is None:
            open_slots.append(slot)  # payload: the writer checksums it
            continue
        crc = struct.pack("<I", zlib.crc32(data))
        filled.extend((field, crc) for field in slot.crc_fields)
    return replace(layout, metadata=joined_segments([*segments, *filled]), checksums=tuple(open_slots))


def joined_segments(segments: Iterable[tuple[int, bytes]]) -> tuple[tuple[int, bytes], ...]:
    """``(offset, bytes)`` segments sorted, each run of adjacent ones joined into one (pure).

    Raises:
        ValueError: two segments overlap.
    """
    runs: list[tuple[int, list[bytes], int]] = []  # (start, parts, end)
    for offset, data in sorted(segments):
        if not data:
            continue
        if runs and offset < runs[-1][2]:
            raise ValueError(f"metadata segments overlap at byte {offset}")
        if runs and offset == runs[-1][2]:
            start, parts, end = runs[-1]
            parts.append(data)
            runs[-1] = (start, parts, end + len(data))
        else:
            runs.append((offset, [data], offset + len(data)))
    return tuple((start, parts[0] if len(parts) == 1 else b"".join(parts)) for start, parts, _ in runs)


def _metadata_bytes(segments: list[tuple[int, bytes]], starts: list[int], offset: int, nbytes: int) -> bytes | None:
    """The ``nbytes`` bytes from ``offset`` if adjacent ``segments`` (sorted; ``starts`` their offsets) hold all of
    them, else None."""
    index = bisect.bisect_right(starts, offset) - 1
    parts: list[bytes] = []
    position, end = offset, offset + nbytes
    while position < end:
        if index < 0 or index >= len(segments):
            return None
        start, data = segments[index]
        if not start <= position < start + len(data):
            return None
        parts.append(data[position - start : end - start])
        position = start + len(data)
        index += 1
    return b"".join(parts)


def cut_ranges(segments: Iterable[tuple[int, bytes]], ranges: list[tuple[int, int]]) -> tuple[tuple[int, bytes], ...]:
    """``segments`` with the ``(offset, nbytes)`` ranges cut out; each range lies inside one segment.

    Raises:
        LayoutUnsupported: a range straddles a segment's end, overlaps another, or lies outside every segment.
    """
    ranges = sorted(r for r in ranges if r[1])
    starts = [start for start, _ in ranges]
    cut = 0
    result: list[tuple[int, bytes]] = []
    for offset, data in segments:
        position, end = offset, offset + len(data)
        index = bisect.bisect_left(starts, offset)
        if index and ranges[index - 1][0] + ranges[index - 1][1] > offset:
            index -= 1  # a range that starts before this segment and reaches into it
        while index < len(ranges) and ranges[index][0] < end:
            start, nbytes = ranges[index]
            if start < position or start + nbytes > end:
                raise LayoutUnsupported(f"bytes {start} to {start + nbytes} straddle a metadata segment")
            if start > position:
                result.append((position, data[position - offset : start - offset]))
            position = start + nbytes
            index += 1
            cut += 1
        if position < end:
            result.append((position, data[position - offset :]))
    if cut != len(ranges):
        raise LayoutUnsupported(f"{len(ranges) - cut} of the byte ranges to cut lie outside the metadata segments")
    return tuple(result)


def replace_range(segments: tuple[tuple[int, bytes], ...], offset: int, data: bytes) -> tuple[tuple[int, bytes], ...]:
    """``segments`` with the bytes from ``offset`` replaced by ``data`` (same length, inside one segment).

    Raises:
        LayoutUnsupported: the range is not inside one segment.
    """
    index = bisect.bisect_right([start for start, _ in segments], offset) - 1
    start, old = segments[index] if index >= 0 else (0, b"")
    at = offset - start
    if index < 0 or at + len(data) > len(old):
        raise LayoutUnsupported(f"bytes {offset} to {offset + len(data)} are not inside one metadata segment")
    return (*segments[:index], (start, old[:at] + data + old[at + len(data) :]), *segments[index + 1 :])
