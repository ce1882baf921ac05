"""Tiered checkpoints (``DataStatesIO(local_tier=...)``) through a real Trainer: real files, the moto server on
loopback for S3.

Every file on both tiers equals the state at its save call, byte for byte; the persistent directory ends as a
single-tier run's (names, top-k, ``last.ckpt``); the local tier keeps the newest ``local_keep``; loads read a good local
copy and pass over a damaged or stale one; what is not supported is refused at setup. Crashes (real SIGKILLs) are in
``tests/test_tiered_crash.py``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_datastates import DataStatesIO
from lightning_datastates.errors import ConfigError
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.records.leftovers import TEMP_SUFFIX, host_tag
from lightning_datastates.records.stamp import SaveStamp
from lightning_datastates.snapshot.engine import SnapshotEngine
from lightning_datastates.storage.base import read_stamp
from lightning_datastates.storage.local import LocalWriter
from lightning_datastates.tiered.layout import REPLICATE_SUFFIX, TARGET_NAME, TierLayout
from tests.conftest import (
    BNModel,
    RecordingDataStatesIO,
    assert_bit_equal,
    dead_pid,
    every_step_checkpoint,
    file_mismatches,
    make_loader,
    make_trainer,
    temp_files,
)
from tests.s3_server import (  # noqa: F401 - the *_fixture imports register the fixtures s3, ...
    require_s3,
    s3_endpoint_fixture,
    s3_fixture,
)
from tests.script_support import datastates_threads

SMALL = {"chunk_size": "64KiB", "eager_copy_size": "1KiB", "writer_threads": 2}


def _local_dir(tier: Path) -> Path:
    """The one directory the local tier holds (one persistent directory per test)."""
    (directory,) = [entry for entry in tier.iterdir() if entry.is_dir()]
    return directory


def _copies(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".ckpt") and not name.startswith("."))


def _markers(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name.endswith(REPLICATE_SUFFIX)]


def _fit(tmp_path: Path, plugin: DataStatesIO, dirpath: str, **checkpoint: Any) -> Any:
    torch.manual_seed(0)
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[every_step_checkpoint(dirpath, **checkpoint)])
    trainer.fit(BNModel(), make_loader())
    return trainer


# ---------------------------------------------------------------------------------------------------- the contract
def test_every_file_on_both_tiers_equals_the_state_at_its_save(tmp_path, slow_copies):
    tier = tmp_path / "local"
    plugin = RecordingDataStatesIO(local_tier=str(tier), local_keep=2, **SMALL)
    _fit(tmp_path, plugin, str(tmp_path / "persist"))
    assert len(plugin.recorded) >= 8
    assert any(s.barrier_wait_s > 0 for s in plugin.stats), "no checkpoint was still copying at a barrier"
    assert file_mismatches(plugin) == []  # the persistent files
    local = _local_dir(tier)
    # The newest two, once replicated, and the last checkpoint beside them.
    assert _copies(local) == ["epoch=1-step=15.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"]
    for name in _copies(local):
        assert (local / name).read_bytes() == (tmp_path / "persist" / name).read_bytes(), name
    assert _markers(local) == [] and temp_files(str(tmp_path)) == []
    for stats in plugin.stats:
        assert stats.persistent_path is not None and stats.persistent_path.startswith(str(tmp_path / "persist"))
        if stats.replication == "committed":
            assert stats.persistent_durable_s >= stats.durable_s and stats.replicated_bytes == stats.total_bytes
    assert [t.name for t in threading.enumerate() if t.name.startswith("datastates-repl")] == []


def test_the_contract_check_catches_a_plugin_that_skips_the_wait(tmp_path, slow_copies, monkeypatch):
    """The check above, against a broken plugin whose barrier returns at once: the files on the persistent tier
    (copies of torn local files) must differ from the state at save."""
    monkeypatch.setattr(SnapshotEngine, "wait_copies", lambda self, attribute=True: 0.0)
    plugin = RecordingDataStatesIO(local_tier=str(tmp_path / "local"), **SMALL)
    _fit(tmp_path, plugin, str(tmp_path / "persist"), save_last=False)
    failures = file_mismatches(plugin)
    assert failures, "a plugin that never waits for its copies produced only correct files: the check is blind"


def test_the_persistent_directory_ends_as_a_single_tier_runs(tmp_path):
    def run(name: str, plugin: DataStatesIO) -> tuple[list[str], list[str]]:
        dirpath = tmp_path / name
        callback = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max")
        torch.manual_seed(0)
        trainer = make_trainer(str(tmp_path / f"{name}-root"), plugin, callbacks=[callback], max_epochs=1)
        trainer.fit(_StepLogging(), make_loader())
        return sorted(os.listdir(dirpath)), sorted(os.path.basename(p) for p in callback.best_k_models)

    single = run("single", DataStatesIO(**SMALL))
    tiered = run("tiered", DataStatesIO(local_tier=str(tmp_path / "local"), local_keep=1, **SMALL))
    assert tiered == single and len(single[0]) == 2
    # A top-k removal removed both copies: the local tier holds the newest one only, no older name.
    assert _copies(_local_dir(tmp_path / "local")) == single[0][-1:]


class _StartStep(Callback):
    """Records the global step training starts from (after a resume: the checkpoint's)."""

    started_at: int | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.started_at = trainer.global_step


def _resume_last(tmp_path: Path, plugin: DataStatesIO, persist: Path) -> int | None:
    """Fit to 3 epochs from ``ckpt_path="last"``; the step it started from."""
    start = _StartStep()
    callbacks = [every_step_checkpoint(str(persist)), start]
    trainer = make_trainer(str(tmp_path), plugin, callbacks=callbacks, max_epochs=3)
    trainer.fit(BNModel(), make_loader(), ckpt_path="last")
    assert trainer.global_step == 24
    return start.started_at


class _StepLogging(BNModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("step", float(self.global_step))
        return super().training_step(batch, batch_idx)


def test_a_replicated_file_is_dated_as_its_local_copy(tmp_path):
    """Both copies carry the time of their save (the persistent one is written later, in the order the local writes
    ended): what goes by modification time sees the saves' order on either tier."""
    tier, persist = tmp_path / "local", tmp_path / "persist"
    _fit(tmp_path, DataStatesIO(local_tier=str(tier), **SMALL), str(persist))
    local = _local_dir(tier)
    copies = _copies(local)
    assert copies
    for name in copies:
        assert os.stat(persist / name).st_mtime_ns == os.stat(local / name).st_mtime_ns, name


@pytest.mark.parametrize("keep", [0, 100])
def test_local_keep_bounds_the_local_copies(tmp_path, keep):
    tier = tmp_path / "local"
    _fit(tmp_path, DataStatesIO(local_tier=str(tier), local_keep=keep, **SMALL), str(tmp_path / "persist"))
    local = _local_dir(tier)
    persistent = sorted(os.listdir(tmp_path / "persist"))
    assert _copies(local) == ([] if keep == 0 else persistent)
    assert sorted(os.listdir(local)) == sorted([TARGET_NAME, *_copies(local)])  # no marker, no note


# ---------------------------------------------------------------------------------------------------- S3
def test_on_s3_both_tiers_hold_the_same_bytes_and_the_summary_says_persistent(s3, tmp_path, capsys):
    require_s3()
    tier = tmp_path / "local"
    plugin = RecordingDataStatesIO(local_tier=str(tier), local_keep=20, storage_options=s3.storage_options, **SMALL)
    _fit(tmp_path, plugin, "s3://bucket/run")
    local = _local_dir(tier)
    names = [key.rsplit("/", 1)[1] for key in s3.keys("run/")]
    assert names == _copies(local) and len(names) >= 8
    for name in names:
        assert s3.read(f"run/{name}") == (local / name).read_bytes(), name
    for path, expected in plugin.recorded.items():
        assert_bit_equal(torch.load(local / path.rsplit("/", 1)[1], weights_only=False), expected, path)
    assert s3.open_uploads() == [] and _markers(local) == []
    assert "s persistent (max" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------- loads
def test_a_damaged_local_copy_is_passed_over_for_the_persistent_one(tmp_path, caplog):
    tier, persist = tmp_path / "local", tmp_path / "persist"
    plugin = DataStatesIO(local_tier=str(tier), **SMALL)
    _fit(tmp_path, plugin, str(persist))
    local_copy = _local_dir(tier) / "last.ckpt"
    expected = torch.load(persist / "last.ckpt", weights_only=False)
    data = bytearray(local_copy.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor record: its CRC-32 no longer matches
    local_copy.write_bytes(bytes(data))
    fresh = DataStatesIO(local_tier=str(tier))
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        loaded = fresh.load_checkpoint(str(persist / "last.ckpt"), weights_only=False)
    assert_bit_equal(loaded, expected)
    assert any("is damaged" in record.getMessage() for record in caplog.records)
    resumed = make_trainer(str(tmp_path / "resumed"), fresh, max_epochs=3, enable_checkpointing=False)
    resumed.fit(BNModel(), make_loader(), ckpt_path=str(persist / "last.ckpt"))
    assert resumed.global_step == 24


@pytest.mark.parametrize("fingerprints", ["given", "none"])
def test_a_persistent_file_written_since_the_replication_is_loaded_not_the_stale_local_copy(
    tmp_path, monkeypatch, fingerprints
):
    """Another node (or a run without the local tier) wrote the persistent path after this node's copy was
    replicated: the local copy is stale, and the load reads the persistent file. Likewise where the persistent
    storage gives no fingerprint (a backend without one, a lookup that failed): it cannot be shown unchanged."""
    tier, persist = tmp_path / "local", tmp_path / "persist"
    if fingerprints == "none":
        monkeypatch.setattr(LocalWriter, "fingerprint", lambda self, path: None)
    _fit(tmp_path, DataStatesIO(local_tier=str(tier), **SMALL), str(persist))
    newer = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 99}
    torch.save(newer, persist / "last.ckpt")  # a plain save elsewhere
    loaded = DataStatesIO(local_tier=str(tier)).load_checkpoint(str(persist / "last.ckpt"), weights_only=False)
    assert loaded["global_step"] == 99


def test_a_good_local_copy_is_read_and_the_persistent_file_is_not(tmp_path, monkeypatch):
    tier, persist = tmp_path / "local", tmp_path / "persist"
    _fit(tmp_path, DataStatesIO(local_tier=str(tier), **SMALL), str(persist))
    expected = torch.load(persist / "last.ckpt", weights_only=False)
    opened: list[str] = []
    open_local = LocalWriter.open_local

    def recording_open_local(self: LocalWriter, path: str, **kwargs: Any) -> Any:
        opened.append(path)
        return open_local(self, path, **kwargs)

    monkeypatch.setattr(LocalWriter, "open_local", recording_open_local)
    fresh = DataStatesIO(local_tier=str(tier))
    assert_bit_equal(fresh.load_checkpoint(str(persist / "last.ckpt"), weights_only=False), expected)
    assert opened == [str(_local_dir(tier) / "last.ckpt")]


def test_a_replicated_local_copy_of_a_deleted_persistent_file_is_not_brought_back(tmp_path, caplog):
    """The persistent directory gone (the user deleted it, or its file system is not mounted on this node any more):
    the local copies were replicated there, so they stand for nothing now. A load fails as without a local tier, and
    says why the local copy was not read; ``ckpt_path="last"`` finds nothing and says so; the run's recovery removes
    the local copies, with a warning."""
    tier, persist = tmp_path / "local", tmp_path / "persist"
    _fit(tmp_path, DataStatesIO(local_tier=str(tier), **SMALL), str(persist))
    local = _local_dir(tier)
    assert (local / "last.ckpt").exists()
    shutil.rmtree(persist)
    fresh = DataStatesIO(local_tier=str(tier))
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"), pytest.raises(FileNotFoundError):
        fresh.load_checkpoint(str(persist / "last.ckpt"), weights_only=False)
    assert any("not reading the local copy" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        assert _resume_last(tmp_path, DataStatesIO(local_tier=str(tier), **SMALL), persist) == 0
    assert any("removing" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)


def test_a_marked_local_copy_older_than_the_persistent_file_is_neither_loaded_nor_replicated(tmp_path, caplog):
    """The job died on this node with a local copy not yet replicated, ran on another node, which wrote the persistent
    file since, and came back: the local copy is older than the persistent file, which stays as it is."""
    tier, persist = tmp_path / "local", tmp_path / "persist"
    _fit(tmp_path, DataStatesIO(local_tier=str(tier), **SMALL), str(persist))
    local = _local_dir(tier)
    marker = local / f".last.ckpt.{host_tag()}.{dead_pid()}.0123abcd.datastates-replicate"
    # As a save marks it: the name, and the stamp of that save (the one the local copy carries).
    stamp = read_stamp(LocalWriter(), str(local / "last.ckpt"))
    assert stamp is not None
    marker.write_text(json.dumps({"name": "last.ckpt", "stamp": [stamp.sequence, stamp.run]}))
    newer = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 99}
    torch.save(newer, persist / "last.ckpt")  # the other node's (plain torch.save: dated by its modification time)
    plugin = DataStatesIO(local_tier=str(tier), **SMALL)
    assert plugin.load_checkpoint(str(persist / "last.ckpt"), weights_only=False)["global_step"] == 99
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        pipeline_of(plugin).clean_stale(str(persist))
    plugin.drain()
    assert torch.load(persist / "last.ckpt", weights_only=False)["global_step"] == 99
    assert _markers(local) == []
    # Said where users see it (issue 39, H: it was an INFO line), and the stale copy is gone.
    assert any("not replicating" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert not (local / "last.ckpt").exists()


def test_new_node_with_an_empty_local_tier_resumes_from_the_persistent_tier(tmp_path):
    persist = tmp_path / "persist"
    _fit(tmp_path, DataStatesIO(local_tier=str(tmp_path / "node-a"), **SMALL), str(persist))
    assert _resume_last(tmp_path, DataStatesIO(local_tier=str(tmp_path / "node-b"), **SMALL), persist) == 16
    assert _copies(_local_dir(tmp_path / "node-b")) == ["epoch=2-step=23.ckpt", "epoch=2-step=24.ckpt", "last.ckpt"]


def test_last_takes_a_local_copy_the_persistent_tier_lacks(tmp_path):
    """A last checkpoint durable locally whose replication never finished (the persistent file removed here, its
    local copy marked as not replicated, as a killed run leaves it): ``ckpt_path="last"`` resumes from it, and the
    run's recovery replicates it."""
    tier, persist = tmp_path / "local", tmp_path / "persist"
    _fit(tmp_path, DataStatesIO(local_tier=str(tier), **SMALL), str(persist))
    local = _local_dir(tier)
    (persist / "last.ckpt").unlink()
    marker = local / f".last.ckpt.{host_tag()}.{dead_pid()}.0123abcd.datastates-replicate"  # its writer is gone
    marker.touch()  # an empty marker, as older releases made: no name inside, nothing known of the persistent file
    # The recovery a run does at its first use of the directory replicates it.
    recovering = DataStatesIO(local_tier=str(tier), **SMALL)
    pipeline_of(recovering).clean_stale(str(persist))
    recovering.drain()
    assert (persist / "last.ckpt").read_bytes() == (local / "last.ckpt").read_bytes()
    assert _markers(local) == []
    # Killed again before the copy: "last" still finds it on the local tier.
    (persist / "last.ckpt").unlink()
    marker.touch()
    assert _resume_last(tmp_path, DataStatesIO(local_tier=str(tier), **SMALL), persist) == 16


def test_recovery_removes_the_temporary_files_of_a_dead_runs_local_writes(tmp_path):
    """A run killed while a local write was in flight leaves its temporary file on the local tier: the next run's
    recovery removes it, and keeps the one a live writer (this process) may still be writing."""
    tier, persist = tmp_path / "local", tmp_path / "persist"
    _fit(tmp_path, DataStatesIO(local_tier=str(tier), **SMALL), str(persist))
    local = _local_dir(tier)
    copies = _copies(local)
    dead = local / f".last.ckpt.{host_tag()}.{dead_pid()}.0123abcd{TEMP_SUFFIX}"
    live = local / f".last.ckpt.{host_tag()}.{os.getpid()}.4567cdef{TEMP_SUFFIX}"
    for leftover in (dead, live):
        leftover.write_bytes(b"torn")
    recovering = DataStatesIO(local_tier=str(tier), **SMALL)
    pipeline_of(recovering).clean_stale(str(persist))
    recovering.drain()
    assert not dead.exists()
    assert live.exists()
    assert _copies(local) == copies


# ---------------------------------------------------------------------------------------------------- around fit
def test_a_save_outside_fit_returns_with_the_persistent_copy_committed(tmp_path):
    before = set(threading.enumerate())
    plugin = DataStatesIO(local_tier=str(tmp_path / "local"), **SMALL)
    trainer = _fit(tmp_path, plugin, str(tmp_path / "persist"))
    path = tmp_path / "persist" / "after.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["global_step"] == 16
    assert datastates_threads(since=before) == []


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"local_tier": "s3://bucket/tier"}, "not a local directory"),
        ({"local_tier": 3}, "local_tier must be"),
        ({"local_tier": "/tmp/x", "local_keep": -1}, "local_keep must be an int >= 0"),
        ({"local_tier": "/tmp/x", "local_keep": True}, "local_keep must be an int >= 0"),
    ],
)
def test_bad_settings_are_refused_naming_the_fix(settings, match):
    with pytest.raises(ConfigError, match=match):
        DataStatesIO(**settings)


def test_a_checkpoint_directory_inside_the_local_tier_is_refused_at_setup(tmp_path):
    (tmp_path / "tier").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "tier")  # the same directory under another name
    plugin = DataStatesIO(local_tier=str(tmp_path / "link"), **SMALL)
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[every_step_checkpoint(str(tmp_path / "tier" / "c"))])
    with pytest.raises(ConfigError, match="lies inside local_tier"):
        trainer.fit(BNModel(), make_loader())
    assert trainer.global_step == 0 and not (tmp_path / "tier" / "c").exists()


def test_a_local_tier_that_cannot_be_written_is_refused_at_setup(tmp_path):
    (tmp_path / "afile").write_text("")
    plugin = DataStatesIO(local_tier=str(tmp_path / "afile" / "tier"), **SMALL)
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[every_step_checkpoint(str(tmp_path / "c"))])
    with pytest.raises(ConfigError, match="local_tier=.* cannot be written"):
        trainer.fit(BNModel(), make_loader())
    assert trainer.global_step == 0


def test_save_last_link_works_as_without_a_local_tier(tmp_path):
    def run(name: str, plugin: DataStatesIO) -> list[str]:
        torch.manual_seed(0)
        callback = every_step_checkpoint(str(tmp_path / name), save_last="link")
        make_trainer(str(tmp_path / f"{name}-root"), plugin, callbacks=[callback], max_epochs=1).fit(
            BNModel(), make_loader()
        )
        return sorted(os.listdir(tmp_path / name))

    assert run("tiered", DataStatesIO(local_tier=str(tmp_path / "local"), **SMALL)) == run("single", DataStatesIO())
    assert os.path.islink(tmp_path / "tiered" / "last.ckpt")
    loaded = DataStatesIO(local_tier=str(tmp_path / "local")).load_checkpoint(str(tmp_path / "tiered" / "last.ckpt"))
    assert loaded["global_step"] == 8


def test_several_nodes_are_refused_at_setup(tmp_path):
    plugin = DataStatesIO(local_tier=str(tmp_path / "local"))

    class TwoNodes:
        num_nodes = 2

    with pytest.raises(ConfigError, match="local_tier supports single-file checkpoints on one node"):
        pipeline_of(plugin).check_tiered(TwoNodes())


def test_a_sharded_strategy_is_refused_at_setup(tmp_path, monkeypatch):
    from tests.test_sharded_parts import _one_process_fit

    plugin = DataStatesIO(local_tier=str(tmp_path / "local"))
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1)
    with pytest.raises(ConfigError, match="sharded strategy's checkpoints"):
        _one_process_fit(tmp_path, monkeypatch, plugin, checkpoint)
    assert not (tmp_path / "ckpt").exists()


def test_a_save_outside_fit_whose_local_write_fails_raises(tmp_path, monkeypatch):
    from lightning_datastates import CheckpointFlushError
    from lightning_datastates.storage.local import LocalWriteSession

    complete = LocalWriteSession.complete

    def failing_complete(self: LocalWriteSession) -> None:
        if not self.path.endswith("a.ckpt"):
            return complete(self)  # the local directory's target file
        raise OSError(28, "No space left on device")

    plugin = DataStatesIO(local_tier=str(tmp_path / "local"), **SMALL)
    monkeypatch.setattr(LocalWriteSession, "complete", failing_complete)
    with pytest.raises(CheckpointFlushError, match=r"No space left.*\(local_keep=2\), or set local_tier"):
        plugin.save_checkpoint({"state_dict": {"w": torch.ones(4)}}, str(tmp_path / "persist" / "a.ckpt"))
    assert not (tmp_path / "persist" / "a.ckpt").exists()


_FULL_LOCAL_TIER_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    import lightning as L
    import torch
    from lightning_datastates import CheckpointFlushError
    from tests.conftest import RecordingDataStatesIO, BNModel, assert_bit_equal, every_step_checkpoint
    from tests.conftest import make_loader, make_trainer, temp_files

    LIMIT = 4 * 2**20
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))

    class BigAtStep3(L.Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            if trainer.global_step == 3:  # this checkpoint does not fit on the local tier
                checkpoint["blob"] = torch.ones(LIMIT // 2)

    persist, local = sys.argv[1], sys.argv[2]
    plugin = RecordingDataStatesIO(local_tier=local, chunk_size="64KiB", writer_threads=2)
    checkpoint = every_step_checkpoint(persist, save_last=False)
    trainer = make_trainer(persist, plugin, callbacks=[checkpoint, BigAtStep3()], max_epochs=-1, max_steps=6)
    error = None
    try:
        trainer.fit(BNModel(), make_loader())
    except CheckpointFlushError as exc:
        error = {"message": str(exc), "path": exc.path, "errno": getattr(exc.__cause__, "errno", None)}
    files = sorted(n for n in os.listdir(persist) if n.endswith(".ckpt"))
    for name in files:  # every persistent file is whole and equals the state of its step
        path = os.path.join(persist, name)
        assert_bit_equal(torch.load(path, weights_only=True), plugin.recorded[path], name)
    local_dirs = [os.path.join(local, d) for d in os.listdir(local)]
    print(json.dumps({"error": error, "files": files, "temp_files": temp_files(persist) + temp_files(*local_dirs)}))
    """
)


def test_a_full_local_tier_is_an_error_naming_local_tier_and_local_keep(tmp_path):
    """RLIMIT_FSIZE in a subprocess: the local write of step 3 fails with EFBIG, as on a full local disk. Training
    stops with an error that names the local tier and the settings that make room; earlier checkpoints are whole
    on the persistent tier, step 3 is on neither, and no temporary file is left."""
    from tests.test_faults import run_script

    persist, local = tmp_path / "persist", tmp_path / "local"
    outcome = run_script(_FULL_LOCAL_TIER_SCRIPT, str(persist), str(local))
    error = outcome["error"]
    assert error is not None and error["errno"] == 27 and error["path"] == str(persist / "epoch=0-step=3.ckpt")
    assert f"writing the local copy of {persist / 'epoch=0-step=3.ckpt'}" in error["message"]
    assert f"local_tier={str(local)!r}" in error["message"] and "local_keep=2" in error["message"]
    # The failure is raised at the first hook after the write failed: step 4 may have been saved meanwhile.
    assert outcome["files"][:2] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    assert "epoch=0-step=3.ckpt" not in outcome["files"]
    assert outcome["temp_files"] == []


def test_the_drain_bar_counts_both_copies():
    from lightning_datastates.progress import _done_bytes, _unfinished
    from lightning_datastates.records.job import SnapshotStats

    local_only = SnapshotStats("l", 100, 90, 0.0, durable_s=1.0, state="committed", replication="pending")
    local_only.replicated_bytes = 40
    single = SnapshotStats("s", 100, 90, 0.0, written_bytes=30)
    assert _unfinished([local_only, single]) == [local_only, single]
    assert _done_bytes([local_only, single]) == 100 + 40 + 30
    local_only.replication, local_only.persistent_durable_s = "committed", 2.0
    assert _unfinished([local_only]) == [] and _done_bytes([local_only]) == 200


def test_a_long_checkpoint_name_saves_with_a_local_tier_as_without(tmp_path):
    """The marker's own name is shortened to fit the file system's limit; the name is kept whole inside it (a
    recovery must find the copy it marks)."""
    name = "x" * 231 + ".ckpt"
    plugin = DataStatesIO(local_tier=str(tmp_path / "local"), **SMALL)
    plugin.save_checkpoint({"state_dict": {"w": torch.ones(4)}}, str(tmp_path / "persist" / name))
    assert os.listdir(tmp_path / "persist") == [name]
    local = _local_dir(tmp_path / "local")
    marker = TierLayout.mark(str(local / name), SaveStamp(1, "0" * 16))
    assert TierLayout.markers(str(local)) == {name: [(marker, TierLayout.markers(str(local))[name][0][1])]}
