"""One run of the SIGKILL crash trial (tests/test_crash_trial.py): 2 ranks, ModelParallelStrategy + FSDP2 on CPU (gloo),
saving through DataStatesIO onto storage slowed to a fixed bandwidth, resuming with ``fit(ckpt_path="last")``.

``python tests/crash_trial_script.py OUT --ckpt-dir D [--storage-options JSON] --run TAG [--steps N]`` starts both
ranks at once as torchrun would (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``,
``MASTER_ADDR``; ``MASTER_PORT`` from its own environment), each with its output in ``OUT/rank<r>.log``, and waits
for them (to replay one run by hand).

``python tests/crash_trial_script.py --serve`` is what the test starts instead: a fork server. It imports torch,
Lightning and the plugin once (most of a run's start-up on a 2-core machine: a dozen runs per trial would otherwise
spend two minutes importing), then reads one JSON line per run from its standard input (``{"argv": [...], "env":
{...}}``), forks both ranks of that run into a new process group (rank 0 leads it, its pid is the group's id: the test
SIGKILLs the group, the server lives on) and answers ``{"pids": [...]}``. Nothing runs in the server but imports (one
thread, no process group, no event loop), so a forked rank starts as a fresh one would, minus the imports.

Each rank:

- trains a 5-layer MLP (width 512, every linear layer sharded with ``fully_shard``: 6.3 MB of weights and AdamW
  moments per rank and checkpoint, two parts on S3 with 5 MiB parts) with ``ModelCheckpoint(every_n_train_steps=2,
  save_top_k=3, monitor="step", mode="max", save_last=True)``: from the 4th save on, every save is followed by a
  top-k removal, and ``last.ckpt`` is saved again each time; a training step takes at least :data:`STEP_S` (the
  model's compute);
- resumes with ``fit(ckpt_path="last")``; once its first training step begins, it writes ``OUT/started<r>.json``: the
  global step it starts from, the path Lightning resolved, and the run that wrote the checkpoint it loaded (None from
  scratch), and ``OUT/restored/rank<r>.pt``: its local shards of the model and optimizer state as restored;
- stamps every checkpoint with ``TAG`` (key :data:`RUN_KEY`, in ``meta.pt``) and records at the save call, on the
  training thread, its local shards of the model and optimizer state into ``OUT/ref/step<k>/rank<r>.pt`` (written
  atomically: a killed run leaves whole records of its saves);
- writes to storage at :data:`BANDWIDTH` bytes per second (each range waits its share first, one range at a time per
  rank), in 1 MiB chunks through a 16 MiB host arena, so that flushes take most of the run and several saves are in
  flight at once; local unlinks inside the checkpoint directory and S3 removals wait :data:`REMOVE_DELAY_S` each, so
  that a removal (or a commit's switch of a directory) takes a moment too;
- logs what its storage writers do into ``OUT/events<r>.log``, one line per event (``<time> <event> <what>``):
  ``save``, ``begin``, ``complete``, ``abort``, ``failed``, ``remove``, ``removed``, ``marker``, ``unlinked``,
  ``start``; the test reads it to time its kills and to tell what was in flight when it killed the run;
- with ``--steps N``: stops N steps after the step it resumed from; at the end of fit it writes ``OUT/rank<r>.result``
  (``ok`` or the error); without ``--steps`` it trains until killed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

RUN_KEY = "crash_trial_run"
WIDTH = 512
LAYERS = 5
#: Bytes per second each rank's storage takes (ranges wait their share, one at a time per rank).
BANDWIDTH = 64 * 1024**2
#: Each unlink in the local checkpoint directory, each S3 removal request, waits this long first.
REMOVE_DELAY_S = 0.05
#: A training step takes at least this long (the model's compute).
STEP_S = 0.1
WORLD = 2
_RANK_ENV = {"GROUP_RANK": "0", "NODE_RANK": "0", "LOCAL_WORLD_SIZE": str(WORLD), "WORLD_SIZE": str(WORLD)}


def rank_env(rank: int) -> dict[str, str]:
    """What torchrun sets for ``rank`` (Lightning then takes the processes as launched: TorchElasticEnvironment)."""
    return {**_RANK_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1"}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--storage-options", help="DataStatesIO's storage_options, as JSON (for s3:// directories)")
    parser.add_argument("--run", required=True, help="the tag stamped into every checkpoint of this run")
    parser.add_argument("--steps", type=int, help="stop this many steps after the step resumed from")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------ launcher, fork server
def launch_ranks(argv: list[str]) -> int:
    """Start both ranks as torchrun would and wait for them; the first non-zero exit status (0 if none)."""
    out = parse(argv).out
    os.makedirs(out, exist_ok=True)
    children = []
    for rank in range(WORLD):
        with open(os.path.join(out, f"rank{rank}.log"), "w") as log:
            command = [sys.executable, os.path.abspath(__file__), *argv]
            children.append(subprocess.Popen(command, env={**os.environ, **rank_env(rank)}, stdout=log, stderr=log))
    codes = [child.wait() for child in children]
    return next((code for code in codes if code), 0)


def preload() -> None:
    """Import what a rank imports (the server's one job before forking): no thread, no process group, no loop."""
    import lightning  # noqa: F401
    import torch
    import torch.distributed.checkpoint
    from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    import lightning_datastates  # noqa: F401

    try:
        import s3fs  # noqa: F401
    except ImportError:  # the S3 trial is skipped then
        pass
    torch.set_num_threads(1)
    assert threading.active_count() == 1, threading.enumerate()  # forked ranks must not lose a thread they need


def serve() -> None:
    """The fork server (see the module docstring): one JSON line in per run, one out."""
    preload()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pids: list[int] = []
        for rank in range(WORLD):
            pid = os.fork()
            if pid == 0:
                _run_forked(rank, pids[0] if pids else 0, request)  # never returns
            group = pids[0] if pids else pid
            try:
                os.setpgid(pid, group)  # in both processes: whichever runs first, the child is in the group
            except OSError:
                pass  # the child already did it, or is gone
            pids.append(pid)
        print(json.dumps({"pids": pids}), flush=True)
        _reap()
    _reap()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _run_forked(rank: int, group: int, request: dict[str, Any]) -> None:
    code = 1
    try:
        try:
            os.setpgid(0, group)
        except OSError:
            pass  # the server already did it
        args = parse(request["argv"])
        os.makedirs(args.out, exist_ok=True)
        log = os.open(os.path.join(args.out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(request["env"])
        os.environ.update(rank_env(rank))
        sys.argv = [os.path.abspath(__file__), *request["argv"]]
        run_rank(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - into the rank's log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ------------------------------------------------------------------------------------------------------------ a rank
class Events:
    """Append-only event log of this rank: one ``os.write`` per line (whole lines, from any thread)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, event: str, what: str) -> None:
        os.write(self._fd, f"{time.time():.6f} {event} {what}\n".encode())


def write_atomically(path: str, write: Any) -> None:
    temp = f"{path}.{os.getpid()}.part"
    write(temp)
    os.replace(temp, path)


def instrument_writers(events: Events) -> None:
    """Log what the plugin's storage writers (local and S3) do into ``events``; slow their ranges to
    :data:`BANDWIDTH` (one range at a time per rank) and their S3 removals by :data:`REMOVE_DELAY_S`.

    The writer classes' methods are wrapped, whatever builds and holds the writers: the plugin's code is unchanged.
    """
    from lightning_datastates.storage import LocalWriter
    from lightning_datastates.storage.s3 import S3Writer

    bandwidth = threading.Lock()
    inside = threading.local()

    def slowed(write: Any) -> Any:
        def wrapper(offset: int, data: Any, *rest: Any) -> None:
            if not getattr(inside, "writing", False):  # a checksummed write may call write_range: wait once
                with bandwidth:
                    time.sleep(memoryview(data).nbytes / BANDWIDTH)
            inside.writing = True
            try:
                write(offset, data, *rest)
            finally:
                inside.writing = False

        return wrapper

    def logged_begin(begin: Any) -> Any:
        def wrapper(self: Any, path: str, total_bytes: int) -> Any:
            session = begin(self, path, total_bytes)
            events("begin", path)
            complete, abort = session.complete, session.abort

            def logged_complete() -> None:
                try:
                    complete()
                except BaseException:
                    events("failed", path)
                    raise
                events("complete", path)

            def logged_abort() -> None:
                events("abort", path)
                abort()

            session.write_range = slowed(session.write_range)
            session.write_checksummed_range = slowed(session.write_checksummed_range)
            session.complete, session.abort = logged_complete, logged_abort
            return session

        return wrapper

    def logged_remove(remove: Any, local: bool) -> Any:
        def wrapper(self: Any, path: str) -> None:
            events("remove", path)
            if not local:
                time.sleep(REMOVE_DELAY_S)
            remove(self, path)
            events("removed", path)

        return wrapper

    def logged_remove_files(remove_files: Any, local: bool) -> Any:
        def wrapper(self: Any, directory: str, names: Any) -> None:
            names = list(names)
            what = f"{directory.rstrip('/')}/{{{','.join(names)}}}"
            events("remove", what)
            if not local:
                time.sleep(REMOVE_DELAY_S)
            remove_files(self, directory, names)
            events("removed", what)

        return wrapper

    def logged_marker(create_marker: Any) -> Any:
        def wrapper(self: Any, path: str) -> None:
            create_marker(self, path)
            events("marker", path)

        return wrapper

    for cls, local in ((LocalWriter, True), (S3Writer, False)):
        cls.begin = logged_begin(cls.begin)  # type: ignore[method-assign]
        cls.remove = logged_remove(cls.remove, local)  # type: ignore[method-assign]
        cls.remove_files = logged_remove_files(cls.remove_files, local)  # type: ignore[method-assign]
        cls.create_marker = logged_marker(cls.create_marker)  # type: ignore[method-assign]


def slow_local_unlinks(directory: str, events: Events) -> None:
    """Every unlink of a file inside the local ``directory`` (and every unlink relative to a directory descriptor:
    ``shutil.rmtree``'s) waits :data:`REMOVE_DELAY_S` first, then is logged (``unlinked``): a removal of a checkpoint
    directory takes a moment, as on a parallel file system."""
    unlink = os.unlink
    prefix = os.path.abspath(directory) + os.sep

    def slow_unlink(path: Any, *, dir_fd: int | None = None) -> None:
        if dir_fd is None and not os.path.abspath(os.fsdecode(path)).startswith(prefix):
            unlink(path)
            return
        time.sleep(REMOVE_DELAY_S)
        unlink(path, dir_fd=dir_fd)
        events("unlinked", os.fsdecode(path))

    os.unlink = os.remove = slow_unlink  # type: ignore[assignment]


def run_rank(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_datastates import DataStatesIO

    rank = int(os.environ["LOCAL_RANK"])
    torch.set_num_threads(1)
    events = Events(os.path.join(args.out, f"events{rank}.log"))
    instrument_writers(events)
    if "://" not in args.ckpt_dir:
        slow_local_unlinks(args.ckpt_dir, events)

    class TrialCheckpoint(ModelCheckpoint):
        """Logs each save call (its step and path) before it is made."""

        def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
            events("save", f"{trainer.global_step} {filepath}")
            super()._save_checkpoint(trainer, filepath)

    def local(tensor: torch.Tensor) -> torch.Tensor:
        to_local = getattr(tensor, "to_local", None)
        return (to_local() if to_local is not None else tensor).detach().clone()

    def local_state(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
        """This rank's shards of the model and optimizer state of a checkpoint dict, copied now."""
        state = {f"state_dict.{k}": local(v) for k, v in checkpoint["state_dict"].items()}
        for fqn, values in checkpoint["optimizer_states"][0]["state"].items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    state[f"optimizer_0.state.{fqn}.{key}"] = local(value)
        return state

    class TrialMLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers: list[nn.Module] = []
            for _ in range(LAYERS - 1):
                layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
            self.layers = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
            self.loaded_run: str | None = None
            self.first_step: int | None = None
            self.restoring = False

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.layers:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.layers, mesh=mesh)

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.loaded_run = checkpoint.get(RUN_KEY)

        def on_train_start(self) -> None:
            trainer = self.trainer
            if args.steps is not None:
                trainer.fit_loop.epoch_loop.max_steps = trainer.global_step + args.steps
            self.first_step = trainer.global_step
            # The state as restored (both ranks: the optimizer's state dict is gathered collectively).
            self.restoring = True
            try:
                restored = local_state(trainer._checkpoint_connector.dump_checkpoint())
            finally:
                self.restoring = False
            os.makedirs(os.path.join(args.out, "restored"), exist_ok=True)
            write_atomically(os.path.join(args.out, "restored", f"rank{rank}.pt"), lambda t: torch.save(restored, t))

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self.first_step is None:
                return
            ckpt_path = self.trainer.ckpt_path
            start = {"step": self.first_step, "ckpt_path": ckpt_path and str(ckpt_path), "run": self.loaded_run}
            events("start", json.dumps(start))
            write_atomically(
                os.path.join(args.out, f"started{rank}.json"), lambda t: open(t, "w").write(json.dumps(start))
            )
            self.first_step = None

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            started = time.monotonic()
            x, y = batch
            loss = nn.functional.mse_loss(self.layers(x), y)
            time.sleep(max(0.0, STEP_S - (time.monotonic() - started)))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            if self.restoring:
                return
            checkpoint[RUN_KEY] = args.run  # lands in meta.pt: which run's records this checkpoint must equal
            directory = os.path.join(args.out, "ref", f"step{self.trainer.global_step}")
            path = os.path.join(directory, f"rank{rank}.pt")
            if os.path.exists(path):  # the step's second save (last.ckpt after the top-k one): the same state
                return
            state = local_state(checkpoint)
            os.makedirs(directory, exist_ok=True)
            write_atomically(path, lambda temp: torch.save(state, temp))

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, WIDTH, generator=generator)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True) / WIDTH), batch_size=8)
    options = json.loads(args.storage_options) if args.storage_options else None
    plugin = DataStatesIO(storage_options=options, host_cache="16MiB", chunk_size="1MiB", eager_copy_size="1KiB")
    checkpoint = TrialCheckpoint(
        dirpath=args.ckpt_dir, every_n_train_steps=2, save_top_k=3, monitor="step", mode="max", save_last=True
    )
    trainer = L.Trainer(
        default_root_dir=args.out,
        accelerator="cpu",
        devices=WORLD,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        plugins=[plugin],
        callbacks=[checkpoint],
        max_steps=10**6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    failure = None
    try:
        trainer.fit(TrialMLP(), data, ckpt_path="last")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        failure = exc
        traceback.print_exc()
    with open(os.path.join(args.out, f"rank{rank}.result"), "w") as handle:
        handle.write("ok" if failure is None else f"{type(failure).__name__}: {failure}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    elif "LOCAL_RANK" in os.environ:
        run_rank(parse(sys.argv[1:]))
    else:
        sys.exit(launch_ranks(sys.argv[1:]))
