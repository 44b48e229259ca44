//! Ragged paged attention v3 as an [`Operation`]: the new tokens' K and V written into
//! the paged cache, then v2's attention over it — the semantics are in docs/semantics.md
//! ("Ragged paged attention v3").
//!
//! ```
//! use ejc_ir::op::Operation;
//! let op = ejc_ir::ops::get("ragged_page_attention_v3").unwrap();
//! assert_eq!(op.plan_names(), ["packed", "split_k"]);
//! assert_eq!(op.outputs(&Default::default()), ["out", "kv_pages"]);
//! ```

use std::collections::{BTreeMap, BTreeSet};

use serde_json::json;

use super::kernels::param_docs;
use super::op::{build_instance, kernel_id, rpa_plans, shape_of, AXES, DIMS};
use super::reference_v3::{live_sequences, random_inputs, reference, V3Inputs};
use crate::ir::Kernel;
use crate::op::{
    self, AxisDecl, CallView, Config, DimDecl, HostCall, KernelInstance, Keys, Operation, PlanDecl, ScalarDecl, Sizes,
    Work,
};
use crate::ops::page_attention::op::{check_soft_cap, scale_of};
use crate::spec::{Decoder, Fields, Spec};
use crate::tensor::HostTensor;
use crate::types::DType;

/// The operation (registered in [`crate::ops`]).
pub struct RaggedPagedV3;

/// What a variant computes: v2's features without sinks (v3 has none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct V3Features {
    pub soft_cap: bool,
    pub window: bool,
}

impl V3Features {
    pub fn to_json(self) -> op::Features {
        let mut f = op::Features::new();
        if self.soft_cap {
            f.insert("logits_soft_cap".into(), json!("runtime"));
        }
        if self.window {
            f.insert("sliding_window".into(), json!("runtime"));
        }
        f
    }

    pub fn from_json(f: &op::Features) -> Result<V3Features, String> {
        let mut out = V3Features::default();
        for (k, v) in f {
            match (k.as_str(), v.as_str()) {
                ("logits_soft_cap", Some("runtime")) => out.soft_cap = true,
                ("sliding_window", Some("runtime")) => out.window = true,
                _ => return Err(format!("unknown ragged_page_attention_v3 feature `{k}` = {v}")),
            }
        }
        Ok(out)
    }
}

fn features(f: &op::Features) -> Result<V3Features, String> {
    V3Features::from_json(f)
}

/// Scalars of ejkernel's v3 that quantise the cache: refused by name.
const QUANTISED: [&str; 3] = ["q_scale", "k_scale", "v_scale"];

impl Operation for RaggedPagedV3 {
    fn name(&self) -> &'static str {
        "ragged_page_attention_v3"
    }

    fn summary(&self) -> &'static str {
        "ragged paged attention that first writes the new tokens' K and V into the paged cache (decode/prefill/mixed distribution)"
    }

    fn dtypes(&self) -> &'static [DType] {
        &[DType::BF16, DType::F16, DType::F32]
    }

    fn dtype_refusal(&self) -> &'static str {
        "cannot be an attention input (bf16, f16 and f32 can; fp8 caches are not supported: the tile IR has no fp8)"
    }

    fn fields(&self) -> &'static [&'static str] {
        &["head_dims"]
    }

    fn decode_fields(&self, d: &mut Decoder, f: &Fields, keys: &mut Vec<(String, Vec<u32>)>, _sets: &mut Vec<Keys>) {
        op::decode_head_dims(d, f, keys)
    }

    fn variant_fields(&self) -> &'static [&'static str] {
        &["logits_soft_cap", "sliding_window"]
    }

    fn variant_allowed(&self) -> &'static str {
        "a mapping such as `sliding_window: runtime`, `logits_soft_cap: runtime`; `{}` for plain softmax"
    }

    fn decode_variant(&self, d: &mut Decoder, f: &Fields) -> op::Features {
        let runtime = |d: &mut Decoder, name: &str, noun: &str| match f.value(name) {
            Some(v) => d.choice(v, &f.path(name), noun, &["runtime"]).is_some(),
            None => false,
        };
        let soft_cap = runtime(d, "logits_soft_cap", "soft cap");
        let window = runtime(d, "sliding_window", "window");
        V3Features { soft_cap, window }.to_json()
    }

    fn describe(&self, f: &op::Features) -> String {
        match features(f) {
            Ok(r) => {
                let mut parts = vec!["new K/V written into the cache, then causal softmax(scale q.k)"];
                if r.window {
                    parts.push("run-time sliding window");
                }
                if r.soft_cap {
                    parts.push("soft-capped at run time");
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
        &["packed", "split_k"]
    }

    fn plans(&self, spec: &Spec, _f: &op::Features) -> Vec<PlanDecl> {
        rpa_plans(spec, false, true)
    }

    fn kernel_id(&self, spec_name: &str, k: &KernelInstance) -> String {
        kernel_id(spec_name, k)
    }

    fn build(&self, spec: &Spec, k: &KernelInstance) -> Result<Kernel, String> {
        let f = features(&k.variant.features)?;
        build_instance(spec, k, f.soft_cap, f.window, false)
    }

    fn param_doc(&self, name: &str) -> &'static str {
        param_docs().iter().find(|(n, _)| *n == name).map(|(_, d)| *d).unwrap_or("")
    }

    fn dims(&self) -> &'static [DimDecl] {
        DIMS
    }

    fn call_dtype(&self, call: &dyn CallView) -> Result<DType, String> {
        call.tensor("queries").map(|t| t.dtype).ok_or_else(|| "argument `queries` is missing".into())
    }

    fn keys_of(&self, dims: &Sizes) -> Keys {
        Keys::from([("head_dim".to_string(), dims.get("head_dim").copied().unwrap_or(0).max(0) as u32)])
    }

    fn call_keys(&self, call: &dyn CallView) -> Result<Keys, String> {
        let q = call.tensor("queries").ok_or("argument `queries` is missing")?;
        if q.shape.len() != 3 {
            return Err(format!("argument `queries`: shape {:?} is not [total_tokens, heads_q, head_dim]", q.shape));
        }
        Ok(Keys::from([("head_dim".to_string(), q.shape[2] as u32)]))
    }

    fn dims_of(&self, sizes: &Sizes) -> Sizes {
        super::op::RaggedPaged.dims_of(sizes)
    }

    fn scalars(&self, f: &op::Features) -> Vec<ScalarDecl> {
        let f = features(f).unwrap_or_default();
        let mut out = vec![ScalarDecl { name: "softmax_scale", doc: "multiplies q.k (ejkernel's v3 default is 1.0)" }];
        if f.soft_cap {
            out.push(ScalarDecl { name: "logits_soft_cap", doc: "soft cap c > 0" });
        }
        if f.window {
            out.push(ScalarDecl {
                name: "sliding_window",
                doc: "w >= 1: the w most recent positions, the query's own included, are seen",
            });
        }
        out
    }

    fn validate(&self, f: &op::Features, dtype: DType, keys: &Keys, call: &dyn CallView) -> Result<Sizes, String> {
        let f = features(f)?;
        if let Some(n) = QUANTISED.iter().find(|n| call.scalar(n).is_some()) {
            return Err(format!(
                "scalar argument `{n}`: quantised KV caches (fp8 e4m3 storage with q/k/v scales) are not supported: the tile IR has no fp8 type yet"
            ));
        }
        let head_dim = keys.get("head_dim").copied().unwrap_or(0) as usize;
        let get =
            |n: &str, dt: DType, rank: usize, what: &str| op::tensor_arg(call, n, self.param_doc(n), dt, rank, what);
        let q = get("queries", dtype, 3, "[total_tokens, heads_q, head_dim]")?;
        let kn = get("keys", dtype, 3, "[total_tokens, heads_kv, head_dim]")?;
        let vn = get("values", dtype, 3, "[total_tokens, heads_kv, head_dim]")?;
        let kv = get("kv_pages", dtype, 4, "[num_pages, page_size, 2 * heads_kv, head_dim]")?;
        let lens = get("kv_lens", DType::I32, 1, "[num_seqs]")?;
        let tables = get("block_tables", DType::I32, 2, "[num_seqs, pages_per_seq] (a flat table: reshape it)")?;
        let qsl_t = get("query_start_loc", DType::I32, 1, "[num_seqs + 1]")?;
        get("distribution", DType::I32, 1, "[3]")?;
        let out = get("out", dtype, 3, "[total_tokens, heads_q, head_dim]")?;
        let (t, hq, d) = (q.shape[0], q.shape[1], q.shape[2]);
        if d != head_dim {
            return Err(format!(
                "argument `queries` has head_dim {d}, but this kernel is compiled for head_dim {head_dim}"
            ));
        }
        let (pages, page, two_kvh) = (kv.shape[0], kv.shape[1], kv.shape[2]);
        if kv.shape[3] != d || two_kvh == 0 || !two_kvh.is_multiple_of(2) || page == 0 || pages == 0 {
            return Err(format!(
                "argument `kv_pages` has shape {:?}, expected [num_pages >= 1, page_size >= 1, 2 * heads_kv, {d}] (K at even heads, V at odd)",
                kv.shape
            ));
        }
        let hkv = two_kvh / 2;
        if kn.shape != [t, hkv, d] || vn.shape != kn.shape {
            return Err(format!(
                "arguments `keys` and `values` must be [{t}, {hkv}, {d}] (a KV head each of kv_pages' pairs), got {:?} and {:?}",
                kn.shape, vn.shape
            ));
        }
        if !hq.is_multiple_of(hkv) {
            return Err(format!("heads_q ({hq}) must be a multiple of `kv_pages`' heads_kv ({hkv})"));
        }
        let s = lens.shape[0];
        if tables.shape[0] != s || qsl_t.shape[0] != s + 1 {
            return Err(format!(
                "`block_tables` must be [{s}, pages_per_seq] and `query_start_loc` [{}] for {s} sequences, got {:?} and {:?}",
                s + 1,
                tables.shape,
                qsl_t.shape
            ));
        }
        if out.shape != q.shape {
            return Err(format!("argument `out` has shape {:?}, expected {:?}", out.shape, q.shape));
        }
        scale_of(call)?;
        if f.soft_cap {
            check_soft_cap(call)?;
        }
        if f.window {
            let w = call.scalar("sliding_window").ok_or("scalar argument `sliding_window` is missing")?;
            if !(w >= 1.0 && w.fract() == 0.0 && w <= i32::MAX as f64) {
                return Err(format!("scalar argument `sliding_window` = {w} must be an integer >= 1"));
            }
        }
        let (ctx, qsl, table, dist) = (
            call.int_values("kv_lens")?,
            call.int_values("query_start_loc")?,
            call.int_values("block_tables")?,
            call.int_values("distribution")?,
        );
        if qsl.first() != Some(&0) {
            return Err(format!("query_start_loc[0] must be 0, got {:?}", qsl.first()));
        }
        let live = live_sequences(&dist, &ctx, &qsl).map_err(|e| format!("argument `distribution`: {e}"))?;
        let width = tables.shape[1];
        let (mut max_q, mut total_keys, mut new_tokens) = (0i64, 0i64, 0i64);
        let mut written = BTreeSet::new();
        for i in 0..live {
            let (a, e, c) = (qsl[i], qsl[i + 1], ctx[i]);
            if e < a || e > t as i64 {
                return Err(format!(
                    "query_start_loc must be non-decreasing and at most the {t} tokens: entries {i}, {} are {a}, {e}",
                    i + 1
                ));
            }
            if c < 0 || c > (width * page) as i64 {
                return Err(format!("kv_lens[{i}] = {c} is outside [0, {}] (pages_per_seq x page_size)", width * page));
            }
            if e - a > c {
                return Err(format!("sequence {i} has {} new tokens but a kv_len of {c}: kv_len counts them", e - a));
            }
            for p in 0..(c as usize).div_ceil(page) {
                let id = table[i * width + p];
                if id < 0 || id >= pages as i64 {
                    return Err(format!("block_tables[{i}, {p}] = {id} is not a page of the cache (0..{pages})"));
                }
            }
            for pos in (c - (e - a))..c {
                let at = (table[i * width + pos as usize / page], pos as usize % page);
                if !written.insert(at) {
                    return Err(format!(
                        "sequence {i}'s new token at position {pos} writes row {} of page {}, which another new token writes too",
                        at.1, at.0
                    ));
                }
            }
            max_q = max_q.max(e - a);
            total_keys += c;
            new_tokens += e - a;
        }
        let group = (hq / hkv) as i64;
        Ok(Sizes::from([
            ("num_seqs".to_string(), live as i64),
            ("total_tokens".to_string(), t as i64),
            ("heads_q".to_string(), hq as i64),
            ("heads_kv".to_string(), hkv as i64),
            ("group".to_string(), group),
            ("head_dim".to_string(), d as i64),
            ("page_size".to_string(), page as i64),
            ("max_q_len".to_string(), max_q),
            ("max_q_rows".to_string(), max_q * group),
            ("max_context".to_string(), ctx[..live].iter().copied().max().unwrap_or(0)),
            ("num_pages".to_string(), pages as i64),
            ("total_keys".to_string(), total_keys),
            ("new_tokens".to_string(), new_tokens),
        ]))
    }

    fn cache_desc(&self, wanted: &op::Features, dtype: DType, sizes: &Sizes) -> serde_json::Value {
        super::op::RaggedPaged.cache_desc(wanted, dtype, sizes)
    }

    fn random_call(&self, f: &op::Features, dtype: DType, dims: &Sizes, seed: u64) -> Result<HostCall, String> {
        let p = features(f)?;
        let shape = shape_of(dims)?;
        let x = random_inputs(dtype, &shape, seed);
        let out = HostTensor::full(dtype, &x.queries.shape, f64::NAN);
        let tensors = BTreeMap::from([
            ("queries".to_string(), x.queries),
            ("keys".to_string(), x.keys),
            ("values".to_string(), x.values),
            ("kv_pages".to_string(), x.kv_pages),
            ("kv_lens".to_string(), x.kv_lens),
            ("block_tables".to_string(), x.block_tables),
            ("query_start_loc".to_string(), x.query_start_loc),
            ("distribution".to_string(), x.distribution),
            ("out".to_string(), out),
        ]);
        let mut scalars = BTreeMap::from([("softmax_scale".to_string(), 1.0 / (shape.head_dim.max(1) as f64).sqrt())]);
        if p.soft_cap {
            scalars.insert("logits_soft_cap".to_string(), 2.5);
        }
        if p.window {
            scalars.insert("sliding_window".to_string(), (shape.max_context / 3).max(1) as f64);
        }
        Ok(HostCall { tensors, scalars })
    }

    fn call_elements(&self, f: &op::Features, dims: &Sizes) -> Result<u64, String> {
        let s = shape_of(dims)?;
        let tokens = s.num_seqs.checked_mul(s.max_q_len).and_then(|n| n.checked_add(2)).ok_or("too many tokens")?;
        let kvn = op::elements(&[tokens, s.heads_kv + 1, s.head_dim])?;
        op::total_elements(&[super::op::RaggedPaged.call_elements(f, dims)?, kvn, kvn, 3])
    }

    fn reference(&self, f: &op::Features, call: &HostCall) -> Result<BTreeMap<String, HostTensor>, String> {
        let p = features(f)?;
        let t = |n: &str| call.tensors.get(n).cloned().ok_or_else(|| format!("the call has no `{n}`"));
        let x = V3Inputs {
            queries: t("queries")?,
            keys: t("keys")?,
            values: t("values")?,
            kv_pages: t("kv_pages")?,
            kv_lens: t("kv_lens")?,
            block_tables: t("block_tables")?,
            query_start_loc: t("query_start_loc")?,
            distribution: t("distribution")?,
        };
        let scalar = |n: &str| call.scalars.get(n).copied().ok_or_else(|| format!("the call has no `{n}`"));
        let cap = if p.soft_cap { Some(scalar("logits_soft_cap")?) } else { None };
        let window = if p.window { Some(scalar("sliding_window")? as i64) } else { None };
        let (out, cache) = reference(&x, scale_of(call)?, cap, window)?;
        Ok(BTreeMap::from([("out".to_string(), out), ("kv_pages".to_string(), cache)]))
    }

    fn outputs(&self, _f: &op::Features) -> Vec<&'static str> {
        vec!["out", "kv_pages"]
    }

    fn small_dims(&self, sizes: &Sizes) -> Sizes {
        super::op::RaggedPaged.small_dims(sizes)
    }

    fn check_dims(&self, keys: &Keys) -> Vec<Sizes> {
        // v2's cases without shared pages (new tokens may not share cache rows), plus more
        // sequences so that every group of the distribution holds several.
        let mut out: Vec<Sizes> = super::op::RaggedPaged.check_dims(keys);
        for d in out.iter_mut() {
            d.insert("num_pages".into(), 0);
        }
        if let Some(first) = out.first().cloned() {
            let mut more = first;
            more.insert("num_seqs".into(), 10);
            out.push(more);
        }
        out
    }

    fn work(&self, f: &op::Features, dtype: DType, sizes: &Sizes) -> Work {
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0).max(0) as f64;
        let w = super::op::RaggedPaged.work(f, dtype, sizes);
        // The new tokens read and written once more.
        let writes = 4.0 * g("new_tokens") * g("heads_kv") * g("head_dim") * dtype.size_bytes() as f64;
        Work { flops: 0.0, bytes: w.bytes + writes }
    }

    fn heuristic(&self, configs: &[Config]) -> Option<usize> {
        super::op::RaggedPaged.heuristic(configs)
    }
}
