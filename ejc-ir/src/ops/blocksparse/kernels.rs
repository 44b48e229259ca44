//! The tile programs of block-sparse attention: the layout builder and the attention
//! kernel that follows a layout.
//!
//! **The layout** (role `layout`). A query block `[i0, i0 + block_m)` and a key block
//! `[j0, j0 + block_n)` are *skipped* when no query row of the sequence in the block
//! sees any key of the block, *full* when every such row sees every key of it (so no key
//! past `seq_k`), and *partial* otherwise. Program `(qb, lh, lb)` evaluates the variant's
//! element mask (its mask algebra, segment ids, attention mask) on the key blocks of query
//! block `qb` that the mask algebra's key range ([`super::mask::MaskExpr::key_range`])
//! leaves (the others are skipped unseen) and writes the indices of the full blocks, in
//! order, to the front of `block_idx[lb, lh, qb, ..]` and those of the partial ones, in
//! order, to its back (the last slot holds the first), with both counts in
//! `block_count[lb, lh, qb, 0..2]`. A layout is per batch entry only where the mask
//! reads the call's tensors (`lb` = 0 otherwise) and per head only with an attention
//! mask (`lh` = 0 otherwise). Its cost is that of reading the mask once, element by
//! element, with no product.
//!
//! **The attention kernel** (role `main`). Program `(p, h, b)` computes rows
//! `[qb · block_m, ..)` of head `h` of batch entry `b`, `qb` = the last query block − `p`
//! (the longest rows of a causal-like mask first): it loads its query tile once,
//! runs the online softmax over the full key blocks and then the partial ones in one
//! loop — a block's element mask is applied only when it is partial (a branch per block,
//! as flash's classified loop has) — and stores the output and the log-sum-exp.
//! Skipped blocks are never loaded. GQA: head `h` reads KV head `h / (H / KVH)`.
//!
//! ```
//! use ejc_ir::ops::blocksparse::kernels::{build, BsKernel, Role};
//! use ejc_ir::ops::blocksparse::reference::BsFeatures;
//! use ejc_ir::types::DType;
//! let k = BsKernel { role: Role::Main, features: BsFeatures::default(), dtype: DType::BF16, head_dim: 64, head_dim_v: 64, block_m: 64, block_n: 64 };
//! let kernel = build("bs_causal", &k).unwrap();
//! let names: Vec<&str> = kernel.params.iter().map(|p| p.name.as_str()).collect();
//! assert_eq!(names, ["query", "key", "value", "out", "lse", "block_count", "block_idx", "softmax_scale"]);
//! ```

use std::f64::consts::LOG2_E;

use super::reference::BsFeatures;
use crate::builder::{Axis, KernelBuilder};
use crate::flash::frontend::cdiv;
use crate::ir::{CmpPred, GridExpr, Kernel, ReduceOp, UnOp, Value};
use crate::types::{DType, Type};
use crate::verify::VerifyError;

/// Which kernel of the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Layout,
    Main,
}

/// One kernel to build.
#[derive(Clone, Debug, PartialEq)]
pub struct BsKernel {
    pub role: Role,
    pub features: BsFeatures,
    pub dtype: DType,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub block_m: usize,
    pub block_n: usize,
}

/// Every parameter's meaning (`ejc list`, the manifest's docs).
pub fn param_docs() -> &'static [(&'static str, &'static str)] {
    &[
        ("query", "input: queries [B, H, Sq, D] (BHSD, any strides)"),
        ("key", "input: keys [B, KVH, Sk, D]"),
        ("value", "input: values [B, KVH, Sk, Dv] (Dv may differ from D)"),
        ("out", "output: attention output [B, H, Sq, Dv], queries' dtype; a row that sees nothing is 0"),
        ("lse", "output: log-sum-exp (natural log) [B, H, Sq], f32; -inf for a row that sees nothing"),
        ("q_segment_ids", "input: query segment ids [B, Sq], i32; -1 = padding (sees nothing)"),
        ("kv_segment_ids", "input: key segment ids [B, Sk], i32; equal ids attend"),
        ("attention_mask", "input: boolean mask [B, H, Sq, Sk], true = attend (stride 0 on the head axis shares one)"),
        ("q_positions", "input: query positions [B, Sq], i32 from 0 to 2^30: the mask algebra's q"),
        ("kv_positions", "input: key positions [B, Sk], i32 from 0 to 2^30: the mask algebra's kv"),
        ("sinks", "input: sink logits [H, n_sinks], f32"),
        (
            "bias",
            "input: additive bias [B, H, Sq, Sk], the query's dtype (stride 0 broadcasts an axis), before the soft cap",
        ),
        ("block_count", "temporary (layout): full and partial key blocks per query block [LB, LH, NQ, 2], i32"),
        (
            "block_idx",
            "temporary (layout): key block indices [LB, LH, NQ, NK], i32: the full ones in order from slot 0, the \
             partial ones in order from slot NK - 1 down",
        ),
        ("seq_q", "scalar: query rows per sequence (bound from the call's sizes)"),
        ("seq_k", "scalar: keys per sequence (bound from the call's sizes)"),
        ("softmax_scale", "scalar: multiplies q.k (1 / sqrt(D) by default)"),
        ("logits_soft_cap", "scalar: c in c * tanh(x / c) (> 0)"),
    ]
}

/// The layout's temporaries (i32), in parameter order, with their rank.
pub const LAYOUT_TENSORS: [(&str, usize); 2] = [("block_count", 4), ("block_idx", 4)];

/// The tile IR of one kernel (verified), named `name`.
pub fn build(name: &str, k: &BsKernel) -> Result<Kernel, VerifyError> {
    match k.role {
        Role::Layout => build_layout(name, k, false),
        Role::Main => build_main(name, k),
    }
}

/// The mask's data-dependent inputs, declared in ABI order.
pub(super) struct MaskInputs {
    pub(super) segment_ids: Option<(Value, Value)>,
    pub(super) attention_mask: Option<Value>,
    /// `q_positions`, `kv_positions`.
    pub(super) positions: Option<(Value, Value)>,
    /// The run-time window's `window_left`, `window_right` (i32 scalars).
    pub(super) window: Option<(Value, Value)>,
    /// The run-time `chunk_size` (i32 scalar).
    pub(super) chunk: Option<Value>,
}

pub(super) fn mask_inputs(b: &mut KernelBuilder, f: &BsFeatures) -> MaskInputs {
    let segment_ids = f.segment_ids.then(|| {
        let q = b.param("q_segment_ids", Type::Tensor(DType::I32, 2));
        let k = b.param("kv_segment_ids", Type::Tensor(DType::I32, 2));
        (q, k)
    });
    let attention_mask = f.attention_mask.then(|| b.param("attention_mask", Type::Tensor(DType::I1, 4)));
    let positions = f.positions.then(|| {
        let q = b.param("q_positions", Type::Tensor(DType::I32, 2));
        let k = b.param("kv_positions", Type::Tensor(DType::I32, 2));
        (q, k)
    });
    MaskInputs { segment_ids, attention_mask, positions, window: None, chunk: None }
}

/// The mask's run-time sizes (scalars: declared after every tensor, the launch ABI's
/// order).
pub(super) fn mask_scalars(b: &mut KernelBuilder, f: &BsFeatures, m: &mut MaskInputs) {
    m.window = f.runtime_window.then(|| {
        let l = b.param("window_left", Type::Scalar(DType::I32));
        let r = b.param("window_right", Type::Scalar(DType::I32));
        (l, r)
    });
    m.chunk = f.runtime_chunk.then(|| b.param("chunk_size", Type::Scalar(DType::I32)));
}

fn layout_params(b: &mut KernelBuilder) -> [Value; 2] {
    LAYOUT_TENSORS.map(|(n, rank)| b.param(n, Type::Tensor(DType::I32, rank)))
}

/// The rows of a query block and what of them is loop-invariant for the mask: row
/// indices `[bm, 1]`, and the query segment ids with their validity.
pub(super) struct RowMask {
    pub(super) q_idx: Value,
    pub(super) q_seg: Option<(Value, Value)>,
    /// The rows' positions `[bm, 1]` (the mask algebra's q): `q_idx`, or `q_positions`.
    pub(super) q_pos: Value,
}

pub(super) fn row_mask(b: &mut KernelBuilder, m: &MaskInputs, batch: Value, i0: Value, bm: usize) -> RowMask {
    let r = b.arange(bm);
    let r = b.add(r, i0);
    let q_idx = b.expand_dims(r, 1);
    let q_seg = m.segment_ids.map(|(qs, _)| {
        let ids = b.load(qs, vec![Axis::Index(batch), Axis::Range { start: i0, size: bm, limit: None }], -1.0);
        let ids = b.expand_dims(ids, 1);
        let pad = b.const_i32(-1);
        let valid = b.cmp(CmpPred::Ne, ids, pad);
        (ids, valid)
    });
    let q_pos = match m.positions {
        Some((qp, _)) => {
            let p = b.load(qp, vec![Axis::Index(batch), Axis::Range { start: i0, size: bm, limit: None }], 0.0);
            b.expand_dims(p, 1)
        }
        None => q_idx,
    };
    RowMask { q_idx, q_seg, q_pos }
}

/// Which keys of block `[j0, j0 + bn)` each row sees: `[bm, bn]` i1, keys past `seq_k`
/// hidden, every condition of the variant applied.
#[allow(clippy::too_many_arguments)]
pub(super) fn block_visibility(
    b: &mut KernelBuilder,
    f: &BsFeatures,
    m: &MaskInputs,
    rows: &RowMask,
    (batch, head): (Value, Value),
    (i0, bm): (Value, usize),
    (j0, bn): (Value, usize),
    seq_k: Value,
) -> Value {
    let c = b.arange(bn);
    let c = b.add(c, j0);
    let kv_idx = b.expand_dims(c, 0);
    let in_seq = b.cmp(CmpPred::Lt, kv_idx, seq_k);
    let mut vis = b.broadcast(in_seq, &[bm, bn]);
    let kv_pos = match m.positions {
        Some((_, kp)) => {
            let p = b.load(kp, vec![Axis::Index(batch), Axis::Range { start: j0, size: bn, limit: None }], 0.0);
            b.expand_dims(p, 0)
        }
        None => kv_idx,
    };
    if let Some(v) = f.mask.emit(b, rows.q_pos, kv_pos) {
        vis = b.and(vis, v);
    }
    if let Some((l, r)) = m.window {
        let lo = b.sub(rows.q_pos, l);
        let hi = b.add(rows.q_pos, r);
        let ge = b.cmp(CmpPred::Ge, kv_pos, lo);
        let le = b.cmp(CmpPred::Le, kv_pos, hi);
        let inside = b.and(ge, le);
        vis = b.and(vis, inside);
    }
    if let Some(c) = m.chunk {
        // ⌊q / c⌋ = ⌊kv / c⌋ and kv ≤ q  ⇔  ⌊q / c⌋·c ≤ kv ≤ q (positions are ≥ 0): one
        // division per row instead of one per key, by a divisor known only at run time.
        let qc = b.div(rows.q_pos, c);
        let start = b.mul(qc, c);
        let after = b.cmp(CmpPred::Ge, kv_pos, start);
        let causal = b.cmp(CmpPred::Le, kv_pos, rows.q_pos);
        let ok = b.and(after, causal);
        vis = b.and(vis, ok);
    }
    if !f.head_masks.is_empty() {
        // Head h takes head_masks[h mod n]: every mask evaluated, the head's selected.
        let n = b.const_i32(f.head_masks.len() as i64);
        let which = b.binary(crate::ir::BinOp::Rem, head, n);
        let all = b.full(1.0, DType::I1, &[bm, bn]);
        let mut own = all;
        for (i, m) in f.head_masks.iter().enumerate().rev() {
            let v = m.emit(b, rows.q_pos, kv_pos).unwrap_or(all);
            let here = b.const_i32(i as i64);
            let is = b.cmp(CmpPred::Eq, which, here);
            own = if i + 1 == f.head_masks.len() { v } else { b.select(is, v, own) };
        }
        vis = b.and(vis, own);
    }
    if let (Some((q_ids, q_valid)), Some((_, ks))) = (rows.q_seg, m.segment_ids) {
        let kv_ids = b.load(ks, vec![Axis::Index(batch), Axis::Range { start: j0, size: bn, limit: None }], -1.0);
        let kv_ids = b.expand_dims(kv_ids, 0);
        let same = b.cmp(CmpPred::Eq, q_ids, kv_ids);
        let ok = b.and(same, q_valid);
        vis = b.and(vis, ok);
    }
    if let Some(am) = m.attention_mask {
        let rows = Axis::Range { start: i0, size: bm, limit: None };
        let cols = Axis::Range { start: j0, size: bn, limit: None };
        let t = b.load(am, vec![Axis::Index(batch), Axis::Index(head), rows, cols], 0.0);
        vis = b.and(vis, t);
    }
    vis
}

/// The layout builder: see the module's docs. With `classes` (the backward's layout) it
/// also writes each visited block's kind to `block_class[lb, lh, qb, kb]` (2 full, 1
/// partial, 0 skipped; the blocks it does not visit keep the temporary's zero fill), from
/// which the backward transposes the lists.
pub(super) fn build_layout(name: &str, k: &BsKernel, classes: bool) -> Result<Kernel, VerifyError> {
    let f = &k.features;
    let (bm, bn) = (k.block_m, k.block_n);
    let mut b = KernelBuilder::new(name);
    let mut m = mask_inputs(&mut b, f);
    let [block_count, block_idx] = layout_params(&mut b);
    let block_class = classes.then(|| b.param("block_class", Type::Tensor(DType::I32, 4)));
    let seq_q = b.param("seq_q", Type::Scalar(DType::I32));
    let seq_k = b.param("seq_k", Type::Scalar(DType::I32));
    mask_scalars(&mut b, f, &mut m);
    b.set_grid([
        GridExpr::cdiv(GridExpr::sym("seq_q"), bm as i64),
        if f.per_head() { GridExpr::sym("heads_q") } else { GridExpr::Const(1) },
        if f.data_dependent() { GridExpr::sym("batch") } else { GridExpr::Const(1) },
    ]);
    let qb = b.program_id(0);
    let lh = b.program_id(1);
    let lb = b.program_id(2);
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let bm_c = b.const_i32(bm as i64);
    let bn_c = b.const_i32(bn as i64);
    let i0 = b.mul(qb, bm_c);
    let rows = row_mask(&mut b, &m, lb, i0, bm);
    let row_in = b.cmp(CmpPred::Lt, rows.q_idx, seq_q);
    let row_out = b.unary(UnOp::Not, row_in);
    let one = b.full(1.0, DType::F32, &[bm, bn]);
    let zero = b.full(0.0, DType::F32, &[bm, bn]);
    let nk = cdiv(&mut b, seq_k, bn_c, c1);
    // Only the key blocks the mask algebra can show to some row of the block are
    // evaluated (the rest are skipped without a look): [lo, hi) keys, clamped to the
    // sequence, as blocks.
    let last = b.add(i0, bm_c);
    let last = b.min(last, seq_q);
    let last = b.sub(last, c1);
    // (Positions move the mask algebra off the indices: every key block is looked at.)
    let (mut lo, mut hi) = if f.positions { (None, None) } else { f.mask.emit_key_range(&mut b, i0, last) };
    if !f.positions {
        // The run-time window and chunks bound the keys as their algebra forms do:
        // [first − left, last + right]; [the first row's chunk start, last].
        let mut tighten = |b: &mut KernelBuilder, l: Value, h: Value| {
            lo = Some(match lo {
                Some(x) => b.max(x, l),
                None => l,
            });
            hi = Some(match hi {
                Some(x) => b.min(x, h),
                None => h,
            });
        };
        if let Some((l, r)) = m.window {
            let a = b.sub(i0, l);
            let e = b.add(last, r);
            let e = b.add(e, c1);
            tighten(&mut b, a, e);
        }
        if let Some(c) = m.chunk {
            let a = b.div(i0, c);
            let a = b.mul(a, c);
            let e = b.add(last, c1);
            tighten(&mut b, a, e);
        }
    }
    let kb_lo = match lo {
        Some(lo) => {
            let lo = b.max(lo, c0);
            b.div(lo, bn_c)
        }
        None => c0,
    };
    let kb_hi = match hi {
        Some(hi) => {
            let hi = b.max(hi, c0);
            let h = cdiv(&mut b, hi, bn_c, c1);
            b.min(h, nk)
        }
        None => nk,
    };
    let z = b.const_f32(0.0);
    let last_slot = b.dim(block_idx, 3);
    let last_slot = b.sub(last_slot, c1);
    let at = |slot: Value| {
        [Axis::Index(lb), Axis::Index(lh), Axis::Index(qb), Axis::Range { start: slot, size: 1, limit: None }]
    };
    let counts = b.for_loop(kb_lo, kb_hi, c1, &[z, z], |b, kb, carried| {
        let (nf, np) = (carried[0], carried[1]);
        let j0 = b.mul(kb, bn_c);
        let vis = block_visibility(b, f, &m, &rows, (lb, lh), (i0, bm), (j0, bn), seq_k);
        // Over the rows of the sequence: does any see a key, does every one see every key?
        let seen = b.and(vis, row_in);
        let seen = b.select(seen, one, zero);
        let any = b.reduce(ReduceOp::Max, seen, 1);
        let any = b.reduce(ReduceOp::Max, any, 0);
        let all = b.binary(crate::ir::BinOp::Or, vis, row_out);
        let all = b.select(all, one, zero);
        let all = b.reduce(ReduceOp::Min, all, 1);
        let all = b.reduce(ReduceOp::Min, all, 0);
        let part = b.sub(any, all);
        // The block's index goes to the next free slot at each end of the row; a slot
        // counts only if the block is of that kind, else the next block overwrites it.
        // Neither reaches the other's claimed slots: nf + np < the blocks seen <= NK.
        let id = b.splat(kb, &[1]);
        let front = b.cast(nf, DType::I32);
        let back = b.cast(np, DType::I32);
        let back = b.sub(last_slot, back);
        b.store(block_idx, at(front).to_vec(), id);
        b.store(block_idx, at(back).to_vec(), id);
        if let Some(bc) = block_class {
            let two = b.const_f32(2.0);
            let class = b.mul(all, two);
            let class = b.add(class, part);
            let class = b.cast(class, DType::I32);
            let class = b.splat(class, &[1]);
            b.store(bc, at(kb).to_vec(), class);
        }
        let nf = b.add(nf, all);
        let np = b.add(np, part);
        vec![nf, np]
    });
    let c = |b: &mut KernelBuilder, v: Value| {
        let n = b.cast(v, DType::I32);
        b.splat(n, &[1])
    };
    let nf = c(&mut b, counts[0]);
    let np = c(&mut b, counts[1]);
    for (i, n) in [(c0, nf), (c1, np)] {
        let here = [Axis::Index(lb), Axis::Index(lh), Axis::Index(qb), Axis::Range { start: i, size: 1, limit: None }];
        b.store(block_count, here.to_vec(), n);
    }
    b.finish()
}

/// A block's bias: the bias tensor, `(batch, head)` and the block's first row and key.
pub(super) type BiasBlock = (Value, (Value, Value), (Value, Value));

/// How a block's `q·k` becomes its logits in the exp2 domain (shared by the forward and
/// the backward): `scale · log2(e)` folded into one multiply, or with a soft cap `c`,
/// `(q·k) · (scale / c)`, its tanh and a multiply by `c · log2(e)`; a bias joins the
/// scaled scores before the cap (times `log2(e)`, or `1 / c` under a cap).
pub(super) struct ScoreScale {
    qk_scale: Value,
    cap_out: Option<Value>,
    bias_scale: Value,
}

impl ScoreScale {
    pub(super) fn new(b: &mut KernelBuilder, scale: Value, softcap: Option<Value>, log2e: Value) -> ScoreScale {
        match softcap {
            None => ScoreScale { qk_scale: b.mul(scale, log2e), cap_out: None, bias_scale: log2e },
            Some(c) => {
                let qk_scale = b.div(scale, c);
                let cap_out = Some(b.mul(c, log2e));
                let one = b.const_f32(1.0);
                let bias_scale = b.div(one, c);
                ScoreScale { qk_scale, cap_out, bias_scale }
            }
        }
    }

    /// The `[bm, bn]` logits (exp2 domain) of the block's `qk` and, with `grad` under a
    /// soft cap, `1 − tanh²` (the cap's derivative); `bias`: the bias tensor and the
    /// block's `(batch, head)` and first row and key `(i0, j0)`.
    pub(super) fn logits(
        &self,
        b: &mut KernelBuilder,
        qk: Value,
        (bm, bn): (usize, usize),
        bias: Option<BiasBlock>,
        grad: bool,
    ) -> (Value, Option<Value>) {
        let mut s = b.mul(qk, self.qk_scale);
        if let Some((t, (batch, head), (i0, j0))) = bias {
            let u = crate::flash::frontend::load_block(b, t, batch, head, (i0, bm), (j0, bn));
            let u = b.cast(u, DType::F32);
            let u = b.mul(u, self.bias_scale);
            s = b.add(s, u);
        }
        match self.cap_out {
            None => (s, None),
            Some(o) => {
                let t = b.unary(UnOp::Tanh, s);
                let capped = b.mul(t, o);
                let grad = grad.then(|| {
                    let one = b.full(1.0, DType::F32, &[bm, bn]);
                    let t2 = b.mul(t, t);
                    b.sub(one, t2)
                });
                (capped, grad)
            }
        }
    }
}

/// The attention kernel: see the module's docs.
fn build_main(name: &str, k: &BsKernel) -> Result<Kernel, VerifyError> {
    let f = &k.features;
    let (bm, bn, d, dv) = (k.block_m, k.block_n, k.head_dim, k.head_dim_v);
    let mut b = KernelBuilder::new(name);
    let t4 = Type::Tensor(k.dtype, 4);
    let query = b.param("query", t4.clone());
    let key = b.param("key", t4.clone());
    let value = b.param("value", t4.clone());
    let out = b.param("out", t4);
    let lse = b.param("lse", Type::Tensor(DType::F32, 3));
    let mut m = mask_inputs(&mut b, f);
    let bias = f.bias.then(|| b.param("bias", Type::Tensor(k.dtype, 4)));
    let sinks = f.sinks.then(|| b.param("sinks", Type::Tensor(DType::F32, 2)));
    let [block_count, block_idx] = layout_params(&mut b);
    let scale = b.param("softmax_scale", Type::Scalar(DType::F32));
    let softcap = f.soft_cap.then(|| b.param("logits_soft_cap", Type::Scalar(DType::F32)));
    mask_scalars(&mut b, f, &mut m);
    b.set_grid([GridExpr::cdiv(GridExpr::sym("seq_q"), bm as i64), GridExpr::sym("heads_q"), GridExpr::sym("batch")]);
    let pid = b.program_id(0);
    let head = b.program_id(1);
    let batch = b.program_id(2);
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    // The last query block first: under a causal-like mask the last rows visit the most
    // key blocks, and a grid that starts them first ends with short programs, not long
    // ones (FlashAttention's order).
    let seq_q = b.dim(query, 2);
    let bm_c = b.const_i32(bm as i64);
    let nq = cdiv(&mut b, seq_q, bm_c, c1);
    let last = b.sub(nq, c1);
    let qb = b.sub(last, pid);
    let heads_q = b.dim(query, 1);
    let heads_kv = b.dim(key, 1);
    let group = b.div(heads_q, heads_kv);
    let kv_head = b.div(head, group);
    let seq_k = b.dim(key, 2);
    let bn_c = b.const_i32(bn as i64);
    let i0 = b.mul(qb, bm_c);
    let lb = if f.data_dependent() { batch } else { c0 };
    let lh = if f.per_head() { head } else { c0 };
    let cols = |n: usize| Axis::Range { start: c0, size: n, limit: None };
    let q_tile = b.load(
        query,
        vec![Axis::Index(batch), Axis::Index(head), Axis::Range { start: i0, size: bm, limit: None }, cols(d)],
        0.0,
    );
    let rows = row_mask(&mut b, &m, batch, i0, bm);

    let mut m_i = b.full(f64::NEG_INFINITY, DType::F32, &[bm]);
    let mut l_i = b.full(0.0, DType::F32, &[bm]);
    let acc = b.full(0.0, DType::F32, &[bm, dv]);
    let log2e = b.const_f32(LOG2_E);
    if let Some(sinks) = sinks {
        (m_i, l_i) = crate::flash::frontend::enter_sinks(&mut b, sinks, head, bm, (c0, c1, log2e), (m_i, l_i));
    }
    let sc = ScoreScale::new(&mut b, scale, softcap, log2e);
    let neg_inf = b.full(f64::NEG_INFINITY, DType::F32, &[bm, bn]);
    let zero_s = b.full(0.0, DType::F32, &[bm, bn]);
    let row = [Axis::Index(lb), Axis::Index(lh), Axis::Index(qb)];
    let n_full = b.load(block_count, [&row[..], &[Axis::Index(c0)]].concat(), 0.0);
    let n_part = b.load(block_count, [&row[..], &[Axis::Index(c1)]].concat(), 0.0);
    let n = b.add(n_full, n_part);
    let last_slot = b.dim(block_idx, 3);
    let last_slot = b.sub(last_slot, c1);
    let s_ty = Type::tile(DType::F32, &[bm, bn]);
    let carried = b.for_loop(c0, n, c1, &[acc, m_i, l_i], |b, t, st| {
        let (acc, m_i, l_i) = (st[0], st[1], st[2]);
        // Full blocks from the front of the row, then partial ones from its back.
        let full = b.cmp(CmpPred::Lt, t, n_full);
        let past = b.sub(t, n_full);
        let back = b.sub(last_slot, past);
        let slot = b.select(full, t, back);
        let kb = b.load(block_idx, [&row[..], &[Axis::Index(slot)]].concat(), 0.0);
        let j0 = b.mul(kb, bn_c);
        let kv_rows = Axis::Range { start: j0, size: bn, limit: None };
        let k_tile = b.load(key, vec![Axis::Index(batch), Axis::Index(kv_head), kv_rows, cols(d)], 0.0);
        let qk = b.dot(q_tile, k_tile, zero_s, false, true);
        let s = sc.logits(b, qk, (bm, bn), bias.map(|t| (t, (batch, head), (i0, j0))), false).0;
        // Only a partial block evaluates the element mask.
        let s = b.if_else(
            full,
            std::slice::from_ref(&s_ty),
            |_| vec![s],
            |b| {
                let vis = block_visibility(b, f, &m, &rows, (batch, head), (i0, bm), (j0, bn), seq_k);
                vec![b.select(vis, s, neg_inf)]
            },
        )[0];
        let (p, alpha, m_new, l_new) = b.softmax_update(s, m_i, l_i);
        let acc = b.softmax_rescale(acc, alpha);
        let p = b.cast(p, k.dtype);
        let kv_rows = Axis::Range { start: j0, size: bn, limit: None };
        let v_tile = b.load(value, vec![Axis::Index(batch), Axis::Index(kv_head), kv_rows, cols(dv)], 0.0);
        let acc = b.dot(p, v_tile, acc, false, false);
        vec![acc, m_new, l_new]
    });
    let (o, l) = b.softmax_finalize(carried[0], carried[1], carried[2]);
    let o = b.cast(o, k.dtype);
    let row_range = Axis::Range { start: i0, size: bm, limit: None };
    b.store(out, vec![Axis::Index(batch), Axis::Index(head), row_range, cols(dv)], o);
    let row_range = Axis::Range { start: i0, size: bm, limit: None };
    b.store(lse, vec![Axis::Index(batch), Axis::Index(head), row_range], l);
    b.finish()
}
