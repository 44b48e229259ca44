//! The tile programs of paged decode attention: the one-kernel plan's `main`, and
//! split-K's `partial` and `combine`.
//!
//! ```
//! use ejc_ir::ops::page_attention::kernels::{build, PagedKernel, Role};
//! use ejc_ir::types::DType;
//!
//! let k = PagedKernel { role: Role::Partial, soft_cap: true, dtype: DType::BF16, head_dim: 64, block_h: 16, block_n: 32 };
//! let kernel = build("paged_partial", &k).unwrap();
//! let names: Vec<&str> = kernel.params.iter().map(|p| p.name.as_str()).collect();
//! assert_eq!(
//!     names,
//!     ["query", "key_cache", "value_cache", "context_lens", "block_tables", "o_partial", "lse_partial",
//!      "softmax_scale", "logits_soft_cap", "num_splits"]
//! );
//! assert_eq!(kernel.grid[0].to_string(), "mul(heads_kv, cdiv(group, 16))");
//! ```
//!
//! # Semantics
//!
//! One query token per sequence (decode). Sequence `s` has `context_lens[s] = L_s` keys;
//! its key `j` (0 ≤ j < L_s) lives in page `block_tables[s, j / P]`, row `j mod P` of
//! `key_cache` / `value_cache [num_pages, KVH, P, D]` (P, the page size, is the caches'
//! third extent, any value from 1). Query head `h` of `query [S, H, D]` reads KV head
//! `h / (H / KVH)`. With `x = softmax_scale · q·k_j` (then `c · tanh(x / c)` with a soft
//! cap `c`), `out[s, h] = Σ_j softmax(x)_j · v_j`, in f32, stored in the dtype. A sequence
//! with `L_s = 0` gets 0. Only the first `ceil(L_s / P)` entries of a block-table row are
//! read; pages may be shared between sequences.
//!
//! # Tile program
//!
//! **GQA packing**: one program serves `block_h` query heads of one KV head (its group,
//! `G = H / KVH`, in `cdiv(G, block_h)` programs), so the group's keys and values are
//! read once: its tile is `[block_h, D]` query heads × head dim, rows past the group
//! padded. It walks the sequence's keys in blocks of `block_n` that never cross a page:
//! page `p` holds `cdiv(P, block_n)` blocks, block `t` is page `t / bpp`, rows
//! `[(t mod bpp) · block_n, +block_n)` cut at the page's end and at `L_s` (loads past
//! them read 0, their scores are masked to −∞). A page size that is a multiple of
//! `block_n` wastes nothing; a smaller one leaves rows of the tile unused (correct, and
//! the tuner prefers another tiling).
//!
//! **Split-K**: the `partial` program takes split `z` of `num_splits` of the sequence's
//! blocks (`cdiv(blocks, num_splits)` each) and stores its normalised output and
//! log-sum-exp in f32 (`o_partial [num_splits, S, H, D]`, `lse_partial [num_splits, S,
//! H]`; 0 and −∞ for an empty split); `combine` merges them: one program per (head,
//! sequence) weighs the splits' outputs by `e^{lse}`, a chunk of splits at a time.
//!
//! Grids: `main` `(KVH · cdiv(G, block_h), S, 1)`; `partial` `(…, S, num_splits)`;
//! `combine` `(H, S, 1)`.

use std::f64::consts::LOG2_E;

use crate::builder::{Axis, KernelBuilder};
use crate::ir::{BinOp, CmpPred, GridExpr, Kernel, MaskTerm, ReduceOp, UnOp, Value};
use crate::types::{DType, Type};
use crate::verify::VerifyError;

/// The combine kernel's tile: splits merged per step (16 for a spec whose largest
/// `num_splits` is 16 or less, else 32) on one warp. Measured on the H100 (docs/perf.md):
/// all 128 splits in one step on four warps made the two-split calls of large batches 11 %
/// slower, and one split per step made a batch of one 1.6x slower.
pub fn combine_tile(max_splits: u32) -> (u32, u32) {
    (if max_splits <= 16 { 16 } else { 32 }, 1)
}

/// Which launch of a plan a kernel is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The one-kernel plan: every key, `out` stored in the dtype.
    Main,
    /// Split-K's first launch: one split of the keys, f32 partial results.
    Partial,
    /// Split-K's second launch: the splits merged into `out`.
    Combine,
}

/// One paged-attention kernel: its role, variant, dtype and tiling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedKernel {
    pub role: Role,
    /// A run-time soft cap `logits_soft_cap` (`c · tanh(x / c)`).
    pub soft_cap: bool,
    /// query / caches / out: bf16, f16 or f32.
    pub dtype: DType,
    /// D, the head dim (compile time).
    pub head_dim: usize,
    /// Query heads per program (the tile's rows): 16 per warp on the GPU targets. The
    /// combine's rows are key splits instead ([`combine_tile`]).
    pub block_h: usize,
    /// Keys per block (the products' inner tile).
    pub block_n: usize,
}

/// One line per parameter name: what it is, with its logical shape (for the
/// manifest's `meaning`).
pub fn param_docs() -> &'static [(&'static str, &'static str)] {
    &[
        ("query", "input: one query token per sequence [S, H, D]"),
        ("key_cache", "input: the paged key cache [num_pages, KVH, P, D], P the page size"),
        ("value_cache", "input: the paged value cache [num_pages, KVH, P, D]"),
        ("context_lens", "input: keys per sequence [S], i32, 0 <= L_s <= max_pages * P"),
        ("block_tables", "input: each sequence's pages in order [S, max_pages], i32; the first ceil(L_s / P) are read"),
        ("out", "output: the attention output [S, H, D], query's dtype"),
        ("o_partial", "temporary: each key split's normalised output [num_splits, S, H, D], f32"),
        ("lse_partial", "temporary: each key split's log-sum-exp [num_splits, S, H], f32"),
        ("softmax_scale", "scalar: multiplies q·k (1 / sqrt(D) by default)"),
        ("logits_soft_cap", "scalar: c in c * tanh(x / c) (> 0)"),
        ("num_splits", "scalar: key splits of the split-K plan (the tuner's choice)"),
    ]
}

/// The tile IR of one kernel (verified), named `name`.
pub fn build(name: &str, k: &PagedKernel) -> Result<Kernel, VerifyError> {
    match k.role {
        Role::Combine => build_combine(name, k),
        _ => build_attention(name, k),
    }
}

fn grid_heads(block_h: usize) -> GridExpr {
    GridExpr::times(GridExpr::sym("heads_kv"), GridExpr::cdiv(GridExpr::sym("group"), block_h as i64))
}

/// `ceil(a / d)` for i32 `a >= 0`, `d > 0`.
fn cdiv(b: &mut KernelBuilder, a: Value, d: Value, c1: Value) -> Value {
    let t = b.add(a, d);
    let t = b.sub(t, c1);
    b.div(t, d)
}

fn build_attention(name: &str, k: &PagedKernel) -> Result<Kernel, VerifyError> {
    let (bh, bn, d) = (k.block_h, k.block_n, k.head_dim);
    let partial = k.role == Role::Partial;
    let mut b = KernelBuilder::new(name);
    let tensor = |b: &mut KernelBuilder, n: &str, dt: DType, rank: usize| b.param(n, Type::Tensor(dt, rank));
    let query = tensor(&mut b, "query", k.dtype, 3);
    let key_cache = tensor(&mut b, "key_cache", k.dtype, 4);
    let value_cache = tensor(&mut b, "value_cache", k.dtype, 4);
    let context_lens = tensor(&mut b, "context_lens", DType::I32, 1);
    let block_tables = tensor(&mut b, "block_tables", DType::I32, 2);
    let outs = if partial {
        let o = tensor(&mut b, "o_partial", DType::F32, 4);
        let l = tensor(&mut b, "lse_partial", DType::F32, 3);
        (o, Some(l))
    } else {
        (tensor(&mut b, "out", k.dtype, 3), None)
    };
    let scale = b.param("softmax_scale", Type::Scalar(DType::F32));
    let cap = k.soft_cap.then(|| b.param("logits_soft_cap", Type::Scalar(DType::F32)));
    let num_splits = partial.then(|| b.param("num_splits", Type::Scalar(DType::I32)));
    let z = if partial { GridExpr::sym("num_splits") } else { GridExpr::Const(1) };
    b.set_grid([grid_heads(bh), GridExpr::sym("num_seqs"), z]);

    // ---- program coordinates: (KV head, head block), sequence, split ----
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let pid = b.program_id(0);
    let seq = b.program_id(1);
    let heads_q = b.dim(query, 1);
    let heads_kv = b.dim(key_cache, 1);
    let page = b.dim(key_cache, 2);
    let group = b.div(heads_q, heads_kv);
    let block_h_c = b.const_i32(bh as i64);
    let head_blocks = cdiv(&mut b, group, block_h_c, c1);
    let kv_head = b.div(pid, head_blocks);
    let hblock = b.binary(BinOp::Rem, pid, head_blocks);
    let g0 = b.mul(kv_head, group);
    let h_off = b.mul(hblock, block_h_c);
    let h0 = b.add(g0, h_off);
    let h_end = b.add(g0, group);
    let heads = Axis::Range { start: h0, size: bh, limit: Some(h_end) };
    let cols = Axis::Range { start: c0, size: d, limit: None };
    let q = b.load(query, vec![Axis::Index(seq), heads, cols], 0.0);

    // ---- the sequence's key blocks: bpp per page, the last page's cut at L ----
    let len = b.load(context_lens, vec![Axis::Index(seq)], 0.0);
    let block_n_c = b.const_i32(bn as i64);
    let per_page = cdiv(&mut b, page, block_n_c, c1);
    let pages = cdiv(&mut b, len, page, c1);
    let full_pages = b.sub(pages, c1);
    let before_last = b.mul(full_pages, page);
    let last_len = b.sub(len, before_last);
    let last_blocks = cdiv(&mut b, last_len, block_n_c, c1);
    let full_blocks = b.mul(full_pages, per_page);
    // L = 0: pages = 0, last_len = P, so blocks = −bpp + bpp = 0.
    let blocks = b.add(full_blocks, last_blocks);
    let (t_lo, t_hi) = match num_splits {
        Some(n) => {
            let split = b.program_id(2);
            let per_split = cdiv(&mut b, blocks, n, c1);
            let lo = b.mul(split, per_split);
            let hi = b.add(lo, per_split);
            (lo, b.min(hi, blocks))
        }
        None => (c0, blocks),
    };

    // ---- online softmax over the blocks ----
    let m_i = b.full(f64::NEG_INFINITY, DType::F32, &[bh]);
    let l_i = b.full(0.0, DType::F32, &[bh]);
    let acc = b.full(0.0, DType::F32, &[bh, d]);
    let zero_s = b.full(0.0, DType::F32, &[bh, bn]);
    let log2e = b.const_f32(LOG2_E);
    // Without a soft cap, log2(e) folds into the scale; with one, 1/c does, and c·log2(e)
    // multiplies after the tanh.
    let (qk_scale, cap_out) = match cap {
        None => (b.mul(scale, log2e), None),
        Some(c) => {
            let s = b.div(scale, c);
            (s, Some(b.mul(c, log2e)))
        }
    };
    let finals = b.for_loop(t_lo, t_hi, c1, &[acc, m_i, l_i], |b, t, carried| {
        let (acc, m_i, l_i) = (carried[0], carried[1], carried[2]);
        let p_idx = b.div(t, per_page);
        let first = b.mul(p_idx, per_page);
        let in_page = b.sub(t, first);
        let off = b.mul(in_page, block_n_c);
        let phys = b.load(block_tables, vec![Axis::Index(seq), Axis::Index(p_idx)], 0.0);
        // Rows of this page that hold keys: the page, cut at L on the last one.
        let page_start = b.mul(p_idx, page);
        let left = b.sub(len, page_start);
        let limit = b.min(page, left);
        let rows = Axis::Range { start: off, size: bn, limit: Some(limit) };
        let kv_at = vec![Axis::Index(phys), Axis::Index(kv_head), rows, cols];
        let kt = b.load(key_cache, kv_at.clone(), 0.0);
        let s = b.dot(q, kt, zero_s, false, true);
        let mut s = b.mul(s, qk_scale);
        if let Some(out) = cap_out {
            let th = b.unary(UnOp::Tanh, s);
            s = b.mul(th, out);
        }
        let s = b.mask_apply(s, c0, off, &[(MaskTerm::ColLt, limit)]);
        let (p, alpha, m_new, l_new) = b.softmax_update(s, m_i, l_i);
        let acc = b.softmax_rescale(acc, alpha);
        let p = b.cast(p, k.dtype);
        let vt = b.load(value_cache, kv_at, 0.0);
        let acc = b.dot(p, vt, acc, false, false);
        vec![acc, m_new, l_new]
    });
    let (o, lse) = b.softmax_finalize(finals[0], finals[1], finals[2]);
    match (num_splits, outs) {
        (Some(_), (o_partial, Some(lse_partial))) => {
            let split = b.program_id(2);
            b.store(o_partial, vec![Axis::Index(split), Axis::Index(seq), heads, cols], o);
            b.store(lse_partial, vec![Axis::Index(split), Axis::Index(seq), heads], lse);
        }
        (_, (out, _)) => {
            let o = b.cast(o, k.dtype);
            b.store(out, vec![Axis::Index(seq), heads, cols], o);
        }
    }
    b.finish()
}

/// Merge the key splits: program `(h, s)` takes the splits of head `h` of sequence `s`
/// `block_s` at a time — each chunk's log-sum-exps as one `[block_s]` tile, their outputs
/// as one `[block_s, D]` tile (rows past `num_splits` read −∞ and 0), weighed by
/// `e^{lse − m}` in two reductions over the chunk's splits — and merges the chunks with the
/// online softmax (`m`, `l` scalars, the `[D]` accumulator rescaled by `e^{m_old − m_new}`).
/// A chunk's loads are issued at once, where a loop over single splits would wait for each
/// in turn (docs/perf.md). A row no split saw (`m = −∞` throughout) gets 0.
fn build_combine(name: &str, k: &PagedKernel) -> Result<Kernel, VerifyError> {
    let (rows, d) = (k.block_h, k.head_dim);
    let mut b = KernelBuilder::new(name);
    let o_partial = b.param("o_partial", Type::Tensor(DType::F32, 4));
    let lse_partial = b.param("lse_partial", Type::Tensor(DType::F32, 3));
    let out = b.param("out", Type::Tensor(k.dtype, 3));
    let num_splits = b.param("num_splits", Type::Scalar(DType::I32));
    b.set_grid([GridExpr::sym("heads_q"), GridExpr::sym("num_seqs"), GridExpr::Const(1)]);
    let c0 = b.const_i32(0);
    let head = b.program_id(0);
    let seq = b.program_id(1);
    let cols = Axis::Range { start: c0, size: d, limit: None };
    let log2e = b.const_f32(LOG2_E);
    let ninf = b.const_f32(f64::NEG_INFINITY);
    let zero = b.const_f32(0.0);
    let acc = b.full(0.0, DType::F32, &[d]);
    let step = b.const_i32(rows as i64);
    let finals = b.for_loop(c0, num_splits, step, &[acc, ninf, zero], |b, z0, carried| {
        let (acc, m, l) = (carried[0], carried[1], carried[2]);
        let splits = Axis::Range { start: z0, size: rows, limit: Some(num_splits) };
        let lse = b.load(lse_partial, vec![splits, Axis::Index(seq), Axis::Index(head)], f64::NEG_INFINITY);
        let t = b.mul(lse, log2e);
        let m_chunk = b.reduce(ReduceOp::Max, t, 0);
        let m_new = b.max(m, m_chunk);
        // Nothing seen yet: weights e^{−∞ − 0} = 0 instead of e^{−∞ − (−∞)}.
        let none = b.cmp(CmpPred::Eq, m_new, ninf);
        let m_use = b.select(none, zero, m_new);
        let shifted = b.sub(t, m_use);
        let w = b.unary(UnOp::Exp2, shifted);
        let old = b.sub(m, m_use);
        let alpha = b.unary(UnOp::Exp2, old);
        let o = b.load(o_partial, vec![splits, Axis::Index(seq), Axis::Index(head), cols], 0.0);
        let w2 = b.expand_dims(w, 1);
        let wo = b.mul(w2, o);
        let part = b.reduce(ReduceOp::Sum, wo, 0);
        let kept = b.mul(acc, alpha);
        let acc = b.add(kept, part);
        let l_chunk = b.reduce(ReduceOp::Sum, w, 0);
        let l_kept = b.mul(l, alpha);
        let l = b.add(l_kept, l_chunk);
        vec![acc, m_new, l]
    });
    let (acc, l) = (finals[0], finals[2]);
    let one = b.const_f32(1.0);
    let inv = b.div(one, l);
    let seen = b.cmp(CmpPred::Gt, l, zero);
    let inv = b.select(seen, inv, zero);
    let o = b.mul(acc, inv);
    let o = b.cast(o, k.dtype);
    b.store(out, vec![Axis::Index(seq), Axis::Index(head), cols], o);
    b.finish()
}
