"""Settings: sizes in ints or with units, validated once, errors that name the argument; the plugin pickles."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle

import pytest
import torch

from lightning_datastates import ConfigError, DataStatesIO
from lightning_datastates.config import USER_SETTINGS, DataStatesConfig, parse_size
from lightning_datastates.errors import DataStatesError
from lightning_datastates.plugin import pipeline_of

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


# ---------------------------------------------------------------------------------------------------- parse_size
@pytest.mark.parametrize(
    "value,expected",
    [
        ("8GiB", 8 * GiB),
        ("512MB", 512 * 1000**2),
        ("4096", 4096),
        (4096, 4096),
        ("1.5GiB", 3 * GiB // 2),
        (" 64 MiB ", 64 * MiB),
        ("64mib", 64 * MiB),
        ("64KiB", 64 * KiB),
        ("2TiB", 2 * TiB),
        ("1TB", 1000**4),
        ("10k", 10_000),
        ("3kb", 3000),
        ("7B", 7),
        ("1g", 1000**3),
        ("0.5KiB", 512),
        (1, 1),
        (1 << 50, 1 << 50),
    ],
)
def test_parse_size_accepts(value, expected) -> None:
    result = parse_size(value, "chunk_size")
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "value",
    ["8 gigs", "", "   ", "GiB", "-1", "-1GiB", "1e9", "1,024", "0x100", "8 GiB extra", "1.5.5MB", "8iB", "KiBKiB"],
)
def test_parse_size_rejects_malformed_strings(value) -> None:
    with pytest.raises(ConfigError, match="chunk_size") as info:
        parse_size(value, "chunk_size")
    assert "GiB" in str(info.value)  # says what is accepted


@pytest.mark.parametrize("value", [0, -1, -4096, "0", "0GiB", "0.1"])  # "0.1" bytes truncates to 0
def test_parse_size_rejects_non_positive(value) -> None:
    with pytest.raises(ConfigError, match="host_cache.*positive"):
        parse_size(value, "host_cache")


@pytest.mark.parametrize("value", [True, False, 1.5, 4096.0, None, [4096], b"4096", {"size": 1}])
def test_parse_size_rejects_other_types(value) -> None:
    with pytest.raises(ConfigError, match="eager_copy_size"):
        parse_size(value, "eager_copy_size")


def test_config_error_is_a_value_error_and_a_package_error() -> None:
    with pytest.raises(ValueError):
        parse_size("nope", "x")
    with pytest.raises(DataStatesError):
        parse_size("nope", "x")


def test_parse_size_huge_number_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        parse_size("9" * 400, "chunk_size")


# ---------------------------------------------------------------------------------------------------- DataStatesConfig
def test_config_converts_every_size() -> None:
    config = DataStatesConfig("2GiB", 8, "16MiB", 1024)
    assert config == DataStatesConfig(host_cache=2 * GiB, writer_threads=8, chunk_size=16 * MiB, eager_copy_size=1024)


def test_config_host_cache_none_means_automatic() -> None:
    config = DataStatesConfig(None, 1, "64MiB", "64KiB")
    assert config.host_cache is None
    assert config.arena_bytes_for(10 * MiB) >= 16 * MiB  # automatic sizing gives a usable arena


def test_arena_bytes_for_uses_the_user_budget() -> None:
    config = DataStatesConfig("8MiB", 1, "1MiB", "1KiB")
    assert config.arena_bytes_for(100 * GiB) == 8 * MiB  # never more than the user's budget


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"host_cache": "8 gigs"}, "host_cache"),
        ({"host_cache": 0}, "host_cache"),
        ({"host_cache": "512KiB"}, "host_cache"),  # below the 1 MiB floor
        ({"host_cache": 1.5}, "host_cache"),
        ({"writer_threads": 0}, "writer_threads"),
        ({"writer_threads": -2}, "writer_threads"),
        ({"writer_threads": 257}, "writer_threads"),
        ({"writer_threads": "4"}, "writer_threads"),
        ({"writer_threads": True}, "writer_threads"),
        ({"writer_threads": 4.0}, "writer_threads"),
        ({"writer_threads": None}, "writer_threads"),
        ({"chunk_size": "big"}, "chunk_size"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": None}, "chunk_size"),
        ({"eager_copy_size": -5}, "eager_copy_size"),
        ({"eager_copy_size": "64 KB!"}, "eager_copy_size"),
        ({"eager_copy_size": None}, "eager_copy_size"),
    ],
)
def test_config_errors_name_the_argument(kwargs, name) -> None:
    arguments = {"host_cache": None, "writer_threads": 4, "chunk_size": "64MiB", "eager_copy_size": "64KiB", **kwargs}
    with pytest.raises(ConfigError) as info:
        DataStatesConfig(**arguments)
    assert name in str(info.value)
    other_names = {"host_cache", "writer_threads", "chunk_size", "eager_copy_size"} - {name}
    assert not any(other in str(info.value) for other in other_names), "the message blames another argument"


def test_config_accepts_the_bounds() -> None:
    assert DataStatesConfig("1MiB", 1, 1, 1).writer_threads == 1
    assert DataStatesConfig(MiB, 256, "1", "1").writer_threads == 256


def test_config_is_frozen() -> None:
    config = DataStatesConfig(None, 4, "64MiB", "64KiB")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.writer_threads = 8  # type: ignore[misc]


def test_replace_keeps_every_value_and_checks_again() -> None:
    config = DataStatesConfig("2GiB", 8, "16MiB", "1KiB", storage_alignment="4KiB", stale_after_s=10)
    replaced = dataclasses.replace(config, write_through=False)
    assert dataclasses.replace(replaced, write_through=True) == config
    with pytest.raises(ConfigError, match="chunk_size"):
        dataclasses.replace(config, chunk_size="lots")


# ---------------------------------------------------------------------------------------------------- one spelling
def test_plugin_parameters_and_config_fields_cannot_drift() -> None:
    """DataStatesIO's signature (what LightningCLI reads) and DataStatesConfig's fields are the two places where the
    settings are spelled: the same names in the same order, the same defaults, and the same annotations, except that
    the config holds each size (``Size``, an int or a string with a unit) as its bytes (``int``)."""
    parameters = list(inspect.signature(DataStatesIO.__init__).parameters.values())[1:]  # without self
    fields = {field.name: field for field in dataclasses.fields(DataStatesConfig)}
    assert [p.name for p in parameters] == list(USER_SETTINGS) == [name for name in fields if name != "write_through"]
    for parameter in parameters:
        field = fields[parameter.name]
        assert parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, parameter
        assert isinstance(parameter.annotation, str) and isinstance(field.type, str)  # postponed annotations
        if "Size" in parameter.annotation:
            assert field.type == parameter.annotation.replace("Size", "int"), parameter.name
            expected = None if parameter.default is None else parse_size(parameter.default, parameter.name)
            assert field.default == expected, parameter.name
        else:
            assert field.type == parameter.annotation, parameter.name
            assert field.default == parameter.default, parameter.name
    assert DataStatesIO().config == DataStatesConfig()


def test_every_setting_is_documented_and_reaches_the_config() -> None:
    doc = DataStatesIO.__doc__ or ""
    for name in USER_SETTINGS:
        assert f"\n        {name}: " in doc, f"DataStatesIO's docstring does not describe {name}"
    given = {
        "host_cache": "2MiB",
        "writer_threads": 3,
        "chunk_size": "1MiB",
        "eager_copy_size": 512,
        "storage_options": {"key": "k"},
        "verify_checksums": False,
        "on_flush_error": "warn",
        "on_arena_full": "skip",
        "stale_after_s": 5,
        "storage_alignment": "4KiB",
        "serve_from_memory": False,
        "direct_io": True,
        "local_tier": "/local/nvme",
        "local_keep": 5,
    }
    assert sorted(given) == sorted(USER_SETTINGS)
    config = DataStatesIO(**given).config
    assert config == DataStatesConfig(**given)
    assert all(
        getattr(config, name) != field.default
        for name, field in DataStatesConfig.__dataclass_fields__.items()
        if name in USER_SETTINGS
    ), "a setting did not reach the config"


# ---------------------------------------------------------------------------------------------------- DataStatesIO
def test_plugin_defaults() -> None:
    plugin = DataStatesIO()
    assert plugin.config == DataStatesConfig(None, 4, 64 * MiB, 64 * KiB)


def test_plugin_accepts_yaml_style_values() -> None:
    # jsonargparse hands "4GiB" as a string and 4096 / "4096" as ints
    plugin = DataStatesIO(host_cache="4GiB", writer_threads=2, chunk_size=4096, eager_copy_size="1KiB")
    assert plugin.config == DataStatesConfig(4 * GiB, 2, 4096, 1024)


@pytest.mark.parametrize("writer_threads", [0, "4", True, -1, 1000, 2.0])
def test_plugin_rejects_bad_writer_threads(writer_threads) -> None:
    with pytest.raises(ConfigError, match="writer_threads"):
        DataStatesIO(writer_threads=writer_threads)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"host_cache": "lots"}, "host_cache"),
        ({"host_cache": -1}, "host_cache"),
        ({"host_cache": 100}, "host_cache"),
        ({"chunk_size": "64 MiBs"}, "chunk_size"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 64.5}, "chunk_size"),
        ({"eager_copy_size": True}, "eager_copy_size"),
        ({"eager_copy_size": "-1KiB"}, "eager_copy_size"),
    ],
)
def test_plugin_rejects_bad_sizes(kwargs, name) -> None:
    with pytest.raises(ConfigError, match=name):
        DataStatesIO(**kwargs)


def test_plugin_pickles_with_its_config() -> None:
    plugin = DataStatesIO(host_cache="32MiB", writer_threads=3, chunk_size="2MiB", eager_copy_size=512)
    clone = pickle.loads(pickle.dumps(plugin))
    assert type(clone) is DataStatesIO
    assert clone.config == plugin.config == DataStatesConfig(32 * MiB, 3, 2 * MiB, 512)
    assert clone.stats == [] and not pipeline_of(clone).is_pending("x.ckpt")
    deep = copy.deepcopy(plugin)
    assert deep.config == plugin.config


def test_used_plugin_pickles_without_its_engine_and_the_copy_works(tmp_path) -> None:
    plugin = DataStatesIO(host_cache="8MiB", writer_threads=2)
    try:
        plugin.save_checkpoint({"w": torch.arange(10.0), "step": 1}, tmp_path / "a.ckpt")
        clone = pickle.loads(pickle.dumps(plugin))  # e.g. sent to ddp_spawn workers
    finally:
        plugin.teardown()
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["step"] == 1
    assert clone.config == plugin.config
    assert pipeline_of(clone)._engine is None and clone.stats == []
    try:
        clone.save_checkpoint({"w": torch.ones(3), "step": 2}, tmp_path / "b.ckpt")
        clone.drain()
        assert torch.equal(clone.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.ones(3))
    finally:
        clone.teardown()


def test_plugin_keeps_one_writer_per_protocol_and_pickles_without_them(tmp_path) -> None:
    plugin = DataStatesIO()
    local = pipeline_of(plugin).writer_for(str(tmp_path / "a.ckpt"))
    assert pipeline_of(plugin).writer_for(str(tmp_path / "sub" / "b.ckpt")) is local
    assert pipeline_of(plugin).writer_for(f"file://{tmp_path}/c.ckpt") is local  # a file:// URL is a local path too
    memory = pipeline_of(plugin).writer_for("memory://run/a.ckpt")
    assert pipeline_of(plugin).writer_for("memory://other/b.ckpt") is memory and memory is not local
    clone = pickle.loads(pickle.dumps(plugin))
    assert pipeline_of(clone)._writers == {} and pipeline_of(plugin).writer_for(str(tmp_path / "d.ckpt")) is local
