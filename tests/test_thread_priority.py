"""Opt-in lower priority of the engine's threads (``LIGHTNING_DATASTATES_THREAD_NICE``): per thread, off by default."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest

from lightning_datastates.snapshot.threads import THREAD_NICE_ENV, lower_thread_priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux behaviour")


def _in_thread() -> tuple[int, int, int]:
    """(increment applied, nice before, nice after) in a fresh thread."""
    result: list[int] = []

    def body() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        applied = lower_thread_priority()
        result.extend([applied, before, os.getpriority(os.PRIO_PROCESS, tid)])

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return result[0], result[1], result[2]


def test_unset_changes_nothing(monkeypatch: Any) -> None:
    monkeypatch.delenv(THREAD_NICE_ENV, raising=False)
    applied, before, after = _in_thread()
    assert applied == 0 and after == before


def test_lowers_only_the_calling_thread(monkeypatch: Any) -> None:
    monkeypatch.setenv(THREAD_NICE_ENV, "5")
    process_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    applied, before, after = _in_thread()
    assert applied == 5
    assert after == min(19, before + 5)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == process_nice  # the caller is untouched


@pytest.mark.parametrize("value", ["high", "25", "-3"])
def test_invalid_values_are_ignored_with_a_warning(monkeypatch: Any, caplog: Any, value: str) -> None:
    monkeypatch.setenv(THREAD_NICE_ENV, value)
    applied, before, after = _in_thread()
    assert applied == 0 and after == before
    assert THREAD_NICE_ENV in caplog.text
