"""Paged decode attention on the GPU: ejc's `page_attention` (both plans, every split count,
the fastest kept: what the tuner picks) against the HBM limit and the anchors, in one run.
With --ragged, `ragged_decode_attention` the same way on a contiguous buffer; with --rpa,
`ragged_page_attention` (v2) on mixed prefill + decode batches.

    python3 bench/paged_gpu.py BUILD_DIR [--ragged | --rpa] [--ejc-gpu .gpu/ejc-gpu] [--json FILE] [--rows N]

BUILD_DIR holds `ejc build specs/page_attention.yaml --target ptx:sm_90a` artifacts (the
`full` variant, bf16, d 128). Each row is a decode step: `num_seqs` sequences of `context`
keys each, in pages of `page` tokens scattered over the cache (a random permutation), GQA
`heads_q / heads_kv`. Decode is memory-bound, so every column is bandwidth: the bytes a
kernel must move (each sequence's K and V read once per KV head, q read and out written
once) over its time.

* **copy**: a device-to-device copy (`dst.copy_(src)`) of as many bytes as the row's K and V,
  counted as read + write: the HBM limit the issue's goal is measured against.
* **ejc**: `ejc-gpu bench` (CUDA events, median) over the candidates the tuner times: every one of
  a plan with at most 64, a staged search through a plan with more (docs/runtime.md, "The autotuner").
  Where the pick's plan runs launches on two streams (`classed`, `classed_split`), the same pick
  is timed again with every launch on one stream, in order (`ejc_one_stream_us`), and on its
  streams with the prefill launch enqueued before the decodes' (`ejc_late_order_us`).
* **FA4**: FlashAttention-4's paged forward (`flash_attn_varlen_func` with `page_table` and
  `seqused_k`, q as `[B, 1, H, D]`; its sm90 kernels on Hopper) on the same K/V in its own
  layout `[pages, page, KVH, D]`, when ../shared/bench/fa4_kit.sh's install.sh has put it on
  PYTHONPATH; timed with its split heuristic (`num_splits=0`) and with one split, the faster
  kept; its output is checked against torch.
* **sdpa**: torch SDPA (cuDNN, else its default) on the cache gathered into contiguous
  `[B, KVH, T, D]` beforehand (the gather not timed: a bound no paged kernel is held to).

With --ragged (BUILD_DIR: `specs/ragged_decode.yaml`'s `full`, bf16, d 128), each row is B
rows over the whole of a `[B, T, KVH, D]` buffer (every range `[0, T)`); FA4 gets the same
buffer (`flash_attn_varlen_func` in batch mode, no page table) and SDPA its
`[B, KVH, T, D]` transpose, made contiguous beforehand.

With --rpa (BUILD_DIR: `specs/ragged_paged.yaml`'s `full`, bf16, d 128, sm_90a), each row is a
serving step: `B` sequences of `ctx` keys in pages of `page` tokens (K and V interleaved on the
head axis, as ejkernel stores them), the first `chunks` of them prefill chunks of `q_len` new
tokens and the rest one decode token each (queries aligned to the end of the context: causal
bottom-right). The columns are times (the fastest of every candidate for ejc); *FA4* is
`flash_attn_varlen_func` with `cu_seqlens_q`, `seqused_k`, `page_table` and `causal=True` on
the same pages split into its K and V layout, *SDPA* two calls on the cache gathered into
`[B, KVH, ctx, D]` beforehand: the decodes (`enable_gqa`) and the chunks (a lower-right causal
mask). ejc's bandwidth is the bytes of a decode (K and V once per KV head, q and out) over its
time, against the copy.
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
    # num_seqs, heads_q, heads_kv, context, page
    (1, 32, 8, 16384, 16),
    (1, 32, 4, 32768, 64),
    (8, 32, 8, 4096, 16),
    (8, 32, 4, 8192, 64),
    (32, 32, 8, 2048, 16),
    (32, 32, 8, 4096, 256),
    (64, 32, 4, 1024, 16),
    (128, 32, 8, 1024, 64),
    (256, 32, 8, 1024, 16),
]
RAGGED_ROWS = [
    # batch, heads_q, heads_kv, T
    (1, 32, 8, 16384),
    (8, 32, 8, 4096),
    (32, 32, 8, 2048),
    (64, 32, 4, 1024),
    (128, 32, 8, 1024),
]
RPA_ROWS = [
    # num_seqs, heads_q, heads_kv, context, page, q_len (the chunks' new tokens), chunks
    (64, 32, 8, 2048, 16, 1, 1),
    (64, 32, 8, 2048, 16, 512, 1),
    (128, 32, 8, 1024, 64, 256, 4),
    (32, 32, 8, 4096, 64, 1024, 4),
    (8, 32, 8, 8192, 64, 2048, 8),
    (4, 32, 4, 16384, 256, 1, 1),
]
D = 128


def ejc_best(rec, args, row, ragged=False):
    """ejc's fastest candidate of the row into rec (`ejc_us`, its config and artifact), and the
    fastest of each plan (`ejc_single_us`, `ejc_split_k_us`)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    if ragged == "rpa":
        n, hq, hkv, ctx, page, ql, chunks = row
        size = (f"num_seqs={n},heads_q={hq},heads_kv={hkv},head_dim={D},page_size={page},max_context={ctx},"
                f"max_q_len={ql},min_context={ctx},prefill_seqs={chunks}")
    elif ragged:
        n, hq, hkv, t = row
        size = f"batch={n},seq={t},heads_q={hq},heads_kv={hkv},head_dim={D},min_len={t}"
    else:
        n, hq, hkv, ctx, page = row
        size = (f"num_seqs={n},heads_q={hq},heads_kv={hkv},head_dim={D},page_size={page},"
                f"max_context={ctx},min_context={ctx}")
    cmd = [args.ejc_gpu, "bench", args.build, "--variant", "full", "--dtype", "bf16", "--size", size,
           "--reps", str(args.reps), "--json", path]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:], flush=True)
        return
    with open(path) as fh:
        res = json.load(fh)
    cands = res["candidates"]
    if res.get("best_one_stream_ms") is not None:
        # The best candidate's launches ran on several streams; the same on one, in order.
        rec["ejc_one_stream_us"] = res["best_one_stream_ms"] * 1e3
    if res.get("best_late_order_ms") is not None:
        # The same on its streams, the prefill launch enqueued before the decodes'.
        rec["ejc_late_order_us"] = res["best_late_order_ms"] * 1e3
    os.unlink(path)
    if not cands:
        return
    best = min(cands, key=lambda c: c["ms"])
    rec.update(ejc_us=best["ms"] * 1e3, ejc_config=best["config"], ejc_artifact=best["artifact"])
    # The fastest of each plan (a split-K candidate names num_splits in its config).
    for c in cands:
        key = "ejc_split_k_us" if "num_splits" in c["config"] else "ejc_single_us"
        rec[key] = min(rec.get(key, math.inf), c["ms"] * 1e3)


def load_fa4():
    try:
        from flash_attn.cute import flash_attn_varlen_func
        return flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"fa4: not available ({type(e).__name__}: {str(e)[:160]})", flush=True)
        return None


def report(rec, label):
    """Bandwidths and ratios of a row (rec gets `<x>_gbs`), printed on one line."""
    moved = rec["bytes"]
    gbs = {x: moved / rec[f"{x}_us"] / 1e3 for x in ("ejc", "fa4", "sdpa") if f"{x}_us" in rec}
    for x, g in gbs.items():
        rec[f"{x}_gbs"] = g
    r = lambda a, b: f"{gbs[a] / gbs[b]:.2f}" if a in gbs and b in gbs else "  - "  # noqa: E731
    cp = rec["copy_gbs"]
    print(
        f"{label}  copy {cp:6.0f}  ejc {gbs.get('ejc', 0):6.0f} "
        f"({gbs.get('ejc', 0) / cp:4.2f} of copy)  fa4 {gbs.get('fa4', 0):6.0f}  sdpa {gbs.get('sdpa', 0):6.0f} GB/s  "
        f"ejc/fa4 {r('ejc', 'fa4')}  ejc/sdpa {r('ejc', 'sdpa')}  fa4 err {rec.get('fa4_err')}  "
        f"[{rec.get('ejc_artifact', '-')} {rec.get('ejc_config', '')}]",
        flush=True,
    )


def time_copy(rec, kv_bytes):
    src = torch.empty(kv_bytes // 2, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    rec["copy_gbs"] = 2 * kv_bytes / ms / 1e6


def time_fa4(rec, fa4, q, k, v, kw, want):
    """FA4 with its split heuristic (num_splits=0) and one split, the faster kept in rec
    (`fa4_us`, `fa4_err` against `want`, `fa4_splits`); a failure is printed, not fatal."""
    if fa4 is None:
        return
    for ns in (0, 1):
        args = dict(kw, num_splits=ns)
        try:
            res = fa4(q, k, v, **args)
            fo = res[0] if isinstance(res, tuple) else res
            err = ((fo.float().view(want.shape) - want).norm() / want.norm()).item()
            ms = do_bench(lambda: fa4(q, k, v, **args), warmup=10, rep=60, return_mode="median")
            if "fa4_us" not in rec or ms * 1e3 < rec["fa4_us"]:
                rec["fa4_us"], rec["fa4_err"], rec["fa4_splits"] = ms * 1e3, err, ns
        except Exception as e:  # noqa: BLE001 - an anchor that fails leaves its column empty
            print(f"  fa4 (num_splits={ns}): {type(e).__name__}: {str(e)[:300]}", flush=True)


def ragged_row(args, fa4, row):
    n, hq, hkv, t = row
    kv_bytes = 2 * n * t * hkv * D * 2
    rec = dict(batch=n, heads_q=hq, heads_kv=hkv, seq=t, head_dim=D, bytes=kv_bytes + 2 * n * hq * D * 2)
    ejc_best(rec, args, row, ragged=True)
    time_copy(rec, kv_bytes)
    torch.manual_seed(0)
    k = torch.randn(n, t, hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(n, 1, hq, D, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(D)
    qs, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    want = torch.nn.functional.scaled_dot_product_attention(
        qs.float(), kt.float(), vt.float(), scale=scale, enable_gqa=True).view(n, hq, D)
    ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, kt, vt, scale=scale, enable_gqa=True),
                  warmup=10, rep=60, return_mode="median")
    rec["sdpa_us"] = ms * 1e3
    time_fa4(rec, fa4, q, k, v, dict(softmax_scale=scale), want)
    del k, v, kt, vt
    torch.cuda.empty_cache()
    report(rec, f"B={n:3d} h={hq}/{hkv} T={t:5d}")
    return rec


def rpa_row(args, fa4, row):
    """One serving step of ragged_page_attention: times of ejc, FA4 and SDPA (`<x>_us`)."""
    n, hq, hkv, ctx, page, ql, chunks = row
    chunks = min(max(chunks, 1), n)
    q_lens = [min(ql, ctx)] * chunks + [1] * (n - chunks)
    tokens = sum(q_lens)
    kv_bytes = 2 * n * ctx * hkv * D * 2
    rec = dict(num_seqs=n, heads_q=hq, heads_kv=hkv, context=ctx, page=page, q_len=ql, chunks=chunks,
               tokens=tokens, head_dim=D, bytes=kv_bytes + 2 * tokens * hq * D * 2)
    # Causal FLOPs of the step (2 products, each query row against the keys it sees).
    rec["flops"] = sum(4 * hq * D * sum(ctx - q + 1 + i for i in range(q)) for q in q_lens)
    ejc_best(rec, args, row, ragged="rpa")
    time_copy(rec, kv_bytes)
    torch.manual_seed(0)
    pages_per_seq = math.ceil(ctx / page)
    num_pages = n * pages_per_seq + 1
    kv = torch.randn(num_pages, page, 2 * hkv, D, device="cuda", dtype=torch.bfloat16)
    k, v = kv[:, :, 0::2].contiguous(), kv[:, :, 1::2].contiguous()
    table = torch.randperm(num_pages, device="cuda")[: n * pages_per_seq].view(n, pages_per_seq).int()
    q = torch.randn(tokens, hq, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), device="cuda", dtype=torch.int32)
    lens = torch.full((n,), ctx, device="cuda", dtype=torch.int32)
    scale = 1 / math.sqrt(D)
    kg = k[table.long()].reshape(n, pages_per_seq * page, hkv, D)[:, :ctx].transpose(1, 2).contiguous()
    vg = v[table.long()].reshape(n, pages_per_seq * page, hkv, D)[:, :ctx].transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    c = chunks if ql > 1 else 0
    qc = q[: c * ql].view(c, ql, hq, D).transpose(1, 2)  # the chunks [c, H, ql, D]
    qd = q[c * ql:].view(n - c, hq, 1, D)  # the decodes [n - c, H, 1, D]
    kx, vx = kg[:c].repeat_interleave(hq // hkv, 1), vg[:c].repeat_interleave(hq // hkv, 1)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(ql, ctx) if c else None

    def run_sdpa():
        if c:
            sdpa(qc, kx, vx, attn_mask=mask, scale=scale)
        if n - c:
            sdpa(qd, kg[c:], vg[c:], scale=scale, enable_gqa=True)

    try:
        rec["sdpa_us"] = do_bench(run_sdpa, warmup=10, rep=60, return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001
        print(f"  sdpa: {type(e).__name__}: {str(e)[:200]}", flush=True)
    # FA4's output is checked on the first and last sequences (f32 math, the bottom-right mask).
    want = []
    for s_, (a, b) in ((0, (0, q_lens[0])), (n - 1, (tokens - q_lens[-1], tokens))):
        qq = q[a:b].float().transpose(0, 1)  # [H, L, D]
        kk = kg[s_].float().repeat_interleave(hq // hkv, 0)
        vv = vg[s_].float().repeat_interleave(hq // hkv, 0)
        sc = qq @ kk.transpose(1, 2) * scale
        pos = torch.arange(ctx - (b - a), ctx, device="cuda")[:, None]
        sc = sc.masked_fill(torch.arange(ctx, device="cuda")[None, :] > pos, float("-inf"))
        want.append((a, b, (sc.softmax(-1) @ vv).transpose(0, 1)))
    if fa4 is not None:
        kw = dict(cu_seqlens_q=cu, seqused_k=lens, page_table=table, softmax_scale=scale, causal=True,
                  max_seqlen_q=max(q_lens))
        try:
            res = fa4(q, k, v, **kw)
            fo = (res[0] if isinstance(res, tuple) else res).float()
            rec["fa4_err"] = max(((fo[a:b] - w).norm() / w.norm()).item() for a, b, w in want)
            rec["fa4_us"] = do_bench(lambda: fa4(q, k, v, **kw), warmup=10, rep=60, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001 - an anchor that fails leaves its column empty
            print(f"  fa4: {type(e).__name__}: {str(e)[:300]}", flush=True)
    del kv, k, v, kg, vg, kx, vx
    torch.cuda.empty_cache()
    anchors = {x: rec[f"{x}_us"] for x in ("fa4", "sdpa") if f"{x}_us" in rec}
    rec["best_anchor"] = min(anchors, key=anchors.get) if anchors else None
    us = lambda x: rec.get(f"{x}_us", float("nan"))  # noqa: E731
    if "ejc_us" in rec:
        rec["ejc_gbs"] = rec["bytes"] / rec["ejc_us"] / 1e3
        rec["ejc_tflops"] = rec["flops"] / rec["ejc_us"] / 1e6
        if anchors:
            rec["ejc_vs_best"] = anchors[rec["best_anchor"]] / rec["ejc_us"]
    print(
        f"B={n:3d} h={hq}/{hkv} ctx={ctx:5d} page={page:3d} chunks={chunks}x{ql:4d}  ejc {us('ejc'):8.1f} us "
        f"({rec.get('ejc_gbs', 0):5.0f} GB/s = {rec.get('ejc_gbs', 0) / rec['copy_gbs']:4.2f} of copy, "
        f"{rec.get('ejc_tflops', 0):5.1f} TFLOP/s)  fa4 {us('fa4'):8.1f} us (err {rec.get('fa4_err')})  "
        f"sdpa {us('sdpa'):8.1f} us  ejc vs best {rec.get('ejc_vs_best', float('nan')):4.2f}  "
        f"(ejc's pick on one stream {us('ejc_one_stream'):8.1f} us, in the late order {us('ejc_late_order'):8.1f} us)  "
        f"[{rec.get('ejc_artifact', '-')} {rec.get('ejc_config', '')}]",
        flush=True,
    )
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--ragged", action="store_true", help="ragged_decode_attention on a contiguous buffer")
    ap.add_argument("--rpa", action="store_true", help="ragged_page_attention (v2) on mixed prefill + decode steps")
    ap.add_argument("--ejc-gpu", default=".gpu/ejc-gpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", type=int, default=None, help="only the first N rows")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    fa4 = load_fa4()
    out = []
    if args.rpa:
        for row in RPA_ROWS[: args.rows]:
            out.append(rpa_row(args, fa4, row))
    elif args.ragged:
        for row in RAGGED_ROWS[: args.rows]:
            out.append(ragged_row(args, fa4, row))
    for row in ([] if args.ragged or args.rpa else ROWS[: args.rows]):
        n, hq, hkv, ctx, page = row
        kv_bytes = 2 * n * ctx * hkv * D * 2
        moved = kv_bytes + 2 * n * hq * D * 2
        rec = dict(num_seqs=n, heads_q=hq, heads_kv=hkv, context=ctx, page=page, head_dim=D, bytes=moved)
        ejc_best(rec, args, row)
        # The copy: as many bytes as K and V, read once and written once.
        time_copy(rec, kv_bytes)
        # The anchors' inputs: pages scattered by a permutation, as ejc's bench has them.
        torch.manual_seed(0)
        pages_per_seq = math.ceil(ctx / page)
        num_pages = n * pages_per_seq + 1
        k = torch.randn(num_pages, page, hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = torch.randperm(num_pages, device="cuda")[: n * pages_per_seq].view(n, pages_per_seq).int()
        lens = torch.full((n,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(n, hq, D, device="cuda", dtype=torch.bfloat16)
        scale = 1 / math.sqrt(D)
        # Gathered [B, KVH, T, D] (the reference and SDPA's input).
        kg = k[table.long()].reshape(n, pages_per_seq * page, hkv, D)[:, :ctx].transpose(1, 2).contiguous()
        vg = v[table.long()].reshape(n, pages_per_seq * page, hkv, D)[:, :ctx].transpose(1, 2).contiguous()
        qs = q.view(n, hq, 1, D)
        want = torch.nn.functional.scaled_dot_product_attention(
            qs.float(), kg.float(), vg.float(), scale=scale, enable_gqa=True).view(n, hq, D)
        try:
            ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                qs, kg, vg, scale=scale, enable_gqa=True), warmup=10, rep=60, return_mode="median")
            rec["sdpa_us"] = ms * 1e3
        except Exception as e:  # noqa: BLE001
            print(f"  sdpa: {type(e).__name__}: {str(e)[:200]}", flush=True)
        time_fa4(rec, fa4, q.view(n, 1, hq, D), k, v, dict(seqused_k=lens, page_table=table, softmax_scale=scale), want)
        del k, v, kg, vg
        torch.cuda.empty_cache()
        report(rec, f"B={n:3d} h={hq}/{hkv} ctx={ctx:5d} page={page:3d}")
        out.append(rec)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=out), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
