"""Copiers move bytes of a source storage into a block of the host arena.

Call order, per snapshot:
  1) ``mark()`` on the training thread, at capture: remembers "everything queued on the device so far";
  2) ``copy(dst, src, mark)`` on the copier thread, once per piece: returns when ``dst`` holds the bytes, with their
     CRC-32 where computing it on the way was free.

``CpuCopier`` copies window by window with ``memmove`` (the GIL is released meanwhile, so training goes on) and
checksums each window right after copying it, while it is still in the CPU cache: the writer threads then need not
read the bytes again for the CRC (one pass over memory fewer per checkpoint).
``CudaCopier`` issues ``non_blocking`` copies on its own stream, ordered after the mark, into pinned memory,
so the DMA engine overlaps the next forward and backward; only the copier thread waits for them.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch

from lightning_datastates.checksums import crc32
from lightning_datastates.snapshot.arena import address_view

#: Bytes copied, then checksummed, in one go: small enough to stay in the CPU cache in between.
COPY_WINDOW_BYTES = 512 * 1024


class Copier(Protocol):
    """Copies device bytes to host bytes; see the module docstring for the call order."""

    def mark(self) -> Any:
        """Training thread, at capture: a token that orders later copies after work already queued."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, mark: Any) -> int | None:
        """Copier thread: copy ``src`` into ``dst`` (equal-sized contiguous ``uint8`` tensors) and return when done;
        the CRC-32 of the bytes if the copier computed it on the way, else None."""


class CpuCopier:
    """Copies from host memory (or any device without streams) synchronously on the calling thread."""

    def mark(self) -> Any:
        """Nothing to order: CPU work of the training thread is already done when the save is called."""
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, mark: Any) -> int | None:
        """Copy ``src`` into ``dst``; return the CRC-32 of the bytes (None from a device other than the CPU)."""
        if src.device.type != "cpu":  # a device without streams (MPS, XPU, ...): no host address to copy from
            dst.copy_(src)
            return None
        nbytes = src.numel()
        source, target = src.data_ptr(), dst.data_ptr()
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

    def copy(self, dst: torch.Tensor, src: torch.Tensor, mark: Any) -> int | None:
        """Issue the copy on the copy stream and wait for it here, on the copier thread; None: the bytes arrive by
        DMA, not through the CPU cache, so the writer threads checksum them."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            # Order after the capture point: the state must be read as it was when save_checkpoint ran.
            self.stream.wait_event(mark)
            # Asynchronous DMA into pinned host memory: overlaps whatever the compute stream runs now.
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            # Marks the end of this chunk's copy on the copy stream.
            done.record(self.stream)
        # Block only this thread: the chunk may be written to storage once the DMA finished.
        done.synchronize()
        return None


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
