//! The tile programs of paged decode attention: the one-kernel plan's `main`, and
//! split-K's `partial` and `combine`.
//!
//! ```
//! use ejc_ir::ops::page_attention::kernels::{build, DecodeKernel, Role};
//! use ejc_ir::types::DType;
//!
//! let k = DecodeKernel::paged(Role::Partial, true, DType::BF16, 64, 16, 32);
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
use crate::flash::frontend::cdiv;
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

/// Where a decode kernel's keys and values live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// `page_attention`: a paged cache read through block tables.
    Paged,
    /// `ragged_decode_attention`: contiguous `key` / `value [B, T, KVH, D]`, row `b`'s
    /// keys `[sequence_start[b], sequence_end[b])`.
    Ragged,
}

/// One decode-attention kernel: where its keys live, its role, variant, dtype and
/// tiling. `page_attention` and `ragged_decode_attention` share these programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeKernel {
    pub source: Source,
    pub role: Role,
    /// A run-time soft cap `logits_soft_cap` (`c · tanh(x / c)`).
    pub soft_cap: bool,
    /// A run-time `window_left`: only keys `j >= end - 1 - window_left` (ragged only).
    pub window: bool,
    /// Attention sinks `sinks [H, num_sinks]`: logits that join every row's softmax
    /// denominator (ragged only). The partial kernel leaves them to the combine.
    pub sinks: bool,
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

impl DecodeKernel {
    /// A `page_attention` kernel.
    pub fn paged(role: Role, soft_cap: bool, dtype: DType, head_dim: usize, block_h: usize, block_n: usize) -> Self {
        DecodeKernel {
            source: Source::Paged,
            role,
            soft_cap,
            window: false,
            sinks: false,
            dtype,
            head_dim,
            block_h,
            block_n,
        }
    }
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
        ("key", "input: the keys [B, T, KVH, D]; row b's are [sequence_start[b], sequence_end[b])"),
        ("value", "input: the values [B, T, KVH, D]"),
        ("sequence_start", "input: each row's first key [B], i32, 0 <= start <= end"),
        ("sequence_end", "input: each row's end (exclusive) [B], i32, <= T; the query is token end - 1"),
        ("sinks", "input: attention-sink logits per query head [H, num_sinks], f32"),
        ("window_left", "scalar: keys at most this far left of the query (token end - 1) are seen (>= 0)"),
    ]
}

/// The tile IR of one kernel (verified), named `name`.
pub fn build(name: &str, k: &DecodeKernel) -> Result<Kernel, VerifyError> {
    match k.role {
        Role::Combine => build_combine(name, k),
        _ => build_attention(name, k),
    }
}

fn grid_heads(block_h: usize) -> GridExpr {
    GridExpr::times(GridExpr::sym("heads_kv"), GridExpr::cdiv(GridExpr::sym("group"), block_h as i64))
}

/// The values that place a program's key blocks.
#[derive(Clone, Copy)]
enum Keys {
    Paged { page: Value, len: Value, per_page: Value, table: Value, blocks: Value },
    Ragged { lo: Value, end: Value, blocks: Value },
}

fn build_attention(name: &str, k: &DecodeKernel) -> Result<Kernel, VerifyError> {
    let (bh, bn, d) = (k.block_h, k.block_n, k.head_dim);
    let partial = k.role == Role::Partial;
    let mut b = KernelBuilder::new(name);
    let tensor = |b: &mut KernelBuilder, n: &str, dt: DType, rank: usize| b.param(n, Type::Tensor(dt, rank));
    let query = tensor(&mut b, "query", k.dtype, 3);
    let ragged = k.source == Source::Ragged;
    let (key, value) = match k.source {
        Source::Paged => (tensor(&mut b, "key_cache", k.dtype, 4), tensor(&mut b, "value_cache", k.dtype, 4)),
        Source::Ragged => (tensor(&mut b, "key", k.dtype, 4), tensor(&mut b, "value", k.dtype, 4)),
    };
    let (lens, ends) = match k.source {
        Source::Paged => (tensor(&mut b, "context_lens", DType::I32, 1), tensor(&mut b, "block_tables", DType::I32, 2)),
        Source::Ragged => {
            (tensor(&mut b, "sequence_start", DType::I32, 1), tensor(&mut b, "sequence_end", DType::I32, 1))
        }
    };
    // Sinks join the one-kernel plan's state; split-K's combine adds them once.
    let sinks = (k.sinks && !partial).then(|| tensor(&mut b, "sinks", DType::F32, 2));
    let outs = if partial {
        let o = tensor(&mut b, "o_partial", DType::F32, 4);
        let l = tensor(&mut b, "lse_partial", DType::F32, 3);
        (o, Some(l))
    } else {
        (tensor(&mut b, "out", k.dtype, 3), None)
    };
    let scale = b.param("softmax_scale", Type::Scalar(DType::F32));
    let cap = k.soft_cap.then(|| b.param("logits_soft_cap", Type::Scalar(DType::F32)));
    let window = (k.window && ragged).then(|| b.param("window_left", Type::Scalar(DType::I32)));
    let num_splits = partial.then(|| b.param("num_splits", Type::Scalar(DType::I32)));
    let z = if partial { GridExpr::sym("num_splits") } else { GridExpr::Const(1) };
    b.set_grid([grid_heads(bh), GridExpr::sym("num_seqs"), z]);

    // ---- program coordinates: (KV head, head block), sequence, split ----
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let pid = b.program_id(0);
    let seq = b.program_id(1);
    let heads_q = b.dim(query, 1);
    let heads_kv = b.dim(key, if ragged { 2 } else { 1 });
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

    let block_n_c = b.const_i32(bn as i64);
    let layout = match k.source {
        // ---- the sequence's key blocks: bpp per page, the last page's cut at L ----
        Source::Paged => {
            let page = b.dim(key, 2);
            let len = b.load(lens, vec![Axis::Index(seq)], 0.0);
            let per_page = cdiv(&mut b, page, block_n_c, c1);
            let pages = cdiv(&mut b, len, page, c1);
            let full_pages = b.sub(pages, c1);
            let before_last = b.mul(full_pages, page);
            let last_len = b.sub(len, before_last);
            let last_blocks = cdiv(&mut b, last_len, block_n_c, c1);
            let full_blocks = b.mul(full_pages, per_page);
            // L = 0: pages = 0, last_len = P, so blocks = −bpp + bpp = 0.
            let blocks = b.add(full_blocks, last_blocks);
            Keys::Paged { page, len, per_page, table: ends, blocks }
        }
        // ---- the row's keys [lo, end): lo the start, or the window's left edge ----
        Source::Ragged => {
            let start = b.load(lens, vec![Axis::Index(seq)], 0.0);
            let end = b.load(ends, vec![Axis::Index(seq)], 0.0);
            let lo = match window {
                // end − 1 − left never overflows: end >= 0, left <= 2^31 − 1.
                Some(left) => {
                    let q_pos = b.sub(end, c1);
                    let edge = b.sub(q_pos, left);
                    b.max(start, edge)
                }
                None => start,
            };
            let n = b.sub(end, lo);
            let n = b.max(n, c0);
            let blocks = cdiv(&mut b, n, block_n_c, c1);
            Keys::Ragged { lo, end, blocks }
        }
    };
    let blocks = match layout {
        Keys::Paged { blocks, .. } | Keys::Ragged { blocks, .. } => blocks,
    };
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
    let mut m_i = b.full(f64::NEG_INFINITY, DType::F32, &[bh]);
    let mut l_i = b.full(0.0, DType::F32, &[bh]);
    let acc = b.full(0.0, DType::F32, &[bh, d]);
    let zero_s = b.full(0.0, DType::F32, &[bh, bn]);
    let log2e = b.const_f32(LOG2_E);
    if let Some(sinks) = sinks {
        // Each sink logit is a one-column block of scores (exp2 domain), before any key.
        let n_sinks = b.dim(sinks, 1);
        let r = b.for_loop(c0, n_sinks, c1, &[m_i, l_i], |b, t, carried| {
            let sink = b.load(sinks, vec![heads, Axis::Index(t)], 0.0);
            let sink = b.mul(sink, log2e);
            let col = b.expand_dims(sink, 1);
            let (_p, _alpha, m_new, l_new) = b.softmax_update(col, carried[0], carried[1]);
            vec![m_new, l_new]
        });
        (m_i, l_i) = (r[0], r[1]);
    }
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
        // The block's first key (`j0`, for the mask), its rows and where they are.
        let (j0, limit, kv_at) = match layout {
            Keys::Paged { page, len, per_page, table, .. } => {
                let p_idx = b.div(t, per_page);
                let first = b.mul(p_idx, per_page);
                let in_page = b.sub(t, first);
                let off = b.mul(in_page, block_n_c);
                let phys = b.load(table, vec![Axis::Index(seq), Axis::Index(p_idx)], 0.0);
                // Rows of this page that hold keys: the page, cut at L on the last one.
                let page_start = b.mul(p_idx, page);
                let left = b.sub(len, page_start);
                let limit = b.min(page, left);
                let rows = Axis::Range { start: off, size: bn, limit: Some(limit) };
                (off, limit, vec![Axis::Index(phys), Axis::Index(kv_head), rows, cols])
            }
            Keys::Ragged { lo, end, .. } => {
                let step = b.mul(t, block_n_c);
                let j0 = b.add(lo, step);
                let rows = Axis::Range { start: j0, size: bn, limit: Some(end) };
                (j0, end, vec![Axis::Index(seq), rows, Axis::Index(kv_head), cols])
            }
        };
        let kt = b.load(key, kv_at.clone(), 0.0);
        let s = b.dot(q, kt, zero_s, false, true);
        let mut s = b.mul(s, qk_scale);
        if let Some(out) = cap_out {
            let th = b.unary(UnOp::Tanh, s);
            s = b.mul(th, out);
        }
        let s = b.mask_apply(s, c0, j0, &[(MaskTerm::ColLt, limit)]);
        let (p, alpha, m_new, l_new) = b.softmax_update(s, m_i, l_i);
        let acc = b.softmax_rescale(acc, alpha);
        let p = b.cast(p, k.dtype);
        let vt = b.load(value, kv_at, 0.0);
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
fn build_combine(name: &str, k: &DecodeKernel) -> Result<Kernel, VerifyError> {
    let (rows, d) = (k.block_h, k.head_dim);
    let mut b = KernelBuilder::new(name);
    let o_partial = b.param("o_partial", Type::Tensor(DType::F32, 4));
    let lse_partial = b.param("lse_partial", Type::Tensor(DType::F32, 3));
    let out = b.param("out", Type::Tensor(k.dtype, 3));
    let sinks = k.sinks.then(|| b.param("sinks", Type::Tensor(DType::F32, 2)));
    let num_splits = b.param("num_splits", Type::Scalar(DType::I32));
    b.set_grid([GridExpr::sym("heads_q"), GridExpr::sym("num_seqs"), GridExpr::Const(1)]);
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let head = b.program_id(0);
    let seq = b.program_id(1);
    let cols = Axis::Range { start: c0, size: d, limit: None };
    let log2e = b.const_f32(LOG2_E);
    let ninf = b.const_f32(f64::NEG_INFINITY);
    let zero = b.const_f32(0.0);
    let acc = b.full(0.0, DType::F32, &[d]);
    // Sinks enter the state first, once: each raises `m` and adds its weight to `l`.
    let (m0, l0) = match sinks {
        Some(sinks) => {
            let n_sinks = b.dim(sinks, 1);
            let r = b.for_loop(c0, n_sinks, c1, &[ninf, zero], |b, t, carried| {
                let (m, l) = (carried[0], carried[1]);
                let x = b.load(sinks, vec![Axis::Index(head), Axis::Index(t)], 0.0);
                let x = b.mul(x, log2e);
                let m_new = b.max(m, x);
                let old = b.sub(m, m_new);
                let alpha = b.unary(UnOp::Exp2, old);
                let kept = b.mul(l, alpha);
                let own = b.sub(x, m_new);
                let w = b.unary(UnOp::Exp2, own);
                vec![m_new, b.add(kept, w)]
            });
            (r[0], r[1])
        }
        None => (ninf, zero),
    };
    let step = b.const_i32(rows as i64);
    let finals = b.for_loop(c0, num_splits, step, &[acc, m0, l0], |b, z0, carried| {
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
