"""Strategies: DDP and ddp_spawn with two real CPU processes, full-state paths given as ``pathlib.Path`` (S3 URLs),
and the strategies that bypass CheckpointIO (a warning at setup; their directories are still removed)."""

from __future__ import annotations

import io
import json
import os
import pathlib
import warnings

import pytest
import torch
import torch.distributed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_datastates import DataStatesIO
from lightning_datastates.callback import DataStatesCallback
from lightning_datastates.compat.lightning import checkpoint_path_str
from lightning_datastates.strategies import PluginBypassedWarning, bypass_reason
from tests.conftest import (
    BNModel,
    RecordingDataStatesIO,
    assert_bit_equal,
    in_background,
    make_loader,
    make_trainer,
    temp_files,
)
from tests.s3_server import (  # noqa: F401 - the *_fixture imports register the fixtures
    free_port,
    s3_endpoint_fixture,
    s3_fixture,
)
from tests.script_support import run_to_completion

#: Two DDP processes start slowly on a loaded 2-core machine; this only bounds a hang.
_RUN_TIMEOUT_S = 600


def _run_script(out: pathlib.Path, strategy: str) -> None:
    run_to_completion("ddp_script.py", str(out), strategy, timeout_s=_RUN_TIMEOUT_S, what=strategy)


def _load(path: pathlib.Path | str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _assert_files_equal_references(checkpoint_dir: pathlib.Path, reference_dir: pathlib.Path) -> list[str]:
    names = sorted(os.listdir(checkpoint_dir))
    assert names, f"no checkpoint in {checkpoint_dir}"
    for name in names:
        assert_bit_equal(_load(checkpoint_dir / name), _load(reference_dir / name), name)
    return names


@pytest.mark.slow
def test_ddp_rank0_writes_other_rank_pays_nothing_all_ranks_resume(tmp_path):
    _run_script(tmp_path, "ddp")
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # Rank 0 wrote through the engine; rank 1 never built one nor ran a thread (no capture, no arena).
    assert reports[0]["engine_seen"] and reports[0]["threads_seen"]
    assert not reports[1]["engine_seen"] and reports[1]["threads_seen"] == []
    assert reports[0]["threads_at_end"] == [] and reports[1]["threads_at_end"] == []
    # The end-of-fit aggregates (torchmetrics) are synced: rank 1, which saved nothing, computed rank 0's figures.
    totals = [report["fit_totals"] for report in reports]
    assert len(totals[0]) == 2 and totals[0][0]["datastates/checkpoints"] > 0  # one per fit
    assert totals[1] == totals[0]

    # Every file equals, bit for bit, the state recorded at its save call: after the first fit and at the end.
    fit1 = tmp_path / "fit1"
    assert _assert_files_equal_references(fit1 / "ckpt", fit1 / "ref") == [
        "epoch=1-step=7.ckpt",
        "epoch=1-step=8.ckpt",
        "last.ckpt",
    ]
    assert reports[0]["best"] == reports[1]["best"] == "epoch=1-step=8.ckpt"
    _assert_files_equal_references(tmp_path / "ckpt", tmp_path / "ref")
    assert temp_files(str(tmp_path)) == []

    # Right after fit, both ranks loaded the files rank 0 had just written: validate(ckpt_path="best") ...
    best = _load(fit1 / "ref" / reports[0]["best"])
    last = _load(fit1 / "ref" / "last.ckpt")
    for rank in (0, 1):
        assert_bit_equal(_load(tmp_path / f"rank{rank}-best.pt"), best["state_dict"], f"rank {rank} best")
        # ... and fit(ckpt_path="last"): weights, buffers and optimizer state as saved.
        restored = _load(tmp_path / f"rank{rank}-last.pt")
        expected = dict(last["state_dict"])
        for index, state in last["optimizer_states"][0]["state"].items():
            expected.update({f"optimizer.{index}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
        assert_bit_equal(restored, expected, f"rank {rank} last")


@pytest.mark.slow
def test_ddp_spawn_final_save_after_teardown_is_durable_and_the_parent_loads_it(tmp_path):
    _run_script(tmp_path, "ddp_spawn")
    # ddp_spawn's rank 0 saves a bare state dict after Strategy.teardown (".temp.ckpt" in a temporary directory);
    # the parent loads it once the workers exited, then removes it.
    final = _load(tmp_path / "ref" / ".temp.ckpt")
    assert_bit_equal(_load(tmp_path / "parent-weights.pt"), final, "weights the parent loaded")
    parent = json.loads((tmp_path / "parent.json").read_text())
    assert parent == {"engine_in_parent": False, "threads_in_parent": []}
    _assert_files_equal_references(tmp_path / "ckpt", tmp_path / "ref")
    assert temp_files(str(tmp_path)) == []


class _ParallelBNModel(BNModel):
    """BNModel for ModelParallelStrategy, which requires a ``configure_model`` hook (nothing to parallelize here)."""

    def configure_model(self) -> None:
        pass


@pytest.fixture
def single_process_group(monkeypatch):
    """ModelParallelStrategy on one CPU process sets up a gloo group: give it a free port and tear it down after."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _model_parallel_fit(tmp_path, plugin, dirpath: str, save_distributed_checkpoint: bool, top_k: int = 1):
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=top_k, monitor="step", mode="max")
    trainer = make_trainer(
        str(tmp_path),
        plugin,
        callbacks=[checkpoint],
        strategy=ModelParallelStrategy(save_distributed_checkpoint=save_distributed_checkpoint),
        devices=1,
        max_epochs=1,
    )
    trainer.fit(_ParallelBNModel(width=32), make_loader(n=32))
    return trainer


def test_bypassing_strategies_are_named_and_the_others_are_not():
    assert "DeepSpeed" in bypass_reason(DeepSpeedStrategy.__new__(DeepSpeedStrategy))  # deepspeed not installed
    assert bypass_reason(FSDPStrategy(state_dict_type="sharded")) is None  # through the plugin (sharded/)
    assert bypass_reason(ModelParallelStrategy()) is None
    assert bypass_reason(FSDPStrategy(state_dict_type="full")) is None
    assert bypass_reason(ModelParallelStrategy(save_distributed_checkpoint=False)) is None
    assert bypass_reason(DDPStrategy()) is None


def test_the_callback_warns_at_setup_of_a_trainer_whose_strategy_bypasses_the_plugin(tmp_path, monkeypatch):
    """DeepSpeed (not installed here, so its strategy cannot run): a real Trainer's callback set up while the trainer's
    strategy is a DeepSpeedStrategy holding the plugin, as Lightning would hand it over. The warning names it, once."""
    plugin = DataStatesIO()
    trainer = make_trainer(str(tmp_path), plugin, enable_checkpointing=False)
    (callback,) = [c for c in trainer.callbacks if isinstance(c, DataStatesCallback)]
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # its __init__ needs the deepspeed package
    deepspeed._checkpoint_io = plugin
    monkeypatch.setattr(type(trainer), "strategy", property(lambda _: deepspeed))
    for stage in ("fit", "validate"):
        with pytest.warns(PluginBypassedWarning, match="DeepSpeedStrategy writes each checkpoint") as warned:
            callback.setup(trainer, BNModel(), stage)
        callback.teardown(trainer, BNModel(), stage)
    assert len(warned) == 1
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginBypassedWarning)
        callback.setup(trainer, BNModel(), "fit")  # the trainer's own strategy: no warning
        callback.teardown(trainer, BNModel(), "fit")


def test_sharded_saves_go_through_the_plugin_and_top_k_removes_directories(tmp_path, single_process_group, recwarn):
    """ModelParallelStrategy with distributed checkpoints (CPU, one process): real Trainer, real DCP directories."""
    checkpoint_dir = tmp_path / "ckpt"
    plugin = DataStatesIO()
    trainer = _model_parallel_fit(tmp_path, plugin, str(checkpoint_dir), save_distributed_checkpoint=True)
    assert not any(issubclass(w.category, PluginBypassedWarning) for w in recwarn)
    # Four directories were saved, top-1 kept: ModelCheckpoint removed three through DataStatesIO.remove_checkpoint.
    assert sorted(os.listdir(checkpoint_dir)) == ["epoch=0-step=4.ckpt"]
    kept = checkpoint_dir / "epoch=0-step=4.ckpt"
    assert sorted(p.name for p in kept.iterdir() if not p.name.endswith(".distcp")) == [".metadata", "meta.pt"]
    assert len(plugin.stats) == 4  # the plugin wrote each rank file
    state = {k: torch.zeros_like(v) for k, v in trainer.lightning_module.state_dict().items()}
    import torch.distributed.checkpoint as dcp

    dcp.load({"state_dict": state}, checkpoint_id=str(kept))  # plain DCP reads it
    assert_bit_equal(state, trainer.lightning_module.state_dict(), "model after fit")
    assert torch.load(kept / "meta.pt", weights_only=False)["global_step"] == 4


def test_full_state_model_parallel_saves_s3_urls_through_the_plugin(tmp_path, s3, single_process_group, recwarn):
    """ModelParallelStrategy(save_distributed_checkpoint=False) hands the plugin a pathlib.Path, which collapses
    ``s3://bucket/key`` into ``s3:/bucket/key``: the files must still reach the bucket, equal to the saved state."""
    plugin = RecordingDataStatesIO(storage_options=s3.storage_options)
    _model_parallel_fit(tmp_path, plugin, s3.url("run"), save_distributed_checkpoint=False, top_k=2)
    assert not any(issubclass(w.category, PluginBypassedWarning) for w in recwarn)
    recorded = {checkpoint_path_str(pathlib.Path(path)): state for path, state in plugin.recorded.items()}
    assert all(path.startswith("s3:/") and not path.startswith("s3://") for path in plugin.recorded), "not a Path"
    saved_keys = s3.keys()
    assert saved_keys == ["run/epoch=0-step=3.ckpt", "run/epoch=0-step=4.ckpt"]
    for key in saved_keys:
        loaded = torch.load(io.BytesIO(s3.read(key)), map_location="cpu", weights_only=False)
        assert_bit_equal(loaded, recorded[s3.url(key)], key)
    assert not (pathlib.Path.cwd() / "s3:").exists() and not (tmp_path / "s3:").exists()


def test_fsdp_full_state_save_call_keeps_the_url(s3):
    """FSDP needs a GPU; its full-state save is called here exactly as the Trainer calls it (no process group)."""
    plugin = DataStatesIO(storage_options=s3.storage_options)
    strategy = FSDPStrategy(state_dict_type="full")
    strategy.checkpoint_io = plugin
    state = {"state_dict": {"w": torch.arange(1000, dtype=torch.float32)}, "global_step": 3}
    strategy.save_checkpoint(dict(state), s3.url("fsdp/full.ckpt"))
    assert_bit_equal(torch.load(io.BytesIO(s3.read("fsdp/full.ckpt")), weights_only=True), state, "fsdp full")
    assert plugin.load_checkpoint(pathlib.Path(s3.url("fsdp/full.ckpt")))["global_step"] == 3


@pytest.mark.parametrize("pending", [False, True], ids=["idle", "with-pending-saves"])
def test_remove_checkpoint_of_a_sharded_directory_on_s3(s3, pending):
    """The exact call a sharded strategy makes (``Strategy.remove_checkpoint`` with a directory) on S3."""
    plugin = DataStatesIO(storage_options=s3.storage_options)
    strategy = FSDPStrategy(state_dict_type="sharded")
    strategy.checkpoint_io = plugin
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"):
        s3.put(f"run/step=1.ckpt/{name}", b"shard")
    s3.put("run/step=10.ckpt/meta.pt", b"keep")  # a sibling sharing the prefix "step=1"
    if pending:
        in_background(plugin)  # as inside fit: the save returns before its file is committed
        plugin.save_checkpoint({"w": torch.ones(4)}, s3.url("run/other.ckpt"))
    strategy.remove_checkpoint(s3.url("run/step=1.ckpt"))
    plugin.drain()
    expected = ["run/step=10.ckpt/meta.pt"] + (["run/other.ckpt"] if pending else [])
    assert s3.keys() == sorted(expected)


@pytest.mark.parametrize("pending", [False, True], ids=["idle", "with-pending-saves"])
def test_remove_checkpoint_of_a_sharded_directory_on_local_disk(tmp_path, pending):
    plugin = DataStatesIO()
    strategy = ModelParallelStrategy()
    strategy.checkpoint_io = plugin
    shard_dir = tmp_path / "step=1.ckpt"
    (shard_dir / "nested").mkdir(parents=True)
    for name in ("__0_0.distcp", ".metadata", "nested/meta.pt"):
        (shard_dir / name).write_bytes(b"shard")
    (tmp_path / "step=10.ckpt").mkdir()
    if pending:
        in_background(plugin)
        plugin.save_checkpoint({"w": torch.ones(4)}, str(tmp_path / "other.ckpt"))
    strategy.remove_checkpoint(str(shard_dir))
    plugin.drain()
    assert sorted(os.listdir(tmp_path)) == sorted(["step=10.ckpt"] + (["other.ckpt"] if pending else []))
