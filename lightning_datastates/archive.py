"""Read the structure of a torch checkpoint file (a zip archive of stored records) without loading it.

``read_archive_index(read_at, size)`` walks the end-of-central-directory record (zip64 included), the central
directory and each record's local header, and returns one :class:`ArchiveRecord` per record: where its bytes lie,
the CRC-32 the archive claims for them, and where that CRC-32 is stored (the central directory entry and, when
the record has one, its data descriptor). It reads only those structures, never a record's data.

One parser serves three readers: the layout planner (where the writer must put each record's checksum), the
integrity check on load, and the ``inspect`` command. Damage to any structure it reads raises
:class:`ArchiveFormatError` naming what is wrong.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

#: ``read_at(offset, nbytes)`` returns ``nbytes`` bytes (any bytes-like) of the file from ``offset``, fewer at its end.
ReadAt = Callable[[int, int], bytes | bytearray | memoryview]

_EOCD = struct.Struct("<IHHHHIIH")  # signature, disk, cd disk, entries on disk, entries, cd size, cd offset, comment
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # signature, disk, zip64 EOCD offset, disks
_ZIP64_EOCD = struct.Struct(
    "<IQHHIIQQQQ"
)  # signature, size, made by, needed, disk, cd disk, entries x2, cd size, offset
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_EOCD_SIGNATURE = 0x06054B50
_ZIP64_LOCATOR_SIGNATURE = 0x07064B50
_ZIP64_EOCD_SIGNATURE = 0x06064B50
_CENTRAL_SIGNATURE = 0x02014B50
_LOCAL_SIGNATURE = 0x04034B50
_DESCRIPTOR_SIGNATURE = 0x08074B50
_FLAG_DATA_DESCRIPTOR = 0x08
_FLAG_UTF8 = 0x800
_ZIP64_EXTRA_ID = 0x0001
_STORED = 0
#: Offset of the CRC-32 field inside a central directory entry.
CENTRAL_CRC_FIELD = 16
_MAX_COMMENT = 0xFFFF


class ArchiveFormatError(ValueError):
    """The file is not a readable zip archive (truncated, damaged, or not a checkpoint at all)."""


@dataclass(frozen=True)
class ArchiveRecord:
    """One record of the archive: ``nbytes`` stored bytes at ``data_offset``, claimed CRC-32 ``crc32``.

    ``crc_fields`` are the file offsets of every 4-byte field holding that CRC-32 (central directory entry first,
    then the data descriptor if any). ``descriptor_crc32`` is the value in the data descriptor (None without one).
    """

    name: str
    local_offset: int
    data_offset: int
    nbytes: int
    crc32: int
    crc_fields: tuple[int, ...]
    descriptor_crc32: int | None = None

    @property
    def short_name(self) -> str:
        """The name without the archive's top folder (``data/0``, ``data.pkl``), as torch calls records."""
        return self.name.split("/", 1)[1] if "/" in self.name else self.name

    @property
    def end(self) -> int:
        """Offset one past the record's last data byte."""
        return self.data_offset + self.nbytes


def read_archive_index(read_at: ReadAt, size: int) -> list[ArchiveRecord]:
    """Every record of the zip archive of ``size`` bytes read through ``read_at``, in central directory order.

    Raises:
        ArchiveFormatError: a structure is missing, truncated or inconsistent, or a record is compressed (torch
            writes stored records only).
    """
    cd_offset, cd_size, count = _central_directory_location(read_at, size)
    central = _read_exact(read_at, cd_offset, cd_size, "the central directory")
    records = []
    position = 0
    for _ in range(count):
        record, position = _central_entry(read_at, size, central, position, cd_offset)
        records.append(record)
    return records


def _central_directory_location(read_at: ReadAt, size: int) -> tuple[int, int, int]:
    """(offset, size, entry count) of the central directory, from the (zip64) end-of-central-directory record."""
    if size < _EOCD.size:
        raise ArchiveFormatError(f"{size} bytes is too short for a zip archive")
    tail_start = max(0, size - _EOCD.size - _MAX_COMMENT)
    tail = bytes(read_at(tail_start, size - tail_start))
    index = tail.rfind(struct.pack("<I", _EOCD_SIGNATURE))
    while index >= 0 and index + _EOCD.size + struct.unpack_from("<H", tail, index + 20)[0] != len(tail):
        index = tail.rfind(struct.pack("<I", _EOCD_SIGNATURE), 0, index)  # the signature inside a comment
    if index < 0:
        raise ArchiveFormatError("no end-of-central-directory record: the file is truncated or not a zip archive")
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, index)
    eocd_offset = tail_start + index
    if eocd_offset >= _ZIP64_LOCATOR.size:
        locator = _read_exact(read_at, eocd_offset - _ZIP64_LOCATOR.size, _ZIP64_LOCATOR.size, "the zip64 locator")
        signature, _, zip64_offset, _ = _ZIP64_LOCATOR.unpack(locator)
        if signature == _ZIP64_LOCATOR_SIGNATURE:
            record = _read_exact(read_at, zip64_offset, _ZIP64_EOCD.size, "the zip64 end-of-central-directory record")
            fields = _ZIP64_EOCD.unpack(record)
            if fields[0] != _ZIP64_EOCD_SIGNATURE:
                raise ArchiveFormatError(f"no zip64 end-of-central-directory record at byte {zip64_offset}")
            count, cd_size, cd_offset = fields[7], fields[8], fields[9]
    if cd_offset + cd_size > size:
        raise ArchiveFormatError(f"the central directory ({cd_size} bytes at {cd_offset}) ends past the file's end")
    return cd_offset, cd_size, count


def _central_entry(
    read_at: ReadAt, size: int, central: bytes, position: int, cd_offset: int
) -> tuple[ArchiveRecord, int]:
    if position + _CENTRAL.size > len(central):
        raise ArchiveFormatError(f"central directory entry at byte {cd_offset + position} is truncated")
    fields = _CENTRAL.unpack_from(central, position)
    signature, flags, method, crc32 = fields[0], fields[3], fields[4], fields[7]
    compressed, uncompressed, name_len, extra_len, comment_len = (
        fields[8],
        fields[9],
        fields[10],
        fields[11],
        fields[12],
    )
    local_offset = fields[16]
    if signature != _CENTRAL_SIGNATURE:
        raise ArchiveFormatError(f"no central directory entry at byte {cd_offset + position}")
    start = position + _CENTRAL.size
    raw_name = central[start : start + name_len]
    extra = central[start + name_len : start + name_len + extra_len]
    name = raw_name.decode("utf-8" if flags & _FLAG_UTF8 else "cp437", errors="replace")
    uncompressed, compressed, local_offset = _apply_zip64(extra, uncompressed, compressed, local_offset, name)
    if method != _STORED or compressed != uncompressed:
        raise ArchiveFormatError(f"record {name!r} is compressed; torch checkpoints store records uncompressed")
    # One read for the fixed header and the name, assuming the local name is as long as the central one (checked).
    header = _read_exact(read_at, local_offset, _LOCAL.size + name_len, "the local header of record", name)
    local = _LOCAL.unpack_from(header)
    if local[0] != _LOCAL_SIGNATURE:
        raise ArchiveFormatError(f"no local header for record {name!r} at byte {local_offset}")
    local_name = header[_LOCAL.size :] if local[9] == name_len else header[_LOCAL.size : _LOCAL.size + local[9]]
    if local_name != raw_name:
        raise ArchiveFormatError(f"record {name!r}: its local header names it {local_name!r}")
    data_offset = local_offset + _LOCAL.size + local[9] + local[10]
    if data_offset + compressed > size:
        raise ArchiveFormatError(f"record {name!r} ({compressed} bytes at {data_offset}) ends past the file's end")
    crc_fields = [cd_offset + position + CENTRAL_CRC_FIELD]
    descriptor_crc32 = None
    if flags & _FLAG_DATA_DESCRIPTOR:
        descriptor = data_offset + compressed
        head = _read_exact(read_at, descriptor, 8, "the data descriptor of record", name)
        if struct.unpack_from("<I", head)[0] == _DESCRIPTOR_SIGNATURE:
            descriptor += 4
            head = head[4:]
        crc_fields.append(descriptor)
        descriptor_crc32 = struct.unpack_from("<I", head)[0]
    record = ArchiveRecord(name, local_offset, data_offset, compressed, crc32, tuple(crc_fields), descriptor_crc32)
    return record, start + name_len + extra_len + comment_len


def _apply_zip64(extra: bytes, uncompressed: int, compressed: int, offset: int, name: str) -> tuple[int, int, int]:
    """Sizes and local header offset, taking the 64-bit values from the zip64 extra field where the 32-bit
    fields say so (``0xFFFFFFFF``)."""
    if 0xFFFFFFFF not in (uncompressed, compressed, offset):
        return uncompressed, compressed, offset
    position = 0
    while position + 4 <= len(extra):
        header_id, length = struct.unpack_from("<HH", extra, position)
        if header_id == _ZIP64_EXTRA_ID:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, position + 4))
            try:
                if uncompressed == 0xFFFFFFFF:
                    uncompressed = values.pop(0)
                if compressed == 0xFFFFFFFF:
                    compressed = values.pop(0)
                if offset == 0xFFFFFFFF:
                    offset = values.pop(0)
            except IndexError:
                break
            return uncompressed, compressed, offset
        position += 4 + length
    raise ArchiveFormatError(f"record {name!r}: its zip64 sizes or offset are missing")


def _read_exact(read_at: ReadAt, offset: int, nbytes: int, what: str, name: str | None = None) -> bytes:
    data = read_at(offset, nbytes)
    if len(data) != nbytes:
        what = what if name is None else f"{what} {name!r}"  # formatted only on failure: this runs per record
        raise ArchiveFormatError(f"{what} ({nbytes} bytes at {offset}) is cut off by the end of the file")
    return data if isinstance(data, bytes) else bytes(data)
