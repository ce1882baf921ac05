"""S3 faults against a real S3 API on loopback (moto): the uploading process killed, the server killed.

No partial object is ever visible; uploads a dead process left open are aborted by the next run (recognised by
their marker, whatever their age); a live process's upload is never touched; a dead server's failure reaches the
training thread, bounded by the writer's timeouts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import CheckpointFlushError, DataStatesIO
from lightning_datastates.storage.s3 import UPLOAD_MARKER_SUFFIX
from tests.conftest import BNModel, make_loader, make_trainer
from tests.s3_server import (  # noqa: F401 - the *_fixture imports register the fixtures
    fresh_bucket,
    moto_process_fixture,
    require_s3,
    s3_endpoint_fixture,
    s3_fixture,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1024**2
#: Hang guard for waits on subprocesses and servers, not a performance threshold.
GUARD_S = 120.0
#: How long requests a stopped process already sent may take to reach the loopback server (a loaded machine).
SETTLE_S = 1.0

_UPLOADER_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from lightning_datastates import DataStatesIO
    endpoint, prefix, stop_file = sys.argv[1], sys.argv[2], sys.argv[3]
    options = {
        "endpoint_url": endpoint, "key": "testing", "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"}, "part_size_bytes": "5MiB", "max_concurrent_parts": 1,
    }
    # On its own: each save returns once committed. stale_after_s: moto dates every upload 2010, so by age alone the
    # other uploader's upload, in the instant before its marker lands, would look abandoned to this one's cleanup.
    plugin = DataStatesIO(storage_options=options, stale_after_s=1e10)
    i = 0
    while not os.path.exists(stop_file):  # saves until told to stop
        plugin.save_checkpoint({"i": i, "w": torch.full((4 * 2**20,), float(i))}, f"{prefix}-{i}.ckpt")  # 4 parts
        print(i, flush=True)
        i += 1
    """
)


@pytest.fixture(autouse=True)
def _needs_s3() -> None:
    require_s3()


def _uploader(endpoint: str, prefix: str, stop_file: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-c", _UPLOADER_SCRIPT, endpoint, prefix, stop_file],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _upload_in_progress(env, key_prefix: str) -> str | None:
    """The key of an open upload under ``key_prefix`` that holds parts and has its marker, if any."""
    uploads = env.client.list_multipart_uploads(Bucket=env.bucket, Prefix=key_prefix).get("Uploads", [])
    markers = [k for k in env.keys("run/.") if k.endswith(UPLOAD_MARKER_SUFFIX)]
    for upload in uploads:
        name = upload["Key"].rsplit("/", 1)[1]
        if _has_parts(env, upload) and any(m.startswith(f"run/.{name}.") for m in markers):
            return upload["Key"]
    return None


def _has_parts(env, upload: dict) -> bool:
    """Whether an open upload (as listed) holds parts; False once it was completed or aborted meanwhile."""
    try:
        return bool(env.client.list_parts(Bucket=env.bucket, Key=upload["Key"], UploadId=upload["UploadId"])["Parts"])
    except (env.client.exceptions.NoSuchUpload, KeyError):
        return False


def _wait_mid_upload(env, key_prefix: str, process: subprocess.Popen[str], committed_first: bool) -> str:
    deadline = time.monotonic() + GUARD_S
    while True:
        assert process.poll() is None and time.monotonic() < deadline, "no upload in progress to interrupt"
        key = _upload_in_progress(env, key_prefix)
        if key is not None and (not committed_first or env.keys(key_prefix)):
            return key
        time.sleep(0.02)


def _assert_whole(env, key: str) -> None:
    loaded = torch.load(__import__("io").BytesIO(env.read(key)), weights_only=True)
    assert torch.equal(loaded["w"], torch.full((4 * MiB,), float(loaded["i"]))), f"{key} is not whole"
    assert key.endswith(f"-{loaded['i']}.ckpt")


def _stop_mid_upload(env, key_prefix: str, process: subprocess.Popen[str], committed_first: bool) -> str:
    """SIGSTOP ``process`` while its upload is open; return the upload's key.

    The upload seen open may complete before the signal lands (a loaded machine), or a request the process sent just
    before it stopped (the completion, say) may still reach the server: the check waits for such requests to land
    first. If the upload is no longer open then, the process goes on, and the next upload is caught instead.
    """
    while True:
        key = _wait_mid_upload(env, key_prefix, process, committed_first)
        process.send_signal(signal.SIGSTOP)
        time.sleep(SETTLE_S)
        if key in env.open_uploads():
            return key
        process.send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_uploading_process_killed_mid_upload_leaves_no_partial_object_and_the_next_run_aborts_it(s3, tmp_path):
    stop_file = str(tmp_path / "stop")
    killed = _uploader(s3.endpoint, "s3://bucket/run/killed", stop_file)
    alive = _uploader(s3.endpoint, "s3://bucket/run/alive", stop_file)
    try:
        # The live writer cleans the directory once, at its first save: that must be over before the other dies (a
        # live process rightly aborts a dead one's upload, as the next run does below), so wait for its first upload.
        _wait_mid_upload(s3, "run/alive", alive, committed_first=False)
        killed_key = _stop_mid_upload(s3, "run/killed", killed, committed_first=True)
        killed.send_signal(signal.SIGKILL)  # mid-upload: parts stored, the commit never comes
        killed.wait(GUARD_S)
        alive_key = _stop_mid_upload(s3, "run/alive", alive, committed_first=False)  # a live writer: not to be touched
        assert killed_key not in s3.keys("run/") and alive_key not in s3.keys("run/")  # no partial object
        for key in s3.keys("run/killed"):
            _assert_whole(s3, key)  # what is visible is complete
        assert set(s3.open_uploads()) == {killed_key, alive_key}

        # The next run (here: a save into the same directory) aborts the dead process's upload, by its marker:
        # stale_after_s is huge, so age plays no part (moto dates every upload 2010).
        next_run = DataStatesIO(storage_options=s3.storage_options, stale_after_s=1e10)
        next_run.save_checkpoint({"w": torch.ones(10)}, "s3://bucket/run/next.ckpt")
        assert s3.open_uploads() == [alive_key]
        assert not [k for k in s3.keys("run/.") if k.endswith(UPLOAD_MARKER_SUFFIX) and ".killed-" in k]
        next_run.teardown()
    except BaseException:
        for process in (killed, alive):
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
        s3.abort_all_uploads()
        raise
    open(stop_file, "w").close()  # the live writer finishes the checkpoint it was writing, then stops
    alive.send_signal(signal.SIGCONT)
    alive.wait(GUARD_S)
    assert alive.returncode == 0  # the live writer went on and committed
    assert alive_key in s3.keys("run/alive")
    for key in s3.keys("run/alive"):
        _assert_whole(s3, key)
    assert [k for k in s3.keys("run/.") if k.endswith(UPLOAD_MARKER_SUFFIX)] == []  # markers removed
    print(f"\nS3 process kill: killed mid-upload of {killed_key}; {len(s3.keys('run/killed'))} whole objects checked")


@pytest.mark.slow
def test_server_killed_mid_upload_reaches_the_training_thread(moto_process, tmp_path):
    server = moto_process.start()
    env = fresh_bucket(server.endpoint, reset=False)
    options = {
        **env.storage_options,
        "part_size_bytes": "5MiB",
        "max_concurrent_parts": 1,
        "retries": 1,
        "timeout_s": 3,
    }
    plugin = DataStatesIO(storage_options=options)
    checkpoint = ModelCheckpoint(dirpath="s3://bucket/run", every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[checkpoint], max_epochs=-1, max_steps=10_000)
    killed_at: list[float] = []

    def kill_mid_upload() -> None:
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            uploads = env.client.list_multipart_uploads(Bucket="bucket").get("Uploads", [])
            for upload in uploads:
                if _has_parts(env, upload):
                    server.kill()
                    killed_at.append(time.monotonic())
                    return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_mid_upload, daemon=True)
    killer.start()
    with pytest.raises(CheckpointFlushError) as raised:
        trainer.fit(BNModel(width=1024), make_loader(n=256))  # ~13 MB checkpoints: 3 parts each
    raised_at = time.monotonic()
    killer.join(GUARD_S)
    assert killed_at, "no upload was seen in progress"
    assert raised_at - killed_at[0] < GUARD_S  # hang guard: the failure arrived
    assert raised.value.path.startswith("s3://bucket/run/") and raised.value.path in str(raised.value)
    assert isinstance(raised.value.__cause__, OSError)
    delay_s = raised_at - killed_at[0]
    print(f"\nS3 server kill: failure on the training thread {delay_s:.1f} s after the kill: {raised.value}")
