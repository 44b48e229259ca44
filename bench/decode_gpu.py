"""Decode-like attention: ejc's one-kernel plan and its split-KV plan against cuDNN and
FlashAttention-2, in one run, on the same shapes.

    python3 bench/decode_gpu.py BUILD_DIR [--ejc-gpu .gpu/ejc-gpu] [--json FILE] [--rows N]

BUILD_DIR holds `ejc build specs/flash_decode.yaml --target ptx:sm_90a` artifacts (the
`full` variant, bf16): both plans. For each row (few query rows, long keys, GQA 4:1,
head_dim 128) ejc's candidates are timed by `ejc-gpu bench` (CUDA events, every
candidate of both plans and every num_splits, the fastest of each plan kept: what the
autotuner would pick), and torch's SDPA with the cuDNN and the flash (FlashAttention-2)
back ends on tensors of the same shapes (triton's do_bench, median).

One query row sees every key, so the `full` variant is the decode step (bottom-right
aligned causal and full agree there); torch's SDPA gets `is_causal=False` for the same
reason (its causal mask is top-left aligned). GQA is given to SDPA as `enable_gqa=True`
where the back end takes it, else with K/V expanded to every query head (noted per row).
Decode is memory-bound: besides time, the K/V bytes read per second are printed.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch
from triton.testing import do_bench

ROWS = [
    # batch, seq_q, seq_k, heads_q, heads_kv, head_dim
    (1, 1, 8192, 32, 8, 128),
    (1, 1, 32768, 32, 8, 128),
    (1, 1, 131072, 32, 8, 128),
    (4, 1, 16384, 32, 8, 128),
    (8, 1, 4096, 32, 8, 128),
    (16, 1, 8192, 32, 8, 128),
    (32, 1, 2048, 32, 8, 128),
    (64, 1, 1024, 32, 8, 128),
]


def ejc_times(ejc_gpu, build, row, reps):
    b, sq, sk, hq, hkv, d = row
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    cmd = [ejc_gpu, "bench", build, "--variant", "full", "--dtype", "bf16", "--shape", f"{b},{sq},{sk},{hq},{hkv},{d}",
           "--reps", str(reps), "--json", path]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:], flush=True)
        return None
    with open(path) as fh:
        doc = json.load(fh)
    os.unlink(path)
    best = {}
    for c in doc["candidates"]:
        plan = "split_kv" if "plan:split_kv" in c["config"] else "single"
        if plan not in best or c["ms"] < best[plan]["ms"]:
            best[plan] = c
    return best


def sdpa(q, k, v, backend):
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
    try:
        run()
        torch.cuda.synchronize()
        return do_bench(run, warmup=20, rep=100, return_mode="median"), "gqa"
    except Exception:
        g = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)

        def run_expanded():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=False)
        try:
            run_expanded()
            torch.cuda.synchronize()
            return do_bench(run_expanded, warmup=20, rep=100, return_mode="median"), "expanded"
        except Exception as e:
            print(f"  {backend}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            return None, None


def main():
    from torch.nn.attention import SDPBackend

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
        b, sq, sk, hq, hkv, d = row
        kv_bytes = 2 * b * sk * hkv * d * 2
        rec = dict(batch=b, seq_q=sq, seq_k=sk, heads_q=hq, heads_kv=hkv, head_dim=d)
        best = ejc_times(args.ejc_gpu, args.build, row, args.reps)
        if best:
            for plan, c in best.items():
                rec[f"ejc_{plan}_us"] = c["ms"] * 1e3
                rec[f"ejc_{plan}_config"] = c["config"]
        torch.manual_seed(0)
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16)
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION)):
            ms, how = sdpa(q, k, v, be)
            if ms is not None:
                rec[f"{name}_us"] = ms * 1e3
                rec[f"{name}_gqa"] = how
        out.append(rec)

        def us(key):
            return f"{rec[key]:8.1f}" if key in rec else "       -"

        def ratio(a, bkey):
            return f"{rec[bkey] / rec[a]:.2f}x" if a in rec and bkey in rec else "-"

        ejc_best = min((rec[k] for k in ("ejc_single_us", "ejc_split_kv_us") if k in rec), default=None)
        if ejc_best is not None:
            rec["ejc_us"] = ejc_best
        gbs = f"{kv_bytes / (ejc_best * 1e-6) / 1e9:6.0f}" if ejc_best else "     -"
        print(
            f"b={b:3d} sq={sq} sk={sk:6d} hq={hq} hkv={hkv} d={d}  us: ejc single {us('ejc_single_us')} split "
            f"{us('ejc_split_kv_us')}  cudnn {us('cudnn_us')} ({rec.get('cudnn_gqa', '-')})  fa2 {us('flash2_us')} "
            f"({rec.get('flash2_gqa', '-')})  | split/single {ratio('ejc_split_kv_us', 'ejc_single_us')}  "
            f"ejc/cudnn {ratio('ejc_us', 'cudnn_us')}  ejc/fa2 {ratio('ejc_us', 'flash2_us')}  ejc K/V GB/s {gbs}  "
            f"[{rec.get('ejc_split_kv_config', '')}]",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(dict(device=dev, rows=out), fh, indent=1)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
