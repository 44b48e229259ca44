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
* **fa4**: FlashAttention-4, the fastest of the ways it serves the pattern (`fa4_way`, each way's time
  in its own column): natively (`fa4_native_us`: `causal=True`, and `window_size=(256, 0)`, on the causal
  and window rows); as variable-length sequences (`fa4_varlen_us`: `flash_attn_varlen_func` with
  `causal=True` over the documents or the 512-long chunks, the way a user would call it for them); and
  with its block sparsity (`fa4_bs_us`, on the rows it has no native way for: a CuTe `mask_mod` for the
  pattern, the document ids
  as an aux tensor, and FlexAttention's `BlockMask` tensors as `BlockSparseTensorsTorch`, 128 × 128,
  its q-direction lists for the backward). Each way's output is compared with FlexAttention's
  (`fa4_*_err`, relative L2).
* **cudnn**: SDPA's cuDNN backend with `is_causal=True`, on the causal row.
* **ejc_rt**: on the window and chunked rows, ejc's `runtime_window` / `runtime_chunked` variants (the
  window or the chunk length a scalar of the call, `--scalars`) beside the compiled ones: what a size
  given per call costs (`rt_vs_compiled`, > 1 is slower). Left empty when the build lacks them.
* **dense**: ejc's flash forward (`full`, no mask) at the same size; `per_block` is ejc's
  throughput per visited key block against it (the issue's goal: ≥ 0.9), the visited blocks
  counted at ejc's chosen tiling.

With `--backward`, BS_BUILD holds `specs/blocksparse_bwd.yaml`'s artifacts and every column is a
backward (dq, dk, dv from the same dout), counted as 2.5 forwards (10·B·H·D·pairs, FlashAttention's
convention): ejc's plan (`ejc_us`: preprocess, dK/dV and dQ, the layout and its transpose built, as
FlexAttention's `BlockMask` holds both; `ejc_total_us` with them); FlexAttention's compiled backward
(`torch.autograd.grad` of its output); FA4's (each way above) and cuDNN's backward where they have the
pattern.
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
# The patterns with a variant whose size is a scalar of the call: (variant, --scalars).
RUNTIME = {"sliding_window": ("runtime_window", "window_left=256,window_right=0"),
           "chunked": ("runtime_chunked", "chunk_size=512")}
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


def ejc_bench(args, build, variant, size, scalars=None, quiet=False):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    cmd = [args.ejc_gpu, "bench", build, "--variant", variant, "--dtype", "bf16", "--size", size, "--reps",
           str(args.reps), "--json", path]
    if scalars:
        cmd += ["--scalars", scalars]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        if quiet:
            print(f"  ejc {variant}: not timed ({(p.stderr or p.stdout).strip().splitlines()[-1:] or '?'})", flush=True)
        else:
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
    """FlashAttention-4's entry points and a CuTe `mask_mod` per pattern (None: not installed).

    A `mask_mod` is traced by the CuTe DSL: its arguments are `TensorSSA`s of one element
    (batch, head, q_idx, kv_idx), then the sequence lengths and the aux tensors; constants are
    made `TensorSSA`s too."""
    try:
        import cutlass
        import cutlass.cute as cute
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
        from flash_attn.cute import utils as fa_utils
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"fa4: not available ({type(e).__name__}: {str(e)[:160]})", flush=True)
        return None

    def c(x):
        return fa_utils.scalar_to_ssa(x, cutlass.Int32)

    @cute.jit
    def causal(b, h, q, kv, seqlen_info, aux):
        return q >= kv

    @cute.jit
    def sliding_window(b, h, q, kv, seqlen_info, aux):
        return (q >= kv) & (q - kv <= c(256))

    @cute.jit
    def chunked(b, h, q, kv, seqlen_info, aux):
        return (q >= kv) & (q // c(512) == kv // c(512))

    @cute.jit
    def document(b, h, q, kv, seqlen_info, aux):
        docs = aux[0]
        return (q >= kv) & (c(docs[q[0]]) == c(docs[kv[0]]))

    @cute.jit
    def strided(b, h, q, kv, seqlen_info, aux):
        return (q >= kv) & ((q - kv <= c(127)) | ((q - kv) % c(128) == c(0)))

    mods = dict(causal=causal, sliding_window=sliding_window, chunked=chunked, document=document, strided=strided)
    return dict(func=flash_attn_func, varlen=flash_attn_varlen_func, tensors=BlockSparseTensorsTorch, mods=mods)


def fa4_ways(fa4, pattern, bmask, docs, b, h, s, scale):
    """(name, call(q, k, v) -> out, layout) for each way FA4 serves the pattern; layout "bshd" takes
    [B, S, H, D] tensors, "thd" the batch's sequences packed along one axis."""
    first = lambda r: r[0] if isinstance(r, tuple) else r  # noqa: E731
    ways = []
    if pattern in ("causal", "sliding_window"):
        kw = dict(causal=True, softmax_scale=scale)
        if pattern == "sliding_window":
            kw["window_size"] = (256, 0)
        ways.append(("native", lambda q, k, v: first(fa4["func"](q, k, v, **kw)), "bshd"))
    if pattern in ("document", "chunked"):
        # Each document (or chunk) a sequence of its own, causal inside: cumulative lengths over the batch.
        ids = docs if pattern == "document" else torch.arange(s, device="cuda", dtype=torch.int32) // 512
        lens = torch.unique_consecutive(ids, return_counts=True)[1].to(torch.int32)
        lens = lens.repeat(b)
        cu = torch.zeros(lens.numel() + 1, device="cuda", dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        mx = int(lens.max())
        ways.append(("varlen", lambda q, k, v: first(fa4["varlen"](
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=True,
            softmax_scale=scale)), "thd"))
    if pattern in ("causal", "sliding_window"):
        # Served natively: its block sparsity would be a second compile of a slower way.
        return ways
    bs = lambda cnt, idx, fcnt, fidx: fa4["tensors"](  # noqa: E731
        mask_block_cnt=cnt.expand(b, h, *cnt.shape[2:]).contiguous(),
        mask_block_idx=idx.expand(b, h, *idx.shape[2:]).contiguous(),
        full_block_cnt=fcnt.expand(b, h, *fcnt.shape[2:]).contiguous(),
        full_block_idx=fidx.expand(b, h, *fidx.shape[2:]).contiguous(),
        block_size=(128, 128))
    fwd_t = bs(bmask.kv_num_blocks, bmask.kv_indices, bmask.full_kv_num_blocks, bmask.full_kv_indices)
    bwd_t = bs(bmask.q_num_blocks, bmask.q_indices, bmask.full_q_num_blocks, bmask.full_q_indices)
    aux = [docs] if pattern == "document" else None
    ways.append(("bs", lambda q, k, v: first(fa4["func"](
        q, k, v, softmax_scale=scale, mask_mod=fa4["mods"][pattern], aux_tensors=aux,
        block_sparse_tensors=fwd_t, block_sparse_tensors_bwd=bwd_t)), "bshd"))
    return ways


def time_fa4(fa4, rec, pattern, bmask, docs, q, k, v, dout, want, backward):
    """Every way of FA4 for the pattern timed (µs, `fa4_<way>_us`); `fa4_us` is the fastest."""
    b, h, s, d = q.shape
    for name, call, layout in fa4_ways(fa4, pattern, bmask, docs, b, h, s, 1 / math.sqrt(d)):
        if layout == "bshd":
            to = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
            back = lambda o: o.transpose(1, 2)  # noqa: E731
        else:
            to = lambda x: x.transpose(1, 2).reshape(b * s, h, d).contiguous()  # noqa: E731
            back = lambda o: o.reshape(b, s, h, d).transpose(1, 2)  # noqa: E731
        qt, kt, vt = to(q), to(k), to(v)
        try:
            if backward:
                rec[f"fa4_{name}_us"] = time_bwd(call, qt, kt, vt, to(dout))
            else:
                out = back(call(qt, kt, vt))
                if want is not None:
                    rec[f"fa4_{name}_err"] = ((out.float() - want.float()).norm() / want.float().norm()).item()
                rec[f"fa4_{name}_us"] = do_bench(lambda: call(qt, kt, vt), warmup=10, rep=60, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001 - a way that fails leaves its column empty
            print(f"  fa4 {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    done = {n: rec[f"fa4_{n}_us"] for n in ("native", "varlen", "bs") if rec.get(f"fa4_{n}_us")}
    if done:
        way = min(done, key=done.get)
        rec.update(fa4_us=done[way], fa4_way=way)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--flash", default=None)
    ap.add_argument("--ejc-gpu", default=".gpu/ejc-gpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default="quick", choices=["quick", "all"])
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--shapes", default=None, help="only these rows of the grid, e.g. 1x16x8192x128,2x16x4096x64")
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
    grid = QUICK if args.rows == "quick" else ALL
    if args.shapes:
        grid = [tuple(int(x) for x in r.split("x")) for r in args.shapes.split(",")]
    for (b, h, s, d) in grid:
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
            bmask = None
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
            if fa4 is not None and bmask is not None:
                time_fa4(fa4, rec, pattern, bmask, docs, q, k, v, dout, want, args.backward)
            # The same mask with its size given per call (a scalar) instead of compiled in.
            rt = RUNTIME.get(pattern)
            if rt and rec.get("ejc_total_us"):
                best_rt = ejc_bench(args, args.build, rt[0], size, scalars=rt[1], quiet=True)
                if best_rt:
                    lm = best_rt.get("launch_ms") or []
                    rec.update(ejc_rt_total_us=best_rt["ms"] * 1e3, ejc_rt_config=best_rt["config"])
                    if len(lm) == 2:
                        rec["ejc_rt_us"] = lm[1] * 1e3
                    elif args.backward and len(lm) >= 5:
                        rec["ejc_rt_us"] = sum(lm[2:]) * 1e3
                    if rec.get("ejc_rt_us") and rec.get("ejc_us"):
                        rec["rt_vs_compiled"] = rec["ejc_rt_us"] / rec["ejc_us"]
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
            ways = "  ".join(f"{n} {rec[f'fa4_{n}_us']:.0f} us" + (f" (err {rec[f'fa4_{n}_err']:.1e})" if rec.get(f"fa4_{n}_err") is not None else "")
                             for n in ("native", "varlen", "bs") if rec.get(f"fa4_{n}_us"))
            if ways:
                print(f"    fa4 ways: {ways}", flush=True)
            if rec.get("ejc_rt_us"):
                print(f"    ejc with the size per call: {rec['ejc_rt_us']:.0f} us ({rec['rt_vs_compiled']:.2f}x the compiled "
                      f"variant's; whole plan {rec['ejc_rt_total_us']:.0f} us) [{rec.get('ejc_rt_config', '')}]", flush=True)
            if args.json:  # after every row: a run cut short keeps what it measured
                with open(args.json, "w") as fh:
                    json.dump(records, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
