"""The writer threads' task dispatch (write/loop.py, records/tasks.py), called directly: no threads, no storage."""

from __future__ import annotations

import dataclasses
import queue
from typing import Any

import pytest

from lightning_datastates.copy.arena import HostArena
from lightning_datastates.copy.sharing import SharedCopies
from lightning_datastates.records.tasks import Commit, WriteMetadata
from lightning_datastates.write.loop import WriteLoop


class _Session:
    def __init__(self) -> None:
        self.writes: list[tuple[int, bytes]] = []

    def write_range(self, offset: int, data: memoryview) -> None:
        self.writes.append((offset, bytes(data)))


class _Job:
    """What the loop reads of a SnapshotJob for a metadata write."""

    def __init__(self, metadata: list[tuple[int, bytes]], stopped: bool = False) -> None:
        self.layout = type("Layout", (), {"metadata": metadata})()
        self.session = _Session()
        self.stopped = stopped
        self.written = 0
        self.released = 0
        self.error: BaseException | None = None

    def add_written(self, nbytes: int) -> None:
        self.written += nbytes

    def release(self) -> None:
        self.released += 1

    def fail(self, exc: BaseException) -> None:
        self.error = exc


def _loop() -> WriteLoop:
    return WriteLoop(queue.Queue(), HostArena(1 << 16), None, SharedCopies(), lambda job: None, lambda q, t: True)


def test_an_unknown_task_raises_and_releases_nothing() -> None:
    job = _Job([(0, b"abc")])
    with pytest.raises(TypeError, match="not a write task"):
        _loop().handle(("metadata", job))  # type: ignore[arg-type]  # the old tuple form
    assert job.released == 0 and job.session.writes == []


def test_metadata_is_written_at_its_offsets_and_released_once() -> None:
    job: Any = _Job([(0, b"abc"), (10, b"de")])
    _loop().handle(WriteMetadata(job))
    assert job.session.writes == [(0, b"abc"), (10, b"de")]
    assert (job.written, job.released, job.error) == (5, 1, None)


def test_a_stopped_job_writes_nothing_but_still_releases() -> None:
    job: Any = _Job([(0, b"abc")], stopped=True)
    _loop().handle(WriteMetadata(job))
    assert job.session.writes == [] and job.released == 1


def test_schedule_commit_queues_a_commit_task_and_tasks_are_frozen() -> None:
    loop = _loop()
    job: Any = _Job([])
    loop.schedule_commit(job)
    task = loop.queue.get_nowait()
    assert isinstance(task, Commit) and task.job is job
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.job = None  # type: ignore[misc]
