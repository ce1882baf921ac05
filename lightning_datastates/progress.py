"""A progress bar for the checkpoint bytes still being written when training ends or is interrupted.

Training can end while the last checkpoints are still on their way to storage; fit then waits for them. So that
this wait is not a silent pause, :func:`drain_with_progress` shows the bytes left to write in the style of the
Trainer's own progress bar: a rich bar when the Trainer uses ``RichProgressBar``, a tqdm bar otherwise. It shows
nothing when the Trainer has no progress bar (``enable_progress_bar=False``), on ranks other than global zero
(Lightning disables their bar), and when nothing is pending.

:func:`drain_on_interrupt` is the same wait after an exception (Ctrl+C among them: the callback's ``on_exception``),
announced by one line that says what it waits for, and cut short by a further Ctrl+C, which abandons the writes in
flight (:meth:`~lightning_datastates.snapshot.engine.SnapshotEngine.abandon`) so that the process ends at once.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

from lightning_datastates.compat.lightning import Tqdm
from lightning_datastates.interrupts import sigint_sets
from lightning_datastates.records.job import JobState, SnapshotJob, SnapshotStats
from lightning_datastates.snapshot.engine import ABANDON_WAIT_S, Abandoned, SnapshotEngine
from lightning_datastates.snapshot.pending import PendingCommit, PendingReplication

log = logging.getLogger("lightning_datastates")

#: Seconds between two refreshes of the bar.
REFRESH_S = 0.1
DESCRIPTION = "Writing checkpoints"


class _Bar(Protocol):
    def show(self, done_bytes: int) -> None: ...


class Drainable(Protocol):
    """What :func:`drain_with_progress` waits on: the plugin, or its pipeline (``pipeline_of(plugin)``)."""

    @property
    def stats(self) -> list[SnapshotStats]:
        """What recent checkpoints cost, most recent last (``durable_s`` None: still pending)."""
        ...

    def drain(self) -> None:
        """Wait until every pending checkpoint is committed or failed."""
        ...


def drain_with_progress(trainer: Trainer, plugin: Drainable) -> None:
    """Wait until every pending checkpoint of ``plugin`` (the plugin or its pipeline) is committed or failed, showing
    the bytes left if the Trainer has a bar."""
    pending = _unfinished(plugin.stats)
    bar_callback = trainer.progress_bar_callback
    # Lightning's bars disable themselves on other ranks than global zero and with refresh_rate=0.
    if pending and bar_callback is not None and getattr(bar_callback, "is_enabled", True):
        total = sum(_bytes_to_move(stats) for stats in pending)
        with open_bar(bar_callback, total) as bar:
            while any(not stats.final for stats in pending):
                bar.show(_done_bytes(pending))
                time.sleep(REFRESH_S)
            bar.show(total)
    plugin.drain()  # anything the loop did not watch, and the engine's own bookkeeping


def drain_on_interrupt(trainer: Trainer, engine: SnapshotEngine, exception: BaseException) -> bool:
    """After ``exception`` stopped the run: wait until every pending save of ``engine`` (the plugin's:
    ``pipeline_of(plugin).engine``) is committed or failed, saying so, unless a Ctrl+C comes meanwhile, which abandons
    them; return whether they were abandoned.

    Call order: the callback's ``on_exception``, on the main thread, before it reports the pending failures. With
    writes pending it first logs one line (a warning, so that a terminal shows it without any logging set up): which
    checkpoints it waits for, by name, how many MiB are still to be handed to storage and how many commits are still to
    finish (an S3 upload whose bytes were all handed over is still sending its last parts until its commit), and,
    where a Ctrl+C can reach this wait, that pressing it again abandons them. Then it shows the bar of
    :func:`drain_with_progress`. A Ctrl+C during the wait (Lightning ignores SIGINT during its shutdown:
    :func:`~lightning_datastates.interrupts.sigint_sets` takes it over for the wait; one pressed while a save held it
    back counts too) abandons the writes (:meth:`~lightning_datastates.snapshot.engine.SnapshotEngine.abandon`):
    checkpoints committed before stay whole, nothing half-written is published, no older checkpoint is removed; a line
    names what was given up and what landed whole meanwhile (a file whose commit had begun). This returns True and the
    caller goes on with its shutdown (Lightning's teardown, then its exit), which then waits for nothing more.
    """
    if not engine.pending.outstanding():
        return False
    pending = _unfinished(engine.history)
    abandon = threading.Event()
    with sigint_sets(abandon, interrupted=isinstance(exception, KeyboardInterrupt)) as catchable:
        log.warning("lightning_datastates: %s", _waiting_line(engine, catchable))
        with _optional_bar(trainer, sum(_bytes_to_move(stats) for stats in pending)) as bar:
            # Polled, not a blocking wait: the SIGINT handler only sets the event (a handler must not take locks
            # the interrupted wait may hold), and a sleep returns to it within REFRESH_S.
            while engine.pending.outstanding() and not abandon.is_set():
                bar.show(_done_bytes(pending))
                time.sleep(REFRESH_S)
            if not abandon.is_set():
                bar.show(_done_bytes(pending))
    if not abandon.is_set():
        engine.drain()  # nothing is left: the engine's own bookkeeping
        return False
    log.warning("lightning_datastates: Ctrl-C: abandoning the checkpoints still being written")
    entries = engine.pending.outstanding()
    landed = _landed_while_waiting(pending, entries)  # taken before the abandon: what lands after is among entries
    started = time.monotonic()
    abandoned = engine.abandon()
    # The engine waits for its own files; a copy to the persistent tier is asked to stop: give it what is left of the
    # same time to abort its upload, so the line can tell whether it did.
    for entry in entries:
        if isinstance(entry, PendingReplication):
            entry.finished.wait(max(0.0, ABANDON_WAIT_S - (time.monotonic() - started)))
    log.warning("lightning_datastates: %s", _abandoned_line(entries, abandoned, landed))
    return True


def _unfinished(history: Iterable[SnapshotStats]) -> list[SnapshotStats]:
    """The checkpoints of ``history`` not yet committed or failed (with a local tier: on both tiers). A skipped one
    (``on_arena_full="skip"``) never gets a ``durable_s``: it has nothing to write and is left out, or a drain would
    wait for it forever."""
    return [stats for stats in history if not stats.final and stats.state != JobState.SKIPPED.value]


def _bytes_to_move(stats: SnapshotStats) -> int:
    """The bytes a checkpoint writes: its file, twice with a local tier (the local copy, then its replication)."""
    return stats.total_bytes * (1 if stats.replication is None else 2)


def _waiting_line(engine: SnapshotEngine, catchable: bool) -> str:
    """What the wait after an exception waits for: every checkpoint by name, the bytes still to hand to storage, the
    commits still to finish (sharded directories' among them)."""
    names: list[str] = []
    left_bytes = commits = 0
    for stats in _unfinished(engine.history):
        names.append(stats.persistent_path or stats.path)
        if stats.durable_s is None:  # the file itself (with a local tier: its local copy)
            left_bytes += stats.total_bytes - min(stats.written_bytes, stats.total_bytes)
            commits += 1
        if stats.replication == "pending":  # its copy to the persistent tier
            left_bytes += stats.total_bytes - min(stats.replicated_bytes, stats.total_bytes)
            commits += 1
    for entry in engine.pending.outstanding():
        if isinstance(entry, PendingCommit) and not isinstance(entry, PendingReplication):  # a sharded directory
            # Its shard files are among the checkpoints above: the directory is what the user named.
            names = [name for name in names if not name.startswith(entry.path.rstrip("/") + "/")] + [entry.path]
            commits += 1
    count = len(names)
    line = (
        f"waiting for {count} checkpoint{'s' if count != 1 else ''} still being written "
        f"({left_bytes / 1024**2:.1f} MiB still to hand to storage, {commits} commit{'s' if commits != 1 else ''} "
        f"to finish) before shutting down: {_names(names)}"
    )
    return line + ("; press Ctrl-C again to abandon them (earlier checkpoints stay whole)" if catchable else "")


def _landed_while_waiting(waited_for: list[SnapshotStats], entries: list[SnapshotJob | PendingCommit]) -> list[str]:
    """The names of the checkpoints the wait began with (``waited_for``) that are committed (on both tiers) and no
    longer among the pending ``entries``."""
    in_entries = {id(entry.stats) for entry in entries if isinstance(entry, SnapshotJob)}
    return [
        stats.persistent_path or stats.path
        for stats in waited_for
        if id(stats) not in in_entries
        and stats.final
        and stats.state == JobState.COMMITTED.value
        and stats.replication in (None, JobState.COMMITTED.value)
    ]


def _abandoned_line(entries: list[SnapshotJob | PendingCommit], abandoned: Abandoned, landed: list[str]) -> str:
    """What an abandon gave up (by name), what landed whole meanwhile (``landed``: during the wait; and among
    ``entries``, what was pending when the abandon began, those whose commit had begun), and what is left for
    ``clean``."""
    landed = list(landed)
    given_up: list[str] = []
    kept_locally: list[str] = []
    for name, parts in _checkpoints(entries):
        if all(_landed(part) for part in parts):
            landed.append(name)
            continue
        given_up.append(name)
        if isinstance(parts[-1], PendingReplication) and all(_landed(part) for part in parts[:-1]):
            kept_locally.append(name)  # its local copy is committed; only the copy to the persistent tier stopped
    count = len(given_up)
    line = f"Ctrl-C: gave up {count} checkpoint{'s' if count != 1 else ''} in flight"
    line += f" ({_names(given_up)}): none of them was published" if given_up else ""
    if landed:
        line += f"; {len(landed)} landed whole while it waited ({_names(landed)})"
    line += "; the checkpoints committed before are whole"
    if kept_locally:
        line += (
            f". The local copies of {_names(kept_locally)} are whole on the local tier: the next run on this node "
            "copies them to their persistent path"
        )
    if abandoned.unfinished:
        line += (
            f". {len(abandoned.unfinished)} of them {'is' if len(abandoned.unfinished) == 1 else 'are'} still in a "
            f"storage call ({_names(abandoned.unfinished)}): if the process ends first, what they leave is removed "
            "by `python -m lightning_datastates clean DIR` or the next run's setup"
        )
    return line


def _checkpoints(entries: list[SnapshotJob | PendingCommit]) -> list[tuple[str, list[SnapshotJob | PendingCommit]]]:
    """``entries`` by checkpoint, in order: a save with a local tier is two entries, its local write (a job) and its
    copy to the persistent path (registered just before the job), which go together as ``[job, copy]``."""
    checkpoints: list[tuple[str, list[SnapshotJob | PendingCommit]]] = []
    for entry in entries:
        name = _name_of(entry)
        if isinstance(entry, SnapshotJob) and entry.stats.persistent_path is not None:
            for _, parts in reversed(checkpoints):
                if len(parts) == 1 and isinstance(parts[0], PendingReplication) and parts[0].path == name:
                    parts.insert(0, entry)
                    break
            else:
                checkpoints.append((name, [entry]))
            continue
        checkpoints.append((name, [entry]))
    return checkpoints


def _landed(entry: SnapshotJob | PendingCommit) -> bool:
    return entry.state is JobState.COMMITTED and entry.finished.is_set()


def _name_of(entry: SnapshotJob | PendingCommit) -> str:
    """The checkpoint's name as ``ModelCheckpoint`` gave it (a local copy's is its persistent path)."""
    if isinstance(entry, SnapshotJob):
        return entry.stats.persistent_path or entry.path
    return entry.path


def _names(names: list[str]) -> str:
    """``names`` for a line: in order, each once (``(2 saves)`` where one path was saved more than once), the first
    :data:`_NAMED` of them and how many more."""
    counts = Counter(names)
    unique = [f"{name} ({counts[name]} saves)" if counts[name] > 1 else name for name in dict.fromkeys(names)]
    shown = ", ".join(unique[:_NAMED])
    return shown + (f" and {len(unique) - _NAMED} more" if len(unique) > _NAMED else "")


#: Most checkpoint names one line lists.
_NAMED = 8


class _NoBar:
    def show(self, done_bytes: int) -> None:
        pass


@contextmanager
def _optional_bar(trainer: Trainer, total_bytes: int) -> Iterator[_Bar]:
    """The bar of :func:`drain_with_progress` where the Trainer shows one and there are bytes to show; else none."""
    bar_callback = trainer.progress_bar_callback
    if total_bytes and bar_callback is not None and getattr(bar_callback, "is_enabled", True):
        with open_bar(bar_callback, total_bytes) as bar:
            yield bar
    else:
        yield _NoBar()


def _done_bytes(pending: list[SnapshotStats]) -> int:
    # A finished checkpoint counts whole (a failed or cancelled one has nothing more to write either).
    return sum(_bytes_to_move(s) if s.final else _moved_bytes(s) for s in pending)


def _moved_bytes(stats: SnapshotStats) -> int:
    """The bytes a pending checkpoint has written so far (its local copy whole once durable, plus what is
    replicated)."""
    local = stats.total_bytes if stats.durable_s is not None else min(stats.written_bytes, stats.total_bytes)
    return local + min(stats.replicated_bytes, stats.total_bytes)


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
