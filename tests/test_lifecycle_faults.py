"""The faults issue 39 found where two mechanisms of the checkpoint lifecycle meet, one test each (A-H and the three
suspected ones), each through the public surface: ``DataStatesIO``, a real ``Trainer``'s resolution of
``ckpt_path="last"``, real files, a real SIGKILL (``tests/lifecycle_kill.py``) where the fault needs a dead run.
Each failed on the code before the lifecycle's rework (``docs/design.md``, "The checkpoint lifecycle"); the
invariants they defend are checked over random sequences by ``tests/test_lifecycle.py``.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn

from lightning_datastates import CheckpointFlushError, DataStatesIO
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.storage.local import LocalWriter, LocalWriteSession
from lightning_datastates.tiered.layout import REPLICATE_SUFFIX, TierLayout
from tests.conftest import BackgroundOwner, BNModel, every_step_checkpoint, in_background, make_loader, make_trainer
from tests.lifecycle_kill import state
from tests.s3_server import require_s3, s3_endpoint_fixture, s3_fixture  # noqa: F401 - fixtures
from tests.script_support import launch, output_of

#: Hang guard for a killed run (it takes a few seconds), not a performance threshold.
_RUN_TIMEOUT_S = 120


def _kill_run(scenario: str, persistent: Any, tier: Any) -> None:
    """Run ``tests/lifecycle_kill.py SCENARIO`` and check that it died of its own SIGKILL."""
    process = launch("lifecycle_kill.py", scenario, str(persistent), str(tier))
    output = output_of(process, _RUN_TIMEOUT_S, scenario)
    assert process.returncode == -signal.SIGKILL and "killing: " in output, output[-3000:]


def _step(path: Any) -> int:
    return int(torch.load(path, weights_only=False)["global_step"])


def _resolve_last(directory: str, plugin: DataStatesIO, **checkpoint: Any) -> Any:
    """What ``fit(ckpt_path="last")`` of a Trainer with ``plugin`` and a ``ModelCheckpoint`` on ``directory`` would
    resume from (Lightning's own entry point, which the plugin wraps)."""
    callback = ModelCheckpoint(dirpath=directory, **{"save_last": True, **checkpoint})
    trainer = L.Trainer(
        plugins=[plugin], callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    connector = trainer._checkpoint_connector
    return connector._parse_ckpt_path(TrainerFn.FITTING, "last", model_provided=True, model_connected=True)


class _SlowWriter(LocalWriter):
    """Local writes that take ``delay_s`` per range (slow storage), and fail with ENOSPC for paths containing
    ``fail`` (a fake at one precise point: a full disk for that checkpoint)."""

    def __init__(self, delay_s: float = 0.02, fail: str | None = None) -> None:
        super().__init__(direct_io=False)
        self.delay_s, self.fail = delay_s, fail

    def begin(self, path: str, total_bytes: int) -> LocalWriteSession:
        session = super().begin(path, total_bytes)
        writer = self

        class _Session(LocalWriteSession):
            fast_writes = False  # through the arena: written later than the save call

            def write_range(self, offset: int, data: memoryview) -> None:
                time.sleep(writer.delay_s)
                if writer.fail is not None and writer.fail in self.path:
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
                super().write_range(offset, data)

        return _Session(session.path, session.temp_path, session._fd)  # type: ignore[arg-type]


def _slow_storage(monkeypatch: pytest.MonkeyPatch, writer: LocalWriter) -> None:
    monkeypatch.setattr("lightning_datastates.pipeline.writer_for", lambda path, storage_options=None, **_: writer)


# ---------------------------------------------------------------------------------------------- A: tiered
def test_a_save_made_while_the_same_name_replicates_stays_the_newest_after_a_kill(tmp_path):
    """A: ``last.ckpt`` of step 2 was saved while step 1's copy of the same name was replicating, and the run died
    once step 1's copy was committed, before step 2's began. Step 2 is the newest checkpoint (durable locally): the
    next run replicates it, and a load returns it (before the rework, the record of step 1's replication made step 2
    look older than the persistent file: it was dropped, and step 1 loaded)."""
    persistent, tier = tmp_path / "persist", tmp_path / "tier"
    _kill_run("overtaken", persistent, tier)
    assert _step(persistent / "last.ckpt") == 1
    assert _step(TierLayout(str(tier)).local_path(str(persistent / "last.ckpt"))) == 2
    plugin = DataStatesIO(local_tier=str(tier))
    assert plugin.load_checkpoint(str(persistent / "last.ckpt"), weights_only=False)["global_step"] == 2
    pipeline_of(plugin).clean_stale(str(persistent))  # the next run's recovery
    plugin.drain()
    assert _step(persistent / "last.ckpt") == 2


# ---------------------------------------------------------------------------------------------- B
@pytest.mark.parametrize("tiered", [False, True], ids=["single-tier", "tiered"])
def test_a_top_k_removal_never_cancels_the_write_of_the_checkpoint_it_may_still_need(
    tmp_path, monkeypatch, caplog, tiered
):
    """B: ``ModelCheckpoint`` saves the new best and removes the old one while the old one's write is still pending;
    the new save then fails (a full disk). The old checkpoint is kept, whole, on the persistent path, and the warning
    saying so is true (before the rework the removal cancelled the old write at once: no checkpoint at all)."""
    persistent = tmp_path / "persist"
    _slow_storage(monkeypatch, _SlowWriter(fail="epoch=1.ckpt"))
    options = {"local_tier": str(tmp_path / "tier")} if tiered else {}
    plugin = in_background(DataStatesIO(chunk_size="64KiB", **options))
    old, new = str(persistent / "epoch=0.ckpt"), str(persistent / "epoch=1.ckpt")
    plugin.save_checkpoint(state(0), old)
    plugin.save_checkpoint(state(1), new)
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        plugin.remove_checkpoint(old)
        plugin.drain()
    with pytest.raises(CheckpointFlushError):
        pipeline_of(plugin).raise_pending_failure()
    assert sorted(os.listdir(persistent)) == ["epoch=0.ckpt"]
    assert _step(persistent / "epoch=0.ckpt") == 0
    assert any(f"keeping {old}" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------- D: tiered
def test_replicated_copies_are_unmarked_and_pruned_even_when_writing_on_the_local_tier_fails(tmp_path, monkeypatch):
    """D: after a copy is committed on the persistent tier, nothing more is written on the local tier before its
    marker goes and the retention runs (before the rework a replica note was written first; on a full local tier it
    failed and neither followed, so every copy stayed, marked, and the tier filled for good)."""

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr("lightning_datastates.tiered.tiers.write_file", full_disk, raising=False)
    tier, persistent = tmp_path / "tier", tmp_path / "persist"
    plugin = in_background(DataStatesIO(local_tier=str(tier), local_keep=1))
    for step in range(4):
        plugin.save_checkpoint(state(step), str(persistent / f"epoch=0-step={step}.ckpt"))
        plugin.drain()
    local = os.path.dirname(TierLayout(str(tier)).local_path(str(persistent / "x.ckpt")))
    assert [n for n in os.listdir(local) if n.endswith(REPLICATE_SUFFIX)] == []
    assert sorted(n for n in os.listdir(local) if n.endswith(".ckpt")) == ["epoch=0-step=3.ckpt"]


# ---------------------------------------------------------------------------------------------- E: tiered
def test_a_newer_local_last_checkpoint_wins_over_the_file_an_older_last_link_names(tmp_path):
    """E: run 1 (``save_last="link"``) left ``last.ckpt`` a link to step 4; run 2 saved a real ``last.ckpt`` of
    step 5, committed locally, and died as its copy began. A load of ``last.ckpt`` returns step 5 (before the rework
    the link was followed first, and step 4 loaded)."""
    persistent, tier = tmp_path / "persist", tmp_path / "tier"
    callbacks = [every_step_checkpoint(str(persistent), save_last="link")]
    make_trainer(str(tmp_path), DataStatesIO(local_tier=str(tier)), callbacks=callbacks, max_steps=4).fit(
        BNModel(), make_loader()
    )
    assert os.readlink(persistent / "last.ckpt") == "epoch=0-step=4.ckpt"
    _kill_run("over-a-link", persistent, tier)
    assert os.path.islink(persistent / "last.ckpt")
    loaded = DataStatesIO(local_tier=str(tier)).load_checkpoint(str(persistent / "last.ckpt"), weights_only=False)
    assert loaded["global_step"] == 5


# ---------------------------------------------------------------------------------------------- F
def test_last_resumes_from_the_newest_top_k_copy_when_no_last_checkpoint_was_saved(tmp_path):
    """F (tiered): a run died with ``epoch=0-step=2/4/6.ckpt`` committed locally, none replicated, and no
    ``last.ckpt`` anywhere. ``ckpt_path="last"`` resumes from step 6 (before the rework: from scratch)."""
    persistent, tier = tmp_path / "persist", tmp_path / "tier"
    _kill_run("top-k-only", persistent, tier)
    assert not os.path.exists(persistent / "last.ckpt")
    found = _resolve_last(str(persistent), DataStatesIO(local_tier=str(tier)), save_top_k=2, monitor="step")
    assert found == str(persistent / "epoch=0-step=6.ckpt")


def test_a_name_saved_again_faster_than_storage_takes_it_lands_at_least_every_second_save(tmp_path, monkeypatch):
    """F, invariant 5: ``last.ckpt`` saved 8 times, each save before the previous one was written (slow storage).
    Saves of one name are coalesced (a pending one cancelled by the next), but never two in a row: at least every
    second one lands, and the last one does (before the rework each save cancelled the one before: only the last
    landed, and ``last.ckpt`` lagged behind every top-k file)."""
    _slow_storage(monkeypatch, _SlowWriter(delay_s=0.05))
    plugin = in_background(DataStatesIO(chunk_size="64KiB"))
    path = str(tmp_path / "last.ckpt")
    for step in range(8):
        plugin.save_checkpoint(state(step), path)
    plugin.drain()
    states = [s.state for s in plugin.stats]
    assert states[-1] == "committed" and _step(path) == 7
    assert "cancelled" in states, states  # storage was slower than the saves: some were coalesced
    assert ("cancelled", "cancelled") not in set(itertools.pairwise(states)), states


# ---------------------------------------------------------------------------------------------- G: single tier
def test_last_takes_a_top_k_file_newer_than_the_last_checkpoint(tmp_path):
    """G: ``last.ckpt`` holds step 8, and ``epoch=0-step=9.ckpt`` was saved after it (the run died before the
    ``last.ckpt`` of step 9). ``ckpt_path="last"`` resumes from step 9 (before the rework: from step 8)."""
    plugin = DataStatesIO()
    plugin.save_checkpoint(state(8), str(tmp_path / "epoch=0-step=8.ckpt"))
    plugin.save_checkpoint(state(8), str(tmp_path / "last.ckpt"))
    plugin.save_checkpoint(state(9), str(tmp_path / "epoch=0-step=9.ckpt"))
    with pytest.warns(UserWarning, match="saved after the last checkpoint"):
        assert _resolve_last(str(tmp_path), DataStatesIO()) == str(tmp_path / "epoch=0-step=9.ckpt")


def test_last_on_s3_takes_the_only_whole_checkpoint_when_no_last_checkpoint_exists(s3):
    """G (S3): only ``epoch=0-step=1.ckpt`` is whole; ``ckpt_path="last"`` resumes from it (before the rework: from
    scratch)."""
    require_s3()
    url = s3.url("run/epoch=0-step=1.ckpt")
    DataStatesIO(storage_options=s3.storage_options).save_checkpoint(state(1), url)
    assert _resolve_last(s3.url("run"), DataStatesIO(storage_options=s3.storage_options)) == url


def test_the_checkpoint_directory_is_never_empty_while_top_k_one_saves_fail(tmp_path, monkeypatch):
    """G: ``save_top_k=1`` saving every step, a full disk for step 6: the removal of step 4 waits for step 5, and
    step 5's removal (asked for once step 6 was saved) waits for step 6, which fails: step 5 stays. A listing taken
    all along never finds the directory without a whole checkpoint once step 4 was (before the rework removing step 5
    cancelled its write, which let step 4's removal run before step 6 was durable: an empty directory)."""
    _slow_storage(monkeypatch, _SlowWriter(delay_s=0.01, fail="step=6"))
    plugin = in_background(DataStatesIO(chunk_size="64KiB", on_flush_error="warn"))
    paths = [str(tmp_path / f"epoch=0-step={step}.ckpt") for step in range(7)]
    plugin.save_checkpoint(state(4), paths[4])
    plugin.drain()
    empty: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if not [n for n in os.listdir(tmp_path) if n.endswith(".ckpt")]:
                empty.append(time.monotonic())
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        plugin.save_checkpoint(state(5), paths[5])
        plugin.remove_checkpoint(paths[4])
        plugin.save_checkpoint(state(6), paths[6])
        plugin.remove_checkpoint(paths[5])
        plugin.drain()
    finally:
        stop.set()
        watcher.join()
    assert empty == [], "the directory held no checkpoint for a while"
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".ckpt")) == ["epoch=0-step=5.ckpt"]
    assert _step(paths[5]) == 5


# ---------------------------------------------------------------------------------------------- H: reporting
def test_a_load_from_the_local_tier_says_so(tmp_path, caplog):
    """H: Lightning says "Restored ... from <persistent path>"; the plugin says which copy that was."""
    persistent, tier = tmp_path / "persist", tmp_path / "tier"
    DataStatesIO(local_tier=str(tier)).save_checkpoint(state(3), str(persistent / "last.ckpt"))
    with caplog.at_level(logging.INFO):
        DataStatesIO(local_tier=str(tier)).load_checkpoint(str(persistent / "last.ckpt"), weights_only=False)
    assert any("was read from its local copy" in r.getMessage() for r in caplog.records)


def test_a_run_on_another_local_tier_names_the_copies_the_old_tier_never_replicated(tmp_path, monkeypatch, caplog):
    """H: a run died with copies on local tier A not yet replicated; the next run uses local tier B. It says that A
    holds them and what to do (before the rework they were orphaned silently)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    persistent = tmp_path / "persist"
    _kill_run("top-k-only", persistent, tmp_path / "tier-a")
    plugin = DataStatesIO(local_tier=str(tmp_path / "tier-b"))
    pipeline = pipeline_of(plugin)
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[every_step_checkpoint(str(persistent))])
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        pipeline.check_tiered(trainer)
        pipeline.clean_stale(str(persistent))
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(tmp_path / "tier-a") in m and "never copied" in m for m in messages), messages


# ---------------------------------------------------------------------------------------------- suspected
def test_a_removal_through_async_checkpoint_io_waits_for_the_save_queued_before_it(tmp_path, monkeypatch):
    """``AsyncCheckpointIO(DataStatesIO())`` hands saves to its own thread and removals on at once: a top-k removal
    must still wait for the save queued before it. Here that save fails (full disk): the removed checkpoint stays
    (before the rework it was removed before the new save even reached the plugin: no checkpoint at all)."""
    _slow_storage(monkeypatch, _SlowWriter(delay_s=0.0, fail="step=1"))  # the second save: named by the logged step
    real_save = DataStatesIO.save_checkpoint

    def late_save(self: DataStatesIO, checkpoint: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if "step=1" in str(path):
            time.sleep(0.3)  # the wrapper's thread reaches the plugin after the removal of step 0 is asked for
        real_save(self, checkpoint, path, *args, **kwargs)

    monkeypatch.setattr(DataStatesIO, "save_checkpoint", late_save)
    directory = tmp_path / "ckpt"
    callback = ModelCheckpoint(dirpath=str(directory), every_n_train_steps=1, save_top_k=1, monitor="step", mode="max")
    trainer = make_trainer(str(tmp_path), AsyncCheckpointIO(DataStatesIO()), callbacks=[callback], max_steps=2)
    with pytest.raises(CheckpointFlushError):
        trainer.fit(_StepLogging(), make_loader())
    assert sorted(os.listdir(directory)) == ["epoch=0-step=0.ckpt"]


class _StepLogging(BNModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("step", float(self.global_step))
        return super().training_step(batch, batch_idx)


def test_a_removal_held_back_at_a_kill_is_carried_out_by_the_next_run_not_replicated_back(tmp_path):
    """A run died with step 1 removed by ``ModelCheckpoint`` but kept until step 2 was persistent (it was durable
    locally only). The next run replicates step 2 and drops step 1 from both tiers (before the rework step 1 was
    replicated back: a file beyond ``save_top_k``)."""
    persistent, tier = tmp_path / "persist", tmp_path / "tier"
    _kill_run("removal-held", persistent, tier)
    plugin = DataStatesIO(local_tier=str(tier))
    pipeline_of(plugin).clean_stale(str(persistent))
    plugin.drain()
    assert sorted(os.listdir(persistent)) == ["epoch=0-step=2.ckpt"]
    local = TierLayout(str(tier)).local_path(str(persistent / "epoch=0-step=1.ckpt"))
    assert not os.path.exists(local)


def test_copies_given_up_by_an_abandon_are_replicated_at_the_next_fit_of_the_same_process(tmp_path, monkeypatch):
    """A second Ctrl-C abandons the copies in flight (their local copies stay marked); a later fit in the same
    process replicates them (before the rework only another process's recovery did)."""
    from lightning_datastates.tiered.replicator import Replicator

    persistent, tier = tmp_path / "persist", tmp_path / "tier"
    release = threading.Event()
    original = Replicator._copy

    def held(self: Replicator, item: Any) -> Any:
        release.wait(30)
        return original(self, item)

    monkeypatch.setattr(Replicator, "_copy", held)
    plugin = DataStatesIO(local_tier=str(tier))
    pipeline, owner = pipeline_of(plugin), BackgroundOwner()
    pipeline.attach(owner)  # a fit begins
    pipeline.clean_once(str(persistent))
    plugin.save_checkpoint(state(1), str(persistent / "epoch=0-step=1.ckpt"))
    while not plugin.stats[-1].durable_s:
        time.sleep(0.005)
    pipeline.engine.abandon(wait_s=0.1)
    release.set()
    plugin.teardown()  # the end of that fit: the copy given up has ended
    assert not os.path.exists(persistent / "epoch=0-step=1.ckpt")
    pipeline.detach(owner)
    pipeline.attach(owner)  # the next fit of this process
    pipeline.clean_once(str(persistent))  # its cleanup
    plugin.drain()
    assert _step(persistent / "epoch=0-step=1.ckpt") == 1


# ---------------------------------------------------------------------------------------------- found by review
def test_a_save_that_fails_in_its_call_through_async_checkpoint_io_keeps_the_checkpoint_it_was_to_replace(
    tmp_path, monkeypatch
):
    """``AsyncCheckpointIO`` keeps the error of a save that failed in the plugin's call (here: the file cannot be
    created, a full disk) on its own thread, and ``ModelCheckpoint`` goes on to remove the previous best: that removal
    keeps the file, as after a skipped save (before the fix the directory was left empty)."""

    class FullAfterTheFirst(LocalWriter):
        def begin(self, path: str, total_bytes: int) -> LocalWriteSession:
            if "step=0" not in path:
                raise OSError(errno.ENOSPC, "No space left on device (injected at begin)")
            return super().begin(path, total_bytes)

    _slow_storage(monkeypatch, FullAfterTheFirst(direct_io=False))
    directory = tmp_path / "ckpt"
    callback = ModelCheckpoint(dirpath=str(directory), every_n_train_steps=1, save_top_k=1, monitor="step", mode="max")
    trainer = make_trainer(str(tmp_path), AsyncCheckpointIO(DataStatesIO()), callbacks=[callback], max_steps=3)
    with pytest.raises(CheckpointFlushError):
        trainer.fit(_StepLogging(), make_loader())
    assert sorted(os.listdir(directory)) == ["epoch=0-step=0.ckpt"]


def test_a_torn_marker_of_a_long_name_still_marks_its_copy(tmp_path):
    """The marker of a checkpoint with a long name has a shortened name of its own and keeps the whole name inside;
    a crash can leave it empty. Its copy is still replicated by the next run (before the fix it was taken for an
    orphan and removed: the newest checkpoint lost on both tiers)."""
    from tests.lifecycle_kill import LONG_NAME

    persistent, tier = tmp_path / "persist", tmp_path / "tier"
    _kill_run("long-name", persistent, tier)
    local = TierLayout(str(tier)).local_path(str(persistent / LONG_NAME))
    directory = os.path.dirname(local)
    markers = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(REPLICATE_SUFFIX)]
    assert markers and all(len(os.path.basename(m)) == 255 for m in markers)
    for marker in markers:
        open(marker, "wb").close()  # torn: its content never reached the disk
    plugin = DataStatesIO(local_tier=str(tier))
    pipeline_of(plugin).clean_stale(str(persistent))
    plugin.drain()
    assert _step(persistent / LONG_NAME) == 7 and os.path.exists(local)


def test_last_passes_over_weights_only_checkpoints(tmp_path):
    """A ``ModelCheckpoint(save_weights_only=True)`` saving more often, beside the full one: its files are no resume
    point (they hold no optimizer state), however new (before the fix the resume took one and crashed)."""
    full, weights = tmp_path / "full", tmp_path / "weights"
    plugin = DataStatesIO()
    plugin.save_checkpoint(state(4), str(full / "last.ckpt"))
    plugin.save_checkpoint({"global_step": 6, "state_dict": {}}, str(weights / "w-step=6.ckpt"))  # weights only
    plugin.save_checkpoint({"global_step": 6, "state_dict": {}}, str(full / "final-weights.ckpt"))  # likewise
    callbacks = [
        ModelCheckpoint(dirpath=str(full), save_last=True),
        ModelCheckpoint(dirpath=str(weights), save_weights_only=True, every_n_train_steps=1),
    ]
    trainer = L.Trainer(
        plugins=[DataStatesIO()],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    found = trainer._checkpoint_connector._parse_ckpt_path(
        TrainerFn.FITTING, "last", model_provided=True, model_connected=True
    )
    assert found == str(full / "last.ckpt")


_NODE = """
import sys, time
import lightning_datastates.records.stamp as stamp
real = time.time_ns
stamp.time.time_ns = lambda: real() + int(sys.argv[2]) * 10**9  # this node's clock
from lightning_datastates import DataStatesIO
directory, mode = sys.argv[1], sys.argv[3]
plugin = DataStatesIO()
if mode == "ahead":
    plugin.save_checkpoint({"global_step": 100, "optimizer_states": []}, directory + "/epoch=0-step=100.ckpt")
    plugin.save_checkpoint({"global_step": 100, "optimizer_states": []}, directory + "/last.ckpt")
else:  # resumed with an explicit ckpt_path, then saves on
    assert plugin.load_checkpoint(directory + "/last.ckpt", weights_only=False)["global_step"] == 100
    plugin.save_checkpoint({"global_step": 150, "optimizer_states": []}, directory + "/epoch=0-step=150.ckpt")
    from tests.test_lifecycle_faults import _resolve_last
    print("resolved", _resolve_last(directory, DataStatesIO(), save_top_k=2, monitor="step"))
"""


def test_a_run_resumed_from_a_node_whose_clock_ran_ahead_saves_after_it(tmp_path):
    """Node A's clock is 10 minutes ahead; the job resumes on node B from an explicit path and saves step 150. Its
    stamps come after the file it loaded, whatever the clocks: ``"last"`` finds step 150 (before the fix, step 100)."""
    from tests.script_support import script_env

    ahead = subprocess.run([sys.executable, "-c", _NODE, str(tmp_path), "600", "ahead"], env=script_env(), timeout=120)
    assert ahead.returncode == 0
    behind = subprocess.run(
        [sys.executable, "-c", _NODE, str(tmp_path), "0", "resume"],
        env=script_env(),
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert behind.returncode == 0, behind.stdout[-2000:] + behind.stderr[-2000:]
    assert f"resolved {tmp_path}/epoch=0-step=150.ckpt" in behind.stdout, behind.stdout[-2000:]


def test_a_copy_that_keeps_failing_is_retried_once_per_fit_not_at_every_save(tmp_path, monkeypatch):
    """The persistent tier is down (every copy fails, ``on_flush_error="warn"``): the copies given up are retried at
    the next fit's start, not by every save of this fit (before the fix each save re-read and re-queued every copy
    given up so far: the save calls grew slower with each one)."""
    from lightning_datastates.tiered.replicator import Replicator
    from lightning_datastates.tiered.tiers import TieredCheckpoints

    def down(self: Replicator, item: Any) -> Any:
        raise OSError(errno.EIO, "the persistent store is down (injected)")

    monkeypatch.setattr(Replicator, "_copy", down)
    recoveries = []
    real_recover = TieredCheckpoints.recover
    monkeypatch.setattr(
        TieredCheckpoints, "recover", lambda self, *a: recoveries.append(a[-1]) or real_recover(self, *a)
    )
    persistent = tmp_path / "persist"
    plugin = DataStatesIO(local_tier=str(tmp_path / "tier"), on_flush_error="warn")
    pipeline, owner = pipeline_of(plugin), BackgroundOwner()
    pipeline.attach(owner)
    for step in range(5):
        plugin.save_checkpoint(state(step), str(persistent / f"epoch=0-step={step}.ckpt"))
        plugin.drain()
        pipeline.raise_pending_failure()  # warned, as a hook would
    assert len(recoveries) == 1  # the first save's cleanup only
    pipeline.detach(owner)
    pipeline.attach(owner)  # the next fit
    pipeline.clean_once(str(persistent))
    assert len(recoveries) == 2


def test_keeping_is_said_only_of_a_file_that_exists_and_an_older_failure_keeps_nothing(tmp_path, monkeypatch, caplog):
    """The save of step 1 fails; step 2 and 3 land. Removing step 1 keeps nothing (it was never written: no "keeping"
    line); removing step 2 goes ahead although step 1, older, failed (before the fix: "keeping ... a newer write
    failed" of a file that did not exist, and step 2 left beyond save_top_k)."""
    _slow_storage(monkeypatch, _SlowWriter(delay_s=0.01, fail="step=1"))
    plugin = in_background(DataStatesIO(chunk_size="64KiB", on_flush_error="warn"))
    paths = [str(tmp_path / f"epoch=0-step={step}.ckpt") for step in range(4)]
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        plugin.save_checkpoint(state(1), paths[1])
        plugin.save_checkpoint(state(2), paths[2])
        plugin.remove_checkpoint(paths[1])
        plugin.save_checkpoint(state(3), paths[3])
        plugin.remove_checkpoint(paths[2])
        plugin.drain()
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt"]
    assert not [r for r in caplog.records if "keeping" in r.getMessage()]


def test_an_on_exception_checkpoint_that_never_fired_changes_nothing(tmp_path):
    """An ``OnExceptionCheckpoint`` whose file does not exist is no candidate: a fresh run finds nothing and says what
    Lightning says; with ``save_last=False`` and top-k files only, Lightning decides (before the fix: a false "not
    whole" warning, and the top-k file taken)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    DataStatesIO().save_checkpoint(state(2), str(tmp_path / "epoch=0-step=2.ckpt"))
    callbacks = [OnExceptionCheckpoint(str(tmp_path / "exc")), ModelCheckpoint(dirpath=str(tmp_path), save_last=False)]
    trainer = L.Trainer(
        plugins=[DataStatesIO()],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="there is no last checkpoint available"):
        found = trainer._checkpoint_connector._parse_ckpt_path(
            TrainerFn.FITTING, "last", model_provided=True, model_connected=True
        )
    assert found is None


def test_without_save_last_the_local_tier_changes_nothing_for_last(tmp_path):
    """``save_last=False``: replicated copies kept by ``local_keep`` do not make ``"last"`` take a top-k file where the
    single tier would not (before the fix the two disagreed)."""
    persistent = tmp_path / "persist"
    plugin = DataStatesIO(local_tier=str(tmp_path / "tier"))
    for step in (1, 2):
        plugin.save_checkpoint(state(step), str(persistent / f"epoch=0-step={step}.ckpt"))
    with pytest.warns(UserWarning, match="there is no last checkpoint available"):
        found = _resolve_last(str(persistent), DataStatesIO(local_tier=str(tmp_path / "tier")), save_last=False)
    assert found is None


def test_the_end_of_an_empty_object_on_s3_reads_as_no_stamp(s3, monkeypatch):
    """S3 answers any range of an empty object with 416 InvalidRange (moto does not): an empty ``*.ckpt`` carries no
    stamp, and reading its end does not fail (before the fix ``fit(ckpt_path="last")`` would raise)."""
    require_s3()
    from botocore.exceptions import ClientError

    from lightning_datastates.storage.s3.client import S3Client

    s3.put("run/empty.ckpt", b"")
    call = S3Client.call

    async def as_aws_does(self: Any, method: str, **kwargs: Any) -> Any:
        if method == "get_object" and str(kwargs.get("Range", "")).startswith("bytes=-"):
            raise ClientError({"Error": {"Code": "InvalidRange", "Message": "416"}}, "GetObject")
        return await call(self, method, **kwargs)

    monkeypatch.setattr(S3Client, "call", as_aws_does)
    assert pipeline_of(DataStatesIO(storage_options=s3.storage_options)).stamp_of(s3.url("run/empty.ckpt")) is None
