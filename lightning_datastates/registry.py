"""Which pipeline each plugin saves through, found from a Trainer: how the callback, the metrics and the resolution of
``ckpt_path="last"`` reach a :class:`~lightning_datastates.pipeline.CheckpointPipeline` when they know a Trainer, not
the plugin.

The plugin registers each pipeline it makes (:func:`register_pipeline`, in its ``__init__`` and ``__setstate__``);
:func:`trainer_pipeline` looks through wrapping CheckpointIOs (``AsyncCheckpointIO``). Any thread (the dictionary's own
operations are atomic under the GIL).
"""

from __future__ import annotations

import weakref
from typing import Any

from lightning_datastates.compat.lightning import unwrap_checkpoint_io
from lightning_datastates.pipeline import CheckpointPipeline

#: Each plugin's pipeline, by plugin (weakly: a plugin dropped takes its entry along).
_PIPELINES: weakref.WeakKeyDictionary[Any, CheckpointPipeline] = weakref.WeakKeyDictionary()


def register_pipeline(plugin: Any, pipeline: CheckpointPipeline) -> None:
    """Record that ``plugin`` (a ``DataStatesIO``) saves and loads through ``pipeline``: the plugin's ``__init__`` and
    ``__setstate__``, before the plugin is handed to a Trainer."""
    _PIPELINES[plugin] = pipeline


def trainer_pipeline(trainer: Any) -> CheckpointPipeline | None:
    """The pipeline of the ``DataStatesIO`` that ``trainer``'s strategy saves through, looking through wrapping
    CheckpointIOs (``AsyncCheckpointIO``); None for a Trainer that does not use one."""
    strategy = getattr(trainer, "strategy", None)
    checkpoint_io = unwrap_checkpoint_io(getattr(strategy, "checkpoint_io", None))
    try:
        return _PIPELINES.get(checkpoint_io)
    except TypeError:  # an unhashable CheckpointIO of somebody else's is not ours
        return None
