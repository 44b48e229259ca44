//! The second launch of split-KV flash attention: merge the key splits.
//!
//! ```
//! use ejc_ir::flash::{build_flash_combine_kernel, build_flash_partial_kernel};
//! use ejc_ir::flash::Features;
//! use ejc_ir::types::DType;
//! let f = Features { causal: true, sinks: true, ..Default::default() };
//! let partial = build_flash_partial_kernel("p", &f, DType::BF16, 64, 64, 64).unwrap();
//! let combine = build_flash_combine_kernel("c", &f, DType::BF16, 64, 64).unwrap();
//! assert!(partial.params.iter().all(|p| p.name != "sinks")); // the combine adds them
//! assert!(combine.params.iter().any(|p| p.name == "sinks"));
//! ```
//!
//! The partial kernel ([`super::build_flash_partial_kernel`]) leaves, per key split
//! `s`, the split's normalised output `o_s` and log-sum-exp `lse_s`. A split is one
//! "score" of weight `exp(lse_s)` carrying the value `o_s`, so merging them is the
//! online softmax again, over splits instead of keys, with the IR's own softmax ops:
//! `t = lse_s · log2(e)` is a one-column block of scores in the exp2 domain, and
//! `acc = acc · alpha + p · o_s`. Sinks enter the state first, exactly as in the
//! forward kernel, so they join the denominator once. An empty split (`lse_s = −∞`,
//! `o_s = 0`) contributes nothing, and a row that no split sees finalizes to output 0
//! and LSE −∞: the forward kernel's results, by the same ops.

use std::f64::consts::LOG2_E;

use super::features::Features;
use crate::builder::{Axis, KernelBuilder};
use crate::ir::Kernel;
use crate::types::DType;
use crate::verify::VerifyError;

use super::abi::{abi_params_combine, grid_combine, NUM_SPLITS};
use super::frontend::enter_sinks;

/// Build the split-KV combine kernel: `out` (in `dtype`) and `lse` of the whole key
/// range from the partial kernel's `o_partial` / `lse_partial`. One program per
/// `[block_m]` query rows of one head of one batch entry. ABI:
/// [`super::abi::abi_params_combine`]; grid: [`super::abi::grid_combine`]. Varlen is
/// refused (an error), as for the partial kernel.
pub fn build_flash_combine_kernel(
    name: &str,
    f: &Features,
    dtype: DType,
    head_dim: usize,
    block_m: usize,
) -> Result<Kernel, VerifyError> {
    super::frontend::refuse_varlen(name, f)?;
    let (bm, d) = (block_m, head_dim);
    let mut b = KernelBuilder::new(name);
    let params: Vec<_> = abi_params_combine(f, dtype).into_iter().map(|p| (p.name, b.param(p.name, p.ty))).collect();
    let param = |n: &str| {
        params.iter().find(|(pn, _)| *pn == n).map(|(_, v)| *v).expect("abi_params_combine declares every parameter")
    };
    b.set_grid(grid_combine(f, bm));

    let pid_m = b.program_id(0);
    let head = b.program_id(1);
    let batch = b.program_id(2);
    let c0 = b.const_i32(0);
    let c1 = b.const_i32(1);
    let block_m_c = b.const_i32(bm as i64);
    let i0 = b.mul(pid_m, block_m_c);
    let (o_partial, lse_partial) = (param("o_partial"), param("lse_partial"));
    // Rows past seq_q (lse_partial's last axis) load 0: finite, never stored.
    let rows = Axis::Range { start: i0, size: bm, limit: None };
    let cols = Axis::Range { start: c0, size: d, limit: None };

    // ---- online-softmax state over splits; sinks enter it first, once ----
    let mut m_i = b.full(f64::NEG_INFINITY, DType::F32, &[bm]);
    let mut l_i = b.full(0.0, DType::F32, &[bm]);
    let acc = b.full(0.0, DType::F32, &[bm, d]);
    let log2e = b.const_f32(LOG2_E);
    if f.sinks {
        (m_i, l_i) = enter_sinks(&mut b, param("sinks"), head, bm, (c0, c1, log2e), (m_i, l_i));
    }

    // ---- the split loop: each split is one column of scores, lse_s, valued o_s ----
    let num_splits = param(NUM_SPLITS);
    let finals = b.for_loop(c0, num_splits, c1, &[acc, m_i, l_i], |b, s, carried| {
        let (acc, m_i, l_i) = (carried[0], carried[1], carried[2]);
        let at = [Axis::Index(s), Axis::Index(batch), Axis::Index(head)];
        let lse_s = b.load(lse_partial, [&at[..], &[rows]].concat(), 0.0);
        let t = b.mul(lse_s, log2e);
        let t = b.expand_dims(t, 1);
        let (p, alpha, m_new, l_new) = b.softmax_update(t, m_i, l_i);
        let acc = b.softmax_rescale(acc, alpha);
        let o_s = b.load(o_partial, [&at[..], &[rows, cols]].concat(), 0.0);
        let po = b.mul(p, o_s);
        let acc = b.add(acc, po);
        vec![acc, m_new, l_new]
    });

    // ---- epilogue: the forward kernel's ----
    let (o, lse) = b.softmax_finalize(finals[0], finals[1], finals[2]);
    let o = b.cast(o, dtype);
    b.store(param("out"), vec![Axis::Index(batch), rows, Axis::Index(head), cols], o);
    b.store(param("lse"), vec![Axis::Index(batch), Axis::Index(head), rows], lse);
    b.finish()
}
