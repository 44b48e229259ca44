//! Ragged paged attention v3 as an [`Operation`]: the new tokens' K and V written into
//! the paged cache, then v2's attention over it — the semantics are in docs/semantics.md
//! ("Ragged paged attention v3").
//!
//! ```
//! use ejc_ir::op::Operation;
//! let op = ejc_ir::ops::get("ragged_page_attention_v3").unwrap();
//! assert_eq!(op.plan_names(), ["packed", "classed", "split_k", "classed_split"]);
//! assert_eq!(op.outputs(&Default::default()), ["out", "kv_pages"]);
//! ```

use std::collections::{BTreeMap, BTreeSet};

use super::kernels::param_docs;
use super::op::{build_instance, check_batch, kernel_id, rpa_plans, shape_of, RpaFeatures, AXES, DIMS};
use super::reference_v3::{live_sequences, random_inputs, reference, V3Inputs};
use crate::ir::Kernel;
use crate::op::{
    self, AxisDecl, CallView, Config, DimDecl, HostCall, KernelInstance, Keys, Operation, PlanDecl, ScalarDecl, Sizes,
    Work,
};
use crate::ops::page_attention::op::scale_of;
use crate::spec::{Decoder, Fields, Spec};
use crate::tensor::HostTensor;
use crate::types::DType;

/// The operation (registered in [`crate::ops`]).
pub struct RaggedPagedV3;

/// v2's features, without sinks (v3 has none).
fn features(f: &op::Features) -> Result<RpaFeatures, String> {
    let r = RpaFeatures::from_json(f)?;
    if r.sinks {
        return Err("ragged_page_attention_v3 has no sinks".into());
    }
    Ok(r)
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
        RpaFeatures { soft_cap, window, sinks: false }.to_json()
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
        &["packed", "classed", "split_k", "classed_split"]
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
        let dist = call.int_values("distribution");
        let rpa = RpaFeatures { soft_cap: f.soft_cap, window: f.window, sinks: false };
        let mut b = check_batch(self, dtype, keys, call, rpa, "kv_lens", |lens, qsl| {
            op::tensor_arg(call, "distribution", self.param_doc("distribution"), DType::I32, 1, "[3]")?;
            live_sequences(&dist.clone()?, lens, qsl).map_err(|e| format!("argument `distribution`: {e}"))
        })?;
        let (t, d) = (b.sizes["total_tokens"] as usize, b.sizes["head_dim"] as usize);
        let get = |n: &str| op::tensor_arg(call, n, self.param_doc(n), dtype, 3, "[total_tokens, heads_kv, head_dim]");
        let (kn, vn) = (get("keys")?, get("values")?);
        if kn.shape != [t, b.heads_kv, d] || vn.shape != kn.shape {
            return Err(format!(
                "arguments `keys` and `values` must be [{t}, {}, {d}] (a KV head each of kv_pages' pairs), got {:?} and {:?}",
                b.heads_kv, kn.shape, vn.shape
            ));
        }
        // The kernels write in parallel: no two new tokens may share a cache row.
        let mut written = BTreeSet::new();
        let mut new_tokens = 0;
        for i in 0..b.live {
            let (q, c) = (b.qsl[i + 1] - b.qsl[i], b.lens[i]);
            for pos in (c - q)..c {
                let at = (b.table[i * b.width + pos as usize / b.page], pos as usize % b.page);
                if !written.insert(at) {
                    return Err(format!(
                        "sequence {i}'s new token at position {pos} writes row {} of page {}, which another new token writes too",
                        at.1, at.0
                    ));
                }
            }
            new_tokens += q;
        }
        b.sizes.insert("new_tokens".to_string(), new_tokens);
        Ok(b.sizes)
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
        Work { flops: w.flops, bytes: w.bytes + writes }
    }

    fn heuristic(&self, configs: &[Config]) -> Option<usize> {
        super::op::RaggedPaged.heuristic(configs)
    }
}
