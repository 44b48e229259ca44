//! The f64 reference of paged decode attention, and random calls.
//!
//! ```
//! use ejc_ir::ops::page_attention::reference::{random_inputs, reference, PagedShape};
//! use ejc_ir::types::DType;
//!
//! let shape = PagedShape { num_seqs: 4, heads_q: 8, heads_kv: 2, head_dim: 16, page_size: 5,
//!                          max_context: 23, min_context: 0, num_pages: None };
//! let x = random_inputs(DType::F32, &shape, 3);
//! assert_eq!(x.context_lens.to_vec()[..4], [23.0, x.context_lens.get(&[1]), 1.0, 0.0]);
//! let out = reference(&x.query, &x.key_cache, &x.value_cache, &x.context_lens, &x.block_tables,
//!                     1.0 / 4.0, None).unwrap();
//! assert_eq!(out.shape, vec![4, 8, 16]);
//! assert!(out.to_vec()[3 * 8 * 16..].iter().all(|v| *v == 0.0)); // an empty context gives 0
//! ```
//!
//! The semantics are stated in [`super::kernels`]; this is their definition, written
//! for clarity (a loop over sequences, heads and keys, f64 sums), sharing no code with
//! the kernels. It returns `Err` — never panics — for tensors of the wrong rank or
//! shape, a context longer than its block-table row holds, or a page index outside the
//! cache.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use crate::tensor::HostTensor;
use crate::types::DType;

/// The size of a test call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedShape {
    pub num_seqs: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub page_size: usize,
    /// Sequence 0's context; the block tables are `ceil(max_context / P)` wide.
    pub max_context: usize,
    /// The others' contexts are uniform in `[min_context, max_context]`; with
    /// `min_context = 0` and at least four sequences, sequence 2 has one key and
    /// sequence 3 none (the awkward cases every check covers).
    pub min_context: usize,
    /// Pages in the caches; `None`: one more than the sequences need, each page used
    /// once (a permutation). Fewer than `S · ceil(max_context / P)` shares pages between
    /// sequences (drawn with replacement).
    pub num_pages: Option<usize>,
}

impl PagedShape {
    /// The block tables' width.
    pub fn max_pages(&self) -> usize {
        self.max_context.div_ceil(self.page_size.max(1)).max(1)
    }

    pub fn pages(&self) -> usize {
        self.num_pages.unwrap_or(self.num_seqs * self.max_pages() + 1).max(1)
    }
}

/// The inputs of one call.
#[derive(Clone, Debug, PartialEq)]
pub struct PagedInputs {
    /// `[S, H, D]`, a view with a padded head axis (not contiguous).
    pub query: HostTensor,
    pub key_cache: HostTensor,
    pub value_cache: HostTensor,
    /// i32 `[S]`.
    pub context_lens: HostTensor,
    /// i32 `[S, max_pages]`; entries past a sequence's pages are −1 (never read).
    pub block_tables: HostTensor,
}

fn randn(dtype: DType, shape: &[usize], rng: &mut StdRng) -> HostTensor {
    let n: usize = shape.iter().product();
    HostTensor::from_vec(dtype, shape, (0..n).map(|_| rng.sample::<f64, _>(StandardNormal)).collect())
}

/// Fresh random inputs (N(0, 1) values; never zeros).
pub fn random_inputs(dtype: DType, s: &PagedShape, seed: u64) -> PagedInputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let (n, h, d) = (s.num_seqs, s.heads_q, s.head_dim);
    // The query as a view of [S, H + 1, D]: its heads are not contiguous with the next
    // sequence's.
    let base = randn(dtype, &[n, h + 1, d], &mut rng);
    let query = base.into_view(&[n, h, d], &[((h + 1) * d) as isize, d as isize, 1], 0);
    let pages = s.pages();
    let cache = [pages, s.heads_kv, s.page_size, d];
    let key_cache = randn(dtype, &cache, &mut rng);
    let value_cache = randn(dtype, &cache, &mut rng);
    let lens: Vec<usize> = (0..n)
        .map(|i| match i {
            0 => s.max_context,
            2 if s.min_context == 0 && n >= 4 => 1.min(s.max_context),
            3 if s.min_context == 0 && n >= 4 => 0,
            _ => rng.random_range(s.min_context.min(s.max_context)..=s.max_context),
        })
        .collect();
    let width = s.max_pages();
    let needed = n * width;
    let mut ids: Vec<usize> = (0..pages).collect();
    ids.shuffle(&mut rng);
    let mut table = vec![-1.0; needed];
    for (i, len) in lens.iter().enumerate() {
        for p in 0..len.div_ceil(s.page_size.max(1)) {
            let k = i * width + p;
            table[k] = if pages > needed { ids[k] as f64 } else { rng.random_range(0..pages) as f64 };
        }
    }
    PagedInputs {
        query,
        key_cache,
        value_cache,
        context_lens: HostTensor::from_vec(DType::I32, &[n], lens.iter().map(|l| *l as f64).collect()),
        block_tables: HostTensor::from_vec(DType::I32, &[n, width], table),
    }
}

/// The attention output `[S, H, D]` (in query's dtype) of one call.
pub fn reference(
    query: &HostTensor,
    key_cache: &HostTensor,
    value_cache: &HostTensor,
    context_lens: &HostTensor,
    block_tables: &HostTensor,
    scale: f64,
    soft_cap: Option<f64>,
) -> Result<HostTensor, String> {
    if query.rank() != 3 {
        return Err(format!("query must be [S, H, D], got shape {:?}", query.shape));
    }
    let (n, h, d) = (query.shape[0], query.shape[1], query.shape[2]);
    if key_cache.rank() != 4 || value_cache.shape != key_cache.shape || key_cache.shape[3] != d {
        return Err(format!(
            "key_cache and value_cache must both be [num_pages, KVH, P, {d}], got {:?} and {:?}",
            key_cache.shape, value_cache.shape
        ));
    }
    let (pages, kvh, page) = (key_cache.shape[0], key_cache.shape[1], key_cache.shape[2]);
    if kvh == 0 || !h.is_multiple_of(kvh) || page == 0 {
        return Err(format!("{h} query heads do not divide into {kvh} KV heads (or the page size is 0)"));
    }
    if context_lens.shape != [n] || block_tables.rank() != 2 || block_tables.shape[0] != n {
        return Err(format!(
            "context_lens must be [{n}] and block_tables [{n}, max_pages], got {:?} and {:?}",
            context_lens.shape, block_tables.shape
        ));
    }
    let width = block_tables.shape[1];
    let group = h / kvh;
    let mut out = HostTensor::zeros(query.dtype, &[n, h, d]);
    for s in 0..n {
        let len = context_lens.get(&[s]);
        if len < 0.0 || len as usize > width * page {
            return Err(format!("context_lens[{s}] = {len} is outside [0, {}] (max_pages x page size)", width * page));
        }
        let len = len as usize;
        let mut rows = Vec::with_capacity(len);
        for j in 0..len {
            let p = block_tables.get(&[s, j / page]);
            if p < 0.0 || p as usize >= pages {
                return Err(format!("block_tables[{s}, {}] = {p} is not a page of the cache (0..{pages})", j / page));
            }
            rows.push((p as usize, j % page));
        }
        for hq in 0..h {
            let g = hq / group;
            let scores: Vec<f64> = rows
                .iter()
                .map(|&(p, r)| {
                    let dot: f64 = (0..d).map(|c| query.get(&[s, hq, c]) * key_cache.get(&[p, g, r, c])).sum();
                    let x = dot * scale;
                    match soft_cap {
                        Some(cap) => cap * (x / cap).tanh(),
                        None => x,
                    }
                })
                .collect();
            if scores.is_empty() {
                continue;
            }
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let total: f64 = w.iter().sum();
            for c in 0..d {
                let v: f64 = rows.iter().zip(&w).map(|(&(p, r), w)| w * value_cache.get(&[p, g, r, c])).sum();
                out.set(&[s, hq, c], v / total);
            }
        }
    }
    Ok(out)
}
