"""Mapping the host arena's pages in off the training thread, where nothing page-locks them (state on the CPU).

The arena is allocated untouched: the kernel maps each page when it is first written. Left to the copier, the first
checkpoints pay for those page faults during their copy: on this project's VM a copy into fresh pages ran at 1.67 s
per GiB, into mapped ones at 0.08 s, so the barrier waited 0.4-1.0 s for each of the benchmark's first two
checkpoints (the default arena holds two) and for none after. ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 and
later) maps pages as a write would, without changing a byte already written: an :class:`ArenaPrefault` thread runs
it piece by piece from the arena's start (the arena hands out its lowest free blocks first), while training goes on
(0.40 s per GiB there, in the kernel, with the GIL released). It may race the copier: a page the copier wrote first
keeps its bytes. Where the call is missing or refused (older kernels, other systems) nothing happens, and pages are
mapped as copies first write them, as without this.

Where the state is on a GPU the pinning thread does this as part of its work (``cudaHostRegister`` faults the pages
in as it locks them, :mod:`~lightning_datastates.copy.pinning`).

Call order:
  1) ``ArenaPrefault(memory)`` on the thread that makes the arena: starts the thread ``datastates-arena-prefault``
     and returns at once;
  2) on that thread, ``populate(address, nbytes)`` once per piece of :data:`PREFAULT_PIECE_BYTES`, in address order
     (:attr:`ArenaPrefault.populated_bytes` grows with each); then :attr:`ArenaPrefault.done` is set (all mapped,
     stopped, or refused: a refusal is logged at debug level, once);
  3) :meth:`ArenaPrefault.stop` from any thread when the arena closes: the thread ends after the piece in progress.
The thread holds ``memory`` until it ends, so no piece is ever advised after its memory was freed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable

import torch

log = logging.getLogger("lightning_datastates")

#: ``MADV_POPULATE_WRITE`` from Linux's ``<linux/mman.h>`` (5.14); Python's ``mmap`` module names it only for
#: mappings it made itself, and the arena's memory may come from torch's allocator.
MADV_POPULATE_WRITE = 23
#: Bytes mapped by one call: a stop waits for one piece at most (about 25 ms at the rate above).
PREFAULT_PIECE_BYTES = 64 * 2**20

#: ``populate(address, nbytes)``: map the range's pages for writing; 0, or an ``errno`` value on failure.
Populate = Callable[[int, int], int]


def _madvise_populate() -> Populate | None:
    """``madvise(..., MADV_POPULATE_WRITE)`` through ctypes (whose calls release the GIL); None off Linux or where
    libc cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int

    def populate(address: int, nbytes: int) -> int:
        return 0 if madvise(address, nbytes, MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()

    return populate


#: How this host maps pages in ahead of use; None where it cannot.
DEFAULT_POPULATE: Populate | None = _madvise_populate()


class ArenaPrefault:
    """Maps the pages of ``memory`` (a contiguous ``uint8`` host tensor: the part of the arena the first checkpoints
    use) in on a thread of its own; see the module docstring for the call order.

    Args:
        populate: what maps a range; None (default): :data:`DEFAULT_POPULATE`, this host's, read when the arena is
            made (tests inject a fault there).
    """

    def __init__(self, memory: torch.Tensor, populate: Populate | None = None) -> None:
        populate = DEFAULT_POPULATE if populate is None else populate
        self.nbytes = memory.numel()
        #: Bytes mapped so far, from the start of ``memory``.
        self.populated_bytes = 0
        #: Set once the thread ended: everything mapped, stopped, or refused.
        self.done = threading.Event()
        self._stopped = threading.Event()
        # A daemon thread: it only prepares memory, nothing on storage depends on it; interpreter exit need not wait.
        self._thread = threading.Thread(
            target=self._run, args=(memory, populate), name="datastates-arena-prefault", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Map no further piece (any thread; returns at once)."""
        self._stopped.set()

    def _run(self, memory: torch.Tensor, populate: Populate | None) -> None:
        try:
            if populate is None:
                return
            address = memory.data_ptr()
            for start in range(0, self.nbytes, PREFAULT_PIECE_BYTES):
                if self._stopped.is_set():
                    return
                size = min(PREFAULT_PIECE_BYTES, self.nbytes - start)
                error = populate(address + start, size)
                if error:  # EINVAL before Linux 5.14: pages are mapped by the copies, as without this
                    log.debug("lightning_datastates: host arena pages not mapped ahead: %s", os.strerror(error))
                    return
                self.populated_bytes = start + size
        except Exception as exc:  # noqa: BLE001 - only an early start: the copies map the pages otherwise
            log.debug("lightning_datastates: host arena pages not mapped ahead: %r", exc)
        finally:
            del memory  # the memory may go once this thread is done with it
            self.done.set()
