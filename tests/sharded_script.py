"""A sharded CPU (gloo) run with DataStatesIO: ``ModelParallelStrategy`` + FSDP2, launched by tests/test_sharded.py.

``python tests/sharded_script.py OUT --world N [--epochs E] [--resume NAME] [--fail-rank R] [--hold-rank R]``

Lightning relaunches this script for ranks 1..N-1. The model's linear layers are sharded with ``fully_shard`` over N
ranks (two of them tied: one weight under two keys); ``ModelCheckpoint`` saves every step (top-2 by step, plus
``last.ckpt``) into ``OUT/ckpt``. At every save call each rank records, synchronously, its local shards of the model and
optimizer state and writes them to ``OUT/ref/step<k>/rank<r>.pt`` at once (a killed run leaves them too); after fit
it writes its final local shards to ``OUT/final/rank<r>.pt``.

Options: ``--resume NAME`` fits from ``NAME`` in the checkpoint directory (Lightning's sharded load); ``--fail-rank
R``: rank R's shard writes fail from its 3rd checkpoint on; ``--hold-rank R``: rank R's writes of its 3rd checkpoint
block forever after announcing ``OUT/held`` (a test then SIGKILLs the run); ``--sync``: Lightning's own synchronous
save instead of the plugin; ``--ckpt-dir D``: save into D (``s3://...`` with ``--storage-options JSON``);
``--on-flush-error warn``; ``--fail-staging-rank R``: rank R's 3rd sharded save fails while staging, on its training
thread; ``--no-last``: no ``last.ckpt``, so one save per step (a second save of a step would wait for the first's
copies, which these slowed copies make long, and hide a missing barrier). ``LDS_BROKEN=barrier``: the plugin's
barrier returns at once and each lazy copy waits until the optimizer has stepped after its save (the race a missing
barrier loses on a real model, lost here whatever the machine's load): the contract test must fail. Copies are
slowed (20 ms per lazily copied piece; not with ``--fsdp1``) so that they outlast a step, as on a real model. Each
rank writes the names of the threads DCP's planning collectives ran on to ``OUT/planning<r>.json``. ``--fsdp1``:
Lightning's ``FSDPStrategy(state_dict_type="sharded")`` instead (FSDP1, whose sharded state dicts hold
``ShardedTensor``s), see :class:`CpuFSDPStrategy`.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_datastates.pipeline as pipeline_module
import lightning_datastates.sharded.saver as saver_module
from lightning_datastates import DataStatesIO
from lightning_datastates.compat.torch import local_shard
from lightning_datastates.copy import copier as copier_module
from lightning_datastates.snapshot.engine import SnapshotEngine

WIDTH = 64


#: The linear layers whose weights are one parameter (two keys of the state dict, as a GPT's tied embedding and head).
TIED = (0, 2)


class ShardedMLP(L.LightningModule):
    """Three linear layers sharded over the data-parallel ranks (FSDP2, or FSDP1 with ``fsdp1``), the first and second
    with one weight."""

    def __init__(self, fsdp1: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fsdp1 = fsdp1
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1))
        self.layers[TIED[1]].weight = self.layers[TIED[0]].weight

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

        if self.fsdp1:
            # Wrapped here, so FSDPStrategy keeps the wrapping: FSDP1 needs the CPU named as its device on a machine
            # without an accelerator, and the strategy would pass none.
            cpu = torch.device("cpu")
            self.layers[3] = FullyShardedDataParallel(self.layers[3], device_id=cpu, use_orig_params=True)
            self.layers = FullyShardedDataParallel(self.layers, device_id=cpu, use_orig_params=True)
            return
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.layers[3], mesh=mesh)
        fully_shard(self.layers, mesh=mesh)  # the tied layers' parameters: one FSDP group holds the shared weight

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class CpuFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``, unchanged. Lightning refuses a CPU accelerator for FSDP only when the strategy's
    type is exactly ``FSDPStrategy``; FSDP1 itself trains on CPU over gloo, so this subclass lets the sharded FSDP path
    (save, load, ``ModelCheckpoint``) run on a CPU machine. The model wraps itself (``ShardedMLP(fsdp1=True)``)."""


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, WIDTH, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


def local_state(checkpoint: dict) -> dict[str, torch.Tensor]:
    """This rank's local shards of the model and optimizer state in ``checkpoint``, copied now."""
    state = {f"state_dict.{k}": _local(v) for k, v in checkpoint["state_dict"].items()}
    for fqn, values in checkpoint["optimizer_states"][0]["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                state[f"optimizer_0.state.{fqn}.{key}"] = _local(value)
    return state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of this rank's part of ``tensor``: a DTensor's local shard, a ``ShardedTensor``'s local shards (FSDP1;
    none where the tensor has fewer rows than there are ranks)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(tensor, ShardedTensor):
        shards = [shard.tensor for shard in tensor.local_shards()]
        return torch.cat(shards) if shards else torch.empty(0, *tensor.shape[1:], dtype=tensor.dtype)
    return local_shard(tensor).clone()


class Recorder(Callback):
    """The state at every save call (synchronous copies), written to ``OUT/ref/step<k>/rank<r>.pt`` at once: a run
    killed later leaves the records of its saves for the test to compare with."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        directory = os.path.join(self.out, "ref", f"step{trainer.global_step}")
        os.makedirs(directory, exist_ok=True)
        torch.save(local_state(checkpoint), os.path.join(directory, f"rank{trainer.global_rank}.pt"))


class StepGate(Callback):
    """``LDS_BROKEN=barrier``: holds each lazy copy until the optimizer has stepped after that copy's save.

    That is the race a missing barrier loses on a real model (copies outlast forward and backward); the sleeps alone
    lose it only while steps stay fast, so a loaded machine could hide the broken barrier. Held, every save but the
    last differs from its save call. Every save copies each lazy piece once, in save order (the broken barrier still
    closes the window in which later saves may share a copy): the n-th copy of a piece belongs to the n-th save. Used
    only in the broken variant: with the plugin's barrier a held copy would hold the barrier too (a copy is let go
    after ``HOLD_LIMIT_S``).
    """

    HOLD_LIMIT_S = 10.0

    def __init__(self) -> None:
        self._trainer: L.Trainer | None = None
        self._save_steps: list[int] = []
        self._copies: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._ended = threading.Event()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._trainer = trainer
        self._save_steps.append(trainer.global_step)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The last save has no step after it. Released before on_train_end, where the plugin's callback drains.
        if trainer.current_epoch + 1 >= (trainer.max_epochs or 0):
            self._ended.set()

    def hold(self, piece: tuple[int, int]) -> None:
        """On a copy thread: return once the optimizer stepped after the save this copy of ``piece`` (source address,
        offset) is for."""
        with self._lock:
            save = self._copies.get(piece, 0)
            self._copies[piece] = save + 1
        if self._trainer is None or save >= len(self._save_steps):
            return
        deadline = time.monotonic() + self.HOLD_LIMIT_S
        while self._trainer.global_step <= self._save_steps[save]:
            if self._ended.wait(0.001) or time.monotonic() > deadline:
                return


def skip_the_wait(engine: SnapshotEngine, attribute: bool = True) -> float:
    """``LDS_BROKEN=barrier``'s barrier: it closes the sharing window as the real one does, but waits for nothing."""
    engine._sharing.close_window()
    return 0.0


def slow_copies(gate: StepGate | None) -> None:
    """Each piece above 1 KiB (the lazily copied ones) waits 20 ms first: copies outlast a training step of this tiny
    model. With ``gate``, a lazy copy off the training thread then waits for the gate."""
    original = copier_module.CpuCopier.copy_pieces

    def slow_copy(self, block, pieces, sources, mark):  # type: ignore[no-untyped-def]
        crcs = {}
        for piece in pieces:
            if piece.nbytes > 1024:  # the lazy ones: the save call itself stays short
                time.sleep(0.02)
                if gate is not None and threading.current_thread() is not threading.main_thread():
                    gate.hold((sources[piece.key].data_ptr(), piece.source_offset))
            crcs.update(original(self, block, [piece], sources, mark))
        return crcs

    copier_module.CpuCopier.copy_pieces = slow_copy  # type: ignore[method-assign]


def faulty_shard_writes(out: str, rank: int, fail: bool) -> None:
    """From this rank's 3rd shard file on, every write fails (``fail``) or blocks forever after announcing it."""
    started = [0]
    announce_lock = threading.Lock()
    writer_for = pipeline_module.writer_for

    def faulty_writer_for(path: str, storage_options: Any = None, **kwargs: Any) -> Any:
        writer = writer_for(path, storage_options, **kwargs)
        begin = writer.begin

        def faulty_begin(target: str, total_bytes: int) -> Any:
            session = begin(target, total_bytes)
            if not target.endswith(".distcp"):
                return session
            started[0] += 1
            if started[0] < 3:
                return session

            def faulty_write(*args: Any) -> None:
                if fail:
                    raise OSError(28, "No space left on device (injected)")
                # Announce once, atomically (several writer threads get here): the test reads the pid at once.
                with announce_lock:
                    if not os.path.exists(os.path.join(out, "held")):
                        with open(os.path.join(out, "held.tmp"), "w") as handle:
                            handle.write(str(os.getpid()))
                        os.replace(os.path.join(out, "held.tmp"), os.path.join(out, "held"))
                threading.Event().wait()  # until the test kills this process

            session.write_range = faulty_write  # type: ignore[method-assign]
            session.write_checksummed_range = faulty_write  # type: ignore[method-assign]
            return session

        writer.begin = faulty_begin  # type: ignore[method-assign]
        return writer

    pipeline_module.writer_for = faulty_writer_for  # type: ignore[assignment]


def record_planning_threads() -> list[str]:
    """The names of the threads on which DCP plans a save (its gather and scatter of plans), in order."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    threads: list[str] = []
    reduce_scatter = _DistWrapper.reduce_scatter

    def recorded(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return reduce_scatter(self, *args, **kwargs)

    _DistWrapper.reduce_scatter = recorded  # type: ignore[method-assign]
    return threads


def failing_staging() -> None:
    """This rank's 3rd sharded save fails while staging (on its training thread)."""
    stage_shard = saver_module.stage_shard
    calls = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("staging failed (injected)")
        return stage_shard(*args, **kwargs)

    saver_module.stage_shard = failing  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume")
    parser.add_argument("--fail-rank", type=int)
    parser.add_argument("--hold-rank", type=int)
    parser.add_argument("--ckpt-dir", help="where ModelCheckpoint saves (default: OUT/ckpt)")
    parser.add_argument("--storage-options", help="DataStatesIO's storage_options, as JSON (for s3:// directories)")
    parser.add_argument("--on-flush-error", default="raise", help="DataStatesIO's on_flush_error")
    parser.add_argument("--fail-staging-rank", type=int)
    parser.add_argument("--no-last", action="store_true", help="no last.ckpt: one save per step")
    parser.add_argument("--sync", action="store_true", help="Lightning's own synchronous sharded save (no plugin)")
    parser.add_argument("--fsdp1", action="store_true", help="FSDPStrategy(state_dict_type='sharded'): FSDP1")
    args = parser.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(1)
    gate = StepGate() if os.environ.get("LDS_BROKEN") == "barrier" else None
    if not args.fsdp1:  # FSDP1's state dicts are copied in the save call: no lazy copy to slow down
        slow_copies(gate)
    if gate is not None:
        SnapshotEngine.wait_copies = skip_the_wait  # type: ignore[method-assign]
    planning_threads = record_planning_threads()
    if args.fail_staging_rank == rank:
        failing_staging()
    if args.fail_rank == rank or args.hold_rank == rank:
        faulty_shard_writes(args.out, rank, fail=args.fail_rank == rank)
    options = json.loads(args.storage_options) if args.storage_options else None
    # Weights and optimizer moments (8 KiB shards) are copied lazily; only the biases during the save call.
    plugin = DataStatesIO(storage_options=options, eager_copy_size="1KiB", on_flush_error=args.on_flush_error)
    recorder = Recorder(args.out)
    checkpoint_dir = args.ckpt_dir or os.path.join(args.out, "ckpt")
    checkpoint = ModelCheckpoint(
        dirpath=checkpoint_dir,
        every_n_train_steps=1,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=not args.no_last,
    )
    trainer = L.Trainer(
        default_root_dir=args.out,
        accelerator="cpu",
        devices=args.world,
        strategy=(
            CpuFSDPStrategy(state_dict_type="sharded")
            if args.fsdp1
            else ModelParallelStrategy(data_parallel_size=args.world, tensor_parallel_size=1)
        ),
        plugins=[] if args.sync else [plugin],
        callbacks=[checkpoint, recorder, *([gate] if gate is not None else [])],
        max_epochs=args.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    ckpt_path = f"{checkpoint_dir.rstrip('/')}/{args.resume}" if args.resume else None  # a URL too
    failure = None
    try:
        trainer.fit(ShardedMLP(fsdp1=args.fsdp1), loader(), ckpt_path=ckpt_path)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        failure = exc
    model = trainer.lightning_module
    final = {f"state_dict.{k}": local_shard(v).detach().clone() for k, v in model.state_dict().items()}
    os.makedirs(os.path.join(args.out, "final"), exist_ok=True)
    torch.save(final, os.path.join(args.out, "final", f"rank{rank}.pt"))
    with open(os.path.join(args.out, f"planning{rank}.json"), "w") as handle:
        json.dump(planning_threads, handle)
    with open(os.path.join(args.out, f"rank{rank}.result"), "w") as handle:
        handle.write("ok" if failure is None else f"{type(failure).__name__}: {failure}")
    # Lightning leaves the process group up at teardown; torch asks for it to be destroyed before exit. Left to the
    # interpreter's exit, gloo's threads were once torn down while running ("terminate called without an active
    # exception"), failing a run whose results were all written.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
