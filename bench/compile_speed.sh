#!/usr/bin/env bash
# Compile speed of `ejc build specs/flash.yaml`, each target alone and all of them, cold
# (an empty compiled-code cache) and warm (nothing changed), and with one variant edited
# (gemma2's soft cap): wall-clock seconds and how many kernels were compiled. The
# figures in docs/perf.md ("Compile speed") come from this script.
#   bash bench/compile_speed.sh           # every target; the PTX of every tiling is ~40 min on 2 cores
#   bash bench/compile_speed.sh --quick   # PTX of one tiling (block 128 x 64) instead of all six
#   TARGETS="cpu mlir" bash bench/compile_speed.sh   # some targets only (default: ir cpu mlir ptx)
# Needs a release build (cargo build --release); uses a temporary cache and output.
set -euo pipefail
cd "$(dirname "$0")/.."
ejc=${EJC:-target/release/ejc}
[ -x "$ejc" ] || { echo "no $ejc: run cargo build --release first" >&2; exit 2; }
ptx_args=()
[ "${1:-}" = "--quick" ] && ptx_args=(--block-m 128 --block-n 64)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export EJC_CACHE_DIR=$work/cache
spec=specs/flash.yaml
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
run() { # label, out dir, build args...
  local label=$1 out=$2; shift 2
  local s e line
  s=$(date +%s.%N)
  line=$("$ejc" build "$@" -o "$work/$out" 2>/dev/null | tail -1)
  e=$(date +%s.%N)
  printf '%-26s %8.2f s   %s\n' "$label" "$(echo "$e - $s" | bc)" "$(echo "$line" | grep -o '([0-9]* compiled, [0-9]* from[^)]*)' || true)"
}
targets=${TARGETS:-ir cpu mlir ptx}
for t in $targets; do
  extra=(); [ $t = ptx ] && extra=("${ptx_args[@]}")
  run "cold $t" "out-$t" $spec --target $t "${extra[@]}"
  run "warm $t" "out-$t" $spec --target $t "${extra[@]}"
  run "warm $t, fresh output" "out2-$t" $spec --target $t "${extra[@]}"
done
if [ ${#ptx_args[@]} -eq 0 ] && [ -z "${TARGETS:-}" ]; then
  run "warm, every target" out-all $spec
  run "warm, every target again" out-all $spec
fi
# One variant edited: only its kernels compile again.
sed 's/logits_soft_cap: 50.0/logits_soft_cap: 30.0/' $spec > "$work/edited.yaml"
for t in $targets; do
  [ $t = ir ] && continue
  extra=(); [ $t = ptx ] && extra=("${ptx_args[@]}")
  run "gemma2 edited, $t" "out-$t" "$work/edited.yaml" --target $t "${extra[@]}"
done
echo "cache: $(du -sh "$EJC_CACHE_DIR" | cut -f1)"
