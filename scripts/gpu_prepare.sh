#!/usr/bin/env bash
# Build what a GPU run needs, here (no GPU needed): the LLVM-free runner `ejc-gpu` and
# PTX artifacts, packed into .gpu/ (git-ignored) so that the device tool can carry them.
#
#   bash scripts/gpu_prepare.sh            # PTX correctness sets + benchmark set
#   bash scripts/gpu_prepare.sh --mlir     # MLIR's gpu form only (for gpu_run.sh --mlir-only)
#   then, on the GPU machine:  bash scripts/gpu_run.sh [--verify | --full | --rows N,M | --mlir-only | --hopper]
# (two packs: together they would pass the device tool's 64 MiB.)
set -euo pipefail
cd "$(dirname "$0")/.."
source .tools/env.sh 2>/dev/null || bash scripts/setup.sh
source .tools/env.sh
cargo build --release -q -p ejc -p ejc-runtime --features ejc-runtime/cuda --bin ejc --bin ejc-gpu
rm -rf .gpu && mkdir -p .gpu
cp target/release/ejc-gpu .gpu/
EJC=target/release/ejc
if [ "${1:-}" = "--mlir" ]; then
    # MLIR's gpu form (issue #6): every variant x bf16/f16/f32 x d64/d128, one tiling, PTX
    # from MLIR's NVVM pipeline.
    $EJC build specs/flash.yaml -q --target mlir:gpu --block-m 64 --block-n 32 -o .gpu/mlir
    tar -C .gpu -czf .gpu/artifacts.tgz mlir
    rm -rf .gpu/mlir
    du -sh .gpu/*
    exit 0
fi
# Correctness: every variant x bf16/f16 x d64/d128, one tiling, both warp counts.
$EJC build specs/flash.yaml -q --target ptx:sm_80 --dtype bf16 --dtype f16 --block-m 128 --block-n 64 \
    --num-stages 2 -o .gpu/check
# Other tilings, three stages, and the Hopper target on a few variants.
$EJC build specs/flash.yaml -q --target ptx:sm_90a --target ptx:sm_80 --variant causal --variant gemma2 \
    --variant varlen_causal --variant sinks --dtype bf16 --dtype f16 --block-m 64 --block-n 32 --block-n 128 \
    --num-stages 3 -o .gpu/check2
# Hopper (wgmma) path: every variant x bf16/f16 x d64/d128 on sm_90a, both warp counts,
# 128 x 64 and 128 x 128 tiles.
$EJC build specs/flash.yaml -q --target ptx:sm_90a --dtype bf16 --dtype f16 --block-m 128 --block-n 64 \
    --block-n 128 --num-stages 2 -o .gpu/check_sm90a
# Benchmark: every tiling and configuration of `full` and `causal`, bf16, on sm_90a: both
# instruction paths (mma.sync and wgmma) as candidates. (sm_80 code is the same mma.sync
# path, so it is left out of the timing to keep the grid inside one device call.)
$EJC build specs/flash.yaml -q --target ptx:sm_90a --variant full --variant causal --dtype bf16 \
    -o .gpu/bench
tar -C .gpu -czf .gpu/artifacts.tgz check check2 check_sm90a bench
rm -rf .gpu/check .gpu/check2 .gpu/check_sm90a .gpu/bench
du -sh .gpu/*
