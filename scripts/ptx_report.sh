#!/usr/bin/env bash
# The exhaustive PTX report, apart from the quick start: build the flash spec's PTX for
# sm_80 and sm_90a (every variant, dtype, head dim, launch configuration and code path of
# one tiling, or of the tilings the options name), assemble every entry point with ptxas,
# and print registers, spills and shared memory per entry point.
#   bash scripts/ptx_report.sh                      # block_m 128, block_n 64: 1,032 candidates
#   bash scripts/ptx_report.sh --variant causal     # extra options go to `ejc build`
#   bash scripts/ptx_report.sh --block-m 64 --block-n 64 --path ws
# On 2 cores, one tiling's PTX takes ~11 minutes the first time (LLVM's NVPTX back end,
# ~1.2 s a candidate per core) and ~1 s after that (compiled PTX is cached); ptxas then
# assembles every file the first time (~1-3 s a file, on every core); its reports are
# cached too, so an unchanged build reports in seconds. Every tiling
# (`--config block_m=64 --config block_m=128`, ...) is ~4,300 files, ~37 minutes cold.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .tools/env.sh
cargo build --release --locked
args=("$@")
case " $* " in *" --block-m "*|*" --config "*) ;; *) args=(--block-m 128 --block-n 64 "${args[@]}") ;; esac
target/release/ejc build specs/flash.yaml --target ptx "${args[@]}" --report -o out/gpu
