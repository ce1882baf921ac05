"""Which storages the save call copies before it returns (the eager part) and which after (the lazy part).

Device storages stand in as ``meta`` storages (a device without a host address, as CUDA's): the split looks at the
device and the size, never at the bytes.
"""

from __future__ import annotations

import torch

from lightning_datastates.capture.planning import eager_record_keys
from lightning_datastates.records.layout import StorageRecord

EAGER_COPY_SIZE = 64 * 1024


def _storages() -> list[torch.UntypedStorage]:
    return [
        torch.zeros(16).untyped_storage(),  # 0: small, host
        torch.zeros(1 << 20).untyped_storage(),  # 1: large, host
        torch.empty(16, device="meta").untyped_storage(),  # 2: small, device
        torch.empty(1 << 20, device="meta").untyped_storage(),  # 3: large, device
        torch.zeros(EAGER_COPY_SIZE // 4).untyped_storage(),  # 4: host, exactly the threshold
    ]


def _records(storages: list[torch.UntypedStorage]) -> list[StorageRecord]:
    return [StorageRecord(key, 4096 * (1 << 10) * key, storage.nbytes()) for key, storage in enumerate(storages)]


def test_without_a_barrier_everything_is_eager() -> None:
    storages = _storages()
    assert eager_record_keys(_records(storages), storages, None, EAGER_COPY_SIZE) == {0, 1, 2, 3, 4}


def test_small_host_storages_are_eager_and_device_storages_lazy_whatever_their_size() -> None:
    """A memcpy of a small host tensor costs less than deferring it; a small device tensor copied in the save call
    would make it wait for the device and for one copy per tensor, so it is left to the copier."""
    storages = _storages()
    assert eager_record_keys(_records(storages), storages, lambda storage: True, EAGER_COPY_SIZE) == {0, 4}


def test_storages_the_predicate_refuses_are_eager_on_any_device() -> None:
    storages = _storages()
    changing = {storages[1].data_ptr(), id(storages[2]), id(storages[3])}  # meta storages have no address

    def lazy(storage: torch.UntypedStorage) -> bool:
        key = id(storage) if storage.device.type == "meta" else storage.data_ptr()
        return key not in changing

    assert eager_record_keys(_records(storages), storages, lazy, EAGER_COPY_SIZE) == {0, 1, 2, 3, 4}
    assert eager_record_keys(_records(storages), storages, lambda s: s.device.type == "cpu", 0) == {2, 3}
