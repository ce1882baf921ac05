"""Lightning's sharded strategies through the plugin: one switch, ``plugins=[DataStatesIO()]``.

``FSDPStrategy(state_dict_type="sharded")`` and ``ModelParallelStrategy(save_distributed_checkpoint=True)`` save with
``torch.distributed.checkpoint`` themselves and never call their ``CheckpointIO``. At setup the callback hands such a
strategy to :func:`install`, which replaces, on that strategy object only, the methods Lightning calls:

- ``save_checkpoint``: the same split as Lightning's (the model's state dict and ``optimizer_<i>`` through DCP, under
  the keys the strategy's own load reads, see :func:`model_key`; the rest as ``meta.pt`` on rank 0), through
  :class:`~lightning_datastates.sharded.saver.ShardedSaver`;
- ``load_checkpoint``: waits for pending commits of this rank first, then Lightning's own load (DCP's reader); a
  sharded checkpoint at a URL (``s3://``), which Lightning's ``pathlib.Path`` would collapse, is loaded the same way
  through DCP's fsspec reader instead (:mod:`~lightning_datastates.sharded.remote_load`);
- ``lightning_module_state_dict`` and ``optimizer_state`` of ``ModelParallelStrategy``: the same state dicts without
  ``cpu_offload``, whose copy to host memory would run synchronously on the training thread on a GPU; the engine
  copies the shards lazily instead. (``FSDPStrategy`` keeps its own, with FSDP's offload.)

:func:`uninstall` puts Lightning's methods back at teardown. DeepSpeed is left alone (it keeps its warning).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lightning_datastates.compat.lightning import (
    checkpoint_path_str,
    fsdp_state_dict_type,
    saves_distributed_checkpoint,
)
from lightning_datastates.sharded.remote_load import check_sharded_checkpoint, is_url, load_sharded_url
from lightning_datastates.sharded.saver import ShardedSaver
from lightning_datastates.storage.base import StorageWriter

_PATCHED = ("save_checkpoint", "load_checkpoint", "lightning_module_state_dict", "optimizer_state")


def saves_with_dcp(strategy: Any) -> bool:
    """Whether ``strategy`` writes its checkpoints as DCP directories (the saves :func:`install` takes over)."""
    if isinstance(strategy, FSDPStrategy):
        return fsdp_state_dict_type(strategy) != "full"
    return isinstance(strategy, ModelParallelStrategy) and saves_distributed_checkpoint(strategy)


def model_key(strategy: Any) -> str:
    """The key under which ``strategy``'s own sharded save puts the model's state dict in the DCP checkpoint, and
    its load looks for it: ``"model"`` for ``FSDPStrategy``, ``"state_dict"`` for ``ModelParallelStrategy``
    (lightning 2.5 and 2.6). A checkpoint under the other key would not load with the strategy that saved it."""
    return "model" if isinstance(strategy, FSDPStrategy) else "state_dict"


def install(
    strategy: Any,
    saver: ShardedSaver,
    drain: Callable[[], None],
    writer_for: Callable[[str], StorageWriter],
    plugin_storage_options: dict[str, Any] | None,
) -> None:
    """Route ``strategy``'s sharded saves through ``saver``, and its loads of URLs through DCP's fsspec reader
    (``writer_for`` and ``plugin_storage_options``: the plugin's); ``drain()`` waits for every pending commit."""
    original_load = strategy.load_checkpoint

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"`{type(strategy).__name__}.save_checkpoint(..., storage_options=...)` is not supported with "
                "DataStatesIO: pass storage options once as `DataStatesIO(storage_options=...)`"
            )
        # Every rank saves into rank 0's directory: the saver broadcasts it once rank 0 has marked it.
        path = checkpoint_path_str(filepath)
        state = {model_key(strategy): checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        saver.save(state, checkpoint, path, strategy.broadcast)

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        drain()  # a checkpoint this run saved is committed before it is read
        # Rank 0 decides for every rank, in one broadcast (Lightning's own load makes one too): a rank that took the
        # other branch would wait in a collective the others never join.
        path, error, cause = _checked_by_rank_0(checkpoint_path_str(checkpoint_path))
        path, error = strategy.broadcast((path, error))
        if error is not None:
            raise FileNotFoundError(error) from cause  # rank 0's own error chained there; the others get its text
        if not is_url(path):
            return original_load(checkpoint_path, *args, **kwargs)
        weights_only = kwargs.get("weights_only", args[0] if args else None)
        return load_sharded_url(strategy, path, writer_for(path), plugin_storage_options, weights_only)

    def _checked_by_rank_0(path: str) -> tuple[str, str | None, BaseException | None]:
        """``path``, and on rank 0 why the URL ``path`` cannot be loaded (None: it can, or it is no URL) and the
        error that said so."""
        if strategy.global_rank != 0 or not is_url(path):
            return path, None, None
        try:
            check_sharded_checkpoint(writer_for(path), path)
        except FileNotFoundError as exc:
            return path, str(exc), exc
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
            return path, f"cannot read {path}: {exc!r}", exc
        return path, None, None

    # On the instance: Lightning calls these through the strategy object; uninstall() drops them again.
    patches: dict[str, Any] = {"save_checkpoint": save_checkpoint, "load_checkpoint": load_checkpoint}
    if isinstance(strategy, ModelParallelStrategy):
        patches["lightning_module_state_dict"] = lambda: _model_state_dict(strategy)
        patches["optimizer_state"] = lambda optimizer: _optimizer_state(strategy, optimizer)
    for name, method in patches.items():
        setattr(strategy, name, method)


def uninstall(strategy: Any) -> None:
    """Undo :func:`install` (Lightning's methods, from the class, apply again)."""
    for name in _PATCHED:
        strategy.__dict__.pop(name, None)


def _model_state_dict(strategy: Any) -> dict[str, Any]:
    """ModelParallelStrategy's sharded model state dict, aliasing the live shards (no copy to host memory)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=False, cpu_offload=False))


def _optimizer_state(strategy: Any, optimizer: Any) -> dict[str, Any]:
    """ModelParallelStrategy's sharded optimizer state dict, aliasing the live state (no copy to host memory)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    options = StateDictOptions(full_state_dict=False, cpu_offload=False)
    return get_optimizer_state_dict(strategy.model, optimizer, options=options)
