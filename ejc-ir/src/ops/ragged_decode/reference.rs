//! The f64 reference of ragged decode attention, and random calls.
//!
//! ```
//! use ejc_ir::ops::ragged_decode::reference::{random_inputs, reference, RaggedShape};
//! use ejc_ir::types::DType;
//!
//! let shape = RaggedShape { batch: 4, seq: 37, heads_q: 8, heads_kv: 2, head_dim: 16, min_len: 0 };
//! let x = random_inputs(DType::F32, &shape, 2, 3);
//! let (start, end) = (x.sequence_start.to_vec(), x.sequence_end.to_vec());
//! assert_eq!((start[0], end[0]), (0.0, 37.0)); // row 0 sees the whole buffer
//! assert_eq!(end[2] - start[2], 1.0); // row 2 one key, row 3 none
//! assert_eq!(end[3], start[3]);
//! let out = reference(&x, 0.25, None, None, false).unwrap();
//! assert!(out.to_vec()[3 * 8 * 16..].iter().all(|v| *v == 0.0)); // no key: 0
//! ```
//!
//! The semantics are stated in docs/semantics.md ("Ragged decode attention"); this is
//! their definition, written for clarity (loops over rows, heads and keys, f64 sums),
//! sharing no code with the kernels. It returns `Err` — never panics — for tensors of
//! the wrong rank or shape and for a range outside the buffer.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use crate::tensor::HostTensor;
use crate::types::DType;

/// The size of a test call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RaggedShape {
    pub batch: usize,
    /// T, the key buffer's length; row 0's range is all of it.
    pub seq: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// The other rows' ranges hold `[min_len, seq]` keys at a random start; with
    /// `min_len = 0` and at least four rows, row 2 has one key and row 3 none.
    pub min_len: usize,
}

/// The inputs of one call.
#[derive(Clone, Debug, PartialEq)]
pub struct RaggedInputs {
    /// `[B, H, D]`, a view with a padded head axis (not contiguous).
    pub query: HostTensor,
    /// `[B, T, KVH, D]`.
    pub key: HostTensor,
    pub value: HostTensor,
    /// i32 `[B]`.
    pub sequence_start: HostTensor,
    pub sequence_end: HostTensor,
    /// f32 `[H, num_sinks]` (N(0, 1) logits), when asked for.
    pub sinks: Option<HostTensor>,
}

fn randn(dtype: DType, shape: &[usize], rng: &mut StdRng) -> HostTensor {
    let n: usize = shape.iter().product();
    HostTensor::from_vec(dtype, shape, (0..n).map(|_| rng.sample::<f64, _>(StandardNormal)).collect())
}

/// Fresh random inputs (N(0, 1) values; never zeros); `num_sinks` sink logits per
/// query head (0: none).
pub fn random_inputs(dtype: DType, s: &RaggedShape, num_sinks: usize, seed: u64) -> RaggedInputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let (b, t, h, d) = (s.batch, s.seq, s.heads_q, s.head_dim);
    let base = randn(dtype, &[b, h + 1, d], &mut rng);
    let query = base.into_view(&[b, h, d], &[((h + 1) * d) as isize, d as isize, 1], 0);
    let kv = [b, t, s.heads_kv, d];
    let key = randn(dtype, &kv, &mut rng);
    let value = randn(dtype, &kv, &mut rng);
    let (mut start, mut end) = (Vec::with_capacity(b), Vec::with_capacity(b));
    for i in 0..b {
        let len = match i {
            0 => t,
            2 if s.min_len == 0 && b >= 4 => 1.min(t),
            3 if s.min_len == 0 && b >= 4 => 0,
            _ => rng.random_range(s.min_len.min(t)..=t),
        };
        let lo = rng.random_range(0..=t - len);
        start.push(lo as f64);
        end.push((lo + len) as f64);
    }
    RaggedInputs {
        query,
        key,
        value,
        sequence_start: HostTensor::from_vec(DType::I32, &[b], start),
        sequence_end: HostTensor::from_vec(DType::I32, &[b], end),
        sinks: (num_sinks > 0).then(|| randn(DType::F32, &[h, num_sinks], &mut rng)),
    }
}

/// The attention output `[B, H, D]` (in query's dtype): `window_left` keeps keys
/// `j >= end - 1 - window_left`; `sinks_on` adds `x.sinks` to every row's denominator.
pub fn reference(
    x: &RaggedInputs,
    scale: f64,
    soft_cap: Option<f64>,
    window_left: Option<i64>,
    sinks_on: bool,
) -> Result<HostTensor, String> {
    let q = &x.query;
    if q.rank() != 3 {
        return Err(format!("query must be [B, H, D], got shape {:?}", q.shape));
    }
    let (b, h, d) = (q.shape[0], q.shape[1], q.shape[2]);
    if x.key.rank() != 4 || x.value.shape != x.key.shape || x.key.shape[0] != b || x.key.shape[3] != d {
        return Err(format!(
            "key and value must both be [{b}, T, KVH, {d}], got {:?} and {:?}",
            x.key.shape, x.value.shape
        ));
    }
    let (t, kvh) = (x.key.shape[1], x.key.shape[2]);
    if kvh == 0 || !h.is_multiple_of(kvh) {
        return Err(format!("{h} query heads do not divide into {kvh} KV heads"));
    }
    if x.sequence_start.shape != [b] || x.sequence_end.shape != [b] {
        return Err(format!("sequence_start and sequence_end must be [{b}]"));
    }
    let sinks = match (sinks_on, &x.sinks) {
        (false, _) => None,
        (true, Some(s)) if s.rank() == 2 && s.shape[0] == h => Some(s),
        (true, _) => return Err(format!("sinks must be [{h}, num_sinks]")),
    };
    let group = h / kvh;
    let mut out = HostTensor::zeros(q.dtype, &[b, h, d]);
    for r in 0..b {
        let (start, end) = (x.sequence_start.get(&[r]), x.sequence_end.get(&[r]));
        if start < 0.0 || end > t as f64 || start > end {
            return Err(format!("row {r}: range [{start}, {end}) is not inside [0, {t}]"));
        }
        let mut lo = start as i64;
        if let Some(left) = window_left {
            lo = lo.max(end as i64 - 1 - left);
        }
        let keys: Vec<usize> = (lo.max(0) as usize..end as usize).collect();
        for hq in 0..h {
            let g = hq / group;
            let scores: Vec<f64> = keys
                .iter()
                .map(|&j| {
                    let dot: f64 = (0..d).map(|c| q.get(&[r, hq, c]) * x.key.get(&[r, j, g, c])).sum();
                    let s = dot * scale;
                    match soft_cap {
                        Some(cap) => cap * (s / cap).tanh(),
                        None => s,
                    }
                })
                .collect();
            if scores.is_empty() {
                continue; // no key: 0, with or without sinks
            }
            let sink_logits: Vec<f64> =
                sinks.map(|s| (0..s.shape[1]).map(|i| s.get(&[hq, i])).collect()).unwrap_or_default();
            let m = scores.iter().chain(&sink_logits).cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let total: f64 = w.iter().sum::<f64>() + sink_logits.iter().map(|s| (s - m).exp()).sum::<f64>();
            for c in 0..d {
                let v: f64 = keys.iter().zip(&w).map(|(&j, w)| w * x.value.get(&[r, j, g, c])).sum();
                out.set(&[r, hq, c], v / total);
            }
        }
    }
    Ok(out)
}
