"""Automatic garbage collection paused around background bursts of allocation (lightning_datastates/gcpause.py)."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from lightning_datastates.gcpause import collection_paused


@pytest.fixture(autouse=True)
def collection_enabled():
    """Each test starts with automatic collection on and leaves it as it found it."""
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def _collections_while(work) -> int:
    """How many collections ran while ``work()`` ran."""
    runs = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(record)
    try:
        work()
    finally:
        gc.callbacks.remove(record)
    return len(runs)


def _burst() -> None:
    """Objects that live a while (held in a list) and then die: what DCP's planning makes, in the thousands."""
    held = [{"index": i, "parts": [i, (i,)]} for i in range(20_000)]
    del held


def test_no_collection_runs_during_a_paused_burst_and_the_collector_is_back_after():
    assert _collections_while(_burst) > 0  # the burst does trigger collections when nothing pauses them

    def paused_burst() -> None:
        with collection_paused():
            _burst()

    assert _collections_while(paused_burst) == 0
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled():
    gc.disable()
    with collection_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_pauses_of_two_threads_end_with_the_last():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first() -> None:
        with collection_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with collection_paused():
            second_in.set()
            first_out.wait(5)
            seen["after the first left"] = gc.isenabled()
        seen["after both left"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == {"after the first left": False, "after both left": True}


def test_an_exception_in_the_block_still_ends_the_pause():
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_process_forked_during_a_pause_has_its_collector_enabled():
    """A DataLoader forks its workers at each epoch's start, maybe while the committer plans: the children must not
    run the epoch without cycle collection (no pause of the parent ever ends in them)."""
    with collection_paused():
        child = os.fork()
        if child == 0:  # the child: report through the exit status, never return into pytest
            os._exit(0 if gc.isenabled() else 1)
        assert not gc.isenabled()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
    with collection_paused():  # the module's state is intact in the parent
        assert not gc.isenabled()
    assert gc.isenabled()
