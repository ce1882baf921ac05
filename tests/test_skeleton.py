"""The layout planner's fast path: ``data.pkl`` pickled as ``torch.save`` does, archives spliced from earlier plans.

Every test compares with what ``torch.save`` writes for the same object: ``data.pkl`` byte for byte, and assembled
files except the fields :func:`tests.test_layout._mask_volatile` zeroes (CRC-32s, the serialization id).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import logging
from typing import Any

import pytest
import torch
from torch import nn

import lightning_datastates.capture.layout as layout_module
from lightning_datastates.capture.layout import plan_layout
from lightning_datastates.capture.planning import LayoutPlanner
from lightning_datastates.capture.skeleton import PickledSkeleton, SkeletonUnsupported, pickle_skeleton
from lightning_datastates.capture.verified import VerifiedStructures
from lightning_datastates.compat.torch import storage_identity
from lightning_datastates.plugin import pipeline_of
from tests.conftest import (
    BNModel,
    RecordingDataStatesIO,
    every_step_checkpoint,
    file_mismatches,
    make_loader,
    make_trainer,
    storage_bytes,
)
from tests.test_layout import (
    CASES,
    _assemble_layout,
    _assert_same,
    _mask_volatile,
    _record_bytes,
    _torch_save,
    _training_checkpoint,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),
    pytest.mark.filterwarnings("ignore:Serializing tensors on the meta device"),
]

#: The cases of tests/test_layout.py the fast path hands to torch.save, and why: each holds a kind of object whose
#: pickling it does not reproduce. Every other case must take the fast path.
UNSUPPORTED = {
    "dtypes": "float8 and uint16/32/64 tensors (saved through untyped storages)",
    "parameters_and_storages": "bare storages",
    "meta_mixed": "meta tensors",
    "sparse": "a sparse tensor",
    "conj_neg_bits": "conjugated and negated tensors",
}


def _identity_traps() -> dict[str, Any]:
    """Objects the pickle's memo would treat differently if the fast path got an object's identity wrong: strings
    equal to the persistent id's constants and keys, one tuple and one tensor object twice, views that share a
    storage (the same key string again, also past key 9), empty hooks of many tensors, a Parameter."""
    shape = (2, 3)
    base = torch.randn(6)
    many = [torch.randn(2) for _ in range(12)]
    return {
        "many": many,
        "view_of_the_12th": many[11][1:],  # a key of two digits met again (one digit strings are cached by Python)
        "device": "cpu",
        "tag": "storage",
        "keys": ["0", "1", str(0)],
        "shape": shape,
        "same_shape": shape,
        "base": base,
        "again": base,
        "views": [base[1:], base[2:4], base.view(2, 3)],
        "hooks": collections.OrderedDict(),
        "scalars": [torch.tensor(float(i)) for i in range(5)],
        "param": nn.Parameter(torch.randn(3)),
        "after": "cpu",
    }


def _supported_cases() -> list[str]:
    return [case for case in CASES if case not in UNSUPPORTED]


@pytest.mark.parametrize("case", [*CASES, "identity_traps"])
def test_pickle_skeleton_writes_the_data_pkl_and_storages_of_torch_save(case: str) -> None:
    obj = _identity_traps() if case == "identity_traps" else CASES[case][0]()
    if case in UNSUPPORTED:
        with pytest.raises(SkeletonUnsupported):
            pickle_skeleton(obj)
        return
    skeleton = pickle_skeleton(obj)
    records = _record_bytes(_torch_save(obj))
    assert skeleton.data == records["data.pkl"]
    assert len(skeleton.storages) == sum(1 for name in records if name.startswith("data/"))
    for key, storage in enumerate(skeleton.storages):
        assert storage_bytes(storage) == records[f"data/{key}"], f"storage {key} is not torch's data/{key}"


def _one_storage_two_dtypes() -> dict[str, torch.Tensor]:
    x = torch.randn(4)
    return {"a": x, "b": x.view(torch.int32)}


@pytest.mark.parametrize(
    ("build", "refused"),
    [
        pytest.param(lambda: {"t": _with_hook(torch.randn(2, requires_grad=True))}, True, id="backward hook"),
        pytest.param(lambda: {"t": _with_attribute(torch.randn(2))}, True, id="python attribute"),
        pytest.param(lambda: {"t": torch.randn(2).as_subclass(_Subclass)}, True, id="tensor subclass"),
        pytest.param(_one_storage_two_dtypes, True, id="one storage under two dtypes"),
        pytest.param(lambda: {"t": torch.randn(4).view(torch.int32)}, False, id="a view under another dtype"),
        pytest.param(lambda: {"t": torch.randn(4, requires_grad=True)}, False, id="requires grad"),
    ],
)
def test_what_the_fast_path_does_not_reproduce_is_refused_not_guessed(build: Any, refused: bool) -> None:
    obj = build()
    if refused:
        with pytest.raises(SkeletonUnsupported):
            pickle_skeleton(obj)
    else:
        assert pickle_skeleton(obj).data == _record_bytes(_torch_save(obj))["data.pkl"]


class _Subclass(torch.Tensor):
    pass


def _with_hook(tensor: torch.Tensor) -> torch.Tensor:
    tensor.register_hook(lambda grad: grad)
    return tensor


def _with_attribute(tensor: torch.Tensor) -> torch.Tensor:
    tensor.note = "kept by torch.save"  # type: ignore[attr-defined]
    return tensor


# ----------------------------------------------------------------------------------------------- plans
def _count_torch_saves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_plans_by_the_fast_path_assemble_the_file_torch_saves(case: str) -> None:
    obj, weights_only = CASES[case][0](), CASES[case][1]
    verified = VerifiedStructures()
    first, first_storages = plan_layout(obj, verified=verified)
    second, second_storages = plan_layout(obj, verified=verified)  # spliced into the first
    reference = _mask_volatile(_torch_save(obj))
    for layout, storages in ((first, first_storages), (second, second_storages)):
        assembled = _assemble_layout(layout, storages)
        assert _mask_volatile(assembled) == reference
        _assert_same(obj, torch.load(io.BytesIO(assembled), weights_only=weights_only))
    assert verified.refused is None
    fast = case not in UNSUPPORTED
    assert (verified.confirmed, verified.spliced) == (fast, int(fast))


def test_a_later_save_of_the_same_lengths_is_spliced_without_torch_save(monkeypatch) -> None:
    verified = VerifiedStructures()
    plan_layout(_training_checkpoint(1), verified=verified)
    assert verified.confirmed
    saves = _count_torch_saves(monkeypatch)
    obj = _training_checkpoint(2, {"best_model_path": "epoch=0-step=2.ckpt"})
    del obj["best_model_path"]  # the same structure as the first: another step, another data.pkl
    planned, storages = plan_layout(obj, verified=verified)
    assert (verified.spliced, saves) == (1, [])
    assert _mask_volatile(_assemble_layout(planned, storages)) == _mask_volatile(_torch_save(obj))
    with pytest.raises(AssertionError):  # the step is in the spliced data.pkl, not the first plan's
        assert _assemble_layout(planned, storages) == _assemble_layout(*plan_layout(_training_checkpoint(1)))


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param({"global_step": 100_000}, id="longer data.pkl"),
        pytest.param({"extra": torch.randn(3)}, id="one storage more"),
        pytest.param({"extra": torch.zeros(0)}, id="an empty storage more"),
        pytest.param({"extra": torch.randn(5)[:3]}, id="a storage of another size"),
    ],
)
def test_other_lengths_are_written_by_torchs_zip_writer_and_checked_without_torch_save(monkeypatch, changed) -> None:
    verified = VerifiedStructures()
    plan_layout(_training_checkpoint(1, {"extra": torch.randn(4)}), verified=verified)
    checks: list[int] = []
    real_check = layout_module._check_layout
    monkeypatch.setattr(layout_module, "_check_layout", lambda layout: checks.append(1) or real_check(layout))
    obj = {**_training_checkpoint(1, {"extra": torch.randn(4)}), **changed}
    saves = _count_torch_saves(monkeypatch)
    planned, storages = plan_layout(obj, verified=verified)
    assert (verified.spliced, len(checks), saves) == (0, 1, [])
    assert _mask_volatile(_assemble_layout(planned, storages)) == _mask_volatile(_torch_save(obj))


def test_a_template_is_forgotten_with_its_structure() -> None:
    verified = VerifiedStructures(capacity=1)
    a, b = _training_checkpoint(1), _training_checkpoint(1, {"best": torch.tensor(0.5)})
    plan_layout(a, verified=verified)
    plan_layout(b, verified=verified)  # pushes a's structure out, and a's template with it
    plan_layout(a, verified=verified)
    assert verified.spliced == 0
    plan_layout(a, verified=verified)
    assert verified.spliced == 1


def _corrupted(skeleton: PickledSkeleton) -> PickledSkeleton:
    data = bytearray(skeleton.data)
    data[len(data) // 2] ^= 0xFF
    return dataclasses.replace(skeleton, data=bytes(data))


def test_a_fast_path_that_differs_from_torch_is_turned_off_and_torch_is_used(monkeypatch, caplog) -> None:
    pickled: list[int] = []
    real = layout_module.pickle_skeleton
    monkeypatch.setattr(
        layout_module, "pickle_skeleton", lambda obj: pickled.append(1) or _corrupted(real(obj))
    )  # a fault injected where the fast path's bytes are made
    planner = LayoutPlanner(alignment=None)
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        for step in (1, 2, 3):
            obj = _training_checkpoint(step)
            layout, storages = planner.plan(obj)
            assert _mask_volatile(_assemble_layout(layout, storages)) == _mask_volatile(_torch_save(obj))
    verified = planner._verified_structures
    assert verified.refused is not None and "differ" in verified.refused
    assert (verified.confirmed, verified.spliced, len(pickled)) == (False, 0, 1)
    assert caplog.text.count("fast pickling did not reproduce torch.save") == 1


def test_an_unpicklable_checkpoint_fails_as_torch_save_fails() -> None:
    obj = {"w": torch.randn(2), "f": lambda: 0}
    with pytest.raises(Exception) as by_torch:
        _torch_save(obj)
    with pytest.raises(type(by_torch.value)):
        plan_layout(obj, verified=VerifiedStructures())


def test_the_fast_path_numbers_storages_as_torch_does() -> None:
    obj = _identity_traps()
    _, fast_storages = plan_layout(obj, verified=VerifiedStructures())
    _, torch_storages = plan_layout(obj)
    assert [storage_identity(s) for s in fast_storages] == [storage_identity(s) for s in torch_storages]


class _TorchSavesInSaveCalls(RecordingDataStatesIO):
    """Counts the torch.save calls made inside each save call (``torch.save`` is counted by the test)."""

    def __init__(self, torch_saves: list[int]) -> None:
        super().__init__()
        self._torch_saves = torch_saves
        self.in_save_calls: list[int] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        before = len(self._torch_saves)
        super().save_checkpoint(checkpoint, path, storage_options)
        self.in_save_calls.append(len(self._torch_saves) - before)


def test_a_real_trainers_saves_take_the_fast_path_and_its_files_hold_each_saves_state(tmp_path, monkeypatch) -> None:
    """A Lightning run saving every step (and last.ckpt): the fast path is compared with torch.save after the first
    optimizer step, before the first save (no save call runs torch.save); the plans are spliced; every file equals,
    bit for bit, the state copied synchronously at its save call."""
    plugin = _TorchSavesInSaveCalls(_count_torch_saves(monkeypatch))
    trainer = make_trainer(str(tmp_path), plugin, [every_step_checkpoint(str(tmp_path / "ckpt"))])
    trainer.fit(BNModel(), make_loader())
    verified = pipeline_of(plugin).engine._layouts._verified_structures
    assert verified.confirmed and verified.refused is None
    assert len(plugin.in_save_calls) >= 16 and set(plugin.in_save_calls) == {0}, plugin.in_save_calls
    assert verified.spliced >= len(plugin.in_save_calls) - 4, f"{verified.spliced} of {len(plugin.in_save_calls)}"
    assert file_mismatches(plugin) == []
