"""The ``dcp`` method: ``torch.distributed.checkpoint.async_save`` as a Lightning ``CheckpointIO``, and its barrier.

Runs in a worker subprocess (:mod:`lightning_datastates.benchmark.worker`): ``save_checkpoint`` and the barrier on
the training thread; DCP stages on its stager's thread and writes on its own, and the recording callbacks run there.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO

from lightning_datastates.benchmark.recording import Recorder, mark_saved


def stager_survives_staging() -> bool:
    """Whether one DCP ``DefaultStager`` can stage twice.

    torch 2.11 closes a ``DefaultStager``'s inner stager at the end of every staging, and a closed one fails the next
    time with ``KeyError: <class 'type'>`` in ``deepcopy_with_tensor_offload`` (pytorch/pytorch#183413, fixed by
    pytorch/pytorch#183424). Tried on a one-element state dict, not inferred from the version.
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    probe = DefaultStager(
        StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
        )
    )
    try:
        for _ in range(2):
            probe.stage({"probe": torch.zeros(1)})
    except KeyError:
        return False
    finally:
        probe.close()
    return True


def staging_options() -> Any:
    """The options of the benchmarks' DCP ``DefaultStager``: staging on a thread of its own, into pinned memory with
    non-blocking copies where CUDA is present. None where this torch has no ``DefaultStager`` (torch 2.7: its
    ``async_save`` has no stager argument and copies the state to CPU memory on the calling thread)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
    except ImportError:
        return None
    cuda = torch.cuda.is_available()
    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
    )


class DcpAsyncIO(CheckpointIO):
    """Benchmark-only: ``torch.distributed.checkpoint.async_save`` as a CheckpointIO (each checkpoint a directory).

    No process group (``no_dist=True``); one ``DefaultStager`` reused across saves, pinned where CUDA is present,
    staging on its own thread (where torch closes a stager after one staging, see :func:`stager_survives_staging`,
    each save gets a new one, as ``async_save`` without a stager would). Training must not change the state before
    staging ended: :class:`DcpBarrier` waits for it in ``on_before_optimizer_step``. Saves only: loading is not
    benchmarked. 1) :meth:`save_checkpoint` and :meth:`wait_staging` on the training thread (staging and upload run
    on DCP's threads, their callbacks there too) 2) :meth:`teardown` at the end of ``fit``.
    """

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.staging_options = staging_options()
        # No stager: this torch's async_save stages on the calling thread (see staging_options).
        self.reuse_stager = self.staging_options is None or stager_survives_staging()
        self.stager: Any = None if self.staging_options is None else self._new_stager()
        self.stager_used = False
        self.staging: list[tuple[Any, dict[str, Any]]] = []
        self.uploads: list[Any] = []

    def _new_stager(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager

        return DefaultStager(self.staging_options)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Start an asynchronous DCP save of ``checkpoint`` into the directory ``path``."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import async_save

        start = time.perf_counter()
        path = os.fspath(path)
        record = self.recorder.new_checkpoint(path, start)
        record["flush_start"] = start
        if self.stager_used and not self.reuse_stager:
            self.stager.close()  # its one staging ended at the barrier: this only stops its thread
            self.stager = self._new_stager()
        self.stager_used = True
        writer = FileSystemWriter(path, sync_files=True)
        response: Any = (
            async_save(checkpoint, checkpoint_id=path, storage_writer=writer)  # stages here, on this thread
            if self.stager is None
            else async_save(
                checkpoint, checkpoint_id=path, storage_writer=writer, async_stager=self.stager, no_dist=True
            )
        )
        staged, uploaded = (
            (response.staging_completion, response.upload_completion)
            if hasattr(response, "staging_completion")
            else (None, response)
        )

        def durable(_: Any) -> None:
            record["durable"] = record["written"] = time.perf_counter()

        def copied(_: Any) -> None:
            record["copy_end"] = time.perf_counter()

        uploaded.add_done_callback(durable)
        if staged is None:
            record["copy_end"] = time.perf_counter()
        else:
            staged.add_done_callback(copied)
            self.staging.append((staged, record))
        self.uploads.append(uploaded)
        mark_saved(self.recorder, record, start)

    def wait_staging(self) -> None:
        """Barrier: wait until no staging still reads the training state."""
        while self.staging:
            staged, record = self.staging.pop(0)
            if not staged.done():
                start = time.perf_counter()
                staged.result()
                self.recorder.waited(record, start, time.perf_counter())
            staged.result()  # raise a staging failure

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        """Not benchmarked."""
        raise NotImplementedError("the dcp benchmark method only saves")

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint directory."""
        shutil.rmtree(os.fspath(path), ignore_errors=True)

    def teardown(self) -> None:
        """Wait for every upload (end of fit), then close the stager."""
        self.wait_staging()
        for upload in self.uploads:
            upload.result()
        self.uploads = []
        if self.stager is not None:
            self.stager.close()


class DcpBarrier(Callback):
    """Waits for DCP's staging before the optimizer changes the state it reads."""

    def __init__(self, io: DcpAsyncIO) -> None:
        self.io = io

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        """The barrier."""
        self.io.wait_staging()
