//! Calling flash-attention kernels on the CPU: bind a call's tensors and scalars to a
//! kernel's ABI after checking them, launch, and hand back the outputs.
//!
//! ```no_run
//! # use ejc_runtime::flash::{FlashBuffers, run_cpu};
//! # fn demo(kernel: ejc_runtime::cpu::CpuKernel, call: &mut FlashBuffers, rt: ejc_ir::flash::FlashRuntime) {
//! use ejc_ir::spec::Features;
//! use ejc_ir::types::DType;
//! let features = Features { causal: true, ..Default::default() };
//! run_cpu(&kernel, &features, DType::BF16, 128, 64, &rt, call, 2).unwrap();
//! # }
//! ```
//!
//! Every check names the argument and what was expected, so a wrong call is an error
//! here and never a fault inside a kernel.

use ejc_ir::flash::abi::abi_params;
use ejc_ir::flash::{FlashInputs, FlashOutputs, FlashRuntime};
use ejc_ir::spec::Features;
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::{DType, Type};

use crate::cpu::{scalar_slot, CpuError, CpuKernel, HostBuffer};

/// The tensors of one call in device representation. Outputs are written in place.
#[derive(Clone, Debug)]
pub struct FlashBuffers {
    pub q: HostBuffer,
    pub k: HostBuffer,
    pub v: HostBuffer,
    pub out: HostBuffer,
    pub lse: HostBuffer,
    pub bias: Option<HostBuffer>,
    pub mask: Option<HostBuffer>,
    pub q_segment_ids: Option<HostBuffer>,
    pub kv_segment_ids: Option<HostBuffer>,
    pub cu_seqlens_q: Option<HostBuffer>,
    pub cu_seqlens_k: Option<HostBuffer>,
    pub sinks: Option<HostBuffer>,
}

impl FlashBuffers {
    /// Device buffers for host inputs, with outputs (q's shape, contiguous; LSE
    /// `[B, Hq, Sq]`) filled with NaN so that an unwritten element shows.
    pub fn from_inputs(inputs: &FlashInputs) -> FlashBuffers {
        let conv = |t: &Option<HostTensor>| t.as_ref().map(HostBuffer::from_host);
        let q = &inputs.q;
        FlashBuffers {
            q: HostBuffer::from_host(q),
            k: HostBuffer::from_host(&inputs.k),
            v: HostBuffer::from_host(&inputs.v),
            out: HostBuffer::from_host(&HostTensor::full(q.dtype, &q.shape, f64::NAN)),
            lse: HostBuffer::from_host(&HostTensor::full(DType::F32, &[q.shape[0], q.shape[2], q.shape[1]], f64::NAN)),
            bias: conv(&inputs.bias),
            mask: conv(&inputs.mask),
            q_segment_ids: conv(&inputs.q_segment_ids),
            kv_segment_ids: conv(&inputs.kv_segment_ids),
            cu_seqlens_q: conv(&inputs.cu_seqlens_q),
            cu_seqlens_k: conv(&inputs.cu_seqlens_k),
            sinks: conv(&inputs.sinks),
        }
    }

    pub fn outputs(&self) -> FlashOutputs {
        FlashOutputs { out: self.out.to_host(), lse: self.lse.to_host() }
    }

    /// The buffer of ABI parameter `name`, if the call has it.
    pub fn get(&mut self, name: &str) -> Option<&mut HostBuffer> {
        match name {
            "q" => Some(&mut self.q),
            "k" => Some(&mut self.k),
            "v" => Some(&mut self.v),
            "out" => Some(&mut self.out),
            "lse" => Some(&mut self.lse),
            "bias" => self.bias.as_mut(),
            "mask" => self.mask.as_mut(),
            "q_segment_ids" => self.q_segment_ids.as_mut(),
            "kv_segment_ids" => self.kv_segment_ids.as_mut(),
            "cu_seqlens_q" => self.cu_seqlens_q.as_mut(),
            "cu_seqlens_k" => self.cu_seqlens_k.as_mut(),
            "sinks" => self.sinks.as_mut(),
            _ => None,
        }
    }
}

fn bad(msg: String) -> CpuError {
    CpuError::Invalid(msg)
}

fn expect_shape(name: &str, b: &HostBuffer, want: &[usize]) -> Result<(), CpuError> {
    if b.shape != want {
        return Err(bad(format!("argument `{name}` has shape {:?}, expected {want:?}", b.shape)));
    }
    Ok(())
}

fn int_values(name: &str, b: &HostBuffer) -> Result<Vec<i64>, CpuError> {
    let t = b.to_host();
    Ok(t.to_vec().into_iter().map(|x| x as i64).collect()).and_then(|v: Vec<i64>| {
        if v.is_empty() {
            Err(bad(format!("argument `{name}` is empty")))
        } else {
            Ok(v)
        }
    })
}

/// Check a call against a kernel's ABI; returns the launch grid's symbol values.
pub fn validate(
    features: &Features,
    dtype: DType,
    head_dim: usize,
    call: &mut FlashBuffers,
) -> Result<Vec<(&'static str, i64)>, CpuError> {
    for p in abi_params(features, dtype) {
        if let Type::Tensor(d, rank) = p.ty {
            let Some(b) = call.get(p.name) else {
                return Err(bad(format!(
                    "the kernel needs argument `{}` ({}), which the call does not provide",
                    p.name, p.meaning
                )));
            };
            if b.dtype != d {
                return Err(bad(format!("argument `{}` has dtype {}, the kernel takes {d}", p.name, b.dtype)));
            }
            if b.shape.len() != rank || b.strides.len() != rank {
                return Err(bad(format!(
                    "argument `{}` has rank {}, the kernel takes rank {rank}",
                    p.name,
                    b.shape.len()
                )));
            }
            b.check_bounds().map_err(|e| bad(format!("argument `{}`: {e}", p.name)))?;
        }
    }
    let [batch, sq, hq, d] =
        <[usize; 4]>::try_from(call.q.shape.as_slice()).map_err(|_| bad("`q` must be rank 4".into()))?;
    let [bk, sk, hkv, dk] =
        <[usize; 4]>::try_from(call.k.shape.as_slice()).map_err(|_| bad("`k` must be rank 4".into()))?;
    if d != head_dim {
        return Err(bad(format!("argument `q` has head_dim {d}, but this kernel is compiled for head_dim {head_dim}")));
    }
    if dk != d || bk != batch {
        return Err(bad(format!(
            "argument `k` has shape {:?}; with q {:?} it must be [{batch}, Sk, Hkv, {d}]",
            call.k.shape, call.q.shape
        )));
    }
    if call.v.shape != call.k.shape {
        return Err(bad(format!("argument `v` has shape {:?}, it must equal k's {:?}", call.v.shape, call.k.shape)));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(bad(format!("heads_q ({hq}) must be a multiple of heads_kv ({hkv})")));
    }
    expect_shape("out", &call.out, &[batch, sq, hq, d])?;
    expect_shape("lse", &call.lse, &[batch, hq, sq])?;
    let mut syms = vec![
        ("batch", batch as i64),
        ("seq_q", sq as i64),
        ("seq_k", sk as i64),
        ("heads_q", hq as i64),
        ("heads_kv", hkv as i64),
        ("head_dim", d as i64),
    ];
    if features.varlen {
        if batch != 1 {
            return Err(bad(format!("varlen: `q` must be packed as [1, total_q, Hq, D], got batch {batch}")));
        }
        let mut longest = [0i64; 2];
        let mut n_seqs = 0;
        for (i, (name, total)) in [("cu_seqlens_q", sq), ("cu_seqlens_k", sk)].into_iter().enumerate() {
            let b = call.get(name).ok_or_else(|| bad(format!("varlen needs `{name}`")))?;
            let cu = int_values(name, b)?;
            if cu[0] != 0 || cu.windows(2).any(|w| w[1] < w[0]) || *cu.last().unwrap_or(&0) > total as i64 {
                return Err(bad(format!(
                    "argument `{name}` must start at 0, never decrease and end at most at {total}; got {cu:?}"
                )));
            }
            longest[i] = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
            n_seqs = cu.len() - 1;
        }
        let nq = call.cu_seqlens_q.as_ref().map(|b| b.shape[0]).unwrap_or(0);
        let nk = call.cu_seqlens_k.as_ref().map(|b| b.shape[0]).unwrap_or(0);
        if nq != nk {
            return Err(bad(format!("`cu_seqlens_q` has {nq} entries and `cu_seqlens_k` {nk}; they must match")));
        }
        syms.push(("num_seqs", n_seqs as i64));
        syms.push(("max_seqlen_q", longest[0]));
        syms.push(("max_seqlen_k", longest[1]));
    }
    if features.bias {
        expect_shape("bias", call.bias.as_ref().ok_or_else(|| bad("missing `bias`".into()))?, &[batch, hq, sq, sk])?;
    }
    if features.mask {
        expect_shape("mask", call.mask.as_ref().ok_or_else(|| bad("missing `mask`".into()))?, &[batch, hq, sq, sk])?;
    }
    if features.segment_ids {
        expect_shape(
            "q_segment_ids",
            call.q_segment_ids.as_ref().ok_or_else(|| bad("missing `q_segment_ids`".into()))?,
            &[batch, sq],
        )?;
        expect_shape(
            "kv_segment_ids",
            call.kv_segment_ids.as_ref().ok_or_else(|| bad("missing `kv_segment_ids`".into()))?,
            &[batch, sk],
        )?;
    }
    if features.sinks {
        let s = call.sinks.as_ref().ok_or_else(|| bad("missing `sinks`".into()))?;
        if s.shape.len() != 2 || s.shape[0] != hq {
            return Err(bad(format!("argument `sinks` has shape {:?}, expected [{hq}, n_sinks]", s.shape)));
        }
    }
    Ok(syms)
}

/// The scalar slots of a call, in ABI order; checks their ranges.
pub fn scalars(features: &Features, dtype: DType, rt: &FlashRuntime) -> Result<Vec<u64>, CpuError> {
    let mut out = Vec::new();
    for p in abi_params(features, dtype) {
        let Type::Scalar(d) = p.ty else { continue };
        let x = match p.name {
            "softmax_scale" => {
                if !(rt.softmax_scale as f32).is_finite() {
                    return Err(bad(format!("softmax_scale {} is not a finite f32", rt.softmax_scale)));
                }
                rt.softmax_scale
            }
            "window_left" | "window_right" => {
                let w = if p.name == "window_left" { rt.window.0 } else { rt.window.1 };
                if w < 0 {
                    return Err(bad(format!("{} is {w}; window sides must be >= 0", p.name)));
                }
                w.min(i32::MAX as i64) as f64
            }
            "logits_soft_cap" => {
                if !(rt.softcap > 0.0 && (rt.softcap as f32).is_finite()) {
                    return Err(bad(format!("logits_soft_cap {} must be a positive finite number", rt.softcap)));
                }
                rt.softcap
            }
            "dropout_p" => {
                let p32 = rt.dropout_p as f32;
                if !(0.0..1.0).contains(&p32) {
                    return Err(bad(format!("dropout_p {} must be in [0, 1)", rt.dropout_p)));
                }
                rt.dropout_p
            }
            "seed_lo" => (rt.seed & 0xffff_ffff) as f64,
            "seed_hi" => (rt.seed >> 32) as f64,
            other => return Err(bad(format!("unknown scalar parameter `{other}`"))),
        };
        out.push(scalar_slot(d, x));
    }
    Ok(out)
}

/// Check a call and work out its launch: the grid (from the ABI's formulas) and the
/// scalar slots, in ABI order. Shared by every executor.
pub fn launch_plan(
    features: &Features,
    dtype: DType,
    head_dim: usize,
    block_m: usize,
    rt: &FlashRuntime,
    call: &mut FlashBuffers,
) -> Result<([i64; 3], Vec<u64>), CpuError> {
    let syms = validate(features, dtype, head_dim, call)?;
    let scalars = scalars(features, dtype, rt)?;
    let sym = |n: &str| syms.iter().find(|(k, _)| *k == n).map(|(_, v)| *v).unwrap_or(0);
    let grid = ejc_ir::flash::abi::grid(features, block_m);
    let lookup = |s: &str| Some(sym(s));
    let mut g = [0i64; 3];
    for (i, e) in grid.iter().enumerate() {
        g[i] = e.eval(&lookup).map_err(bad)?;
    }
    Ok((g, scalars))
}

/// The names of the tensor parameters, in ABI order.
pub fn tensor_names(features: &Features, dtype: DType) -> Vec<&'static str> {
    abi_params(features, dtype).into_iter().filter(|p| matches!(p.ty, Type::Tensor(..))).map(|p| p.name).collect()
}

/// Validate and run one flash kernel on the CPU; outputs land in `call.out` / `call.lse`.
#[allow(clippy::too_many_arguments)]
pub fn run_cpu(
    kernel: &CpuKernel,
    features: &Features,
    dtype: DType,
    head_dim: usize,
    block_m: usize,
    rt: &FlashRuntime,
    call: &mut FlashBuffers,
    threads: usize,
) -> Result<(), CpuError> {
    let (g, scalars) = launch_plan(features, dtype, head_dim, block_m, rt, call)?;
    let mut tensors = Vec::new();
    for p in abi_params(features, dtype) {
        if let Type::Tensor(..) = p.ty {
            let b = call.get(p.name).ok_or_else(|| bad(format!("missing `{}`", p.name)))?;
            tensors.push(b.abi());
        }
    }
    // Safety: validate() checked dtypes, ranks, shapes and that strides stay inside
    // each buffer; outputs are separate buffers.
    unsafe { kernel.launch(&tensors, &scalars, g, threads) }
}
