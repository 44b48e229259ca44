"""ejc's flash-attention backward with the bias gradient (`bias_grad`) against torch, in one run.

    python3 bench/compare_gpu_dbias.py BUILD_DIR [BUILD_DIR ...] [--dims 64,128] [--rows 1024,4096] [--json FILE]
    python3 bench/compare_gpu_dbias.py --forward FWD_BUILD_DIR ...   # the forward's `bias` variant instead

The BUILD_DIRs hold `ejc build specs/flash_bwd.yaml --target ptx:...` artifacts with the `bias_grad`
variant (bf16; scripts/gpu_prepare.sh --bwd makes them). FlashAttention-2 and -4 take no bias, and
cuDNN's SDPA returns no bias gradient in torch, so the anchor is torch SDPA's memory-efficient
back end (the one torch uses for `attn_mask` with `requires_grad`); cuDNN is tried too and says why
when it refuses. For each row (b·s = 16384 tokens, h·d = 2048, a dense `[b, h, s, s]` bias, full
attention; s up to 8k, where bias and dbias take 8.6 GB each) it times, with triton's do_bench
(median):

* ejc: each role of each backward plan over every candidate of the build, the fastest of each kept,
  a plan's time their sum and ejc's the faster plan's (the autotuner's choice); dbias is written by
  `dq` (two_pass) or `dkdv_dq` (atomic);
* torch: `autograd.grad` of SDPA's output with respect to q, k, v and the bias.

With `--forward`, the BUILD_DIRs hold `ejc build specs/flash.yaml` artifacts of the `bias` variant, and
the rows time the forward alone (the fastest candidate) against torch SDPA's memory-efficient and cuDNN
forwards with the same bias (FLOPs: 4·d per pair), ejc's output compared with the efficient back end's.

The backward's `out` and `lse` come from torch's memory-efficient forward with the same bias. FLOPs:
2.5 forwards (4·d per pair). ejc's dq, dk, dv and dbias are compared with float32 autograd where it
fits in memory, else with the memory-efficient back end's gradients.
"""
import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bwd_plans import PLANS, artifacts, ratio, rel, save, time_plans  # noqa: E402
from cupy_launch import EjcKernel, flash_sizes, head_dims, instance  # noqa: E402

VARIANT = "bias_grad"


def forward_rows(args, arts, dev):
    """The forward's `bias` variant against torch SDPA's back ends that take a bias."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, kernels = [], {}
    for d in [int(x) for x in args.dims.split(",")]:
        cands = [(bd, a) for bd, a in arts if instance(a) == ("bias", "bf16", d, "main") and head_dims(a) == (d, d)]
        for s in [int(x) for x in args.rows.split(",")]:
            b, h = max(1, 16384 // s), round(2048 / d)
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            bias = 0.5 * torch.randn(b, h, s, s, device="cuda", dtype=torch.bfloat16)
            scale = 1.0 / math.sqrt(d)
            t = dict(q=q, k=k, v=v, bias=bias, out=torch.empty_like(q),
                     lse=torch.empty(b, h, s, device="cuda", dtype=torch.float32))
            scalars, sizes = dict(softmax_scale=scale), flash_sizes(q, k, v)
            fl = 4.0 * b * h * s * s * d
            row = dict(d=d, s=s, b=b, h=h, variant="bias", direction="forward")
            best = None
            for bd, a in cands:
                try:
                    if a["artifact_id"] not in kernels:  # loading is the driver's JIT: once per candidate
                        kernels[a["artifact_id"]] = EjcKernel(bd, a)
                    kern = kernels[a["artifact_id"]]
                    ms = do_bench(lambda: kern(t, scalars, sizes), warmup=5, rep=30, return_mode="median")
                except Exception as e:
                    print(f"  {a['artifact_id']}: failed: {e}", flush=True)
                    continue
                if best is None or ms < best[1]:
                    best = (kern, ms, a["artifact_id"])
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            ref = None
            for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=scale)
                        ms = do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=scale),
                                      warmup=5, rep=30, return_mode="median")
                    row[name], row[name + "_ms"] = fl / ms / 1e9, ms
                    ref = o if ref is None else ref
                except Exception as e:
                    print(f"  torch-{name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            if best is not None:
                best[0](t, scalars, sizes)
                torch.cuda.synchronize()
                row.update(ejc=fl / best[1] / 1e9, ejc_ms=best[1], ejc_kernel=best[2])
                if ref is not None:
                    row["err"] = rel(t["out"], ref.transpose(1, 2))
            rows.append(row)

            print(f"fwd d={d:3d} s={s:5d} b={b} h={h}  ejc {row.get('ejc', 0):6.1f} TFLOP/s ({row.get('ejc_ms', 0):.3f} ms, "
                  f"{row.get('ejc_kernel', '-').split('@')[-1]})  efficient {row.get('efficient', 0):6.1f}  "
                  f"cudnn {row.get('cudnn', 0):6.1f}   ejc/efficient {ratio(row, 'efficient')}  ejc/cudnn {ratio(row, 'cudnn')}  "
                  f"err {row.get('err', float('nan')):.1e}", flush=True)
            save(args.json, dev, rows)
            del q, k, v, bias, t
            torch.cuda.empty_cache()
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--rows", default="1024,2048,4096,8192", help="comma-separated sequence lengths")
    ap.add_argument("--forward", action="store_true", help="time the forward's `bias` variant instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}", flush=True)
    arts = artifacts(args.builds)
    if args.forward:
        return forward_rows(args, arts, dev)
    if not any(instance(a)[0] == VARIANT for _, a in arts):
        print(f"no `{VARIANT}` artifacts in {args.builds}", flush=True)
        return 1
    rows, kernels = [], {}
    for d in [int(x) for x in args.dims.split(",")]:
        for s in [int(x) for x in args.rows.split(",")]:
            b, h = max(1, 16384 // s), round(2048 / d)
            torch.manual_seed(0)
            q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            bias = 0.5 * torch.randn(b, h, s, s, device="cuda", dtype=torch.bfloat16)
            scale = 1.0 / math.sqrt(d)
            qt, kt, vt, dt = (x.transpose(1, 2) for x in (q, k, v, dout))
            o_t, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, bias, True, 0.0, False,
                                                                              scale=scale)[:2]
            out = o_t.transpose(1, 2).contiguous()
            lse = lse[..., :s].float().contiguous()
            fl = 2.5 * 4.0 * b * h * s * s * d
            row = dict(d=d, s=s, b=b, h=h, variant=VARIANT)
            t = dict(q=q, k=k, v=v, out=out, dout=dout, lse=lse, bias=bias,
                     delta=torch.empty(b, h, s, device="cuda", dtype=torch.float32),
                     dq_accum=torch.empty(b, s, h, d, device="cuda", dtype=torch.float32),
                     dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v),
                     dbias=torch.full_like(bias, float("nan")))
            scalars = dict(softmax_scale=scale)
            sizes = flash_sizes(q, k, v)
            plans = time_plans(arts, kernels, VARIANT, d, t, scalars, sizes)
            if plans:
                fastest = min(plans, key=lambda p: plans[p][0])
                ms, best = plans[fastest]
                row.update(ejc=fl / ms / 1e9, ejc_ms=ms, ejc_plan=fastest,
                           ejc_plans={p: {r: [x[2], x[1]] for r, x in bst.items()} for p, (_, bst) in plans.items()})
                for r in PLANS[fastest]:
                    best[r][0](t, scalars, sizes)
                torch.cuda.synchronize()
            # ---- torch: the back ends that differentiate the bias
            grads = None
            for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    qa, ka, va, ba = (x.detach().requires_grad_() for x in (qt, kt, vt, bias))
                    with sdpa_kernel(be):
                        oa = F.scaled_dot_product_attention(qa, ka, va, attn_mask=ba, scale=scale)
                    g = torch.autograd.grad(oa, (qa, ka, va, ba), dt, retain_graph=True)
                    if g[3] is None:
                        raise RuntimeError("no bias gradient")
                    ms = do_bench(lambda: torch.autograd.grad(oa, (qa, ka, va, ba), dt, retain_graph=True),
                                  warmup=5, rep=30, return_mode="median")
                    row[name] = fl / ms / 1e9
                    row[name + "_ms"] = ms
                    if name == "efficient":
                        grads = g
                    del qa, ka, va, ba, oa
                except Exception as e:
                    print(f"  torch-{name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            # ---- ejc's gradients against float32 autograd (or the efficient back end's)
            if "ejc" in row:
                if b * h * s * s * 4 <= 2 ** 31:
                    qf, kf, vf, bf = (x.detach().float().requires_grad_() for x in (qt, kt, vt, bias))
                    with sdpa_kernel(SDPBackend.MATH):
                        of = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=bf, scale=scale)
                    grads = torch.autograd.grad(of, (qf, kf, vf, bf), dt.float())
                    row["err_against"] = "float32 autograd"
                    del qf, kf, vf, bf, of
                elif grads is not None:
                    row["err_against"] = "torch efficient"
                if grads is not None:
                    gq, gk, gv, gb = grads
                    row["err"] = dict(dq=rel(t["dq"], gq.transpose(1, 2)), dk=rel(t["dk"], gk.transpose(1, 2)),
                                      dv=rel(t["dv"], gv.transpose(1, 2)), dbias=rel(t["dbias"], gb))
                del grads
            rows.append(row)

            err = {k_: f"{v_:.1e}" for k_, v_ in row.get("err", {}).items()}
            print(f"d={d:3d} s={s:5d} b={b} h={h}  ejc {row.get('ejc', 0):6.1f} TFLOP/s ({row.get('ejc_ms', 0):.3f} ms, "
                  f"{row.get('ejc_plan')})  efficient {row.get('efficient', 0):6.1f} ({row.get('efficient_ms', 0):.3f} ms)"
                  f"  cudnn {row.get('cudnn', 0):6.1f}   ejc/efficient {ratio(row, 'efficient')}  ejc/cudnn {ratio(row, 'cudnn')}  "
                  f"err vs {row.get('err_against')} {err}", flush=True)
            save(args.json, dev, rows)
            del q, k, v, dout, out, lse, t, qt, kt, vt, dt, bias
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
