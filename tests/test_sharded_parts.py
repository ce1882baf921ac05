"""The parts of sharded saves that need no process group: the shard file layout (pure), DCP's ``StorageWriter``
seam in one process, the commit's file order, the cleanup of dead saves, and one sharded fit on S3 (moto)."""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

import lightning_datastates.sharded.saver as saver_module
from lightning_datastates import DataStatesIO
from lightning_datastates.alignment import align_up
from lightning_datastates.compat.torch import local_shard
from lightning_datastates.errors import CheckpointCaptureError, CheckpointFlushError
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.records.leftovers import host_tag
from lightning_datastates.records.names import DCP_METADATA_NAME, LIGHTNING_META_NAME, PENDING_SUFFIX
from lightning_datastates.sharded.commit import ShardedSave
from lightning_datastates.sharded.dcp_writer import plan_checkpoint
from lightning_datastates.sharded.layout import ArchivePlans, plan_shard_file
from lightning_datastates.sharded.leftovers import clean_sharded_leftovers, mark_pending
from lightning_datastates.sharded.publish import write_commit_record
from lightning_datastates.sharded.saver import ShardedSaver
from lightning_datastates.sharded.staging import LocalPlans, stage_shard
from lightning_datastates.snapshot.pending import PendingCheckpoints
from lightning_datastates.storage import LocalWriter
from tests.conftest import BNModel, assert_bit_equal, dead_pid, make_loader, make_trainer, temp_files
from tests.s3_server import (  # noqa: F401 - the *_fixture imports register the fixtures
    free_port,
    s3_endpoint_fixture,
    s3_fixture,
)
from tests.script_support import datastates_threads
from tests.sharded_script import CpuFSDPStrategy


def _write(plan, path: str) -> None:
    """Write a planned file the plain way: metadata, each storage's bytes at its record, each CRC-32 field zero."""
    data = bytearray(plan.layout.total_bytes)
    for offset, chunk in plan.layout.metadata:
        data[offset : offset + len(chunk)] = chunk
    for record in plan.layout.records:
        storage = plan.storages[record.key]
        data[record.offset : record.offset + record.nbytes] = bytes(storage)
    with open(path, "wb") as handle:
        handle.write(data)


@pytest.mark.parametrize("alignment", [None, 4096])
def test_each_item_of_a_shard_file_loads_with_torch_load_of_its_extent(tmp_path, alignment):
    base = torch.arange(100, dtype=torch.float32)
    items = [torch.randn(7, 5), b"pickled bytes", torch.arange(12, dtype=torch.int64).reshape(3, 4), base[10:20], b""]
    plan = plan_shard_file(items, alignment)
    path = tmp_path / "shard.distcp"
    _write(plan, str(path))
    blob = path.read_bytes()
    assert len(plan.extents) == len(items)
    previous_end = 0
    for extent in sorted(plan.extents, key=lambda e: e.offset):  # aligned pieces, none overlapping another
        assert extent.offset % (alignment or 64) == 0 and extent.offset >= previous_end
        previous_end = extent.offset + extent.length
    assert previous_end == plan.layout.total_bytes
    for item, extent in zip(items, plan.extents, strict=True):
        piece = blob[extent.offset : extent.offset + extent.length]
        if isinstance(item, bytes):
            assert piece == item
        else:  # a view is saved with its storage, as torch.save does; torch.load rebuilds the same view
            assert_bit_equal(torch.load(io.BytesIO(piece), weights_only=True), item, "item")
    if alignment:
        assert all(r.offset % alignment == 0 for r in plan.layout.records if r.nbytes)


def test_a_staged_shard_planned_by_dcp_is_read_by_dcp_once_the_metadata_is_written(tmp_path):
    """One process, no process group: the training thread's half (staging, no collective) and the committer's (DCP's
    planning, driving the writer as on every rank); ``.metadata`` is not written by either."""
    state = {"model": {"w": torch.randn(16, 8), "b": torch.zeros(8)}, "extra": {"lr": 0.1, "names": ["a"]}}
    directory = tmp_path / "ckpt"
    directory.mkdir()
    plans = ArchivePlans(None)
    staged, shard = stage_shard(state, 0, plans)
    assert shard is not None
    _write(shard, str(directory / staged.file_name))
    planned = plan_checkpoint(staged, str(directory), None)
    assert planned is not None and planned.file_names == (staged.file_name,)
    assert not (directory / DCP_METADATA_NAME).exists()  # the commit writes it, once every rank's file is durable
    (directory / DCP_METADATA_NAME).write_bytes(planned.metadata_bytes)
    target = {"model": {"w": torch.empty(16, 8), "b": torch.ones(8)}, "extra": {"lr": 0.0, "names": []}}
    dcp.load(target, checkpoint_id=str(directory), no_dist=True)
    assert_bit_equal(target, state, "loaded")
    # A second save into the same directory uses new file names: the committed files stay as they are.
    second, _ = stage_shard(state, 0, plans)
    assert second.file_name != staged.file_name and plans.run_hits == 1


def _dead_marker(directory) -> None:
    (directory / f".commit.{host_tag()}.{dead_pid()}.deadbeef{PENDING_SUFFIX}").write_bytes(b"")


def test_dead_sharded_saves_are_removed_and_committed_checkpoints_kept(tmp_path):
    uncommitted = tmp_path / "epoch=0-step=3.ckpt"  # died in flight: no meta.pt
    uncommitted.mkdir()
    (uncommitted / "__0_abc.distcp").write_bytes(b"x")
    _dead_marker(uncommitted)
    resaved = tmp_path / "last.ckpt"  # a re-save of a committed checkpoint that died: the old one stays
    resaved.mkdir()
    storage = {"item": _StorageInfo("__0_old.distcp")}
    (resaved / DCP_METADATA_NAME).write_bytes(pickle.dumps(_Metadata(storage)))
    (resaved / LIGHTNING_META_NAME).write_bytes(b"meta")
    (resaved / "__0_old.distcp").write_bytes(b"old")
    (resaved / "__0_new.distcp").write_bytes(b"new")
    _dead_marker(resaved)
    live = tmp_path / "live.ckpt"  # a save of this process in flight: untouched
    live.mkdir()
    (live / "__0_x.distcp").write_bytes(b"x")
    mark_pending(LocalWriter(), str(live))
    removed = clean_sharded_leftovers(LocalWriter(), str(tmp_path), max_age_s=3600)
    assert not uncommitted.exists()
    assert sorted(os.listdir(resaved)) == [DCP_METADATA_NAME, "__0_old.distcp", LIGHTNING_META_NAME]
    assert len(os.listdir(live)) == 2
    assert str(uncommitted) in removed and str(resaved / "__0_new.distcp") in removed


class _RefusingShardRemovals(LocalWriter):
    """Refuses to remove shard files, whichever call is used (the fault: a storage error in the middle of a
    cleanup)."""

    def remove(self, path):
        if path.endswith(".distcp"):
            raise PermissionError("refused")
        super().remove(path)

    def remove_files(self, directory, names):
        if any(name.endswith(".distcp") for name in names):
            raise PermissionError("refused")
        super().remove_files(directory, names)


def test_a_cleanup_that_fails_half_way_leaves_the_directory_marked_for_the_next_run(tmp_path, caplog):
    resaved = tmp_path / "last.ckpt"  # a committed checkpoint and the files of a re-save that died
    resaved.mkdir()
    (resaved / DCP_METADATA_NAME).write_bytes(pickle.dumps(_Metadata({"item": _StorageInfo("__0_old.distcp")})))
    (resaved / LIGHTNING_META_NAME).write_bytes(b"meta")
    (resaved / "__0_old.distcp").write_bytes(b"old")
    (resaved / "__0_new.distcp").write_bytes(b"new")
    _dead_marker(resaved)
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        assert clean_sharded_leftovers(_RefusingShardRemovals(), str(tmp_path), max_age_s=3600) == []
    assert "could not clean the dead sharded save" in caplog.text and "refused" in caplog.text  # said, not raised
    # The marker goes last: still there, so the next run finds the leftover and removes it.
    assert len(os.listdir(resaved)) == 5
    clean_sharded_leftovers(LocalWriter(), str(tmp_path), max_age_s=3600)
    assert sorted(os.listdir(resaved)) == [DCP_METADATA_NAME, "__0_old.distcp", LIGHTNING_META_NAME]


@dataclass
class _StorageInfo:
    """Stands in for DCP's per-item storage record in the test above (only its file name is read)."""

    relative_path: str


class _Metadata:
    """Stands in for DCP's Metadata in the test above (pickled by reference to this module)."""

    def __init__(self, storage_data: dict) -> None:
        self.storage_data = storage_data


def alone_in_a_process_group(monkeypatch) -> None:
    """The environment of a process group of this process alone, on a free port; restored after the test. Call it
    again before each new group: Lightning sets the rank variables in this process, and a port may linger."""
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.setenv(name, "0")  # records the value before (or its absence) for the undo
        monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def _one_process_fit(
    tmp_path,
    monkeypatch,
    plugin: DataStatesIO,
    checkpoint: ModelCheckpoint,
    strategy: ModelParallelStrategy | None = None,
    model: type[BNModel] | None = None,
    max_epochs: int = 1,
    ckpt_path: str | None = None,
    callbacks: list[L.Callback] | None = None,
) -> L.Trainer:
    """A ModelParallel fit of this process alone (a process group of its own, 4 steps per epoch of a seeded
    ``model``, by default one whose parameters stay plain tensors), saving through ``plugin`` as ``checkpoint`` says,
    resumed from ``ckpt_path`` if given, with ``callbacks`` besides; the trainer, its process group destroyed."""
    alone_in_a_process_group(monkeypatch)
    torch.manual_seed(0)
    strategy = ModelParallelStrategy() if strategy is None else strategy
    trainer = make_trainer(
        str(tmp_path),
        plugin,
        callbacks=[checkpoint, *(callbacks or [])],
        strategy=strategy,
        devices=1,
        max_epochs=max_epochs,
    )
    try:
        trainer.fit((model or _ParallelBNModel)(width=32), make_loader(n=32), ckpt_path=ckpt_path)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer


class _ParallelBNModel(BNModel):
    def configure_model(self) -> None:
        pass


class _ShardedBNModel(BNModel):
    """Its layers sharded by FSDP2 over the one rank: DTensor parameters, as Lightning's sharded load requires."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def _final_weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    return {key: local_shard(value).detach().clone() for key, value in trainer.lightning_module.state_dict().items()}


@pytest.mark.parametrize("where", ["s3", "file"])
def test_a_run_resumes_from_a_sharded_checkpoint_at_a_url(tmp_path, s3, monkeypatch, where):
    """Lightning's own sharded load makes a ``pathlib.Path`` of the URL (``s3://b`` becomes ``s3:/b``, ``file:///x``
    becomes ``file:/x``) and fails; the plugin loads it with DCP's fsspec reader, with the S3 writer's own settings
    left out of what s3fs gets. A one-epoch run, resumed from its checkpoint at the URL for a second epoch (model,
    AdamW, LR scheduler, loop state), ends with the weights of an uninterrupted two-epoch run."""
    if where == "s3":
        options = {**s3.storage_options, "part_size_bytes": 5 * 1024**2}  # a setting of the S3 writer, not s3fs's
        directory = url = s3.url(f"resume-{time.monotonic_ns()}")
    else:  # saved to a plain path (ModelCheckpoint itself would turn a file:// dirpath into a relative one)
        options, directory = None, str(tmp_path / "ckpt")
        url = f"file://{directory}"

    def fit(name: str, max_epochs: int, ckpt_path: str | None = None) -> L.Trainer:
        checkpoint = ModelCheckpoint(dirpath=f"{directory}/{name}", every_n_train_steps=4)
        plugin = DataStatesIO(storage_options=options)
        return _one_process_fit(
            tmp_path / name, monkeypatch, plugin, checkpoint, None, _ShardedBNModel, max_epochs, ckpt_path
        )

    fit("first", 1)
    resumed = fit("resumed", 2, f"{url}/first/epoch=0-step=4.ckpt")
    assert resumed.global_step == 8
    assert_bit_equal(_final_weights(resumed), _final_weights(fit("uninterrupted", 2)), "after resume")


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("half_way", [False, True], ids=["committed", "switch-stopped-half-way"])
def test_fit_with_ckpt_path_last_resumes_from_the_sharded_last_checkpoint(tmp_path, s3, monkeypatch, where, half_way):
    """``fit(ckpt_path="last")`` finds the sharded ``last.ckpt`` directory the plugin saved and resumes from it: the
    weights of an uninterrupted run. On S3 Lightning alone finds nothing there (it drops the protocol of what it lists,
    Lightning-AI/pytorch-lightning#18261, and a directory has no modification time): the plugin resolves it.
    ``half_way``: the run died in the switch of ``last.ckpt`` (``meta.pt`` and ``.metadata`` gone, the commit record
    there, its marker left): it is still the last checkpoint, finished by the new run's cleanup before it is loaded."""
    if where == "s3":
        options, directory = s3.storage_options, s3.url(f"last-{time.monotonic_ns()}")
    else:
        options, directory = None, str(tmp_path / "ckpt")

    def fit(name: str, max_epochs: int, ckpt_path: str | None = None, into: str = directory) -> L.Trainer:
        checkpoint = ModelCheckpoint(dirpath=into, every_n_train_steps=4, save_last=True)
        plugin = DataStatesIO(storage_options=options)
        return _one_process_fit(
            tmp_path / name, monkeypatch, plugin, checkpoint, None, _ShardedBNModel, max_epochs, ckpt_path
        )

    fit("first", 1)
    if half_way:
        last = f"{directory}/last.ckpt"
        writer = pipeline_of(DataStatesIO(storage_options=options)).writer_for(last)
        metadata, meta = (
            bytes(writer.read_bytes(f"{last}/{name}")) for name in (DCP_METADATA_NAME, LIGHTNING_META_NAME)
        )
        write_commit_record(writer, last, metadata, meta)
        # As a kill during the switch of a first save leaves it (no .metadata yet either): the resolution of "last"
        # lists it so, and on S3 the load's reader shares that listing's cache unless it is dropped.
        writer.remove_files(last, [LIGHTNING_META_NAME, DCP_METADATA_NAME])
        writer.create_marker(f"{last}/.commit.{host_tag()}.{dead_pid()}.deadbeef{PENDING_SUFFIX}")
    resumed = fit("resumed", 2, "last")
    assert resumed.ckpt_path == f"{directory}/last.ckpt"  # not a fresh start, which would end with the same weights
    assert resumed.global_step == 8
    uninterrupted = fit("uninterrupted", 2, into=f"{directory}-uninterrupted")
    assert_bit_equal(_final_weights(resumed), _final_weights(uninterrupted), "after resume")


class _Fsdp1BNModel(BNModel):
    """Its layers wrapped by FSDP1 on the CPU (named as FSDP's device: the strategy passes none on a CPU machine)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"), use_orig_params=True)


def _parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as they are (FSDP1 over one rank with ``use_orig_params``: whole tensors), without FSDP's full
    state dict, which gathers."""
    return {name: param.detach().clone() for name, param in module.named_parameters()}


def test_fsdp_validates_and_tests_from_a_sharded_checkpoint_on_s3(tmp_path, s3, monkeypatch):
    """``FSDPStrategy``'s sharded load outside fit (``validate``/``test`` with ``ckpt_path``) loads the model only;
    from S3 the plugin does that with DCP's fsspec reader. A fresh, differently seeded model validated and then tested
    from the checkpoint of a one-epoch fit holds that fit's final parameters. (Over one rank FSDP shards nothing;
    test_sharded.py's two-rank runs load real shards, while fitting.)"""
    directory = s3.url(f"fsdp-{time.monotonic_ns()}")
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_train_steps=4)
    fsdp = CpuFSDPStrategy(state_dict_type="sharded")
    fitted = _one_process_fit(
        tmp_path / "fit", monkeypatch, DataStatesIO(storage_options=s3.storage_options), checkpoint, fsdp, _Fsdp1BNModel
    )
    expected = _parameters(fitted.lightning_module)
    for run in ("validate", "test"):
        alone_in_a_process_group(monkeypatch)
        torch.manual_seed(1)
        model = _Fsdp1BNModel(width=32)
        model.test_step = model.validation_step  # type: ignore[method-assign]
        trainer = make_trainer(
            str(tmp_path / run),
            DataStatesIO(storage_options=s3.storage_options),
            strategy=CpuFSDPStrategy(state_dict_type="sharded"),
            devices=1,
        )
        try:
            getattr(trainer, run)(model, make_loader(n=16), ckpt_path=f"{directory}/epoch=0-step=4.ckpt")
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        assert_bit_equal(_parameters(model), expected, f"parameters after {run}")


def test_a_url_that_holds_no_sharded_checkpoint_fails_naming_it(tmp_path, s3, monkeypatch):
    """A sharded strategy loads a URL only as a committed sharded directory: anything else fails with the URL in the
    message (Lightning's own error would name the collapsed ``s3:/`` path)."""
    s3.put("single/model.ckpt", b"not a sharded checkpoint")
    for url in (s3.url("single/model.ckpt"), s3.url("nothing-here")):
        checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))
        plugin = DataStatesIO(storage_options=s3.storage_options)
        with pytest.raises(FileNotFoundError, match=f"{url} holds no sharded checkpoint"):
            _one_process_fit(tmp_path, monkeypatch, plugin, checkpoint, None, _ShardedBNModel, 1, url)


def test_a_damaged_meta_pt_at_a_url_fails_the_resume(tmp_path, s3, monkeypatch):
    """``meta.pt`` (the loops', callbacks' and schedulers' state) is verified like every file the plugin loads: a
    flipped byte in it fails the resume with ``CheckpointCorruptError`` naming it, instead of restoring wrong state."""
    from lightning_datastates.errors import CheckpointCorruptError

    directory = f"damaged-meta-{time.monotonic_ns()}"
    checkpoint = ModelCheckpoint(dirpath=s3.url(directory), every_n_train_steps=4)
    plugin = DataStatesIO(storage_options=s3.storage_options)
    _one_process_fit(tmp_path / "a", monkeypatch, plugin, checkpoint, None, _ShardedBNModel, 1)
    key = f"{directory}/epoch=0-step=4.ckpt/{LIGHTNING_META_NAME}"
    meta = bytearray(s3.read(key))
    meta[len(meta) // 3] ^= 0x01  # inside a record: torch.load alone may not notice
    s3.put(key, bytes(meta))
    resume = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointCorruptError, match=LIGHTNING_META_NAME):
        _one_process_fit(
            tmp_path / "b",
            monkeypatch,
            DataStatesIO(storage_options=s3.storage_options),
            resume,
            None,
            _ShardedBNModel,
            1,
            s3.url(f"{directory}/epoch=0-step=4.ckpt"),
        )


def test_sharded_fit_on_s3_commits_each_checkpoint_after_its_files(tmp_path, s3, monkeypatch):
    """One process (ModelParallel on CPU), checkpoints in a moto bucket, read back with DCP's fsspec reader."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    checkpoint = ModelCheckpoint(dirpath=s3.url("run"), every_n_train_steps=1, save_top_k=2, monitor="step", mode="max")
    trainer = _one_process_fit(tmp_path, monkeypatch, DataStatesIO(storage_options=s3.storage_options), checkpoint)
    keys = s3.keys("run/")
    directories = sorted({key.split("/")[1] for key in keys})
    assert directories == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt"]
    for directory in directories:
        names = sorted(key.split("/")[2] for key in keys if key.split("/")[1] == directory)
        assert names[:2] == [DCP_METADATA_NAME, "__0_" + names[1][4:]] and names[-1] == LIGHTNING_META_NAME
    final = s3.url("run/epoch=0-step=4.ckpt")
    state = {k: torch.zeros_like(v) for k, v in trainer.lightning_module.state_dict().items()}
    reader = FsspecReader(final, **s3.storage_options)
    dcp.load({"state_dict": state}, storage_reader=reader, no_dist=True)
    assert_bit_equal(state, trainer.lightning_module.state_dict(), "model after fit")
    meta = torch.load(io.BytesIO(s3.read("run/epoch=0-step=4.ckpt/meta.pt")), weights_only=False)
    assert meta["global_step"] == 4


class _RemoveThenSaveAgain(L.Callback):
    """At step 2 saves ``user.ckpt``; at step 3 saves ``other.ckpt``, removes ``user.ckpt`` while that save is still
    being committed (the committer held in its planning), and saves ``user.ckpt`` again, recording the model then."""

    def __init__(self, directory, hold: threading.Event) -> None:
        self.directory, self.hold = directory, hold
        self.deferred = self.pending = False
        self.state_at_save: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        user = str(self.directory / "user.ckpt")
        if trainer.global_step == 2:
            trainer.save_checkpoint(user)
        elif trainer.global_step == 3:
            self.hold.clear()
            trainer.save_checkpoint(str(self.directory / "other.ckpt"))
            trainer.strategy.remove_checkpoint(user)
            self.deferred = pipeline_of(trainer.strategy.checkpoint_io).engine.pending.is_removal_deferred(user)
            trainer.save_checkpoint(user)
            self.state_at_save = {k: local_shard(v).detach().clone() for k, v in pl_module.state_dict().items()}
            self.pending = pipeline_of(trainer.strategy.checkpoint_io).is_pending(user)  # its commit is held
            self.hold.set()


def test_a_path_removed_while_commits_are_pending_then_saved_again_keeps_the_new_save(tmp_path, monkeypatch):
    """A removal queued behind pending commits must not run once the same path is saved again: Lightning alone ends
    with the new save there; so must the plugin (the new save's files are in the directory before its commit)."""
    import lightning_datastates.sharded.commit as commit_module

    hold = threading.Event()
    hold.set()
    planned = commit_module.plan_checkpoint

    def held(*args, **kwargs):  # the committer thread waits here until the callback has saved user.ckpt again
        assert hold.wait(60)
        return planned(*args, **kwargs)

    monkeypatch.setattr(commit_module, "plan_checkpoint", held)
    callback = _RemoveThenSaveAgain(tmp_path / "ckpt", hold)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "unused"), save_top_k=0)
    _one_process_fit(tmp_path, monkeypatch, DataStatesIO(), checkpoint, callbacks=[callback])
    assert callback.deferred, "the removal should have waited behind the pending save of other.ckpt"
    assert callback.pending  # the pipeline's is_pending knows the directory's commit is still to come
    directory = tmp_path / "ckpt" / "user.ckpt"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["other.ckpt", "user.ckpt"]
    assert torch.load(directory / LIGHTNING_META_NAME, weights_only=False)["global_step"] == 3
    state = {k: torch.zeros_like(v) for k, v in callback.state_at_save.items()}
    dcp.load({"state_dict": state}, checkpoint_id=str(directory), no_dist=True)
    assert_bit_equal(state, callback.state_at_save, "user.ckpt saved again")


def test_no_rank_learns_the_directory_before_rank_0_has_marked_it(tmp_path, monkeypatch):
    """Other ranks write into a save's directory only once they know its path, which rank 0 broadcasts: the marker
    must be on storage by then, or a run that dies could leave their files in a directory the next run's cleanup never
    looks at (it removes only marked ones)."""
    strategy = ModelParallelStrategy()
    listings: dict[str, list[list[str]]] = {}
    broadcast = strategy.broadcast

    def recording_broadcast(obj, src=0):  # type: ignore[no-untyped-def]
        for value in obj if isinstance(obj, tuple) else (obj,):  # the directory, wherever the value carries it
            if isinstance(value, str | os.PathLike) and os.fspath(value).endswith(".ckpt"):
                path = os.fspath(value)
                listings.setdefault(path, []).append(sorted(os.listdir(path)) if os.path.isdir(path) else [])
        return broadcast(obj, src)

    strategy.broadcast = recording_broadcast  # type: ignore[method-assign]
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1, save_last=True)
    _one_process_fit(tmp_path, monkeypatch, DataStatesIO(), checkpoint, strategy)
    assert sorted(os.path.basename(p) for p in listings) == sorted(os.listdir(tmp_path / "ckpt"))
    assert len(listings[str(tmp_path / "ckpt" / "last.ckpt")]) == 4  # saved at every step
    for path, seen in listings.items():
        for names in seen:
            assert [n for n in names if n.endswith(PENDING_SUFFIX)], (path, names)
    for directory in (tmp_path / "ckpt").iterdir():  # settled: every marker removed
        assert not [n for n in os.listdir(directory) if n.endswith(PENDING_SUFFIX)]


class _SaverHost:
    """The plugin's part of a sharded save, as far as a save that fails before it captures anything needs it;
    ``pending`` is the earlier background failure it raises, if any."""

    def __init__(self, pending: BaseException | None = None) -> None:
        self.engine = SimpleNamespace(wait_path=lambda path: None, pending=PendingCheckpoints())
        self.pending = pending

    def writer_for(self, path: str) -> LocalWriter:
        return LocalWriter()

    def raise_pending_failure(self, path: str | None = None) -> None:
        if self.pending is not None:
            raise self.pending

    def clean_once(self, directory: str) -> list[str]:
        return []

    def lazy_for_save(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a save that failed before its capture must not capture anything")


def _refuse_to_mark(writer: LocalWriter, directory: str) -> str:
    raise PermissionError(13, "Permission denied (injected)", directory)


def test_every_archive_of_a_shard_file_carries_the_crcs_of_its_records(tmp_path, monkeypatch):
    """Each tensor item of a rank's file is a zip archive whose every record (``data.pkl``, ``byteorder``, the
    payload, ...) carries its CRC-32, as ``torch.save`` writes them: the metadata records' filled at plan time, the
    payload's by the writer. ``zipfile`` checks them all, for every save of a real fit."""
    import zipfile

    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    _one_process_fit(tmp_path, monkeypatch, DataStatesIO(), checkpoint, model=_ShardedBNModel)
    directories = sorted((tmp_path / "ckpt").iterdir())
    assert len(directories) == 4
    checked = 0
    for directory in directories:
        metadata = pickle.loads((directory / DCP_METADATA_NAME).read_bytes())
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata[index.fqn], dcp.metadata.BytesStorageMetadata):
                continue  # a pickled object's bytes, no archive
            with open(directory / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                archive = zipfile.ZipFile(io.BytesIO(handle.read(info.length)))
            assert archive.testzip() is None, (directory.name, index.fqn)
            assert len(archive.namelist()) >= 4
            checked += 1
    # Per save: 8 parameters, with AdamW's two moments and step each; 3 BatchNorm buffers.
    assert checked == 4 * (8 * 4 + 3)


def test_a_ranks_arena_maps_one_checkpoint_of_shards_ahead(tmp_path, monkeypatch):
    """A rank's shard files are read from storage, never from its arena, so their blocks are freed once written and
    the next checkpoint reuses them: the arena made before the first save maps one checkpoint's pages ahead, not two
    (a whole checkpoint of shards more resident memory per rank for nothing)."""
    import lightning_datastates.snapshot.engine as engine_module

    requests: list[tuple[int, bool]] = []
    prepare_arena = engine_module.prepare_arena

    def recorded(config, request_bytes, keeps_written=True, cuda_device=None):
        requests.append((request_bytes, keeps_written))
        return prepare_arena(config, request_bytes, keeps_written, cuda_device)

    monkeypatch.setattr(engine_module, "prepare_arena", recorded)
    plugin = DataStatesIO()
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    _one_process_fit(tmp_path, monkeypatch, plugin, checkpoint, model=_ShardedBNModel)
    ((request, keeps_written),) = requests
    assert not keeps_written
    assert pipeline_of(plugin).engine.arena.wait_prefaulted(30) == align_up(request)


def test_dcp_plans_each_save_with_automatic_collection_paused(tmp_path, monkeypatch):
    """The committer's planning (thousands of objects made and dropped) runs with automatic garbage collection
    paused, so that it triggers no collection of the training process's heap on its thread; the collector is on again
    after it."""
    import gc

    import lightning_datastates.sharded.commit as commit_module

    seen: list[tuple[str, bool]] = []
    plan_checkpoint = commit_module.plan_checkpoint

    def recorded(*args, **kwargs):
        seen.append((threading.current_thread().name, gc.isenabled()))
        return plan_checkpoint(*args, **kwargs)

    monkeypatch.setattr(commit_module, "plan_checkpoint", recorded)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    _one_process_fit(tmp_path, monkeypatch, DataStatesIO(), checkpoint)
    assert seen == [("datastates-sharded-commit", False)] * 4
    assert gc.isenabled()


def test_a_sharded_fit_leaves_no_thread_of_ours_running(tmp_path, monkeypatch):
    """Once fit returns, the committer thread has ended with its last commit (it lived on, one per fit, before), as
    the engine's threads have: Lightning's own tests fail on threads left behind."""
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    _one_process_fit(tmp_path, monkeypatch, DataStatesIO(), checkpoint)
    deadline = time.monotonic() + 10  # the committer ends right after its last commit, a moment after fit's drain
    while datastates_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert datastates_threads() == []


@pytest.mark.parametrize("failing", ["mark", "meta"])
def test_a_save_rank_0_cannot_start_fails_on_every_rank_and_leaves_nothing(tmp_path, monkeypatch, failing):
    """Rank 0 sends its error instead of the go-ahead: it raises its own, every other rank a capture error naming
    rank 0's (here the broadcast is played by the test: rank 0's half, then another rank's). Nothing is left: no
    directory, no marker, no temporary file, no save handed to a committer."""
    path = str(tmp_path / "ckpt" / "epoch=0-step=1.ckpt")
    meta: dict = {"global_step": 1}
    if failing == "mark":
        monkeypatch.setattr(saver_module, "mark_pending", _refuse_to_mark)
        error, text = PermissionError, "Permission denied"
    else:
        meta["callback"] = lambda: None  # Lightning's meta.pt is pickled: a lambda cannot be
        error, text = AttributeError, "local object"
    sent: list[object] = []
    rank0 = ShardedSaver(_SaverHost(), 0, None, None)
    submitted: list[object] = []
    monkeypatch.setattr(rank0.committer, "submit", submitted.append)
    with pytest.raises(error):
        rank0.save({"w": torch.zeros(4)}, meta, path, lambda value: sent.append(value) or value)
    assert sent == [(path, sent[0][1])] and text in str(sent[0][1])  # the others learn it
    assert not (tmp_path / "ckpt" / "epoch=0-step=1.ckpt").exists() and submitted == []

    other_path = str(tmp_path / "other" / "epoch=0-step=1.ckpt")  # the other rank's own name for it is not used
    rank1 = ShardedSaver(_SaverHost(), 1, None, None)
    monkeypatch.setattr(rank1.committer, "submit", submitted.append)
    with pytest.raises(CheckpointCaptureError, match=rf"rank 0 could not start sharded checkpoint .*{text}"):
        rank1.save({"w": torch.zeros(4)}, {}, other_path, lambda value: sent[0])
    assert not (tmp_path / "other").exists() and temp_files(str(tmp_path)) == [] and submitted == []


def test_an_earlier_failure_raised_at_a_save_fails_that_save_on_every_rank(tmp_path, monkeypatch):
    """A rank that raises an earlier write's failure at a save does so after the broadcast, and hands the save to its
    committer as failed: the other ranks' committers, planning it with DCP, learn it instead of waiting for a plan
    that never comes (real ranks: tests/test_sharded.py), and rank 0's committer removes the marker."""
    path = str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    earlier = CheckpointFlushError("writing checkpoint epoch=0-step=1.ckpt failed (injected)", "epoch=0-step=1.ckpt")
    broadcasts: list[object] = []
    for rank in (0, 1):
        saver = ShardedSaver(_SaverHost(pending=earlier), rank, None, None)
        submitted: list[ShardedSave] = []
        monkeypatch.setattr(saver.committer, "submit", submitted.append)
        with pytest.raises(CheckpointFlushError, match="injected"):
            saver.save({"w": torch.zeros(4)}, {}, path, lambda value: broadcasts.append(value) or value)
        assert [(s.path, s.shard, s.staged.error) for s in submitted] == [(path, None, earlier)]
        assert (submitted[0].marker is not None) is (rank == 0)  # the committer removes it once settled
    assert len(broadcasts) == 2  # every rank took part in the broadcast


def test_shard_files_give_their_arena_blocks_back_once_written(tmp_path, monkeypatch):
    """DCP's reader reads shard files from storage: keeping their blocks to serve loads (``serve_from_memory``, on by
    default) would only hold a second checkpoint's worth of arena pages."""
    plugin = DataStatesIO(eager_copy_size="1KiB")
    assert plugin.config.serve_from_memory
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    _one_process_fit(tmp_path, monkeypatch, plugin, checkpoint)
    engine = pipeline_of(plugin).engine
    assert len(os.listdir(tmp_path / "ckpt")) == 4 and engine.arena is not None and engine.resident is not None
    assert engine.arena.peak_used_bytes > 0  # the shards went through the arena ...
    assert engine.arena.used_bytes == 0 and engine.resident.counters.published == 0  # ... and nothing stayed there


def test_archives_planned_once_serve_later_tensors_of_the_same_signature_only(tmp_path):
    plans = ArchivePlans(None)
    base = torch.arange(100, dtype=torch.float32)
    first = [torch.randn(4, 6), base[10:20], torch.ones(3, dtype=torch.bfloat16)]
    plan_shard_file(first, None, plans)
    assert plans.hits == 0
    # Same dtypes, shapes, strides, offsets and storage sizes, other values: every archive comes from the cache ...
    other = torch.arange(100, 200, dtype=torch.float32)
    second = [torch.randn(4, 6), other[10:20], torch.zeros(3, dtype=torch.bfloat16)]
    # ... but a view at another offset, a transposed view and another dtype are planned anew.
    different = [base[20:30], torch.randn(6, 4).t(), torch.ones(3, dtype=torch.float16)]
    plan = plan_shard_file(second + different, None, plans)
    assert plans.hits == len(second)
    path = tmp_path / "shard.distcp"
    _write(plan, str(path))
    blob = path.read_bytes()
    for item, extent in zip(second + different, plan.extents, strict=True):
        loaded = torch.load(io.BytesIO(blob[extent.offset : extent.offset + extent.length]), weights_only=True)
        assert_bit_equal(loaded, item, "item")
        assert loaded.stride() == item.stride() and loaded.storage_offset() == item.storage_offset()


def test_a_later_save_of_the_same_shards_reuses_their_placement_and_places_new_bytes_after_them(tmp_path):
    """The tensors' placement depends on their signatures only; byte items (pickled objects) may change from save to
    save and come after the tensors."""
    plans = ArchivePlans(None)
    first = plan_shard_file([b"step 1", torch.randn(4, 6), torch.ones(3, dtype=torch.bfloat16)], None, plans)
    items = [b"step 2, longer", torch.randn(4, 6), torch.zeros(3, dtype=torch.bfloat16)]
    second = plan_shard_file(items, None, plans)
    assert (plans.run_hits, plans.hits) == (1, 0)
    assert second.layout.records == first.layout.records and second.extents[1:] == first.extents[1:]
    assert second.extents[0].offset > second.extents[2].offset  # the byte item after the tensors
    path = tmp_path / "shard.distcp"
    _write(second, str(path))
    blob = path.read_bytes()
    assert len(blob) == second.layout.total_bytes
    assert blob[second.extents[0].offset : second.extents[0].offset + second.extents[0].length] == items[0]
    for item, extent in zip(items[1:], second.extents[1:], strict=True):
        loaded = torch.load(io.BytesIO(blob[extent.offset : extent.offset + extent.length]), weights_only=True)
        assert_bit_equal(loaded, item, "item")
    # A tensor of another shape is another run.
    plan_shard_file([torch.randn(5, 6), torch.zeros(3, dtype=torch.bfloat16)], None, plans)
    assert plans.run_hits == 1


def test_items_that_are_one_view_of_one_storage_share_one_archive_and_other_views_do_not(tmp_path):
    """Tied weights (two keys of one parameter) are written once; a view at another offset of the same storage, or a
    tensor of the same signature with other memory, keeps an archive of its own."""
    plans = ArchivePlans(None)
    tied = torch.randn(6, 4)
    base = torch.arange(100, dtype=torch.float32)
    items = [tied, b"bytes", tied.detach(), base[10:20], base[20:30], torch.randn(6, 4), tied]
    plan = plan_shard_file(items, None, plans)
    assert plan.extents[0] == plan.extents[2] == plan.extents[6]  # the same view: one archive
    assert len({plan.extents[i] for i in (0, 3, 4, 5)}) == 4  # other views, other memory: archives of their own
    assert len(plan.storages) == 4 and len(plan.layout.records) == 4  # each storage copied (and written) once
    # The file is the one of the items without their repeats.
    unrepeated = plan_shard_file([tied, b"bytes", base[10:20], base[20:30], items[5]], None, ArchivePlans(None))
    assert (plan.layout.total_bytes, plan.layout.records) == (unrepeated.layout.total_bytes, unrepeated.layout.records)
    path = tmp_path / "shard.distcp"
    _write(plan, str(path))
    blob = path.read_bytes()
    assert len(blob) == plan.layout.total_bytes
    for item, extent in zip(items, plan.extents, strict=True):
        piece = blob[extent.offset : extent.offset + extent.length]
        if isinstance(item, bytes):
            assert piece == item
        else:
            assert_bit_equal(torch.load(io.BytesIO(piece), weights_only=True), item, "item")
    # The tie is part of the cached placement: the same signatures without it are planned as two archives ...
    pair_plans = ArchivePlans(None)
    plan_shard_file([tied, b"bytes", tied], None, pair_plans)
    untied = plan_shard_file([tied, b"bytes", torch.randn(6, 4)], None, pair_plans)
    assert untied.extents[0] != untied.extents[2] and len(untied.storages) == 2
    # ... and a later tie of the same signatures reuses the first placement.
    other = torch.randn(6, 4)
    tied_again = plan_shard_file([other, b"other bytes", other], None, pair_plans)
    assert tied_again.extents[0] == tied_again.extents[2] and pair_plans.run_hits == 1


def test_tied_items_are_read_back_by_dcp_from_one_archive(tmp_path):
    weight = torch.randn(16, 8)
    state = {"model": {"embed": weight, "head": weight, "bias": torch.zeros(8)}}
    directory = tmp_path / "ckpt"
    directory.mkdir()
    staged, shard = stage_shard(state, 0, ArchivePlans(None))
    assert shard is not None and len(shard.storages) == 2
    _write(shard, str(directory / staged.file_name))
    planned = plan_checkpoint(staged, str(directory), None)
    assert planned is not None
    (directory / DCP_METADATA_NAME).write_bytes(planned.metadata_bytes)
    metadata = pickle.loads(planned.metadata_bytes)
    by_key = {index.fqn: info for index, info in metadata.storage_data.items()}
    assert by_key["model.embed"] == by_key["model.head"] != by_key["model.bias"]
    target = {"model": {"embed": torch.empty(16, 8), "head": torch.empty(16, 8), "bias": torch.ones(8)}}
    dcp.load(target, checkpoint_id=str(directory), no_dist=True)
    assert_bit_equal(target, state, "loaded")


@pytest.fixture
def one_rank_mesh():
    """A device mesh of this process alone (gloo), for DTensors outside a Trainer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dcp_local_plan_is_reused_only_while_every_input_of_it_is_the_same(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    def sharded(*shape: int, requires_grad: bool = True) -> torch.nn.Parameter:
        tensor = distribute_tensor(torch.randn(*shape), one_rank_mesh, [Shard(0)])
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)

    weight = sharded(8, 4)

    def state(w: torch.Tensor = weight, **extra: object) -> dict:
        return {"model": {"w": w, "b": torch.zeros(4)}, "optimizer": {"lr": 0.1, **extra}}

    def fresh(checkpoint: dict):  # DCP's own local plan, no cache
        return stage_shard(checkpoint, 0, ArchivePlans(None))[0].plan

    local_plans, plans = LocalPlans(), ArchivePlans(None)
    stage_shard(state(), 0, plans, local_plans)
    reused = stage_shard(state(w=sharded(8, 4)), 0, plans, local_plans)[0].plan  # other values, same structure
    assert local_plans.hits == 1
    assert reused.items == fresh(state()).items and reused.planner_data == fresh(state()).planner_data
    # Each input of DCP's plan, changed: planned anew, and what DCP itself plans.
    changed = [state(w=sharded(6, 4)), state(w=sharded(8, 4, requires_grad=False)), state(momentum=0.9)]
    for checkpoint in changed:
        assert stage_shard(checkpoint, 0, plans, local_plans)[0].plan.items == fresh(checkpoint).items
    stage_shard(state(), 0, plans, local_plans)
    with torch.no_grad():  # DCP's to_local() does not require grad then: another plan
        without_grad = stage_shard(state(), 0, plans, local_plans)[0].plan.items
        assert without_grad == fresh(state()).items != reused.items
    assert local_plans.hits == 1


def test_items_resolve_to_the_tensors_dcp_resolves_and_only_bytes_go_through_dcp(one_rank_mesh, monkeypatch):
    """The staging resolves tensor items itself (DCP's ``to_local()`` per item is most of its cost): the same bytes,
    storage, offset, shape and strides as DCP's own resolution; a DTensor with a partial placement is left to DCP."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import lightning_datastates.sharded.staging as staging

    weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), one_rank_mesh, [Shard(0)]))
    moment = distribute_tensor(torch.randn(8, 4), one_rank_mesh, [Replicate()])
    state = {"model": {"w": weight, "b": torch.arange(6.0)[2:]}, "optim": {"m": moment, "lr": 0.1, "step": 3}}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=True)
    items = planner.create_local_plan().items
    through_dcp = []
    dcp_resolve = planner.resolve_data
    monkeypatch.setattr(planner, "resolve_data", lambda item: through_dcp.append(item.index.fqn) or dcp_resolve(item))
    for item in items:
        ours, theirs = staging._resolve(planner, item), dcp_resolve(item)
        if isinstance(theirs, io.BytesIO):
            assert isinstance(ours, io.BytesIO) and ours.getvalue() == theirs.getvalue()
            continue
        assert (ours.untyped_storage().data_ptr(), ours.storage_offset()) == (
            theirs.untyped_storage().data_ptr(),
            theirs.storage_offset(),
        )
        assert (ours.shape, ours.stride(), ours.dtype) == (theirs.shape, theirs.stride(), theirs.dtype)
        assert_bit_equal(ours.detach(), theirs.detach(), item.index.fqn)
    assert sorted(through_dcp) == ["optim.lr", "optim.step"]  # the byte items only

    # DCP's planning refuses partial placements already; were one resolved, DCP's refusal would still come.
    planner.state_dict["model.w"] = DTensor.from_local(torch.randn(8, 4), one_rank_mesh, [Partial()])
    (item,) = [item for item in items if item.index.fqn == "model.w"]
    with pytest.raises(ValueError, match="partial"):
        staging._resolve(planner, item)


def test_a_dtensors_local_shard_is_what_to_local_gives(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_datastates.compat.torch import local_shard

    weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), one_rank_mesh, [Shard(0)]))
    with torch.no_grad():
        expected = weight.to_local()
    shard = local_shard(weight)
    assert (shard.untyped_storage().data_ptr(), shard.storage_offset(), shard.shape, shard.stride()) == (
        expected.untyped_storage().data_ptr(),
        expected.storage_offset(),
        expected.shape,
        expected.stride(),
    )
    assert not shard.requires_grad and shard.grad_fn is None
    plain = torch.zeros(3)
    assert local_shard(plain) is plain


def _stage_and_plan_replicated(rank: int, world: int, port: int, directory: str) -> None:
    """One rank of the test below: a replicated DTensor, a sharded one and a plain tensor, staged, written the plain
    way and planned with DCP over the default group; rank 0 writes ``.metadata``. Each rank records its items."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)  # every rank the same full tensors: distribute_tensor keeps its part
        full = _replicated_state()
        state = {
            "model": {
                "norm": distribute_tensor(full["model"]["norm"], mesh, [Replicate()]),
                "bias": distribute_tensor(full["model"]["bias"], mesh, [Replicate()]),
                "w": distribute_tensor(full["model"]["w"], mesh, [Shard(0)]),
            },
            "step": full["step"],
        }
        staged, shard = stage_shard(state, rank, ArchivePlans(None))
        assert shard is not None
        _write(shard, os.path.join(directory, staged.file_name))
        planned = plan_checkpoint(staged, directory, dist.group.WORLD)
        if rank == 0:
            assert planned is not None
            with open(os.path.join(directory, DCP_METADATA_NAME), "wb") as handle:
                handle.write(planned.metadata_bytes)
        items = sorted(item.index.fqn for item in staged.plan.items)
        with open(os.path.join(directory, f"items{rank}.json"), "w") as handle:
            json.dump({"file": staged.file_name, "items": items}, handle)
    finally:
        dist.destroy_process_group()


def _replicated_state() -> dict:
    return {
        "model": {"norm": torch.randn(16), "bias": torch.randn(8), "w": torch.randn(8, 4)},
        "step": torch.tensor(3.0),
    }


def test_each_replicated_dtensor_is_written_by_one_rank_and_dcp_reads_it_back(tmp_path):
    """Every rank holds a replicated DTensor's whole local tensor; one of them copies and writes it, the replicated
    tensors dealt between the ranks by size (DCP's coordinator would keep one copy anyway). Two processes, gloo."""
    import json

    import torch.multiprocessing as mp

    directory = tmp_path / "ckpt"
    directory.mkdir()
    mp.spawn(_stage_and_plan_replicated, args=(2, free_port(), str(directory)), nprocs=2, join=True)
    ranks = [json.loads((directory / f"items{rank}.json").read_text()) for rank in range(2)]
    # The larger replica to rank 0, the smaller to rank 1; the shards and the plain tensor on both.
    assert ranks[0]["items"] == ["model.norm", "model.w", "step"]
    assert ranks[1]["items"] == ["model.bias", "model.w", "step"]
    metadata = pickle.loads((directory / DCP_METADATA_NAME).read_bytes())
    files = {index.fqn: info.relative_path for index, info in metadata.storage_data.items() if index.fqn != "model.w"}
    assert files == {"model.norm": ranks[0]["file"], "model.bias": ranks[1]["file"], "step": files["step"]}
    torch.manual_seed(0)
    expected = _replicated_state()
    target = {
        "model": {"norm": torch.zeros(16), "bias": torch.zeros(8), "w": torch.zeros(8, 4)},
        "step": torch.tensor(0.0),
    }
    dcp.load(target, checkpoint_id=str(directory), no_dist=True)
    assert_bit_equal(target, expected, "loaded")


@pytest.mark.parametrize(
    ("coordinate", "shape", "placements", "position"),
    [
        ([0, 3], [2, 4], ["replicate", "shard"], (0, 2)),  # HSDP: replica groups along dimension 0
        ([1, 3], [2, 4], ["replicate", "shard"], (1, 2)),
        ([1, 2], [2, 4], ["shard", "replicate"], (2, 4)),
        ([1, 2, 1], [2, 3, 2], ["replicate", "strided", "replicate"], (3, 4)),  # mixed radix over dimensions 0, 2
        ([1, 0], [2, 2], ["shard", "partial"], (0, 1)),  # nothing replicated: every rank holds its own
        ([2], [4], ["shard"], (0, 1)),
        (None, [2], ["replicate"], None),  # not on the mesh
    ],
)
def test_a_ranks_position_among_the_replicas_of_a_shard_reads_its_replicated_coordinates(
    coordinate, shape, placements, position
):
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_datastates.sharded.staging import replica_position

    kinds = {
        "replicate": Replicate(),
        "shard": Shard(0),
        "partial": Partial(),
        "strided": _StridedShard(0, split_factor=2),
    }
    assert replica_position(coordinate, shape, [kinds[p] for p in placements]) == position


def test_replicated_items_are_dealt_largest_first_to_the_least_loaded_replica():
    from lightning_datastates.sharded.staging import deal_by_size

    items = [(("a", ()), 10), (("b", ()), 40), (("c", ()), 30), (("d", ()), 0), (("e", ()), 20)]
    # b(40) -> 0; c(30) -> 1; e(20) -> 1 (30 < 40); a(10) -> 0 (40 < 50); d(0, counted as 1) -> 0 (50 = 50: lowest)
    assert deal_by_size(items, 2) == [0, 0, 1, 0, 1]
    assert deal_by_size(list(reversed(items)), 2) == list(reversed([0, 0, 1, 0, 1]))  # the order given is no input
    assert deal_by_size(items, 1) == [0] * 5
    assert deal_by_size([], 3) == []
