"""The host arena: one host buffer, allocated once, handed out in aligned blocks with back-pressure.

Snapshots are copied from the training state into blocks of the arena and written to storage from there;
a block returns to the arena when its bytes are on storage. When the arena is full, :meth:`HostArena.allocate`
waits for blocks to come back (back-pressure) instead of allocating more memory, so host memory for
snapshots never exceeds the arena's size.

Blocks may outlive their write: a :attr:`HostArena.reclaim` callback (the resident cache, see
:mod:`~lightning_datastates.load.resident`) keeps written blocks to serve loads from memory, and gives them
back on demand: when an allocation finds no space, the arena asks it for blocks before waiting.

The buffer is ordinary pageable memory, mapped by the kernel page by page as it is first written (allocating it takes
microseconds, on any thread). Where a :class:`~lightning_datastates.copy.pinning.Pinner` is given (state on a GPU), a
thread of its own page-locks the buffer afterwards, piece by piece from its start
(:mod:`~lightning_datastates.copy.pinning`): copies into a piece not yet locked take the pageable path, none waits for
it. Free space is handed out lowest offset first, so the first copies land in the pieces locked first. Where nothing
locks it (state on the CPU), a thread of its own maps in, ahead of the copies, the pages the first checkpoints use
(:mod:`~lightning_datastates.copy.prefault`): copies into fresh pages are many times slower.

Thread model: any thread may call :meth:`allocate` and :meth:`free`; in this package the copier thread
allocates and the writer threads free.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time
import weakref
from collections.abc import Callable

import torch

from lightning_datastates.alignment import PAGE_ALIGNMENT_BYTES, align_up
from lightning_datastates.copy.pinning import ArenaPinning, Pinner, fork_excluded_mapping
from lightning_datastates.copy.prefault import ArenaPrefault
from lightning_datastates.records.block import Block


class ArenaClosed(Exception):
    """The arena was closed while a caller waited for space."""


class HostArena:
    """A fixed-size host buffer with a first-fit, coalescing free list.

    Args:
        size_bytes: capacity; rounded up to :data:`~lightning_datastates.alignment.PAGE_ALIGNMENT_BYTES`.
        pinner: page-locks the buffer in the background (wanted when copies come from a CUDA device: DMA straight
            into it); None: the buffer stays pageable.
        prefault_bytes: where the buffer is not page-locked, how much of it, from its start, a background thread maps
            in ahead of the copies (at most the whole buffer; 0: none, pages are mapped as copies first write them).
    """

    def __init__(self, size_bytes: int, pinner: Pinner | None = None, prefault_bytes: int = 0) -> None:
        self.size_bytes = align_up(size_bytes)
        # Pageable and untouched either way: the kernel maps pages as they are first written, so this costs
        # microseconds whatever the size.
        if pinner is not None and (mapping := fork_excluded_mapping(self.size_bytes)) is not None:
            # A mapping of its own (page-aligned), kept out of forked children before it is locked (copy/pinning.py);
            # the tensor keeps the mapping alive, and the mapping's end ends the exclusion too.
            self.buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        else:
            # Over-allocate by a page and start on a page boundary: torch's CPU allocator aligns to 64 bytes only,
            # and direct I/O needs page-aligned memory as well as page-aligned offsets.
            raw = torch.empty(self.size_bytes + PAGE_ALIGNMENT_BYTES, dtype=torch.uint8)
            shift = -raw.data_ptr() % PAGE_ALIGNMENT_BYTES
            self.buffer = raw[shift : shift + self.size_bytes]
            pinner = None  # no pinning of memory a forked child would copy
        self._pinning = (
            None if pinner is None else ArenaPinning(self.buffer.data_ptr(), self.size_bytes, pinner, self.buffer)
        )
        self._unpin: weakref.finalize[[], HostArena] | None = None
        if self._pinning is not None:
            # Unpin before the buffer's memory is freed: finalizers run before the arena's attributes are cleared.
            self._unpin = weakref.finalize(self, self._pinning.release)
        prefault_bytes = min(align_up(max(prefault_bytes, 0)), self.size_bytes) if self._pinning is None else 0
        self._prefault = ArenaPrefault(self.buffer[:prefault_bytes]) if prefault_bytes else None
        if self._prefault is not None:
            weakref.finalize(self, self._prefault.stop)  # an arena dropped without close() maps nothing more
        self._free: list[tuple[int, int]] = [(0, self.size_bytes)]  # sorted, disjoint (offset, size) ranges
        self._used_bytes = 0
        self._peak_used_bytes = 0
        self._waited_s = 0.0  # time allocations spent waiting for space (back-pressure), in total
        self._closed = False
        self._cond = threading.Condition()  # an RLock inside: free() may run within allocate() (reclaimed blocks)
        #: Called (with the arena's lock held) when an allocation finds no space: returns the blocks it gives back
        #: (the arena frees them), an empty list if it let go of something that frees nothing yet, or None when it
        #: holds nothing more it may give back (the allocation then waits). It must not call into the arena.
        self.reclaim: Callable[[], list[Block] | None] | None = None

    # ------------------------------------------------------------------ allocation
    def allocate(self, nbytes: int, timeout_s: float | None = None) -> Block:
        """Reserve ``nbytes`` (at most the arena's size), waiting until that much contiguous space is free.

        Raises:
            ValueError: ``nbytes`` is larger than the arena.
            ArenaClosed: the arena was closed while waiting.
            TimeoutError: ``timeout_s`` passed without space.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
        block = Block(0, nbytes)
        if block.reserved_bytes > self.size_bytes:
            raise ValueError(f"a block of {nbytes} bytes does not fit in an arena of {self.size_bytes} bytes")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise ArenaClosed("the host arena was closed")
                offset = self._take(block.reserved_bytes)
                if offset is not None:
                    self._used_bytes += block.reserved_bytes
                    self._peak_used_bytes = max(self._peak_used_bytes, self._used_bytes)
                    return Block(offset, nbytes)
                if self._reclaim_one():
                    continue  # something was given back: try again before waiting
                remaining = None if deadline is None else deadline - time.monotonic()
                wait_started = time.perf_counter()
                try:
                    if remaining is not None and (remaining <= 0 or not self._cond.wait(remaining)):
                        raise TimeoutError(f"no {nbytes} bytes free in the host arena after {timeout_s} s")
                    if remaining is None:
                        self._cond.wait()
                finally:
                    self._waited_s += time.perf_counter() - wait_started

    def free(self, block: Block) -> None:
        """Return ``block`` to the arena and wake waiting allocators."""
        size = block.reserved_bytes
        with self._cond:
            index = bisect.bisect_left(self._free, (block.offset, 0))
            start, end = block.offset, block.offset + size
            overlaps_next = index < len(self._free) and self._free[index][0] < end
            overlaps_previous = index > 0 and sum(self._free[index - 1]) > start
            if overlaps_next or overlaps_previous or end > self.size_bytes:
                raise ValueError(f"{block} is not an allocated block of this arena (freed twice?)")
            # Coalesce with the neighbours so large requests can be served again.
            if index < len(self._free) and self._free[index][0] == end:
                end += self._free.pop(index)[1]
            if index > 0 and sum(self._free[index - 1]) == start:
                start = self._free.pop(index - 1)[0]
                index -= 1
            self._free.insert(index, (start, end - start))
            self._used_bytes -= size
            self._cond.notify_all()

    def wake(self) -> None:
        """Make waiting allocators look again (the reclaim callback may have something to give back now)."""
        with self._cond:
            self._cond.notify_all()

    def _reclaim_one(self) -> bool:
        """Ask the reclaim callback for blocks once (lock held); whether it let go of anything."""
        reclaimed = None if self.reclaim is None else self.reclaim()
        for block in reclaimed or ():
            self.free(block)
        return reclaimed is not None

    def close(self) -> None:
        """Wake and fail every waiter; later allocations fail too; no more pages are mapped ahead."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._prefault is not None:
            self._prefault.stop()

    def discard(self) -> None:
        """Close the arena and let its memory go without waiting on this thread for a pinning still in progress: a
        thread of its own (``datastates-arena-release``) waits for it, unpins, and only then drops the buffer. For an
        arena nothing was ever allocated from; use it no more."""
        self.close()
        # Detached, the finalizer no longer runs when the arena goes (perhaps on this thread, before the thread below
        # got to it); the thread holds the buffer, so that its memory outlives the unpinning.
        detached = None if self._unpin is None else self._unpin.detach()
        if detached is None:
            return
        _, unpin, _, _ = detached
        release = threading.Thread(
            target=_unpin_then_drop, args=(unpin, self.buffer), name="datastates-arena-release", daemon=True
        )
        release.start()

    def _take(self, size: int) -> int | None:
        for index, (offset, free_size) in enumerate(self._free):
            if free_size >= size:
                if free_size == size:
                    self._free.pop(index)
                else:
                    self._free[index] = (offset + size, free_size - size)
                return offset
        return None

    # ------------------------------------------------------------------ views
    def tensor(self, block: Block) -> torch.Tensor:
        """A ``uint8`` tensor over the block's bytes (a view: no copy)."""
        return self.buffer[block.offset : block.offset + block.nbytes]

    def memoryview(self, block: Block) -> memoryview:
        """A writable memoryview over the block's bytes, for ``os.pwrite`` and friends (no copy)."""
        return address_view(self.buffer.data_ptr() + block.offset, block.nbytes)

    # ------------------------------------------------------------------ pinning
    @property
    def page_locking(self) -> bool:
        """Whether the buffer is page-locked or being page-locked (made with a pinner that could take it)."""
        return self._pinning is not None

    @property
    def pinned(self) -> bool:
        """Whether the buffer is page-locked now (False until the background pinning is done, or without a pinner)."""
        return self._pinning is not None and self._pinning.pinned

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the buffer page-locked now, from its start (it is locked piece by piece, in address order)."""
        return 0 if self._pinning is None else self._pinning.pinned_bytes

    def wait_pinned(self, timeout_s: float | None = None) -> bool:
        """Wait until the background pinning ended (at most ``timeout_s``); whether the buffer is pinned then."""
        if self._pinning is not None:
            self._pinning.done.wait(timeout_s)
        return self.pinned

    @property
    def prefaulted_bytes(self) -> int:
        """Bytes of the buffer, from its start, mapped in ahead of the copies so far (0 where it is page-locked
        instead, or where the host cannot map ahead)."""
        return 0 if self._prefault is None else self._prefault.populated_bytes

    def wait_prefaulted(self, timeout_s: float | None = None) -> int:
        """Wait until the mapping ahead ended (at most ``timeout_s``); the bytes mapped then."""
        if self._prefault is not None:
            self._prefault.done.wait(timeout_s)
        return self.prefaulted_bytes

    # ------------------------------------------------------------------ accounting
    @property
    def waited_s(self) -> float:
        """Seconds allocations have spent waiting for space so far (back-pressure), in total."""
        with self._cond:
            return self._waited_s

    @property
    def used_bytes(self) -> int:
        """Bytes currently reserved."""
        with self._cond:
            return self._used_bytes

    @property
    def peak_used_bytes(self) -> int:
        """Most bytes ever reserved at once."""
        with self._cond:
            return self._peak_used_bytes


def _unpin_then_drop(unpin: Callable[[], object], buffer: torch.Tensor) -> None:
    """Body of :meth:`HostArena.discard`'s thread: ``buffer`` is released when this returns, after ``unpin``."""
    unpin()


def address_view(address: int, nbytes: int) -> memoryview:
    """A writable byte memoryview of ``nbytes`` bytes of host memory at ``address`` (no copy; valid while the memory
    it points into lives)."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
