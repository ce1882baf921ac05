"""A progress bar for the checkpoint bytes still being written when training ends.

Training can end while the last checkpoints are still on their way to storage; fit then waits for them. So that
this wait is not a silent pause, :func:`drain_with_progress` shows the bytes left to write in the style of the
Trainer's own progress bar: a rich bar when the Trainer uses ``RichProgressBar``, a tqdm bar otherwise. It shows
nothing when the Trainer has no progress bar (``enable_progress_bar=False``), on ranks other than global zero
(Lightning disables their bar), and when nothing is pending.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

from lightning_datastates.compat.lightning import Tqdm
from lightning_datastates.records.job import SnapshotStats

if TYPE_CHECKING:
    from lightning_datastates.plugin import DataStatesIO

#: Seconds between two refreshes of the bar.
REFRESH_S = 0.1
DESCRIPTION = "Writing checkpoints"


class _Bar(Protocol):
    def show(self, done_bytes: int) -> None: ...


def drain_with_progress(trainer: Trainer, plugin: DataStatesIO) -> None:
    """Wait until every pending checkpoint is committed or failed, showing the bytes left if the Trainer has a bar."""
    pending = [stats for stats in plugin.stats if stats.durable_s is None]
    bar_callback = trainer.progress_bar_callback
    # Lightning's bars disable themselves on other ranks than global zero and with refresh_rate=0.
    if pending and bar_callback is not None and getattr(bar_callback, "is_enabled", True):
        total = sum(stats.total_bytes for stats in pending)
        with open_bar(bar_callback, total) as bar:
            while any(stats.durable_s is None for stats in pending):
                bar.show(_done_bytes(pending))
                time.sleep(REFRESH_S)
            bar.show(total)
    plugin.drain()  # anything the loop did not watch, and the engine's own bookkeeping


def _done_bytes(pending: list[SnapshotStats]) -> int:
    # A finished checkpoint counts whole (a failed or cancelled one has nothing more to write either).
    return sum(s.total_bytes if s.durable_s is not None else min(s.written_bytes, s.total_bytes) for s in pending)


@contextmanager
def open_bar(bar_callback: ProgressBar, total_bytes: int) -> Iterator[_Bar]:
    """A bar of ``total_bytes`` in the style of ``bar_callback`` (rich for ``RichProgressBar``, tqdm otherwise)."""
    if isinstance(bar_callback, RichProgressBar):
        with _rich_bar(bar_callback, total_bytes) as bar:
            yield bar
    else:
        with _tqdm_bar(bar_callback, total_bytes) as bar:
            yield bar


class _RichBar:
    def __init__(self, progress: Any, task: Any) -> None:
        self._progress, self._task = progress, task

    def show(self, done_bytes: int) -> None:
        self._progress.update(self._task, completed=done_bytes)


@contextmanager
def _rich_bar(bar_callback: RichProgressBar, total_bytes: int) -> Iterator[_Bar]:
    from rich import progress as rich_progress

    # The Trainer's bar is still live; rich (14 and later) shows a second live display below it.
    console = bar_callback.progress.console if bar_callback.progress is not None else None
    style = bar_callback.theme.description or "none"
    columns = (
        rich_progress.TextColumn(f"[{style}]{{task.description}}"),
        rich_progress.BarColumn(),
        rich_progress.DownloadColumn(),
        rich_progress.TransferSpeedColumn(),
        rich_progress.TimeRemainingColumn(),
    )
    from rich.errors import LiveError

    progress = rich_progress.Progress(*columns, console=console)
    try:
        progress.start()
    except LiveError:  # rich before 14 allows one live display at a time: fall back to tqdm
        with _tqdm_bar(bar_callback, total_bytes) as bar:
            yield bar
        return
    try:
        yield _RichBar(progress, progress.add_task(DESCRIPTION, total=total_bytes))
    finally:
        progress.stop()


class _TqdmBar:
    def __init__(self, bar: Tqdm) -> None:
        self._bar = bar

    def show(self, done_bytes: int) -> None:
        self._bar.n = done_bytes
        self._bar.refresh()


@contextmanager
def _tqdm_bar(bar_callback: ProgressBar, total_bytes: int) -> Iterator[_Bar]:
    # As TQDMProgressBar makes its own bars; one line below the training bar, where the validation bar would be.
    position = 2 * bar_callback.process_position + 1 if isinstance(bar_callback, TQDMProgressBar) else 0
    bar = Tqdm(
        desc=DESCRIPTION,
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        position=position,
        leave=True,
        dynamic_ncols=True,
        file=sys.stdout,
        smoothing=0,
    )
    try:
        yield _TqdmBar(bar)
    finally:
        bar.close()
