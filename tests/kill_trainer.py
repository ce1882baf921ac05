"""A fork server for the SIGKILL fault suite: training runs that checkpoint every step, killed at random moments.

Importing torch and Lightning takes seconds; forking a process that already did takes milliseconds. So this script
imports once, then reads one JSON command per line on stdin and answers one JSON line on stdout:

* ``{"cmd": "trial", "dir": D, "seed": S, "delay_s": T}``: fork a child that trains with ``DataStatesIO`` and a
  ``ModelCheckpoint`` saving every step (plus ``last.ckpt``) into ``D``; once its first checkpoint was saved, wait
  ``T`` seconds and SIGKILL it. Answers ``{"killed": true, "temp_files": [...], "exit": ...}``.
* ``{"cmd": "resume", "dir": D, "ckpt": P, "steps": N}``: fork a child that resumes from ``P`` into ``D`` and trains
  ``N`` more steps, to its end. Answers ``{"exit": 0, "global_step": G}``.

The expected content of every checkpoint does not come from the plugin: the child's CheckpointIO first computes
:func:`checkpoint_digest` of the checkpoint dict on the training thread at the save call (the state of that step)
and writes it, atomically, to ``D/refs/<file name>@<step>.json``; the test compares each file it finds against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Model width: checkpoints of about 1.3 MB (weights + AdamW state), written in many chunks.
WIDTH = 320


def checkpoint_digest(obj: Any) -> str:
    """A SHA-256 over a checkpoint's structure and every tensor's dtype, shape and bytes (other leaves by repr)."""
    digest = hashlib.sha256()
    _feed(digest, obj)
    return digest.hexdigest()


def _feed(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous()
        digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        digest.update(f"D{len(obj)}".encode())
        for key, value in obj.items():
            _feed(digest, key)
            _feed(digest, value)
    elif isinstance(obj, (list, tuple)):
        digest.update(f"{type(obj).__name__}{len(obj)}".encode())
        for item in obj:
            _feed(digest, item)
    else:
        digest.update(f"{type(obj).__name__}:{obj!r}".encode())


def ref_path(directory: str, name: str, step: int) -> str:
    """Where the reference digest of checkpoint file ``name`` saved at ``step`` is recorded."""
    return os.path.join(directory, "refs", f"{name}@{step}.json")


def _train(directory: str, seed: int, ready_fd: int | None, ckpt_path: str | None, max_steps: int) -> int:
    """Train in this (forked) process; return the global step reached."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_datastates import DataStatesIO
    from tests.conftest import BNModel, make_loader, make_trainer

    class DigestRecordingIO(DataStatesIO):
        """Records the reference digest of each checkpoint, synchronously, before handing it to the plugin."""

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            reference = ref_path(directory, os.path.basename(os.fspath(path)), int(checkpoint["global_step"]))
            with open(reference + ".tmp", "w") as out:
                json.dump({"digest": checkpoint_digest(checkpoint), "step": int(checkpoint["global_step"])}, out)
            os.replace(reference + ".tmp", reference)  # never torn, whenever the kill comes
            super().save_checkpoint(checkpoint, path, storage_options)

    class Ready(L.Callback):
        """Tells the server the run is checkpointing (after the first save call), once.

        Lightning runs ModelCheckpoint after the other callbacks, so at the end of the second step one save was made.
        """

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            nonlocal ready_fd
            if ready_fd is not None and trainer.global_step >= 2:
                os.write(ready_fd, b"r")
                os.close(ready_fd)
                ready_fd = None

    torch.manual_seed(seed)
    os.makedirs(os.path.join(directory, "refs"), exist_ok=True)
    plugin = DigestRecordingIO(chunk_size="64KiB", writer_threads=2)
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1, save_last=True)
    trainer = make_trainer(
        directory, plugin, callbacks=[checkpoint, Ready()], max_epochs=-1, max_steps=max_steps, deterministic=False
    )
    trainer.fit(BNModel(width=WIDTH), make_loader(n=64, seed=seed), ckpt_path=ckpt_path)
    return int(trainer.global_step)


def _fork(run: Any) -> tuple[int, int]:
    """Fork a child running ``run(ready_write_fd)``; return (pid, ready_read_fd)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        os.close(read_fd)
        os.dup2(2, 1)  # stdout is the server's answer channel
        status = 1
        try:
            torch.set_num_threads(1)
            run(write_fd)
            status = 0
        except BaseException:  # noqa: BLE001 - reported through the exit status and stderr
            import traceback

            traceback.print_exc()
        finally:
            os._exit(status)
    os.close(write_fd)
    return pid, read_fd


def _trial(command: dict[str, Any]) -> dict[str, Any]:
    directory = command["dir"]
    pid, ready = _fork(lambda fd: _train(directory, command["seed"], fd, None, 100_000))
    started = time.monotonic()
    signalled = os.read(ready, 1)  # empty: the child died before its first checkpoint
    os.close(ready)
    if signalled:
        time.sleep(command["delay_s"])
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    temp = sorted(n for n in os.listdir(directory) if n.endswith(".datastates-tmp"))
    return {"killed": killed, "status": status, "temp_files": temp, "ran_s": time.monotonic() - started}


def _resume(command: dict[str, Any]) -> dict[str, Any]:
    directory, result = command["dir"], os.path.join(command["dir"], "resume.json")
    start_step = int(torch.load(command["ckpt"], weights_only=False, map_location="cpu")["global_step"])

    def run(fd: int) -> None:
        os.close(fd)
        reached = _train(directory, 0, None, command["ckpt"], start_step + command["steps"])
        with open(result, "w") as out:
            json.dump({"global_step": reached, "from_step": start_step}, out)

    pid, ready = _fork(run)
    os.close(ready)
    _, status = os.waitpid(pid, 0)
    answer: dict[str, Any] = {"exit": os.waitstatus_to_exitcode(status)}
    if os.path.exists(result):
        with open(result) as inp:
            answer.update(json.load(inp))
        os.unlink(result)
    return answer


def main() -> None:
    """Serve commands from stdin until it closes."""
    sys.path.insert(0, REPO)
    import lightning  # noqa: F401 - imported once here, inherited by every child

    import tests.conftest  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        answer = _trial(command) if command["cmd"] == "trial" else _resume(command)
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
