"""Mean pooling (chunk means, and their gradient) on the GPU: ejc's kernels against torch's
own reduction, in one run, on the same shapes.

    python3 bench/pool_gpu.py BUILD_DIR [--ejc-gpu .gpu/ejc-gpu] [--json FILE] [--rows N]

BUILD_DIR holds `ejc build specs/mean_pooling.yaml --target ptx:sm_90a` artifacts (or
sm_80). For each row ejc's candidates (every block_h x num_warps) are timed by `ejc-gpu
bench` (CUDA events, median; the fastest kept: what the autotuner would pick), and torch
on tensors of the same shapes (triton's do_bench, median): forward `x.view(B, T/C, C, H,
D).mean(2)`, backward `(dout / C).repeat_interleave(C, dim=1)` (T a multiple of C, so
torch needs no padding; ejc's kernels take any T). The operation is memory-bound: the
bytes each moves (read + write) per second are printed beside the time.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from triton.testing import do_bench

ROWS = [
    # variant, batch, seq, heads, head_dim, chunk
    ("fwd", 8, 4096, 32, 128, 16),
    ("fwd", 4, 16384, 16, 128, 64),
    ("fwd", 16, 2048, 64, 64, 32),
    ("fwd", 1, 65536, 8, 128, 128),
    ("bwd", 8, 4096, 32, 128, 16),
    ("bwd", 4, 16384, 16, 128, 64),
    ("bwd", 16, 2048, 64, 64, 32),
]


def ejc_best(ejc_gpu, build, row, reps):
    variant, b, t, h, d, c = row
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    size = f"batch={b},seq={t},heads={h},head_dim={d},chunk_size={c}"
    cmd = [ejc_gpu, "bench", build, "--variant", variant, "--dtype", "bf16", "--size", size, "--reps", str(reps),
           "--json", path]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:], flush=True)
        return None
    with open(path) as fh:
        doc = json.load(fh)
    os.unlink(path)
    return min(doc["candidates"], key=lambda c: c["ms"]) if doc["candidates"] else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--ejc-gpu", default=".gpu/ejc-gpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", type=int, default=None, help="only the first N rows")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}", flush=True)
    out = []
    for row in ROWS[: args.rows]:
        variant, b, t, h, d, c = row
        n = t // c
        moved = (b * t * h * d + b * n * h * d) * 2  # bf16 read + write
        rec = dict(variant=variant, batch=b, seq=t, heads=h, head_dim=d, chunk=c, bytes=moved)
        best = ejc_best(args.ejc_gpu, args.build, row, args.reps)
        if best:
            rec["ejc_us"] = best["ms"] * 1e3
            rec["ejc_config"] = best["config"]
        torch.manual_seed(0)
        if variant == "fwd":
            x = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16)

            def run():
                return x.view(b, n, c, h, d).mean(2)
        else:
            dout = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)

            def run():
                return (dout / c).repeat_interleave(c, dim=1)
        run()
        torch.cuda.synchronize()
        rec["torch_us"] = do_bench(run, warmup=20, rep=100, return_mode="median") * 1e3
        out.append(rec)
        ejc = rec.get("ejc_us")
        gbs = lambda us: f"{moved / (us * 1e-6) / 1e9:6.0f}" if us else "     -"  # noqa: E731
        ratio = f"{rec['torch_us'] / ejc:.2f}x" if ejc else "-"
        print(
            f"{variant} b={b:2d} T={t:6d} H={h:2d} D={d:3d} C={c:3d}  us: ejc {ejc or float('nan'):8.1f} "
            f"torch {rec['torch_us']:8.1f}  | ejc/torch speed-up {ratio}  GB/s: ejc {gbs(ejc)} torch "
            f"{gbs(rec['torch_us'])}  [{rec.get('ejc_config', '')}]",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(dict(device=dev, rows=out), fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
