"""The backward plans' timing, shared by bench/compare_gpu_bwd.py and bench/compare_gpu_dbias.py.

For one variant and head dim, every role of each plan is timed over every candidate of the build
(triton's do_bench, median), the fastest of each kept: a plan's time is their sum.
"""
import json
import time

import torch
from triton.testing import do_bench

from cupy_launch import EjcKernel, head_dims, instance, load_manifest

PLANS = {"two_pass": ("preprocess", "dkdv", "dq"), "atomic": ("preprocess_dq", "dkdv_dq", "dq_convert")}


def artifacts(builds):
    """[(build dir, artifact)] of the PTX artifacts of `builds` (ejc build output folders)."""
    arts = []
    for b in builds:
        m = load_manifest(b)
        arts += [(b, a) for a in m["artifacts"] if a["target"] in ("ptx:sm_90a", "ptx:sm_80")]
    return arts


def ratio(row, anchor):
    """ejc's TFLOP/s over an anchor's in a bench row, as `1.23x`, or `-` when either is missing."""
    return f"{row['ejc'] / row[anchor]:.2f}x" if "ejc" in row and anchor in row else "-"


def save(path, device, rows):
    """The rows so far as JSON (rewritten after every row: an interrupted run keeps what it measured)."""
    if path:
        with open(path, "w") as fh:
            json.dump(dict(device=device, rows=rows), fh, indent=1)


def rel(a, b):
    """||a - b|| / ||b||, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def time_plans(arts, kernels, variant, d, t, scalars, sizes, verbose=False):
    """{plan: (ms, {role: (kernel, ms, artifact id)})} for the plans whose every role has a
    candidate. `arts` is [(build dir, artifact)]; `kernels` caches loaded kernels by artifact id
    across calls. A candidate whose one launch takes 20x the best so far (and over 50 ms: a
    spilling tile in a sweep) is skipped instead of stalling the run."""
    plans = {}
    for plan, roles in PLANS.items():
        best = {}
        for role in roles:
            for bd, a in arts:
                if instance(a) != (variant, "bf16", d, role) or head_dims(a) != (d, d):
                    continue
                key = a["artifact_id"]
                if key not in kernels:
                    try:
                        kernels[key] = EjcKernel(bd, a)
                    except Exception as e:
                        print(f"  {key}: cannot load: {e}", flush=True)
                        kernels[key] = None
                kern = kernels[key]
                if kern is None:
                    continue
                try:
                    kern(t, scalars, sizes)  # loads the module (the driver's JIT)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    kern(t, scalars, sizes)
                    torch.cuda.synchronize()
                    once = (time.perf_counter() - t0) * 1e3
                    if role in best and once > max(20 * best[role][1], 50.0):
                        print(f"  {key}: {once:.1f} ms for one launch, skipped", flush=True)
                        continue
                    ms = do_bench(lambda: kern(t, scalars, sizes), warmup=5, rep=40, return_mode="median")
                except Exception as e:
                    print(f"  {key}: failed: {e}", flush=True)
                    continue
                if verbose:
                    print(f"  {key}: {ms:.3f} ms", flush=True)
                if role not in best or ms < best[role][1]:
                    best[role] = (kern, ms, key)
        if len(best) == len(roles):
            plans[plan] = (sum(best[r][1] for r in roles), best)
    return plans
