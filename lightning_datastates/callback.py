"""``DataStatesCallback``: the barriers and error surfacing of :class:`~lightning_datastates.DataStatesIO`.

A snapshot's tensors are copied while training goes on, so training must wait wherever the saved state could
change next. This callback waits (a *barrier*) in ``on_before_optimizer_step`` and at the rarer points where
Lightning or other callbacks mutate state (epoch start, validation start, train end; see ``docs/design.md``,
"Where training waits"), and nowhere else: not at epoch or validation end, where nothing mutates the saved state
before the next of those points. It raises background write failures on the training thread at the next hook, and
drains every pending write at the end of fit and on exceptions. It has the host arena made before the first save, as
soon as its size is known (at train start with a ``host_cache``, else once the first optimizer step has created the
optimizer's state), on the ranks that save through the plugin.

The plugin adds it to the Trainers that save through a ``DataStatesIO`` (:func:`attach_callback`, run by
:mod:`~lightning_datastates.compat.trainer_hooks` when Lightning builds a Trainer's callbacks); no other Trainer sees
it. It keeps no state in checkpoints and tolerates being passed explicitly as well (the first instance to set up drives
the plugin, the others stay idle). It knows the plugin only through its pipeline
(:func:`~lightning_datastates.registry.trainer_pipeline`). No storage here.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any, NoReturn

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_datastates.capture.admission import state_request_bytes
from lightning_datastates.compat.lightning import (
    checkpoint_path_str,
    override_file_exists,
    restore_file_exists,
    restored_signal_handlers,
    unwrap_checkpoint_io,
    wait_for_queued_saves,
)
from lightning_datastates.compat.torch import local_shard, persistent_buffers, storage_identity
from lightning_datastates.compat.trainer_hooks import is_logging_step
from lightning_datastates.copy.pinning import cuda_device_of
from lightning_datastates.errors import CheckpointFlushError
from lightning_datastates.file_systems import adopt_file_systems
from lightning_datastates.interrupts import ignore_sigint_in_shutdown
from lightning_datastates.metrics import CheckpointMetrics
from lightning_datastates.pipeline import CheckpointPipeline
from lightning_datastates.progress import drain_on_interrupt, drain_with_progress
from lightning_datastates.registry import trainer_pipeline
from lightning_datastates.sharded.lightning import saves_with_dcp
from lightning_datastates.snapshot.engine import LazyPredicate
from lightning_datastates.strategies import bypass_reason, gathers_full_state, warn_if_bypassed

log = logging.getLogger("lightning_datastates")


class DataStatesCallback(Callback):
    """Barriers, failure reporting and draining for :class:`~lightning_datastates.DataStatesIO`.

    Users need not pass it: the plugin adds it to the Trainer that uses it (:func:`attach_callback`). Passing it
    explicitly is harmless. It is the plugin's :class:`~lightning_datastates.pipeline.PluginOwner`, and drives it
    through the plugin's pipeline.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pipeline: CheckpointPipeline | None = None
        self._trainer: Trainer | None = None
        self._armed = False  # inside the training loop, where the barriers below are guaranteed to run
        self._patched: list[ModelCheckpoint] = []
        self._arena_requested = False  # prepare_arena was called for this fit (or this rank saves nothing)
        self._planning_prepared = False  # prepare_planning likewise
        self._metrics = CheckpointMetrics()

    # ------------------------------------------------------------------ wiring
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Find the plugin; take charge of it unless another instance did; prepare ModelCheckpoint callbacks."""
        pipeline = trainer_pipeline(trainer)
        if pipeline is None or not pipeline.attach(self):
            return
        self._pipeline, self._trainer = pipeline, trainer
        if trainer.strategy.checkpoint_io is not unwrap_checkpoint_io(trainer.strategy.checkpoint_io):
            # AsyncCheckpointIO(DataStatesIO()): its saves reach the plugin later, on its own thread.
            pipeline.wait_for_queued_saves = partial(wait_for_queued_saves, trainer.strategy.checkpoint_io)
        pipeline.check_tiered(trainer)  # a local tier on several nodes: refused before anything is saved
        if saves_with_dcp(trainer.strategy):
            pipeline.enable_sharded(trainer.strategy)  # sharded FSDP and ModelParallel save through DCP: take them over
        warn_if_bypassed(trainer.strategy)  # DeepSpeed: its saves never reach the plugin
        self._metrics.start(pipeline)
        # Run our hooks first, so the barrier precedes other callbacks' mutations (SWA at epoch start, ...).
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, unannotated
        if callbacks and callbacks[0] is not self and self in callbacks:
            callbacks.remove(self)
            callbacks.insert(0, self)
        adopt_file_systems(trainer, pipeline.config.storage_options)  # before ModelCheckpoint's setup lists it
        for checkpoint_callback in trainer.checkpoint_callbacks:
            if isinstance(checkpoint_callback, ModelCheckpoint):
                self._patch_file_exists(checkpoint_callback, pipeline)
        self._clean_checkpoint_directories(trainer)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Clean the checkpoint directories that :meth:`setup` could not: a ``ModelCheckpoint`` derives its
        ``dirpath`` (from the logger) in its own setup, which Lightning runs after ours. A sharded checkpoint is
        restored after this hook (``restore_checkpoint_after_setup``), and a directory whose switch a dead run left
        half-way must be completed first: every rank waits here for rank 0's cleanup."""
        if self._pipeline is None:
            return
        self._clean_checkpoint_directories(trainer)
        if self._pipeline.saves_sharded:
            trainer.strategy.barrier("lightning_datastates: checkpoint directories cleaned")

    def _clean_checkpoint_directories(self, trainer: Trainer) -> None:
        """Rank 0: check that checkpoints can be written in each ``ModelCheckpoint``'s directory (a local path that is a
        file, an S3 bucket that does not exist, missing credentials: found now, before training, not at the first
        save), and remove what dead runs left there, once per directory and run.

        Raises:
            CheckpointFlushError: the directory cannot take checkpoints (the storage error chained, naming the fix).
        """
        if self._pipeline is None:
            return
        for checkpoint_callback in trainer.checkpoint_callbacks:
            if not isinstance(checkpoint_callback, ModelCheckpoint) or not checkpoint_callback.dirpath:
                continue
            # is_global_zero asked only where there is a directory to clean (a strategy half set up may not say)
            if trainer.is_global_zero:
                directory = str(checkpoint_callback.dirpath)
                check_checkpoint_directory(self._pipeline, directory)
                try:
                    self._pipeline.clean_once(directory)
                except OSError as exc:  # S3WriteError among them
                    raise _directory_error(directory, exc) from exc

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Undo :meth:`setup`, and tear the plugin down: drain, and end its threads. Lightning's strategy tears down
        its CheckpointIO as well, but a wrapper's teardown (``AsyncCheckpointIO``) does not reach the plugin inside;
        a save the wrapper hands over later is one outside the training loop, which ends its own threads."""
        pipeline = self._pipeline
        self._release()
        if pipeline is not None:
            pipeline.teardown()

    def _release(self) -> None:
        pipeline = self._pipeline
        if pipeline is None:
            return
        for checkpoint_callback in self._patched:
            restore_file_exists(checkpoint_callback)
        self._patched = []
        self._armed = False
        if self._trainer is not None:
            pipeline.disable_sharded(self._trainer.strategy)
        pipeline.wait_for_queued_saves = None
        pipeline.detach(self)
        self._pipeline, self._trainer = None, None

    @property
    def in_training_loop(self) -> bool:
        """Whether fit's training loop runs, so barriers and the final drain are guaranteed to follow a save."""
        return self._armed

    def lazy_predicate(self) -> LazyPredicate | None:
        """Which storages may be copied after ``save_checkpoint`` returns; None when all must be copied in it.

        Only parameters and optimizer state, and only inside the training loop of automatic optimization:
        those change in the optimizer step alone, which waits at ``on_before_optimizer_step``. Buffers (BatchNorm
        statistics change in every forward) and anything else are copied during the save call.
        """
        trainer = self._trainer
        if not self._armed or trainer is None or trainer.lightning_module is None:
            return None
        if not trainer.lightning_module.automatic_optimization:
            return None  # manual optimization may step an optimizer that fires no hook
        # Sharded parameters and optimizer state are DTensors: their local shards are what a save copies.
        tensors = itertools.chain(trainer.lightning_module.parameters(), optimizer_state_tensors(trainer))
        safe = {storage_identity(local_shard(tensor).untyped_storage()) for tensor in tensors}
        return lambda storage: storage_identity(storage) in safe

    def _prepare_arena(self, trainer: Trainer) -> None:
        """Once per fit, have the plugin make its host arena now, sized from the training state, on a rank that
        saves through it: the arena's page-locking (state on a GPU) then runs during training, not during the first
        checkpoint's copy. Where the estimate falls short (another callback saves large tensors), the first save
        makes the arena again, as without this."""
        pipeline = self._pipeline
        if pipeline is None or self._arena_requested:
            return
        self._arena_requested = True
        if not self._saves_own_state(trainer, pipeline):
            return
        state = checkpoint_state_tensors(trainer, with_optimizer_state=not _weights_only(trainer))
        try:
            # A rank saving shards copies their local parts.
            local = [local_shard(tensor) for tensor in state]
            request = state_request_bytes(local)
            cuda_device = cuda_device_of(tensor.device for tensor in local)
        except Exception as exc:  # noqa: BLE001 - only an early start: the first save makes the arena instead
            log.debug("lightning_datastates: no host arena made before the first save: %r", exc)
            return
        pipeline.prepare_arena(request, cuda_device)

    def _prepare_planning(self, trainer: Trainer) -> None:
        """Once per fit, after the first optimizer step (the optimizers' state exists): have the plugin compare its
        layout planner's fast path with ``torch.save`` on the model's and optimizers' state dicts now, on a rank that
        saves single files through it, so that this one-time comparison is not part of the first save call."""
        pipeline = self._pipeline
        if pipeline is None or self._planning_prepared:
            return
        self._planning_prepared = True
        if pipeline.saves_sharded or not self._saves_own_state(trainer, pipeline) or trainer.lightning_module is None:
            return
        sample: dict[str, Any] = {"state_dict": trainer.lightning_module.state_dict()}
        if not _weights_only(trainer):
            sample["optimizer_states"] = [optimizer.state_dict() for optimizer in trainer.optimizers]
        pipeline.prepare_planning(sample)

    @staticmethod
    def _saves_own_state(trainer: Trainer, pipeline: CheckpointPipeline) -> bool:
        """Whether this rank's saves of this fit reach the plugin and hold this rank's own training state."""
        strategy = trainer.strategy
        if bypass_reason(strategy) is not None or not trainer.checkpoint_callbacks:
            return False  # no save of this fit reaches the plugin (a manual save prepares itself, as before)
        # Otherwise this rank saves nothing, or saves state gathered from every rank: its own does not tell.
        return pipeline.saves_sharded or (trainer.is_global_zero and not gathers_full_state(strategy))

    # ------------------------------------------------------------------ barriers
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Arm lazy copies: from here on the barriers below run before any optimizer step."""
        self._check()
        self._armed = self._pipeline is not None
        self._arena_requested = False
        self._planning_prepared = False
        if self._pipeline is not None and self._pipeline.config.host_cache is not None:
            self._prepare_arena(trainer)  # its size is the user's: known now

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """No wait here (parameters do not change in forward); report a background failure, if any."""
        self._check()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the first optimizer step (the optimizers' state exists now), have the host arena made; this runs
        before ModelCheckpoint's save of the same batch (this callback runs first). At the steps where Lightning sends
        its rows to the loggers (``log_every_n_steps``), send the rows of the checkpoints committed since."""
        if self._pipeline is not None and is_logging_step(trainer):
            self._metrics.log_committed(trainer)
        if trainer.global_step >= 1:
            self._prepare_arena(trainer)
            self._prepare_planning(trainer)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        """The main barrier: the optimizer is about to update the state being copied."""
        self._barrier()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Barrier: callbacks such as StochasticWeightAveraging change weights here."""
        self._barrier()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Barrier: weight averaging callbacks swap weights in for validation."""
        self._barrier()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Barrier, and disarm: after training nothing guarantees another barrier. Then drain (with a progress bar),
        log the checkpoint metrics and print their summary while the loggers are still open."""
        self._barrier()
        self._armed = False
        if self._pipeline is not None:
            drain_with_progress(trainer, self._pipeline)
            self._metrics.finish(trainer, self._pipeline)  # on every rank, before a failure is raised: it syncs
            self._check()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Drain: every checkpoint of this fit is on storage (or its failure raised) when fit returns."""
        if self._pipeline is not None:
            self._pipeline.drain()
        self._check()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Drain (saying what it waits for; a further Ctrl-C abandons the writes in flight, see
        :func:`~lightning_datastates.progress.drain_on_interrupt`), attach background failures to the exception instead
        of raising over it, and let go of the plugin."""
        self._armed = False
        pipeline = self._pipeline
        if pipeline is None:
            return
        if isinstance(exception, KeyboardInterrupt):
            # Lightning exits after its teardown, which puts Python's SIGINT handler back first: a Ctrl-C then must
            # not kill the process by the signal (and cut the end of the drain's report, or a script's cleanup).
            ignore_sigint_in_shutdown(restored_signal_handlers(trainer))
        # Says what it waits for, with the drain bar; a further Ctrl-C abandons the writes in flight.
        drain_on_interrupt(trainer, pipeline.engine, exception)
        pipeline.drain()  # returns at once now: nothing outstanding, or abandoned
        while True:
            try:
                pipeline.raise_pending_failure()
                break
            except Exception as failure:  # noqa: BLE001 - reported as a note, never swallowed
                log.error("lightning_datastates: %s", failure)
                if sys.version_info >= (3, 11):  # notes are new in 3.11; on 3.10 the log line above is the report
                    exception.add_note(f"lightning_datastates: {failure}")
        self._release()  # Lightning calls no teardown hook of callbacks after an exception

    # ------------------------------------------------------------------ helpers
    def _barrier(self) -> None:
        if self._pipeline is not None:
            self._pipeline.barrier()
        self._check()

    def _check(self) -> None:
        if self._pipeline is not None:
            self._pipeline.raise_pending_failure()
            self._metrics.observe(self._pipeline)

    def _patch_file_exists(self, checkpoint_callback: ModelCheckpoint, pipeline: CheckpointPipeline) -> None:
        """Make ModelCheckpoint see files as a synchronous run would: pending saves exist, deferred removals don't.

        ModelCheckpoint picks version suffixes (``-v1``) by asking whether a file exists; a checkpoint still in
        flight must count, and one whose removal waits for newer checkpoints to land must not, or names would
        differ from a synchronous run.
        """
        override_file_exists(checkpoint_callback, pipeline.counts_as_existing, partial(_storage_unreachable, pipeline))
        self._patched.append(checkpoint_callback)


def _storage_unreachable(pipeline: CheckpointPipeline, path: Any, error: Exception) -> NoReturn:
    """``ModelCheckpoint`` could not ask storage whether ``path`` exists (it picks its file names so): a store that
    went away. Once the saves in flight ended (they fail against the same store, within their timeouts), raise the
    oldest failure among them, the cause; else this one, as a ``CheckpointFlushError`` naming ``path``.

    Raises:
        CheckpointFlushError: always.
    """
    path = checkpoint_path_str(path)
    pipeline.drain()
    pipeline.raise_pending_failure()  # with on_flush_error="warn" it logs them, and this one is raised below
    raise CheckpointFlushError(
        f"cannot ask storage whether {path} exists (ModelCheckpoint picks its file names so): {error!r}", path
    ) from error


def checkpoint_state_tensors(trainer: Trainer, with_optimizer_state: bool) -> Iterator[torch.Tensor]:
    """The tensors a checkpoint of ``trainer`` holds, as far as known before one is made: the module's parameters and
    persistent buffers, and (``with_optimizer_state``) the optimizers' state. Calls no ``state_dict``."""
    module = trainer.lightning_module
    yield from module.parameters()
    yield from persistent_buffers(module)
    if with_optimizer_state:
        yield from optimizer_state_tensors(trainer)


def optimizer_state_tensors(trainer: Trainer) -> Iterator[torch.Tensor]:
    """Every tensor of the trainer's optimizers' state (momentum, variance, step counters), as stored."""
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value


def check_checkpoint_directory(pipeline: CheckpointPipeline, directory: str) -> None:
    """Before training (the callback's setup, the resolution of ``ckpt_path="last"``): raise unless checkpoints can be
    written in ``directory`` (a local path that is a file; on S3 a bucket that does not exist, missing credentials),
    through the storage writer's :meth:`~lightning_datastates.storage.base.StorageWriter.check_directory`.

    Raises:
        CheckpointFlushError: naming the directory and the fix, the storage error chained.
    """
    try:
        pipeline.writer_for(directory).check_directory(directory)
    except OSError as exc:  # S3WriteError among them
        raise _directory_error(directory, exc) from exc


def _directory_error(directory: str, exc: OSError) -> CheckpointFlushError:
    detail = exc.strerror if exc.errno is not None and exc.strerror else str(exc)  # without "[Errno 20]"
    return CheckpointFlushError(
        f"checkpoint directory {directory} (ModelCheckpoint's dirpath), checked at setup: {detail}", directory
    )


def attach_callback(trainer: Trainer) -> None:
    """Give ``trainer`` a :class:`DataStatesCallback` if its strategy saves through a ``DataStatesIO`` (wrapped or
    not) and none is there yet; leave any other Trainer alone. Run by
    :func:`~lightning_datastates.compat.trainer_hooks.after_callbacks_configured` each time Lightning builds the
    callback list (Trainer init, start of every fit), on that thread; idempotent."""
    if trainer_pipeline(trainer) is None:
        return
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, unannotated
    if not any(isinstance(callback, DataStatesCallback) for callback in callbacks):
        callbacks.insert(0, DataStatesCallback())  # first: its barriers precede other callbacks' mutations


def _weights_only(trainer: Trainer) -> bool:
    """Whether every checkpoint callback of ``trainer`` saves weights only (no optimizer state)."""
    return all(getattr(callback, "save_weights_only", False) for callback in trainer.checkpoint_callbacks)
