"""Private torch internals the package relies on, checked against torch 2.13.0 (pyproject accepts 2.7 to 2.14).

Each reach into a torch name, attribute or behaviour that torch does not document as stable is here, named for what
it gives us; the rest of the package calls these. Why the planner needs each one: ``docs/design.md``, "torch file
format facts".
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import pickle
import sys
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.serialization

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def storage_identity(storage: torch.UntypedStorage) -> int:
    """A key that is equal for two ``UntypedStorage`` objects exactly when they are the same storage.

    ``UntypedStorage._cdata`` (the address of the C++ storage object) is private but stable since torch 1.x; two
    Python wrappers of one storage share it, unlike ``id()``, and unlike ``data_ptr()`` it differs for empty storages.
    Checked against torch 2.13.0.
    """
    return int(storage._cdata)


def skip_data() -> contextlib.AbstractContextManager[Any]:
    """Within the block, ``torch.save`` writes every byte of its archive but the storages' data, seeking over it.

    Checked against torch 2.13.0: ``torch.serialization.skip_data`` (a prototype API since torch 2.5); torch refuses
    it for some tensors (quantized, storage-less backends) by raising.
    """
    return torch.serialization.skip_data()


@contextlib.contextmanager
def save_storage_alignment(alignment_bytes: int) -> Iterator[None]:
    """Within the block, ``torch.save`` starts every storage's data at a file offset multiple of ``alignment_bytes``.

    Checked against torch 2.13.0: the process-wide ``torch.utils.serialization.config.save.storage_alignment``
    (torch 2.7 and later, 64 by default), restored on exit. Not thread-safe on its own: the caller keeps two blocks
    from overlapping.
    """
    config = torch.utils.serialization.config.save
    previous = config.storage_alignment
    config.storage_alignment = alignment_bytes
    try:
        yield
    finally:
        config.storage_alignment = previous


# ---------------------------------------------------------------------------------------------------------------------
# torch.save's pickling of a plain tensor and its archive, reproduced by the layout planner's fast path
# (capture/skeleton.py, capture/layout.py); each use is checked against torch.save's own output once per planner.

#: The pickle protocol ``torch.save`` uses by default (its ``pickle_protocol`` argument).
SAVE_PICKLE_PROTOCOL: int = torch.serialization.DEFAULT_PROTOCOL

#: The function ``torch.save``'s pickle names to rebuild a plain tensor from a typed storage (``Tensor.__reduce_ex__``
#: for a tensor of a dtype :func:`typed_storage_pickling` knows).
REBUILD_TENSOR: Any = torch._utils._rebuild_tensor_v2


@functools.cache
def typed_storage_pickling(dtype: torch.dtype) -> tuple[type, int] | None:
    """The storage class ``torch.save`` names in a tensor's persistent id (``torch.FloatStorage`` for float32...) and
    the dtype's element size; None for the dtypes torch saves another way (an untyped storage and
    ``_rebuild_tensor_v3``: float8, uint16, ...).

    Checked against torch 2.13.0: ``torch.storage._new_dtypes`` and ``_dtype_to_storage_type_map``, as
    ``TypedStorage._pickle_storage_type`` uses them; the numel in the id is the storage's bytes over the element size.
    """
    if dtype in torch.storage._new_dtypes():
        return None
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    return None if name is None else (getattr(torch, name), torch._utils._element_size(dtype))


def storage_location_tag(device: torch.device) -> str | None:
    """``torch.serialization.location_tag`` of a storage on ``device``; None for devices other than CPU and CUDA.

    Checked against torch 2.13.0 (``_cpu_tag``, ``_backend_tag``). The pickle memoizes strings by identity, so the
    identity matters as much as the text: torch answers the same interned constant for every CPU storage (so does
    this literal), and a new string for every CUDA storage (so does this concatenation).
    """
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and device.index is not None:
        return "cuda:" + str(device.index)
    return None


def tensor_pickle_metadata(tensor: torch.Tensor) -> dict[str, Any]:
    """The metadata ``torch.save`` appends to a tensor's pickled arguments when it is not empty (conjugate and
    negative bits). Checked against torch 2.13.0: ``torch._C._get_tensor_metadata``."""
    return torch._C._get_tensor_metadata(tensor)  # type: ignore[attr-defined]


def current_storage_alignment() -> int:
    """The alignment ``torch.save`` gives storage records now (``config.save.storage_alignment``, 64 by default).
    Checked against torch 2.13.0: ``torch.serialization._get_storage_alignment``."""
    return int(torch.serialization._get_storage_alignment())


def open_archive_writer(sink: Any) -> contextlib.AbstractContextManager[Any]:
    """``torch.save``'s own zip writer over ``sink`` (a ``torch._C.PyTorchFileWriter`` with torch's current CRC and
    alignment settings, as ``torch.save`` makes it for a file object); on exit the end of the archive is written.

    Checked against torch 2.13.0: ``torch.serialization._open_zipfile_writer``; the writer's ``write_record(name,
    data, nbytes)`` and ``write_record_metadata(name, nbytes)`` (a record whose data is skipped, as under
    ``skip_data``).
    """
    return torch.serialization._open_zipfile_writer(sink)


def records_after_pickle() -> tuple[tuple[str, str], ...]:
    """The records ``torch.save`` writes after ``data.pkl`` and before the storages, in its order, with their content.

    Checked against torch 2.13.0 (``torch.serialization._save``): ``.format_version``, ``.storage_alignment``, then
    ``byteorder``.
    """
    return (
        (".format_version", "1"),
        (".storage_alignment", str(current_storage_alignment())),
        ("byteorder", sys.byteorder),
    )


#: Types of which no instance is a storage: most of the objects a checkpoint pickles (shapes, strides, numbers, keys).
#: torch's ``persistent_id`` answers None for each (checked against torch 2.13.0).
NEVER_STORAGE_TYPES = frozenset(
    {int, float, bool, str, bytes, type(None), tuple, list, dict, collections.OrderedDict, torch.Size, torch.dtype}
)


def recording_pickle_module(storages_by_key: dict[int, torch.UntypedStorage]) -> Any:
    """A ``pickle_module`` for ``torch.save`` that writes each storage torch names into ``storages_by_key``, under the
    record key torch gives it (its data goes to the archive record ``data/<key>``).

    Checked against torch 2.13.0: ``torch.save`` subclasses ``pickle_module.Pickler`` and defines ``persistent_id`` on
    the subclass, which answers ``("storage", storage_type, key, location, numel)`` for a storage (an
    ``UntypedStorage``, or a ``TypedStorage`` around the private ``_untyped_storage``) and None for the types of
    :data:`NEVER_STORAGE_TYPES`. ``__init_subclass__`` wraps that method: those types are answered without asking
    torch (two calls and checks fewer per object), and every storage torch names is recorded.
    """

    class RecordingPickler(pickle.Pickler):
        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            torch_persistent_id = cls.persistent_id

            def persistent_id(self: Any, obj: Any) -> Any:
                if type(obj) in NEVER_STORAGE_TYPES:
                    return None  # what torch's persistent_id answers for them, without its two calls and checks
                result = torch_persistent_id(self, obj)
                if isinstance(result, tuple) and result and result[0] == "storage":
                    storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                    storages_by_key.setdefault(int(result[2]), storage)
                return result

            cls.persistent_id = persistent_id  # type: ignore[method-assign]

    return types.SimpleNamespace(__name__="pickle", Pickler=RecordingPickler, dump=pickle.dump)


class TorchArchiveReader:
    """torch's own reader of ``torch.save`` archives, to ask where it finds each record.

    Checked against torch 2.13.0: the private binding ``torch._C.PyTorchFileReader``, over a file object with
    ``read``, ``seek`` and ``tell``; it raises (``RuntimeError``) on an archive it cannot parse.
    """

    def __init__(self, source: Any) -> None:
        self._reader = torch._C.PyTorchFileReader(source)

    def record_names(self) -> set[str]:
        """The names of every record of the archive (``data.pkl``, ``data/0``, ...)."""
        return set(self._reader.get_all_records())

    def record_offset(self, name: str) -> int:
        """The file offset at which torch reads the data of record ``name``."""
        return int(self._reader.get_record_offset(name))  # type: ignore[attr-defined]  # missing from torch's stubs


def fake_tensor_mode() -> contextlib.AbstractContextManager[Any]:
    """Within the block, ``torch.load`` builds tensors with shapes and dtypes but no data (nothing is read for them).

    Checked against torch 2.13.0: ``torch._subclasses.fake_tensor.FakeTensorMode`` (private; imported on use, it loads
    much of torch's compiler stack).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def loaded_storage_nbytes(tensor: torch.Tensor) -> int:
    """The bytes of the storage ``tensor`` was loaded over by ``torch.load`` (possibly under :func:`fake_tensor_mode`):
    the size of its record in the file.

    torch 2.7 (seen on 2.7.1) makes each storage it fakes ``element_size`` times too large: it multiplies the byte
    count by the element size of the storage's dtype a second time. Where a probe shows that, the size of a fake
    (``meta``) storage is divided by the element size of the tensor over it (the dtype torch loaded it as, unless
    tensors of two dtypes share it).
    """
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if storage.device.type == "meta" and _fake_storages_scaled_by_element_size():
        return nbytes // tensor.element_size()
    return nbytes


@functools.cache
def _fake_storages_scaled_by_element_size() -> bool:
    """Whether ``torch.load`` under fake tensors makes storages ``element_size`` times too large (see
    :func:`loaded_storage_nbytes`). Tried on a one-element float32 tensor, not inferred from the version."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(1, dtype=torch.float32), buffer)
    buffer.seek(0)
    with fake_tensor_mode():
        probe = torch.load(buffer, weights_only=True)
    return int(probe.untyped_storage().nbytes()) == 4 * 4


def loaded_storage_key(storage: torch.UntypedStorage) -> Any:
    """A key naming the record a storage was loaded from: equal for tensors that share one record of the file.

    Checked against torch 2.13.0: under fake tensors (and with ``mmap``) ``torch.load`` sets the private
    ``_checkpoint_offset`` (the record's offset in the file) on each storage; elsewhere the data pointer, or the
    object's identity for storages without data, stand in.
    """
    return getattr(storage, "_checkpoint_offset", None) or storage.data_ptr() or id(storage)


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """The record DCP's ``.metadata`` keeps for one item: where its bytes lie in which file of the checkpoint.

    ``torch.distributed.checkpoint.filesystem._StorageInfo`` is private, but it is what ``FileSystemReader`` (and
    Lightning's sharded load through it) expects in ``Metadata.storage_data``. Checked against torch 2.13.0.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


@functools.cache
def dtensor_type() -> type[DTensor]:
    """torch's ``DTensor`` class, imported on first use (importing ``torch.distributed.tensor`` costs time at startup;
    a function-level import costs a microsecond per call, and the sharded staging asks thousands of times a save)."""
    from torch.distributed.tensor import DTensor

    return DTensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a DTensor's local tensor (sharing its storage), else ``tensor``.

    A DTensor of exactly that type gives its ``_local_tensor`` (private; what ``to_local()`` returns a view of,
    without the autograd function that costs microseconds per tensor, thousands per save; checked against torch
    2.13.0); another subclass goes through ``to_local()``.
    """
    dtensor = dtensor_type()
    if isinstance(tensor, dtensor):
        local = getattr(tensor, "_local_tensor", None)
        if type(tensor) is dtensor and isinstance(local, torch.Tensor):
            return local
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def persistent_buffers(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The buffers of ``module`` and its submodules that its ``state_dict`` holds (those registered with
    ``persistent=False`` are left out), without calling ``state_dict`` (which runs hooks, and collectives under FSDP).
    ``Module._buffers`` and ``_non_persistent_buffers_set`` are private; checked against torch 2.13.0."""
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                yield buffer


def dcp_fsspec_reader(path: str, storage_options: dict[str, Any] | None) -> Any:
    """DCP's ``StorageReader`` for a checkpoint directory at an fsspec URL (``s3://``, ...), its file system opened
    with ``storage_options``.

    ``FsspecReader`` lives in the private ``torch.distributed.checkpoint._fsspec_filesystem`` (torch does not export
    it from the package); its constructor has taken ``(path, **fsspec_options)`` since torch 2.2. Checked against torch
    2.13.0.
    """
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(path, **(storage_options or {}))
