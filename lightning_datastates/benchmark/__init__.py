"""The benchmark: DataStatesIO side by side with no checkpointing, Lightning's synchronous and asynchronous
CheckpointIO and DCP's ``async_save``, on the same model, data and checkpoint interval; and with a local tier
(``tiered``) against one tier, at a slow target.

``python -m lightning_datastates.benchmark --help``. Modules: ``command`` (the command line; rounds, report, plot,
gates), ``runner`` (the parent: one worker subprocess per method and round), ``targets`` (where checkpoints go, the
local tier, the raw throughput of each), ``moto`` (moto's S3 server for ``--moto``), ``worker`` (a subprocess: one
method's training run), ``methods``, ``dcp`` and ``recording`` (the timed CheckpointIO of each method and what records
their timestamps), ``resume`` (``--resume``: loads from each tier), ``report`` and ``tiered_report`` (figures,
medians, ratios, markdown, JSON, gates), ``plot`` (the timeline), ``choices`` (methods and model sizes), ``options``
(``--datastates NAME=VALUE``). Importing this
package loads neither torch nor Lightning (the workers do); nothing in the plugin imports it.
"""

from __future__ import annotations

from lightning_datastates.benchmark.command import main

__all__ = ["main"]
