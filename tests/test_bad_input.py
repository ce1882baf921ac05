"""Bad and unusual input: what cannot be saved fails at ``save_checkpoint`` with nothing written; everything torch can
save round-trips bit for bit through the plugin (eager and lazy paths) and loads with plain ``torch.load``.

The lazy path saves inside a (stand-in) training loop, waits at the barrier, then overwrites every source tensor:
the file must still hold the state of the save call.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import threading
from collections import namedtuple
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_datastates import CheckpointCaptureError, DataStatesIO
from lightning_datastates.plugin import pipeline_of
from tests.conftest import (  # noqa: F401 - slow_copies is a fixture
    BNModel,
    every_step_checkpoint,
    in_background,
    make_loader,
    make_trainer,
    slow_copies,
    temp_files,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor"),
    pytest.mark.filterwarnings("ignore:.*support is experimental"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),
]

Pair = namedtuple("Pair", ["left", "right"])


@pytest.fixture(autouse=True)
def _uninitialized_memory_unfilled() -> Any:
    """A Trainer(deterministic=True) earlier in the process makes torch fill every new tensor, which torch cannot
    do for several exotic dtypes (deepcopy of a bits16 tensor then fails): restore torch's default here."""
    import torch.utils.deterministic

    previous = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    yield
    torch.utils.deterministic.fill_uninitialized_memory = previous


@dataclasses.dataclass
class Holder:
    """A dataclass holding tensors (pickled by reference to this module)."""

    weight: torch.Tensor
    extra: list[Any]


@pytest.fixture(autouse=True)
def _slow_lazy_copies(request: pytest.FixtureRequest) -> None:
    """On the lazy path, make copies outlast the save call (as a large model's do), so the file holds the save-time
    state only if the barrier really waits for them."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("lazy"):
        request.getfixturevalue("slow_copies")


# ---------------------------------------------------------------------------------------------------- helpers
def _all_dtypes() -> list[torch.dtype]:
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _torch_can_save(dtype: torch.dtype) -> bool:
    try:
        torch.save(torch.empty(2, dtype=dtype), io.BytesIO())
        return True
    except Exception:  # noqa: BLE001 - torch's own limit (sub-byte int1..7/uint1..7 have no storage type)
        return False


def _random_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (every bit pattern, NaNs included), or a quantized tensor."""
    generator = torch.Generator().manual_seed(seed)
    if dtype in _QUANTIZED:
        return torch.quantize_per_tensor(torch.randn(numel, generator=generator), 0.05, 2, dtype)
    itemsize = dtype.itemsize
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_quantized:
        return tensor.int_repr().reshape(-1).view(torch.uint8)
    return tensor.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)


def _assert_same(actual: Any, expected: Any, where: str = "checkpoint") -> None:
    """Bit-exact comparison that also understands quantized tensors, sets and dataclasses."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert actual.shape == expected.shape and actual.stride() == expected.stride(), where
        if expected.is_quantized:
            assert (actual.q_scale(), actual.q_zero_point()) == (expected.q_scale(), expected.q_zero_point()), where
        assert torch.equal(_bits(actual), _bits(expected)), f"{where}: bytes differ"
    elif dataclasses.is_dataclass(expected):
        assert type(actual) is type(expected), where
        for field in dataclasses.fields(expected):
            _assert_same(getattr(actual, field.name), getattr(expected, field.name), f"{where}.{field.name}")
    elif isinstance(expected, (set, frozenset)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        if all(not isinstance(item, torch.Tensor) for item in expected):
            assert actual == expected, where
        else:  # tensors hash by identity: compare sorted by content
            key = lambda t: bytes(_bits(t).numpy())
            for a, e in zip(sorted(actual, key=key), sorted(expected, key=key)):
                _assert_same(a, e, f"{where}{{}}")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), where
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return [t for item in value for t in _tensors(item)]
    return []


def _overwrite_sources(checkpoint: Any) -> None:
    """What training does after the barrier: every byte of every source storage changes (each storage once)."""
    flipped = set()
    for tensor in _tensors(checkpoint):
        storage = tensor.untyped_storage()
        if tensor.is_quantized or storage.nbytes() == 0 or storage.data_ptr() in flipped:
            continue
        flipped.add(storage.data_ptr())
        torch.empty(0, dtype=torch.uint8).set_(storage).bitwise_not_()


def _roundtrip(tmp_path: Any, checkpoint: Any, lazy: bool, weights_only: bool = True, **settings: Any) -> Any:
    """Save through the plugin, check plain ``torch.load`` and the plugin's load both return the save-time state."""
    expected = copy.deepcopy(checkpoint)
    options: dict[str, Any] = {"host_cache": "4MiB", "chunk_size": "64KiB", "eager_copy_size": "256"}
    options.update(settings)
    plugin = DataStatesIO(**options)
    path = str(tmp_path / ("lazy.ckpt" if lazy else "eager.ckpt"))
    if lazy:
        in_background(plugin, lazy=True)
    plugin.save_checkpoint(checkpoint, path)
    if lazy:
        pipeline_of(plugin).barrier()
        _overwrite_sources(checkpoint)  # training goes on: the file must keep the state of the save call
    plugin.drain()
    pipeline_of(plugin).raise_pending_failure()
    plain = torch.load(path, weights_only=weights_only)
    _assert_same(plain, expected)
    loaded = plugin.load_checkpoint(path, weights_only=weights_only)
    _assert_same(loaded, expected)
    plugin.teardown()
    return loaded


PATHS = pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])


# ---------------------------------------------------------------------------------------------------- not picklable
class _LocalThing:
    pass


UNPICKLABLE = {
    "lambda": lambda: {"hyper_parameters": {"activation": lambda x: x}},
    "open file": lambda: {"log": open(os.devnull)},
    "lock": lambda: {"lock": threading.Lock()},
    "generator": lambda: {"batches": (i for i in range(3))},
    "local class": lambda: {"thing": type("Local", (), {})()},
}


@PATHS
@pytest.mark.parametrize("case", list(UNPICKLABLE))
def test_unpicklable_objects_fail_at_save_with_nothing_written(tmp_path, case: str, lazy: bool) -> None:
    directory = tmp_path / "run"
    directory.mkdir()
    good = directory / "a.ckpt"
    plugin = DataStatesIO()
    plugin.save_checkpoint({"w": torch.randn(100)}, str(good))
    before = good.read_bytes()
    if lazy:
        in_background(plugin, lazy=True)
    checkpoint = {"state_dict": {"w": torch.randn(1000)}, **UNPICKLABLE[case]()}
    with pytest.raises(CheckpointCaptureError, match="cannot be pickled") as caught:
        plugin.save_checkpoint(checkpoint, str(good))
    assert "remove or replace the offending object" in str(caught.value)
    with pytest.raises(CheckpointCaptureError):
        plugin.save_checkpoint(checkpoint, str(tmp_path / "new" / "b.ckpt"))
    plugin.drain()
    assert sorted(os.listdir(directory)) == ["a.ckpt"] and temp_files(str(tmp_path)) == []
    assert not (tmp_path / "new").exists(), "a directory was created for a checkpoint that was never written"
    assert good.read_bytes() == before
    plugin.teardown()
    for value in checkpoint.values():
        if hasattr(value, "close"):
            value.close()


def test_unpicklable_callback_state_stops_fit_at_the_first_save(tmp_path) -> None:
    # Lightning drops unpicklable hyperparameters itself; a callback's state goes into the checkpoint as it is.
    class LambdaState(L.Callback):
        def state_dict(self) -> dict[str, Any]:
            return {"schedule": lambda step: step * 2}

    trainer = make_trainer(
        str(tmp_path), DataStatesIO(), [LambdaState(), every_step_checkpoint(str(tmp_path / "ck"))], max_epochs=1
    )
    with pytest.raises(CheckpointCaptureError, match="cannot be pickled"):
        trainer.fit(BNModel(), make_loader())
    assert trainer.global_step == 1, "training went on past the failed save"
    assert temp_files(str(tmp_path)) == []
    assert not any(name.endswith(".ckpt") for _, _, names in os.walk(tmp_path) for name in names)


# ---------------------------------------------------------------------------------------------------- dtypes
SAVABLE = [d for d in _all_dtypes() if d in _QUANTIZED or _torch_can_save(d)]


def test_the_dtype_list_covers_what_torch_can_save() -> None:
    names = {str(d).removeprefix("torch.") for d in SAVABLE}
    for required in ("bool", "uint16", "uint32", "uint64", "bfloat16", "float16", "complex32", "complex128"):
        assert required in names
    assert {n for n in names if n.startswith("float8")} >= {"float8_e4m3fn", "float8_e5m2"}
    unsavable = [d for d in _all_dtypes() if d not in SAVABLE]
    assert all(str(d).removeprefix("torch.")[:-1] in ("int", "uint") for d in unsavable), unsavable  # int1..7 only


@PATHS
def test_every_dtype_round_trips_bit_exact(tmp_path, lazy: bool) -> None:
    checkpoint = {str(d): _random_tensor(d, 333, seed) for seed, d in enumerate(SAVABLE)}
    checkpoint["scalars"] = [_random_tensor(d, 1, 99).reshape(()) for d in SAVABLE if d not in _QUANTIZED]
    _roundtrip(tmp_path, checkpoint, lazy, weights_only=False)


def test_every_plain_dtype_loads_with_weights_only(tmp_path) -> None:
    checkpoint = {str(d): _random_tensor(d, 64, seed) for seed, d in enumerate(SAVABLE) if d not in _QUANTIZED}
    _roundtrip(tmp_path, checkpoint, lazy=False, weights_only=True)


# ------------------------------------------------------------------------------------------------ shapes and sharing
@PATHS
def test_views_non_contiguous_and_zero_size_tensors(tmp_path, lazy: bool) -> None:
    base = torch.randn(40, 30)
    checkpoint = {
        "base": base,
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "row": base[7],
        "column": base[:, 4],
        "expanded": torch.randn(5, 1).expand(5, 6),
        "conj": torch.randn(6, dtype=torch.complex64).conj(),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(0, 5, dtype=torch.float16),
        "empty_view": base[5:5],
        "scalar": torch.tensor(3.5),
    }
    conj_before = checkpoint["conj"].is_conj()
    loaded = _roundtrip(tmp_path, checkpoint, lazy)  # compares values (conjugation resolved): deepcopy drops the bit
    assert loaded["conj"].is_conj() == conj_before
    storage = loaded["base"].untyped_storage().data_ptr()
    for name in ("transposed", "strided", "row", "column"):
        assert loaded[name].untyped_storage().data_ptr() == storage, f"{name} no longer views base"


@PATHS
def test_tied_weights_stay_tied(tmp_path, lazy: bool) -> None:
    embed = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = embed.weight  # tied
    model = nn.ModuleDict({"embed": embed, "head": head})
    optimizer = torch.optim.AdamW(model.parameters())
    model["head"](model["embed"](torch.tensor([1, 2]))).sum().backward()
    optimizer.step()
    checkpoint = {"state_dict": model.state_dict(keep_vars=False), "optimizer": optimizer.state_dict()}
    loaded = _roundtrip(tmp_path, checkpoint, lazy)
    state = loaded["state_dict"]
    assert state["embed.weight"].data_ptr() == state["head.weight"].data_ptr()
    fresh = nn.ModuleDict({"embed": nn.Embedding(50, 16), "head": nn.Linear(16, 50, bias=False)})
    fresh["head"].weight = fresh["embed"].weight
    fresh.load_state_dict(state)
    assert fresh["head"].weight is fresh["embed"].weight


# ---------------------------------------------------------------------------------------------------- containers
@PATHS
def test_nested_containers_namedtuples_dataclasses_and_sets(tmp_path, lazy: bool) -> None:
    shared = torch.randn(8)
    checkpoint = {
        "nested": [[torch.randn(3), (torch.arange(4), [shared, {"deep": torch.ones(2, 2)}])], []],
        "tuple": (1, "two", torch.randn(2)),
        "namedtuple": Pair(torch.randn(3), Pair(shared, None)),
        "dataclass": Holder(torch.randn(4, 4), [shared, {"k": torch.zeros(1)}]),
        "set": {1, 2, "three"},
        "tensor_set": {torch.randn(2), torch.randn(3)},
        "frozenset": frozenset({"a", 4}),
        "none": None,
        "bytes": b"\x00\xff",
    }
    loaded = _roundtrip(tmp_path, checkpoint, lazy, weights_only=False)
    assert loaded["namedtuple"].right.left.data_ptr() == loaded["nested"][0][1][1][0].data_ptr()  # still shared


@PATHS
def test_namedtuples_and_dataclasses_load_with_weights_only_when_allowed(tmp_path, lazy: bool) -> None:
    checkpoint = {"pair": Pair(torch.randn(3), 7), "holder": Holder(torch.randn(2), [1])}
    with torch.serialization.safe_globals([Pair, Holder]):
        _roundtrip(tmp_path, checkpoint, lazy, weights_only=True)


# ---------------------------------------------------------------------------------------------------- sizes
@pytest.mark.slow
def test_ten_thousand_small_tensors(tmp_path) -> None:
    # The lazy path only (the eager one differs in when, not how, the same chunks are copied): ~10 s, mostly torch.load.
    generator = torch.Generator().manual_seed(0)
    checkpoint = {f"layer{i}.weight": torch.randn(i % 7 + 1, generator=generator) for i in range(10_000)}
    _roundtrip(tmp_path, checkpoint, lazy=True)


@PATHS
def test_a_tensor_larger_than_the_arena_streams_through_it(tmp_path, lazy: bool) -> None:
    big = torch.randn(6 * 1024**2 // 4)  # 6 MiB through a 1 MiB arena
    loaded = _roundtrip(tmp_path, {"big": big, "small": torch.arange(3)}, lazy, host_cache="1MiB", chunk_size="256KiB")
    assert loaded["big"].nbytes == 6 * 1024**2
