"""lightning-datastates: lazy asynchronous checkpointing for PyTorch Lightning.

``Trainer(plugins=[DataStatesIO()])`` and keep ``ModelCheckpoint`` as it is: checkpoints are snapshotted while the
next iteration computes and flushed to storage in the background; training waits only where the saved state
could change next.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_datastates.callback import DataStatesCallback
    from lightning_datastates.errors import (
        CheckpointCaptureError,
        CheckpointCorruptError,
        CheckpointFlushError,
        ConfigError,
        DataStatesError,
    )
    from lightning_datastates.plugin import DataStatesIO
    from lightning_datastates.records.job import SnapshotStats
    from lightning_datastates.snapshot.backpressure import BackPressureWarning

# Imported on first use (PEP 562): the plugin pulls in Lightning, seconds of startup that the command line
# (`python -m lightning_datastates verify ...`) does not need.
_EXPORTS = {
    "BackPressureWarning": "lightning_datastates.snapshot.backpressure",
    "CheckpointCaptureError": "lightning_datastates.errors",
    "CheckpointCorruptError": "lightning_datastates.errors",
    "CheckpointFlushError": "lightning_datastates.errors",
    "ConfigError": "lightning_datastates.errors",
    "DataStatesError": "lightning_datastates.errors",
    "DataStatesCallback": "lightning_datastates.callback",
    "DataStatesIO": "lightning_datastates.plugin",
    "SnapshotStats": "lightning_datastates.records.job",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = [
    "BackPressureWarning",
    "CheckpointCaptureError",
    "CheckpointCorruptError",
    "CheckpointFlushError",
    "ConfigError",
    "DataStatesCallback",
    "DataStatesError",
    "DataStatesIO",
    "SnapshotStats",
    "__version__",
]
