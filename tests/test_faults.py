"""Real faults with nothing lost: SIGKILL mid-checkpoint, a file-size limit (disk full), slow and flaky storage.

The SIGKILL trials run in CI (15 by default, each at a new random moment, a new seed per run); for a longer soak
set ``DATASTATES_KILL_TRIALS`` (e.g. 1000) and optionally ``DATASTATES_KILL_SEED``. Each test prints its figures
(``-s`` shows them).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import CheckpointFlushError
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.storage.local import LocalWriter, LocalWriteSession
from tests.conftest import (
    BNModel,
    GatedWriter,
    RecordingDataStatesIO,
    assert_bit_equal,
    every_step_checkpoint,
    make_loader,
    make_trainer,
    temp_files,
)
from tests.kill_trainer import checkpoint_digest, ref_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_TRIALS = int(os.environ.get("DATASTATES_KILL_TRIALS", "15"))
KILL_SEED = int(os.environ.get("DATASTATES_KILL_SEED", str(int(time.time()))))
#: A hang guard for subprocess answers, not a performance threshold.
ANSWER_TIMEOUT_S = 300


class KillServer:
    """The fork server of tests/kill_trainer.py, driven line by line."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", "kill_trainer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert json.loads(self._read_line()) == {"ready": True}

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return json.loads(self._read_line())

    def _read_line(self) -> str:
        assert self.process.stdout is not None
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            assert selector.select(ANSWER_TIMEOUT_S), "the kill server did not answer (hang guard)"
        line = self.process.stdout.readline()
        assert line, f"the kill server died (exit {self.process.poll()})"
        return line

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_script(script: str, *args: str) -> Any:
    """Run ``script`` in a fresh interpreter (this checkout first on the path); return its last line, JSON-decoded."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=ANSWER_TIMEOUT_S,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def verify_directory(directory: str) -> dict[str, int]:
    """Every file under a final ``.ckpt`` name loads and equals the state recorded for its step; return its steps."""
    steps = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".ckpt"):
            continue
        loaded = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=False)
        step = int(loaded["global_step"])
        reference = ref_path(directory, name, step)
        assert os.path.exists(reference), f"{name}: no state was recorded for step {step}"
        with open(reference) as inp:
            expected = json.load(inp)["digest"]
        assert checkpoint_digest(loaded) == expected, f"{name}: differs from the state of step {step}"
        steps[name] = step
    return steps


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing(tmp_path):
    rng = random.Random(KILL_SEED)
    server = KillServer()
    figures = {"trials": 0, "kills": 0, "files_checked": 0, "killed_mid_write": 0, "no_checkpoint_yet": 0}
    try:
        for trial in range(KILL_TRIALS):
            directory = str(tmp_path / f"trial{trial}")
            os.makedirs(directory)
            answer = server.ask(cmd="trial", dir=directory, seed=trial, delay_s=rng.uniform(0.0, 0.8))
            assert answer["killed"], f"trial {trial}: the run ended before the kill: {answer}"
            figures["trials"] += 1
            figures["kills"] += 1
            figures["killed_mid_write"] += bool(answer["temp_files"])
            steps = verify_directory(directory)
            figures["files_checked"] += len(steps)
            numbered = {name: step for name, step in steps.items() if name != "last.ckpt"}
            if not numbered:
                figures["no_checkpoint_yet"] += 1
                continue
            newest = max(numbered, key=numbered.get)  # the newest complete checkpoint resumes training
            resumed = server.ask(cmd="resume", dir=directory, ckpt=os.path.join(directory, newest), steps=1)
            assert resumed["exit"] == 0 and resumed["global_step"] == numbered[newest] + 1, resumed
            assert temp_files(directory) == [], "the next run did not remove the killed run's temporary files"
            after = verify_directory(directory)  # the resumed run's own checkpoint is whole and right too
            figures["files_checked"] += len(after)
            assert any(step == numbered[newest] + 1 for step in after.values())
    finally:
        server.close()
    print(f"\nSIGKILL fault suite (seed {KILL_SEED}): {figures}")
    assert figures["trials"] == KILL_TRIALS


# ---------------------------------------------------------------------------------------------------- disk full
_FILE_SIZE_LIMIT_SCRIPT = textwrap.dedent(
    """
    import json, logging, os, resource, signal, sys
    import lightning as L
    import torch
    from lightning_datastates import CheckpointFlushError
    from tests.conftest import RecordingDataStatesIO, BNModel, assert_bit_equal, every_step_checkpoint
    from tests.conftest import make_loader, make_trainer, temp_files

    LIMIT = 4 * 2**20
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))

    class BigAtStep3(L.Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            if trainer.global_step == 3:  # this checkpoint does not fit under the file-size limit
                checkpoint["blob"] = torch.ones(LIMIT // 2)

    class Warnings(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []
        def emit(self, record):
            self.messages.append(record.getMessage())

    results = {}
    for policy in ("raise", "warn"):
        directory = os.path.join(sys.argv[1], policy)
        handler = Warnings()
        logging.getLogger("lightning_datastates").addHandler(handler)
        plugin = RecordingDataStatesIO(on_flush_error=policy)
        checkpoint = every_step_checkpoint(directory, save_last=False)
        trainer = make_trainer(directory, plugin, callbacks=[checkpoint, BigAtStep3()], max_epochs=-1, max_steps=6)
        result = {"error": None}
        try:
            trainer.fit(BNModel(), make_loader())
        except CheckpointFlushError as exc:
            result["error"] = {"message": str(exc), "path": exc.path, "errno": getattr(exc.__cause__, "errno", None)}
        logging.getLogger("lightning_datastates").removeHandler(handler)
        files = sorted(n for n in os.listdir(directory) if n.endswith(".ckpt"))
        for name in files:  # every file there is whole and equals the state of its step
            path = os.path.join(directory, name)
            assert_bit_equal(torch.load(path, weights_only=True), plugin.recorded[path], name)
        result.update(files=files, temp_files=temp_files(directory), warnings=handler.messages)
        results[policy] = result
    print(json.dumps(results))
    """
)


def test_file_size_limit_is_a_clear_error_and_the_policy_decides(tmp_path):
    """RLIMIT_FSIZE in a subprocess: the write of step 3 fails with EFBIG, as on a full disk."""
    outcome = run_script(_FILE_SIZE_LIMIT_SCRIPT, str(tmp_path))
    failed = str(tmp_path / "raise" / "epoch=0-step=3.ckpt")

    raised = outcome["raise"]  # default policy: training stops with an error naming the path and the fix
    assert raised["error"] is not None and raised["error"]["path"] == failed and raised["error"]["errno"] == 27
    message = raised["error"]["message"]
    assert failed in message and "File too large" in message and "ulimit -f" in message
    # Earlier checkpoints intact, the failed one absent. The failure is raised at the first hook after the write
    # failed, so on a loaded machine step 4 may have been saved (and written whole: the script compares every file
    # with its recorded state) before it surfaced.
    assert raised["files"][:2] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    assert "epoch=0-step=3.ckpt" not in raised["files"]
    assert raised["temp_files"] == []  # no partial file

    warned = outcome["warn"]  # on_flush_error="warn": training goes on, the failure is logged once
    assert warned["error"] is None
    assert warned["files"] == [f"epoch=0-step={step}.ckpt" for step in (1, 2, 4, 5, 6)]
    assert warned["temp_files"] == []
    failure_warnings = [m for m in warned["warnings"] if "on_flush_error='warn'" in m]
    assert len(failure_warnings) == 1 and "epoch=0-step=3.ckpt" in failure_warnings[0]
    assert "File too large" in failure_warnings[0]
    print(f"\nfile-size limit: raise -> {message!r}; warn -> {failure_warnings[0]!r}")


# ---------------------------------------------------------------------------------------------------- slow storage
_SLOW_STORAGE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import lightning as L
    import lightning_datastates.pipeline as pipeline_module
    from lightning_datastates import DataStatesIO
    from lightning_datastates.plugin import pipeline_of
    from tests.conftest import BNModel, GatedWriter, every_step_checkpoint, make_loader, make_trainer

    def rss_bytes(field):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024

    writer = GatedWriter(delay_s=0.02)  # every write takes 20 ms more: storage far slower than the steps
    pipeline_module.writer_for = lambda path, storage_options=None, **_: writer

    class InFlight(L.Callback):
        def __init__(self):
            self.most = 0
        def on_train_batch_end(self, trainer, *args):
            active = list(pipeline_of(plugin).engine._pending.active)
            self.most = max(self.most, sum(not job.finished.is_set() for job in active))

    steps = int(sys.argv[2])
    plugin = DataStatesIO(host_cache="16MiB", chunk_size="1MiB", writer_threads=2)
    in_flight = InFlight()
    trainer = make_trainer(
        sys.argv[1], plugin, callbacks=[every_step_checkpoint(sys.argv[1], save_last=False), in_flight],
        max_epochs=-1, max_steps=steps,
    )
    model = BNModel(width=1024)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = rss_bytes("VmRSS")
    trainer.fit(model, make_loader(n=256))
    stats = plugin.stats
    engine = pipeline_of(plugin).engine
    print(json.dumps({
        "growth_bytes": rss_bytes("VmHWM") - before,
        "checkpoint_bytes": max(s.total_bytes for s in stats),
        "committed": sum(s.state == "committed" for s in stats),
        "arena_bytes": engine.arena.size_bytes,
        "arena_peak_bytes": engine.arena.peak_used_bytes,
        "most_in_flight": in_flight.most,
        "writer_threads": plugin.config.writer_threads,
    }))
    """
)


@pytest.mark.slow
def test_storage_slower_than_saves_keeps_memory_and_checkpoints_in_flight_bounded(tmp_path):
    steps = 16
    figures = run_script(_SLOW_STORAGE_SCRIPT, str(tmp_path), str(steps))
    print(f"\nslow storage: {figures}")
    assert figures["committed"] == steps  # back-pressure (the default) loses no checkpoint
    assert figures["arena_peak_bytes"] <= figures["arena_bytes"]
    assert figures["most_in_flight"] <= 2 * figures["writer_threads"]
    # Holding every pending snapshot would take steps x checkpoint bytes; host memory must not grow with the count.
    assert figures["growth_bytes"] < steps * figures["checkpoint_bytes"] / 2


@pytest.mark.slow
def test_arena_full_policy_skip_skips_whole_checkpoints_and_keeps_older_files(tmp_path, monkeypatch, caplog):
    writer = GatedWriter(delay_s=0.05)  # storage far slower than the steps
    monkeypatch.setattr("lightning_datastates.pipeline.writer_for", lambda path, storage_options=None, **_: writer)
    plugin = RecordingDataStatesIO(on_arena_full="skip", host_cache="8MiB", chunk_size="1MiB", writer_threads=2)
    directory = str(tmp_path / "ckpt")
    top_k = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=2, monitor="train_loss")
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[top_k], max_epochs=-1, max_steps=16)
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        trainer.fit(BNModel(width=512), make_loader(n=128))
    skipped = {s.path for s in plugin.stats if s.state == "skipped"}
    committed = {s.path for s in plugin.stats if s.state == "committed"}
    print(f"\narena full, skip: {len(skipped)} skipped, {len(committed)} committed of {len(plugin.stats)} saves")
    assert skipped and committed  # slow storage made some saves skip; the others were written
    skip_warnings = [r.getMessage() for r in caplog.records if "on_arena_full='skip'" in r.getMessage()]
    assert len(skip_warnings) == len(skipped) and all(any(p in m for m in skip_warnings) for p in skipped)
    present = sorted(os.path.join(directory, n) for n in os.listdir(directory))
    assert present and not set(present) & skipped and set(present) <= committed  # no partial file, no skipped one
    assert temp_files(directory) == []
    for path in present:
        assert_bit_equal(torch.load(path, weights_only=True), plugin.recorded[path], path)
    # Every checkpoint ModelCheckpoint still counts on exists, unless it was skipped (a skip never removed a file).
    assert all(os.path.exists(path) or path in skipped for path in top_k.best_k_models)


class FlakyWriter(LocalWriter):
    """A local writer whose Nth checkpoints (1-based, in save order) fail at their first write; the rest succeed."""

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing
        self.failed_paths: list[str] = []
        self._begun = 0
        self._lock = threading.Lock()

    def begin(self, path: str, total_bytes: int) -> LocalWriteSession:
        session = super().begin(path, total_bytes)
        with self._lock:
            self._begun += 1
            fail = self._begun in self.failing
        if fail:
            self.failed_paths.append(path)

            def failing_write(offset: int, data: memoryview) -> None:
                raise OSError(errno.EIO, "Input/output error (injected)")

            session.write_range = failing_write  # type: ignore[method-assign]
        return session


def test_storage_that_recovers_warn_policy_one_warning_per_failed_checkpoint(tmp_path, monkeypatch, caplog):
    writer = FlakyWriter(failing={3, 6})
    monkeypatch.setattr("lightning_datastates.pipeline.writer_for", lambda path, storage_options=None, **_: writer)
    plugin = RecordingDataStatesIO(on_flush_error="warn")
    directory = str(tmp_path / "ckpt")
    trainer = make_trainer(
        str(tmp_path), plugin, callbacks=[every_step_checkpoint(directory, save_last=False)], max_epochs=-1, max_steps=8
    )
    with caplog.at_level(logging.WARNING, logger="lightning_datastates"):
        trainer.fit(BNModel(), make_loader())  # nothing raised
    failures = [r.getMessage() for r in caplog.records if "on_flush_error='warn'" in r.getMessage()]
    assert (
        len(failures) == 2 and [p for p in writer.failed_paths if any(p in m for m in failures)] == writer.failed_paths
    )
    for path in writer.failed_paths:
        assert sum(path in m for m in failures) == 1  # exactly one report per failed checkpoint
        assert not os.path.exists(path)
    kept = sorted(os.listdir(directory))
    assert len(kept) == 6 and temp_files(directory) == []
    for name in kept:  # the later checkpoints succeeded, whole and right
        path = os.path.join(directory, name)
        assert_bit_equal(torch.load(path, weights_only=True), plugin.recorded[path], name)
    pipeline_of(plugin).raise_pending_failure()  # nothing left to report


def test_storage_that_recovers_raise_policy_raises_once_then_resumes(tmp_path, monkeypatch):
    writer = FlakyWriter(failing={3})
    monkeypatch.setattr("lightning_datastates.pipeline.writer_for", lambda path, storage_options=None, **_: writer)
    plugin = RecordingDataStatesIO()  # on_flush_error="raise", the default
    directory = str(tmp_path / "ckpt")
    callbacks = [every_step_checkpoint(directory, save_last=False)]
    with pytest.raises(CheckpointFlushError) as raised:
        make_trainer(str(tmp_path), plugin, callbacks=callbacks, max_epochs=-1, max_steps=8).fit(
            BNModel(), make_loader()
        )
    assert raised.value.path == writer.failed_paths[0] and "injected" in str(raised.value)
    good = sorted(os.listdir(directory))
    assert good and writer.failed_paths[0] not in good and temp_files(directory) == []
    # The same plugin goes on from the newest good checkpoint: the failure is not raised again, later saves land.
    newest = max(
        (os.path.join(directory, n) for n in good), key=lambda p: torch.load(p, weights_only=True)["global_step"]
    )
    resumed = make_trainer(
        str(tmp_path), plugin, callbacks=[every_step_checkpoint(directory, save_last=False)], max_epochs=-1, max_steps=8
    )
    resumed.fit(BNModel(), make_loader(), ckpt_path=newest)
    assert resumed.global_step == 8
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        assert_bit_equal(torch.load(path, weights_only=True), plugin.recorded[path], name)
    assert os.path.exists(os.path.join(directory, "epoch=0-step=8.ckpt"))
