//! The kernel ABI of the flash family: parameter order, types and meaning, launch
//! grid, and the binding of a call's inputs to kernel arguments.
//!
//! ```
//! use ejc_ir::flash::abi::abi_params;
//! use ejc_ir::flash::Features;
//! use ejc_ir::types::DType;
//! let f = Features { causal: true, dropout: true, ..Default::default() };
//! let names: Vec<&str> = abi_params(&f, DType::BF16).iter().map(|p| p.name).collect();
//! assert_eq!(names, ["q", "k", "v", "out", "lse", "softmax_scale", "dropout_p", "seed_lo", "seed_hi"]);
//! ```
//!
//! The same order is what back ends emit and what `manifest.json` publishes
//! (docs/abi.md): tensors first (inputs, outputs, optional inputs), then scalars.
//!
//! Split-KV (two launches, for few query rows and long keys) has its own two ABIs,
//! derived from this one: the partial kernel's ([`abi_params_partial`], grid
//! [`grid_partial`]) and the combine kernel's ([`abi_params_combine`], grid
//! [`grid_combine`]). The call supplies the grid symbol [`NUM_SPLITS`] and the
//! temporaries ([`alloc_split_temps`]).

use super::features::{Features, SoftCap, Window};
use crate::interp::{launch_with_stats, Arg, Stats};
use crate::ir::{GridExpr, Kernel};
use crate::tensor::HostTensor;
use crate::types::{DType, Type};

use super::problem::{FlashInputs, FlashOutputs, FlashRuntime};

/// One kernel parameter of the flash ABI.
#[derive(Clone, Debug, PartialEq)]
pub struct AbiParam {
    pub name: &'static str,
    pub ty: Type,
    /// What the parameter is, with its logical shape.
    pub meaning: &'static str,
}

fn p(name: &'static str, ty: Type, meaning: &'static str) -> AbiParam {
    AbiParam { name, ty, meaning }
}

/// The parameters of a kernel of this variant, in order.
pub fn abi_params(f: &Features, dtype: DType) -> Vec<AbiParam> {
    let t4 = Type::Tensor(dtype, 4);
    let mut v = vec![
        p("q", t4.clone(), "input: queries [B, Sq, Hq, D] (varlen: [1, total_q, Hq, D])"),
        p("k", t4.clone(), "input: keys [B, Sk, Hkv, D] (varlen: [1, total_k, Hkv, D])"),
        p("v", t4.clone(), "input: values [B, Sk, Hkv, Dv] (varlen: [1, total_k, Hkv, Dv])"),
        p("out", t4.clone(), "output: attention output [B, Sq, Hq, Dv] (q's shape, v's head dim)"),
        p(
            "lse",
            Type::Tensor(DType::F32, 3),
            "output: log-sum-exp (natural log) [B, Hq, Sq] (varlen: [1, Hq, total_q])",
        ),
    ];
    if f.varlen {
        v.push(p("cu_seqlens_q", Type::Tensor(DType::I32, 1), "input: query prefix sums [num_seqs + 1]"));
        v.push(p("cu_seqlens_k", Type::Tensor(DType::I32, 1), "input: key prefix sums [num_seqs + 1]"));
    }
    if f.bias {
        v.push(p("bias", t4.clone(), "input: additive bias [B, Hq, Sq, Sk] (stride 0 broadcasts)"));
    }
    if f.mask {
        v.push(p(
            "mask",
            Type::Tensor(DType::I1, 4),
            "input: boolean mask, true = attend, [B, Hq, Sq, Sk] (stride 0 broadcasts)",
        ));
    }
    if f.segment_ids {
        v.push(p("q_segment_ids", Type::Tensor(DType::I32, 2), "input: query segment ids [B, Sq], -1 = padding"));
        v.push(p("kv_segment_ids", Type::Tensor(DType::I32, 2), "input: key segment ids [B, Sk], -1 = padding"));
    }
    if f.sinks {
        v.push(p(
            "sinks",
            Type::Tensor(DType::F32, 2),
            "input: sink logits [Hq, n_sinks] (stride 0 on axis 0 shares them)",
        ));
    }
    v.push(p("softmax_scale", Type::Scalar(DType::F32), "scalar: multiplies q.k (usually 1/sqrt(D))"));
    if f.sliding_window == Some(Window::Runtime) {
        v.push(p("window_left", Type::Scalar(DType::I32), "scalar: keys visible to the left of the diagonal (>= 0)"));
        v.push(p("window_right", Type::Scalar(DType::I32), "scalar: keys visible to the right of the diagonal (>= 0)"));
    }
    if f.logits_soft_cap == Some(SoftCap::Runtime) {
        v.push(p("logits_soft_cap", Type::Scalar(DType::F32), "scalar: soft cap c > 0"));
    }
    if f.dropout {
        v.push(p("dropout_p", Type::Scalar(DType::F32), "scalar: dropout probability in [0, 1)"));
        v.push(p("seed_lo", Type::Scalar(DType::U32), "scalar: low 32 bits of the dropout seed"));
        v.push(p("seed_hi", Type::Scalar(DType::U32), "scalar: high 32 bits of the dropout seed"));
    }
    v
}

/// The grid symbol (and scalar parameter) of split-KV: how many key splits.
pub const NUM_SPLITS: &str = "num_splits";

fn o_partial() -> AbiParam {
    p(
        "o_partial",
        Type::Tensor(DType::F32, 5),
        "temporary: normalised output of each key split [num_splits, B, Hq, Sq, D]",
    )
}

fn lse_partial() -> AbiParam {
    p(
        "lse_partial",
        Type::Tensor(DType::F32, 4),
        "temporary: log-sum-exp (natural log) of each key split [num_splits, B, Hq, Sq]",
    )
}

fn num_splits() -> AbiParam {
    p(NUM_SPLITS, Type::Scalar(DType::I32), "scalar: key splits (>= 1); the grid's num_splits")
}

/// The parameters of the split-KV partial kernel: the forward kernel's, with `out` and
/// `lse` replaced (same positions) by `o_partial` and `lse_partial`, without `sinks`
/// (the combine adds them, once), and `num_splits` last.
///
/// ```
/// use ejc_ir::flash::abi::abi_params_partial;
/// use ejc_ir::flash::Features;
/// use ejc_ir::types::DType;
/// let f = Features { causal: true, sinks: true, ..Default::default() };
/// let names: Vec<&str> = abi_params_partial(&f, DType::BF16).iter().map(|p| p.name).collect();
/// assert_eq!(names, ["q", "k", "v", "o_partial", "lse_partial", "softmax_scale", "num_splits"]);
/// ```
pub fn abi_params_partial(f: &Features, dtype: DType) -> Vec<AbiParam> {
    let no_sinks = Features { sinks: false, ..f.clone() };
    let mut v: Vec<AbiParam> = abi_params(&no_sinks, dtype)
        .into_iter()
        .map(|a| match a.name {
            "out" => o_partial(),
            "lse" => lse_partial(),
            _ => a,
        })
        .collect();
    v.push(num_splits());
    v
}

/// The parameters of the split-KV combine kernel: `o_partial`, `lse_partial`, the
/// forward kernel's `out`, `lse` (and `sinks` if the variant has them), `num_splits`.
///
/// ```
/// use ejc_ir::flash::abi::abi_params_combine;
/// use ejc_ir::flash::Features;
/// use ejc_ir::types::DType;
/// let f = Features { causal: true, sinks: true, ..Default::default() };
/// let names: Vec<&str> = abi_params_combine(&f, DType::BF16).iter().map(|p| p.name).collect();
/// assert_eq!(names, ["o_partial", "lse_partial", "out", "lse", "sinks", "num_splits"]);
/// ```
pub fn abi_params_combine(f: &Features, dtype: DType) -> Vec<AbiParam> {
    let mut v = vec![o_partial(), lse_partial()];
    v.extend(abi_params(f, dtype).into_iter().filter(|a| matches!(a.name, "out" | "lse" | "sinks")));
    v.push(num_splits());
    v
}

/// The partial kernel's grid: the forward grid with `batch × num_splits` programs on
/// axis 2 (program `z` is batch entry `z / num_splits`, split `z % num_splits`).
pub fn grid_partial(f: &Features, block_m: usize) -> [GridExpr; 3] {
    let [rows, heads, batch] = grid(f, block_m);
    [rows, heads, GridExpr::Mul(Box::new(batch), Box::new(GridExpr::sym(NUM_SPLITS)))]
}

/// The combine kernel's grid: the forward grid (one program per query block, head
/// and batch entry).
pub fn grid_combine(f: &Features, block_m: usize) -> [GridExpr; 3] {
    grid(f, block_m)
}

/// The launch grid: (query blocks, query heads, batch or sequences).
pub fn grid(f: &Features, block_m: usize) -> [GridExpr; 3] {
    if f.varlen {
        [
            GridExpr::cdiv(GridExpr::sym("max_seqlen_q"), block_m as i64),
            GridExpr::sym("heads_q"),
            GridExpr::sym("num_seqs"),
        ]
    } else {
        [GridExpr::cdiv(GridExpr::sym("seq_q"), block_m as i64), GridExpr::sym("heads_q"), GridExpr::sym("batch")]
    }
}

/// Values of the grid symbols for a call: `batch`, `seq_q`, `seq_k`, `heads_q`,
/// `heads_kv`, `head_dim`, `head_dim_v`, and for varlen `num_seqs`, `max_seqlen_q`, `max_seqlen_k`.
pub fn grid_symbols(inputs: &FlashInputs) -> Vec<(&'static str, i64)> {
    let q = &inputs.q.shape;
    let k = &inputs.k.shape;
    let mut v = vec![
        ("batch", q[0] as i64),
        ("seq_q", q[1] as i64),
        ("seq_k", k[1] as i64),
        ("heads_q", q[2] as i64),
        ("heads_kv", k[2] as i64),
        ("head_dim", q[3] as i64),
        ("head_dim_v", inputs.v.shape[3] as i64),
    ];
    let longest = |cu: &HostTensor| -> i64 {
        let c = cu.to_vec();
        c.windows(2).map(|w| (w[1] - w[0]) as i64).max().unwrap_or(0).max(0)
    };
    if let (Some(cq), Some(ck)) = (&inputs.cu_seqlens_q, &inputs.cu_seqlens_k) {
        v.push(("num_seqs", cq.numel().saturating_sub(1) as i64));
        v.push(("max_seqlen_q", longest(cq)));
        v.push(("max_seqlen_k", longest(ck)));
    }
    v
}

/// Evaluate a kernel's grid for a call.
pub fn launch_grid(kernel: &Kernel, inputs: &FlashInputs) -> Result<[usize; 3], String> {
    launch_grid_with(kernel, inputs, &[])
}

/// [`launch_grid`] with more symbols (split-KV: `(NUM_SPLITS, n)`).
pub fn launch_grid_with(kernel: &Kernel, inputs: &FlashInputs, extra: &[(&str, i64)]) -> Result<[usize; 3], String> {
    let mut syms: Vec<(&str, i64)> = grid_symbols(inputs);
    syms.extend_from_slice(extra);
    let lookup = |s: &str| syms.iter().find(|(n, _)| *n == s).map(|(_, v)| *v);
    let mut g = [0usize; 3];
    for (i, e) in kernel.grid.iter().enumerate() {
        g[i] = e.eval(&lookup)?.max(0) as usize;
    }
    Ok(g)
}

/// Output tensors for a call, filled with NaN so that an element a kernel fails to
/// write can never pass a comparison.
pub fn alloc_outputs(inputs: &FlashInputs) -> FlashOutputs {
    let q = &inputs.q;
    let dv = inputs.v.shape[3];
    let out = HostTensor::full(q.dtype, &[q.shape[0], q.shape[1], q.shape[2], dv], f64::NAN);
    let lse = HostTensor::full(DType::F32, &[q.shape[0], q.shape[2], q.shape[1]], f64::NAN);
    FlashOutputs { out, lse }
}

/// The split-KV temporaries of a call with `num_splits` splits, `o_partial`
/// `[num_splits, B, Hq, Sq, D]` and `lse_partial` `[num_splits, B, Hq, Sq]` (f32),
/// filled with NaN like [`alloc_outputs`]'s.
pub fn alloc_split_temps(inputs: &FlashInputs, num_splits: usize) -> (HostTensor, HostTensor) {
    let q = &inputs.q.shape;
    let (b, sq, hq, d) = (q[0], q[1], q[2], inputs.v.shape[3]);
    let o = HostTensor::full(DType::F32, &[num_splits, b, hq, sq, d], f64::NAN);
    let lse = HostTensor::full(DType::F32, &[num_splits, b, hq, sq], f64::NAN);
    (o, lse)
}

/// Kernel arguments in `kernel`'s parameter order, matched by name.
pub fn bind_args(
    kernel: &Kernel,
    rt: &FlashRuntime,
    inputs: &FlashInputs,
    outputs: &FlashOutputs,
) -> Result<Vec<Arg>, String> {
    bind_args_with(kernel, rt, inputs, outputs, &[])
}

/// [`bind_args`] with more named arguments, which take precedence (split-KV:
/// `o_partial`, `lse_partial`, `num_splits`).
pub fn bind_args_with(
    kernel: &Kernel,
    rt: &FlashRuntime,
    inputs: &FlashInputs,
    outputs: &FlashOutputs,
    extra: &[(&str, Arg)],
) -> Result<Vec<Arg>, String> {
    let mut args = Vec::with_capacity(kernel.params.len());
    let need = |t: &Option<HostTensor>, name: &str| -> Result<Arg, String> {
        t.clone()
            .map(Arg::Tensor)
            .ok_or_else(|| format!("kernel `{}` needs the `{name}` input, which the call did not provide", kernel.name))
    };
    for param in &kernel.params {
        if let Some((_, a)) = extra.iter().find(|(n, _)| *n == param.name) {
            args.push(a.clone());
            continue;
        }
        let arg = match param.name.as_str() {
            "q" => Arg::Tensor(inputs.q.clone()),
            "k" => Arg::Tensor(inputs.k.clone()),
            "v" => Arg::Tensor(inputs.v.clone()),
            "out" => Arg::Tensor(outputs.out.clone()),
            "lse" => Arg::Tensor(outputs.lse.clone()),
            "cu_seqlens_q" => need(&inputs.cu_seqlens_q, "cu_seqlens_q")?,
            "cu_seqlens_k" => need(&inputs.cu_seqlens_k, "cu_seqlens_k")?,
            "bias" => need(&inputs.bias, "bias")?,
            "mask" => need(&inputs.mask, "mask")?,
            "q_segment_ids" => need(&inputs.q_segment_ids, "q_segment_ids")?,
            "kv_segment_ids" => need(&inputs.kv_segment_ids, "kv_segment_ids")?,
            "sinks" => need(&inputs.sinks, "sinks")?,
            "softmax_scale" => Arg::Scalar(rt.softmax_scale),
            "window_left" => Arg::Scalar(rt.window.0 as f64),
            "window_right" => Arg::Scalar(rt.window.1 as f64),
            "logits_soft_cap" => Arg::Scalar(rt.softcap),
            "dropout_p" => Arg::Scalar(rt.dropout_p),
            "seed_lo" => Arg::Scalar((rt.seed & 0xffff_ffff) as f64),
            "seed_hi" => Arg::Scalar((rt.seed >> 32) as f64),
            other => {
                return Err(format!(
                    "kernel `{}` has parameter `{other}`, which the flash ABI does not know",
                    kernel.name
                ))
            }
        };
        args.push(arg);
    }
    Ok(args)
}

/// Run a flash kernel on the interpreter and return its outputs.
pub fn run_interp(kernel: &Kernel, rt: &FlashRuntime, inputs: &FlashInputs) -> Result<FlashOutputs, String> {
    run_interp_with_stats(kernel, rt, inputs).map(|r| r.0)
}

/// [`run_interp`], also returning how often each op ran.
pub fn run_interp_with_stats(
    kernel: &Kernel,
    rt: &FlashRuntime,
    inputs: &FlashInputs,
) -> Result<(FlashOutputs, Stats), String> {
    run_interp_with_args(kernel, rt, inputs, &[])
}

/// [`run_interp_with_stats`] with more named arguments (the tensors of mods that read
/// tensors, e.g. `doc`).
pub fn run_interp_with_args(
    kernel: &Kernel,
    rt: &FlashRuntime,
    inputs: &FlashInputs,
    extra: &[(&str, Arg)],
) -> Result<(FlashOutputs, Stats), String> {
    let outputs = alloc_outputs(inputs);
    let mut args = bind_args_with(kernel, rt, inputs, &outputs, extra)?;
    let grid = launch_grid(kernel, inputs)?;
    let stats = launch_with_stats(kernel, &mut args, grid).map_err(|e| format!("interpreter: {e}"))?;
    let pos = |n: &str| kernel.params.iter().position(|p| p.name == n);
    let take = |i: Option<usize>| -> Result<HostTensor, String> {
        i.and_then(|i| args[i].tensor().cloned()).ok_or_else(|| "kernel has no output tensor".to_string())
    };
    Ok((FlashOutputs { out: take(pos("out"))?, lse: take(pos("lse"))? }, stats))
}
