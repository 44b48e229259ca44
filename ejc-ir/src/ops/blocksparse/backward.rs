//! The tile programs of block-sparse attention's backward (`blocksparse_attention_bwd`):
//! FlashAttention-2's deterministic plan over block layouts, so that the backward, like
//! the forward, never reads a skipped block and evaluates the mask only on partial ones.
//!
//! The plan `layout` launches, in order:
//!
//! - **layout**: the forward's layout kernel ([`super::kernels`]): per query block, its
//!   full and partial key blocks (`block_count`, `block_idx`), and each visited block's
//!   kind in `block_class [LB, LH, NQ, NK]` (2 full, 1 partial, 0 skipped);
//! - **layout_t**: the transposed layout, per key block the query blocks that see it:
//!   program `(kb, lhk, lb)` reads column `kb` of `block_class` and writes the full ones
//!   from the front and the partial ones from the back of one list, `kv_count [LB, LHK,
//!   NK, 2]` and `kv_idx [LB, LH, NK, NQ]`. With a mask per head (an attention mask) the
//!   list of KV head `kvh` covers every query head of its group: entry `hg · NQ + qb`
//!   (head `kvh · G + hg`), flat slot `s` at `kv_idx[lb, kvh · G + s / NQ, kb, s % NQ]`;
//!   otherwise `G` = 1 and one list serves every head;
//! - **preprocess**: `delta = rowsum(dout ∘ out)` (f32) per query row;
//! - **dkdv**: one program per key block of one KV head: it follows its list (over every
//!   query head of the group when the list is shared), recomputes `P = exp(s − lse)`
//!   with the element mask on partial blocks only, and keeps `dK`, `dV` in registers;
//! - **dq**: one program per query block (the last first, as the forward), following the
//!   forward's list: `dQ = scale · Σ dS k` (with sinks it also rewrites its rows of
//!   `delta` as `Σ P dP` in f32, which dsinks sums; with `bias_grad` it writes each
//!   visited block's `dU` to `dbias` and zeros to the blocks `block_class` marks skipped);
//! - **dsinks** (sinks variants): `−Σ exp(sink − lse) · delta` per (head, sink).
//!
//! Every sum is taken in one order: the plan is deterministic.
//!
//! ```
//! use ejc_ir::ops::blocksparse::backward::{build_bwd, BwdRole};
//! use ejc_ir::ops::blocksparse::reference::BsFeatures;
//! use ejc_ir::types::DType;
//! let f = BsFeatures::default();
//! let k = build_bwd("dkdv", BwdRole::DkDv, &f, DType::BF16, (64, 64), (64, 64)).unwrap();
//! let names: Vec<&str> = k.params.iter().map(|p| p.name.as_str()).collect();
//! assert_eq!(names, ["query", "key", "value", "dout", "lse", "delta", "dk", "dv", "kv_count", "kv_idx", "softmax_scale"]);
//! ```

use std::f64::consts::LOG2_E;

use super::kernels::{
    block_visibility, build_layout, mask_inputs, mask_scalars, row_mask, BsKernel, MaskInputs, Role, ScoreScale,
};
use super::reference::BsFeatures;
use crate::builder::{Axis, KernelBuilder};
use crate::flash::frontend::cdiv;
use crate::ir::{BinOp, CmpPred, GridExpr, Kernel, ReduceOp, UnOp, Value};
use crate::types::{DType, Type};
use crate::verify::VerifyError;

/// Rows per step of the dsinks kernel (a constant: its config has no tile axis, so it
/// pairs with every tiling of the rest).
pub const DSINKS_ROWS: usize = 64;

/// A kernel of the backward's plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdRole {
    Layout,
    LayoutT,
    Preprocess,
    DkDv,
    Dq,
    Dsinks,
}

impl BwdRole {
    pub const ALL: [BwdRole; 6] =
        [BwdRole::Layout, BwdRole::LayoutT, BwdRole::Preprocess, BwdRole::DkDv, BwdRole::Dq, BwdRole::Dsinks];

    pub fn name(self) -> &'static str {
        match self {
            BwdRole::Layout => "layout",
            BwdRole::LayoutT => "layout_t",
            BwdRole::Preprocess => "preprocess",
            BwdRole::DkDv => "dkdv",
            BwdRole::Dq => "dq",
            BwdRole::Dsinks => "dsinks",
        }
    }

    pub fn from_name(s: &str) -> Option<BwdRole> {
        BwdRole::ALL.into_iter().find(|r| r.name() == s)
    }

    /// The plan's kernels for a variant, in launch order.
    pub fn roles(f: &BsFeatures) -> Vec<BwdRole> {
        BwdRole::ALL.into_iter().filter(|r| *r != BwdRole::Dsinks || f.sinks).collect()
    }
}

/// Every parameter's meaning that the forward's list lacks.
pub fn bwd_param_docs() -> &'static [(&'static str, &'static str)] {
    &[
        ("out", "input: the forward's output [B, H, Sq, Dv]"),
        ("lse", "input: the forward's log-sum-exp (natural log) [B, H, Sq], f32"),
        ("dout", "input: the gradient of the output [B, H, Sq, Dv]"),
        ("dq", "output: gradient of the query [B, H, Sq, D]"),
        ("dk", "output: gradient of the key [B, KVH, Sk, D] (summed over each group)"),
        ("dv", "output: gradient of the value [B, KVH, Sk, Dv]"),
        ("dsinks", "output: gradient of the sinks [H, n_sinks], f32"),
        (
            "dbias",
            "output (bias_grad): gradient of each logit's bias [B, H, Sq, Sk], the query's dtype (0 where the key is \
             hidden; a caller that broadcast the bias sums it over the broadcast axes)",
        ),
        ("delta", "temporary: rowsum(dout * out) per query row [B, H, Sq], f32"),
        ("block_class", "temporary (layout): each block's kind [LB, LH, NQ, NK], i32: 2 full, 1 partial, 0 skipped"),
        ("kv_count", "temporary (layout_t): full and partial query blocks per key block [LB, LHK, NK, 2], i32"),
        (
            "kv_idx",
            "temporary (layout_t): the query blocks of each key block [LB, LH, NK, NQ], i32 (entry hg * NQ + qb; \
             full from the front, partial from the back)",
        ),
    ]
}

/// One kernel of the plan, verified: `dims` the (query/key, value) head dims, `tile`
/// (block_m, block_n).
pub fn build_bwd(
    name: &str,
    role: BwdRole,
    f: &BsFeatures,
    dtype: DType,
    (d, dv): (usize, usize),
    (bm, bn): (usize, usize),
) -> Result<Kernel, VerifyError> {
    let k = BsKernel {
        role: Role::Layout,
        features: f.clone(),
        dtype,
        head_dim: d,
        head_dim_v: dv,
        block_m: bm,
        block_n: bn,
    };
    match role {
        BwdRole::Layout => build_layout(name, &k, true),
        BwdRole::LayoutT => layout_t(name, &k),
        BwdRole::Preprocess => preprocess(name, &k),
        BwdRole::DkDv => dkdv(name, &k),
        BwdRole::Dq => dq(name, &k),
        BwdRole::Dsinks => dsinks(name),
    }
}

/// The transposed layout: see the module's docs.
fn layout_t(name: &str, k: &BsKernel) -> Result<Kernel, VerifyError> {
    let f = &k.features;
    let mut b = KernelBuilder::new(name);
    let block_class = b.param("block_class", Type::Tensor(DType::I32, 4));
    let kv_count = b.param("kv_count", Type::Tensor(DType::I32, 4));
    let kv_idx = b.param("kv_idx", Type::Tensor(DType::I32, 4));
    b.set_grid([
        GridExpr::cdiv(GridExpr::sym("seq_k"), k.block_n as i64),
        if f.per_head() { GridExpr::sym("heads_kv") } else { GridExpr::Const(1) },
        if f.data_dependent() { GridExpr::sym("batch") } else { GridExpr::Const(1) },
    ]);
    let kb = b.program_id(0);
    let lhk = b.program_id(1);
    let lb = b.program_id(2);
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let c2 = b.const_i32(2);
    // Query heads per list: the layout's heads over the lists' (1 when shared).
    let n_lh = b.dim(block_class, 1);
    let n_lhk = b.dim(kv_count, 1);
    let groups = b.div(n_lh, n_lhk);
    let nq = b.dim(block_class, 2);
    let first_row = b.mul(lhk, groups);
    let trips = b.mul(groups, nq);
    let last_slot = b.sub(trips, c1);
    let nq1 = b.max(nq, c1);
    let at = move |b: &mut KernelBuilder, slot: Value| {
        let r = b.div(slot, nq1);
        let r = b.add(first_row, r);
        let c = b.binary(BinOp::Rem, slot, nq1);
        vec![Axis::Index(lb), Axis::Index(r), Axis::Index(kb), Axis::Range { start: c, size: 1, limit: None }]
    };
    let counts = b.for_loop(c0, trips, c1, &[c0, c0], |b, t, carried| {
        let (nf, np) = (carried[0], carried[1]);
        let hg = b.div(t, nq1);
        let qb = b.binary(BinOp::Rem, t, nq1);
        let row = b.add(first_row, hg);
        let class = b.load(block_class, vec![Axis::Index(lb), Axis::Index(row), Axis::Index(qb), Axis::Index(kb)], 0.0);
        let full = b.cmp(CmpPred::Eq, class, c2);
        let part = b.cmp(CmpPred::Eq, class, c1);
        // As the forward's layout: the entry goes to the next free slot at each end; a
        // slot counts only if the block is of that kind.
        let id = b.splat(t, &[1]);
        let front = at(b, nf);
        b.store(kv_idx, front, id);
        let back = b.sub(last_slot, np);
        let back = at(b, back);
        b.store(kv_idx, back, id);
        let nf1 = b.add(nf, c1);
        let np1 = b.add(np, c1);
        let nf = b.select(full, nf1, nf);
        let np = b.select(part, np1, np);
        vec![nf, np]
    });
    for (i, n) in [(c0, counts[0]), (c1, counts[1])] {
        let n = b.splat(n, &[1]);
        let here =
            vec![Axis::Index(lb), Axis::Index(lhk), Axis::Index(kb), Axis::Range { start: i, size: 1, limit: None }];
        b.store(kv_count, here, n);
    }
    b.finish()
}

/// `delta[b, h, i] = Σ_c dout[b, h, i, c] · out[b, h, i, c]` in f32.
fn preprocess(name: &str, k: &BsKernel) -> Result<Kernel, VerifyError> {
    let (bm, dv) = (k.block_m, k.head_dim_v);
    let mut b = KernelBuilder::new(name);
    let t4 = Type::Tensor(k.dtype, 4);
    let out = b.param("out", t4.clone());
    let dout = b.param("dout", t4);
    let delta = b.param("delta", Type::Tensor(DType::F32, 3));
    b.set_grid([GridExpr::cdiv(GridExpr::sym("seq_q"), bm as i64), GridExpr::sym("heads_q"), GridExpr::sym("batch")]);
    let qb = b.program_id(0);
    let head = b.program_id(1);
    let batch = b.program_id(2);
    let c0 = b.const_i32(0);
    let bm_c = b.const_i32(bm as i64);
    let i0 = b.mul(qb, bm_c);
    let rows = Axis::Range { start: i0, size: bm, limit: None };
    let cols = Axis::Range { start: c0, size: dv, limit: None };
    let at = vec![Axis::Index(batch), Axis::Index(head), rows, cols];
    let o = b.load(out, at.clone(), 0.0);
    let g = b.load(dout, at, 0.0);
    let o = b.cast(o, DType::F32);
    let g = b.cast(g, DType::F32);
    let og = b.mul(o, g);
    let s = b.reduce(ReduceOp::Sum, og, 1);
    b.store(delta, vec![Axis::Index(batch), Axis::Index(head), rows], s);
    b.finish()
}

/// What dkdv and dq share: inputs, the scores' scale, the constants.
struct Scores {
    query: Value,
    key: Value,
    value: Value,
    dout: Value,
    lse: Value,
    delta: Value,
    mask: MaskInputs,
    /// `bias [B, H, Sq, Sk]` (bias variants).
    bias: Option<Value>,
    scale: Value,
    /// How q·k becomes the logits in the exp2 domain (scale, bias, soft cap).
    logits: ScoreScale,
    c0: Value,
    c1: Value,
    log2e: Value,
}

/// Declares dkdv's or dq's parameters in ABI order — the inputs, `outputs`, the mask's
/// tensors, `layout` (the layout's temporaries it follows), the scalars — and the
/// constants: the scores' context, the outputs and the layout tensors.
fn declare(b: &mut KernelBuilder, k: &BsKernel, outputs: &[&str], layout: &[&str]) -> (Scores, Vec<Value>, Vec<Value>) {
    let t4 = Type::Tensor(k.dtype, 4);
    let f3 = Type::Tensor(DType::F32, 3);
    let query = b.param("query", t4.clone());
    let key = b.param("key", t4.clone());
    let value = b.param("value", t4.clone());
    let dout = b.param("dout", t4.clone());
    let lse = b.param("lse", f3.clone());
    let delta = b.param("delta", f3);
    let outs = outputs.iter().map(|n| b.param(n, t4.clone())).collect();
    let mut mask = mask_inputs(b, &k.features);
    let bias = k.features.bias.then(|| b.param("bias", t4.clone()));
    let layout = layout.iter().map(|n| b.param(n, Type::Tensor(DType::I32, 4))).collect();
    let scale = b.param("softmax_scale", Type::Scalar(DType::F32));
    let softcap = k.features.soft_cap.then(|| b.param("logits_soft_cap", Type::Scalar(DType::F32)));
    mask_scalars(b, &k.features, &mut mask);
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let log2e = b.const_f32(LOG2_E);
    // Scores into the exp2 domain, as the forward's.
    let logits = ScoreScale::new(b, scale, softcap, log2e);
    let sc = Scores { query, key, value, dout, lse, delta, mask, bias, scale, logits, c0, c1, log2e };
    (sc, outs, layout)
}

impl Scores {
    /// `lse` (exp2 domain; +∞ where it is −∞ or past the rows: P = 0) and `delta` of `bm`
    /// rows from `i0` of `(batch, head)`, as `[bm, 1]` columns.
    fn row_stats(&self, b: &mut KernelBuilder, batch: Value, head: Value, i0: Value, bm: usize) -> (Value, Value) {
        let at = vec![Axis::Index(batch), Axis::Index(head), Axis::Range { start: i0, size: bm, limit: None }];
        crate::flash::backward::row_stats_at(b, (self.lse, self.delta), at, bm, self.log2e)
    }

    /// `n` rows from `r0` of `(batch, head)` of a BHSD tensor, `cols` wide.
    fn rows(
        &self,
        b: &mut KernelBuilder,
        t: Value,
        (batch, head): (Value, Value),
        r0: Value,
        n: usize,
        cols: usize,
    ) -> Value {
        let rows = Axis::Range { start: r0, size: n, limit: None };
        let cols = Axis::Range { start: self.c0, size: cols, limit: None };
        b.load(t, vec![Axis::Index(batch), Axis::Index(head), rows, cols], 0.0)
    }

    /// One block's `P` (f32 `[bm, bn]`) and, under a soft cap, `1 − tanh²`: `full`
    /// blocks skip the element mask.
    #[allow(clippy::too_many_arguments)]
    fn probabilities(
        &self,
        b: &mut KernelBuilder,
        k: &BsKernel,
        q_tile: Value,
        k_tile: Value,
        lse2: Value,
        kind: BlockKind,
        (batch, head): (Value, Value),
        (i0, j0): (Value, Value),
        seq_k: Value,
    ) -> (Value, Option<Value>) {
        let (bm, bn) = (k.block_m, k.block_n);
        let zero = b.full(0.0, DType::F32, &[bm, bn]);
        let qk = b.dot(q_tile, k_tile, zero, false, true);
        let bias = self.bias.map(|t| (t, (batch, head), (i0, j0)));
        let (s, cap_grad) = self.logits.logits(b, qk, (bm, bn), bias, true);
        let neg_inf = b.full(f64::NEG_INFINITY, DType::F32, &[bm, bn]);
        let s_ty = Type::tile(DType::F32, &[bm, bn]);
        let f = &k.features;
        let masked = |b: &mut KernelBuilder| {
            let rows = row_mask(b, &self.mask, batch, i0, bm);
            let vis = block_visibility(b, f, &self.mask, &rows, (batch, head), (i0, bm), (j0, bn), seq_k);
            b.select(vis, s, neg_inf)
        };
        let s = match kind {
            BlockKind::Full => s,
            BlockKind::Partial => masked(b),
            BlockKind::Either(full) => {
                b.if_else(full, std::slice::from_ref(&s_ty), |_| vec![s], |b| vec![masked(b)])[0]
            }
        };
        let x = b.sub(s, lse2);
        (b.unary(UnOp::Exp2, x), cap_grad)
    }
}

/// What a loop knows of its blocks' kind: the element mask is evaluated on partial
/// blocks only.
#[derive(Clone, Copy)]
enum BlockKind {
    Full,
    Partial,
    /// Full where the i1 scalar is true: a branch per block.
    Either(Value),
}

/// `dS = P ∘ (dP − delta)` (times the cap's derivative) with `dP = dout vᵀ`; returns
/// `(dS, P ∘ dP)`.
fn score_grad(
    b: &mut KernelBuilder,
    (bm, bn): (usize, usize),
    (p, cap_grad): (Value, Option<Value>),
    do_tile: Value,
    v_tile: Value,
    delta: Value,
) -> (Value, Value) {
    let zero = b.full(0.0, DType::F32, &[bm, bn]);
    let dp = b.dot(do_tile, v_tile, zero, false, true);
    let x = b.sub(dp, delta);
    let mut ds = b.mul(p, x);
    if let Some(g) = cap_grad {
        ds = b.mul(ds, g);
    }
    (ds, b.mul(p, dp))
}

/// One key block of one KV head: see the module's docs.
fn dkdv(name: &str, k: &BsKernel) -> Result<Kernel, VerifyError> {
    let f = &k.features;
    let (bm, bn, d, dv) = (k.block_m, k.block_n, k.head_dim, k.head_dim_v);
    let mut b = KernelBuilder::new(name);
    let (sc, outs, layout) = declare(&mut b, k, &["dk", "dv"], &["kv_count", "kv_idx"]);
    let (kv_count, kv_idx) = (layout[0], layout[1]);
    let (dk_out, dv_out) = (outs[0], outs[1]);
    b.set_grid([GridExpr::cdiv(GridExpr::sym("seq_k"), bn as i64), GridExpr::sym("heads_kv"), GridExpr::sym("batch")]);
    let kb = b.program_id(0);
    let kv_head = b.program_id(1);
    let batch = b.program_id(2);
    let (c0, c1) = (sc.c0, sc.c1);
    let heads_q = b.dim(sc.query, 1);
    let heads_kv = b.dim(sc.key, 1);
    let group = b.div(heads_q, heads_kv);
    let seq_k = b.dim(sc.key, 2);
    let bn_c = b.const_i32(bn as i64);
    let bm_c = b.const_i32(bm as i64);
    let j0 = b.mul(kb, bn_c);
    let k_tile = sc.rows(&mut b, sc.key, (batch, kv_head), j0, bn, d);
    let v_tile = sc.rows(&mut b, sc.value, (batch, kv_head), j0, bn, dv);
    let lb = if f.data_dependent() { batch } else { c0 };
    let lhk = if f.per_head() { kv_head } else { c0 };
    // A list per KV head covers its group's heads (G = group); a shared list is walked
    // once per head of the group (reps = group).
    let (groups, reps) = if f.per_head() {
        let lh = b.dim(kv_idx, 1);
        let lhk = b.dim(kv_count, 1);
        (b.div(lh, lhk), c1)
    } else {
        (c1, group)
    };
    let first_row = b.mul(lhk, groups);
    let first_head = b.mul(kv_head, group);
    let row = [Axis::Index(lb), Axis::Index(lhk), Axis::Index(kb)];
    let n_full = b.load(kv_count, [&row[..], &[Axis::Index(c0)]].concat(), 0.0);
    let n_part = b.load(kv_count, [&row[..], &[Axis::Index(c1)]].concat(), 0.0);
    let nq = b.dim(kv_idx, 3);
    let nq1 = b.max(nq, c1);
    let slots = b.mul(groups, nq);
    let last_slot = b.sub(slots, c1);
    let dk0 = b.full(0.0, DType::F32, &[bn, d]);
    let dv0 = b.full(0.0, DType::F32, &[bn, dv]);
    // Two loops, the full blocks (no mask) and then the partial ones (masked): one loop
    // with a branch per block, as dq has, keeps both forms of the scores live and spills
    // at d = 128 (measured: 140-290 bytes against 0 for the aligned warp-specialised entry).
    let mut acc = vec![dk0, dv0];
    for (count, kind) in [(n_full, BlockKind::Full), (n_part, BlockKind::Partial)] {
        let n1 = b.max(count, c1);
        let trips = b.mul(reps, count);
        acc = b.for_loop(c0, trips, c1, &acc, |b, t, carried| {
            let rep = b.div(t, n1);
            let e = b.binary(BinOp::Rem, t, n1);
            // Full blocks from the front of the list, partial ones from its back.
            let slot = match kind {
                BlockKind::Full => e,
                _ => b.sub(last_slot, e),
            };
            let r = b.div(slot, nq1);
            let r = b.add(first_row, r);
            let c = b.binary(BinOp::Rem, slot, nq1);
            let entry = b.load(kv_idx, vec![Axis::Index(lb), Axis::Index(r), Axis::Index(kb), Axis::Index(c)], 0.0);
            let hg = b.div(entry, nq1);
            let hg = b.add(hg, rep);
            let head = b.add(first_head, hg);
            let qb = b.binary(BinOp::Rem, entry, nq1);
            let i0 = b.mul(qb, bm_c);
            let q_tile = sc.rows(b, sc.query, (batch, head), i0, bm, d);
            let do_tile = sc.rows(b, sc.dout, (batch, head), i0, bm, dv);
            let (lse2, delta) = sc.row_stats(b, batch, head, i0, bm);
            let (p, cap_grad) = sc.probabilities(b, k, q_tile, k_tile, lse2, kind, (batch, head), (i0, j0), seq_k);
            let pc = b.cast(p, k.dtype);
            let dv_acc = b.dot(pc, do_tile, carried[1], true, false);
            let (ds, _) = score_grad(b, (bm, bn), (p, cap_grad), do_tile, v_tile, delta);
            let ds = b.cast(ds, k.dtype);
            let dk_acc = b.dot(ds, q_tile, carried[0], true, false);
            vec![dk_acc, dv_acc]
        });
    }
    let r = acc;
    let dk = b.mul(r[0], sc.scale);
    let dk = b.cast(dk, k.dtype);
    let dvt = b.cast(r[1], k.dtype);
    let store = |b: &mut KernelBuilder, t: Value, cols: usize, v: Value| {
        let rows = Axis::Range { start: j0, size: bn, limit: None };
        let cols = Axis::Range { start: c0, size: cols, limit: None };
        b.store(t, vec![Axis::Index(batch), Axis::Index(kv_head), rows, cols], v);
    };
    store(&mut b, dk_out, d, dk);
    store(&mut b, dv_out, dv, dvt);
    b.finish()
}

/// One query block: `dQ = scale · Σ dS k` over the forward's list.
fn dq(name: &str, k: &BsKernel) -> Result<Kernel, VerifyError> {
    let f = &k.features;
    let (bm, bn, d, dv) = (k.block_m, k.block_n, k.head_dim, k.head_dim_v);
    let mut b = KernelBuilder::new(name);
    let outputs: &[&str] = if f.bias_grad { &["dq", "dbias"] } else { &["dq"] };
    // dbias: this program writes its rows' dU on every block it visits and zeros on the
    // others, which `block_class` tells (0: skipped).
    let layout: &[&str] =
        if f.bias_grad { &["block_count", "block_idx", "block_class"] } else { &["block_count", "block_idx"] };
    let (sc, outs, layout) = declare(&mut b, k, outputs, layout);
    let (block_count, block_idx) = (layout[0], layout[1]);
    let dq_out = outs[0];
    let dbias = f.bias_grad.then(|| (outs[1], layout[2]));
    b.set_grid([GridExpr::cdiv(GridExpr::sym("seq_q"), bm as i64), GridExpr::sym("heads_q"), GridExpr::sym("batch")]);
    let pid = b.program_id(0);
    let head = b.program_id(1);
    let batch = b.program_id(2);
    let (c0, c1) = (sc.c0, sc.c1);
    let seq_q = b.dim(sc.query, 2);
    let bm_c = b.const_i32(bm as i64);
    let nq = cdiv(&mut b, seq_q, bm_c, c1);
    let last = b.sub(nq, c1);
    let qb = b.sub(last, pid);
    let heads_q = b.dim(sc.query, 1);
    let heads_kv = b.dim(sc.key, 1);
    let group = b.div(heads_q, heads_kv);
    let kv_head = b.div(head, group);
    let seq_k = b.dim(sc.key, 2);
    let bn_c = b.const_i32(bn as i64);
    let i0 = b.mul(qb, bm_c);
    let lb = if f.data_dependent() { batch } else { c0 };
    let lh = if f.per_head() { head } else { c0 };
    let q_tile = sc.rows(&mut b, sc.query, (batch, head), i0, bm, d);
    let do_tile = sc.rows(&mut b, sc.dout, (batch, head), i0, bm, dv);
    let (lse2, delta) = sc.row_stats(&mut b, batch, head, i0, bm);
    let row = [Axis::Index(lb), Axis::Index(lh), Axis::Index(qb)];
    let n_full = b.load(block_count, [&row[..], &[Axis::Index(c0)]].concat(), 0.0);
    let n_part = b.load(block_count, [&row[..], &[Axis::Index(c1)]].concat(), 0.0);
    let n = b.add(n_full, n_part);
    let last_slot = b.dim(block_idx, 3);
    let last_slot = b.sub(last_slot, c1);
    let mut inits = vec![b.full(0.0, DType::F32, &[bm, d])];
    if f.sinks {
        inits.push(b.full(0.0, DType::F32, &[bm]));
    }
    let r = b.for_loop(c0, n, c1, &inits, |b, t, carried| {
        let full = b.cmp(CmpPred::Lt, t, n_full);
        let past = b.sub(t, n_full);
        let back = b.sub(last_slot, past);
        let slot = b.select(full, t, back);
        let kb = b.load(block_idx, [&row[..], &[Axis::Index(slot)]].concat(), 0.0);
        let j0 = b.mul(kb, bn_c);
        let k_tile = sc.rows(b, sc.key, (batch, kv_head), j0, bn, d);
        let v_tile = sc.rows(b, sc.value, (batch, kv_head), j0, bn, dv);
        let pg = sc.probabilities(b, k, q_tile, k_tile, lse2, BlockKind::Either(full), (batch, head), (i0, j0), seq_k);
        let (ds, pdp) = score_grad(b, (bm, bn), pg, do_tile, v_tile, delta);
        let ds = b.cast(ds, k.dtype);
        if let Some((t, _)) = dbias {
            store_block(b, t, (batch, head), (i0, bm), (j0, bn), None, ds);
        }
        let mut out = vec![b.dot(ds, k_tile, carried[0], false, false)];
        if f.sinks {
            let s = b.reduce(ReduceOp::Sum, pdp, 1);
            out.push(b.add(carried[1], s));
        }
        out
    });
    let rows = Axis::Range { start: i0, size: bm, limit: None };
    if f.sinks {
        // Its own rows of delta, after reading them: Σ P dP in f32 (the forward's 16-bit
        // `out` leaves rowsum(dout ∘ out) a rounding off, which dsinks' sum over every
        // row would not cancel). dkdv ran before; dsinks runs next.
        b.store(sc.delta, vec![Axis::Index(batch), Axis::Index(head), rows], r[1]);
    }
    if let Some((t, block_class)) = dbias {
        // Zeros on the key blocks the layout skips: a store whose row limit is the block's
        // first row (nothing) where the block was visited, the sequence's end where not.
        let nk = cdiv(&mut b, seq_k, bn_c, c1);
        let zero = b.full(0.0, DType::F32, &[bm, bn]);
        let zero = b.cast(zero, k.dtype);
        b.for_loop(c0, nk, c1, &[], |b, kb, _| {
            let class = b.load(block_class, [&row[..], &[Axis::Index(kb)]].concat(), 0.0);
            let skipped = b.cmp(CmpPred::Eq, class, c0);
            let limit = b.select(skipped, seq_q, i0);
            let j0 = b.mul(kb, bn_c);
            store_block(b, t, (batch, head), (i0, bm), (j0, bn), Some(limit), zero);
            vec![]
        });
    }
    let g = b.mul(r[0], sc.scale);
    let g = b.cast(g, k.dtype);
    let rows = Axis::Range { start: i0, size: bm, limit: None };
    let cols = Axis::Range { start: c0, size: d, limit: None };
    b.store(dq_out, vec![Axis::Index(batch), Axis::Index(head), rows, cols], g);
    b.finish()
}

/// Stores the `[bm, bn]` tile `v` at rows `i0..`, keys `j0..` of `(batch, head)` of a
/// `[B, H, Sq, Sk]` tensor, rows from `limit` on left out (the tensor's sizes clip it).
fn store_block(
    b: &mut KernelBuilder,
    t: Value,
    (batch, head): (Value, Value),
    (i0, bm): (Value, usize),
    (j0, bn): (Value, usize),
    limit: Option<Value>,
    v: Value,
) {
    let rows = Axis::Range { start: i0, size: bm, limit };
    let cols = Axis::Range { start: j0, size: bn, limit: None };
    b.store(t, vec![Axis::Index(batch), Axis::Index(head), rows, cols], v);
}

/// `dsinks[h, t] = −Σ exp(sink − lse) · delta` over every row: flash's kernel body.
fn dsinks(name: &str) -> Result<Kernel, VerifyError> {
    let mut b = KernelBuilder::new(name);
    let f3 = Type::Tensor(DType::F32, 3);
    let lse = b.param("lse", f3.clone());
    let delta = b.param("delta", f3);
    let sinks = b.param("sinks", Type::Tensor(DType::F32, 2));
    let dsinks = b.param("dsinks", Type::Tensor(DType::F32, 2));
    b.set_grid([GridExpr::sym("heads_q"), GridExpr::sym("n_sinks"), GridExpr::Const(1)]);
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let log2e = b.const_f32(LOG2_E);
    crate::flash::backward::dsinks_sum(&mut b, [lse, delta, sinks, dsinks], (c0, c1, log2e), DSINKS_ROWS, &|_| None);
    b.finish()
}
