"""Sharded checkpoints through the plugin: ModelParallelStrategy + FSDP2 on 2 and 4 CPU processes (gloo), real
Trainers launched as real processes (tests/sharded_script.py), real DCP directories.

Every checkpoint directory is read back with torch's own ``dcp_to_torch_save`` (DCP's reader, one process: a
different world size) and compared, bit for bit, with the concatenation of the local shards each rank copied
synchronously at the save call.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import signal
import time
from collections.abc import Callable

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_datastates import DataStatesIO
from tests.conftest import assert_bit_equal, temp_files
from tests.s3_server import (  # noqa: F401 - the *_fixture imports register the fixtures
    free_port,
    s3_endpoint_fixture,
    s3_fixture,
)
from tests.script_support import launch, run_to_completion
from tests.sharded_script import TIED, ShardedMLP, loader, local_state
from tests.tensor_parallel_script import HSDP_REPLICATED, REPLICATED
from tests.test_sharded_parts import alone_in_a_process_group

#: A sharded run starts slowly on a loaded 2-core machine; this only bounds a hang.
_RUN_TIMEOUT_S = 600
_NAMES = ["epoch=1-step=7.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]  # 2 ranks: 4 steps per epoch, 2 epochs


def _names(world: int) -> list[str]:
    """What ModelCheckpoint keeps after the script's 2 epochs of 64 samples in batches of 8 per rank."""
    steps = 2 * 64 // (8 * world)
    return [f"epoch=1-step={steps - 1}.ckpt", f"epoch=1-step={steps}.ckpt", "last.ckpt"]


def _run(out: pathlib.Path, *args: str, **env: str) -> str:
    return run_to_completion("sharded_script.py", str(out), *args, timeout_s=_RUN_TIMEOUT_S, what="sharded", **env)


def _results(out: pathlib.Path, world: int) -> list[str]:
    return [(out / f"rank{rank}.result").read_text() for rank in range(world)]


def _read_with_dcp(directory: pathlib.Path, scratch: pathlib.Path) -> dict[str, torch.Tensor]:
    """The checkpoint as DCP reads it on one process, flattened to the reference keys (ModelParallel's: the model
    under ``state_dict``; FSDPStrategy's checkpoints keep it under ``model``, see :func:`_read_all_with_dcp`)."""
    converted = scratch / f"{directory.name}.pt"
    dcp_to_torch_save(str(directory), str(converted))
    full = torch.load(converted, weights_only=False)
    flat = {f"state_dict.{k}": v for k, v in full["state_dict"].items()}
    for fqn, values in full["optimizer_0"]["state"].items():
        flat.update({f"optimizer_0.state.{fqn}.{key}": v for key, v in values.items() if isinstance(v, torch.Tensor)})
    return dict(sorted(flat.items()))


def _expected(out: pathlib.Path, step: int, world: int) -> dict[str, torch.Tensor]:
    """The state at the save call of ``step``: each rank's synchronous copy of its shards, joined (FSDP2 splits
    dim 0)."""
    shards = [torch.load(out / "ref" / f"step{step}" / f"rank{rank}.pt") for rank in range(world)]
    expected = {}
    for key, first in shards[0].items():
        if first.dim() == 0:  # replicated (AdamW's step): every rank holds the same value
            for shard in shards[1:]:
                assert_bit_equal(shard[key], first, f"replicated {key} at step {step}")
            expected[key] = first
        else:
            expected[key] = torch.cat([shard[key] for shard in shards])
    return dict(sorted(expected.items()))


def _step_of(directory: pathlib.Path) -> int:
    return torch.load(directory / "meta.pt", weights_only=False)["global_step"]


def _mismatches(out: pathlib.Path, world: int, scratch: pathlib.Path) -> list[str]:
    """The checkpoint directories whose content differs from the state at their save call."""
    wrong = []
    for directory in sorted((out / "ckpt").iterdir()):
        try:
            expected = _expected(out, _step_of(directory), world)
            assert_bit_equal(_read_with_dcp(directory, scratch), expected, directory.name)
        except AssertionError:
            wrong.append(directory.name)
    return wrong


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One run of 2 ranks with the plugin (2 epochs, a save every step, top-2 and last.ckpt), shared by the tests that
    only read what it left: each run costs a few dozen seconds of CI."""
    out = tmp_path_factory.mktemp("two-rank-run")
    _run(out, "--world", "2")
    return out


def _assert_saved_as_at_the_save_call(out: pathlib.Path, world: int) -> None:
    assert _results(out, world) == ["ok"] * world
    checkpoint_dir = out / "ckpt"
    assert sorted(os.listdir(checkpoint_dir)) == _names(world)  # top-2 by step and last.ckpt, as a synchronous run
    for name in _names(world):
        files = sorted(os.listdir(checkpoint_dir / name))
        shards = [f for f in files if f.startswith("__") and f.endswith(".distcp")]
        # One file per rank; the earlier saves of last.ckpt were removed, and so was every in-flight marker.
        assert sorted(files) == sorted([".metadata", "meta.pt", *shards]) and len(shards) == world, files
        # The tied weight's two keys point to one archive per rank: copied and written once.
        storage = pickle.loads((checkpoint_dir / name / ".metadata").read_bytes()).storage_data
        keys = [f"state_dict.layers.{i}.weight" for i in TIED]
        tied = [
            {
                (index.offset, info.relative_path, info.offset, info.length)
                for index, info in storage.items()
                if index.fqn == key
            }
            for key in keys
        ]
        assert tied[0] == tied[1] and len(tied[0]) == world, tied
    assert _mismatches(out, world, out) == []
    assert temp_files(str(out)) == []


@pytest.mark.slow
def test_two_ranks_save_their_shards_as_at_the_save_call_and_dcp_reads_them(two_rank_run):
    _assert_saved_as_at_the_save_call(two_rank_run, 2)


@pytest.mark.slow
def test_four_ranks_save_their_shards_as_at_the_save_call_and_dcp_reads_them(tmp_path):
    _run(tmp_path, "--world", "4")
    _assert_saved_as_at_the_save_call(tmp_path, 4)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("broken", [False, True], ids=["plugin", "broken-no-barrier"])
def test_one_save_per_step_equals_the_state_at_the_save_call_and_fails_without_the_barrier(tmp_path, broken, world):
    """The broken variant: barriers return at once, so the optimizer updates shards that are still being copied.
    (With ``last.ckpt`` too, a step's second save would wait for its first's copies and hide the broken barrier.)"""
    _run(tmp_path, "--world", str(world), "--no-last", **({"LDS_BROKEN": "barrier"} if broken else {}))
    assert sorted(os.listdir(tmp_path / "ckpt")) == _names(world)[:2]
    assert (_mismatches(tmp_path, world, tmp_path) != []) == broken


@pytest.fixture(scope="module")
def synchronous_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The same run with Lightning's own synchronous sharded save (no plugin)."""
    out = tmp_path_factory.mktemp("synchronous-run")
    _run(out, "--world", "2", "--sync")
    return out


@pytest.mark.slow
def test_names_and_content_match_lightning_synchronous_sharded_save(tmp_path, two_rank_run, synchronous_run):
    ours, theirs = two_rank_run, synchronous_run
    assert sorted(os.listdir(ours / "ckpt")) == sorted(os.listdir(theirs / "ckpt")) == _NAMES
    for name in _NAMES:
        theirs_read = _read_with_dcp(theirs / "ckpt" / name, theirs)
        assert_bit_equal(_read_with_dcp(ours / "ckpt" / name, tmp_path), theirs_read, name)
        assert _step_of(ours / "ckpt" / name) == _step_of(theirs / "ckpt" / name)


@pytest.fixture(scope="module")
def fsdp_synchronous_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Lightning's ``FSDPStrategy(state_dict_type="sharded")`` (FSDP1) on 2 ranks with its own synchronous save."""
    out = tmp_path_factory.mktemp("fsdp-synchronous-run")
    _run(out, "--world", "2", "--fsdp1", "--sync")
    return out


def _assert_same_final_state(out: pathlib.Path, uninterrupted: pathlib.Path) -> None:
    for rank in (0, 1):
        final = torch.load(out / "final" / f"rank{rank}.pt")
        assert_bit_equal(final, torch.load(uninterrupted / "final" / f"rank{rank}.pt"), f"rank {rank} after resume")


@pytest.mark.slow
def test_fsdp_strategy_saves_as_lightning_does_and_resumes_bit_for_bit(tmp_path, fsdp_synchronous_run):
    """Lightning's ``FSDPStrategy(state_dict_type="sharded")`` (FSDP1: ``ShardedTensor`` state dicts, the model under
    the key ``"model"``) on 2 CPU ranks. A run through the plugin stops after one epoch and a second run resumes it
    from ``last.ckpt`` with Lightning's own sharded load; the checkpoints it leaves (top-2 and last, the older ones
    removed across the restart) read back exactly as those of one uninterrupted run with Lightning's synchronous save,
    and both runs end with the same weights. FSDP1's state dicts are copies made at the save call, so the barrier has
    nothing to protect here: the ModelParallel tests above prove the snapshot contract."""
    ours, theirs = tmp_path / "ours", fsdp_synchronous_run
    _run(ours, "--world", "2", "--fsdp1", "--epochs", "1")
    assert _results(ours, 2) == ["ok", "ok"]
    _run(ours, "--world", "2", "--fsdp1", "--resume", "last.ckpt")
    assert _results(ours, 2) == _results(theirs, 2) == ["ok", "ok"]
    assert sorted(os.listdir(ours / "ckpt")) == sorted(os.listdir(theirs / "ckpt")) == _NAMES
    for name in _NAMES:
        shard_files = [f for f in os.listdir(ours / "ckpt" / name) if f.endswith(".distcp")]
        assert len(shard_files) == 2 and "__0_0.distcp" not in shard_files, shard_files  # the plugin's files
        loaded = [_read_all_with_dcp(out / "ckpt" / name, out) for out in (ours, theirs)]
        assert_bit_equal(loaded[0], loaded[1], name)
        assert _step_of(ours / "ckpt" / name) == _step_of(theirs / "ckpt" / name)
    _assert_same_final_state(ours, theirs)


@pytest.mark.slow
def test_resume_from_s3_reproduces_the_uninterrupted_run(tmp_path, s3, fsdp_synchronous_run):
    """Lightning's sharded load turns ``s3://bucket/...`` into a ``pathlib.Path`` and cannot read it; the plugin loads
    such a directory itself, with DCP's fsspec reader (every rank told by rank 0 which way to load). With
    ``FSDPStrategy`` on 2 ranks (ModelParallel's load from a URL: test_sharded_parts.py, in one process): a run saving
    to the moto server stops after one epoch; a second run resumes from ``last.ckpt`` there and ends with the weights
    of an uninterrupted local run; the bucket then holds the names an uninterrupted run leaves (top-2 and last, the
    older ones removed across the restart)."""
    prefix = f"resume-{time.monotonic_ns()}/ckpt"
    storage = ("--ckpt-dir", s3.url(prefix), "--storage-options", json.dumps(s3.storage_options))
    _run(tmp_path, "--world", "2", "--fsdp1", *storage, "--epochs", "1")
    assert _results(tmp_path, 2) == ["ok", "ok"]
    _run(tmp_path, "--world", "2", "--fsdp1", *storage, "--resume", "last.ckpt")
    assert _results(tmp_path, 2) == ["ok", "ok"]
    assert sorted(_s3_directories(s3, prefix)) == _NAMES
    _assert_same_final_state(tmp_path, fsdp_synchronous_run)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "replicated", "holders"),
    [
        ("tp-fsdp2", REPLICATED, ((0, 1), (2, 3))),  # replicated over the tensor-parallel dimension
        ("hsdp", HSDP_REPLICATED, ((0, 2), (1, 3))),  # replica groups along the first dimension
    ],
)
def test_2d_meshes_match_lightnings_own_save_and_write_each_replica_once(tmp_path, layout, replicated, holders):
    """Four ranks on a 2x2 mesh: tensor parallelism with FSDP2 (column- and row-split weights, replicated biases, norm
    and head, all sharded over data parallel), or HSDP. Every checkpoint reads back as Lightning's synchronous save of
    the same run does; of the two ranks holding a replicated shard, exactly one put it in its file, and both got
    some (the items each rank staged, recorded by the script)."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    extra = ("--hsdp",) if layout == "hsdp" else ()
    for out, sync in ((ours, ()), (theirs, ("--sync",))):
        run_to_completion("tensor_parallel_script.py", str(out), *extra, *sync, timeout_s=_RUN_TIMEOUT_S, what=layout)
    names = sorted(os.listdir(ours / "ckpt"))
    assert names == sorted(os.listdir(theirs / "ckpt")) and len(names) == 2
    for name in names:
        loaded = [_read_all_with_dcp(out / "ckpt" / name, out) for out in (ours, theirs)]
        assert_bit_equal(loaded[0], loaded[1], name)
    replicas = {f"{prefix}{key}{suffix}" for key in replicated for prefix, suffix in _STATE_KEYS}
    staged = [[set(items) for items in json.loads((ours / f"staged{rank}.json").read_text())] for rank in range(4)]
    assert [len(saves) for saves in staged] == [2] * 4
    for save in range(2):
        for first, second in holders:  # the two ranks holding the same shards
            one, other = staged[first][save] & replicas, staged[second][save] & replicas
            assert one and other and not one & other and one | other == replicas, (save, first, one, other)
        rest = [staged[rank][save] - replicas for rank in range(4)]
        assert all(items == rest[0] for items in rest)  # split weights, plain items: on every rank


#: Where a parameter's values are in a checkpoint: its weights, and its two AdamW moments.
_STATE_KEYS = (("state_dict.", ""), ("optimizer_0.state.", ".exp_avg"), ("optimizer_0.state.", ".exp_avg_sq"))


def _read_all_with_dcp(directory: pathlib.Path, scratch: pathlib.Path) -> dict:
    """Everything in the checkpoint as DCP reads it on one process, flat and sorted by key (DCP rebuilds a dict's keys
    in the order of its metadata, which is each writer's own)."""
    converted = scratch / f"{directory.name}.all.pt"
    dcp_to_torch_save(str(directory), str(converted))
    flat: dict = {}

    def walk(value, prefix: str) -> None:  # nested dicts and lists (param_groups), whatever their key order
        if isinstance(value, dict | list):
            for key, item in value.items() if isinstance(value, dict) else enumerate(value):
                walk(item, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = value

    walk(torch.load(converted, weights_only=False), "")
    return dict(sorted(flat.items()))


@pytest.mark.slow
def test_dcp_plans_each_save_on_the_committer_thread_not_the_training_thread(two_rank_run, synchronous_run):
    """DCP's planning collectives (gather and scatter of every rank's plan) cost the training thread nothing: they
    run on the committer thread. Lightning's own save, the reference, plans on the training thread."""
    for rank in (0, 1):
        ours = json.loads((two_rank_run / f"planning{rank}.json").read_text())
        theirs = json.loads((synchronous_run / f"planning{rank}.json").read_text())
        assert len(ours) == len(theirs) > 0, (ours, theirs)  # one planning per save
        assert set(ours) == {"datastates-sharded-commit"} and set(theirs) == {"MainThread"}, (ours, theirs)


@pytest.mark.slow
def test_a_rank_whose_staging_fails_fails_that_save_on_every_rank(tmp_path):
    """Rank 1's 3rd save raises on its training thread before anything is copied; its committer still joins that
    save's planning with the failure, so rank 0 learns it there: no rank commits the save, none waits for it."""
    _run(tmp_path, "--world", "2", "--fail-staging-rank", "1", "--on-flush-error", "warn")
    results = _results(tmp_path, 2)
    assert results[1] == "RuntimeError: staging failed (injected)", results
    assert results[0] != "ok", results  # rank 1 left fit: rank 0's next collective with it fails
    for directory in (tmp_path / "ckpt").iterdir():  # the two saves before are whole; nothing of the third
        assert (directory / "meta.pt").is_file() and (directory / ".metadata").is_file(), directory
    assert _mismatches(tmp_path, 2, tmp_path) == []
    assert not any(name.endswith(".datastates-pending") for _, _, n in os.walk(tmp_path / "ckpt") for name in n)


@pytest.mark.slow
def test_resume_from_a_sharded_checkpoint_reproduces_the_uninterrupted_run(tmp_path, two_rank_run):
    uninterrupted, resumed = two_rank_run, tmp_path / "resumed"  # the shared run trains 2 epochs
    _run(resumed, "--world", "2", "--epochs", "1")
    _run(resumed, "--world", "2", "--epochs", "2", "--resume", "last.ckpt")  # Lightning's own sharded load
    _assert_same_final_state(resumed, uninterrupted)


@pytest.mark.slow
def test_lightning_alone_loads_a_two_rank_checkpoint_onto_one_rank(two_rank_run, monkeypatch):
    """The plugin's ``last.ckpt`` of 2 ranks, resumed by a Trainer without the plugin on 1 rank: Lightning's own
    sharded load, DCP resharding every tensor onto the one rank, restores the model and the optimizer state as they
    were at that save call (the run had ended: no step follows the load)."""
    last = two_rank_run / "ckpt" / "last.ckpt"
    alone_in_a_process_group(monkeypatch)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ModelParallelStrategy(),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    assert not isinstance(trainer.strategy.checkpoint_io, DataStatesIO)
    try:
        trainer.fit(ShardedMLP(), loader(), ckpt_path=str(last))
        restored = local_state(trainer._checkpoint_connector.dump_checkpoint())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert trainer.global_step == _step_of(last)
    assert_bit_equal(dict(sorted(restored.items())), _expected(two_rank_run, _step_of(last), 2), "restored on 1 rank")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_a_rank_that_fails_its_flush_leaves_the_checkpoint_uncommitted_on_every_rank(tmp_path, policy):
    output = _run(tmp_path, "--world", "2", "--fail-rank", "1", "--on-flush-error", policy)
    results = _results(tmp_path, 2)
    if policy == "raise":
        # Rank 1 raises its own error at its next hook and leaves fit; rank 0 then fails too (with the committer's
        # report, or first with a collective that rank 1 left: which one comes first is a race of the two ranks).
        assert results[1].startswith("CheckpointFlushError: writing checkpoint") and "__1_" in results[1], results
        assert results[0] != "ok", results
    else:  # training goes on; each rank reports once: its own failure, or which rank failed
        assert results == ["ok", "ok"], results
        assert output.count("(injected)") >= 1 and "was not committed: rank 1 failed" in output, output[-3000:]
    # Whatever is on storage is a whole checkpoint equal to its save call's state, or nothing: no directory holds
    # rank 0's new file without the others, and none without meta.pt.
    for directory in (tmp_path / "ckpt").iterdir():
        assert (directory / "meta.pt").is_file() and (directory / ".metadata").is_file(), directory
    assert _mismatches(tmp_path, 2, tmp_path) == []


def _kill_mid_flush(out: pathlib.Path, committed: Callable[[], bool], *args: str) -> None:
    """Run the script with rank 1 held in its 3rd shard write; once ``committed()`` (an earlier checkpoint is on
    storage, committed by every rank's committer meanwhile: on a loaded machine that can take seconds), SIGKILL rank 1
    there, then every other rank."""
    args = ("--world", "2", "--hold-rank", "1", *args)
    process = launch("sharded_script.py", str(out), *args, MASTER_PORT=str(free_port()))
    try:
        deadline = time.monotonic() + _RUN_TIMEOUT_S
        while not ((out / "held").exists() and committed()):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-4000:]
            time.sleep(0.05)
        time.sleep(0.2)  # rank 0 goes on into the exchange
        os.kill(int((out / "held").read_text()), signal.SIGKILL)  # rank 1, mid-flush
    finally:
        time.sleep(1.0)
        process.kill()
        _kill_leftover_ranks(out)  # first: a live rank keeps the output pipe open, and communicate() would wait
        process.communicate(timeout=60)


@pytest.mark.slow
def test_a_rank_killed_mid_flush_leaves_no_checkpoint_and_the_next_run_cleans_up(tmp_path):
    checkpoint_dir = tmp_path / "ckpt"
    _kill_mid_flush(tmp_path, lambda: any(checkpoint_dir.glob("*/meta.pt")))
    committed = [d for d in checkpoint_dir.iterdir() if (d / "meta.pt").is_file()]
    uncommitted = [d for d in checkpoint_dir.iterdir() if not (d / "meta.pt").is_file()]
    assert uncommitted, "the held save should have left an uncommitted directory"
    for directory in uncommitted:  # nothing DCP would take for a checkpoint either
        assert not (directory / ".metadata").exists(), sorted(os.listdir(directory))
    for directory in committed:  # the earlier checkpoints are whole: each as at its save call, bit for bit
        expected = _expected(tmp_path, _step_of(directory), 2)
        assert_bit_equal(_read_with_dcp(directory, tmp_path), expected, directory.name)
    # The next run in the same directory removes the dead run's leftovers before its first save.
    _run(tmp_path / "next", "--world", "2", "--epochs", "1", "--ckpt-dir", str(checkpoint_dir))
    for directory in checkpoint_dir.iterdir():
        assert (directory / "meta.pt").is_file(), directory
        # Each directory holds its checkpoint's files and nothing else: no marker, shard file or record of the dead run.
        named = {
            info.relative_path for info in pickle.loads((directory / ".metadata").read_bytes()).storage_data.values()
        }
        assert set(os.listdir(directory)) == named | {".metadata", "meta.pt"}, sorted(os.listdir(directory))


@pytest.mark.slow
def test_a_rank_killed_mid_flush_on_s3_leaves_no_checkpoint_and_the_next_run_cleans_up(tmp_path, s3):
    prefix = f"killed-{time.monotonic_ns()}/ckpt"
    args = ("--ckpt-dir", s3.url(prefix), "--storage-options", json.dumps(s3.storage_options))
    _kill_mid_flush(tmp_path, lambda: any(key.endswith("/meta.pt") for key in s3.keys(prefix + "/")), *args)
    directories = _s3_directories(s3, prefix)
    committed = [d for d, names in directories.items() if "meta.pt" in names]
    assert (committed and len(committed) < len(directories)) or s3.open_uploads(), directories
    for directory, names in directories.items():  # nothing DCP would take for a checkpoint without meta.pt either
        assert "meta.pt" in names or ".metadata" not in names, (directory, names)
    for directory in committed:  # the earlier checkpoints are whole: each as at its save call, bit for bit
        local = s3.download(f"{prefix}/{directory}", tmp_path / "from-s3" / directory)
        assert_bit_equal(_read_with_dcp(local, tmp_path), _expected(tmp_path, _step_of(local), 2), directory)
    _run(tmp_path / "next", "--world", "2", "--epochs", "1", *args)
    for directory, names in _s3_directories(s3, prefix).items():
        # Each directory holds its checkpoint's files and nothing else: no marker, shard file or record of the dead run.
        assert "meta.pt" in names, (directory, names)
        _assert_s3_checkpoint_whole(s3, f"{prefix}/{directory}")
        named = {
            info.relative_path
            for info in pickle.loads(s3.read(f"{prefix}/{directory}/.metadata")).storage_data.values()
        }
        assert set(names) == named | {".metadata", "meta.pt"}, (directory, sorted(names))
    assert [u for u in s3.open_uploads() if prefix in u] == []


def _s3_directories(s3, prefix: str) -> dict[str, list[str]]:
    directories: dict[str, list[str]] = {}
    for key in s3.keys(prefix + "/"):
        directory, _, name = key[len(prefix) + 1 :].partition("/")
        if name:
            directories.setdefault(directory, []).append(name)
    return directories


def _assert_s3_checkpoint_whole(s3, directory: str) -> None:
    metadata = pickle.loads(s3.read(f"{directory}/.metadata"))
    for info in metadata.storage_data.values():
        data = s3.read(f"{directory}/{info.relative_path}")
        assert data is not None and len(data) >= info.offset + info.length, (directory, info)


def _kill_leftover_ranks(out: pathlib.Path) -> None:
    """Lightning launched rank 1 as a child of rank 0: kill any process still running this script for ``out``."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"sharded_script.py") for part in cmdline) and str(out).encode() in cmdline:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
