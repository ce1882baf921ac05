"""Admission of a capture into the host arena: how much arena the first checkpoint asks for, and whether a save
starts now, waits, or is skipped (``on_arena_full``).

Call order, on the training thread:
  0) optionally, before any capture (after the first optimizer step, when the state's size is known):
     :func:`prepare_arena`, sized by :func:`state_request_bytes` of the training state, so that the arena is made
     and page-locked (state on a GPU; off the training thread) before the first checkpoint needs it;
then inside capture (:mod:`~lightning_datastates.snapshot.engine`):
  1) :func:`open_arena` on the first capture, sized by :func:`arena_request_bytes` of its checkpoint; it takes the
     prepared arena where that one was sized for at least this checkpoint (:meth:`PreparedArena.serves`);
  2) :func:`admit` for every capture: None to go on, or why the save is skipped;
  3) :func:`skipped_stats` for a skipped save (nothing is written).
The decisions themselves (:func:`pending_limit`, :func:`arena_shortfall`) are pure functions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from lightning_datastates.alignment import PAGE_ALIGNMENT_BYTES
from lightning_datastates.compat.torch import storage_identity
from lightning_datastates.config import DataStatesConfig
from lightning_datastates.copy import pinning, sizing
from lightning_datastates.copy.arena import HostArena
from lightning_datastates.load.resident import ResidentCache
from lightning_datastates.records.job import JobState, SnapshotJob, SnapshotStats
from lightning_datastates.records.layout import CheckpointLayout

log = logging.getLogger("lightning_datastates")

#: At most this many checkpoints per writer thread are in flight (captured, not yet committed or dropped): each holds
#: an open write session and its metadata; beyond it a save waits (or is skipped, with on_arena_full="skip").
PENDING_PER_WRITER = 2


def arena_request_bytes(layout: CheckpointLayout) -> int:
    """Arena bytes to ask for a checkpoint of ``layout``: its payload, plus room for the padding of chunk planning
    (pieces placed in phase for direct I/O, blocks rounded up to pages), so that a checkpoint the size of the default
    arena fits in it whole and the copy never waits."""
    return _padded(layout.payload_bytes, len(layout.records))


def _padded(payload_bytes: int, records: int) -> int:
    """``payload_bytes`` of ``records`` storages plus two pages per record and two more: the padding chunk planning
    may add (pieces placed in phase, blocks rounded up to pages)."""
    return payload_bytes + (records + 1) * 2 * PAGE_ALIGNMENT_BYTES


#: A prepared arena serves a first checkpoint up to this fraction larger than the state it was sized for (other
#: callbacks' small tensors, a grad scaler's state); beyond, it would hold noticeably fewer checkpoints than the rule
#: asks, so it is replaced.
PREPARED_TOLERANCE = 1 / 16


def state_request_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Arena bytes to ask for a checkpoint of ``tensors`` (the model's parameters and buffers and the optimizers'
    state), before any checkpoint is planned: their distinct storages' bytes, padded as :func:`arena_request_bytes`
    pads a planned one. An estimate: a checkpoint may hold more (another callback's tensors)."""
    storages = {storage_identity(s): s.nbytes() for s in (t.untyped_storage() for t in tensors)}
    return _padded(sum(storages.values()), len(storages))


@dataclass(frozen=True)
class PreparedArena:
    """An arena made before the first capture (:func:`prepare_arena`), the request it was sized for, and the CUDA
    device it was page-locked for (None: not page-locked)."""

    arena: HostArena
    request_bytes: int
    cuda_device: int | None = None

    def serves(self, request_bytes: int, config: DataStatesConfig, cuda_device: int | None = None) -> bool:
        """Whether the first checkpoint, asking ``request_bytes`` with copies from ``cuda_device``, is served by this
        arena: always with a ``host_cache`` (the size is the user's), else when the estimate fell short by at most
        :data:`PREPARED_TOLERANCE`; and only if it is page-locked where that checkpoint's copies come from a GPU."""
        if cuda_device is not None and self.cuda_device is None:
            return False
        return config.host_cache is not None or request_bytes <= self.request_bytes * (1 + PREPARED_TOLERANCE)


def prepare_arena(
    config: DataStatesConfig, request_bytes: int, keeps_written: bool = True, cuda_device: int | None = None
) -> PreparedArena:
    """An arena for checkpoints asking about ``request_bytes``, made now, before the first capture: its pinning
    (state on ``cuda_device``; None: on the CPU, no pinning) then runs while training does, and ends before the first
    checkpoint is copied. ``keeps_written``: whether written checkpoints stay in it for loading (see
    :func:`~lightning_datastates.copy.sizing.checkpoints_mapped_ahead`)."""
    return PreparedArena(_new_arena(config, request_bytes, keeps_written, cuda_device), request_bytes, cuda_device)


def open_arena(
    config: DataStatesConfig,
    request_bytes: int,
    prepared: PreparedArena | None = None,
    keeps_written: bool = True,
    cuda_device: int | None = None,
) -> tuple[HostArena, ResidentCache | None]:
    """The host arena for ``request_bytes`` as ``config`` sizes it (``keeps_written`` and ``cuda_device`` as for
    :func:`prepare_arena`), and, with ``serve_from_memory``, the resident cache over it. The ``prepared`` arena where it
    serves this checkpoint; otherwise it is discarded (its unpinning runs on a thread of its own) and a new one made."""
    if prepared is not None and prepared.serves(request_bytes, config, cuda_device):
        arena = prepared.arena
    else:
        if prepared is not None and cuda_device is not None and prepared.cuda_device is None:
            log.info(
                "lightning_datastates: the first checkpoint is copied from GPU %d, and the host arena made before it "
                "was not page-locked (the training state was on the CPU then); the arena is made again for it",
                cuda_device,
            )
            prepared.arena.discard()
        elif prepared is not None:
            log.info(
                "lightning_datastates: the first checkpoint asks %.1f MiB of host arena, more than the %.1f MiB "
                "estimated from the training state; the arena is made again for it",
                request_bytes / 2**20,
                prepared.request_bytes / 2**20,
            )
            prepared.arena.discard()
        arena = _new_arena(config, request_bytes, keeps_written, cuda_device)
    resident = ResidentCache(arena) if config.serve_from_memory else None
    return arena, resident


def _new_arena(config: DataStatesConfig, request_bytes: int, keeps_written: bool, cuda_device: int | None) -> HostArena:
    # Page-locked memory lets the CUDA copy engine write straight into the arena, asynchronously; it is locked on a
    # thread of its own (copy/pinning.py), never on the training thread. Elsewhere the pages the first checkpoints
    # use (those that routinely sit in the arena together) are mapped in ahead of their copies, also on a thread of
    # its own (copy/prefault.py); the rest of the arena is mapped as copies first write it.
    keeps_written = keeps_written and config.serve_from_memory
    prefault_bytes = sizing.checkpoints_mapped_ahead(keeps_written) * request_bytes
    arena = HostArena(config.arena_bytes_for(request_bytes), pinning.default_pinner(cuda_device), prefault_bytes)
    log.info("lightning_datastates: host arena of %.1f MiB allocated", arena.size_bytes / 2**20)
    return arena


def pending_limit(writer_threads: int) -> int:
    """How many checkpoints may be in flight at once with ``writer_threads`` writers."""
    return max(2, PENDING_PER_WRITER * writer_threads)


def arena_shortfall(payload_bytes: int, arena_bytes: int, held_bytes: int) -> str | None:
    """Why a checkpoint of ``payload_bytes`` would wait for arena space that earlier checkpoints hold (``held_bytes``
    of ``arena_bytes``), or None if it would not."""
    if held_bytes and arena_bytes - held_bytes < min(payload_bytes, arena_bytes):
        return f"the host arena ({arena_bytes} bytes) holds {held_bytes} bytes of earlier checkpoints"
    return None


@dataclass(frozen=True)
class Admission:
    """What :func:`admit` decided: why the save is skipped (None: it goes on), and how long it waited first."""

    skip_reason: str | None
    waited_s: float = 0.0


def admit(
    layout: CheckpointLayout,
    arena: HostArena,
    config: DataStatesConfig,
    may_skip: bool,
    in_flight: Callable[[], list[SnapshotJob]],
    held_bytes: Callable[[], int],
) -> Admission:
    """Bound the checkpoints in flight before a new one starts: whether it is skipped, and the time waited.

    ``on_arena_full="wait"``: wait while too many checkpoints are in flight (the arena then makes the copy wait for
    space, back-pressure). ``"skip"``: skip this one instead of waiting, also when earlier checkpoints hold arena space
    this one needs; only saves inside the training loop (``may_skip``) are ever skipped, never a save the caller waits
    for.

    Args:
        in_flight: the checkpoints captured and not yet finished, oldest first.
        held_bytes: arena bytes pending checkpoints hold (retained ones give their space up on demand: not counted).
    """
    limit = pending_limit(config.writer_threads)
    skip = may_skip and config.on_arena_full == "skip"
    waited_since = None
    while len(pending := in_flight()) >= limit:
        if skip:
            return Admission(f"{len(pending)} earlier checkpoints are still being written")
        waited_since = waited_since or time.perf_counter()
        pending[0].finished.wait()
    waited_s = 0.0 if waited_since is None else time.perf_counter() - waited_since
    shortfall = arena_shortfall(layout.payload_bytes, arena.size_bytes, held_bytes()) if skip else None
    return Admission(shortfall, waited_s)


def skipped_stats(path: str, layout: CheckpointLayout, started_at: float, reason: str) -> SnapshotStats:
    """The stats of a checkpoint skipped by ``on_arena_full="skip"`` (``reason``: from :func:`admit`), logged."""
    log.warning(
        "lightning_datastates: skipped checkpoint %s (on_arena_full='skip'): %s; storage is slower than saves",
        path,
        reason,
    )
    return SnapshotStats(path, layout.total_bytes, layout.payload_bytes, started_at, state=JobState.SKIPPED.value)
