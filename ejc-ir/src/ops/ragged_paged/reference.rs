//! The f64 reference of ragged paged attention (mixed prefill and decode over a paged
//! KV cache), and random calls.
//!
//! ```
//! use ejc_ir::ops::ragged_paged::reference::{random_inputs, reference, RpaShape};
//! use ejc_ir::types::DType;
//!
//! let shape = RpaShape { num_seqs: 5, heads_q: 8, heads_kv: 2, head_dim: 16, page_size: 5,
//!                        max_context: 23, max_q_len: 9, num_pages: None,
//!                        min_context: 0, prefill_seqs: 0 };
//! let x = random_inputs(DType::F32, &shape, 2, 3);
//! let (ctx, qsl) = (x.context_lens.to_vec(), x.query_start_loc.to_vec());
//! assert_eq!((ctx[0], qsl[1] - qsl[0]), (23.0, 9.0)); // sequence 0: a prefill chunk
//! assert_eq!(qsl[2] - qsl[1], 1.0); // sequence 1: a decode token
//! assert_eq!((ctx[2], qsl[3] - qsl[2]), (1.0, 1.0)); // sequence 2: one token, one key
//! assert_eq!((ctx[3], qsl[4] - qsl[3]), (0.0, 0.0)); // sequence 3: empty
//! assert_eq!(x.total_tokens, qsl[5] as usize + 2); // two padding tokens
//! let out = reference(&x, 0.25, Some(30.0), Some(7)).unwrap();
//! assert_eq!(out.shape, vec![x.total_tokens, 8, 16]);
//! assert!(out.to_vec()[qsl[5] as usize * 8 * 16..].iter().all(|v| *v == 0.0)); // padding: 0
//! ```
//!
//! # Semantics
//!
//! `queries [T, QH, D]`; `kv_pages [P, page_size, 2 · KVH, D]` with keys and values
//! interleaved on the head axis (KV head `h`'s key is head `2h`, its value `2h + 1`);
//! i32 `context_lens [S]`, `block_tables [S, pages_per_seq]` and `query_start_loc [S + 1]`
//! (non-decreasing, from 0, ending at most at `T`); optional f32 `sinks [QH, num_sinks]`.
//!
//! Sequence `s` owns query rows `qsl[s] .. qsl[s + 1]` (`q_len` of them, at most its
//! `ctx = context_lens[s]`) and keys `0 .. ctx`, key `j` being row `j % page_size` of
//! page `block_tables[s, j / page_size]`. Its token `i` sits at position
//! `p = ctx − q_len + i` (queries aligned to the end of the context) and sees key `j`
//! iff `j ≤ p`, and with a sliding window `w ≥ 1` also `j > p − w` (the `w` most recent
//! positions, its own included). Query head `hq` reads KV head `hq / (QH / KVH)`; the
//! logit is `x_j = scale · q·k_j`, soft-capped to `c · tanh(x_j / c)`; each sink logit
//! joins the softmax's denominator only. Rows past `qsl[S]` (padding) are 0, as is a row
//! that sees no key.
//!
//! This is their definition, written for clarity (loops over sequences, tokens, heads
//! and keys, f64 sums), sharing no code with the kernels. It returns `Err` — never
//! panics — for tensors of the wrong rank or shape, ill-formed `query_start_loc`, a
//! sequence with more queries than keys, a context longer than its block-table row
//! holds, a page index outside the cache, a soft cap that is not positive, or a window
//! below 1.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use crate::tensor::HostTensor;
use crate::types::DType;

/// The size of a test call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RpaShape {
    pub num_seqs: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub page_size: usize,
    /// sequence 0's context; tables are ceil(max_context / page_size) wide (at least 1)
    pub max_context: usize,
    /// sequence 0's query length (a prefill chunk); must be <= max_context
    pub max_q_len: usize,
    /// pages in the cache; None: one more than needed, each used once (a shuffled permutation); fewer shares pages between sequences (drawn with replacement)
    pub num_pages: Option<usize>,
    /// 0: the awkward batch of [`random_inputs`]; above 0, a serving batch: every context
    /// is drawn from `[min_context, max_context]` and the first `prefill_seqs` sequences
    /// (at least one) are chunks of `max_q_len` new tokens, the others decode one token
    pub min_context: usize,
    /// the serving batch's prefill chunks (read only when `min_context > 0`)
    pub prefill_seqs: usize,
}

impl RpaShape {
    /// The block tables' width.
    pub fn max_pages(&self) -> usize {
        self.max_context.div_ceil(self.page_size.max(1)).max(1)
    }

    /// The pages in the cache.
    pub fn pages(&self) -> usize {
        self.num_pages.unwrap_or(self.num_seqs * self.max_pages() + 1).max(1)
    }
}

/// The inputs of one call.
#[derive(Clone, Debug, PartialEq)]
pub struct RpaInputs {
    /// `[T, QH, D]`, a view with a padded head axis (not contiguous).
    pub queries: HostTensor,
    /// `[P, page_size, 2 · KVH, D]`, keys at even heads, values at odd ones.
    pub kv_pages: HostTensor,
    /// i32 `[S]`.
    pub context_lens: HostTensor,
    /// i32 `[S, max_pages]`; entries past a sequence's pages are −1 (never read).
    pub block_tables: HostTensor,
    /// i32 `[S + 1]`.
    pub query_start_loc: HostTensor,
    /// f32 `[QH, num_sinks]` (N(0, 1) logits), when asked for.
    pub sinks: Option<HostTensor>,
    /// T, `queries`' rows: `query_start_loc[S]` plus two padding tokens.
    pub total_tokens: usize,
}

fn randn(dtype: DType, shape: &[usize], rng: &mut StdRng) -> HostTensor {
    let n: usize = shape.iter().product();
    HostTensor::from_vec(dtype, shape, (0..n).map(|_| rng.sample::<f64, _>(StandardNormal)).collect())
}

/// Fresh N(0,1) inputs (never zeros). n_sinks = 0: no sinks.
///
/// The batch is awkward on purpose: sequence 0 is a prefill chunk (`max_q_len` queries
/// over `max_context` keys); with at least four sequences, sequence 1 is a decode token
/// over a random context, sequence 2 one token over one key and sequence 3 empty;
/// sequence 4 is a second chunk (`max_q_len` queries over at least half of
/// `max_context` keys: a large sequence after small ones); the
/// others draw a context in `[0, max_context]` and a query length in
/// `[0, min(ctx, max_q_len)]`. With `min_context > 0` it is a serving batch instead (see
/// [`RpaShape::min_context`]). Two padding tokens follow the last sequence's. Cache
/// slots outside every context are NaN.
pub fn random_inputs(dtype: DType, s: &RpaShape, n_sinks: usize, seed: u64) -> RpaInputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let (n, h, d, mc) = (s.num_seqs, s.heads_q, s.head_dim, s.max_context);
    let four = n >= 4;
    let mut lens = Vec::with_capacity(n);
    let mut q_lens = Vec::with_capacity(n);
    for i in 0..n {
        let serving = s.min_context > 0;
        let (ctx, q) = match i {
            _ if serving => {
                let ctx = rng.random_range(s.min_context.min(mc)..=mc);
                (ctx, if i < s.prefill_seqs.max(1) { s.max_q_len.min(ctx) } else { 1.min(ctx) })
            }
            0 => (mc, s.max_q_len.min(mc)),
            1 if four => {
                let ctx = rng.random_range(1.min(mc)..=mc);
                (ctx, 1.min(ctx))
            }
            2 if four => (1.min(mc), 1.min(mc)),
            3 if four => (0, 0),
            // A second chunk after the small ones: a large sequence that is not the
            // first (the classed plans' `classify` must list it after counting them).
            4 => {
                let ctx = rng.random_range(mc.div_ceil(2)..=mc);
                (ctx, s.max_q_len.min(ctx))
            }
            _ => {
                let ctx = rng.random_range(0..=mc);
                (ctx, rng.random_range(0..=ctx.min(s.max_q_len)))
            }
        };
        lens.push(ctx);
        q_lens.push(q);
    }
    let mut qsl = vec![0usize];
    for q in &q_lens {
        qsl.push(qsl.last().unwrap() + q);
    }
    let t = qsl[n] + 2;
    // The queries as a view of [T, QH + 1, D]: a token's heads are not contiguous with
    // the next token's.
    let base = randn(dtype, &[t, h + 1, d], &mut rng);
    let queries = base.into_view(&[t, h, d], &[((h + 1) * d) as isize, d as isize, 1], 0);
    let pages = s.pages();
    let mut kv_pages = randn(dtype, &[pages, s.page_size, 2 * s.heads_kv, d], &mut rng);
    let width = s.max_pages();
    let needed = n * width;
    let mut ids: Vec<usize> = (0..pages).collect();
    ids.shuffle(&mut rng);
    let mut table = vec![-1.0; needed];
    // The cache slots some sequence's context holds; every other slot is NaN, as a cache
    // fresh from `torch.empty` may be: a kernel must never let one reach its output
    // (`0 · NaN` in the value product is NaN).
    let mut held = vec![false; pages * s.page_size];
    for (i, len) in lens.iter().enumerate() {
        for p in 0..len.div_ceil(s.page_size.max(1)) {
            let k = i * width + p;
            let page = if pages > needed { ids[k] } else { rng.random_range(0..pages) };
            table[k] = page as f64;
            for r in 0..s.page_size.min(len - p * s.page_size) {
                held[page * s.page_size + r] = true;
            }
        }
    }
    let slot = 2 * s.heads_kv * d;
    for (i, x) in kv_pages.data.iter_mut().enumerate() {
        if !held[i / slot.max(1)] {
            *x = f64::NAN;
        }
    }
    RpaInputs {
        queries,
        kv_pages,
        context_lens: HostTensor::from_vec(DType::I32, &[n], lens.iter().map(|l| *l as f64).collect()),
        block_tables: HostTensor::from_vec(DType::I32, &[n, width], table),
        query_start_loc: HostTensor::from_vec(DType::I32, &[n + 1], qsl.iter().map(|l| *l as f64).collect()),
        sinks: (n_sinks > 0).then(|| randn(DType::F32, &[h, n_sinks], &mut rng)),
        total_tokens: t,
    }
}

/// The attention output `[T, QH, D]` (in queries' dtype) of one call: `soft_cap` `c`
/// maps each logit to `c · tanh(x / c)`; `window` `w` keeps keys `j > p − w`; `x.sinks`,
/// when present, join every row's denominator.
pub fn reference(x: &RpaInputs, scale: f64, soft_cap: Option<f64>, window: Option<i64>) -> Result<HostTensor, String> {
    let q = &x.queries;
    if q.rank() != 3 {
        return Err(format!("queries must be [T, QH, D], got shape {:?}", q.shape));
    }
    let (t, h, d) = (q.shape[0], q.shape[1], q.shape[2]);
    let kv = &x.kv_pages;
    if kv.rank() != 4 || kv.shape[3] != d {
        return Err(format!("kv_pages must be [num_pages, page_size, 2 * KVH, {d}], got shape {:?}", kv.shape));
    }
    let (pages, page, heads2) = (kv.shape[0], kv.shape[1], kv.shape[2]);
    if heads2 == 0 || !heads2.is_multiple_of(2) {
        return Err(format!("kv_pages' head axis must be even and non-empty (2 * KVH), got {heads2}"));
    }
    let kvh = heads2 / 2;
    if !h.is_multiple_of(kvh) {
        return Err(format!("{h} query heads do not divide into {kvh} KV heads"));
    }
    if page == 0 {
        return Err("kv_pages' page size is 0".to_string());
    }
    let qsl = &x.query_start_loc;
    if qsl.rank() != 1 || qsl.shape[0] == 0 {
        return Err(format!("query_start_loc must be [S + 1], got shape {:?}", qsl.shape));
    }
    let n = qsl.shape[0] - 1;
    if x.context_lens.shape != [n] || x.block_tables.rank() != 2 || x.block_tables.shape[0] != n {
        return Err(format!(
            "context_lens must be [{n}] and block_tables [{n}, pages_per_seq] (S from query_start_loc), got {:?} and {:?}",
            x.context_lens.shape, x.block_tables.shape
        ));
    }
    let width = x.block_tables.shape[1];
    let sinks = match &x.sinks {
        None => None,
        Some(s) if s.rank() == 2 && s.shape[0] == h => Some(s),
        Some(s) => return Err(format!("sinks must be [{h}, num_sinks], got shape {:?}", s.shape)),
    };
    if let Some(c) = soft_cap {
        if c.is_nan() || c <= 0.0 {
            return Err(format!("the soft cap must be positive, got {c}"));
        }
    }
    if let Some(w) = window {
        if w < 1 {
            return Err(format!("the sliding window must be at least 1, got {w}"));
        }
    }
    let starts: Vec<f64> = (0..=n).map(|i| qsl.get(&[i])).collect();
    if starts[0] != 0.0 {
        return Err(format!("query_start_loc[0] must be 0, got {}", starts[0]));
    }
    if let Some(i) = (0..n).find(|&i| starts[i + 1] < starts[i]) {
        return Err(format!("query_start_loc must be non-decreasing, got {} then {} at {i}", starts[i], starts[i + 1]));
    }
    if starts[n] > t as f64 {
        return Err(format!("query_start_loc[{n}] = {} runs past the {t} query tokens", starts[n]));
    }
    let group = h / kvh;
    let mut out = HostTensor::zeros(q.dtype, &[t, h, d]);
    for s in 0..n {
        let (first, q_len) = (starts[s] as usize, (starts[s + 1] - starts[s]) as usize);
        let ctx = x.context_lens.get(&[s]);
        if ctx < 0.0 || ctx > (width * page) as f64 {
            return Err(format!(
                "context_lens[{s}] = {ctx} is outside [0, {}] (pages_per_seq x page size)",
                width * page
            ));
        }
        let ctx = ctx as usize;
        if q_len > ctx {
            return Err(format!("sequence {s} has {q_len} query tokens but only {ctx} keys"));
        }
        let mut rows = Vec::with_capacity(ctx);
        for j in 0..ctx {
            let p = x.block_tables.get(&[s, j / page]);
            if p < 0.0 || p >= pages as f64 {
                return Err(format!("block_tables[{s}, {}] = {p} is not a page of the cache (0..{pages})", j / page));
            }
            rows.push((p as usize, j % page));
        }
        for i in 0..q_len {
            let token = first + i;
            let pos = (ctx - q_len + i) as i64;
            let lo = match window {
                Some(w) => (pos - w + 1).max(0),
                None => 0,
            } as usize;
            let keys = &rows[lo..=pos as usize];
            for hq in 0..h {
                let g = hq / group;
                // Rows by their first element and the head axis' stride (same sums, in order).
                let (qs, ks) = (q.strides[2], kv.strides[3]);
                let q0 = q.position(&[token, hq, 0]) as isize;
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&(p, r)| {
                        let k0 = kv.position(&[p, r, 2 * g, 0]) as isize;
                        let dot: f64 = (0..d as isize)
                            .map(|c| q.data[(q0 + c * qs) as usize] * kv.data[(k0 + c * ks) as usize])
                            .sum();
                        let v = dot * scale;
                        match soft_cap {
                            Some(cap) => cap * (v / cap).tanh(),
                            None => v,
                        }
                    })
                    .collect();
                if scores.is_empty() {
                    continue; // no key: 0, with or without sinks
                }
                let sink_logits: Vec<f64> =
                    sinks.map(|s| (0..s.shape[1]).map(|k| s.get(&[hq, k])).collect()).unwrap_or_default();
                let m = scores.iter().chain(&sink_logits).cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|v| (v - m).exp()).collect();
                let total: f64 = w.iter().sum::<f64>() + sink_logits.iter().map(|v| (v - m).exp()).sum::<f64>();
                let v0: Vec<isize> = keys.iter().map(|&(p, r)| kv.position(&[p, r, 2 * g + 1, 0]) as isize).collect();
                for c in 0..d {
                    let v: f64 = v0.iter().zip(&w).map(|(v0, w)| w * kv.data[(v0 + c as isize * ks) as usize]).sum();
                    out.set(&[token, hq, c], v / total);
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs from plain lists: `keys[j]` / `values[j]` (`[KVH][D]` each) of one
    /// sequence's positions, scattered into pages through `table`.
    fn one_sequence(
        queries: &[Vec<Vec<f64>>],
        keys: &[Vec<Vec<f64>>],
        values: &[Vec<Vec<f64>>],
        page_size: usize,
        pages: usize,
        table: &[i64],
    ) -> RpaInputs {
        let (t, h, d, kvh, ctx) = (queries.len(), queries[0].len(), queries[0][0].len(), keys[0].len(), keys.len());
        let mut qt = HostTensor::zeros(DType::F64, &[t, h, d]);
        for (i, row) in queries.iter().enumerate() {
            for (hq, v) in row.iter().enumerate() {
                for (c, x) in v.iter().enumerate() {
                    qt.set(&[i, hq, c], *x);
                }
            }
        }
        let mut kv = HostTensor::from_vec(
            DType::F64,
            &[pages, page_size, 2 * kvh, d],
            vec![1e3; pages * page_size * 2 * kvh * d],
        );
        for j in 0..ctx {
            let p = table[j / page_size] as usize;
            for g in 0..kvh {
                for c in 0..d {
                    kv.set(&[p, j % page_size, 2 * g, c], keys[j][g][c]);
                    kv.set(&[p, j % page_size, 2 * g + 1, c], values[j][g][c]);
                }
            }
        }
        RpaInputs {
            queries: qt,
            kv_pages: kv,
            context_lens: HostTensor::from_vec(DType::I32, &[1], vec![ctx as f64]),
            block_tables: HostTensor::from_vec(
                DType::I32,
                &[1, table.len()],
                table.iter().map(|p| *p as f64).collect(),
            ),
            query_start_loc: HostTensor::from_vec(DType::I32, &[2], vec![0.0, t as f64]),
            sinks: None,
            total_tokens: t,
        }
    }

    /// Σ softmax(logits ∪ sinks)_j · values_j over the keys only.
    fn softmax_mix(logits: &[f64], sinks: &[f64], values: &[Vec<f64>]) -> Vec<f64> {
        let e: Vec<f64> = logits.iter().map(|x| x.exp()).collect();
        let total: f64 = e.iter().sum::<f64>() + sinks.iter().map(|x| x.exp()).sum::<f64>();
        (0..values[0].len()).map(|c| e.iter().zip(values).map(|(e, v)| e * v[c]).sum::<f64>() / total).collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * (1.0 + b.abs())
    }

    #[test]
    fn hand_computed_causal_alignment() {
        // One sequence, 3 keys on pages [2, 0] (page_size 2), 2 query tokens at
        // positions 1 and 2; two query heads on one KV head, D = 2.
        let keys = vec![vec![vec![0.5, -1.0]], vec![vec![2.0, 0.25]], vec![vec![-1.5, 1.0]]];
        let values = vec![vec![vec![1.0, 2.0]], vec![vec![-3.0, 0.5]], vec![vec![4.0, -1.0]]];
        let queries = vec![vec![vec![1.0, 0.0], vec![0.0, 2.0]], vec![vec![-1.0, 1.0], vec![0.5, 0.5]]];
        let mut x = one_sequence(&queries, &keys, &values, 2, 3, &[2, 0]);
        let scale = 0.7;
        let logits = |i: usize, hq: usize, n: usize, cap: Option<f64>| -> Vec<f64> {
            (0..n)
                .map(|j| {
                    let v = scale * (queries[i][hq][0] * keys[j][0][0] + queries[i][hq][1] * keys[j][0][1]);
                    cap.map_or(v, |c| c * (v / c).tanh())
                })
                .collect()
        };
        let vals: Vec<Vec<f64>> = values.iter().map(|v| v[0].clone()).collect();
        for (cap, sinks) in [(None, vec![]), (Some(1.5), vec![]), (None, vec![0.3, -2.0]), (Some(0.8), vec![1.0, 0.1])]
        {
            x.sinks = (!sinks.is_empty())
                .then(|| HostTensor::from_vec(DType::F32, &[2, 2], vec![sinks[0], sinks[1], sinks[1], sinks[0]]));
            let out = reference(&x, scale, cap, None).unwrap();
            assert_eq!(out.shape, vec![2, 2, 2]);
            for i in 0..2 {
                for hq in 0..2 {
                    // Token i is at position 3 - 2 + i: it sees keys 0 ..= 1 + i.
                    let s: Vec<f64> = if sinks.is_empty() {
                        vec![]
                    } else if hq == 0 {
                        vec![sinks[0] as f32 as f64, sinks[1] as f32 as f64]
                    } else {
                        vec![sinks[1] as f32 as f64, sinks[0] as f32 as f64]
                    };
                    let want = softmax_mix(&logits(i, hq, 2 + i, cap), &s, &vals[..2 + i]);
                    for c in 0..2 {
                        let got = out.get(&[i, hq, c]);
                        assert!(close(got, want[c]), "token {i} head {hq} [{c}]: {got} vs {want:?} (cap {cap:?})");
                    }
                }
            }
        }
        // Token 0 would see key 2 too if the queries were aligned to the start: check
        // the value is not the full-context one.
        x.sinks = None;
        let out = reference(&x, scale, None, None).unwrap();
        let full = softmax_mix(&logits(0, 0, 3, None), &[], &vals);
        assert!(!close(out.get(&[0, 0, 0]), full[0]));
    }

    #[test]
    fn window_excludes_exactly_the_far_keys() {
        // ctx 7, q_len 4 (positions 3..=6), page_size 3; perturb one position's value
        // at a time and see which tokens move.
        let ctx = 7;
        let keys: Vec<Vec<Vec<f64>>> = (0..ctx).map(|j| vec![vec![0.1 * j as f64 - 0.3, 0.05 * j as f64]]).collect();
        let values: Vec<Vec<Vec<f64>>> = (0..ctx).map(|j| vec![vec![j as f64, 1.0 - j as f64]]).collect();
        let queries: Vec<Vec<Vec<f64>>> = (0..4).map(|i| vec![vec![1.0 + i as f64, -0.5]]).collect();
        let x = one_sequence(&queries, &keys, &values, 3, 4, &[3, 1, 0]);
        for w in 1..=8i64 {
            let base = reference(&x, 0.5, Some(5.0), Some(w)).unwrap();
            for j in 0..ctx {
                let mut y = x.clone();
                let p = [3, 1, 0][j / 3];
                y.kv_pages.set(&[p, j % 3, 1, 0], 100.0);
                let moved = reference(&y, 0.5, Some(5.0), Some(w)).unwrap();
                for i in 0..4 {
                    let pos = (ctx - 4 + i) as i64;
                    let sees = (j as i64) <= pos && (j as i64) > pos - w;
                    let changed = moved.get(&[i, 0, 0]) != base.get(&[i, 0, 0]);
                    assert_eq!(changed, sees, "w {w}, key {j}, token {i} (position {pos})");
                    assert_eq!(moved.get(&[i, 0, 1]), base.get(&[i, 0, 1]));
                }
            }
            if w >= ctx as i64 {
                assert_eq!(base, reference(&x, 0.5, Some(5.0), None).unwrap());
            }
        }
        // w = 1: every token sees only itself, so it returns its own value.
        let out = reference(&x, 0.5, None, Some(1)).unwrap();
        for i in 0..4 {
            assert_eq!(out.get(&[i, 0, 0]), values[ctx - 4 + i][0][0]);
        }
    }

    #[test]
    fn serving_batches_are_chunks_then_decodes() {
        let shape = RpaShape {
            num_seqs: 9,
            heads_q: 4,
            heads_kv: 2,
            head_dim: 8,
            page_size: 4,
            max_context: 40,
            max_q_len: 12,
            num_pages: None,
            min_context: 30,
            prefill_seqs: 3,
        };
        let x = random_inputs(DType::F32, &shape, 0, 1);
        let (ctx, qsl) = (x.context_lens.to_vec(), x.query_start_loc.to_vec());
        for i in 0..9 {
            assert!((30.0..=40.0).contains(&ctx[i]), "{ctx:?}");
            assert_eq!(qsl[i + 1] - qsl[i], if i < 3 { 12.0 } else { 1.0 }, "{qsl:?}");
        }
        // v3's serving batch: the decodes first, then the chunks as mixed sequences.
        let v3 = super::super::reference_v3::random_inputs(DType::F32, &shape, 1);
        assert_eq!(v3.distribution.to_vec(), [6.0, 6.0, 9.0]);
        let q3 = v3.query_start_loc.to_vec();
        assert_eq!((q3[6], q3[9]), (6.0, 42.0));
        assert!(v3.kv_lens.to_vec().iter().all(|c| (30.0..=40.0).contains(c)));
    }

    #[test]
    fn mixed_batch_padding_and_empty_sequence() {
        let shape = RpaShape {
            num_seqs: 7,
            heads_q: 4,
            heads_kv: 2,
            head_dim: 8,
            page_size: 4,
            max_context: 19,
            max_q_len: 6,
            num_pages: None,
            min_context: 0,
            prefill_seqs: 0,
        };
        for seed in 0..8 {
            let x = random_inputs(DType::F32, &shape, if seed % 2 == 0 { 0 } else { 3 }, seed);
            // The same batch again (compared as text: the slots outside every context are NaN).
            let again = random_inputs(DType::F32, &shape, if seed % 2 == 0 { 0 } else { 3 }, seed);
            assert_eq!(format!("{x:?}"), format!("{again:?}"));
            // A slot is finite exactly when some sequence's context holds it.
            let slot = 2 * shape.heads_kv * shape.head_dim;
            let mut held = vec![false; shape.pages() * 4];
            for (s, len) in x.context_lens.to_vec().iter().enumerate() {
                for j in 0..*len as usize {
                    held[x.block_tables.get(&[s, j / 4]) as usize * 4 + j % 4] = true;
                }
            }
            for (i, h) in held.iter().enumerate() {
                let finite = x.kv_pages.data[i * slot..(i + 1) * slot].iter().all(|v| v.is_finite());
                let nan = x.kv_pages.data[i * slot..(i + 1) * slot].iter().all(|v| v.is_nan());
                assert!(if *h { finite } else { nan }, "slot {i}: held {h}");
            }
            assert!(held.contains(&false), "some slot is unheld");
            let (ctx, qsl) = (x.context_lens.to_vec(), x.query_start_loc.to_vec());
            assert_eq!(qsl.len(), 8);
            assert_eq!((ctx[0], qsl[1]), (19.0, 6.0));
            assert_eq!(qsl[2] - qsl[1], 1.0);
            assert!((1.0..=19.0).contains(&ctx[1]));
            assert_eq!((ctx[2], qsl[3] - qsl[2]), (1.0, 1.0));
            assert_eq!((ctx[3], qsl[4], qsl[3]), (0.0, qsl[3], qsl[4]));
            for s in 0..7 {
                assert!(qsl[s + 1] - qsl[s] <= ctx[s]);
                for k in 0..shape.max_pages() {
                    let used = k < (ctx[s] as usize).div_ceil(4);
                    assert_eq!(x.block_tables.get(&[s, k]) >= 0.0, used, "seq {s} entry {k}");
                }
            }
            let t = qsl[7] as usize;
            assert_eq!(x.total_tokens, t + 2);
            assert_eq!(x.queries.shape, vec![t + 2, 4, 8]);
            assert_ne!(x.queries.strides, HostTensor::contiguous_strides(&x.queries.shape));
            assert_eq!(x.kv_pages.shape, vec![shape.pages(), 4, 4, 8]);
            assert_eq!(x.sinks.as_ref().map(|s| s.shape.clone()), (seed % 2 == 1).then(|| vec![4, 3]));
            for w in [None, Some(3)] {
                let out = reference(&x, 0.35, None, w).unwrap();
                let v = out.to_vec();
                assert!(v[t * 32..].iter().all(|v| *v == 0.0), "padding tokens must be 0");
                assert!(v[..t * 32].iter().all(|v| v.is_finite() && *v != 0.0));
            }
        }
        // The same call with the padding dropped and the empty sequence removed gives
        // the same rows.
        let x = random_inputs(DType::F32, &shape, 2, 11);
        let out = reference(&x, 0.35, Some(20.0), Some(5)).unwrap();
        let qsl = x.query_start_loc.to_vec();
        let keep: Vec<usize> = (0..7).filter(|&s| s != 3).collect();
        let t = qsl[7] as usize;
        let y = RpaInputs {
            queries: HostTensor::view(&x.queries, &[t, 4, 8], &x.queries.strides, x.queries.offset),
            context_lens: HostTensor::from_vec(
                DType::I32,
                &[6],
                keep.iter().map(|&s| x.context_lens.get(&[s])).collect(),
            ),
            block_tables: HostTensor::from_vec(
                DType::I32,
                &[6, shape.max_pages()],
                keep.iter()
                    .flat_map(|&s| (0..shape.max_pages()).map(move |k| (s, k)))
                    .map(|(s, k)| x.block_tables.get(&[s, k]))
                    .collect(),
            ),
            query_start_loc: HostTensor::from_vec(
                DType::I32,
                &[7],
                std::iter::once(0.0).chain(keep.iter().map(|&s| qsl[s + 1])).collect(),
            ),
            total_tokens: t,
            ..x.clone()
        };
        assert_eq!(reference(&y, 0.35, Some(20.0), Some(5)).unwrap().to_vec(), out.to_vec()[..t * 32].to_vec());
    }

    #[test]
    fn decode_tokens_match_paged_decode() {
        // A sequence's last token sees its whole context: it is paged decode attention.
        let shape = RpaShape {
            num_seqs: 6,
            heads_q: 6,
            heads_kv: 3,
            head_dim: 4,
            page_size: 3,
            max_context: 11,
            max_q_len: 4,
            num_pages: Some(5),
            min_context: 0,
            prefill_seqs: 0,
        };
        let x = random_inputs(DType::BF16, &shape, 0, 5);
        let out = reference(&x, 0.5, Some(3.0), None).unwrap();
        let qsl = x.query_start_loc.to_vec();
        let (pages, d) = (shape.pages(), 4);
        let mut kc = HostTensor::zeros(DType::BF16, &[pages, 3, 3, d]);
        let mut vc = kc.clone();
        for p in 0..pages {
            for r in 0..3 {
                for g in 0..3 {
                    for c in 0..d {
                        kc.set(&[p, g, r, c], x.kv_pages.get(&[p, r, 2 * g, c]));
                        vc.set(&[p, g, r, c], x.kv_pages.get(&[p, r, 2 * g + 1, c]));
                    }
                }
            }
        }
        let last: Vec<usize> = (0..6).map(|s| (qsl[s + 1] as usize).max(1) - 1).collect();
        let q = HostTensor::from_vec(
            DType::BF16,
            &[6, 6, d],
            last.iter()
                .flat_map(|&t| (0..6 * d).map(move |k| (t, k)))
                .map(|(t, k)| x.queries.get(&[t, k / d, k % d]))
                .collect(),
        );
        let want = crate::ops::page_attention::reference::reference(
            &q,
            &kc,
            &vc,
            &x.context_lens,
            &x.block_tables,
            0.5,
            Some(3.0),
        )
        .unwrap();
        for s in 0..6 {
            if qsl[s + 1] == qsl[s] {
                continue;
            }
            for hq in 0..6 {
                for c in 0..d {
                    assert_eq!(out.get(&[last[s], hq, c]), want.get(&[s, hq, c]), "seq {s} head {hq}");
                }
            }
        }
    }

    #[test]
    fn errors_not_panics() {
        let shape = RpaShape {
            num_seqs: 4,
            heads_q: 4,
            heads_kv: 2,
            head_dim: 4,
            page_size: 2,
            max_context: 5,
            max_q_len: 3,
            num_pages: None,
            min_context: 0,
            prefill_seqs: 0,
        };
        let x = random_inputs(DType::F32, &shape, 1, 0);
        assert!(reference(&x, 1.0, None, None).is_ok());
        let err = |y: &RpaInputs, w: Option<i64>| reference(y, 1.0, None, w).unwrap_err();

        // More queries than keys: sequence 2 (1 key) gets 2 tokens.
        let mut y = x.clone();
        let mut qsl = y.query_start_loc.to_vec();
        qsl[2] -= 1.0;
        y.query_start_loc = HostTensor::from_vec(DType::I32, &[5], qsl);
        assert!(err(&y, None).contains("2 query tokens but only 1 keys"), "{}", err(&y, None));

        // A page outside the cache, and a -1 entry that is read.
        for bad in [shape.pages() as f64, -1.0] {
            let mut y = x.clone();
            y.block_tables.set(&[0, 2], bad);
            assert!(err(&y, None).contains("not a page of the cache"), "{}", err(&y, None));
        }
        // ... but an unread -1 is fine (sequence 2 has one page).
        assert_eq!(x.block_tables.get(&[2, 1]), -1.0);

        // A context longer than the table row holds.
        let mut y = x.clone();
        y.context_lens.set(&[0], 7.0);
        assert!(err(&y, None).contains("outside [0, 6]"));

        // Ill-formed query_start_loc.
        for (qsl, what) in [
            (vec![1.0, 3.0, 4.0, 5.0, 5.0], "must be 0"),
            (vec![0.0, 3.0, 2.0, 5.0, 5.0], "non-decreasing"),
            (vec![0.0, 3.0, 4.0, 5.0, x.total_tokens as f64 + 1.0], "runs past"),
        ] {
            let mut y = x.clone();
            y.query_start_loc = HostTensor::from_vec(DType::I32, &[5], qsl);
            assert!(err(&y, None).contains(what), "{what}: {}", err(&y, None));
        }

        // Window below 1, soft cap not positive.
        assert!(err(&x, Some(0)).contains("at least 1"));
        assert!(reference(&x, 1.0, Some(0.0), None).unwrap_err().contains("soft cap"));

        // Shapes: rank, odd head axis, heads not a multiple, sinks, context_lens.
        let mut y = x.clone();
        y.queries = HostTensor::zeros(DType::F32, &[x.total_tokens, 16]);
        assert!(err(&y, None).contains("[T, QH, D]"));
        let mut y = x.clone();
        y.kv_pages = HostTensor::zeros(DType::F32, &[shape.pages(), 2, 3, 4]);
        assert!(err(&y, None).contains("even"));
        let mut y = x.clone();
        y.kv_pages = HostTensor::zeros(DType::F32, &[shape.pages(), 2, 6, 4]);
        assert!(err(&y, None).contains("do not divide"));
        let mut y = x.clone();
        y.kv_pages = HostTensor::zeros(DType::F32, &[shape.pages(), 2, 4, 5]);
        assert!(err(&y, None).contains("kv_pages must be"));
        let mut y = x.clone();
        y.sinks = Some(HostTensor::zeros(DType::F32, &[3, 1]));
        assert!(err(&y, None).contains("sinks must be"));
        let mut y = x.clone();
        y.context_lens = HostTensor::zeros(DType::I32, &[3]);
        assert!(err(&y, None).contains("context_lens must be"));
    }
}
