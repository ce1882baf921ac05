"""What ``DataStatesIO(local_tier=...)`` adds to a pipeline: saves committed locally first and replicated behind
training, loads from the local copy where it is good, removals from both tiers, recovery of a dead run's copies.

The persistent path (``ModelCheckpoint``'s own: ``s3://bucket/run/epoch=3.ckpt``) stays the checkpoint's name
everywhere Lightning sees it; its local copy is written by the engine and replicated by the
:class:`~lightning_datastates.tiered.replicator.Replicator`. The persistent path is registered as pending (a
:class:`~lightning_datastates.snapshot.pending.PendingReplication`) from before the capture until its copy is
committed, so that ``ModelCheckpoint``'s existence checks, waits, removals held back and failures of that path work as
for any save: an older top-k file goes only once the newer checkpoint is on the persistent tier.

Which copy a load reads (:meth:`TieredCheckpoints.load`): the local one when it is not replicated yet (it is then the
newest), or when the persistent file is still the one it was replicated as (its fingerprint, kept beside the copy:
another node may have written the persistent path since), or when the persistent file is gone; always with every
record's CRC-32 checked, and a local copy that fails the check is passed over with a warning for the persistent one.
Else the persistent copy.

Call order and threads: every method on the training thread, but :meth:`TieredCheckpoints.local_copies` (any thread);
:meth:`TieredCheckpoints.close` wherever the engine is closed. See docs/design.md, "Tiered checkpoints".
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from lightning_datastates.config import DataStatesConfig
from lightning_datastates.errors import CheckpointCorruptError, CheckpointFlushError, ConfigError
from lightning_datastates.load.reader import verify_checkpoint
from lightning_datastates.records.job import JobState, SnapshotJob, SnapshotStats
from lightning_datastates.records.leftovers import writer_gone
from lightning_datastates.snapshot.engine import LazyPredicate, SnapshotEngine
from lightning_datastates.snapshot.pending import PendingReplication
from lightning_datastates.storage.base import StorageWriter, write_file
from lightning_datastates.storage.local import MAX_NAME_BYTES, OUT_OF_SPACE
from lightning_datastates.tiered.layout import TierLayout, persistent_dir
from lightning_datastates.tiered.replicator import Replication, Replicator, fingerprint_text
from lightning_datastates.tiered.retention import local_copies, prune_local

log = logging.getLogger("lightning_datastates")

#: Suffix of the file beside a replicated local copy that holds the persistent file's fingerprint at replication.
REPLICA_SUFFIX = ".datastates-replica"
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
        # Orders a save's marking of its local copy against the retention's listing and unlinking.
        self._lock = threading.Lock()
        self._replicator: Replicator | None = None

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
    ) -> SnapshotStats:
        """Snapshot ``checkpoint`` for the persistent ``path``: written to its local copy, replicated after the local
        commit. Returns as the engine's capture does.

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
            marker = self.layout.mark(local_path, _read_note(local_path))
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
        copy must be read instead (see the module docstring).

        Raises:
            CheckpointFlushError: the pending local write of ``path`` failed (raised by ``read``).
        """
        if "://" not in path and os.path.islink(path):
            path = os.path.realpath(path)  # save_last="link": the checkpoint it points to (maybe not copied yet)
        local_path = self.local_copy_of(path)
        if local_path is None:  # no local directory for it, or one of another persistent directory
            return NOT_LOCAL
        if engine is not None:
            engine.wait_path(local_path)
        if not os.path.isfile(local_path) or not self._local_is_current(local_path, path):
            return NOT_LOCAL
        try:
            return read(local_path)
        except FileNotFoundError:
            return NOT_LOCAL  # pruned since it was found (retention, another rank's recovery): not damaged
        except (CheckpointCorruptError, OSError, RuntimeError, EOFError) as exc:
            log.warning(
                "lightning_datastates: the local copy %s of %s is damaged (%s); loading the persistent copy",
                local_path,
                path,
                exc,
            )
            return NOT_LOCAL

    def remove(self, engine: SnapshotEngine, path: str, remove_persistent: Callable[[], None]) -> None:
        """ModelCheckpoint's removal of the persistent ``path``: drop a pending local write of it, then, once every
        save before this call is on the persistent tier (or kept, if one fails), remove both copies."""
        local_path = self.layout.local_path(path)
        if local_path is None:
            engine.remove_after_pending(path, remove_persistent)
            return
        engine.cancel_path(local_path)
        engine.remove_after_pending(path, partial(self._remove_both, local_path, remove_persistent))

    def recover(self, engine: SnapshotEngine, persistent_directory: str) -> list[str]:
        """At a run's first use of ``persistent_directory`` (the pipeline's cleanup): replicate the local copies a
        dead run did not (markers whose writer is gone), drop the markers of copies that never became whole and the
        temporary files of its local writes, and apply the retention; the local copies queued for replication."""
        directory = self.layout.local_dir(persistent_directory)
        if directory is None:
            return []
        # A local write the dead run was killed in leaves its temporary file here, where the persistent directory's
        # cleanup does not look: the same rule removes it (this host's dead processes; other hosts' once stale).
        self._writer_for(directory).clean_stale(directory, self._config.stale_after_s)
        adopted = []
        for name, markers in self.layout.markers(directory).items():
            gone = [
                path
                for path, parsed in markers
                if writer_gone(parsed.owner, _age_s(path), self._config.stale_after_s, tracks_own_writes=False)
            ]
            if not gone:
                continue  # a live writer's (this process's own save in flight, another run on this node)
            local_path = os.path.join(directory, name)
            persistent_path = f"{persistent_directory.rstrip('/')}/{name}"
            if not os.path.isfile(local_path):
                self.layout.unmark(gone)  # killed before its first commit here: nothing to replicate
                continue
            try:
                verify_checkpoint(self._writer_for(local_path), local_path)
            except (CheckpointCorruptError, OSError) as exc:  # damaged: never copied over the persistent file
                log.warning(
                    "lightning_datastates: not replicating %s, which a dead run did not: it is damaged (%s)",
                    local_path,
                    exc,
                )
                self.layout.unmark(gone)
                continue
            if not self._marked_copy_is_newest(persistent_path, [path for path, _ in markers]):
                log.info(
                    "lightning_datastates: not replicating %s, which a dead run did not: %s was written since (by "
                    "another node or run, or by that copy itself)",
                    local_path,
                    persistent_path,
                )
                self.layout.unmark(gone)
                continue
            log.info(
                "lightning_datastates: replicating %s to %s, which a dead run did not", local_path, persistent_path
            )
            entry = PendingReplication(persistent_path)
            engine.pending.register_commit(entry)
            self._replicator_of(engine).adopt(Replication(entry, local_path, gone))
            adopted.append(local_path)
        self._prune(directory)
        return adopted

    def local_copy_of(self, path: str) -> str | None:
        """Where the local copy of the persistent ``path`` is written (None where its local directory does not
        exist, or belongs to another persistent directory). Any thread."""
        try:
            return self.layout.local_path(path)
        except ConfigError:
            return None

    def local_copies(self, persistent_directory: str) -> dict[str, float]:
        """The local copies of ``persistent_directory``'s checkpoints: persistent path -> the copy's modification time
        (seconds since the epoch); empty where the local tier holds none. Any thread."""
        try:
            directory = self.layout.local_dir(persistent_directory)
        except ConfigError:
            return {}
        if directory is None:
            return {}
        base = persistent_directory.rstrip("/")
        return {f"{base}/{name}": stamp for name, stamp in local_copies(directory).items()}

    def close(self) -> None:
        """Wait until every replication has ended and its threads are gone."""
        if self._replicator is not None:
            self._replicator.close()

    # ------------------------------------------------------------------ internals
    def _replicator_of(self, engine: SnapshotEngine) -> Replicator:
        if self._replicator is None:
            self._replicator = Replicator(
                self._writer_for,
                lambda: engine.resident,
                engine.pending,
                min(self._config.chunk_size, _WINDOW_BYTES),
                self._config.writer_threads,
                self._after_commit,
                self.layout.unmark,
            )
        return self._replicator

    def _after_commit(self, item: Replication) -> None:
        """Coordinator thread, once ``item`` is committed on the persistent tier: note what the copy is a replica of,
        unmark it (in this order: a crash in between leaves it marked, replicated once more by the next run), then
        apply the retention to its directory."""
        if item.persistent_fingerprint is not None:
            note = fingerprint_text(item.persistent_fingerprint).encode()
            write_file(self._writer_for(item.local_path), _replica_note(item.local_path), note)
        self.layout.unmark(item.markers)
        self._prune(os.path.dirname(item.local_path))

    def _prune(self, directory: str) -> None:
        """The retention of the local ``directory``: the copies beyond the newest ``local_keep`` go, with their
        notes, marked ones stay (under the lock that orders it against a save's marking)."""
        with self._lock:
            for removed in prune_local(directory, self.keep, self.layout.markers(directory)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_replica_note(removed))

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
        self.layout.unmark(item.markers)
        item.entry.state = state
        engine.pending.finish(item.entry)

    def _local_is_current(self, local_path: str, path: str) -> bool:
        """Whether the local copy of ``path`` holds the newest checkpoint of that name (see the module docstring)."""
        directory, name = os.path.split(local_path)
        markers = self.layout.markers(directory).get(name)
        if markers:  # not replicated yet: the newest, unless the persistent file was written since
            return self._marked_copy_is_newest(path, [marker for marker, _ in markers])
        noted = _read_note(local_path) or None
        writer = self._writer_for(path)
        current = writer.fingerprint(path)
        if current is None:
            if not _exists(writer, path):
                return True  # the persistent file is gone: the local copy is all there is
            log.info(
                "lightning_datastates: cannot tell whether %s changed since %s was replicated to it (its storage "
                "gives no fingerprint now): loading it, not the local copy",
                path,
                local_path,
            )
            return False
        if noted != fingerprint_text(current):
            log.info(
                "lightning_datastates: %s changed since %s was replicated to it (another run or node wrote it): "
                "loading it, not the local copy",
                path,
                local_path,
            )
            return False
        return True

    def _marked_copy_is_newest(self, path: str, markers: list[str]) -> bool:
        """Whether the local copy of ``path``, marked as not replicated by ``markers``, is newer than the persistent
        file: the persistent file is missing, or unchanged since this node last replicated it (the newest marker says
        how it was then), or, for a name this node never replicated (or a storage that gives no fingerprint now), last
        written before that save began. Else it was
        written since: by another node (the job moved and came back), or by this copy's own replication, killed before
        its marker went (then both are the same bytes)."""
        writer = self._writer_for(path)
        current = writer.fingerprint(path)
        if current is None and not _exists(writer, path):
            return True
        newest = max(markers, key=_modified_or_zero)
        seen = self.layout.seen_in(newest)
        if seen and current is not None:  # else (its storage cannot tell now) by the times, as a name never replicated
            return seen == fingerprint_text(current)
        directory, name = path.rstrip("/").rsplit("/", 1)
        modified = {entry.name: entry.modified_s for entry in writer.list_directory(directory)}.get(name)
        return modified is None or modified <= _modified_or_zero(newest)

    def _remove_both(self, local_path: str, remove_persistent: Callable[[], None]) -> None:
        """Remove a checkpoint from both tiers: its markers first (a removed copy is never replicated again), then
        the persistent file, then the local copy."""
        directory, name = os.path.split(local_path)
        with self._lock:
            self.layout.unmark([marker for marker, _ in self.layout.markers(directory).get(name, [])])
        remove_persistent()
        for leftover in (local_path, _replica_note(local_path)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)

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


def _replica_note(local_path: str) -> str:
    """The note beside the copy at ``local_path``: ``.<name>.datastates-replica``, or, where that name would be too
    long for the file system, ``.<hash of the name>.datastates-replica``."""
    directory, name = os.path.split(local_path)
    note = f".{name}{REPLICA_SUFFIX}"
    if len(note.encode()) > MAX_NAME_BYTES:
        note = f".{hashlib.sha256(name.encode()).hexdigest()[:16]}{REPLICA_SUFFIX}"
    return os.path.join(directory, note)


def _read_note(local_path: str) -> str:
    """The persistent fingerprint noted when the copy at ``local_path`` was last replicated; empty if none."""
    try:
        with open(_replica_note(local_path)) as file:
            return file.read()
    except FileNotFoundError:
        return ""


def _exists(writer: StorageWriter, path: str) -> bool:
    """Whether something is at ``path`` (told apart from a fingerprint its storage cannot give); True where the
    storage cannot be asked now, so that the persistent file is never taken for gone by mistake."""
    try:
        return writer.exists(path)
    except Exception:  # noqa: BLE001 - unknown: as present (the local copy is then read only if shown newer)
        return True


def _age_s(path: str) -> float | None:
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def _modified_or_zero(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0
