//! Spec → tile IR for the flash-attention backward (docs/semantics.md, "Flash-attention
//! backward"): FlashAttention-2's plan without atomics, so every gradient is summed in
//! one order (deterministic by construction).
//!
//! ```
//! use ejc_ir::flash::backward::{build_bwd_kernel, Role};
//! use ejc_ir::flash::Features;
//! use ejc_ir::types::DType;
//! let f = Features { causal: true, ..Default::default() };
//! let k = build_bwd_kernel("dkdv", Role::DkDv, &f, DType::BF16, 64.into(), 64, 64).unwrap();
//! let names: Vec<&str> = k.params.iter().map(|p| p.name.as_str()).collect();
//! assert_eq!(names, ["q", "k", "v", "dout", "lse", "delta", "dk", "dv", "softmax_scale"]);
//! ```
//!
//! Two plans ([`Plan`]). **`two_pass`** (deterministic) launches four roles in this
//! order:
//!
//! - **preprocess**: `delta = rowsum(dout ∘ out)` per query row, into an f32 temporary
//!   shaped like `lse`;
//! - **dkdv**: one program per key block of one KV head; it loops over the query blocks
//!   of every query head of the KV head's group, recomputing `P = exp(s − lse)`, and
//!   keeps `dK` and `dV` in registers (`dV += P'ᵀ dout`, `dK += scale · dSᵀ q`);
//! - **dq**: one program per query block, looping over the key blocks like the forward
//!   (`dQ += scale · dS k`);
//! - **dsinks** (sinks variants): one program per (head, sink), summing
//!   `−exp(sink − lse) · delta` over every row of every sequence; for sinks variants the
//!   dq kernel first rewrites its rows of `delta` as `Σ_j P dP` in f32 (the same value,
//!   without the rounding of the forward's 16-bit `out`, which this sum would not cancel).
//!
//! **`atomic`** (FlashAttention-2's and -3's plan) computes the scores once: its
//! `preprocess_dq` also zeroes an f32 `dq_accum` (and, for sinks, a `pdp` row sum);
//! `dkdv_dq` is `dkdv` that also adds each block's `dS k` into `dq_accum` (and its rows'
//! `Σ P dP` into `pdp`) with atomic adds; `dq_convert` writes `dq = scale · dq_accum`;
//! `dsinks` reads `pdp` as its `delta`. The atomic adds land in no fixed order, so `dq`
//! (and `dsinks`) may differ from run to run in the last bits.
//!
//! **dbias** (`bias_grad` variants): the kernel that sums dQ (`dq`, or `dkdv_dq`)
//! visits every (query block, key block) pair once, so it writes each visited block's
//! `dU` into `dbias`, and zeros into the blocks its loop skips (outside the causal
//! band or the window), so that every element is written.
//!
//! Every kernel recomputes the scores the forward computed (scale, bias, soft cap,
//! masks, dropout's keep-mask at the same Philox counters) from `q`, `k` and the
//! forward's `lse`; a row whose `lse` is −∞ (it saw nothing) is read as +∞, so its `P`
//! is 0 and it contributes nothing.

use std::f64::consts::LOG2_E;

use super::abi::AbiParam;
use super::features::{Features, SoftCap, Window};
use super::frontend::{cdiv, load_block, HeadDims};
use crate::builder::{Axis, KernelBuilder};
use crate::ir::{BinOp, CmpPred, GridExpr, Kernel, MaskTerm, ReduceOp, UnOp, Value};
use crate::types::{DType, Type};
use crate::verify::VerifyError;

/// A kernel of a backward plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Preprocess,
    PreprocessDq,
    DkDv,
    DkDvDq,
    Dq,
    DqConvert,
    Dsinks,
}

/// How the backward sums dQ over the key blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// A dQ kernel of its own that recomputes the scores: every sum in one order.
    TwoPass,
    /// dQ added by the dK/dV kernel into an f32 accumulator with atomic adds.
    Atomic,
}

impl Plan {
    pub const ALL: [Plan; 2] = [Plan::TwoPass, Plan::Atomic];

    pub fn name(self) -> &'static str {
        match self {
            Plan::TwoPass => "two_pass",
            Plan::Atomic => "atomic",
        }
    }

    pub fn from_name(s: &str) -> Option<Plan> {
        Plan::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Whether every run gives the same bits.
    pub fn deterministic(self) -> bool {
        self == Plan::TwoPass
    }

    /// The plan's kernels for a variant, in launch order.
    pub fn roles(self, f: &Features) -> Vec<Role> {
        let all: &[Role] = match self {
            Plan::TwoPass => &[Role::Preprocess, Role::DkDv, Role::Dq, Role::Dsinks],
            Plan::Atomic => &[Role::PreprocessDq, Role::DkDvDq, Role::DqConvert, Role::Dsinks],
        };
        all.iter().copied().filter(|r| r.applies(f)).collect()
    }
}

impl Role {
    pub const ALL: [Role; 7] =
        [Role::Preprocess, Role::PreprocessDq, Role::DkDv, Role::DkDvDq, Role::Dq, Role::DqConvert, Role::Dsinks];

    pub fn name(self) -> &'static str {
        match self {
            Role::Preprocess => "preprocess",
            Role::PreprocessDq => "preprocess_dq",
            Role::DkDv => "dkdv",
            Role::DkDvDq => "dkdv_dq",
            Role::Dq => "dq",
            Role::DqConvert => "dq_convert",
            Role::Dsinks => "dsinks",
        }
    }

    pub fn from_name(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.name() == s)
    }

    /// Whether a variant's backward has this kernel.
    pub fn applies(self, f: &Features) -> bool {
        self != Role::Dsinks || f.sinks
    }
}

fn p(name: &'static str, ty: Type, meaning: &'static str) -> AbiParam {
    AbiParam { name, ty, meaning }
}

/// The parameters of a role's kernel, in order: tensors (inputs, the temporary, outputs,
/// optional inputs), then scalars.
pub fn bwd_params(role: Role, f: &Features, dtype: DType) -> Vec<AbiParam> {
    let t4 = Type::Tensor(dtype, 4);
    let f3 = Type::Tensor(DType::F32, 3);
    let q = p("q", t4.clone(), "input: queries [B, Sq, Hq, D] (varlen: [1, total_q, Hq, D])");
    let k = p("k", t4.clone(), "input: keys [B, Sk, Hkv, D] (varlen: [1, total_k, Hkv, D])");
    let v = p("v", t4.clone(), "input: values [B, Sk, Hkv, Dv] (varlen: [1, total_k, Hkv, Dv])");
    let out = p("out", t4.clone(), "input: the forward's output [B, Sq, Hq, Dv]");
    let dout = p("dout", t4.clone(), "input: the gradient of the output [B, Sq, Hq, Dv]");
    let lse =
        p("lse", f3.clone(), "input: the forward's log-sum-exp (natural log) [B, Hq, Sq] (varlen: [1, Hq, total_q])");
    let delta = p("delta", f3.clone(), "temporary: rowsum(dout * out), f32, lse's shape");
    let dq_accum =
        p("dq_accum", Type::Tensor(DType::F32, 4), "temporary: dQ / scale summed by atomic adds, f32, q's shape");
    let pdp = p("pdp", f3, "temporary (sinks, atomic plan): rowsum(P * dP) by atomic adds, f32, lse's shape");
    let sinks = f.sinks;
    let mut v_ = match role {
        Role::Preprocess => vec![out, dout, delta],
        Role::PreprocessDq => {
            let mut v = vec![out, dout, delta, dq_accum];
            if sinks {
                v.push(pdp);
            }
            v
        }
        Role::DkDvDq => {
            let mut v = vec![
                q,
                k,
                v,
                dout,
                lse,
                delta,
                p("dk", t4.clone(), "output: gradient of k [B, Sk, Hkv, D]"),
                p("dv", t4.clone(), "output: gradient of v [B, Sk, Hkv, Dv]"),
                dq_accum,
            ];
            if sinks {
                v.push(pdp);
            }
            v
        }
        Role::DqConvert => vec![dq_accum, p("dq", t4.clone(), "output: gradient of q [B, Sq, Hq, D]")],
        Role::DkDv => vec![
            q,
            k,
            v,
            dout,
            lse,
            delta,
            p("dk", t4.clone(), "output: gradient of k [B, Sk, Hkv, D]"),
            p("dv", t4.clone(), "output: gradient of v [B, Sk, Hkv, Dv]"),
        ],
        Role::Dq => vec![q, k, v, dout, lse, delta, p("dq", t4.clone(), "output: gradient of q [B, Sq, Hq, D]")],
        Role::Dsinks => vec![
            lse,
            delta,
            p("sinks", Type::Tensor(DType::F32, 2), "input: sink logits [Hq, n_sinks] (f32)"),
            p("dsinks", Type::Tensor(DType::F32, 2), "output: gradient of the sinks [Hq, n_sinks] (f32)"),
        ],
    };
    if f.bias_grad && matches!(role, Role::Dq | Role::DkDvDq) {
        // The kernel that sums dQ visits every (query block, key block) once: it writes dbias.
        v_.push(p("dbias", t4.clone(), "output (bias_grad): gradient of the bias [B, Hq, Sq, Sk]"));
    }
    let scores = matches!(role, Role::DkDv | Role::DkDvDq | Role::Dq);
    if f.varlen {
        v_.push(p("cu_seqlens_q", Type::Tensor(DType::I32, 1), "input: query prefix sums [num_seqs + 1]"));
        if scores {
            v_.push(p("cu_seqlens_k", Type::Tensor(DType::I32, 1), "input: key prefix sums [num_seqs + 1]"));
        }
    }
    if scores {
        if f.bias {
            v_.push(p("bias", t4.clone(), "input: additive bias [B, Hq, Sq, Sk] (stride 0 broadcasts)"));
        }
        if f.mask {
            v_.push(p("mask", Type::Tensor(DType::I1, 4), "input: boolean mask [B, Hq, Sq, Sk], nonzero = attend"));
        }
        if f.segment_ids {
            v_.push(p("q_segment_ids", Type::Tensor(DType::I32, 2), "input: query segment ids [B, Sq], -1 = padding"));
            v_.push(p("kv_segment_ids", Type::Tensor(DType::I32, 2), "input: key segment ids [B, Sk]"));
        }
        v_.push(p("softmax_scale", Type::Scalar(DType::F32), "scalar: multiplies q.k (default 1/sqrt(head_dim))"));
        if f.sliding_window == Some(Window::Runtime) {
            v_.push(p("window_left", Type::Scalar(DType::I32), "scalar: keys visible left of the diagonal"));
            v_.push(p("window_right", Type::Scalar(DType::I32), "scalar: keys visible right of the diagonal"));
        }
        if f.logits_soft_cap == Some(SoftCap::Runtime) {
            v_.push(p("logits_soft_cap", Type::Scalar(DType::F32), "scalar: soft cap c > 0"));
        }
        if f.dropout {
            v_.push(p("dropout_p", Type::Scalar(DType::F32), "scalar: dropout probability in [0, 1)"));
            v_.push(p("seed_lo", Type::Scalar(DType::U32), "scalar: low 32 bits of the dropout seed"));
            v_.push(p("seed_hi", Type::Scalar(DType::U32), "scalar: high 32 bits of the dropout seed"));
        }
    }
    if role == Role::DqConvert {
        v_.push(p("softmax_scale", Type::Scalar(DType::F32), "scalar: multiplies q.k (default 1/sqrt(head_dim))"));
    }
    v_
}

/// A role's launch grid: query blocks × query heads × sequences (preprocess, dq), key
/// blocks × KV heads × sequences (dkdv), heads × sinks (dsinks).
pub fn bwd_grid(role: Role, f: &Features, block_m: usize, block_n: usize) -> [GridExpr; 3] {
    let (seqs, sq, sk) = if f.varlen {
        (GridExpr::sym("num_seqs"), GridExpr::sym("max_seqlen_q"), GridExpr::sym("max_seqlen_k"))
    } else {
        (GridExpr::sym("batch"), GridExpr::sym("seq_q"), GridExpr::sym("seq_k"))
    };
    match role {
        Role::Preprocess | Role::PreprocessDq | Role::Dq | Role::DqConvert => {
            [GridExpr::cdiv(sq, block_m as i64), GridExpr::sym("heads_q"), seqs]
        }
        Role::DkDv | Role::DkDvDq => [GridExpr::cdiv(sk, block_n as i64), GridExpr::sym("heads_kv"), seqs],
        Role::Dsinks => [GridExpr::sym("heads_q"), GridExpr::sym("n_sinks"), GridExpr::Const(1)],
    }
}

/// Build one kernel of the backward plan for any feature combination, dtype, head dims
/// and tiling (`block_m` query rows, `block_n` keys).
pub fn build_bwd_kernel(
    name: &str,
    role: Role,
    f: &Features,
    dtype: DType,
    dims: HeadDims,
    block_m: usize,
    block_n: usize,
) -> Result<Kernel, VerifyError> {
    if !role.applies(f) {
        return Err(VerifyError {
            kernel: name.to_string(),
            location: "while building".into(),
            message: format!("the variant has no `{}` kernel (it has no sinks)", role.name()),
        });
    }
    let mut b = KernelBuilder::new(name);
    let params: Vec<(&str, Value)> =
        bwd_params(role, f, dtype).into_iter().map(|p| (p.name, b.param(p.name, p.ty))).collect();
    let param = move |n: &str| {
        params.iter().find(|(pn, _)| *pn == n).map(|(_, v)| *v).expect("bwd_params declares every parameter used")
    };
    b.set_grid(bwd_grid(role, f, block_m, block_n));
    let k = Ctx::new(&mut b, f, dtype, dims, block_m, block_n, role, &param);
    match role {
        Role::Preprocess | Role::PreprocessDq => preprocess(&mut b, &k, &param, role == Role::PreprocessDq),
        Role::Dq => dq(&mut b, &k, &param),
        Role::DqConvert => dq_convert(&mut b, &k, &param),
        Role::DkDv | Role::DkDvDq => dkdv(&mut b, &k, &param, role == Role::DkDvDq),
        Role::Dsinks => dsinks(&mut b, &k, &param),
    }
    b.finish()
}

/// What every role's body reads: the program's sequence and the constants.
struct Ctx<'f> {
    f: &'f Features,
    dtype: DType,
    bm: usize,
    bn: usize,
    d: usize,
    dv: usize,
    c0: Value,
    c1: Value,
    log2e: Value,
    /// Sequence index (indexes bias, mask, segment ids, dropout).
    batch: Value,
    /// Batch coordinate of q/k/v (the sequence when dense, 0 when varlen).
    tensor_batch: Value,
    q_start: Value,
    q_end: Option<Value>,
    k_start: Value,
    k_end: Option<Value>,
    seq_q: Value,
    seq_k: Value,
}

impl<'f> Ctx<'f> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        b: &mut KernelBuilder,
        f: &'f Features,
        dtype: DType,
        dims: HeadDims,
        bm: usize,
        bn: usize,
        role: Role,
        param: &dyn Fn(&str) -> Value,
    ) -> Ctx<'f> {
        let c0 = b.const_i32(0);
        let c1 = b.const_i32(1);
        let log2e = b.const_f32(LOG2_E);
        // dsinks runs over every sequence itself: its program ids are (head, sink).
        let batch = if role == Role::Dsinks { c0 } else { b.program_id(2) };
        let (tensor_batch, q_start, q_end, k_start, k_end, seq_q, seq_k) = if f.varlen && role != Role::Dsinks {
            let cu_q = param("cu_seqlens_q");
            let next = b.add(batch, c1);
            let q_start = b.load(cu_q, vec![Axis::Index(batch)], 0.0);
            let q_end = b.load(cu_q, vec![Axis::Index(next)], 0.0);
            let (k_start, k_end) = if matches!(role, Role::Preprocess | Role::PreprocessDq | Role::DqConvert) {
                (c0, c0)
            } else {
                let cu_k = param("cu_seqlens_k");
                (b.load(cu_k, vec![Axis::Index(batch)], 0.0), b.load(cu_k, vec![Axis::Index(next)], 0.0))
            };
            let seq_q = b.sub(q_end, q_start);
            let seq_k = b.sub(k_end, k_start);
            (c0, q_start, Some(q_end), k_start, Some(k_end), seq_q, seq_k)
        } else if role == Role::Dsinks {
            (c0, c0, None, c0, None, c0, c0)
        } else {
            let (q, kk) = match role {
                Role::Preprocess | Role::PreprocessDq => (param("out"), param("out")),
                Role::DqConvert => (param("dq"), param("dq")),
                _ => (param("q"), param("k")),
            };
            let seq_q = b.dim(q, 1);
            let seq_k = b.dim(kk, 1);
            (batch, c0, None, c0, None, seq_q, seq_k)
        };
        Ctx {
            f,
            dtype,
            bm,
            bn,
            d: dims.qk,
            dv: dims.v,
            c0,
            c1,
            log2e,
            batch,
            tensor_batch,
            q_start,
            q_end,
            k_start,
            k_end,
            seq_q,
            seq_k,
        }
    }

    /// `[rows, cols]` of a BSHD tensor: `n` rows from local row `r0` of head `head`.
    fn rows(&self, start: Value, local0: Value, b: &mut KernelBuilder, n: usize, end: Option<Value>) -> Axis {
        let s = b.add(start, local0);
        Axis::Range { start: s, size: n, limit: end }
    }

    fn load_rows(&self, b: &mut KernelBuilder, t: Value, rows: Axis, head: Value, cols: usize) -> Value {
        let c0 = self.c0;
        b.load(
            t,
            vec![
                Axis::Index(self.tensor_batch),
                rows,
                Axis::Index(head),
                Axis::Range { start: c0, size: cols, limit: None },
            ],
            0.0,
        )
    }

    /// `[rows, cols]` of a BSHD tensor written (`v` a `[rows, cols]` tile).
    fn store_rows(&self, b: &mut KernelBuilder, t: Value, rows: Axis, head: Value, cols: usize, v: Value) {
        let cols = Axis::Range { start: self.c0, size: cols, limit: None };
        b.store(t, vec![Axis::Index(self.tensor_batch), rows, Axis::Index(head), cols], v);
    }

    /// The program's query block (program ids: block, query head): `(head, i0, rows)`,
    /// `i0` its first local row, `rows` its `bm` rows as an axis.
    fn query_block(&self, b: &mut KernelBuilder) -> (Value, Value, Axis) {
        let pid_m = b.program_id(0);
        let head = b.program_id(1);
        let bmc = b.const_i32(self.bm as i64);
        let i0 = b.mul(pid_m, bmc);
        let rows = self.rows(self.q_start, i0, b, self.bm, self.q_end);
        (head, i0, rows)
    }

    /// `lse` (read as +∞ where it is −∞: a row that saw nothing gives P = 0) and
    /// `delta` of `bm` query rows from local row `i0` of `head`, as `[bm, 1]` columns,
    /// `lse` in the exp2 domain.
    fn row_stats(&self, b: &mut KernelBuilder, lse: Value, delta: Value, head: Value, i0: Value) -> (Value, Value) {
        let bm = self.bm;
        let r = self.rows(self.q_start, i0, b, bm, self.q_end);
        let at = vec![Axis::Index(self.tensor_batch), Axis::Index(head), r];
        row_stats_at(b, (lse, delta), at, bm, self.log2e)
    }
}

/// `lse` and `delta` of `bm` query rows at `at` (an `[.., .., rows]` index of both):
/// `lse` in the exp2 domain, read as +∞ where it is −∞ (a row that saw nothing) or past
/// the rows, so that its `P` is 0; both as `[bm, 1]` columns. Shared by every attention
/// backward.
pub(crate) fn row_stats_at(
    b: &mut KernelBuilder,
    (lse, delta): (Value, Value),
    at: Vec<Axis>,
    bm: usize,
    log2e: Value,
) -> (Value, Value) {
    let (l, dl) = lse2_rows(b, (lse, delta), at, bm, log2e);
    (b.expand_dims(l, 1), b.expand_dims(dl, 1))
}

/// [`row_stats_at`]'s values as `[bm]` rows: `lse` in the exp2 domain (+∞ where it is −∞
/// or past the rows) and `delta`.
fn lse2_rows(
    b: &mut KernelBuilder,
    (lse, delta): (Value, Value),
    at: Vec<Axis>,
    bm: usize,
    log2e: Value,
) -> (Value, Value) {
    let l = b.load(lse, at.clone(), f64::INFINITY);
    let dl = b.load(delta, at, 0.0);
    let neg_inf = b.full(f64::NEG_INFINITY, DType::F32, &[bm]);
    let pos_inf = b.full(f64::INFINITY, DType::F32, &[bm]);
    let empty = b.cmp(CmpPred::Eq, l, neg_inf);
    let l = b.select(empty, pos_inf, l);
    (b.mul(l, log2e), dl)
}

/// The visible band around the (bottom-right) diagonal, `j − i − shift ∈ [−left, right]`:
/// `left` for a window (else unbounded), `right` 0 for causal, the window's for a window
/// alone (else unbounded); sides clamped to `s_q + s_k` as the masks clamp them.
fn band(b: &mut KernelBuilder, k: &Ctx, param: &dyn Fn(&str) -> Value) -> (Value, Option<Value>, Option<Value>) {
    let shift = b.sub(k.seq_k, k.seq_q);
    let span = b.add(k.seq_q, k.seq_k);
    let (left, right) = match k.f.sliding_window {
        None => (None, None),
        Some(w) => {
            let (l, r) = match w {
                Window::Runtime => (param("window_left"), param("window_right")),
                Window::Fixed { left, right } => (b.const_i32(left as i64), b.const_i32(right as i64)),
            };
            (Some(b.min(l, span)), Some(b.min(r, span)))
        }
    };
    let right = if k.f.causal { Some(k.c0) } else { right };
    (shift, left, right)
}

/// `delta[b, h, i] = Σ_d dout[b, i, h, d] · out[b, i, h, d]`, in f32; with `zero`
/// (the atomic plan) also `dq_accum` (and `pdp`) of these rows set to 0.
fn preprocess(b: &mut KernelBuilder, k: &Ctx, param: &dyn Fn(&str) -> Value, zero: bool) {
    let (head, _, rows) = k.query_block(b);
    let o = k.load_rows(b, param("out"), rows, head, k.dv);
    let g = k.load_rows(b, param("dout"), rows, head, k.dv);
    let o = b.cast(o, DType::F32);
    let g = b.cast(g, DType::F32);
    let og = b.mul(o, g);
    let delta = b.reduce(ReduceOp::Sum, og, 1);
    b.store(param("delta"), vec![Axis::Index(k.tensor_batch), Axis::Index(head), rows], delta);
    if zero {
        let z = b.full(0.0, DType::F32, &[k.bm, k.d]);
        k.store_rows(b, param("dq_accum"), rows, head, k.d, z);
        if k.f.sinks {
            let z = b.full(0.0, DType::F32, &[k.bm]);
            b.store(param("pdp"), vec![Axis::Index(k.tensor_batch), Axis::Index(head), rows], z);
        }
    }
}

/// `dq = scale · dq_accum` of one query block (the atomic plan's last step).
fn dq_convert(b: &mut KernelBuilder, k: &Ctx, param: &dyn Fn(&str) -> Value) {
    let (head, _, rows) = k.query_block(b);
    let acc = k.load_rows(b, param("dq_accum"), rows, head, k.d);
    let dq = b.mul(acc, param("softmax_scale"));
    let dq = b.cast(dq, k.dtype);
    k.store_rows(b, param("dq"), rows, head, k.d, dq);
}

/// The scores' transform and masks of a `[bm, bn]` block (query rows from local `i0`
/// of `head`, keys from local `j0`): the masked logits `s` (natural log domain, −∞
/// where hidden) and, with a soft cap, `1 − tanh²`, the cap's derivative.
struct Scores {
    s: Value,
    cap_grad: Option<Value>,
}

#[allow(clippy::too_many_arguments)]
fn scores(
    b: &mut KernelBuilder,
    k: &Ctx,
    param: &dyn Fn(&str) -> Value,
    q_tile: Value,
    k_tile: Value,
    head: Value,
    i0: Value,
    j0: Value,
) -> Scores {
    let (bm, bn, f) = (k.bm, k.bn, k.f);
    let zero = b.full(0.0, DType::F32, &[bm, bn]);
    let qk = b.dot(q_tile, k_tile, zero, false, true);
    let mut s = b.mul(qk, param("softmax_scale"));
    if f.bias {
        let bias = load_block(b, param("bias"), k.batch, head, (i0, bm), (j0, bn));
        let bias = b.cast(bias, DType::F32);
        s = b.add(s, bias);
    }
    let mut cap_grad = None;
    if let Some(cap) = f.logits_soft_cap {
        let c = match cap {
            SoftCap::Runtime => param("logits_soft_cap"),
            SoftCap::Fixed(c) => b.const_f32(c),
        };
        let x = b.div(s, c);
        let t = b.unary(UnOp::Tanh, x);
        s = b.mul(t, c);
        let one = b.full(1.0, DType::F32, &[bm, bn]);
        let t2 = b.mul(t, t);
        cap_grad = Some(b.sub(one, t2));
    }
    // Analysable masks, bottom-right aligned, as the forward's.
    let shift = b.sub(k.seq_k, k.seq_q);
    let mut terms: Vec<(MaskTerm, Value)> = vec![(MaskTerm::ColLt, k.seq_k), (MaskTerm::RowLt, k.seq_q)];
    terms.extend(super::frontend::band_terms(b, f, param, shift, k.seq_q, k.seq_k));
    s = b.mask_apply(s, i0, j0, &terms);
    let neg_inf = b.full(f64::NEG_INFINITY, DType::F32, &[bm, bn]);
    if f.mask {
        let m = load_block(b, param("mask"), k.batch, head, (i0, bm), (j0, bn));
        s = b.select(m, s, neg_inf);
    }
    if f.segment_ids {
        let q_ids = b.load(
            param("q_segment_ids"),
            vec![Axis::Index(k.batch), Axis::Range { start: i0, size: bm, limit: None }],
            -1.0,
        );
        let q_ids = b.expand_dims(q_ids, 1);
        let pad = b.const_i32(-1);
        let valid = b.cmp(CmpPred::Ne, q_ids, pad);
        let kv_ids = b.load(
            param("kv_segment_ids"),
            vec![Axis::Index(k.batch), Axis::Range { start: j0, size: bn, limit: None }],
            -1.0,
        );
        let kv_ids = b.expand_dims(kv_ids, 0);
        let same = b.cmp(CmpPred::Eq, q_ids, kv_ids);
        let visible = b.and(same, valid);
        s = b.select(visible, s, neg_inf);
    }
    Scores { s, cap_grad }
}

/// `P = exp(s − lse)`, and the dropout factor (keep / (1 − p), or 0) of the block.
fn probabilities(
    b: &mut KernelBuilder,
    k: &Ctx,
    param: &dyn Fn(&str) -> Value,
    sc: &Scores,
    lse2: Value,
    head: Value,
    i0: Value,
    j0: Value,
) -> (Value, Option<Value>) {
    let s2 = b.mul(sc.s, k.log2e);
    let x = b.sub(s2, lse2);
    let p = b.unary(UnOp::Exp2, x);
    let keep = k.f.dropout.then(|| {
        let drop_p = param("dropout_p");
        let one = b.const_f32(1.0);
        let kept = b.sub(one, drop_p);
        let inv_keep = b.div(one, kept);
        let u = b.rand_uniform(param("seed_lo"), param("seed_hi"), k.batch, head, i0, j0, &[k.bm, k.bn]);
        let kept = b.cmp(CmpPred::Ge, u, drop_p);
        let scale = b.full(0.0, DType::F32, &[k.bm, k.bn]);
        let inv = b.splat(inv_keep, &[k.bm, k.bn]);
        b.select(kept, inv, scale)
    });
    (p, keep)
}

/// `dS = P ∘ (dP − delta)` (times the soft cap's derivative), `dP = (dout vᵀ) ∘ keep`;
/// returns `(dS, P ∘ dP)`.
#[allow(clippy::too_many_arguments)]
fn score_grad(
    b: &mut KernelBuilder,
    k: &Ctx,
    sc: &Scores,
    p: Value,
    keep: Option<Value>,
    do_tile: Value,
    v_tile: Value,
    delta: Value,
) -> (Value, Value) {
    let zero = b.full(0.0, DType::F32, &[k.bm, k.bn]);
    let mut dp = b.dot(do_tile, v_tile, zero, false, true);
    if let Some(keep) = keep {
        dp = b.mul(dp, keep);
    }
    let x = b.sub(dp, delta);
    let mut ds = b.mul(p, x);
    if let Some(g) = sc.cap_grad {
        ds = b.mul(ds, g);
    }
    let pdp = b.mul(p, dp);
    (ds, pdp)
}

/// `dbias` of the `[bm, bn]` block at query row `i0`, key `j0` of `head`: `du` (the f32
/// `dU`, or zeros) in the dtype. Dense only (`bias` excludes `varlen`): the tensor's
/// own sizes clip the block.
#[allow(clippy::too_many_arguments)]
fn store_dbias(
    b: &mut KernelBuilder,
    k: &Ctx,
    param: &dyn Fn(&str) -> Value,
    head: Value,
    i0: Value,
    j0: Value,
    du: Value,
) {
    let du = b.cast(du, k.dtype);
    let rows = Axis::Range { start: i0, size: k.bm, limit: None };
    let cols = Axis::Range { start: j0, size: k.bn, limit: None };
    b.store(param("dbias"), vec![Axis::Index(k.batch), Axis::Index(head), rows, cols], du);
}

/// One query block: `dQ = scale · Σ_j dS_j k_j` over the key blocks.
fn dq(b: &mut KernelBuilder, k: &Ctx, param: &dyn Fn(&str) -> Value) {
    let (head, i0, rows) = k.query_block(b);
    let (q, kk, v) = (param("q"), param("k"), param("v"));
    let heads_q = b.dim(q, 2);
    let heads_kv = b.dim(kk, 2);
    let group = b.div(heads_q, heads_kv);
    let kv_head = b.div(head, group);
    let bmc = b.const_i32(k.bm as i64);
    let q_tile = k.load_rows(b, q, rows, head, k.d);
    let do_tile = k.load_rows(b, param("dout"), rows, head, k.dv);
    let (lse2, delta) = k.row_stats(b, param("lse"), param("delta"), head, i0);
    let acc = b.full(0.0, DType::F32, &[k.bm, k.d]);
    let bnc = b.const_i32(k.bn as i64);
    // Sinks: Σ_j P dP, which is delta computed from P and dP in f32 instead of from the
    // forward's rounded `out`; dsinks sums it over every row, where that rounding would
    // not cancel (a 16-bit `out` leaves delta about 2⁻⁹ off).
    let sinks = k.f.sinks;
    let mut inits = vec![acc];
    if sinks {
        inits.push(b.full(0.0, DType::F32, &[k.bm]));
    }
    // The key blocks the band lets this query block see (the others add exactly 0):
    // j < i0 + bm + shift + right and j >= i0 + shift - left, in whole blocks.
    let (shift, left, right) = band(b, k, param);
    let diag = b.add(i0, shift);
    let hi = match right {
        Some(r) => {
            let e = b.add(diag, bmc);
            let e = b.add(e, r);
            let e = b.max(e, k.c0);
            b.min(e, k.seq_k)
        }
        None => k.seq_k,
    };
    let lo = match left {
        Some(l) => {
            let e = b.sub(diag, l);
            let e = b.max(e, k.c0);
            let e = b.div(e, bnc);
            b.mul(e, bnc)
        }
        None => k.c0,
    };
    let r = b.for_loop(lo, hi, bnc, &inits, |b, j0, carried| {
        let kr = k.rows(k.k_start, j0, b, k.bn, k.k_end);
        let k_tile = k.load_rows(b, kk, kr, kv_head, k.d);
        let v_tile = k.load_rows(b, v, kr, kv_head, k.dv);
        let sc = scores(b, k, param, q_tile, k_tile, head, i0, j0);
        let (p, keep) = probabilities(b, k, param, &sc, lse2, head, i0, j0);
        let (ds, pdp) = score_grad(b, k, &sc, p, keep, do_tile, v_tile, delta);
        if k.f.bias_grad {
            store_dbias(b, k, param, head, i0, j0, ds);
        }
        let ds = b.cast(ds, k.dtype);
        let mut out = vec![b.dot(ds, k_tile, carried[0], false, false)];
        if sinks {
            let row = b.reduce(ReduceOp::Sum, pdp, 1);
            out.push(b.add(carried[1], row));
        }
        out
    });
    if k.f.bias_grad {
        // dbias is 0 on the key blocks the loop skipped: [0, lo) and from the end of its
        // last block on.
        let zero = b.full(0.0, DType::F32, &[k.bm, k.bn]);
        b.for_loop(k.c0, lo, bnc, &[], |b, j0, _| {
            store_dbias(b, k, param, head, i0, j0, zero);
            vec![]
        });
        let len = b.sub(hi, lo);
        let len = b.max(len, k.c0);
        let blocks = cdiv(b, len, bnc, k.c1);
        let covered = b.mul(blocks, bnc);
        let end = b.add(lo, covered);
        b.for_loop(end, k.seq_k, bnc, &[], |b, j0, _| {
            store_dbias(b, k, param, head, i0, j0, zero);
            vec![]
        });
    }
    if sinks {
        // Every program rewrites its own rows of delta, after reading them; dsinks runs next.
        b.store(param("delta"), vec![Axis::Index(k.tensor_batch), Axis::Index(head), rows], r[1]);
    }
    let dq = b.mul(r[0], param("softmax_scale"));
    let dq = b.cast(dq, k.dtype);
    k.store_rows(b, param("dq"), rows, head, k.d, dq);
}

/// One key block of one KV head: `dV = Σ P'ᵀ dout`, `dK = scale · Σ dSᵀ q` over the
/// query blocks of every query head of the group (one loop over both, in order); with
/// `with_dq` (the atomic plan) also `dq_accum += dS k` (and, for sinks, the rows'
/// `Σ P dP` into `pdp`) by atomic adds.
fn dkdv(b: &mut KernelBuilder, k: &Ctx, param: &dyn Fn(&str) -> Value, with_dq: bool) {
    let pid_n = b.program_id(0);
    let kv_head = b.program_id(1);
    let (q, kk, v) = (param("q"), param("k"), param("v"));
    let heads_q = b.dim(q, 2);
    let heads_kv = b.dim(kk, 2);
    let group = b.div(heads_q, heads_kv);
    let bnc = b.const_i32(k.bn as i64);
    let j0 = b.mul(pid_n, bnc);
    let kr = k.rows(k.k_start, j0, b, k.bn, k.k_end);
    let k_tile = k.load_rows(b, kk, kr, kv_head, k.d);
    let v_tile = k.load_rows(b, v, kr, kv_head, k.dv);
    let bmc = b.const_i32(k.bm as i64);
    let q_blocks = cdiv(b, k.seq_q, bmc, k.c1);
    // The query blocks the band lets this key block be seen from (the others add exactly
    // 0): i >= j0 - shift - right and i < j0 + bn - shift + left, in whole blocks.
    let (shift, left, right) = band(b, k, param);
    let anti = b.sub(j0, shift);
    let blk_lo = match right {
        Some(r) => {
            let e = b.sub(anti, r);
            let e = b.max(e, k.c0);
            let e = b.min(e, k.seq_q);
            b.div(e, bmc)
        }
        None => k.c0,
    };
    let blk_hi = match left {
        Some(l) => {
            let e = b.add(anti, bnc);
            let e = b.add(e, l);
            let e = b.max(e, k.c0);
            let e = b.min(e, k.seq_q);
            cdiv(b, e, bmc, k.c1)
        }
        None => q_blocks,
    };
    let span = b.sub(blk_hi, blk_lo);
    let span = b.max(span, k.c0);
    let trips = b.mul(group, span);
    let first_head = b.mul(kv_head, group);
    let dk0 = b.full(0.0, DType::F32, &[k.bn, k.d]);
    let dv0 = b.full(0.0, DType::F32, &[k.bn, k.dv]);
    let r = b.for_loop(k.c0, trips, k.c1, &[dk0, dv0], |b, t, carried| {
        let hg = b.div(t, span);
        let head = b.add(first_head, hg);
        let blk = b.binary(BinOp::Rem, t, span);
        let blk = b.add(blk, blk_lo);
        let i0 = b.mul(blk, bmc);
        let rows = k.rows(k.q_start, i0, b, k.bm, k.q_end);
        let q_tile = k.load_rows(b, q, rows, head, k.d);
        let do_tile = k.load_rows(b, param("dout"), rows, head, k.dv);
        let (lse2, delta) = k.row_stats(b, param("lse"), param("delta"), head, i0);
        let sc = scores(b, k, param, q_tile, k_tile, head, i0, j0);
        let (p, keep) = probabilities(b, k, param, &sc, lse2, head, i0, j0);
        let pk = match keep {
            Some(keep) => b.mul(p, keep),
            None => p,
        };
        let pk = b.cast(pk, k.dtype);
        let dv = b.dot(pk, do_tile, carried[1], true, false);
        let (ds, pdp) = score_grad(b, k, &sc, p, keep, do_tile, v_tile, delta);
        if with_dq && k.f.bias_grad {
            store_dbias(b, k, param, head, i0, j0, ds);
        }
        let ds = b.cast(ds, k.dtype);
        let dk = b.dot(ds, q_tile, carried[0], true, false);
        if with_dq {
            let zero = b.full(0.0, DType::F32, &[k.bm, k.d]);
            let dq = b.dot(ds, k_tile, zero, false, false);
            let cols = Axis::Range { start: k.c0, size: k.d, limit: None };
            b.atomic_add(param("dq_accum"), vec![Axis::Index(k.tensor_batch), rows, Axis::Index(head), cols], dq);
            if k.f.sinks {
                let row = b.reduce(ReduceOp::Sum, pdp, 1);
                b.atomic_add(param("pdp"), vec![Axis::Index(k.tensor_batch), Axis::Index(head), rows], row);
            }
        }
        vec![dk, dv]
    });
    if with_dq && k.f.bias_grad {
        // dbias is 0 on the query blocks of the group's heads the loop skipped: those
        // below blk_lo and from blk_hi on.
        let zero = b.full(0.0, DType::F32, &[k.bm, k.bn]);
        let above = b.sub(q_blocks, blk_hi);
        let above = b.max(above, k.c0);
        for (first_blk, n) in [(k.c0, blk_lo), (blk_hi, above)] {
            let trips = b.mul(group, n);
            let n1 = b.max(n, k.c1); // never divides by 0 (no trip runs when n is 0)
            b.for_loop(k.c0, trips, k.c1, &[], |b, t, _| {
                let hg = b.div(t, n1);
                let head = b.add(first_head, hg);
                let blk = b.binary(BinOp::Rem, t, n1);
                let blk = b.add(blk, first_blk);
                let i0 = b.mul(blk, bmc);
                store_dbias(b, k, param, head, i0, j0, zero);
                vec![]
            });
        }
    }
    let dk = b.mul(r[0], param("softmax_scale"));
    let dk = b.cast(dk, k.dtype);
    let dv = b.cast(r[1], k.dtype);
    k.store_rows(b, param("dk"), kr, kv_head, k.d, dk);
    k.store_rows(b, param("dv"), kr, kv_head, k.dv, dv);
}

/// One (head, sink): `dsinks[h, t] = −Σ exp(sink − lse) · delta` over every query row
/// of every sequence (varlen: the packed rows up to `cu_seqlens_q[num_seqs]`).
fn dsinks(b: &mut KernelBuilder, k: &Ctx, param: &dyn Fn(&str) -> Value) {
    let c1 = k.c1;
    let rows = |b: &mut KernelBuilder| {
        k.f.varlen.then(|| {
            let cu_q = param("cu_seqlens_q");
            let n = b.dim(cu_q, 0);
            let last = b.sub(n, c1);
            b.load(cu_q, vec![Axis::Index(last)], 0.0)
        })
    };
    let tensors = [param("lse"), param("delta"), param("sinks"), param("dsinks")];
    dsinks_sum(b, tensors, (k.c0, k.c1, k.log2e), k.bm, &rows);
}

/// The dsinks kernel's body, program ids (head, sink): `dsinks[h, t] = −Σ exp(sink −
/// lse) · delta` over rows `[0, rows)` (`rows` computes it, or `None`: `lse`'s last
/// axis) of every batch entry of `lse` / `delta` `[B, H, S]`, `bm` rows at a time; a row
/// whose `lse` is −∞ adds 0. `consts` are i32 0 and 1 and f32 log2(e). Shared by every
/// attention backward with sinks.
pub(crate) fn dsinks_sum(
    b: &mut KernelBuilder,
    [lse, delta, sinks, dsinks]: [Value; 4],
    (c0, c1, log2e): (Value, Value, Value),
    bm: usize,
    rows: &dyn Fn(&mut KernelBuilder) -> Option<Value>,
) {
    let head = b.program_id(0);
    let sink_t = b.program_id(1);
    let sink = b.load(sinks, vec![Axis::Index(head), Axis::Index(sink_t)], 0.0);
    let sink2 = b.mul(sink, log2e);
    let batches = b.dim(lse, 0);
    let rows = match rows(b) {
        Some(r) => r,
        None => b.dim(lse, 2),
    };
    let bmc = b.const_i32(bm as i64);
    let q_blocks = cdiv(b, rows, bmc, c1);
    let trips = b.mul(batches, q_blocks);
    let acc = b.full(0.0, DType::F32, &[bm]);
    let r = b.for_loop(c0, trips, c1, &[acc], |b, t, carried| {
        let bi = b.div(t, q_blocks);
        let blk = b.binary(BinOp::Rem, t, q_blocks);
        let i0 = b.mul(blk, bmc);
        let at = vec![Axis::Index(bi), Axis::Index(head), Axis::Range { start: i0, size: bm, limit: Some(rows) }];
        let (l2, dl) = lse2_rows(b, (lse, delta), at, bm, log2e);
        let x = b.sub(sink2, l2);
        let p = b.unary(UnOp::Exp2, x);
        let w = b.mul(p, dl);
        vec![b.add(carried[0], w)]
    });
    let total = b.reduce(ReduceOp::Sum, r[0], 0);
    let zero = b.const_f32(0.0);
    let neg = b.sub(zero, total);
    b.store(dsinks, vec![Axis::Index(head), Axis::Index(sink_t)], neg);
}

/// The backward on the interpreter: a plan's `kernels` by role (those the variant has:
/// [`Plan::roles`]), run in that order on a call (`inputs`, the forward's `out` and
/// `lse`, `dout`); gradients in the inputs' dtypes (dsinks f32). Tensors a kernel fails
/// to write stay NaN (the temporaries too: `dq_accum` must be zeroed by the plan).
pub fn run_interp(
    kernels: &[(Role, Kernel)],
    rt: &super::FlashRuntime,
    inputs: &super::FlashInputs,
    forward: &super::FlashOutputs,
    dout: &crate::tensor::HostTensor,
) -> Result<BwdOutputs, String> {
    use crate::interp::{launch, Arg};
    use crate::tensor::HostTensor;
    let nan = |dtype: DType, shape: &[usize]| Arg::Tensor(HostTensor::full(dtype, shape, f64::NAN));
    let mut named: Vec<(&str, Arg)> = vec![
        ("dout", Arg::Tensor(dout.clone())),
        ("delta", nan(DType::F32, &forward.lse.shape)),
        ("dq", nan(inputs.q.dtype, &inputs.q.shape)),
        ("dk", nan(inputs.k.dtype, &inputs.k.shape)),
        ("dv", nan(inputs.v.dtype, &inputs.v.shape)),
        ("dq_accum", nan(DType::F32, &inputs.q.shape)),
        ("pdp", nan(DType::F32, &forward.lse.shape)),
    ];
    let n_sinks = inputs.sinks.as_ref().map_or(0, |s| s.shape[1]);
    if let Some(s) = &inputs.sinks {
        named.push(("dsinks", nan(DType::F32, &s.shape)));
    }
    if let Some(bias) = &inputs.bias {
        named.push(("dbias", nan(inputs.q.dtype, &bias.shape)));
    }
    let bias_grad = kernels.iter().any(|(_, k)| k.params.iter().any(|p| p.name == "dbias"));
    let atomic = kernels.iter().any(|(r, _)| *r == Role::DkDvDq);
    for (role, kernel) in kernels {
        if *role == Role::Dsinks && atomic {
            // The atomic plan binds dsinks' `delta` to `pdp`.
            let i = named.iter().position(|(n, _)| *n == "pdp").expect("pdp");
            let j = named.iter().position(|(n, _)| *n == "delta").expect("delta");
            let pdp = named[i].1.clone();
            named[j].1 = pdp;
        }
        let mut args = super::abi::bind_args_with(kernel, rt, inputs, forward, &named)?;
        let grid = super::abi::launch_grid_with(kernel, inputs, &[("n_sinks", n_sinks as i64)])?;
        launch(kernel, &mut args, grid).map_err(|e| format!("{}: {e}", kernel.name))?;
        for (p, a) in kernel.params.iter().zip(args) {
            if let Some(slot) = named.iter_mut().find(|(n, _)| *n == p.name) {
                slot.1 = a;
            }
        }
    }
    let take = |n: &str| named.iter().find(|(m, _)| *m == n).and_then(|(_, a)| a.tensor().cloned());
    Ok(BwdOutputs {
        dq: take("dq").expect("dq"),
        dk: take("dk").expect("dk"),
        dv: take("dv").expect("dv"),
        dsinks: take("dsinks"),
        dbias: if bias_grad { take("dbias") } else { None },
    })
}

/// The backward's outputs.
#[derive(Clone, Debug)]
pub struct BwdOutputs {
    pub dq: crate::tensor::HostTensor,
    pub dk: crate::tensor::HostTensor,
    pub dv: crate::tensor::HostTensor,
    pub dsinks: Option<crate::tensor::HostTensor>,
    /// `[B, Hq, Sq, Sk]`, for `bias_grad` variants.
    pub dbias: Option<crate::tensor::HostTensor>,
}
