//! The f64 reference of ragged paged attention v3 — the new tokens' K and V written into
//! the cache, then v2's attention over it — and random calls.
//!
//! ```
//! use ejc_ir::ops::ragged_paged::reference::RpaShape;
//! use ejc_ir::ops::ragged_paged::reference_v3::{random_inputs, reference};
//! use ejc_ir::types::DType;
//!
//! let shape = RpaShape { num_seqs: 7, heads_q: 4, heads_kv: 2, head_dim: 8, page_size: 3,
//!                        max_context: 20, max_q_len: 6, num_pages: None,
//!                        min_context: 0, prefill_seqs: 0 };
//! let x = random_inputs(DType::F32, &shape, 5);
//! let d = x.distribution.to_vec();
//! assert_eq!(d, [2.0, 4.0, 6.0]); // decode-only, prefill-only, mixed; slot 6 inactive
//! let (out, cache) = reference(&x, 0.3, None, None).unwrap();
//! assert_eq!(out.shape, vec![x.queries.shape[0], 4, 8]);
//! assert_ne!(cache.to_vec(), x.kv_pages.to_vec()); // the new tokens were written
//! ```
//!
//! # Semantics
//!
//! The inputs of v2 ([`super::reference`]) with `kv_lens` for `context_lens` (each
//! sequence's keys *after* its new tokens are added), plus the new tokens' `keys` and
//! `values [T, KVH, D]` and `distribution [3]` (i32): sequences `[0, d0)` are decode-only
//! (one new token each), `[d0, d1)` prefill-only (every key is new: `q_len = kv_len`),
//! `[d1, d2)` mixed, and `d2` is the number of live sequences; the entries of later
//! slots are ignored. First, sequence `s`'s token `i` (position `p = kv_len − q_len + i`)
//! has its key written to head `2h` and its value to head `2h + 1` of row `p mod P` of
//! page `block_tables[s, p / P]`, for every KV head `h`; then v2's attention runs over
//! the live sequences against the updated cache (no sinks). Rows past `qsl[d2]` are 0
//! and never written. Two new tokens may not write the same row of the cache (an error:
//! the kernels write in parallel).

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use super::reference::{reference as attend, RpaInputs, RpaShape};
use crate::tensor::HostTensor;
use crate::types::DType;

/// The inputs of one v3 call.
#[derive(Clone, Debug, PartialEq)]
pub struct V3Inputs {
    /// `[T, QH, D]`.
    pub queries: HostTensor,
    /// The new tokens' keys and values `[T, KVH, D]` (views with a padded head axis).
    pub keys: HostTensor,
    pub values: HostTensor,
    /// `[P, page_size, 2 · KVH, D]`, before the writes.
    pub kv_pages: HostTensor,
    /// i32 `[S]`, the contexts after the writes.
    pub kv_lens: HostTensor,
    /// i32 `[S, pages_per_seq]`.
    pub block_tables: HostTensor,
    /// i32 `[S + 1]`.
    pub query_start_loc: HostTensor,
    /// i32 `[3]`.
    pub distribution: HostTensor,
}

fn randn(dtype: DType, shape: &[usize], rng: &mut StdRng) -> HostTensor {
    let n: usize = shape.iter().product();
    HostTensor::from_vec(dtype, shape, (0..n).map(|_| rng.sample::<f64, _>(StandardNormal)).collect())
}

/// Fresh N(0, 1) inputs. With `S ≥ 4` the last slot is inactive (garbage length, no
/// pages); the live ones are a third decode-only (random contexts), a third prefill-only
/// (the first `max_q_len` tokens long, one of them empty when there are two or more) and
/// the rest mixed (the first a chunk of `max_q_len` over `max_context`, the others
/// random). With `min_context > 0`, a serving batch: contexts drawn from `[min_context,
/// max_context]`, the last `prefill_seqs` (at least one) mixed chunks of `max_q_len`, the
/// others decode-only. Each page is used once (writes must not collide); two padding tokens follow.
pub fn random_inputs(dtype: DType, s: &RpaShape, seed: u64) -> V3Inputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = s.num_seqs;
    let serving = s.min_context > 0;
    let live = if n >= 4 && !serving { n - 1 } else { n };
    // A serving batch: decodes first, then `prefill_seqs` mixed chunks, no prefill-only.
    let (decode, prefill) = if serving { (n - s.prefill_seqs.max(1).min(n), 0) } else { (live / 3, live / 3) };
    let (mc, mq) = (s.max_context, s.max_q_len.min(s.max_context));
    let mut lens = Vec::with_capacity(n);
    let mut q_lens = Vec::with_capacity(n);
    for i in 0..n {
        let (ctx, q) = if serving {
            let c = rng.random_range(s.min_context.min(mc)..=mc);
            (c, if i < decode { 1.min(c) } else { mq.min(c) })
        } else if i < decode {
            let c = rng.random_range(1.min(mc)..=mc);
            (c, 1.min(c))
        } else if i < decode + prefill {
            let c = match i - decode {
                0 => mq,
                1 => 0,
                _ => rng.random_range(0..=mq),
            };
            (c, c)
        } else if i < live {
            if i == decode + prefill {
                (mc, mq)
            } else {
                let c = rng.random_range(0..=mc);
                (c, rng.random_range(0..=c.min(mq)))
            }
        } else {
            (5.min(mc), 0)
        };
        lens.push(ctx);
        q_lens.push(q);
    }
    let mut qsl = vec![0usize];
    for q in &q_lens {
        qsl.push(qsl.last().unwrap() + q);
    }
    let (h, kvh, d) = (s.heads_q, s.heads_kv, s.head_dim);
    let t = qsl[n] + 2;
    let view = |base: HostTensor, heads: usize| {
        base.into_view(&[t, heads, d], &[((heads + 1) * d) as isize, d as isize, 1], 0)
    };
    let queries = view(randn(dtype, &[t, h + 1, d], &mut rng), h);
    let keys = view(randn(dtype, &[t, kvh + 1, d], &mut rng), kvh);
    let values = view(randn(dtype, &[t, kvh + 1, d], &mut rng), kvh);
    let width = s.max_pages();
    let pages = n * width + 1;
    let kv_pages = randn(dtype, &[pages, s.page_size, 2 * kvh, d], &mut rng);
    let mut ids: Vec<usize> = (0..pages).collect();
    ids.shuffle(&mut rng);
    let mut table = vec![-1.0; n * width];
    for (i, len) in lens.iter().enumerate().take(live) {
        for p in 0..len.div_ceil(s.page_size.max(1)) {
            table[i * width + p] = ids[i * width + p] as f64;
        }
    }
    let i32s = |shape: &[usize], v: Vec<f64>| HostTensor::from_vec(DType::I32, shape, v);
    V3Inputs {
        queries,
        keys,
        values,
        kv_pages,
        kv_lens: i32s(&[n], lens.iter().map(|l| *l as f64).collect()),
        block_tables: i32s(&[n, width], table),
        query_start_loc: i32s(&[n + 1], qsl.iter().map(|l| *l as f64).collect()),
        distribution: i32s(&[3], [decode, decode + prefill, live].iter().map(|v| *v as f64).collect()),
    }
}

/// The live sequences `d2` after checking `distribution` against the batch.
pub fn live_sequences(distribution: &[i64], kv_lens: &[i64], qsl: &[i64]) -> Result<usize, String> {
    let s = kv_lens.len();
    let [d0, d1, d2] = <[i64; 3]>::try_from(distribution)
        .map_err(|_| format!("distribution must hold 3 entries, got {}", distribution.len()))?;
    if !(0 <= d0 && d0 <= d1 && d1 <= d2 && d2 <= s as i64) {
        return Err(format!("distribution ({d0}, {d1}, {d2}) must satisfy 0 <= d0 <= d1 <= d2 <= {s} (the sequences)"));
    }
    if qsl.len() != s + 1 {
        return Err(format!("query_start_loc must have {} entries, got {}", s + 1, qsl.len()));
    }
    for i in 0..d2 as usize {
        let q = qsl[i + 1] - qsl[i];
        if (i as i64) < d0 && q != 1 {
            return Err(format!("sequence {i} is decode-only (distribution[0] = {d0}) but has {q} new tokens"));
        }
        if (d0..d1).contains(&(i as i64)) && q != kv_lens[i] {
            return Err(format!(
                "sequence {i} is prefill-only (distribution[1] = {d1}) but has {q} new tokens and kv_len {}",
                kv_lens[i]
            ));
        }
    }
    Ok(d2 as usize)
}

fn ints(t: &HostTensor) -> Vec<i64> {
    t.to_vec().into_iter().map(|v| v as i64).collect()
}

/// The attention output `[T, QH, D]` and the updated cache.
pub fn reference(
    x: &V3Inputs,
    scale: f64,
    soft_cap: Option<f64>,
    window: Option<i64>,
) -> Result<(HostTensor, HostTensor), String> {
    let (lens, qsl, dist) = (ints(&x.kv_lens), ints(&x.query_start_loc), ints(&x.distribution));
    let live = live_sequences(&dist, &lens, &qsl)?;
    let kv = &x.kv_pages;
    if kv.rank() != 4 || x.keys.rank() != 3 || x.values.shape != x.keys.shape {
        return Err(format!(
            "kv_pages must be [P, page_size, 2 * KVH, D] and keys, values both [T, KVH, D]: got {:?}, {:?}, {:?}",
            kv.shape, x.keys.shape, x.values.shape
        ));
    }
    let (page, kvh, d) = (kv.shape[1], x.keys.shape[1], x.keys.shape[2]);
    if kv.shape[2] != 2 * kvh || kv.shape[3] != d || page == 0 || x.keys.shape[0] != x.queries.shape[0] {
        return Err(format!(
            "keys/values [T, KVH, D] = {:?} do not fit kv_pages {:?} (2 * KVH heads) or queries {:?}",
            x.keys.shape, kv.shape, x.queries.shape
        ));
    }
    let table = &x.block_tables;
    let width = table.shape.get(1).copied().unwrap_or(0);
    let mut cache = HostTensor::from_vec(kv.dtype, &kv.shape, kv.to_vec());
    let mut written = std::collections::BTreeMap::new();
    for s in 0..live {
        let (q0, q1, ctx) = (qsl[s], qsl[s + 1], lens[s]);
        if q1 < q0 || q1 - q0 > ctx || ctx > (width * page) as i64 {
            return Err(format!("sequence {s}: {} new tokens, kv_len {ctx}, a table of {width} pages", q1 - q0));
        }
        for i in 0..(q1 - q0) {
            let p = (ctx - (q1 - q0) + i) as usize;
            let pg = table.get(&[s, p / page]);
            if pg < 0.0 || pg as usize >= kv.shape[0] {
                return Err(format!("block_tables[{s}, {}] = {pg} is not a page of the cache", p / page));
            }
            let at = (pg as usize, p % page);
            if let Some(other) = written.insert(at, s) {
                return Err(format!(
                    "sequences {other} and {s} both write row {} of page {}: new tokens must not share cache rows",
                    at.1, at.0
                ));
            }
            let tok = (q0 + i) as usize;
            for h in 0..kvh {
                for c in 0..d {
                    cache.set(&[at.0, at.1, 2 * h, c], x.keys.get(&[tok, h, c]));
                    cache.set(&[at.0, at.1, 2 * h + 1, c], x.values.get(&[tok, h, c]));
                }
            }
        }
    }
    let first = |t: &HostTensor, n: usize| -> HostTensor {
        let row: usize = t.shape[1..].iter().product();
        let mut shape = t.shape.clone();
        shape[0] = n;
        HostTensor::from_vec(t.dtype, &shape, t.to_vec()[..n * row].to_vec())
    };
    let v2 = RpaInputs {
        queries: x.queries.clone(),
        kv_pages: cache.clone(),
        context_lens: first(&x.kv_lens, live),
        block_tables: first(table, live),
        query_start_loc: first(&x.query_start_loc, live + 1),
        sinks: None,
        total_tokens: x.queries.shape[0],
    };
    let out = attend(&v2, scale, soft_cap, window)?;
    Ok((out, cache))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> RpaShape {
        RpaShape {
            num_seqs: 7,
            heads_q: 4,
            heads_kv: 2,
            head_dim: 8,
            page_size: 3,
            max_context: 20,
            max_q_len: 6,
            num_pages: None,
            min_context: 0,
            prefill_seqs: 0,
        }
    }

    /// Every new token's key and value land at its position's page row, nothing else moves.
    #[test]
    fn the_writes_land_where_the_positions_say() {
        let x = random_inputs(DType::BF16, &shape(), 11);
        let (_, cache) = reference(&x, 0.3, None, None).unwrap();
        let (lens, qsl) = (ints(&x.kv_lens), ints(&x.query_start_loc));
        let mut expect = x.kv_pages.clone();
        let mut changed = 0;
        for s in 0..6 {
            let q = qsl[s + 1] - qsl[s];
            for i in 0..q {
                let p = (lens[s] - q + i) as usize;
                let pg = x.block_tables.get(&[s, p / 3]) as usize;
                for h in 0..2 {
                    for c in 0..8 {
                        let tok = (qsl[s] + i) as usize;
                        expect.set(&[pg, p % 3, 2 * h, c], x.keys.get(&[tok, h, c]));
                        expect.set(&[pg, p % 3, 2 * h + 1, c], x.values.get(&[tok, h, c]));
                    }
                }
                changed += 1;
            }
        }
        assert!(changed > 10, "the batch writes tokens");
        assert_eq!(cache.to_vec(), expect.to_vec());
    }

    #[test]
    fn distribution_and_collisions_are_checked() {
        let x = random_inputs(DType::F32, &shape(), 2);
        let mut bad = x.clone();
        bad.distribution = HostTensor::from_vec(DType::I32, &[3], vec![3.0, 4.0, 6.0]);
        assert!(reference(&bad, 1.0, None, None).unwrap_err().contains("decode-only"));
        let mut bad = x.clone();
        bad.distribution = HostTensor::from_vec(DType::I32, &[3], vec![2.0, 5.0, 6.0]);
        assert!(reference(&bad, 1.0, None, None).unwrap_err().contains("prefill-only"));
        let mut bad = x.clone();
        bad.distribution = HostTensor::from_vec(DType::I32, &[3], vec![2.0, 1.0, 6.0]);
        assert!(reference(&bad, 1.0, None, None).unwrap_err().contains("d0 <= d1"));
        // Sequence 0 (decode) writes into sequence 4's (a chunk of new tokens) last page.
        let mut bad = x;
        let (lens, qsl) = (ints(&bad.kv_lens), ints(&bad.query_start_loc));
        let p4 = (lens[4] - 1) as usize / 3;
        let p0 = (lens[0] - 1) as usize / 3;
        let row4 = (lens[4] - 1) as usize % 3;
        assert!(qsl[5] > qsl[4], "sequence 4 writes");
        bad.kv_lens.set(&[0], (p0 * 3 + row4 + 1) as f64);
        let shared = bad.block_tables.get(&[4, p4]);
        bad.block_tables.set(&[0, p0], shared);
        assert!(reference(&bad, 1.0, None, None).unwrap_err().contains("new tokens must not share cache rows"));
    }

    /// Inactive slots are ignored: their garbage lengths and missing pages change nothing.
    #[test]
    fn inactive_slots_are_ignored() {
        let x = random_inputs(DType::F32, &shape(), 4);
        let (out, cache) = reference(&x, 0.3, Some(20.0), Some(4)).unwrap();
        let mut y = x.clone();
        y.kv_lens.set(&[6], 17.0);
        let (out2, cache2) = reference(&y, 0.3, Some(20.0), Some(4)).unwrap();
        assert_eq!((out.to_vec(), cache.to_vec()), (out2.to_vec(), cache2.to_vec()));
    }
}
