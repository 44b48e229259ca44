//! The tile programs of ragged paged attention: `pack`, `main` and `unpack`.
//!
//! ```
//! use ejc_ir::ops::ragged_paged::kernels::{build, Class, RpaKernel, Role};
//! use ejc_ir::types::DType;
//!
//! let k = RpaKernel { role: Role::Main, soft_cap: true, window: true, sinks: false,
//!                     dtype: DType::BF16, head_dim: 64, block_m: 64, block_n: 32, class: Class::All };
//! let kernel = build("rpa_main", &k).unwrap();
//! let names: Vec<&str> = kernel.params.iter().map(|p| p.name.as_str()).collect();
//! assert_eq!(
//!     names,
//!     ["q_packed", "kv_pages", "context_lens", "block_tables", "query_start_loc", "o_packed",
//!      "softmax_scale", "group", "logits_soft_cap", "sliding_window"]
//! );
//! assert_eq!(kernel.grid[0].to_string(), "cdiv(max_q_rows, 64)");
//! ```
//!
//! # GQA packing
//!
//! Every query head of one KV head is served from one pass over that KV head's pages,
//! for prefill and decode tokens alike: the programs' rows are (token, head of the
//! group) pairs. Those rows are not a strided range of `queries [T, QH, D]` (a token's
//! group is `G = QH / KVH` consecutive heads, the next token's `QH` further on), so a
//! `pack` launch copies the queries into `q_packed [KVH, T · G, D]`, where KV head `h`'s
//! row `t · G + g` is token `t`'s head `h · G + g`: a sequence's rows are then one range,
//! `[qsl[s] · G, qsl[s + 1] · G)`. `main` writes `o_packed` in the same order and
//! `unpack` copies it back to `out [T, QH, D]`, joining the sinks there: `main` keeps
//! each row's log-sum-exp over its keys, and the sinks' logits rescale the row by
//! `1 / (1 + Σ e^(sink − lse))`. Pack and unpack move the queries and
//! outputs once more (`2 · T · QH · D` elements each way), small next to the pages a
//! long context reads.
//!
//! # The main program
//!
//! Program `(m, s, h)` takes rows `[qsl[s] · G + m · block_m, +block_m)` of sequence `s`
//! (cut at `qsl[s + 1] · G`) for KV head `h`. Row `r` is token `t = r / G` at position
//! `p = ctx − q_len + (t − qsl[s])` (queries aligned to the end of the context); it sees
//! key `j ≤ p`, and with a window `w` also `j > p − w`. The program walks the key blocks
//! from the window's edge of its first token to its last token's position, in blocks of
//! `block_n` that never cross a page (as paged decode: `cdiv(P, block_n)` blocks a page),
//! masks each score by that rule (and by the page's rows that hold keys), and keeps the
//! online softmax in f32. A program past its sequence's rows walks no block and stores
//! nothing.
//!
//! The `classed` plan launches it twice ([`Class`]): once as one 16-row block per sequence
//! of at most [`SMALL_ROWS`] packed rows (grid `[1, S, KVH]`), once with the tuned tiling
//! for the others; each gives the other class's sequences an empty row range. The
//! `classed_split` plan cuts the small class's key blocks into `num_splits` pieces (grid
//! `[num_splits, S, KVH]`, each sequence's splits in a slot of [`SMALL_ROWS`] rows) and
//! merges them per sequence before the large class runs: a few long decodes beside
//! prefill chunks no longer walk their whole context on one warp each.

use std::f64::consts::LOG2_E;

use crate::builder::{Axis, KernelBuilder};
use crate::flash::frontend::cdiv;
use crate::ir::{CmpPred, GridExpr, Kernel, UnOp, Value};
use crate::types::{DType, Type};
use crate::verify::VerifyError;

/// Query heads a `pack` / `unpack` program copies (a group is `cdiv(G, 16)` programs).
pub const BLOCK_G: usize = 16;

/// Packed rows up to which a sequence is "small" (a decode token's group, a few tokens):
/// the `classed` plan serves those with one block of this many rows on one warp and
/// the others with the tuned tiling.
pub const SMALL_ROWS: usize = 16;

/// Which sequences a `main` program serves (the `classed` plan launches one of each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Every sequence (the `packed` and `split_k` plans).
    All,
    /// Sequences of at most [`SMALL_ROWS`] packed rows, one block each (`block_m` must be
    /// at least that): grid `[1, num_seqs, heads_kv]`.
    Small,
    /// Sequences of more than [`SMALL_ROWS`] packed rows.
    Large,
}

/// Which launch of the plan a kernel is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `queries [T, QH, D]` → `q_packed [KVH, T · G, D]`.
    Pack,
    /// The attention, packed rows in, packed rows out.
    Main,
    /// `o_packed [KVH, T · G, D]` (f32) → `out [T, QH, D]`, the sinks joined.
    Unpack,
    /// v3: the new tokens' `keys` / `values [T, KVH, D]` written into their rows of
    /// `kv_pages` (program `(i, s, h)`: sequence `s`'s token `i`, KV head `h`).
    Write,
    /// Split-K's first launch: `main` over split `z` of `num_splits` pieces of each row
    /// block's key blocks, into `o_split [num_splits, KVH, T · G, D]` and `lse_split
    /// [num_splits, KVH, T · G]` (f32; 0 and −∞ where a split saw nothing). Of the small
    /// class (`classed_split`): sequence `s`'s rows go to its slot, rows `[s · SMALL_ROWS,
    /// +SMALL_ROWS)` of `o_split [num_splits, KVH, S · SMALL_ROWS, D]`.
    Partial,
    /// Split-K's second launch: the splits merged by log-sum-exp into `o_packed` (and
    /// `lse_packed` with sinks), `BLOCK_G` packed rows a program. Of the small class:
    /// program `(s, h)` merges sequence `s`'s slot into its packed rows when it is of the
    /// small class (grid `[S, KVH]`).
    Combine,
    /// The classed plans' list of the large class: program `s` (grid `[S]`) counts the
    /// sequences before it of more than [`SMALL_ROWS`] packed rows, `r`, and when it is one
    /// itself writes `large_ids[r] = s`. The large class's launch then has a program per
    /// (row block, large sequence, KV head), its sequence `large_ids[y]`, instead of one
    /// for every sequence.
    Classify,
}

/// Sequences a `classify` program counts per step (a tile of `query_start_loc`).
pub const CLASSIFY_STEP: usize = 128;

/// One ragged-paged-attention kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RpaKernel {
    pub role: Role,
    /// A run-time soft cap `logits_soft_cap`.
    pub soft_cap: bool,
    /// A run-time `sliding_window` (keys `j > p − w`).
    pub window: bool,
    /// Attention sinks `sinks [QH, num_sinks]`.
    pub sinks: bool,
    pub dtype: DType,
    pub head_dim: usize,
    /// Packed rows per program (main).
    pub block_m: usize,
    /// Keys per block (main).
    pub block_n: usize,
    /// The sequences a main program serves.
    pub class: Class,
}

/// One line per parameter name (the manifest's `meaning`).
pub fn param_docs() -> &'static [(&'static str, &'static str)] {
    &[
        ("queries", "input: every sequence's new tokens, one after another [T, QH, D]"),
        (
            "kv_pages",
            "input: the paged cache [num_pages, page_size, 2 * KVH, D], KV head h's key at head 2h, value at 2h + 1",
        ),
        ("context_lens", "input: keys per sequence, new tokens included [S], i32"),
        (
            "block_tables",
            "input: each sequence's pages in order [S, pages_per_seq], i32; the first ceil(ctx / page_size) are read",
        ),
        ("query_start_loc", "input: sequence s's tokens are rows [qsl[s], qsl[s + 1]) of queries [S + 1], i32"),
        ("sinks", "input: attention-sink logits per query head [QH, num_sinks], f32"),
        ("out", "output: the attention output [T, QH, D], queries' dtype; rows past qsl[S] are 0"),
        (
            "q_packed",
            "temporary: the queries, a KV head's group of heads per token in consecutive rows [KVH, T * G, D], \
             queries' dtype",
        ),
        ("o_packed", "temporary: the output in the packed order [KVH, T * G, D], f32"),
        ("lse_packed", "temporary: each packed row's log-sum-exp over its keys [KVH, T * G], f32 (with sinks)"),
        (
            "o_split",
            "temporary (split_k): each key split's normalised output [num_splits, KVH, T * G, D], f32 \
             (classed_split: a 16-row slot per sequence, [num_splits, KVH, S * 16, D])",
        ),
        (
            "lse_split",
            "temporary (split_k): each key split's log-sum-exp [num_splits, KVH, T * G], f32 (classed_split: [num_splits, \
             KVH, S * 16])",
        ),
        (
            "large_ids",
            "temporary (classed plans): the sequences of more than 16 packed rows, in order [S + 1], i32 (classify \
             writes them; the large class's programs read their sequence there)",
        ),
        ("num_splits", "scalar: key splits of the split-K plan (the tuner's choice)"),
        ("softmax_scale", "scalar: multiplies q.k (1 / sqrt(D) by default)"),
        ("logits_soft_cap", "scalar: c in c * tanh(x / c) (> 0)"),
        ("sliding_window", "scalar: w >= 1, the w most recent positions (the query's own included) are seen"),
        ("group", "scalar: query heads per KV head, QH / KVH (bound from the call's sizes)"),
        ("keys", "input (v3): the new tokens' keys [T, KVH, D], written into the cache before the attention"),
        ("values", "input (v3): the new tokens' values [T, KVH, D]"),
        ("kv_lens", "input (v3): keys per sequence after the new tokens are written [S], i32"),
        ("distribution", "input (v3): i32 [3], the ends of the decode-only, prefill-only and mixed sequences; the last is the live count"),
    ]
}

/// The tile IR of one kernel (verified), named `name`.
pub fn build(name: &str, k: &RpaKernel) -> Result<Kernel, VerifyError> {
    match k.role {
        Role::Pack | Role::Unpack => build_copy(name, k),
        Role::Main | Role::Partial => build_main(name, k),
        Role::Write => build_write(name, k),
        Role::Combine => build_combine(name, k),
        Role::Classify => build_classify(name),
    }
}

/// The large class's sequences, in order: see [`Role::Classify`].
fn build_classify(name: &str) -> Result<Kernel, VerifyError> {
    let mut b = KernelBuilder::new(name);
    let qsl = b.param("query_start_loc", Type::Tensor(DType::I32, 1));
    let large_ids = b.param("large_ids", Type::Tensor(DType::I32, 1));
    let group = b.param("group", Type::Scalar(DType::I32));
    b.set_grid([GridExpr::sym("num_seqs"), GridExpr::Const(1), GridExpr::Const(1)]);
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let s = b.program_id(0);
    let s1 = b.add(s, c1);
    let small = seq_class(&mut b, qsl, s, group).small;
    // r = the large sequences among 0..s, CLASSIFY_STEP at a time (padding reads 0 rows).
    let step = b.const_i32(CLASSIFY_STEP as i64);
    let steps = cdiv(&mut b, s, step, c1);
    let zero = b.const_f32(0.0);
    let one_t = b.full(1.0, DType::F32, &[CLASSIFY_STEP]);
    let zero_t = b.full(0.0, DType::F32, &[CLASSIFY_STEP]);
    let count = b.for_loop(c0, steps, c1, &[zero], |b, c, carried| {
        let first = b.mul(c, step);
        let next = b.add(first, c1);
        let starts = b.load(qsl, vec![Axis::Range { start: first, size: CLASSIFY_STEP, limit: Some(s) }], 0.0);
        let ends = b.load(qsl, vec![Axis::Range { start: next, size: CLASSIFY_STEP, limit: Some(s1) }], 0.0);
        let lens = b.sub(ends, starts);
        let small = small_rows(b, lens, group);
        let ones = b.select(small, zero_t, one_t);
        let n = b.reduce(crate::ir::ReduceOp::Sum, ones, 0);
        vec![b.add(carried[0], n)]
    })[0];
    let r = b.cast(count, DType::I32);
    let r1 = b.add(r, c1);
    let end = b.select(small, r, r1);
    let id = b.splat(s, &[1]);
    b.store(large_ids, vec![Axis::Range { start: r, size: 1, limit: Some(end) }], id);
    b.finish()
}

/// v3's cache write: program `(i, s, h)` copies sequence `s`'s new token `i` (at position
/// `p = ctx − q_len + i`) for KV head `h` into row `p mod P` of page
/// `block_tables[s, p / P]`, key at head `2h`, value at `2h + 1`. A program past the
/// sequence's new tokens reads and writes nothing (its ranges are empty).
fn build_write(name: &str, k: &RpaKernel) -> Result<Kernel, VerifyError> {
    let d = k.head_dim;
    let mut b = KernelBuilder::new(name);
    let keys = b.param("keys", Type::Tensor(k.dtype, 3));
    let values = b.param("values", Type::Tensor(k.dtype, 3));
    let kv_pages = b.param("kv_pages", Type::Tensor(k.dtype, 4));
    let lens = b.param("context_lens", Type::Tensor(DType::I32, 1));
    let tables = b.param("block_tables", Type::Tensor(DType::I32, 2));
    let qsl = b.param("query_start_loc", Type::Tensor(DType::I32, 1));
    b.set_grid([GridExpr::sym("max_q_len"), GridExpr::sym("num_seqs"), GridExpr::sym("heads_kv")]);
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let i = b.program_id(0);
    let seq = b.program_id(1);
    let h = b.program_id(2);
    let seq1 = b.add(seq, c1);
    let q_start = b.load(qsl, vec![Axis::Index(seq)], 0.0);
    let q_end = b.load(qsl, vec![Axis::Index(seq1)], 0.0);
    let ctx = b.load(lens, vec![Axis::Index(seq)], 0.0);
    let q_len = b.sub(q_end, q_start);
    let live = b.cmp(CmpPred::Lt, i, q_len);
    let one = b.select(live, c1, c0);
    // A dead program's indices point at row 0 of page 0 (with empty ranges: never touched).
    let first = b.sub(ctx, q_len);
    let pos = b.add(first, i);
    let pos = b.select(live, pos, c0);
    let page = b.dim(kv_pages, 1);
    let p_idx = b.div(pos, page);
    let p_first = b.mul(p_idx, page);
    let row = b.sub(pos, p_first);
    let phys = b.load(tables, vec![Axis::Index(seq), Axis::Index(p_idx)], 0.0);
    let phys = b.select(live, phys, c0);
    let tok = b.add(q_start, i);
    let tok = b.select(live, tok, c0);
    let tok_end = b.add(tok, one);
    let row_end = b.add(row, one);
    let cols = Axis::Range { start: c0, size: d, limit: None };
    let src = |t| vec![Axis::Range { start: t, size: 1, limit: Some(tok_end) }, Axis::Index(h), cols];
    let two = b.const_i32(2);
    let k_head = b.mul(h, two);
    let v_head = b.add(k_head, c1);
    let at = |head| {
        vec![Axis::Index(phys), Axis::Range { start: row, size: 1, limit: Some(row_end) }, Axis::Index(head), cols]
    };
    let kt = b.load(keys, src(tok), 0.0);
    b.store(kv_pages, at(k_head), kt);
    let vt = b.load(values, src(tok), 0.0);
    b.store(kv_pages, at(v_head), vt);
    b.finish()
}

/// The class rule, on the host: a sequence of `tokens` new tokens, `group` query heads per
/// KV head, is of the large class when its packed rows are more than [`SMALL_ROWS`]. The
/// kernels apply the same rule through [`seq_class`]; the host counts `large_seqs` with
/// this one.
pub fn is_large(tokens: i64, group: i64) -> bool {
    tokens * group > SMALL_ROWS as i64
}

/// Sequence `s`'s new tokens `[q_start, q_end)` (read from `query_start_loc`) and whether
/// they make it small: `(q_end − q_start) · G ≤ SMALL_ROWS` ([`is_large`]'s negation).
struct SeqClass {
    q_start: Value,
    q_end: Value,
    small: Value,
}

fn seq_class(b: &mut KernelBuilder, qsl: Value, s: Value, group: Value) -> SeqClass {
    let c1 = b.const_i32(1);
    let s1 = b.add(s, c1);
    let q_start = b.load(qsl, vec![Axis::Index(s)], 0.0);
    let q_end = b.load(qsl, vec![Axis::Index(s1)], 0.0);
    let len = b.sub(q_end, q_start);
    let small = small_rows(b, len, group);
    SeqClass { q_start, q_end, small }
}

/// `tokens · G ≤ SMALL_ROWS`, for a scalar or a tile of token counts.
fn small_rows(b: &mut KernelBuilder, tokens: Value, group: Value) -> Value {
    let rows = b.mul(tokens, group);
    let limit = b.const_i32(SMALL_ROWS as i64);
    b.cmp(CmpPred::Le, rows, limit)
}

/// Pack or unpack: program `(t, h, c)` copies heads `[c · 16, +16)` (cut at `G`) of
/// token `t`'s group for KV head `h`.
fn build_copy(name: &str, k: &RpaKernel) -> Result<Kernel, VerifyError> {
    let d = k.head_dim;
    let mut b = KernelBuilder::new(name);
    let unpack = k.role == Role::Unpack;
    let (src, dst) = match k.role {
        Role::Pack => {
            let q = b.param("queries", Type::Tensor(k.dtype, 3));
            (q, b.param("q_packed", Type::Tensor(k.dtype, 3)))
        }
        _ => {
            let o = b.param("o_packed", Type::Tensor(DType::F32, 3));
            (o, b.param("out", Type::Tensor(k.dtype, 3)))
        }
    };
    let sinks = (unpack && k.sinks).then(|| {
        let lse = b.param("lse_packed", Type::Tensor(DType::F32, 2));
        (lse, b.param("sinks", Type::Tensor(DType::F32, 2)))
    });
    let group = b.param("group", Type::Scalar(DType::I32));
    b.set_grid([
        GridExpr::sym("total_tokens"),
        GridExpr::sym("heads_kv"),
        GridExpr::cdiv(GridExpr::sym("group"), BLOCK_G as i64),
    ]);
    let c0 = b.const_i32(0);
    let t = b.program_id(0);
    let h = b.program_id(1);
    let c = b.program_id(2);
    let bg = b.const_i32(BLOCK_G as i64);
    let g0 = b.mul(c, bg);
    // The token's heads in `[T, QH, D]`: h·G + g; its rows in the packed slab: t·G + g.
    let head_base = b.mul(h, group);
    let head0 = b.add(head_base, g0);
    let head_end = b.add(head_base, group);
    let row_base = b.mul(t, group);
    let row0 = b.add(row_base, g0);
    let row_end = b.add(row_base, group);
    let cols = Axis::Range { start: c0, size: d, limit: None };
    let flat = [Axis::Index(t), Axis::Range { start: head0, size: BLOCK_G, limit: Some(head_end) }, cols];
    let packed = [Axis::Index(h), Axis::Range { start: row0, size: BLOCK_G, limit: Some(row_end) }, cols];
    let (from, to) = match k.role {
        Role::Pack => (flat, packed),
        _ => (packed, flat),
    };
    let mut x = b.load(src, from.to_vec(), 0.0);
    if let Some((lse_packed, sinks)) = sinks {
        // The sinks join each row's denominator: o · e^lse / (e^lse + Σ e^sink)
        // = o / (1 + Σ e^(sink − lse)); a row that saw no key (o = 0, lse = −∞) stays 0.
        let heads = Axis::Range { start: head0, size: BLOCK_G, limit: Some(head_end) };
        let lse = b.load(
            lse_packed,
            vec![Axis::Index(h), Axis::Range { start: row0, size: BLOCK_G, limit: Some(row_end) }],
            0.0,
        );
        let n_sinks = b.dim(sinks, 1);
        let c1 = b.const_i32(1);
        let zero = b.full(0.0, DType::F32, &[BLOCK_G]);
        let sum = b.for_loop(c0, n_sinks, c1, &[zero], |b, n, carried| {
            let sink = b.load(sinks, vec![heads, Axis::Index(n)], 0.0);
            let e = b.sub(sink, lse);
            let e = b.unary(UnOp::Exp, e);
            vec![b.add(carried[0], e)]
        });
        let one = b.const_f32(1.0);
        let den = b.add(sum[0], one);
        let den = b.expand_dims(den, 1);
        x = b.div(x, den);
    }
    // Pack copies the queries as they are; unpack rounds the f32 output to their dtype.
    let x = if unpack { b.cast(x, k.dtype) } else { x };
    b.store(dst, to.to_vec(), x);
    b.finish()
}

fn build_main(name: &str, k: &RpaKernel) -> Result<Kernel, VerifyError> {
    let (bm, bn, d) = (k.block_m, k.block_n, k.head_dim);
    if k.class == Class::Small && bm < SMALL_ROWS {
        return Err(VerifyError {
            kernel: name.to_string(),
            location: "the kernel".into(),
            message: format!("a small-class program needs block_m >= {SMALL_ROWS}, got {bm}"),
        });
    }
    let mut b = KernelBuilder::new(name);
    let tensor = |b: &mut KernelBuilder, n: &str, dt: DType, rank: usize| b.param(n, Type::Tensor(dt, rank));
    let q_packed = tensor(&mut b, "q_packed", k.dtype, 3);
    let kv_pages = tensor(&mut b, "kv_pages", k.dtype, 4);
    let lens = tensor(&mut b, "context_lens", DType::I32, 1);
    let tables = tensor(&mut b, "block_tables", DType::I32, 2);
    let qsl = tensor(&mut b, "query_start_loc", DType::I32, 1);
    let partial = k.role == Role::Partial;
    let (o_packed, lse_packed) = if partial {
        (tensor(&mut b, "o_split", DType::F32, 4), Some(tensor(&mut b, "lse_split", DType::F32, 3)))
    } else {
        (tensor(&mut b, "o_packed", DType::F32, 3), k.sinks.then(|| tensor(&mut b, "lse_packed", DType::F32, 2)))
    };
    // (Tensors before scalars: the PTX launch passes them in that order.)
    let large_ids = (k.class == Class::Large).then(|| tensor(&mut b, "large_ids", DType::I32, 1));
    let scale = b.param("softmax_scale", Type::Scalar(DType::F32));
    let group = b.param("group", Type::Scalar(DType::I32));
    let cap = k.soft_cap.then(|| b.param("logits_soft_cap", Type::Scalar(DType::F32)));
    let window = k.window.then(|| b.param("sliding_window", Type::Scalar(DType::I32)));
    let num_splits = partial.then(|| b.param("num_splits", Type::Scalar(DType::I32)));
    let row_blocks = match k.class {
        Class::Small => GridExpr::Const(1),
        _ => GridExpr::cdiv(GridExpr::sym("max_q_rows"), bm as i64),
    };
    b.set_grid([
        // Split-K: the split is the fastest part of axis 0 (the grid has three axes).
        if partial { GridExpr::times(row_blocks, GridExpr::sym("num_splits")) } else { row_blocks },
        // The large class: its sequences only (`large_ids`, written by `classify`).
        GridExpr::sym(if k.class == Class::Large { "large_seqs" } else { "num_seqs" }),
        GridExpr::sym("heads_kv"),
    ]);

    // ---- program coordinates: row block (and split), sequence, KV head ----
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let pid0 = b.program_id(0);
    let (mb, split) = match num_splits {
        Some(n) => (b.div(pid0, n), Some(b.binary(crate::ir::BinOp::Rem, pid0, n))),
        None => (pid0, None),
    };
    let seq = b.program_id(1);
    let seq = match large_ids {
        Some(ids) => b.load(ids, vec![Axis::Index(seq)], 0.0),
        None => seq,
    };
    let kvh = b.program_id(2);
    let class = seq_class(&mut b, qsl, seq, group);
    let (q_start, q_end) = (class.q_start, class.q_end);
    let ctx = b.load(lens, vec![Axis::Index(seq)], 0.0);
    let q_len = b.sub(q_end, q_start);
    // Position of token t: base + t (base = ctx − q_len − qsl[s]).
    let ctx_first = b.sub(ctx, q_len);
    let base = b.sub(ctx_first, q_start);
    let bm_c = b.const_i32(bm as i64);
    let seq_rows = b.mul(q_start, group);
    let step = b.mul(mb, bm_c);
    let row0 = b.add(seq_rows, step);
    let row_end = b.mul(q_end, group);
    // A sequence of the other class gets an empty range of rows: no key block, no store.
    let row_end = match k.class {
        Class::All => row_end,
        Class::Small => b.select(class.small, row_end, seq_rows),
        Class::Large => b.select(class.small, seq_rows, row_end),
    };
    let cols = Axis::Range { start: c0, size: d, limit: None };
    let rows = Axis::Range { start: row0, size: bm, limit: Some(row_end) };
    let q = b.load(q_packed, vec![Axis::Index(kvh), rows, cols], 0.0);

    // ---- the key positions this block of rows may see: [kv_lo, kv_hi) ----
    let last_row = {
        let e = b.add(row0, bm_c);
        let e = b.min(e, row_end);
        b.sub(e, c1)
    };
    let live = b.cmp(CmpPred::Lt, row0, row_end);
    let t_first = b.div(row0, group);
    let t_last = b.div(last_row, group);
    let p_last = b.add(base, t_last);
    let p_first = b.add(base, t_first);
    let hi = b.add(p_last, c1);
    let kv_hi = b.select(live, hi, c0);
    let kv_lo = match window {
        Some(w) => {
            // First token's edge: p − w + 1, at least 0.
            let e = b.sub(p_first, w);
            let e = b.add(e, c1);
            let e = b.max(e, c0);
            b.min(e, kv_hi)
        }
        None => c0,
    };
    let page = b.dim(kv_pages, 1);
    let bn_c = b.const_i32(bn as i64);
    let bn_m1 = b.const_i32(bn as i64 - 1);
    let per_page = cdiv(&mut b, page, bn_c, c1);
    // Key block of position x: (x / P) · bpp + (x mod P) / block_n.
    let block_of = |b: &mut KernelBuilder, x: Value| {
        let p = b.div(x, page);
        let first = b.mul(p, page);
        let within = b.sub(x, first);
        let inner = b.div(within, bn_c);
        let outer = b.mul(p, per_page);
        b.add(outer, inner)
    };
    let t_lo = block_of(&mut b, kv_lo);
    let t_hi = {
        let last_key = b.sub(kv_hi, c1);
        let last_key = b.max(last_key, c0);
        let t = block_of(&mut b, last_key);
        let t = b.add(t, c1);
        let any = b.cmp(CmpPred::Lt, kv_lo, kv_hi);
        let t = b.select(any, t, t_lo);
        b.max(t, t_lo)
    };
    // Split z takes blocks [t_lo + z · per, +per) of the row block's, per = cdiv(n, splits).
    let (t_lo, t_hi) = match (num_splits, split) {
        (Some(n), Some(z)) => {
            let count = b.sub(t_hi, t_lo);
            let per = cdiv(&mut b, count, n, c1);
            let off = b.mul(z, per);
            let lo = b.add(t_lo, off);
            let lo = b.min(lo, t_hi);
            let hi = b.add(lo, per);
            (lo, b.min(hi, t_hi))
        }
        _ => (t_lo, t_hi),
    };

    // ---- each row's position (for the mask), as a [block_m, 1] column ----
    let r = b.arange(bm);
    let r = b.add(r, row0);
    let tok = b.div(r, group);
    let pos = b.add(tok, base);
    let pos = b.expand_dims(pos, 1);
    let low = window.map(|w| b.sub(pos, w));

    // ---- online softmax over the key blocks ----
    let m_i = b.full(f64::NEG_INFINITY, DType::F32, &[bm]);
    let l_i = b.full(0.0, DType::F32, &[bm]);
    let acc = b.full(0.0, DType::F32, &[bm, d]);
    let zero_s = b.full(0.0, DType::F32, &[bm, bn]);
    let log2e = b.const_f32(LOG2_E);
    let ninf = b.const_f32(f64::NEG_INFINITY);
    let (qk_scale, cap_out) = match cap {
        None => (b.mul(scale, log2e), None),
        Some(c) => {
            let s = b.div(scale, c);
            (s, Some(b.mul(c, log2e)))
        }
    };
    let k_head = {
        let two = b.const_i32(2);
        b.mul(kvh, two)
    };
    let v_head = b.add(k_head, c1);
    let finals = b.for_loop(t_lo, t_hi, c1, &[acc, m_i, l_i], |b, t, carried| {
        let (acc, m_i, l_i) = (carried[0], carried[1], carried[2]);
        let p_idx = b.div(t, per_page);
        let first = b.mul(p_idx, per_page);
        let in_page = b.sub(t, first);
        let off = b.mul(in_page, bn_c);
        let phys = b.load(tables, vec![Axis::Index(seq), Axis::Index(p_idx)], 0.0);
        let page_start = b.mul(p_idx, page);
        let left = b.sub(ctx, page_start);
        let limit = b.min(page, left);
        let krows = Axis::Range { start: off, size: bn, limit: Some(limit) };
        let kt = b.load(kv_pages, vec![Axis::Index(phys), krows, Axis::Index(k_head), cols], 0.0);
        let s = b.dot(q, kt, zero_s, false, true);
        let mut s = b.mul(s, qk_scale);
        if let Some(out) = cap_out {
            let th = b.unary(UnOp::Tanh, s);
            s = b.mul(th, out);
        }
        // Key positions of the block's columns, and the rows of the page that hold keys.
        let j0 = b.add(page_start, off);
        let page_end = b.add(page_start, limit);
        // A full block — every key held by the page, at or before the first row's
        // position, inside the last row's window — takes its scores as they are: only
        // the partial blocks (a chunk's diagonal, a page's end, a window's edge) pay for
        // the per-element mask.
        let full = {
            let j_last = b.add(j0, bn_m1);
            let held = b.cmp(CmpPred::Lt, j_last, page_end);
            let before = b.cmp(CmpPred::Le, j_last, p_first);
            let mut full = b.and(held, before);
            if let Some(w) = window {
                let edge = b.sub(p_last, w);
                let inside = b.cmp(CmpPred::Gt, j0, edge);
                full = b.and(full, inside);
            }
            full
        };
        let s_ty = b.ty(s).clone();
        let s = b.if_else(
            full,
            &[s_ty],
            |_| vec![s],
            |b| {
                let c = b.arange(bn);
                let j = b.add(c, j0);
                let j = b.expand_dims(j, 0);
                let held = b.cmp(CmpPred::Lt, j, page_end);
                let causal = b.cmp(CmpPred::Le, j, pos);
                let mut ok = b.and(held, causal);
                if let Some(low) = low {
                    let inside = b.cmp(CmpPred::Gt, j, low);
                    ok = b.and(ok, inside);
                }
                vec![b.select(ok, s, ninf)]
            },
        )[0];
        let (p, alpha, m_new, l_new) = b.softmax_update(s, m_i, l_i);
        let acc = b.softmax_rescale(acc, alpha);
        let p = b.cast(p, k.dtype);
        let vrows = Axis::Range { start: off, size: bn, limit: Some(limit) };
        let vt = b.load(kv_pages, vec![Axis::Index(phys), vrows, Axis::Index(v_head), cols], 0.0);
        let acc = b.dot(p, vt, acc, false, false);
        vec![acc, m_new, l_new]
    });
    let (o, lse) = b.softmax_finalize(finals[0], finals[1], finals[2]);
    let lead: Vec<Axis> = split.iter().map(|z| Axis::Index(*z)).chain([Axis::Index(kvh)]).collect();
    // The small class's splits go to the sequence's slot of `SMALL_ROWS` rows (`o_split
    // [num_splits, KVH, S · SMALL_ROWS, D]`): its row block is the sequence's only one, and
    // a sequence of the other class stores nothing (an empty row range).
    let out_rows = if partial && k.class == Class::Small {
        let small = b.const_i32(SMALL_ROWS as i64);
        let slot = b.mul(seq, small);
        let n = b.sub(row_end, row0);
        let n = b.max(n, c0);
        let end = b.add(slot, n);
        Axis::Range { start: slot, size: bm, limit: Some(end) }
    } else {
        rows
    };
    b.store(o_packed, lead.iter().copied().chain([out_rows, cols]).collect(), o);
    if let Some(lse_packed) = lse_packed {
        b.store(lse_packed, lead.iter().copied().chain([out_rows]).collect(), lse);
    }
    b.finish()
}

/// Split-K's combine: program `(r, h)` merges rows `[r · 16, +16)` of KV head `h`'s
/// packed slab over the splits — `m` the running max of the splits' log-sum-exps, each
/// split weighed by `e^(lse − m)` — into `o_packed` (and `lse_packed`, for the sinks).
/// A row no split saw (every `lse = −∞`) gets 0 and `−∞`.
fn build_combine(name: &str, k: &RpaKernel) -> Result<Kernel, VerifyError> {
    let (d, rows_n) = (k.head_dim, BLOCK_G);
    let mut b = KernelBuilder::new(name);
    let o_split = b.param("o_split", Type::Tensor(DType::F32, 4));
    let lse_split = b.param("lse_split", Type::Tensor(DType::F32, 3));
    let o_packed = b.param("o_packed", Type::Tensor(DType::F32, 3));
    let lse_packed = k.sinks.then(|| b.param("lse_packed", Type::Tensor(DType::F32, 2)));
    let small = k.class == Class::Small;
    let sequences = small.then(|| {
        let qsl = b.param("query_start_loc", Type::Tensor(DType::I32, 1));
        let group = b.param("group", Type::Scalar(DType::I32));
        (qsl, group)
    });
    let num_splits = b.param("num_splits", Type::Scalar(DType::I32));
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let cols = Axis::Range { start: c0, size: d, limit: None };
    // (rows read from the splits, rows written to the packed output)
    let (src, dst, h) = match sequences {
        None => {
            b.set_grid([
                GridExpr::cdiv(GridExpr::times(GridExpr::sym("total_tokens"), GridExpr::sym("group")), rows_n as i64),
                GridExpr::sym("heads_kv"),
                GridExpr::Const(1),
            ]);
            let r = b.program_id(0);
            let h = b.program_id(1);
            let total = b.dim(o_packed, 1);
            let step = b.const_i32(rows_n as i64);
            let r0 = b.mul(r, step);
            let rows = Axis::Range { start: r0, size: rows_n, limit: Some(total) };
            (rows, rows, h)
        }
        Some((qsl, group)) => {
            // Program (s, h): sequence s's slot of SMALL_ROWS rows into its packed rows, when
            // it is of the small class (else an empty range).
            b.set_grid([GridExpr::sym("num_seqs"), GridExpr::sym("heads_kv"), GridExpr::Const(1)]);
            let s = b.program_id(0);
            let h = b.program_id(1);
            let SeqClass { q_start, q_end, small: mine } = seq_class(&mut b, qsl, s, group);
            let len = b.sub(q_end, q_start);
            let n = b.mul(len, group);
            let n = b.select(mine, n, c0);
            let small_c = b.const_i32(SMALL_ROWS as i64);
            let slot = b.mul(s, small_c);
            let slot_end = b.add(slot, n);
            let row0 = b.mul(q_start, group);
            let row_end = b.add(row0, n);
            (
                Axis::Range { start: slot, size: SMALL_ROWS, limit: Some(slot_end) },
                Axis::Range { start: row0, size: SMALL_ROWS, limit: Some(row_end) },
                h,
            )
        }
    };
    let rows_n = if small { SMALL_ROWS } else { rows_n };
    let ninf = b.const_f32(f64::NEG_INFINITY);
    let zero = b.const_f32(0.0);
    let m0 = b.full(f64::NEG_INFINITY, DType::F32, &[rows_n]);
    let l0 = b.full(0.0, DType::F32, &[rows_n]);
    let a0 = b.full(0.0, DType::F32, &[rows_n, d]);
    let finals = b.for_loop(c0, num_splits, c1, &[a0, m0, l0], |b, z, carried| {
        let (acc, m, l) = (carried[0], carried[1], carried[2]);
        let lse = b.load(lse_split, vec![Axis::Index(z), Axis::Index(h), src], f64::NEG_INFINITY);
        let m_new = b.max(m, lse);
        // Nothing seen yet: shift by 0 instead of −∞ (e^(−∞ − 0) = 0, never e^(−∞ + ∞)).
        let none = b.cmp(CmpPred::Eq, m_new, ninf);
        let m_use = b.select(none, zero, m_new);
        let old = b.sub(m, m_use);
        let alpha = b.unary(UnOp::Exp, old);
        let own = b.sub(lse, m_use);
        let w = b.unary(UnOp::Exp, own);
        let o = b.load(o_split, vec![Axis::Index(z), Axis::Index(h), src, cols], 0.0);
        let a2 = b.expand_dims(alpha, 1);
        let w2 = b.expand_dims(w, 1);
        let kept = b.mul(acc, a2);
        let part = b.mul(o, w2);
        let acc = b.add(kept, part);
        let lk = b.mul(l, alpha);
        let l = b.add(lk, w);
        vec![acc, m_new, l]
    });
    let (acc, m, l) = (finals[0], finals[1], finals[2]);
    let one = b.const_f32(1.0);
    let inv = b.div(one, l);
    let seen = b.cmp(CmpPred::Gt, l, zero);
    let inv = b.select(seen, inv, zero);
    let inv2 = b.expand_dims(inv, 1);
    let o = b.mul(acc, inv2);
    b.store(o_packed, vec![Axis::Index(h), dst, cols], o);
    if let Some(lse_packed) = lse_packed {
        let log_l = b.unary(UnOp::Log, l);
        let lse = b.add(m, log_l);
        let lse = b.select(seen, lse, ninf);
        b.store(lse_packed, vec![Axis::Index(h), dst], lse);
    }
    b.finish()
}
