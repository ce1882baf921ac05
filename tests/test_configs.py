"""The LightningCLI configs in configs/ run as shipped (with run-length and directory overrides) through LightningCLI.

S3 runs against the loopback moto server; the Lustre config runs against a local directory standing in for Lustre
(a local file system takes the same code path: temporary file, fsync, rename).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.cli import LightningCLI

from lightning_datastates import ConfigError, DataStatesIO
from tests.s3_server import fresh_bucket, s3_endpoint_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
MiB, GiB = 2**20, 2**30


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # SmallGPT and TokenData, as examples/cli.py uses them
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # LightningCLI warns when pytest's own arguments are there too


def _run_cli(tmp_path: Path, config: str, *overrides: str) -> LightningCLI:
    from cli import SmallGPT
    from gpt_data import TokenData

    args = [
        "fit",
        "--config",
        str(CONFIGS / config),
        "--trainer.max_steps=4",
        "--trainer.accelerator=cpu",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks.init_args.every_n_train_steps=2",
        "--trainer.plugins.init_args.host_cache=64MiB",  # the shipped values are for real models
        *overrides,
    ]
    return LightningCLI(SmallGPT, TokenData, args=args)


def _plugin(cli: LightningCLI) -> DataStatesIO:
    plugin = cli.trainer.strategy.checkpoint_io
    assert isinstance(plugin, DataStatesIO)
    return plugin


def _assert_committed(plugin: DataStatesIO, names: list[str]) -> None:
    assert [os.path.basename(s.path) for s in plugin.stats] == names
    assert all(s.state == "committed" for s in plugin.stats)


def test_local_config(tmp_path):
    directory = tmp_path / "checkpoints"
    cli = _run_cli(tmp_path, "local.yaml", f"--trainer.callbacks.init_args.dirpath={directory}")
    plugin = _plugin(cli)
    config = plugin.config
    assert (config.host_cache, config.writer_threads, config.chunk_size, config.eager_copy_size) == (
        64 * MiB,
        4,
        64 * MiB,
        64 * 1024,
    )
    _assert_committed(plugin, ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"])  # last.ckpt: a link (save_last: link)
    assert sorted(os.listdir(directory)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert os.readlink(directory / "last.ckpt") == "epoch=0-step=4.ckpt"
    assert torch.load(directory / "epoch=0-step=4.ckpt", weights_only=True)["global_step"] == 4


def test_sizes_take_integers_and_unit_strings(tmp_path):
    cli = _run_cli(
        tmp_path,
        "local.yaml",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'c'}",
        "--trainer.plugins.init_args.chunk_size=1048576",
        "--trainer.plugins.init_args.eager_copy_size=4KiB",
        "--trainer.max_steps=2",
    )
    config = _plugin(cli).config
    assert (config.chunk_size, config.eager_copy_size) == (MiB, 4096)


def test_a_bad_size_names_the_setting(tmp_path, capsys):
    # jsonargparse reports the plugin's ConfigError inside its own ValueError (or exits, from a command line).
    with pytest.raises((ConfigError, ValueError, SystemExit)) as raised:
        _run_cli(tmp_path, "local.yaml", "--trainer.plugins.init_args.chunk_size=64 parsecs")
    message = capsys.readouterr().err if raised.type is SystemExit else str(raised.value)
    assert "chunk_size" in message and "8GiB" in message, message


def test_lustre_config_on_a_local_directory(tmp_path):
    directory = tmp_path / "lustre-standin"
    cli = _run_cli(tmp_path, "lustre.yaml", f"--trainer.callbacks.init_args.dirpath={directory}")
    plugin = _plugin(cli)
    assert (plugin.config.writer_threads, plugin.config.chunk_size) == (16, 64 * MiB)
    _assert_committed(plugin, ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"])
    assert sorted(os.listdir(directory)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]


def test_s3_config_against_a_local_s3_server(tmp_path, s3_endpoint):
    env = fresh_bucket(s3_endpoint, "my-bucket")  # the bucket named in configs/s3.yaml
    cli = _run_cli(tmp_path, "s3.yaml")
    plugin = _plugin(cli)
    assert plugin.config.storage_options == {
        "part_size_bytes": "16MiB",
        "max_concurrent_parts": 8,
        "retries": 3,
        "timeout_s": 10,
        "min_bytes_per_s": "2MiB",
    }
    # save_last: true writes last.ckpt as a checkpoint of its own after each one (S3 has no links).
    _assert_committed(plugin, ["epoch=0-step=2.ckpt", "last.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"])
    assert env.keys() == [
        f"my-run/checkpoints/{name}" for name in ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt")
    ]
    loaded = plugin.load_checkpoint("s3://my-bucket/my-run/checkpoints/epoch=0-step=4.ckpt", weights_only=True)
    assert loaded["global_step"] == 4
    assert env.open_uploads() == []


def test_tiered_config_against_a_local_s3_server(tmp_path, s3_endpoint):
    env = fresh_bucket(s3_endpoint, "my-bucket")  # the bucket named in configs/tiered.yaml
    tier = tmp_path / "nvme"
    cli = _run_cli(tmp_path, "tiered.yaml", f"--trainer.plugins.init_args.local_tier={tier}")
    plugin = _plugin(cli)
    assert (plugin.config.local_tier, plugin.config.local_keep) == (str(tier), 2)
    assert [s.replication for s in plugin.stats] == ["committed"] * 4  # two checkpoints, each with its last.ckpt
    names = ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt")
    assert env.keys() == [f"my-run/checkpoints/{name}" for name in names]
    (local,) = tier.iterdir()
    # local_keep: 2 keeps the two newest checkpoints locally, last.ckpt beside them, each a replica of its S3 object.
    assert sorted(n for n in os.listdir(local) if n.endswith(".ckpt")) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "last.ckpt",
    ]
    for name in names[1:]:
        assert (local / name).read_bytes() == env.read(f"my-run/checkpoints/{name}")
    assert env.open_uploads() == []


# ---------------------------------------------------------------------------------------------------- resume
def _run_example(root: Path, config: str, max_steps: int, *overrides: str) -> LightningCLI:
    """examples/cli.py's main with a shipped config, as a user runs it (run length, directories and the size of the
    arena overridden; ``root``: the run's own directory, where LightningCLI saves its config.yaml)."""
    from cli import main

    return main(
        [
            "fit",
            "--config",
            str(CONFIGS / config),
            f"--trainer.max_steps={max_steps}",
            "--trainer.accelerator=cpu",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={root}",
            "--trainer.callbacks.init_args.every_n_train_steps=2",
            "--trainer.plugins.init_args.host_cache=64MiB",
            *overrides,
        ]
    )


@pytest.mark.parametrize("config", ["local.yaml", "lustre.yaml", "s3.yaml", "tiered.yaml"])
def test_every_shipped_config_resumes_from_last(tmp_path, s3_endpoint, config):
    """Run as shipped, then again with ``--ckpt_path last``: the second run starts where the first ended (its first
    checkpoint is step 6, not a ``-v1`` of step 2) and its model and step counter are those of the first run's end."""
    env = fresh_bucket(s3_endpoint, "my-bucket")  # the bucket configs/s3.yaml and configs/tiered.yaml name
    overrides: list[str] = []
    if config in ("local.yaml", "lustre.yaml"):
        overrides.append(f"--trainer.callbacks.init_args.dirpath={tmp_path / 'checkpoints'}")
    if config == "tiered.yaml":
        overrides.append(f"--trainer.plugins.init_args.local_tier={tmp_path / 'nvme'}")
    first = _run_example(tmp_path / "run1", config, 4, *overrides)
    assert first.trainer.global_step == 4
    weights = {k: v.clone() for k, v in first.model.state_dict().items()}
    _plugin(first).teardown()

    second = _run_example(tmp_path / "run2", config, 8, *overrides, "--ckpt_path", "last")
    assert second.trainer.ckpt_path is not None and second.trainer.ckpt_path.endswith("last.ckpt")
    assert second.trainer.global_step == 8
    saved = [os.path.basename(s.path) for s in _plugin(second).stats]
    assert saved[0] == "epoch=0-step=6.ckpt", saved  # resumed at step 4: trained 4 more steps, no save of step 2
    if config in ("s3.yaml", "tiered.yaml"):
        names = sorted(os.path.basename(key) for key in env.keys())
        assert env.open_uploads() == []
    else:
        names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == [f"epoch=0-step={step}.ckpt" for step in (2, 4, 6, 8)] + ["last.ckpt"], names
    # The resumed run started from the first run's weights: its checkpoint of step 4 holds them.
    loaded = _plugin(second).load_checkpoint(_path_of(config, tmp_path, "epoch=0-step=4.ckpt"), weights_only=True)
    for name, tensor in weights.items():
        assert torch.equal(loaded["state_dict"][name], tensor), name
    _plugin(second).teardown()


def _path_of(config: str, tmp_path: Path, name: str) -> str:
    if config in ("s3.yaml", "tiered.yaml"):
        return f"s3://my-bucket/my-run/checkpoints/{name}"
    return str(tmp_path / "checkpoints" / name)
