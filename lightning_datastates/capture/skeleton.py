"""Pickle a checkpoint as ``torch.save`` does (its ``data.pkl``), several times faster: the layout planner's fast path.

``torch.save`` pickles every tensor through ``Tensor.__reduce_ex__`` and every storage through its own
``persistent_id``: tens of microseconds of Python per tensor, which at an LLM's tensor count (a thousand and more)
is most of a save call. :func:`pickle_skeleton` runs the same C pickler with the same protocol, and answers plain
tensors itself with the very reduction torch would build: ``_rebuild_tensor_v2`` of a persistent id
``("storage", <storage class>, <key>, <location>, <numel>)``, the storage offset, size, strides, ``requires_grad``
and an empty ``OrderedDict`` of hooks. Everything else (dicts, numbers, strings, hyperparameters, ``Parameter``'s own
reduction) is pickled by the same pickler as in ``torch.save``.

The result must be byte for byte the ``data.pkl`` torch would write, and the pickle's memo makes that a question of
identity as well as of values: the pickler memoizes every object it meets by ``id()`` and refers back to it later.
So each reduction returns new tuples and a new hooks object, as torch's does; the key of a storage met again is the
same string object (torch's ``id_map``); the constant strings (``"storage"``, ``"cpu"``) are the same interned
objects torch uses. Storage keys are numbered in the order storages are first met, as torch numbers them, and
storages of the same data under two dtypes are refused as torch refuses them.

Anything this module does not reproduce (tensor subclasses other than ``Parameter``, tensors with hooks or Python
attributes, quantized, sparse, nested or conjugated tensors, dtypes saved as untyped storages, devices other than
CPU and CUDA, bare storages) raises :class:`SkeletonUnsupported`: the caller plans that checkpoint with
``torch.save`` instead. The caller also compares the result with ``torch.save``'s before trusting it
(:mod:`~lightning_datastates.capture.layout`).

This module is pure: no threads, no files, no devices beyond reading tensor metadata.
"""

from __future__ import annotations

import collections
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from lightning_datastates.compat.torch import (
    REBUILD_TENSOR,
    SAVE_PICKLE_PROTOCOL,
    storage_identity,
    storage_location_tag,
    tensor_pickle_metadata,
    typed_storage_pickling,
)

#: The first element of every storage's persistent id (the same interned string as torch's constant).
_STORAGE_TAG = "storage"


class SkeletonUnsupported(Exception):
    """The checkpoint holds an object this module does not pickle as ``torch.save`` would; plan it with torch."""


@dataclass(frozen=True)
class PickledSkeleton:
    """A checkpoint's ``data.pkl`` as ``torch.save`` writes it, and its storages by record key (``data/<key>``)."""

    data: bytes
    storages: list[torch.UntypedStorage]


def pickle_skeleton(checkpoint: Any) -> PickledSkeleton:
    """Pickle ``checkpoint`` as ``torch.save`` does, without touching tensor data.

    Raises:
        SkeletonUnsupported: the checkpoint holds an object whose pickling this module does not reproduce.
        Exception: whatever pickling the checkpoint raises (an unpicklable value); ``torch.save`` would fail too.
    """
    buffer = io.BytesIO()
    pickler = _SkeletonPickler(buffer)
    pickler.dump(checkpoint)
    return PickledSkeleton(buffer.getvalue(), pickler.storages)


class _StorageReference:
    """Stands for a tensor's storage in its reduction; the pickler writes its persistent id in its place."""

    __slots__ = ("persistent_id",)

    def __init__(self, persistent_id: tuple[Any, ...]) -> None:
        self.persistent_id = persistent_id


class _EmptyHooks:
    """Stands for the empty ``OrderedDict`` of backward hooks in a tensor's reduction.

    An ``OrderedDict`` pickles as its class called with no arguments (with nothing after when it is empty); this
    object reduces to exactly that, so the bytes and the memo entry are the same, without ``OrderedDict``'s own
    reduction, which looks up slot names through ``copyreg`` each time (a third of the time per tensor).
    """

    __slots__ = ()


class _SkeletonPickler(pickle.Pickler):
    """``torch.save``'s pickler, with plain tensors reduced here (see the module docstring). One per dump."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=SAVE_PICKLE_PROTOCOL)
        #: Storages by record key, in the order first met.
        self.storages: list[torch.UntypedStorage] = []
        self._keys: dict[int, str] = {}  # storage identity -> key (the same str object each time, as torch's id_map)
        self._dtypes: dict[int, torch.dtype] = {}  # data pointer -> dtype, to refuse one storage under two dtypes

    def persistent_id(self, obj: Any) -> Any:
        """The storage's persistent id for a storage reference; None for every other object (pickled as itself)."""
        if type(obj) is _StorageReference:
            return obj.persistent_id
        return None

    def reducer_override(self, obj: Any) -> Any:
        """The reduction of a plain tensor and of its hooks; ``NotImplemented`` (pickle's own way) for the rest.

        Raises:
            SkeletonUnsupported: a tensor or storage this module does not reproduce.
        """
        kind = type(obj)
        if kind is _EmptyHooks:
            return collections.OrderedDict, ()
        if kind is torch.Tensor:
            return self._reduce_tensor(obj)
        if kind is torch.nn.Parameter:
            return NotImplemented  # Parameter's own reduction hands its plain .data back to this pickler
        if isinstance(obj, (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage)):
            raise SkeletonUnsupported(f"a {kind.__qualname__} in the checkpoint")
        return NotImplemented

    def _reduce_tensor(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        if tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_nested:
            raise SkeletonUnsupported(f"a tensor of layout {tensor.layout} (quantized: {tensor.is_quantized})")
        if tensor._backward_hooks or tensor.__dict__:
            raise SkeletonUnsupported("a tensor with backward hooks or Python attributes")
        dtype = tensor.dtype
        pickling = typed_storage_pickling(dtype)
        if pickling is None:
            raise SkeletonUnsupported(f"a tensor of dtype {dtype}, which torch saves as an untyped storage")
        location = storage_location_tag(tensor.device)
        if location is None:
            raise SkeletonUnsupported(f"a tensor on {tensor.device}")
        if tensor_pickle_metadata(tensor):
            raise SkeletonUnsupported("a conjugated or negated tensor")
        storage = tensor.untyped_storage()
        identity = storage_identity(storage)
        key = self._keys.get(identity)
        if key is None:
            key = self._keys[identity] = str(len(self._keys))
            self.storages.append(storage)
        pointer = storage.data_ptr()
        if pointer and self._dtypes.setdefault(pointer, dtype) != dtype:
            raise SkeletonUnsupported("one storage's data under two dtypes (torch.save refuses it)")
        storage_class, element_size = pickling
        persistent_id = (_STORAGE_TAG, storage_class, key, location, storage.nbytes() // element_size)
        arguments = (
            _StorageReference(persistent_id),
            tensor.storage_offset(),
            tuple(tensor.size()),
            tensor.stride(),
            tensor.requires_grad,
            _EmptyHooks(),
        )
        return REBUILD_TENSOR, arguments
