//! The f64 reference of block-sparse attention, and random calls.
//!
//! ```
//! use ejc_ir::ops::blocksparse::mask::MaskExpr;
//! use ejc_ir::ops::blocksparse::reference::{random_inputs, reference, BsFeatures, BsShape};
//! use ejc_ir::types::DType;
//!
//! let f = BsFeatures { mask: MaskExpr::Causal { offset: 0 }, segment_ids: true, ..Default::default() };
//! let s = BsShape { batch: 2, heads_q: 4, heads_kv: 2, seq_q: 37, seq_k: 41, head_dim: 16, head_dim_v: 8, doc_len: 0, mask_heads: 1 };
//! let x = random_inputs(&f, DType::F32, &s, 5);
//! let (out, lse) = reference(&f, &x, 0.25, None).unwrap();
//! assert_eq!(out.shape, vec![2, 4, 37, 8]);
//! assert_eq!(lse.shape, vec![2, 4, 37]);
//! ```
//!
//! The semantics are in docs/semantics.md ("Block-sparse attention"); this is their
//! definition, written for clarity (loops over rows and keys, f64 sums), sharing no code
//! with the kernels except the mask algebra's host form ([`MaskExpr::visible`]). It knows
//! nothing of blocks: a block layout only decides which keys a kernel reads, never what
//! it computes.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use super::mask::MaskExpr;
use crate::tensor::HostTensor;
use crate::types::DType;

/// What a variant computes.
#[derive(Clone, Debug, PartialEq)]
pub struct BsFeatures {
    /// The mask algebra (the seed's default: causal).
    pub mask: MaskExpr,
    /// `q_segment_ids [B, Sq]`, `kv_segment_ids [B, Sk]` (i32): equal ids attend; a query
    /// id of −1 is padding and sees nothing.
    pub segment_ids: bool,
    /// `attention_mask [B, H, Sq, Sk]` (i1, true = attend; stride 0 on the head axis
    /// shares one head's), ANDed with the rest.
    pub attention_mask: bool,
    /// `sinks [H, n]`: extra logits in each row's softmax denominator.
    pub sinks: bool,
    /// A run-time soft cap `logits_soft_cap`: `c · tanh(x / c)` on the scaled scores.
    pub soft_cap: bool,
    /// `q_positions [B, Sq]`, `kv_positions [B, Sk]` (i32, from 0 to 2³⁰): the mask algebra
    /// is evaluated on them instead of the row and key indices (the seed's positions;
    /// their default is `arange`).
    pub positions: bool,
    /// The seed's `MultiHeadMask`: head `h` also needs `head_masks[h mod n]` (empty: no
    /// per-head mask). Layouts are then per head.
    pub head_masks: Vec<MaskExpr>,
    /// `bias [B, H, Sq, Sk]` (the query's dtype; stride 0 broadcasts an axis): added to
    /// the scaled scores before the soft cap. It changes no layout: a block the mask
    /// hides is skipped whatever its bias.
    pub bias: bool,
    /// Backward only: also return `dbias [B, H, Sq, Sk]`, the gradient of each logit's
    /// bias term (needs `bias`; never in a forward spec).
    pub bias_grad: bool,
    /// A sliding window given per call (the seed's `sliding_window`): scalars
    /// `window_left`, `window_right`; row `q` also needs `q − left ≤ kv ≤ q + right`.
    pub runtime_window: bool,
    /// Chunks given per call (the seed's `chunk_size`): scalar `chunk_size`; row `q` also
    /// needs `⌊q / c⌋ = ⌊kv / c⌋` and `kv ≤ q` (the seed's `ChunkedCausalMask`).
    pub runtime_chunk: bool,
}

impl Default for BsFeatures {
    fn default() -> Self {
        BsFeatures {
            mask: MaskExpr::Causal { offset: 0 },
            segment_ids: false,
            attention_mask: false,
            sinks: false,
            soft_cap: false,
            positions: false,
            head_masks: Vec::new(),
            bias: false,
            bias_grad: false,
            runtime_window: false,
            runtime_chunk: false,
        }
    }
}

impl BsFeatures {
    /// Whether a block layout is per head: an attention mask or per-head masks.
    pub fn per_head(&self) -> bool {
        self.attention_mask || !self.head_masks.is_empty()
    }

    /// The mask of head `h`'s own, where the variant has per-head masks.
    pub fn head_mask(&self, h: usize) -> Option<&MaskExpr> {
        (!self.head_masks.is_empty()).then(|| &self.head_masks[h % self.head_masks.len()])
    }

    /// Whether a block layout depends on the call's tensors (segment ids, an array mask
    /// or positions): then it is built per batch entry, else once for the whole call.
    pub fn data_dependent(&self) -> bool {
        self.segment_ids || self.attention_mask || self.positions
    }
}

/// The size of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BsShape {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    /// Segment-id variants: 0 for documents of random lengths, else documents whose lengths
    /// cycle through [`DOC_CYCLE`] × `doc_len` / 4 (no padding): a layout a benchmark's
    /// anchors can rebuild exactly.
    pub doc_len: usize,
    /// Heads of distinct attention masks: 1 (one shared by every head, a stride-0 view)
    /// or `heads_q`.
    pub mask_heads: usize,
}

/// The inputs of one call (the optional ones where the variant has them).
#[derive(Clone, Debug, PartialEq)]
pub struct BsInputs {
    /// `[B, H, Sq, D]`, a view with a padded head axis (not contiguous).
    pub query: HostTensor,
    /// `[B, KVH, Sk, D]`.
    pub key: HostTensor,
    /// `[B, KVH, Sk, Dv]`, a view of a `[B, Sk, KVH, Dv]` buffer (BSHD storage).
    pub value: HostTensor,
    pub q_segment_ids: Option<HostTensor>,
    pub kv_segment_ids: Option<HostTensor>,
    pub attention_mask: Option<HostTensor>,
    pub sinks: Option<HostTensor>,
    pub q_positions: Option<HostTensor>,
    pub kv_positions: Option<HostTensor>,
    /// `[B, H, Sq, Sk]`; random calls share one across the batch (a stride-0 view).
    pub bias: Option<HostTensor>,
    /// The call's `(window_left, window_right)` (run-time window variants).
    pub window: Option<(i64, i64)>,
    /// The call's `chunk_size` (run-time chunk variants).
    pub chunk: Option<i64>,
}

fn randn(dtype: DType, shape: &[usize], rng: &mut StdRng) -> HostTensor {
    let n: usize = shape.iter().product();
    HostTensor::from_vec(dtype, shape, (0..n).map(|_| rng.sample::<f64, _>(StandardNormal)).collect())
}

/// Document ids for `len` positions: runs of random lengths (ids 0, 1, 2, ...); with
/// `pad`, the last few positions are −1.
fn documents(len: usize, mean: usize, pad: bool, rng: &mut StdRng) -> Vec<f64> {
    let mut ids = Vec::with_capacity(len);
    let mut id = 0.0;
    while ids.len() < len {
        let run = rng.random_range(1..=2 * mean.max(1));
        ids.extend(std::iter::repeat_n(id, run.min(len - ids.len())));
        id += 1.0;
    }
    if pad && len > 3 {
        let n = rng.random_range(1..=len / 4 + 1);
        for x in ids.iter_mut().rev().take(n) {
            *x = -1.0;
        }
    }
    ids
}

/// The document lengths of `doc_len` > 0, in quarters of `doc_len`: unequal, repeating.
pub const DOC_CYCLE: [usize; 5] = [2, 6, 4, 3, 5];

/// The segment ids of `len` positions with `doc_len` > 0: documents of lengths
/// `DOC_CYCLE[i mod 5] · doc_len / 4` (at least 1), ids 0, 1, 2, ...
pub fn cycled_documents(len: usize, doc_len: usize) -> Vec<f64> {
    let mut ids = Vec::with_capacity(len);
    let mut i = 0;
    while ids.len() < len {
        let run = (DOC_CYCLE[i % DOC_CYCLE.len()] * doc_len / 4).max(1);
        ids.extend(std::iter::repeat_n(i as f64, run.min(len - ids.len())));
        i += 1;
    }
    ids
}

/// Fresh random inputs (N(0, 1) values; never zeros). Segment ids are documents of
/// random lengths (the same documents for queries and keys over their common prefix, the
/// queries' tail padded with −1); the attention mask is made of 24 × 40 regions that are
/// each all visible, all hidden or random, so that a layout has every kind of block.
pub fn random_inputs(f: &BsFeatures, dtype: DType, s: &BsShape, seed: u64) -> BsInputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let (b, h, kvh) = (s.batch, s.heads_q, s.heads_kv);
    let base = randn(dtype, &[b, h + 1, s.seq_q, s.head_dim], &mut rng);
    let query = base.into_view(
        &[b, h, s.seq_q, s.head_dim],
        &[((h + 1) * s.seq_q * s.head_dim) as isize, (s.seq_q * s.head_dim) as isize, s.head_dim as isize, 1],
        0,
    );
    let key = randn(dtype, &[b, kvh, s.seq_k, s.head_dim], &mut rng);
    let vbase = randn(dtype, &[b, s.seq_k, kvh, s.head_dim_v], &mut rng);
    let dv = s.head_dim_v;
    let value = vbase.into_view(
        &[b, kvh, s.seq_k, dv],
        &[(s.seq_k * kvh * dv) as isize, dv as isize, (kvh * dv) as isize, 1],
        0,
    );
    let (mut q_seg, mut kv_seg) = (None, None);
    if f.segment_ids {
        let mean = (s.seq_q.max(s.seq_k) / 4).max(1);
        let mut qv = Vec::new();
        let mut kv = Vec::new();
        for _ in 0..b {
            if s.doc_len > 0 {
                qv.extend(cycled_documents(s.seq_q, s.doc_len));
                kv.extend(cycled_documents(s.seq_k, s.doc_len));
                continue;
            }
            let long = documents(s.seq_q.max(s.seq_k), mean, false, &mut rng);
            let mut q: Vec<f64> = long[..s.seq_q].to_vec();
            let n = rng.random_range(0..=s.seq_q / 5);
            for x in q.iter_mut().rev().take(n) {
                *x = -1.0;
            }
            qv.extend(q);
            kv.extend_from_slice(&long[..s.seq_k]);
        }
        q_seg = Some(HostTensor::from_vec(DType::I32, &[b, s.seq_q], qv));
        kv_seg = Some(HostTensor::from_vec(DType::I32, &[b, s.seq_k], kv));
    }
    let attention_mask = f.attention_mask.then(|| {
        let mh = s.mask_heads.max(1);
        let mut m = vec![0.0; b * mh * s.seq_q * s.seq_k];
        let (ry, rx) = (24, 40);
        for bh in 0..b * mh {
            for y0 in (0..s.seq_q).step_by(ry) {
                for x0 in (0..s.seq_k).step_by(rx) {
                    let kind = rng.random_range(0..5);
                    for y in y0..(y0 + ry).min(s.seq_q) {
                        for x in x0..(x0 + rx).min(s.seq_k) {
                            let on = match kind {
                                0 | 1 => true,
                                2 | 3 => false,
                                _ => rng.random_bool(0.5),
                            };
                            m[(bh * s.seq_q + y) * s.seq_k + x] = f64::from(u8::from(on));
                        }
                    }
                }
            }
        }
        let t = HostTensor::from_vec(DType::I1, &[b, mh, s.seq_q, s.seq_k], m);
        // One head's mask shared by every head: a stride-0 view, as a caller broadcasts.
        let hs = if mh == 1 { 0 } else { (s.seq_q * s.seq_k) as isize };
        let strides = [(mh * s.seq_q * s.seq_k) as isize, hs, s.seq_k as isize, 1];
        t.into_view(&[b, h, s.seq_q, s.seq_k], &strides, 0)
    });
    let sinks = f.sinks.then(|| randn(DType::F32, &[h, 2], &mut rng));
    // Positions: with segment ids, each document's own (from 0 at its first token, as
    // packed sequences have them); without, the queries are the last Sq positions of a
    // sequence of Sk + a random offset (a chunk of a longer sequence, as under sequence
    // parallelism), and the keys' positions skip a few numbers.
    let (mut q_positions, mut kv_positions) = (None, None);
    if f.positions {
        let (mut qp, mut kp) = (Vec::new(), Vec::new());
        for bi in 0..b {
            if let (Some(qs), Some(ks)) = (&q_seg, &kv_seg) {
                for (ids, len, out) in [(qs, s.seq_q, &mut qp), (ks, s.seq_k, &mut kp)] {
                    let mut pos = 0.0;
                    for i in 0..len {
                        if i > 0 && ids.get(&[bi, i]) != ids.get(&[bi, i - 1]) {
                            pos = 0.0;
                        }
                        out.push(pos);
                        pos += 1.0;
                    }
                }
            } else {
                let mut pos = 0.0;
                let mut keys = Vec::with_capacity(s.seq_k);
                for _ in 0..s.seq_k {
                    keys.push(pos);
                    pos += if rng.random_bool(0.1) { 2.0 } else { 1.0 };
                }
                let end = keys.last().copied().unwrap_or(0.0) + rng.random_range(0..=s.seq_k / 3 + 1) as f64;
                qp.extend((0..s.seq_q).map(|i| (end - (s.seq_q - 1 - i) as f64).max(0.0)));
                kp.extend(keys);
            }
        }
        q_positions = Some(HostTensor::from_vec(DType::I32, &[b, s.seq_q], qp));
        kv_positions = Some(HostTensor::from_vec(DType::I32, &[b, s.seq_k], kp));
    }
    // A bias shared by the batch (as a relative-position bias is): one `[1, H, Sq, Sk]`
    // buffer seen through a stride-0 batch axis.
    let bias = f.bias.then(|| {
        let t = randn(dtype, &[1, h, s.seq_q, s.seq_k], &mut rng);
        let strides = [0, (s.seq_q * s.seq_k) as isize, s.seq_k as isize, 1];
        t.into_view(&[b, h, s.seq_q, s.seq_k], &strides, 0)
    });
    // Run-time sizes that cut through blocks: a window of a few dozen keys, chunks of a
    // length off every block size.
    let window = f.runtime_window.then(|| (rng.random_range(50..=100), rng.random_range(0..=9)));
    let chunk = f.runtime_chunk.then(|| rng.random_range(60..=97));
    BsInputs {
        query,
        key,
        value,
        q_segment_ids: q_seg,
        kv_segment_ids: kv_seg,
        attention_mask,
        sinks,
        q_positions,
        kv_positions,
        bias,
        window,
        chunk,
    }
}

/// Whether row `i` of sequence `b`, head `h`, sees key `j` (every condition of the
/// variant; `0 <= i < Sq`, `0 <= j < Sk`).
pub fn visible(f: &BsFeatures, x: &BsInputs, b: usize, h: usize, i: usize, j: usize) -> bool {
    let (qp, kp) = match (&x.q_positions, &x.kv_positions) {
        (Some(q), Some(k)) => (q.get(&[b, i]) as i64, k.get(&[b, j]) as i64),
        _ => (i as i64, j as i64),
    };
    if !f.mask.visible(qp, kp) || f.head_mask(h).is_some_and(|m| !m.visible(qp, kp)) {
        return false;
    }
    if let Some((left, right)) = x.window {
        if !(MaskExpr::Local { left, right }).visible(qp, kp) {
            return false;
        }
    }
    if let Some(chunk) = x.chunk {
        if !(MaskExpr::ChunkedCausal { chunk }).visible(qp, kp) {
            return false;
        }
    }
    if let (Some(q), Some(k)) = (&x.q_segment_ids, &x.kv_segment_ids) {
        let qi = q.get(&[b, i]);
        if qi == -1.0 || qi != k.get(&[b, j]) {
            return false;
        }
    }
    if let Some(m) = &x.attention_mask {
        if m.get(&[b, h, i, j]) == 0.0 {
            return false;
        }
    }
    true
}

/// `out [B, H, Sq, Dv]` (query's dtype) and `lse [B, H, Sq]` (f32, natural log; −∞ for a
/// row that sees nothing and has no sinks, whose output is 0).
pub fn reference(
    f: &BsFeatures,
    x: &BsInputs,
    scale: f64,
    soft_cap: Option<f64>,
) -> Result<(HostTensor, HostTensor), String> {
    let (q, k, v) = (&x.query, &x.key, &x.value);
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        return Err(format!(
            "query, key and value must be rank 4 (BHSD), got {:?}, {:?}, {:?}",
            q.shape, k.shape, v.shape
        ));
    }
    let (b, h, sq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (kvh, sk) = (k.shape[1], k.shape[2]);
    let dv = v.shape[3];
    if k.shape != [b, kvh, sk, d] || v.shape[..3] != [b, kvh, sk] {
        return Err(format!("key {:?} / value {:?} do not match query {:?}", k.shape, v.shape, q.shape));
    }
    if kvh == 0 || !h.is_multiple_of(kvh) {
        return Err(format!("{h} query heads do not divide into {kvh} KV heads"));
    }
    if f.segment_ids != (x.q_segment_ids.is_some() && x.kv_segment_ids.is_some())
        || f.attention_mask != x.attention_mask.is_some()
        || f.sinks != x.sinks.is_some()
        || f.positions != (x.q_positions.is_some() && x.kv_positions.is_some())
        || f.bias != x.bias.is_some()
        || f.runtime_window != x.window.is_some()
        || f.runtime_chunk != x.chunk.is_some()
    {
        return Err("the inputs do not match the variant's features".into());
    }
    for t in [&x.q_positions, &x.kv_positions].into_iter().flatten() {
        if let Some(p) = t.to_vec().into_iter().find(|p| !(0.0..=super::mask::MAX_SIZE as f64).contains(p)) {
            return Err(format!("a position is {p}: positions are from 0 to 2^30"));
        }
    }
    let group = h / kvh;
    let mut out = HostTensor::zeros(q.dtype, &[b, h, sq, dv]);
    let mut lse = HostTensor::full(DType::F32, &[b, h, sq], f64::NEG_INFINITY);
    for bi in 0..b {
        for hq in 0..h {
            let g = hq / group;
            let sinks: Vec<f64> = match &x.sinks {
                Some(s) => (0..s.shape[1]).map(|t| s.get(&[hq, t])).collect(),
                None => Vec::new(),
            };
            for i in 0..sq {
                let logits: Vec<(usize, f64)> = (0..sk)
                    .filter(|&j| visible(f, x, bi, hq, i, j))
                    .map(|j| {
                        let dot: f64 = (0..d).map(|c| q.get(&[bi, hq, i, c]) * k.get(&[bi, g, j, c])).sum();
                        let s = dot * scale + x.bias.as_ref().map_or(0.0, |t| t.get(&[bi, hq, i, j]));
                        (j, soft_cap.map_or(s, |c| c * (s / c).tanh()))
                    })
                    .collect();
                let m = logits.iter().map(|&(_, s)| s).chain(sinks.iter().copied()).fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let z: f64 = logits.iter().map(|&(_, s)| s).chain(sinks.iter().copied()).map(|s| (s - m).exp()).sum();
                lse.set(&[bi, hq, i], m + z.ln());
                for c in 0..dv {
                    let acc: f64 = logits.iter().map(|&(j, s)| (s - m).exp() * v.get(&[bi, g, j, c])).sum();
                    out.set(&[bi, hq, i, c], acc / z);
                }
            }
        }
    }
    Ok((out, lse))
}

/// The gradients of the backward (`blocksparse_attention_bwd`).
#[derive(Clone, Debug, PartialEq)]
pub struct BsGrads {
    /// `[B, H, Sq, D]`, the query's dtype.
    pub dq: HostTensor,
    /// `[B, KVH, Sk, D]`: summed over each KV head's group of query heads.
    pub dk: HostTensor,
    /// `[B, KVH, Sk, Dv]`.
    pub dv: HostTensor,
    /// `[H, n]` f32, for sinks variants.
    pub dsinks: Option<HostTensor>,
    /// `[B, H, Sq, Sk]` (the query's dtype), for `bias_grad` variants: `dU`, the gradient
    /// of each logit before the soft cap (0 where the key is hidden).
    pub dbias: Option<HostTensor>,
}

/// The gradients of `L = Σ dout ∘ out` (docs/semantics.md, "Block-sparse attention",
/// its backward) with respect to the query, key, value (and sinks), in f64 from the
/// inputs alone: `P` and `delta = Σ_j P dP` are recomputed exactly (a kernel reads the
/// forward's rounded `lse` and `out` instead). A row that sees nothing contributes 0.
pub fn reference_bwd(
    f: &BsFeatures,
    x: &BsInputs,
    scale: f64,
    soft_cap: Option<f64>,
    dout: &HostTensor,
) -> Result<BsGrads, String> {
    let (q, k, v) = (&x.query, &x.key, &x.value);
    let (out, _) = reference(f, x, scale, soft_cap)?;
    if dout.shape != out.shape {
        return Err(format!("dout has shape {:?}, the output {:?}", dout.shape, out.shape));
    }
    let (b, h, sq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (kvh, sk, dv) = (k.shape[1], k.shape[2], v.shape[3]);
    let group = h / kvh;
    let n_sinks = x.sinks.as_ref().map_or(0, |s| s.shape[1]);
    let mut dq = vec![0.0; b * h * sq * d];
    let mut dk = vec![0.0; b * kvh * sk * d];
    let mut dvv = vec![0.0; b * kvh * sk * dv];
    let mut ds_sinks = vec![0.0; h * n_sinks];
    let mut dbias = vec![0.0; if f.bias_grad { b * h * sq * sk } else { 0 }];
    for bi in 0..b {
        for hq in 0..h {
            let g = hq / group;
            let sinks: Vec<f64> = (0..n_sinks).map(|t| x.sinks.as_ref().unwrap().get(&[hq, t])).collect();
            for i in 0..sq {
                // (key, capped logit, d capped / d scaled logit)
                let logits: Vec<(usize, f64, f64)> = (0..sk)
                    .filter(|&j| visible(f, x, bi, hq, i, j))
                    .map(|j| {
                        let dot: f64 = (0..d).map(|c| q.get(&[bi, hq, i, c]) * k.get(&[bi, g, j, c])).sum();
                        let s = dot * scale + x.bias.as_ref().map_or(0.0, |t| t.get(&[bi, hq, i, j]));
                        match soft_cap {
                            Some(cap) => {
                                let t = (s / cap).tanh();
                                (j, cap * t, 1.0 - t * t)
                            }
                            None => (j, s, 1.0),
                        }
                    })
                    .collect();
                let m = logits.iter().map(|l| l.1).chain(sinks.iter().copied()).fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let z: f64 = logits.iter().map(|l| l.1).chain(sinks.iter().copied()).map(|s| (s - m).exp()).sum();
                let go: Vec<f64> = (0..dv).map(|c| dout.get(&[bi, hq, i, c])).collect();
                // P, dP = dout · v_j, and delta = Σ_j P dP.
                let pd: Vec<(f64, f64)> = logits
                    .iter()
                    .map(|&(j, s, _)| {
                        let p = (s - m).exp() / z;
                        let dp: f64 = (0..dv).map(|c| go[c] * v.get(&[bi, g, j, c])).sum();
                        (p, dp)
                    })
                    .collect();
                let delta: f64 = pd.iter().map(|(p, dp)| p * dp).sum();
                for (t, s) in sinks.iter().enumerate() {
                    ds_sinks[hq * n_sinks + t] -= (s - m).exp() / z * delta;
                }
                for (&(j, _, cap_grad), &(p, dp)) in logits.iter().zip(&pd) {
                    let du = p * (dp - delta) * cap_grad;
                    if f.bias_grad {
                        dbias[((bi * h + hq) * sq + i) * sk + j] = du;
                    }
                    let ds = du * scale;
                    for c in 0..d {
                        dq[((bi * h + hq) * sq + i) * d + c] += ds * k.get(&[bi, g, j, c]);
                        dk[((bi * kvh + g) * sk + j) * d + c] += ds * q.get(&[bi, hq, i, c]);
                    }
                    for (c, gc) in go.iter().enumerate() {
                        dvv[((bi * kvh + g) * sk + j) * dv + c] += p * gc;
                    }
                }
            }
        }
    }
    Ok(BsGrads {
        dq: HostTensor::from_vec(q.dtype, &[b, h, sq, d], dq),
        dk: HostTensor::from_vec(k.dtype, &[b, kvh, sk, d], dk),
        dv: HostTensor::from_vec(v.dtype, &[b, kvh, sk, dv], dvv),
        dsinks: x.sinks.as_ref().map(|_| HostTensor::from_vec(DType::F32, &[h, n_sinks], ds_sinks)),
        dbias: f.bias_grad.then(|| HostTensor::from_vec(q.dtype, &[b, h, sq, sk], dbias)),
    })
}
