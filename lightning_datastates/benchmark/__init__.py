"""The benchmark: DataStatesIO side by side with no checkpointing, Lightning's synchronous and asynchronous
CheckpointIO and DCP's ``async_save``, on the same model, data and checkpoint interval.

``python -m lightning_datastates.benchmark --help``. Modules: ``command`` (the command line; rounds, report, plot,
gate), ``runner`` (the parent: one worker subprocess per method and round; the raw throughput of the target),
``worker`` (a subprocess: one method's training run), ``methods``, ``dcp`` and ``recording`` (the timed CheckpointIO
of each method and what records their timestamps), ``report`` (figures, medians, ratios, markdown, JSON), ``plot``
(the timeline), ``choices`` (methods and model sizes), ``options`` (``--datastates NAME=VALUE``). Importing this
package loads neither torch nor Lightning (the workers do); nothing in the plugin imports it.
"""

from __future__ import annotations

from lightning_datastates.benchmark.command import main

__all__ = ["main"]
