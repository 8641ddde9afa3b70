#!/usr/bin/env bash
# The prepared run for a lent GPU (an H200), sized for one lease (~13 minutes of steps): the kernels' benchmark,
# the served step on the full-width slice preset (then a traced run of it, summarised per op), the kernel tests
# compiled for the device, then async scheduling against one step at a time, then a layer scan's cost (does XLA:GPU
# copy each layer's weights out of the stack, as XLA:CPU does?), then the GEMM tiles' autotune (its table, to be
# committed as pallas_kernels/tuned/<device kind>.json once read), each under its own time limit (KERNEL_BENCH_S,
# SLICE_S, PROFILE_S, TESTS_S, ASYNC_S, LAYER_SCAN_S, AUTOTUNE_S), every result under $OUT (default ./gpu_out; at
# most 9 files)
# as soon as it exists, so a run cut short keeps the steps that finished.
# First run (2026-12-04): the slice's 13 programs compiled cold in 276 s; from JAX's cache in 31 s.
# The default limits add up to ~850 s, past one 600 s device call: lower some (e.g. SLICE_S, PROFILE_S) to reach the
# last steps in one call, or run the rest in a second call on the warm machine.
# Needs a Python with jax's CUDA plugin (the device image's python3 has jax 0.11.2 + cuda13);
# flax / orbax wheels in .whl/ are installed first when that Python's are missing or too old. Scratch files (those
# wheels, JAX's compile cache, traces) go to $WORK (default: a new temporary folder).
#   OUT=gpu_out PYTHON=python3 tools/gpu_check.sh
# DRY_RUN=1 runs every step on this machine's CPU with tiny shapes (the tiny preset, the kernels' smoke sizes
# interpreted, one kernel test file), so the script's plumbing is checked before a lease is spent on it:
#   DRY_RUN=1 OUT=/some/dir PYTHON=.venv/bin/python tools/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_out}
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
step() { echo "== $1 ($(date +%T), +$(( $(date +%s) - T0 )) s)" | tee -a "$OUT/steps.log"; }
# what each step runs on: the device, or (DRY_RUN=1) the CPU at tiny shapes
if [ "${DRY_RUN:-0}" = 1 ]; then
    KERNEL_SIZES=--smoke SLICE_MODEL="--model tiny --dtype float32 --lengths 64 --block-size 16 --decode-context 64"
    DECODE_BATCHES=1,2 DECODE_TRACED=1,2 TEST_PLATFORM=cpu KERNEL_TESTS=tests/pallas_kernels/test_router.py
    ASYNC_MODEL="--model tiny --batches 2 --steps 4 --repeats 1 --context 32"
    LAYER_SCAN="--model tiny --layers 2 --tokens 8 --repeats 2"
    AUTOTUNE="--smoke --rows 3 --reps 1"
else
    KERNEL_SIZES=""
    SLICE_MODEL="--model v41-flash-slice --dtype bfloat16 --lengths 8192 --block-size 256 --decode-context 1024"
    DECODE_BATCHES=1,8,64 DECODE_TRACED=1,64 TEST_PLATFORM=cuda KERNEL_TESTS=tests/pallas_kernels
    ASYNC_MODEL="--model small --batches 8,64 --steps 24 --repeats 3"
    LAYER_SCAN="--layers 3,5 --tokens 8,512"
    AUTOTUNE="--rows 1,64,4096"
fi

step "devices and packages"
if ! "$PY" -c 'import flax, orbax.checkpoint
from packaging.version import Version as V
assert V(flax.__version__) >= V("0.12.8"), flax.__version__' 2>>"$OUT/steps.log" && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
        2>&1 | tail -3 | tee -a "$OUT/steps.log"
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import jax, jaxlib, flax, numpy; print(jax.devices(), jax.default_backend(), 'jax', jax.__version__,
'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'numpy', numpy.__version__)" 2>&1 | tee -a "$OUT/steps.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>&1 | tee -a "$OUT/steps.log"
nproc | tee -a "$OUT/steps.log"

step "kernels' benchmark at V4.1-Flash sizes (checked on the device against the slower path, then timed)"
timeout -k 5 "${KERNEL_BENCH_S:-150}" "$PY" -m serving.bench.kernels $KERNEL_SIZES --reps 10 \
    --max-seconds "${KERNEL_CASES_S:-120}" --only "${KERNEL_ONLY:-}" --out "$OUT/kernel_bench.json" 2>&1 \
    | tee -a "$OUT/steps.log"
echo "rc ${PIPESTATUS[0]}" | tee -a "$OUT/steps.log"

step "served step on v41-flash-slice (release formats, bf16): 8K prefill replay off / on, decode batch 1 / 8 / 64"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # 78 GB of weights and tables, then caches and activations
slice() {  # seconds, kernel impl, JSON path, extra flags: the bench's table and progress appended to slice.txt
    echo "-- $3 --kernel-impl $2 $4" >> "$OUT/slice.txt"
    timeout -k 5 "$1" "$PY" -m serving.bench.prefill $SLICE_MODEL \
        --compilation-cache-dir "$WORK/jax_cache" --kernel-impl "$2" $4 \
        --out "$3" 2>&1 | tr '\r' '\n' | grep -v "pinned host\|Source Location\|cuda_host_allocator\|^)$" \
        | tee -a "$OUT/slice.txt"
    return "${PIPESTATUS[0]}"
}
S0=$(date +%s)
slice "${SLICE_S:-330}" auto "$OUT/slice_auto.json" "--repeats 3 --decode-batches $DECODE_BATCHES --decode-steps 8"
rc=$?
echo "rc $rc" | tee -a "$OUT/steps.log"
left=$(( ${SLICE_S:-330} - ($(date +%s) - S0) ))
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$left" -gt 120 ]; then
    step "the Pallas run failed: the same with the XLA paths (--kernel-impl xla) in the $left s left"
    slice "$left" xla "$OUT/slice_xla.json" "--repeats 3 --decode-batches $DECODE_BATCHES --decode-steps 8"
    echo "rc $?" | tee -a "$OUT/steps.log"
fi

step "where the slice's time goes: a traced 8K prefill per mode and decode at batch 1 / 64 (programs from the cache)"
slice "${PROFILE_S:-100}" auto "$WORK/slice_profiled.json" \
    "--repeats 1 --decode-batches $DECODE_TRACED --decode-steps 3 --profile-dir $WORK/prof"
echo "rc $?" | tee -a "$OUT/steps.log"
"$PY" - "$WORK/prof" > "$OUT/slice_profile.txt" 2>&1 <<'PY'
import sys
from pathlib import Path
from serving.engine.trace_report import format_report, read_trace
for run in sorted(p for p in Path(sys.argv[1]).glob("*") if p.is_dir()):
    try:
        print(format_report(read_trace(run), top=25), "\n")
    except Exception as e:  # a trace the reader cannot take: say why, and go on to the next run
        print(f"{run}: {type(e).__name__}: {e}\n")
PY
unset XLA_PYTHON_CLIENT_MEM_FRACTION

step "kernel tests compiled for the GPU (Triton kernels against their references)"
# four workers where the image has pytest-xdist (a dev extra of ours, not of the image): else one
workers=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 4")
JAX_PLATFORMS=$TEST_PLATFORM XLA_FLAGS="" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${TESTS_S:-60}" \
    "$PY" -m pytest -v -rf $workers $KERNEL_TESTS > "$OUT/kernel_tests.txt" 2>&1
echo "rc $?" | tee -a "$OUT/steps.log"
grep -E "FAILED|passed|failed" "$OUT/kernel_tests.txt" | tail -15
step "async scheduling against one step at a time: the engine's decode step on the small preset (float32)"
timeout -k 5 "${ASYNC_S:-120}" "$PY" -m serving.bench.async_scheduling $ASYNC_MODEL \
    --compilation-cache-dir "$WORK/jax_cache" --out "$OUT/async_scheduling.json" 2>&1 \
    | tail -12 | tee -a "$OUT/steps.log"
echo "rc ${PIPESTATUS[0]}" | tee -a "$OUT/steps.log"
step "one compiled body per layer structure: G same-structure layers unrolled / scanned / one layer (small, bf16)"
timeout -k 5 "${LAYER_SCAN_S:-90}" "$PY" -m serving.bench.layer_scan $LAYER_SCAN \
    --out "$WORK/layer_scan.json" 2>&1 | grep -v "freed memory" | tee -a "$OUT/steps.log"
echo "rc ${PIPESTATUS[0]}" | tee -a "$OUT/steps.log"
step "tile autotune: the FP8 linears' and MXFP4 experts' Pallas tiles against XLA, each candidate checked first"
timeout -k 5 "${AUTOTUNE_S:-150}" "$PY" -m serving.bench.autotune $AUTOTUNE --budget-s "${AUTOTUNE_BUDGET_S:-120}" \
    --out "$OUT/tile_table.json" 2>&1 | tee -a "$OUT/steps.log"
echo "rc ${PIPESTATUS[0]}" | tee -a "$OUT/steps.log"
step "done"
