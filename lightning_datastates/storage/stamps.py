"""Save stamps read from storage, and the process's save sequence kept after them (:mod:`~lightning_datastates.records.
stamp`): a run that resumed from, or saves beside, checkpoints another node stamped (with a clock that ran ahead)
still stamps its own saves after them.

Any thread; reads are one request each on S3 (:meth:`StorageWriter.read_tail
<lightning_datastates.storage.base.StorageWriter.read_tail>`).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from lightning_datastates.records.names import LIGHTNING_META_NAME
from lightning_datastates.records.stamp import SAVE_SEQUENCE, SaveStamp
from lightning_datastates.storage.base import StorageWriter, read_stamp

log = logging.getLogger("lightning_datastates")

#: The newest checkpoints of a directory (by listing date) whose stamps a run reads before it saves there.
OBSERVED_PER_DIRECTORY = 16
#: Stamps read at once.
_READS_IN_FLIGHT = 8


def observe_stamp(writer: StorageWriter, path: str) -> SaveStamp | None:
    """The save stamp of the committed file at ``path`` (None where it carries none); later saves of this process are
    stamped after it.

    Raises:
        FileNotFoundError: nothing at ``path``.
        OSError: storage could not be read (``S3WriteError`` on S3).
    """
    stamp = read_stamp(writer, path)
    SAVE_SEQUENCE.observe(stamp)
    return stamp


def observe_quietly(writer: StorageWriter, path: str) -> None:
    """:func:`observe_stamp`, where a file that cannot be read is passed over (logged at debug level): the clock still
    orders this run's saves after its start."""
    try:
        observe_stamp(writer, path)
    except Exception as exc:  # noqa: BLE001 - best effort, see above
        log.debug("lightning_datastates: cannot read the stamp of %s: %r", path, exc)


def observe_directory(writer: StorageWriter, directory: str) -> None:
    """:func:`observe_quietly` of the newest checkpoints of ``directory`` by listing date (at most
    :data:`OBSERVED_PER_DIRECTORY`; a sharded checkpoint by its ``meta.pt``), a few at a time."""
    try:
        entries = writer.list_directory(directory)
    except Exception as exc:  # noqa: BLE001 - best effort, as above
        log.debug("lightning_datastates: cannot list %s: %r", directory, exc)
        return
    checkpoints = [e for e in entries if e.name.endswith(".ckpt") and not e.name.startswith(".")]
    newest = sorted(checkpoints, key=lambda e: e.modified_s or 0.0, reverse=True)[:OBSERVED_PER_DIRECTORY]
    base = directory.rstrip("/")
    paths = [f"{base}/{e.name}" + (f"/{LIGHTNING_META_NAME}" if e.is_directory else "") for e in newest]
    if paths:
        with ThreadPoolExecutor(max_workers=min(_READS_IN_FLIGHT, len(paths))) as pool:
            list(pool.map(lambda path: observe_quietly(writer, path), paths))
