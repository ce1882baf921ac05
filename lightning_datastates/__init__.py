"""lightning-datastates: lazy asynchronous checkpointing for PyTorch Lightning.

``Trainer(plugins=[DataStatesIO()])`` and keep ``ModelCheckpoint`` as it is: checkpoints are snapshotted while the
next iteration computes and flushed to storage in the background; training waits only where the saved state
could change next.
"""

from lightning_datastates.callback import DataStatesCallback
from lightning_datastates.errors import (
    CheckpointCaptureError,
    CheckpointCorruptError,
    CheckpointFlushError,
    ConfigError,
    DataStatesError,
)
from lightning_datastates.plugin import DataStatesIO
from lightning_datastates.snapshot.job import SnapshotStats

__version__ = "0.1.0"

__all__ = [
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
