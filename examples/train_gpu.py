"""Training with ejc's flash attention, forward and backward, inside torch autograd.

    python3 examples/train_gpu.py FWD_BUILD BWD_BUILD [--steps 40] [--causal | --bias]

FWD_BUILD holds `ejc build specs/flash.yaml --target ptx:...` artifacts and BWD_BUILD
`ejc build specs/flash_bwd.yaml --target ptx:...` ones (bf16, head dim 64, the `full` and `causal`
variants; scripts/gpu_prepare.sh --train makes both). `EjcAttention` is a `torch.autograd.Function`
whose forward launches the forward kernel (which also writes the log-sum-exp) and whose backward
launches the backward plan from its manifest: preprocess (delta = rowsum(dout * out)), dK/dV, dQ —
each kernel through CuPy (examples/cupy_launch.py), on torch's tensors, no copy. With `--bias` the
layer also learns a relative-position bias per head (T5-style, `rel[h, i - j]`, expanded to the dense
`[B, H, S, S]` bias the kernels take): the forward's `bias` variant and the backward's `bias_grad`
variant, whose `dbias` autograd sums back into `rel`.

A small attention layer (x -> q, k, v projections -> attention -> output projection) is trained to
fit a fixed random target twice from the same initial weights: once with ejc's attention and once
with torch's scaled_dot_product_attention. The two loss curves are printed side by side; the run
fails (exit 1) if they part by more than bf16 noise allows.
"""
import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cupy_launch import EjcKernel, flash_sizes, head_dims, instance, load_manifest  # noqa: E402


def kernels_of(build, variant, d, roles):
    """The first candidate of each role that runs on this GPU (sm_90a on Hopper, else sm_80)."""
    major, _ = torch.cuda.get_device_capability()
    targets = ("ptx:sm_90a", "ptx:sm_80") if major == 9 else ("ptx:sm_80",)
    m = load_manifest(build)
    out = {}
    for role in roles:
        for t in targets:
            arts = [a for a in m["artifacts"] if a["target"] == t and instance(a) == (variant, "bf16", d, role)
                    and head_dims(a) == (d, d)]
            if arts:
                out[role] = EjcKernel(build, arts[0])
                break
        if role not in out:
            raise SystemExit(f"{build}: no {variant} bf16 d{d} `{role}` kernel for this GPU")
    return out


class EjcAttention(torch.autograd.Function):
    """out = attention(q, k, v) for BSHD bf16 tensors, through ejc's kernels both ways."""

    @staticmethod
    def forward(ctx, q, k, v, bias, fwd, bwd):
        q, k, v = (x.contiguous() for x in (q, k, v))
        b, s, h, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
        scalars = dict(softmax_scale=1.0 / math.sqrt(d))
        t = dict(q=q, k=k, v=v, out=out, lse=lse)
        if bias is not None:
            t["bias"] = bias = bias.contiguous()
        fwd["main"](t, scalars, flash_sizes(q, k, v))
        ctx.save_for_backward(q, k, v, out, lse, bias)
        ctx.bwd = bwd
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, bias = ctx.saved_tensors
        b, s, h, d = q.shape
        t = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout.contiguous(),
                 delta=torch.empty(b, h, s, device=q.device, dtype=torch.float32),
                 dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
        if bias is not None:
            # The bias_grad variant: the dq kernel also writes dbias, every element of it.
            t["bias"], t["dbias"] = bias, torch.empty_like(bias)
        scalars, sizes = dict(softmax_scale=1.0 / math.sqrt(d)), flash_sizes(q, k, v)
        for role in ("preprocess", "dkdv", "dq"):
            ctx.bwd[role](t, scalars, sizes)
        return t["dq"], t["dk"], t["dv"], t.get("dbias"), None, None


def train(attend, steps, seed, x, y, heads, with_bias):
    torch.manual_seed(seed)
    b, s, e = x.shape
    ws = [torch.nn.Parameter(torch.randn(e, e, device="cuda") / math.sqrt(e)) for _ in range(4)]
    params = list(ws)
    if with_bias:
        # rel[h, i - j + s - 1]: one learned logit offset per head and relative position.
        rel = torch.nn.Parameter(0.5 * torch.randn(heads, 2 * s - 1, device="cuda"))
        params.append(rel)
        pos = torch.arange(s, device="cuda")
        offsets = pos[:, None] - pos[None, :] + s - 1
    opt = torch.optim.Adam(params, lr=3e-3)
    start = [p.detach().clone() for p in params]
    losses = []
    for _ in range(steps):
        q, k, v = ((x @ w).to(torch.bfloat16).view(b, s, heads, e // heads) for w in ws[:3])
        bias = rel[:, offsets].to(torch.bfloat16).unsqueeze(0).expand(b, heads, s, s) if with_bias else None
        o = attend(q, k, v, bias).reshape(b, s, e).float() @ ws[3]
        loss = F.mse_loss(o, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in params], start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fwd_build")
    ap.add_argument("bwd_build")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--bias", action="store_true", help="also learn a relative-position bias (dbias)")
    args = ap.parse_args()
    if args.causal and args.bias:
        ap.error("--bias trains the full (non-causal) `bias` / `bias_grad` variants: drop --causal")
    variant, d, heads, e = ("causal" if args.causal else "full"), 64, 4, 256
    fwd = kernels_of(args.fwd_build, "bias" if args.bias else variant, d, ["main"])
    bwd = kernels_of(args.bwd_build, "bias_grad" if args.bias else variant, d, ["preprocess", "dkdv", "dq"])
    if args.bias:
        variant = "full + a learned bias"
    print(f"device: {torch.cuda.get_device_name()}; {variant}, d {d}; ejc kernels: "
          + ", ".join(k.a["artifact_id"] for k in list(fwd.values()) + list(bwd.values())), flush=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 333, e, device="cuda", generator=g)
    y = torch.randn(4, 333, e, device="cuda", generator=g)

    def ejc(q, k, v, bias):
        return EjcAttention.apply(q, k, v, bias, fwd, bwd)

    def sdpa(q, k, v, bias):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=bias, is_causal=args.causal)
        return o.transpose(1, 2)

    a, pa, p0 = train(ejc, args.steps, 0, x, y, heads, args.bias)
    t, pt, _ = train(sdpa, args.steps, 0, x, y, heads, args.bias)
    # Each parameter's change over training, ejc's against torch's: a gradient ejc failed to
    # return (dbias, say) leaves its parameter where it started.
    names = ["w_q", "w_k", "w_v", "w_o", "rel_bias"]
    param_gap = 0.0
    for name, a_, t_, s_ in zip(names, pa, pt, p0):
        moved = (t_ - s_).norm().item()
        gap_ = ((a_ - s_) - (t_ - s_)).norm().item() / max(moved, 1e-30)
        param_gap = max(param_gap, gap_)
        print(f"{name:8s} moved {moved:.3e} with torch; ejc's move differs by {gap_:.2e} of it", flush=True)
    worst = 0.0
    for i, (la, lt) in enumerate(zip(a, t)):
        gap = abs(la - lt) / lt
        worst = max(worst, gap)
        if i % 5 == 0 or i == len(a) - 1:
            print(f"step {i:3d}  loss ejc {la:.5f}  torch {lt:.5f}  gap {gap:.2e}", flush=True)
    drop = (a[0] - a[-1]) / a[0]
    print(f"loss fell by {drop:.1%} with ejc ({(t[0] - t[-1]) / t[0]:.1%} with torch); largest gap {worst:.2e}")
    if not (drop > 0.05 and worst < 2e-2 and param_gap < 0.25):
        print("FAIL: ejc's training curve does not follow torch's")
        sys.exit(1)
    print("ok: ejc's forward and backward train like torch's attention")


if __name__ == "__main__":
    main()
