#!/usr/bin/env bash
# On the GPU machine (through the device tool, carrying .gpu): correctness of every
# PTX artifact against the reference, the CuPy example, and the side-by-side benchmark.
# Results go to $OUT (or /tmp/ejc-gpu-out).
#   bash scripts/gpu_run.sh            # quick benchmark (3 rows)
#   bash scripts/gpu_run.sh --full     # the whole standard grid
#   bash scripts/gpu_run.sh --rows 1024,8192   # those sequence lengths of the grid
#   bash scripts/gpu_run.sh --mlir-only  # only the MLIR gpu form's correctness (+ memcheck sample)
#   bash scripts/gpu_run.sh --hopper     # only the sm_90a (wgmma) artifacts' correctness, memcheck, 3 bench rows
#   bash scripts/gpu_run.sh --checks     # every PTX check (both entries), memcheck, CuPy example; no MLIR, no bench
#   bash scripts/gpu_run.sh --bench-only [ROWS]  # only the benchmark (whole grid, or those sequence lengths)
# (the device tool allows 10 minutes per call: --checks then --bench-only fit two calls)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ejc-gpu-out}
mkdir -p "$OUT" /tmp/ejc-art
tar -C /tmp/ejc-art -xzf .gpu/artifacts.tgz
nvidia-smi -L | tee "$OUT/device.txt"
export PYTHONUNBUFFERED=1
status=0
if [ "${1:-}" = "--hopper" ]; then
    echo "== sm_90a (wgmma): ejc-gpu check"
    ./.gpu/ejc-gpu check /tmp/ejc-art/check_sm90a 2>&1 | tee "$OUT/check_sm90a.log" || status=1
    if command -v compute-sanitizer >/dev/null; then
        compute-sanitizer --tool memcheck --error-exitcode 9 ./.gpu/ejc-gpu check /tmp/ejc-art/check_sm90a \
            --filter causal_bf16_d128 2>&1 | tail -8 | tee "$OUT/memcheck_sm90a.log" || status=1
    fi
    python3 bench/compare_gpu.py /tmp/ejc-art/bench --quick --verbose --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    exit $status
fi
if [ "${1:-}" = "--bench-only" ]; then
    rows=()
    [ -n "${2:-}" ] && rows=(--rows "$2")
    python3 bench/compare_gpu.py /tmp/ejc-art/bench "${rows[@]}" --verbose --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    exit $status
fi
if [ "${1:-}" != "--checks" ]; then
echo "== MLIR gpu form: ejc-gpu check (every artifact x 5 awkward shapes vs the reference)"
./.gpu/ejc-gpu check /tmp/ejc-art/mlir 2>&1 | tee "$OUT/check_mlir.log" || status=1
if command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck --error-exitcode 9 ./.gpu/ejc-gpu check /tmp/ejc-art/mlir --filter causal_bf16_d64 \
        2>&1 | tail -8 | tee "$OUT/memcheck_mlir.log" || status=1
fi
if [ "${1:-}" = "--mlir-only" ]; then
    exit $status
fi
fi
echo "== ejc-gpu check (every artifact x 5 awkward shapes vs the reference)"
./.gpu/ejc-gpu check /tmp/ejc-art/check_sm90a 2>&1 | tee "$OUT/check_sm90a.log" || status=1
./.gpu/ejc-gpu check /tmp/ejc-art/check 2>&1 | tee "$OUT/check.log" || status=1
./.gpu/ejc-gpu check /tmp/ejc-art/check2 2>&1 | tee "$OUT/check2.log" || status=1
echo "== compute-sanitizer memcheck on a sample (causal, gemma2, varlen_causal, sinks; both archs, both entries)"
if command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck --error-exitcode 9 ./.gpu/ejc-gpu check /tmp/ejc-art/check2 --filter bf16_d64_m64_n32 \
        2>&1 | tail -25 | tee "$OUT/memcheck.log" || status=1
    compute-sanitizer --tool memcheck --error-exitcode 9 ./.gpu/ejc-gpu check /tmp/ejc-art/check_sm90a --filter causal_bf16_d128 \
        2>&1 | tail -12 | tee "$OUT/memcheck_sm90a.log" || status=1
else
    echo "compute-sanitizer not found: skipped" | tee "$OUT/memcheck.log"
fi
echo "== examples/cupy_launch.py"
python3 examples/cupy_launch.py /tmp/ejc-art/check 2>&1 | tee "$OUT/cupy.log" || status=1
if [ "${1:-}" = "--checks" ]; then
    exit $status
fi
echo "== bench/compare_gpu.py"
if [ "${1:-}" = "--full" ]; then
    python3 bench/compare_gpu.py /tmp/ejc-art/bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
elif [ "${1:-}" = "--rows" ]; then
    python3 bench/compare_gpu.py /tmp/ejc-art/bench --rows "$2" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
else
    python3 bench/compare_gpu.py /tmp/ejc-art/bench --quick --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
fi
exit $status
