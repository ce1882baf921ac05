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
from lightning_datastates.load.integrity import verify_file
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.progress import drain_on_interrupt, drain_with_progress
from lightning_datastates.records.layout import CheckpointLayout
from tests.conftest import GatedWriter, assert_bit_equal, in_background, temp_files
from tests.script_support import REPO_ROOT, launch, script_env

#: Generous bounds against a hang, far above what the run needs (the whole test takes about 10 s): to reach the first
#: committed checkpoint, for the waiting line after the first SIGINT, and for the exit after the second. The drain
#: the second SIGINT cuts short holds several checkpoints of about 2 s each; the exit after it takes a fraction of a s.
_START_TIMEOUT_S = 60
_LINE_TIMEOUT_S = 30
_EXIT_TIMEOUT_S = 30

_WAITING = re.compile(r"waiting for (\d+) checkpoints? still being written \(([\d.]+) MiB left\)")


class _Run:
    """The script's process, its output read by a thread into ``lines``."""

    def __init__(self, out: str) -> None:
        self.process = launch("interrupt_script.py", out)
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
        count, mib_left = _WAITING.search(run.text()).groups()
        assert int(count) >= 1 and float(mib_left) > 0, run.text()[-4000:]
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
    assert re.search(r"abandoned \d+ checkpoints? in flight", output), output[-4000:]

    # What is left: whole checkpoints (the one committed before the abandon among them), temporary files only of
    # a writer that is gone (clean removes them; the aborts should have left none).
    references = set(os.listdir(reference_dir))
    files = _committed(checkpoint_dir)
    assert newest_before in files, f"{newest_before} was removed because newer writes were abandoned: {files}"
    assert len(references - set(files)) >= 1, "no returned save was abandoned: the drain ran to its end"
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
