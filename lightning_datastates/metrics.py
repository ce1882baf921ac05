"""What checkpointing cost, in the Trainer's loggers and as a one-line summary at the end of training.

Per checkpoint, once it is committed (the callback looks at every hook where it runs), one row goes to each of the
Trainer's loggers under the ``datastates/`` prefix, at the next training step where Lightning sends its own rows
(``Trainer(log_every_n_steps=...)``, as ``LearningRateMonitor`` does; what is committed after the last such step goes
at the end of training), with that step:

==================================  ====================================================================================
key                                 meaning
==================================  ====================================================================================
``datastates/blocked_s``            training time lost to this checkpoint: the save call plus the barrier waits (s)
``datastates/bytes``                size of the file written (bytes)
``datastates/copy_MB_per_s``        tensor bytes copied into host memory / seconds from the save call to the copy's end
``datastates/flush_MB_per_s``       file bytes / seconds from the save call until the commit (1 MB = 10^6 bytes)
``datastates/durable_s``            seconds from the save call until the file was committed (with a local tier: its
                                    local copy)
``datastates/persistent_durable_s`` with a local tier: seconds from the save call until the copy at the persistent path
                                    was committed
``datastates/replicate_MB_per_s``   with a local tier: file bytes / seconds from the local commit to the persistent one
``datastates/arena_occupancy``      highest fraction of the host arena held by pending checkpoints (not retained ones)
==================================  ====================================================================================

Across checkpoints and processes, ``torchmetrics`` aggregates (``MeanMetric``, ``MaxMetric``, ``SumMetric``) are
updated with the same values and computed at the end of training; ``compute`` syncs them across processes (the
way Lightning syncs the metric objects given to ``self.log``), so every rank must reach it, as every rank reaches
``on_train_end``. The results are logged as ``datastates/<name>_mean``, ``_max``, ``_total`` and
``datastates/checkpoints``, and printed as one line on global rank zero. Checkpoints are saved by global rank 0
only, so the other ranks contribute nothing but their (empty) share of the sync.

Nothing is logged when the Trainer has no logger (``logger=False``); the summary is printed all the same.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from lightning.pytorch import Trainer
from torchmetrics import MaxMetric, MeanMetric, Metric, SumMetric

from lightning_datastates.compat.lightning import logging_step
from lightning_datastates.pipeline import CheckpointPipeline
from lightning_datastates.records.job import JobState, SnapshotStats

#: Every metric key starts with this.
PREFIX = "datastates/"
_MB = 1e6


def checkpoint_metrics(stats: SnapshotStats, arena_occupancy: float | None = None) -> dict[str, float]:
    """The per-checkpoint values logged for a committed checkpoint (keys with :data:`PREFIX`)."""
    values = {"blocked_s": stats.blocked_s, "bytes": float(stats.total_bytes)}
    if stats.durable_s is not None:
        values["durable_s"] = stats.durable_s
        if stats.durable_s > 0:
            values["flush_MB_per_s"] = stats.total_bytes / stats.durable_s / _MB
    if stats.copy_s is not None and stats.copy_s > 0:
        values["copy_MB_per_s"] = stats.payload_bytes / stats.copy_s / _MB
    if stats.persistent_durable_s is not None:
        values["persistent_durable_s"] = stats.persistent_durable_s
        if stats.durable_s is not None and stats.persistent_durable_s > stats.durable_s:
            values["replicate_MB_per_s"] = stats.total_bytes / (stats.persistent_durable_s - stats.durable_s) / _MB
    if arena_occupancy is not None:
        values["arena_occupancy"] = arena_occupancy
    return {PREFIX + name: value for name, value in values.items()}


@dataclass
class _Watched:
    """A checkpoint not yet final, with the highest arena occupancy seen while it was pending."""

    stats: SnapshotStats
    arena_occupancy: float | None = None


class CheckpointMetrics:
    """Collects :class:`~lightning_datastates.SnapshotStats` as checkpoints finish; logs and aggregates them.

    Thread model: every method is called on the training thread (from the callback's hooks). Call order per fit:
    :meth:`start`; :meth:`observe` at any hook and :meth:`log_committed` at the steps where Lightning logs, any number
    of times; :meth:`finish` at the end of training.
    """

    def __init__(self) -> None:
        self._watched: list[_Watched] = []
        self._unlogged: list[_Watched] = []  # final (committed, failed or superseded), not yet logged nor counted
        self._last_seen: SnapshotStats | None = None
        # name -> metric; ``compute`` syncs across processes, so all ranks update (or not) the same set.
        self.aggregates: dict[str, Metric] = {
            "blocked_s_mean": MeanMetric(),
            "blocked_s_max": MaxMetric(),
            "durable_s_mean": MeanMetric(),
            "durable_s_max": MaxMetric(),
            "persistent_durable_s_mean": MeanMetric(),
            "persistent_durable_s_max": MaxMetric(),
            "copy_MB_per_s_mean": MeanMetric(),
            "flush_MB_per_s_mean": MeanMetric(),
            "arena_occupancy_max": MaxMetric(),
            "bytes_total": SumMetric(),
            "checkpoints": SumMetric(),
            "failed": SumMetric(),
            "superseded": SumMetric(),
        }
        self._device: torch.device | None = None
        self._reset_aggregates()

    def start(self, pipeline: CheckpointPipeline) -> None:
        """Begin a fit: checkpoints already in ``pipeline``'s history are not this fit's; the aggregates start
        empty."""
        history = pipeline.stats
        self._last_seen = history[-1] if history else None
        self._watched = []
        self._unlogged = []
        self._reset_aggregates()

    def observe(self, pipeline: CheckpointPipeline) -> None:
        """Pick up new checkpoints, sample the arena, and keep every checkpoint that became final since last time
        for :meth:`log_committed`."""
        history = pipeline.stats
        new: list[SnapshotStats] = []
        for stats in reversed(history):  # newest first, down to the last one already seen
            if stats is self._last_seen:
                break
            new.append(stats)
        if history:
            self._last_seen = history[-1]
        self._watched.extend(_Watched(stats) for stats in reversed(new))
        if not self._watched:
            return
        occupancy = pipeline.arena_occupancy()
        finished: list[_Watched] = []
        for watched in self._watched:
            if occupancy is not None:
                watched.arena_occupancy = max(occupancy, watched.arena_occupancy or 0.0)
            if watched.stats.final:  # committed, failed or cancelled (and replicated or not, with a local tier)
                finished.append(watched)
        if finished:
            self._watched = [w for w in self._watched if not w.stats.final]
            self._unlogged.extend(finished)

    def log_committed(self, trainer: Trainer) -> None:
        """Send each checkpoint that became final since the last call to the loggers (committed ones) and the
        aggregates, at the step Lightning logs now."""
        finished, self._unlogged = self._unlogged, []
        if finished:
            self._record(trainer, finished)

    def finish(self, trainer: Trainer, pipeline: CheckpointPipeline) -> None:
        """After the drain: log what is left, then the aggregates; print the summary; start over for the next fit.

        Every rank must call this (the aggregates sync across processes).
        """
        self.observe(pipeline)
        self.log_committed(trainer)
        self._move_to(trainer.strategy.root_device)
        with warnings.catch_warnings():
            # Ranks other than 0 save nothing: computing with no update is expected there, not a mistake.
            warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
            totals = {name: float(metric.compute()) for name, metric in self.aggregates.items()}
        self._reset_aggregates()
        self._watched = []
        if totals["checkpoints"] == 0 and totals["failed"] == 0:
            return
        if totals["checkpoints"] > 0:
            # A metric never updated (persistent_durable_s without a local tier) computes to nan or -inf: not logged.
            logged = {
                name: value for name, value in totals.items() if name not in _COUNTED_ONLY and math.isfinite(value)
            }
            _log(trainer, {PREFIX + name: value for name, value in logged.items()})
        if trainer.is_global_zero:
            print(summary_line(totals, pipeline.config.on_flush_error), flush=True)

    def _record(self, trainer: Trainer, finished: list[_Watched]) -> None:
        self._move_to(trainer.strategy.root_device)
        for watched in finished:
            stats = watched.stats
            # With a local tier, a checkpoint counts as committed once on both tiers.
            state = stats.state if stats.state != JobState.COMMITTED.value else (stats.replication or stats.state)
            if state != JobState.COMMITTED.value:
                if state == JobState.FAILED.value:
                    self.aggregates["failed"].update(1.0)
                elif state == JobState.CANCELLED.value:
                    self.aggregates["superseded"].update(1.0)
                continue
            values = checkpoint_metrics(stats, watched.arena_occupancy)
            _log(trainer, values)
            self.aggregates["checkpoints"].update(1.0)
            self.aggregates["bytes_total"].update(float(stats.total_bytes))
            for name, value in values.items():
                short = name[len(PREFIX) :]
                for suffix in ("_mean", "_max"):
                    if short + suffix in self.aggregates:
                        self.aggregates[short + suffix].update(value)

    def _reset_aggregates(self) -> None:
        for metric in self.aggregates.values():
            metric.reset()
            metric.set_dtype(torch.float64)  # after reset, which restores float32: byte totals past 2**24 stay exact

    def _move_to(self, device: torch.device) -> None:
        # The sync in ``compute`` gathers the states with the process group's backend (NCCL needs CUDA tensors).
        if self._device != device:
            for metric in self.aggregates.values():
                metric.to(device)
                metric.set_dtype(torch.float64)  # `to` resets the dtype that inputs are cast to
            self._device = device


#: Totals said in the summary line, not logged.
_COUNTED_ONLY = ("failed", "superseded")


def summary_line(totals: dict[str, float], on_flush_error: str = "raise") -> str:
    """The one-line summary printed at the end of training, from :meth:`CheckpointMetrics.finish`'s totals; failures
    are said as the plugin's ``on_flush_error`` reported them."""
    count = int(totals["checkpoints"])
    parts = [f"lightning_datastates: {count} checkpoint(s), {_human_bytes(totals['bytes_total'])} committed"]
    if count:
        parts.append(
            f"training blocked {totals['blocked_s_mean'] * 1e3:.1f} ms per checkpoint "
            f"(max {totals['blocked_s_max'] * 1e3:.1f} ms)"
        )
        durable = f"durable {totals['durable_s_mean']:.2f} s after the save (max {totals['durable_s_max']:.2f} s)"
        if totals.get("persistent_durable_s_max", 0.0) > 0:  # a local tier: durable there, then persistent
            durable = (
                f"durable {totals['durable_s_mean']:.2f} s after the save locally (max {totals['durable_s_max']:.2f} "
                f"s), {totals['persistent_durable_s_mean']:.2f} s persistent (max "
                f"{totals['persistent_durable_s_max']:.2f} s)"
            )
        parts.append(
            f"copy {totals['copy_MB_per_s_mean']:.0f} MB/s, flush {totals['flush_MB_per_s_mean']:.0f} MB/s, {durable}"
        )
        parts.append(f"host arena up to {100 * totals['arena_occupancy_max']:.0f}% full")
    superseded = int(totals.get("superseded", 0.0))
    if superseded:
        # A pending save cancelled: the same file saved again (last.ckpt at every save: only the newer is written) or
        # removed (top-k) before it was written.
        parts.append(f"{superseded} not written: a newer save or a removal of the same file came first")
    failed = int(totals["failed"])
    if failed:
        reported = "logged as warnings above" if on_flush_error == "warn" else "see the CheckpointFlushError raised"
        parts.append(f"{failed} FAILED ({reported})")
    return "; ".join(parts)


def _log(trainer: Trainer, values: dict[str, float]) -> None:
    """Send ``values`` to every logger of the Trainer, at the step ``self.log`` uses (as LearningRateMonitor)."""
    if not trainer.loggers:
        return
    step = logging_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


def _human_bytes(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
