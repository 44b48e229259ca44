#!/usr/bin/env bash
# On the GPU machine: Nsight Compute on the fastest ejc candidate of two standard-grid rows
# (d 128 s 8k, d 64 s 16k, non-causal) and, when FlashAttention-4 is installable here
# (call 2 of ../shared/bench/fa4_kit.sh's recipe: carry .anchors/fa4/part-ab and whl on the
# machine that has /tmp/part-aa), on FA4's kernel for the same rows. Needs the pack of
# `scripts/gpu_prepare.sh --anchors` in .gpu. Reports go to $OUT/ncu_*.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ejc-gpu-out}
mkdir -p "$OUT"
mkdir -p /tmp/ejc-art && tar -C /tmp/ejc-art -xf .gpu/artifacts.tar.xz
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats"
for row in "flash_full_bf16_d128_m128_n128@ptx:sm_90a/w8_s2_wgmma_ws 128 8192" "flash_full_bf16_d64_m64_n64@ptx:sm_90a/w4_s3_wgmma_ws 64 16384"; do
  set -- $row
  timeout 150 $NCU $S -k regex:flash --launch-skip 1 --launch-count 1 python3 bench/profile_gpu.py /tmp/ejc-art/bench $1 $2 $3 > $OUT/ncu_ejc_d$2.txt 2>&1; echo "ejc d$2 rc=$?"
done
if source .anchors/fa4/whl/install.sh; then
  for row in "128 8192" "64 16384"; do set -- $row
    timeout 150 $NCU $S -k regex:"flash|Flash|fwd" --launch-skip 1 --launch-count 1 python3 bench/profile_gpu.py x x $1 $2 --fa4 > $OUT/ncu_fa4_d$1.txt 2>&1; echo "fa4 d$1 rc=$?"
  done
fi
