"""Copiers move a chunk's pieces from their source storages into the chunk's block of the host arena.

Call order, per snapshot:
  1) ``mark()`` on the training thread, at capture: remembers "everything queued on the device so far";
  2) ``start_pieces(block, pieces, sources, mark)`` on the copier thread, once per chunk and source device: starts
     the copies and returns a :class:`CopyInFlight` at once (a device copy) or once the bytes are there (a host copy);
  3) on the copier thread, ``ready()`` of that handle (never blocks) or ``wait()``: returns when the block holds the
     pieces' bytes, with the CRC-32 of each piece where computing it on the way was free. Nothing may read the block,
     and the sources must stay alive and unchanged, until then.

``CpuCopier`` copies host memory by address, with no tensor made per piece (a checkpoint has hundreds of small
tensors, and the save call waits for them). Large pieces are copied window by window with ``memmove`` (the GIL is
released meanwhile, so training goes on) and each window is checksummed right after, while it is still in the CPU
cache: the writer threads then need not read the bytes again for the CRC (one pass over memory fewer per
checkpoint). Small pieces are copied with the GIL held and not checksummed (the writer threads do it): releasing and
retaking the GIL, which the CRC of more than 5 KiB does, would cost more than the copy (a matter of cost only: the
sources stay alive and unchanged because the job holds them and the barrier waits for the copy, as for every copy).
``CudaCopier`` issues ``non_blocking`` copies of all the pieces on its own stream, ordered after the mark, into pinned
memory, so the DMA engine overlaps the next forward and backward; only the copier thread waits for them. It returns
before the copies end, so that the copier thread can queue the next chunks' copies behind them
(:mod:`~lightning_datastates.copy.loop`): the DMA engine is never idle while the copier thread waits for the GIL,
which the training thread holds for up to the interpreter's switch interval (5 ms) at a time while it launches
kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lightning_datastates.copy.arena import address_view
from lightning_datastates.copy.pinning import cut_at_pin_boundaries
from lightning_datastates.records.block import PieceCrcs
from lightning_datastates.records.checksums import crc32
from lightning_datastates.records.chunks import Piece

#: Bytes copied, then checksummed, in one go: small enough to stay in the CPU cache in between.
COPY_WINDOW_BYTES = 512 * 1024
#: Pieces up to this size are copied without releasing the GIL and without a CRC-32 (a few microseconds).
GIL_HELD_COPY_BYTES = 64 * 1024


class CopyInFlight(Protocol):
    """Copies started by a copier (copier thread only)."""

    def ready(self) -> bool:
        """Whether the copies have ended (never blocks)."""

    def wait(self) -> PieceCrcs:
        """Return once the copies have ended: the CRC-32s computed on the way, by block offset. Raises what the copies
        raised."""


class Copied:
    """A :class:`CopyInFlight` that had ended when it was returned (host copies)."""

    def __init__(self, crcs: PieceCrcs) -> None:
        self.crcs = crcs

    def ready(self) -> bool:
        """Always True."""
        return True

    def wait(self) -> PieceCrcs:
        """The CRC-32s computed while copying."""
        return self.crcs


class Copier(Protocol):
    """Copies device bytes to host bytes; see the module docstring for the call order."""

    def mark(self) -> Any:
        """Training thread, at capture: a token that orders later copies after work already queued."""

    def start_pieces(
        self, block: torch.Tensor, pieces: Sequence[Piece], sources: Sequence[torch.UntypedStorage], mark: Any
    ) -> CopyInFlight:
        """Copier thread: start copying each piece of ``sources[piece.key]`` into ``block`` (a contiguous ``uint8``
        host tensor) at its ``block_offset``; the handle tells when they are done. Raises if they could not start."""


class CpuCopier:
    """Copies from host memory (or any device without streams) synchronously on the calling thread."""

    def mark(self) -> Any:
        """Nothing to order: CPU work of the training thread is already done when the save is called."""
        return None

    def start_pieces(
        self, block: torch.Tensor, pieces: Sequence[Piece], sources: Sequence[torch.UntypedStorage], mark: Any
    ) -> CopyInFlight:
        """Copy the pieces now (:meth:`copy_pieces`); the handle returned has ended."""
        return Copied(self.copy_pieces(block, pieces, sources, mark))

    def copy_pieces(
        self, block: torch.Tensor, pieces: Sequence[Piece], sources: Sequence[torch.UntypedStorage], mark: Any
    ) -> PieceCrcs:
        """Copy the pieces into ``block``; the CRC-32 of every piece copied from host memory larger than
        :data:`GIL_HELD_COPY_BYTES` (writer threads checksum the others)."""
        crcs: PieceCrcs = {}
        base = block.data_ptr()
        for piece in pieces:
            storage = sources[piece.key]
            if storage.device.type != "cpu":  # a device without streams (MPS, XPU, ...): no host address to copy from
                source_bytes = byte_range(storage, piece.source_offset, piece.nbytes)
                block[piece.block_offset : piece.block_offset + piece.nbytes].copy_(source_bytes)
                continue
            source, target = storage.data_ptr() + piece.source_offset, base + piece.block_offset
            crc = copy_host_bytes(target, source, piece.nbytes)
            if crc is not None:
                crcs[piece.block_offset] = (piece.nbytes, crc)
        return crcs


def copy_host_bytes(target: int, source: int, nbytes: int) -> int | None:
    """Copy ``nbytes`` bytes of host memory from address ``source`` to ``target``; return their CRC-32, or None for
    a small range (at most :data:`GIL_HELD_COPY_BYTES`), which the writer threads checksum instead.

    Why not checksum small ranges here: the CRC releases the GIL for buffers over 5 KiB, and retaking it, while
    writer threads flush earlier checkpoints, costs far more than the copy; the save call waits for the small
    tensors' copies, not for their CRCs (measured with a real Trainer, 1169 small tensors: 21 ms with the CRC,
    4 ms without).
    """
    if nbytes <= GIL_HELD_COPY_BYTES:
        if nbytes:  # an empty view is read-only
            address_view(target, nbytes)[:] = address_view(source, nbytes)
        return None
    crc = 0
    for start in range(0, nbytes, COPY_WINDOW_BYTES):
        size = min(COPY_WINDOW_BYTES, nbytes - start)
        ctypes.memmove(target + start, source + start, size)
        crc = crc32(address_view(target + start, size), crc)
    return crc


class CudaCopier:
    """Copies from one CUDA device through a dedicated stream (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # A stream of our own: the copies must neither wait behind nor delay the compute stream's kernels.
        self.stream = torch.cuda.Stream(device=device)

    def mark(self) -> Any:
        """Record an event on the compute stream: copies start only once the kernels producing the state ran."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start_pieces(
        self, block: torch.Tensor, pieces: Sequence[Piece], sources: Sequence[torch.UntypedStorage], mark: Any
    ) -> CopyInFlight:
        """Issue the pieces' copies on the copy stream and return; the copier thread waits for them through the
        handle. No CRC-32s: the bytes arrive by DMA, not through the CPU cache, so the writer threads checksum
        them."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            # Order after the capture point: the state must be read as it was when save_checkpoint ran.
            self.stream.wait_event(mark)
            base = block.data_ptr()
            try:
                # Four tensor calls per copy (view, set, slice, copy): an LLM has hundreds of small tensors, issued
                # while the training thread launches its kernels and wants the GIL.
                for piece in pieces:
                    storage = sources[piece.key]
                    # One copy per span of the arena's pinning (copy/pinning.py): each lies within one registration.
                    for start, nbytes in pin_spans(base + piece.block_offset, piece.nbytes):
                        at = piece.block_offset + start
                        source = byte_range(storage, piece.source_offset + start, nbytes)
                        # Asynchronous DMA into pinned host memory: overlaps whatever the compute stream runs now.
                        block[at : at + nbytes].copy_(source, non_blocking=True)
            except BaseException:
                # The caller frees the block on failure: the copies already issued must not write into it later.
                self.stream.synchronize()
                raise
            # Marks the end of this chunk's copies on the copy stream. Blocking: waiting for it yields the CPU instead
            # of spinning on it (the copier thread waits for chunks in flight, cores are training's).
            done = torch.cuda.Event(blocking=True)
            done.record(self.stream)
        return _CudaCopies(done)


class _CudaCopies:
    """A chunk's copies on a copy stream, up to the event recorded after them."""

    def __init__(self, done: torch.cuda.Event) -> None:
        self._done = done

    def ready(self) -> bool:
        """Whether the copy stream has passed the event (a query: never blocks)."""
        return bool(self._done.query())

    def wait(self) -> PieceCrcs:
        """Block only this thread (the copier's) until the DMA ended: then the chunk may be written to storage."""
        self._done.synchronize()
        return {}


class ChunkCopy:
    """A chunk's copies from each of its source devices (one :class:`CopyInFlight` per device)."""

    def __init__(self, parts: list[CopyInFlight]) -> None:
        self._parts = parts

    def ready(self) -> bool:
        """Whether every device's copies have ended (never blocks)."""
        return all(part.ready() for part in self._parts)

    def wait(self) -> PieceCrcs:
        """Wait for every device's copies; their CRC-32s together. If one failed, the others are still waited for
        before its error is raised: the block is freed then, and no late copy may write into it afterwards."""
        crcs: PieceCrcs = {}
        error: BaseException | None = None
        for part in self._parts:
            try:
                crcs.update(part.wait())
            except BaseException as exc:  # noqa: BLE001 - raised below, once every part ended
                error = error or exc
        if error is not None:
            raise error
        return crcs


class CopierSet:
    """One copier per source device, created on first use."""

    def __init__(self) -> None:
        self._copiers: dict[torch.device, Copier] = {}

    def for_device(self, device: torch.device) -> Copier:
        """The copier for storages on ``device``."""
        copier = self._copiers.get(device)
        if copier is None:
            copier = CudaCopier(device) if device.type == "cuda" else CpuCopier()
            self._copiers[device] = copier
        return copier

    def marks(self, devices: set[torch.device]) -> dict[torch.device, Any]:
        """Training thread: one mark per device that holds sources of the snapshot being captured."""
        return {device: self.for_device(device).mark() for device in devices}

    def start_chunk(
        self,
        block: torch.Tensor,
        pieces: Sequence[Piece],
        sources: Sequence[torch.UntypedStorage],
        marks: dict[torch.device, Any],
    ) -> ChunkCopy:
        """Start copying a chunk's pieces into ``block``, each source device's by its own copier (one call per
        device). If one device's copies cannot start, those already started are waited for before the error is
        raised: nothing writes into the block afterwards."""
        by_device: dict[torch.device, list[Piece]] = {}
        for piece in pieces:
            by_device.setdefault(sources[piece.key].device, []).append(piece)
        parts: list[CopyInFlight] = []
        try:
            for device, device_pieces in by_device.items():
                parts.append(self.for_device(device).start_pieces(block, device_pieces, sources, marks.get(device)))
        except BaseException:
            with contextlib.suppress(BaseException):  # the error raised is the one that stopped the start
                ChunkCopy(parts).wait()
            raise
        return ChunkCopy(parts)


def pin_spans(target_address: int, nbytes: int) -> list[tuple[int, int]]:
    """The spans, as ``(offset from target_address, nbytes)``, that a device copy of ``nbytes`` to host memory at
    ``target_address`` is issued in: cut where the arena's pinning pieces meet (:func:`cut_at_pin_boundaries`)."""
    return [(address - target_address, size) for address, size in cut_at_pin_boundaries(target_address, nbytes)]


def byte_range(storage: torch.UntypedStorage, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``storage`` from byte ``offset``, as a flat ``uint8`` tensor on its device (a view: no
    copy; made in one ``set_``, no slicing)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, offset, (nbytes,), (1,))
