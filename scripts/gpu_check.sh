#!/usr/bin/env bash
# The GPU checks, in one short run for a lent GPU machine: every step under its own timeout (460 s together),
# every result in the output folder ($OUT on the device machine).
#   1) install without network (no build isolation), and check that the callback's entry point is registered:
#      without it no DataStatesCallback joins the Trainer and every save would be synchronous;
#   2) the CUDA tests (arena page-locked in the background, copy stream ordering, Trainer on GPU, no extra GPU memory);
#   3) a short measurement: pinned cudaMemcpy rate vs our copier's rate, and blocked time per checkpoint;
#   4) the side-by-side benchmark on the 368M-llm preset (seq 1024, batch 16, bf16-mixed: ~0.1 s steps, 4.4 GB
#      checkpoints), all five methods, one round, a checkpoint every 10 steps; DataStatesIO right after the baseline
#      and the synchronous save last, so that a timeout cuts the least informative run (each prints its line at once);
#   5) the sharded benchmark on one GPU (ModelParallelStrategy, FSDP2 over one rank, NCCL): Lightning's synchronous
#      sharded save, DCP async_save and DataStatesIO side by side.
# Usage: bash scripts/gpu_check.sh [OUTPUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 20 python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$out/env.txt"
timeout 45 python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2 | tee -a "$out/env.txt"
timeout 20 python3 -c "from importlib.metadata import entry_points; eps = [e.value for e in entry_points(group='lightning.pytorch.callbacks_factory')]; print('callbacks_factory:', eps); assert any('lightning_datastates' in v for v in eps), 'entry point missing: saves would be synchronous'" 2>&1 | tee -a "$out/env.txt"
timeout 100 python3 -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tee "$out/cuda_tests.txt"
timeout 45 python3 scripts/gpu_bench.py 2>&1 | tee "$out/gpu_bench.txt"
timeout 170 python3 -m lightning_datastates.benchmark --model 368M-llm --steps 31 --every 10 --rounds 1 \
    --methods none,datastates,async,dcp,torch --out "$out/benchmark" 2>&1 | tee "$out/benchmark.txt"
timeout 60 python3 -m lightning_datastates.benchmark.sharded --world 1 --accelerator gpu --model 125M --steps 18 \
    --every 4 --out "$out/sharded" 2>&1 | tee "$out/sharded.txt"
