#!/usr/bin/env python3
"""ejc's CPU kernels against PyTorch's CPU scaled_dot_product_attention, side by side.

One run, one machine, the same input tensors for both: ejc's kernels come from the
shared library that `ejc build --target cpu` writes and are launched on torch's tensors
through the C ABI that manifest.json describes (docs/abi.md), from ctypes. The grid runs
on ejc's own thread pool through libejc_runtime_capi.so's C entry point (the pool `ejc bench`
uses), so Python's threads do not stand between the kernel and the clock.

    python3 bench/compare_cpu.py                  # the full table (b=1, h=8, 2 threads)
    python3 bench/compare_cpu.py --quick          # s in {512, 1024} only
    python3 bench/compare_cpu.py --markdown       # a table for docs/perf.md
    python3 bench/compare_cpu.py --target cpu:amx # a named ISA's library (default: the host's)
    python3 bench/compare_cpu.py --threads 1,16   # several thread counts: the table per count,
                                                  # then the 1 -> N scaling of both sides
    # on a machine without Rust (the GPU host): a prebuilt compiler and runtime
    python3 bench/compare_cpu.py --ejc ./ejc --runtime ./libejc_runtime_capi.so

For each row, every tiling the spec offers is probed once and the fastest is timed (what
the autotuner does); each side's time is the median of --reps runs after a warm-up. Each
row also checks that ejc's output matches torch's (relative error within DESIGN.md's
tolerance). FLOPs: 4*b*h*s*s*d, halved for causal (ANCHORS.md).
Needs: torch (CPU); the script builds ejc itself (cargo build --release).
"""
import argparse
import ctypes
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class EjcTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("shape", ctypes.c_int64 * 4), ("strides", ctypes.c_int64 * 4)]


ENTRY = ctypes.CFUNCTYPE(None, ctypes.POINTER(EjcTensor), ctypes.POINTER(ctypes.c_uint64),
                         ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)


def abi_tensor(t):
    x = EjcTensor()
    x.data = t.data_ptr()
    for i in range(4):
        x.shape[i] = t.shape[i] if i < t.dim() else 1
        x.strides[i] = t.stride(i) if i < t.dim() else 0
    return x


def grid_value(expr, syms):
    """Evaluate a manifest size formula: a number, a symbol, cdiv(e, n), mul(e, e),
    add(e, e) or max(e, e) (docs/abi.md)."""
    funcs = {"cdiv": lambda a, b: -(-a // b), "mul": lambda a, b: a * b, "add": lambda a, b: a + b, "max": max}
    text = re.sub(r"[A-Za-z_][A-Za-z_0-9]*", lambda m: m.group(0) if m.group(0) in funcs else str(syms[m.group(0)]), expr)
    return int(eval(text, {"__builtins__": {}}, funcs))


class Kernel:
    """One artifact of the manifest, callable from Python on torch tensors."""

    def __init__(self, lib, artifact):
        self.a = artifact
        self.fn = ENTRY((artifact["entry"], lib))
        self.scratch = artifact.get("scratch_bytes", 0)

    def __call__(self, q, k, v, out, lse, scale, threads):
        tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
        tabs = [abi_tensor(tensors[p["name"]]) for p in self.a["params"] if p["kind"] == "tensor"]
        tab = (EjcTensor * len(tabs))(*tabs)
        scalars = []
        for p in self.a["params"]:
            if p["kind"] != "scalar":
                continue
            if p["name"] != "softmax_scale":
                raise SystemExit(f"this script benchmarks plain variants; `{p['name']}` is not supported")
            scalars.append(int.from_bytes(torch.tensor([scale], dtype=torch.float32).numpy().tobytes(), "little"))
        sc = (ctypes.c_uint64 * max(1, len(scalars)))(*scalars)
        b, s, h, d = q.shape
        syms = {"batch": b, "seq_q": s, "seq_k": k.shape[1], "heads_q": h, "heads_kv": k.shape[2], "head_dim": d}
        g = [grid_value(e, syms) for e in self.a["grid"]]
        grid = (ctypes.c_int64 * 3)(*g)
        rc = RUNTIME.ejc_cpu_launch(self.fn, tab, sc, grid, ctypes.c_uint64(self.scratch), ctypes.c_uint32(threads))
        if rc != 0:
            raise SystemExit(f"ejc_cpu_launch failed ({rc})")


def median_time(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


RUNTIME = None


def main():
    global RUNTIME
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ejc", default=os.path.join(ROOT, "target/release/ejc"))
    ap.add_argument("--out", default=os.path.join(ROOT, "out/bench-cpu"))
    ap.add_argument("--threads", default="2", help="thread count, or several separated by commas")
    ap.add_argument("--target", default="cpu", help="ejc build target: cpu (the host's ISA) or cpu:ISA")
    ap.add_argument("--runtime", help="a prebuilt libejc_runtime_capi.so (then nothing is built with cargo)")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--seqs", help="sequence lengths, comma-separated (default 512,1024,2048,4096)")
    ap.add_argument("--dims", default="64,128", help="head dims, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    dtypes = [d for d in (("f32", torch.float32), ("bf16", torch.bfloat16)) if d[0] in args.dtypes.split(",")]

    runtime = args.runtime
    if runtime is None:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "ejc", "-p", "ejc-runtime-capi"], cwd=ROOT, check=True)
        runtime = os.path.join(ROOT, "target/release/libejc_runtime_capi.so")
    RUNTIME = ctypes.CDLL(os.path.abspath(runtime))
    RUNTIME.ejc_cpu_launch.argtypes = [ENTRY, ctypes.POINTER(EjcTensor), ctypes.POINTER(ctypes.c_uint64),
                                       ctypes.POINTER(ctypes.c_int64), ctypes.c_uint64, ctypes.c_uint32]
    RUNTIME.ejc_cpu_launch.restype = ctypes.c_int32
    build = [args.ejc, "build", os.path.join(ROOT, "specs/flash.yaml"), "-o", args.out, "--target", args.target, "-q",
             "--variant", "full", "--variant", "causal", "--dtype", "f32", "--dtype", "bf16"]
    subprocess.run(build, check=True)
    manifest = json.load(open(os.path.join(args.out, "manifest.json")))
    libs = {}
    kernels = {}
    for a in manifest["artifacts"]:
        path = os.path.join(args.out, a["file"])
        if path not in libs:
            libs[path] = ctypes.CDLL(path)
        i = a["instance"]
        kernels.setdefault((i["variant"], i["dtype"], i["keys"]["head_dim"]), []).append(Kernel(libs[path], a))
    isa = manifest["artifacts"][0]["target"]
    seqs = [512, 1024] if args.quick else [512, 1024, 2048, 4096]
    if args.seqs:
        seqs = [int(x) for x in args.seqs.split(",")]
    rows = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        print(f"# torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), ejc {manifest['compiler']['version']} "
              f"({isa}), b=1 h=8, {threads} threads", file=sys.stderr)
        for d in [int(x) for x in args.dims.split(",")]:
            for s in seqs:
                for causal in (False, True):
                    for dt_name, dt in dtypes:
                        rows.append(measure(kernels, d, s, causal, dt_name, dt, threads, args.reps))
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    if args.markdown:
        for threads in thread_counts:
            print(f"\n{threads} thread(s):\n")
            print("| d | causal | seq | dtype | ejc GFLOP/s | torch SDPA GFLOP/s | ratio | ejc tiling |")
            print("|---|---|---|---|---|---|---|---|")
            for r in rows:
                if r["threads"] == threads:
                    print(f"| {r['d']} | {r['causal']} | {r['s']} | {r['dtype']} | {r['ejc_gflops']:.0f} | "
                          f"{r['torch_gflops']:.0f} | {r['ratio']:.2f} | {r['tiling']} |")
    if len(thread_counts) > 1:
        lo, hi = min(thread_counts), max(thread_counts)
        print(f"\nThread scaling {lo} -> {hi}: efficiency = t({lo}) * {lo} / (t({hi}) * {hi})\n")
        print("| d | causal | seq | dtype | ejc efficiency | torch efficiency |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if r["threads"] != lo:
                continue
            h = next(x for x in rows if x["threads"] == hi and all(x[k] == r[k] for k in ("d", "s", "causal", "dtype")))
            e = r["ejc_ms"] * lo / (h["ejc_ms"] * hi)
            t = r["torch_ms"] * lo / (h["torch_ms"] * hi)
            print(f"| {r['d']} | {r['causal']} | {r['s']} | {r['dtype']} | {e:.2f} | {t:.2f} |")
    if not all(r["ok"] for r in rows):
        sys.exit("some ejc outputs did not match torch")


def measure(kernels, d, s, causal, dt_name, dt, threads, reps):
    """One row: the fastest tiling of ejc against torch SDPA, on the same tensors."""
    torch.manual_seed(s * 7 + d)
    q, k, v = (torch.randn(1, s, 8, d).to(dt) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    out = torch.empty_like(q)
    lse = torch.empty(1, 8, s, dtype=torch.float32)
    cands = kernels[("causal" if causal else "full", dt_name, d)]
    probe = [(median_time(lambda kk=kk: kk(q, k, v, out, lse, scale, threads), 2), kk) for kk in cands]
    best = min(probe, key=lambda x: x[0])[1]
    out.fill_(float("nan"))
    best(q, k, v, out, lse, scale, threads)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    tol = 1e-2 if dt_name == "bf16" else 1e-5
    t_ejc = median_time(lambda: best(q, k, v, out, lse, scale, threads), reps)
    t_torch = median_time(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), reps)
    fl = 4 * 8 * s * s * d / (2 if causal else 1)
    row = {"threads": threads, "d": d, "s": s, "causal": int(causal), "dtype": dt_name, "ejc_ms": t_ejc * 1e3,
           "torch_ms": t_torch * 1e3, "ejc_gflops": fl / t_ejc / 1e9, "torch_gflops": fl / t_torch / 1e9,
           "ratio": t_torch / t_ejc, "tiling": f"{best.a['config']['block_m']}x{best.a['config']['block_n']}",
           "rel_err": rel, "ok": rel <= tol}
    print(f"t={threads:2d} d={d:3d} s={s:5d} causal={int(causal)} {dt_name:4s}  ejc {row['ejc_gflops']:7.1f}  "
          f"torch {row['torch_gflops']:7.1f} GFLOP/s  ratio {row['ratio']:.2f}  tiling {row['tiling']}  "
          f"rel_err {rel:.1e}{'' if row['ok'] else '  MISMATCH'}", flush=True)
    return row


if __name__ == "__main__":
    main()
