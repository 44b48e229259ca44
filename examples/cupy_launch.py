"""Launch an ejc PTX kernel from Python with CuPy, knowing nothing but the manifest.

    ejc build specs/flash.yaml --target ptx:sm_80 --variant causal --dtype bf16 --head-dim 128 -o out
    python3 examples/cupy_launch.py out            # on a machine with a GPU, torch and cupy
    python3 examples/cupy_launch.py out _ws        # the first artifact whose id contains `_ws`

The manifest (docs/abi.md) gives, per artifact: the PTX file and its entry symbol, the
parameters in order, the grid as formulas of the call's sizes, the block, and the
dynamic shared memory. A tensor parameter is passed as (pointer, shape[rank] int64,
strides[rank] int64), strides in elements; a scalar as its value (f32, or int32 for
i32/u32/i1). Where the artifact has an `aligned` entry, every tensor it names is aligned
(16-byte data address, last stride 1, other strides multiples of 8) and every scalar it
names is positive, that entry is called instead: same parameters, faster code. A
warp-specialised artifact's aligned entry also takes tensor maps after those parameters
(`aligned.tensor_maps`: `CUtensorMap`s encoded with the driver's cuTensorMapEncodeTiled,
passed by value; docs/abi.md, "Tensor maps"). The script runs one kernel on an awkward
shape and compares it with PyTorch's attention in float32; bench/compare_gpu.py uses the
same loader.
"""
import json
import math
import os
import re
import sys

import numpy as np

TORCH_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "i32": "int32"}


def load_manifest(build_dir):
    with open(os.path.join(build_dir, "manifest.json")) as fh:
        return json.load(fh)


def instance(a):
    """(variant, dtype, head_dim, role) of an artifact: `ejc-manifest/2` names the instance
    and the role; `ejc-manifest/1` (older builds, for side-by-side comparisons) had the
    flash fields at the top level and one role."""
    if "instance" in a:
        i = a["instance"]
        return i["variant"], i["dtype"], i.get("keys", {}).get("head_dim"), a["role"]
    return a["variant"], a["dtype"], a["head_dim"], "main"


def head_dims(a):
    """(q/k head dim, v head dim) of an artifact: the keys `head_dim` and, where v's
    differs, `head_dim_v`."""
    keys = a["instance"].get("keys", {}) if "instance" in a else {"head_dim": a["head_dim"]}
    return keys.get("head_dim"), keys.get("head_dim_v", keys.get("head_dim"))


def eval_grid(formula, sizes):
    """A size formula from the manifest (`cdiv(seq_q, 128)`, `mul(batch, num_splits)`,
    `add(a, b)`, `max(a, 1)`, `heads_q`, `7`; docs/abi.md)."""
    funcs = {"cdiv": lambda a, b: -(-a // b), "mul": lambda a, b: a * b, "add": lambda a, b: a + b, "max": max}
    expr = re.sub(r"[A-Za-z_][A-Za-z_0-9]*", lambda m: m.group(0) if m.group(0) in funcs else str(sizes[m.group(0)]), formula)
    return int(eval(expr, {"__builtins__": {}}, funcs))


# CUtensorMapDataType values (cuda.h).
TENSOR_MAP_DTYPES = {"bfloat16": 9, "float16": 6}


def encode_tensor_map(t, spec):
    """A CUtensorMap (128 bytes, as a NumPy structured scalar CuPy passes by value) for
    torch tensor `t` and a manifest `tensor_maps` entry: the tensor's shape and strides
    innermost first, the box, 128-byte swizzle, zero fill outside the tensor."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuTensorMapEncodeTiled
    f.restype = ctypes.c_int
    rank = t.dim()
    if spec["swizzle"] != "128B" or len(spec["box"]) != rank:
        raise ValueError(f"tensor map {spec}: not for a rank-{rank} tensor with 128B swizzle")
    dims = (ctypes.c_uint64 * rank)(*[max(1, n) for n in reversed(t.shape)])
    strides = (ctypes.c_uint64 * max(1, rank - 1))(*[s * t.element_size() for s in reversed(t.stride()[:-1])])
    box = (ctypes.c_uint32 * rank)(*reversed(spec["box"]))
    ones = (ctypes.c_uint32 * rank)(*([1] * rank))
    out = (ctypes.c_uint64 * 16)()
    dtype = TENSOR_MAP_DTYPES[str(t.dtype).replace("torch.", "")]
    # interleave none (0), swizzle 128B (3), L2 promotion 256B (3), zero fill (0)
    r = f(ctypes.byref(out), ctypes.c_int(dtype), ctypes.c_uint32(rank), ctypes.c_void_p(t.data_ptr()),
          dims, strides, box, ones, ctypes.c_int(0), ctypes.c_int(3), ctypes.c_int(3), ctypes.c_int(0))
    if r != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({r}) for {spec['tensor']} {tuple(t.shape)} {t.stride()}")
    return np.frombuffer(bytes(out), dtype=np.dtype([("opaque", np.uint64, (16,))]))[0]


class EjcKernel:
    """One PTX artifact, callable on torch tensors."""

    def __init__(self, build_dir, artifact):
        import cupy as cp

        self.a = artifact
        self.module = cp.RawModule(path=os.path.join(build_dir, artifact["file"]))
        self.smem = artifact["dynamic_shared_memory"]
        self.fn = self._function(artifact["entry"])
        aligned = artifact.get("aligned")
        self.aligned = aligned and (self._function(aligned["entry"]), aligned["tensors"], aligned.get("positive", []))
        self.tensor_maps = (aligned or {}).get("tensor_maps", [])
        self._maps = {}
        self.block = tuple(artifact["block"])

    def _function(self, entry):
        fn = self.module.get_function(entry)
        if self.smem > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = self.smem
        return fn

    @staticmethod
    def is_aligned(t):
        strides = t.stride()
        return (t.data_ptr() % 16 == 0 and (not strides or strides[-1] == 1)
                and all(s % 8 == 0 for s in strides[:-1]))

    def function(self, tensors, scalars):
        """The entry to call on these arguments: the aligned one when they allow it."""
        if (self.aligned and all(self.is_aligned(tensors[n]) for n in self.aligned[1])
                and all(scalars[n] > 0 for n in self.aligned[2])):
            return self.aligned[0]
        return self.fn

    def maps(self, tensors):
        """The aligned entry's tensor maps for these tensors (cached by address and layout)."""
        key = tuple((m["tensor"], tensors[m["tensor"]].data_ptr(), tuple(tensors[m["tensor"]].shape),
                     tensors[m["tensor"]].stride()) for m in self.tensor_maps)
        if key not in self._maps:
            self._maps = {key: [encode_tensor_map(tensors[m["tensor"]], m) for m in self.tensor_maps]}
        return self._maps[key]

    def args(self, tensors, scalars, fn=None):
        out = []
        for p in self.a["params"]:
            if p["kind"] == "tensor":
                t = tensors[p["name"]]
                if t.dim() != p["rank"]:
                    raise ValueError(f"{p['name']}: rank {t.dim()}, the kernel takes {p['rank']}")
                out.append(np.uint64(t.data_ptr()))
                out.extend(np.int64(s) for s in t.shape)
                out.extend(np.int64(s) for s in t.stride())
            elif p["dtype"] == "f32":
                out.append(np.float32(scalars[p["name"]]))
            else:
                out.append(np.int32(scalars[p["name"]]))
        if self.tensor_maps and self.aligned and fn is self.aligned[0]:
            out.extend(self.maps(tensors))
        return tuple(out)

    def grid(self, sizes):
        return tuple(eval_grid(g, sizes) for g in self.a["grid"])

    def __call__(self, tensors, scalars, sizes):
        fn = self.function(tensors, scalars)
        fn(self.grid(sizes), self.block, self.args(tensors, scalars, fn), shared_mem=self.smem)


def flash_sizes(q, k, v=None):
    b, sq, hq, d = q.shape
    dv = d if v is None else v.shape[3]
    return dict(batch=b, seq_q=sq, seq_k=k.shape[1], heads_q=hq, heads_kv=k.shape[2], head_dim=d, head_dim_v=dv)


def reference(q, k, v, causal, window=None, softcap=None):
    """float32 attention in [B, S, H, D], bottom-right aligned causal mask, GQA; an
    inclusive (left, right) window around the shifted diagonal and a logit soft cap
    c · tanh(s / c) as docs/semantics.md defines them."""
    import torch

    hq, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    qt, kt, vt = (x.transpose(1, 2).float() for x in (q, k, v))
    s = qt @ kt.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = s.shape[-2], s.shape[-1]
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    if causal:
        s = s.masked_fill(j > i, float("-inf"))
    if window is not None:
        s = s.masked_fill((j < i - window[0]) | (j > i + window[1]), float("-inf"))
    return (s.softmax(-1) @ vt).transpose(1, 2)


def main():
    import torch

    build_dir = sys.argv[1] if len(sys.argv) > 1 else "out"
    m = load_manifest(build_dir)
    major, minor = torch.cuda.get_device_capability()
    arts = [a for a in m["artifacts"] if a["target"] == "ptx:sm_80" or (a["target"] == "ptx:sm_90a" and (major, minor) == (9, 0))]
    arts = [a for a in arts if instance(a)[3] == "main" and instance(a)[0] in ("full", "causal")
            and instance(a)[1] in ("bf16", "f16")]
    if len(sys.argv) > 2:  # an artifact id substring: e.g. `_ws` for a warp-specialised one
        arts = [a for a in arts if sys.argv[2] in a["artifact_id"]]
    if not arts:
        sys.exit("no full/causal bf16/f16 PTX artifact in " + build_dir)
    a = arts[0]
    variant, dtype, d, _ = instance(a)
    causal = variant == "causal"
    dt = getattr(torch, TORCH_DTYPES[dtype])
    torch.manual_seed(0)
    b, sq, sk, hq, hkv = 2, 300, 301, 8, 2  # not block multiples, GQA 4:1
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt)
    kern = EjcKernel(build_dir, a)
    tol = 1e-2 if dtype == "bf16" else 5e-3
    worst = 0.0
    # Contiguous tensors (the aligned entry, where the artifact has one), then K and V
    # as views with a row stride that is not a multiple of 8 (the general entry).
    k_odd = torch.randn(b, sk, hkv, d + 1, device="cuda", dtype=dt)[..., :d]
    v_odd = torch.randn(b, sk, hkv, d + 1, device="cuda", dtype=dt)[..., :d]
    for name, kk, vv in (("contiguous", k, v), ("strided k/v", k_odd, v_odd)):
        out = torch.empty_like(q)
        lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
        tensors = dict(q=q, k=kk, v=vv, out=out, lse=lse)
        scalars = dict(softmax_scale=1.0 / math.sqrt(d))
        entry = "aligned" if kern.function(tensors, scalars) is not kern.fn else "general"
        kern(tensors, scalars, flash_sizes(q, kk))
        torch.cuda.synchronize()
        want = reference(q, kk, vv, causal)
        err = ((out.float() - want).norm() / want.norm()).item()
        worst = max(worst, err)
        print(f"{a['artifact_id']} ({name}, {entry} entry): rel_err {err:.2e} (tolerance {tol})")
    sys.exit(0 if worst <= tol else 1)

if __name__ == "__main__":
    main()
