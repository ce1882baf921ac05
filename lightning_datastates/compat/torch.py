"""Private torch internals the package relies on, checked against torch 2.6 to 2.14 (tested on 2.13)."""

from __future__ import annotations

import torch


def storage_identity(storage: torch.UntypedStorage) -> int:
    """A key that is equal for two ``UntypedStorage`` objects exactly when they are the same storage.

    ``UntypedStorage._cdata`` (the address of the C++ storage object) is private but stable since torch 1.x; two
    Python wrappers of one storage share it, unlike ``id()``, and unlike ``data_ptr()`` it differs for empty storages.
    """
    return int(storage._cdata)
