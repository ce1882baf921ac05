"""Lightning's sharded load for checkpoint directories at a URL (``s3://``, other fsspec protocols).

``ModelParallelStrategy.load_checkpoint`` and ``FSDPStrategy.load_checkpoint`` turn the path into a ``pathlib.Path``
(``s3://bucket/run`` becomes ``s3:/bucket/run``) and read it with DCP's local file reader, so Lightning alone cannot
resume from a sharded checkpoint the plugin saved to S3. :func:`load_sharded_url` does what the sharded branch of
those methods does (lightning 2.5 and 2.6), with DCP's fsspec reader opened with the plugin's storage options, and
reads Lightning's ``meta.pt`` through the plugin's storage writer.

Call order: the training thread of every rank, inside the strategy's ``load_checkpoint`` (the plugin's patch, after
this rank's pending commits are drained); DCP's load is collective over the training process group, as Lightning's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fsspec
from lightning.pytorch.strategies import FSDPStrategy

from lightning_datastates.compat.torch import dcp_fsspec_reader
from lightning_datastates.load.reader import load_checkpoint
from lightning_datastates.records.names import LIGHTNING_META_NAME
from lightning_datastates.sharded.dcp_writer import join_path
from lightning_datastates.storage import fsspec_storage_options
from lightning_datastates.storage.base import StorageWriter


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``s3://``, ``file://``, ...), which Lightning's ``pathlib.Path`` would collapse
    (``file:///x`` too, into ``file:/x``: the storage writers write ``file://`` as a local path, but every URL is
    loaded here)."""
    return "://" in path


def check_sharded_checkpoint(writer: StorageWriter, path: str) -> None:
    """Before a load from the URL ``path`` (rank 0): the directory holds a committed sharded checkpoint.

    Raises:
        FileNotFoundError: it holds no ``meta.pt`` (a save that never committed, a single-file checkpoint, a typo).
    """
    if not writer.exists(join_path(path, LIGHTNING_META_NAME)):
        raise FileNotFoundError(
            f"{path} holds no sharded checkpoint (no {LIGHTNING_META_NAME}): with a sharded strategy, a checkpoint at "
            "a URL loads only as the directory of a committed sharded save. Check the path; copy a single-file "
            "checkpoint to the local file system to load it."
        )


def load_sharded_url(
    strategy: Any,
    path: str,
    writer: StorageWriter,
    storage_options: dict[str, Any] | None,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load the committed sharded checkpoint at URL ``path`` (the same on every rank: rank 0's, which checked it with
    :func:`check_sharded_checkpoint`) into ``strategy``'s model and optimizers, as the strategy's own
    ``load_checkpoint`` loads a local one; return the rest of the checkpoint (``meta.pt``), which Lightning restores
    from."""

    options = fsspec_storage_options(path, storage_options)
    # fsspec shares one file system per set of options, listing cache included: the resolution of ckpt_path="last"
    # and ModelCheckpoint list through the same one, possibly before the cleanup at setup completed this directory
    # (a switch a dead run left half-way). A listing from then would hide its .metadata from DCP's reader.
    fsspec.url_to_fs(path, **options)[0].invalidate_cache()

    def reader() -> Any:  # one per DCP load: a reader keeps the metadata of the load it served
        return dcp_fsspec_reader(path, options)

    strict = strategy.lightning_module.strict_loading
    if isinstance(strategy, FSDPStrategy):
        _load_fsdp(strategy, reader, strict)
    else:
        _load_model_parallel(strategy, reader, strict)
    # Read, verified and loaded as every file this plugin loads: damage raises CheckpointCorruptError.
    return load_checkpoint(writer, join_path(path, LIGHTNING_META_NAME), weights_only=weights_only)


def _load_model_parallel(strategy: Any, reader: Callable[[], Any], strict: bool) -> None:
    """``ModelParallelStrategy``'s sharded load: the model under ``state_dict``, each optimizer under
    ``optimizer_<i>``, through ``torch.distributed.checkpoint.state_dict``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    module = strategy.model
    module_state = {"state_dict": get_model_state_dict(module)}
    dcp_load(module_state, storage_reader=reader())
    module.load_state_dict(module_state["state_dict"], strict=strict)
    for index, optimizer in enumerate(strategy.optimizers):
        key = f"optimizer_{index}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp_load(optimizer_state, storage_reader=reader())
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key], options=options)


def _load_fsdp(strategy: Any, reader: Callable[[], Any], strict: bool) -> None:
    """``FSDPStrategy``'s sharded load (FSDP1): the model under ``model`` in FSDP's sharded state dict type, each
    optimizer under ``optimizer_<i>`` (only when fitting, as Lightning does)."""
    from lightning.pytorch.trainer.states import TrainerFn
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.api import ShardedOptimStateDictConfig, ShardedStateDictConfig

    model = strategy.model
    sharded = FullyShardedDataParallel.state_dict_type(
        module=model,
        state_dict_type=StateDictType.SHARDED_STATE_DICT,
        state_dict_config=ShardedStateDictConfig(offload_to_cpu=True),
        optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True),
    )
    with sharded:
        module_state = {"model": model.state_dict()}
        dcp_load(module_state, storage_reader=reader())
        model.load_state_dict(module_state["model"], strict=strict)
        if strategy.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return
        for index, optimizer in enumerate(strategy.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = load_sharded_optimizer_state_dict(
                model_state_dict=module_state["model"], optimizer_key=key, storage_reader=reader()
            )
            flattened = FullyShardedDataParallel.optim_state_dict_to_load(
                model=model, optim=optimizer, optim_state_dict=optimizer_state[key]
            )
            optimizer.load_state_dict(flattened)
