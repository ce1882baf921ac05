"""Process exit with writes in flight, in real processes: Ctrl+C, SIGTERM, ``sys.exit`` and ``KeyboardInterrupt`` in a
hook, a normal return right after ``fit``, and SIGKILL.

Every checkpoint whose save returned must be on disk, whole, equal to the state at its save call; nothing
half-written may carry a final name; the process must end (no writer thread keeps it alive). The script is
tests/exit_script.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

import pytest
import torch

from lightning_datastates import DataStatesIO
from lightning_datastates.copy.loop import CopyLoop
from lightning_datastates.interrupts import sigint_deferred
from lightning_datastates.plugin import pipeline_of
from tests.conftest import assert_bit_equal, in_background, temp_files
from tests.script_support import launch

#: Bounds a hang (a process kept alive by a thread); the runs take a few seconds.
_EXIT_TIMEOUT_S = 300


def _run(tmp_path, how: str, send: signal.Signals | None = None, **env: str) -> tuple[int, str]:
    """Run the script; with ``send``, deliver that signal once the third save returned. Returns (status, output)."""
    process = launch("exit_script.py", str(tmp_path), how, **env)
    lines: list[str] = []
    sent = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if send is not None and not sent.is_set() and line.strip() == "saved 3":
                sent.set()
                process.send_signal(send)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status = process.wait(timeout=_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        reader.join(timeout=10)
        pytest.fail(f"the process did not exit ({how}, {send}):\n{''.join(lines)[-4000:]}")
    reader.join(timeout=30)
    output = "".join(lines)
    if send is not None:
        assert sent.is_set(), f"the run ended before the signal could be sent:\n{output[-4000:]}"
    return status, output


def _check_saved_checkpoints(tmp_path) -> list[str]:
    """Every reference (a save that returned) has its file, equal bit for bit; every file loads whole."""
    checkpoint_dir, reference_dir = tmp_path / "ckpt", tmp_path / "ref"
    files = sorted(n for n in os.listdir(checkpoint_dir) if n.endswith(".ckpt")) if checkpoint_dir.exists() else []
    references = sorted(n for n in os.listdir(reference_dir) if n.endswith(".ckpt")) if reference_dir.exists() else []
    assert references, "no save returned before the end: the test proves nothing"
    missing = sorted(set(references) - set(files))
    assert not missing, f"saves returned but their files are missing: {missing}"
    for name in files:
        loaded = torch.load(checkpoint_dir / name, map_location="cpu", weights_only=False)  # whole, or this raises
        if name in references:
            expected = torch.load(reference_dir / name, map_location="cpu", weights_only=False)
            assert_bit_equal(loaded, expected, name)
    return files


def _pending_at_drain(output: str) -> int:
    counts = [int(n) for n in re.findall(r"^draining (\d+) pending$", output, flags=re.MULTILINE)]
    # After an exception the callback first waits saying so (progress.drain_on_interrupt), then drains what is left.
    counts += [int(n) for n in re.findall(r"waiting for (\d+) checkpoints? still being written", output)]
    assert counts, f"no drain ran:\n{output[-4000:]}"
    return max(counts)


# (how the script ends, signal sent by the test, expected exit status)
_ENDINGS = {
    # Lightning catches KeyboardInterrupt, runs on_exception (our drain) and teardown, then calls sys.exit(1).
    "sigint": ("external", signal.SIGINT, 1),
    "keyboard-interrupt-in-hook": ("keyboard-interrupt", None, 1),
    # Lightning's SIGTERM handler only sets a flag; at the end of the batch it raises SIGTERMException, a
    # SystemExit without a code: the process exits with status 0.
    "sigterm": ("external", signal.SIGTERM, 0),
    "sys-exit-in-hook": ("sys-exit", None, 3),
    "normal-exit-after-fit": ("normal", None, 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("ending", list(_ENDINGS))
def test_every_returned_save_is_complete_when_the_process_ends(tmp_path, ending):
    how, send, expected_status = _ENDINGS[ending]
    status, output = _run(tmp_path, how, send)
    assert status == expected_status, f"exit status {status}, expected {expected_status}:\n{output[-4000:]}"
    assert _pending_at_drain(output) > 0, "no write was in flight at the end: the test proves nothing"
    _check_saved_checkpoints(tmp_path)
    assert temp_files(str(tmp_path)) == []


@pytest.mark.slow
def test_sigkill_leaves_whole_files_or_none_and_the_next_run_cleans_up(tmp_path):
    status, _ = _run(tmp_path, "external", signal.SIGKILL)
    assert status == -signal.SIGKILL
    files = [n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".ckpt")]
    for name in files:  # complete under the final name, or absent: never torn
        torch.load(tmp_path / "ckpt" / name, map_location="cpu", weights_only=False)
    for name in set(files) & set(os.listdir(tmp_path / "ref")):
        expected = torch.load(tmp_path / "ref" / name, map_location="cpu", weights_only=False)
        assert_bit_equal(torch.load(tmp_path / "ckpt" / name, map_location="cpu", weights_only=False), expected, name)
    # Temporary files of the killed process remain; the next run's setup removes them (its pid is dead).
    left = temp_files(str(tmp_path / "ckpt"))
    removed = pipeline_of(DataStatesIO()).clean_stale(str(tmp_path / "ckpt"))
    assert sorted(removed) == sorted(left)
    assert temp_files(str(tmp_path)) == []


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler for the test, whatever an earlier test in this process left (a test-runner worker
    was once found with SIGINT ignored, cause not found); the handler before is restored afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_capture_is_delivered_after_it_and_nothing_is_lost(tmp_path, monkeypatch, python_sigint_handler):
    """SIGINT at the worst moment of a capture (registered, not yet queued) must not strand the checkpoint."""
    plugin = in_background(DataStatesIO(host_cache="1MiB"))
    path = str(tmp_path / "a.ckpt")
    original_submit = CopyLoop.submit

    def submit(self, job):  # Ctrl+C arrives just before the job is handed to the copier
        os.kill(os.getpid(), signal.SIGINT)
        original_submit(self, job)

    monkeypatch.setattr(CopyLoop, "submit", submit)
    state = {"w": torch.arange(10_000, dtype=torch.float32)}
    with pytest.raises(KeyboardInterrupt):
        plugin.save_checkpoint(state, path)
    finished = threading.Event()
    threading.Thread(target=lambda: (plugin.drain(), finished.set()), daemon=True).start()
    assert finished.wait(timeout=60), "the interrupted checkpoint was never scheduled: drain hangs"
    plugin.teardown()
    assert_bit_equal(torch.load(path, weights_only=True), state, "a.ckpt")
    assert temp_files(str(tmp_path)) == []


def test_sigint_deferred_delivers_once_after_the_block():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # give the interpreter many chances to run a handler inside the block
                pass
            assert calls == []
        assert calls == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is not None and callable(signal.getsignal(signal.SIGINT))
    finally:
        signal.signal(signal.SIGINT, previous)
