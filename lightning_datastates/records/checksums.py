"""CRC-32 checksums of a checkpoint's records, computed while the writer threads write them.

A checkpoint is a zip archive, and the zip format already carries a CRC-32 per record (in the central directory
and in each record's data descriptor); ``torch.save`` under ``skip_data`` cannot fill them for the payloads it never
sees. :class:`ChecksummingSession` wraps a storage write session: every range written is checksummed on the
writer thread that writes it (:func:`crc32` releases the GIL), pieces of one record arriving out of order from
several threads are joined with :func:`crc32_combine`, and the moment a record's last byte is written its CRC-32
goes into the fields the layout left open for it. The commit is refused if any record was not fully written.
Zip tools, Python's ``zipfile`` and :mod:`~lightning_datastates.load.integrity` then agree on every byte.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import struct
import threading
import zlib
from collections.abc import Callable
from typing import Any

from lightning_datastates.records.layout import ChecksumSlot
from lightning_datastates.records.session import WriteSession

_POLYNOMIAL = 0xEDB88320  # CRC-32 (zip, zlib), bit-reflected
#: Bytes checksummed and then written in one go: small enough to stay in the CPU cache in between.
WINDOW_BYTES = 1024**2


def _fastest_crc32() -> Callable[[Any, int], int]:
    # ISA-L's CRC-32 (the `isal` package, installed with this one where it has wheels) folds with carry-less
    # multiplication: 12.4 GB/s against zlib's 2.4 GB/s on this project's machine, on the core that training leaves
    # free. Same polynomial, same results; both release the GIL.
    try:
        from isal import isal_zlib
    except ImportError:
        return zlib.crc32
    return isal_zlib.crc32


_crc32_impl = _fastest_crc32()


def crc32(data: Any, value: int = 0) -> int:
    """CRC-32 (zip's, zlib's) of the bytes-like ``data``, continuing from ``value``; ISA-L's where installed."""
    return _crc32_impl(data, value)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len2 = len(b)``.

    Appending ``len2`` bytes multiplies the CRC register by ``x^(8*len2)`` modulo the CRC polynomial, so the
    combination is ``crc1 * x^(8*len2) mod P`` xor ``crc2``: arithmetic in GF(2)[x], in O(log len2) steps.
    """
    if len2 <= 0:
        return crc1
    return _multiply_mod_p(_x_power_bytes(len2), crc1) ^ crc2


def _multiply_mod_p(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (bit-reflected: bit 31 holds x^0)."""
    product = 0
    bit = 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLYNOMIAL if b & 1 else b >> 1
    return product


def _x_powers_of_two() -> tuple[int, ...]:
    """``x^(2^k)`` modulo the polynomial for k = 0..63 (enough for any length below 2^64 bits)."""
    powers = [1 << 30]  # x^1
    for _ in range(63):
        powers.append(_multiply_mod_p(powers[-1], powers[-1]))
    return tuple(powers)


_X_POWERS = _x_powers_of_two()


@functools.lru_cache(maxsize=256)  # chunks of one size recur: their power is computed once
def _x_power_bytes(nbytes: int) -> int:
    """``x^(8*nbytes)`` modulo the polynomial."""
    result = 1 << 31  # x^0
    exponent, k = nbytes, 3  # 8*nbytes = nbytes * 2^3
    while exponent:
        if exponent & 1:
            result = _multiply_mod_p(_X_POWERS[k], result)
        exponent >>= 1
        k += 1
    return result


def combine_pieces(pieces: list[tuple[int, int, int]]) -> int:
    """CRC-32 of consecutive pieces given as ``(offset, nbytes, crc32)`` in any order.

    Raises:
        ValueError: the pieces leave a gap or overlap.
    """
    pieces = sorted(pieces)
    crc = 0
    expected = pieces[0][0] if pieces else 0
    for offset, nbytes, piece_crc in pieces:
        if offset != expected:
            raise ValueError(f"pieces are not contiguous at byte {expected}")
        crc = crc32_combine(crc, piece_crc, nbytes)
        expected = offset + nbytes
    return crc


class ChecksummingSession(WriteSession):
    """A write session that checksums what it writes and fills each record's CRC-32 fields (see module doc).

    Call order and threads as any :class:`~lightning_datastates.records.session.WriteSession`; ``write_range`` is
    thread-safe. The CRC fields of a record are written (through the wrapped session, by the writer thread that
    completes the record) before that ``write_range`` returns, so they are written before ``complete`` runs.
    """

    def __init__(self, inner: WriteSession, slots: tuple[ChecksumSlot, ...]) -> None:
        self.path = inner.path
        self.inner = inner
        self._slots = sorted(slots, key=lambda s: s.data_offset)
        self._starts = [slot.data_offset for slot in self._slots]
        self._pieces: list[list[tuple[int, int, int]]] = [[] for _ in self._slots]
        self._written = [0] * len(self._slots)
        self._unfinished = sum(1 for slot in self._slots if slot.nbytes)
        self._fields: list[tuple[int, bytes]] = []  # CRC-32 fields written so far: (file offset, 4 bytes)
        self._lock = threading.Lock()

    def write_range(self, offset: int, data: memoryview) -> None:
        """Checksum the parts of ``data`` that belong to records, write ``data``, then any finished record's CRC.

        Large ranges go through the page cache in windows, each checksummed and then written while it is still in
        the CPU cache: the bytes are read from memory once, not once for the CRC and again for the kernel's copy.
        Windows end at file offsets that are multiples of :data:`WINDOW_BYTES`. With direct I/O the device reads
        the memory itself, so there is nothing to keep in the cache: the whole range is checksummed, then written
        in one request (large requests suit disks and whole Lustre stripes).
        """
        view = memoryview(data).cast("B")
        end = offset + view.nbytes
        running: dict[int, tuple[int, int, int]] = {}  # slot index -> (first byte, bytes so far, running CRC-32)
        # Window bounds: offset, the multiples of WINDOW_BYTES in between, end (no window when there are no bytes).
        if self.inner.direct_alignment:
            bounds = [offset, end]
        else:
            bounds = [offset, *range(offset - offset % WINDOW_BYTES + WINDOW_BYTES, end, WINDOW_BYTES), end]
        for window, window_end in itertools.pairwise(bounds if view.nbytes else ()):
            index = max(0, bisect.bisect_right(self._starts, window) - 1)
            while index < len(self._slots) and self._slots[index].data_offset < window_end:
                slot = self._slots[index]
                lo, hi = max(window, slot.data_offset), min(window_end, slot.data_offset + slot.nbytes)
                if lo < hi:  # the CRC releases the GIL for buffers over 5 KiB: training goes on meanwhile
                    first, nbytes, crc = running.get(index, (lo, 0, 0))
                    running[index] = (first, nbytes + hi - lo, crc32(view[lo - offset : hi - offset], crc))
                index += 1
            self.inner.write_range(window, view[window - offset : window_end - offset])
        self._add_parts([(index, first, nbytes, crc) for index, (first, nbytes, crc) in running.items()])

    def write_checksummed_range(self, offset: int, data: memoryview, crc: int) -> None:
        """Write ``data`` at ``offset`` whose CRC-32 the caller already computed (the copier does, while the bytes are
        in the CPU cache), then any finished record's CRC. A range that is not inside one record is checksummed
        here, as by :meth:`write_range`.
        """
        view = memoryview(data).cast("B")
        index = bisect.bisect_right(self._starts, offset) - 1
        slot = self._slots[index] if index >= 0 else None
        if not view.nbytes or slot is None or offset + view.nbytes > slot.data_offset + slot.nbytes:
            self.write_range(offset, view)
            return
        self.inner.write_range(offset, view)
        self._add_parts([(index, offset, view.nbytes, crc)])

    def _add_parts(self, parts: list[tuple[int, int, int, int]]) -> None:
        """Account written ``(slot index, first byte, bytes, CRC-32)`` parts; write the CRC of records now whole."""
        finished = []
        with self._lock:
            for index, lo, nbytes, crc in parts:
                self._pieces[index].append((lo, nbytes, crc))
                self._written[index] += nbytes
                if self._written[index] > self._slots[index].nbytes:
                    raise RuntimeError(f"{self.path}: record {self._slots[index].name} was written twice")
                if self._written[index] == self._slots[index].nbytes:
                    finished.append(index)
                    self._unfinished -= 1
        for index in finished:
            try:
                field_bytes = struct.pack("<I", combine_pieces(self._pieces[index]))
            except ValueError as exc:
                raise RuntimeError(f"{self.path}: record {self._slots[index].name} was written with overlaps") from exc
            self._pieces[index] = []
            for field in self._slots[index].crc_fields:
                self.inner.write_range(field, memoryview(field_bytes))
            with self._lock:
                self._fields += [(field, field_bytes) for field in self._slots[index].crc_fields]

    def written_fields(self) -> list[tuple[int, bytes]]:
        """``(file_offset, bytes)`` of every CRC-32 field written so far (all of them once ``complete`` passed)."""
        with self._lock:
            return list(self._fields)

    @property
    def fast_writes(self) -> bool:  # type: ignore[override]
        """As the wrapped session's."""
        return self.inner.fast_writes

    @property
    def direct_alignment(self) -> int | None:  # type: ignore[override]
        """As the wrapped session's."""
        return self.inner.direct_alignment

    def __getattr__(self, name: str) -> Any:
        # Backend details of the wrapped session (a temporary path, an upload id) stay reachable for diagnostics.
        return getattr(self.inner, name)

    def complete(self) -> None:
        """Commit, once every record was written whole (and so carries its CRC-32).

        Raises:
            RuntimeError: a record was not fully written (the file would be torn); nothing is published.
        """
        with self._lock:
            if self._unfinished:
                missing = next(s for s, w in zip(self._slots, self._written, strict=True) if w < s.nbytes)
                raise RuntimeError(
                    f"{self.path}: record {missing.name} is incomplete ({self._written[self._slots.index(missing)]} "
                    f"of {missing.nbytes} bytes written); the checkpoint was not committed"
                )
        self.inner.complete()

    def date(self, modified_ns: int) -> None:
        """Date the file (see the wrapped session)."""
        self.inner.date(modified_ns)

    def abort(self) -> None:
        """Discard the file (see the wrapped session)."""
        self.inner.abort()


def checksummed(session: WriteSession, slots: tuple[ChecksumSlot, ...]) -> WriteSession:
    """``session`` wrapped to fill the CRC-32 fields of ``slots`` (unchanged when there are none)."""
    return ChecksummingSession(session, slots) if slots else session
