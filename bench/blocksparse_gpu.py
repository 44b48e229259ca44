"""Block-sparse attention on the GPU: ejc's `blocksparse_attention` (every candidate timed, the
fastest kept: what the tuner picks) against PyTorch FlexAttention with the same mask, FlashAttention-4
where it has the pattern natively (causal, sliding window), cuDNN (SDPA) on the causal rows, and
ejc's own dense flash forward, in one run.

    python3 bench/blocksparse_gpu.py BS_BUILD [--flash FLASH_BUILD] [--ejc-gpu .gpu/ejc-gpu] [--json FILE]
                                     [--reps N] [--rows quick|all]

BS_BUILD holds `ejc build specs/blocksparse.yaml --target ptx:sm_90a --dtype bf16` artifacts (the
variants below, d 64 and 128); FLASH_BUILD (optional) `specs/flash.yaml`'s `full` variant, bf16,
sm_90a, for the dense column. Every row is bf16, batch B, H query and key heads, Sq = Sk = S, the
same inputs for every column, and a pattern:

* causal; sliding_window (each row sees itself and the 256 keys before it); chunked (causal in
  chunks of 512); document (causal within documents of lengths cycling through 0.5, 1.5, 1, 0.75
  and 1.25 × S/8: ejc's `doc_len` = S/8 and the same ids for the anchors); strided (the
  sparse-transformer pattern: causal, and a band of 128 keys or every 128th key).

Columns are times (µs) and TFLOP/s counted over the visible (row, key) pairs only, 4·B·H·D·pairs
(FlexAttention's convention): one work count for every column.

* **ejc**: `ejc-gpu bench` over every candidate (tiling, code path, warps), the fastest plan (the
  layout kernel, then attention) kept; its launches are then timed one by one: `ejc_us` is the
  attention alone (the layout built, as FlexAttention's `BlockMask` is), `ejc_layout_us` the layout
  kernel, `ejc_total_us` the whole plan as a call runs it today (no layout cache yet).
* **flex**: `torch.compile(flex_attention)` with a `BlockMask` from `create_block_mask` (128 × 128
  blocks, built once, not timed; its build time is the `flex_mask_us` column).
* **fa4**: `flash_attn_func` with `causal=True` (and `window_size=(256, 0)`): rows it serves
  natively only.
* **cudnn**: SDPA's cuDNN backend with `is_causal=True`, on the causal row.
* **dense**: ejc's flash forward (`full`, no mask) at the same size; `per_block` is ejc's
  throughput per visited key block against it (the issue's goal: ≥ 0.9), the visited blocks
  counted at ejc's chosen tiling.

With `--backward`, BS_BUILD holds `specs/blocksparse_bwd.yaml`'s artifacts and every column is a
backward (dq, dk, dv from the same dout), counted as 2.5 forwards (10·B·H·D·pairs, FlashAttention's
convention): ejc's plan (`ejc_us`: preprocess, dK/dV and dQ, the layout and its transpose built, as
FlexAttention's `BlockMask` holds both; `ejc_total_us` with them); FlexAttention's compiled backward
(`torch.autograd.grad` of its output); FA4's and cuDNN's backward where they have the pattern.
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

PATTERNS = ["causal", "sliding_window", "chunked", "document", "strided"]
QUICK = [(1, 16, 8192, 128), (1, 16, 32768, 128), (2, 16, 4096, 64)]
ALL = QUICK + [(4, 16, 2048, 128), (1, 16, 16384, 64)]


def mask_fn(pattern, docs):
    """The pattern's visibility as a function of broadcastable index tensors (q, kv)."""
    if pattern == "causal":
        return lambda q, kv: q >= kv
    if pattern == "sliding_window":
        return lambda q, kv: (q >= kv) & (q - kv <= 256)
    if pattern == "chunked":
        return lambda q, kv: (q >= kv) & (q // 512 == kv // 512)
    if pattern == "document":
        return lambda q, kv: (q >= kv) & (docs[q] == docs[kv])
    if pattern == "strided":
        return lambda q, kv: (q >= kv) & ((q - kv <= 127) | ((q - kv) % 128 == 0))
    raise ValueError(pattern)


def cycled_documents(n, doc_len):
    """ejc_ir::ops::blocksparse::reference::cycled_documents: lengths (2, 6, 4, 3, 5) · doc_len / 4."""
    ids, i = [], 0
    while len(ids) < n:
        run = max([2, 6, 4, 3, 5][i % 5] * doc_len // 4, 1)
        ids.extend([i] * min(run, n - len(ids)))
        i += 1
    return torch.tensor(ids, device="cuda", dtype=torch.int32)


def visible_stats(fn, s, bm, bn):
    """(visible pairs, visited blocks / all blocks at bm × bn), on the GPU in row strips."""
    pairs, visited = 0, 0
    nq, nk = math.ceil(s / bm), math.ceil(s / bn)
    kv = torch.arange(s, device="cuda")[None, :]
    for q0 in range(0, s, bm):
        q = torch.arange(q0, min(q0 + bm, s), device="cuda")[:, None]
        m = fn(q, kv)
        pairs += int(m.sum())
        pad = nk * bn - s
        mm = torch.nn.functional.pad(m, (0, pad)) if pad else m
        visited += int(mm.view(m.shape[0], nk, bn).any(dim=2).any(dim=0).sum())
    return pairs, visited / (nq * nk)


def ejc_bench(args, build, variant, size):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    cmd = [args.ejc_gpu, "bench", build, "--variant", variant, "--dtype", "bf16", "--size", size, "--reps",
           str(args.reps), "--json", path]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:], flush=True)
        return None
    with open(path) as fh:
        res = json.load(fh)
    os.unlink(path)
    cands = res.get("candidates") or []
    if not cands:
        return None
    best = dict(min(cands, key=lambda c: c["ms"]))
    best["launch_ms"] = res.get("best_launch_ms")
    return best


def parse_config(text):
    """A candidate's config id (`ejc_ir::op::config_id`): `m64_n32` or `k=v,k=v`."""
    if "=" not in text and text.startswith("m") and "_n" in text:
        m, n = text[1:].split("_n")
        return {"block_m": int(m), "block_n": int(n)}
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if "=" in kv)}


def time_bwd(fwd, q, k, v, dout):
    """The backward alone (µs, median): the forward run once with gradients, then
    `torch.autograd.grad` of its output against dout timed with the graph kept."""
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    out = fwd(qg, kg, vg)
    f = lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)  # noqa: E731
    f()
    return do_bench(f, warmup=10, rep=60, return_mode="median") * 1e3


def load_fa4():
    try:
        from flash_attn.cute import flash_attn_func
        return flash_attn_func
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"fa4: not available ({type(e).__name__}: {str(e)[:160]})", flush=True)
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--flash", default=None)
    ap.add_argument("--ejc-gpu", default=".gpu/ejc-gpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default="quick", choices=["quick", "all"])
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--backward", action="store_true", help="time backwards (BS_BUILD: specs/blocksparse_bwd.yaml)")
    args = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import torch._dynamo
    # Every row's mask is a new function: without room for the recompilations, dynamo
    # falls back to the unfused path (a materialised score matrix) after eight.
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 1 << 20)
    if args.backward:
        # The backward is timed with the graph kept (retain_graph), which a compiled backward
        # with donated buffers refuses.
        import torch._functorch.config
        torch._functorch.config.donated_buffer = False
    flex = torch.compile(flex_attention)
    fa4 = load_fa4()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    records = []
    for (b, h, s, d) in (QUICK if args.rows == "quick" else ALL):
        torch.manual_seed(0)
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn_like(q)
        v = torch.randn_like(q)
        dout = torch.randn_like(q)
        scale = 1 / math.sqrt(d)
        dense = None
        if args.flash and not args.backward:
            best = ejc_bench(args, args.flash, "full", f"batch={b},seq_q={s},seq_k={s},heads_q={h},heads_kv={h},head_dim={d}")
            dense = best["ms"] * 1e3 if best else None
        torch.cuda.empty_cache()
        docs = cycled_documents(s, s // 8)
        for pattern in args.patterns.split(","):
            fn = mask_fn(pattern, docs)
            rec = dict(pattern=pattern, batch=b, heads=h, seq=s, head_dim=d, dense_us=dense)
            size = f"batch={b},heads_q={h},heads_kv={h},seq_q={s},seq_k={s},head_dim={d}"
            if pattern == "document":
                size += f",doc_len={s // 8}"
            best = ejc_bench(args, args.build, pattern, size)
            if best:
                # ejc_us: the attention launch alone, the layout built (FlexAttention's BlockMask
                # is prebuilt too); ejc_total_us: the plan, layout and attention, as a call runs it.
                rec.update(ejc_total_us=best["ms"] * 1e3, ejc_config=best["config"], ejc_artifact=best["artifact"])
                lm = best.get("launch_ms") or []
                rec["ejc_launch_us"] = [x * 1e3 for x in lm]
                if len(lm) == 2:
                    rec.update(ejc_layout_us=lm[0] * 1e3, ejc_us=lm[1] * 1e3)
                elif args.backward and len(lm) >= 5:
                    # layout, layout_t, then preprocess, dkdv, dq.
                    rec.update(ejc_layout_us=(lm[0] + lm[1]) * 1e3, ejc_us=sum(lm[2:]) * 1e3)
            cfg = parse_config(best["config"]) if best else {}
            bm, bn = cfg.get("block_m", 128), cfg.get("block_n", 128)
            pairs, frac = visible_stats(fn, s, bm, bn)
            rec.update(pairs=pairs, visited=frac, flops=(10.0 if args.backward else 4.0) * b * h * d * pairs)
            # FlexAttention, the same mask.
            try:
                mm = lambda bb, hh, qi, ki: fn(qi, ki)  # noqa: E731
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                bmask = create_block_mask(mm, None, None, s, s, device="cuda", BLOCK_SIZE=128, _compile=True)
                t0.record()
                bmask = create_block_mask(mm, None, None, s, s, device="cuda", BLOCK_SIZE=128, _compile=True)
                t1.record()
                torch.cuda.synchronize()
                rec["flex_mask_us"] = t0.elapsed_time(t1) * 1e3
                if args.backward:
                    rec["flex_us"] = time_bwd(lambda a, b_, c: flex(a, b_, c, block_mask=bmask, scale=scale), q, k, v, dout)
                    want = None
                else:
                    want = flex(q, k, v, block_mask=bmask, scale=scale)
                    rec["flex_us"] = do_bench(lambda: flex(q, k, v, block_mask=bmask, scale=scale), warmup=10, rep=60,
                                              return_mode="median") * 1e3
            except Exception as e:  # noqa: BLE001 - an anchor that fails leaves its column empty
                print(f"  flex: {type(e).__name__}: {str(e)[:300]}", flush=True)
                want = None
            if fa4 is not None and pattern in ("causal", "sliding_window"):
                kw = dict(causal=True, softmax_scale=scale)
                if pattern == "sliding_window":
                    kw["window_size"] = (256, 0)
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                try:
                    if args.backward:
                        dt = dout.transpose(1, 2).contiguous()
                        first = lambda a, b_, c: (lambda r: r[0] if isinstance(r, tuple) else r)(fa4(a, b_, c, **kw))  # noqa: E731
                        rec["fa4_us"] = time_bwd(first, qt, kt, vt, dt)
                        raise StopIteration
                    res = fa4(qt, kt, vt, **kw)
                    fo = (res[0] if isinstance(res, tuple) else res).transpose(1, 2)
                    if want is not None:
                        rec["fa4_err"] = ((fo.float() - want.float()).norm() / want.float().norm()).item()
                    rec["fa4_us"] = do_bench(lambda: fa4(qt, kt, vt, **kw), warmup=10, rep=60, return_mode="median") * 1e3
                except StopIteration:
                    pass
                except Exception as e:  # noqa: BLE001
                    print(f"  fa4: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if pattern == "causal":
                try:
                    from torch.nn.attention import SDPBackend, sdpa_kernel
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        sdpa = lambda a, b_, c: torch.nn.functional.scaled_dot_product_attention(a, b_, c, is_causal=True, scale=scale)  # noqa: E731
                        if args.backward:
                            rec["cudnn_us"] = time_bwd(sdpa, q, k, v, dout)
                        else:
                            f = lambda: sdpa(q, k, v)  # noqa: E731
                            f()
                            rec["cudnn_us"] = do_bench(f, warmup=10, rep=60, return_mode="median") * 1e3
                except Exception as e:  # noqa: BLE001
                    print(f"  cudnn: {type(e).__name__}: {str(e)[:200]}", flush=True)
            tf = {x: rec["flops"] / rec[f"{x}_us"] / 1e6 for x in ("ejc", "flex", "fa4", "cudnn") if rec.get(f"{x}_us")}
            for x, t in tf.items():
                rec[f"{x}_tflops"] = t
            anchors = [rec[f"{x}_us"] for x in ("flex", "fa4", "cudnn") if rec.get(f"{x}_us")]
            if rec.get("ejc_us") and anchors:
                rec["vs_best_anchor"] = min(anchors) / rec["ejc_us"]
            if rec.get("ejc_total_us") and anchors:
                rec["total_vs_best_anchor"] = min(anchors) / rec["ejc_total_us"]
            if rec.get("ejc_us") and dense:
                rec["per_block"] = dense * frac / rec["ejc_us"]
            records.append(rec)
            fmt = lambda x: f"{rec[x]:8.0f}" if rec.get(x) else "       -"  # noqa: E731
            print(
                f"{pattern:15s} b{b} h{h} s{s:6d} d{d:3d} visited {frac:5.3f}  us: ejc {fmt('ejc_us')} layout "
                f"{fmt('ejc_layout_us')} flex "
                f"{fmt('flex_us')} fa4 {fmt('fa4_us')} cudnn {fmt('cudnn_us')} dense {fmt('dense_us')}  "
                f"TFLOP/s ejc {tf.get('ejc', 0):5.0f} flex {tf.get('flex', 0):5.0f}  ejc/best "
                f"{rec.get('vs_best_anchor', 0):4.2f} (with layout {rec.get('total_vs_best_anchor', 0):4.2f})  per_block {rec.get('per_block', 0):4.2f}  "
                f"flex_mask {rec.get('flex_mask_us', 0):6.0f} us  [{rec.get('ejc_artifact', '-')} {rec.get('ejc_config', '')}]",
                flush=True,
            )
            if args.json:  # after every row: a run cut short keeps what it measured
                with open(args.json, "w") as fh:
                    json.dump(records, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
