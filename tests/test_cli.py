"""``python -m lightning_datastates verify|inspect|clean``, run as real subprocesses on real files, S3 on moto's server.

Temporary files and open uploads for ``clean`` are left by real writers that were SIGKILLed mid-write.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from lightning_datastates import DataStatesIO
from lightning_datastates.archive import read_archive_index
from lightning_datastates.cli import main, summarize
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.records.leftovers import host_tag
from lightning_datastates.records.names import PENDING_SUFFIX
from tests.conftest import BNModel, dead_pid, every_step_checkpoint, make_loader, make_trainer, temp_files
from tests.s3_server import require_s3, s3_endpoint_fixture, s3_fixture  # noqa: F401 - fixtures
from tests.test_integrity import torch_crc_off

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 120


def _cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the command line in a fresh interpreter with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "lightning_datastates", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT, env=env, check=False)


def _flip_largest_record(path: str) -> str:
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    record = max(read_archive_index(lambda o, n: data[o : o + n], len(data)), key=lambda r: r.nbytes)
    data[record.data_offset + record.nbytes // 3] ^= 0x04
    with open(path, "wb") as handle:
        handle.write(data)
    return record.short_name


@pytest.fixture(scope="module")
def lightning_checkpoint(tmp_path_factory: Any) -> str:
    """A checkpoint written by the plugin during a real fit."""
    directory = tmp_path_factory.mktemp("fit")
    trainer = make_trainer(
        str(directory), DataStatesIO(), [every_step_checkpoint(str(directory / "ck"), save_top_k=1)], max_epochs=1
    )
    trainer.fit(BNModel(), make_loader())
    return str(directory / "ck" / "last.ckpt")


# ---------------------------------------------------------------------------------------------------- verify
def test_verify_passes_whole_files_and_fails_damaged_missing_and_unchecksummed_ones(
    lightning_checkpoint, tmp_path, capsys
) -> None:
    good = lightning_checkpoint
    damaged = str(tmp_path / "damaged.ckpt")
    shutil.copyfile(good, damaged)
    record = _flip_largest_record(damaged)
    unchecked = str(tmp_path / "nocrc.ckpt")
    with torch_crc_off():
        torch.save({"w": torch.randn(4)}, unchecked)

    assert main(["verify", good]) == 0  # in-process: each interpreter start costs seconds
    assert capsys.readouterr().out.startswith(f"OK {good}: ")

    result = _cli("verify", good, damaged, str(tmp_path / "missing.ckpt"), unchecked)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"OK {good}")
    assert lines[1].startswith(f"DAMAGED {damaged}") and record in lines[1]
    assert lines[2].startswith("ERROR") and "missing.ckpt" in lines[2]
    assert lines[3].startswith(f"UNVERIFIED {unchecked}") and "data/0" in lines[3]
    legacy = str(tmp_path / "legacy.ckpt")
    torch.save({"w": torch.randn(4)}, legacy, _use_new_zipfile_serialization=False)
    assert main(["verify", legacy]) == 1  # nothing to verify: not OK, and not damaged either
    assert capsys.readouterr().out.startswith(f"UNVERIFIED {legacy}: torch's legacy (non-zip) format")


def test_verify_reads_s3_urls(s3, capsys) -> None:
    url = s3.url("run/a.ckpt")
    plugin = DataStatesIO(storage_options=s3.storage_options)
    plugin.save_checkpoint({"w": torch.randn(5000), "epoch": 1}, url)
    assert main(["verify", url]) == 0  # the fixture points AWS_ENDPOINT_URL at the server, as a user's setup would
    assert capsys.readouterr().out.startswith(f"OK {url}")
    data = bytearray(s3.read("run/a.ckpt"))
    data[len(data) // 2 - 2000] ^= 0x01  # inside the 20 kB tensor
    s3.put("run/a.ckpt", bytes(data))
    result = _cli("--storage-options", json.dumps(s3.storage_options), "verify", url)
    assert result.returncode == 1 and result.stdout.startswith(f"DAMAGED {url}"), result.stdout + result.stderr
    assert "data/0" in result.stdout


# ---------------------------------------------------------------------------------------------------- inspect
def test_inspect_lists_every_tensor_without_loading_them(lightning_checkpoint, tmp_path, capsys) -> None:
    result = _cli("inspect", "--json", lightning_checkpoint)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    checkpoint = torch.load(lightning_checkpoint, weights_only=True)
    weight = checkpoint["state_dict"]["net.0.weight"]
    listed = {t["name"]: t for t in summary["tensors"]}
    assert listed["state_dict.net.0.weight"] == {
        "name": "state_dict.net.0.weight",
        "dtype": "float32",
        "shape": list(weight.shape),
        "nbytes": weight.nbytes,
    }
    assert "optimizer_states[0].state.0.exp_avg" in listed
    # The metadata-only read lists exactly what a full load holds.
    assert summary["tensors"] == summarize(checkpoint)["tensors"]
    assert summary["totals"] == summarize(checkpoint)["totals"]
    expected_tensors = summary["totals"]["tensors"]
    assert expected_tensors > len(checkpoint["state_dict"]) + len(checkpoint["optimizer_states"][0]["state"])
    assert set(summary["keys"]) >= {"epoch", "global_step", "state_dict", "optimizer_states"}
    # Tensor data is not read: a file whose payload is damaged is still listed (verify is what checks it).
    damaged = str(tmp_path / "damaged.ckpt")
    shutil.copyfile(lightning_checkpoint, damaged)
    _flip_largest_record(damaged)
    assert main(["inspect", damaged]) == 0
    text = capsys.readouterr().out
    assert "state_dict.net.0.weight" in text and "float32" in text and "256x32" in text
    assert text.splitlines()[-1].startswith(f"totals: {expected_tensors} tensors")


class _Opaque:
    """An object ``torch.load(weights_only=True)`` refuses."""


def test_inspect_lines_fit_100_columns_however_long_the_names(tmp_path, capsys) -> None:
    name = "model." + ".".join(f"block_with_a_long_name_{i}" for i in range(6)) + ".weight"
    torch.save({"state_dict": {name: torch.zeros(3, 4)}}, tmp_path / "long.ckpt")
    assert main(["inspect", str(tmp_path / "long.ckpt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    tensor_lines = [line for line in lines if line.startswith("  ")]
    assert tensor_lines and all(len(line) <= 100 for line in tensor_lines), tensor_lines
    assert tensor_lines[0].strip().startswith("state_dict.model.") and ".weight" in tensor_lines[0]


def test_storage_totals_of_a_metadata_only_read_are_the_records_sizes(tmp_path) -> None:
    """Fake storages count their file record's bytes (torch 2.7 makes them element_size times larger), for every
    dtype, and a storage shared by two tensors counts once."""
    weight = torch.randn(100)
    state = {"w": weight, "view": weight[10:20], "i": torch.arange(7), "h": torch.ones(3, dtype=torch.float16)}
    path = str(tmp_path / "small.pt")
    torch.save(state, path)
    result = _cli("inspect", "--json", path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["totals"]["storage_bytes"] == 100 * 4 + 7 * 8 + 3 * 2
    assert json.loads(result.stdout)["totals"]["storages"] == 3


def test_inspect_reports_unreadable_files(tmp_path, capsys, lightning_checkpoint) -> None:
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    assert main(["inspect", str(tmp_path / "junk.ckpt")]) == 1
    assert "cannot read it" in capsys.readouterr().err
    # A file cut short is damaged, not unsafe: the hint is verify, not --unsafe (as verify itself says "truncated").
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(open(lightning_checkpoint, "rb").read()[:-4096])
    assert main(["inspect", str(truncated)]) == 1
    error = capsys.readouterr().err
    assert "verify" in error and "--unsafe" not in error
    # An object weights_only refuses: there --unsafe is the way.
    torch.save({"object": _Opaque()}, tmp_path / "object.ckpt")
    assert main(["inspect", str(tmp_path / "object.ckpt")]) == 1
    assert "--unsafe" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.ckpt")]) == 1
    assert "no such checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- clean
_DIE_MID_WRITE = """
import os, signal, sys
from lightning_datastates.storage import writer_for
from lightning_datastates.storage import unnamed
url, options = sys.argv[1], {storage_options!r}
unnamed._UNNAMED_REFUSED.add(os.path.dirname(url))  # a named temporary file, as on NFS (an unnamed one leaves nothing)
session = writer_for(url, options).begin(url, {total_bytes})
session.write_range(0, memoryview(bytes({written_bytes})))
os.kill(os.getpid(), signal.SIGKILL)  # the writer dies mid-write: its temporary file or upload stays behind
"""


def _die_mid_write(url: str, total_bytes: int, written_bytes: int, storage_options: Any = None) -> None:
    code = _DIE_MID_WRITE.format(storage_options=storage_options, total_bytes=total_bytes, written_bytes=written_bytes)
    result = _cli(url, code=textwrap.dedent(code))
    assert result.returncode == -signal.SIGKILL, result.stderr


def test_clean_removes_the_temporary_file_of_a_killed_writer_only(tmp_path, refused_unnamed) -> None:
    directory = tmp_path / "run"
    _die_mid_write(str(directory / "a.ckpt"), 4096, 1024)
    dead = temp_files(str(directory))
    assert len(dead) == 1
    (directory / "keep.ckpt").write_bytes(b"a committed checkpoint")
    writer = pipeline_of(DataStatesIO()).writer_for(str(directory / "b.ckpt"))
    live = writer.begin(str(directory / "b.ckpt"), 10)  # this process
    try:
        result = _cli("clean", str(directory))
        assert result.returncode == 0, result.stderr
        assert f"removed {dead[0]}" in result.stdout
        assert temp_files(str(directory)) == [live.temp_path]  # type: ignore[attr-defined]
        assert (directory / "keep.ckpt").read_bytes() == b"a committed checkpoint"
    finally:
        live.abort()


def test_clean_of_a_missing_directory_or_a_file_fails_naming_what_to_give(tmp_path, capsys) -> None:
    """A typo, or a checkpoint file given instead of its directory, must not pass for "nothing to clean"."""
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.write_bytes(b"a checkpoint")
    assert main(["clean", str(tmp_path / "nowhere")]) == 1
    assert "no such directory" in capsys.readouterr().out
    assert main(["clean", str(checkpoint)]) == 1
    assert "is a file: give the checkpoint directory" in capsys.readouterr().out
    assert main(["clean", str(tmp_path)]) == 0


def test_clean_removes_a_sharded_save_that_died_in_flight(tmp_path) -> None:
    directory = tmp_path / "run"
    died = directory / "epoch=0-step=3.ckpt"  # a sharded save whose process died before the commit: no meta.pt
    died.mkdir(parents=True)
    (died / "__0_abc.distcp").write_bytes(b"x")
    (died / f".commit.{host_tag()}.{dead_pid()}.deadbeef{PENDING_SUFFIX}").write_bytes(b"")
    result = _cli("clean", str(directory))
    assert result.returncode == 0, result.stderr
    assert f"removed {died}" in result.stdout and not died.exists()


def test_clean_refuses_a_negative_age(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["clean", "--max-age-s", "-1", "somewhere"])
    assert "give a number of seconds >= 0" in capsys.readouterr().err


def test_clean_aborts_the_open_upload_of_a_killed_s3_writer(s3) -> None:
    url = s3.url("run/a.ckpt")
    options = {**s3.storage_options, "part_size_bytes": 5 * 1024**2}
    _die_mid_write(url, 12 * 1024**2, 5 * 1024**2, options)  # three parts: a multipart upload is open
    assert len(s3.open_uploads()) == 1
    # Its marker names a process of this host that is gone: aborted at once, without waiting for --max-age-s.
    result = _cli("--storage-options", json.dumps(s3.storage_options), "clean", s3.url("run"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"removed {url}" in result.stdout
    assert s3.open_uploads() == []


def test_help_is_plain_text(capsys) -> None:
    """``--help`` is read in a terminal: no reStructuredText markup from the docstrings."""
    for command in ([], ["verify"], ["inspect"], ["clean"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = capsys.readouterr().out
        assert "usage:" in text and "``" not in text and ":class:" not in text, text
