"""Page-locking the host arena off the training thread.

CUDA copies reach host memory by DMA at the link's full speed only when that memory is page-locked ("pinned");
into pageable memory they go through a driver staging buffer at a fraction of it. Allocating pinned memory
(``torch.empty(..., pin_memory=True)``, i.e. ``cudaHostAlloc``) costs about 0.4 s per GiB *on the calling thread*:
done at the first save, it stalls training for seconds. So the arena is allocated as ordinary pageable memory (the
kernel maps its pages lazily: microseconds), and an :class:`ArenaPinning` thread page-locks it afterwards with a
:class:`Pinner` (``cudaHostRegister`` on CUDA hosts). Until that is done, copies into the arena take the pageable
path: correct, only slower (the copier waits for every chunk's copies on its own stream either way). Training never
waits for the pinning.

Locked pages of private memory would be copied into every child at ``fork`` (Linux copies pages pinned for DMA
instead of sharing them copy-on-write): a data loader forking its workers would duplicate the arena each time. So an
arena to be pinned is a mapping of its own (:func:`fork_excluded_mapping`), marked ``MADV_DONTFORK`` when it is made:
children do not inherit it (nothing in a child reads the arena: it only serves this process's copies, writes and
loads), and the mark ends with the mapping, never with memory that the allocator hands out again.

Call order:
  1) ``ArenaPinning(address, nbytes, pinner)`` on the training thread, where the arena is made: starts the thread
     and returns at once;
  2) ``pinner.pin(address, nbytes)`` on the thread ``datastates-arena-pin``; then :attr:`ArenaPinning.done` is set
     (pinned, or failed: :attr:`ArenaPinning.pinned` tells; a failure is logged, the arena stays pageable);
  3) :meth:`ArenaPinning.release` when the arena's memory goes (any thread of this process): waits for 2), then
     unpins.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from typing import Protocol

import torch

log = logging.getLogger("lightning_datastates")

#: ``cudaHostRegisterPortable``: the range counts as pinned for every CUDA context of the process, not only the one
#: current on the pinning thread (which need not be the device the copier copies from).
_CUDA_HOST_REGISTER_PORTABLE = 1


class Pinner(Protocol):
    """Page-locks a range of host memory for a device's DMA engine, and undoes it."""

    def pin(self, address: int, nbytes: int) -> None:
        """Page-lock ``[address, address + nbytes)``; raise ``OSError`` if the driver refuses."""

    def unpin(self, address: int) -> None:
        """Undo :meth:`pin` of the range starting at ``address``."""


class CudaHostRegister:
    """:class:`Pinner` through ``cudaHostRegister``: locks memory already allocated by anyone.

    Args:
        device: the CUDA device current on the training thread when the arena was made: the pinning thread makes it
            current too, so that it creates no context on another GPU (a fresh thread's current device is 0).
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
        """Unregister the range (its memory must still be allocated)."""
        with torch.cuda.device(self.device):
            torch.cuda.cudart().cudaHostUnregister(address)


class ArenaPinning:
    """Pins one arena's buffer on a thread of its own; see the module docstring for the call order."""

    def __init__(self, address: int, nbytes: int, pinner: Pinner) -> None:
        self.address = address
        self.nbytes = nbytes
        self._pinner = pinner
        self._pid = os.getpid()  # a forked child inherits this object, not the locked range
        self.pinned = False
        #: Set once the pinning ended, pinned or not.
        self.done = threading.Event()
        self._lock = threading.Lock()
        # A daemon thread: it only prepares memory, nothing on storage depends on it; interpreter exit need not wait.
        self._thread = threading.Thread(target=self._run, name="datastates-arena-pin", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._pinner.pin(self.address, self.nbytes)
        except Exception as exc:  # noqa: BLE001 - pinning only speeds copies up: log it, keep the pageable path
            log.warning(
                "lightning_datastates: could not page-lock the host arena (%d bytes): %s; copies from the GPU go "
                "through pageable memory (correct, slower).",
                self.nbytes,
                exc,
            )
        else:
            with self._lock:
                self.pinned = True
        finally:
            self.done.set()

    def release(self) -> None:
        """Unpin (once); waits for a pinning still in progress. Call before the buffer's memory is freed.

        Nothing to do in a forked child (the range was not inherited), and no wait on the pinning thread itself (a
        garbage collection there may release the arena before :attr:`done` is set).
        """
        if os.getpid() != self._pid:
            return
        if threading.current_thread() is not self._thread:
            self.done.wait()
        with self._lock:
            if self.pinned:
                self.pinned = False
                self._pinner.unpin(self.address)


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


def default_pinner() -> Pinner | None:
    """The pinner for this host, called on the training thread: ``cudaHostRegister`` for its current CUDA device where
    CUDA is available; None elsewhere (CPU copies gain nothing from locked pages, and untouched pageable pages cost no
    memory until used)."""
    return CudaHostRegister(torch.cuda.current_device()) if torch.cuda.is_available() else None
