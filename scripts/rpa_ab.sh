#!/usr/bin/env bash
# On the GPU machine: ragged paged attention's bench rows (bench/paged_gpu.py's RPA_ROWS) timed
# by `ejc-gpu bench` on two builds in one run, one row after the other (A then B), so a change
# to the kernels is measured side by side with the build before it. Prints each build's best.
#   bash scripts/rpa_ab.sh DIR_A DIR_B [REPS]
set -euo pipefail
A=$1; B=$2; REPS=${3:-20}
G=${EJC_GPU:-.gpu/ejc-gpu}
# num_seqs heads_q heads_kv context page q_len chunks (RPA_ROWS)
while read -r n hq hkv ctx page ql chunks; do
  size="num_seqs=$n,heads_q=$hq,heads_kv=$hkv,head_dim=128,page_size=$page,max_context=$ctx,max_q_len=$ql,min_context=$ctx,prefill_seqs=$chunks"
  for d in "$A" "$B"; do
    best=$("$G" bench "$d" --variant full --dtype bf16 --size "$size" --reps "$REPS" | grep -E "^best" | head -3 | tr '\n' ' ')
    echo "$n x $ctx (page $page, q_len $ql, $chunks chunk(s)) $(basename "$d"): $best"
  done
done <<'ROWS'
64 32 8 2048 16 1 1
64 32 8 2048 16 512 1
128 32 8 1024 64 256 4
32 32 8 4096 64 1024 4
8 32 8 8192 64 2048 8
4 32 4 16384 256 1 1
ROWS
