#!/usr/bin/env bash
# The two checkpoint regimes of the GPU targets, for a lent GPU machine once scripts/gpu_check.sh has run and at least
# 7 minutes of device time remain (the steps' timeouts sum to 410 s); every result in the output folder.
#   0) the save call's fixed cost on this host's CPU: planning the layout of a checkpoint of 1169 tensors (the
#      368M-llm preset's count), to set against its ~0.12 s step;
#   1) storage within reach: a checkpoint every 40 steps (4.4 GB per ~5 s of training on an H200 against ~4 s of
#      flush), default settings: loop overhead of DataStatesIO and AsyncCheckpointIO against no checkpoints;
#   2) storage slower than the checkpoints: one every 10 steps, with host_cache="16GiB" so that the run's checkpoints
#      fit the arena: DataStatesIO beside AsyncCheckpointIO and DCP's async_save.
# The synchronous save is left out (the main check measures it; ~9 s per checkpoint would eat the time). No
# checkpoint falls on a run's last step (121 = 3 x 40 + 1, 31 = 3 x 10 + 1): the final drain is timed apart.
# Usage: bash scripts/gpu_regimes.sh [OUTPUT_DIR]; MODEL and ACCELERATOR override the preset and the accelerator
# (MODEL=3M ACCELERATOR=cpu runs the same steps on a CPU, as a check of the script itself).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu_regimes}}"
model="${MODEL:-368M-llm}"
accelerator="${ACCELERATOR:-gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# Where gpu_check.sh could not install the package, the checkout on PYTHONPATH serves.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 30 python3 scripts/bench_save_call.py 2>&1 | tee "$out/save_call.txt"
timeout 200 python3 -m lightning_datastates.benchmark --model "$model" --accelerator "$accelerator" --steps 121 \
    --every 40 --rounds 1 --methods none,datastates,async --no-plot --out "$out/every40" 2>&1 | tee "$out/every40.txt"
timeout 180 python3 -m lightning_datastates.benchmark --model "$model" --accelerator "$accelerator" --steps 31 \
    --every 10 --rounds 1 --methods none,datastates,async,dcp --datastates host_cache=16GiB --no-plot \
    --out "$out/every10" 2>&1 | tee "$out/every10.txt"
