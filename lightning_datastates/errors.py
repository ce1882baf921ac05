"""Exceptions raised by lightning_datastates.

Every error names the checkpoint path it concerns and, where it wraps a lower-level failure, chains it
(``raise ... from cause``) so the original traceback is never lost.
"""

from __future__ import annotations


class DataStatesError(Exception):
    """Base class of every error this package raises."""


class ConfigError(DataStatesError, ValueError):
    """A setting of :class:`~lightning_datastates.DataStatesIO` is invalid; the message names it and the fix."""


class CheckpointCaptureError(DataStatesError):
    """``save_checkpoint`` could not capture the checkpoint (for example it holds an object that cannot be pickled).

    Raised synchronously by ``save_checkpoint``; nothing is written for that checkpoint.
    """


class CheckpointCorruptError(DataStatesError):
    """A checkpoint file failed its integrity check: a record's bytes do not match their CRC-32, or the archive's
    structure is damaged. ``path`` names the file and ``record`` the damaged record (None for the structure).
    """

    def __init__(self, message: str, path: str, record: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.record = record


class CheckpointFlushError(DataStatesError):
    """Writing a checkpoint failed, or checkpoints cannot be written where they are to go.

    A background write that failed is raised once, on the training thread, at the next hook after the failure: the
    checkpoint was not published under its final name and earlier checkpoints are untouched. A checkpoint directory
    that cannot take checkpoints (a local path that is a file; on S3 a missing bucket, missing credentials, an
    endpoint that does not answer) is raised at setup, before training starts. ``path`` names the checkpoint (or the
    directory); the storage error is chained as ``__cause__`` (on S3 an ``S3WriteError``, an ``OSError``).
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path
