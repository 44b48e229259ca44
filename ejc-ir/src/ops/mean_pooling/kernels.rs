//! The tile programs of mean pooling: forward and backward, dense and varlen.
//!
//! ```
//! use ejc_ir::ops::mean_pooling::kernels::{build, PoolKernel};
//! use ejc_ir::types::DType;
//!
//! let k = PoolKernel { backward: true, varlen: true, dtype: DType::BF16, head_dim: 64, block_h: 16 };
//! let kernel = build("mean_pooling_bwd_varlen", &k).unwrap();
//! let names: Vec<&str> = kernel.params.iter().map(|p| p.name.as_str()).collect();
//! assert_eq!(names, ["dout", "dx", "cu_seqlens", "chunk_size"]);
//! assert_eq!(kernel.grid[0].to_string(), "max_chunks");
//! ```
//!
//! # Semantics
//!
//! * **Forward**: x `[B, T, H, D]` (any strides; bf16, f16 or f32) and a chunk size
//!   `C >= 1` (the run-time i32 `chunk_size`) give `out [B, NC, H, D]` in x's dtype with
//!   `NC = ceil(T / C)`: `out[b, c, h, :]` is the mean of `x[b, t, h, :]` over
//!   `t in [c·C, min(T, (c+1)·C))`, accumulated in f32. The last chunk divides by its
//!   own, possibly smaller, count.
//! * **Varlen**: `cu_seqlens` i32 `[S + 1]` (prefix sums from 0, non-decreasing) and x
//!   packed as `[1, total_T, H, D]`: sequence `s` is rows `[cu[s], cu[s+1])`, with
//!   `n_s = ceil(len_s / C)` chunks (none for an empty sequence). The output is
//!   `[1, total_chunks, H, D]`; sequence `s`'s chunks start at row
//!   `off_s = sum_{s' < s} n_s'`. Chunks never cross sequences.
//! * **Backward**: dout `[B, NC, H, D]` (varlen `[1, total_chunks, H, D]`) gives
//!   `dx [B, T, H, D]` (varlen packed like x) with
//!   `dx[b, t, h, :] = dout[b, t / C, h, :] / count(chunk of t)` (per sequence for
//!   varlen), computed in f32 and stored in the dtype.
//!
//! # Tile program
//!
//! One program per (chunk `c`, block of `block_h` heads, batch entry or sequence). Its
//! tile is `[block_h, head_dim]`: rows are the heads `[h0, h0 + block_h)` (bounded by
//! the tensor's head extent), columns the whole head dim (compile time). The forward
//! program sums the chunk's rows into an f32 accumulator and stores `acc / count`; the
//! backward one loads its chunk's gradient once, divides it by the count and stores it
//! to every row of the chunk.
//!
//! Launch grid: dense `(num_chunks, cdiv(heads, block_h), batch)`; varlen
//! `(max_chunks, cdiv(heads, block_h), num_seqs)` where `max_chunks` is the largest
//! `n_s`. A varlen program whose chunk is past its sequence's end does nothing.

use crate::builder::{Axis, KernelBuilder};
use crate::ir::{BinOp, CmpPred, GridExpr, Kernel, Value};
use crate::types::{DType, Type};
use crate::verify::VerifyError;

/// One mean-pooling kernel: its direction, layout, dtype and tiling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolKernel {
    /// dout → dx instead of x → out.
    pub backward: bool,
    /// Packed sequences with `cu_seqlens`.
    pub varlen: bool,
    /// Element type of x / out (dout / dx): bf16, f16 or f32.
    pub dtype: DType,
    /// D, the head dim (the tile's columns).
    pub head_dim: usize,
    /// Heads per program (the tile's rows).
    pub block_h: usize,
}

/// One line per parameter name: what it is, with its logical shape (for the
/// manifest's `meaning`).
pub fn param_docs() -> &'static [(&'static str, &'static str)] {
    &[
        ("x", "input: the sequence to pool [B, T, H, D] (varlen: packed [1, total_T, H, D])"),
        ("out", "output: the chunk means [B, ceil(T / C), H, D] (varlen: [1, total_chunks, H, D]), x's dtype"),
        ("dout", "input: the gradient of out [B, ceil(T / C), H, D] (varlen: [1, total_chunks, H, D])"),
        ("dx", "output: the gradient of x [B, T, H, D] (varlen: packed [1, total_T, H, D]), dout's dtype"),
        ("cu_seqlens", "input: sequence prefix sums [num_seqs + 1], i32, from 0, non-decreasing"),
        ("chunk_size", "scalar: C, tokens per chunk (>= 1); the last chunk of a sequence may be shorter"),
    ]
}

/// The tile IR of one kernel (verified), named `name`.
pub fn build(name: &str, k: &PoolKernel) -> Result<Kernel, VerifyError> {
    let (bh, d) = (k.block_h, k.head_dim);
    let mut b = KernelBuilder::new(name);
    let t4 = Type::Tensor(k.dtype, 4);
    // Parameters in ABI order: the tensor read, the tensor written, cu_seqlens, C.
    let (src_name, dst_name) = if k.backward { ("dout", "dx") } else { ("x", "out") };
    let src = b.param(src_name, t4.clone());
    let dst = b.param(dst_name, t4);
    let cu_seqlens = k.varlen.then(|| b.param("cu_seqlens", Type::Tensor(DType::I32, 1)));
    let chunk_size = b.param("chunk_size", Type::Scalar(DType::I32));
    let batch_axis = if k.varlen { GridExpr::sym("num_seqs") } else { GridExpr::sym("batch") };
    let chunk_axis = if k.varlen { GridExpr::sym("max_chunks") } else { GridExpr::sym("num_chunks") };
    b.set_grid([chunk_axis, GridExpr::cdiv(GridExpr::sym("heads"), bh as i64), batch_axis]);
    for (key, value) in [
        ("op", "mean_pooling".to_string()),
        ("direction", if k.backward { "bwd" } else { "fwd" }.to_string()),
        ("varlen", k.varlen.to_string()),
        ("dtype", k.dtype.to_string()),
        ("head_dim", d.to_string()),
        ("block_h", bh.to_string()),
    ] {
        b.attr(key, value);
    }

    // ---- program coordinates ----
    let chunk_idx = b.program_id(0);
    let head_block = b.program_id(1);
    let batch = b.program_id(2);
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    // A chunk size below 1 is the caller's error (the reference refuses it); clamping
    // keeps the kernel's loops finite and its divisions defined whatever it is given.
    let chunk = b.max(chunk_size, c1);
    let block_h_c = b.const_i32(bh as i64);
    let h0 = b.mul(head_block, block_h_c);

    // The rows of the token tensor (x or dx) this program's sequence owns,
    // [seq_start, seq_start + seq_len), and the row of its first chunk in the chunk
    // tensor (out or dout). Both tensors are indexed at batch `tensor_batch`.
    let tokens = if k.backward { dst } else { src };
    let (tensor_batch, seq_start, seq_len, chunk_base, heads_live) = match cu_seqlens {
        None => {
            let seq_len = b.dim(tokens, 1);
            (batch, c0, seq_len, c0, None)
        }
        Some(cu) => {
            let next = b.add(batch, c1);
            let seq_start = b.load(cu, vec![Axis::Index(batch)], 0.0);
            let seq_end = b.load(cu, vec![Axis::Index(next)], 0.0);
            let seq_len = b.sub(seq_end, seq_start);
            // Chunks of the sequences before this one: the offset of ours in the
            // packed chunk tensor. A loop over at most num_seqs sequences, cheaper than
            // a second launch for a prefix sum.
            let chunk_base = b.for_loop(c0, batch, c1, &[c0], |b, s, carried| {
                let s_next = b.add(s, c1);
                let lo = b.load(cu, vec![Axis::Index(s)], 0.0);
                let hi = b.load(cu, vec![Axis::Index(s_next)], 0.0);
                let len = b.sub(hi, lo);
                let n_chunks = chunks_of(b, len, chunk);
                vec![b.add(carried[0], n_chunks)]
            })[0];
            // The grid covers the longest sequence; a chunk past this sequence's last
            // one has nothing to do. Bounding the head range by 0 there turns its
            // loads and stores off without a branch (stores inside `scf.if` are not
            // something every back end handles alike).
            let n_chunks = chunks_of(&mut b, seq_len, chunk);
            let live = b.cmp(CmpPred::Lt, chunk_idx, n_chunks);
            let heads = b.dim(src, 2);
            let heads_live = b.select(live, heads, c0);
            (c0, seq_start, seq_len, chunk_base, Some(heads_live))
        }
    };

    // ---- the chunk: tokens [t0, t0 + count) of the sequence ----
    let t0 = b.mul(chunk_idx, chunk);
    // min(seq_len - t0, C), not min(seq_len, t0 + C): t0 + C may overflow i32 for a
    // huge C, seq_len - t0 cannot. Dead varlen programs get count <= 0: clamped to 1
    // so that their (never stored) division stays finite.
    let left = b.sub(seq_len, t0);
    let count = b.min(left, chunk);
    let row_lo = b.add(seq_start, t0);
    let row_hi = b.add(row_lo, count);
    let count = b.max(count, c1);
    let count_f = b.cast(count, DType::F32);
    let chunk_row = b.add(chunk_base, chunk_idx);

    // The `[block_h, D]` tile of rows `row` of a tensor: heads from h0 (bounded by the
    // tensor's head extent, and by `heads_live` for varlen), the whole head dim.
    let tile_at = |row: Value| {
        vec![
            Axis::Index(tensor_batch),
            Axis::Index(row),
            Axis::Range { start: h0, size: bh, limit: heads_live },
            Axis::Range { start: c0, size: d, limit: None },
        ]
    };

    if k.backward {
        // d out / d x = 1 / count for each token of the chunk: one gradient tile,
        // scaled once, stored to every token.
        let dout_tile = b.load(src, tile_at(chunk_row), 0.0);
        let dout_f = b.cast(dout_tile, DType::F32);
        let g = b.div(dout_f, count_f);
        let dx_tile = b.cast(g, k.dtype);
        b.for_loop(row_lo, row_hi, c1, &[], |b, t, _| {
            b.store(dst, tile_at(t), dx_tile);
            vec![]
        });
    } else {
        let acc = b.full(0.0, DType::F32, &[bh, d]);
        let acc = b.for_loop(row_lo, row_hi, c1, &[acc], |b, t, carried| {
            let x_tile = b.load(src, tile_at(t), 0.0);
            let x_f = b.cast(x_tile, DType::F32);
            vec![b.add(carried[0], x_f)]
        })[0];
        let mean = b.div(acc, count_f);
        let out_tile = b.cast(mean, k.dtype);
        b.store(dst, tile_at(chunk_row), out_tile);
    }
    b.finish()
}

/// ceil(len / chunk) for len >= 0 and chunk >= 1, as `len / chunk + min(len % chunk, 1)`:
/// `(len + chunk - 1) / chunk` would overflow i32 for a chunk near its maximum.
fn chunks_of(b: &mut KernelBuilder, len: Value, chunk: Value) -> Value {
    let whole = b.div(len, chunk);
    let rest = b.binary(BinOp::Rem, len, chunk);
    let c1 = b.const_i32(1);
    let partial = b.min(rest, c1);
    b.add(whole, partial)
}
