#!/usr/bin/env python3
"""ejc's CPU flash backward against PyTorch's CPU scaled_dot_product_attention backward, side by side.

One run, one machine, the same sizes for both (issue 16's CPU anchor): ejc through `ejc bench
specs/flash_bwd.yaml --backend cpu` (every plan and tiling of the spec timed, the fastest kept, the
median of --reps runs after a warm-up: what the autotuner picks), torch through autograd on its own
SDPA (`out.backward(dout)` with the graph kept, the median of --reps runs after a warm-up; its CPU
flash-attention backward kernel). FLOPs: the backward's 2.5 x the forward's 4*b*h*s*s*d, halved
for causal (ANCHORS.md), on both sides.

    python3 bench/compare_cpu_bwd.py                   # b=1, h=8, d 64/128, s 512..4096, f32 and bf16
    python3 bench/compare_cpu_bwd.py --quick           # s in {512, 1024}
    python3 bench/compare_cpu_bwd.py --threads 1,2 --markdown

Correctness is not this script's job: the CPU backward is checked against the f64 reference in
the test suite (ejc-codegen/tests/cpu.rs, tests/cli.rs).
Needs: torch (CPU); builds ejc itself (cargo build --release).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ejc_binary():
    subprocess.run(["cargo", "build", "--release", "-q", "--bin", "ejc"], cwd=ROOT, check=True)
    return os.path.join(ROOT, "target", "release", "ejc")


def ejc_row(ejc, d, s, causal, dtype, threads, reps):
    """The fastest plan and tiling of `ejc bench`: (GFLOP/s, plan/tiling)."""
    cmd = [ejc, "bench", os.path.join(ROOT, "specs", "flash_bwd.yaml"), "--variant", "causal" if causal else "full",
           "--dtype", dtype, "--shape", f"1,{s},{s},8,8,{d}", "--threads", str(threads), "--reps", str(reps),
           "--json"]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    return row["gflops"], f"{row['plan']} {row['config'].get('block_m')}x{row['config'].get('block_n')}"


def torch_row(d, s, causal, dtype, threads, reps):
    torch.set_num_threads(threads)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    g = torch.Generator().manual_seed(s * 31 + d)
    q, k, v = (torch.randn(1, 8, s, d, generator=g).to(dt).requires_grad_() for _ in range(3))
    dout = torch.randn(1, 8, s, d, generator=g).to(dt)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    times = []
    for i in range(reps + 1):
        for t in (q, k, v):
            t.grad = None
        t0 = time.perf_counter()
        out.backward(dout, retain_graph=True)
        if i:
            times.append(time.perf_counter() - t0)
    flops = 2.5 * 4 * 8 * s * s * d / (2 if causal else 1)
    return flops / statistics.median(times) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default=str(os.cpu_count()), help="thread counts, e.g. 1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--dtypes", default="f32,bf16")
    a = ap.parse_args()
    ejc = ejc_binary()
    seqs = [512, 1024] if a.quick else [512, 1024, 2048, 4096]
    tables = {}
    for threads in [int(t) for t in a.threads.split(",")]:
        print(f"# torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), b=1 h=8, {threads} threads",
              file=sys.stderr)
        rows = []
        for d in (64, 128):
            for s in seqs:
                for causal in (0, 1):
                    for dtype in a.dtypes.split(","):
                        e, how = ejc_row(ejc, d, s, causal, dtype, threads, a.reps)
                        t = torch_row(d, s, bool(causal), dtype, threads, a.reps)
                        rows.append((d, causal, s, dtype, e, t, how))
                        print(f"t={threads:2} d={d:3} s={s:5} causal={causal} {dtype:5} ejc {e:7.1f}  torch {t:7.1f}"
                              f" GFLOP/s  ratio {e / t:.2f}  {how}", flush=True)
        tables[threads] = rows
    if a.markdown:
        for threads, rows in tables.items():
            print(f"\n{threads} thread(s):\n")
            print("| d | causal | seq | dtype | ejc GFLOP/s | torch SDPA bwd GFLOP/s | ratio | ejc plan, tiling |")
            print("|---|---|---|---|---|---|---|---|")
            for d, c, s, dt, e, t, how in rows:
                print(f"| {d} | {c} | {s} | {dt} | {e:.0f} | {t:.0f} | {e / t:.2f} | {how} |")
        ratios = [r[4] / r[5] for rows in tables.values() for r in rows]
        print(f"\nratio range: {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
