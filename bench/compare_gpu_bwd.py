"""ejc's flash-attention backward against the GPU anchors, in one run, on the same tensors.

    python3 bench/compare_gpu_bwd.py BUILD_DIR [BUILD_DIR ...] [--dims 64,128] [--rows 2048,16384] [--json FILE]

The BUILD_DIRs hold `ejc build specs/flash_bwd.yaml --target ptx:...` artifacts (bf16, the `full` and
`causal` variants; scripts/gpu_prepare.sh --bwd makes them). For each row of the standard grid
(b·s = 16384 tokens, h·d = 2048, s 512-16k, causal and not) it times, with triton's do_bench (median):

* ejc: each role of each backward plan over every candidate of the build, the fastest of each kept:
  a plan's time is their sum, and ejc's the faster plan's (the autotuner's choice). `two_pass`
  (preprocess, dkdv, dq) is the deterministic one; `atomic` (preprocess_dq, dkdv_dq with dQ by
  atomic adds, dq_convert) computes the scores once. Both are reported (`ejc_det` is two_pass);
* torch SDPA's backward with the cuDNN and the flash (FlashAttention-2) back ends;
* FlashAttention-4's backward (`flash_attn.cute.flash_attn_func` under autograd), when
  ../shared/bench/fa4_kit.sh's install.sh has put it on PYTHONPATH.

The forward's `out` and `lse` come from torch's FlashAttention-2 forward. FLOPs: 2.5 forwards
(FlashAttention's convention: 4·d per visible pair forward, s² full, s²/2 causal). ejc's gradients are
checked against float32 autograd where that fits in memory.
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
from cupy_launch import flash_sizes  # noqa: E402


def load_fa4():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # not installed here: the column stays empty, and says why
        print(f"fa4: not available ({type(e).__name__}: {str(e)[:120]})", flush=True)
        return None
    return flash_attn_func


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--rows", default=None, help="comma-separated sequence lengths to keep (default: all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}", flush=True)
    fa4 = load_fa4()
    arts = artifacts(args.builds)
    seqs = [512, 1024, 2048, 4096, 8192, 16384]
    if args.rows:
        seqs = [s for s in seqs if s in {int(x) for x in args.rows.split(",")}]
    rows, kernels = [], {}
    for d in [int(x) for x in args.dims.split(",")]:
        for s in seqs:
            for causal in (False, True):
                variant = "causal" if causal else "full"
                b, h = max(1, 16384 // s), round(2048 / d)
                torch.manual_seed(0)
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                scale = 1.0 / math.sqrt(d)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                o_t, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False,
                                                                              scale=scale)[:2]
                out = o_t.transpose(1, 2).contiguous()
                lse = lse.float().contiguous()
                fl = 2.5 * 4.0 * b * h * s * s * d / (2 if causal else 1)
                row = dict(d=d, s=s, b=b, h=h, variant=variant)
                t = dict(q=q, k=k, v=v, out=out, dout=dout, lse=lse,
                         delta=torch.empty(b, h, s, device="cuda", dtype=torch.float32),
                         dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
                scalars = dict(softmax_scale=scale)
                sizes = flash_sizes(q, k, v)
                # ---- ejc: the fastest candidate of each role of each plan
                t["dq_accum"] = torch.empty(b, s, h, d, device="cuda", dtype=torch.float32)
                plans = {}
                for plan, (ms, best) in time_plans(arts, kernels, variant, d, t, scalars, sizes,
                                                   args.verbose).items():
                    roles = PLANS[plan]
                    info = dict(ms=ms, tflops=fl / ms / 1e9, roles={r: [best[r][2], best[r][1]] for r in roles})
                    for r in roles:
                        best[r][0](t, scalars, sizes)
                    torch.cuda.synchronize()
                    if b * h * s * s * 4 <= 2 ** 31:
                        qf, kf, vf = (x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v))
                        of = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, scale=scale)
                        gq, gk, gv = torch.autograd.grad(of, (qf, kf, vf), dout.float().transpose(1, 2))
                        info["err"] = max(rel(t["dq"], gq.transpose(1, 2)), rel(t["dk"], gk.transpose(1, 2)),
                                          rel(t["dv"], gv.transpose(1, 2)))
                        del qf, kf, vf, of, gq, gk, gv
                    plans[plan] = info
                if plans:
                    fastest = min(plans, key=lambda p: plans[p]["ms"])
                    row.update(ejc=plans[fastest]["tflops"], ejc_ms=plans[fastest]["ms"], ejc_plan=fastest,
                               ejc_roles=plans[fastest]["roles"], ejc_plans=plans)
                    if "err" in plans[fastest]:
                        row["ejc_err"] = max(p.get("err", 0) for p in plans.values())
                    if "two_pass" in plans:
                        row["ejc_det"] = plans["two_pass"]["tflops"]
                # ---- anchors: backward only, on the forward's saved state
                dt = dout.transpose(1, 2)
                for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    try:
                        qa, ka, va = (x.detach().requires_grad_() for x in (qt, kt, vt))
                        with sdpa_kernel(be):
                            oa = F.scaled_dot_product_attention(qa, ka, va, is_causal=causal, scale=scale)
                        ms = do_bench(lambda: torch.autograd.grad(oa, (qa, ka, va), dt, retain_graph=True),
                                      warmup=5, rep=40, return_mode="median")
                        row[name] = fl / ms / 1e9
                    except Exception as e:
                        print(f"  torch-{name}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                if fa4 is not None:
                    try:
                        qa, ka, va = (x.detach().requires_grad_() for x in (q, k, v))
                        oa = fa4(qa, ka, va, causal=causal, softmax_scale=scale)
                        oa = oa[0] if isinstance(oa, tuple) else oa
                        ms = do_bench(lambda: torch.autograd.grad(oa, (qa, ka, va), dout, retain_graph=True),
                                      warmup=5, rep=40, return_mode="median")
                        row["fa4"] = fl / ms / 1e9
                    except Exception as e:
                        print(f"  fa4: {type(e).__name__}: {str(e)[:200]}", flush=True)
                anchors = [x for x in ("fa4", "cudnn") if x in row]
                if anchors:
                    row["best_anchor"] = max(anchors, key=lambda x: row[x])
                rows.append(row)

                print(f"d={d:3d} s={s:5d} {variant:6s} h={h}  ejc {row.get('ejc', 0):6.1f} ({row.get('ejc_plan')}; "
                      f"deterministic {row.get('ejc_det', 0):6.1f})  fa4 {row.get('fa4', 0):6.1f}  "
                      f"cudnn {row.get('cudnn', 0):6.1f}  flash {row.get('flash', 0):6.1f} TFLOP/s   ejc/fa4 {ratio(row, 'fa4')}  "
                      f"ejc/cudnn {ratio(row, 'cudnn')}  ejc/flash {ratio(row, 'flash')}   err {row.get('ejc_err')}  "
                      f"{ {p: {k: round(v[1], 3) for k, v in i['roles'].items()} for p, i in row.get('ejc_plans', {}).items()} }",
                      flush=True)
                save(args.json, dev, rows)
                del q, k, v, dout, out, lse, t, qt, kt, vt
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
