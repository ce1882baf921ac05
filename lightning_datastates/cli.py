"""``python -m lightning_datastates``: verify, inspect and clean checkpoints, local or remote.

* ``verify PATH...``: check every record of each checkpoint against its CRC-32; exit status 0 when every file is
  whole and fully checksummed, 1 otherwise (damaged, missing, or records without a checksum).
* ``inspect PATH``: what a checkpoint holds: top-level keys, every tensor with dtype, shape and size, totals;
  tensors are read as metadata only (their data is not loaded). ``--json`` for scripts.
* ``clean DIR_OR_URL...``: remove temporary files of writers that died, abort their open S3 multipart uploads, and
  remove what sharded saves that died in flight left in the directory's subdirectories.

PATHs are local paths or URLs (``s3://bucket/key``, any fsspec protocol); ``--storage-options`` takes the same
JSON object as ``DataStatesIO(storage_options=...)``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from lightning_datastates.compat.torch import fake_tensor_mode, loaded_storage_key, loaded_storage_nbytes
from lightning_datastates.config import DEFAULT_STALE_AGE_S
from lightning_datastates.errors import CheckpointCorruptError
from lightning_datastates.load.reader import verify_checkpoint
from lightning_datastates.storage import LocalWriter, StorageWriter, is_local_path, local_path, writer_for


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.storage_options) if args.storage_options else None
    except json.JSONDecodeError as exc:
        parser.error(f"--storage-options is not JSON: {exc}")
    if options is not None and not isinstance(options, dict):
        parser.error('--storage-options must be a JSON object, e.g. \'{"endpoint_url": "http://..."}\'')
    return int(args.run(args, options))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_datastates",
        description="Verify, inspect and clean checkpoints, local or remote (PATHs are local paths or URLs such as "
        "s3://bucket/key).",
    )
    parser.add_argument(
        "--storage-options", metavar="JSON", help="fsspec options for URLs, as DataStatesIO(storage_options=...)"
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    verify = commands.add_parser("verify", help="check checkpoints against their CRC-32s (exit 1 if any fails)")
    verify.add_argument("paths", nargs="+", metavar="PATH")
    verify.set_defaults(run=_verify)
    inspect = commands.add_parser("inspect", help="list what a checkpoint holds without loading its tensors")
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument(
        "--unsafe",
        action="store_true",
        help="unpickle objects weights_only=True refuses (runs code from the file: only for files you trust)",
    )
    inspect.set_defaults(run=_inspect)
    clean = commands.add_parser(
        "clean", help="remove temporary files, open uploads and sharded saves of writers that died"
    )
    clean.add_argument(
        "directories", nargs="+", metavar="DIR_OR_URL", help="a checkpoint directory (ModelCheckpoint's dirpath)"
    )
    clean.add_argument(
        "--max-age-s",
        type=_non_negative_seconds,
        default=DEFAULT_STALE_AGE_S,
        metavar="SECONDS",
        help="remove leftovers whose writer cannot be asked (another host, no marker) once older than this "
        f"(default {DEFAULT_STALE_AGE_S:g}; those of dead processes on this host go at once)",
    )
    clean.set_defaults(run=_clean)
    return parser


# ---------------------------------------------------------------------------------------------------- verify
def _verify(args: argparse.Namespace, options: dict[str, Any] | None) -> int:
    failures = 0
    for path in args.paths:
        try:
            report = verify_checkpoint(writer_for(path, options), path)
        except CheckpointCorruptError as exc:
            print(f"DAMAGED {path}: {exc}")
            failures += 1
            continue
        except (OSError, ValueError) as exc:  # missing file, unreadable, unknown protocol
            print(f"ERROR {path}: {exc}")
            failures += 1
            continue
        if report.legacy_format:
            print(f"UNVERIFIED {path}: torch's legacy (non-zip) format, which carries no CRC-32")
            failures += 1
            continue
        if report.unchecked:
            names = ", ".join(report.unchecked[:5]) + (", ..." if len(report.unchecked) > 5 else "")
            print(
                f"UNVERIFIED {path}: {len(report.unchecked)} record(s) carry no CRC-32 ({names}); written by "
                "torch.save with its CRC option off, or by lightning-datastates 0.1"
            )
            failures += 1
            continue
        print(f"OK {path}: {report.verified} records, {_size(report.verified_bytes)} verified")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------------- inspect
def _inspect(args: argparse.Namespace, options: dict[str, Any] | None) -> int:
    path = args.path
    try:
        writer = writer_for(path, options)
        if not writer.exists(path):
            print(f"ERROR {path}: no such checkpoint", file=sys.stderr)
            return 1
        checkpoint = _load_metadata(writer, path, weights_only=not args.unsafe)
    except Exception as exc:  # noqa: BLE001 - any failure to read is reported, with its cause
        print(f"ERROR {path}: cannot read it: {exc} ({_read_hint(exc, args.unsafe, path)})", file=sys.stderr)
        return 1
    summary = summarize(checkpoint)
    if args.json:
        print(json.dumps({"path": path, **summary}, indent=1))
        return 0
    print(path)
    print("keys: " + ", ".join(f"{k} ({v})" for k, v in summary["keys"].items()))
    print("tensors:")
    width = min(max((len(t["name"]) for t in summary["tensors"]), default=0), _NAME_COLUMN)
    for tensor in summary["tensors"]:
        shape = "x".join(map(str, tensor["shape"])) or "scalar"
        name = _fit(tensor["name"], width)
        print(f"  {name:<{width}}  {tensor['dtype']:<14} {_fit(shape, 16):<16} {_size(tensor['nbytes']):>10}")
    totals = summary["totals"]
    dtypes = ", ".join(f"{d} ({n})" for d, n in totals["dtypes"].items())
    print(
        f"totals: {totals['tensors']} tensors in {totals['storages']} storages, "
        f"{_size(totals['storage_bytes'])} of tensor data; dtypes: {dtypes or 'none'}"
    )
    return 0


#: The widest tensor name ``inspect`` prints in full: its lines fit 100 columns (``--json`` gives every name whole).
_NAME_COLUMN = 52


def _fit(text: str, width: int) -> str:
    """``text``, its middle elided where it is wider than ``width`` (a tensor's name keeps its start and its end)."""
    if len(text) <= width:
        return text
    keep = width - 3
    return f"{text[: keep - keep // 2]}...{text[len(text) - keep // 2 :]}"


def _read_hint(exc: Exception, unsafe: bool, path: str) -> str:
    """What to do about a checkpoint ``inspect`` cannot read: ``--unsafe`` only where ``weights_only`` refused an
    object in it; otherwise the file may be damaged, which ``verify`` tells."""
    if not unsafe and isinstance(exc, pickle.UnpicklingError):
        return "it holds objects weights_only=True refuses; if you trust the file: --unsafe"
    return f"the file may be damaged or cut short: python -m lightning_datastates verify {path} checks every record"


def _load_metadata(writer: StorageWriter, path: str, weights_only: bool) -> Any:
    """The checkpoint with fake tensors: shapes and dtypes, no tensor data read (local files are mapped instead
    when torch cannot fake them)."""
    source: Any = local_path(path) if isinstance(writer, LocalWriter) else None
    try:
        with fake_tensor_mode():
            if source is not None:
                return torch.load(source, weights_only=weights_only)
            with writer.open_read(path) as stream:
                return torch.load(stream, weights_only=weights_only)
    except Exception:
        if source is None:
            raise
        return torch.load(source, weights_only=weights_only, mmap=True)  # pages are read only if touched


def summarize(checkpoint: Any) -> dict[str, Any]:
    """Keys, tensors (name, dtype, shape, bytes) and totals of a loaded (possibly fake) checkpoint."""
    tensors: list[dict[str, Any]] = []
    storages: dict[Any, int] = {}
    _walk(checkpoint, "", tensors, storages)
    keys = {str(k): _describe(v) for k, v in checkpoint.items()} if isinstance(checkpoint, dict) else {}
    return {
        "keys": keys,
        "tensors": tensors,
        "totals": {
            "tensors": len(tensors),
            "storages": len(storages),
            "storage_bytes": sum(storages.values()),
            "dtypes": dict(Counter(t["dtype"] for t in tensors).most_common()),
        },
    }


def _walk(value: Any, name: str, tensors: list[dict[str, Any]], storages: dict[Any, int]) -> None:
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage() if value.layout == torch.strided else None
        if storage is not None:
            # Fake and mapped storages have no comparable data pointer: the file offset names the record.
            storages[loaded_storage_key(storage)] = loaded_storage_nbytes(value)
        tensors.append(
            {
                "name": name or "<root>",
                "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape),
                "nbytes": value.numel() * value.element_size(),
            }
        )
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{name}.{key}" if name else str(key), tensors, storages)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for index, item in enumerate(value):
            _walk(item, f"{name}[{index}]", tensors, storages)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, (dict, list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------------------------------- clean
def _clean(args: argparse.Namespace, options: dict[str, Any] | None) -> int:
    # Imported here: it brings torch.distributed.checkpoint (about 1 s), which verify and inspect do not need.
    from lightning_datastates.sharded.leftovers import clean_leftovers

    status = 0
    for directory in args.directories:
        problem = _not_a_local_directory(directory)
        if problem is not None:
            print(f"ERROR {directory}: {problem}")
            status = 1
            continue
        try:
            removed = clean_leftovers(writer_for(directory, options), directory, args.max_age_s)
        except (OSError, ValueError) as exc:
            print(f"ERROR {directory}: {exc}")
            status = 1
            continue
        for entry in removed:
            print(f"removed {entry}")
        print(f"{directory}: {len(removed)} leftover(s) of dead writers removed")
    return status


def _not_a_local_directory(directory: str) -> str | None:
    """Why the local ``directory`` cannot be cleaned (missing, or a file such as a checkpoint given instead of its
    directory); None where it can, and for URLs (an object store has no directories to be missing)."""
    if not is_local_path(directory):
        return None
    path = local_path(directory)
    if os.path.isfile(path):
        return "is a file: give the checkpoint directory that holds it (ModelCheckpoint's dirpath)"
    if not os.path.isdir(path):
        return "no such directory: give the checkpoint directory (ModelCheckpoint's dirpath)"
    return None


def _non_negative_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds >= 0")
    return seconds


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")
