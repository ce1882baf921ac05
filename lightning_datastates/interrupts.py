"""Ctrl+C (SIGINT) around the engine: kept out of a capture's critical steps, and turned into a request while writes
drain after an interruption.

:func:`sigint_deferred`: Python raises ``KeyboardInterrupt`` in the main thread between any two bytecodes. Inside
the engine's capture that could leave a write session open but never scheduled (a temporary file nobody removes) or
a checkpoint registered but never queued (the drain at exit would wait for it forever). While such a section runs, a
SIGINT is held back and delivered to the previous handler right after it, so the interrupt still happens, a few
milliseconds later, with the engine consistent. Lightning then drains the pending writes in its exception path.

:func:`sigint_sets`: while that drain runs (:func:`~lightning_datastates.progress.drain_on_interrupt`), a further
Ctrl+C only sets an event, which the waiting loop polls to abandon the writes. Lightning ignores SIGINT from its
"attempting graceful shutdown" on (so that more Ctrl+C cannot interrupt its shutdown): that is why, without this,
the second and third Ctrl+C did nothing while the writes drained. A further Ctrl+C that came while
:func:`sigint_deferred` held the first back (a save waiting for room in the host arena) counts as one pressed during
the drain: the drain then abandons the writes at once instead of waiting for all of them.

:func:`ignore_sigint_in_shutdown`: Lightning's Trainer teardown puts back the SIGINT handler the run started with
(Python's, which raises ``KeyboardInterrupt``) before Lightning exits the process; a Ctrl+C after the drain, while
the process ends (a ``finally`` of the script, the interpreter waiting for threads), then killed it by the signal
(exit status -2, with a traceback). The callback has that teardown put back a handler that only says the run is
ending.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

log = logging.getLogger("lightning_datastates")

#: Ctrl+C pressed while :func:`sigint_deferred` held back an earlier one (beyond the one it delivers); the next
#: :func:`sigint_sets` takes them as pressed during its block. Reset when a section begins: they belong to one
#: interruption. Main thread only.
_held_repeats = 0


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold back SIGINT while the block runs and deliver it to the previous handler afterwards.

    Only the main thread receives Python signal handlers, and only it may change them: elsewhere, or when another
    library installed a non-Python handler, the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN / SIG_DFL / a C handler: nothing raises inside the block
        yield
        return
    received: list[tuple[int, FrameType | None]] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        received.append((signum, frame))

    global _held_repeats
    _held_repeats = 0
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            _held_repeats = len(received) - 1  # the user pressed again: the drain that follows abandons at once
            previous(*received[0])  # the default handler raises KeyboardInterrupt here, after the section


@contextmanager
def sigint_sets(event: threading.Event, interrupted: bool) -> Iterator[bool]:
    """While the block runs, a SIGINT sets ``event`` (and raises nothing); yield whether it will.

    Main thread only. The handler replaces Python handlers and the default action; it replaces an ignored SIGINT only
    when ``interrupted`` (the run was stopped by a Ctrl+C, and Lightning ignores further ones during its shutdown: a
    Ctrl+C then means the user, not a launcher that started the process with SIGINT ignored). A C handler installed
    by another library stays. The previous handler is restored afterwards. With ``interrupted``, a Ctrl+C that came
    while :func:`sigint_deferred` held back the one that stopped the run sets ``event`` at once.
    """
    global _held_repeats
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or (previous is signal.SIG_IGN and not interrupted):
        yield False
        return
    if interrupted and _held_repeats:
        event.set()  # pressed again before this wait could listen: the user asked for the abandon already
    _held_repeats = 0

    def note(signum: int, frame: FrameType | None) -> None:
        event.set()

    signal.signal(signal.SIGINT, note)
    try:
        yield True
    finally:
        signal.signal(signal.SIGINT, previous)


def ignore_sigint_in_shutdown(handlers: dict[Any, Any]) -> None:
    """Have a Ctrl+C while the run shuts down only say so: set the SIGINT entry of ``handlers`` (the handlers that
    Lightning's Trainer teardown puts back, ``compat.lightning.restored_signal_handlers``) to :func:`_shutting_down`.

    Call it (main thread, the callback's ``on_exception``) only where Lightning ignores SIGINT for its shutdown after a
    ``KeyboardInterrupt`` and then exits the process; there SIGINT stays handled so until the process ends.
    """
    if signal.SIGINT in handlers and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        handlers[signal.SIGINT] = _shutting_down


def _shutting_down(signum: int, frame: FrameType | None) -> None:
    """SIGINT while the run ends after a Ctrl+C: said once, nothing raised (see :func:`ignore_sigint_in_shutdown`)."""
    global _said_shutting_down
    if not _said_shutting_down:
        _said_shutting_down = True
        log.warning(
            "lightning_datastates: Ctrl-C: the run is already ending (Lightning exits once its shutdown is done); "
            "SIGTERM or SIGKILL end it now, and what a write in flight leaves is removed by "
            "`python -m lightning_datastates clean DIR` or the next run's setup"
        )


_said_shutting_down = False
