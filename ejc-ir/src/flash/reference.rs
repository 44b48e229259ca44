//! The reference flash-attention forward: the executable definition of every feature.
//!
//! ```
//! use ejc_ir::flash::{inputs, reference::reference, FlashShape};
//! use ejc_ir::flash::Features;
//! use ejc_ir::types::DType;
//!
//! let features = Features { causal: true, sinks: true, ..Features::default() };
//! let shape = FlashShape::new(2, 5, 7, 4, 2, 8);
//! let x = inputs::random_inputs(&features, DType::BF16, &shape, 1);
//! let rt = inputs::default_runtime(&features, &shape, 1);
//! let y = reference(&features, &rt, &x).unwrap();
//! assert_eq!(y.out.shape, vec![2, 5, 4, 8]); // q's shape, BSHD
//! assert_eq!(y.lse.shape, vec![2, 4, 5]); // [B, Hq, Sq]
//! ```
//!
//! `docs/semantics.md` states the rules in prose and formulas; this function is their
//! definition, so where the two seem to disagree, this code wins and the document is
//! fixed. It is written for clarity, not speed: plain loops, f64 arithmetic, and a
//! two-pass softmax per query row (all logits of the row are materialised, then
//! normalised), so it shares no structure — and no bug — with the tiled online-softmax
//! kernels it checks.
//!
//! Every check on the inputs returns `Err` with a message naming the tensor or scalar
//! at fault; nothing that depends on the inputs panics.

use super::features::{Features, SoftCap, Window};
use crate::flash::problem::{FlashInputs, FlashOutputs, FlashRuntime};
use crate::philox::dropout_uniform;
use crate::tensor::HostTensor;
use crate::types::DType;

/// Compute `out` and `lse` for one forward call.
///
/// Outputs are `f64` and unrounded: `out` has q's logical shape with v's head dim (contiguous), `lse` is
/// `[B, Hq, Sq]` (varlen: `[1, Hq, total_q]`). Tensors that `features` does not use are
/// ignored, like the unused fields of `rt`.
pub fn reference(features: &Features, rt: &FlashRuntime, inputs: &FlashInputs) -> Result<FlashOutputs, String> {
    reference_with_mods(features, rt, inputs, &Mods::default())
}

/// User hooks on top of a variant (FlexAttention style; `#[ej_kernel(mask_mod)]` and
/// `#[ej_kernel(score_mod)]` compile the same functions into kernels). Indices are
/// local to the sequence, `b` is the sequence index.
#[derive(Clone, Copy, Default)]
pub struct Mods<'a> {
    /// `mask(b, h, q_idx, kv_idx)`: true = attend; ANDed with the variant's masks.
    pub mask: Option<&'a dyn Fn(i64, i64, i64, i64) -> bool>,
    /// `score(s, b, h, q_idx, kv_idx)`: applied after scale and bias, before the soft
    /// cap and the masks.
    pub score: Option<&'a dyn Fn(f64, i64, i64, i64, i64) -> f64>,
}

/// [`reference`] with a mask mod and/or a score mod.
pub fn reference_with_mods(
    features: &Features,
    rt: &FlashRuntime,
    inputs: &FlashInputs,
    mods: &Mods,
) -> Result<FlashOutputs, String> {
    let mut problem = Problem::new(features, rt, inputs)?;
    problem.mask_mod = mods.mask;
    problem.score_mod = mods.score;
    let q_shape = &inputs.q.shape;
    let heads_q = q_shape[2];

    let dv = inputs.v.shape.get(3).copied().unwrap_or(0);
    let mut out = HostTensor::zeros(DType::F64, &[q_shape[0], q_shape[1], heads_q, dv]);
    // Packed rows past cu_seqlens_q[B] belong to no sequence; they keep out = 0 and
    // lse = -inf, the values of a row that sees nothing.
    let mut lse = HostTensor::full(DType::F64, &[q_shape[0], heads_q, q_shape[1]], f64::NEG_INFINITY);

    let mut logits = Vec::new();
    for seq in &problem.sequences {
        for h in 0..heads_q {
            let kv = problem.gather_kv(seq, h / problem.group);
            for i in 0..seq.len_q {
                let row = problem.attend(seq, h, i, &kv, &mut logits);
                let t = seq.q_start + i;
                for (d, &x) in row.out.iter().enumerate() {
                    out.set(&[seq.batch, t, h, d], x);
                }
                lse.set(&[seq.batch, h, t], row.lse);
            }
        }
    }
    Ok(FlashOutputs { out, lse })
}

/// Gradients of the loss `L = Σ dout ∘ out` for one call ([`reference_bwd`]): f64,
/// unrounded, contiguous, each with its input's logical shape.
#[derive(Clone, Debug)]
pub struct FlashGrads {
    /// `[B, Sq, Hq, D]`.
    pub dq: HostTensor,
    /// `[B, Sk, Hkv, D]`: summed over the query heads of each KV head (GQA/MQA).
    pub dk: HostTensor,
    /// `[B, Sk, Hkv, Dv]`: summed likewise.
    pub dv: HostTensor,
    /// `[B, Hq, Sq, Sk]` (bias variants): the gradient of every logit's bias term,
    /// unsummed over the axes a broadcast bias shares (the caller sums those).
    pub dbias: Option<HostTensor>,
    /// `[Hq, n_sinks]` (sinks variants): summed over the batch and the query rows.
    pub dsinks: Option<HostTensor>,
}

/// The backward of one forward call: the gradients of `L = Σ dout ∘ out` with respect to
/// q, k, v, and the bias and sinks where the variant has them (docs/semantics.md,
/// "Backward"). `dout` has `out`'s logical shape, `[B, Sq, Hq, Dv]`.
///
/// The forward is recomputed here in f64 (its P, its LSE, its output), so the
/// definition depends on nothing a kernel stored; a kernel takes `out` and `lse` from
/// its forward instead, as FlashAttention does. Masks, segment ids, windows and
/// dropout's keep-mask select and scale exactly as in the forward; a row that sees
/// nothing (LSE −∞) contributes nothing, and a row with sinks but no visible key only
/// to nothing either (its output is 0, so `Δ = 0`).
///
/// ```
/// use ejc_ir::flash::{inputs, reference, FlashShape, Features};
/// use ejc_ir::tensor::HostTensor;
/// use ejc_ir::types::DType;
///
/// let f = Features { causal: true, sinks: true, ..Features::default() };
/// let shape = FlashShape::new(1, 3, 4, 2, 1, 8);
/// let x = inputs::random_inputs(&f, DType::F32, &shape, 1);
/// let rt = inputs::default_runtime(&f, &shape, 1);
/// let dout = HostTensor::full(DType::F32, &[1, 3, 2, 8], 0.5);
/// let g = reference::reference_bwd(&f, &rt, &x, &dout).unwrap();
/// assert_eq!(g.dk.shape, vec![1, 4, 1, 8]); // k's shape: summed over the 2 query heads
/// assert_eq!(g.dsinks.unwrap().shape, vec![2, 3]);
/// ```
pub fn reference_bwd(
    features: &Features,
    rt: &FlashRuntime,
    inputs: &FlashInputs,
    dout: &HostTensor,
) -> Result<FlashGrads, String> {
    let p = Problem::new(features, rt, inputs)?;
    let (q_shape, k_shape, v_shape) = (&inputs.q.shape, &inputs.k.shape, &inputs.v.shape);
    let (heads_q, dv) = (q_shape[2], p.head_dim_v);
    check_tensor("dout", dout, &[q_shape[0], q_shape[1], heads_q, dv])?;
    let mut dq = HostTensor::zeros(DType::F64, q_shape);
    let mut dk = HostTensor::zeros(DType::F64, k_shape);
    let mut dvt = HostTensor::zeros(DType::F64, v_shape);
    let mut dbias = p.bias.map(|b| HostTensor::zeros(DType::F64, &b.shape));
    let mut dsinks = p.sinks.map(|t| HostTensor::zeros(DType::F64, &t.shape));

    let mut logits = Vec::new();
    for seq in &p.sequences {
        for h in 0..heads_q {
            let kv_head = h / p.group;
            let kv = p.gather_kv(seq, kv_head);
            for i in 0..seq.len_q {
                let t = seq.q_start + i;
                let q_i: Vec<f64> = (0..p.head_dim).map(|d| p.q.get(&[seq.batch, t, h, d])).collect();
                logits.clear();
                for j in 0..seq.len_k {
                    if p.visible(seq, h, i, j) {
                        logits.push((j, p.logit(seq, h, i, j, &q_i, &kv.k[j])));
                    }
                }
                let sinks = p.sink_logits(h);
                let m = logits.iter().map(|&(_, s)| s).chain(sinks.iter().copied()).fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue; // out = 0 whatever the inputs: every gradient is 0
                }
                let z: f64 = logits.iter().map(|&(_, s)| s).chain(sinks.iter().copied()).map(|s| (s - m).exp()).sum();
                let lse = m + z.ln();
                let do_i: Vec<f64> = (0..dv).map(|d| dout.get(&[seq.batch, t, h, d])).collect();
                // P'_ij = P_ij · keep_ij; out_i = Σ_j P'_ij v_j; Δ_i = dout_i · out_i.
                let weights: Vec<(usize, f64, f64, f64)> = logits
                    .iter()
                    .map(|&(j, s)| {
                        let p_ij = (s - lse).exp();
                        (j, s, p_ij, p.dropout_factor(seq, h, i, j))
                    })
                    .collect();
                let mut out_i = vec![0.0; dv];
                for &(j, _, p_ij, keep) in &weights {
                    for (o, &x) in out_i.iter_mut().zip(&kv.v[j]) {
                        *o += p_ij * keep * x;
                    }
                }
                let delta: f64 = do_i.iter().zip(&out_i).map(|(a, b)| a * b).sum();
                for &(j, s, p_ij, keep) in &weights {
                    let tj = seq.k_start + j;
                    for (d, &g) in do_i.iter().enumerate() {
                        let at = [seq.batch, tj, kv_head, d];
                        dvt.set(&at, dvt.get(&at) + p_ij * keep * g);
                    }
                    let dp: f64 = keep * do_i.iter().zip(&kv.v[j]).map(|(a, b)| a * b).sum::<f64>();
                    let mut ds = p_ij * (dp - delta);
                    if let Some(c) = p.softcap {
                        // s = c·tanh(u / c): ds/du = 1 − tanh² = 1 − (s / c)².
                        ds *= 1.0 - (s / c) * (s / c);
                    }
                    if let Some(db) = dbias.as_mut() {
                        db.set(&[seq.index, h, i, j], ds);
                    }
                    for (d, (&k_jd, &q_id)) in kv.k[j].iter().zip(&q_i).enumerate() {
                        let at = [seq.batch, t, h, d];
                        dq.set(&at, dq.get(&at) + p.scale * ds * k_jd);
                        let at = [seq.batch, tj, kv_head, d];
                        dk.set(&at, dk.get(&at) + p.scale * ds * q_id);
                    }
                }
                if let Some(dsk) = dsinks.as_mut() {
                    // A sink joins the softmax with value 0: dP = 0, so dS = P · (0 − Δ).
                    for (n, &s) in sinks.iter().enumerate() {
                        dsk.set(&[h, n], dsk.get(&[h, n]) - (s - lse).exp() * delta);
                    }
                }
            }
        }
    }
    Ok(FlashGrads { dq, dk, dv: dvt, dbias, dsinks })
}

/// One sequence of the call: a batch entry (dense) or a `cu_seqlens` range (varlen).
#[derive(Clone, Copy, Debug)]
struct Sequence {
    /// Sequence index `b`: indexes bias, mask and segment ids, and keys dropout.
    index: usize,
    /// Batch coordinate of q/k/v/out (`index` when dense, 0 when varlen).
    batch: usize,
    /// First row of the sequence in q / in k and v (0 when dense).
    q_start: usize,
    k_start: usize,
    len_q: usize,
    len_k: usize,
}

impl Sequence {
    /// `s_k - s_q`: the offset that aligns causal masks and windows to the bottom right.
    fn shift(&self) -> i64 {
        self.len_k as i64 - self.len_q as i64
    }
}

#[derive(Clone, Copy, Debug)]
struct Dropout {
    /// Drop probability, already rounded to f32.
    p: f64,
    /// `1 / (1 - p)`, in f64 from the rounded p.
    keep_scale: f64,
    seed: u64,
}

/// The validated call: tensors a feature needs, effective scalars, sequences.
struct Problem<'a> {
    q: &'a HostTensor,
    k: &'a HostTensor,
    v: &'a HostTensor,
    bias: Option<&'a HostTensor>,
    mask: Option<&'a HostTensor>,
    /// (q_segment_ids, kv_segment_ids).
    segments: Option<(&'a HostTensor, &'a HostTensor)>,
    sinks: Option<&'a HostTensor>,
    /// Query heads per KV head.
    group: usize,
    head_dim: usize,
    /// v's and the output's.
    head_dim_v: usize,
    scale: f64,
    softcap: Option<f64>,
    causal: bool,
    /// Effective (left, right), both >= 0.
    window: Option<(i64, i64)>,
    dropout: Option<Dropout>,
    sequences: Vec<Sequence>,
    mask_mod: Option<&'a dyn Fn(i64, i64, i64, i64) -> bool>,
    score_mod: Option<&'a dyn Fn(f64, i64, i64, i64, i64) -> f64>,
}

/// K and V rows of one (sequence, KV head), gathered once and reused by every query
/// row of the query heads that share the KV head.
struct KvRows {
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
}

struct Row {
    out: Vec<f64>,
    lse: f64,
}

impl<'a> Problem<'a> {
    fn new(features: &Features, rt: &FlashRuntime, inputs: &'a FlashInputs) -> Result<Problem<'a>, String> {
        let (q, k, v) = (&inputs.q, &inputs.k, &inputs.v);
        check_layout("q", q)?;
        check_layout("k", k)?;
        check_layout("v", v)?;
        let [batch_q, rows_q, heads_q, head_dim] = dims4("q", q)?;
        let [batch_k, rows_k, heads_kv, head_dim_k] = dims4("k", k)?;
        let head_dim_v = dims4("v", v)?[3];
        if v.shape[..3] != k.shape[..3] || head_dim_v == 0 {
            return Err(format!(
                "v has shape {:?} but k has {:?}; they must match but for the head dim",
                v.shape, k.shape
            ));
        }
        if head_dim_k != head_dim {
            return Err(format!("q has head_dim {head_dim} but k has {head_dim_k}; they must match"));
        }
        if heads_kv == 0 || heads_q % heads_kv != 0 {
            return Err(format!(
                "heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) \
                 (GQA/MQA groups query heads evenly)"
            ));
        }
        if batch_q != batch_k {
            return Err(format!("q has batch {batch_q} but k/v have batch {batch_k}; they must match"));
        }

        let sequences = if features.varlen {
            if features.bias || features.mask || features.segment_ids {
                return Err("varlen cannot be combined with bias, mask or segment ids \
                            (the spec loader rejects these combinations too)"
                    .into());
            }
            if batch_q != 1 {
                return Err(format!(
                    "varlen q/k/v must be packed as [1, total, heads, head_dim]; q has batch {batch_q}"
                ));
            }
            varlen_sequences(inputs, rows_q, rows_k)?
        } else {
            (0..batch_q)
                .map(|b| Sequence { index: b, batch: b, q_start: 0, k_start: 0, len_q: rows_q, len_k: rows_k })
                .collect()
        };
        // Bias, mask and segment ids exist only for dense calls, where the batch, the
        // sequence count and the tensor lengths are the same thing.
        let (batch, sq, sk) = (batch_q, rows_q, rows_k);

        let bias = if features.bias {
            let t = required(&inputs.bias, "bias", "bias")?;
            check_tensor("bias", t, &[batch, heads_q, sq, sk])?;
            Some(t)
        } else {
            None
        };
        let mask = if features.mask {
            let t = required(&inputs.mask, "mask", "mask")?;
            check_tensor("mask", t, &[batch, heads_q, sq, sk])?;
            Some(t)
        } else {
            None
        };
        let segments = if features.segment_ids {
            let qs = required(&inputs.q_segment_ids, "q_segment_ids", "segment_ids")?;
            let ks = required(&inputs.kv_segment_ids, "kv_segment_ids", "segment_ids")?;
            check_tensor("q_segment_ids", qs, &[batch, sq])?;
            check_tensor("kv_segment_ids", ks, &[batch, sk])?;
            Some((qs, ks))
        } else {
            None
        };
        let sinks = if features.sinks {
            let t = required(&inputs.sinks, "sinks", "sinks")?;
            check_layout("sinks", t)?;
            if t.rank() != 2 || t.shape[0] != heads_q {
                return Err(format!(
                    "sinks has shape {:?}; expected [{heads_q}, n_sinks] \
                     (use stride 0 on the head axis to share sinks across heads)",
                    t.shape
                ));
            }
            Some(t)
        } else {
            None
        };

        // The kernels take scale, soft cap and dropout p as f32 parameters; rounding
        // here makes the reference compute with the very values they see.
        let scale = to_f32(rt.softmax_scale);
        if !scale.is_finite() {
            return Err(format!("softmax_scale {} is not finite as an f32", rt.softmax_scale));
        }
        let softcap = match features.logits_soft_cap {
            None => None,
            Some(SoftCap::Fixed(c)) => Some(checked_softcap(c, "the variant's fixed")?),
            Some(SoftCap::Runtime) => Some(checked_softcap(rt.softcap, "the run-time")?),
        };
        let window = match features.sliding_window {
            None => None,
            Some(Window::Fixed { left, right }) => Some((i64::from(left), i64::from(right))),
            Some(Window::Runtime) => {
                // A negative side moves the band off the diagonal (ring attention's
                // blocks, docs/semantics.md); the public front doors refuse it.
                Some(rt.window)
            }
        };
        let dropout = if features.dropout {
            let p = to_f32(rt.dropout_p);
            if !(0.0..1.0).contains(&p) {
                return Err(format!("dropout_p {} must lie in [0, 1) (after rounding to f32: {p})", rt.dropout_p));
            }
            // Philox counters are u32: every coordinate of the call must fit.
            let max_len = sequences.iter().map(|s| s.len_q.max(s.len_k)).max().unwrap_or(0);
            for (what, n) in [("sequences", sequences.len()), ("heads", heads_q), ("rows", max_len)] {
                if n.saturating_sub(1) > u32::MAX as usize {
                    return Err(format!("{n} {what} do not fit dropout's 32-bit Philox counters"));
                }
            }
            Some(Dropout { p, keep_scale: 1.0 / (1.0 - p), seed: rt.seed })
        } else {
            None
        };

        Ok(Problem {
            q,
            k,
            v,
            bias,
            mask,
            segments,
            sinks,
            group: heads_q / heads_kv,
            head_dim,
            head_dim_v,
            scale,
            softcap,
            causal: features.causal,
            window,
            dropout,
            sequences,
            mask_mod: None,
            score_mod: None,
        })
    }

    fn gather_kv(&self, seq: &Sequence, kv_head: usize) -> KvRows {
        let row = |t: &HostTensor, j: usize, n: usize| -> Vec<f64> {
            (0..n).map(|d| t.get(&[seq.batch, seq.k_start + j, kv_head, d])).collect()
        };
        KvRows {
            k: (0..seq.len_k).map(|j| row(self.k, j, self.head_dim)).collect(),
            v: (0..seq.len_k).map(|j| row(self.v, j, self.head_dim_v)).collect(),
        }
    }

    /// Whether query row `i` of head `h` sees key `j` (local positions; `j < s_k` holds
    /// by construction of the caller's loop).
    fn visible(&self, seq: &Sequence, h: usize, i: usize, j: usize) -> bool {
        let diagonal = i as i64 + seq.shift();
        let j_pos = j as i64;
        if self.causal && j_pos > diagonal {
            return false;
        }
        if let Some((left, right)) = self.window {
            // Saturating: a run-time window may be as wide as i64 allows.
            if j_pos < diagonal.saturating_sub(left) || j_pos > diagonal.saturating_add(right) {
                return false;
            }
        }
        if let Some(mask) = self.mask {
            if mask.get(&[seq.index, h, i, j]) == 0.0 {
                return false;
            }
        }
        if let Some((q_ids, kv_ids)) = self.segments {
            let id = q_ids.get(&[seq.index, i]);
            if id == -1.0 || id != kv_ids.get(&[seq.index, j]) {
                return false;
            }
        }
        if let Some(m) = self.mask_mod {
            if !m(seq.index as i64, h as i64, i as i64, j as i64) {
                return false;
            }
        }
        true
    }

    /// `s_ij`: scale, then bias, then soft cap.
    fn logit(&self, seq: &Sequence, h: usize, i: usize, j: usize, q_i: &[f64], k_j: &[f64]) -> f64 {
        let dot: f64 = q_i.iter().zip(k_j).map(|(a, b)| a * b).sum();
        let mut s = self.scale * dot;
        if let Some(bias) = self.bias {
            s += bias.get(&[seq.index, h, i, j]);
        }
        if let Some(f) = self.score_mod {
            s = f(s, seq.index as i64, h as i64, i as i64, j as i64);
        }
        if let Some(c) = self.softcap {
            s = c * (s / c).tanh();
        }
        s
    }

    /// Sink logits of head `h`: used as stored, neither scaled nor capped.
    fn sink_logits(&self, h: usize) -> Vec<f64> {
        match self.sinks {
            Some(t) => (0..t.shape[1]).map(|n| t.get(&[h, n])).collect(),
            None => Vec::new(),
        }
    }

    /// Weight multiplier of attention element (i, j) after dropout: 0 if dropped,
    /// `1 / (1 - p)` if kept, 1 without dropout.
    fn dropout_factor(&self, seq: &Sequence, h: usize, i: usize, j: usize) -> f64 {
        let Some(dropout) = self.dropout else {
            return 1.0;
        };
        // The casts are lossless: `Problem::new` checked that every coordinate fits u32.
        let u = dropout_uniform(dropout.seed, seq.index as u32, h as u32, i as u32, j as u32);
        if u >= dropout.p {
            dropout.keep_scale
        } else {
            0.0
        }
    }

    /// One query row, two-pass: materialise the visible logits, then normalise.
    fn attend(&self, seq: &Sequence, h: usize, i: usize, kv: &KvRows, logits: &mut Vec<(usize, f64)>) -> Row {
        let q_i: Vec<f64> = (0..self.head_dim).map(|d| self.q.get(&[seq.batch, seq.q_start + i, h, d])).collect();
        logits.clear();
        for j in 0..seq.len_k {
            if self.visible(seq, h, i, j) {
                logits.push((j, self.logit(seq, h, i, j, &q_i, &kv.k[j])));
            }
        }
        let sinks = self.sink_logits(h);

        let mut out = vec![0.0; self.head_dim_v];
        let m = logits.iter().map(|&(_, s)| s).chain(sinks.iter().copied()).fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            // Nothing carries weight (no visible key and no sink, or all of them -inf):
            // the softmax is empty, not 0/0.
            return Row { out, lse: f64::NEG_INFINITY };
        }
        // Z / exp(m); subtracting the max keeps every exponent <= 0.
        let z: f64 = logits.iter().map(|&(_, s)| s).chain(sinks.iter().copied()).map(|s| (s - m).exp()).sum();
        for &(j, s) in logits.iter() {
            let weight = (s - m).exp() / z * self.dropout_factor(seq, h, i, j);
            if weight == 0.0 {
                continue;
            }
            for (o, &x) in out.iter_mut().zip(&kv.v[j]) {
                *o += weight * x;
            }
        }
        Row { out, lse: m + z.ln() }
    }
}

fn to_f32(x: f64) -> f64 {
    x as f32 as f64
}

fn checked_softcap(c: f64, which: &str) -> Result<f64, String> {
    let c32 = to_f32(c);
    if c32 > 0.0 && c32.is_finite() {
        Ok(c32)
    } else {
        Err(format!("{which} logits soft cap {c} must be > 0 and finite as an f32 (got {c32})"))
    }
}

fn required<'t>(t: &'t Option<HostTensor>, name: &str, feature: &str) -> Result<&'t HostTensor, String> {
    t.as_ref().ok_or_else(|| format!("the variant has `{feature}` but no `{name}` tensor was given"))
}

/// Strides agree with the rank and every index maps into storage, so `get` cannot
/// go out of bounds.
fn check_layout(name: &str, t: &HostTensor) -> Result<(), String> {
    if t.strides.len() != t.shape.len() {
        return Err(format!("{name} has {} strides for its rank-{} shape {:?}", t.strides.len(), t.rank(), t.shape));
    }
    if !t.in_storage() {
        return Err(format!(
            "{name} (shape {:?}, strides {:?}, offset {}) reaches outside its {} stored values",
            t.shape,
            t.strides,
            t.offset,
            t.data.len()
        ));
    }
    Ok(())
}

fn check_tensor(name: &str, t: &HostTensor, expected: &[usize]) -> Result<(), String> {
    check_layout(name, t)?;
    if t.shape != expected {
        return Err(format!(
            "{name} has shape {:?}; expected {expected:?} (broadcast axes keep their full \
             size with stride 0)",
            t.shape
        ));
    }
    Ok(())
}

fn dims4(name: &str, t: &HostTensor) -> Result<[usize; 4], String> {
    <[usize; 4]>::try_from(t.shape.as_slice())
        .map_err(|_| format!("{name} has shape {:?}; expected rank 4 [batch, seq, heads, head_dim] (BSHD)", t.shape))
}

/// The sequences of a packed call, from `cu_seqlens_q/k`.
fn varlen_sequences(inputs: &FlashInputs, total_q: usize, total_k: usize) -> Result<Vec<Sequence>, String> {
    let cu_q = read_cu_seqlens("cu_seqlens_q", required(&inputs.cu_seqlens_q, "cu_seqlens_q", "varlen")?, total_q)?;
    let cu_k = read_cu_seqlens("cu_seqlens_k", required(&inputs.cu_seqlens_k, "cu_seqlens_k", "varlen")?, total_k)?;
    if cu_q.len() != cu_k.len() {
        return Err(format!(
            "cu_seqlens_q has {} entries but cu_seqlens_k has {}; both must be [B + 1]",
            cu_q.len(),
            cu_k.len()
        ));
    }
    Ok((0..cu_q.len() - 1)
        .map(|b| Sequence {
            index: b,
            batch: 0,
            q_start: cu_q[b],
            k_start: cu_k[b],
            len_q: cu_q[b + 1] - cu_q[b],
            len_k: cu_k[b + 1] - cu_k[b],
        })
        .collect())
}

/// Prefix sums `[B + 1]`: integers, starting at 0, non-decreasing, at most `total`.
fn read_cu_seqlens(name: &str, t: &HostTensor, total: usize) -> Result<Vec<usize>, String> {
    check_layout(name, t)?;
    if t.rank() != 1 || t.shape[0] == 0 {
        return Err(format!("{name} has shape {:?}; expected [B + 1] with B >= 0", t.shape));
    }
    let values = t.to_vec();
    let mut out = Vec::with_capacity(values.len());
    for (n, &x) in values.iter().enumerate() {
        if !(x >= 0.0 && x.fract() == 0.0 && x <= total as f64) {
            return Err(format!("{name}[{n}] = {x} is not an integer in [0, {total}] (the packed length)"));
        }
        let x = x as usize;
        if n == 0 && x != 0 {
            return Err(format!("{name} must start at 0; it starts at {x}"));
        }
        if let Some(&prev) = out.last() {
            if x < prev {
                return Err(format!(
                    "{name} must be non-decreasing; entry {n} ({x}) is below entry {} ({prev})",
                    n - 1
                ));
            }
        }
        out.push(x);
    }
    Ok(out)
}
