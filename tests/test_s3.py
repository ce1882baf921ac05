"""S3 through the multipart writer, against a real S3 API on loopback (moto's server; see tests/s3_server.py).

The storage contract suite runs against S3 too (the "s3" harness of tests/test_storage_contract.py); here is what is
specific to S3: multipart parts, back-pressure, failures of the server (a vanished upload, SIGSTOP, SIGKILL), stale
uploads, and the Trainer round trip on ``s3://`` URLs.
"""

from __future__ import annotations

import io
import math
import os
import random
import sys
import threading
import time
from typing import Any

import fsspec
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import CheckpointFlushError, DataStatesIO
from lightning_datastates.compat.lightning import override_file_exists
from lightning_datastates.errors import ConfigError
from lightning_datastates.load.reader import load_checkpoint
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.storage import writer_for
from lightning_datastates.storage.s3 import (
    MAX_PART_BYTES,
    MAX_PARTS,
    MIN_PART_BYTES,
    S3NotFoundError,
    S3WriteError,
    S3Writer,
    fetch_into_memfd,
    plan_parts,
)
from lightning_datastates.streams import BufferReader
from tests.conftest import BNModel, RecordingDataStatesIO, assert_bit_equal, in_background, make_loader, make_trainer
from tests.s3_server import (  # noqa: F401 - the *_fixture imports register the fixtures s3, moto_process, ...
    fresh_bucket,
    moto_process_fixture,
    require_s3,
    s3_endpoint_fixture,
    s3_fixture,
)
from tests.test_storage_contract import JOIN_S, _write_in_threads

MiB = 1024**2
P = 5 * MiB  # the smallest part S3 (and moto) accepts


@pytest.fixture(autouse=True)
def _needs_s3() -> None:
    require_s3()


def _writer(env, **tunables) -> S3Writer:
    settings = {"part_size_bytes": P, "retries": 1, "timeout_s": 10.0}
    settings.update(tunables)
    return S3Writer(env.storage_options, **settings)


@pytest.fixture
def no_thread_escapes(monkeypatch):
    """Collect exceptions that escape any thread (there must be none)."""
    escaped: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    yield escaped
    assert escaped == [], f"exceptions escaped threads: {escaped!r}"


# ---------------------------------------------------------------------------------------------------- part plan (pure)
def test_part_plan_respects_s3_limits():
    assert plan_parts(0, P) == plan_parts(0, P) and plan_parts(0, P).count == 1 and not plan_parts(0, P).multipart
    assert not plan_parts(P, P).multipart  # exactly one part: a single PutObject
    plan = plan_parts(2 * P + 1, P)
    assert (plan.count, plan.length(0), plan.length(2)) == (3, P, 1)
    assert plan_parts(100, 1).part_bytes == MIN_PART_BYTES  # clamped up to 5 MiB
    assert plan_parts(100, 10 * 1024**3).part_bytes == MAX_PART_BYTES  # clamped down to 5 GiB
    huge = plan_parts(5 * 1024**4, 64 * MiB)  # 5 TiB: 64 MiB parts would be 81,920 parts
    assert huge.count <= MAX_PARTS and huge.part_bytes % MiB == 0 and huge.part_bytes <= MAX_PART_BYTES
    assert (huge.count - 1) * huge.part_bytes < huge.total_bytes <= huge.count * huge.part_bytes
    with pytest.raises(ValueError, match="5 TiB"):
        plan_parts(5 * 1024**4 + 1, 64 * MiB)


# ---------------------------------------------------------------------------------------------------- multipart driver
@pytest.mark.parametrize("seed", [0, 1])
def test_multipart_out_of_order_ranges_from_threads(s3, seed):
    rng = random.Random(seed)
    data = rng.randbytes(2 * P + rng.randint(1, P))  # three parts, the last one short
    writer = _writer(s3, max_concurrent_parts=2)
    path = s3.url(f"run/seed{seed}.ckpt")
    session = writer.begin(path, len(data))
    assert session.upload_id is not None and s3.open_uploads() == [f"run/seed{seed}.ckpt"]
    _write_in_threads(session, data, rng, threads=4)
    assert s3.read(f"run/seed{seed}.ckpt") is None, "visible before complete"
    session.complete()
    assert s3.read(f"run/seed{seed}.ckpt") == data
    assert s3.etag(f"run/seed{seed}.ckpt").strip('"').endswith("-3")  # a real three-part multipart upload


def test_incomplete_parts_never_block_and_queued_parts_apply_back_pressure(moto_process):
    server = moto_process.start()
    env = fresh_bucket(server.endpoint, reset=False)
    writer = _writer(env, max_concurrent_parts=1, timeout_s=30.0)
    data = os.urandom(8 * P + 10)
    view = memoryview(data)
    path = env.url("bp.ckpt")
    session = writer.begin(path, len(data))
    started = time.monotonic()
    for i in range(9):  # the first half of every part: nothing complete, nothing queued, nothing waits
        session.write_range(i * P, view[i * P : i * P + min(P, len(data) - i * P) // 2])
    server.pause()  # the server stops answering: uploads hang
    try:
        for i in range(3):  # complete three parts: one in flight, two queued (the limit is 2 * max_concurrent_parts)
            session.write_range(i * P + P // 2, view[i * P + P // 2 : (i + 1) * P])
        assert time.monotonic() - started < 5.0, "write_range waited although at most 3 parts were queued"
        blocked = threading.Thread(target=session.write_range, args=(3 * P + P // 2, view[3 * P + P // 2 : 4 * P]))
        blocked.start()
        blocked.join(1.0)
        assert blocked.is_alive(), "write_range did not wait with 3 parts queued behind a stalled server"
    finally:
        server.resume()
    blocked.join(JOIN_S)
    assert not blocked.is_alive()
    for i in range(4, 9):
        length = min(P, len(data) - i * P)
        session.write_range(i * P + length // 2, view[i * P + length // 2 : i * P + length])
    session.complete()
    assert env.read("bp.ckpt") == data and env.etag("bp.ckpt").strip('"').endswith("-9")
    assert env.open_uploads() == []


def test_a_failed_part_names_the_path_and_abort_leaves_nothing(s3):
    writer = _writer(s3)
    s3.put("run/x.ckpt", b"earlier checkpoint")
    path = s3.url("run/x.ckpt")
    session = writer.begin(path, 3 * P)
    s3.abort_all_uploads()  # the upload vanishes under the writer (a lifecycle rule, another process)
    data = memoryview(os.urandom(3 * P))
    with pytest.raises(S3WriteError) as raised:
        for i in range(3):
            session.write_range(i * P, data[i * P : (i + 1) * P])
        session.complete()
    assert path in str(raised.value) and "part" in str(raised.value)
    session.abort()
    session.abort()  # safe twice
    assert s3.read("run/x.ckpt") == b"earlier checkpoint" and s3.open_uploads() == []


def test_abort_with_parts_in_flight_leaves_no_open_upload(s3):
    writer = _writer(s3, max_concurrent_parts=4)
    path = s3.url("run/aborted.ckpt")
    session = writer.begin(path, 5 * P)
    data = memoryview(os.urandom(3 * P))
    for i in range(3):
        session.write_range(i * P, data[i * P : (i + 1) * P])  # three parts scheduled
    session.abort()
    assert s3.open_uploads() == [] and s3.read("run/aborted.ckpt") is None
    with pytest.raises(RuntimeError):
        session.write_range(3 * P, data[:P])
    with pytest.raises(RuntimeError):
        session.complete()


def test_complete_refuses_a_file_with_holes(s3):
    session = _writer(s3).begin(s3.url("holes.ckpt"), 2 * P)
    session.write_range(0, memoryview(os.urandom(P)))
    with pytest.raises(S3WriteError, match="never written"):
        session.complete()
    assert s3.open_uploads() == [] and s3.read("holes.ckpt") is None


def test_begin_in_a_missing_bucket_fails_at_once_naming_the_path(s3):
    writer = _writer(s3)
    with pytest.raises(S3NotFoundError) as raised:
        writer.begin("s3://no-such-bucket/run/x.ckpt", 3 * P)
    assert "s3://no-such-bucket/run/x.ckpt" in str(raised.value) and isinstance(raised.value, OSError)


def test_a_writer_built_before_a_fork_works_in_the_child(s3):
    """s3fs file systems are not fork-safe: the writer builds new clients in a forked child (ddp_fork builds the
    plugin before forking)."""
    writer = _writer(s3)
    writer.exists(s3.url("run/warm"))  # the parent's clients are in use
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        try:
            session = writer.begin(s3.url("run/child.ckpt"), 5)
            session.write_range(0, memoryview(b"child"))
            session.complete()
            os._exit(0 if writer.exists(s3.url("run/child.ckpt")) else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    deadline = time.monotonic() + JOIN_S  # hang guard: a child on the parent's clients waits forever
    while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if ended[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the parent's S3 clients")
    status = ended[1]
    assert os.waitstatus_to_exitcode(status) == 0
    assert s3.read("run/child.ckpt") == b"child" and writer.exists(s3.url("run/child.ckpt"))


# ---------------------------------------------------------------------------------------------------- other operations
def test_remove_deletes_the_object_and_its_prefix_tree_only(s3):
    for key in ("run/a.ckpt", "run/a.ckpt/shard_0", "run/a.ckpt/sub/.metadata", "run/a.ckpt2", "run/b.ckpt"):
        s3.put(key, b"x")
    writer = _writer(s3)
    writer.remove(s3.url("run/a.ckpt"))
    assert s3.keys() == ["run/a.ckpt2", "run/b.ckpt"]
    writer.remove(s3.url("run/a.ckpt"))  # missing: fine
    assert not writer.exists(s3.url("run/a.ckpt")) and writer.exists(s3.url("run/b.ckpt"))


def _requests_of(writer: S3Writer, monkeypatch, before=None, after=None) -> list[tuple[str, dict]]:
    """Record each S3 request the writer's client makes (method, arguments). A fault injected at one precise request:
    ``before(method, kwargs)`` may raise instead of sending it; ``after(method, kwargs, response)`` may change the
    response."""
    client = writer.client
    call = client.call
    made: list[tuple[str, dict]] = []

    async def recorded(method, **kwargs):
        made.append((method, kwargs))
        if before is not None:
            before(method, kwargs)
        response = await call(method, **kwargs)
        return response if after is None else after(method, kwargs, response)

    monkeypatch.setattr(client, "call", recorded)
    return made


def _keys_sent(made: list[tuple[str, dict]]) -> list[list[str]]:
    return [[o["Key"] for o in kw["Delete"]["Objects"]] if m == "delete_objects" else [kw["Key"]] for m, kw in made]


def test_remove_files_deletes_many_objects_in_one_request_per_thousand_and_one_with_delete_object(s3, monkeypatch):
    import lightning_datastates.storage.s3.deletes as deletes_module

    names = [f"__{rank}_t.distcp" for rank in range(5)]
    for name in [*names, "meta.pt", ".record"]:
        s3.put(f"run/a.ckpt/{name}", b"x")
    writer = _writer(s3)
    made = _requests_of(writer, monkeypatch)
    writer.remove_files(s3.url("run/a.ckpt"), names[:2])
    writer.remove_files(s3.url("run/a.ckpt/"), [".record"])
    assert [method for method, _ in made] == ["delete_objects", "delete_object"]  # no listing, unlike remove()
    monkeypatch.setattr(deletes_module, "DELETE_BATCH", 2)
    writer.remove_files(s3.url("run/a.ckpt"), [*names[2:], "missing"])
    assert _keys_sent(made[2:]) == [
        [f"run/a.ckpt/{n}" for n in names[2:4]],
        ["run/a.ckpt/__4_t.distcp", "run/a.ckpt/missing"],
    ]
    assert s3.keys() == ["run/a.ckpt/meta.pt"]


def test_remove_files_retries_only_the_keys_refused_for_a_while_and_names_those_refused_for_good(s3, monkeypatch):
    for name in ("a", "b", "c", "d"):
        s3.put(f"run/d/{name}", b"x")
    writer = _writer(s3)

    def refuse(method, kwargs, response):  # S3 answers 200 and lists the keys it did not delete
        if len(kwargs["Delete"]["Objects"]) == 4:  # the first request only
            errors = [
                {"Key": "run/d/b", "Code": "SlowDown", "Message": "slow down (injected)"},
                {"Key": "run/d/c", "Code": "AccessDenied", "Message": "refused (injected)"},
            ]
            return {**response, "Errors": errors}
        return response

    made = _requests_of(writer, monkeypatch, after=refuse)
    with pytest.raises(S3WriteError, match=r"removing 4 file.*run/d.*AccessDenied: run/d/c: refused.*credentials"):
        writer.remove_files(s3.url("run/d"), ["a", "b", "c", "d"])
    # The retry sends the key refused for a while alone; the one refused for good is not sent again, but named.
    assert _keys_sent(made) == [["run/d/a", "run/d/b", "run/d/c", "run/d/d"], ["run/d/b"]]


def test_remove_of_a_directory_refused_in_part_raises_instead_of_reporting_it_removed(s3, monkeypatch):
    """A DeleteObjects answer listing a key S3 did not delete (here meta.pt): the removal of a sharded checkpoint's
    directory must not report success over a directory holding part of a checkpoint."""
    for name in ("__0_t.distcp", "__1_t.distcp", "meta.pt"):
        s3.put(f"run/a.ckpt/{name}", b"x")
    writer = _writer(s3)

    def refuse_meta(method, kwargs, response):
        if method == "delete_objects":
            return {**response, "Errors": [{"Key": "run/a.ckpt/meta.pt", "Code": "AccessDenied", "Message": "no"}]}
        return response

    _requests_of(writer, monkeypatch, after=refuse_meta)
    with pytest.raises(S3WriteError, match=r"removing s3://.*run/a.ckpt failed: AccessDenied: run/a.ckpt/meta.pt"):
        writer.remove(s3.url("run/a.ckpt"))


@pytest.mark.parametrize("code,status", [("NotImplemented", 501), ("MissingContentMD5", 400)])
def test_remove_files_deletes_one_object_at_a_time_where_deleteobjects_is_refused(s3, monkeypatch, code, status):
    """Services that do not implement DeleteObjects, or want the Content-MD5 header botocore no longer sends."""
    from botocore.exceptions import ClientError

    for name in ("a", "b", "c", "d"):
        s3.put(f"run/d/{name}", b"x")
    writer = _writer(s3)

    def refuse_batches(method, kwargs):
        if method == "delete_objects":
            error = {
                "Error": {"Code": code, "Message": "refused (injected)"},
                "ResponseMetadata": {"HTTPStatusCode": status},
            }
            raise ClientError(error, "DeleteObjects")

    made = _requests_of(writer, monkeypatch, before=refuse_batches)
    writer.remove_files(s3.url("run/d"), ["a", "b"])
    writer.remove_files(s3.url("run/d"), ["c", "d"])  # known now: no second try
    assert [method for method, _ in made] == ["delete_objects"] + ["delete_object"] * 4
    assert s3.keys("run/d") == []


def test_clean_stale_aborts_old_foreign_uploads_in_the_directory_only(s3):
    # moto dates every upload 2010-11-10: all look older than an hour, like uploads a crashed run left.
    foreign = s3.client.create_multipart_upload(Bucket=s3.bucket, Key="run/crashed.ckpt")["UploadId"]
    nested = s3.client.create_multipart_upload(Bucket=s3.bucket, Key="run/sub/other.ckpt")["UploadId"]
    writer = _writer(s3)
    mine = writer.begin(s3.url("run/inflight.ckpt"), 2 * P)  # this process's own upload: never touched
    assert writer.clean_stale(s3.url("run")) == ["s3://bucket/run/crashed.ckpt"]
    assert s3.open_uploads() == ["run/inflight.ckpt", "run/sub/other.ckpt"]
    data = os.urandom(2 * P)
    mine.write_range(0, memoryview(data))
    mine.complete()
    assert s3.read("run/inflight.ckpt") == data
    s3.client.abort_multipart_upload(Bucket=s3.bucket, Key="run/sub/other.ckpt", UploadId=nested)
    assert foreign and writer.clean_stale("s3://no-such-bucket/run") == []


def test_read_bytes_fetches_ranges_concurrently_and_bit_exact(s3):
    data = os.urandom(3 * 8 * MiB + 123)
    s3.put("big.bin", data)
    writer = _writer(s3, max_concurrent_parts=3)
    assert writer.range_bytes_for(len(data)) == math.ceil(len(data) / 3)  # the window filled once
    assert writer.range_bytes_for(1000) == 8 * MiB  # never below 8 MiB
    assert bytes(writer.read_bytes(s3.url("big.bin"))) == data
    fixed = _writer(s3, max_concurrent_parts=2, read_range_bytes="5MiB")
    assert fixed.range_bytes_for(len(data)) == 5 * MiB  # five ranges, two at a time
    assert bytes(fixed.read_bytes(s3.url("big.bin"))) == data
    s3.put("empty.bin", b"")
    assert writer.read_bytes(s3.url("empty.bin")) == bytearray()
    with pytest.raises(FileNotFoundError):
        writer.read_bytes(s3.url("missing.bin"))


def test_load_goes_through_an_in_memory_file_mapped_by_torch_and_honors_map_location(s3):
    checkpoint = {"state_dict": {"w": torch.randn(3 * MiB), "b": torch.arange(7)}, "epoch": 2}
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    s3.put("run/plain.ckpt", buffer.getvalue())  # a plain torch.save file: CRC-32s present
    writer = _writer(s3, max_concurrent_parts=4, read_range_bytes="5MiB")
    fd = fetch_into_memfd(writer, s3.url("run/plain.ckpt"))
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:datastates-load")
        assert os.fstat(fd).st_size == len(buffer.getvalue())
        assert os.pread(fd, len(buffer.getvalue()), 0) == buffer.getvalue()
    finally:
        os.close(fd)
    loaded = load_checkpoint(writer, s3.url("run/plain.ckpt"), weights_only=True)
    assert_bit_equal(loaded, checkpoint)
    loaded["state_dict"]["w"].add_(1)  # copy-on-write: writable, and the object is untouched
    meta = load_checkpoint(writer, s3.url("run/plain.ckpt"), map_location="meta", weights_only=True)
    assert meta["state_dict"]["w"].device.type == "meta" and meta["epoch"] == 2
    with pytest.raises(FileNotFoundError):
        load_checkpoint(writer, s3.url("run/missing.ckpt"))


def test_buffer_reader_reads_seeks_and_loads_without_copying_the_buffer():
    buffer = io.BytesIO()
    state = {"w": torch.randn(1000), "step": 3}
    torch.save(state, buffer)
    raw = bytearray(buffer.getvalue())
    reader = BufferReader(raw)
    assert reader.read(2) == bytes(raw[:2]) and reader.tell() == 2
    assert reader.seek(-3, os.SEEK_END) == len(raw) - 3 and reader.read() == bytes(raw[-3:])
    assert reader.seek(0) == 0 and reader.seek(5, os.SEEK_CUR) == 5
    with pytest.raises(ValueError):
        reader.seek(-1)
    reader.seek(0)
    assert_bit_equal(torch.load(reader, weights_only=True), state)


def test_writer_for_routes_s3_and_checks_options(s3):
    assert isinstance(writer_for("s3://bucket/run/x.ckpt"), S3Writer)
    assert isinstance(writer_for("s3a://bucket/run/x.ckpt"), S3Writer)
    tuned = writer_for(
        "s3://bucket/x", {"part_size_bytes": "8MiB", "max_concurrent_parts": 4, "retries": 0, "timeout_s": 5}
    )
    assert (tuned.part_size_bytes, tuned.max_concurrent_parts, tuned.retries, tuned.timeout_s) == (8 * MiB, 4, 0, 5.0)
    with pytest.raises(ValueError, match="endpoint_url"):
        writer_for("s3://bucket/x", {"endpont_url": "http://x"})
    with pytest.raises(ConfigError, match="max_concurrent_parts"):
        writer_for("s3://bucket/x", {"max_concurrent_parts": 0})
    with pytest.raises(ConfigError, match="part_size_bytes"):
        writer_for("s3://bucket/x", {"part_size_bytes": "lots"})


def test_writer_for_s3_without_s3fs_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    with pytest.raises(ValueError, match=r"pip install lightning-datastates\[s3\]"):
        writer_for("s3://bucket/x")


# ---------------------------------------------------------------------------------------------------- the plugin
def test_plugin_multipart_checkpoint_with_storage_options_instead_of_env(s3, monkeypatch, no_thread_escapes):
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    options = {**s3.storage_options, "part_size_bytes": "5MiB", "max_concurrent_parts": 4}
    plugin = DataStatesIO(storage_options=options, chunk_size="4MiB")
    checkpoint = {"state_dict": {"w": torch.randn(4 * MiB), "b": torch.arange(10)}, "epoch": 1}  # ~16 MiB
    path = s3.url("run/big.ckpt")
    plugin.save_checkpoint(checkpoint, path)
    plugin.drain()
    pipeline_of(plugin).raise_pending_failure()
    size = s3.client.head_object(Bucket=s3.bucket, Key="run/big.ckpt")["ContentLength"]
    assert size > 3 * P and s3.etag("run/big.ckpt").strip('"').endswith(f"-{math.ceil(size / P)}")
    assert_bit_equal(plugin.load_checkpoint(path, weights_only=True), checkpoint)
    with s3.client.get_object(Bucket=s3.bucket, Key="run/big.ckpt")["Body"] as body:  # a plain torch file
        assert_bit_equal(torch.load(io.BytesIO(body.read()), weights_only=True), checkpoint)
    plugin.remove_checkpoint(path)
    assert s3.keys() == []


def test_trainer_top_k_on_s3_matches_a_synchronous_run_bit_exact_and_resumes(s3, no_thread_escapes, tmp_path):
    def checkpoint_callback(dirpath: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=2, monitor="train_loss")

    torch.manual_seed(0)
    reference = make_trainer(
        str(tmp_path / "sync"), None, callbacks=[checkpoint_callback("s3://bucket/sync")], max_epochs=1
    )
    reference.fit(BNModel(), make_loader())
    expected_names = [key.rsplit("/", 1)[1] for key in s3.keys("sync/")]
    assert len(expected_names) == 2

    torch.manual_seed(0)
    plugin = RecordingDataStatesIO(chunk_size="64KiB")
    trainer = make_trainer(
        str(tmp_path / "async"), plugin, callbacks=[checkpoint_callback("s3://bucket/run")], max_epochs=1
    )
    trainer.fit(BNModel(), make_loader())
    assert [key.rsplit("/", 1)[1] for key in s3.keys("run/")] == expected_names
    assert len(plugin.recorded) > 2  # saved only when in the top 2; the rest were removed
    for path, expected in plugin.recorded.items():
        if path.rsplit("/", 1)[1] in expected_names:
            assert_bit_equal(plugin.load_checkpoint(path, weights_only=False), expected, path)
        else:
            assert s3.read(s3.key_of(path)) is None, f"top-k removal left {path}"

    resumed = make_trainer(str(tmp_path / "resumed"), DataStatesIO(), max_epochs=2, enable_checkpointing=False)
    resumed.fit(BNModel(), make_loader(), ckpt_path=f"s3://bucket/run/{expected_names[-1]}")
    assert resumed.global_step == 16


def _parts_received(env, key: str) -> int:
    """Parts the server holds for the open upload of ``key`` (observed from outside, with the test's own client)."""
    uploads = [u for u in env.client.list_multipart_uploads(Bucket=env.bucket).get("Uploads", []) if u["Key"] == key]
    if not uploads:
        return 0
    return len(env.client.list_parts(Bucket=env.bucket, Key=key, UploadId=uploads[0]["UploadId"]).get("Parts", []))


def test_server_killed_mid_upload_fails_loudly_and_the_plugin_recovers(moto_process, no_thread_escapes):
    server = moto_process.start()
    env = fresh_bucket(server.endpoint, reset=False)
    options = {
        **env.storage_options,
        "part_size_bytes": "5MiB",
        "max_concurrent_parts": 1,
        "retries": 1,
        "timeout_s": 3,
    }
    plugin = in_background(DataStatesIO(storage_options=options))  # as in training: the flush is pending
    path = env.url("run/big.ckpt")
    plugin.save_checkpoint({"state_dict": {"w": torch.randn(32 * MiB)}}, path)  # 128 MiB: ~26 parts, one at a time
    deadline = time.monotonic() + 30
    while _parts_received(env, "run/big.ckpt") == 0:  # kill mid-transfer: some parts stored, the rest to come
        assert time.monotonic() < deadline and pipeline_of(plugin).is_pending(path)
        time.sleep(0.01)
    server.kill()
    failure = _failure_within(plugin, 30)
    assert failure.path == path and path in str(failure) and isinstance(failure.__cause__, OSError)
    assert "part" in str(failure.__cause__) and "part 1/" not in str(failure.__cause__)
    plugin.drain()
    pipeline_of(plugin).raise_pending_failure()  # raised once: nothing more

    server.start()  # the same port; moto lost every bucket and upload with the process
    env = fresh_bucket(server.endpoint, reset=False)
    small = {"state_dict": {"w": torch.randn(3 * MiB)}, "step": 2}  # 12 MiB: multipart again
    plugin.save_checkpoint(small, path)
    plugin.drain()
    pipeline_of(plugin).raise_pending_failure()
    assert_bit_equal(plugin.load_checkpoint(path, weights_only=True), small)
    assert env.open_uploads() == []


def _failure_within(plugin: DataStatesIO, seconds: float) -> CheckpointFlushError:
    """The background failure, once the training thread sees it; fails the test if that takes over ``seconds``."""
    started = time.monotonic()
    while True:
        assert time.monotonic() - started < seconds, f"the failure did not reach the training thread within {seconds} s"
        try:
            pipeline_of(plugin).raise_pending_failure()
        except CheckpointFlushError as exc:
            return exc
        time.sleep(0.05)


def test_server_stalled_mid_upload_fails_within_seconds_and_the_previous_checkpoint_stays_whole(
    moto_process, no_thread_escapes
):
    """A server that stops answering (SIGSTOP) mid-upload of a checkpoint that *replaces* an earlier one: the
    failure reaches the training thread within the bounded timeouts, nothing partial is ever visible, the earlier
    object is intact, and no multipart upload is left open once the server answers again. (A SIGKILLed moto loses
    every object, so "the previous checkpoint is intact" is checked here, with a server that survives.)"""
    server = moto_process.start()
    env = fresh_bucket(server.endpoint, reset=False)
    options = {**env.storage_options, "part_size_bytes": "5MiB", "max_concurrent_parts": 1, "retries": 1}
    # min_bytes_per_s: each attempt of a 5 MiB part gets 2 s and 5 ms, not 2 s + 2.5 s at the default 2 MiB/s (a send
    # the stopped server no longer reads is bounded by that allowance, not by timeout_s), as the bound below assumes.
    plugin = in_background(DataStatesIO(storage_options={**options, "timeout_s": 2, "min_bytes_per_s": "1GiB"}))
    path = env.url("run/model.ckpt")
    earlier = {"state_dict": {"w": torch.randn(3 * MiB)}, "step": 1}  # 12 MiB: three parts
    plugin.save_checkpoint(earlier, path)
    plugin.drain()
    pipeline_of(plugin).raise_pending_failure()
    earlier_bytes = env.read("run/model.ckpt")
    plugin.save_checkpoint({"state_dict": {"w": torch.randn(32 * MiB)}, "step": 2}, path)  # 128 MiB, one part at a time
    deadline = time.monotonic() + 30
    while _parts_received(env, "run/model.ckpt") == 0:
        assert time.monotonic() < deadline and pipeline_of(plugin).is_pending(path)
        time.sleep(0.01)
    server.pause()
    stalled = time.monotonic()
    try:
        failure = _failure_within(plugin, 30)
    finally:
        server.resume()
    delay_s = time.monotonic() - stalled
    assert failure.path == path and "no answer within timeout_s" in str(failure.__cause__)
    assert delay_s < 20  # 2 s per attempt, 2 attempts per request: the part, then the abort
    plugin.drain()
    assert env.read("run/model.ckpt") == earlier_bytes  # the earlier checkpoint, whole; nothing partial
    assert_bit_equal(plugin.load_checkpoint(path, weights_only=True), earlier)
    # The abort was sent while the server slept; if it was lost, the next run's clean-up (here: now) aborts it.
    pipeline_of(plugin).clean_stale("s3://bucket/run")
    assert env.open_uploads() == []
    assert [k for k in env.keys("run/") if k != "run/model.ckpt"] == []  # the upload marker went with it
    plugin.teardown()


def test_many_lazy_checkpoints_with_removals_keep_exactly_the_survivors_bit_exact(s3, no_thread_escapes):
    options = {**s3.storage_options, "part_size_bytes": "5MiB", "max_concurrent_parts": 4}
    plugin = in_background(DataStatesIO(storage_options=options, chunk_size="1MiB"), lazy=True)
    expected = {}
    weights = torch.randn(3 * MiB)
    for step in range(24):
        size = (step % 3) * 1536 * 1024 + 1000  # 4 KB to 12 MiB: single-put and multipart objects
        checkpoint = {"state_dict": {"w": weights[:size], "b": torch.full((5,), step)}, "step": step}
        expected[step] = {"state_dict": {"w": weights[:size].clone(), "b": torch.full((5,), step)}, "step": step}
        plugin.save_checkpoint(checkpoint, s3.url(f"run/step={step:02d}.ckpt"))
        # as the callback does before the optimizer step: copies done, training may mutate
        pipeline_of(plugin).barrier()
        weights.add_(1)  # the optimizer step: the files must not see it
        if step >= 3:
            plugin.remove_checkpoint(s3.url(f"run/step={step - 3:02d}.ckpt"))  # keep the last three
    plugin.drain()
    pipeline_of(plugin).raise_pending_failure()
    assert s3.keys("run/") == [f"run/step={step}.ckpt" for step in (21, 22, 23)]
    for step in (21, 22, 23):
        assert_bit_equal(plugin.load_checkpoint(s3.url(f"run/step={step}.ckpt"), weights_only=True), expected[step])
    plugin.teardown()


def test_whole_parts_go_up_from_the_callers_memory_before_write_range_returns(moto_process):
    """A range holding whole parts is sent from the caller's buffer (no copy of the parts is made) and
    ``write_range`` returns only once those parts are stored: the caller may then reuse its buffer at once.

    The server runs in its own process, so what is allocated here is the client's: measured 0.63 part in all
    (botocore reads a file body in pieces), against 4.4 parts when the driver copied each part before sending it.
    """
    import tracemalloc

    server = moto_process.start()
    s3 = fresh_bucket(server.endpoint, reset=False)
    writer = _writer(s3, max_concurrent_parts=4)
    data = bytearray(os.urandom(4 * P + 1000))
    expected = bytes(data)
    session = writer.begin(s3.url("run/zero-copy.ckpt"), len(data))
    view = memoryview(data)
    writer.exists(s3.url("run/other"))  # warm the clients: their first use allocates
    tracemalloc.start()
    try:
        session.write_range(0, view[: 4 * P])  # four whole parts
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * P, f"{peak} bytes allocated while sending 4 parts of {P}: the parts were copied"
    upload = s3.client.list_multipart_uploads(Bucket=s3.bucket)["Uploads"][0]
    parts = s3.client.list_parts(Bucket=s3.bucket, Key="run/zero-copy.ckpt", UploadId=upload["UploadId"])["Parts"]
    assert [p["PartNumber"] for p in parts] == [1, 2, 3, 4]  # stored before write_range returned
    data[: 4 * P] = bytes(4 * P)  # the caller reuses its buffer
    session.write_range(4 * P, view[4 * P :])  # the short last part
    session.complete()
    assert s3.read("run/zero-copy.ckpt") == expected
    assert s3.open_uploads() == []


def test_fit_with_ckpt_path_last_resumes_from_last_ckpt_on_s3(s3, tmp_path):
    """Lightning alone cannot: it lists the ModelCheckpoint's S3 directory without the protocol, finds no
    ``last.ckpt`` on the local disk and trains from scratch (Lightning-AI/pytorch-lightning#18261). With the plugin the
    run resumes from the newest ``last.ckpt``: its path, and the weights of an uninterrupted run."""

    def fit(name: str, max_epochs: int, ckpt_path: str | None = None, into: str = "s3://bucket/last") -> Any:
        checkpoint = ModelCheckpoint(dirpath=into, every_n_epochs=1, save_last=True, save_top_k=0)
        torch.manual_seed(0)
        trainer = make_trainer(str(tmp_path / name), DataStatesIO(), callbacks=[checkpoint], max_epochs=max_epochs)
        trainer.fit(BNModel(), make_loader(), ckpt_path=ckpt_path)
        return trainer

    fit("first", 1)
    resumed = fit("resumed", 2, "last")
    assert resumed.ckpt_path == "s3://bucket/last/last.ckpt"  # not a fresh start, which would end with the same weights
    assert resumed.global_step == 16
    uninterrupted = fit("uninterrupted", 2, into="s3://bucket/uninterrupted")
    assert_bit_equal(resumed.lightning_module.state_dict(), uninterrupted.lightning_module.state_dict(), "resumed")


def test_modelcheckpoint_works_at_an_endpoint_given_only_to_the_plugin(s3, tmp_path, monkeypatch):
    """No ``AWS_*`` variable: the endpoint and the credentials reach the plugin alone, through ``storage_options``.
    ModelCheckpoint's own file system (made by Lightning without them) would ask AWS: its setup's listing of a
    non-empty directory, its names, top-k, ``last.ckpt`` and ``ckpt_path="last"`` must all reach the moto server."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)

    def fit(name: str, max_epochs: int, ckpt_path: str | None = None) -> Any:
        checkpoint = ModelCheckpoint(
            dirpath=s3.url("endpoint"), every_n_train_steps=4, save_top_k=2, monitor="train_loss", save_last=True
        )
        torch.manual_seed(0)
        plugin = DataStatesIO(storage_options={**s3.storage_options, "retries": 1, "timeout_s": 10})
        trainer = make_trainer(str(tmp_path / name), plugin, callbacks=[checkpoint], max_epochs=max_epochs)
        trainer.fit(BNModel(), make_loader(), ckpt_path=ckpt_path)
        return trainer

    fit("first", 1)
    assert sorted(key.rsplit("/", 1)[1] for key in s3.keys("endpoint/")) == [
        "epoch=0-step=4.ckpt",
        "epoch=0-step=8.ckpt",
        "last.ckpt",
    ]
    resumed = fit("resumed", 2, "last")  # the directory is not empty: ModelCheckpoint's setup lists it
    assert resumed.ckpt_path == s3.url("endpoint/last.ckpt") and resumed.global_step == 16
    assert "last-v1.ckpt" not in {key.rsplit("/", 1)[1] for key in s3.keys("endpoint/")}


def test_modelcheckpoint_asks_storage_not_its_listing_cache_whether_a_file_exists(s3, tmp_path):
    """ModelCheckpoint's own s3fs instance caches listings (resolving ``ckpt_path="last"`` lists the directory); the
    plugin's writers change storage behind it, so a file they removed must not count as existing (ModelCheckpoint
    would save ``last-v1.ckpt`` instead of ``last.ckpt``)."""
    s3.put("cached/last.ckpt", b"x")
    checkpoint = ModelCheckpoint(dirpath=s3.url("cached"))
    trainer = make_trainer(str(tmp_path), DataStatesIO(storage_options=s3.storage_options), callbacks=[checkpoint])
    checkpoint._fs = fsspec.filesystem("s3", **s3.storage_options)  # as Lightning makes it
    assert "last.ckpt" in str(checkpoint._fs.ls(s3.url("cached")))  # listed, so cached
    override_file_exists(checkpoint, lambda path, exists: exists)
    s3.client.delete_object(Bucket=s3.bucket, Key="cached/last.ckpt")  # behind the cache, as the plugin's writers do
    assert not checkpoint.file_exists(s3.url("cached/last.ckpt"), trainer)


@pytest.mark.parametrize("into", ["memfd", "bytearray"])
def test_an_object_replaced_while_it_is_loaded_is_read_again_whole(s3, monkeypatch, into):
    """Each ranged GET asks for the ETag the HEAD saw: an object replaced between the HEAD and its reads (here right
    before the first GET, by another writer) is read again from the start, never mixed with the old one, into an
    in-memory file (Linux) or a bytearray (elsewhere)."""
    from lightning_datastates.storage.s3.client import S3Client

    if into == "bytearray":
        monkeypatch.delattr(os, "memfd_create", raising=False)
    plugin = DataStatesIO(storage_options={**s3.storage_options, "read_range_bytes": 4096}, serve_from_memory=False)
    url = s3.url(f"replaced-{into}/a.ckpt")
    plugin.save_checkpoint({"w": torch.zeros(20_000)}, url)  # outside fit: committed on return
    newer = io.BytesIO()
    torch.save({"w": torch.ones(20_000)}, newer)
    replaced: list[bool] = []
    call = S3Client.call

    def replacing_call(self, method, **kwargs):
        if method == "get_object" and not replaced:
            replaced.append(True)
            s3.put(f"replaced-{into}/a.ckpt", newer.getvalue())
        return call(self, method, **kwargs)

    monkeypatch.setattr(S3Client, "call", replacing_call)
    loaded = plugin.load_checkpoint(url, weights_only=True)
    assert replaced and torch.equal(loaded["w"], torch.ones(20_000))
    plugin.teardown()


def test_a_server_that_ignores_the_range_of_a_get_fails_the_load(s3, monkeypatch):
    """A ranged GET whose answer is not that range (a server or proxy that ignores Range sends the whole object) must
    not land at the range's offset: the load fails, naming what was asked and answered, even unverified."""
    from lightning_datastates.storage.s3.client import S3Client

    options = {**s3.storage_options, "read_range_bytes": 4096, "retries": 0}
    plugin = DataStatesIO(storage_options=options, serve_from_memory=False, verify_checksums=False)
    url = s3.url("ranges/a.ckpt")
    plugin.save_checkpoint({"w": torch.arange(20_000.0)}, url)
    call = S3Client.call

    async def ignoring_range(self, method, **kwargs):
        response = await call(self, method, **kwargs)
        return {k: v for k, v in response.items() if k != "ContentRange"} if method == "get_object" else response

    monkeypatch.setattr(S3Client, "call", ignoring_range)
    with pytest.raises(Exception, match="the server answered the whole object"):
        plugin.load_checkpoint(url, weights_only=True)
    plugin.teardown()


def test_the_last_checkpoint_at_a_url_is_found_when_written_after_a_cached_listing(s3):
    """``ckpt_path="last"`` lists each ModelCheckpoint's directory through its own s3fs instance, whose listing cache
    ModelCheckpoint fills itself (its setup lists a non-empty directory); a ``last.ckpt`` the plugin's writers put
    there afterwards must still be found."""
    from types import SimpleNamespace

    from lightning_datastates.compat.last_checkpoint import newest_last_checkpoint

    s3.put("listed/epoch=0-step=2.ckpt", b"an earlier checkpoint")
    callback = ModelCheckpoint(dirpath=s3.url("listed"))
    callback._fs = fsspec.filesystem("s3", **s3.storage_options)  # as Lightning makes it
    callback._fs.ls(s3.url("listed"))  # as ModelCheckpoint's setup does: the listing is cached
    time.sleep(1.1)  # S3 dates objects to the second (these files carry no save stamp)
    s3.put("listed/last.ckpt", b"the last checkpoint")  # behind the cache, as the plugin's writers do
    trainer = SimpleNamespace(callbacks=[callback], checkpoint_callbacks=[callback])
    assert newest_last_checkpoint(trainer, _last_options(s3)) == s3.url("listed/last.ckpt")


def test_the_last_checkpoint_at_a_url_skips_a_directory_that_is_no_checkpoint(s3):
    """A sharded ``last.ckpt`` directory without ``meta.pt`` (a save that never committed) is no candidate, however
    new: the newest committed ``last*.ckpt`` is."""
    from types import SimpleNamespace

    from lightning_datastates.compat.last_checkpoint import NO_CANDIDATE, newest_last_checkpoint

    callback = ModelCheckpoint(dirpath="s3://bucket/candidates")
    trainer = SimpleNamespace(callbacks=[callback], checkpoint_callbacks=[callback])
    assert newest_last_checkpoint(trainer, _last_options(s3)) is NO_CANDIDATE
    s3.put("candidates/epoch=0-step=4.ckpt", b"an older checkpoint, not a last one")
    time.sleep(1.1)  # S3 dates objects to the second (these files carry no save stamp)
    s3.put("candidates/last-v1.ckpt", b"a committed single file")
    time.sleep(1.1)
    s3.put("candidates/last.ckpt/.metadata", b"a sharded save in flight: no meta.pt yet")
    with pytest.warns(UserWarning, match=r"last\.ckpt is not whole"):
        assert newest_last_checkpoint(trainer, _last_options(s3)) == "s3://bucket/candidates/last-v1.ckpt"
    s3.put("candidates/last.ckpt/meta.pt", b"committed")
    assert newest_last_checkpoint(trainer, _last_options(s3)) == "s3://bucket/candidates/last.ckpt"


def _last_options(s3: Any) -> Any:
    """What a plugin on ``s3``'s server gives the resolution of "last" (its stamp reads)."""
    from lightning_datastates.compat.last_checkpoint import LastOptions

    plugin = DataStatesIO(storage_options=s3.storage_options)
    return LastOptions(3600.0, pipeline_of(plugin).stamp_of)
