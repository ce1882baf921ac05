"""How rank 0 makes a directory a sharded checkpoint, so that no crash or storage error loses the one it held.

A sharded checkpoint is a directory whose DCP ``.metadata`` names the shard files and whose Lightning ``meta.pt``
makes it a checkpoint for Lightning's load. A new save into a directory that holds one (``last.ckpt``, saved again and
again) must replace both files together, and no storage offers a transaction over two files. Left as two writes, a
crash between them leaves either the old ``meta.pt`` beside the new ``.metadata`` (a mix: new weights with the old loop
state, loaded without a word) or, with ``meta.pt`` removed first, a directory that holds neither checkpoint whole.

So rank 0 first writes both files' bytes into one **commit record** (:data:`COMMIT_RECORD_NAME`, written atomically,
:func:`write_commit_record`), while the directory still holds the earlier checkpoint untouched; only then
(:func:`switch_to_record`) it

1. removes ``meta.pt``: from here the directory is no checkpoint;
2. writes ``.metadata`` and then ``meta.pt`` from the record (each atomically);
3. removes the record.

Whatever stops this, the directory is in one of three states, and :func:`complete_or_keep` (the next run's cleanup of
a save whose writer died, or rank 0's next save of a directory whose switch it left half-way on a storage error)
leaves each one a whole checkpoint:

- ``meta.pt`` present: the earlier checkpoint (step 1 not done) or the new one (step 2 done); ``.metadata`` is the
  one that goes with it. The caller keeps the files ``.metadata`` names and removes the rest (the record too);
- ``meta.pt`` missing, the record present: step 1 happened, so the new checkpoint is the one to finish: its shard
  files were all durable before the record was written (every rank reported its file committed), and steps 2 and 3
  run again from the record (each is idempotent);
- neither: the save died before its commit; the directory never held a checkpoint and is removed whole.

The record costs one small write and one removal per commit, on the committer thread. A later save never replaces or
removes the record of a switch that stopped half-way before that switch is finished: it may be the only way back to a
whole checkpoint. Call order: rank 0's committer thread (:class:`~lightning_datastates.sharded.commit.
ShardedCommitter`), saves in order, or the cleanup of a directory whose writer is gone
(:mod:`~lightning_datastates.sharded.leftovers`); never two at once in one directory.
"""

from __future__ import annotations

import pickle
import struct

from lightning_datastates.records.names import COMMIT_RECORD_NAME, DCP_METADATA_NAME, LIGHTNING_META_NAME
from lightning_datastates.sharded.dcp_writer import join_path
from lightning_datastates.storage.base import StorageWriter, write_file

_RECORD_MAGIC = b"LDSCOMMIT1"
_LENGTH = struct.Struct("<Q")


def encode_record(metadata_bytes: bytes, meta_bytes: bytes) -> bytes:
    """The commit record of a checkpoint whose ``.metadata`` and ``meta.pt`` hold these bytes (pure)."""
    return _RECORD_MAGIC + _LENGTH.pack(len(metadata_bytes)) + metadata_bytes + meta_bytes


def decode_record(record: bytes) -> tuple[bytes, bytes]:
    """``(metadata_bytes, meta_bytes)`` of a commit record (pure).

    Raises:
        ValueError: ``record`` is no commit record of this package, or a cut one.
    """
    head = len(_RECORD_MAGIC) + _LENGTH.size
    if len(record) < head or record[: len(_RECORD_MAGIC)] != _RECORD_MAGIC:
        raise ValueError("not a commit record of lightning_datastates")
    (metadata_length,) = _LENGTH.unpack_from(record, len(_RECORD_MAGIC))
    if head + metadata_length > len(record):
        raise ValueError("a commit record cut short")
    return bytes(record[head : head + metadata_length]), bytes(record[head + metadata_length :])


def files_named(metadata_bytes: bytes) -> list[str]:
    """The shard files a DCP ``.metadata`` (its bytes) refers to, sorted."""
    metadata = pickle.loads(metadata_bytes)
    return sorted({info.relative_path for info in metadata.storage_data.values()})


def write_commit_record(writer: StorageWriter, directory: str, metadata_bytes: bytes, meta_bytes: bytes) -> None:
    """Before the switch: the new checkpoint's ``.metadata`` and ``meta.pt`` bytes into ``directory``'s record (the
    directory still holds its earlier checkpoint, if any, untouched)."""
    write_file(writer, join_path(directory, COMMIT_RECORD_NAME), encode_record(metadata_bytes, meta_bytes))


def switch_to_record(writer: StorageWriter, directory: str, metadata_bytes: bytes, meta_bytes: bytes) -> None:
    """Steps 1-3 of the module docstring, the record already durable: ``directory`` becomes the new checkpoint.

    Raises:
        Exception: whatever storage raised; the directory is then left for :func:`complete_or_keep`.
    """
    writer.remove_files(directory, [LIGHTNING_META_NAME])  # from here the directory is no checkpoint
    write_file(writer, join_path(directory, DCP_METADATA_NAME), metadata_bytes)
    write_file(writer, join_path(directory, LIGHTNING_META_NAME), meta_bytes)
    writer.remove_files(directory, [COMMIT_RECORD_NAME])


def complete_or_keep(writer: StorageWriter, directory: str, names: set[str]) -> bool:
    """A directory holding ``names`` and no ``meta.pt`` (a save whose writer died, or whose switch stopped on a storage
    error): finish its switch from its commit record. True if it is now a checkpoint; False if it holds no record (it
    never became one: the caller removes it).

    Raises:
        ValueError: the record is unreadable, or a shard file its ``.metadata`` names is missing; nothing is changed
            (the caller keeps the directory rather than guess).
    """
    if COMMIT_RECORD_NAME not in names:
        return False
    metadata_bytes, meta_bytes = decode_record(bytes(writer.read_bytes(join_path(directory, COMMIT_RECORD_NAME))))
    missing = [name for name in files_named(metadata_bytes) if name not in names]
    if missing:
        raise ValueError(f"the commit record of {directory} names shard files that are missing: {missing}")
    switch_to_record(writer, directory, metadata_bytes, meta_bytes)
    return True
