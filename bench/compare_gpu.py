"""ejc against the GPU anchors, in one run, on the same tensors.

    python3 bench/compare_gpu.py BUILD_DIR [--quick] [--json FILE]

BUILD_DIR holds `ejc build --target ptx:...` artifacts of the `full` and `causal`
variants (bf16). For each row of the standard grid (b·s = 16384 tokens, h·d = 2048,
s from 512 to 16384, d 64 and 128, causal and not) it times, with triton's do_bench
(median) on the same q, k, v:

* ejc: every candidate configuration in the build (the autotuner's choice is the
  fastest), launched through CuPy from the manifest (examples/cupy_launch.py);
* torch SDPA with the cuDNN and the flash (FlashAttention-2) back ends;
* a plain Triton flash-attention forward (written below: 128 x 64 tiles, 8 warps,
  3 stages — what a Triton user writes in an afternoon).

It prints TFLOP/s (forward = 4·b·h·s²·d, halved for causal) and ejc's ratio to each
anchor, and checks ejc's output against a float32 reference where that fits in memory.

`--baseline DIR` times a second build the same way in the same run (e.g. an older
compiler's PTX, `ejc-manifest/1` or `/2`), for a regression check side by side:
`ejc/base` is then printed too.
"""
import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from cupy_launch import EjcKernel, flash_sizes, instance, load_manifest, reference  # noqa: E402


@triton.jit
def _attn_fwd(Q, K, V, O, scale, S, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              CAUSAL: tl.constexpr):
    # q, k, v, o: [B, S, H, D] contiguous; one program per BM query rows of one (batch, head)
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    row_stride = H * D
    offset = (bh // H) * S * row_stride + (bh % H) * D
    rows = start_m * BM + tl.arange(0, BM)
    dims = tl.arange(0, D)
    q = tl.load(Q + offset + rows[:, None] * row_stride + dims[None, :], mask=rows[:, None] < S, other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    o = tl.zeros([BM, D], tl.float32)
    end = tl.minimum((start_m + 1) * BM, S) if CAUSAL else S
    for n0 in range(0, end, BN):
        cols = n0 + tl.arange(0, BN)
        kt = tl.load(K + offset + cols[None, :] * row_stride + dims[:, None], mask=cols[None, :] < S, other=0.0)
        s = tl.dot(q, kt) * (scale * 1.4426950408889634)
        ok = cols[None, :] < S
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        corr = tl.math.exp2(m - m_new)
        l = l * corr + tl.sum(p, 1)
        vv = tl.load(V + offset + cols[:, None] * row_stride + dims[None, :], mask=cols[:, None] < S, other=0.0)
        o = tl.dot(p.to(vv.dtype), vv, o * corr[:, None])
        m = m_new
    o = o / l[:, None]
    tl.store(O + offset + rows[:, None] * row_stride + dims[None, :], o.to(O.dtype.element_ty), mask=rows[:, None] < S)


def triton_attention(q, k, v, causal, out):
    b, s, h, d = q.shape
    grid = (triton.cdiv(s, 128), b * h)
    _attn_fwd[grid](q, k, v, out, 1.0 / math.sqrt(d), s, h, d, 128, 64, causal, num_warps=8, num_stages=3)
    return out


def flops(b, h, s, d, causal):
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--quick", action="store_true", help="three rows only")
    ap.add_argument("--rows", default=None, help="comma-separated sequence lengths to keep (default: all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--verbose", action="store_true", help="print every candidate's time")
    ap.add_argument("--baseline", default=None, help="a second build timed the same way (regression check)")
    ap.add_argument("--only", default=None,
                    help="only the candidates whose artifact id contains this text (e.g. _wgmma: Hopper's paths)")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    dev_name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    print(f"device: {dev_name} (sm_{major}{minor}), torch {torch.__version__}, triton {triton.__version__}", flush=True)
    m = load_manifest(args.build)
    base_m = load_manifest(args.baseline) if args.baseline else None

    def runs_here(t):
        return t == "ptx:sm_80" or (t == "ptx:sm_90a" and (major, minor) == (9, 0))

    rows = []
    grid = [(d, s, c) for d in (64, 128) for s in (512, 1024, 2048, 4096, 8192, 16384) for c in (False, True)]
    if args.quick:
        grid = [(128, 2048, False), (128, 2048, True), (64, 4096, False)]
    if args.rows:
        keep = {int(x) for x in args.rows.split(",")}
        grid = [g for g in grid if g[1] in keep]
    kernels = {}
    for d, s, causal in grid:
        h = 2048 // d
        b = max(1, 16384 // s)
        variant = "causal" if causal else "full"
        def candidates(man):
            return [a for a in man["artifacts"] if instance(a) == (variant, "bf16", d, "main") and runs_here(a["target"])
                    and (args.only is None or args.only in a["artifact_id"])]
        cands = candidates(m)
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        fl = flops(b, h, s, d, causal)
        row = dict(d=d, s=s, b=b, h=h, causal=causal)
        # ---- ejc: every candidate, the fastest kept (and the baseline build's, the same way)
        def fastest(build, cands, tag):
            best = None
            for a in cands:
                key = tag + a["artifact_id"]
                if key not in kernels:
                    try:
                        kernels[key] = EjcKernel(build, a)
                    except Exception as e:  # a candidate that does not load is infinitely slow
                        print(f"  {key}: cannot load: {e}", flush=True)
                        kernels[key] = None
                kern = kernels[key]
                if kern is None:
                    continue
                tensors = dict(q=q, k=k, v=v, out=out, lse=lse)
                sc = dict(softmax_scale=1.0 / math.sqrt(d))
                sizes = flash_sizes(q, k)
                try:
                    ms = do_bench(lambda: kern(tensors, sc, sizes), warmup=10, rep=60, return_mode="median")
                except Exception as e:
                    print(f"  {key}: failed: {e}", flush=True)
                    continue
                if args.verbose:
                    print(f"  {key}: {fl / ms / 1e9:.1f} TFLOP/s", flush=True)
                if best is None or ms < best[1]:
                    best = (a, ms, kern)
            return best

        best = fastest(args.build, cands, "")
        if best is not None:
            a, ms, kern = best
            kern(dict(q=q, k=k, v=v, out=out, lse=lse), dict(softmax_scale=1.0 / math.sqrt(d)), flash_sizes(q, k))
            torch.cuda.synchronize()
            err = None
            if b * h * s * s * 4 <= 2 ** 31:
                want = reference(q, k, v, causal)
                err = ((out.float() - want).norm() / want.norm()).item()
            row.update(ejc=fl / ms / 1e9, ejc_ms=ms, ejc_config=a["artifact_id"], ejc_err=err)
        if base_m is not None:
            base = fastest(args.baseline, candidates(base_m), "base:")
            if base is not None:
                row.update(base=fl / base[1] / 1e9, base_config=base[0]["artifact_id"])
        # ---- anchors
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def f(be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            try:
                ms = do_bench(f, warmup=10, rep=60, return_mode="median")
                row[name] = fl / ms / 1e9
            except Exception as e:
                print(f"  torch-{name}: {type(e).__name__}: {str(e)[:100]}", flush=True)
        try:
            tout = torch.empty_like(q)
            ms = do_bench(lambda: triton_attention(q, k, v, causal, tout), warmup=10, rep=60, return_mode="median")
            row["triton"] = fl / ms / 1e9
        except Exception as e:
            print(f"  triton: {type(e).__name__}: {str(e)[:100]}", flush=True)
        rows.append(row)
        if args.json:  # after every row: a run cut short keeps what it measured
            with open(args.json, "w") as fh:
                json.dump(dict(device=dev_name, rows=rows), fh, indent=1)

        def r(x):
            return f"{row['ejc'] / row[x]:.2f}x" if "ejc" in row and x in row else "-"

        print(
            f"d={d:3d} s={s:5d} causal={int(causal)}  ejc {row.get('ejc', 0):6.1f}  cudnn {row.get('cudnn', 0):6.1f}  "
            f"flash {row.get('flash', 0):6.1f}  triton {row.get('triton', 0):6.1f} TFLOP/s   "
            f"ejc/cudnn {r('cudnn')}  ejc/flash {r('flash')}  ejc/triton {r('triton')}   "
            + (f"base {row.get('base', 0):6.1f}  ejc/base {r('base')}   " if base_m is not None else "")
            + f"err {row.get('ejc_err')}  [{row.get('ejc_config', '-')}]",
            flush=True,
        )
        del q, k, v, out, lse, qt, kt, vt
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=dev_name, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
