"""Typed settings of :class:`~lightning_datastates.DataStatesIO`, validated once, with errors that name the fix."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from decimal import Decimal
from typing import Any, Literal, get_args

from lightning_datastates.copy import sizing
from lightning_datastates.errors import ConfigError

#: A size setting: bytes as an int, or a string such as ``"8GiB"``, ``"512MB"``, ``"4096"``.
Size = int | str

# ---------------------------------------------------------------------------------------------- fault policies
#: What training does when a checkpoint fails to reach storage: raise ``CheckpointFlushError`` at the next hook, or
#: log a warning naming the path and the cause and go on (the failed checkpoint is lost, earlier ones are kept).
FlushErrorPolicy = Literal["raise", "warn"]
#: What a save does when earlier checkpoints still hold the host arena: ``wait`` for their flush (back-pressure), or
#: ``skip`` this checkpoint with a warning (nothing is written for it, and the removals it would allow are dropped).
ArenaFullPolicy = Literal["wait", "skip"]
#: Local writes: ``"auto"`` writes whole aligned blocks with direct I/O (``O_DIRECT``) on local disks and parallel
#: file systems and through the page cache elsewhere, quietly; True: direct I/O wherever accepted, with a warning
#: where refused; False: page cache.
DirectIO = bool | Literal["auto"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_MAX_SIZE_BYTES = 2**60  # 1 EiB
#: Largest ``storage_alignment``: a 16 MiB Lustre stripe.
MAX_ALIGNMENT = 16 * 1024**2
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
#: Leftovers whose writer cannot be asked whether it is alive (a temporary file of another host, an S3 upload with no
#: marker) are removed by ``StorageWriter.clean_stale`` once they are this old (by default; the rule is
#: :mod:`~lightning_datastates.records.leftovers`'s).
DEFAULT_STALE_AGE_S = 3600.0


def parse_size(value: Size, name: str) -> int:
    """Bytes from an int or a string with a unit (``"8GiB"``, ``"1.5GB"``, ``"4096"``).

    Raises:
        ConfigError: naming ``name`` and the accepted forms.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size such as 4096 or '8GiB', got {value!r}")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE_PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"{name}={value!r} is not a size: use bytes (4096) or a number with a unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '8GiB'"
            )
        nbytes = int(Decimal(match.group(1)) * _UNITS[unit])  # exact: no float rounding or overflow
    else:
        raise ConfigError(f"{name} must be an int or a string such as '8GiB', got {type(value).__name__}")
    if nbytes <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    if nbytes > _MAX_SIZE_BYTES:
        raise ConfigError(f"{name}={value!r} is larger than any machine's memory or file; did you mean a smaller unit?")
    return nbytes


@dataclass(frozen=True)
class DataStatesConfig:
    """Validated settings; see :class:`~lightning_datastates.DataStatesIO` for what each one means.

    The fields are ``DataStatesIO``'s parameters, with its names, in its order and with its defaults (each size as
    bytes), plus ``write_through``; ``tests/test_config.py`` keeps the two in step. The constructor takes the
    values as a user gives them (sizes as ints or strings such as ``"8GiB"``, in Python or yaml), checks each one
    and raises :class:`~lightning_datastates.errors.ConfigError` naming the setting and the fix; once built, every
    size holds its bytes as an int.
    """

    host_cache: int | None = None
    writer_threads: int = 4
    chunk_size: int = 64 * 1024**2
    eager_copy_size: int = 64 * 1024
    storage_options: dict[str, Any] | None = None
    verify_checksums: bool = True
    on_flush_error: FlushErrorPolicy = "raise"
    on_arena_full: ArenaFullPolicy = "wait"
    stale_after_s: float = DEFAULT_STALE_AGE_S
    storage_alignment: int | None = None
    serve_from_memory: bool = True
    direct_io: DirectIO = "auto"
    local_tier: str | None = None
    local_keep: int = 2
    # Not a user setting: lazy chunks of host tensors are written straight from them when the storage takes writes
    # at memory speed (records/through.py). Tests turn it off to exercise the arena path on the CPU.
    write_through: bool = field(default=True, metadata={"user_setting": False})

    def __post_init__(self) -> None:
        """Check every value as given (by the constructor, yaml, or ``dataclasses.replace``); sizes become bytes."""
        host_cache: Size | None = self.host_cache
        host_cache_bytes = None if host_cache is None else parse_size(host_cache, "host_cache")
        writer_threads = self.writer_threads
        if isinstance(writer_threads, bool) or not isinstance(writer_threads, int) or not 1 <= writer_threads <= 256:
            raise ConfigError(f"writer_threads must be an int from 1 to 256, got {writer_threads!r}")
        chunk_bytes = parse_size(self.chunk_size, "chunk_size")
        if host_cache_bytes is not None and host_cache_bytes < 1024**2:
            raise ConfigError(f"host_cache={host_cache!r} is below 1MiB; give at least '64MiB', or None for automatic")
        eager_copy_bytes = parse_size(self.eager_copy_size, "eager_copy_size")
        storage_options = self.storage_options
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}")
        if not isinstance(self.verify_checksums, bool):
            raise ConfigError(f"verify_checksums must be True or False, got {self.verify_checksums!r}")
        if not isinstance(self.serve_from_memory, bool):
            raise ConfigError(f"serve_from_memory must be True or False, got {self.serve_from_memory!r}")
        direct_io = self.direct_io
        if not (isinstance(direct_io, bool) or direct_io == "auto"):
            raise ConfigError(
                f"direct_io must be 'auto' (direct I/O for local files where the file system supports it), True (the "
                f"same, warning where it does not) or False (always the page cache), got {direct_io!r}"
            )
        _check_fault_policies(self.on_flush_error, self.on_arena_full, self.stale_after_s)
        local_tier = _local_tier(self.local_tier)
        local_keep = self.local_keep
        if isinstance(local_keep, bool) or not isinstance(local_keep, int) or local_keep < 0:
            raise ConfigError(
                f"local_keep must be an int >= 0 (how many of the newest checkpoints the local tier keeps once "
                f"replicated; default 2), got {local_keep!r}"
            )
        storage_alignment: Size | None = self.storage_alignment
        alignment = None if storage_alignment is None else parse_size(storage_alignment, "storage_alignment")
        if alignment is not None and not (alignment & (alignment - 1) == 0 and 64 <= alignment <= MAX_ALIGNMENT):
            raise ConfigError(
                f"storage_alignment must be a power of two from 64 to {MAX_ALIGNMENT} bytes (4096: every tensor on "
                "its own disk blocks), "
                f"or None; got {storage_alignment!r}"
            )
        # Frozen: the normalised values are set the way dataclasses set fields of frozen instances.
        for name, value in (
            ("host_cache", host_cache_bytes),
            ("chunk_size", chunk_bytes),
            ("eager_copy_size", eager_copy_bytes),
            ("stale_after_s", float(self.stale_after_s)),
            ("storage_alignment", alignment),
            ("local_tier", local_tier),
        ):
            object.__setattr__(self, name, value)

    def arena_bytes_for(self, payload_bytes: int) -> int:
        """Arena size: the user's ``host_cache``, or the default rule of :mod:`~lightning_datastates.copy.sizing`
        (two checkpoints, at most half the available memory)."""
        if self.host_cache is not None:
            return self.host_cache
        return sizing.default_arena_bytes(payload_bytes, sizing.available_memory_bytes())


#: The fields that are ``DataStatesIO`` parameters, in its order: every field but ``write_through``.
USER_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(DataStatesConfig) if f.metadata.get("user_setting", True))


def check_settings(settings: Mapping[str, Any]) -> DataStatesConfig:
    """Validate ``DataStatesIO`` keyword arguments as a user gives them (in Python, yaml or on a command line): names
    and values; return the validated settings.

    Raises:
        ConfigError: for a name ``DataStatesIO`` does not take, naming it and the closest setting; else as
            :class:`DataStatesConfig` does for the first invalid value (naming the setting and the fix).
    """
    for name in settings:
        if name not in USER_SETTINGS:
            close = difflib.get_close_matches(name, USER_SETTINGS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"DataStatesIO has no setting {name!r}: {hint}Its settings are {', '.join(USER_SETTINGS)} "
                '(docs/operations.md, "Configuration")'
            )
    return DataStatesConfig(**settings)


def _local_tier(value: Any) -> str | None:
    """``local_tier`` as an absolute, normalized local path (``file://`` dropped); None stays None.

    Raises:
        ConfigError: not a string, or not a local path.
    """
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ConfigError(f"local_tier must be a local directory such as '/local/nvme/ckpts', or None; got {value!r}")
    text = os.fspath(value)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if "://" in text:
        raise ConfigError(
            f"local_tier={value!r} is not a local directory: the local tier is node-local storage (NVMe, a local "
            "disk). Give the remote location as ModelCheckpoint's dirpath, and local_tier a local directory such as "
            "'/local/nvme/ckpts'"
        )
    return os.path.abspath(os.path.expanduser(text))


def _check_fault_policies(on_flush_error: Any, on_arena_full: Any, stale_after_s: Any) -> None:
    """Raise ``ConfigError`` naming the fault-policy setting that is invalid and its accepted values."""
    for name, value, policy in (
        ("on_flush_error", on_flush_error, FlushErrorPolicy),
        ("on_arena_full", on_arena_full, ArenaFullPolicy),
    ):
        if value not in get_args(policy):
            accepted = " or ".join(repr(choice) for choice in get_args(policy))
            raise ConfigError(f"{name} must be {accepted}, got {value!r}")
    if isinstance(stale_after_s, bool) or not isinstance(stale_after_s, (int, float)) or not stale_after_s >= 0:
        raise ConfigError(f"stale_after_s must be a number of seconds >= 0 (default 3600), got {stale_after_s!r}")
