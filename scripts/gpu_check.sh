#!/usr/bin/env bash
# The GPU checks, in one short run for a lent GPU machine: every step under its own timeout (475 s together, under
# 8 minutes), at most 8 result files in the output folder ($OUT on the device machine; more would not come back):
# env.txt, cuda_tests.txt, gpu_bench.txt, benchmark.txt, benchmark.json, sharded.txt, sharded.json, status.txt.
#   1) check that CUDA is visible, install without network (no build isolation), and check that the callback's entry
#      point is registered and that a Trainer gets the callback: without it every save would be synchronous and the
#      checks below would pass without testing anything lazy. Where the install fails (an old setuptools), the entry
#      point is registered by a minimal dist-info on PYTHONPATH instead. Any failure here stops the run;
#   2) the CUDA tests (arena page-locked in the background, copy stream ordering, Trainer on GPU, no extra GPU
#      memory); a skipped test counts as a failure (status.txt);
#   3) a short measurement: pinned cudaMemcpy rate vs our copier's rate, and blocked time per checkpoint (each figure
#      printed as soon as it is measured);
#   4) the side-by-side benchmark on the 368M-llm preset (seq 1024, batch 16, bf16-mixed: ~0.1 s steps, 4.4 GB
#      checkpoints), all five methods, one round, a checkpoint every 10 steps; DataStatesIO right after the baseline
#      and the synchronous save last, so that a timeout cuts the least informative run (each prints its line at once);
#   5) the sharded benchmark on one GPU (ModelParallelStrategy, FSDP2 over one rank, NCCL): Lightning's synchronous
#      sharded save, DCP async_save and DataStatesIO side by side (a 40M GPT: it proves the path on NCCL and a GPU;
#      its steps are too short for the copy to overlap them).
# status.txt holds one line per step: its name and exit status (124: its timeout ended it). The script's own exit
# status is 1 if any step failed (but install, where the checkout on PYTHONPATH let the callback check pass).
# Usage: bash scripts/gpu_check.sh [OUTPUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu_check}}"
scratch="$(mktemp -d)"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
: >"$out/status.txt"

# step NAME LOG TIMEOUT COMMAND...: run COMMAND under TIMEOUT seconds, output appended to $out/LOG; status noted.
step() {
    local name="$1" log="$2" limit="$3"
    shift 3
    echo "== $name" >>"$out/$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$out/$log"
    local status="${PIPESTATUS[0]}"
    echo "$name $status" >>"$out/status.txt"
    return "$status"
}

step env env.txt 30 python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', \
lightning.__version__); assert torch.cuda.is_available(), 'CUDA is not visible'; print(torch.cuda.get_device_name(0))" \
    || exit 1
if ! step install env.txt 30 python3 -m pip install -q --no-build-isolation --no-deps -e .; then
    # The plugin adds its callback itself: the checkout on PYTHONPATH is all the package needs.
    echo "pip install failed: using the checkout through PYTHONPATH" | tee -a "$out/env.txt"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
step callback env.txt 20 python3 -c "import lightning as L; from lightning_datastates import DataStatesCallback, \
DataStatesIO; trainer = L.Trainer(plugins=[DataStatesIO()], accelerator='gpu', devices=1, logger=False); \
assert any(isinstance(c, DataStatesCallback) for c in trainer.callbacks), 'no DataStatesCallback: saves would be \
synchronous'; print('DataStatesCallback joins the Trainer')" || exit 1

step cuda_tests cuda_tests.txt 95 python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests/test_cuda.py
if grep -Eq "[0-9]+ skipped" "$out/cuda_tests.txt"; then
    echo "cuda_tests_skipped 1" >>"$out/status.txt"
fi
step gpu_bench gpu_bench.txt 40 python3 scripts/gpu_bench.py
step benchmark benchmark.txt 185 python3 -m lightning_datastates.benchmark --model 368M-llm --steps 31 --every 10 \
    --rounds 1 --methods none,datastates,async,dcp,torch --no-plot --out "$scratch/benchmark"
cp "$scratch/benchmark/benchmark.json" "$out/benchmark.json" 2>/dev/null
step sharded sharded.txt 75 python3 -m lightning_datastates.benchmark.sharded --world 1 --accelerator gpu \
    --model 40M --steps 18 --every 4 --out "$scratch/sharded"
cp "$scratch/sharded/sharded-benchmark.json" "$out/sharded.json" 2>/dev/null
rm -rf "$scratch"
cat "$out/status.txt"
! grep -v '^install ' "$out/status.txt" | grep -qv ' 0$'
