"""What ``DataStatesIO(local_tier=...)`` adds to a pipeline: saves committed locally first and replicated behind
training, loads from the local copy where it is the one to read, removals from both tiers, recovery of a dead run's
copies (:mod:`~lightning_datastates.tiered.recovery`).

The persistent path (``ModelCheckpoint``'s own: ``s3://bucket/run/epoch=3.ckpt``) stays the checkpoint's name
everywhere Lightning sees it; its local copy is written by the engine and replicated by the
:class:`~lightning_datastates.tiered.replicator.Replicator`. The persistent path is registered as pending (a
:class:`~lightning_datastates.snapshot.pending.PendingReplication`) from before the capture until its copy is
committed, so that ``ModelCheckpoint``'s existence checks, waits, removals held back and failures of that path work as
for any save: an older top-k file goes only once the newer checkpoint is on the persistent tier.

Which copy a load reads, and which counts for ``ckpt_path="last"``: one rule, :func:`~lightning_datastates.tiered.
copies.choose_copy`, by the save stamps both copies carry; a local copy is always read with every record's CRC-32
checked (or from its resident image), and one that fails the check is passed over with a warning.

Call order and threads: every method on the training thread, but :meth:`TieredCheckpoints.local_copies` (any thread);
:meth:`TieredCheckpoints.close` wherever the engine is closed. See docs/design.md, "Tiered checkpoints".
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from lightning_datastates.config import DataStatesConfig
from lightning_datastates.errors import CheckpointCorruptError, CheckpointFlushError, ConfigError
from lightning_datastates.records.job import JobState, SnapshotJob, SnapshotStats
from lightning_datastates.records.stamp import SaveStamp
from lightning_datastates.snapshot.engine import LazyPredicate, SnapshotEngine
from lightning_datastates.snapshot.pending import PendingReplication
from lightning_datastates.storage.base import StorageWriter
from lightning_datastates.storage.local import LocalWriter
from lightning_datastates.storage.unnamed import OUT_OF_SPACE
from lightning_datastates.tiered import recovery
from lightning_datastates.tiered.copies import Choice, Decision, Presence, choose_copy, local_facts, persistent_facts
from lightning_datastates.tiered.layout import TierLayout, persistent_dir
from lightning_datastates.tiered.replicator import Replication, Replicator
from lightning_datastates.tiered.retention import local_copies, prune_local

log = logging.getLogger("lightning_datastates")

#: What :meth:`TieredCheckpoints.load` returns where the persistent copy is to be read.
NOT_LOCAL: Any = object()
#: Bytes per window of a replication, and windows in flight (a persistent backend may choose others).
_WINDOW_BYTES = 16 * 1024**2


class TieredCheckpoints:
    """The local tier of one pipeline (see the module docstring). ``writer_for`` gives the storage writer of a path
    (the pipeline's)."""

    def __init__(self, config: DataStatesConfig, writer_for: Callable[[str], StorageWriter]) -> None:
        assert config.local_tier is not None
        self.layout = TierLayout(config.local_tier)
        self.keep = config.local_keep
        self._config = config
        self._writer_for = writer_for
        self.local_writer = LocalWriter(direct_io=False)  # reads of local copies' stamps
        # Orders a save's marking of its local copy against the retention's listing and unlinking.
        self._lock = threading.Lock()
        self._replicator: Replicator | None = None
        #: Markers of this process's saves whose replication is still to come (not those given up by an abandon:
        #: the recovery at the next fit of this process replicates those, as the next run's would).
        self.live_markers: set[str] = set()
        self._given_up: set[str] = set()  # markers of copies this process gave up on (see _keep_for_recovery)
        #: Where the last load read from: ``(persistent path, local path, why)`` for a local copy, else None.
        self.last_local_read: tuple[str, str, str] | None = None
        recovery.note_tier_used(os.path.realpath(config.local_tier))

    # ------------------------------------------------------------------ training thread
    def check_directories(self, dirpaths: list[str]) -> None:
        """At setup: the local tier can be written, and no checkpoint directory lies inside it (``dirpaths``, the
        ``ModelCheckpoint`` directories known then).

        Raises:
            ConfigError: naming ``local_tier`` and the fix.
        """
        root = os.path.realpath(self.layout.root)
        for dirpath in dirpaths:
            if "://" not in dirpath or dirpath.startswith("file://"):
                self._check_outside_tier(os.path.join(os.path.realpath(dirpath.removeprefix("file://")), "x.ckpt"))
        try:
            os.makedirs(root, exist_ok=True)
            probe = os.path.join(root, f".datastates-probe.{os.getpid()}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError(
                f"local_tier={self.layout.root!r} cannot be written ({exc.strerror or exc}): give local_tier a "
                "writable directory on node-local storage, or None"
            ) from exc

    def check_supported(self, sharded: bool, num_nodes: int) -> None:
        """Refuse what the local tier does not do yet: sharded checkpoints and runs on several nodes.

        Raises:
            ConfigError: naming what is not supported and the way out.
        """
        unsupported = None
        if sharded:
            unsupported = "a sharded strategy's checkpoints (one file per rank)"
        elif num_nodes > 1:
            unsupported = f"a run on {num_nodes} nodes (each node would resume from its own local tier)"
        if unsupported is not None:
            raise ConfigError(
                f"local_tier supports single-file checkpoints on one node; {unsupported} is not: remove local_tier, "
                "or save full state dicts from one node (FSDPStrategy(state_dict_type='full'))"
            )

    def save(
        self,
        engine: SnapshotEngine,
        checkpoint: dict[str, Any],
        path: str,
        lazy: LazyPredicate | None,
        awaits_commit: bool,
        stamp: SaveStamp,
    ) -> SnapshotStats:
        """Snapshot ``checkpoint`` for the persistent ``path``: written to its local copy (carrying ``stamp``),
        replicated after the local commit. Returns as the engine's capture does.

        Raises:
            ConfigError: ``path`` lies inside the local tier.
            OSError: the local copy cannot be started (its directory, its marker).
            CheckpointCaptureError: as the engine's capture.
        """
        self._check_outside_tier(path)
        if "://" not in path:
            # As a save without a local tier makes it (in LocalWriter.begin): Lightning links last.ckpt into it
            # (save_last="link") right after this call, before the copy gets there.
            os.makedirs(persistent_dir(path), exist_ok=True)
        local_path = self.layout.local_path(path, create=True)
        assert local_path is not None
        pending = engine.pending
        pending.before_save(path)
        pending.before_save(local_path)
        with self._lock:
            marker = self.layout.mark(local_path, stamp)
            self.live_markers.add(marker)
        entry = PendingReplication(path)
        pending.register_commit(entry)  # before the capture: a fast local commit must find it registered
        item = Replication(entry, local_path, [marker])
        replicator = self._replicator_of(engine)
        try:
            stats = engine.capture(
                checkpoint,
                local_path,
                self._writer_for(local_path),
                lazy,
                awaits_commit=awaits_commit,
                on_settled=partial(self._local_write_settled, replicator, item),
                persistent_path=path,
                stamp=stamp,
            )
        except BaseException:
            self._end_unwritten(engine, item, JobState.CANCELLED)
            raise
        if stats.state == JobState.SKIPPED.value:
            self._end_unwritten(engine, item, JobState.SKIPPED)
        return stats

    def load(self, engine: SnapshotEngine | None, path: str, read: Callable[[str], Any]) -> Any:
        """The checkpoint of the persistent ``path`` from its local copy (through ``read``: the pipeline's load of a
        stored file, from its resident image or with every CRC-32 checked), or :data:`NOT_LOCAL` where the persistent
        copy must be read instead (:meth:`decide`). A ``save_last="link"`` link stands for the file it names where
        the local copy of the link's own name is not the one to read.

        Raises:
            CheckpointFlushError: the pending local write of ``path`` failed (raised by ``read``).
        """
        self.last_local_read = None
        for name in _path_then_link_target(path):
            local_path = self.local_copy_of(name)
            if local_path is None:  # no local directory for it, or one of another persistent directory
                continue
            if engine is not None:
                engine.wait_path(local_path)
            decision = self.decide(name, local_path)
            if decision.choice is Choice.NONE and os.path.isfile(local_path) and not os.path.islink(name):
                log.warning(
                    "lightning_datastates: not reading the local copy %s of %s: %s", local_path, name, decision.reason
                )
            if decision.choice is not Choice.LOCAL:
                continue
            try:
                loaded = read(local_path)
            except FileNotFoundError:
                continue  # pruned since it was found (retention, another rank's recovery): not damaged
            except (CheckpointCorruptError, OSError, RuntimeError, EOFError) as exc:
                log.warning(
                    "lightning_datastates: the local copy %s of %s is damaged (%s); loading the persistent copy",
                    local_path,
                    name,
                    exc,
                )
                return NOT_LOCAL
            self.last_local_read = (path, local_path, decision.reason)
            return loaded
        return NOT_LOCAL

    def decide(self, path: str, local_path: str) -> Decision:
        """Which copy of the persistent ``path`` to read, its local copy being at ``local_path``
        (:func:`~lightning_datastates.tiered.copies.choose_copy`). Any thread."""
        local = local_facts(self.local_writer, local_path)
        marked = local.presence is Presence.PRESENT and self._is_marked(local_path, local.stamp)
        return choose_copy(local, marked, persistent_facts(self._writer_for(path), path))

    def remove(self, engine: SnapshotEngine, path: str, remove_persistent: Callable[[], None]) -> None:
        """ModelCheckpoint's removal of the persistent ``path``: once every save before this call is on the
        persistent tier (or kept, if one fails), the pending writes of both copies cancelled and ended, remove both
        copies. Meanwhile the local copy's markers say it is not wanted: a run killed before then has the next run's
        recovery drop it rather than replicate it back."""
        local_path = self.layout.local_path(path)
        if local_path is None:
            engine.remove_after_pending(path, remove_persistent)
            return
        directory, name = os.path.split(local_path)
        with self._lock:
            self.layout.mark_unwanted([marker for marker, _ in self.layout.markers(directory).get(name, [])])
        engine.remove_after_pending(path, partial(self._remove_both, local_path, remove_persistent), (local_path,))

    def recover(self, engine: SnapshotEngine, persistent_directory: str) -> list[str]:
        """At a run's first use of ``persistent_directory`` (the pipeline's cleanup): see
        :func:`~lightning_datastates.tiered.recovery.recover`; the local copies queued for replication."""
        directory = self.local_copy_of(f"{persistent_directory.rstrip('/')}/x")
        if directory is not None:
            prefix = os.path.dirname(directory) + os.sep
            self._given_up = {marker for marker in self._given_up if not marker.startswith(prefix)}
        return recovery.recover(self, engine, persistent_directory)

    def local_copy_of(self, path: str) -> str | None:
        """Where the local copy of the persistent ``path`` is written (None where its local directory does not
        exist, or belongs to another persistent directory). Any thread."""
        try:
            return self.layout.local_path(path)
        except ConfigError:
            return None

    def local_copies(self, persistent_directory: str) -> dict[str, tuple[int, str]]:
        """The local copies of ``persistent_directory``'s checkpoints that are the ones to read (:meth:`decide`):
        persistent path -> the copy's order key (:func:`~lightning_datastates.records.stamp.order_key`); empty
        where the local tier holds none. Any thread."""
        try:
            directory = self.layout.local_dir(persistent_directory)
        except ConfigError:
            return {}
        if directory is None:
            return {}
        base = persistent_directory.rstrip("/")
        found = {}
        for name, key in local_copies(directory).items():
            path, local_path = f"{base}/{name}", os.path.join(directory, name)
            decision = self.decide(path, local_path)
            if decision.choice is Choice.LOCAL:
                found[path] = key
            elif decision.choice is Choice.NONE and not os.path.islink(path):  # a dangling last.ckpt link is no loss
                log.warning(
                    "lightning_datastates: not resuming from %s, the local copy of %s: %s",
                    local_path,
                    path,
                    decision.reason,
                )
        return found

    def close(self) -> None:
        """Wait until every replication has ended and its threads are gone."""
        if self._replicator is not None:
            self._replicator.close()

    # ------------------------------------------------------------------ internals (recovery uses some)
    def replicator_of(self, engine: SnapshotEngine) -> Replicator:
        """This tier's replicator (made on first use)."""
        return self._replicator_of(engine)

    def writer_for(self, path: str) -> StorageWriter:
        """The pipeline's storage writer of ``path``."""
        return self._writer_for(path)

    @property
    def config(self) -> DataStatesConfig:
        """The plugin's settings."""
        return self._config

    def prune(self, directory: str) -> None:
        """The retention of the local ``directory`` (:mod:`~lightning_datastates.tiered.retention`), under the lock
        that orders it against a save's marking; marked copies stay."""
        with self._lock:
            prune_local(directory, self.keep, self.layout.markers(directory))

    def _is_marked(self, local_path: str, stamp: SaveStamp | None) -> bool:
        """Whether a marker names the save the local copy at ``local_path`` holds (``stamp``): it is not replicated
        yet. A marker without a stamp (an older release's, or one torn by a crash) marks whatever copy is there."""
        directory, name = os.path.split(local_path)
        for marker, _ in self.layout.markers(directory).get(name, []):
            marked = self.layout.stamp_in(marker)
            if marked is None or marked == stamp:
                return True
        return False

    def _replicator_of(self, engine: SnapshotEngine) -> Replicator:
        if self._replicator is None:
            self._replicator = Replicator(
                self._writer_for,
                lambda: engine.resident,
                engine.pending,
                min(self._config.chunk_size, _WINDOW_BYTES),
                self._config.writer_threads,
                self._after_commit,
                self._unmark,
                self._keep_for_recovery,
            )
        return self._replicator

    def _unmark(self, markers: list[str]) -> None:
        self.live_markers.difference_update(markers)
        self.layout.unmark(markers)

    def _keep_for_recovery(self, markers: list[str]) -> None:
        """``markers`` stay: their copy was not replicated (it failed, or an abandon gave it up); the recovery at
        this process's next use of their directory (:meth:`needs_recovery`), or the next run's, replicates it."""
        self.live_markers.difference_update(markers)
        self._given_up.update(markers)

    def needs_recovery(self, persistent_directory: str) -> bool:
        """Whether this process gave up on replicating copies of ``persistent_directory`` since its last recovery
        there (a failed copy, a second Ctrl-C): the pipeline's cleanup then recovers it again. Training thread."""
        directory = self.local_copy_of(f"{persistent_directory.rstrip('/')}/x")
        if directory is None:
            return False
        directory = os.path.dirname(directory) + os.sep
        return any(marker.startswith(directory) for marker in self._given_up)

    def _after_commit(self, item: Replication) -> None:
        """Coordinator thread, once ``item`` is committed on the persistent tier: unmark the local copy, then apply
        the retention to its directory. Each step on its own: a failure of one (a full local disk) never stops the
        other."""
        try:
            self._unmark(item.markers)
        finally:
            self.prune(os.path.dirname(item.local_path))

    def _local_write_settled(self, replicator: Replicator, item: Replication, job: SnapshotJob) -> None:
        """The local write of ``item`` ended (its ``on_settled`` hook, on the writer thread, before the failure is
        reported): a failure is told as the local copy's, naming the local tier and what to change; then the
        replicator takes it."""
        with job.lock:
            if job.error is not None and not isinstance(job.error, CheckpointFlushError):
                job.error = local_write_error(self._config, item.entry.path, job.path, job.error)
        replicator.settled(item, job)

    def _end_unwritten(self, engine: SnapshotEngine, item: Replication, state: JobState) -> None:
        """End ``item``'s entry where its local write never started (skipped, or the capture raised)."""
        self._unmark(item.markers)
        item.entry.state = state
        engine.pending.finish(item.entry)

    def _remove_both(self, local_path: str, remove_persistent: Callable[[], None]) -> None:
        """Remove a checkpoint from both tiers: its markers first (a removed copy is never replicated again), then
        the persistent file, then the local copy."""
        directory, name = os.path.split(local_path)
        with self._lock:
            self._unmark([marker for marker, _ in self.layout.markers(directory).get(name, [])])
        remove_persistent()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local_path)

    def _check_outside_tier(self, path: str) -> None:
        if "://" in path:
            return
        root = os.path.realpath(self.layout.root).rstrip(os.sep) + os.sep
        if (os.path.realpath(persistent_dir(path)).rstrip(os.sep) + os.sep).startswith(root):
            raise ConfigError(
                f"the checkpoint {path} lies inside local_tier={self.layout.root!r}: the local tier holds copies of "
                "checkpoints kept elsewhere. Give ModelCheckpoint a dirpath on the persistent storage (S3, Lustre), "
                "or local_tier another directory"
            )


def local_write_error(
    config: DataStatesConfig, persistent_path: str, local_path: str, exc: BaseException
) -> CheckpointFlushError:
    """The error to report for the failed write of ``local_path``, the local copy of ``persistent_path``: it names
    the local tier, and for a full one (disk, quota, file-size limit) the settings that make room; ``exc`` chained.
    Pure."""
    where = f"writing the local copy of {persistent_path} at {local_path} failed"
    if isinstance(exc, OSError) and exc.errno in OUT_OF_SPACE:
        message = (
            f"{where}: the local tier (local_tier={config.local_tier!r}) has no room for it ({exc.strerror}). Free "
            f"space there, keep fewer replicated copies on it (local_keep={config.local_keep}), or set local_tier to "
            f"a larger disk; nothing of this checkpoint was written to {persistent_path}"
        )
    else:
        message = f"{where} (local_tier={config.local_tier!r}): {exc!r}"
    error = CheckpointFlushError(message, persistent_path)  # the checkpoint's name, as ModelCheckpoint gave it
    error.__cause__ = exc
    return error


def _path_then_link_target(path: str) -> list[str]:
    """``path``, then, where it is a local symbolic link (``save_last="link"``), the file the link names (the end of
    its chain, as the link's directory names it; maybe not replicated yet, so maybe dangling)."""
    if "://" in path or not os.path.islink(path):
        return [path]
    return [path, os.path.realpath(path)]
