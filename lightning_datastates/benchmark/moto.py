"""moto's S3 server as a subprocess on a loopback port: the benchmark's slow persistent tier (``--moto``) and the
tests' killable server (``tests/s3_server.py`` adds pausing to it).

The server is ``moto_server`` from ``moto[server]`` (an optional dependency: ``pip install 'moto[server]' s3fs
boto3``); :func:`missing_moto` says what is missing. It keeps every object in memory up to 5 MiB and in temporary
files beyond (``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE`` moves that limit), behind HTTP and Python request handling: a real
S3 API, slower than the local disk, and one whose every byte costs CPU time of the machine it runs on.

Runs in the parent process (main thread); the server is a child process of it, stopped by :meth:`MotoServer.kill`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import TypeVar

#: Dummy credentials: moto takes any, s3fs and boto3 want some.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
_START_TIMEOUT_S = 30.0

_Server = TypeVar("_Server", bound="MotoServer")


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def missing_moto() -> str | None:
    """What is missing to run moto's server and reach it (a line to print), or None when nothing is."""
    # moto[server] brings flask and werkzeug; s3fs and boto3 are what the writers and the raw measurement use.
    missing = [name for name in ("moto", "flask", "s3fs", "boto3") if importlib.util.find_spec(name) is None]
    if missing:
        return f"--moto needs {', '.join(missing)}: pip install 'moto[server]' s3fs boto3"
    return None


class MotoServer:
    """``moto_server -H 127.0.0.1 -p PORT`` in a subprocess: :meth:`start` (waits until it answers), :meth:`kill`
    (SIGKILL: its buckets and uploads die with it), and it can be started again on the same port. ``environment``:
    variables for the server process (moto's settings)."""

    def __init__(self, port: int | None = None, environment: dict[str, str] | None = None) -> None:
        self.server_environment = dict(environment or {})  # for the server process, beside the credentials
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self: _Server) -> _Server:
        """Start the server and wait until it answers (at most 30 s).

        Raises:
            RuntimeError: it exited or did not answer in time.
        """
        command = shutil.which("moto_server")
        argv = [command] if command else [sys.executable, "-m", "moto.server"]
        self.process = subprocess.Popen(
            [*argv, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **CREDENTIALS, **self.server_environment},
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).read()
                return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"moto_server did not start on port {self.port}") from None
                time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: the server dies mid-request, its state (buckets, uploads) with it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def environment(self) -> dict[str, str]:
        """The variables that send plain ``s3://`` URLs of s3fs and boto3 (the workers' too) to this server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}
