//! The flash-attention forward as an [`Operation`]: how its spec decodes, which kernels
//! and plans it has, how a call is checked, and its reference.
//!
//! ```
//! use ejc_ir::op::Operation;
//! let op = ejc_ir::ops::get("flash_attention_fwd").unwrap();
//! assert_eq!(op.plan_names(), ["single", "split_kv"]);
//! assert_eq!(op.dims()[0].name, "batch");
//! ```
//!
//! Plans: `single` runs one kernel (role `main`); `split_kv` (when the spec's schedule
//! lists `num_splits`; not for varlen) runs the key range in `num_splits` pieces (role
//! `partial`, per-split outputs and log-sum-exps in f32 temporaries) and merges them
//! (role `combine`, which also adds the sinks): for decode-like calls with few query
//! rows and long keys, where one program per query block leaves the GPU idle.

use std::collections::BTreeMap;

use serde_json::json;

use super::abi::abi_params;
use super::features::{decode_variant, features_match, CallFeatures, Features, SoftCap, Window, VARIANT_FIELDS};
use super::inputs::{default_runtime, random_inputs};
use super::problem::{FlashInputs, FlashRuntime, FlashShape};
use crate::ir::Kernel;
use crate::manifest::{Launch, Temporary};
use crate::op::{
    self, AxisDecl, AxisKind, CallView, Config, DimDecl, HostCall, KernelInstance, Keys, Operation, PlanDecl, RoleDecl,
    ScalarDecl, Scalars, Sizes, Work,
};
use crate::spec::{Decoder, Fields, Spec};
use crate::tensor::HostTensor;
use crate::types::{DType, Type};

/// The operation (registered in [`crate::ops`]).
pub struct FlashAttentionFwd;

/// Rows per program of the split-KV combine kernel, and its warps (16 rows per warp
/// is the register layout of every back end).
const COMBINE_BLOCK_M: u32 = 16;
const COMBINE_WARPS: u32 = 1;

fn block_check(v: i64) -> Option<&'static str> {
    if v <= 0 || v & (v - 1) != 0 {
        Some("block size is not a power of two")
    } else if !(16..=256).contains(&v) {
        Some("block size is out of range")
    } else {
        None
    }
}

/// Query rows: also 192, three warpgroups' 64-row blocks on Hopper (with 12 warps:
/// FlashAttention-3's tile at d = 64).
fn block_m_check(v: i64) -> Option<&'static str> {
    if v == 192 {
        None
    } else {
        block_check(v)
    }
}

pub(super) const AXES: &[AxisDecl] = &[
    AxisDecl {
        name: "block_m",
        kind: AxisKind::Tile,
        required: true,
        noun: "block size",
        allowed: "a power of two from 16 to 256, or 192",
        list_allowed: "a non-empty list of powers of two from 16 to 256 (or 192)",
        check: block_m_check,
    },
    AxisDecl {
        name: "block_n",
        kind: AxisKind::Tile,
        required: true,
        noun: "block size",
        allowed: "a power of two from 16 to 256",
        list_allowed: "a non-empty list of powers of two from 16 to 256",
        check: block_check,
    },
    AxisDecl {
        name: "num_warps",
        kind: AxisKind::Launch,
        required: true,
        noun: "warp count",
        allowed: "1, 2, 4, 8, 12 or 16",
        list_allowed: "a non-empty list of warp counts from 1, 2, 4, 8, 12 or 16",
        check: |v| (![1, 2, 4, 8, 12, 16].contains(&v)).then_some("unsupported warp count"),
    },
    AxisDecl {
        name: "num_stages",
        kind: AxisKind::Launch,
        required: true,
        noun: "stage count",
        allowed: "an integer from 1 to 8",
        list_allowed: "a non-empty list of stage counts from 1 to 8",
        check: |v| (!(1..=8).contains(&v)).then_some("pipeline stage count is out of range"),
    },
    AxisDecl {
        name: "num_splits",
        kind: AxisKind::Runtime,
        required: false,
        noun: "split count",
        allowed: "an integer from 1 to 256",
        list_allowed: "a non-empty list of split counts from 1 to 256",
        check: |v| (!(1..=256).contains(&v)).then_some("the split count is out of range"),
    },
];

const DIMS: &[DimDecl] = &[
    DimDecl { name: "batch", default: 2, optional: false, doc: "batch size (varlen: the number of packed sequences)" },
    DimDecl { name: "seq_q", default: 77, optional: false, doc: "query length (varlen: the longest)" },
    DimDecl { name: "seq_k", default: 93, optional: false, doc: "key length (varlen: the longest)" },
    DimDecl { name: "heads_q", default: 4, optional: false, doc: "query heads" },
    DimDecl { name: "heads_kv", default: 2, optional: false, doc: "key/value heads (divides heads_q: GQA/MQA)" },
    DimDecl {
        name: "head_dim",
        default: 64,
        optional: false,
        doc: "head dimension of q and k (compiled in: one of the spec's head_dims)",
    },
    DimDecl {
        name: "head_dim_v",
        default: 0,
        optional: true,
        doc: "head dimension of v and the output (compiled in; default: head_dim)",
    },
];

pub(super) fn features(f: &op::Features) -> Result<Features, String> {
    Features::from_json(f)
}

/// The compile-time keys of a q/k head dim `d` and value head dim `dv`: `head_dim`, and
/// `head_dim_v` only where it differs (so the usual case reads as it always has).
pub fn key_set(d: u32, dv: u32) -> Keys {
    let mut k = Keys::from([("head_dim".to_string(), d)]);
    if dv != d {
        k.insert("head_dim_v".into(), dv);
    }
    k
}

/// The keys of sizes `head_dim` and (where given and positive) `head_dim_v`.
pub(crate) fn head_dim_keys(dims: &Sizes) -> Keys {
    let d = dims.get("head_dim").copied().unwrap_or(0).max(0) as u32;
    let dv = dims.get("head_dim_v").copied().filter(|v| *v > 0).map_or(d, |v| v as u32);
    key_set(d, dv)
}

/// The keys of a call whose rank-4 query and value tensors (`names`) end in their head
/// dims (`shape`: the query's axes in words, for the error).
pub(crate) fn qv_keys(call: &dyn CallView, (q, v): (&str, &str), shape: &str) -> Result<Keys, String> {
    let qt = call.tensor(q).ok_or_else(|| format!("argument `{q}` is missing"))?;
    if qt.shape.len() != 4 {
        return Err(format!("argument `{q}`: shape {:?} is not {shape}", qt.shape));
    }
    let dv = match call.tensor(v) {
        Some(vt) if vt.shape.len() == 4 => vt.shape[3] as u32,
        _ => qt.shape[3] as u32,
    };
    Ok(key_set(qt.shape[3] as u32, dv))
}

/// The value head dim of an instance's keys.
pub fn head_dim_v(keys: &Keys) -> Option<u32> {
    keys.get("head_dim_v").or(keys.get("head_dim")).copied()
}

/// The flash runtime of a call's scalars (the defaults where a scalar is absent).
pub fn runtime_of(scalars: &Scalars, head_dim: usize) -> FlashRuntime {
    let get = |k: &str| scalars.get(k).copied();
    FlashRuntime {
        softmax_scale: get("softmax_scale").unwrap_or(1.0 / (head_dim as f64).sqrt()),
        window: (get("window_left").unwrap_or(0.0) as i64, get("window_right").unwrap_or(0.0) as i64),
        softcap: get("logits_soft_cap").unwrap_or(1.0),
        dropout_p: get("dropout_p").unwrap_or(0.0),
        seed: (get("seed_lo").unwrap_or(0.0) as u64) | ((get("seed_hi").unwrap_or(0.0) as u64) << 32),
    }
}

/// The scalars of a variant's call with run-time values `rt` (only those its kernels take).
pub fn scalars_of(f: &Features, rt: &FlashRuntime) -> Scalars {
    let mut s = Scalars::new();
    s.insert("softmax_scale".into(), rt.softmax_scale);
    if f.sliding_window == Some(Window::Runtime) {
        s.insert("window_left".into(), rt.window.0.min(i32::MAX as i64) as f64);
        s.insert("window_right".into(), rt.window.1.min(i32::MAX as i64) as f64);
    }
    if f.logits_soft_cap == Some(SoftCap::Runtime) {
        s.insert("logits_soft_cap".into(), rt.softcap);
    }
    if f.dropout {
        s.insert("dropout_p".into(), rt.dropout_p);
        s.insert("seed_lo".into(), (rt.seed & 0xffff_ffff) as f64);
        s.insert("seed_hi".into(), (rt.seed >> 32) as f64);
    }
    s
}

/// A host call from flash inputs (outputs allocated, NaN-filled) and run-time values.
pub fn host_call(f: &Features, rt: &FlashRuntime, inputs: &FlashInputs) -> HostCall {
    host_call_owned(f, rt, inputs.clone())
}

/// [`host_call`] taking the inputs (no copy of them).
pub fn host_call_owned(f: &Features, rt: &FlashRuntime, inputs: FlashInputs) -> HostCall {
    let outs = super::abi::alloc_outputs(&inputs);
    let FlashInputs { q, k, v, bias, mask, q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, sinks } = inputs;
    let mut tensors = BTreeMap::new();
    tensors.insert("q".into(), q);
    tensors.insert("k".into(), k);
    tensors.insert("v".into(), v);
    let opt = [
        ("bias", bias),
        ("mask", mask),
        ("q_segment_ids", q_segment_ids),
        ("kv_segment_ids", kv_segment_ids),
        ("cu_seqlens_q", cu_seqlens_q),
        ("cu_seqlens_k", cu_seqlens_k),
        ("sinks", sinks),
    ];
    for (n, t) in opt {
        if let Some(t) = t {
            tensors.insert(n.to_string(), t);
        }
    }
    tensors.insert("out".into(), outs.out);
    tensors.insert("lse".into(), outs.lse);
    HostCall { tensors, scalars: scalars_of(f, rt) }
}

/// The flash inputs of a host call.
pub fn inputs_of(call: &HostCall) -> Result<FlashInputs, String> {
    let need = |n: &str| call.tensors.get(n).cloned().ok_or_else(|| format!("the call has no `{n}`"));
    let opt = |n: &str| call.tensors.get(n).cloned();
    Ok(FlashInputs {
        q: need("q")?,
        k: need("k")?,
        v: need("v")?,
        bias: opt("bias"),
        mask: opt("mask"),
        q_segment_ids: opt("q_segment_ids"),
        kv_segment_ids: opt("kv_segment_ids"),
        cu_seqlens_q: opt("cu_seqlens_q"),
        cu_seqlens_k: opt("cu_seqlens_k"),
        sinks: opt("sinks"),
    })
}

pub(super) fn shape_of(dims: &Sizes) -> Result<FlashShape, String> {
    let g = |k: &str| -> Result<usize, String> {
        dims.get(k).map(|v| *v as usize).ok_or_else(|| format!("size `{k}` is missing"))
    };
    let s = FlashShape {
        batch: g("batch")?,
        seq_q: g("seq_q")?,
        seq_k: g("seq_k")?,
        heads_q: g("heads_q")?,
        heads_kv: g("heads_kv")?,
        head_dim: g("head_dim")?,
        head_dim_v: match dims.get("head_dim_v") {
            Some(&v) if v > 0 => v as usize,
            _ => g("head_dim")?,
        },
    };
    s.validate()?;
    Ok(s)
}

fn dims_of(s: &FlashShape) -> Sizes {
    Sizes::from([
        ("batch".to_string(), s.batch as i64),
        ("seq_q".to_string(), s.seq_q as i64),
        ("seq_k".to_string(), s.seq_k as i64),
        ("heads_q".to_string(), s.heads_q as i64),
        ("heads_kv".to_string(), s.heads_kv as i64),
        ("head_dim".to_string(), s.head_dim as i64),
        ("head_dim_v".to_string(), s.head_dim_v as i64),
    ])
}

/// The logical problem of validated sizes: varlen's batch is its sequence count and its
/// lengths the longest.
pub fn problem_of(sizes: &Sizes) -> FlashShape {
    let g = |k: &str| sizes.get(k).copied().unwrap_or(0).max(0) as usize;
    let varlen = sizes.contains_key("num_seqs");
    FlashShape {
        batch: if varlen { g("num_seqs") } else { g("batch") },
        seq_q: if varlen { g("max_seqlen_q") } else { g("seq_q") },
        seq_k: if varlen { g("max_seqlen_k") } else { g("seq_k") },
        heads_q: g("heads_q"),
        heads_kv: g("heads_kv"),
        head_dim: g("head_dim"),
        head_dim_v: match g("head_dim_v") {
            0 => g("head_dim"),
            v => v,
        },
    }
}

/// The spec's `head_dims`: multiples of 16 from 16 to 256, or `{qk: D, v: DV}` where the
/// value head dim differs (the keys `head_dim`, and `head_dim_v` with one key set per
/// pair where any differs). Shared by the operations whose value head dim may differ.
pub(crate) fn decode_head_dim_pairs(
    d: &mut Decoder,
    f: &Fields,
    keys: &mut Vec<(String, Vec<u32>)>,
    sets: &mut Vec<Keys>,
) {
    let allowed = "a multiple of 16 from 16 to 256";
    let list_allowed = "a non-empty list of head dimensions: multiples of 16 from 16 to 256, or \
                        `{qk: D, v: DV}` where the value head dimension differs";
    let check = |v: i64| {
        if v % 16 != 0 {
            Some("head dimension is not a multiple of 16")
        } else if !(16..=256).contains(&v) {
            Some("head dimension is out of range")
        } else {
            None
        }
    };
    if let Some(v) = d.required(f, "head_dims", list_allowed) {
        // Each entry: (q/k head dim, value head dim).
        let pairs = d.unique_list(v, "head_dims", "head dimension", list_allowed, |d, node, path| {
            if !matches!(node.kind, crate::spec::yaml::NodeKind::Map(_)) {
                let v = u32::try_from(d.int(node, path, allowed, check)?).ok()?;
                return Some((v, v));
            }
            let pair_allowed = "`{qk: D, v: DV}`: the q/k and the value head dimension";
            let f = d.fields(node, path, &["qk", "v"], "head dimension field", pair_allowed)?;
            let qk = d.required(&f, "qk", allowed);
            let vv = d.required(&f, "v", allowed);
            let qk = u32::try_from(d.int(qk?, &f.path("qk"), allowed, check)?).ok()?;
            let vv = u32::try_from(d.int(vv?, &f.path("v"), allowed, check)?).ok()?;
            Some((qk, vv))
        });
        let mut qk: Vec<u32> = Vec::new();
        let mut dv: Vec<u32> = Vec::new();
        for &(a, b) in &pairs {
            if !qk.contains(&a) {
                qk.push(a);
            }
            if a != b && !dv.contains(&b) {
                dv.push(b);
            }
        }
        keys.push(("head_dim".into(), qk));
        if !dv.is_empty() {
            keys.push(("head_dim_v".into(), dv));
            sets.extend(pairs.iter().map(|&(a, b)| key_set(a, b)));
        }
    }
}

pub(super) fn expect_shape(call: &dyn CallView, name: &str, want: &[usize]) -> Result<(), String> {
    let t = call.tensor(name).ok_or_else(|| format!("argument `{name}` is missing"))?;
    if t.shape != want {
        return Err(format!("argument `{name}` has shape {:?}, expected {want:?}", t.shape));
    }
    Ok(())
}

impl Operation for FlashAttentionFwd {
    fn name(&self) -> &'static str {
        "flash_attention_fwd"
    }

    fn summary(&self) -> &'static str {
        "flash-attention forward: output and log-sum-exp, BSHD, GQA/MQA, every mask and score feature"
    }

    fn dtypes(&self) -> &'static [DType] {
        &[DType::BF16, DType::F16, DType::F32]
    }

    fn dtype_refusal(&self) -> &'static str {
        "cannot be an attention input"
    }

    fn fields(&self) -> &'static [&'static str] {
        &["layout", "head_dims"]
    }

    fn decode_fields(&self, d: &mut Decoder, f: &Fields, keys: &mut Vec<(String, Vec<u32>)>, sets: &mut Vec<Keys>) {
        if let Some(v) = f.value("layout") {
            d.choice(v, "layout", "layout", &["bshd"]);
        }
        decode_head_dim_pairs(d, f, keys, sets);
    }

    fn variant_fields(&self) -> &'static [&'static str] {
        VARIANT_FIELDS
    }

    fn variant_allowed(&self) -> &'static str {
        "a mapping of features such as `causal: true`; `{}` for plain full attention"
    }

    fn decode_variant(&self, d: &mut Decoder, f: &Fields) -> op::Features {
        decode_variant(d, f).to_json()
    }

    fn describe(&self, f: &op::Features) -> String {
        features(f).map(|f| f.describe()).unwrap_or_else(|e| e)
    }

    fn axes(&self) -> &'static [AxisDecl] {
        AXES
    }

    fn plan_names(&self) -> &'static [&'static str] {
        &["single", "split_kv"]
    }

    fn plans(&self, spec: &Spec, f: &op::Features) -> Vec<PlanDecl> {
        let mut plans = vec![PlanDecl::single(&["block_m", "block_n"])];
        let varlen = features(f).map(|f| f.varlen).unwrap_or(true);
        if !spec.schedule.values("num_splits").is_empty() && !varlen {
            let o = "o_partial".to_string();
            let l = "lse_partial".to_string();
            plans.push(PlanDecl {
                name: "split_kv",
                roles: vec![
                    RoleDecl { name: "partial", tile_axes: vec!["block_m", "block_n"], fixed: Config::new() },
                    RoleDecl {
                        name: "combine",
                        tile_axes: vec![],
                        fixed: Config::from([
                            ("block_m".to_string(), COMBINE_BLOCK_M),
                            ("num_warps".to_string(), COMBINE_WARPS),
                        ]),
                    },
                ],
                temporaries: vec![
                    Temporary {
                        name: o,
                        dtype: "f32".into(),
                        shape: ["num_splits", "batch", "heads_q", "seq_q", "head_dim_v"].map(String::from).to_vec(),
                        fill: "none".into(),
                        given: false,
                    },
                    Temporary {
                        name: l,
                        dtype: "f32".into(),
                        shape: ["num_splits", "batch", "heads_q", "seq_q"].map(String::from).to_vec(),
                        fill: "none".into(),
                        given: false,
                    },
                ],
                launches: vec![Launch::of("partial"), Launch::of("combine")],
                runtime_axes: vec!["num_splits"],
                shared_axes: vec![],
            });
        }
        plans
    }

    fn kernel_id(&self, spec_name: &str, k: &KernelInstance) -> String {
        let hd = k.keys.get("head_dim").copied().unwrap_or(0);
        let dv = match k.keys.get("head_dim_v") {
            Some(v) => format!("v{v}"),
            None => String::new(),
        };
        let base = format!("{spec_name}_{}_{}_d{hd}{dv}", k.variant.name, k.dtype);
        let (m, n) = (k.tile.get("block_m").copied().unwrap_or(0), k.tile.get("block_n").copied().unwrap_or(0));
        match k.role {
            "partial" => format!("{base}_m{m}_n{n}_split"),
            "combine" => format!("{base}_combine"),
            _ => format!("{base}_m{m}_n{n}"),
        }
    }

    fn build(&self, spec: &Spec, k: &KernelInstance) -> Result<Kernel, String> {
        let f = features(&k.variant.features)?;
        let hd = *k.keys.get("head_dim").ok_or("the instance has no head_dim")? as usize;
        let dv = head_dim_v(&k.keys).unwrap_or(hd as u32) as usize;
        let dims = super::frontend::HeadDims { qk: hd, v: dv };
        let tile = |n: &str| k.tile.get(n).copied().map(|v| v as usize).ok_or(format!("no `{n}` for {}", k.id));
        let mut kernel = match k.role {
            "main" => super::frontend::build_flash_kernel(&k.id, &f, k.dtype, dims, tile("block_m")?, tile("block_n")?),
            "partial" => super::frontend::build_flash_partial_kernel(
                &k.id,
                &f,
                k.dtype,
                dims,
                tile("block_m")?,
                tile("block_n")?,
            ),
            "combine" => super::combine::build_flash_combine_kernel(&k.id, &f, k.dtype, dv, tile("block_m")?),
            other => return Err(format!("flash has no role `{other}`")),
        }
        .map_err(|e| e.to_string())?;
        let mut attrs = kernel_attrs(spec, k, hd, dv);
        if k.role != "main" {
            attrs.push(("role".into(), k.role.into()));
        }
        kernel.attrs = attrs;
        Ok(kernel)
    }

    fn param_doc(&self, name: &str) -> &'static str {
        let all = Features::every();
        match name {
            "o_partial" => "temporary: per-split outputs, f32 [num_splits, B, Hq, Sq, Dv]",
            "lse_partial" => "temporary: per-split log-sum-exps, f32 [num_splits, B, Hq, Sq]",
            "num_splits" => "scalar: key splits of the split-KV plan",
            _ => abi_params(&all, DType::F32).into_iter().find(|p| p.name == name).map(|p| p.meaning).unwrap_or(""),
        }
    }

    fn dims(&self) -> &'static [DimDecl] {
        DIMS
    }

    fn call_dtype(&self, call: &dyn CallView) -> Result<DType, String> {
        call.tensor("q")
            .map(|t| t.dtype)
            .ok_or_else(|| "argument `q` is missing (the call's dtype is its dtype)".into())
    }

    fn keys_of(&self, dims: &Sizes) -> Keys {
        head_dim_keys(dims)
    }

    fn call_keys(&self, call: &dyn CallView) -> Result<Keys, String> {
        qv_keys(call, ("q", "v"), "[batch, seq, heads, head_dim]")
    }

    fn dims_of(&self, sizes: &Sizes) -> Sizes {
        dims_of(&problem_of(sizes))
    }

    fn scalars(&self, f: &op::Features) -> Vec<ScalarDecl> {
        let f = features(f).unwrap_or_default();
        let mut out = vec![ScalarDecl { name: "softmax_scale", doc: "multiplies q.k (default 1/sqrt(head_dim))" }];
        if f.sliding_window == Some(Window::Runtime) {
            out.push(ScalarDecl { name: "window_left", doc: "keys visible left of the diagonal (>= 0)" });
            out.push(ScalarDecl { name: "window_right", doc: "keys visible right of the diagonal (>= 0)" });
        }
        if f.logits_soft_cap == Some(SoftCap::Runtime) {
            out.push(ScalarDecl { name: "logits_soft_cap", doc: "soft cap c > 0" });
        }
        if f.dropout {
            out.push(ScalarDecl { name: "dropout_p", doc: "dropout probability in [0, 1)" });
            out.push(ScalarDecl { name: "seed_lo", doc: "low 32 bits of the dropout seed" });
            out.push(ScalarDecl { name: "seed_hi", doc: "high 32 bits of the dropout seed" });
        }
        out
    }

    fn validate(&self, f: &op::Features, dtype: DType, keys: &Keys, call: &dyn CallView) -> Result<Sizes, String> {
        let f = features(f)?;
        let head_dim = keys.get("head_dim").copied().unwrap_or(0) as usize;
        let head_dim_v = head_dim_v(keys).unwrap_or(0) as usize;
        // Every tensor the kernels take: present, dtype and rank.
        for p in abi_params(&f, dtype) {
            if let Type::Tensor(d, rank) = p.ty {
                let t = call.tensor(p.name).ok_or_else(|| {
                    format!("the kernel needs argument `{}` ({}), which the call does not provide", p.name, p.meaning)
                })?;
                if t.dtype != d {
                    return Err(format!("argument `{}` has dtype {}, the kernel takes {d}", p.name, t.dtype));
                }
                if t.shape.len() != rank || t.strides.len() != rank {
                    return Err(format!(
                        "argument `{}` has rank {}, the kernel takes rank {rank}",
                        p.name,
                        t.shape.len()
                    ));
                }
            }
        }
        let q = call.tensor("q").ok_or("argument `q` is missing")?;
        let k = call.tensor("k").ok_or("argument `k` is missing")?;
        let v = call.tensor("v").ok_or("argument `v` is missing")?;
        let (batch, sq, hq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
        let (bk, sk, hkv, dk) = (k.shape[0], k.shape[1], k.shape[2], k.shape[3]);
        if d != head_dim {
            return Err(format!("argument `q` has head_dim {d}, but this kernel is compiled for head_dim {head_dim}"));
        }
        if dk != d || bk != batch {
            return Err(format!(
                "argument `k` has shape {:?}; with q {:?} it must be [{batch}, Sk, Hkv, {d}]",
                k.shape, q.shape
            ));
        }
        let dv = v.shape[3];
        if v.shape[..3] != k.shape[..3] {
            return Err(format!(
                "argument `v` has shape {:?}; with k {:?} it must be [{bk}, {sk}, {hkv}, Dv]",
                v.shape, k.shape
            ));
        }
        if dv != head_dim_v {
            return Err(format!(
                "argument `v` has head_dim {dv}, but this kernel is compiled for a value head_dim of {head_dim_v}"
            ));
        }
        if hkv == 0 || hq % hkv != 0 {
            return Err(format!("heads_q ({hq}) must be a multiple of heads_kv ({hkv})"));
        }
        expect_shape(call, "out", &[batch, sq, hq, dv])?;
        expect_shape(call, "lse", &[batch, hq, sq])?;
        let mut sizes = Sizes::from([
            ("batch".to_string(), batch as i64),
            ("seq_q".to_string(), sq as i64),
            ("seq_k".to_string(), sk as i64),
            ("heads_q".to_string(), hq as i64),
            ("heads_kv".to_string(), hkv as i64),
            ("head_dim".to_string(), d as i64),
            ("head_dim_v".to_string(), dv as i64),
        ]);
        if f.varlen {
            if batch != 1 {
                return Err(format!("varlen: `q` must be packed as [1, total_q, Hq, D], got batch {batch}"));
            }
            let mut longest = [0i64; 2];
            let mut n_seqs = [0usize; 2];
            for (i, (name, total)) in [("cu_seqlens_q", sq), ("cu_seqlens_k", sk)].into_iter().enumerate() {
                let cu = call.int_values(name)?;
                if cu.is_empty() {
                    return Err(format!("argument `{name}` is empty"));
                }
                if cu[0] != 0 || cu.windows(2).any(|w| w[1] < w[0]) || *cu.last().unwrap_or(&0) > total as i64 {
                    return Err(format!(
                        "argument `{name}` must start at 0, never decrease and end at most at {total}; got {cu:?}"
                    ));
                }
                longest[i] = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
                n_seqs[i] = cu.len() - 1;
            }
            if n_seqs[0] != n_seqs[1] {
                return Err(format!(
                    "`cu_seqlens_q` has {} entries and `cu_seqlens_k` {}; they must match",
                    n_seqs[0] + 1,
                    n_seqs[1] + 1
                ));
            }
            sizes.insert("num_seqs".into(), n_seqs[0] as i64);
            sizes.insert("max_seqlen_q".into(), longest[0]);
            sizes.insert("max_seqlen_k".into(), longest[1]);
        }
        if f.bias {
            expect_shape(call, "bias", &[batch, hq, sq, sk])?;
        }
        if f.mask {
            expect_shape(call, "mask", &[batch, hq, sq, sk])?;
        }
        if f.segment_ids {
            expect_shape(call, "q_segment_ids", &[batch, sq])?;
            expect_shape(call, "kv_segment_ids", &[batch, sk])?;
        }
        if f.sinks {
            let s = call.tensor("sinks").ok_or("argument `sinks` is missing")?;
            if s.shape.len() != 2 || s.shape[0] != hq {
                return Err(format!("argument `sinks` has shape {:?}, expected [{hq}, n_sinks]", s.shape));
            }
        }
        // Scalars: present and in range.
        for p in abi_params(&f, dtype) {
            if let Type::Scalar(_) = p.ty {
                let x = call
                    .scalar(p.name)
                    .ok_or_else(|| format!("scalar argument `{}` ({}) is missing", p.name, p.meaning))?;
                let bad = match p.name {
                    "softmax_scale" => !(x as f32).is_finite(),
                    // Negative sides shift the band off the diagonal (ring attention's
                    // blocks; the tuner checks them on small calls, where a side may lie
                    // past the whole block). Down to -2^30: the kernels' i32 band
                    // arithmetic stays in range for any sequence shorter than 2^30.
                    "window_left" | "window_right" => x < -((1u64 << 30) as f64),
                    "logits_soft_cap" => !(x > 0.0 && (x as f32).is_finite()),
                    "dropout_p" => !(0.0..1.0).contains(&(x as f32)),
                    "seed_lo" | "seed_hi" => !(0.0..=u32::MAX as f64).contains(&x),
                    _ => false,
                };
                if bad {
                    return Err(format!("scalar argument `{}` = {x} is out of range ({})", p.name, p.meaning));
                }
            }
        }
        Ok(sizes)
    }

    fn matches(&self, variant: &op::Features, wanted: &op::Features) -> bool {
        match (Features::from_json(variant), CallFeatures::from_json(wanted)) {
            (Ok(v), Ok(c)) => features_match(&v, &c),
            _ => false,
        }
    }

    fn wanted(&self, f: &op::Features, call: &dyn CallView) -> op::Features {
        let Ok(f) = features(f) else { return f.clone() };
        let get = |k: &str| call.scalar(k);
        let window = (get("window_left").unwrap_or(0.0) as i64, get("window_right").unwrap_or(0.0) as i64);
        CallFeatures::of_variant(&f, window, get("logits_soft_cap").unwrap_or(1.0)).to_json()
    }

    fn cache_desc(&self, wanted: &op::Features, dtype: DType, sizes: &Sizes) -> serde_json::Value {
        let s = problem_of(sizes);
        let b = |n: usize| n.max(16).next_power_of_two();
        let mut desc = json!({
            "q": {"shape": [s.batch, b(s.seq_q), s.heads_q, s.head_dim], "dtype": dtype.to_string()},
            "k": {"shape": [s.batch, b(s.seq_k), s.heads_kv, s.head_dim], "dtype": dtype.to_string()},
            "features": wanted,
        });
        if s.head_dim_v != s.head_dim {
            desc["v"] = json!({"shape": [s.batch, b(s.seq_k), s.heads_kv, s.head_dim_v], "dtype": dtype.to_string()});
        }
        desc
    }

    fn random_call(&self, f: &op::Features, dtype: DType, dims: &Sizes, seed: u64) -> Result<HostCall, String> {
        let f = features(f)?;
        let shape = shape_of(dims)?;
        let inputs = random_inputs(&f, dtype, &shape, seed);
        let rt = default_runtime(&f, &shape, seed);
        Ok(host_call_owned(&f, &rt, inputs))
    }

    fn call_elements(&self, f: &op::Features, dims: &Sizes) -> Result<u64, String> {
        let f = features(f)?;
        let s = shape_of(dims)?;
        let FlashShape { batch: b, seq_q: sq, seq_k: sk, heads_q: hq, heads_kv: hk, head_dim: d, head_dim_v: dv } = s;
        let q = op::elements(&[b, sq, hq, d])?;
        let k = op::elements(&[b, sk, hk, d])?;
        let v = op::elements(&[b, sk, hk, dv])?;
        let o = op::elements(&[b, sq, hq, dv])?;
        let mut counts = vec![q, k, v, o, op::elements(&[b, hq, sq])?];
        if f.bias {
            counts.push(op::elements(&[hq, sq, sk])?);
        }
        if f.mask {
            counts.push(op::elements(&[b, sq, sk])?);
        }
        if f.segment_ids {
            counts.push(op::elements(&[b, sq])?);
            counts.push(op::elements(&[b, sk])?);
        }
        op::total_elements(&counts)
    }

    fn reference(&self, f: &op::Features, call: &HostCall) -> Result<BTreeMap<String, HostTensor>, String> {
        let f = features(f)?;
        let inputs = inputs_of(call)?;
        let rt = runtime_of(&call.scalars, inputs.q.shape[3]);
        let r = super::reference::reference(&f, &rt, &inputs)?;
        Ok(BTreeMap::from([("out".to_string(), r.out), ("lse".to_string(), r.lse)]))
    }

    fn outputs(&self, _f: &op::Features) -> Vec<&'static str> {
        vec!["out", "lse"]
    }

    fn small_dims(&self, sizes: &Sizes) -> Sizes {
        let s = problem_of(sizes);
        dims_of(&FlashShape {
            batch: s.batch.min(2),
            seq_q: s.seq_q.min(77),
            seq_k: s.seq_k.min(93),
            heads_q: s.heads_q,
            heads_kv: s.heads_kv,
            head_dim: s.head_dim,
            head_dim_v: s.head_dim_v,
        })
    }

    fn check_dims(&self, keys: &Keys) -> Vec<Sizes> {
        let d = keys.get("head_dim").copied().unwrap_or(64) as usize;
        let dv = head_dim_v(keys).unwrap_or(d as u32) as usize;
        // s_q ≠ s_k both ways, lengths off the block size, GQA 2:1 and 4:1, MQA, one query row.
        [[2, 77, 93, 4, 2], [1, 45, 21, 2, 1], [1, 19, 140, 8, 2], [2, 129, 129, 4, 1], [1, 1, 23, 2, 2]]
            .iter()
            .map(|[b, sq, sk, hq, hkv]| dims_of(&FlashShape::new(*b, *sq, *sk, *hq, *hkv, d).with_head_dim_v(dv)))
            .collect()
    }

    fn work(&self, f: &op::Features, dtype: DType, sizes: &Sizes) -> Work {
        let causal = features(f).map(|f| f.causal).unwrap_or(false);
        let s = problem_of(sizes);
        // Two products: q·kᵀ over head_dim and p·v over head_dim_v.
        let mut flops =
            2.0 * (s.batch * s.heads_q) as f64 * s.seq_q as f64 * s.seq_k as f64 * (s.head_dim + s.head_dim_v) as f64;
        if causal {
            flops /= 2.0;
        }
        let (d, dv) = (s.head_dim as f64, s.head_dim_v as f64);
        let (rows_q, rows_k) = ((s.seq_q * s.heads_q) as f64, (s.seq_k * s.heads_kv) as f64);
        let elems = s.batch as f64 * (rows_q * (d + dv) + rows_k * (d + dv));
        Work { flops, bytes: elems * dtype.size_bytes() as f64 }
    }

    /// 64 × 64 blocks of the one-kernel plan when built (a balanced tiling for both
    /// products), else the first.
    fn heuristic(&self, configs: &[Config]) -> Option<usize> {
        configs
            .iter()
            .position(|c| {
                c.get("block_m") == Some(&64)
                    && c.get("block_n") == Some(&64)
                    && !c.keys().any(|k| k.starts_with("plan:"))
            })
            .or((!configs.is_empty()).then_some(0))
    }
}

/// A kernel's printed metadata (snapshots, dumps; nothing reads it back): op, variant,
/// dtype, head dims, block sizes.
pub(super) fn kernel_attrs(spec: &Spec, k: &KernelInstance, hd: usize, dv: usize) -> Vec<(String, String)> {
    let mut attrs = vec![
        ("op".to_string(), spec.op.clone()),
        ("variant".to_string(), k.variant.name.clone()),
        ("dtype".to_string(), k.dtype.to_string()),
        ("head_dim".to_string(), hd.to_string()),
    ];
    if dv != hd {
        attrs.push(("head_dim_v".to_string(), dv.to_string()));
    }
    for (n, v) in &k.tile {
        if n.starts_with("block_") {
            attrs.push((n.clone(), v.to_string()));
        }
    }
    attrs
}

/// The one-kernel plan's kernel of `variant` at head dims (one `usize`, or
/// [`super::HeadDims`]) and a tiling, named and annotated as
/// `ejc build` compiles it (tests and tools that want one flash kernel of a spec).
pub fn main_kernel(
    spec: &Spec,
    variant: &crate::spec::Variant,
    dtype: DType,
    head_dims: impl Into<super::frontend::HeadDims>,
    block_m: u32,
    block_n: u32,
) -> Result<Kernel, String> {
    let dims = head_dims.into();
    let mut k = KernelInstance {
        id: String::new(),
        variant,
        dtype,
        keys: key_set(dims.qk as u32, dims.v as u32),
        role: "main",
        tile: Config::from([("block_m".to_string(), block_m), ("block_n".to_string(), block_n)]),
    };
    k.id = FlashAttentionFwd.kernel_id(&spec.name, &k);
    FlashAttentionFwd.build(spec, &k)
}
