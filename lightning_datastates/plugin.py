"""``DataStatesIO``: Lightning's ``CheckpointIO`` with lazy, asynchronous snapshots.

The plugin knows Lightning's checkpoint interface, not streams or bytes: it shows ``CheckpointIO``'s methods and the
user's ``config``, ``stats`` and ``drain()``, and hands the rest to its
:class:`~lightning_datastates.pipeline.CheckpointPipeline`, which hands each checkpoint to the
:class:`~lightning_datastates.snapshot.engine.SnapshotEngine`, orders loads and removals after pending
writes, and turns background failures into :class:`~lightning_datastates.errors.CheckpointFlushError`.
Its companion :class:`~lightning_datastates.callback.DataStatesCallback` supplies the barriers: the plugin has it added
to every Trainer that saves through it, and to no other (:func:`~lightning_datastates.callback.attach_callback`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from lightning_datastates.callback import attach_callback, check_checkpoint_directory
from lightning_datastates.compat.last_checkpoint import LastOptions, resolve_last_checkpoint
from lightning_datastates.compat.lightning import CheckpointPath
from lightning_datastates.compat.trainer_hooks import after_callbacks_configured
from lightning_datastates.config import (
    DEFAULT_STALE_AGE_S,
    USER_SETTINGS,
    ArenaFullPolicy,
    DataStatesConfig,
    DirectIO,
    FlushErrorPolicy,
    Size,
)
from lightning_datastates.file_systems import adopt_file_systems
from lightning_datastates.pipeline import CheckpointPipeline
from lightning_datastates.records.job import SnapshotStats
from lightning_datastates.registry import register_pipeline, trainer_pipeline
from lightning_datastates.warning_display import show_warnings_plainly


def on_cpu(storage: Any, location: str) -> Any:
    """``map_location`` that keeps every storage on the CPU, where ``torch.load`` reads it: the default of
    :meth:`DataStatesIO.load_checkpoint`, as of Lightning's ``TorchCheckpointIO`` (a GPU checkpoint loads on a host
    without one, and the ranks of a multi-GPU run do not all load onto ``cuda:0``)."""
    return storage


class DataStatesIO(CheckpointIO):
    """Checkpoint without stalling training: Trainer(plugins=[DataStatesIO()]).

    Inside fit's training loop, ``save_checkpoint`` snapshots the non-tensor part of the checkpoint and the
    tensors that may change before the next optimizer step, then returns; parameters and optimizer state are
    copied into a host arena while the next forward and backward run, and written to storage from there in the
    background, local files with direct I/O where the file system supports it (the end of fit waits for them).
    Anywhere else (``trainer.save_checkpoint`` after fit, ``validate``, the plugin used on its own) it returns once
    the file is committed, as Lightning's default does, and its threads have ended. Files are plain Lightning
    checkpoints, published atomically under their final name once complete. A Trainer given this plugin gets the
    :class:`~lightning_datastates.DataStatesCallback` that drives it (passing one yourself is harmless).

    The first line and the arguments are plain text (no markup): LightningCLI shows them as they are in ``--help``.

    Args:
        host_cache: host memory for snapshots (bytes, or a string such as "8GiB"). None (default) sizes it
            to hold two checkpoints, estimated after the first optimizer step (at least 64 MiB, at most half the
            available memory). Checkpoints larger than the arena stream
            through it; when it is full, the next copy waits for a flush to free space.
        writer_threads: threads writing to storage in parallel (default 4).
        chunk_size: most bytes copied and written as one piece (default "64MiB"; at most a quarter of the
            arena is used).
        eager_copy_size: tensors in host memory of at most this size are copied inside save_checkpoint (default
            "64KiB"): cheaper than scheduling them, and safe for small state that changes anywhere. Device
            (GPU) tensors are copied after the save call wherever the barrier covers them, whatever their size.
        storage_options: options for the fsspec file system of non-local paths (s3://, memory://, ...),
            e.g. {"key": ..., "secret": ..., "endpoint_url": ...}; used for saving, loading and removing.
            For s3:// it also takes the multipart writer's part_size_bytes (default 16 MiB),
            max_concurrent_parts (8; parts uploaded, or ranges read on load, at once), retries (3; each retry
            logged as a warning), timeout_s (10: the longest the endpoint may stay silent while connecting or
            answering, and the limit of one attempt of a request that moves no data; an endpoint that never answers
            fails a request in about a minute), min_bytes_per_s (the slowest link tolerated, default "2MiB": an
            attempt moving n bytes may take timeout_s + n * max_concurrent_parts / min_bytes_per_s) and
            read_range_bytes (bytes per ranged GET on load; default: the object split evenly over
            max_concurrent_parts ranges of 8 to 256 MiB). ModelCheckpoint lists and checks its s3:// directory
            with these options too.
        on_flush_error: "raise" (default): a checkpoint that fails to reach storage raises
            CheckpointFlushError on the training thread at the next hook; "warn": it is logged as a warning
            naming the path and the cause, and training goes on.
        on_arena_full: "wait" (default): a save whose copy needs arena space still held by earlier checkpoints
            waits for their flush (back-pressure); "skip": that checkpoint is skipped with a warning (nothing is
            written, and the removals it would allow are dropped, so older checkpoints stay).
        stale_after_s: temporary files of other hosts and open S3 uploads whose writer cannot be asked are removed
            once this old (default 3600); those of dead processes on this host at once.
        verify_checksums: check every record of a checkpoint against its CRC-32 before loading it (default True);
            a damaged file raises CheckpointCorruptError naming the file and
            the record. Checksums are always written; False only skips the check on load.
        storage_alignment: None (default): torch's own record alignment (64 bytes), as torch.save. A power
            of two (bytes, e.g. 4096 or "4KiB"): every tensor's data starts at a file offset that is a
            multiple of it (the file stays a plain torch file, a little larger), so that with direct I/O no block is
            shared by two tensors; a Lustre stripe size ("16MiB") pads each tensor more.
        direct_io: how local files are written. "auto" (default): on local disks and parallel file systems
            (ext4, XFS, btrfs, Lustre, GPFS, ...), whole aligned 4 KiB blocks with direct I/O (O_DIRECT: no copy
            into the page cache, no writeback later), the rest (each tensor's first and last partial block, the
            metadata) through the page cache; on network and FUSE file systems (NFS, SMB, ...) and tmpfs, or where
            the file system refuses direct I/O, everything through the page cache, quietly. True: direct I/O
            on every file system that accepts it, with a warning once per directory where refused. False:
            always the page cache (tensors already in host memory are then written straight from the training
            state where possible, see docs/how-it-works.md, "The pipeline").
        serve_from_memory: keep each written checkpoint's bytes in the host arena until the space is needed
            (default True): loading a checkpoint still whole there (typically the newest) reads it from memory, not
            from storage, if the file on storage is unchanged since its commit (checked by a stat, or a HEAD on
            S3). It never takes memory beyond host_cache: new snapshots evict retained ones, oldest first.
            False: arena space is freed as soon as it is written.
        local_tier: a directory on node-local storage (NVMe) for tiered checkpoints, or None (default: one tier).
            Each checkpoint is committed there first (durable against a process crash within seconds), then
            copied behind training to its ModelCheckpoint path (S3, Lustre: durable against the loss of the node),
            which stays the checkpoint's name everywhere. Loads read the local copy where it is whole and current,
            else the persistent one; a run that dies before a copy finished has it finished by the next run on the
            node. Single-file checkpoints on one node (sharded strategies and several nodes are refused at setup).
            See the README, "Tiered checkpoints".
        local_keep: how many of the newest checkpoints of each directory the local tier keeps once replicated
            (default 2), the copy of each last checkpoint (last.ckpt) kept beside them; 0: each local copy goes
            once replicated, last.ckpt's too. Copies not yet replicated are always kept.
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
        local_tier: str | None = None,
        local_keep: int = 2,
    ) -> None:
        # Every parameter is the DataStatesConfig field of the same name (tests/test_config.py checks): handed over by
        # name, so that the settings are spelled in two places only, this signature and the config's fields.
        settings = {name: value for name, value in locals().items() if name in USER_SETTINGS}
        super().__init__()
        self._install_pipeline(DataStatesConfig(**settings))

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
        self._pipeline.save_checkpoint(checkpoint, path)

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
        loaded = self._pipeline.load_checkpoint(path, map_location, weights_only)
        tiers = self._pipeline.tiers
        if tiers is not None and tiers.last_local_read is not None:
            persistent, local, why = tiers.last_local_read
            # Lightning says "Restored ... from <persistent path>": say which copy that was, where users look.
            rank_zero_info(f"lightning_datastates: {persistent} was read from its local copy {local} ({why})")
        return loaded

    def remove_checkpoint(self, path: CheckpointPath) -> None:
        """Delete the file at ``path``, or the sharded checkpoint's directory, in an order that no crash can leave
        torn (see ``storage/removal.py``), once every checkpoint saved before this call is committed.

        The deletion waits (in the background) until every checkpoint saved before this call is committed, single
        files and sharded directories alike, and is dropped if one of them fails: ModelCheckpoint removes the
        previous best right after saving the new one, which must not leave the run without a checkpoint. Only then is
        a pending write of ``path`` itself cancelled (or a commit in progress let end): until then it may be the
        newest checkpoint there is.

        Raises:
            OSError: the removal ran at once (nothing pending) and failed; one carried out later is logged instead.
        """
        self._pipeline.remove_checkpoint(path)

    def teardown(self) -> None:
        """Finish every pending write and stop the threads (they restart if the plugin is used again).

        Failures found here are not raised (Lightning's own teardown must go on); they are logged and raised by
        the next call of this plugin or its callback.
        """
        self._pipeline.teardown()

    # ------------------------------------------------------------------ the user's
    @property
    def config(self) -> DataStatesConfig:
        """The settings, as given to the constructor (kept by the pipeline, which uses them)."""
        return self._pipeline.config

    @config.setter
    def config(self, config: DataStatesConfig) -> None:
        # Before the first save (the engine reads them once, when it is made), as tests and scripts do.
        self._pipeline.config = config

    @property
    def stats(self) -> list[SnapshotStats]:
        """What recent checkpoints cost (most recent last)."""
        return self._pipeline.stats

    def drain(self) -> None:
        """Wait until every pending checkpoint is committed or failed (sharded ones included)."""
        self._pipeline.drain()

    # ------------------------------------------------------------------ pipeline (subclasses), pickling
    def _install_pipeline(self, config: DataStatesConfig) -> None:
        """Make this plugin's pipeline (in ``__init__`` and in an unpickled copy, another process's) and what every
        Trainer that uses the plugin needs, installed once per process."""
        # The settings, the engine, the storage writers, the owner, the sharded saver: all of it (pipeline.py).
        self._pipeline = self._new_pipeline(config)
        register_pipeline(self, self._pipeline)  # how the callback and the hooks below find it from a Trainer
        # The callback that drives the barriers, in the Trainers that save through a DataStatesIO and no other.
        after_callbacks_configured(attach_callback)
        # Lightning resolves fit(ckpt_path="last") before any hook of ours runs, cannot at a URL, and takes a sharded
        # directory a dead save left torn: fixed for the Trainers that use a DataStatesIO (compat/last_checkpoint.py).
        resolve_last_checkpoint(_prepare_for_last)
        # Our warnings (back-pressure, a strategy that bypasses the plugin) as one line above the progress bar.
        show_warnings_plainly()

    def _new_pipeline(self, config: DataStatesConfig) -> CheckpointPipeline:
        """A new pipeline with settings ``config``: in ``__init__`` (before a subclass's own ``__init__`` goes on)
        and in an unpickled copy. A subclass may return a subclass of
        :class:`~lightning_datastates.pipeline.CheckpointPipeline` (the benchmark times its barrier this way)."""
        return CheckpointPipeline(config)

    # ddp_spawn, LightningCLI: the settings go along; the engine, its threads, the writers and the owner stay behind,
    # and the copy gets a new pipeline.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_pipeline"]
        state["config"] = self.config
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        config = state.pop("config")
        self.__dict__.update(state)
        self._install_pipeline(config)  # a spawned worker's own process: installed there too


def pipeline_of(plugin: DataStatesIO) -> CheckpointPipeline:
    """The wiring behind ``plugin`` (its engine, writers, barriers, sharded saves): how the callback, the metrics, the
    demo, the benchmark and the tests reach what ``DataStatesIO`` does not show. Any thread; the pipeline's methods
    name theirs."""
    return plugin._pipeline


def _prepare_for_last(trainer: Any) -> LastOptions | None:
    """For ``fit(ckpt_path="last")`` of a ``trainer`` that saves and loads through a :class:`DataStatesIO` (wrapped or
    not): its ``ModelCheckpoint``s look at the plugin's store (``file_systems.adopt_file_systems``), their
    directories are checked (:func:`~lightning_datastates.callback.check_checkpoint_directory`), and the plugin's
    ``stale_after_s`` and local tier; None (nothing done) for a Trainer without one.

    Raises:
        CheckpointFlushError: a checkpoint directory cannot take checkpoints (see ``check_checkpoint_directory``).
    """
    pipeline = trainer_pipeline(trainer)
    if pipeline is None:
        return None
    adopt_file_systems(trainer, pipeline.config.storage_options)
    for callback in trainer.checkpoint_callbacks:  # a missing bucket or credentials: said now, not by a listing
        dirpath = getattr(callback, "dirpath", None)
        if dirpath:
            check_checkpoint_directory(pipeline, str(dirpath))
    tiers = pipeline.tiers
    return LastOptions(pipeline.config.stale_after_s, pipeline.stamp_of, None if tiers is None else tiers.local_copies)
