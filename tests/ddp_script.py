"""A two-process CPU (gloo) run with DataStatesIO, launched by tests/test_strategies.py.

``python tests/ddp_script.py OUT {ddp,ddp_spawn}`` (``BROKEN_DRAIN=1`` in the environment: see below)

* ``ddp``: Lightning relaunches this script for rank 1. Both ranks fit (a checkpoint every step, top-2 by step,
  plus last.ckpt), then ``validate(ckpt_path="best")`` and ``fit(ckpt_path="last")`` in the same processes: every
  rank loads files that rank 0 wrote moments before. Each rank reports to ``OUT/rank<r>.json`` whether it ever
  built an engine or ran engine threads, and saves what it loaded to ``OUT/rank<r>-*.pt``.
* ``ddp_spawn``: workers are spawned with the pickled plugin; after fit the parent holds the weights that rank 0
  saved after ``Strategy.teardown`` (Lightning's bare state dict in a temporary file); it saves them to
  ``OUT/parent-weights.pt``.

Writes are slowed (every range waits 20 ms) so flushes are still running when fit ends. ``BROKEN_DRAIN=1`` turns off
the plugin's draining and waiting (fit end, teardown, saves outside the training loop) and makes its threads
daemons, to show that the tests catch a rank reading an unfinished file and a worker exiting before its last save.
Both are set up when this module is imported, so spawned workers (which import it as ``__mp_main__``) get them too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_datastates.metrics
from lightning_datastates import DataStatesIO
from lightning_datastates.plugin import pipeline_of
from tests.conftest import BNModel, make_loader
from tests.script_support import (
    ReferenceRecordingIO,
    break_draining,
    datastates_threads,
    slow_local_writes,
    write_json,
)

WRITE_DELAY_S = 0.02
#: The aggregates each fit computed on this rank (what the callback logs at the end of training, logger or not).
FIT_TOTALS: list[dict[str, float]] = []


def _record_totals() -> None:
    """Keep the end-of-fit aggregates this rank computes: rank 1 saves nothing, so it has them only via the sync."""
    log = lightning_datastates.metrics._log

    def recording_log(trainer: L.Trainer, values: dict[str, float]) -> None:
        if "datastates/checkpoints" in values:
            FIT_TOTALS.append(dict(values))
        log(trainer, values)

    lightning_datastates.metrics._log = recording_log


class RankProbe(Callback):
    """Records, on each rank, whether the plugin ever built an engine or ran threads there."""

    def __init__(self, plugin: DataStatesIO) -> None:
        self.plugin = plugin
        self.engine_seen = False
        self.threads_seen: set[str] = set()
        self.restored: dict[str, torch.Tensor] | None = None

    def _look(self) -> None:
        self.engine_seen |= pipeline_of(self.plugin)._engine is not None
        self.threads_seen.update(datastates_threads())

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self._look()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._look()
        if trainer.ckpt_path is not None:  # the second fit: what this rank restored
            self.restored = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self.restored.update({f"optimizer.{k}": v for k, v in _flat_optimizer_state(trainer.optimizers[0]).items()})

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._look()


def _flat_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                flat[f"{index}.{name}"] = value.detach().clone()
    return flat


def _trainer(out: str, strategy: str, plugin: DataStatesIO, probe: RankProbe, max_epochs: int) -> L.Trainer:
    checkpoint = ModelCheckpoint(
        dirpath=os.path.join(out, "ckpt"),
        every_n_train_steps=1,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=max_epochs,
        plugins=[plugin],
        callbacks=[checkpoint, probe],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
        deterministic=True,
    )


def _first_fit(out: str, strategy: str, max_epochs: int) -> tuple[L.Trainer, ReferenceRecordingIO, RankProbe, BNModel]:
    torch.manual_seed(0)
    plugin = ReferenceRecordingIO(os.path.join(out, "ref"), chunk_size="16KiB")
    probe = RankProbe(plugin)
    trainer = _trainer(out, strategy, plugin, probe, max_epochs=max_epochs)
    model = BNModel(width=64)
    trainer.fit(model, make_loader(), make_loader(n=16))
    return trainer, plugin, probe, model


def run_ddp(out: str) -> None:
    trainer, _, probe, model = _first_fit(out, "ddp", max_epochs=2)
    rank = trainer.global_rank
    best, last = trainer.checkpoint_callback.best_model_path, trainer.checkpoint_callback.last_model_path

    if rank == 0:  # what fit left (the second fit replaces it), and the references it must equal
        shutil.copytree(os.path.join(out, "ckpt"), os.path.join(out, "fit1", "ckpt"))
        shutil.copytree(os.path.join(out, "ref"), os.path.join(out, "fit1", "ref"))
    # Right after fit, in the same processes: every rank loads what rank 0 has just written.
    trainer.validate(model, make_loader(n=16), ckpt_path="best", verbose=False)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"rank{rank}-best.pt"))
    trainer.fit_loop.max_epochs = 3
    trainer.fit(model, make_loader(), make_loader(n=16), ckpt_path="last")
    assert probe.restored is not None
    torch.save(probe.restored, os.path.join(out, f"rank{rank}-last.pt"))

    write_json(
        os.path.join(out, f"rank{rank}.json"),
        {
            "rank": rank,
            "best": os.path.basename(best),
            "last": os.path.basename(last),
            "engine_seen": probe.engine_seen,
            "threads_seen": sorted(probe.threads_seen),
            "threads_at_end": datastates_threads(),
            "fit_totals": FIT_TOTALS,
        },
    )


def run_ddp_spawn(out: str) -> None:
    _, plugin, _, model = _first_fit(out, "ddp_spawn", max_epochs=1)
    # The parent loaded the weights rank 0 saved after teardown, through its own (unpickled) plugin.
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, "parent-weights.pt"))
    write_json(
        os.path.join(out, "parent.json"),
        {"engine_in_parent": pipeline_of(plugin)._engine is not None, "threads_in_parent": datastates_threads()},
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("strategy", choices=["ddp", "ddp_spawn"])
    args = parser.parse_args()
    (run_ddp if args.strategy == "ddp" else run_ddp_spawn)(args.out)
    print(f"done rank={os.environ.get('LOCAL_RANK', 'parent')} threads={threading.active_count()}", flush=True)


slow_local_writes(WRITE_DELAY_S)
_record_totals()
if os.environ.get("BROKEN_DRAIN") == "1":
    break_draining()

if __name__ == "__main__":
    sys.exit(main())
