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
    """Writing a checkpoint in the background failed.

    Raised once, on the training thread, at the next hook after the failure. The checkpoint was not published
    under its final name and earlier checkpoints are untouched. ``path`` names the checkpoint; the cause is
    chained as ``__cause__``.
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path
