"""Tiered checkpoints (``DataStatesIO(local_tier=...)``) against a real SIGKILL, on a local persistent directory and
on S3 (moto on loopback).

A run launched as tests/tiered_kill.py trains, saving every step plus ``last.ckpt``, and kills itself at one seam of
the replication: ``before`` it is queued (local copy committed), ``during`` its windows (the persistent session open:
an S3 multipart upload), ``after`` the persistent commit (markers not yet removed). Then, for each case:

- the killed run's files: every ``*.ckpt`` on either tier is whole (CRC-32s verified, and loads);
- an in-process ``fit(ckpt_path="last")`` with the same ``local_tier`` and directory resumes from the newest
  ``last.ckpt`` committed on either tier, and completes;
- afterwards, every local copy that was marked (not replicated) at the kill is on the persistent tier, bit for bit;
  every local copy left equals its persistent copy; no replication marker, no temporary file, no open multipart
  upload (nor its marker object) remains, and no replication thread.

And a move to another node: a run on tier A, then ``fit(ckpt_path="last")`` on an empty tier B resumes from the
persistent tier at the step the first run ended at.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
from typing import Any

import lightning as L
import pytest
import torch

from lightning_datastates import DataStatesIO
from lightning_datastates.load.reader import load_checkpoint, verify_checkpoint
from lightning_datastates.plugin import pipeline_of
from lightning_datastates.records.leftovers import TEMP_SUFFIX
from lightning_datastates.storage import writer_for
from lightning_datastates.storage.s3 import UPLOAD_MARKER_SUFFIX
from lightning_datastates.tiered.layout import REPLICATE_SUFFIX, TierLayout
from tests import tiered_kill
from tests.conftest import BNModel, every_step_checkpoint, make_loader, make_trainer
from tests.s3_server import require_s3, s3_endpoint_fixture, s3_fixture  # noqa: F401 - fixtures
from tests.script_support import datastates_threads, launch, output_of

pytestmark = pytest.mark.slow

#: Hang guard for the killed run (it takes about 5 s), not a performance threshold.
_RUN_TIMEOUT_S = 120


# ---------------------------------------------------------------------------------------------- the persistent tier
class _Tier:
    """The persistent tier of a test: a local directory, or ``s3://bucket/run`` (read through boto3, not the plugin)."""

    def __init__(self, tmp_path: Any, s3: Any = None) -> None:
        self.s3 = s3
        self.dirpath = s3.url("run") if s3 is not None else str(tmp_path / "persistent")

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return tiered_kill.storage_options(None if self.s3 is None else self.s3.endpoint)

    def names(self) -> dict[str, bytes]:
        """Every ``*.ckpt`` on the persistent tier, with its bytes."""
        if self.s3 is not None:
            keys = [key for key in self.s3.keys("run/") if key.endswith(".ckpt") and "/." not in key]
            return {key.rsplit("/", 1)[1]: self.s3.read(key) for key in keys}
        if not os.path.isdir(self.dirpath):
            return {}
        return {name: _read(os.path.join(self.dirpath, name)) for name in os.listdir(self.dirpath) if _is_ckpt(name)}

    def path(self, name: str) -> str:
        return f"{self.dirpath}/{name}"

    def leftovers(self) -> list[str]:
        """Temporary files, open multipart uploads and their marker objects on the persistent tier."""
        if self.s3 is not None:
            markers = [key for key in self.s3.keys("run/") if key.endswith((UPLOAD_MARKER_SUFFIX, TEMP_SUFFIX))]
            return markers + [f"open upload {key}" for key in self.s3.open_uploads()]
        return _files_ending(self.dirpath, TEMP_SUFFIX)

    def verify_all(self) -> dict[str, int]:
        """Check that every ``*.ckpt`` here is whole (CRC-32s, then a load); each one's ``global_step``."""
        writer = writer_for(self.dirpath, self.storage_options)
        steps = {}
        for name in self.names():
            path = self.path(name)
            verify_checkpoint(writer, path)
            steps[name] = int(load_checkpoint(writer, path, map_location="cpu", weights_only=False)["global_step"])
        return steps


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def _digest(data: bytes | None) -> str | None:
    """What an assertion shows of a file's bytes (not the bytes themselves)."""
    return None if data is None else f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}"


def _is_ckpt(name: str) -> bool:
    return name.endswith(".ckpt") and not name.startswith(".")


def _files_ending(directory: str, suffix: str) -> list[str]:
    found = []
    for root, _, names in os.walk(directory):
        found += [os.path.join(root, name) for name in names if name.endswith(suffix)]
    return found


# ---------------------------------------------------------------------------------------------- the local tier
def _local_dir(local_tier: str, dirpath: str) -> str:
    directory = TierLayout(local_tier).local_dir(dirpath)
    assert directory is not None, f"the run made no local copy of {dirpath} in {local_tier}"
    return directory


def _local_copies(directory: str) -> dict[str, bytes]:
    return {name: _read(os.path.join(directory, name)) for name in os.listdir(directory) if _is_ckpt(name)}


def _verify_local(directory: str) -> dict[str, int]:
    """Check that every local copy is whole (CRC-32s, then ``torch.load``); each one's ``global_step``."""
    writer = writer_for(directory)
    steps = {}
    for name in _local_copies(directory):
        path = os.path.join(directory, name)
        verify_checkpoint(writer, path)
        steps[name] = int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])
    return steps


# ---------------------------------------------------------------------------------------------- the resumed run
class _SavedNames(DataStatesIO):
    """DataStatesIO that records the file names it was asked to save (they replace the killed run's files)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.saved: set[str] = set()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.saved.add(os.path.basename(os.fspath(path)))
        super().save_checkpoint(checkpoint, path, storage_options)


class _ResumedFrom(L.Callback):
    """Notes the checkpoint and the step a fit resumed from."""

    ckpt_path: str | None = None
    global_step: int = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.ckpt_path, self.global_step = trainer.ckpt_path, trainer.global_step


def _fit_last(
    tmp_path: Any, tier: _Tier, local_tier: str, width: int, max_steps: int, save_last: Any = True
) -> tuple[_SavedNames, Any]:
    """``fit(ckpt_path="last")`` of a fresh Trainer in this process, saving as the killed run did (``save_last``);
    the plugin (the names it saved) and where it resumed from. Fails on an exception escaping a thread, or a
    background failure."""
    escaped: list[BaseException | None] = []
    before = set(threading.enumerate())  # other tests in this worker may have left plugins they never tore down
    hook = threading.excepthook
    threading.excepthook = lambda args: escaped.append(args.exc_value)
    try:
        plugin = _SavedNames(
            local_tier=local_tier, chunk_size="64KiB", writer_threads=2, storage_options=tier.storage_options
        )
        resumed = _ResumedFrom()
        trainer = make_trainer(
            str(tmp_path),
            plugin,
            callbacks=[every_step_checkpoint(tier.dirpath, save_last=save_last), resumed],
            max_epochs=-1,
            max_steps=max_steps,
        )
        torch.manual_seed(0)
        trainer.fit(BNModel(width=width), make_loader(n=64), ckpt_path="last")
    finally:
        threading.excepthook = hook
    assert escaped == [], f"exceptions escaped threads: {escaped!r}"
    pipeline_of(plugin).raise_pending_failure()  # a replication that failed in the background (teardown logs it)
    assert datastates_threads(since=before) == [], "threads outlived the fit's teardown"
    return plugin, resumed


# ---------------------------------------------------------------------------------------------- the tests
_STEP_3 = tiered_kill.KILL_NAME
_CASES = [
    pytest.param("posix", "before", 256, _STEP_3, id="posix-before"),
    pytest.param("posix", "during", 256, _STEP_3, id="posix-during"),
    pytest.param("posix", "after", 256, _STEP_3, id="posix-after"),
    pytest.param("s3", "before", 256, _STEP_3, id="s3-before"),
    # About 7.4 MB: two 5 MiB parts, so the upload is multipart, open when the second window begins.
    pytest.param("s3", "during", 768, _STEP_3, id="s3-during-multipart"),
    pytest.param("s3", "after", 256, _STEP_3, id="s3-after"),
    # The first last.ckpt never reached the persistent tier: "last" must find its local copy.
    pytest.param("posix", "before", 256, "last.ckpt", id="posix-before-first-last"),
]


@pytest.fixture
def tier(request: pytest.FixtureRequest, tmp_path: Any) -> _Tier:
    """The persistent tier of the case: a local directory, or a fresh bucket on the test's moto server."""
    if request.param == "s3":
        require_s3()
        return _Tier(tmp_path, request.getfixturevalue("s3"))
    return _Tier(tmp_path)


@pytest.mark.parametrize(("tier", "seam", "width", "killed"), _CASES, indirect=["tier"])
def test_a_run_killed_at_a_replication_seam_leaves_whole_files_and_the_next_run_replicates_and_resumes(
    tmp_path, tier, seam, width, killed
):
    """The run is killed at ``seam`` of the replication of ``killed``; nothing torn is left, and the next run on the
    node replicates what was not, resumes from the newest ``last.ckpt``, and leaves both tiers equal and clean."""
    local_tier = str(tmp_path / "local")
    args = [tier.dirpath, local_tier, seam, str(width), killed] + ([tier.s3.endpoint] if tier.s3 is not None else [])
    process = launch("tiered_kill.py", *args)
    output = output_of(process, _RUN_TIMEOUT_S, "the killed")
    assert process.returncode == -signal.SIGKILL, f"status {process.returncode}:\n{output[-4000:]}"
    assert f"killing at {seam}: " in output, output[-4000:]

    # What the kill left: whole files under every final name, on both tiers.
    directory = _local_dir(local_tier, tier.dirpath)
    local_steps = _verify_local(directory)
    persistent_steps = tier.verify_all()
    marked = {name for name in TierLayout.markers(directory) if name in local_steps}
    at_kill = {name: data for name, data in _local_copies(directory).items() if name in marked}
    assert killed in at_kill, f"{killed} is not a marked local copy: {sorted(os.listdir(directory))}"
    if seam == "after":
        # Committed on the persistent tier, whole, still marked locally: the next run copies it once more.
        assert _digest(tier.names().get(killed)) == _digest(at_kill[killed])
    else:
        assert killed not in persistent_steps  # never committed there: the next run has a replication to do
    if seam == "during" and tier.s3 is not None:
        assert tier.s3.open_uploads() == [tier.s3.key_of(tier.path(killed))], "no multipart upload open at the kill"
    whole = {**persistent_steps, **local_steps}  # every checkpoint whole on either tier at the kill, by name
    newest = max(whole.values())

    plugin, resumed = _fit_last(tmp_path, tier, local_tier, width, max_steps=newest + 2)

    # Resumed from the newest checkpoint whole on either tier (the newest save: a step-named file may be newer than
    # last.ckpt, whose save of that step was cut short by the kill, or superseded before it was written).
    newest_names = {tier.path(name) for name, step in whole.items() if step == newest}
    assert resumed.ckpt_path in newest_names and resumed.global_step == newest, (resumed.ckpt_path, whole)
    # Every copy marked at the kill is on the persistent tier, bit for bit (unless the resumed run saved that name).
    now_persistent = tier.names()
    compared = [name for name in at_kill if name not in plugin.saved]
    # A last.ckpt is saved again by the resumed run: the check below compares the newest copy on both tiers.
    assert killed in compared or killed == "last.ckpt", f"the resumed run saved {killed} again"
    for name in compared:
        assert _digest(now_persistent.get(name)) == _digest(at_kill[name]), f"{name}: not replicated after the kill"
    # Whatever the local tier keeps is replicated, and nothing of either run is left half-done.
    for name, data in _local_copies(directory).items():
        assert _digest(now_persistent.get(name)) == _digest(data), f"{name}: the local and persistent copies differ"
    assert _files_ending(local_tier, REPLICATE_SUFFIX) == []
    assert _files_ending(local_tier, TEMP_SUFFIX) == []
    assert tier.leftovers() == []
    tier.verify_all()


def test_a_run_killed_with_last_linked_to_a_copy_not_replicated_resumes_from_that_copy(tmp_path):
    """``save_last="link"``: the run is killed once ``last.ckpt`` links to step 3's checkpoint, committed locally and
    never copied, so the link dangles on the persistent tier. ``fit(ckpt_path="last")`` resumes from step 3 (its local
    copy), not from scratch, and the run's recovery puts the file the link names on the persistent tier."""
    tier, local_tier, killed = _Tier(tmp_path), str(tmp_path / "local"), _STEP_3
    process = launch("tiered_kill.py", tier.dirpath, local_tier, "before", "256", killed, TIERED_KILL_LINK="1")
    output = output_of(process, _RUN_TIMEOUT_S, "the killed")
    assert process.returncode == -signal.SIGKILL, f"status {process.returncode}:\n{output[-4000:]}"
    link = os.path.join(tier.dirpath, "last.ckpt")
    assert os.readlink(link) == killed and not os.path.exists(link), "the kill left no dangling last.ckpt link"
    directory = _local_dir(local_tier, tier.dirpath)
    at_kill = _local_copies(directory)[killed]
    assert _verify_local(directory)[killed] == 3

    _, resumed = _fit_last(tmp_path, tier, local_tier, 256, max_steps=5, save_last="link")

    assert resumed.ckpt_path == tier.path(killed) and resumed.global_step == 3
    assert _digest(tier.names().get(killed)) == _digest(at_kill), f"{killed}: not replicated after the kill"
    assert os.readlink(link) == "epoch=0-step=5.ckpt" and os.path.exists(link)
    assert _files_ending(local_tier, REPLICATE_SUFFIX) == [] and _files_ending(local_tier, TEMP_SUFFIX) == []
    assert tier.leftovers() == []


@pytest.mark.parametrize("tier", ["posix", "s3"], indirect=True)
def test_a_run_on_a_new_node_resumes_from_the_persistent_tier(tmp_path, tier):
    """The node changed: its local tier is empty. ``ckpt_path="last"`` finds the persistent ``last.ckpt`` and resumes
    at the step the first run ended at; the new tier then holds the new run's copies, replicated."""
    _fit_last(tmp_path, tier, str(tmp_path / "node-a"), 256, max_steps=3)  # nothing to resume from: from scratch
    assert tier.verify_all()["last.ckpt"] == 3
    node_b = str(tmp_path / "node-b")
    _, resumed = _fit_last(tmp_path, tier, node_b, 256, max_steps=5)
    assert resumed.ckpt_path == tier.path("last.ckpt") and resumed.global_step == 3
    assert tier.verify_all()["last.ckpt"] == 5
    directory = _local_dir(node_b, tier.dirpath)
    copies = _local_copies(directory)
    assert "last.ckpt" in copies
    for name, data in copies.items():
        assert _digest(tier.names().get(name)) == _digest(data), f"{name}: the local and persistent copies differ"
    assert _files_ending(node_b, REPLICATE_SUFFIX) == [] and tier.leftovers() == []
