"""Probe Hopper's wgmma on the GPU at hand: which shared-memory layouts and descriptor
fields give the product the PTX back end expects (run on an sm_90 GPU with CuPy).

    python3 scripts/probe_wgmma.py

For B operands without swizzling, a "core matrix" is 8 rows x 16 bytes stored as 128
contiguous bytes. The probe stores B tiles as

    K-major (B[k][n] = T[n][k], T's rows n with k contiguous; S = Q K^T):
        offset(n, k) = (n / 8) * SBO + (k / 8) * LBO + (n % 8) * 16 + (k % 8) * 2
    MN-major (B[k][n] = V[k][n], n contiguous; O = P V), transposed by the instruction:
        offset(k, n) = (k / 8) * X + (n / 8) * Y + (k % 8) * 16 + (n % 8) * 2

and tries the descriptor's (LBO, SBO) both ways for the MN-major case. Modes 3-5 do the
same for the 128-byte swizzle (docs/gpu.md): 64-column blocks of 128-byte rows, the
16-byte chunk c of row r stored at chunk c ^ (r % 8), blocks 1024-byte aligned:

    K-major (mode 3): offset(n, k) = (k / 64) * (N / 8) * 1024 + n * 128 + (((k % 64) / 8) ^ (n % 8)) * 16 + (k % 8) * 2
                      descriptor of k-step ks: start + (ks / 4) * (N / 8) * 1024 + (ks % 4) * 32, LBO 16, SBO 1024
    MN-major (4, 5):  offset(k, n) = (n / 64) * (K / 8) * 1024 + k * 128 + (((n % 64) / 8) ^ (k % 8)) * 16 + (n % 8) * 2
                      descriptor of k-step ks: start + ks * 2048, (LBO, SBO) = ((K / 8) * 1024, 1024) or swapped A comes from
registers in the mma.m16n8k16 A-fragment layout (warp w of the warpgroup owns rows
16w..16w+15); D is read back in the accumulator layout (thread's n8 block j holds
rows 16w + lane/4 (+8), columns 8j + 2 (lane % 4) (+1)).
"""
import sys

import cupy as cp
import numpy as np

SRC = r"""
#include <cuda_bf16.h>
extern "C" __device__ unsigned long long desc(const void* smem, unsigned lbo, unsigned sbo, int sw = 0) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    unsigned long long d = 0;
    d |= (unsigned long long)((addr >> 4) & 0x3FFF);
    d |= (unsigned long long)((lbo >> 4) & 0x3FFF) << 16;
    d |= (unsigned long long)((sbo >> 4) & 0x3FFF) << 32;
    if (sw) d |= 1ull << 62;  // 128-byte swizzle
    return d;  // base offset 0
}
__device__ unsigned pack(const __nv_bfloat16* p) {
    return *(const unsigned*)p;
}
#define N NVAL
#define KS KSVAL
// MODE 0: K-major B (T[n][k] given), trans-b 0. MODE 1/2: MN-major B (B[k][n] given), trans-b 1,
// with (LBO, SBO) = (X, Y) for MODE 1 and (Y, X) for MODE 2.
extern "C" __global__ void probe(const __nv_bfloat16* A, const __nv_bfloat16* Bg, float* D) {
    extern __shared__ __align__(1024) unsigned char smem[];
    int tid = threadIdx.x, w = tid / 32, l = tid % 32;
    const int K = 16 * KS;
    // Fill shared memory with the layout under test.
    for (int i = tid; i < N * K; i += 128) {
        int off;
        if (MODE == 0) {  // Bg is T[n][k]
            int n = i / K, k = i % K;
            int sbo = (K / 8) * 128, lbo = 128;
            off = (n / 8) * sbo + (k / 8) * lbo + (n % 8) * 16 + (k % 8) * 2;
        } else if (MODE == 3) {  // Bg is T[n][k], 128-byte swizzle
            int n = i / K, k = i % K;
            off = (k / 64) * (N / 8) * 1024 + n * 128 + ((((k % 64) / 8) ^ (n % 8)) * 16) + (k % 8) * 2;
        } else if (MODE >= 4) {  // Bg is B[k][n], 128-byte swizzle
            int k = i / N, n = i % N;
            off = (n / 64) * (K / 8) * 1024 + k * 128 + ((((n % 64) / 8) ^ (k % 8)) * 16) + (n % 8) * 2;
        } else {          // Bg is B[k][n]
            int k = i / N, n = i % N;
            int X = (N / 8) * 128, Y = 128;   // k8-groups outer, n-chunks inner
            off = (k / 8) * X + (n / 8) * Y + (k % 8) * 16 + (n % 8) * 2;
        }
        *(__nv_bfloat16*)(smem + off) = Bg[i];
    }
    __syncthreads();
    float d[N / 2];
    for (int i = 0; i < N / 2; i++) d[i] = 0.f;
    for (int ks = 0; ks < KS; ks++) {
        int r0 = 16 * w + l / 4, c0 = 16 * ks + 2 * (l % 4);
        unsigned a0 = pack(A + r0 * K + c0), a1 = pack(A + (r0 + 8) * K + c0);
        unsigned a2 = pack(A + r0 * K + c0 + 8), a3 = pack(A + (r0 + 8) * K + c0 + 8);
        unsigned long long db;
        if (MODE == 0) db = desc(smem + ks * 2 * 128, 128, (K / 8) * 128);
        else if (MODE == 1) db = desc(smem + ks * 2 * (N / 8) * 128, (N / 8) * 128, 128);
        else if (MODE == 3) db = desc(smem + (ks / 4) * (N / 8) * 1024 + (ks % 4) * 32, 16, 1024, 1);
        else if (MODE == 4) db = desc(smem + ks * 2048, (K / 8) * 1024, 1024, 1);
        else if (MODE == 5) db = desc(smem + ks * 2048, 1024, (K / 8) * 1024, 1);
        else db = desc(smem + ks * 2 * (N / 8) * 128, 128, (N / 8) * 128);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        WGMMA_CALL
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    for (int j = 0; j < N / 8; j++) {
        int r0 = 16 * w + l / 4, c = 8 * j + 2 * (l % 4);
        D[r0 * N + c] = d[4 * j]; D[r0 * N + c + 1] = d[4 * j + 1];
        D[(r0 + 8) * N + c] = d[4 * j + 2]; D[(r0 + 8) * N + c + 1] = d[4 * j + 3];
    }
}
"""


def wgmma_call(n, trans_b):
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    a = ", ".join(f"%{n // 2 + i}" for i in range(4))
    dd = n // 2 + 4
    asm = ("{\\n.reg .pred p;\\nsetp.ne.b32 p, %" + str(dd + 1) + ", 0;\\n"
           f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, {{{a}}}, %{dd}, p, 1, 1, {trans_b};\\n}}\\n")
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    return f'asm volatile("{asm}" : {outs} : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1) : "memory");'


def run(mode, n, ks):
    src = SRC.replace("NVAL", str(n)).replace("KSVAL", str(ks)).replace("MODE", str(mode))
    src = src.replace("WGMMA_CALL", wgmma_call(n, 0 if mode in (0, 3) else 1))
    mod = cp.RawModule(code=src, options=("--gpu-architecture=sm_90a", "-std=c++17"))
    f = mod.get_function("probe")
    k = 16 * ks
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    import torch

    at = torch.tensor(a).to(torch.bfloat16)
    bt = torch.tensor(b).to(torch.bfloat16)
    want = (at.float() @ bt.float()).numpy()
    bg = bt.t().contiguous() if mode in (0, 3) else bt.contiguous()
    A = cp.asarray(at.view(torch.int16).numpy())
    B = cp.asarray(bg.view(torch.int16).numpy())
    D = cp.zeros((64, n), dtype=cp.float32)
    f((1,), (128,), (A, B, D), shared_mem=n * k * 2)
    got = cp.asnumpy(D)
    err = np.abs(got - want).max() / np.abs(want).max()
    return err


def main():
    if len(sys.argv) == 4 and sys.argv[1] != "--swizzle":  # one configuration, in its own process (a fault poisons the context)
        mode, n, ks = map(int, sys.argv[1:])
        print(f"{run(mode, n, ks):.3e}")
        return 0
    import subprocess
    names = {0: "K-major B: LBO=128 (k-chunks), SBO=(K/8)*128 (n-groups), trans-b 0",
             1: "MN-major B: LBO=(N/8)*128 (k-groups), SBO=128 (n-chunks), trans-b 1",
             2: "MN-major B: LBO=128 (n-chunks), SBO=(N/8)*128 (k-groups), trans-b 1",
             3: "K-major B, 128B swizzle: LBO=16, SBO=1024, k-step start +32 B within a 64-column block",
             4: "MN-major B, 128B swizzle: LBO=(K/8)*1024 (64-column blocks), SBO=1024 (k-groups)",
             5: "MN-major B, 128B swizzle: LBO=1024, SBO=(K/8)*1024 (swapped)"}
    modes = (3, 4, 5) if "--swizzle" in sys.argv else (0, 1, 2, 3, 4, 5)
    for mode in modes:
        for n, ks in [(64, 4), (128, 4), (64, 8), (128, 8)]:
            r = subprocess.run([sys.executable, __file__, str(mode), str(n), str(ks)], capture_output=True, text=True)
            out = (r.stdout.strip().splitlines() or [""])[-1]
            err = [l for l in r.stderr.strip().splitlines() if "Error" in l or "error" in l][:1]
            print(f"mode {mode} n={n} k={16 * ks}: {out if r.returncode == 0 else 'FAILED ' + ' '.join(err)}  ({names[mode]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
