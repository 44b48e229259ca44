#!/usr/bin/env bash
# Set up, build, and run the main job: validate the flash spec, compile every kernel
# it declares (tile IR and the CPU library + manifest in ./out), and run every variant on
# random inputs against the reference, in the interpreter and as native CPU code.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .tools/env.sh
cargo build --release --locked
ejc=target/release/ejc
$ejc check specs/flash.yaml
$ejc build specs/flash.yaml -o out
$ejc run specs/flash.yaml --backend interp
$ejc run specs/flash.yaml --backend cpu
