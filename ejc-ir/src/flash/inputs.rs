//! Fresh random inputs and run-time scalars for one flash-attention call.
//!
//! ```
//! use ejc_ir::flash::{inputs, FlashShape};
//! use ejc_ir::flash::Features;
//! use ejc_ir::types::DType;
//!
//! let features = Features { bias: true, mask: true, ..Features::default() };
//! let shape = FlashShape::new(2, 16, 24, 4, 2, 32);
//! let x = inputs::random_inputs(&features, DType::F16, &shape, 7);
//! assert_eq!(x.k.shape, vec![2, 24, 2, 32]); // BSHD logically...
//! assert_eq!(x.k.strides, vec![2 * 24 * 32, 32, 24 * 32, 1]); // ...stored head-major
//! assert_eq!(x.bias.unwrap().strides[0], 0); // bias broadcast over the batch
//! let rt = inputs::default_runtime(&features, &shape, 7);
//! assert_eq!(rt.softmax_scale, 1.0 / 32f64.sqrt());
//! ```
//!
//! The data is meant to catch kernel bugs, not to look like a model's activations:
//! values are never zero (an all-zero input hides wrong indexing), k and v are not
//! contiguous (a kernel that assumes BSHD-contiguous strides reads the wrong
//! elements), bias and mask are broadcast with stride 0, the mask always has a fully
//! masked row, segment ids end in padding, and varlen batches have uneven lengths.
//! Everything is a pure function of the seed.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use super::features::{Features, SoftCap, Window};
use crate::flash::problem::{FlashInputs, FlashRuntime, FlashShape};
use crate::tensor::HostTensor;
use crate::types::DType;

/// Random inputs for `features` at `shape`, q/k/v/bias in `dtype`.
///
/// Dense: q `[B, Sq, Hq, D]` (contiguous), k `[B, Sk, Hkv, D]` and v `[B, Sk, Hkv, Dv]`
/// stored as `[B, Hkv, Sk, D]`. Varlen: the same with batch 1 and the packed totals, sequence
/// lengths uniform in `[1, seq_q]` / `[1, seq_k]` except sequence 0, which gets exactly
/// `seq_q` / `seq_k` so the maximum lengths are exercised. Tensors for features the
/// variant lacks are `None`; the others are generated from the shape even where the
/// reference rejects the combination (varlen with bias, mask or segment ids).
pub fn random_inputs(features: &Features, dtype: DType, shape: &FlashShape, seed: u64) -> FlashInputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let FlashShape { batch, seq_q, seq_k, heads_q, heads_kv, head_dim, head_dim_v } = *shape;

    let (cu_seqlens_q, cu_seqlens_k) = if features.varlen {
        let (cu_q, cu_k) = varlen_offsets(&mut rng, batch, seq_q, seq_k);
        (Some(cu_q), Some(cu_k))
    } else {
        (None, None)
    };
    // The q/k/v batch and sequence axes: packed totals for varlen.
    let total = |cu: &Option<HostTensor>| cu.as_ref().map(|t| t.get(&[batch]) as usize);
    let (qkv_batch, rows_q, rows_k) = match (total(&cu_seqlens_q), total(&cu_seqlens_k)) {
        (Some(tq), Some(tk)) => (1, tq, tk),
        _ => (batch, seq_q, seq_k),
    };

    let q = HostTensor::from_vec(
        dtype,
        &[qkv_batch, rows_q, heads_q, head_dim],
        normals(&mut rng, dtype, qkv_batch * rows_q * heads_q * head_dim, 1.0),
    );
    let k = head_major(&mut rng, dtype, [qkv_batch, rows_k, heads_kv, head_dim]);
    let v = head_major(&mut rng, dtype, [qkv_batch, rows_k, heads_kv, head_dim_v]);

    let bias = features.bias.then(|| {
        // One [Hq, Sq, Sk] plane shared by every batch entry: stride 0 on the batch axis.
        let plane = HostTensor::from_vec(
            dtype,
            &[1, heads_q, seq_q, seq_k],
            normals(&mut rng, dtype, heads_q * seq_q * seq_k, 0.5),
        );
        let s = plane.strides.clone();
        plane.into_view(&[batch, heads_q, seq_q, seq_k], &[0, s[1], s[2], s[3]], 0)
    });
    let mask = features.mask.then(|| random_mask(&mut rng, batch, heads_q, seq_q, seq_k));
    let (q_segment_ids, kv_segment_ids) = if features.segment_ids {
        let (q_ids, kv_ids) = segment_ids(&mut rng, batch, seq_q, seq_k);
        (Some(q_ids), Some(kv_ids))
    } else {
        (None, None)
    };
    let sinks = features.sinks.then(|| {
        let values = (0..heads_q * SINKS_PER_HEAD).map(|_| rng.sample::<f64, _>(StandardNormal)).collect();
        HostTensor::from_vec(DType::F32, &[heads_q, SINKS_PER_HEAD], values)
    });

    FlashInputs { q, k, v, bias, mask, q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, sinks }
}

/// Run-time scalars for a test call: scale `1/sqrt(D)`, window
/// `(max(1, Sk/3), max(1, Sk/5))`, soft cap 5, dropout p 0.2 and a dropout seed mixed
/// from `seed` (so it differs from the data seed).
///
/// None of these is a no-op value, so a kernel that applies a feature the variant lacks
/// still disagrees with the reference. A variant's fixed window or soft cap is copied
/// in, so the runtime shows the values the call really uses.
pub fn default_runtime(features: &Features, shape: &FlashShape, seed: u64) -> FlashRuntime {
    let sk = shape.seq_k as i64;
    let mut rt = FlashRuntime {
        softmax_scale: 1.0 / (shape.head_dim as f64).sqrt(),
        window: ((sk / 3).max(1), (sk / 5).max(1)),
        softcap: 5.0,
        dropout_p: 0.2,
        seed: splitmix64(seed),
    };
    if let Some(Window::Fixed { left, right }) = features.sliding_window {
        rt.window = (i64::from(left), i64::from(right));
    }
    if let Some(SoftCap::Fixed(c)) = features.logits_soft_cap {
        rt.softcap = c;
    }
    rt
}

/// Sinks per head in generated inputs (more than one, so the sum over sinks matters).
const SINKS_PER_HEAD: usize = 3;

/// Share of each sequence given to trailing segment-id padding (-1).
const SEGMENT_PADDING: f64 = 0.1;

/// Probability that a mask element is true (attend).
const MASK_DENSITY: f64 = 0.75;

/// `n` samples of N(0, std²) rounded to `dtype`, redrawn if they round to zero.
fn normals(rng: &mut StdRng, dtype: DType, n: usize, std: f64) -> Vec<f64> {
    (0..n)
        .map(|_| loop {
            let x = dtype.round(std * rng.sample::<f64, _>(StandardNormal));
            if x != 0.0 {
                break x;
            }
        })
        .collect()
}

/// A BSHD tensor stored as `[B, H, S, D]`: the head and sequence axes swap places in
/// memory, so the sequence stride is `D` and the head stride `S * D`.
fn head_major(rng: &mut StdRng, dtype: DType, [b, s, h, d]: [usize; 4]) -> HostTensor {
    let storage = HostTensor::from_vec(dtype, &[b, h, s, d], normals(rng, dtype, b * h * s * d, 1.0));
    let st = storage.strides.clone();
    storage.into_view(&[b, s, h, d], &[st[0], st[2], st[1], st[3]], 0)
}

/// i1 `[B, Hq, Sq, Sk]` broadcast over heads (stored `[B, 1, Sq, Sk]`), true with
/// probability 0.75, with one random query row of batch 0 entirely false (when
/// `Sq > 1`) so the fully-masked-row path is always exercised.
fn random_mask(rng: &mut StdRng, batch: usize, heads_q: usize, seq_q: usize, seq_k: usize) -> HostTensor {
    let mut values: Vec<f64> =
        (0..batch * seq_q * seq_k).map(|_| f64::from(u8::from(rng.random_bool(MASK_DENSITY)))).collect();
    if seq_q > 1 && seq_k > 0 {
        let row = rng.random_range(0..seq_q);
        values[row * seq_k..(row + 1) * seq_k].fill(0.0);
    }
    let storage = HostTensor::from_vec(DType::I1, &[batch, 1, seq_q, seq_k], values);
    let st = storage.strides.clone();
    HostTensor::view(&storage, &[batch, heads_q, seq_q, seq_k], &[st[0], 0, st[2], st[3]], 0)
}

/// i32 q `[B, Sq]` and kv `[B, Sk]` segment ids: per batch entry 2 or 3 contiguous
/// segments (ids 0, 1, 2) followed by a -1 padding run. q and kv share the segments'
/// proportions, so with `Sq != Sk` the boundaries fall at different positions.
fn segment_ids(rng: &mut StdRng, batch: usize, seq_q: usize, seq_k: usize) -> (HostTensor, HostTensor) {
    let mut q_ids = Vec::with_capacity(batch * seq_q);
    let mut kv_ids = Vec::with_capacity(batch * seq_k);
    for _ in 0..batch {
        let n_segments = rng.random_range(2..=3);
        let weights: Vec<f64> = (0..n_segments).map(|_| rng.random_range(0.5..1.5)).collect();
        q_ids.extend(segments_of(seq_q, &weights));
        kv_ids.extend(segments_of(seq_k, &weights));
    }
    (
        HostTensor::from_vec(DType::I32, &[batch, seq_q], q_ids),
        HostTensor::from_vec(DType::I32, &[batch, seq_k], kv_ids),
    )
}

/// Ids for one sequence of `len` positions: segments sized in proportion to `weights`,
/// then ~10% padding (at least one position once `len >= 4`).
fn segments_of(len: usize, weights: &[f64]) -> Vec<f64> {
    let padding = if len >= 4 { ((len as f64 * SEGMENT_PADDING).round() as usize).max(1) } else { 0 };
    let valid = len - padding;
    let total: f64 = weights.iter().sum();
    let mut ids = vec![-1.0; len];
    let (mut start, mut acc) = (0, 0.0);
    for (id, w) in weights.iter().enumerate() {
        acc += w;
        let end =
            if id + 1 == weights.len() { valid } else { ((acc / total * valid as f64).round() as usize).min(valid) };
        ids[start..end.max(start)].fill(id as f64);
        start = end.max(start);
    }
    ids
}

/// i32 `cu_seqlens_q/k` `[B + 1]`: sequence 0 has the maximum lengths, the others are
/// uniform in `[1, max]`.
fn varlen_offsets(rng: &mut StdRng, batch: usize, seq_q: usize, seq_k: usize) -> (HostTensor, HostTensor) {
    let mut length = |b: usize, max: usize| {
        if b == 0 || max == 0 {
            max
        } else {
            rng.random_range(1..=max)
        }
    };
    let (mut cu_q, mut cu_k) = (vec![0.0], vec![0.0]);
    for b in 0..batch {
        let (lq, lk) = (length(b, seq_q), length(b, seq_k));
        cu_q.push(cu_q[b] + lq as f64);
        cu_k.push(cu_k[b] + lk as f64);
    }
    (HostTensor::from_vec(DType::I32, &[batch + 1], cu_q), HostTensor::from_vec(DType::I32, &[batch + 1], cu_k))
}

/// SplitMix64's finaliser: derives the dropout seed from the data seed, so the two
/// streams are unrelated even though one number names the test case.
fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
