#!/usr/bin/env bash
# The GPU checks, in one short run (< 8 minutes) for a lent GPU machine:
#   1) the CUDA tests (pinned arena, copy stream ordering, Trainer on GPU, no extra GPU memory);
#   2) a short measurement: pinned cudaMemcpy rate vs our copier's rate, and blocked time per checkpoint;
#   3) the side-by-side benchmark on a 350M GPT (no checkpointing, TorchCheckpointIO, DataStatesIO), one round.
# Usage: bash scripts/gpu_check.sh [OUTPUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())" | tee "$out/env.txt"
python3 -m pip install -q --no-deps -e . 2>&1 | tail -1
timeout 240 python3 -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tee "$out/cuda_tests.txt"
timeout 120 python3 scripts/gpu_bench.py 2>&1 | tee "$out/gpu_bench.txt"
timeout 100 python3 -m lightning_datastates.benchmark --model 350M --steps 8 --every 4 --rounds 1 \
    --methods none,torch,datastates --out "$out/benchmark" 2>&1 | tee "$out/benchmark.txt"
