//! The f64 reference of mean pooling, random inputs and the launch grid's symbols.
//!
//! ```
//! use ejc_ir::ops::mean_pooling::reference::{grid_symbols, random_inputs, reference_bwd, PoolShape};
//! use ejc_ir::types::DType;
//!
//! let shape = PoolShape { batch: 3, seq: 9, heads: 2, head_dim: 8, chunk: 4 };
//! let inputs = random_inputs(true, true, DType::BF16, &shape, 11);
//! let cu = inputs.cu_seqlens.as_ref().unwrap();
//! assert_eq!(cu.get(&[1]), 9.0); // sequence 0 has exactly `seq` tokens
//! let dx = reference_bwd(&inputs.input, Some(cu), 4, &inputs.out_shape).unwrap();
//! assert_eq!(dx.shape, inputs.out_shape);
//! let syms = grid_symbols(&inputs.out_shape, Some(cu), 4);
//! assert!(syms.contains(&("max_chunks", 3)));
//! ```
//!
//! The semantics are stated in [`super::kernels`]; these functions are their
//! definition. They are written for clarity (plain loops over sequences, chunks and
//! tokens, f64 sums), share no code with the kernels, and return `Err` — never panic —
//! for a chunk size of 0, tensors of the wrong rank or shape, or inconsistent
//! `cu_seqlens`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;

use crate::tensor::HostTensor;
use crate::types::DType;

/// The size of a test call. Varlen: `batch` sequences of up to `seq` tokens each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub chunk: usize,
}

/// The inputs of one call.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolInputs {
    /// x (forward) or dout (backward).
    pub input: HostTensor,
    /// i32 `[S + 1]` for varlen.
    pub cu_seqlens: Option<HostTensor>,
    /// The shape of out (forward) or dx (backward).
    pub out_shape: Vec<usize>,
}

/// One sequence of a call: its first token row, its length, and the row of its
/// first chunk in the chunk tensor, all at batch index `batch` of the tensors.
#[derive(Clone, Copy, Debug)]
struct Sequence {
    batch: usize,
    start: usize,
    len: usize,
    chunk_start: usize,
}

/// The sequences of a call whose token tensor (x or dx) has shape `tokens` (rank 4).
fn sequences(tokens: &[usize], cu_seqlens: Option<&HostTensor>, chunk: usize) -> Result<Vec<Sequence>, String> {
    if chunk == 0 {
        return Err("chunk_size must be at least 1 (got 0)".into());
    }
    if tokens.len() != 4 {
        return Err(format!("the token tensor must have rank 4 [B, T, H, D], got shape {tokens:?}"));
    }
    let Some(cu) = cu_seqlens else {
        return Ok((0..tokens[0]).map(|b| Sequence { batch: b, start: 0, len: tokens[1], chunk_start: 0 }).collect());
    };
    if cu.dtype != DType::I32 || cu.rank() != 1 || cu.numel() == 0 {
        return Err(format!(
            "cu_seqlens must be a non-empty rank-1 i32 tensor [num_seqs + 1], got {} with shape {:?}",
            cu.dtype, cu.shape
        ));
    }
    if tokens[0] != 1 {
        return Err(format!("varlen tokens are packed as [1, total_T, H, D], got batch {}", tokens[0]));
    }
    let cu = cu.to_vec();
    if cu[0] != 0.0 {
        return Err(format!("cu_seqlens[0] must be 0, got {}", cu[0]));
    }
    let total = tokens[1];
    if cu[cu.len() - 1] != total as f64 {
        return Err(format!("cu_seqlens ends at {}, but the packed sequence has {total} tokens", cu[cu.len() - 1]));
    }
    let mut out = Vec::with_capacity(cu.len() - 1);
    let mut chunk_start = 0;
    for (s, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(format!("cu_seqlens decreases at sequence {s}: {} then {}", w[0], w[1]));
        }
        let (start, len) = (w[0] as usize, (w[1] - w[0]) as usize);
        out.push(Sequence { batch: 0, start, len, chunk_start });
        chunk_start += len.div_ceil(chunk);
    }
    Ok(out)
}

/// Rows of the chunk tensor for token tensor `tokens`: `ceil(T / C)` dense, the sum of
/// every sequence's chunks varlen.
fn chunk_rows(tokens: &[usize], seqs: &[Sequence], varlen: bool, chunk: usize) -> usize {
    if varlen {
        seqs.iter().map(|s| s.len.div_ceil(chunk)).sum()
    } else {
        tokens[1].div_ceil(chunk)
    }
}

fn rank4(t: &HostTensor, what: &str) -> Result<(), String> {
    if t.rank() != 4 {
        return Err(format!("{what} must have rank 4 [B, T, H, D], got shape {:?}", t.shape));
    }
    if !t.dtype.is_float() {
        return Err(format!("{what} must be a float tensor, got {}", t.dtype));
    }
    Ok(())
}

/// The forward: `out` (contiguous, x's dtype, rounded from the f64 means).
pub fn reference_fwd(x: &HostTensor, cu_seqlens: Option<&HostTensor>, chunk: usize) -> Result<HostTensor, String> {
    rank4(x, "x")?;
    let seqs = sequences(&x.shape, cu_seqlens, chunk)?;
    let (heads, dim) = (x.shape[2], x.shape[3]);
    let rows = chunk_rows(&x.shape, &seqs, cu_seqlens.is_some(), chunk);
    let mut out = HostTensor::zeros(x.dtype, &[x.shape[0], rows, heads, dim]);
    for seq in &seqs {
        for c in 0..seq.len.div_ceil(chunk) {
            let tokens = c * chunk..seq.len.min((c + 1) * chunk);
            let count = tokens.len() as f64;
            for h in 0..heads {
                for e in 0..dim {
                    let sum: f64 = tokens.clone().map(|t| x.get(&[seq.batch, seq.start + t, h, e])).sum();
                    out.set(&[seq.batch, seq.chunk_start + c, h, e], sum / count);
                }
            }
        }
    }
    Ok(out)
}

/// The backward: `dx` of shape `dx_shape` (contiguous, dout's dtype), each token's
/// chunk gradient divided by the chunk's count.
pub fn reference_bwd(
    dout: &HostTensor,
    cu_seqlens: Option<&HostTensor>,
    chunk: usize,
    dx_shape: &[usize],
) -> Result<HostTensor, String> {
    rank4(dout, "dout")?;
    let seqs = sequences(dx_shape, cu_seqlens, chunk)?;
    let rows = chunk_rows(dx_shape, &seqs, cu_seqlens.is_some(), chunk);
    let want = [dx_shape[0], rows, dx_shape[2], dx_shape[3]];
    if dout.shape != want {
        return Err(format!(
            "dout must have shape {want:?} for dx {dx_shape:?} and chunk {chunk}, got {:?}",
            dout.shape
        ));
    }
    let mut dx = HostTensor::zeros(dout.dtype, dx_shape);
    for seq in &seqs {
        for t in 0..seq.len {
            let c = t / chunk;
            let count = (seq.len.min((c + 1) * chunk) - c * chunk) as f64;
            for h in 0..dx_shape[2] {
                for e in 0..dx_shape[3] {
                    let g = dout.get(&[seq.batch, seq.chunk_start + c, h, e]);
                    dx.set(&[seq.batch, seq.start + t, h, e], g / count);
                }
            }
        }
    }
    Ok(dx)
}

/// The grid symbols of a call whose token tensor (x, or dx for the backward) has shape
/// `tokens` `[B, T, H, D]` (varlen `[1, total_T, H, D]`): `num_chunks`, `heads`,
/// `batch` (dense) or `max_chunks`, `heads`, `num_seqs` (varlen), and `total_chunks`,
/// the chunk tensor's axis-1 extent. A chunk of 0, which the reference refuses, counts
/// as 1 here; a shape of another rank gives zero extents.
pub fn grid_symbols(tokens: &[usize], cu_seqlens: Option<&HostTensor>, chunk: usize) -> Vec<(&'static str, i64)> {
    let chunk = chunk.max(1);
    let dim = |i: usize| tokens.get(i).copied().unwrap_or(0) as i64;
    let heads = ("heads", dim(2));
    match cu_seqlens {
        None => {
            let n = (dim(1) as usize).div_ceil(chunk) as i64;
            vec![("num_chunks", n), heads, ("batch", dim(0)), ("total_chunks", n)]
        }
        Some(cu) => {
            let cu = cu.to_vec();
            let lens = cu.windows(2).map(|w| ((w[1] - w[0]).max(0.0) as usize).div_ceil(chunk) as i64);
            let (max, total) = lens.fold((0, 0), |(m, t), n| (m.max(n), t + n));
            vec![("max_chunks", max), heads, ("num_seqs", cu.len().saturating_sub(1) as i64), ("total_chunks", total)]
        }
    }
}

/// Random inputs for one call: x (forward) or dout (backward) in `dtype`, N(0, 1)
/// values never zero, stored head-major (`[B, H, T, D]` in memory, like flash's k and
/// v), so a kernel that assumes contiguous BSHD strides reads the wrong elements.
///
/// Varlen: `batch` sequences of random lengths in `[0, seq]` packed as batch 1:
/// sequence 0 has exactly `seq` tokens (the longest, so `max_chunks` is exercised), one
/// of the others is empty when `batch >= 3`, and the rest are drawn from the lengths
/// in `[1, seq]` that are not multiples of `chunk` (any length when there is none).
/// Everything is a pure function of the seed.
pub fn random_inputs(backward: bool, varlen: bool, dtype: DType, shape: &PoolShape, seed: u64) -> PoolInputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let PoolShape { batch, seq, heads, head_dim, chunk } = *shape;
    let chunk = chunk.max(1);
    let cu_seqlens = varlen.then(|| varlen_offsets(&mut rng, batch, seq, chunk));
    let tokens = match &cu_seqlens {
        Some(cu) => vec![1, cu.get(&[batch]) as usize, heads, head_dim],
        None => vec![batch, seq, heads, head_dim],
    };
    let syms = grid_symbols(&tokens, cu_seqlens.as_ref(), chunk);
    let total_chunks = syms.iter().find(|(n, _)| *n == "total_chunks").map_or(0, |(_, v)| *v as usize);
    let chunks = vec![tokens[0], total_chunks, heads, head_dim];
    let (input_shape, out_shape) = if backward { (chunks, tokens) } else { (tokens, chunks) };
    let input = head_major(&mut rng, dtype, &input_shape);
    PoolInputs { input, cu_seqlens, out_shape }
}

/// A `[B, S, H, D]` tensor stored as `[B, H, S, D]`, N(0, 1) values redrawn until
/// they do not round to zero.
fn head_major(rng: &mut StdRng, dtype: DType, shape: &[usize]) -> HostTensor {
    let (b, s, h, d) = (shape[0], shape[1], shape[2], shape[3]);
    let values = (0..b * h * s * d)
        .map(|_| loop {
            let x = dtype.round(rng.sample::<f64, _>(StandardNormal));
            if x != 0.0 {
                break x;
            }
        })
        .collect();
    let storage = HostTensor::from_vec(dtype, &[b, h, s, d], values);
    let st = storage.strides.clone();
    HostTensor::view(&storage, &[b, s, h, d], &[st[0], st[2], st[1], st[3]], 0)
}

/// i32 `cu_seqlens` `[batch + 1]` (see [`random_inputs`]).
fn varlen_offsets(rng: &mut StdRng, batch: usize, seq: usize, chunk: usize) -> HostTensor {
    let empty = (batch >= 3).then(|| rng.random_range(1..batch));
    let awkward: Vec<usize> = (1..=seq).filter(|n| n % chunk != 0).collect();
    let mut cu = vec![0.0];
    for s in 0..batch {
        let len = if s == 0 {
            seq
        } else if Some(s) == empty || seq == 0 {
            0
        } else if awkward.is_empty() {
            rng.random_range(1..=seq)
        } else {
            awkward[rng.random_range(0..awkward.len())]
        };
        cu.push(cu[s] + len as f64);
    }
    HostTensor::from_vec(DType::I32, &[batch + 1], cu)
}
