"""``DataStatesIO``: Lightning's ``CheckpointIO`` with lazy, asynchronous snapshots.

The plugin knows Lightning's checkpoint interface, not streams or bytes: it hands each checkpoint to the
:class:`~lightning_datastates.snapshot.engine.SnapshotEngine`, orders loads and removals after pending
writes, and turns background failures into :class:`~lightning_datastates.errors.CheckpointFlushError`.
Its companion :class:`~lightning_datastates.callback.DataStatesCallback` supplies the barriers.
"""

from __future__ import annotations

import logging
import os
import time
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

import torch
from lightning.pytorch.plugins.io import CheckpointIO

from lightning_datastates.compat.last_checkpoint import resolve_last_checkpoint
from lightning_datastates.compat.lightning import CheckpointPath, checkpoint_path_str, unwrap_checkpoint_io
from lightning_datastates.config import (
    DEFAULT_STALE_AGE_S,
    USER_SETTINGS,
    ArenaFullPolicy,
    DataStatesConfig,
    DirectIO,
    FlushErrorPolicy,
    Size,
)
from lightning_datastates.errors import CheckpointFlushError
from lightning_datastates.interrupts import sigint_deferred
from lightning_datastates.load.reader import load_checkpoint
from lightning_datastates.records.job import SnapshotStats
from lightning_datastates.sharded.leftovers import clean_leftovers
from lightning_datastates.snapshot.engine import LazyPredicate, SnapshotEngine
from lightning_datastates.snapshot.pending import flush_error
from lightning_datastates.storage import StorageWriter, writer_for, writer_kind
from lightning_datastates.storage.removal import remove_checkpoint

if TYPE_CHECKING:
    from lightning_datastates.sharded.saver import ShardedSaver

log = logging.getLogger("lightning_datastates")


class PluginOwner(Protocol):
    """What the plugin asks of the callback that drives its barriers (``DataStatesCallback``).

    The callback implements this and imports the plugin; the plugin knows only this interface. Both members are
    read on the training thread, inside ``save_checkpoint``.
    """

    @property
    def in_training_loop(self) -> bool:
        """Whether fit's training loop runs, so that a barrier and the final drain are sure to follow a save."""

    def lazy_predicate(self) -> LazyPredicate | None:
        """Which storages may be copied after ``save_checkpoint`` returns; None when all must be copied in it."""


def on_cpu(storage: Any, location: str) -> Any:
    """``map_location`` that keeps every storage on the CPU, where ``torch.load`` reads it: the default of
    :meth:`DataStatesIO.load_checkpoint`, as of Lightning's ``TorchCheckpointIO`` (a GPU checkpoint loads on a host
    without one, and the ranks of a multi-GPU run do not all load onto ``cuda:0``)."""
    return storage


class DataStatesIO(CheckpointIO):
    """Checkpoint without stalling training: ``Trainer(plugins=[DataStatesIO()])``.

    Inside fit's training loop, ``save_checkpoint`` snapshots the non-tensor part of the checkpoint and the
    tensors that may change before the next optimizer step, then returns; parameters and optimizer state are
    copied into a host arena while the next forward and backward run, and written to storage from there in the
    background, local files with direct I/O where the file system supports it (the end of fit waits for them).
    Anywhere else (``trainer.save_checkpoint`` after fit, ``validate``, the plugin used on its own) it returns once
    the file is committed, as Lightning's default does. Files are plain Lightning checkpoints, published atomically
    under their final name once complete.

    Args:
        host_cache: host memory for snapshots (bytes, or a string such as ``"8GiB"``). ``None`` (default) sizes it
            to hold two checkpoints, estimated after the first optimizer step (at least 64 MiB, at most half the
            available memory). Checkpoints larger than the arena stream
            through it; when it is full, the next copy waits for a flush to free space.
        writer_threads: threads writing to storage in parallel (default 4).
        chunk_size: most bytes copied and written as one piece (default ``"64MiB"``; at most a quarter of the
            arena is used).
        eager_copy_size: tensors in host memory of at most this size are copied inside ``save_checkpoint`` (default
            ``"64KiB"``): cheaper than scheduling them, and safe for small state that changes anywhere. Device
            (GPU) tensors are copied after the save call wherever the barrier covers them, whatever their size.
        storage_options: options for the fsspec file system of non-local paths (``s3://``, ``memory://``, ...),
            e.g. ``{"key": ..., "secret": ..., "endpoint_url": ...}``; used for saving, loading and removing.
            For ``s3://`` it also takes the multipart writer's ``part_size_bytes`` (default 16 MiB),
            ``max_concurrent_parts`` (8; parts uploaded, or ranges read on load, at once), ``retries`` (3),
            ``timeout_s`` (120) and ``read_range_bytes`` (bytes per ranged GET on load; default: the object split
            evenly over ``max_concurrent_parts`` ranges of 8 to 256 MiB).
        on_flush_error: ``"raise"`` (default): a checkpoint that fails to reach storage raises
            ``CheckpointFlushError`` on the training thread at the next hook; ``"warn"``: it is logged as a warning
            naming the path and the cause, and training goes on.
        on_arena_full: ``"wait"`` (default): a save whose copy needs arena space still held by earlier checkpoints
            waits for their flush (back-pressure); ``"skip"``: that checkpoint is skipped with a warning (nothing is
            written, and the removals it would allow are dropped, so older checkpoints stay).
        stale_after_s: temporary files of other hosts and open S3 uploads whose writer cannot be asked are removed
            once this old (default 3600); those of dead processes on this host at once.
        verify_checksums: check every record of a checkpoint against its CRC-32 before loading it (default True);
            a damaged file raises :class:`~lightning_datastates.errors.CheckpointCorruptError` naming the file and
            the record. Checksums are always written; False only skips the check on load.
        storage_alignment: ``None`` (default): torch's own record alignment (64 bytes), as ``torch.save``. A power
            of two (bytes, e.g. ``4096`` or ``"4KiB"``): every tensor's data starts at a file offset that is a
            multiple of it (the file stays a plain torch file, a little larger), so that with direct I/O no block is
            shared by two tensors; a Lustre stripe size (``"16MiB"``) pads each tensor more.
        direct_io: how local files are written. ``"auto"`` (default): on local disks and parallel file systems
            (ext4, XFS, btrfs, Lustre, GPFS, ...), whole aligned 4 KiB blocks with direct I/O (``O_DIRECT``: no copy
            into the page cache, no writeback later), the rest (each tensor's first and last partial block, the
            metadata) through the page cache; on network and FUSE file systems (NFS, SMB, ...) and tmpfs, or where
            the file system refuses direct I/O, everything through the page cache, quietly. ``True``: direct I/O
            on every file system that accepts it, with a warning once per directory where refused. ``False``:
            always the page cache (tensors already in host memory are then written straight from the training
            state where possible, see the README).
        serve_from_memory: keep each written checkpoint's bytes in the host arena until the space is needed
            (default True): loading a checkpoint still whole there (typically the newest) reads it from memory, not
            from storage, if the file on storage is unchanged since its commit (checked by a ``stat``, or a HEAD on
            S3). It never takes memory beyond ``host_cache``: new snapshots evict retained ones, oldest first.
            False: arena space is freed as soon as it is written.
    """

    def __init__(
        self,
        host_cache: Size | None = None,
        writer_threads: int = 4,
        chunk_size: Size = "64MiB",
        eager_copy_size: Size = "64KiB",
        storage_options: dict[str, Any] | None = None,
        verify_checksums: bool = True,
        on_flush_error: FlushErrorPolicy = "raise",
        on_arena_full: ArenaFullPolicy = "wait",
        stale_after_s: float = DEFAULT_STALE_AGE_S,
        storage_alignment: Size | None = None,
        serve_from_memory: bool = True,
        direct_io: DirectIO = "auto",
    ) -> None:
        # Every parameter is the DataStatesConfig field of the same name (tests/test_config.py checks): handed over by
        # name, so that the settings are spelled in two places only, this signature and the config's fields.
        settings = {name: value for name, value in locals().items() if name in USER_SETTINGS}
        super().__init__()
        self.config = DataStatesConfig(**settings)
        self._engine: SnapshotEngine | None = None
        self._owner: PluginOwner | None = None
        self._cleaned_directories: set[str] = set()
        # One storage writer per protocol ("" for local paths), built on first use; on the training thread only.
        self._writers: dict[str, StorageWriter] = {}
        self._sharded: ShardedSaver | None = None  # set while a sharded strategy's saves go through the plugin
        # Lightning resolves fit(ckpt_path="last") before any hook of ours runs, cannot at a URL, and takes a sharded
        # directory a dead save left torn: fixed for the Trainers that use a DataStatesIO (compat/last_checkpoint.py).
        resolve_last_checkpoint(_checkpoints_through_the_plugin)

    # ------------------------------------------------------------------ CheckpointIO
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: CheckpointPath, storage_options: Any | None = None
    ) -> None:
        """Snapshot ``checkpoint`` and return; it reaches ``path`` in the background.

        Raises:
            CheckpointFlushError: an earlier background write failed (raised once), or ``path`` cannot be written.
            CheckpointCaptureError: the checkpoint cannot be pickled; nothing is written.
        """
        if storage_options is not None:
            raise TypeError(
                "DataStatesIO does not take storage_options per save: drop `storage_options` from "
                "`Trainer.save_checkpoint(...)` and pass them once as `DataStatesIO(storage_options=...)`"
            )
        started = time.perf_counter()
        self.raise_pending_failure()
        path = checkpoint_path_str(path)
        writer = self.writer_for(path)
        directory = os.path.dirname(path) or "."
        lazy, awaits_commit = self.lazy_for_save()
        try:
            self.clean_stale(directory)
            self.engine.pending.before_save(path)  # a removal of this path held back must not delete the new file
            with sigint_deferred():  # Ctrl+C must not split a capture (see interrupts.py)
                stats = self.engine.capture(checkpoint, path, writer, lazy, awaits_commit=awaits_commit)
        except OSError as exc:
            raise CheckpointFlushError(f"cannot write checkpoint {path}: {exc}", path) from exc
        if awaits_commit:
            # Outside fit's training loop no later hook drains or reports: behave like TorchCheckpointIO and
            # return once the file is committed (`trainer.save_checkpoint(p)` then `torch.load(p)` must work).
            try:
                self.engine.wait_path(path)
            finally:
                # Whatever ended the wait (even an interrupt), the state must not be read once this call returns.
                self.engine.wait_copies(attribute=False)
            self.raise_pending_failure(path)
        stats.save_call_s = time.perf_counter() - started

    def load_checkpoint(
        self, path: CheckpointPath, map_location: Any | None = on_cpu, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load ``path`` once any pending write of it has landed; ``map_location`` and ``weights_only`` as torch's.

        Without ``map_location`` every tensor is loaded onto the CPU, as Lightning's ``TorchCheckpointIO`` does (its
        strategies pass none, and move the state to the device themselves); ``map_location=None`` is torch's own
        default, each tensor back onto the device it was saved from.

        Raises:
            CheckpointFlushError: the pending write of ``path`` failed.
            CheckpointCorruptError: ``path`` fails its integrity check (with ``verify_checksums``).
            FileNotFoundError: no checkpoint at ``path``.
        """
        path = checkpoint_path_str(path)
        if self._engine is not None:
            # A symbolic link (save_last="link") is read through to its target: a pending save of that file counts.
            for name in dict.fromkeys((path, path if "://" in path else os.path.realpath(path))):
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
            verify_checksums=self.config.verify_checksums,
        )

    def lazy_for_save(self) -> tuple[LazyPredicate | None, bool]:
        """For a save now: which storages may be copied after the save call (the engine's ``lazy``), and whether the
        call must wait for the commit (``awaits_commit``: outside fit's training loop, where no barrier follows)."""
        owner = self._owner
        if owner is None or not owner.in_training_loop:
            # The call returns only once the file is committed, so nothing changes the state before then: everything
            # may be copied (or written straight from host memory) after the capture.
            return _every_storage, True
        return owner.lazy_predicate(), False

    def remove_checkpoint(self, path: CheckpointPath) -> None:
        """Drop a pending write of ``path`` (or let a commit in progress end), then delete the file, or the sharded
        checkpoint's directory, in an order that no crash can leave torn (see ``storage/removal.py``).

        The deletion waits (in the background) until every checkpoint saved before this call is committed, single
        files and sharded directories alike, and is dropped if one of them fails: ModelCheckpoint removes the
        previous best right after saving the new one, which must not leave the run without a checkpoint.

        Raises:
            OSError: the removal ran at once (nothing pending) and failed; one carried out later is logged instead.
        """
        path = checkpoint_path_str(path)
        writer = self.writer_for(path)
        if self._engine is None:
            remove_checkpoint(writer, path)
            return
        self._engine.remove_after_pending(path, lambda: remove_checkpoint(writer, path))

    def counts_as_existing(self, path: CheckpointPath, exists: bool) -> bool:
        """Whether ModelCheckpoint should see ``path`` as existing, as after a synchronous save or removal."""
        path = checkpoint_path_str(path)
        if self._engine is None:
            return exists
        return (exists or self._engine.is_pending(path)) and not self._engine.is_removal_deferred(path)

    def teardown(self) -> None:
        """Finish every pending write and stop the threads (they restart if the plugin is used again).

        Failures found here are not raised (Lightning's own teardown must go on); they are logged and raised by
        the next call of this plugin or its callback.
        """
        if self._engine is None:
            return
        self._engine.close()  # drains every pending save, sharded commits included
        for failed in self._engine.unreported_failures():
            log.error(
                "lightning_datastates: %s (raised as CheckpointFlushError by the next call of the plugin); earlier "
                "checkpoints are intact",
                flush_error(failed),
            )

    # ------------------------------------------------------------------ used by the callback and the demo
    @property
    def engine(self) -> SnapshotEngine:
        """The snapshot engine, created on first use (it is not pickled into spawned workers)."""
        if self._engine is None:
            self._engine = SnapshotEngine(self.config)
        return self._engine

    @property
    def stats(self) -> list[SnapshotStats]:
        """What recent checkpoints cost (most recent last)."""
        return [] if self._engine is None else list(self._engine.history)

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

    def drain(self) -> None:
        """Wait until every pending checkpoint is committed or failed (sharded ones included)."""
        if self._engine is not None:
            self._engine.drain()

    def is_pending(self, path: CheckpointPath) -> bool:
        """Whether ``path`` has a checkpoint that is saved but not yet on storage (a sharded one: not yet committed)."""
        return self._engine is not None and self._engine.is_pending(checkpoint_path_str(path))

    def raise_pending_failure(self, path: str | None = None) -> None:
        """Raise the oldest unreported background failure (of ``path`` if given) as ``CheckpointFlushError``.

        With ``on_flush_error="warn"`` the failures found by the hooks (no ``path``) are logged instead, once each.
        """
        if self._engine is None:
            return
        if path is None and self.config.on_flush_error == "warn":
            self._engine.warn_failures()
            return
        failed = self._engine.pop_failure(path)
        if failed is not None:
            error = flush_error(failed)
            raise error from error.__cause__

    def clean_stale(self, directory: str) -> list[str]:
        """Remove what crashed runs left in ``directory`` (temporary files, open uploads, sharded saves that died,
        removals that died half-way): once per directory and run, whoever asks first (the callback's setup, a save)."""
        directory = directory.rstrip("/") or "/"
        if directory in self._cleaned_directories:
            return []
        self._cleaned_directories.add(directory)
        removed = clean_leftovers(self.writer_for(directory), directory, self.config.stale_after_s)
        if removed:
            log.info("lightning_datastates: removed %d stale temporary file(s) in %s", len(removed), directory)
        return removed

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

    # ------------------------------------------------------------------ pickling (ddp_spawn, LightningCLI)
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_engine=None, _owner=None, _cleaned_directories=set(), _writers={}, _sharded=None)
        return state


def _every_storage(storage: Any) -> bool:
    return True


def _checkpoints_through_the_plugin(trainer: Any) -> bool:
    """Whether ``trainer`` saves and loads through a :class:`DataStatesIO` (wrapped or not)."""
    return isinstance(unwrap_checkpoint_io(trainer.strategy.checkpoint_io), DataStatesIO)
