#!/usr/bin/env bash
# The GPU checks, in one short run (< 8 minutes) for a lent GPU machine:
#   1) the CUDA tests (pinned arena, copy stream ordering, Trainer on GPU, no extra GPU memory);
#   2) a short measurement: pinned cudaMemcpy rate vs our copier's rate, and blocked time per checkpoint.
# Usage: bash scripts/gpu_check.sh [OUTPUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())" | tee "$out/env.txt"
python3 -m pip install -q --no-deps -e . 2>&1 | tail -1
timeout 300 python3 -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tee "$out/cuda_tests.txt"
timeout 150 python3 scripts/gpu_bench.py 2>&1 | tee "$out/gpu_bench.txt"
