"""A real S3 API on loopback for the tests: moto's server, in a thread (shared) or as a process (to SIGKILL).

* :func:`shared_server` starts one ``ThreadedMotoServer`` per test process, on a free port, on first use.
* :func:`fresh_bucket` resets it (``POST /moto-api/reset``), drops s3fs's cached clients and creates a bucket.
* Fixtures (import the ``*_fixture`` functions into a test module): ``s3_endpoint`` (session: the server, plus
  dummy ``AWS_*`` variables and ``AWS_ENDPOINT_URL`` so plain ``s3://`` URLs reach it, as in Lightning's own
  ``ModelCheckpoint``) and ``s3`` (per test: a fresh bucket; after the test, no multipart upload may be left open).
* :class:`MotoProcess`: ``moto_server -H 127.0.0.1 -p PORT`` as a subprocess, killable and restartable on its port
  (the benchmark's :class:`~lightning_datastates.benchmark.moto.MotoServer`, which can also pause here).

Skips (not fails) when s3fs or moto's server extras are missing.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lightning_datastates.benchmark.moto import CREDENTIALS, MotoServer, free_port  # noqa: F401 - tests import it here

BUCKET = "bucket"

_shared: Any = None
_shared_lock = threading.Lock()


def require_s3() -> None:
    """Skip the calling test when s3fs or moto's server are not installed."""
    pytest.importorskip("s3fs")
    pytest.importorskip("boto3")
    pytest.importorskip("moto.moto_server.threaded_moto_server")


def shared_server() -> str:
    """The endpoint URL of this process's loopback moto server (started on first call)."""
    global _shared
    require_s3()
    with _shared_lock:
        if _shared is None:
            from moto.moto_server.threaded_moto_server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            atexit.register(server.stop)
            host, port = server.get_host_and_port()
            _shared = (server, f"http://{host}:{port}")
        return _shared[1]


@dataclass
class S3Env:
    """One test's view of a server: its endpoint, a bucket, and a boto3 client independent of the code under test."""

    endpoint: str
    bucket: str = BUCKET
    client: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.client is None:
            self.client = _boto_client(self.endpoint)

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options reaching this server without any environment variable."""
        return {
            "endpoint_url": self.endpoint,
            "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"region_name": CREDENTIALS["AWS_DEFAULT_REGION"]},
        }

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def key_of(self, url: str) -> str:
        prefix = f"s3://{self.bucket}/"
        assert url.startswith(prefix), url
        return url[len(prefix) :]

    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when there is none."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def download(self, prefix: str, local: Path) -> Path:
        """The objects under ``prefix/``, as files of the new local directory ``local`` (for readers of local files)."""
        local.mkdir(parents=True)
        for key in self.keys(prefix + "/"):
            (local / key[len(prefix) + 1 :]).write_bytes(self.read(key) or b"")
        return local

    def upload(self, local: Path, prefix: str) -> None:
        """The files of the local directory ``local`` as objects under ``prefix/``."""
        for path in local.iterdir():
            self.put(f"{prefix}/{path.name}", path.read_bytes())

    def etag(self, key: str) -> str:
        return self.client.head_object(Bucket=self.bucket, Key=key)["ETag"]

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def open_uploads(self) -> list[str]:
        """Keys of multipart uploads still open in the bucket (an aborted or completed one is gone)."""
        uploads = self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
        return sorted(upload["Key"] for upload in uploads)

    def abort_all_uploads(self) -> None:
        for upload in self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", []):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])


_boto_clients: dict[str, Any] = {}


def _boto_client(endpoint: str) -> Any:
    """The test side's own client (boto3, not s3fs), one per endpoint: building one takes a quarter second."""
    if endpoint not in _boto_clients:
        import boto3
        from botocore.config import Config

        _boto_clients[endpoint] = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            config=Config(retries={"max_attempts": 2}, connect_timeout=5, read_timeout=30),
        )
    return _boto_clients[endpoint]


def clear_client_caches() -> None:
    """Drop s3fs's cached instances (and their listing caches): every test starts with fresh clients. Writers own
    theirs: a new writer has new clients."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def fresh_bucket(endpoint: str, bucket: str = BUCKET, reset: bool = True) -> S3Env:
    """Reset the server (all buckets and uploads gone), drop cached clients, create ``bucket``."""
    if reset:
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=30).read()
    clear_client_caches()
    env = S3Env(endpoint, bucket)
    env.client.create_bucket(Bucket=bucket)
    return env


@pytest.fixture(scope="session", name="s3_endpoint")
def s3_endpoint_fixture() -> Any:
    """The shared server, with dummy credentials and ``AWS_ENDPOINT_URL`` set for the session."""
    endpoint = shared_server()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CREDENTIALS.items():
            patch.setenv(name, value)
        patch.setenv("AWS_ENDPOINT_URL", endpoint)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            patch.delenv(name, raising=False)
        yield endpoint


@pytest.fixture(name="s3")
def s3_fixture(s3_endpoint: str) -> Any:
    """A fresh bucket on a reset server; after the test, no multipart upload may be left open."""
    env = fresh_bucket(s3_endpoint)
    yield env
    assert env.open_uploads() == [], "a test left an open multipart upload behind"
    clear_client_caches()


# ---------------------------------------------------------------------------------------------------- a killable server
class MotoProcess(MotoServer):
    """``moto_server`` in a subprocess on a fixed port (the benchmark's): SIGKILL it, SIGSTOP it, start it again on
    the same port."""

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


@pytest.fixture(name="moto_process")
def moto_process_fixture() -> Any:
    """A subprocess server (killed at the end of the test, whatever happens)."""
    require_s3()
    server = MotoProcess()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.resume()
        server.kill()
    clear_client_caches()
