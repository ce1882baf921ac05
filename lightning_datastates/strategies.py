"""Which Lightning strategies send their checkpoint files through ``DataStatesIO``, and a warning for the others.

``Strategy.save_checkpoint`` hands the checkpoint dict to the ``CheckpointIO`` on global rank 0 (DDP, ddp_spawn,
single device, and FSDP / ModelParallel in full-state mode, which pass a ``pathlib.Path``). Sharded FSDP,
ModelParallel with distributed checkpoints and DeepSpeed write their own directories instead
(``torch.distributed.checkpoint`` or DeepSpeed's engine), so the plugin never sees those saves; they still send
``remove_checkpoint`` for the directories, which the plugin's writers delete recursively. See ``docs/design.md``,
"Lightning facts".
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn

from lightning_datastates.compat.lightning import fsdp_state_dict_type, saves_distributed_checkpoint


class PluginBypassedWarning(UserWarning):
    """The Trainer's strategy saves checkpoints without its ``CheckpointIO``: ``DataStatesIO`` is not used for them."""


def bypass_reason(strategy: Any) -> str | None:
    """Why ``strategy`` writes checkpoint files without calling its ``CheckpointIO``; None if it calls it."""
    if isinstance(strategy, FSDPStrategy) and fsdp_state_dict_type(strategy) != "full":
        return (
            "FSDPStrategy(state_dict_type='sharded') writes each checkpoint as a directory with "
            "torch.distributed.checkpoint (for single files that DataStatesIO writes: state_dict_type='full')"
        )
    if isinstance(strategy, ModelParallelStrategy) and saves_distributed_checkpoint(strategy):
        return (
            "ModelParallelStrategy(save_distributed_checkpoint=True) writes each checkpoint as a directory with "
            "torch.distributed.checkpoint (for single files, which DataStatesIO writes: "
            "save_distributed_checkpoint=False)"
        )
    if isinstance(strategy, DeepSpeedStrategy):
        return "DeepSpeedStrategy writes each checkpoint as a directory through the DeepSpeed engine"
    return None


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
