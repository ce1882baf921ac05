"""Verify a checkpoint file against the CRC-32 its archive records for every record, before torch reads it.

Every record (the pickled skeleton ``data.pkl``, each storage ``data/N``, ``byteorder``, ``version``, ...) is read
where torch will read it and checksummed; a mismatch, or damage to the archive's structure, raises
:class:`~lightning_datastates.errors.CheckpointCorruptError` naming the file and the record. Records are cut into
pieces checksummed in parallel threads (:func:`~lightning_datastates.records.checksums.crc32` releases the GIL) and the
pieces' CRC-32s combined.

A non-empty record whose recorded CRC-32 is 0 carries no checksum (``torch.save`` with its CRC option off, or
lightning-datastates 0.1): it is reported as unchecked, not as damaged.
"""

from __future__ import annotations

import mmap
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from lightning_datastates.archive import ArchiveFormatError, ArchiveRecord, read_archive_index
from lightning_datastates.errors import CheckpointCorruptError
from lightning_datastates.records.checksums import combine_pieces, crc32

#: Bytes checksummed per task: large enough that scheduling costs nothing, small enough to spread over threads.
PIECE_BYTES = 32 * 1024**2
#: Most threads one verification uses.
MAX_WORKERS = 8


#: The first bytes of a file in torch's legacy format (``torch.save(..., _use_new_zipfile_serialization=False)``): its
#: magic number, pickled. Such a file is no zip archive and carries no CRC-32.
LEGACY_MAGIC = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)


@dataclass(frozen=True)
class IntegrityReport:
    """What a verification covered: ``verified`` of ``records`` records (``verified_bytes`` bytes) matched their
    CRC-32; ``unchecked`` names the non-empty records that carry no CRC-32. ``legacy_format``: the file is in torch's
    legacy (non-zip) format, which has no records and no CRC-32 at all (nothing was verified)."""

    path: str
    records: int
    verified: int
    verified_bytes: int
    unchecked: tuple[str, ...]
    legacy_format: bool = False

    @property
    def complete(self) -> bool:
        """Whether every record was verified."""
        return not self.unchecked and not self.legacy_format


def verify_file(path: str) -> IntegrityReport:
    """Verify the local file at ``path`` (mapped, not read into memory).

    Raises:
        CheckpointCorruptError: a record does not match its CRC-32, or the archive is damaged.
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as file:
        return verify_open_file(file, path)


def verify_open_file(file: Any, path: str) -> IntegrityReport:
    """Verify the open local ``file`` (a real file with a descriptor); ``path`` names it in errors."""
    size = os.fstat(file.fileno()).st_size
    if size == 0:
        raise CheckpointCorruptError(f"{path} is empty: not a checkpoint (the file was truncated)", path)
    mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return verify_buffer(mapped, path)
    finally:
        mapped.close()


def verify_buffer(data: Any, path: str) -> IntegrityReport:
    """Verify a whole checkpoint held in ``data`` (bytes, bytearray, mmap or memoryview); ``path`` names it.

    Raises:
        CheckpointCorruptError: a record does not match its CRC-32, or the archive is damaged.
    """
    view = memoryview(data).cast("B")
    try:
        if view[: len(LEGACY_MAGIC)] == LEGACY_MAGIC:
            return IntegrityReport(path, 0, 0, 0, (), legacy_format=True)  # no zip archive: nothing to verify
        try:
            records = read_archive_index(lambda offset, nbytes: view[offset : offset + nbytes], view.nbytes)
        except ArchiveFormatError as exc:
            raise CheckpointCorruptError(f"{path} is damaged: {exc}", path) from exc
        for record in records:
            if not record.crc32 and record.descriptor_crc32:
                # A file written without CRC-32s has none anywhere; one field zeroed must not turn the record (and
                # any damage to it) into an unchecked one.
                raise CheckpointCorruptError(
                    f"{path} is damaged: record {record.short_name}'s central directory entry carries no CRC-32, "
                    f"its data descriptor {record.descriptor_crc32:08x}",
                    path,
                    record.short_name,
                )
        checked = [r for r in records if r.crc32 or not r.nbytes]
        actual = _checksums(view, checked)
        for record, crc in zip(checked, actual, strict=True):
            if crc != record.crc32:
                raise CheckpointCorruptError(_mismatch(path, record, crc), path, record.short_name)
            if record.descriptor_crc32 is not None and record.descriptor_crc32 != record.crc32:
                raise CheckpointCorruptError(
                    f"{path} is damaged: record {record.short_name}'s data descriptor records CRC-32 "
                    f"{record.descriptor_crc32:08x}, its central directory entry {record.crc32:08x}",
                    path,
                    record.short_name,
                )
        unchecked = tuple(r.short_name for r in records if r.nbytes and not r.crc32)
        return IntegrityReport(path, len(records), len(checked), sum(r.nbytes for r in checked), unchecked)
    finally:
        view.release()


def _mismatch(path: str, record: ArchiveRecord, crc: int) -> str:
    return (
        f"{path} is damaged: record {record.short_name} ({record.nbytes} bytes at byte {record.data_offset}) has "
        f"CRC-32 {crc:08x} but the archive recorded {record.crc32:08x}. The file changed after it was written "
        "(a disk, network or copy fault): load an earlier checkpoint. (DataStatesIO(verify_checksums=False) "
        "skips this check, and would load the damaged bytes.)"
    )


def _checksums(view: memoryview, records: list[ArchiveRecord]) -> list[int]:
    """CRC-32 of each record's bytes in ``view``, computed piecewise in parallel."""
    tasks: list[list[tuple[int, int, int]]] = [[]]  # per task: (record index, offset, nbytes)
    filled = 0
    for index, record in enumerate(records):
        for start in range(record.data_offset, record.end, PIECE_BYTES):
            nbytes = min(PIECE_BYTES, record.end - start)
            if filled + nbytes > PIECE_BYTES and tasks[-1]:
                tasks.append([])
                filled = 0
            tasks[-1].append((index, start, nbytes))
            filled += nbytes

    def run(task: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
        return [(index, start, nbytes, crc32(view[start : start + nbytes])) for index, start, nbytes in task]

    workers = min(MAX_WORKERS, os.cpu_count() or 1, len(tasks))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="datastates-verify") as pool:
            results = list(pool.map(run, tasks))
    else:
        results = [run(task) for task in tasks]
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in records]
    for result in results:
        for index, start, nbytes, crc in result:
            pieces[index].append((start, nbytes, crc))
    return [combine_pieces(p) for p in pieces]
