"""What a writer that died leaves behind, and when it may be removed: one rule for every backend.

A write in progress leaves a hidden object beside its target: a temporary file (other fsspec file systems; local
disks where the file system takes no unnamed files, see :mod:`~lightning_datastates.storage.local`, and for the
moment between the link and the rename of a local commit) or, on S3, a marker object naming an open multipart upload.
Local writes elsewhere leave nothing (a crash frees their unnamed file), but named ones of older versions of this
package are still cleaned. Each is named
``.<name>.<host>.<pid>.<token><suffix>`` (:func:`leftover_name`), so that ``clean_stale`` can tell from the name alone
which process left it (:func:`parse_leftover_name`), and never matches ``*.ckpt``.

Whether its writer is gone (:func:`writer_gone`): a process of this host can be asked (:func:`pid_alive`); a writer
of another host, or one whose name says nothing, counts as gone once the leftover is
:data:`~lightning_datastates.config.DEFAULT_STALE_AGE_S` old (``max_age_s``).
"""

from __future__ import annotations

import functools
import os
import re
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass

#: Suffix of temporary files (local and other fsspec file systems).
TEMP_SUFFIX = ".datastates-tmp"


@dataclass(frozen=True)
class LeftoverOwner:
    """The process that wrote a leftover: its host tag (see :func:`host_tag`) and process id."""

    host: str
    pid: int


@dataclass(frozen=True)
class LeftoverName:
    """A leftover's name, parsed: the target's ``name`` (possibly shortened), its ``owner``, a random ``token``."""

    name: str
    owner: LeftoverOwner
    token: str


def host_tag() -> str:
    """This host's name as it appears in leftover names (characters other than ``[A-Za-z0-9_-]`` become ``_``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def this_process() -> LeftoverOwner:
    """The owner this process writes into leftover names."""
    return LeftoverOwner(host_tag(), os.getpid())


def leftover_name(name: str, suffix: str, max_length: int | None = None) -> str:
    """A fresh hidden name for a leftover of this process beside ``name``: ``.<name>.<host>.<pid>.<token><suffix>``.

    With ``max_length``, ``name`` is shortened so that the whole name fits (a valid target name must not make the
    temporary name too long for the file system).
    """
    owner = this_process()
    tail = f".{owner.host}.{owner.pid}.{uuid.uuid4().hex[:8]}{suffix}"
    if max_length is not None:
        name = name[: max(1, max_length - 1 - len(tail))]
    return f".{name}{tail}"


def parse_leftover_name(basename: str, suffix: str) -> LeftoverName | None:
    """``basename`` parsed as made by :func:`leftover_name` with ``suffix``; None if it is not such a name."""
    match = _pattern(suffix).match(basename)
    if match is None:
        return None
    return LeftoverName(match["name"], LeftoverOwner(match["host"], int(match["pid"])), match["token"])


@functools.lru_cache(maxsize=8)
def _pattern(suffix: str) -> re.Pattern[str]:
    return re.compile(
        r"^\.(?P<name>.+)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.(?P<token>[0-9a-f]{8})" + re.escape(suffix) + "$"
    )


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def writer_gone(
    owner: LeftoverOwner | None,
    age_s: float | None,
    max_age_s: float,
    *,
    tracks_own_writes: bool,
    here: LeftoverOwner | None = None,
    alive: Callable[[int], bool] = pid_alive,
) -> bool:
    """Whether the writer of a leftover is certainly or presumably gone, so that the leftover may be removed.

    * A leftover of this process (``here``, by default :func:`this_process`): gone only if ``tracks_own_writes``, that
      is when the caller already set aside this process's writes in flight (S3 keeps a registry of its open
      uploads), so that what remains is no longer written; a caller that cannot tell (local temporary files) keeps
      this process's leftovers.
    * Of another process of this host: gone when that process is (``alive`` answers for a pid).
    * Of another host, or of no known owner: gone once older than ``max_age_s``; an unknown age counts as old.

    Pure given ``here`` and ``alive``.
    """
    here = here if here is not None else this_process()
    if owner is not None and owner.host == here.host:
        if owner.pid == here.pid:
            return tracks_own_writes
        return not alive(owner.pid)
    return age_s is None or age_s > max_age_s
