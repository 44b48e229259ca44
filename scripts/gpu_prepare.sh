#!/usr/bin/env bash
# Build what a GPU run needs, here (no GPU needed): the LLVM-free runner `ejc-gpu` and
# PTX artifacts, packed into .gpu/ (git-ignored) so that the device tool can carry them.
#
#   bash scripts/gpu_prepare.sh            # warp-specialised sm_90a checks + benchmark set (gpu_run.sh --ws, --bench-only)
#   bash scripts/gpu_prepare.sh --checks   # the whole PTX correctness matrix, every code path (gpu_run.sh --checks)
#   bash scripts/gpu_prepare.sh --mlir     # MLIR's gpu form only (for gpu_run.sh --mlir-only)
#   bash scripts/gpu_prepare.sh --ops      # every operation and plan through the generic runtime: flash_decode
#                                          # (both plans), mean pooling, a flash slice of every code path, and
#                                          # the benchmark sets (gpu_run.sh --ops, then gpu_run.sh --ops-bench)
#   bash scripts/gpu_prepare.sh --cpu      # the GPU host's CPU (an AMX Xeon): the compiler and the C runtime, for
#                                          # gpu_run.sh --cpu (AMX checks, the table against torch, thread scaling)
#   bash scripts/gpu_prepare.sh --dsl      # examples/dsl-demo's #[ej_kernel] kernels on the GPU (gpu_run.sh --dsl)
#   bash scripts/gpu_prepare.sh --kernels  # the back ends' generality cases (ejc-codegen/tests/kernels/*.tir: transposed
#                                          # products, loops of 3 and 4 products) on every PTX path, for
#                                          # gpu_run.sh --kernels (checked against the interpreter)
#   bash scripts/gpu_prepare.sh --anchors  # the side-by-side against FlashAttention-4 (with ../shared/bench/fa4_kit.sh's
#                                          # halves): the bench set (full, causal, gemma2; bf16; sm_90a), the soft-cap
#                                          # variants on every path, and the generality cases, for gpu_run.sh
#                                          # --anchors-check (call 1) and --anchors-bench (call 2)
#   bash scripts/gpu_prepare.sh --headdims # head dims 96/192/256 and 192 with v 128: checks on every path and the bench
#                                          # set (gpu_run.sh --headdims, then --anchors-bench with
#                                          # EJC_DIMS=96,192,256,192v128); EJC_KEYS="--key head_dim_v=128": 192/128 alone
#   bash scripts/gpu_prepare.sh --bwd      # the flash backward (specs/flash_bwd.yaml) on every PTX path (gpu_run.sh --bwd)
#   bash scripts/gpu_prepare.sh --bwd-tiles # a tile sweep of the flash backward's deterministic plan (gpu_run.sh --bwd-tiles;
#                                          # EJC_OLD=PATH adds the spec's schedule built by another ejc, timed beside it)
#   bash scripts/gpu_prepare.sh --train    # examples/train_gpu.py's kernels: forward and backward (gpu_run.sh --train)
#   bash scripts/gpu_prepare.sh --paged    # page_attention, ragged_decode_attention: every variant x bf16/f16 x d64/d128,
#                                          # both plans, sm_80 and sm_90a, MLIR's gpu form, and the bench sets
#                                          # (gpu_run.sh --paged; FA4's halves as for --anchors)
#   bash scripts/gpu_prepare.sh --rpa      # ragged_page_attention v2 and v3: their check sets (PTX, MLIR) and the bench set
#                                          # (gpu_run.sh --rpa, then --rpa-bench; FA4's halves as for --paged)
#   EJC_BS_VARIANTS="bias bias_grad" bash scripts/gpu_prepare.sh --bs  # those variants' check sets alone
#                                          # (gpu_run.sh --bs-variants)
#   bash scripts/gpu_prepare.sh --bs       # blocksparse_attention and its backward: the check sets (every variant; bf16 d128 on sm_90a and
#                                          # sm_80, f16 d64 on both; MLIR's gpu form) and the bench set (bf16, d64/d128,
#                                          # sm_90a, the Hopper paths) with flash's dense `full` beside it
#                                          # (gpu_run.sh --bs, then --bs-bench; FA4's halves as for --paged)
#   bash scripts/gpu_prepare.sh --bs-bench # the bench set alone (gpu_run.sh --bs-bench-check, then --bs-bench, --bs-bench-bwd)
#   bash scripts/gpu_prepare.sh --ring     # ring attention (issue 23): `ejc-ring` and the ring specs' blocks (bf16,
#                                          # d64/d128, sm_90a), for gpu_run.sh --ring and --ring-bench on a kind
#                                          # with several GPUs (nvidia-h100-x4: 2 and 4 ranks)
#   bash scripts/gpu_prepare.sh --hostile  # samples of every operation for gpu_run.sh --hostile (memcheck,
#                                          # racecheck, zero-sized axes, tensors past 2^31 elements)
# (seven packs: together they would pass the device tool's 64 MiB.)
set -euo pipefail
cd "$(dirname "$0")/.."
source .tools/env.sh 2>/dev/null || bash scripts/setup.sh
source .tools/env.sh
if [ "${1:-}" = "--cpu" ]; then
    # No artifacts: the compiler (LLVM linked in, stripped, xz ~33 MB) builds `cpu:amx` there.
    cargo build --release -q -p ejc -p ejc-runtime-capi
    rm -rf .gpu && mkdir -p .gpu
    strip -o .gpu/ejc target/release/ejc && xz -T0 -6 .gpu/ejc
    cp target/release/libejc_runtime_capi.so .gpu/
    cp "$(ldconfig -p | awk '/libffi.so.8 /{print $NF; exit}')" .gpu/ 2>/dev/null || true
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--dsl" ]; then
    # examples/dsl-demo's #[ej_kernel] kernels on the GPU (gpu_run.sh --dsl): its GPU test
    # binary (feature `cuda`; no LLVM linked in) and the build's kernels (PTX for sm_80 and
    # sm_90a, found through EJC_DEMO_DIR there).
    bin=$(cargo test -q -p ejc-dsl-demo --features cuda --test gpu --no-run --message-format=json \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu": print(m["executable"])' | tail -1)
    [ -n "$bin" ] || { echo "no GPU test binary of examples/dsl-demo was built" >&2; exit 1; }
    # Beside whatever .gpu holds (another pack may travel in the same call).
    mkdir -p .gpu && rm -rf .gpu/dsl_gpu_test .gpu/ejc-demo
    strip -o .gpu/dsl_gpu_test "$bin"
    out=$(ls -td target/debug/build/ejc-dsl-demo-*/out/ejc-demo | head -1)
    cp -r "$out" .gpu/ejc-demo
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--kernels" ]; then
    # The runner alone (no LLVM), and the PTX from the test that compiles the cases
    # (passing ptxas on them), which writes the pack.
    cargo build --release -q -p ejc-runtime --features cuda --bin ejc-gpu
    rm -rf .gpu && mkdir -p .gpu
    cp target/release/ejc-gpu .gpu/
    EJC_KERNEL_PACK="$PWD/.gpu/kernels" cargo test -q -p ejc-codegen --test ptx -- the_kernel_suite 2>&1 | tail -3
    tar -C .gpu -czf .gpu/artifacts.tgz kernels
    rm -rf .gpu/kernels
    du -sh .gpu/*
    exit 0
fi
cargo build --release -q -p ejc -p ejc-runtime --features ejc-runtime/cuda --bin ejc --bin ejc-gpu
rm -rf .gpu && mkdir -p .gpu
cp target/release/ejc-gpu .gpu/
EJC=target/release/ejc
if [ "${1:-}" = "--anchors" ]; then
    [ -f .anchors/fa4/part-aa ] || { echo "run ../shared/bench/fa4_kit.sh first (FlashAttention-4's halves)" >&2; exit 1; }
    # The benchmark set with the Gemma-2 rows' variant (the Hopper paths: what the bench times); the spec's
    # sm_90a schedule has Hopper's three-warpgroup tile at d = 64 (block_m 192, 12 warps).
    $EJC build specs/flash.yaml -q --target ptx:sm_90a --variant full --variant causal --variant gemma2 \
        --dtype bf16 --head-dim 64 --head-dim 128 --path wgmma --path ws -o .gpu/bench --report --drop-spilling \
        > .gpu/bench_ptxas.txt
    # The soft cap's tanh (tanh.approx in 16-bit kernels) on every path and both archs.
    $EJC build specs/flash.yaml -q --head-dim 64 --head-dim 128 --target ptx:sm_90a --target ptx:sm_80 --variant softcap --variant gemma2 \
        --dtype bf16 --dtype f16 --block-m 128 --block-n 64 --block-n 128 --num-stages 2 -o .gpu/softcap
    # The generality cases (the f32 soft cap: the precise tanh).
    EJC_KERNEL_PACK="$PWD/.gpu/kernels" cargo test -q -p ejc-codegen --test ptx -- the_kernel_suite 2>&1 | tail -3
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz bench softcap kernels
    rm -rf .gpu/bench .gpu/softcap .gpu/kernels
    du -sh .gpu/* .anchors/fa4/*
    exit 0
fi
if [ "${1:-}" = "--headdims" ]; then
    # Head dims 96, 192 (v 192 and v 128), 256: the check set (every variant x bf16/f16, 128 x 64 tiles,
    # every path of sm_90a and sm_80) and the bench set (full, causal; bf16; sm_90a; the spec's search
    # space for them). EJC_KEYS narrows both (e.g. EJC_KEYS="--key head_dim_v=128": the 192/128 kernels).
    read -r -a keys <<< "${EJC_KEYS:---head-dim 96 --head-dim 192 --head-dim 256}"
    $EJC build specs/flash.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 --dtype f16 \
        "${keys[@]}" --block-m 128 --block-n 64 --num-warps 8 --num-stages 2 -o .gpu/hd
    # sm_80 at d = 256: two stages of 128 x 64 tiles pass its shared memory; one stage.
    if [ -z "${EJC_KEYS:-}" ]; then
        $EJC build specs/flash.yaml -q --target ptx:sm_80 --dtype bf16 --dtype f16 --head-dim 256 --block-m 128 \
            --block-n 64 --num-warps 8 --num-stages 1 -o .gpu/hd2
    fi
    $EJC build specs/flash.yaml -q --target ptx:sm_90a --variant full --variant causal --dtype bf16 \
        "${keys[@]}" -o .gpu/bench --report --drop-spilling > .gpu/bench_ptxas.txt
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz hd $([ -d .gpu/hd2 ] && echo hd2) bench
    rm -rf .gpu/hd .gpu/hd2 .gpu/bench
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--bwd" ]; then
    # The flash backward (specs/flash_bwd.yaml): every variant x bf16/f16 at d 64 and bf16 at d 128,
    # every PTX path of sm_90a and sm_80 (gpu_run.sh --bwd).
    $EJC build specs/flash_bwd.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 --dtype f16 \
        --head-dim 64 -o .gpu/bwd
    $EJC build specs/flash_bwd.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 \
        --head-dim 128 -o .gpu/bwd128 --report > .gpu/bwd_ptxas.txt
    # The forward's bias variants (their bias tiles load through the same register path as the
    # backward's): every path of both archs, 128 x 64 tiles.
    $EJC build specs/flash.yaml -q --target ptx:sm_90a --target ptx:sm_80 --variant bias --variant bias_dropout \
        --dtype bf16 --dtype f16 --head-dim 64 --head-dim 128 --block-m 128 --block-n 64 --num-stages 2 -o .gpu/fwdbias
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz bwd bwd128 fwdbias
    rm -rf .gpu/bwd .gpu/bwd128 .gpu/fwdbias
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--bwd-tiles" ]; then
    # A tile sweep of the flash backward (gpu_run.sh --bwd-tiles): bf16, full and causal, d 64 and 128,
    # the deterministic plan on sm_90a, block_m {32, 64} x block_n {64, 128} x {4, 8} warps, every
    # candidate that does not spill (bwdnew); with EJC_OLD=PATH (an older ejc binary) also the spec's
    # own schedule built by it (bwdold), timed beside the sweep in the same call.
    sweep=$(mktemp -d)
    sed -e '/^schedule:/,/^$/{s/block_m: \[.*\]/block_m: [32, 64]/;s/block_n: \[.*\]/block_n: [64, 128]/;s/num_warps: \[.*\]/num_warps: [4, 8]/}' \
        specs/flash_bwd.yaml > "$sweep/flash_bwd.yaml"
    $EJC build "$sweep/flash_bwd.yaml" -q --target ptx:sm_90a --variant full --variant causal --dtype bf16 \
        --head-dim 64 --head-dim 128 --plan two_pass --report --drop-spilling -o .gpu/bwdnew > .gpu/bwdnew_ptxas.txt
    sets=(bwdnew)
    if [ -n "${EJC_OLD:-}" ]; then
        "$EJC_OLD" build specs/flash_bwd.yaml -q --target ptx:sm_90a --variant full --variant causal --dtype bf16 \
            --head-dim 64 --head-dim 128 --plan two_pass -o .gpu/bwdold
        sets+=(bwdold)
    fi
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz "${sets[@]}"
    rm -rf "$sweep" .gpu/bwdnew .gpu/bwdold
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--train" ]; then
    # examples/train_gpu.py (gpu_run.sh --train): the forward and the backward, bf16, d 64, full and causal,
    # and with a learned bias (the forward's `bias`, the backward's `bias_grad`).
    $EJC build specs/flash.yaml -q --target ptx:sm_90a --target ptx:sm_80 --variant full --variant causal --variant bias \
        --dtype bf16 --head-dim 64 --block-m 128 --block-n 64 --num-warps 8 --num-stages 2 -o .gpu/trainfwd
    $EJC build specs/flash_bwd.yaml -q --target ptx:sm_90a --target ptx:sm_80 --variant full --variant causal \
        --variant bias_grad --dtype bf16 --head-dim 64 -o .gpu/trainbwd
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz trainfwd trainbwd
    rm -rf .gpu/trainfwd .gpu/trainbwd
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--paged" ]; then
    # Paged decode attention: the check set (every variant x bf16/f16 x d64/d128 x both plans, every
    # tiling and launch configuration, sm_90a and sm_80), MLIR's gpu form (bf16, d128), and the bench set
    # (full, bf16, d128, sm_90a, every candidate: the tuner's space).
    $EJC build specs/page_attention.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 --dtype f16 \
        -o .gpu/paged --report > .gpu/paged_ptxas.txt
    $EJC build specs/page_attention.yaml -q --target mlir:gpu --dtype bf16 --head-dim 128 -o .gpu/paged_mlir
    $EJC build specs/page_attention.yaml -q --target ptx:sm_90a --variant full --dtype bf16 --head-dim 128 \
        -o .gpu/paged_bench
    # Ragged decode attention (the same kernels over contiguous ranges): the same three sets.
    $EJC build specs/ragged_decode.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 --dtype f16 \
        -o .gpu/ragged --report > .gpu/ragged_ptxas.txt
    $EJC build specs/ragged_decode.yaml -q --target mlir:gpu --dtype bf16 --head-dim 128 -o .gpu/ragged_mlir
    $EJC build specs/ragged_decode.yaml -q --target ptx:sm_90a --variant full --dtype bf16 --head-dim 128 \
        -o .gpu/ragged_bench
    # (Ragged paged attention has its own pack, --rpa: with its GPU tilings it is 15 MB, and this pack
    # travels with FA4's first half.)
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz paged paged_mlir paged_bench ragged ragged_mlir ragged_bench
    rm -rf .gpu/paged .gpu/paged_mlir .gpu/paged_bench .gpu/ragged .gpu/ragged_mlir .gpu/ragged_bench
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--bs" ] && [ -n "${EJC_BS_VARIANTS:-}" ]; then
    # The check sets of --bs for some variants only (EJC_BS_VARIANTS="bias bias_grad": each spec
    # builds those it has), no bench set: gpu_run.sh --bs-variants checks them.
    vargs() { for v in $EJC_BS_VARIANTS; do if grep -q "^  $v:" "$1"; then echo "--variant $v"; fi; done; }
    fw=$(vargs specs/blocksparse.yaml); bw=$(vargs specs/blocksparse_bwd.yaml); sets=()
    if [ -n "$fw" ]; then
        $EJC build specs/blocksparse.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 --head-dim 128 \
            $fw -o .gpu/bs --report --drop-spilling > .gpu/bs_ptxas.txt
        $EJC build specs/blocksparse.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype f16 --head-dim 64 \
            $fw -o .gpu/bs16 --report --drop-spilling > .gpu/bs16_ptxas.txt
        $EJC build specs/blocksparse.yaml -q --target mlir:gpu --dtype bf16 --head-dim 64 $fw -o .gpu/bs_mlir
        sets+=(bs bs16 bs_mlir)
    fi
    if [ -n "$bw" ]; then
        $EJC build specs/blocksparse_bwd.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 --head-dim 128 \
            $bw -o .gpu/bsb --report > .gpu/bsb_ptxas.txt
        $EJC build specs/blocksparse_bwd.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype f16 --head-dim 64 \
            $bw -o .gpu/bsb16 --report --drop-spilling > .gpu/bsb16_ptxas.txt
        $EJC build specs/blocksparse_bwd.yaml -q --target mlir:gpu --dtype bf16 --head-dim 64 $bw -o .gpu/bsb_mlir
        sets+=(bsb bsb16 bsb_mlir)
    fi
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz "${sets[@]}"
    (cd .gpu && rm -rf "${sets[@]}")
    du -sh .gpu/*
    exit 0
fi
# The block-sparse bench set (bench/blocksparse_gpu.py's patterns, and the run-time window and chunk
# variants beside the compiled ones) on the Hopper paths, flash's dense forward at the same sizes,
# and the backward's set; packed into .gpu/bs_bench.tar.xz by the callers.
bs_bench_set() {
    local variants=(--variant causal --variant sliding_window --variant chunked --variant document --variant strided
                    --variant runtime_window --variant runtime_chunked)
    $EJC build specs/blocksparse.yaml -q --target ptx:sm_90a --dtype bf16 --head-dim 64 --head-dim 128 \
        "${variants[@]}" --path wgmma --path ws -o .gpu/bs_bench --report --drop-spilling > .gpu/bs_bench_ptxas.txt
    $EJC build specs/flash.yaml -q --target ptx:sm_90a --variant full --dtype bf16 --head-dim 64 --head-dim 128 \
        --path wgmma --path ws -o .gpu/bs_dense --report --drop-spilling > .gpu/bs_dense_ptxas.txt
    $EJC build specs/blocksparse_bwd.yaml -q --target ptx:sm_90a --dtype bf16 --head-dim 64 --head-dim 128 \
        "${variants[@]}" --path wgmma --path ws -o .gpu/bsb_bench --report > .gpu/bsb_bench_ptxas.txt
}
if [ "${1:-}" = "--bs-bench" ]; then
    # The bench pack alone (gpu_run.sh --bs-bench-check, then --bs-bench and --bs-bench-bwd).
    bs_bench_set
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/bs_bench.tar.xz bs_bench bs_dense bsb_bench
    rm -rf .gpu/bs_bench .gpu/bs_dense .gpu/bsb_bench
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--bs" ]; then
    # Block-sparse attention: every variant against the reference on both archs (bf16 at d 128,
    # f16 at d 64), the gpu form of MLIR, and the bench set. --drop-spilling: a tuned
    # configuration must not spill.
    $EJC build specs/blocksparse.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 --head-dim 128 \
        -o .gpu/bs --report --drop-spilling > .gpu/bs_ptxas.txt
    $EJC build specs/blocksparse.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype f16 --head-dim 64 \
        -o .gpu/bs16 --report --drop-spilling > .gpu/bs16_ptxas.txt
    $EJC build specs/blocksparse.yaml -q --target mlir:gpu --dtype bf16 --head-dim 64 -o .gpu/bs_mlir
    # The backward (specs/blocksparse_bwd.yaml), the same sets. Its one tiling's dK/dV kernel
    # spills at d = 128 on every path, so these keep spilling entries (checked, not tuned).
    $EJC build specs/blocksparse_bwd.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 --head-dim 128 \
        -o .gpu/bsb --report > .gpu/bsb_ptxas.txt
    $EJC build specs/blocksparse_bwd.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype f16 --head-dim 64 \
        -o .gpu/bsb16 --report --drop-spilling > .gpu/bsb16_ptxas.txt
    $EJC build specs/blocksparse_bwd.yaml -q --target mlir:gpu --dtype bf16 --head-dim 64 -o .gpu/bsb_mlir
    bs_bench_set
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz bs bs16 bs_mlir bsb bsb16 bsb_mlir
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/bs_bench.tar.xz bs_bench bs_dense bsb_bench
    rm -rf .gpu/bs .gpu/bs16 .gpu/bs_mlir .gpu/bs_bench .gpu/bs_dense .gpu/bsb .gpu/bsb16 .gpu/bsb_mlir .gpu/bsb_bench
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--rpa" ]; then
    # Ragged paged attention alone (v2 and v3): the check sets of --paged's last three, and the
    # bench set (v2's full variant, bf16, d128, sm_90a, both plans, every tiling: the tuner's space)
    # for gpu_run.sh --rpa (checks, memcheck, tune/call) and --rpa-bench (bench/paged_gpu.py --rpa).
    # (--drop-spilling: at d = 64, 64 rows on one warp, and at d = 128, 128 rows on four, spill
    # although their accumulators fit the back end's rule; a tuned configuration must not spill.)
    $EJC build specs/ragged_paged.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 --dtype f16 \
        -o .gpu/rpa --report --drop-spilling > .gpu/rpa_ptxas.txt
    $EJC build specs/ragged_paged.yaml -q --target mlir:gpu --dtype bf16 --head-dim 128 -o .gpu/rpa_mlir
    $EJC build specs/ragged_paged_v3.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 --dtype f16 \
        -o .gpu/rpa3 --report --drop-spilling > .gpu/rpa3_ptxas.txt
    $EJC build specs/ragged_paged.yaml -q --target ptx:sm_90a --variant full --dtype bf16 --head-dim 128 \
        -o .gpu/rpa_bench --report --drop-spilling > .gpu/rpa_bench_ptxas.txt
    # Flash's varlen variants on the warp-specialised path: their key tiles end at their
    # sequence's last key (a row limit), which the TMA path takes since paged attention needed it.
    $EJC build specs/flash.yaml -q --target ptx:sm_90a --variant varlen --variant varlen_causal --dtype bf16 \
        --dtype f16 --head-dim 64 --head-dim 128 --path ws -o .gpu/varlen_ws --report --drop-spilling > .gpu/varlen_ws_ptxas.txt
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz rpa rpa_mlir rpa3 rpa_bench varlen_ws
    # The bench set alone as well: call 2 carries it with FA4's second half and wheels (~41 MB).
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/rpa_bench.tar.xz rpa_bench
    rm -rf .gpu/rpa .gpu/rpa_mlir .gpu/rpa3 .gpu/rpa_bench .gpu/varlen_ws
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--ring" ]; then
    # The runner of the ring (one process per GPU, NCCL), the block kernels of both passes.
    cargo build --release -q -p ejc-runtime --features cuda --bin ejc-ring
    cp target/release/ejc-ring .gpu/
    $EJC build specs/ring.yaml -q --target ptx:sm_90a --dtype bf16 -o .gpu/ring --report > .gpu/ring_ptxas.txt
    $EJC build specs/ring_bwd.yaml -q --target ptx:sm_90a --dtype bf16 -o .gpu/ring_bwd --report > .gpu/ring_bwd_ptxas.txt
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz ring ring_bwd
    rm -rf .gpu/ring .gpu/ring_bwd
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--mlir" ]; then
    # MLIR's gpu form (issue #6): every variant x bf16/f16/f32 x d64/d128, one tiling, PTX
    # from MLIR's NVVM pipeline.
    $EJC build specs/flash.yaml -q --head-dim 64 --head-dim 128 --target mlir:gpu --block-m 64 --block-n 32 -o .gpu/mlir
    tar -C .gpu -czf .gpu/artifacts.tgz mlir
    rm -rf .gpu/mlir
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--hostile" ]; then
    # Kernel-level hostility (gpu_run.sh --hostile): a sample of every operation's kernels
    # for memcheck/racecheck, zero-sized axes and tensors just past 2^31 elements.
    $EJC build specs/flash.yaml -q --target ptx:sm_90a --variant full --variant causal --variant varlen_causal \
        --variant sliding_window --dtype bf16 --head-dim 128 --block-m 128 --block-n 128 --num-stages 2 --num-warps 8 \
        -o .gpu/hostile_flash
    $EJC build specs/flash.yaml -q --target ptx:sm_80 --variant full --variant causal --variant varlen_causal \
        --dtype f16 --head-dim 64 --block-m 128 --block-n 64 --num-stages 2 --num-warps 4 -o .gpu/hostile_flash80
    $EJC build specs/flash_decode.yaml -q --target ptx:sm_90a --variant full --variant gpt_oss --dtype bf16 \
        --head-dim 128 --block-n 128 -o .gpu/hostile_decode
    $EJC build specs/mean_pooling.yaml -q --target ptx:sm_90a --target ptx:sm_80 --dtype bf16 -o .gpu/hostile_pool
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz hostile_flash hostile_flash80 hostile_decode hostile_pool
    rm -rf .gpu/hostile_flash .gpu/hostile_flash80 .gpu/hostile_decode .gpu/hostile_pool
    du -sh .gpu/*
    exit 0
fi
if [ "${1:-}" = "--ops" ]; then
    # specs/flash_decode.yaml (single and split_kv plans, every variant, bf16/f16, d64/d128)
    # and specs/mean_pooling.yaml (every variant and dtype), sm_80 and sm_90a, every code path.
    $EJC build specs/flash_decode.yaml -q --target ptx:sm_90a --target ptx:sm_80 -o .gpu/ops_decode
    $EJC build specs/mean_pooling.yaml -q --target ptx:sm_90a --target ptx:sm_80 -o .gpu/ops_pool
    # Flash's one-kernel plan through the same runtime: every variant, bf16 d128 128 x 128
    # on sm_90a (every path), f16 d64 128 x 64 on sm_80.
    $EJC build specs/flash.yaml -q --target ptx:sm_90a --dtype bf16 --head-dim 128 --block-m 128 --block-n 128 \
        --num-stages 2 --num-warps 8 -o .gpu/ops_flash
    $EJC build specs/flash.yaml -q --target ptx:sm_80 --dtype f16 --head-dim 64 --block-m 128 --block-n 64 \
        --num-stages 2 --num-warps 4 -o .gpu/ops_flash80
    # The benchmark set (gpu_run.sh --ops-bench): as the default pack's.
    $EJC build specs/flash.yaml -q --head-dim 64 --head-dim 128 --target ptx:sm_90a --variant full --variant causal --dtype bf16 \
        -o .gpu/bench --report --drop-spilling > .gpu/bench_ptxas.txt
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz ops_decode ops_pool ops_flash ops_flash80 bench
    rm -rf .gpu/ops_decode .gpu/ops_pool .gpu/ops_flash .gpu/ops_flash80 .gpu/bench
    # The compiler itself (stripped, xz: ~33 MB; LLVM is linked in statically, libffi rides
    # along) for `gpu_run.sh --ops-cli`: `ejc tune/run --backend cuda` on the GPU machine.
    strip -o .gpu/ejc "$EJC" && xz -T0 -6 .gpu/ejc
    cp "$(ldconfig -p | awk '/libffi.so.8 /{print $NF; exit}')" .gpu/ 2>/dev/null || true
    du -sh .gpu/*
    exit 0
fi
# Hopper: every variant x bf16/f16 x d64/d128 on sm_90a, both warp counts, 128 x 64 and
# 128 x 128 tiles: the warp-specialised path here (default pack), mma.sync and wgmma with
# --checks.
PATHS=(--path ws)
[ "${1:-}" = "--checks" ] && PATHS=()
$EJC build specs/flash.yaml -q --head-dim 64 --head-dim 128 --target ptx:sm_90a --dtype bf16 --dtype f16 --block-m 128 --block-n 64 \
    --block-n 128 --num-stages 2 "${PATHS[@]}" -o .gpu/check_sm90a
if [ "${1:-}" = "--checks" ]; then
    # The whole matrix (gpu_run.sh --checks): the sm_90a set above with every code path,
    # sm_80 (every variant x bf16/f16 x d64/d128, one tiling, both warp counts), other
    # tilings and three stages; xz keeps it under the device tool's 64 MiB.
    $EJC build specs/flash.yaml -q --head-dim 64 --head-dim 128 --target ptx:sm_80 --dtype bf16 --dtype f16 --block-m 128 --block-n 64 \
        --num-stages 2 -o .gpu/check
    $EJC build specs/flash.yaml -q --head-dim 64 --head-dim 128 --target ptx:sm_90a --target ptx:sm_80 --variant causal --variant gemma2 \
        --variant varlen_causal --variant sinks --dtype bf16 --dtype f16 --block-m 64 --block-n 32 --block-n 128 \
        --num-stages 3 -o .gpu/check2
    XZ_OPT="-6 -T0" tar -C .gpu -cJf .gpu/artifacts.tar.xz check check2 check_sm90a
    rm -rf .gpu/check .gpu/check2 .gpu/check_sm90a
    du -sh .gpu/*
    exit 0
fi
# Default pack (gpu_run.sh --ws, --bench-only): the warp-specialised half of the sm_90a
# matrix and the benchmark set (the whole matrix and the bench set pass 64 MiB together).
# Benchmark: every tiling and configuration of `full` and `causal`, bf16, on sm_90a, with
# the candidates that spill registers left out (a tuned configuration must not spill).
$EJC build specs/flash.yaml -q --head-dim 64 --head-dim 128 --target ptx:sm_90a --variant full --variant causal --dtype bf16 \
    -o .gpu/bench --report --drop-spilling > .gpu/bench_ptxas.txt
tar -C .gpu -czf .gpu/artifacts.tgz check_sm90a bench
rm -rf .gpu/check_sm90a .gpu/bench
du -sh .gpu/*
