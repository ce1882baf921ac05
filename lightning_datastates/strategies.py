"""Which Lightning strategies send their checkpoints through ``DataStatesIO``, and a warning for the others.

``Strategy.save_checkpoint`` hands the checkpoint dict to the ``CheckpointIO`` on global rank 0 (DDP, ddp_spawn,
single device, and FSDP / ModelParallel in full-state mode, which pass a ``pathlib.Path``). Sharded FSDP and
ModelParallel with distributed checkpoints write directories with ``torch.distributed.checkpoint`` instead: the
callback routes those saves through the plugin (:mod:`~lightning_datastates.sharded.lightning`). DeepSpeed writes its
own directories through its engine, so the plugin never sees those saves; it still receives ``remove_checkpoint`` for
them, which its writers delete recursively. See ``docs/design.md``, "Lightning facts".
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn


class PluginBypassedWarning(UserWarning):
    """The Trainer's strategy saves checkpoints without its ``CheckpointIO``: ``DataStatesIO`` is not used for them."""


def bypass_reason(strategy: Any) -> str | None:
    """Why ``strategy`` writes checkpoint files without the plugin; None if the plugin writes them."""
    if isinstance(strategy, DeepSpeedStrategy):
        return "DeepSpeedStrategy writes each checkpoint as a directory through the DeepSpeed engine"
    return None


def gathers_full_state(strategy: Any) -> bool:
    """Whether ``strategy``'s single-file saves hold state gathered from every rank (FSDP and ModelParallel in
    full-state mode: rank 0 saves more than it holds), so that no rank's own tensors tell a checkpoint's size."""
    return isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))


def warn_if_bypassed(strategy: Any) -> bool:
    """Warn (once per process and message, on rank 0) when ``strategy`` saves without the plugin; True if it does."""
    reason = bypass_reason(strategy)
    if reason is None:
        return False
    rank_zero_warn(
        f"lightning_datastates: {reason}. It bypasses the CheckpointIO plugin: DataStatesIO is not used for these "
        "saves (they are synchronous and not covered by its guarantees), only to remove old checkpoint directories.",
        category=PluginBypassedWarning,
    )
    return True
