#!/usr/bin/env bash
# Set up, build, and run the main job: validate the flash spec, compile every kernel
# it declares (tile IR and the CPU library + manifest in ./out; PTX for sm_80 and sm_90a of
# one tiling, with ptxas's register report, in ./out/gpu; the MLIR modules and MLIR-made PTX
# of one tiling in ./out/mlir), and run every variant on random inputs against the
# reference: in the interpreter, as native CPU code, and through MLIR. (PTX runs on a GPU
# machine: docs/gpu.md.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .tools/env.sh
cargo build --release --locked
ejc=target/release/ejc
$ejc check specs/flash.yaml
$ejc build specs/flash.yaml --target ir --target cpu -o out
$ejc build specs/flash.yaml --target ptx --block-m 128 --block-n 64 --report -o out/gpu
$ejc build specs/flash.yaml --target mlir --block-m 64 --block-n 32 -o out/mlir
$ejc run specs/flash.yaml --backend interp
$ejc run specs/flash.yaml --backend cpu
$ejc run specs/flash.yaml --backend mlir
