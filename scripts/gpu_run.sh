#!/usr/bin/env bash
# On the GPU machine (through the device tool, carrying .gpu): correctness of every
# PTX artifact against the reference, the CuPy example, and the side-by-side benchmark.
# Results go to $OUT (or /tmp/ejc-gpu-out).
#   bash scripts/gpu_run.sh            # every check, then a quick benchmark (3 rows)
#   bash scripts/gpu_run.sh --full     # every check, then the whole standard grid
#   bash scripts/gpu_run.sh --rows 1024,8192   # every check, then those sequence lengths of the grid
#   bash scripts/gpu_run.sh --mlir-only  # only the MLIR gpu form's correctness (+ memcheck sample; `gpu_prepare.sh --mlir`)
#   bash scripts/gpu_run.sh --hopper     # wgmma layout probe, the sm_90a artifacts' correctness, memcheck, 3 bench rows
#   bash scripts/gpu_run.sh --checks     # every PTX check (both entries, every code path), memcheck, CuPy examples (`gpu_prepare.sh --checks`)
#   bash scripts/gpu_run.sh --bench-only [ROWS]  # only the benchmark (whole grid, or those sequence lengths; EJC_ONLY=TEXT: those candidates)
#   bash scripts/gpu_run.sh --verify     # the PTX checks, memcheck on two sm_90a samples, the whole grid: one call
#   bash scripts/gpu_run.sh --ws [ROWS]  # the warp-specialised artifacts' checks, memcheck, CuPy example, then the bench
#   bash scripts/gpu_run.sh --dsl        # examples/dsl-demo's kernels through `launch_gpu` against plain Rust
#                                        # (`gpu_prepare.sh --dsl`; carry .gpu), then the bf16 matmul's
#                                        # timing at 4096^3 beside torch.matmul's
#   bash scripts/gpu_run.sh --kernels    # the generality cases (`gpu_prepare.sh --kernels`) against the interpreter,
#                                        # then memcheck over them and racecheck on five
#   bash scripts/gpu_run.sh --anchors-check  # call 1 of the FlashAttention-4 side-by-side (`gpu_prepare.sh --anchors`;
#                                        # carry .gpu and .anchors/fa4/part-aa): FA4's first half to /tmp, the soft-cap
#                                        # variants' checks, the generality cases; the bench set stays in /tmp/ejc-art
#   bash scripts/gpu_run.sh --anchors-bench [ROWS]  # call 2, at once on the warm machine (carry .anchors/fa4/part-ab
#                                        # and .anchors/fa4/whl): FA4 installed, then bench/compare_gpu.py --extra (ROWS:
#                                        # those sequence lengths; EJC_EXTRA_ONLY=1: the Gemma-2 and GQA rows alone)
#   bash scripts/gpu_run.sh --headdims   # head dims 96/192/256 (`gpu_prepare.sh --headdims`): the check set on every path;
#                                        # then `cp .anchors/fa4/part-aa /tmp/` (call 2) and EJC_DIMS=96,192,256
#                                        # gpu_run.sh --anchors-bench (call 3, carry part-ab, whl, .gpu/ejc-gpu)
#   bash scripts/gpu_run.sh --hostile    # samples of every operation (`gpu_prepare.sh --hostile`): zero-sized axes,
#                                        # memcheck and racecheck, one tensor just past 2^31 elements (EJC_BIG=0: not that;
#                                        # EJC_BIG=flash|decode: that case's aligned entry alone, EJC_SANITIZE=memcheck under the sanitizer)
#   bash scripts/gpu_run.sh --ops        # every operation and plan (`gpu_prepare.sh --ops`): checks, memcheck, tune/call, CuPy
#   bash scripts/gpu_run.sh --ops-bench  # decode rows (both plans vs cuDNN, FA2), pooling vs torch, 3 flash rows
#   bash scripts/gpu_run.sh --ops-cli    # the compiler on the GPU: `ejc tune --backend cuda` stores a winner that the
#                                        # runtime (`ejc-gpu call`, another process) then uses; `ejc run --backend cuda`
#   bash scripts/gpu_run.sh --bwd        # the flash backward (`gpu_prepare.sh --bwd`): every artifact checked, memcheck,
#                                        # racecheck (carry .anchors/fa4/part-aa too and `cp` it to /tmp/ for the bench)
#   bash scripts/gpu_run.sh --bwd-bench  # then (carry .gpu/ejc-gpu, .anchors/fa4/part-ab and whl): the backward vs
#                                        # cuDNN, FlashAttention-2 and FlashAttention-4 (bench/compare_gpu_bwd.py)
#   bash scripts/gpu_run.sh --bwd-tiles [ROWS]  # the backward's dK/dV tile sweep (`gpu_prepare.sh --bwd-tiles`): checks,
#                                        # sanitizer samples, then its timings beside the previous build's and the anchors
#   bash scripts/gpu_run.sh --dbias-bench  # after --bwd, same call: the backward with dbias (bias_grad) vs torch SDPA's
#                                        # bias-gradient back ends, then the forward's bias variant (bench/compare_gpu_dbias.py)
#   bash scripts/gpu_run.sh --paged      # page_attention, ragged_decode_attention (`gpu_prepare.sh --paged`; carry .anchors/fa4/part-aa too): every
#                                        # artifact of both plans checked (PTX and MLIR), memcheck and racecheck samples, the
#                                        # tuner's choice stored and reused; then --paged-bench in a second call (carry
#                                        # .anchors/fa4/part-ab and whl): bench/paged_gpu.py, bandwidth vs copy, FA4, SDPA
#   bash scripts/gpu_run.sh --rpa        # ragged_page_attention v2/v3 (`gpu_prepare.sh --rpa`; carry .gpu, then in a
#                                        # short call .anchors/fa4/part-aa: together they pass 64 MiB): every artifact
#                                        # checked, memcheck samples, tune/call on a serving step;
#                                        # then --rpa-bench at once (carry .gpu/ejc-gpu, .gpu/rpa_bench.tar.xz,
#                                        # .anchors/fa4/part-ab, whl): mixed
#                                        # prefill + decode steps vs FA4's paged varlen and SDPA (bench/paged_gpu.py --rpa).
#                                        # EJC_RPA_FILTERS="TEXT ..." checks only matching artifacts, EJC_RPA_CHECKS_ONLY=1
#                                        # stops after the checks, EJC_RPA_SPLIT_ONLY=1 runs the classed_split samples and
#                                        # the tuner alone after them
#   bash scripts/gpu_run.sh --rpa-samples # after `--rpa` with EJC_RPA_CHECKS_ONLY=1: memcheck on every classed plan,
#                                        # then tune/call on a serving step (carry .gpu, both packs)
#   bash scripts/gpu_run.sh --rpa-streams # the classed plans, whose decodes and chunks run on two streams: their
#                                        # checks (v2, v3, both archs) and memcheck samples; then --rpa-bench
#   bash scripts/gpu_run.sh --bs-variants # the check sets of `EJC_BS_VARIANTS=... gpu_prepare.sh --bs` (EJC_BS_SAMPLES
#                                        # adds memcheck/racecheck samples, "SET:FILTER ...")
#   bash scripts/gpu_run.sh --bs         # blocksparse_attention and its backward (`gpu_prepare.sh --bs`; carry .gpu/ejc-gpu,
#                                        # .gpu/artifacts.tar.xz and .anchors/fa4/part-aa): every artifact checked (PTX
#                                        # on both archs, MLIR's gpu form), memcheck and racecheck samples, tune/call;
#                                        # then --bs-bench at once (carry .gpu/ejc-gpu, .gpu/bs_bench.tar.xz,
#                                        # .anchors/fa4/part-ab, whl): bench/blocksparse_gpu.py against FlexAttention,
#                                        # FA4, cuDNN and ejc's dense flash (EJC_BS_ROWS=all: the longer grid);
#                                        # --bs-bench-check (carry the bench pack and part-aa): the bench set's
#                                        # checks, as call 1 before --bs-bench when the check pack is not rebuilt;
#                                        # --bs-bench-bwd (the --bs-bench carry, at once after it): the backward's
#                                        # bench set checked, then bench/blocksparse_gpu.py --backward
#   bash scripts/gpu_run.sh --ring       # ring attention (`gpu_prepare.sh --ring`; a kind with 2+ GPUs): the block
#                                        # artifacts checked, then `ejc-ring check` on 2 and on every GPU (NCCL ranks
#                                        # vs the one-GPU simulation bit for bit, and vs the f64 reference)
#   bash scripts/gpu_run.sh --ring-bench # then, on the warm machine: `ejc-ring bench` (scaling, hidden transfers,
#                                        # layouts) and bench/ring_gpu.py (torch all-gather + SDPA) side by side
#   bash scripts/gpu_run.sh --train      # examples/train_gpu.py, full and causal (`gpu_prepare.sh --train`)
#   bash scripts/gpu_run.sh --cpu [THREADS]  # the host CPU (`gpu_prepare.sh --cpu`): AMX detection, `ejc run --backend cpu`
#                                        # on every variant x dtype with `--isa amx` (awkward sizes, against the reference),
#                                        # then bench/compare_cpu.py with cpu:amx at THREADS (default 1,16): ratios, scaling
# EJC_FILTER=TEXT keeps the artifacts whose id contains TEXT in the checks; EJC_SHARDS=N
# (default: the CPU count, at most 16) runs N `ejc-gpu check` processes side by side:
# loading PTX is the driver's JIT compile, CPU-bound, about a second per entry.
# (the device tool allows 10 minutes per call: --checks then --bench-only fit two calls)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ejc-gpu-out}
mkdir -p "$OUT" /tmp/ejc-art
for pack in .gpu/artifacts.tgz .gpu/artifacts.tar.xz .gpu/rpa_bench.tar.xz .gpu/bs_bench.tar.xz; do
    [ -f "$pack" ] && tar -C /tmp/ejc-art -xf "$pack"
done
nvidia-smi -L | tee "$OUT/device.txt"
export PYTHONUNBUFFERED=1
status=0
SEED=${EJC_SEED:-$(date +%s%N)}
SHARDS=${EJC_SHARDS:-$(nproc)}
[ "$SHARDS" -gt 16 ] && SHARDS=16

# check_set NAME: every artifact of /tmp/ejc-art/NAME, in $SHARDS processes; one log,
# $OUT/check_NAME.log, and a summary line.
check_set() {
    local name=$1 pids=() i rc=0
    if [ ! -d "/tmp/ejc-art/$name" ]; then
        echo "check $name: not in this pack (scripts/gpu_prepare.sh builds it): skipped" | tee -a "$OUT/summary.txt"
        return 0
    fi
    for i in $(seq 0 $((SHARDS - 1))); do
        timeout "${EJC_TIMEOUT:-480}" ./.gpu/ejc-gpu check "/tmp/ejc-art/$name" --seed "$SEED" --shard "$i/$SHARDS" \
            ${EJC_FILTER:+--filter "$EJC_FILTER"} > "/tmp/ejc-check-$name.$i.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    cat /tmp/ejc-check-"$name".*.log > "$OUT/check_$name.log"
    local passed failed
    passed=$(grep -c '^ok ' "$OUT/check_$name.log")
    failed=$(grep -c '^FAIL' "$OUT/check_$name.log")
    grep '^FAIL' "$OUT/check_$name.log" | head -20
    echo "check $name: $passed passed, $failed failed (seed $SEED, $SHARDS processes)" | tee -a "$OUT/summary.txt"
    [ "$failed" -eq 0 ] && [ "$rc" -eq 0 ]
}

memcheck() {  # memcheck SET FILTER
    if command -v compute-sanitizer >/dev/null; then
        timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 ./.gpu/ejc-gpu check "/tmp/ejc-art/$1" --seed "$SEED" \
            --filter "$2" 2>&1 | tail -4 | tee -a "$OUT/memcheck.log"
        local rc=${PIPESTATUS[0]}
        echo "memcheck $1 $2: exit $rc" | tee -a "$OUT/summary.txt"
        return "$rc"
    fi
    echo "compute-sanitizer not found: memcheck skipped" | tee -a "$OUT/summary.txt"
}

racecheck() {  # racecheck SET FILTER: shared-memory hazards on one sample
    if command -v compute-sanitizer >/dev/null; then
        timeout 300 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
            ./.gpu/ejc-gpu check "/tmp/ejc-art/$1" --seed "$SEED" --filter "$2" 2>&1 | tail -4 | tee -a "$OUT/racecheck.log"
        local rc=${PIPESTATUS[0]}
        echo "racecheck $1 $2: exit $rc" | tee -a "$OUT/summary.txt"
        return "$rc"
    fi
    echo "compute-sanitizer not found: racecheck skipped" | tee -a "$OUT/summary.txt"
}

# tune_then_call SET SIZES [VARIANT]: `ejc-gpu tune` on one call of SIZES (VARIANT, default full;
# bf16) stores its winner; then `ejc-gpu call`, a second process, must find it in the persistent cache.
tune_then_call() {
    local step rc=0
    for step in tune call; do
        timeout 300 ./.gpu/ejc-gpu $step "/tmp/ejc-art/$1" --variant "${3:-full}" --dtype bf16 --size "$2" \
            --cache-dir /tmp/ejc-cache 2>&1 | tail -8 | tee -a "$OUT/tune.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    return $rc
}

# one_case SET FILTER SIZES [FLAGS...]: every candidate matching FILTER on one call of SIZES
# (FLAGS: e.g. --entry aligned, one entry only).
one_case() {
    local log="$OUT/case_$1_$(echo "$3" | tr ',=' '_-')${4:+_${4#--}_$5}${EJC_SANITIZE:+_$EJC_SANITIZE}.log"
    # EJC_SANITIZE=memcheck (or racecheck, ...): the case under compute-sanitizer.
    local sanitize=()
    [ -n "${EJC_SANITIZE:-}" ] && sanitize=(compute-sanitizer --tool "$EJC_SANITIZE" --error-exitcode 9)
    /usr/bin/time -f "%e s, %M KB peak" timeout "${EJC_TIMEOUT:-400}" "${sanitize[@]}" ./.gpu/ejc-gpu check "/tmp/ejc-art/$1" \
        --seed "$SEED" --filter "$2" --size "$3" "${@:4}" > "$log" 2>&1
    local rc=$?
    grep -E '^(ok|FAIL)|passed|error|ERROR SUMMARY' "$log" | tail -8
    echo "case $1 [$2] $3: exit $rc ($(tail -1 "$log"))" | tee -a "$OUT/summary.txt"
    return "$rc"
}

if [ "${1:-}" = "--headdims" ]; then
    # Head dims 96, 192 and 256 (`gpu_prepare.sh --headdims`): every variant x bf16/f16 on every
    # path of sm_90a and sm_80, a memcheck sample; the bench set stays in /tmp/ejc-art for
    # --anchors-bench (EJC_DIMS=96,192,256) after FA4's first half: `cp .anchors/fa4/part-aa /tmp/`.
    check_set hd || status=1
    check_set hd2 || status=1
    # A memcheck and a racecheck sample of the kernels the pack has (EJC_KEYS may narrow it).
    for f in "causal_bf16_d256_m128_n64@ptx:sm_90a/w8_s2_wgmma_ws" "varlen_causal_f16_d96_m128_n64@ptx:sm_80/w8_s2" \
        "causal_bf16_d192v128_m128_n64@ptx:sm_90a/w8_s2_wgmma_ws" "sinks_f16_d192v128_m128_n64@ptx:sm_80/w8_s2"; do
        grep -q "${f%%@*}\"" /tmp/ejc-art/hd/manifest.json && { memcheck hd "$f" || status=1; }
    done
    grep -q 'causal_bf16_d192v128_m128_n64"' /tmp/ejc-art/hd/manifest.json &&
        { racecheck hd "causal_bf16_d192v128_m128_n64@ptx:sm_90a/w8_s2_wgmma_ws" || status=1; }
    grep -h "d96\|d192\|d256" /tmp/ejc-art/bench_ptxas.txt 2>/dev/null | head -400 > "$OUT/bench_ptxas.txt"
    exit $status
fi
if [ "${1:-}" = "--bwd" ]; then
    # The flash backward (`gpu_prepare.sh --bwd`): every artifact on the awkward shapes, both entries,
    # against the f64 reference backward; memcheck and racecheck samples.
    check_set bwd || status=1
    check_set bwd128 || status=1
    check_set fwdbias || status=1
    memcheck bwd "causal_bf16_d64_dkdv_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    memcheck bwd "causal_bf16_d64_dkdv_dq_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    memcheck bwd "varlen_causal_f16_d64" || status=1
    memcheck bwd "gpt_oss_f16_d64_dkdv_dq_m64_n64@ptx:sm_80" || status=1
    racecheck bwd "gpt_oss_bf16_d64_dq_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    racecheck bwd "gpt_oss_bf16_d64_dkdv_dq_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    # dbias (bias_grad): written by dq (two_pass) and dkdv_dq (atomic), zeroed on skipped blocks.
    memcheck bwd "local_bias_grad_bf16_d64_dq_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    memcheck bwd "local_bias_grad_f16_d64_dkdv_dq_m64_n64@ptx:sm_80" || status=1
    racecheck bwd "local_bias_grad_bf16_d64_dkdv_dq_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    cp /tmp/ejc-art/bwd_ptxas.txt "$OUT/" 2>/dev/null
    exit $status
fi
if [ "${1:-}" = "--bwd-tiles" ]; then
    # The backward's dK/dV tilings (`gpu_prepare.sh --bwd-tiles`): the new pack (bwdnew: every sm_90a
    # candidate of the tile sweep that does not spill) checked against the f64 reference, memcheck and
    # racecheck on a warp-specialised sample, then timed beside the previous build (bwdold, when the pack
    # has it) and the anchors: bench/compare_gpu_bwd.py, --verbose (every candidate's time in the log).
    check_set bwdnew || status=1
    memcheck bwdnew "causal_bf16_d64_dkdv_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    racecheck bwdnew "causal_bf16_d64_dkdv_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    for extra in ${EJC_EXTRA_CHECKS:-}; do check_set "$extra" || status=1; done
    [ -f /tmp/part-aa ] && [ -f .anchors/fa4/part-ab ] && source .anchors/fa4/whl/install.sh
    rows=${2:-2048,16384}
    for set in bwdold bwdnew; do
        [ -d "/tmp/ejc-art/$set" ] || continue
        timeout "${EJC_BENCH_TIMEOUT:-240}" python3 bench/compare_gpu_bwd.py "/tmp/ejc-art/$set" --rows "$rows" \
            --verbose --json "$OUT/bench_$set.json" > "$OUT/bench_$set.log" 2>&1 || status=1
        echo "== $set"; grep -E '^(d=|fa4|device)' "$OUT/bench_$set.log"
    done
    exit $status
fi
if [ "${1:-}" = "--bwd-bench" ]; then
    # After --bwd on the same warm machine (its packs in /tmp/ejc-art), with FA4's second half carried:
    # the backward side by side against cuDNN, FlashAttention-2 and FlashAttention-4 (~5 min).
    source .anchors/fa4/whl/install.sh || echo "FA4 not installed: its column stays empty"
    rows=(); [ -n "${2:-}" ] && rows=(--rows "$2")
    timeout "${EJC_BENCH_TIMEOUT:-560}" python3 bench/compare_gpu_bwd.py /tmp/ejc-art/bwd /tmp/ejc-art/bwd128 \
        "${rows[@]}" --json "$OUT/bench_bwd.json" > "$OUT/bench_bwd.log" 2>&1
    status=$?
    grep -E '^(d=|fa4|device)' "$OUT/bench_bwd.log"
    exit $status
fi
if [ "${1:-}" = "--dbias-bench" ]; then
    # After --bwd on the same warm machine: the backward with dbias (bias_grad) against torch SDPA's
    # back ends that return a bias gradient (FlashAttention-2 and -4 take no bias).
    timeout "${EJC_BENCH_TIMEOUT:-400}" python3 bench/compare_gpu_dbias.py /tmp/ejc-art/bwd /tmp/ejc-art/bwd128 \
        --json "$OUT/bench_dbias.json" > "$OUT/bench_dbias.log" 2>&1
    status=$?
    grep -E '^(d=|device|torch)' "$OUT/bench_dbias.log"
    # The forward's bias variant (the --bwd pack's 128 x 64 check tiles; docs/perf.md used the spec's
    # whole sm_90a space: `ejc build specs/flash.yaml --target ptx:sm_90a --variant bias --dtype bf16
    # --head-dim 64 --head-dim 128 --path wgmma --path ws --report --drop-spilling`).
    timeout 200 python3 bench/compare_gpu_dbias.py --forward /tmp/ejc-art/fwdbias --rows 2048,8192 \
        --json "$OUT/bench_fwd_bias.json" > "$OUT/bench_fwd_bias.log" 2>&1 || status=1
    grep -E '^fwd' "$OUT/bench_fwd_bias.log"
    exit $status
fi
if [ "${1:-}" = "--train" ]; then
    # examples/train_gpu.py: a layer trained with ejc's forward and backward against torch's SDPA
    # (full, causal, and full with a learned relative-position bias: dbias).
    for c in "" --causal --bias; do
        python3 examples/train_gpu.py /tmp/ejc-art/trainfwd /tmp/ejc-art/trainbwd $c 2>&1 | tee -a "$OUT/train.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    exit $status
fi
if [ "${1:-}" = "--anchors-check" ]; then
    cp .anchors/fa4/part-aa /tmp/ || { echo "carry .anchors/fa4/part-aa (../shared/bench/fa4_kit.sh)"; exit 1; }
    check_set softcap || status=1
    ./.gpu/ejc-gpu check-kernels /tmp/ejc-art/kernels --seed "$SEED" 2>&1 | tee "$OUT/check_kernels.log"
    rc=${PIPESTATUS[0]}
    echo "check-kernels: $(tail -1 "$OUT/check_kernels.log") (exit $rc, seed $SEED)" | tee -a "$OUT/summary.txt"
    [ "$rc" -eq 0 ] || status=1
    memcheck softcap "gemma2_bf16_d128_m128_n128@ptx:sm_90a/w8_s2_wgmma_ws" || status=1
    exit $status
fi
if [ "${1:-}" = "--anchors-bench" ]; then
    # FA4's second half and its wheels (install.sh says so if the machine is a fresh one).
    source .anchors/fa4/whl/install.sh || exit 1
    [ -d /tmp/ejc-art/bench ] || { echo "no bench set in /tmp/ejc-art: run --anchors-check first (same warm machine)"; exit 1; }
    rows=(); [ -n "${2:-}" ] && rows=(--rows "$2")
    extra=(--extra); [ -n "${EJC_EXTRA_ONLY:-}" ] && extra=(--extra-only)
    # EJC_DIMS=96,192,256: the standard grid at those head dims alone (gpu_prepare.sh --headdims).
    [ -n "${EJC_DIMS:-}" ] && extra=(--dims "$EJC_DIMS")
    timeout "${EJC_BENCH_TIMEOUT:-560}" python3 bench/compare_gpu.py /tmp/ejc-art/bench "${extra[@]}" "${rows[@]}" \
        --verbose --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    status=$?
    grep -E '^(d=|fa4|device)' "$OUT/bench.log"
    exit $status
fi
if [ "${1:-}" = "--dsl" ]; then
    # The demo's kernels through their generated launch_gpu, against plain Rust (both archs' PTX
    # are in the build; the library picks sm_90a on a Hopper GPU), then the tuned
    # kernels timed beside torch.matmul (cuBLAS), a device copy and torch's own, then memcheck over the tests.
    export EJC_DEMO_DIR=$PWD/.gpu/ejc-demo
    ./.gpu/dsl_gpu_test --test-threads 1 --nocapture 2>&1 | tee "$OUT/dsl_gpu.log"
    rc=${PIPESTATUS[0]}
    echo "dsl gpu tests: exit $rc (seeds in dsl_gpu.log)" | tee -a "$OUT/summary.txt"
    ./.gpu/dsl_gpu_test --ignored --nocapture dsl_timings 2>&1 | grep -E "TFLOP|GB/s|GPU|point" | tee -a "$OUT/summary.txt"
    python3 - <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import torch
from triton.testing import do_bench
n = 4096
a = torch.full((n, n), 0.5, device="cuda", dtype=torch.bfloat16)
b = torch.full((n, n), 0.25, device="cuda", dtype=torch.bfloat16)
for name, f in (("bf16 out", lambda: a @ b), ("f32 out", lambda: torch.matmul(a, b, out_dtype=torch.float32) if "out_dtype" in torch.matmul.__doc__ else (a @ b).float())):
    try:
        ms = do_bench(f, warmup=10, rep=100, return_mode="median")
        print(f"torch.matmul {n}^3 ({name}): {ms:.3f} ms, {2 * n**3 / ms / 1e9:.0f} TFLOP/s")
    except Exception as e:  # noqa: BLE001
        print(f"torch.matmul ({name}): {type(e).__name__}: {e}")
del a, b
r, c = 16384, 8192
for dt in (torch.float32, torch.bfloat16):
    x = torch.full((r, c), 0.5, device="cuda", dtype=dt)
    y = torch.empty_like(x)
    w = torch.full((c,), 1.5, device="cuda", dtype=dt)
    gb = 2 * x.numel() * x.element_size() / 1e6
    for name, f in (("copy", lambda: y.copy_(x)),
                    ("torch rms_norm", lambda: torch.nn.functional.rms_norm(x, (c,), w, 1e-5)),
                    ("torch softmax", lambda: torch.softmax(x, -1))):
        ms = do_bench(f, warmup=10, rep=100, return_mode="median")
        print(f"{name} {r}x{c} {str(dt).split('.')[-1]}: {ms:.3f} ms, {gb / ms:.0f} GB/s")
PY
    # EJC_NO_MEMCHECK=1: leave memcheck out (a call short of device time).
    if [ -z "${EJC_NO_MEMCHECK:-}" ] && command -v compute-sanitizer >/dev/null; then
        timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 ./.gpu/dsl_gpu_test --test-threads 1 \
            2>&1 | tail -4 | tee -a "$OUT/memcheck.log"
        m=${PIPESTATUS[0]}
        echo "memcheck dsl: exit $m" | tee -a "$OUT/summary.txt"
        [ "$m" -eq 0 ] || rc=1
    fi
    exit $rc
fi
if [ "${1:-}" = "--kernels" ]; then
    ./.gpu/ejc-gpu check-kernels /tmp/ejc-art/kernels --seed "$SEED" 2>&1 | tee "$OUT/check_kernels.log"
    rc=${PIPESTATUS[0]}
    echo "check-kernels: $(tail -1 "$OUT/check_kernels.log") (exit $rc, seed $SEED)" | tee -a "$OUT/summary.txt"
    if command -v compute-sanitizer >/dev/null; then
        timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 ./.gpu/ejc-gpu check-kernels /tmp/ejc-art/kernels \
            --seed "$SEED" 2>&1 | tail -3 | tee -a "$OUT/memcheck.log"
        m=${PIPESTATUS[0]}
        echo "memcheck kernels: exit $m" | tee -a "$OUT/summary.txt"
        [ "$m" -eq 0 ] || rc=1
        # Shared-memory hazards: the cross-warp reductions, a staged transposed operand,
        # staged f32 operands, replicated rows (8 warps on 16- and 64-row tiles).
        for f in col_reduce "dq_q157_k131 [sm_90a wgmma w4 s2]" "f32_gemm_m64_n128_k96 [sm_80 mma w8" \
            "few_rows_r40_k150 [sm_90a mma w8" "dkdv_q157_k131 [sm_80 mma w8"; do
            timeout 300 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
                ./.gpu/ejc-gpu check-kernels /tmp/ejc-art/kernels --seed "$SEED" --filter "$f" 2>&1 | tail -2 | tee -a "$OUT/racecheck.log"
            m=${PIPESTATUS[0]}
            echo "racecheck kernels $f: exit $m" | tee -a "$OUT/summary.txt"
            [ "$m" -eq 0 ] || rc=1
        done
    fi
    exit "$rc"
fi
if [ "${1:-}" = "--hostile" ]; then
    ./.gpu/ejc-gpu info | tee "$OUT/info.txt"
    if [ "${EJC_BIG:-1}" = 1 ] || [ "${EJC_BIG:-1}" = 0 ]; then
        # The awkward cases of every sampled kernel, then zero-sized axes on each.
        for set in hostile_flash hostile_flash80 hostile_decode hostile_pool; do check_set $set || status=1; done
        for z in seq_q=0 seq_k=0 seq_q=0,seq_k=0; do
            for set in hostile_flash hostile_flash80 hostile_decode; do one_case $set _ $z || status=1; done
        done
        one_case hostile_pool _ seq=0 || status=1
        # Sanitizers on a sample of every operation (both entries where a kernel has two).
        memcheck hostile_flash causal_bf16_d128_m128_n128@ptx:sm_90a/w8_s2_wgmma_ws || status=1
        memcheck hostile_flash80 varlen_causal_f16_d64 || status=1
        memcheck hostile_decode gpt_oss_bf16_d128_m64_n128_split@ptx:sm_90a/w4_s2_wgmma || status=1
        memcheck hostile_pool bf16_d128 || status=1
        racecheck hostile_flash causal_bf16_d128_m128_n128@ptx:sm_90a/w8_s2_wgmma_ws || status=1
        racecheck hostile_flash causal_bf16_d128_m128_n128@ptx:sm_90a/w8_s2_wgmma || status=1
        racecheck hostile_flash80 causal_f16_d64 || status=1
        racecheck hostile_decode gpt_oss_bf16_d128_m64_n128_split@ptx:sm_90a/w4_s2_wgmma || status=1
        racecheck hostile_pool bf16_d128 || status=1
    fi
    # One tensor just past 2^31 elements: the input of pooling, k and v of decode's
    # split plan, q (and out) of flash. The f64 reference and inputs on the host take
    # minutes and up to ~70 GB here (EJC_BIG=0 leaves these out, EJC_BIG=only runs only them).
    # The aligned entries past 2^31 elements, one call each (ENTRY=general for the others).
    if [ "${EJC_BIG:-1}" = flash ]; then
        one_case hostile_flash full_bf16_d128_m128_n128@ptx:sm_90a/w8_s2_wgmma_ws \
            batch=1,seq_q=262145,seq_k=3,heads_q=64,heads_kv=64 --entry "${ENTRY:-aligned}" || status=1
        exit $status
    fi
    if [ "${EJC_BIG:-1}" = decode ]; then
        one_case hostile_decode split@ptx:sm_90a/w4_s2_wgmma_ws batch=1,seq_q=1,seq_k=262145,heads_q=64,heads_kv=64 \
            --entry "${ENTRY:-aligned}" || status=1
        exit $status
    fi
    if [ "${EJC_BIG:-1}" != 0 ]; then
        one_case hostile_pool pool_fwd_bf16_d128_h64@ptx:sm_90a/w4 batch=1,seq=1048577,heads=16,chunk_size=32 || status=1
        one_case hostile_decode split@ptx:sm_90a/w4_s2_wgmma_ws batch=1,seq_q=1,seq_k=262145,heads_q=64,heads_kv=64 || status=1
        one_case hostile_flash full_bf16_d128_m128_n128@ptx:sm_90a/w8_s2_wgmma_ws \
            batch=1,seq_q=262145,seq_k=3,heads_q=64,heads_kv=64 || status=1
    fi
    exit $status
fi
if [ "${1:-}" = "--ops" ]; then
    ./.gpu/ejc-gpu info | tee "$OUT/info.txt"
    for set in ops_decode ops_pool ops_flash ops_flash80; do check_set $set || status=1; done
    memcheck ops_decode gpt_oss_bf16_d128 || status=1
    memcheck ops_pool bf16_d128 || status=1
    # The runtime's chain on the GPU: tune one decode call (both plans, every split count),
    # then a second process finds the choice in the persistent cache.
    for step in tune call; do
        timeout 300 ./.gpu/ejc-gpu $step /tmp/ejc-art/ops_decode --variant gpt_oss --dtype bf16 --shape 4,1,16384,32,8,128 \
            --cache-dir /tmp/ejc-cache 2>&1 | tail -15 | tee -a "$OUT/tune.log" || status=1
    done
    timeout 120 python3 examples/cupy_launch.py /tmp/ejc-art/ops_flash _ws 2>&1 | tee "$OUT/cupy.log" || status=1
    exit $status
fi
if [ "${1:-}" = "--cpu" ]; then
    mkdir -p /tmp/ejc-bin && xz -dc .gpu/ejc.xz > /tmp/ejc-bin/ejc && chmod +x /tmp/ejc-bin/ejc
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$PWD/.gpu"
    E=/tmp/ejc-bin/ejc
    {
        lscpu | grep -E "Model name|^CPU\(s\)|Thread|L2|L3|Flags" | sed 's/Flags:.*/Flags (amx, avx512_bf16): '"$(grep -o 'amx[a-z0-9_]*\|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"'/'
        python3 -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability())"
        echo "== ejc run --backend cpu --isa amx: every variant, against the reference (awkward sizes)"
        for dt in bf16 f16 f32; do
            for shape in 2,77,93,4,2,64 1,333,517,4,1,128; do
                timeout 300 $E run specs/flash.yaml --backend cpu --isa amx --dtype $dt --shape $shape \
                    --block-m 64 --block-n 64 2>&1 | tail -18 || status=1
            done
        done
        echo "== the same through the 32-row tiles (2 x 2 AMX accumulators) and 128-row blocks"
        timeout 300 $E run specs/flash.yaml --backend cpu --isa amx --dtype bf16 --shape 2,300,411,4,2,128 \
            --block-m 128 --block-n 128 2>&1 | tail -18 || status=1
    } > "$OUT/cpu_checks.log" 2>&1
    cat "$OUT/cpu_checks.log"
    timeout 500 python3 bench/compare_cpu.py --ejc $E --runtime .gpu/libejc_runtime_capi.so --target cpu:amx \
        --threads "${2:-1,16}" --reps "${EJC_REPS:-10}" --markdown --json "$OUT/cpu_bench.json" 2>&1 | tee "$OUT/cpu_bench.log" || status=1
    exit $status
fi
if [ "${1:-}" = "--paged" ]; then
    [ -f .anchors/fa4/part-aa ] && cp .anchors/fa4/part-aa /tmp/
    ./.gpu/ejc-gpu info | tee "$OUT/info.txt"
    check_set paged || status=1
    check_set paged_mlir || status=1
    check_set ragged || status=1
    check_set ragged_mlir || status=1
    memcheck ragged "gpt_oss_bf16_d128_h16_n64_split@ptx:sm_90a/w1_s2" || status=1
    memcheck ragged "softcap_f16_d64_h16_n32@ptx:sm_80/w1_s3" || status=1
    memcheck paged "full_bf16_d128_h16_n64_split@ptx:sm_90a/w1_s2" || status=1
    memcheck paged "softcap_f16_d64_h16_n16@ptx:sm_80/w1_s3" || status=1
    racecheck paged "full_bf16_d128_h16_n64@ptx:sm_90a/w1_s2" || status=1
    # The tuner on the GPU: one decode batch tuned (both plans, every split count), then a
    # second process finds the choice in the persistent cache.
    tune_then_call paged_bench num_seqs=4,heads_q=32,heads_kv=8,head_dim=128,page_size=16,max_context=8192,min_context=8192 \
        || status=1
    exit $status
fi
# Ragged paged attention's classed plans under memcheck: `classed` and `classed_split` on sm_90a
# (the chunks on the warp-specialised TMA path), `classed_split` on sm_80, v3's `classed` on sm_80
# (each sample: `classify`, both classes, the split merge where there is one).
rpa_classed_memchecks() {
    local rc=0
    memcheck rpa "rpa_gpt_oss_bf16_d128_m16_n16_small@ptx:sm_90a/w1_s2 + rpa_gpt_oss_bf16_d128_m128_n64_large@ptx:sm_90a/w8_s2_wgmma_ws + " || rc=1
    memcheck rpa "rpa_gpt_oss_bf16_d128_m16_n16_small_split@ptx:sm_90a/w1_s2 + rpa_gpt_oss_bf16_d128_combine_small@ptx:sm_90a/w1_s2 + rpa_gpt_oss_bf16_d128_m128_n64_large@ptx:sm_90a/w8_s2_wgmma_ws + " || rc=1
    memcheck rpa "rpa_softcap_f16_d64_m16_n16_small_split@ptx:sm_80/w1_s2 + rpa_softcap_f16_d64_combine_small@ptx:sm_80/w1_s2 + rpa_softcap_f16_d64_m64_n32_large@ptx:sm_80/w4_s2 + " || rc=1
    memcheck rpa3 "rpa3_sliding_window_f16_d64_m16_n16_small@ptx:sm_80/w1_s2 + rpa3_sliding_window_f16_d64_m64_n32_large@ptx:sm_80/w4_s2 + " || rc=1
    return $rc
}

# The tuner on a serving step of the bench set (64 sequences of 2k keys in 16-token pages, one
# 512-token chunk), then its choice reused by a second process.
rpa_tune_serving_step() {
    tune_then_call rpa_bench \
        num_seqs=64,heads_q=32,heads_kv=8,head_dim=128,page_size=16,max_context=2048,min_context=2048,max_q_len=512,prefill_seqs=1
}

if [ "${1:-}" = "--bs" ]; then
    [ -f .anchors/fa4/part-aa ] && cp .anchors/fa4/part-aa /tmp/
    ./.gpu/ejc-gpu info | tee "$OUT/info.txt"
    check_set bs || status=1
    check_set bs16 || status=1
    check_set bs_mlir || status=1
    # (A label is "layout + attention"; the filters name the attention artifact.)
    memcheck bs "blocksparse_document_bf16_d128_m128_n64@ptx:sm_90a/w8_s2_wgmma_ws" || status=1
    memcheck bs16 "blocksparse_array_mask_f16_d64_m64_n64@ptx:sm_80/w4_s2" || status=1
    racecheck bs "blocksparse_strided_bf16_d128_m128_n64@ptx:sm_90a/w8_s2_wgmma_ws" || status=1
    tune_then_call bs batch=2,heads_q=8,heads_kv=2,seq_q=3000,seq_k=3000,head_dim=128 document || status=1
    # The backward: every artifact, a memcheck sample per arch (the dkdv filter names the plan's
    # label: layout, layout_t, preprocess, dkdv, dq), a racecheck of the warp-specialised path.
    check_set bsb || status=1
    check_set bsb16 || status=1
    check_set bsb_mlir || status=1
    memcheck bsb "blocksparse_bwd_document_bf16_d128_dkdv_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    memcheck bsb16 "blocksparse_bwd_array_mask_f16_d64_dkdv_m64_n64@ptx:sm_80/w4_s2" || status=1
    racecheck bsb "blocksparse_bwd_strided_bf16_d128_dq_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    exit $status
fi
if [ "${1:-}" = "--bs-variants" ]; then
    # The check sets of `EJC_BS_VARIANTS=... gpu_prepare.sh --bs` (some variants only): every artifact
    # against the reference; EJC_BS_SAMPLES="SET:FILTER ..." adds memcheck and racecheck samples.
    for set in bs bs16 bs_mlir bsb bsb16 bsb_mlir; do
        [ -d "/tmp/ejc-art/$set" ] && { check_set "$set" || status=1; }
    done
    for sample in ${EJC_BS_SAMPLES:-}; do
        memcheck "${sample%%:*}" "${sample#*:}" || status=1
        racecheck "${sample%%:*}" "${sample#*:}" || status=1
    done
    exit $status
fi
if [ "${1:-}" = "--bs-bench-check" ]; then
    # Call 1 of a bench-only pair (carry .gpu/ejc-gpu, .gpu/bs_bench.tar.xz, .anchors/fa4/part-aa): FA4's first
    # half to /tmp, and the bench set itself checked against the reference.
    [ -f .anchors/fa4/part-aa ] && cp .anchors/fa4/part-aa /tmp/
    check_set bs_bench || status=1
    exit $status
fi
if [ "${1:-}" = "--bs-bench" ]; then
    source .anchors/fa4/whl/install.sh || echo "fa4: not installed (its column stays empty)"
    timeout 560 python3 bench/blocksparse_gpu.py /tmp/ejc-art/bs_bench --flash /tmp/ejc-art/bs_dense \
        --json "$OUT/blocksparse.json" --reps "${EJC_BENCH_REPS:-20}" --rows "${EJC_BS_ROWS:-quick}" \
        2>&1 | tee "$OUT/blocksparse.txt" || status=1
    exit $status
fi
if [ "${1:-}" = "--bs-bench-bwd" ]; then
    # The backward's bench (carry what --bs-bench carries; at once after it, or after --bs-bench-check):
    # its set checked against the reference, then bench/blocksparse_gpu.py --backward.
    check_set bsb_bench || status=1
    source .anchors/fa4/whl/install.sh || echo "fa4: not installed (its column stays empty)"
    timeout 500 python3 bench/blocksparse_gpu.py /tmp/ejc-art/bsb_bench --backward \
        --json "$OUT/blocksparse_bwd.json" --reps "${EJC_BENCH_REPS:-20}" --rows "${EJC_BS_ROWS:-quick}" \
        2>&1 | tee "$OUT/blocksparse_bwd.txt" || status=1
    exit $status
fi
if [ "${1:-}" = "--rpa" ]; then
    # Ragged paged attention v2 and v3 (`gpu_prepare.sh --rpa`): every artifact checked (PTX on both
    # archs, MLIR's gpu form), memcheck samples of every role (v3's cache write included), the
    # tuner on a serving step, then the choice reused by a second process.
    [ -f .anchors/fa4/part-aa ] && cp .anchors/fa4/part-aa /tmp/
    ./.gpu/ejc-gpu info | tee "$OUT/info.txt"
    # EJC_RPA_FILTERS="TEXT ...": only the artifacts matching each TEXT (e.g. "_m16_ _m64_n16",
    # the tilings a schedule change added), one check pass per TEXT; MLIR's set then skipped.
    if [ -n "${EJC_RPA_FILTERS:-}" ]; then
        for f in $EJC_RPA_FILTERS; do
            EJC_FILTER=$f check_set rpa || status=1
            EJC_FILTER=$f check_set rpa3 || status=1
        done
    else
        check_set rpa || status=1
        check_set rpa_mlir || status=1
        check_set rpa3 || status=1
    fi
    # EJC_RPA_CHECKS_ONLY=1: the check sets alone (a second call for the rest of a split check).
    [ -n "${EJC_RPA_CHECKS_ONLY:-}" ] && exit $status
    # The classed_split plan (the decodes' key blocks split, merged per sequence): a sample on each
    # arch and of v3, under memcheck (labels `ejc-gpu check` runs: the check pairs every prefill
    # tiling with the first decode tiling).
    memcheck rpa "rpa_gpt_oss_bf16_d128_m16_n16_small_split@ptx:sm_90a/w1_s2 + rpa_gpt_oss_bf16_d128_combine_small@ptx:sm_90a/w1_s2 + rpa_gpt_oss_bf16_d128_m128_n64_large@ptx:sm_90a/w8_s2_wgmma_ws + " || status=1
    memcheck rpa "rpa_softcap_f16_d64_m16_n16_small_split@ptx:sm_80/w1_s2 + rpa_softcap_f16_d64_combine_small@ptx:sm_80/w1_s2 + rpa_softcap_f16_d64_m64_n32_large@ptx:sm_80/w4_s2 + " || status=1
    memcheck rpa3 "rpa3_sliding_window_bf16_d128_m16_n16_small_split@ptx:sm_90a/w1_s2 + rpa3_sliding_window_bf16_d128_combine_small@ptx:sm_90a/w1_s2 + rpa3_sliding_window_bf16_d128_m64_n32_large@ptx:sm_90a/w4_s2_wgmma + " || status=1
    # EJC_RPA_SPLIT_ONLY=1: those samples and the tuner alone (after a check pass filtered to them).
    if [ -n "${EJC_RPA_SPLIT_ONLY:-}" ]; then
        tune_then_call rpa_bench \
            num_seqs=32,heads_q=32,heads_kv=8,head_dim=128,page_size=64,max_context=4096,min_context=4096,max_q_len=1024,prefill_seqs=4 \
            || status=1
        exit $status
    fi
    check_set varlen_ws || status=1
    # The TMA path on cut key tiles (rows past a page's context zeroed by the consumers), one
    # and two consumer warpgroups, and flash's varlen on it.
    memcheck rpa "rpa_gpt_oss_bf16_d128_m64_n32@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    memcheck rpa "rpa_full_bf16_d128_m128_n64@ptx:sm_90a/w8_s2_wgmma_ws" || status=1
    memcheck rpa3 "rpa3_sliding_window_bf16_d64_m128_n32@ptx:sm_90a/w8_s2_wgmma_ws" || status=1
    memcheck varlen_ws "flash_varlen_causal_bf16_d128_m128_n128@ptx:sm_90a/w8_s2_wgmma_ws" || status=1
    racecheck rpa "rpa_full_bf16_d128_m128_n64@ptx:sm_90a/w8_s2_wgmma_ws" || status=1
    racecheck rpa "rpa_softcap_f16_d64_m64_n16@ptx:sm_90a/w4_s2_wgmma_ws" || status=1
    memcheck rpa "rpa_gpt_oss_bf16_d128_m16_n16@ptx:sm_90a/w1_s2" || status=1
    memcheck rpa "rpa_gpt_oss_bf16_d128_m64_n32@ptx:sm_90a/w4_s2_wgmma" || status=1
    memcheck rpa "rpa_gpt_oss_bf16_d128_m64_n64_split@ptx:sm_90a/w4_s2_wgmma" || status=1
    memcheck rpa "rpa_softcap_f16_d64_m64_n32_split@ptx:sm_80/w4_s2" || status=1
    memcheck rpa3 "rpa3_softcap_f16_d64_m64_n32@ptx:sm_90a/w4_s2_wgmma" || status=1
    racecheck rpa "rpa_full_bf16_d128_m64_n64@ptx:sm_90a/w4_s2_wgmma" || status=1
    rpa_tune_serving_step || status=1
    exit $status
fi
if [ "${1:-}" = "--rpa-samples" ]; then
    # After a --rpa check pass (EJC_RPA_CHECKS_ONLY=1) in an earlier call: memcheck on a sample
    # of every classed plan (classify, both classes, v3 on sm_80 too), then the tuner on a
    # serving step of the bench set and its choice reused by a second process (carry
    # .gpu/artifacts.tar.xz and .gpu/rpa_bench.tar.xz).
    rpa_classed_memchecks || status=1
    rpa_tune_serving_step || status=1
    exit $status
fi
if [ "${1:-}" = "--rpa-streams" ]; then
    # The plans whose decodes and prefill chunks run on two streams at once (`classed`,
    # `classed_split`: every artifact id with `_small`), checked on both archs for v2 and v3,
    # and memcheck on a sample of each plan; then --rpa-bench in a second call.
    [ -f .anchors/fa4/part-aa ] && cp .anchors/fa4/part-aa /tmp/
    ./.gpu/ejc-gpu info | tee "$OUT/info.txt"
    EJC_FILTER=_small check_set rpa || status=1
    EJC_FILTER=_small check_set rpa3 || status=1
    rpa_classed_memchecks || status=1
    exit $status
fi
if [ "${1:-}" = "--rpa-bench" ]; then
    source .anchors/fa4/whl/install.sh || echo "FA4 not installed: the bench runs without it"
    # EJC_BENCH_REPS=N: ejc's repetitions per candidate (default 50), to fit one call.
    timeout 500 python3 bench/paged_gpu.py /tmp/ejc-art/rpa_bench --rpa ${EJC_BENCH_REPS:+--reps "$EJC_BENCH_REPS"} \
        --json "$OUT/rpa.json" 2>&1 | tee "$OUT/rpa.log"
    exit "${PIPESTATUS[0]}"
fi
# NCCL and NVRTC for ejc-ring, from the machine's Python wheels or CUDA (cudarc looks for
# libnccl.so / libnvrtc.so; the wheels ship libnccl.so.2, libnvrtc.so.13).
ring_libs() {
    mkdir -p /tmp/ejc-libs
    local lib f
    for lib in nccl nvrtc; do
        f=$(python3 -c "
import glob, site, sys
dirs = site.getsitepackages() + [site.getusersitepackages()]
hits = [p for d in dirs for p in glob.glob(d + '/nvidia/**/lib$lib.so*', recursive=True)]
print(sorted(hits)[0] if hits else '')" 2>/dev/null)
        [ -n "$f" ] || f=$(ls /usr/local/cuda/lib64/lib$lib.so* 2>/dev/null | head -1)
        [ -n "$f" ] || { echo "no lib$lib on this machine"; return 1; }
        ln -sf "$f" /tmp/ejc-libs/lib$lib.so
        export LD_LIBRARY_PATH="/tmp/ejc-libs:$(dirname "$f")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "lib$lib: $f"
    done
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export EJC_KERNELS=/tmp/ejc-art/ring:/tmp/ejc-art/ring_bwd
}
if [ "${1:-}" = "--ring" ]; then
    ring_libs | tee "$OUT/ring_libs.txt" || exit 1
    ring_libs > /dev/null
    N=$(nvidia-smi -L | wc -l)
    if [ -z "${EJC_RING_SKIP_SETS:-}" ]; then
        check_set ring || status=1
        check_set ring_bwd || status=1
    fi
    # The banded blocks with negative sides (a band off the diagonal, as a ring's blocks have);
    # EJC_RING_SKIP_NEG=1 skips them (some minutes: every banded artifact, three bands).
    [ -n "${EJC_RING_SKIP_NEG:-}" ] || for w in "window_left=-40,window_right=150" "window_left=150,window_right=-40" "window_left=-200,window_right=260"; do
        for d in ring ring_bwd; do
            echo "== $d band $w" | tee -a "$OUT/ring_neg.log"
            timeout 200 ./.gpu/ejc-gpu check "/tmp/ejc-art/$d" --filter band_bf16 --shape 1,300,300,4,2,128 \
                --scalars "$w" 2>&1 | tail -4 | tee -a "$OUT/ring_neg.log" || status=1
        done
    done
    R=./.gpu/ejc-ring
    C="--cache-dir /tmp/ejc-cache"
    {
        # Small sequences: each check tunes its blocks (in every simulated rank) and runs the f64
        # reference of the whole sequence on the CPU, forward and backward.
        if [ "${EJC_RING_CHECKS:-}" = quick ]; then
            # One backward check with every rank busy on every step (after a change to the transfers).
            timeout 200 $R check --gpus "$N" --seq 1200 --heads 4:1 --dim 128 --causal --backward $C
            exit
        fi
        # (The zig-zag d64 check first: the slowest to tune, and the one a 600 s call most needs to reach.)
        timeout 240 $R check --gpus "$N" --seq 1600 --heads 4:2 --dim 64 --causal --window 500,0 --softcap 30 \
            --sinks 2 --backward $C || status=1
        timeout 200 $R check --gpus 2 --seq 1024 --heads 8:2 --dim 128 --causal --sinks 2 --backward $C || status=1
        timeout 120 $R check --gpus "$N" --seq 4096 --heads 16:4 --dim 128 --causal $C || status=1
        timeout 200 $R check --gpus "$N" --seq 1200 --heads 4:1 --dim 128 --layout contiguous --causal --backward $C \
            || status=1
        timeout 200 $R check --gpus 3 --seq 1200 --heads 4:1 --dim 128 --layout contiguous --window 300,200 \
            --segments --backward $C || status=1
        exit $status
    } 2>&1 | tee "$OUT/ring_check.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    exit $status
fi
if [ "${1:-}" = "--ring-debug" ]; then
    # The backward's windowed GPU failures, bisected: the exact block alone, a ring of one, of two.
    ring_libs > /dev/null || exit 1
    R=./.gpu/ejc-ring
    {
        [ -n "${EJC_RING_BISECT:-}" ] || timeout 100 ./.gpu/ejc-gpu check /tmp/ejc-art/ring_bwd --filter band_bf16_d128 \
            --shape 1,750,750,4,1,128 --scalars window_left=-450,window_right=1500 2>&1 | tail -3
        if [ -n "${EJC_RING_BISECT:-}" ]; then
            # Four ranks, every block unmasked; causal (ranks with idle steps); three ranks with the window.
            timeout 60 $R check --gpus 4 --seq 1200 --heads 4:1 --dim 128 --layout contiguous --backward 2>&1 | grep -v "^ejc: warning"
            timeout 60 $R check --gpus 4 --seq 1200 --heads 4:1 --dim 128 --layout contiguous --causal --backward 2>&1 | grep -v "^ejc: warning"
            timeout 60 $R check --gpus 3 --seq 1200 --heads 4:1 --dim 128 --layout contiguous --window 300,200 --backward 2>&1 | grep -v "^ejc: warning"
        else
            for g in 1 2; do
                timeout 100 $R check --gpus $g --seq 1500 --heads 4:1 --dim 128 --layout contiguous --window 300,200 \
                    --backward 2>&1 | grep -v "^ejc: warning"
            done
        fi
    } 2>&1 | tee "$OUT/ring_debug.log"
    exit 0
fi
if [ "${1:-}" = "--ring-bench" ]; then
    ring_libs > /dev/null || exit 1
    N=$(nvidia-smi -L | wc -l)
    R=./.gpu/ejc-ring
    J="$OUT/ring.json"
    H="--heads 16:4 --dim 128"
    row() {  # GPUS SEQ [flags]: ejc, then the torch anchor, same problem
        local g=$1 s=$2; shift 2
        timeout 280 $R bench --gpus "$g" --seq "$s" $H "$@" --json "$J" --cache-dir /tmp/ejc-cache 2>&1 | tail -1 \
            | cut -c1-600 || status=1
        [ -n "${EJC_RING_NO_ANCHOR:-}" ] && return
        local a=(); for f in "$@"; do case $f in --causal|--backward) a+=("$f");; esac; done
        timeout 200 python3 bench/ring_gpu.py --gpus "$g" --seq "$s" --heads 16:4 "${a[@]}" --json "$J" 2>&1 | tail -1 \
            || status=1
    }
    # EJC_RING_ROWS=fwd: the forward rows alone; =bwd: the 128k backward rows; =pool: the memory pool's A/B at 32k a rank; EJC_RING_NO_ANCHOR=1: without torch's runs.
    {
        if [ "${EJC_RING_ROWS:-}" = bwd ]; then
            row "$N" 131072 --causal --backward
            row "$N" 131072 --backward
        elif [ "${EJC_RING_ROWS:-}" = pool ]; then
            # The forward at 32k tokens a rank, A/B in one run: the driver's default memory pool
            # (trimmed at every sync) against ejc's (kept), then NCCL held to 4 channels.
            for pool in trim keep; do
                echo "== EJC_CUDA_POOL=$pool"
                EJC_CUDA_POOL=$pool row "$N" 131072 --causal
                EJC_CUDA_POOL=$pool row "$N" 131072
            done
            echo "== NCCL_MAX_NCHANNELS=4"
            NCCL_MAX_NCHANNELS=4 row "$N" 131072 --causal
            NCCL_MAX_NCHANNELS=4 row "$N" 131072
            echo "== 2 GPUs"
            row 2 131072 --causal
        elif [ "${EJC_RING_ROWS:-}" = fwd ]; then
            row "$N" 131072 --causal
            row "$N" 131072 --causal --layout contiguous
            row 2 131072 --causal
            row "$N" 524288 --causal --reps 2
        else
            row "$N" 131072 --causal --backward
            row "$N" 131072 --causal --backward --layout contiguous
            row 2 131072 --causal --backward
            row "$N" 131072 --backward
            row "$N" 524288 --causal --backward --reps 2
            row "$N" 1048576 --causal --reps 1
        fi
        exit $status
    } 2>&1 | tee "$OUT/ring_bench.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    exit $status
fi
if [ "${1:-}" = "--paged-bench" ]; then
    source .anchors/fa4/whl/install.sh || echo "FA4 not installed: the bench runs without it"
    timeout 330 python3 bench/paged_gpu.py /tmp/ejc-art/paged_bench --json "$OUT/paged.json" 2>&1 | tee "$OUT/paged.log"
    status=${PIPESTATUS[0]}
    timeout 230 python3 bench/paged_gpu.py /tmp/ejc-art/ragged_bench --ragged --json "$OUT/ragged.json" 2>&1 \
        | tee "$OUT/ragged.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    exit $status
fi
if [ "${1:-}" = "--ops-cli" ]; then
    mkdir -p /tmp/ejc-bin && xz -dc .gpu/ejc.xz > /tmp/ejc-bin/ejc && chmod +x /tmp/ejc-bin/ejc
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$PWD/.gpu"  # libffi, if the machine lacks it
    E=/tmp/ejc-bin/ejc
    shape=1,1,32768,32,8,128
    {
        echo "== ejc tune --backend cuda (compiles the candidates for this GPU, autotunes, stores the winner)"
        timeout 240 $E tune specs/flash_decode.yaml --backend cuda --variant gpt_oss --dtype bf16 --shape $shape \
            --cache-dir /tmp/ejc-cache 2>&1 | tail -12 || status=1
        echo "== ejc-gpu call (another process, the runtime on a build of the same spec): from the persistent cache"
        timeout 120 ./.gpu/ejc-gpu call /tmp/ejc-art/ops_decode --variant gpt_oss --dtype bf16 --shape $shape \
            --cache-dir /tmp/ejc-cache 2>&1 | tail -6 || status=1
        echo "== ejc tune, the full variant (every key visible: split-KV should win at batch 1)"
        timeout 240 $E tune specs/flash_decode.yaml --backend cuda --variant full --dtype bf16 --shape $shape \
            --cache-dir /tmp/ejc-cache 2>&1 | tail -45 || status=1
        echo "== ejc tune again (gpt_oss): found, not re-tuned"
        timeout 120 $E tune specs/flash_decode.yaml --backend cuda --variant gpt_oss --dtype bf16 --shape $shape \
            --cache-dir /tmp/ejc-cache 2>&1 | tail -6 || status=1
        echo "== ejc run --backend cuda: split-KV by hand, every variant, against the reference"
        timeout 200 $E run specs/flash_decode.yaml --backend cuda --dtype bf16 --plan split_kv \
            --config num_splits=8 --shape 2,3,3000,16,4,128 2>&1 | tail -8 || status=1
    } > "$OUT/cli.log" 2>&1
    cat "$OUT/cli.log"
    exit $status
fi
if [ "${1:-}" = "--ops-bench" ]; then
    timeout 280 python3 bench/decode_gpu.py /tmp/ejc-art/ops_decode --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log"
    timeout 120 python3 bench/pool_gpu.py /tmp/ejc-art/ops_pool --json "$OUT/pool.json" 2>&1 | tee "$OUT/pool.log"
    timeout 150 python3 bench/compare_gpu.py /tmp/ejc-art/bench --quick --only _wgmma --json "$OUT/bench.json" \
        > "$OUT/bench.log" 2>&1
    grep '^d=' "$OUT/bench.log"
    exit $status
fi
if [ "${1:-}" = "--hopper" ]; then
    echo "== wgmma layouts (scripts/probe_wgmma.py --swizzle)"
    python3 scripts/probe_wgmma.py --swizzle 2>&1 | tee "$OUT/probe.log"
    echo "== sm_90a: ejc-gpu check"
    check_set check_sm90a || status=1
    memcheck check_sm90a causal_bf16_d128_m128_n64@ptx:sm_90a/w4_s2_wgmma || status=1
    python3 bench/compare_gpu.py /tmp/ejc-art/bench --quick --verbose --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    exit $status
fi
if [ "${1:-}" = "--ws" ]; then
    # Warp-specialised candidates (`_ws`): their checks (both entries), memcheck on one,
    # the CuPy example on one (tensor maps from Python), then the bench (ROWS, or the
    # whole grid) over every candidate of the bench set.
    EJC_FILTER=_ws check_set check_sm90a || status=1
    memcheck check_sm90a causal_bf16_d128_m128_n128@ptx:sm_90a/w8_s2_wgmma_ws || status=1
    timeout 120 python3 examples/cupy_launch.py /tmp/ejc-art/check_sm90a _ws 2>&1 | tee "$OUT/cupy.log" || status=1
    rows=()
    [ -n "${2:-}" ] && rows=(--rows "$2")
    # Hopper's paths only (`_wgmma`: wgmma, and wgmma with warp specialisation): the
    # mma.sync candidates never win on sm_90a and would not fit the call's 10 minutes.
    timeout "${EJC_BENCH_TIMEOUT:-420}" python3 bench/compare_gpu.py /tmp/ejc-art/bench "${rows[@]}" --verbose \
        --only "${EJC_ONLY:-_wgmma}" --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    grep '^d=' "$OUT/bench.log"
    exit $status
fi
if [ "${1:-}" = "--verify" ]; then
    for set in check_sm90a check check2; do check_set $set || status=1; done
    memcheck check_sm90a causal_bf16_d128_m128_n64@ptx:sm_90a/w4_s2_wgmma || status=1
    memcheck check_sm90a varlen_causal_f16_d64_m128_n128@ptx:sm_90a/w8_s2_wgmma || status=1
    python3 bench/compare_gpu.py /tmp/ejc-art/bench --verbose --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    grep '^d=' "$OUT/bench.log"
    rm -f "$OUT/device.txt"
    exit $status
fi
if [ "${1:-}" = "--bench-only" ]; then
    rows=()
    [ -n "${2:-}" ] && rows=(--rows "$2")
    only=()
    [ -n "${EJC_ONLY:-}" ] && only=(--only "$EJC_ONLY")
    timeout "${EJC_BENCH_TIMEOUT:-560}" python3 bench/compare_gpu.py /tmp/ejc-art/bench "${rows[@]}" "${only[@]}" \
        --verbose --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    grep '^d=' "$OUT/bench.log"
    exit $status
fi
if [ "${1:-}" != "--checks" ] && [ -d /tmp/ejc-art/mlir ]; then
    echo "== MLIR gpu form: ejc-gpu check (every artifact x 5 awkward shapes vs the reference)"
    check_set mlir || status=1
    memcheck mlir causal_bf16_d64 || status=1
fi
if [ "${1:-}" = "--mlir-only" ]; then
    [ -d /tmp/ejc-art/mlir ] || echo "no MLIR pack: run scripts/gpu_prepare.sh --mlir first"
    exit $status
fi
echo "== ejc-gpu check (every artifact x 5 awkward shapes vs the reference, both entries)"
check_set check_sm90a || status=1
check_set check || status=1
check_set check2 || status=1
echo "== compute-sanitizer memcheck on a sample (both entries)"
memcheck check2 bf16_d64_m64_n32 || status=1
memcheck check_sm90a causal_bf16_d128_m128_n64@ptx:sm_90a/w4_s2_wgmma || status=1
memcheck check_sm90a varlen_causal_f16_d64_m128_n128@ptx:sm_90a/w8_s2_wgmma || status=1
memcheck check_sm90a causal_bf16_d128_m128_n128@ptx:sm_90a/w8_s2_wgmma_ws || status=1
echo "== examples/cupy_launch.py"
python3 examples/cupy_launch.py /tmp/ejc-art/check 2>&1 | tee "$OUT/cupy.log" || status=1
if [ -d /tmp/ejc-art/check_sm90a ]; then  # a warp-specialised kernel: tensor maps from Python
    python3 examples/cupy_launch.py /tmp/ejc-art/check_sm90a _ws 2>&1 | tee -a "$OUT/cupy.log" || status=1
fi
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
