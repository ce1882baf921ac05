"""Page-locking the host arena off the training thread.

CUDA copies reach host memory by DMA at the link's full speed only when that memory is page-locked ("pinned");
into pageable memory they go through a driver staging buffer at a fraction of it. Allocating pinned memory
(``torch.empty(..., pin_memory=True)``, i.e. ``cudaHostAlloc``) costs about 0.4 s per GiB *on the calling thread*:
done at the first save, it stalls training for seconds. So the arena is allocated as ordinary pageable memory (the
kernel maps its pages lazily: microseconds), and an :class:`ArenaPinning` thread page-locks it afterwards with a
:class:`Pinner` (``cudaHostRegister`` on CUDA hosts). Until that is done, copies into the arena take the pageable
path: correct, only slower. Training never waits for the pinning.

Call order:
  1) ``ArenaPinning(address, nbytes, pinner)`` on the training thread, where the arena is made: starts the thread
     and returns at once;
  2) ``pinner.pin(address, nbytes)`` on the thread ``datastates-arena-pin``; then :attr:`ArenaPinning.done` is set
     (pinned, or failed: :attr:`ArenaPinning.pinned` tells; a failure is logged, the arena stays pageable);
  3) :meth:`ArenaPinning.release` when the arena's memory goes (any thread): waits for 2), then unpins.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import torch

log = logging.getLogger("lightning_datastates")


class Pinner(Protocol):
    """Page-locks a range of host memory for a device's DMA engine, and undoes it."""

    def pin(self, address: int, nbytes: int) -> None:
        """Page-lock ``[address, address + nbytes)``; raise ``OSError`` if the driver refuses."""

    def unpin(self, address: int) -> None:
        """Undo :meth:`pin` of the range starting at ``address``."""


class CudaHostRegister:
    """:class:`Pinner` through ``cudaHostRegister``: locks memory already allocated (and mapped) by anyone."""

    def pin(self, address: int, nbytes: int) -> None:
        """Register the range with the CUDA driver (it faults the pages in and locks them)."""
        # Flags 0 (cudaHostRegisterDefault): portable across this process's CUDA contexts is not needed, one
        # device's copier uses it; the memory stays ordinary host memory for the CPU (writers read it as usual).
        error = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        if int(error) != 0:
            raise OSError(f"cudaHostRegister of {nbytes} bytes failed: {error!r}")

    def unpin(self, address: int) -> None:
        """Unregister the range (its memory must still be allocated)."""
        torch.cuda.cudart().cudaHostUnregister(address)


class ArenaPinning:
    """Pins one arena's buffer on a thread of its own; see the module docstring for the call order."""

    def __init__(self, address: int, nbytes: int, pinner: Pinner) -> None:
        self.address = address
        self.nbytes = nbytes
        self._pinner = pinner
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
                "through pageable memory (correct, slower). Lower host_cache if the host limits locked memory.",
                self.nbytes,
                exc,
            )
        else:
            self.pinned = True
        finally:
            self.done.set()

    def release(self) -> None:
        """Unpin (once); waits for a pinning still in progress. Call before the buffer's memory is freed."""
        self.done.wait()
        with self._lock:
            if self.pinned:
                self.pinned = False
                self._pinner.unpin(self.address)


def default_pinner() -> Pinner | None:
    """The pinner for this host: ``cudaHostRegister`` where CUDA is available; None elsewhere (CPU copies gain
    nothing from locked pages, and untouched pageable pages cost no memory until used)."""
    return CudaHostRegister() if torch.cuda.is_available() else None
