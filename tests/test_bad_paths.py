"""Bad paths and storage settings: each is a clear error at the save call, naming the problem and the fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from lightning_datastates import CheckpointFlushError, ConfigError, DataStatesIO
from tests.s3_server import require_s3, s3_endpoint_fixture, s3_fixture  # noqa: F401 - fixtures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _small() -> dict:
    return {"state_dict": {"w": torch.arange(1000, dtype=torch.float32)}, "epoch": 1}


def test_a_directory_where_a_file_is_expected(tmp_path):
    plugin = DataStatesIO()
    with pytest.raises(CheckpointFlushError) as raised:
        plugin.save_checkpoint(_small(), str(tmp_path))
    message = str(raised.value)
    assert str(tmp_path) in message and "is a directory" in message and "file name" in message
    assert os.listdir(tmp_path) == []
    plugin.teardown()


def test_a_file_where_a_directory_is_expected(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    plugin = DataStatesIO()
    with pytest.raises(CheckpointFlushError) as raised:
        plugin.save_checkpoint(_small(), str(tmp_path / "run" / "sub" / "x.ckpt"))
    message = str(raised.value)
    assert "is a file, not a directory" in message and "dirpath" in message
    assert f"{tmp_path / 'run'} is a file" in message  # the file itself, not a path below it that does not exist
    assert (tmp_path / "run").read_text() == "not a directory"
    plugin.teardown()


_NO_PERMISSION_SCRIPT = textwrap.dedent(
    """
    import os, sys, tempfile, torch
    from lightning_datastates import CheckpointFlushError, DataStatesIO
    with tempfile.TemporaryDirectory() as warm:  # one save first: torch imports some modules on first use
        DataStatesIO().save_checkpoint({"w": torch.ones(10)}, os.path.join(warm, "warm.ckpt"))
    if os.geteuid() == 0:  # root may write anywhere: drop to nobody for the check (after the imports)
        os.setgid(65534)
        os.setuid(65534)
    try:
        DataStatesIO().save_checkpoint({"w": torch.ones(10)}, os.path.join(sys.argv[1], "x.ckpt"))
    except CheckpointFlushError as exc:
        print(exc)
    else:
        print("NO ERROR")
    """
)


def test_no_write_permission():
    parent = tempfile.mkdtemp(prefix="datastates-readonly-")  # under /tmp: reachable for the unprivileged user
    directory = os.path.join(parent, "readonly")
    os.mkdir(directory, 0o555)
    os.chmod(directory, 0o555)
    os.chmod(parent, 0o755)
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run(
        [sys.executable, "-c", _NO_PERMISSION_SCRIPT, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    message = result.stdout.strip()
    try:
        assert directory in message and "Permission denied" in message and "writable" in message, message
        assert os.listdir(directory) == []
    finally:
        shutil.rmtree(parent)


def test_an_unknown_protocol():
    with pytest.raises(ValueError) as raised:
        DataStatesIO().save_checkpoint(_small(), "nosuchproto://bucket/x.ckpt")
    message = str(raised.value)
    assert "nosuchproto" in message and "Install its fsspec package" in message and "fix the URL" in message


def test_a_typo_in_storage_options_for_s3():
    pytest.importorskip("s3fs")
    with pytest.raises(ConfigError) as raised:
        DataStatesIO(storage_options={"endpoint": "http://127.0.0.1:1"}).save_checkpoint(_small(), "s3://b/x.ckpt")
    message = str(raised.value)
    assert "'endpoint'" in message and "did you mean 'endpoint_url'" in message and "storage_options" in message


def test_a_typo_in_storage_options_for_another_protocol():
    with pytest.raises(ValueError) as raised:
        DataStatesIO(storage_options={"skip_instance_cach": True}).save_checkpoint(_small(), "memory://run/x.ckpt")
    message = str(raised.value)
    assert "'skip_instance_cach'" in message and "did you mean 'skip_instance_cache'" in message
    assert "storage_options" in message


def test_a_misspelt_policy_names_the_accepted_values():
    with pytest.raises(ConfigError, match="on_flush_error must be 'raise' or 'warn', got 'rase'"):
        DataStatesIO(on_flush_error="rase")
    with pytest.raises(ConfigError, match="on_arena_full must be 'wait' or 'skip', got 'drop'"):
        DataStatesIO(on_arena_full="drop")
    with pytest.raises(ConfigError, match="stale_after_s must be a number of seconds >= 0"):
        DataStatesIO(stale_after_s=-1)


@pytest.mark.parametrize("nbytes", [1000, 3 * 5 * 1024**2], ids=["single-part", "multipart"])
def test_a_nonexistent_bucket_fails_at_the_save_call(s3, nbytes):
    plugin = DataStatesIO(storage_options={**s3.storage_options, "part_size_bytes": "5MiB"})
    path = "s3://no-such-bucket/run/x.ckpt"
    with pytest.raises(CheckpointFlushError) as raised:  # at once, not later in the background
        plugin.save_checkpoint({"w": torch.ones(nbytes // 4)}, path)
    message = str(raised.value)
    assert path in message and "'no-such-bucket' does not exist" in message and "create the bucket" in message
    plugin.teardown()
