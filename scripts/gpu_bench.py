"""Short GPU measurement for scripts/gpu_check.sh: copy rate and blocked time, beside a pinned cudaMemcpy.

Prints: the pinned device-to-host rate of a plain ``copy_`` (cudaMemcpy), our copier's rate for the same bytes
(ratio is the target: >= 0.8x), and the training-thread blocked time of DataStatesIO.save_checkpoint + barrier
vs TorchCheckpointIO.save_checkpoint for a ~1B-parameter state held on the GPU.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_datastates import DataStatesIO
from lightning_datastates.plugin import pipeline_of


class _AllLazy:
    in_training_loop = True

    def lazy_predicate(self):
        return lambda storage: True


def main() -> None:
    """Measure and print each figure as soon as it is known (a timeout of the caller keeps what was printed)."""
    assert torch.cuda.is_available(), "needs a GPU"
    directory = tempfile.mkdtemp()
    try:
        _measure(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # ~12 GB of checkpoints: the next steps need the disk


def _measure(directory: str) -> None:
    gib = 2**30
    source = torch.empty(2 * gib, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(2 * gib, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(source)  # warm up
    torch.cuda.synchronize()
    started = time.perf_counter()
    pinned.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    memcpy_gbps = 2 / (time.perf_counter() - started)
    del pinned, source
    print(f"pinned cudaMemcpy D2H: {memcpy_gbps:.1f} GiB/s")

    # ~1B parameters in bf16 (2 GB), split into 256 tensors like a model's layers.
    params = [torch.randn(4 * 2**20 - 1, device="cuda").to(torch.bfloat16) for _ in range(256)]
    plugin = DataStatesIO(host_cache="6GiB", chunk_size="256MiB")
    pipeline = pipeline_of(plugin)
    pipeline.attach(_AllLazy())
    # As the callback does after the first optimizer step: the arena made and page-locked before the first save.
    pipeline.prepare_arena(sum(p.nbytes for p in params), torch.cuda.current_device())
    arena = pipeline.engine.arena
    # 6 GiB at the ~0.11 s per GiB measured on an H200 host: about a second.
    print(f"host arena page-locked before the first save: {arena is not None and arena.wait_pinned(15)}")
    ckpt = {"state_dict": {f"p{i}": p for i, p in enumerate(params)}}
    blocked, copy_rates = [], []
    matrix = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for round_ in range(4):
        torch.cuda.synchronize()
        started = time.perf_counter()
        plugin.save_checkpoint(ckpt, f"{directory}/ds{round_}.ckpt")
        returned = time.perf_counter()
        # Simulated forward/backward: 200 ms of GPU work while the copy runs, a few kernels queued at a time.
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            matrix = (matrix @ matrix).clamp_(-1, 1)
            torch.cuda.synchronize()
        before_barrier = time.perf_counter()
        pipeline.barrier()
        after_barrier = time.perf_counter()
        blocked.append((returned - started) + (after_barrier - before_barrier))
        stats = plugin.stats[-1]
        # The copy's own rate: from the first chunk's copy issued (after the save call's planning) until copied.
        rate = stats.payload_bytes / gib / stats.copying_s if stats.copying_s else None
        if rate is not None:
            copy_rates.append(rate)
        rate_text = "-" if rate is None else f"{rate:.1f} GiB/s"
        call_text = "-" if not stats.copy_s else f"{stats.payload_bytes / gib / stats.copy_s:.1f} GiB/s"
        print(
            f"round {round_}: blocked {1e3 * blocked[-1]:.1f} ms, copy {rate_text} (first chunk issued to copied), "
            f"{call_text} (save call to copied)"
        )
        plugin.drain()
    plugin.teardown()
    if copy_rates:
        copy_rate = statistics.median(copy_rates)
        print(f"DataStatesIO copy rate (first chunk issued to copied, beside matmuls): {copy_rate:.1f} GiB/s")
        print(f"copy rate ratio vs cudaMemcpy: {copy_rate / memcpy_gbps:.2f}x")
    p50_ms, max_ms = 1e3 * statistics.median(blocked), 1e3 * max(blocked)
    print(f"blocked per checkpoint, DataStatesIO: p50 {p50_ms:.1f} ms, max {max_ms:.1f} ms")

    torch_io = TorchCheckpointIO()
    sync_times = []
    for round_ in range(2):
        started = time.perf_counter()
        torch_io.save_checkpoint(ckpt, f"{directory}/t{round_}.ckpt")
        sync_times.append(time.perf_counter() - started)
        print(f"TorchCheckpointIO round {round_}: {1e3 * sync_times[-1]:.1f} ms")
    print(f"blocked per checkpoint, TorchCheckpointIO: p50 {1e3 * statistics.median(sync_times):.1f} ms")
    print(f"ratio: {statistics.median(blocked) / statistics.median(sync_times):.4f}")


if __name__ == "__main__":
    main()
