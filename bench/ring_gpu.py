"""The anchor for ring attention (issue 23): the same sequence-parallel attention in
PyTorch, one process per GPU over NCCL, run on the same machine as `ejc-ring bench`.

    python3 bench/ring_gpu.py --gpus N --seq S --heads HQ:HKV [--dim D] [--causal] [--backward]
                              [--reps R] [--json FILE]

No ring implementation ships with torch that runs here without compiling, so the anchor
is the issue's fallback: each rank holds `S/N` contiguous tokens, all-gathers the keys and
values (`torch.distributed.nn.functional.all_gather`, differentiable: its backward is the
reduce-scatter of dK/dV), and runs torch SDPA on its queries against the keys it may see
(`[0, end)` of its own chunk with causal; everything without). Causal uses SDPA's
lower-right causal bias (`torch.nn.attention.bias.causal_lower_right`, FlashAttention-2 /
memory-efficient back ends), so rank r's queries line up with the end of its keys. GQA:
the KV heads are repeated to the query heads after the gather. bf16, batch 1.

The time reported is the slowest rank's median (a forward, or forward + backward), CUDA
synchronised and barrier-aligned before each run; the causal contiguous split leaves
rank N−1 with N times rank 0's work, which is that approach's cost.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, args, port, queue):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.gpus)
    from torch.distributed.nn.functional import all_gather
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    hq, hkv = (int(x) for x in args.heads.split(":"))
    n, s, d = args.gpus, args.seq, args.dim
    l = s // n
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    mk = lambda h: torch.randn(1, l, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(args.backward)
    q, k, v = mk(hq), mk(hkv), mk(hkv)
    do = torch.randn(1, l, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        ks = torch.cat(all_gather(k), dim=1)
        vs = torch.cat(all_gather(v), dim=1)
        end = (rank + 1) * l if args.causal else s
        kk = ks[:, :end].transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
        vv = vs[:, :end].transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
        qq = q.transpose(1, 2)
        mask = causal_lower_right(l, end) if args.causal else None
        o = sdpa(qq, kk, vv, attn_mask=mask)
        if args.backward:
            o.backward(do.transpose(1, 2))
        return o

    times = []
    for i in range(args.reps + 1):
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i > 0:
            times.append(time.perf_counter() - t)
    queue.put((rank, statistics.median(times)))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--heads", default="16:4")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.seq % args.gpus:
        sys.exit(f"--seq {args.seq} does not split over {args.gpus} GPUs")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=run, args=(r, args, port, queue)) for r in range(args.gpus)]
    for p in procs:
        p.start()
    res = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit("a rank failed")
    worst = max(res.values())
    row = {"anchor": "torch all-gather + SDPA", "gpus": args.gpus, "seq": args.seq, "heads": args.heads,
           "dim": args.dim, "causal": args.causal, "backward": args.backward, "s": worst,
           "ranks": [res[r] for r in sorted(res)]}
    print(json.dumps(row))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
