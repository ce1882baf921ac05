"""An S3 endpoint that accepts connections and never answers: the run fails fast and loudly (issue 33, item 3).

The endpoint is a real listening socket on loopback whose accepting thread holds every connection and never sends a
byte: the TCP connect succeeds, so only the response timeout can detect it. The endpoint reaches the plugin alone
(``storage_options``; no ``AWS_*`` variable), as a user's MinIO or Ceph gateway would.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import DataStatesIO
from lightning_datastates.errors import CheckpointFlushError, ConfigError
from lightning_datastates.storage.s3 import S3WriteError, S3Writer
from lightning_datastates.storage.s3.client import worst_case_s
from tests.conftest import BNModel, make_loader, make_trainer
from tests.s3_server import require_s3

#: Hang guard for the whole fit against the silent endpoint, not a performance threshold: with timeout_s=1 and
#: retries=1 the setup's first request gives up after about 2.5 s (two attempts of 1 s and a backoff of at most 1.5 s);
#: the old defaults took 488 s, and an attempt limit that ignored timeout_s would take at least 60 s (botocore's own).
GUARD_S = 30.0
MiB = 1024**2


@pytest.fixture(autouse=True)
def _needs_s3() -> None:
    require_s3()


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a socket that accepts every connection, holds it open and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.1)  # the accepting thread looks at ``stop`` this often
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(connection)  # never read from, never answered, kept open until the test ends

    acceptor = threading.Thread(target=accept, name="silent-endpoint", daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join(5.0)
        listener.close()
        for connection in held:
            connection.close()


def _options(endpoint: str, **tunables: object) -> dict[str, object]:
    return {
        "endpoint_url": endpoint,
        "key": "k",
        "secret": "s",
        "client_kwargs": {"region_name": "us-east-1"},
        **tunables,
    }


@pytest.fixture
def no_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``AWS_*`` endpoint or credentials in the environment: the endpoint is given to the plugin only."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)


def test_fit_against_a_silent_endpoint_fails_fast_naming_it_and_logging_each_retry(
    silent_endpoint, tmp_path, caplog, no_aws_environment
):
    plugin = DataStatesIO(storage_options=_options(silent_endpoint, timeout_s=1, retries=1))
    checkpoint = ModelCheckpoint(dirpath="s3://bucket/run", every_n_train_steps=1)
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[checkpoint], max_epochs=1)
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="lightning_datastates"),
        pytest.raises(CheckpointFlushError) as raised,  # the documented type, the storage error chained
    ):
        trainer.fit(BNModel(), make_loader())
    elapsed_s = time.monotonic() - started
    assert elapsed_s < GUARD_S, f"fit took {elapsed_s:.1f} s to fail against a silent endpoint"
    assert trainer.global_step == 0  # failed at setup, before the first training step
    assert isinstance(raised.value.__cause__, S3WriteError)

    message = str(raised.value)
    assert silent_endpoint in message and "s3://bucket/run" in message
    assert "no answer within timeout_s" in message and "2 attempts" in message
    assert "endpoint_url" in message and "timeout_s" in message and "retries" in message
    warnings = [r for r in caplog.records if r.name == "lightning_datastates" and r.levelno == logging.WARNING]
    retries = [r for r in warnings if "attempt" in r.getMessage()]
    assert len(retries) == 1, [r.getMessage() for r in warnings]  # retries=1: one retry, logged as it happens
    logged = retries[0].getMessage()
    assert silent_endpoint in logged and "attempt 1 of 2" in logged and "s3://bucket/run" in logged
    assert re.search(r"retrying in \d+(\.\d+)? s", logged), logged


def test_the_default_settings_give_up_on_a_silent_endpoint_in_about_a_minute_and_allow_slow_parts():
    """Computed from the settings, not measured: the slowest a request at default settings can fail is every attempt
    timing out and every backoff at its longest. A part upload may take longer, in proportion to its bytes."""
    writer = S3Writer({"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"})
    worst_s = worst_case_s(writer.retries, writer.timeout_s)
    assert 45.0 <= worst_s <= 75.0, worst_s
    assert writer.client.worst_case_s() == worst_s
    # A 16 MiB part, 8 at once over a link of 2 MiB/s, is slow but alive: it takes 64 s, within one attempt.
    part_bytes, link_bytes_per_s = 16 * MiB, 2 * MiB
    assert writer.client.attempt_limit_s(part_bytes) >= part_bytes * writer.max_concurrent_parts / link_bytes_per_s


@pytest.mark.parametrize(
    ("setting", "value", "expected"),
    [
        ("timeout_s", 0, "timeout_s must be a positive, finite number of seconds"),
        ("timeout_s", "10", "timeout_s must be a positive, finite number of seconds"),
        ("min_bytes_per_s", "fast", "min_bytes_per_s='fast' is not a size"),
        ("retries", -1, "retries must be an int from 0 to 100"),
    ],
)
def test_the_request_settings_are_validated_naming_the_setting(setting, value, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        S3Writer.from_storage_options({"endpoint_url": "http://127.0.0.1:9", setting: value})


def test_resuming_from_last_against_a_silent_endpoint_fails_within_the_shared_file_systems_timeouts(
    silent_endpoint, tmp_path, no_aws_environment
):
    """``fit(ckpt_path="last")`` lists the directory through ``ModelCheckpoint``'s file system before any hook of ours
    runs: that file system has the plugin's ``timeout_s`` too (s3fs's own 5 attempts of 1 s here, with its short
    backoffs). With s3fs's defaults it waited botocore's 60 s per attempt, times botocore's and s3fs's retries."""
    plugin = DataStatesIO(storage_options=_options(silent_endpoint, timeout_s=1, retries=1))
    checkpoint = ModelCheckpoint(dirpath="s3://bucket/resume", every_n_train_steps=1)
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[checkpoint], max_epochs=1)
    started = time.monotonic()
    with pytest.raises(Exception) as raised:  # botocore's or ours: what matters is how soon
        trainer.fit(BNModel(), make_loader(), ckpt_path="last")
    elapsed_s = time.monotonic() - started
    assert elapsed_s < GUARD_S, f"fit(ckpt_path='last') took {elapsed_s:.1f} s to fail against a silent endpoint"
    assert trainer.global_step == 0, raised.value
