"""ejc against the GPU anchors, in one run, on the same tensors.

    python3 bench/compare_gpu.py BUILD_DIR [--quick] [--extra] [--json FILE]

BUILD_DIR holds `ejc build --target ptx:...` artifacts of the `full` and `causal`
variants (bf16), and of `gemma2` for the --extra rows. For each row of the standard grid (b·s = 16384 tokens, h·d = 2048,
s from 512 to 16384, d 64 and 128, causal and not) it times, with triton's do_bench
(median) on the same q, k, v:

* ejc: every candidate configuration in the build (the autotuner's choice is the
  fastest), launched through CuPy from the manifest (examples/cupy_launch.py);
* torch SDPA with the cuDNN and the flash (FlashAttention-2) back ends;
* FlashAttention-4 (`flash_attn.cute.flash_attn_func`: its sm90 kernels on Hopper),
  when ../shared/bench/fa4_kit.sh's install.sh has put it on PYTHONPATH (scripts/gpu_run.sh
  --anchors); the only anchor of the Gemma-2 rows, which torch SDPA cannot express;
* a plain Triton flash-attention forward (written below: 128 x 64 tiles, 8 warps,
  3 stages — what a Triton user writes in an afternoon).

It prints TFLOP/s (forward = 4·d FLOPs per visible (query, key) pair: b·h·s² full, about
half of it causal, the window's pairs for Gemma-2) and ejc's ratio to each
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
from cupy_launch import EjcKernel, flash_sizes, head_dims, instance, load_manifest, reference  # noqa: E402


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


def flops(b, h, s, d, causal, window=None, dv=None):
    """Forward FLOPs of the visible (query, key) pairs (2·(d + dv) each, 4·d when v's head
    dim is q's): s² for full attention, s²/2 causal (FlashAttention's convention), and a
    causal window of `left` keys before the diagonal counts min(i, left) + 1 keys for row i."""
    if window is not None:
        left = window[0]
        pairs = sum(min(i, left) + 1 for i in range(s)) if causal else s * s
    else:
        pairs = s * s / 2 if causal else s * s
    return 2.0 * b * h * pairs * (d + (d if dv is None else dv))


def load_fa4():
    """FlashAttention-4's `flash_attn_func` (CuTe DSL, sm90 kernels on Hopper), when
    `../shared/bench/fa4_kit.sh`'s install.sh has put it on PYTHONPATH; else None."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # not installed here: the column stays empty, and says why
        print(f"fa4: not available ({type(e).__name__}: {str(e)[:120]})", flush=True)
        return None
    return flash_attn_func


# Gemma-2's local layers: causal, a 4096-key window (the row and the 4095 before it),
# soft cap 50.
GEMMA2_WINDOW = (4095, 0)
GEMMA2_CAP = 50.0


def grid_rows(args):
    """(d, s, variant, heads_q, heads_kv, dv) rows: the standard grid (b·s = 16384 tokens,
    h·d ≈ 2048, d 64/128 or --dims, s 512-16k, full and causal), then with --extra the Gemma-2
    rows (window + soft cap) and GQA rows (8 query heads per KV head). A --dims entry
    `192v128` is q/k head dim 192 with v head dim 128."""
    dims = []
    for x in (args.dims.split(",") if args.dims else ["64", "128"]):
        d, _, dv = x.partition("v")
        dims.append((int(d), int(dv or d)))
    # h·d ≈ 2048 (d = 96: 21 heads, 192: 11, 256: 8).
    grid = [(d, s, "causal" if c else "full", round(2048 / d), round(2048 / d), dv)
            for d, dv in dims for s in (512, 1024, 2048, 4096, 8192, 16384) for c in (False, True)]
    if args.quick:
        grid = [(128, 2048, "full", 16, 16, 128), (128, 2048, "causal", 16, 16, 128), (64, 4096, "full", 32, 32, 64)]
    if args.extra:
        grid += [(128, s, "gemma2", 16, 16, 128) for s in (2048, 8192, 16384)]
        grid += [(128, s, v, 16, 2, 128) for s in (512, 4096, 16384) for v in ("full", "causal")]
    if args.extra_only:
        grid = [g for g in grid if g[2] == "gemma2" or g[3] != g[4]]
    if args.rows:
        keep = {int(x) for x in args.rows.split(",")}
        grid = [g for g in grid if g[1] in keep]
    return grid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--quick", action="store_true", help="three rows only")
    ap.add_argument("--extra", action="store_true",
                    help="add Gemma-2 rows (causal, 4096-key window, soft cap 50; ejc's `gemma2` variant) and GQA rows")
    ap.add_argument("--extra-only", action="store_true", help="only the --extra rows (implies --extra)")
    ap.add_argument("--dims", default=None,
                    help="comma-separated head dims of the standard grid (default 64,128; e.g. 96,192,256; "
                         "192v128: q/k 192, v 128)")
    ap.add_argument("--rows", default=None, help="comma-separated sequence lengths to keep (default: all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--verbose", action="store_true", help="print every candidate's time")
    ap.add_argument("--baseline", default=None, help="a second build timed the same way (regression check)")
    ap.add_argument("--only", default=None,
                    help="only the candidates whose artifact id contains this text (e.g. _wgmma: Hopper's paths)")
    args = ap.parse_args()
    args.extra = args.extra or args.extra_only
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    dev_name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    print(f"device: {dev_name} (sm_{major}{minor}), torch {torch.__version__}, triton {triton.__version__}", flush=True)
    fa4 = load_fa4()
    m = load_manifest(args.build)
    base_m = load_manifest(args.baseline) if args.baseline else None

    def runs_here(t):
        return t == "ptx:sm_80" or (t == "ptx:sm_90a" and (major, minor) == (9, 0))

    rows = []
    kernels = {}
    for d, s, variant, h, hkv, dv in grid_rows(args):
        b = max(1, 16384 // s)
        causal = variant in ("causal", "gemma2")
        window, cap = (GEMMA2_WINDOW, GEMMA2_CAP) if variant == "gemma2" else (None, None)
        def candidates(man):
            return [a for a in man["artifacts"] if instance(a) == (variant, "bf16", d, "main") and runs_here(a["target"])
                    and head_dims(a) == (d, dv) and (args.only is None or args.only in a["artifact_id"])]
        cands = candidates(m)
        torch.manual_seed(0)
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hkv, dv, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        fl = flops(b, h, s, d, causal, window, dv)
        row = dict(d=d, dv=dv, s=s, b=b, h=h, hkv=hkv, variant=variant, causal=causal)
        scalars = dict(softmax_scale=1.0 / math.sqrt(d))
        if window is not None:
            scalars.update(window_left=window[0], window_right=window[1])
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
                sizes = flash_sizes(q, k, v)
                try:
                    ms = do_bench(lambda: kern(tensors, scalars, sizes), warmup=10, rep=60, return_mode="median")
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
            kern(dict(q=q, k=k, v=v, out=out, lse=lse), scalars, flash_sizes(q, k, v))
            torch.cuda.synchronize()
            err = None
            if b * h * s * s * 4 <= 2 ** 31:
                want = reference(q, k, v, causal, window, cap)
                err = ((out.float() - want).norm() / want.norm()).item()
            row.update(ejc=fl / ms / 1e9, ejc_ms=ms, ejc_config=a["artifact_id"], ejc_err=err)
        if base_m is not None:
            base = fastest(args.baseline, candidates(base_m), "base:")
            if base is not None:
                row.update(base=fl / base[1] / 1e9, base_config=base[0]["artifact_id"])
        # ---- anchors (torch SDPA has no window or soft cap: those rows are FA4's alone)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        if variant != "gemma2":
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                def f(be=be):
                    with sdpa_kernel(be):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=h != hkv)
                try:
                    ms = do_bench(f, warmup=10, rep=60, return_mode="median")
                    row[name] = fl / ms / 1e9
                except Exception as e:
                    print(f"  torch-{name}: {type(e).__name__}: {str(e)[:100]}", flush=True)
        if fa4 is not None:
            kw = dict(causal=causal, softmax_scale=1.0 / math.sqrt(d))
            if window is not None:
                kw.update(window_size=window, softcap=cap)
            try:
                fo = fa4(q, k, v, **kw)
                fo = fo[0] if isinstance(fo, tuple) else fo
                if b * h * s * s * 4 <= 2 ** 31:
                    want = reference(q, k, v, causal, window, cap)
                    row["fa4_err"] = ((fo.float() - want).norm() / want.norm()).item()
                ms = do_bench(lambda: fa4(q, k, v, **kw), warmup=10, rep=60, return_mode="median")
                row["fa4"] = fl / ms / 1e9
            except Exception as e:
                print(f"  fa4: {type(e).__name__}: {str(e)[:200]}", flush=True)
        if variant in ("full", "causal") and h == hkv and d == dv:
            try:
                tout = torch.empty_like(q)
                ms = do_bench(lambda: triton_attention(q, k, v, causal, tout), warmup=10, rep=60,
                              return_mode="median")
                row["triton"] = fl / ms / 1e9
            except Exception as e:
                print(f"  triton: {type(e).__name__}: {str(e)[:100]}", flush=True)
        anchors = [x for x in ("fa4", "cudnn") if x in row]
        if anchors:
            row["best_anchor"] = max(anchors, key=lambda x: row[x])
        rows.append(row)
        if args.json:  # after every row: a run cut short keeps what it measured
            with open(args.json, "w") as fh:
                json.dump(dict(device=dev_name, rows=rows), fh, indent=1)

        def r(x):
            return f"{row['ejc'] / row[x]:.2f}x" if "ejc" in row and x in row else "-"

        print(
            f"d={d:3d}{'' if dv == d else f'/{dv}'} s={s:5d} {variant:7s} h={h}/{hkv}  ejc {row.get('ejc', 0):6.1f}  fa4 {row.get('fa4', 0):6.1f}  "
            f"cudnn {row.get('cudnn', 0):6.1f}  flash {row.get('flash', 0):6.1f}  triton {row.get('triton', 0):6.1f} TFLOP/s   "
            f"ejc/fa4 {r('fa4')}  ejc/cudnn {r('cudnn')}  ejc/flash {r('flash')}  ejc/triton {r('triton')}   "
            + (f"base {row.get('base', 0):6.1f}  ejc/base {r('base')}   " if base_m is not None else "")
            + f"err {row.get('ejc_err')} (fa4 {row.get('fa4_err')})  [{row.get('ejc_config', '-')}]",
            flush=True,
        )
        del q, k, v, out, lse, qt, kt, vt
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=dev_name, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
