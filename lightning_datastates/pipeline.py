"""``CheckpointPipeline``: the wiring behind :class:`~lightning_datastates.DataStatesIO`.

The plugin shows Lightning's ``CheckpointIO`` and the user's ``config``, ``stats`` and ``drain()``; what it owns besides
lives here, one pipeline per plugin: the :class:`~lightning_datastates.snapshot.engine.SnapshotEngine` (made on first
use), one storage writer per protocol, the directories already cleaned, the sharded saver while a sharded strategy
saves through the plugin, and the callback that drives the barriers (its :class:`PluginOwner`). The pipeline hands
each checkpoint to the engine, orders loads and removals after pending writes, and turns background failures into
:class:`~lightning_datastates.errors.CheckpointFlushError`. It is the
:class:`~lightning_datastates.sharded.saver.SaverHost` of sharded saves.

The demo, the benchmark and the tests reach it through :func:`lightning_datastates.plugin.pipeline_of`; the callback
and the metrics, which know a Trainer, not the plugin, through :func:`lightning_datastates.registry.trainer_pipeline`.
This module does not import the plugin: the plugin registers each pipeline it makes
(:func:`lightning_datastates.registry.register_pipeline`). A pickled plugin (ddp_spawn, LightningCLI) gets a new
pipeline: engine, threads, writers and owner stay behind.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

import torch

from lightning_datastates.compat.lightning import (
    CheckpointPath,
    checkpoint_path_str,
)
from lightning_datastates.config import DataStatesConfig
from lightning_datastates.errors import CheckpointFlushError
from lightning_datastates.interrupts import sigint_deferred
from lightning_datastates.load.reader import load_checkpoint
from lightning_datastates.records.job import SnapshotStats
from lightning_datastates.records.stamp import SAVE_SEQUENCE, SaveStamp
from lightning_datastates.sharded.leftovers import clean_leftovers
from lightning_datastates.snapshot.engine import LazyPredicate, SnapshotEngine
from lightning_datastates.snapshot.pending import flush_error
from lightning_datastates.storage import StorageWriter, writer_for, writer_kind
from lightning_datastates.storage.removal import remove_checkpoint
from lightning_datastates.storage.stamps import observe_directory, observe_quietly, observe_stamp
from lightning_datastates.tiered.tiers import NOT_LOCAL, TieredCheckpoints

if TYPE_CHECKING:
    from lightning_datastates.sharded.saver import ShardedSaver

log = logging.getLogger("lightning_datastates")


class PluginOwner(Protocol):
    """What the plugin asks of the callback that drives its barriers (``DataStatesCallback``).

    The callback implements this and imports the plugin; the plugin and its pipeline know only this interface. Both
    members are read on the training thread, inside ``save_checkpoint``.
    """

    @property
    def in_training_loop(self) -> bool:
        """Whether fit's training loop runs, so that a barrier and the final drain are sure to follow a save."""

    def lazy_predicate(self) -> LazyPredicate | None:
        """Which storages may be copied after ``save_checkpoint`` returns; None when all must be copied in it."""


class CheckpointPipeline:
    """What a :class:`~lightning_datastates.DataStatesIO` owns and does, behind its public methods (see the module
    docstring). Every method runs on the training thread unless its docstring says otherwise.

    ``config`` is the plugin's own (the same object).
    """

    def __init__(self, config: DataStatesConfig) -> None:
        self.config = config
        self._engine: SnapshotEngine | None = None
        self._owner: PluginOwner | None = None
        self._cleaned_directories: set[str] = set()
        self._recovered_in_fit: set[str] = set()  # directories whose local copies this fit recovered (see clean_once)
        # One storage writer per protocol ("" for local paths), built on first use; on the training thread only.
        self._writers: dict[str, StorageWriter] = {}
        self._sharded: ShardedSaver | None = None  # set while a sharded strategy's saves go through the plugin
        self._tiers: TieredCheckpoints | None = None  # with local_tier: made on first use (config may change before)
        #: Set by the callback where a wrapper (``AsyncCheckpointIO``) queues saves before they reach the plugin:
        #: returns once those queued so far reached it (removals and loads are held back behind them).
        self.wait_for_queued_saves: Callable[[], None] | None = None

    # ------------------------------------------------------------------ the plugin's CheckpointIO methods
    def save_checkpoint(self, checkpoint: dict[str, Any], path: CheckpointPath) -> None:
        """:meth:`DataStatesIO.save_checkpoint <lightning_datastates.DataStatesIO.save_checkpoint>`: snapshot
        ``checkpoint`` and return (outside fit's training loop: once the file is committed)."""
        started = time.perf_counter()
        path = checkpoint_path_str(path)
        try:
            stats, awaits_commit = self._capture(checkpoint, path)
        except BaseException:
            # This save did not happen: a top-k removal right after it (with AsyncCheckpointIO, whose thread swallows
            # the error, training goes on) keeps its file, as after a skipped save.
            self.engine.pending.note_skipped(path)
            raise
        if awaits_commit:
            self.wait_for_commit(path)  # with a local tier: until the copy at path is committed
            # Nothing of the training loop follows to drain or tear down: the threads end now, as a synchronous save
            # leaves none behind (the next save starts them again).
            self._close()
        stats.save_call_s = time.perf_counter() - started

    def _capture(self, checkpoint: dict[str, Any], path: str) -> tuple[SnapshotStats, bool]:
        """The first part of :meth:`save_checkpoint`: report an earlier failure, clean the directory once, number the
        save and hand it to the engine (or the local tier); its stats, and whether the call must wait for the commit
        (:meth:`lazy_for_save`).

        Raises:
            CheckpointFlushError: an earlier save failed, or this one cannot be started (its cause chained).
            CheckpointCaptureError: the checkpoint cannot be pickled.
        """
        self.raise_pending_failure()
        writer = self.writer_for(path)
        directory = os.path.dirname(path) or "."
        lazy, awaits_commit = self.lazy_for_save()
        try:
            self.clean_once(directory)
            self.engine.pending.before_save(path)  # a removal of this path held back must not delete the new file
            # Which save this is, in the one order every "which copy is newest" follows (records/stamp.py); a
            # checkpoint without optimizer states (save_weights_only) is no resume point for ckpt_path="last".
            stamp = SAVE_SEQUENCE.next(resumable="optimizer_states" in checkpoint)
            with sigint_deferred():  # Ctrl+C must not split a capture (see interrupts.py)
                if self.tiers is not None:  # written to the local copy, replicated to path after its commit
                    stats = self.tiers.save(self.engine, checkpoint, path, lazy, awaits_commit, stamp)
                else:
                    stats = self.engine.capture(
                        checkpoint, path, writer, lazy, awaits_commit=awaits_commit, stamp=stamp
                    )
        except OSError as exc:
            raise CheckpointFlushError(f"cannot write checkpoint {path}: {exc}", path) from exc
        return stats, awaits_commit

    def wait_for_commit(self, path: str) -> None:
        """Return once the pending save of ``path`` (a file, or a sharded checkpoint's directory) is committed, and no
        copy reads the training state any more; raise its failure if it failed.

        Outside fit's training loop no later hook drains or reports: a save there behaves like ``TorchCheckpointIO``
        and returns once committed (``trainer.save_checkpoint(p)`` then ``torch.load(p)`` must work).

        Raises:
            CheckpointFlushError: the save of ``path`` failed.
        """
        try:
            self.engine.wait_path(path)
        finally:
            # Whatever ended the wait (even an interrupt), the state must not be read once this call returns.
            self.engine.wait_copies(attribute=False)
        if self._tiers is not None and (local_path := self._tiers.local_copy_of(path)) is not None:
            self.raise_pending_failure(local_path)  # the local write's own failure (the copy then had nothing to copy)
        self.raise_pending_failure(path)

    def load_checkpoint(self, path: CheckpointPath, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        """:meth:`DataStatesIO.load_checkpoint <lightning_datastates.DataStatesIO.load_checkpoint>`: load ``path``
        once any pending write of it has landed, from the host arena where it is still whole there. On the caller's
        thread (the training thread in a run)."""
        path = checkpoint_path_str(path)
        if self.wait_for_queued_saves is not None:
            self.wait_for_queued_saves()  # a save of path queued by a wrapper lands before the load reads it
        if self.tiers is not None:
            # The local copy where it is whole and current (it waits for a pending write of it, not for the copy).
            loaded = self.tiers.load(self._engine, path, partial(self._load_from, map_location, weights_only))
            if loaded is not NOT_LOCAL:
                return cast(dict[str, Any], loaded)
        loaded = self._load_from(map_location, weights_only, path, verify_checksums=self.config.verify_checksums)
        observe_quietly(self.writer_for(path), path)  # resumed from it: later saves come after it
        return loaded

    def _load_from(
        self, map_location: Any, weights_only: bool | None, path: str, verify_checksums: bool = True
    ) -> dict[str, Any]:
        """:meth:`load_checkpoint` of ``path`` as it is stored (a local tier's copy, or any checkpoint)."""
        if self._engine is not None:
            for name in _path_and_target(path):
                self._engine.wait_path(name)
                self.raise_pending_failure(name)
            resident = self._engine.open_resident(path)
            if resident is not None:
                # Served from the host arena: torch reads each storage with readinto, one copy into the new tensors.
                # No CRC check: these are the very bytes the CRC-32s were computed from while writing the file.
                with resident:
                    return torch.load(cast(IO[bytes], resident), map_location=map_location, weights_only=weights_only)
        return load_checkpoint(
            self.writer_for(path),
            path,
            map_location=map_location,
            weights_only=weights_only,
            verify_checksums=verify_checksums,
        )

    def remove_checkpoint(self, path: CheckpointPath) -> None:
        """:meth:`DataStatesIO.remove_checkpoint <lightning_datastates.DataStatesIO.remove_checkpoint>`: delete
        ``path`` at once, or (something pending) once every checkpoint saved before this call is committed."""
        path = checkpoint_path_str(path)
        writer = self.writer_for(path)
        if self.wait_for_queued_saves is not None:
            self.wait_for_queued_saves()  # the save queued before this removal (the new best) is held back behind
        if self.tiers is not None:  # both copies, once the saves before are on the persistent tier
            self.tiers.remove(self.engine, path, lambda: remove_checkpoint(writer, path))
            return
        if self._engine is None:
            remove_checkpoint(writer, path)
            return
        self._engine.remove_after_pending(path, lambda: remove_checkpoint(writer, path))

    def teardown(self) -> None:
        """:meth:`DataStatesIO.teardown <lightning_datastates.DataStatesIO.teardown>`: finish every pending write and
        stop the threads (they restart on the next use); failures found here are logged, and raised by the next call
        of the plugin or its callback."""
        if self._engine is None:
            return
        self._close()
        for failed in self._engine.pending.unreported_failures():
            log.error(
                "lightning_datastates: %s (raised as CheckpointFlushError by the next call of the plugin); earlier "
                "checkpoints are intact",
                flush_error(failed),
            )

    def _close(self) -> None:
        """Drain every pending save (sharded commits and replications included) and end the engine's and the
        replicator's threads; they start again on the next save."""
        self.engine.close()
        if self._tiers is not None:
            self._tiers.close()

    @property
    def stats(self) -> list[SnapshotStats]:
        """What recent checkpoints cost (most recent last): the plugin's ``stats``. Any thread."""
        return [] if self._engine is None else list(self._engine.history)

    def drain(self) -> None:
        """Wait until every pending checkpoint is committed or failed (sharded ones included): the plugin's
        ``drain()``."""
        if self._engine is not None:
            self._engine.drain()

    # ------------------------------------------------------------------ used by the callback and the demo
    @property
    def tiers(self) -> TieredCheckpoints | None:
        """The local tier (``local_tier``), made on first use; None without one."""
        if self._tiers is None and self.config.local_tier is not None:
            self._tiers = TieredCheckpoints(self.config, self.writer_for)
        return self._tiers

    def check_tiered(self, trainer: Any) -> None:
        """Refuse, at setup, a tiered run the local tier does not support (several nodes, a checkpoint directory inside
        the local tier, a local tier that cannot be written; sharded strategies are refused by
        :meth:`enable_sharded`).

        Raises:
            ConfigError: naming what is not supported.
        """
        if self.tiers is not None:
            self.tiers.check_supported(sharded=False, num_nodes=int(getattr(trainer, "num_nodes", 1) or 1))
            callbacks = getattr(trainer, "checkpoint_callbacks", [])
            dirpaths = [str(dirpath) for c in callbacks if (dirpath := getattr(c, "dirpath", None)) is not None]
            self.tiers.check_directories(dirpaths)

    @property
    def engine(self) -> SnapshotEngine:
        """The snapshot engine, created on first use (it is not pickled into spawned workers)."""
        if self._engine is None:
            self._engine = SnapshotEngine(self.config)
        return self._engine

    def lazy_for_save(self) -> tuple[LazyPredicate | None, bool]:
        """For a save now: which storages may be copied after the save call (the engine's ``lazy``), and whether the
        call must wait for the commit (``awaits_commit``: outside fit's training loop, where no barrier follows)."""
        owner = self._owner
        if owner is None or not owner.in_training_loop:
            # The call returns only once the file is committed, so nothing changes the state before then: everything
            # may be copied (or written straight from host memory) after the capture.
            return _every_storage, True
        return owner.lazy_predicate(), False

    def counts_as_existing(self, path: CheckpointPath, exists: bool) -> bool:
        """Whether ModelCheckpoint should see ``path`` as existing, as after a synchronous save or removal."""
        path = checkpoint_path_str(path)
        if self._engine is None:
            return exists
        pending = any(self._engine.pending.is_pending(name) for name in _path_and_target(path))
        return (exists or pending) and not self._engine.pending.is_removal_deferred(path)

    def prepare_arena(self, request_bytes: int, cuda_device: int | None = None) -> None:
        """Make the host arena before the first save, sized for checkpoints asking about ``request_bytes``, and
        page-locked in the background for copies from ``cuda_device`` (None: state on the CPU, not page-locked; see
        :meth:`SnapshotEngine.prepare_arena <lightning_datastates.snapshot.engine.SnapshotEngine.prepare_arena>`).
        Training thread, on a rank that saves through this plugin."""
        # A rank's shard files are read by DCP from storage, never from the arena: their blocks are freed once written.
        self.engine.prepare_arena(request_bytes, serve_loads=not self.saves_sharded, cuda_device=cuda_device)

    def prepare_planning(self, sample: Any) -> None:
        """Have the layout planner compare its fast path with ``torch.save`` on ``sample`` (the training state) before
        the first save, not during it (see :meth:`SnapshotEngine.prepare_planning
        <lightning_datastates.snapshot.engine.SnapshotEngine.prepare_planning>`). Training thread, on a rank that
        saves single files through this plugin."""
        self.engine.prepare_planning(sample)

    @property
    def saves_sharded(self) -> bool:
        """Whether every rank saves its own shards through this plugin now (sharded FSDP, ModelParallel)."""
        return self._sharded is not None

    def barrier(self) -> float:
        """Wait until no pending snapshot reads training state; return the seconds waited."""
        return 0.0 if self._engine is None else self._engine.wait_copies()

    def is_pending(self, path: CheckpointPath) -> bool:
        """Whether ``path`` has a checkpoint that is saved but not yet on storage (a sharded one: not yet committed)."""
        return self._engine is not None and self._engine.pending.is_pending(checkpoint_path_str(path))

    def raise_pending_failure(self, path: str | None = None) -> None:
        """Raise the oldest unreported background failure (of ``path`` if given) as ``CheckpointFlushError``.

        With ``on_flush_error="warn"`` the failures found by the hooks (no ``path``) are logged instead, once each.
        """
        if self._engine is None:
            return
        if path is None and self.config.on_flush_error == "warn":
            self._engine.pending.warn_failures()
            return
        failed = self._engine.pending.pop_failure(path)
        if failed is not None:
            error = flush_error(failed)
            raise error from error.__cause__

    def clean_once(self, directory: str) -> list[str]:
        """:meth:`clean_stale` of ``directory`` once per run, whoever asks first (the callback's setup or fit start, a
        single-file save, a sharded save's announcement); the paths removed (none when it was cleaned already)."""
        directory = directory.rstrip("/") or "/"
        if directory in self._cleaned_directories:
            if (
                self._tiers is not None
                and directory not in self._recovered_in_fit
                and self._tiers.needs_recovery(directory)
            ):
                self._recovered_in_fit.add(directory)  # once per fit: a store that is down is not asked at every save
                self._tiers.recover(self.engine, directory)  # copies this process gave up on: replicated now
            return []
        return self.clean_stale(directory)

    def clean_stale(self, directory: str) -> list[str]:
        """Remove what crashed runs left in ``directory`` (temporary files, open uploads, sharded saves that died,
        removals that died half-way), now; the paths removed."""
        directory = directory.rstrip("/") or "/"
        self._cleaned_directories.add(directory)
        self._recovered_in_fit.add(directory)
        removed = clean_leftovers(self.writer_for(directory), directory, self.config.stale_after_s)
        if removed:
            log.info("lightning_datastates: removed %d stale temporary file(s) in %s", len(removed), directory)
        observe_directory(self.writer_for(directory), directory)  # this run's saves come after what is there
        if self.tiers is not None:
            # After the cleanup (a dead run's upload aborted first): replicate the local copies it did not.
            self.tiers.recover(self.engine, directory)
        return removed

    def stamp_of(self, path: str) -> SaveStamp | None:
        """The save stamp of the committed file at ``path`` (None where it carries none), read through this plugin's
        storage; later saves are stamped after it (:meth:`SaveSequence.observe
        <lightning_datastates.records.stamp.SaveSequence.observe>`).

        Raises:
            FileNotFoundError: nothing at ``path``.
            IsADirectoryError: a directory (a sharded checkpoint).
        """
        return observe_stamp(self.writer_for(path), path)

    def arena_occupancy(self) -> float | None:
        """The fraction of the host arena that pending checkpoints hold; None before the first checkpoint sized it.

        Checkpoints kept for loading from memory (``serve_from_memory``) do not count: any new copy evicts them.
        """
        engine = self._engine
        if engine is None or engine.arena is None or engine.arena.size_bytes == 0:
            return None
        return engine.held_arena_bytes() / engine.arena.size_bytes

    def enable_sharded(self, strategy: Any) -> None:
        """Take over ``strategy``'s sharded saves (FSDP, ModelParallel through DCP): training thread of every rank,
        at setup, after the process group is up (it makes a gloo group for the commits: a collective)."""
        import torch.distributed as dist

        if self.tiers is not None:
            self.tiers.check_supported(sharded=True, num_nodes=1)  # raises: not supported yet
        from lightning_datastates.sharded.commit import DEFAULT_EXCHANGE_TIMEOUT
        from lightning_datastates.sharded.lightning import install
        from lightning_datastates.sharded.saver import ShardedSaver

        group = dist.new_group(backend="gloo", timeout=DEFAULT_EXCHANGE_TIMEOUT)
        self._sharded = ShardedSaver(self, dist.get_rank(), group, self.config.storage_alignment)
        install(strategy, self._sharded, self.drain, self.writer_for, self.config.storage_options)

    def disable_sharded(self, strategy: Any) -> None:
        """Undo :meth:`enable_sharded` once every pending sharded checkpoint is committed."""
        if self._sharded is None:
            return
        from lightning_datastates.sharded.lightning import uninstall

        self.drain()
        uninstall(strategy)
        self._sharded = None

    def attach(self, owner: PluginOwner) -> bool:
        """Let ``owner`` drive this plugin's barriers; False if another callback already does."""
        if self._owner is not None and self._owner is not owner:
            return False
        self._owner = owner
        self._recovered_in_fit = set()  # a new fit: copies given up since are recovered once more (clean_once)
        return True

    def detach(self, owner: PluginOwner) -> None:
        """Undo :meth:`attach`."""
        if self._owner is owner:
            self._owner = None

    def writer_for(self, path: str) -> StorageWriter:
        """The storage writer for ``path``'s protocol, built once per protocol and kept (on the training thread)."""
        kind = writer_kind(path)
        writer = self._writers.get(kind)
        if writer is None:
            writer = writer_for(path, self.config.storage_options, direct_io=self.config.direct_io)
            self._writers[kind] = writer
        return writer


def _every_storage(storage: Any) -> bool:
    return True


def _path_and_target(path: str) -> tuple[str, ...]:
    """``path``, and where it is a local symbolic link (``save_last="link"``) the file it names: a pending save of
    that file counts for the link (a load waits for it; ModelCheckpoint sees the link as existing, as it would once
    that file is committed)."""
    return tuple(dict.fromkeys((path, path if "://" in path else os.path.realpath(path))))
