"""The save call's fixed cost at an LLM's tensor count: planning the file layout of a checkpoint.

The training thread plans each checkpoint's layout during the save call: it pickles the structure (every tensor is
pickled, its bytes are not). That cost grows with the number of tensors, not their size, so a narrow model with an
LLM's depth measures it: the benchmark's GPT with ``--layers`` blocks (its 368M-llm preset has 24) at width 64, AdamW
stepped once (two moments and a step per parameter), in a checkpoint dict shaped as Lightning's. Prints the median
over ``--rounds`` plans, after warm-up plans, and the cost per tensor; the step counter changes between plans, as
between saves. Two planners side by side, in alternating calls: the package's (its fast path: ``data.pkl`` pickled
by ``capture/skeleton.py`` and spliced into the archive planned before) and the same planner with the fast path
turned off (``torch.save`` under ``skip_data``, as before the fast path), with their ratio.

``--sharded`` times a sharded save's staging instead (every tensor a DTensor on a one-rank gloo mesh): DCP's local
plan, each item resolved to its local tensor, the shard file planned.

``--trainer`` times whole save calls instead: a real ``lightning.Trainer`` (CPU) trains the same GPT for ``--rounds``
steps and saves it through ``DataStatesIO()`` at every step (every tensor of this narrow model is small, so the save
call also copies all of them); prints the first save call and the median of the others after two more.

``--new-lengths`` makes every plan meet a ``data.pkl`` of a new length (a new archive structure: written by torch's zip
writer and self-checked, not spliced), as when a checkpoint path in ModelCheckpoint's state grows by a digit.

    python3 scripts/bench_save_call.py [--layers 24] [--rounds 20] [--sharded | --trainer | --new-lengths]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_datastates._gpt import GPT
from lightning_datastates.capture.planning import LayoutPlanner


def narrow_gpt(layers: int, width: int = 64) -> GPT:
    """The benchmark's GPT with ``layers`` blocks of ``width`` (an LLM's tensor count, little data), seeded."""
    torch.manual_seed(0)
    return GPT(vocab=128, dim=width, layers=layers, heads=4, seq_len=16)


def llm_shaped_checkpoint(layers: int, width: int = 64) -> dict:
    """A checkpoint dict as Lightning makes it, of :func:`narrow_gpt` stepped once by its optimizer."""
    model = narrow_gpt(layers, width)
    optimizer = model.configure_optimizers()
    model.training_step(torch.randint(0, 128, (2, 17)), 0).backward()
    optimizer.step()
    return {
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1, "completed": 0}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": None, "dirpath": "/checkpoints"}},
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": dict(model.hparams),
    }


def count_tensors(value: object) -> int:
    """How many tensors ``value`` holds, nested in dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, dict):
        return sum(count_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(count_tensors(v) for v in value)
    return 0


def as_dtensors(value: Any, mesh: Any) -> Any:
    """``value`` with every tensor of one or more dimensions made a DTensor sharded on dim 0 over ``mesh`` (as FSDP2
    holds parameters and optimizer moments); scalars (AdamW's steps) stay plain."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if isinstance(value, torch.Tensor):
        return distribute_tensor(value, mesh, [Shard(0)]) if value.dim() else value
    if isinstance(value, dict):
        return {key: as_dtensors(item, mesh) for key, item in value.items()}
    if isinstance(value, list):
        return [as_dtensors(item, mesh) for item in value]
    return value


def timed(plans: list[Callable[[], object]], checkpoint: dict, rounds: int, new_lengths: bool = False) -> list[float]:
    """The median seconds of each of ``plans`` over ``rounds`` calls each, after three (the first plans of a structure
    also run self-checks and fill caches), the plans called in turn; the step counter changes between calls, as
    between saves. With ``new_lengths`` a string in the checkpoint also grows by a character before each call (as a
    checkpoint path in ModelCheckpoint's state grows by a digit), so that every plan meets a new structure."""
    for plan in plans:
        for _ in range(3):
            plan()
    durations: list[list[float]] = [[] for _ in plans]
    for _ in range(rounds):
        for plan, times in zip(plans, durations, strict=True):
            checkpoint["global_step"] += 1
            if new_lengths:
                checkpoint["hparams_name"] += "x"
            started = time.perf_counter()
            plan()
            times.append(time.perf_counter() - started)
    return [statistics.median(times) for times in durations]


def trainer_save_calls(layers: int, steps: int, width: int = 64) -> list[float]:
    """The seconds of every save call of a real Trainer that trains :func:`narrow_gpt` for
    ``steps`` steps on the CPU and saves it through ``DataStatesIO()`` after each."""
    import tempfile

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_datastates import DataStatesIO

    model = narrow_gpt(layers, width)
    plugin = DataStatesIO()
    with tempfile.TemporaryDirectory() as directory:
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            plugins=[plugin],
            callbacks=[ModelCheckpoint(directory, every_n_train_steps=1, save_top_k=-1)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, DataLoader(torch.randint(0, 128, (2 * steps, 17)), batch_size=2))
    return [stats.save_call_s for stats in plugin.stats]


def main() -> None:
    """Run the measurement and print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sharded", action="store_true", help="time a sharded save's staging (one-rank gloo mesh)")
    parser.add_argument("--trainer", action="store_true", help="time whole save calls of a Trainer saving every step")
    parser.add_argument("--new-lengths", action="store_true", help="a data.pkl of a new length at every plan")
    args = parser.parse_args()
    if args.trainer:
        calls = trainer_save_calls(args.layers, max(args.rounds, 4))
        tensors = count_tensors(llm_shaped_checkpoint(args.layers))
        first, later = 1000 * calls[0], 1000 * statistics.median(calls[3:])
        print(f"save calls of a Trainer saving {tensors} tensors ({args.layers} blocks) every step: first ", end="")
        print(f"{first:.1f} ms, median of {len(calls) - 3} later {later:.1f} ms; torch {torch.__version__}")
        return
    checkpoint = llm_shaped_checkpoint(args.layers)
    tensors = count_tensors(checkpoint)
    if args.sharded:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_datastates.sharded.layout import ArchivePlans
        from lightning_datastates.sharded.staging import LocalPlans, stage_shard

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        checkpoint = as_dtensors(checkpoint, init_device_mesh("cpu", (1,)))
        plans, local_plans = ArchivePlans(None), LocalPlans()
        (median,) = timed([lambda: stage_shard(checkpoint, 0, plans, local_plans)], checkpoint, args.rounds)
        dist.destroy_process_group()
        report("sharded staging (DCP's local plan, items resolved, shard file planned)", median, tensors, args.layers)
        return
    planner, by_torch = LayoutPlanner(alignment=None), LayoutPlanner(alignment=None, fast_path=False)
    plans = [lambda: planner.plan(checkpoint), lambda: by_torch.plan(checkpoint)]
    fast, slow = timed(plans, checkpoint, args.rounds, args.new_lengths)
    verified = planner._verified_structures
    if not verified.confirmed or (verified.spliced == 0 and not args.new_lengths):
        raise SystemExit(f"the fast path was not taken (refused: {verified.refused}, spliced: {verified.spliced})")
    report("layout plan" + (" of new structures" if args.new_lengths else ""), fast, tensors, args.layers)
    report("layout plan by torch.save (fast path off)", slow, tensors, args.layers)
    print(f"fast path / torch.save: {fast / slow:.2f}")


def report(what: str, median: float, tensors: int, layers: int) -> None:
    """Print one measurement."""
    print(
        f"{what} of a checkpoint of {tensors} tensors ({layers} blocks): median {1000 * median:.1f} ms "
        f"({1e6 * median / tensors:.1f} us per tensor); torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
