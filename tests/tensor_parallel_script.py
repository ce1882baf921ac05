"""A CPU (gloo) run of 4 ranks on one 2-D mesh, tensor parallelism and FSDP2 or HSDP, launched by
tests/test_sharded.py.

``python tests/tensor_parallel_script.py OUT [--sync] [--hsdp]``

Lightning relaunches this script for ranks 1-3. ``ModelParallelStrategy`` with a mesh of 2 data-parallel by 2
tensor-parallel ranks (rank = 2 * data-parallel coordinate + tensor-parallel coordinate): the first linear layer is
split by columns, the second by rows (its bias replicated), the norm and the head are replicated over the
tensor-parallel dimension; then FSDP2 shards everything over the data-parallel dimension. So every replicated tensor's
local shard is held by the two ranks of one data-parallel coordinate. ``ModelCheckpoint`` saves every step, all kept,
into ``OUT/ckpt``: through the plugin, or with ``--sync`` through Lightning's own synchronous sharded save. With
``--hsdp`` no tensor parallelism: FSDP2 shards every parameter over the second mesh dimension and replicates it over
the first (HSDP), so ranks r and r + 2 hold the same shards. Each rank
writes the keys of the items it staged for each save (its file's content) to ``OUT/staged<rank>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_datastates.sharded.saver as saver_module
from lightning_datastates import DataStatesIO

WIDTH = 32
WORLD = 4
#: The parameters replicated over the tensor-parallel dimension (held by ranks 2k and 2k + 1).
REPLICATED = ("layers.3.weight", "layers.3.bias", "layers.4.weight", "layers.4.bias", "layers.2.bias")
#: With ``--hsdp``, every parameter, replicated over the first mesh dimension (held by ranks r and r + 2).
HSDP_REPLICATED = tuple(f"layers.{i}.{name}" for i in (0, 2, 3, 4) for name in ("weight", "bias"))


class TensorParallelMLP(L.LightningModule):
    """Column- then row-parallel linear layers, then a replicated norm and head; all sharded by FSDP2."""

    def __init__(self, hsdp: bool = False) -> None:
        super().__init__()
        self.hsdp = hsdp
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH),
            nn.ReLU(),
            nn.Linear(2 * WIDTH, WIDTH),
            nn.LayerNorm(WIDTH),
            nn.Linear(WIDTH, 1),
        )

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import distribute_module
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.hsdp:
            fully_shard(self.layers, mesh=self.device_mesh)  # replicated over dimension 0, sharded over dimension 1
            return
        mesh = self.device_mesh["tensor_parallel"]
        # The row-parallel output stays a (replicated) DTensor for the replicated norm and head after it.
        parallelize_module(self.layers, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=False)})
        for index in (3, 4):
            distribute_module(self.layers[index], mesh)  # every parameter replicated
        fully_shard(self.layers, mesh=self.device_mesh["data_parallel"])  # 2-D DTensors: (Shard(0), tensor parallel)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.layers(x)
        return nn.functional.mse_loss(out.to_local() if hasattr(out, "to_local") else out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def record_staged_items() -> list[list[str]]:
    """The keys of the items this rank stages for each save, in save order."""
    staged_items: list[list[str]] = []
    stage_shard = saver_module.stage_shard

    def recorded(*args: Any, **kwargs: Any) -> Any:
        staged, shard = stage_shard(*args, **kwargs)
        staged_items.append(sorted(item.index.fqn for item in staged.plan.items))
        return staged, shard

    saver_module.stage_shard = recorded  # type: ignore[assignment]
    return staged_items


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sync", action="store_true", help="Lightning's own synchronous sharded save (no plugin)")
    parser.add_argument("--hsdp", action="store_true", help="HSDP instead of tensor parallelism and FSDP2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    staged_items = record_staged_items()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, WIDTH, generator=generator)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    trainer = L.Trainer(
        default_root_dir=args.out,
        accelerator="cpu",
        devices=WORLD,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        plugins=[] if args.sync else [DataStatesIO()],
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), every_n_train_steps=1, save_top_k=-1)],
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TensorParallelMLP(hsdp=args.hsdp), data)
    with open(os.path.join(args.out, f"staged{trainer.global_rank}.json"), "w") as handle:
        json.dump(staged_items, handle)


if __name__ == "__main__":
    main()
