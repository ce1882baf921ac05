"""Keep Ctrl+C (SIGINT) out of the few steps that must happen together when a checkpoint is captured.

Python raises ``KeyboardInterrupt`` in the main thread between any two bytecodes. Inside the engine's capture
that could leave a write session open but never scheduled (a temporary file nobody removes) or a checkpoint
registered but never queued (the drain at exit would wait for it forever). While such a section runs, a SIGINT
is held back and delivered to the previous handler right after it, so the interrupt still happens, a few
milliseconds later, with the engine consistent. Lightning then drains the pending writes in its exception path.
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
