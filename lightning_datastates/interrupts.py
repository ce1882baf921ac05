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
the second and third Ctrl+C did nothing while the writes drained.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


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

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            previous(*received[0])  # the default handler raises KeyboardInterrupt here, after the section


@contextmanager
def sigint_sets(event: threading.Event, interrupted: bool) -> Iterator[bool]:
    """While the block runs, a SIGINT sets ``event`` (and raises nothing); yield whether it will.

    Main thread only. The handler replaces Python handlers and the default action; it replaces an ignored SIGINT only
    when ``interrupted`` (the run was stopped by a Ctrl+C, and Lightning ignores further ones during its shutdown: a
    Ctrl+C then means the user, not a launcher that started the process with SIGINT ignored). A C handler installed
    by another library stays. The previous handler is restored afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or (previous is signal.SIG_IGN and not interrupted):
        yield False
        return

    def note(signum: int, frame: FrameType | None) -> None:
        event.set()

    signal.signal(signal.SIGINT, note)
    try:
        yield True
    finally:
        signal.signal(signal.SIGINT, previous)
