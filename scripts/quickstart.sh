#!/usr/bin/env bash
# Set up, build, and run the main job: validate the flash spec; compile every kernel it
# declares to tile IR and a CPU library (./out); PTX for sm_80 and sm_90a of every variant
# at head dims 64 and 128 in bf16, one tiling and one launch configuration per code path (./out/gpu);
# the MLIR modules and MLIR-made PTX of one tiling (./out/mlir); run every variant on
# random inputs against the reference in the interpreter, as native CPU code and through
# MLIR; and autotune one call on this CPU. (PTX runs on a GPU machine: docs/gpu.md. The
# exhaustive PTX build with ptxas's register report: scripts/ptx_report.sh.)
#
# On 2 cores, after set-up and the Rust build: ~4 minutes the first time, seconds after
# that (compiled code is cached: `ejc cache ls`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .tools/env.sh
cargo build --release --locked
ejc=target/release/ejc
start=$SECONDS
step() { printf '\n== [%ds] %s\n' $((SECONDS - start)) "$*"; }
step "ejc check"
$ejc check specs/flash.yaml
step "ejc build: tile IR and the CPU library of all 720 kernels (head dims 64 to 256, and 192 with v 128)"
$ejc build specs/flash.yaml --target ir --target cpu -o out
step "ejc build: PTX (sm_80, sm_90a), bf16, head dims 64 and 128, block 128x64, 4 warps, 2 stages"
$ejc build specs/flash.yaml --target ptx --dtype bf16 --head-dim 64 --head-dim 128 --block-m 128 --block-n 64 \
    --num-warps 4 --num-stages 2 -o out/gpu
step "ejc build: MLIR (cpu and gpu forms), block 64x32"
$ejc build specs/flash.yaml --target mlir --block-m 64 --block-n 32 -o out/mlir
step "ejc run: every variant against the reference"
$ejc run specs/flash.yaml --backend interp
$ejc run specs/flash.yaml --backend cpu
$ejc run specs/flash.yaml --backend mlir
step "ejc tune: one call on this CPU (the winner goes to the tuning cache: ejc cache ls)"
$ejc tune specs/flash.yaml --variant causal --dtype f32 --shape 1,1024,1024,4,4,64 --threads 2
step "done"
