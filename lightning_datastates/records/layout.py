"""The byte layout of a checkpoint file: what capture plans and every later stage reads.

:class:`CheckpointLayout` is the whole file: its metadata segments, one :class:`StorageRecord` per storage (where its
bytes go) and one :class:`ChecksumSlot` per record whose CRC-32 the writer fills. Planned by
:mod:`~lightning_datastates.capture.layout`; chunked by :mod:`~lightning_datastates.records.chunks`, checksummed by
:mod:`~lightning_datastates.records.checksums`, shared between checkpoints by :mod:`~lightning_datastates.copy.sharing`.
Pure records.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_datastates.records.stamp import SaveStamp, stamp_end_record

#: Bytes of a CRC-32 field.
CRC_FIELD_BYTES = 4


@dataclass(frozen=True)
class StorageRecord:
    """Where one storage's bytes go in the file.

    ``key`` is torch's record name suffix (``data/<key>``); ``offset`` and ``nbytes`` locate the payload.
    """

    key: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ChecksumSlot:
    """A record whose CRC-32 the writer computes: ``nbytes`` bytes at ``data_offset``; the CRC-32 goes into the
    4-byte fields at ``crc_fields``. ``name`` is the record's name in the archive (for error messages)."""

    name: str
    data_offset: int
    nbytes: int
    crc_fields: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointLayout:
    """The complete byte layout of a checkpoint file.

    ``metadata`` holds every byte that is neither a payload nor a CRC-32 field as ``(file_offset, bytes)``
    segments; ``records`` holds one entry per storage in key order (zero-size storages included, with
    ``nbytes == 0``); ``checksums`` says which CRC-32 fields the writer fills, from which bytes; ``total_bytes``
    is the file size.
    """

    metadata: tuple[tuple[int, bytes], ...]
    records: tuple[StorageRecord, ...]
    total_bytes: int
    checksums: tuple[ChecksumSlot, ...] = ()

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data in the file."""
        return sum(r.nbytes for r in self.records)

    def stamped(self, stamp: SaveStamp) -> CheckpointLayout:
        """This layout with ``stamp`` as the archive's comment (:mod:`~lightning_datastates.records.stamp`): the end
        record's comment length set and the comment appended, the file that much longer; this layout itself where its
        last metadata segment is not the file's comment-less end record (then the file carries no stamp)."""
        if not self.metadata:
            return self
        offset, data = self.metadata[-1]
        end = stamp_end_record(data, stamp)
        if end is None or offset + len(data) != self.total_bytes:
            return self
        metadata = (*self.metadata[:-1], (offset, end))
        return replace(self, metadata=metadata, total_bytes=offset + len(end))
