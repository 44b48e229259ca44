//! Ragged decode attention as an [`Operation`]: one query token per row against its own
//! range of a contiguous key/value buffer — the semantics are in docs/semantics.md
//! ("Ragged decode attention").
//!
//! ```
//! use ejc_ir::op::Operation;
//! let op = ejc_ir::ops::get("ragged_decode_attention").unwrap();
//! assert_eq!(op.plan_names(), ["single", "split_k"]);
//! let dims: Vec<&str> = op.dims().iter().map(|d| d.name).collect();
//! assert_eq!(dims, ["batch", "seq", "heads_q", "heads_kv", "head_dim", "min_len"]);
//! ```

use std::collections::BTreeMap;

use serde_json::json;

use super::reference::{random_inputs, reference, RaggedInputs, RaggedShape};
use crate::ir::Kernel;
use crate::op::{
    self, AxisDecl, CallView, Config, DimDecl, HostCall, KernelInstance, Keys, Operation, PlanDecl, ScalarDecl, Sizes,
    Work,
};
use crate::ops::page_attention::kernels::{param_docs, DecodeKernel, Source};
use crate::ops::page_attention::op::{
    check_soft_cap, decode_build, decode_kernel_id, decode_plans, query_keys, scale_of, AXES,
};
use crate::spec::{Decoder, Fields, Spec};
use crate::tensor::HostTensor;
use crate::types::DType;

/// The operation (registered in [`crate::ops`]).
pub struct RaggedDecode;

/// Sink logits per query head in [`Operation::random_call`]'s calls.
const RANDOM_SINKS: usize = 3;

/// What a variant computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RaggedFeatures {
    /// A run-time soft cap `logits_soft_cap`.
    pub soft_cap: bool,
    /// A run-time `window_left`.
    pub window: bool,
    /// Attention sinks `sinks [H, num_sinks]`.
    pub sinks: bool,
}

impl RaggedFeatures {
    pub fn to_json(self) -> op::Features {
        let mut f = op::Features::new();
        if self.soft_cap {
            f.insert("logits_soft_cap".into(), json!("runtime"));
        }
        if self.window {
            f.insert("sliding_window".into(), json!("runtime"));
        }
        if self.sinks {
            f.insert("sinks".into(), json!(true));
        }
        f
    }

    pub fn from_json(f: &op::Features) -> Result<RaggedFeatures, String> {
        let mut out = RaggedFeatures::default();
        for (k, v) in f {
            match (k.as_str(), v) {
                ("logits_soft_cap", v) if v.as_str() == Some("runtime") => out.soft_cap = true,
                ("sliding_window", v) if v.as_str() == Some("runtime") => out.window = true,
                ("sinks", v) if v.as_bool().is_some() => out.sinks = v.as_bool() == Some(true),
                _ => return Err(format!("unknown ragged_decode_attention feature `{k}` = {v}")),
            }
        }
        Ok(out)
    }
}

fn features(f: &op::Features) -> Result<RaggedFeatures, String> {
    RaggedFeatures::from_json(f)
}

const DIMS: &[DimDecl] = &[
    DimDecl { name: "batch", default: 5, optional: false, doc: "rows (one query token each)" },
    DimDecl { name: "seq", default: 333, optional: false, doc: "T, the key buffer's length (row 0 sees all of it)" },
    DimDecl { name: "heads_q", default: 8, optional: false, doc: "query heads" },
    DimDecl { name: "heads_kv", default: 2, optional: false, doc: "KV heads (divides heads_q)" },
    DimDecl {
        name: "head_dim",
        default: 64,
        optional: false,
        doc: "head dimension (compiled in: one of the spec's head_dims)",
    },
    DimDecl {
        name: "min_len",
        default: 0,
        optional: true,
        doc: "the other rows see [min_len, seq] keys at a random start; 0 also makes row 2 one key and row 3 none",
    },
];

fn shape_of(dims: &Sizes) -> Result<RaggedShape, String> {
    let g = |k: &str| -> Result<usize, String> {
        dims.get(k).map(|v| (*v).max(0) as usize).ok_or_else(|| format!("size `{k}` is missing"))
    };
    let s = RaggedShape {
        batch: g("batch")?,
        seq: g("seq")?,
        heads_q: g("heads_q")?,
        heads_kv: g("heads_kv")?,
        head_dim: g("head_dim")?,
        min_len: dims.get("min_len").copied().unwrap_or(0).max(0) as usize,
    };
    if s.heads_kv == 0 || s.heads_q == 0 || !s.heads_q.is_multiple_of(s.heads_kv) {
        return Err(format!("heads_q ({}) must be a positive multiple of heads_kv ({})", s.heads_q, s.heads_kv));
    }
    if s.min_len > s.seq {
        return Err(format!("min_len ({}) is above seq ({})", s.min_len, s.seq));
    }
    Ok(s)
}

impl Operation for RaggedDecode {
    fn name(&self) -> &'static str {
        "ragged_decode_attention"
    }

    fn summary(&self) -> &'static str {
        "decode attention of one token per row over its own range of a contiguous KV buffer (window, soft cap, sinks)"
    }

    fn dtypes(&self) -> &'static [DType] {
        &[DType::BF16, DType::F16, DType::F32]
    }

    fn dtype_refusal(&self) -> &'static str {
        "cannot be an attention input (bf16, f16 and f32 can)"
    }

    fn fields(&self) -> &'static [&'static str] {
        &["head_dims"]
    }

    fn decode_fields(&self, d: &mut Decoder, f: &Fields, keys: &mut Vec<(String, Vec<u32>)>, _sets: &mut Vec<Keys>) {
        op::decode_head_dims(d, f, keys)
    }

    fn variant_fields(&self) -> &'static [&'static str] {
        &["logits_soft_cap", "sliding_window", "sinks"]
    }

    fn variant_allowed(&self) -> &'static str {
        "a mapping such as `sliding_window: runtime`, `logits_soft_cap: runtime`, `sinks: true`; `{}` for plain softmax"
    }

    fn decode_variant(&self, d: &mut Decoder, f: &Fields) -> op::Features {
        let runtime = |d: &mut Decoder, name: &str, noun: &str| match f.value(name) {
            Some(v) => d.choice(v, &f.path(name), noun, &["runtime"]).is_some(),
            None => false,
        };
        let soft_cap = runtime(d, "logits_soft_cap", "soft cap");
        let window = runtime(d, "sliding_window", "window");
        let sinks = match f.value("sinks") {
            Some(v) => d.bool(v, &f.path("sinks")).unwrap_or(false),
            None => false,
        };
        RaggedFeatures { soft_cap, window, sinks }.to_json()
    }

    fn describe(&self, f: &op::Features) -> String {
        match features(f) {
            Ok(r) => {
                let mut parts = vec!["softmax(scale q.k) over each row's range"];
                if r.window {
                    parts.push("run-time window left of the query");
                }
                if r.soft_cap {
                    parts.push("soft-capped at run time");
                }
                if r.sinks {
                    parts.push("sinks");
                }
                parts.join(", ")
            }
            Err(e) => e,
        }
    }

    fn axes(&self) -> &'static [AxisDecl] {
        AXES
    }

    fn plan_names(&self) -> &'static [&'static str] {
        &["single", "split_k"]
    }

    fn plans(&self, spec: &Spec, _f: &op::Features) -> Vec<PlanDecl> {
        decode_plans(spec)
    }

    fn kernel_id(&self, spec_name: &str, k: &KernelInstance) -> String {
        decode_kernel_id(spec_name, k)
    }

    fn build(&self, spec: &Spec, k: &KernelInstance) -> Result<Kernel, String> {
        let f = features(&k.variant.features)?;
        decode_build(spec, k, |role, dtype, head_dim, block_h, block_n| DecodeKernel {
            source: Source::Ragged,
            window: f.window,
            sinks: f.sinks,
            ..DecodeKernel::paged(role, f.soft_cap, dtype, head_dim, block_h, block_n)
        })
    }

    fn param_doc(&self, name: &str) -> &'static str {
        param_docs().iter().find(|(n, _)| *n == name).map(|(_, d)| *d).unwrap_or("")
    }

    fn dims(&self) -> &'static [DimDecl] {
        DIMS
    }

    fn call_dtype(&self, call: &dyn CallView) -> Result<DType, String> {
        call.tensor("query").map(|t| t.dtype).ok_or_else(|| "argument `query` is missing".into())
    }

    fn keys_of(&self, dims: &Sizes) -> Keys {
        Keys::from([("head_dim".to_string(), dims.get("head_dim").copied().unwrap_or(0).max(0) as u32)])
    }

    fn call_keys(&self, call: &dyn CallView) -> Result<Keys, String> {
        query_keys(call, "[batch, heads_q, head_dim]")
    }

    fn dims_of(&self, sizes: &Sizes) -> Sizes {
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0);
        Sizes::from([
            ("batch".to_string(), g("num_seqs")),
            ("seq".to_string(), g("seq")),
            ("heads_q".to_string(), g("heads_q")),
            ("heads_kv".to_string(), g("heads_kv")),
            ("head_dim".to_string(), g("head_dim")),
            ("min_len".to_string(), g("min_len")),
        ])
    }

    fn scalars(&self, f: &op::Features) -> Vec<ScalarDecl> {
        let f = features(f).unwrap_or_default();
        let mut out = vec![ScalarDecl { name: "softmax_scale", doc: "multiplies q.k (default 1/sqrt(head_dim))" }];
        if f.soft_cap {
            out.push(ScalarDecl { name: "logits_soft_cap", doc: "soft cap c > 0" });
        }
        if f.window {
            out.push(ScalarDecl { name: "window_left", doc: "keys at most this far left of the query (>= 0)" });
        }
        out
    }

    fn validate(&self, f: &op::Features, dtype: DType, keys: &Keys, call: &dyn CallView) -> Result<Sizes, String> {
        let f = features(f)?;
        let head_dim = keys.get("head_dim").copied().unwrap_or(0) as usize;
        let get =
            |n: &str, dt: DType, rank: usize, what: &str| op::tensor_arg(call, n, self.param_doc(n), dt, rank, what);
        let q = get("query", dtype, 3, "[batch, heads_q, head_dim]")?;
        let k = get("key", dtype, 4, "[batch, seq, heads_kv, head_dim]")?;
        let v = get("value", dtype, 4, "[batch, seq, heads_kv, head_dim]")?;
        get("sequence_start", DType::I32, 1, "[batch]")?;
        get("sequence_end", DType::I32, 1, "[batch]")?;
        let out = get("out", dtype, 3, "[batch, heads_q, head_dim]")?;
        let (b, hq, d) = (q.shape[0], q.shape[1], q.shape[2]);
        if d != head_dim {
            return Err(format!(
                "argument `query` has head_dim {d}, but this kernel is compiled for head_dim {head_dim}"
            ));
        }
        let (t, hkv) = (k.shape[1], k.shape[2]);
        if k.shape[0] != b || k.shape[3] != d {
            return Err(format!("argument `key` has shape {:?}, expected [{b}, seq, heads_kv, {d}]", k.shape));
        }
        if v.shape != k.shape {
            return Err(format!("argument `value` has shape {:?}, `key` {:?}", v.shape, k.shape));
        }
        if hkv == 0 || !hq.is_multiple_of(hkv) {
            return Err(format!("heads_q ({hq}) must be a multiple of `key`'s heads_kv ({hkv})"));
        }
        if out.shape != q.shape {
            return Err(format!("argument `out` has shape {:?}, expected {:?}", out.shape, q.shape));
        }
        scale_of(call)?;
        if f.soft_cap {
            check_soft_cap(call)?;
        }
        let left = if f.window {
            let w = call.scalar("window_left").ok_or("scalar argument `window_left` is missing")?;
            if !(w >= 0.0 && w.fract() == 0.0) {
                return Err(format!("scalar argument `window_left` = {w} must be a non-negative integer"));
            }
            Some(w as i64)
        } else {
            None
        };
        if f.sinks {
            let s = get("sinks", DType::F32, 2, "[heads_q, num_sinks]")?;
            if s.shape[0] != hq {
                return Err(format!("argument `sinks` has shape {:?}: it must be [{hq}, num_sinks]", s.shape));
            }
        }
        let (starts, ends) = (call.int_values("sequence_start")?, call.int_values("sequence_end")?);
        if starts.len() != b || ends.len() != b {
            return Err(format!("`sequence_start` and `sequence_end` must have one entry per row ({b})"));
        }
        let (mut total, mut shortest) = (0i64, i64::MAX);
        for (r, (&s, &e)) in starts.iter().zip(&ends).enumerate() {
            if s < 0 || e > t as i64 || s > e {
                return Err(format!(
                    "row {r}: sequence_start {s}, sequence_end {e} is not a range inside the {t} keys (0 <= start <= end <= {t})"
                ));
            }
            let lo = left.map_or(s, |l| s.max(e - 1 - l));
            total += (e - lo).max(0);
            shortest = shortest.min(e - s);
        }
        Ok(Sizes::from([
            ("num_seqs".to_string(), b as i64),
            ("seq".to_string(), t as i64),
            ("heads_q".to_string(), hq as i64),
            ("heads_kv".to_string(), hkv as i64),
            ("group".to_string(), (hq / hkv) as i64),
            ("head_dim".to_string(), d as i64),
            ("min_len".to_string(), if b == 0 { 0 } else { shortest }),
            ("total_keys".to_string(), total),
        ]))
    }

    fn cache_desc(&self, wanted: &op::Features, dtype: DType, sizes: &Sizes) -> serde_json::Value {
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0);
        let b = |n: i64| (n.max(16) as u64).next_power_of_two();
        json!({
            "batch": b(g("num_seqs")), "seq": b(g("seq")), "heads_q": g("heads_q"), "heads_kv": g("heads_kv"),
            "head_dim": g("head_dim"), "dtype": dtype.to_string(), "features": wanted,
        })
    }

    fn random_call(&self, f: &op::Features, dtype: DType, dims: &Sizes, seed: u64) -> Result<HostCall, String> {
        let p = features(f)?;
        let shape = shape_of(dims)?;
        let x = random_inputs(dtype, &shape, if p.sinks { RANDOM_SINKS } else { 0 }, seed);
        let out = HostTensor::full(dtype, &[shape.batch, shape.heads_q, shape.head_dim], f64::NAN);
        let mut tensors = BTreeMap::from([
            ("query".to_string(), x.query),
            ("key".to_string(), x.key),
            ("value".to_string(), x.value),
            ("sequence_start".to_string(), x.sequence_start),
            ("sequence_end".to_string(), x.sequence_end),
            ("out".to_string(), out),
        ]);
        if let Some(s) = x.sinks {
            tensors.insert("sinks".to_string(), s);
        }
        let mut scalars = BTreeMap::from([("softmax_scale".to_string(), 1.0 / (shape.head_dim.max(1) as f64).sqrt())]);
        if p.soft_cap {
            scalars.insert("logits_soft_cap".to_string(), 2.5);
        }
        if p.window {
            // A third of the buffer: it cuts the longer rows, not the short ones.
            scalars.insert("window_left".to_string(), (shape.seq / 3) as f64);
        }
        Ok(HostCall { tensors, scalars })
    }

    fn call_elements(&self, _f: &op::Features, dims: &Sizes) -> Result<u64, String> {
        let s = shape_of(dims)?;
        let q = op::elements(&[s.batch, s.heads_q + 1, s.head_dim])?;
        let kv = op::elements(&[s.batch, s.seq, s.heads_kv, s.head_dim])?;
        op::total_elements(&[q, q, kv, kv, 2 * s.batch as u64, op::elements(&[s.heads_q, RANDOM_SINKS])?])
    }

    fn reference(&self, f: &op::Features, call: &HostCall) -> Result<BTreeMap<String, HostTensor>, String> {
        let p = features(f)?;
        let t = |n: &str| call.tensors.get(n).cloned().ok_or_else(|| format!("the call has no `{n}`"));
        let x = RaggedInputs {
            query: t("query")?,
            key: t("key")?,
            value: t("value")?,
            sequence_start: t("sequence_start")?,
            sequence_end: t("sequence_end")?,
            sinks: if p.sinks { Some(t("sinks")?) } else { None },
        };
        let scalar = |n: &str| call.scalars.get(n).copied().ok_or_else(|| format!("the call has no `{n}`"));
        let cap = if p.soft_cap { Some(scalar("logits_soft_cap")?) } else { None };
        let left = if p.window { Some(scalar("window_left")? as i64) } else { None };
        let out = reference(&x, scale_of(call)?, cap, left, p.sinks)?;
        Ok(BTreeMap::from([("out".to_string(), out)]))
    }

    fn outputs(&self, _f: &op::Features) -> Vec<&'static str> {
        vec!["out"]
    }

    fn small_dims(&self, sizes: &Sizes) -> Sizes {
        let mut d = self.dims_of(sizes);
        d.insert("batch".into(), d["batch"].min(4));
        d.insert("seq".into(), d["seq"].min(150));
        d.insert("min_len".into(), d["min_len"].min(d["seq"]));
        d
    }

    fn check_dims(&self, keys: &Keys) -> Vec<Sizes> {
        let d = keys.get("head_dim").copied().unwrap_or(64) as i64;
        // [batch, seq, heads_q, heads_kv]: ranges off every key block with an empty and a
        // one-key row, MQA with two head blocks, MHA, one row of one key.
        [[5, 333, 8, 2], [4, 77, 20, 1], [6, 130, 4, 4], [1, 1, 8, 1]]
            .iter()
            .map(|[b, t, hq, hkv]| {
                Sizes::from([
                    ("batch".to_string(), *b),
                    ("seq".to_string(), *t),
                    ("heads_q".to_string(), *hq),
                    ("heads_kv".to_string(), *hkv),
                    ("head_dim".to_string(), d),
                    ("min_len".to_string(), 0),
                ])
            })
            .collect()
    }

    fn work(&self, _f: &op::Features, dtype: DType, sizes: &Sizes) -> Work {
        // Memory-bound: the keys and values each row attends to, read once per KV head;
        // the query read and the output written once. Reported as GB/s.
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0).max(0) as f64;
        let total = match sizes.get("total_keys") {
            Some(t) => *t as f64,
            None => g("num_seqs") * g("seq"),
        };
        let kv = 2.0 * total * g("heads_kv") * g("head_dim");
        let qo = 2.0 * g("num_seqs") * g("heads_q") * g("head_dim");
        // No FLOPs: `ejc bench` then reports GB/s, the figure that limits decode.
        Work { flops: 0.0, bytes: (kv + qo) * dtype.size_bytes() as f64 }
    }

    fn heuristic(&self, configs: &[Config]) -> Option<usize> {
        configs
            .iter()
            .position(|c| c.get("block_n") == Some(&64) && !c.keys().any(|k| k.starts_with("plan:")))
            .or((!configs.is_empty()).then_some(0))
    }
}
