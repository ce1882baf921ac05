"""What capture plans, on the training thread: the file layout of a checkpoint, and how its lazy part is copied.

Call order, inside :meth:`~lightning_datastates.snapshot.engine.SnapshotEngine.capture`:
  1) :meth:`LayoutPlanner.plan` first, before anything is written or admitted;
  2) :func:`eager_record_keys` once the checkpoint is admitted: which storages the save call copies before it returns;
  3) :func:`plan_lazy_copy` while the checkpoint is registered (its storages are shared with earlier checkpoints of
     the same barrier interval, and offered to later ones, :mod:`~lightning_datastates.copy.sharing`).
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_datastates.capture.layout import plan_layout, plan_serialized_layout, storage_alignment
from lightning_datastates.capture.verified import VerifiedStructures
from lightning_datastates.copy.sharing import SharedCopies
from lightning_datastates.errors import CheckpointCaptureError
from lightning_datastates.records.chunks import Chunk, plan_chunks
from lightning_datastates.records.job import SnapshotJob
from lightning_datastates.records.layout import CheckpointLayout, StorageRecord
from lightning_datastates.records.through import WRITE_THROUGH_CHUNK_BYTES, WriteThrough

log = logging.getLogger("lightning_datastates")


class LayoutPlanner:
    """Plans the layout of every checkpoint of one engine (``alignment``: the configured ``storage_alignment``;
    ``fast_path=False`` plans with ``torch.save`` only, to measure it)."""

    def __init__(self, alignment: int | None, fast_path: bool = True) -> None:
        self._alignment = alignment
        # Saves of one training run repeat a few archive structures: planned again, they skip the self-check, and
        # the fast path splices into them.
        self._verified_structures = VerifiedStructures(fast_path=fast_path)
        self._warned_fallback = False
        self._warned_refused = False

    def plan(self, checkpoint: dict[str, Any]) -> tuple[CheckpointLayout, list[torch.UntypedStorage]]:
        """The out-of-order layout and its storages; failing that, the checkpoint serialized by a plain
        ``torch.save`` now (no storages left to copy).

        Raises:
            CheckpointCaptureError: the checkpoint cannot be pickled.
        """
        try:
            planned = plan_layout(checkpoint, self._alignment, self._verified_structures)
            self._warn_if_fast_path_refused()
            return planned
        except Exception as reason:  # noqa: BLE001 - LayoutUnsupported, skip_data refused, or an object that cannot be pickled
            buffer = io.BytesIO()
            try:
                with storage_alignment(self._alignment):
                    torch.save(checkpoint, buffer)
            except Exception as exc:
                raise CheckpointCaptureError(
                    f"the checkpoint cannot be pickled: {exc!r}. Every value in the checkpoint dict "
                    "(hyperparameters, callback and datamodule state) must be picklable: remove or replace the "
                    "offending object (lambdas, open files, locks and generators are common culprits)."
                ) from exc
            if not self._warned_fallback:
                log.warning(
                    "lightning_datastates: cannot plan an out-of-order layout (%r); this checkpoint is serialized "
                    "with a plain torch.save into host memory during the save call instead (slower, still correct; "
                    "warned once). Tensors without plain storage (quantized, sparse) cause this: keep them out of the "
                    "checkpoint to save lazily.",
                    reason,
                )
                self._warned_fallback = True
            return plan_serialized_layout(buffer.getvalue()), []

    def confirm_fast_path(self, sample: Any) -> None:
        """Compare the fast path with ``torch.save`` on ``sample`` now (the training state: what checkpoints mostly
        hold), instead of at the first plan (see :func:`~lightning_datastates.capture.layout.plan_layout`). Nothing
        to do once compared; a sample the fast path does not take leaves the comparison to the first plan. Never
        raises: it only moves work out of the first save call."""
        verified = self._verified_structures
        if not verified.fast_path_open or verified.confirmed:
            return
        try:
            plan_layout(sample, self._alignment, verified)
        except Exception as exc:  # noqa: BLE001 - the first save plans (and reports) as without this
            log.debug("lightning_datastates: fast path not compared before the first save: %r", exc)
        self._warn_if_fast_path_refused()

    def _warn_if_fast_path_refused(self) -> None:
        refused = self._verified_structures.refused
        if refused is not None and not self._warned_refused:
            log.warning(
                "lightning_datastates: the save call's fast pickling did not reproduce torch.save %s (%s); checkpoints "
                "are planned with torch.save instead (correct, a slower save call; warned once). Please report this "
                "with your torch version.",
                torch.__version__,
                refused,
            )
            self._warned_refused = True


def eager_record_keys(
    records: Iterable[StorageRecord],
    storages: list[torch.UntypedStorage],
    lazy: Callable[[torch.UntypedStorage], bool] | None,
    eager_copy_size: int,
) -> set[int]:
    """The keys of the records whose storages the save call copies before it returns (the eager part); the other
    records are copied lazily, after it returned and before the next barrier.

    Eager: every record when there is no ``lazy`` predicate (no barrier follows the save call); a storage ``lazy``
    refuses (it may change before the barrier); and a host storage of at most ``eager_copy_size`` bytes, for which a
    ``memcpy`` now costs less than planning, sharing and writing it through later. A device storage that ``lazy``
    accepts is lazy whatever its size: copying it now would make the save call wait until the device reached the
    capture point, and for one copy per storage (an LLM has hundreds of small device tensors: biases, norms, their
    optimizer moments), where after the save call the copier issues those copies while forward and backward run.
    """
    if lazy is None:
        return {record.key for record in records}
    eager = set()
    for record in records:
        storage = storages[record.key]
        small_on_host = record.nbytes <= eager_copy_size and _in_host_memory(storage)
        if small_on_host or not lazy(storage):
            eager.add(record.key)
    return eager


def plan_lazy_copy(
    job: SnapshotJob,
    records: list[StorageRecord],
    storages: list[torch.UntypedStorage],
    sharing: SharedCopies,
    chunk_bytes: int,
    phase_bytes: int | None,
    write_through: bool,
    copier_wake: threading.Condition,
    awaits_commit: bool,
) -> None:
    """Plan ``job``'s lazy chunks from ``records``: storages an earlier checkpoint of this barrier interval copies are
    followed instead (one host copy serves both files); the rest are planned, and offered to later checkpoints.

    With ``write_through``, chunks of host tensors may be written straight from them (records/through.py), gated by a
    :class:`~lightning_datastates.records.through.WriteThrough` over ``copier_wake``; the copier races the writers
    unless the caller ``awaits_commit``.
    """
    if write_through:  # small chunks: a barrier waits for those being written (records/through.py)
        chunk_bytes = min(chunk_bytes, WRITE_THROUGH_CHUNK_BYTES)
    followed = sharing.follow(job, records, storages)
    job.lazy_chunks = plan_chunks((r for r in records if r.key not in followed), chunk_bytes, phase_bytes)
    sharing.offer(job, storages)
    host_chunks = [c for c in job.lazy_chunks if _all_in_host_memory(c, storages)] if write_through else []
    if host_chunks:
        job.write_through = WriteThrough(host_chunks, copier_wake, copier_races=not awaits_commit)


def _all_in_host_memory(chunk: Chunk, storages: list[torch.UntypedStorage]) -> bool:
    return all(_in_host_memory(storages[piece.key]) for piece in chunk.pieces)


def _in_host_memory(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` lies in host memory (copied by address, written straight from it)."""
    return storage.device.type == "cpu"
