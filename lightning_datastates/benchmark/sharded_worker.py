"""One method's sharded training run, on every rank: the body of ``python -m lightning_datastates.benchmark.sharded
--worker METHOD``.

The parent (:mod:`lightning_datastates.benchmark.sharded`) starts rank 0; Lightning's launcher starts the other ranks
with the same command line. Each rank trains the GPT of :mod:`lightning_datastates.benchmark.choices` with every block
sharded by FSDP2 (``ModelParallelStrategy``, data parallel over ``--world`` processes), times each step on its
training thread, and writes ``rank<r>.json`` into the result directory: step durations, the steps that saved, its peak
resident memory and the CPU time of all its threads from step 2 on, and the bytes of its local shards (model and
optimizer state).

Methods (:data:`SHARDED_METHODS`): ``none`` (no checkpoints), ``sync`` (Lightning's own sharded save with DCP),
``dcp`` (``torch.distributed.checkpoint.async_save`` with a reused ``DefaultStager`` staging on its thread, a barrier
before the optimizer step, one save in flight at a time), ``datastates`` (``plugins=[DataStatesIO()]``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_datastates import DataStatesIO
from lightning_datastates._gpt import GPT
from lightning_datastates.benchmark.choices import MODELS, SEED
from lightning_datastates.benchmark.dcp import stager_survives_staging, staging_options
from lightning_datastates.benchmark.worker import peak_rss_bytes, process_cpu_s, reset_peak_rss, resident_bytes
from lightning_datastates.compat.torch import local_shard
from lightning_datastates.plugin import pipeline_of

#: The methods of the sharded benchmark, in the order of its report.
SHARDED_METHODS = ("none", "sync", "dcp", "datastates")
#: Steps before this one are warm-up: not timed, and the peak memory is reset when it starts.
WARMUP_STEPS = 2


class ShardedGPT(GPT):
    """The benchmark's GPT with each block, and the rest of the model, sharded over the data-parallel ranks."""

    def configure_model(self) -> None:
        """FSDP2: one ``fully_shard`` per block, then the root."""
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None, "ModelParallelStrategy sets the device mesh before configure_model"
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


class StepTimer(Callback):
    """Times each step on the training thread (batch start to next batch start: the save at batch end and the next
    barrier fall into it) and notes the steps at whose end ModelCheckpoint saved. Also the CPU time the process
    (every thread) had used when the first timed step began."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.saved_steps: list[int] = []
        self.cpu_at_start_s = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        """Start of a step (and, at the first timed step, a fresh peak-memory reading and the CPU time so far)."""
        _sync(trainer)
        self.starts.append(time.perf_counter())
        if len(self.starts) == WARMUP_STEPS + 1:
            reset_peak_rss()
            self.cpu_at_start_s = process_cpu_s()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of the current step."""
        self.saved_steps.append(len(self.starts) - 1)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """End of the last step (the final drain comes later and is not a step)."""
        _sync(trainer)
        self.starts.append(time.perf_counter())


def _sync(trainer: L.Trainer) -> None:
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.synchronize()


class AsyncDcpSaves(Callback):
    """The ``dcp`` method: the strategy's sharded save replaced by DCP's ``async_save`` (benchmark only).

    Installed at setup on every rank (it makes a gloo group for DCP's background collectives: a collective itself).
    At each save: wait for the previous upload (DCP takes one at a time), start ``async_save`` with a reused stager
    (pinned where CUDA is present; without DCP's ``DefaultStager``, torch 2.7, ``async_save`` stages on the training
    thread), and write Lightning's ``meta.pt`` on rank 0. The barrier before the optimizer step waits for staging.
    """

    def __init__(self) -> None:
        self.stager: Any = None
        self.staging: Any = None
        self.upload: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Replace the strategy's ``save_checkpoint`` on this rank."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import async_save

        # Without DCP's DefaultStager (torch 2.7), async_save stages on the calling thread: measured as it is.
        options = staging_options()
        staged_here = options is None
        if not staged_here:
            from torch.distributed.checkpoint.staging import DefaultStager

            reuse = stager_survives_staging()
        group = dist.new_group(backend="gloo")
        strategy = trainer.strategy

        def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
            path = os.fspath(strategy.broadcast(filepath))
            os.makedirs(path, exist_ok=True)
            state = {"state_dict": checkpoint.pop("state_dict")}
            state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
            if self.upload is not None:
                self.upload.result()
            if staged_here:
                response: Any = async_save(state, checkpoint_id=path, process_group=group)
            else:
                if self.stager is None or not reuse:
                    if self.stager is not None:
                        self.stager.close()
                    self.stager = DefaultStager(options)
                response = async_save(state, checkpoint_id=path, async_stager=self.stager, process_group=group)
            self.staging, self.upload = (
                (response.staging_completion, response.upload_completion)
                if hasattr(response, "staging_completion")
                else (None, response)
            )
            if trainer.global_rank == 0:
                torch.save(checkpoint, os.path.join(path, "meta.pt"))

        strategy.save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        """Barrier: staging must have read the state before the optimizer changes it."""
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Drain: the last upload."""
        if self.upload is not None:
            self.upload.result()
        if self.stager is not None:
            self.stager.close()


def _shard_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [local_shard(p) for p in model.parameters()]
    tensors += [local_shard(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _arena_figures(plugin: Any) -> dict[str, int | None] | None:
    """DataStatesIO's host arena on this rank: its size, peak use and resident pages in bytes (None for the other
    methods). The arena never gives pages back while it is open, so what is resident after ``fit`` is its peak: the
    part of the extra host memory the arena holds, measured directly, where the peak RSS moves with the rest of the
    process."""
    arena = pipeline_of(plugin).engine.arena if isinstance(plugin, DataStatesIO) else None
    if arena is None:
        return None
    return {
        "size_bytes": arena.size_bytes,
        "peak_used_bytes": arena.peak_used_bytes,
        "resident_bytes": resident_bytes(arena.buffer.data_ptr(), arena.size_bytes),
    }


def _engine_figures(stats: Any) -> dict[str, Any]:
    return {
        "save_call_s": stats.save_call_s,
        "barrier_wait_s": stats.barrier_wait_s,
        "arena_wait_s": stats.arena_wait_s,
        "copy_s": stats.copy_s,
        "durable_s": stats.durable_s,
    }


def run_rank(args: argparse.Namespace) -> None:
    """Train under ``args.worker`` on this rank; write ``rank<r>.json`` into ``args.result``."""
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    method = args.worker
    vocab, dim, layers, heads, seq_len, batch_size = MODELS[args.model]
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(vocab, (args.steps * batch_size * args.world, seq_len + 1), generator=generator)
    loader: Any = torch.utils.data.DataLoader(tokens, batch_size=batch_size)  # type: ignore[arg-type]
    L.seed_everything(SEED, verbose=False)
    timer = StepTimer()
    callbacks: list[Callback] = [timer]
    if method != "none":
        callbacks.append(ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.every, save_top_k=-1))
    if method == "dcp":
        callbacks.append(AsyncDcpSaves())
    cuda = torch.cuda.is_available() and args.accelerator in ("auto", "gpu", "cuda")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.world,
        strategy=ModelParallelStrategy(data_parallel_size=args.world, tensor_parallel_size=1),
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=method != "none",
        callbacks=callbacks,
        plugins=[DataStatesIO()] if method == "datastates" else None,
        num_sanity_val_steps=0,
    )
    model = ShardedGPT(vocab, dim, layers, heads, seq_len)
    trainer.fit(model, loader)
    # From the first timed step until fit returned: the final drain's copies and writes count, as they were caused by
    # the checkpoints of the timed steps.
    cpu_s = process_cpu_s() - timer.cpu_at_start_s
    rss = peak_rss_bytes()
    plugin = trainer.strategy.checkpoint_io
    durations = [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)]
    result = {
        "method": method,
        "rank": trainer.global_rank,
        "step_s": durations,
        "saved_steps": sorted(set(timer.saved_steps)),
        "peak_rss_bytes": rss,
        "cpu_s": cpu_s,
        "shard_bytes": _shard_bytes(model, trainer.optimizers[0]),
        "params": sum(p.numel() for p in model.parameters()),
        # DataStatesIO's own account of each checkpoint on this rank (what the training thread waited for, and why)
        "engine": [_engine_figures(stats) for stats in plugin.stats] if isinstance(plugin, DataStatesIO) else [],
        # The host arena's size and the most of it ever in use: how much of the extra memory the arena explains.
        "arena": _arena_figures(plugin),
    }
    os.makedirs(args.result, exist_ok=True)
    with open(os.path.join(args.result, f"rank{trainer.global_rank}.json"), "w") as out:
        json.dump(result, out)
