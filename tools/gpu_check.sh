#!/usr/bin/env bash
# The prepared run for a lent GPU (an H200): kernel checks, the kernels' benchmark and the served step on the
# full-width slice preset, every result under $OUT (default ./gpu_out). Needs a Python with this project and
# jax's CUDA plugin importable (`pip install -e '.[cuda]'`, or wheels on PYTHONPATH). About 10 minutes.
#   OUT=gpu_out PYTHON=python3 tools/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo "== $1 ($(date +%T))" | tee -a "$OUT/steps.log"; }

step "devices"
"$PY" -c "import jax; print(jax.devices(), jax.default_backend())" 2>&1 | tee "$OUT/devices.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$OUT/devices.txt"

step "kernel tests on the GPU (compiled Triton kernels against their references)"
"$PY" -m pytest -q -p no:cacheprovider tests/pallas_kernels 2>&1 | tail -30 | tee "$OUT/kernel_tests.txt"

step "kernels' benchmark at V4.1-Flash sizes"
"$PY" -m pallas_kernels.bench --reps 20 --out "$OUT/pallas_kernels_bench.json" 2>&1 | tee "$OUT/pallas_kernels_bench.txt"

step "served step on v41-flash-slice (release formats, bf16): 8K prefill, decode at batch 1 / 8 / 64"
"$PY" -m serving.bench.prefill --model v41-flash-slice --dtype bfloat16 --lengths 8192 --repeats 2 \
    --decode-batches 1,8,64 --decode-context 1024 --decode-steps 8 --block-size 256 --quiet \
    --out "$OUT/slice_prefill_decode.json" 2>&1 | tee "$OUT/slice_prefill_decode.txt"
step "done"
