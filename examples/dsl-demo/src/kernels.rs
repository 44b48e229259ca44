//! The crate's kernels and attention mods, in ejc's tile DSL. This file is compiled
//! twice: into the library (launch wrappers, mods as host functions) and into
//! `build.rs` (which compiles the kernels to a CPU library at build time).

use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

/// `out = alpha · (a · b)`, then `max(out, 0)` when `relu`: `a` is `[M, K]`, `b` is
/// `[K, N]`; one program per `BM × BN` tile of `out`, `K` in steps of `BK`.
#[ej_kernel(bm = 32, bn = 32, bk = 16)]
pub fn scaled_matmul(a: Tensor<f32, 2>, b: Tensor<f32, 2>, out: Tensor<f32, 2>, alpha: f32, relu: bool) {
    let m0 = program_id(0) * BM;
    let n0 = program_id(1) * BN;
    let m = dim(a, 0);
    let n = dim(b, 1);
    let k = dim(a, 1);
    let mut acc = full([BM, BN], 0.0);
    for k0 in range(0, k, BK) {
        let a_tile = load(a, [span(m0, BM, m), span(k0, BK, k)]);
        let b_tile = load(b, [span(k0, BK, k), span(n0, BN, n)]);
        acc = dot(a_tile, b_tile, acc);
    }
    acc = acc * alpha;
    if relu {
        acc = maximum(acc, full([BM, BN], 0.0));
    }
    store(out, [span(m0, BM, m), span(n0, BN, n)], acc);
}

/// `out = a · b` for 16-bit `a` `[M, K]` and `b` `[K, N]`, accumulated and stored in
/// f32: one body, two kernels (`matmul_bf16`, `matmul_f16`); the products run on tensor
/// cores on a GPU (`mma.sync`, `wgmma` on Hopper). Tuned: the tile (`BM × BN`, the
/// default 128 × 128 first) on both devices, warps and pipeline depth on the GPU; the
/// launch's grid follows the chosen tile (`matmul_bf16::launch_tuned`).
#[ej_kernel(tune(bm = [128, 64], bn = [128, 256], warps = [8, 4], stages = [2, 3]), bk = 64, dtypes(T = [Bf16, F16]))]
pub fn matmul<T: Elem>(a: Tensor<T, 2>, b: Tensor<T, 2>, out: Tensor<f32, 2>) {
    let m0 = program_id(0) * BM;
    let n0 = program_id(1) * BN;
    let m = dim(a, 0);
    let n = dim(b, 1);
    let k = dim(a, 1);
    let mut acc = full([BM, BN], 0.0);
    for k0 in range(0, k, BK) {
        // Each tile bounded by its own tensor's extents: on Hopper the copy engine
        // (TMA, warp-specialised points) can then fetch it, zero-filling the edges.
        let a_tile = load(a, [span(m0, BM, m), span(k0, BK, k)]);
        let b_tile = load(b, [span(k0, BK, dim(b, 0)), span(n0, BN, n)]);
        acc = dot(a_tile, b_tile, acc);
    }
    store(out, [span(m0, BM, m), span(n0, BN, n)], acc);
}

/// Row-wise softmax of `x` (`[R, C]`, any `C`), in f32 inside and `T` outside
/// (`softmax_f32`, `softmax_bf16`): one program per `BR` rows, two passes over the
/// columns in blocks of `BC` (online max and sum, then normalise); both tuned.
#[ej_kernel(tune(br = [16, 64], bc = [32, 64, 128]), dtypes(T = [f32, Bf16]))]
pub fn softmax<T: Elem>(x: Tensor<T, 2>, out: Tensor<T, 2>) {
    let r0 = program_id(0) * BR;
    let rows = dim(x, 0);
    let cols = dim(x, 1);
    let mut m_i = full1(BR, f32::NEG_INFINITY);
    let mut l_i = full1(BR, 0.0);
    for c0 in range(0, cols, BC) {
        let s = load_pad(x, [span(r0, BR, rows), span(c0, BC, cols)], f32::NEG_INFINITY).cast::<f32>();
        let m_new = maximum(m_i, max_along(s, 1));
        let p = exp(s - m_new.expand(1));
        l_i = l_i * exp(m_i - m_new) + sum(p, 1);
        m_i = m_new;
    }
    for c0 in range(0, cols, BC) {
        let s = load_pad(x, [span(r0, BR, rows), span(c0, BC, cols)], f32::NEG_INFINITY).cast::<f32>();
        let p = exp(s - m_i.expand(1)) / l_i.expand(1);
        store(out, [span(r0, BR, rows), span(c0, BC, cols)], p.cast::<T>());
    }
}

/// RMSNorm of every row of `x` (`[R, C]`, any `C`), scaled by `w` (`[C]`): `out = x /
/// sqrt(mean(x²) + eps) · w`, in f32 inside, in `T` outside (`rms_norm_f32`,
/// `rms_norm_bf16`). One program per `BR` rows, two passes over the columns in blocks
/// of `BC`; both are tuned.
#[ej_kernel(tune(br = [16, 64, 128], bc = [128, 64]), dtypes(T = [f32, Bf16]))]
pub fn rms_norm<T: Elem>(x: Tensor<T, 2>, w: Tensor<T, 1>, out: Tensor<T, 2>, eps: f32) {
    let r0 = program_id(0) * BR;
    let rows = dim(x, 0);
    let cols = dim(x, 1);
    let mut ss = full1(BR, 0.0);
    for c0 in range(0, cols, BC) {
        let t = load(x, [span(r0, BR, rows), span(c0, BC, cols)]).cast::<f32>();
        ss += sum(t * t, 1);
    }
    let inv = 1.0 / sqrt(ss / cols as f32 + eps);
    for c0 in range(0, cols, BC) {
        let t = load(x, [span(r0, BR, rows), span(c0, BC, cols)]).cast::<f32>();
        let g = load(w, [span(c0, BC, cols)]).cast::<f32>();
        store(out, [span(r0, BR, rows), span(c0, BC, cols)], (t * inv.expand(1) * g).cast::<T>());
    }
}

/// `out += alpha · x` over rank-1 tensors, one program per `B` elements (tuned). It
/// reads its output: tuning must put `out` back before the chosen point runs.
#[ej_kernel(tune(b = [128, 1024]))]
pub fn accumulate(x: Tensor<f32, 1>, out: Tensor<f32, 1>, alpha: f32) {
    let i0 = program_id(0) * B;
    let n = dim(x, 0);
    let mut acc = load(out, [span(i0, B, n)]);
    acc += load(x, [span(i0, B, n)]) * alpha;
    store(out, [span(i0, B, n)], acc);
}

/// Prefix-LM: every query sees the first `PREFIX` keys, and the keys up to itself.
/// A disjunction: not affine, so the flash kernel applies it on every block.
#[ej_kernel(mask_mod, prefix = 24)]
pub fn prefix_lm(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
    kv_idx <= q_idx || kv_idx < PREFIX
}

/// Causal attention to the last `WINDOW` keys: affine in the indices, so the flash
/// kernel skips the blocks it hides.
#[ej_kernel(mask_mod, window = 40)]
pub fn causal_window(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
    kv_idx <= q_idx && q_idx - kv_idx < WINDOW
}

/// Document masking, FlexAttention's most common mod: a query sees the keys of its own
/// document, up to itself. `doc[[b, i]]` is the document of token `i` of batch entry `b`
/// (a tensor the flash kernel takes as a parameter named `doc`).
#[ej_kernel(mask_mod)]
pub fn document_causal(b: i32, _h: i32, q_idx: i32, kv_idx: i32, doc: Tensor<i32, 2>) -> bool {
    doc[[b, q_idx]] == doc[[b, kv_idx]] && kv_idx <= q_idx
}

/// ALiBi with learned (or any) per-head slopes, read from a tensor `slopes[h]`.
#[ej_kernel(score_mod)]
pub fn alibi_slopes(score: f32, _b: i32, h: i32, q_idx: i32, kv_idx: i32, slopes: Tensor<f32, 1>) -> f32 {
    score - slopes[h] * (q_idx - kv_idx) as f32
}

/// ALiBi: scores fall linearly with distance, with per-head slopes `2^(-8(h+1)/HEADS)`.
#[ej_kernel(score_mod, heads = 4)]
pub fn alibi(score: f32, _b: i32, h: i32, q_idx: i32, kv_idx: i32) -> f32 {
    let slope = exp2(-8.0 * (h + 1) as f32 / HEADS as f32);
    score - slope * (q_idx - kv_idx) as f32
}
