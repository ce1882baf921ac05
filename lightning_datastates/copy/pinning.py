"""Page-locking the host arena off the training thread.

CUDA copies reach host memory by DMA at the link's full speed only when that memory is page-locked ("pinned"); into
pageable memory they go through a driver staging buffer at a fraction of it. Allocating pinned memory
(``torch.empty(..., pin_memory=True)``, i.e. ``cudaHostAlloc``) costs about 0.4 s per GiB *on the calling thread*: done
at the first save, it stalls training for seconds. So the arena is allocated as ordinary pageable memory (the kernel
maps its pages lazily: microseconds), and an :class:`ArenaPinning` thread page-locks it afterwards with a
:class:`Pinner` (``cudaHostRegister``, where the state to checkpoint is on a GPU). Until that is done, copies into the
arena take the pageable path: correct, only slower (the copier waits for every chunk's copies on its own stream either
way). Training never waits for the pinning.

The arena is locked in pieces (:data:`PIN_PIECE_BYTES`, cut at the multiples of that size in the address space, in
address order), not in one call: each piece is usable at the pinned rate as soon as it is locked (the arena hands out
its lowest free blocks first, so the first checkpoint's copies land in the pieces locked first), a release while the
pinning runs waits for one piece instead of the whole arena, and no single driver call runs for long (about 28 ms per
piece at the 0.11 s per GiB measured on an H200 host, against seconds for tens of GiB at once). A device copy is cut
at the same boundaries (:func:`cut_at_pin_boundaries`): a copy whose host range lies within one registration is
known to take the pinned path; how the driver treats a range that straddles two is not documented.

Locked pages of private memory would be copied into every child at ``fork`` (Linux copies pages pinned for DMA
instead of sharing them copy-on-write): a data loader forking its workers would duplicate the arena each time. So an
arena to be pinned is a mapping of its own (:func:`fork_excluded_mapping`), marked ``MADV_DONTFORK`` when it is made:
children do not inherit it (nothing in a child reads the arena: it only serves this process's copies, writes and
loads), and the mark ends with the mapping, never with memory that the allocator hands out again.

Call order:
  1) ``ArenaPinning(address, nbytes, pinner)`` on the training thread, where the arena is made: starts the thread
     and returns at once;
  2) ``pinner.pin(address, nbytes)`` on the thread ``datastates-arena-pin``, once per piece, in address order
     (:attr:`ArenaPinning.pinned_bytes` grows with each); then :attr:`ArenaPinning.done` is set (all pinned, or
     failed: :attr:`ArenaPinning.pinned` tells; a failure is logged, the pieces locked before it stay locked, the
     rest of the arena stays pageable);
  3) :meth:`ArenaPinning.release` when the arena's memory goes (any thread of this process): stops 2) after the
     piece in progress, waits for it, then unpins every piece that was locked.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Iterable
from typing import Protocol

import torch

log = logging.getLogger("lightning_datastates")

#: ``cudaHostRegisterPortable``: the range counts as pinned for every CUDA context of the process, not only the one
#: current on the pinning thread (which need not be the device the copier copies from).
_CUDA_HOST_REGISTER_PORTABLE = 1
#: Bytes page-locked by one driver call: the arena is locked piece by piece, cut at the multiples of this size (see
#: the module docstring). 256 MiB: about 28 ms of ``cudaHostRegister`` each, while a 64 MiB chunk rarely straddles two.
PIN_PIECE_BYTES = 256 * 2**20


class Pinner(Protocol):
    """Page-locks a range of host memory for a device's DMA engine, and undoes it."""

    def pin(self, address: int, nbytes: int) -> None:
        """Page-lock ``[address, address + nbytes)``; raise ``OSError`` if the driver refuses."""

    def unpin(self, address: int) -> None:
        """Undo :meth:`pin` of the range starting at ``address``."""


class CudaHostRegister:
    """:class:`Pinner` through ``cudaHostRegister``: locks memory already allocated by anyone.

    Args:
        device: the CUDA device the state to checkpoint is on (:func:`cuda_device_of`): the pinning thread makes it
            current, so that it creates no context on another GPU (a fresh thread's current device is 0).
    """

    def __init__(self, device: int) -> None:
        self.device = device

    def pin(self, address: int, nbytes: int) -> None:
        """Register the range with the CUDA driver (it faults the pages in and locks them), portable across the
        process's contexts."""
        with torch.cuda.device(self.device):
            error = torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
        if int(error) != 0:
            raise OSError(f"cudaHostRegister of {nbytes} bytes failed: {error!r}")

    def unpin(self, address: int) -> None:
        """Unregister the range (its memory must still be allocated); raise ``OSError`` if the driver refuses."""
        with torch.cuda.device(self.device):
            error = torch.cuda.cudart().cudaHostUnregister(address)
        if int(error) != 0:  # logged by the caller, which goes on with the other pieces
            raise OSError(f"cudaHostUnregister failed: {error!r}")


class ArenaPinning:
    """Pins one arena's buffer, piece by piece, on a thread of its own; see the module docstring for the call
    order.

    Args:
        memory: what owns the range's memory (the arena's buffer): the pinning thread holds it until it ends, so the
            memory outlives any piece being locked even when the arena is released meanwhile.
    """

    def __init__(self, address: int, nbytes: int, pinner: Pinner, memory: object = None) -> None:
        self.address = address
        self.nbytes = nbytes
        self._pinner = pinner
        self._pid = os.getpid()  # a forked child inherits this object, not the locked range
        self._pieces = cut_at_pin_boundaries(address, nbytes)  # the boundaries the copier cuts at, read once
        self._locked: list[tuple[int, int]] = []  # pieces pinned and not yet unpinned, in address order
        self._released = False  # no piece is locked after this is set
        self._released_here = False  # released on the pinning thread itself: it unpins what it locks afterwards
        #: Set once the pinning ended: every piece pinned, or stopped by a failure or a release.
        self.done = threading.Event()
        # Reentrant: a garbage collection on the pinning thread may run the arena's finalizer, i.e. release(), while
        # that thread holds the lock (any allocation may start one).
        self._lock = threading.RLock()
        # A daemon thread: it only prepares memory, nothing on storage depends on it; interpreter exit need not wait.
        self._thread = threading.Thread(target=self._run, args=(memory,), name="datastates-arena-pin", daemon=True)
        self._thread.start()

    @property
    def pinned(self) -> bool:
        """Whether the whole range is page-locked now."""
        with self._lock:
            return self._bytes_locked() == self.nbytes and not self._released

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked now, from the start of the range (the pieces are locked in address order)."""
        with self._lock:
            return self._bytes_locked()

    def _bytes_locked(self) -> int:
        return sum(nbytes for _, nbytes in self._locked)  # a few pieces per GiB: summed when asked

    def _run(self, memory: object) -> None:
        try:
            for address, nbytes in self._pieces:
                with self._lock:
                    if self._released:
                        break  # the arena is going: lock no more of it
                self._pinner.pin(address, nbytes)
                with self._lock:
                    self._locked.append((address, nbytes))
        except Exception as exc:  # noqa: BLE001 - pinning only speeds copies up: log it, keep the pageable path
            log.warning(
                "lightning_datastates: could not page-lock the host arena (%d of %d bytes locked): %s; copies from "
                "the GPU into the rest go through pageable memory (correct, slower).",
                self.pinned_bytes,
                self.nbytes,
                exc,
            )
        finally:
            self.done.set()
            if self._released_here:
                self._unpin_locked()  # a piece locked after the release that ran on this thread
            del memory  # only now may the memory go

    def release(self) -> None:
        """Unpin (once) every piece that was locked; a pinning still in progress stops after its current piece, which
        is waited for. Call before the buffer's memory is freed.

        Nothing to do in a forked child (the range was not inherited). On the pinning thread itself (a garbage
        collection there may release the arena at any point of its loop) nothing waits: the pieces locked so far are
        unpinned at once, a piece being locked by the interrupted code once its loop ended; the thread holds the
        memory until then.
        """
        if os.getpid() != self._pid:
            return
        on_pinning_thread = threading.current_thread() is self._thread
        with self._lock:
            self._released = True
            self._released_here = self._released_here or on_pinning_thread
        if not on_pinning_thread:
            self.done.wait()
        self._unpin_locked()

    def _unpin_locked(self) -> None:
        """Unpin every piece still locked. One piece at a time, each taken off the list before it is unpinned: a
        release run in between (by a collection on this thread) unpins only the pieces still listed, so every piece is
        unpinned exactly once."""
        while True:
            with self._lock:
                if not self._locked:
                    return
                address, nbytes = self._locked.pop(0)
            try:
                self._pinner.unpin(address)
            except Exception as exc:  # noqa: BLE001 - the other pieces must still be unpinned before the memory goes
                log.warning("lightning_datastates: could not unpin %d bytes of the host arena: %s", nbytes, exc)


def cut_at_pin_boundaries(address: int, nbytes: int) -> list[tuple[int, int]]:
    """``[address, address + nbytes)`` cut at the multiples of :data:`PIN_PIECE_BYTES`, as ``(address, nbytes)``
    pairs in address order: the pieces the arena is locked in, and the spans a device copy into the arena is issued
    in (so that no copy straddles two registrations)."""
    spans = []
    end = address + nbytes
    while address < end:
        boundary = (address // PIN_PIECE_BYTES + 1) * PIN_PIECE_BYTES
        span_end = min(boundary, end)
        spans.append((address, span_end - address))
        address = span_end
    return spans


def fork_excluded_mapping(nbytes: int) -> mmap.mmap | None:
    """A private anonymous mapping of ``nbytes`` (a multiple of the page size) that forked children do not inherit
    (``MADV_DONTFORK``); None where the kernel refuses or has no such advice (the caller then keeps its memory
    unpinned, with a warning: locked private pages would be copied into every child)."""
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_DONTFORK)
    except (AttributeError, OSError, ValueError) as exc:  # no MADV_DONTFORK here, or refused
        log.warning(
            "lightning_datastates: cannot keep the host arena out of forked processes (%s); it stays pageable, and "
            "copies from the GPU go through pageable memory (correct, slower).",
            exc,
        )
        return None
    return mapping


def cuda_device_of(devices: Iterable[torch.device]) -> int | None:
    """The CUDA device copies into the arena come from: the lowest-numbered CUDA device among ``devices`` (the devices
    of the state to checkpoint; a device without an index is the current one); None where none is a CUDA device.
    With several, any would do (the arena is registered for every context of the process), but the choice must not
    depend on the order of a set."""
    indices = {torch.cuda.current_device() if d.index is None else d.index for d in devices if d.type == "cuda"}
    return min(indices) if indices else None


def default_pinner(cuda_device: int | None) -> Pinner | None:
    """The pinner for an arena that takes copies from ``cuda_device`` (:func:`cuda_device_of`; training thread):
    ``cudaHostRegister`` for that device; None for state on the CPU (CPU copies gain nothing from locked pages; the
    arena's first pages are mapped ahead instead, copy/prefault.py, and untouched pageable pages cost no memory until
    used). Decided by where the state is, not by whether the host has a GPU: CPU training on a GPU host must not
    create a CUDA context (it would take GPU memory, and Lightning refuses to fork after it)."""
    return None if cuda_device is None else CudaHostRegister(cuda_device)
