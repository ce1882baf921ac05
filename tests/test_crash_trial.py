"""SIGKILL crash trial of sharded saves: a chain of 2-rank runs (ModelParallelStrategy + FSDP2 on CPU, gloo; driver:
tests/crash_trial_script.py), each killed whole (SIGKILL to its process group: both ranks at once) at a random moment
while its checkpoints are being flushed, the next one resuming with ``fit(ckpt_path="last")``; once on a local
directory, once on the moto S3 server (the endpoint given to the plugin through ``storage_options``).

Each run saves every 2 steps with ``ModelCheckpoint(save_top_k=3, monitor="step", mode="max", save_last=True)`` onto
storage slowed to 64 MB/s per rank (6.3 MB per rank and checkpoint; a step takes 0.1 s: several saves, a ``last.ckpt``
re-save and a top-k removal are in flight at once; local unlinks and S3 removal requests take 50 ms each). The ranks
are forked by a fork server that imported torch and Lightning once (a run reaches its first step in about a second).

How kills are timed: the trial reads rank 0's event log (what its storage writers begin, commit and remove, as the
driver logs it) and SIGKILLs the run's process group at a moment drawn uniformly, by a seeded ``random.Random``, from
a window after an anchor event (see the constants below: the first kill of a chain lands during the first flush of
``last.ckpt``; the others during the run's first top-k removal, a commit's switch of ``last.ckpt``, or anywhere in
the first seconds of flushes, in an order drawn from the seed). The seed is printed: ``CRASH_TRIAL_SEED=<seed>``
replays the same choices (not the same machine timing). What each rank's writer had in flight at the kill (shard files
begun and not committed, removals started and not finished) is printed with what each directory then held.

After each kill:

(a) every directory that Lightning would take for a checkpoint (it holds ``meta.pt``) is read with DCP on one process
    (``dcp_to_torch_save``) and must equal, bit for bit, the state the run named in its ``meta.pt`` recorded at the
    save call of its ``global_step`` (each rank's local shards, joined along dim 0 as FSDP2 splits them); a
    top-k directory's name must carry the same step. A directory without ``meta.pt`` whose commit record (a switch
    of ``last.ckpt`` killed half-way, which the next run's cleanup completes) names shard files that are all there is
    read the same way, as the cleanup will make it;
(b) the next run (the next link of the chain) must start training from the newest whole checkpoint of the directory
    (whole, or completable from its record; not being removed): the last save among them, a later run's after an
    earlier run's, whether ``last*.ckpt`` or a top-k directory; else from scratch; the state it restored must equal
    the record of that checkpoint's save, bit for bit.

At the end one more run trains 4 steps without being killed; it must end cleanly, its newest ``last*.ckpt`` must hold
its last step, and the directory must hold only whole checkpoints, each with exactly the files its ``.metadata``
names: no in-flight marker, temporary file or commit record, no directory without ``meta.pt``; on S3 no open multipart
upload.

Failures are collected over the whole chain (each with its kill and run) and reported together at the end.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import assert_bit_equal
from tests.crash_trial_script import RUN_KEY
from tests.s3_server import (  # noqa: F401 - the *_fixture imports register the fixtures
    s3_endpoint_fixture,
    s3_fixture,
)
from tests.script_support import REPO_ROOT, script_env

#: Kills per storage (each a run of the chain, one per AIM_SCHEDULE entry); one more run then ends without being killed.
KILLS = 7
#: Runs per storage at most (runs that fail to start are no kill): bounds a trial that finds a run failing to start.
MAX_RUNS = KILLS + 3
#: Each kill lands at a uniformly random moment within a window after an anchor that rank 0's event log shows (an
#: anchor that does not come within RUN_WINDOW_S of the run's first shard write: the kill comes at once):
#: - "flush": the run's first shard write; window WINDOW_S (several saves: flushes, commits, removals in flight);
#: - "first last.ckpt flush": the run's first shard write into last.ckpt; FIRST_LAST_WINDOW_S (until about when its
#:   commit comes, the top-k checkpoint of the same step committed before it or not: ~0.3 s locally, ~1 s on the
#:   loopback S3 server; in a fresh directory the one moment a kill can leave a last.ckpt that was never committed);
#: - "top-k removal": the run's first removal of a checkpoint directory; locally, the first file it unlinked, and
#:   UNLINK_WINDOW_S (before the next unlink, 50 ms later: the directory killed with one file gone); on S3
#:   TOPK_WINDOW_S after the removal began;
#: - "last.ckpt switch": the 1st or 2nd removal of last.ckpt's meta.pt (a commit switching it to a new checkpoint);
#:   SWITCH_WINDOW_S.
#: The first kill of a chain (a fresh directory) aims at the first flush of last.ckpt; the others follow AIM_SCHEDULE
#: in an order drawn from the seed.
WINDOW_S = 2.5
FIRST_LAST_WINDOW_S = {"local": 0.3, "s3": 1.0}
TOPK_WINDOW_S = 0.15
UNLINK_WINDOW_S = 0.045
SWITCH_WINDOW_S = 0.25
RUN_WINDOW_S = 5.0
AIM_SCHEDULE = ("first last.ckpt flush", *["top-k removal"] * 3, "last.ckpt switch", "flush", "flush")
assert len(AIM_SCHEDULE) == KILLS
#: Steps the last run trains (2 saves, a top-k removal, a re-save of last.ckpt) before it ends by itself.
FINAL_STEPS = 4
WORLD = 2
#: Hang guards (a run starts, and writes its first shard, about a second after its launch), not performance thresholds.
START_TIMEOUT_S = 30.0
FINAL_TIMEOUT_S = 120.0
#: After a kill, requests the dead ranks had already sent may still be served (loopback S3 server).
S3_SETTLE_S = 0.3

META = "meta.pt"
DCP_METADATA = ".metadata"
#: The commit record of a directory being switched to a new checkpoint (lightning_datastates/sharded/publish.py):
#: ``LDSCOMMIT1``, the ``.metadata`` length (u64, little-endian), the ``.metadata`` bytes, then the ``meta.pt`` bytes.
COMMIT_RECORD = ".datastates-commit"
_RECORD_MAGIC = b"LDSCOMMIT1"
#: A directory marked so is being removed: no checkpoint to resume from, whatever it still holds.
REMOVING_SUFFIX = ".datastates-removing"


def _removal_begins(event: str, what: str) -> bool:
    """A removal of a checkpoint directory begins: one step (``remove <dir>.ckpt``) or marked first (``marker
    <dir>.ckpt/<marker>.datastates-removing``), as the driver logs them."""
    return (event == "remove" and what.rstrip("/").endswith(".ckpt")) or (
        event in ("begin", "marker") and what.endswith(REMOVING_SUFFIX)
    )


def _last_switch_begins(event: str, what: str) -> bool:
    """A commit begins to switch last.ckpt to a new checkpoint: it removes its ``meta.pt``."""
    return event == "remove" and what.endswith(f"/last.ckpt/{{{META}}}")


def _shard_write(event: str, what: str) -> bool:
    return event == "begin" and what.endswith(".distcp")


def _first_last_write(event: str, what: str) -> bool:
    return event == "begin" and what.endswith(".distcp") and "/last.ckpt/" in what


#: How each aim anchors a kill (see WINDOW_S): ``nth`` -> (window, anchor event or None for the first shard write, nth).
AIMS: dict[str, Any] = {
    "flush": lambda nth: (WINDOW_S, None, 1),
    "first last.ckpt flush": lambda nth: (FIRST_LAST_WINDOW_S, _first_last_write, 1),  # by storage
    "top-k removal": lambda nth: (TOPK_WINDOW_S, _removal_begins, 1),
    "last.ckpt switch": lambda nth: (SWITCH_WINDOW_S, _last_switch_begins, nth),
}


def _seed() -> int:
    value = os.environ.get("CRASH_TRIAL_SEED")
    return int(value) if value else random.SystemRandom().randrange(10**6)


def say(message: str) -> None:
    print(message, flush=True)


# ------------------------------------------------------------------------------------------------------- fork server
@dataclass
class Run:
    index: int
    out: pathlib.Path
    pids: list[int]

    @property
    def group(self) -> int:
        return self.pids[0]

    def alive(self) -> list[int]:
        return [pid for pid in self.pids if _alive(pid)]

    def kill(self) -> None:
        try:
            os.killpg(self.group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while self.alive():
            assert time.monotonic() < deadline, f"run {self.index}: ranks {self.alive()} survived SIGKILL"
            time.sleep(0.01)

    def results(self) -> list[str | None]:
        return [_read_text(self.out / f"rank{rank}.result") for rank in range(WORLD)]

    def started(self) -> list[dict[str, Any] | None]:
        texts = [_read_text(self.out / f"started{rank}.json") for rank in range(WORLD)]
        return [json.loads(text) if text else None for text in texts]

    def log_tails(self, chars: int = 2500) -> str:
        return "\n".join(
            f"--- run {self.index} rank {rank} log (end):\n{(_read_text(self.out / f'rank{rank}.log') or '')[-chars:]}"
            for rank in range(WORLD)
        )


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped by the fork server, does not)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _read_text(path: pathlib.Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


class ForkServer:
    """tests/crash_trial_script.py --serve: imports once, forks each run's two ranks into a process group of its own."""

    def __init__(self) -> None:
        from tests.s3_server import free_port

        self._free_port = free_port
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(REPO_ROOT, "tests", "crash_trial_script.py"), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=script_env(),
            cwd=REPO_ROOT,
            text=True,
        )
        self.runs: list[Run] = []
        ready = self.process.stdout.readline()  # type: ignore[union-attr]
        assert ready.startswith('{"ready"'), f"the fork server did not start: {ready!r}"

    def start(self, index: int, out: pathlib.Path, *args: str) -> Run:
        request = {
            "argv": [str(out), "--run", str(index), *args],
            # The S3 fixture's endpoint and dummy credentials, for Lightning's own fsspec calls.
            "env": {
                "MASTER_PORT": str(self._free_port()),
                **{k: v for k, v in os.environ.items() if k.startswith("AWS_")},
            },
        }
        self.process.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        answer = json.loads(self.process.stdout.readline())  # type: ignore[union-attr]
        run = Run(index, out, answer["pids"])
        self.runs.append(run)
        return run

    def close(self) -> None:
        for run in self.runs:
            run.kill()
        self.process.stdin.close()  # type: ignore[union-attr]
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def fork_server() -> Iterator[ForkServer]:
    server = ForkServer()
    try:
        yield server
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------------------- storages
class LocalStorage:
    name = "local"

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.args: tuple[str, ...] = ("--ckpt-dir", str(directory))

    def listing(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """``({directory: {file: signature}}, [files directly in the checkpoint directory])``."""
        directories: dict[str, dict[str, Any]] = {}
        files: list[str] = []
        if not self.directory.exists():
            return directories, files
        for entry in os.scandir(self.directory):
            if entry.is_dir(follow_symlinks=False):
                directories[entry.name] = {
                    e.name: (e.stat().st_size, e.stat().st_mtime_ns, e.stat().st_ino)
                    for e in os.scandir(entry.path)
                    if not e.is_dir()
                }
                files += [f"{entry.name}/{e.name}/" for e in os.scandir(entry.path) if e.is_dir()]
            else:
                files.append(entry.name)
        return directories, files

    def local_copy(self, name: str, scratch: pathlib.Path) -> pathlib.Path:
        return self.directory / name

    def read(self, name: str, file: str) -> bytes:
        return (self.directory / name / file).read_bytes()

    def open_uploads(self) -> list[str]:
        return []


class S3Storage:
    name = "s3"

    def __init__(self, s3: Any, prefix: str) -> None:
        self.s3, self.prefix = s3, prefix
        options = {**s3.storage_options, "part_size_bytes": "5MiB"}  # a ~6 MB shard goes up in 2 parts
        self.args = ("--ckpt-dir", s3.url(prefix), "--storage-options", json.dumps(options))

    def listing(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        directories: dict[str, dict[str, Any]] = {}
        files: list[str] = []
        pages = self.s3.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.s3.bucket, Prefix=self.prefix + "/"
        )
        for page in pages:
            for item in page.get("Contents", []):
                directory, _, name = item["Key"][len(self.prefix) + 1 :].partition("/")
                if not name:
                    files.append(directory)
                elif "/" in name:
                    files.append(f"{directory}/{name}")
                else:
                    directories.setdefault(directory, {})[name] = (item["Size"], item["ETag"])
        return directories, files

    def local_copy(self, name: str, scratch: pathlib.Path) -> pathlib.Path:
        local = scratch / f"s3-{time.monotonic_ns()}-{name}"
        return self.s3.download(f"{self.prefix}/{name}", local)

    def read(self, name: str, file: str) -> bytes:
        data = self.s3.read(f"{self.prefix}/{name}/{file}")
        assert data is not None, (name, file)
        return data

    def open_uploads(self) -> list[str]:
        return self.s3.open_uploads()


# ------------------------------------------------------------------------------------------------------------ checks
def _files_named(metadata: bytes) -> set[str]:
    return {info.relative_path for info in pickle.loads(metadata).storage_data.values()}


def _decode_record(record: bytes) -> tuple[bytes, bytes]:
    head = len(_RECORD_MAGIC) + 8
    assert record[: len(_RECORD_MAGIC)] == _RECORD_MAGIC, "not a commit record of the format this trial knows"
    (length,) = struct.unpack_from("<Q", record, len(_RECORD_MAGIC))
    return record[head : head + length], record[head + length :]


def _read_with_dcp(directory: pathlib.Path, scratch: pathlib.Path) -> dict[str, torch.Tensor]:
    """The checkpoint as DCP reads it on one process, flattened to the record's keys."""
    converted = scratch / f"dcp-{time.monotonic_ns()}.pt"
    try:
        dcp_to_torch_save(str(directory), str(converted))
        full = torch.load(converted, weights_only=False)
    finally:
        converted.unlink(missing_ok=True)
    flat = {f"state_dict.{k}": v for k, v in full["state_dict"].items()}
    for fqn, values in full["optimizer_0"]["state"].items():
        flat.update({f"optimizer_0.state.{fqn}.{key}": v for key, v in values.items() if isinstance(v, torch.Tensor)})
    return dict(sorted(flat.items()))


def _joined(shards: list[dict[str, torch.Tensor]], where: str) -> dict[str, torch.Tensor]:
    """Each rank's local shards joined as FSDP2 split them (dim 0); AdamW's step (a scalar) is the same on every
    rank."""
    joined = {}
    for key, first in shards[0].items():
        if first.dim() == 0:
            for shard in shards[1:]:
                assert_bit_equal(shard[key], first, f"{where}: replicated {key}")
            joined[key] = first
        else:
            joined[key] = torch.cat([shard[key] for shard in shards])
    return dict(sorted(joined.items()))


@dataclass
class Checkpoint:
    """What a directory holds (or will, once the next run's cleanup completed its commit record)."""

    name: str
    step: int
    run: str
    from_record: bool = False
    being_removed: bool = False


@dataclass
class Trial:
    root: pathlib.Path
    storage: LocalStorage | S3Storage
    server: ForkServer
    rng: random.Random
    seed: int
    failures: list[str] = field(default_factory=list)
    #: Directories checked, by name and content (sizes, dates or ETags): the checkpoint each holds, None if none (its
    #: failure reported once).
    verified: dict[tuple[str, Any], Checkpoint | None] = field(default_factory=dict)
    kills_in_flush: int = 0

    @property
    def scratch(self) -> pathlib.Path:
        path = self.root / "scratch"
        path.mkdir(exist_ok=True)
        return path

    def fail(self, where: str, message: str) -> None:
        line = f"[{self.storage.name} seed={self.seed}] {where}: {message}"
        self.failures.append(line)
        say(f"  FAILURE {line}")

    def expected_state(self, run: str, step: int, where: str) -> dict[str, torch.Tensor]:
        directory = self.root / f"run{run}" / "ref" / f"step{step}"
        paths = [directory / f"rank{rank}.pt" for rank in range(WORLD)]
        missing = [str(p) for p in paths if not p.exists()]
        assert not missing, f"{where}: no record of run {run}'s save of step {step} ({missing})"
        return _joined([torch.load(p) for p in paths], where)

    # -------------------------------------------------------------------------------------------------- (a)
    def verify_directory(self, name: str, files: dict[str, Any], where: str) -> Checkpoint | None:
        """Check one directory; the checkpoint it holds (or will hold after the next cleanup), None if none."""
        being_removed = any(f.endswith(REMOVING_SUFFIX) for f in files)
        if META in files:
            return self._verify(name, files, where, record=None, being_removed=being_removed)
        if COMMIT_RECORD in files and not being_removed:
            try:
                metadata, meta = _decode_record(self.storage.read(name, COMMIT_RECORD))
            except AssertionError as exc:
                self.fail(where, f"{name}: {exc}")
                return None
            if not _files_named(metadata) <= set(files):
                return None  # the cleanup removes it: no checkpoint
            return self._verify(name, files, where, record=(metadata, meta), being_removed=False)
        return None

    def _verify(
        self, name: str, files: dict[str, Any], where: str, record: tuple[bytes, bytes] | None, being_removed: bool
    ) -> Checkpoint | None:
        key = (name, tuple(sorted(files.items())))
        if key not in self.verified:
            self.verified[key] = self._read(name, files, where, record, being_removed)
        return self.verified[key]

    def _read(
        self, name: str, files: dict[str, Any], where: str, record: tuple[bytes, bytes] | None, being_removed: bool
    ) -> Checkpoint | None:
        local = copy = self.storage.local_copy(name, self.scratch)
        try:
            if record is not None:  # as the cleanup will leave it: the shard files, .metadata and meta.pt of the record
                local = self.scratch / f"record-{time.monotonic_ns()}-{name}"
                local.mkdir()
                for file in _files_named(record[0]):
                    os.symlink(os.path.abspath(copy / file), local / file)
                (local / DCP_METADATA).write_bytes(record[0])
                (local / META).write_bytes(record[1])
            try:
                meta = torch.load(io.BytesIO((local / META).read_bytes()), weights_only=False)
                loaded = _read_with_dcp(local, self.scratch)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the finding (DCP's is a BaseException)
                last_line = [line for line in str(exc).splitlines() if line.strip()][-1:] or [""]
                self.fail(
                    where,
                    f"{name} (files {sorted(files)}): Lightning takes it for a checkpoint, it cannot be read: "
                    f"{type(exc).__name__}: {last_line[0].strip()[:300]}",
                )
                return None
            step, run = meta["global_step"], str(meta.get(RUN_KEY))
            named = re.search(r"step=(\d+)", name)
            if named and int(named.group(1)) != step:
                self.fail(where, f"{name}: its meta.pt holds global_step {step}")
            try:
                assert_bit_equal(loaded, self.expected_state(run, step, f"{where} {name}"), name)
            except AssertionError as exc:
                self.fail(where, f"{name} (meta.pt: run {run}, step {step}) differs from that save: {exc}")
                return None
            return Checkpoint(name, step, run, from_record=record is not None, being_removed=being_removed)
        finally:
            for scratch in {local, copy}:
                if scratch.is_relative_to(self.scratch):
                    shutil.rmtree(scratch, ignore_errors=True)

    def inspect(self, where: str) -> dict[str, Checkpoint]:
        """Check every directory (a); print what each holds; the checkpoints a next run may resume from."""
        directories, loose = self.storage.listing()
        resumable: dict[str, Checkpoint] = {}
        for name in sorted(directories):
            files = directories[name]
            checkpoint = self.verify_directory(name, files, where)
            shown = ",".join(sorted(f if len(f) < 24 else f[:6] + "…" + f[-18:] for f in files))
            if checkpoint is None:
                say(f"    {name}: no checkpoint [{shown}]")
                continue
            how = " (completable from its commit record)" if checkpoint.from_record else ""
            how += " (being removed)" if checkpoint.being_removed else ""
            say(f"    {name}: run {checkpoint.run} step {checkpoint.step}, equal to its save{how} [{shown}]")
            if not checkpoint.being_removed:
                resumable[name] = checkpoint
        if loose:
            say(f"    loose files: {sorted(loose)}")
        return resumable

    # -------------------------------------------------------------------------------------------------- (b)
    @staticmethod
    def expected_resume(resumable: dict[str, Checkpoint]) -> set[tuple[int, str | None]]:
        pool = list(resumable.values())
        if not pool:
            return {(0, None)}
        newest = max((int(c.run), c.step) for c in pool)  # the last save: runs of the chain save one after another
        return {(c.step, c.run) for c in pool if (int(c.run), c.step) == newest}

    def wait_started(self, run: Run, where: str) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if all(run.started()):
                return True
            results = run.results()
            if any(results) or not run.alive() or time.monotonic() > deadline:
                run.kill()
                why = "timed out" if time.monotonic() > deadline else "ended"
                self.fail(where, f"run {run.index} never started training ({why}); results {results}")
                say(run.log_tails())
                return False
            time.sleep(0.02)

    def check_start(self, run: Run, expected: set[tuple[int, str | None]], where: str) -> int:
        started = run.started()
        assert all(started)
        ranks = {(s["step"], s["run"]) for s in started}  # type: ignore[index]
        step, loaded = next(iter(ranks))
        path = started[0]["ckpt_path"]  # type: ignore[index]
        say(
            f"  run {run.index} started at step {step} from {path} (run {loaded}); expected {sorted(expected, key=str)}"
        )
        if len(ranks) > 1:
            self.fail(where, f"run {run.index}: ranks resumed from different checkpoints: {started}")
        if (step, loaded) not in expected:
            self.fail(
                where,
                f"run {run.index} resumed at step {step} from {path} (run {loaded}); the newest whole "
                f"checkpoint: {sorted(expected, key=str)} (step 0: from scratch)",
            )
        if step:
            try:
                restored = _joined([torch.load(run.out / "restored" / f"rank{r}.pt") for r in range(WORLD)], where)
                assert_bit_equal(restored, self.expected_state(str(loaded), step, where), "restored state")
            except AssertionError as exc:
                self.fail(where, f"run {run.index}: the state restored from {path} differs from its save: {exc}")
        return step

    # -------------------------------------------------------------------------------------------------- kills
    def wait_event(self, run: Run, matches: Any, nth: int, timeout_s: float, after: float = 0.0) -> float | None:
        """When rank 0 logged the ``nth`` event that ``matches(event, what)`` at ``after`` or later (None if not within
        ``timeout_s``, or if the run ended)."""
        deadline = time.monotonic() + timeout_s
        events = run.out / "events0.log"
        while time.monotonic() < deadline and run.alive() and not any(run.results()):
            seen = 0
            for line in (_read_text(events) or "").splitlines():
                stamp, event, what = line.split(" ", 2)
                seen += float(stamp) >= after and bool(matches(event, what))
                if seen == nth:
                    return float(stamp)
            time.sleep(0.005)
        return None

    def in_flight(self, run: Run) -> list[str]:
        """What each rank's writer had begun and not finished when the run was killed (shard files by directory,
        other files and removals by path), and its last save calls."""
        found = []
        prefix = str(self.storage.args[1]).rstrip("/") + "/"
        for rank in range(WORLD):
            pending: dict[str, None] = {}
            saves = []
            for line in (_read_text(run.out / f"events{rank}.log") or "").splitlines():
                _, event, what = line.split(" ", 2)
                what = what.replace(prefix, "")
                if event in ("begin", "remove"):
                    pending[f"{event} {what}"] = None
                elif event in ("complete", "abort", "failed"):
                    pending.pop(f"begin {what}", None)
                elif event == "removed":
                    pending.pop(f"remove {what}", None)
                elif event == "save":
                    step, path = what.split(" ", 1)
                    saves.append(f"{os.path.basename(path)}@{step}")
            shards = [
                k[len("begin ") :].split("/")[0] for k in pending if k.startswith("begin ") and k.endswith(".distcp")
            ]
            others = [k for k in pending if not (k.startswith("begin ") and k.endswith(".distcp"))]
            found.append(
                f"rank {rank}: last saves {saves[-3:]}; shard files in flight {len(shards)} "
                f"({', '.join(dict.fromkeys(shards))}); other writes and removals in flight {others}"
            )
        return found

    def kill_during_flushes(self, run: Run, where: str, aim: str) -> bool:
        """SIGKILL the run's process group at a random moment while its checkpoints are being flushed, around the
        moment ``aim`` names (see :data:`AIMS`)."""
        nth, fraction = self.rng.randint(1, 2), self.rng.random()  # drawn whatever happens: a seed replays them
        first = self.wait_event(run, _shard_write, 1, START_TIMEOUT_S)
        if first is None:
            self.fail(where, f"run {run.index} wrote no shard file; results {run.results()}")
            say(run.log_tails())
            run.kill()
            return False
        window, matches, nth = AIMS[aim](nth)
        if isinstance(window, dict):
            window = window[self.storage.name]
        # Only what the run does once it saves: its cleanup at setup removes what dead runs left, before.
        timeout_s = first + RUN_WINDOW_S - time.time()
        anchor = first if matches is None else self.wait_event(run, matches, nth, timeout_s, after=first)
        how = f"after {aim} #{nth} began" if matches else "after its first shard write began"
        if anchor is not None and aim == "top-k removal" and isinstance(self.storage, LocalStorage):
            unlinked = self.wait_event(run, lambda event, what: event == "unlinked", 1, 2.0, after=anchor)
            if unlinked is not None:
                anchor, window, how = unlinked, UNLINK_WINDOW_S, f"after {aim} #{nth} unlinked its first file"
        if anchor is None:
            anchor, delay, how = time.time(), 0.0, f"at once: no {aim} #{nth} within {RUN_WINDOW_S} s"
        else:
            delay = fraction * window
        time.sleep(max(0.0, anchor + delay - time.time()))
        late = time.time() - anchor - delay
        ended = [r for r in run.results() if r]
        run.kill()
        if ended:
            self.fail(where, f"run {run.index} ended before the kill: {ended}")
            say(run.log_tails())
        if isinstance(self.storage, S3Storage):
            time.sleep(S3_SETTLE_S)
        flights = self.in_flight(run)
        if any("shard files in flight 0 " not in f or "in flight []" not in f for f in flights):
            self.kills_in_flush += 1
        say(f"  killed run {run.index} {delay:.3f} s (+{late:.3f} s late) {how}")
        for line in flights:
            say(f"    {line}")
        return True

    # -------------------------------------------------------------------------------------------------- the end
    def check_no_leftovers(self, where: str) -> None:
        directories, loose = self.storage.listing()
        if loose:
            self.fail(where, f"files outside checkpoint directories: {sorted(loose)}")
        for name, files in sorted(directories.items()):
            if META not in files or DCP_METADATA not in files:
                self.fail(where, f"{name} is no whole checkpoint: {sorted(files)}")
                continue
            named = _files_named(self.storage.read(name, DCP_METADATA))
            extra = set(files) - named - {META, DCP_METADATA}
            if extra or not named <= set(files):
                self.fail(where, f"{name} holds {sorted(files)}; its .metadata names {sorted(named)}")
        uploads = self.storage.open_uploads()
        if uploads:
            self.fail(where, f"open multipart uploads left: {uploads}")

    def run_chain(self) -> None:
        say(f"crash trial on {self.storage.name}: seed {self.seed} (replay: CRASH_TRIAL_SEED={self.seed})")
        resumable: dict[str, Checkpoint] = {}
        expected = self.expected_resume(resumable)
        kills = index = 0
        # The first kill aims at the first flush of last.ckpt (a fresh directory); the others in the seed's order.
        aims = [*AIM_SCHEDULE[1:]]
        self.rng.shuffle(aims)
        aims = [AIM_SCHEDULE[0], *aims]
        started_at = time.monotonic()
        missed = 0  # runs in a row that could not be killed during flushes (they did not start, or wrote nothing)
        while kills < KILLS:
            if index >= MAX_RUNS or missed >= 2:
                self.fail(f"kill {kills + 1}", f"chain stopped: {index} runs for {kills} kills, the last {missed} not")
                break
            where = f"kill {kills + 1} (run {index})"
            say(f"{where}: {time.monotonic() - started_at:.1f} s into the trial")
            launched = time.monotonic()
            run = self.server.start(index, self.root / f"run{index}", *self.storage.args)
            killed = False
            if self.wait_started(run, where):
                say(f"  run {index} reached its first step {time.monotonic() - launched:.1f} s after its launch")
                self.check_start(run, expected, where)
                killed = self.kill_during_flushes(run, where, aims[kills])
            kills, missed, index = kills + killed, 0 if killed else missed + 1, index + 1
            inspected = time.monotonic()
            resumable = self.inspect(where)
            expected = self.expected_resume(resumable)
            say(f"  checked in {time.monotonic() - inspected:.1f} s")
        where = f"the last run (run {index})"
        say(f"{where}: {time.monotonic() - started_at:.1f} s into the trial")
        run = self.server.start(index, self.root / f"run{index}", *self.storage.args, "--steps", str(FINAL_STEPS))
        if self.wait_started(run, where):
            step = self.check_start(run, expected, where)
            deadline = time.monotonic() + FINAL_TIMEOUT_S
            while run.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if run.alive():
                run.kill()
            if run.results() != ["ok"] * WORLD:
                self.fail(where, f"run {index} did not end cleanly: {run.results()}")
                say(run.log_tails())
            resumable = self.inspect(where)
            lasts = [c for name, c in resumable.items() if name.startswith("last")]
            last = max(lasts, key=lambda c: c.step, default=None)
            if last is None or (last.step, last.run) != (step + FINAL_STEPS, str(index)):
                self.fail(where, f"the newest last*.ckpt should hold run {index}'s step {step + FINAL_STEPS}: {last}")
            self.check_no_leftovers(where)
        say(
            f"crash trial on {self.storage.name}: {kills} kills ({self.kills_in_flush} with writes or removals in "
            f"flight), {index + 1} runs, {len(self.failures)} failure(s), {time.monotonic() - started_at:.1f} s"
        )
        assert not self.failures, f"{len(self.failures)} failure(s):\n" + "\n".join(self.failures)
        # The trial's own power: kills that find nothing in flight test little.
        assert self.kills_in_flush >= KILLS // 2, "most kills should land while a write or a removal is in flight"


def _trial(root: pathlib.Path, storage: LocalStorage | S3Storage, server: ForkServer) -> Trial:
    seed = _seed()
    return Trial(root, storage, server, random.Random(f"{seed}-{storage.name}"), seed)


@pytest.mark.slow
def test_sigkill_during_flushes_on_a_local_directory(tmp_path, fork_server):
    _trial(tmp_path, LocalStorage(tmp_path / "ckpt"), fork_server).run_chain()


@pytest.mark.slow
def test_sigkill_during_flushes_on_s3(tmp_path, s3, fork_server):
    _trial(tmp_path, S3Storage(s3, f"trial-{time.monotonic_ns()}/ckpt"), fork_server).run_chain()
