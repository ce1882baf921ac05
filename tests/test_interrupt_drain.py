"""Ctrl+C with checkpoint writes in flight: the wait says what it waits for, and a second Ctrl+C abandons the writes.

Lightning ignores SIGINT from its "attempting graceful shutdown" on, so a second Ctrl+C used to do nothing while the
callback drained the writes in silence. Now the drain (lightning_datastates/progress.py, ``drain_on_interrupt``) logs
one line naming the checkpoints and the bytes left, shows the bar, and takes a further Ctrl+C as the user giving up on
the writes: they are abandoned (snapshot/engine.py, ``abandon``) and the process ends at once. Checkpoints committed
before stay whole, nothing half-written carries a final name, no older checkpoint is removed because a newer one was
abandoned, and whatever is left is something ``clean`` removes. The run is tests/interrupt_script.py, a real process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import lightning as L
import pytest
import torch

from lightning_datastates import DataStatesIO
from lightning_datastates.capture.admission import skipped_stats
from lightning_datastates.interrupts import sigint_deferred, sigint_sets
from lightning_datastates.load.integrity import verify_file
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.progress import drain_on_interrupt, drain_with_progress
from lightning_datastates.records.layout import CheckpointLayout
from lightning_datastates.storage.local import LocalWriter, LocalWriteSession
from tests.conftest import GatedWriter, assert_bit_equal, in_background, temp_files
from tests.script_support import REPO_ROOT, launch, script_env

#: Generous bounds against a hang, far above what the run needs (the whole test takes about 10 s): to reach the first
#: committed checkpoint, for the waiting line after the first SIGINT, and for the exit after the second. The drain
#: the second SIGINT cuts short holds several checkpoints of about 2 s each; the exit after it takes a fraction of a s.
_START_TIMEOUT_S = 60
_LINE_TIMEOUT_S = 30
_EXIT_TIMEOUT_S = 30

_WAITING = re.compile(
    r"waiting for (\d+) checkpoints? still being written \(([\d.]+) MiB still to hand to storage, (\d+) commits? "
    r"to finish\) before shutting down: ([^;\n]+);"
)
_GAVE_UP = re.compile(r"Ctrl-C: gave up (\d+) checkpoints? in flight \(([^)]*)\): none of them was published")


class _Run:
    """The script's process, its output read by a thread into ``lines``."""

    def __init__(self, out: str, script: str = "interrupt_script.py") -> None:
        self.process = launch(script, out)
        self.output: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        while chunk := self.process.stdout.read(1):  # tqdm writes \r without newlines: read as it comes
            with self._lock:
                self.output.append(chunk)

    def text(self) -> str:
        with self._lock:
            return "".join(self.output)

    def wait_for(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{what}; the run's output:\n{self.text()[-4000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(timeout=10)


def _committed(directory) -> list[str]:
    """Checkpoints under their final names, by step."""
    names = [n for n in os.listdir(directory) if n.endswith(".ckpt")] if directory.exists() else []
    return sorted(names, key=lambda n: int(re.findall(r"\d+", n)[0]))


def test_second_ctrl_c_abandons_the_writes_in_flight_and_leaves_earlier_checkpoints_whole(tmp_path):
    checkpoint_dir, reference_dir = tmp_path / "ckpt", tmp_path / "ref"
    run = _Run(str(tmp_path))
    try:
        # Once a checkpoint is committed and two more saves returned, writes are in flight behind it.
        run.wait_for(lambda: _committed(checkpoint_dir), _START_TIMEOUT_S, "no checkpoint was committed")
        saves_before = len(re.findall(r"^saved \d+$", run.text(), flags=re.MULTILINE))
        run.wait_for(
            lambda: len(re.findall(r"^saved \d+$", run.text(), flags=re.MULTILINE)) >= saves_before + 2,
            _START_TIMEOUT_S,
            "no save returned after the first commit",
        )
        run.process.send_signal(signal.SIGINT)
        run.wait_for(lambda: _WAITING.search(run.text()), _LINE_TIMEOUT_S, "no line said what the drain waits for")
        count, mib_left, commits, names = _WAITING.search(run.text()).groups()
        assert int(count) >= 1 and float(mib_left) > 0 and int(commits) >= int(count), run.text()[-4000:]
        # Every checkpoint it waits for is named: those whose save returned and that are not committed yet.
        waited_for = names.split(", ")
        assert all(os.path.dirname(name) == str(checkpoint_dir) for name in waited_for), names
        assert len(waited_for) == int(count), names
        assert "press Ctrl-C again to abandon them (earlier checkpoints stay whole)" in run.text()
        newest_before = _committed(checkpoint_dir)[-1]  # committed before the abandon: must survive it
        run.process.send_signal(signal.SIGINT)
        try:
            status = run.process.wait(timeout=_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the second Ctrl-C did not end the run:\n{run.text()[-4000:]}")
    finally:
        run.kill()
    output = run.text()
    assert status == 1, f"exit status {status} (Lightning exits 1 after a KeyboardInterrupt):\n{output[-4000:]}"
    assert "Writing checkpoints" in output, "the drain bar did not show"
    gave_up = _GAVE_UP.search(output)
    assert gave_up, output[-4000:]
    given_up = [os.path.basename(name) for name in gave_up.group(2).split(", ")]
    assert int(gave_up.group(1)) == len(given_up) >= 1, gave_up.group(0)

    # What is left: whole checkpoints (the one committed before the abandon among them), temporary files only of
    # a writer that is gone (clean removes them; the aborts should have left none).
    references = set(os.listdir(reference_dir))
    files = _committed(checkpoint_dir)
    assert newest_before in files, f"{newest_before} was removed because newer writes were abandoned: {files}"
    assert len(references - set(files)) >= 1, "no returned save was abandoned: the drain ran to its end"
    assert set(given_up) <= references - set(files), f"named as given up but published: {given_up}, {files}"
    clean = subprocess.run(
        [sys.executable, "-m", "lightning_datastates", "clean", str(checkpoint_dir)],
        env=script_env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert temp_files(str(tmp_path)) == []
    assert sorted(os.listdir(checkpoint_dir), key=lambda n: int(re.findall(r"\d+", n)[0])) == files
    for name in files:
        assert verify_file(str(checkpoint_dir / name)).complete
        loaded = torch.load(checkpoint_dir / name, map_location="cpu", weights_only=False)
        expected = torch.load(reference_dir / name, map_location="cpu", weights_only=False)
        assert_bit_equal(loaded, expected, name)


def test_abandon_keeps_the_file_whose_removal_waited_for_the_abandoned_write(tmp_path, monkeypatch):
    """ModelCheckpoint's top-k removal of an older file waits for the newer write; abandoning that write must not
    remove the older file (it may be the last whole checkpoint), and must leave no temporary file."""
    writer = GatedWriter()
    monkeypatch.setattr("lightning_datastates.pipeline.writer_for", lambda path, storage_options=None, **_: writer)
    plugin = in_background(DataStatesIO(host_cache="1MiB"))
    old, new = str(tmp_path / "old.ckpt"), str(tmp_path / "new.ckpt")
    plugin.save_checkpoint({"w": torch.zeros(1000)}, old)
    plugin.drain()
    writer.gate.clear()  # the next write hangs in storage until the abandon
    plugin.save_checkpoint({"w": torch.ones(1000)}, new)
    plugin.remove_checkpoint(old)  # held back behind the new write
    assert os.path.exists(old)
    engine = pipeline_of(plugin).engine
    done = threading.Event()
    threading.Thread(target=lambda: (engine.abandon(), done.set()), daemon=True).start()
    time.sleep(0.2)  # the writer is in the gated write: the abandon waits for that call only
    writer.gate.set()
    assert done.wait(timeout=60), "abandon did not return once the storage call ended"
    plugin.teardown()  # drains nothing more, ends the threads
    assert os.path.exists(old), "the older checkpoint was removed although the newer one was abandoned"
    assert not os.path.exists(new)
    assert temp_files(str(tmp_path)) == []
    assert_bit_equal(torch.load(old, weights_only=True), {"w": torch.zeros(1000)}, "old.ckpt")


def test_drain_bar_does_not_wait_for_a_skipped_save(tmp_path):
    """A save skipped by ``on_arena_full="skip"`` never becomes durable: the drain bar (at train end, and the wait
    after an exception) must not wait for it. Its stats are put in the history at the precise point a skip leaves them.
    """
    plugin = in_background(DataStatesIO(host_cache="1MiB"))
    plugin.save_checkpoint({"w": torch.zeros(1000)}, str(tmp_path / "a.ckpt"))
    engine = pipeline_of(plugin).engine
    skipped = skipped_stats(str(tmp_path / "b.ckpt"), CheckpointLayout((), (), 4096), time.perf_counter(), "arena full")
    engine.history.append(skipped)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=True)
    finished = threading.Event()

    def drain() -> None:
        drain_with_progress(trainer, plugin)
        drain_on_interrupt(trainer, engine, RuntimeError("boom"))
        finished.set()

    threading.Thread(target=drain, daemon=True).start()
    assert finished.wait(timeout=60), "the drain waits for a skipped save forever"  # bounds a hang
    plugin.teardown()


def test_a_ctrl_c_while_the_process_ends_does_not_kill_it(tmp_path):
    """Lightning's teardown puts Python's SIGINT handler back before it exits the process: a Ctrl-C after the drain,
    while the script's own cleanup runs (tests/interrupt_exit_script.py), killed the process by the signal (exit
    status -2, a KeyboardInterrupt traceback, the cleanup cut short). Now it is told and ignored."""
    run = _Run(str(tmp_path), "interrupt_exit_script.py")
    try:
        run.wait_for(lambda: _committed(tmp_path / "ckpt"), _START_TIMEOUT_S, "no checkpoint was committed")
        run.process.send_signal(signal.SIGINT)
        run.wait_for(lambda: "cleaning up" in run.text(), _LINE_TIMEOUT_S, "the run did not reach its cleanup")
        run.process.send_signal(signal.SIGINT)
        run.wait_for(lambda: "the run is already ending" in run.text(), _LINE_TIMEOUT_S, "the Ctrl-C was not told")
        (tmp_path / "go").touch()
        status = run.process.wait(timeout=_EXIT_TIMEOUT_S)
    finally:
        run.kill()
    output = run.text()
    assert status == 1, f"exit status {status} (Lightning exits 1 after a KeyboardInterrupt):\n{output[-4000:]}"
    assert "cleaned up" in output and "Traceback" not in output, output[-4000:]


class _SlowCommitWriter(LocalWriter):
    """LocalWriter whose commits wait for ``gate``: every byte of a file handed over, its commit in flight."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.committing = threading.Event()

    def begin(self, path: str, total_bytes: int) -> LocalWriteSession:
        session = super().begin(path, total_bytes)
        writer = self

        class _Session(LocalWriteSession):
            fast_writes = False

            def complete(self) -> None:
                writer.committing.set()
                writer.gate.wait(timeout=60)
                super().complete()

        return _Session(session.path, session.temp_path, session._fd)  # type: ignore[arg-type]


def test_a_commit_in_flight_is_waited_for_by_name_and_said_to_land_whole(tmp_path, monkeypatch, caplog):
    """A file whose bytes were all handed to storage, its commit still to finish (the S3 upload of its last parts):
    the wait names it and counts the commit (it said "0.0 MiB left"); a Ctrl-C then cannot stop a commit that began,
    and the abandon line says that it landed whole (it said "abandoned 0 checkpoints in flight ()")."""
    writer = _SlowCommitWriter()
    monkeypatch.setattr("lightning_datastates.pipeline.writer_for", lambda path, storage_options=None, **_: writer)
    plugin = in_background(DataStatesIO(host_cache="1MiB"))
    path = str(tmp_path / "step=1.ckpt")
    plugin.save_checkpoint({"w": torch.ones(1000)}, path)
    assert writer.committing.wait(timeout=60), "the commit did not begin"
    engine = pipeline_of(plugin).engine
    (job,) = engine.pending.in_flight()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)

    def ctrl_c_then_let_the_commit_end() -> None:
        deadline = time.monotonic() + _LINE_TIMEOUT_S
        while signal.getsignal(signal.SIGINT) is signal.SIG_IGN and time.monotonic() < deadline:
            time.sleep(0.01)  # until the wait listens for Ctrl-C
        os.kill(os.getpid(), signal.SIGINT)
        while not job.cancel_requested and time.monotonic() < deadline:
            time.sleep(0.01)  # until the abandon began
        writer.gate.set()

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as Lightning, from its graceful shutdown on
    helper = threading.Thread(target=ctrl_c_then_let_the_commit_end, daemon=True)
    try:
        helper.start()
        with caplog.at_level("WARNING", logger="lightning_datastates"):
            assert drain_on_interrupt(trainer, engine, KeyboardInterrupt())
    finally:
        signal.signal(signal.SIGINT, previous)
        writer.gate.set()
        helper.join(timeout=60)
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert (
        "waiting for 1 checkpoint still being written (0.0 MiB still to hand to storage, 1 commit to finish) before "
        f"shutting down: {path}; press Ctrl-C again" in text
    ), text
    assert f"Ctrl-C: gave up 0 checkpoints in flight; 1 landed whole while it waited ({path})" in text, text
    plugin.teardown()
    assert_bit_equal(torch.load(path, weights_only=True), {"w": torch.ones(1000)}, "step=1.ckpt")


def test_a_ctrl_c_held_back_by_a_save_abandons_the_drain_at_once():
    """Two Ctrl-C while a save holds SIGINT back (a capture waiting for room in the arena): the first stops the run
    once the save is done, the second counts as pressed during the drain that follows (it was lost, and the drain ran
    to its end)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), sigint_deferred():
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)  # the handler runs before the sleep goes on (PEP 475)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as Lightning, from its graceful shutdown on
        abandon = threading.Event()
        with sigint_sets(abandon, interrupted=True):
            assert abandon.is_set()
        later = threading.Event()
        with sigint_sets(later, interrupted=True):
            assert not later.is_set()  # taken once
    finally:
        signal.signal(signal.SIGINT, previous)
