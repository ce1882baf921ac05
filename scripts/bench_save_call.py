"""The save call's fixed cost at an LLM's tensor count: planning the file layout of a checkpoint.

The training thread plans each checkpoint's layout during the save call (``torch.save`` of the structure under
``skip_data``: every tensor is pickled, its bytes are not). That cost grows with the number of tensors, not their
size, so a narrow model with an LLM's depth measures it: the benchmark's GPT with ``--layers`` blocks (its 368M-llm
preset has 24) at width 64, AdamW stepped once (two moments and a step per parameter), in a checkpoint dict shaped
as Lightning's. Prints the median over ``--rounds`` plans, after warm-up plans, and the cost
per tensor; the step counter changes between plans, as between saves.

    python3 scripts/bench_save_call.py [--layers 24] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_datastates._gpt import GPT
from lightning_datastates.capture.planning import LayoutPlanner


def llm_shaped_checkpoint(layers: int, width: int = 64) -> dict:
    """A checkpoint dict as Lightning makes it, of the benchmark's GPT with ``layers`` blocks of ``width``."""
    torch.manual_seed(0)
    model = GPT(vocab=128, dim=width, layers=layers, heads=4, seq_len=16)
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


def main() -> None:
    """Run the measurement and print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    checkpoint = llm_shaped_checkpoint(args.layers)
    tensors = count_tensors(checkpoint)
    planner = LayoutPlanner(alignment=None)
    for _ in range(3):  # the first plan of a structure also runs the self-check
        planner.plan(checkpoint)
    durations = []
    for _ in range(args.rounds):
        checkpoint["global_step"] += 1
        started = time.perf_counter()
        planner.plan(checkpoint)
        durations.append(time.perf_counter() - started)
    median = statistics.median(durations)
    print(
        f"layout plan of a checkpoint of {tensors} tensors ({args.layers} blocks): median {1000 * median:.1f} ms "
        f"over {args.rounds} plans ({1e6 * median / tensors:.1f} us per tensor); torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
