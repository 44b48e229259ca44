//! Spec → tile IR for the flash-attention forward family.
//!
//! ```
//! use ejc_ir::flash::{build_flash_kernel, Features};
//! use ejc_ir::types::DType;
//! let f = Features { causal: true, ..Default::default() };
//! let k = build_flash_kernel("flash_causal_bf16_d128_m64_n32", &f, DType::BF16, 128, 64, 32).unwrap();
//! assert_eq!(k.params[0].name, "q");
//! ```
//!
//! One kernel computes a `[block_m, head_dim]` block of the output for one query
//! head of one batch entry (or packed sequence). It is written the way the paper
//! states the algorithm: load `q`, loop over key blocks carrying `acc`, `m_i`, `l_i`,
//! compute the scores, mask them, update the online softmax, accumulate `p · v`,
//! finalize and store the output and the log-sum-exp.
//!
//! The front end emits the *naive* loop (every key block, every block masked);
//! `classify_mask_blocks` then narrows the loop to the visible key range and keeps
//! the masking only on partial blocks. Keeping the two apart lets each be tested
//! alone: the interpreter must give the same result before and after the pass.

use std::f64::consts::LOG2_E;

use super::features::{Features, SoftCap, Window};
use crate::builder::{Axis, KernelBuilder};
use crate::dsl::{Dsl, MaskMod, ModCtx, ModTensor, ScoreMod};
use crate::ir::{BinOp, CmpPred, Kernel, MaskTerm, UnOp, Value};
use crate::types::DType;
use crate::verify::VerifyError;

use super::abi::{abi_params, abi_params_partial, grid, grid_partial, NUM_SPLITS};

/// User hooks compiled into the kernel (from `#[ej_kernel(mask_mod)]` and
/// `#[ej_kernel(score_mod)]`).
#[derive(Clone, Copy, Debug, Default)]
pub struct FlashHooks {
    /// ANDed with the variant's masks. Its affine conjuncts become analysable mask terms
    /// (blocks they hide are skipped); the rest of it, if any, is applied per element
    /// on every visited block.
    pub mask_mod: Option<MaskMod>,
    /// Applied to the scores after scale and bias, before the soft cap and the masks.
    pub score_mod: Option<ScoreMod>,
}

impl FlashHooks {
    /// The tensors the mods read, the mask mod's first (a name may appear twice).
    pub fn mod_tensors(&self) -> impl Iterator<Item = &'static ModTensor> {
        let lists = [self.mask_mod.map(|m| m.tensors), self.score_mod.map(|m| m.tensors)];
        lists.into_iter().flatten().flatten()
    }
}

/// The head dims of a flash kernel: of q and k (`qk`), and of v and the output (`v`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadDims {
    pub qk: usize,
    pub v: usize,
}

impl HeadDims {
    /// q, k and v share `d`.
    pub fn same(d: usize) -> Self {
        HeadDims { qk: d, v: d }
    }
}

impl From<usize> for HeadDims {
    fn from(d: usize) -> Self {
        HeadDims::same(d)
    }
}

/// Build a flash forward kernel for any feature combination, dtype, head dims (one
/// `usize` for q, k and v, or [`HeadDims`]) and tiling (tests use tilings outside the
/// spec's schedule space, e.g. 16 x 16).
pub fn build_flash_kernel(
    name: &str,
    f: &Features,
    dtype: DType,
    head_dim: impl Into<HeadDims>,
    block_m: usize,
    block_n: usize,
) -> Result<Kernel, VerifyError> {
    build_flash_kernel_with(name, f, dtype, head_dim, block_m, block_n, &FlashHooks::default())
}

/// [`build_flash_kernel`] with mask / score mods.
pub fn build_flash_kernel_with(
    name: &str,
    f: &Features,
    dtype: DType,
    head_dim: impl Into<HeadDims>,
    block_m: usize,
    block_n: usize,
    hooks: &FlashHooks,
) -> Result<Kernel, VerifyError> {
    build_flash(name, f, dtype, head_dim.into(), block_m, block_n, hooks, Output::Forward)
}

/// The tensors the mods read, as parameters after the operation's own (one parameter
/// per name: two mods reading `doc` share it, if they agree on its dtype and rank).
fn mod_tensor_params(
    b: &mut KernelBuilder,
    name: &str,
    hooks: &FlashHooks,
    abi: &[&str],
) -> Result<Vec<(&'static str, Value)>, VerifyError> {
    let err = |message: String| VerifyError { kernel: name.to_string(), location: "while building".into(), message };
    let mut out: Vec<(&'static str, Value, ModTensor)> = Vec::new();
    for t in hooks.mod_tensors() {
        if abi.contains(&t.name) {
            return Err(err(format!(
                "the mod's tensor `{}` has the name of one of the flash kernel's own parameters; rename it",
                t.name
            )));
        }
        match out.iter().find(|(n, ..)| *n == t.name) {
            Some((_, _, prev)) if prev.dtype != t.dtype || prev.rank != t.rank => {
                return Err(err(format!(
                    "both mods read a tensor `{}`, as {} rank {} and as {} rank {}; rename one",
                    t.name, prev.dtype, prev.rank, t.dtype, t.rank
                )))
            }
            Some(_) => {}
            None => {
                let v = b.param(t.name, crate::types::Type::Tensor(t.dtype, t.rank));
                out.push((t.name, v, *t));
            }
        }
    }
    Ok(out.into_iter().map(|(n, v, _)| (n, v)).collect())
}

/// Split-KV's kernels take dense batches only: a varlen variant is an error.
pub(super) fn refuse_varlen(name: &str, f: &Features) -> Result<(), VerifyError> {
    if f.varlen {
        return Err(VerifyError {
            kernel: name.to_string(),
            location: "while building".into(),
            message: "split-KV kernels do not support varlen (packed sequences)".into(),
        });
    }
    Ok(())
}

/// Split-KV partial kernel: like the forward kernel, over one key split.
///
/// For decode-like calls (few query rows, long keys) the keys are cut into
/// `num_splits` ranges that separate programs process; [`super::build_flash_combine_kernel`]
/// then merges them. Program `(m, h, z)` handles query block `m` of head `h` of batch
/// entry `z / num_splits` over split `z % num_splits`: keys `[split·L, min(seq_k,
/// (split+1)·L))` with `L = cdiv(cdiv(seq_k, num_splits), block_n) · block_n`, so
/// splits start on key blocks. It stores, in f32, `softmax_finalize`'s results over
/// those keys: `o_partial[split, b, h, rows, :]` (normalised within the split) and
/// `lse_partial[split, b, h, rows]`; a split that sees no key gives 0 and −∞.
///
/// Sinks are not applied here (the combine adds them once): the partial kernel of a
/// sinks variant has no `sinks` parameter. Varlen is refused (an error). ABI:
/// [`super::abi::abi_params_partial`]; grid: [`super::abi::grid_partial`].
pub fn build_flash_partial_kernel(
    name: &str,
    f: &Features,
    dtype: DType,
    dims: impl Into<HeadDims>,
    block_m: usize,
    block_n: usize,
) -> Result<Kernel, VerifyError> {
    refuse_varlen(name, f)?;
    let f = Features { sinks: false, ..f.clone() };
    build_flash(name, &f, dtype, dims.into(), block_m, block_n, &FlashHooks::default(), Output::SplitPartial)
}

/// What a kernel built by [`build_flash`] computes and stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Output {
    /// The forward kernel: every key; `out` (in the input dtype) and `lse`.
    Forward,
    /// The split-KV partial kernel: one key split; `o_partial` and `lse_partial` (f32).
    SplitPartial,
}

/// The body shared by the forward and split-KV partial kernels. The forward kernel's
/// IR does not depend on the split-KV code: that only adds ops when `output` asks.
#[allow(clippy::too_many_arguments)]
fn build_flash(
    name: &str,
    f: &Features,
    dtype: DType,
    dims: HeadDims,
    block_m: usize,
    block_n: usize,
    hooks: &FlashHooks,
    output: Output,
) -> Result<Kernel, VerifyError> {
    let (bm, bn, d, dv) = (block_m, block_n, dims.qk, dims.v);
    let split_kv = output == Output::SplitPartial;
    let mut b = KernelBuilder::new(name);
    let abi = if split_kv { abi_params_partial(f, dtype) } else { abi_params(f, dtype) };
    // Tensors first, then the mods' tensors, then the scalars (the launch ABI passes
    // every tensor before the scalars).
    let (tensors, scalars): (Vec<_>, Vec<_>) = abi.into_iter().partition(|p| p.ty.is_tensor());
    let mut params: Vec<(&str, Value)> = tensors.iter().map(|p| (p.name, b.param(p.name, p.ty.clone()))).collect();
    let names: Vec<&str> = tensors.iter().chain(&scalars).map(|p| p.name).collect();
    let mod_tensors = mod_tensor_params(&mut b, name, hooks, &names)?;
    params.extend(scalars.iter().map(|p| (p.name, b.param(p.name, p.ty.clone()))));
    let param = |n: &str| {
        params
            .iter()
            .find(|(pn, _)| *pn == n)
            .map(|(_, v)| *v)
            .expect("abi_params declares every parameter the body uses")
    };
    b.set_grid(if split_kv { grid_partial(f, bm) } else { grid(f, bm) });

    // ---- program coordinates ----
    let pid_m = b.program_id(0);
    let head = b.program_id(1);
    let pid_z = b.program_id(2);
    // Split-KV: axis 2 runs over batch × splits.
    let (batch, split) = if split_kv {
        let num_splits = param(NUM_SPLITS);
        let batch = b.div(pid_z, num_splits);
        let split = b.binary(BinOp::Rem, pid_z, num_splits);
        (batch, Some((split, num_splits)))
    } else {
        (pid_z, None)
    };
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let (q, k, v) = (param("q"), param("k"), param("v"));
    let heads_q = b.dim(q, 2);
    let heads_kv = b.dim(k, 2);
    let group = b.div(heads_q, heads_kv);
    // GQA / MQA: query head h reads kv head h / (Hq / Hkv).
    let kv_head = b.div(head, group);

    // Sequence extents: rows [q_start, q_end) and keys [k_start, k_end) of the
    // tensors belong to this program's sequence; `seq_q`/`seq_k` are its lengths.
    let (tensor_batch, q_start, q_end, k_start, k_end, seq_q, seq_k) = if f.varlen {
        let (cu_q, cu_k) = (param("cu_seqlens_q"), param("cu_seqlens_k"));
        let next = b.add(batch, c1);
        let q_start = b.load(cu_q, vec![Axis::Index(batch)], 0.0);
        let q_end = b.load(cu_q, vec![Axis::Index(next)], 0.0);
        let k_start = b.load(cu_k, vec![Axis::Index(batch)], 0.0);
        let k_end = b.load(cu_k, vec![Axis::Index(next)], 0.0);
        let seq_q = b.sub(q_end, q_start);
        let seq_k = b.sub(k_end, k_start);
        (c0, q_start, Some(q_end), k_start, Some(k_end), seq_q, seq_k)
    } else {
        let seq_q = b.dim(q, 1);
        let seq_k = b.dim(k, 1);
        (batch, c0, None, c0, None, seq_q, seq_k)
    };
    let block_m_c = b.const_i32(bm as i64);
    let i0 = b.mul(pid_m, block_m_c); // first query row of the block, local to the sequence
    let q_row0 = b.add(q_start, i0);

    let q_tile = b.load(
        q,
        vec![
            Axis::Index(tensor_batch),
            Axis::Range { start: q_row0, size: bm, limit: q_end },
            Axis::Index(head),
            Axis::Range { start: c0, size: d, limit: None },
        ],
        0.0,
    );

    // ---- online-softmax state; sinks enter it once, before any key ----
    let mut m_i = b.full(f64::NEG_INFINITY, DType::F32, &[bm]);
    let mut l_i = b.full(0.0, DType::F32, &[bm]);
    let acc = b.full(0.0, DType::F32, &[bm, dv]);
    let log2e = b.const_f32(LOG2_E);
    if f.sinks {
        (m_i, l_i) = enter_sinks(&mut b, param("sinks"), head, bm, (c0, c1, log2e), (m_i, l_i));
    }

    // ---- the scores' transform: scale, bias, soft cap, into the exp2 domain ----
    let scale = param("softmax_scale");
    let softcap = match f.logits_soft_cap {
        None => None,
        Some(SoftCap::Runtime) => Some(param("logits_soft_cap")),
        Some(SoftCap::Fixed(c)) => Some(b.const_f32(c)),
    };
    // Without bias, soft cap or score mod, log2(e) folds into the scale (one multiply
    // per score). With a soft cap, 1/c folds into the scale when nothing comes between
    // them, and log2(e) into the multiply by c after the tanh: one multiply on each side
    // of the tanh, and no division per score.
    let fold_log2e = !f.bias && softcap.is_none() && hooks.score_mod.is_none();
    let cap_in_scale = softcap.is_some() && !f.bias && hooks.score_mod.is_none();
    let qk_scale = match softcap {
        _ if fold_log2e => b.mul(scale, log2e),
        Some(c) if cap_in_scale => b.div(scale, c),
        _ => scale,
    };
    // (1/c, c·log2(e)) for the soft cap.
    let cap_factors = softcap.map(|c| {
        let inv = if cap_in_scale {
            None
        } else {
            let one = b.const_f32(1.0);
            Some(b.div(one, c))
        };
        let out = match f.logits_soft_cap {
            Some(SoftCap::Fixed(c)) => b.const_f32(c * LOG2_E),
            _ => b.mul(c, log2e),
        };
        (inv, out)
    });

    // ---- analysable mask terms (bottom-right aligned) ----
    let shift = b.sub(seq_k, seq_q);
    let mut terms: Vec<(MaskTerm, Value)> = vec![(MaskTerm::ColLt, seq_k), (MaskTerm::RowLt, seq_q)];
    if let Some((split, num_splits)) = split {
        // This split's keys, [split·L, (split+1)·L) (cut at seq_k by the col_lt term
        // above), as analysable terms: `classify-mask-blocks` narrows the key loop to
        // them. L is a multiple of block_n, so splits start and end on key blocks, and
        // the pass, seeing the bounds are multiples of block_n, does not test them per
        // block or per element.
        let per_split = cdiv(&mut b, seq_k, num_splits, c1);
        let block_n_c = b.const_i32(bn as i64);
        let blocks = cdiv(&mut b, per_split, block_n_c, c1);
        let len = b.mul(blocks, block_n_c);
        let k_lo = b.mul(split, len);
        let k_hi = b.add(k_lo, len);
        terms.push((MaskTerm::ColGe, k_lo));
        terms.push((MaskTerm::ColLt, k_hi));
    }
    terms.extend(band_terms(&mut b, f, &param, shift, seq_q, seq_k));

    // A mask mod's affine conjuncts join the analysable mask.
    let mask_mod_terms = hooks.mask_mod.and_then(|m| m.affine);
    if let Some(affine) = mask_mod_terms {
        for (t, x) in affine {
            let c = b.const_i32(*x);
            terms.push((*t, c));
        }
    }
    // Row indices of the block, for the mods.
    let q_idx = if hooks.mask_mod.is_some() || hooks.score_mod.is_some() {
        let r = b.arange(bm);
        let r = b.add(r, i0);
        Some(b.expand_dims(r, 1))
    } else {
        None
    };

    // Loop invariants of the data-dependent masks and of dropout.
    let neg_inf = b.full(f64::NEG_INFINITY, DType::F32, &[bm, bn]);
    let q_seg = if f.segment_ids {
        let ids = b.load(
            param("q_segment_ids"),
            vec![Axis::Index(batch), Axis::Range { start: i0, size: bm, limit: None }],
            -1.0,
        );
        let ids = b.expand_dims(ids, 1);
        let pad = b.const_i32(-1);
        let valid = b.cmp(CmpPred::Ne, ids, pad);
        Some((ids, valid))
    } else {
        None
    };
    let dropout = if f.dropout {
        let p = param("dropout_p");
        let one = b.const_f32(1.0);
        let keep = b.sub(one, p);
        let inv_keep = b.div(one, keep);
        Some((p, inv_keep))
    } else {
        None
    };
    let zero_s = b.full(0.0, DType::F32, &[bm, bn]);
    let block_n_c = b.const_i32(bn as i64);

    // ---- the key loop ----
    let finals = b.for_loop(c0, seq_k, block_n_c, &[acc, m_i, l_i], |b, j0, carried| {
        let (acc, m_i, l_i) = (carried[0], carried[1], carried[2]);
        let k_row0 = b.add(k_start, j0);
        let kv_rows = Axis::Range { start: k_row0, size: bn, limit: k_end };
        let k_tile = b.load(
            k,
            vec![
                Axis::Index(tensor_batch),
                kv_rows,
                Axis::Index(kv_head),
                Axis::Range { start: c0, size: d, limit: None },
            ],
            0.0,
        );
        let qk = b.dot(q_tile, k_tile, zero_s, false, true);
        let mut s = b.mul(qk, qk_scale);
        if f.bias {
            let bias = load_block(b, param("bias"), batch, head, (i0, bm), (j0, bn));
            let bias = b.cast(bias, DType::F32);
            s = b.add(s, bias);
        }
        let kv_idx = q_idx.map(|_| {
            let c = b.arange(bn);
            let c = b.add(c, j0);
            b.expand_dims(c, 0)
        });
        let ctx = match (q_idx, kv_idx) {
            (Some(q_idx), Some(kv_idx)) => Some(ModCtx {
                b: batch,
                h: head,
                q_idx,
                kv_idx,
                q0: i0,
                kv0: j0,
                block_m: bm,
                block_n: bn,
                tensors: mod_tensors.clone(),
            }),
            _ => None,
        };
        if let (Some(sm), Some(ctx)) = (hooks.score_mod, &ctx) {
            s = (sm.expand)(&mut Dsl::new(b), s, ctx);
        }
        if let Some((inv, out)) = cap_factors {
            let x = match inv {
                Some(inv) => b.mul(s, inv),
                None => s,
            };
            let t = b.unary(UnOp::Tanh, x);
            s = b.mul(t, out);
        } else if !fold_log2e {
            s = b.mul(s, log2e);
        }
        s = b.mask_apply(s, i0, j0, &terms);
        let per_element = hooks.mask_mod.filter(|m| m.affine.is_none() || !m.exact);
        if let (Some(mm), Some(ctx)) = (per_element, &ctx) {
            let visible = (mm.expand)(&mut Dsl::new(b), ctx);
            s = b.select(visible, s, neg_inf);
        }
        if f.mask {
            let m = load_block(b, param("mask"), batch, head, (i0, bm), (j0, bn));
            s = b.select(m, s, neg_inf);
        }
        if let Some((q_ids, q_valid)) = q_seg {
            let kv_ids = b.load(
                param("kv_segment_ids"),
                vec![Axis::Index(batch), Axis::Range { start: j0, size: bn, limit: None }],
                -1.0,
            );
            let kv_ids = b.expand_dims(kv_ids, 0);
            let same = b.cmp(CmpPred::Eq, q_ids, kv_ids);
            let visible = b.and(same, q_valid);
            s = b.select(visible, s, neg_inf);
        }
        let (mut p, alpha, m_new, l_new) = b.softmax_update(s, m_i, l_i);
        let acc = b.softmax_rescale(acc, alpha);
        if let Some((drop_p, inv_keep)) = dropout {
            let u = b.rand_uniform(param("seed_lo"), param("seed_hi"), batch, head, i0, j0, &[bm, bn]);
            let kept = b.cmp(CmpPred::Ge, u, drop_p);
            let scaled = b.mul(p, inv_keep);
            p = b.select(kept, scaled, zero_s);
        }
        let p = b.cast(p, dtype);
        let v_tile = b.load(
            v,
            vec![
                Axis::Index(tensor_batch),
                kv_rows,
                Axis::Index(kv_head),
                Axis::Range { start: c0, size: dv, limit: None },
            ],
            0.0,
        );
        let acc = b.dot(p, v_tile, acc, false, false);
        vec![acc, m_new, l_new]
    });

    // ---- epilogue ----
    let (o, lse) = b.softmax_finalize(finals[0], finals[1], finals[2]);
    if let Some((split, _)) = split {
        // The split's own softmax, normalised, in f32: the combine weighs it by its LSE.
        let rows = Axis::Range { start: q_row0, size: bm, limit: q_end };
        let cols = Axis::Range { start: c0, size: dv, limit: None };
        let at = [Axis::Index(split), Axis::Index(batch), Axis::Index(head)];
        b.store(param("o_partial"), [&at[..], &[rows, cols]].concat(), o);
        b.store(param("lse_partial"), [&at[..], &[rows]].concat(), lse);
        return b.finish();
    }
    let o = b.cast(o, dtype);
    b.store(
        param("out"),
        vec![
            Axis::Index(tensor_batch),
            Axis::Range { start: q_row0, size: bm, limit: q_end },
            Axis::Index(head),
            Axis::Range { start: c0, size: dv, limit: None },
        ],
        o,
    );
    b.store(
        param("lse"),
        vec![Axis::Index(tensor_batch), Axis::Index(head), Axis::Range { start: q_row0, size: bm, limit: q_end }],
        lse,
    );
    b.finish()
}

/// `ceil(a / d)` for i32 `a >= 0`, `d > 0` (`c1`: the constant 1).
pub(crate) fn cdiv(b: &mut KernelBuilder, a: Value, d: Value, c1: Value) -> Value {
    let t = b.add(a, d);
    let t = b.sub(t, c1);
    b.div(t, d)
}

/// Attention sinks join the online-softmax state `(m, l)` once, before any key: each
/// sink logit (exp2 domain) is a one-column block of scores. Shared by the forward
/// kernel and the split-KV combine, so both add them the same way. `consts` are the
/// caller's i32 0 and 1 and f32 log2(e).
/// The `[bm, bn]` block at query row `i0`, key `j0` of a `[B, Hq, Sq, Sk]` tensor (bias,
/// mask) for sequence `batch`, head `head`.
pub(crate) fn load_block(
    b: &mut KernelBuilder,
    t: Value,
    batch: Value,
    head: Value,
    (i0, bm): (Value, usize),
    (j0, bn): (Value, usize),
) -> Value {
    let rows = Axis::Range { start: i0, size: bm, limit: None };
    let cols = Axis::Range { start: j0, size: bn, limit: None };
    b.load(t, vec![Axis::Index(batch), Axis::Index(head), rows, cols], 0.0)
}

/// The causal and window mask terms (bottom-right aligned: `shift = s_k − s_q`), the
/// forward's and the backward's.
pub(super) fn band_terms(
    b: &mut KernelBuilder,
    f: &Features,
    param: &dyn Fn(&str) -> Value,
    shift: Value,
    seq_q: Value,
    seq_k: Value,
) -> Vec<(MaskTerm, Value)> {
    let mut terms = Vec::new();
    if f.causal {
        terms.push((MaskTerm::ColLeRow, shift));
    }
    if let Some(w) = f.sliding_window {
        let (left, right) = match w {
            Window::Runtime => (param("window_left"), param("window_right")),
            Window::Fixed { left, right } => (b.const_i32(left as i64), b.const_i32(right as i64)),
        };
        // A side wider than s_q + s_k hides nothing more; clamping keeps `shift ± side`
        // inside i32 for any run-time window (the reference saturates the same way).
        let span = b.add(seq_q, seq_k);
        let left = b.min(left, span);
        let right = b.min(right, span);
        let lo = b.sub(shift, left);
        let hi = b.add(shift, right);
        terms.push((MaskTerm::ColGeRow, lo));
        terms.push((MaskTerm::ColLeRow, hi));
    }
    terms
}

pub(crate) fn enter_sinks(
    b: &mut KernelBuilder,
    sinks: Value,
    head: Value,
    bm: usize,
    (c0, c1, log2e): (Value, Value, Value),
    (m_i, l_i): (Value, Value),
) -> (Value, Value) {
    let n_sinks = b.dim(sinks, 1);
    let r = b.for_loop(c0, n_sinks, c1, &[m_i, l_i], |b, t, carried| {
        let sink = b.load(sinks, vec![Axis::Index(head), Axis::Index(t)], 0.0);
        let sink2 = b.mul(sink, log2e);
        let s = b.splat(sink2, &[bm, 1]);
        let (_p, _alpha, m_new, l_new) = b.softmax_update(s, carried[0], carried[1]);
        vec![m_new, l_new]
    });
    (r[0], r[1])
}
