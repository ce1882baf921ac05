"""Checkpoints whose every byte is still in host memory, served to loads without touching storage.

A chunk's arena block holds, once written, exactly the bytes that went into the file (and whose CRC-32s were
computed from it). Instead of freeing the block, the engine hands it here with, per job that wrote from it (its
owner and any sharing followers), the ``(block_offset, file_offset, nbytes)`` ranges that job wrote. Each job has
an *image*: the blocks it holds. At the job's commit its image is *published* under its path if the metadata, the
CRC-32 fields and the retained ranges tile the whole file; a load of that path then reads the image
(:meth:`ResidentCache.lease`) if the file on storage is still the one committed (a cheap fingerprint: a ``stat``, a
HEAD). No verification is needed there: these are the very bytes the CRC-32s were computed from while writing.

Memory: retained blocks are spare arena space, never extra memory. A block is referenced by the images holding it
and returns to the arena when none does. When an allocation finds no space, the arena asks :meth:`_reclaim` to
evict images oldest first, one per call, also images of jobs still being written (a checkpoint larger than the
arena streams through it and evicts its own earlier chunks: its image is then dead and never published). An image
being read (leased) is not evicted: it is *doomed* (no new leases) and goes when its last lease ends.

Locks: the arena calls :meth:`_reclaim` with its own lock held, so this cache never calls into the arena while
holding its lock: blocks to free are collected under the lock and freed after it is released; :meth:`_reclaim`
returns them to the arena, which frees them under its own lock.

Thread model: ``register`` on the training thread (capture), ``retain`` and ``settle`` on writer threads,
``drop_path``, ``lease`` and the leases' ``close`` on the training thread, ``_reclaim`` on whichever thread
allocates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_datastates.copy.arena import HostArena
from lightning_datastates.records.block import Block
from lightning_datastates.records.checksums import ChecksummingSession
from lightning_datastates.records.job import JobState, SnapshotJob
from lightning_datastates.storage.base import StorageWriter
from lightning_datastates.streams import SegmentReader

#: ``(block_offset, file_offset, nbytes)``: bytes of a block that a job wrote at ``file_offset`` of its file.
BlockRange = tuple[int, int, int]


@dataclass
class ResidentCounters:
    """Loads served from memory (``hits``) or not (``misses``: no image, or the file changed), images published,
    and images evicted to make room in the arena."""

    hits: int = 0
    misses: int = 0
    published: int = 0
    evictions: int = 0


@dataclass(eq=False)  # identity semantics: images are kept in lists and compared by identity
class _Image:
    """The arena blocks one job wrote from, and once published what else makes up its file."""

    writer: StorageWriter
    blocks: dict[Block, list[BlockRange]] = field(default_factory=dict)
    alive: bool = True  # False once evicted or dropped: it holds no blocks any more
    leases: int = 0
    doomed: bool = False  # to be dropped as soon as the last lease ends; no new leases
    path: str | None = None  # set when published
    total_bytes: int = 0
    fixed: tuple[tuple[int, bytes], ...] = ()  # metadata and CRC-32 fields: (file_offset, bytes)
    fingerprint: Hashable | None = None


class ResidentCache:
    """Retained arena blocks and the published images over them (see the module doc). Becomes ``arena``'s
    reclaim callback."""

    def __init__(self, arena: HostArena) -> None:
        self._arena = arena
        self._lock = threading.Lock()
        self._refs: dict[Block, int] = {}  # retained block -> number of live images holding it
        self._by_job: dict[int, _Image] = {}  # id(job) -> its image, from capture until its commit or drop
        self._published: dict[str, _Image] = {}
        self._order: list[_Image] = []  # live images, oldest first: the eviction order
        self.counters = ResidentCounters()
        arena.reclaim = self._reclaim

    # ------------------------------------------------------------------ engine hooks
    def register(self, job: SnapshotJob, writer: StorageWriter) -> None:
        """Start an (empty) image for ``job``, just captured; ``writer`` later fingerprints its file."""
        with self._lock:
            image = _Image(writer)
            self._by_job[id(job)] = image  # the engine holds the job until settle: its id is not reused before
            self._order.append(image)

    def retain(self, block: Block, holders: Sequence[tuple[SnapshotJob, list[BlockRange]]]) -> None:
        """``block`` was written into the files of ``holders`` (each with the ranges it wrote); keep it while their
        images live. With no live holder it goes back to the arena at once."""
        with self._lock:
            for job, ranges in holders:
                image = self._by_job.get(id(job))
                if image is not None and image.alive and ranges:
                    image.blocks[block] = ranges
                    self._refs[block] = self._refs.get(block, 0) + 1
            held = block in self._refs
        if held:
            self._arena.wake()  # an allocator waiting for space may evict this image now
        else:
            self._arena.free(block)

    def settle(self, job: SnapshotJob) -> None:
        """``job`` committed (publish its image if it is whole; it replaces the path's older image) or was dropped
        (drop its image). Called once per registered job, after ``complete`` or ``abort``."""
        committed = job.state is JobState.COMMITTED
        image = self._by_job.get(id(job))
        if image is None:
            return
        # Metadata only (a stat, a HEAD), and outside the lock: reclaim may need the lock meanwhile.
        fingerprint = _fingerprint(image.writer, job.path) if committed else None
        fields = job.session.written_fields() if isinstance(job.session, ChecksummingSession) else []
        with self._lock:
            del self._by_job[id(job)]
            old = self._published.pop(job.path, None) if committed else None  # the file it stood for is replaced
            to_free = [] if old is None else self._drop(old)
            image.fixed = tuple(sorted((*job.layout.metadata, *fields)))
            # Only images holding arena blocks: a checkpoint planned as one plain torch.save (no records) would
            # keep its whole serialized copy alive outside the arena's budget.
            if fingerprint is not None and image.alive and image.blocks and _tiles(image, job.layout.total_bytes):
                image.path, image.total_bytes, image.fingerprint = job.path, job.layout.total_bytes, fingerprint
                self._published[job.path] = image
                self.counters.published += 1
            else:
                to_free += self._drop(image)
        self._free(to_free)

    def drop_path(self, path: str) -> None:
        """Forget the image of ``path`` (the file is being removed)."""
        with self._lock:
            image = self._published.pop(path, None)
            to_free = [] if image is None else self._drop(image)
        self._free(to_free)

    # ------------------------------------------------------------------ loads
    def lease(self, path: str, fingerprint: Hashable | None = None) -> SegmentReader | None:
        """A reader over the image of ``path`` if there is one and the file on storage is still the one it was
        committed as; None otherwise. The image stays in the arena until the reader is closed.

        With ``fingerprint`` (a reader of one version of the file, the local tier's replicator: the one it opened),
        only the image committed as that version serves; another is left as it is."""
        with self._lock:
            image = self._published.get(path)
            if image is not None and fingerprint is not None and image.fingerprint != fingerprint:
                return None  # another version's image: not this reader's, and still good for loads
            if image is None or image.doomed:
                self.counters.misses += 1
                return None
            image.leases += 1  # not evictable while we ask storage for the fingerprint
        current = _fingerprint(image.writer, path)
        if current is None or current != image.fingerprint:
            with self._lock:
                self.counters.misses += 1
                if self._published.get(path) is image:
                    del self._published[path]
                image.doomed = True  # the file changed (or is gone): this image never serves again
            self._end_lease(image)
            return None
        segments: list[tuple[int, Any]] = list(image.fixed)
        for block, ranges in image.blocks.items():  # the lease keeps the blocks (and this dict) as they are
            view = self._arena.memoryview(block)
            segments += [(file_offset, view[start : start + n]) for start, file_offset, n in ranges]
        segments.sort(key=lambda segment: segment[0])
        with self._lock:
            self.counters.hits += 1
        return _LeasedReader(segments, image.total_bytes, lambda: self._end_lease(image))

    def published_paths(self) -> list[str]:
        """Paths whose checkpoint a load may be served from memory now (if the file is unchanged)."""
        with self._lock:
            return list(self._published)

    def evictable_bytes(self) -> int:
        """Arena bytes held only by retained images that no load is reading: space an allocation can reclaim."""
        with self._lock:
            leased = {block for image in self._order if image.leases for block in image.blocks}
            return sum(block.reserved_bytes for block in self._refs if block not in leased)

    # ------------------------------------------------------------------ internals
    def _end_lease(self, image: _Image) -> None:
        with self._lock:
            image.leases -= 1
            to_free = self._drop(image) if image.doomed and not image.leases else []
        self._free(to_free)
        self._arena.wake()  # a doomed image gone, or evictable again: waiting allocators look again

    def _reclaim(self) -> list[Block] | None:
        """The arena's reclaim callback (arena lock held): evict the oldest image no load is reading; return the
        blocks nobody holds any more, for the arena to free. Leased images in the way are doomed instead. None
        when nothing is left to evict."""
        with self._lock:
            for image in self._order:
                if not image.blocks:
                    continue  # evicting it frees nothing (a job whose chunks are not written yet)
                if image.leases:
                    image.doomed = True
                    if image.path is not None and self._published.get(image.path) is image:
                        del self._published[image.path]
                    continue
                if image.path is not None and self._published.get(image.path) is image:
                    del self._published[image.path]
                self.counters.evictions += 1
                return self._drop(image)
        return None

    def _drop(self, image: _Image) -> list[Block]:
        """Drop ``image`` (lock held): doom it if it is leased, else release its blocks; return those that no
        image holds any more (the caller frees them once the lock is released)."""
        if image.leases:
            image.doomed = True
            return []
        freed: list[Block] = []
        if image.alive:
            image.alive = False
            self._order.remove(image)
            for block in image.blocks:
                self._refs[block] -= 1
                if not self._refs[block]:
                    del self._refs[block]
                    freed.append(block)
            image.blocks = {}
        return freed

    def _free(self, blocks: list[Block]) -> None:
        for block in blocks:  # never under our lock: free() takes the arena's
            self._arena.free(block)


def _fingerprint(writer: StorageWriter, path: str) -> Hashable | None:
    """``writer.fingerprint(path)``; None (never serve) if storage cannot be asked now."""
    try:
        return writer.fingerprint(path)
    except Exception:  # noqa: BLE001 - a failed HEAD only means the file is read from storage
        return None


def _tiles(image: _Image, total_bytes: int) -> bool:
    """Whether the fixed segments and the retained ranges of ``image`` cover ``[0, total_bytes)`` exactly."""
    extents = [(offset, len(data)) for offset, data in image.fixed]
    extents += [(file_offset, n) for ranges in image.blocks.values() for _, file_offset, n in ranges]
    position = 0
    for offset, nbytes in sorted(extents):
        if offset != position:
            return False  # a gap (a chunk not retained) or an overlap
        position += nbytes
    return position == total_bytes


class _LeasedReader(SegmentReader):
    """A reader over a leased image; closing it (or collecting it) ends the lease, once."""

    def __init__(self, segments: list[tuple[int, Any]], size: int, end_lease: Callable[[], None]) -> None:
        self._end_lease: Callable[[], None] | None = end_lease
        super().__init__(segments, size)

    def close(self) -> None:
        """Stop reading and let the image go (the arena may reuse its blocks from now on)."""
        end_lease, self._end_lease = self._end_lease, None
        super().close()
        if end_lease is not None:
            end_lease()
