"""Which save a checkpoint file holds: the save's stamp, kept in the file's zip comment, and the sequence it comes from.

The lifecycle decides "which copy is newest" one way (``docs/design.md``, "The checkpoint lifecycle"): by the stamp of
the save each copy holds, never by the date a file system or an object store gives a file. A date tells when bytes
reached storage, and the writes of overlapping saves end in any order; S3 dates an object by the start of its upload,
to the second, on the server's clock; a copy replicated later, or on another node, gets another date again.

A :class:`SaveStamp` is taken on the training thread at the save call (:meth:`SaveSequence.next`) and written into
the file itself, as the archive comment of its zip end-of-central-directory record, the one field of a zip archive
that every reader skips (``torch.load``, ``zipfile``, ``unzip``). A replica is a byte copy, so both tiers' copies of
one save carry the same stamp: equal stamps prove two copies hold the same save, and the larger stamp is the newer
save, whichever tier, node or run wrote it.

The sequence: strictly increasing within a process (each stamp above the one before), never below the clock in
microseconds (so that a later run's saves come after an earlier run's, and files without a stamp, written by plain
Lightning or an older release, compare by their modification time in the same unit), and raised above every stamp the
process reads (:meth:`SaveSequence.observe`: the resolution of ``"last"`` and the local tier's recovery read the
stamps of a directory before the run saves into it, so its saves come after them even where another node's clock ran
ahead). ``run`` names the process that took the stamp (random, new in a forked child), to tell apart two stamps of the
same number from two processes.

Pure records and arithmetic; any thread (the sequence holds its own lock).
"""

from __future__ import annotations

import os
import re
import struct
import threading
import time
from dataclasses import dataclass, field

#: Signature of the zip end-of-central-directory record, which ends every zip archive (before its comment).
_EOCD_SIGNATURE = b"PK\x05\x06"
#: Bytes of that record without its comment; its last field (2 bytes) is the comment's length.
EOCD_BYTES = 22
_COMMENT = re.compile(rb"lightning-datastates save (\d{20}) run ([0-9a-f]{16}) (resume|weight)\Z")
#: Bytes of a stamp's comment.
COMMENT_BYTES = len(b"lightning-datastates save ") + 20 + len(b" run ") + 16 + len(b" resume")
#: Bytes at the end of a file that hold its stamp (the end-of-central-directory record and the comment).
TAIL_BYTES = EOCD_BYTES + COMMENT_BYTES


@dataclass(frozen=True, order=True)
class SaveStamp:
    """The save a checkpoint file holds: its place in the save sequence (``sequence``, microseconds since the epoch
    or above, see the module docstring) and the process that saved it (``run``, 16 hex digits). Ordered by
    ``sequence`` first: the larger stamp is the newer save. ``resumable``: the checkpoint holds what a resume needs
    (optimizer states; False for ``save_weights_only``): ``ckpt_path="last"`` passes over the others. It is no part
    of which save a stamp names (equality and order leave it out)."""

    sequence: int
    run: str
    resumable: bool = field(default=True, compare=False)

    def comment(self) -> bytes:
        """The zip archive comment that holds this stamp (:data:`COMMENT_BYTES` bytes)."""
        kind = b"resume" if self.resumable else b"weight"
        return b"lightning-datastates save %020d run %s %s" % (self.sequence, self.run.encode(), kind)

    def __str__(self) -> str:
        return f"save {self.sequence} of run {self.run}"


def stamp_end_record(end_record: bytes, stamp: SaveStamp) -> bytes | None:
    """``end_record`` (a file's last bytes, ending with a comment-less end-of-central-directory record) with that
    record's comment set to ``stamp``; None where ``end_record`` does not end so (nothing is stamped then). Pure."""
    if len(end_record) < EOCD_BYTES or end_record[-EOCD_BYTES:][:4] != _EOCD_SIGNATURE or end_record[-2:] != b"\0\0":
        return None
    comment = stamp.comment()
    return end_record[:-2] + struct.pack("<H", len(comment)) + comment


def stamp_bytes(archive: bytes, stamp: SaveStamp) -> bytes:
    """The zip archive ``archive`` (a whole file's bytes, as ``torch.save`` writes them) with ``stamp`` as its
    comment; ``archive`` itself where it does not end with a comment-less end record. Pure."""
    end = stamp_end_record(archive[-EOCD_BYTES:], stamp)
    return archive if end is None else archive[:-EOCD_BYTES] + end


def parse_stamp(tail: bytes | bytearray | memoryview) -> SaveStamp | None:
    """The stamp in a file's last bytes (``tail``: at least :data:`TAIL_BYTES` of them, or the whole file); None where
    the file carries none (plain ``torch.save``, an older release, not a zip archive). Pure."""
    tail = bytes(tail[-TAIL_BYTES:])
    if len(tail) != TAIL_BYTES or tail[:4] != _EOCD_SIGNATURE:
        return None
    if struct.unpack_from("<H", tail, EOCD_BYTES - 2)[0] != COMMENT_BYTES:
        return None
    match = _COMMENT.match(tail, EOCD_BYTES)
    if match is None:
        return None
    return SaveStamp(int(match.group(1)), match.group(2).decode(), match.group(3) == b"resume")


def order_key(stamp: SaveStamp | None, modified_s: float | None) -> tuple[int, str]:
    """What orders two checkpoints, newest largest: the stamp; for a file without one (plain Lightning, an older
    release) its modification time in microseconds (the unit of the sequence), which compares with stamps as the
    clock does; ``(-1, "")`` where neither is known. Pure."""
    if stamp is not None:
        return stamp.sequence, stamp.run
    if modified_s is not None:
        return int(modified_s * 1_000_000), ""
    return -1, ""


class SaveSequence:
    """Numbers saves (see the module docstring). One per process (:data:`SAVE_SEQUENCE`); any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0
        self.run = os.urandom(8).hex()

    def next(self, resumable: bool = True) -> SaveStamp:
        """A stamp above every stamp taken or observed before, and not below the clock (microseconds), for a
        checkpoint that is ``resumable`` (see :class:`SaveStamp`)."""
        with self._lock:
            self._last = max(self._last + 1, time.time_ns() // 1000)
            return SaveStamp(self._last, self.run, resumable)

    def observe(self, stamp: SaveStamp | None) -> None:
        """Stamps taken from now on come after ``stamp`` (a stamp read from storage); None does nothing."""
        if stamp is not None:
            with self._lock:
                self._last = max(self._last, stamp.sequence)

    def _new_run(self) -> None:
        """A forked child is another process: its stamps get a run of their own."""
        self._lock = threading.Lock()
        self.run = os.urandom(8).hex()


#: The process's save sequence.
SAVE_SEQUENCE = SaveSequence()
os.register_at_fork(after_in_child=SAVE_SEQUENCE._new_run)
