"""One ejc flash kernel launched a few times, for a profiler (Nsight Compute) to look at.

    ncu --set detailed -k regex:flash python3 bench/profile_gpu.py BUILD ARTIFACT_ID D S [--causal] [--fa4]

ARTIFACT_ID is an id from BUILD's manifest (bench/compare_gpu.py prints the fastest per
row); the shapes are the standard grid's (b·s = 16384 tokens, h·d = 2048). `--fa4` runs
FlashAttention-4 on the same row instead (its kernels for the same profiler).
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from cupy_launch import EjcKernel, flash_sizes, load_manifest  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("artifact")
    ap.add_argument("d", type=int)
    ap.add_argument("s", type=int)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--fa4", action="store_true")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args()
    d, s = args.d, args.s
    h, b = 2048 // d, max(1, 16384 // s)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if args.fa4:
        from flash_attn.cute import flash_attn_func
        for _ in range(args.launches):
            flash_attn_func(q, k, v, causal=args.causal)
    else:
        m = load_manifest(args.build)
        a = next((a for a in m["artifacts"] if a["artifact_id"] == args.artifact), None)
        if a is None:
            sys.exit(f"{args.artifact}: not in {args.build}/manifest.json")
        kern = EjcKernel(args.build, a)
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        for _ in range(args.launches):
            kern(dict(q=q, k=k, v=v, out=out, lse=lse), dict(softmax_scale=1 / math.sqrt(d)), flash_sizes(q, k))
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
