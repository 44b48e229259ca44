//! Paged decode attention as an [`Operation`]: one query token per sequence against a
//! paged KV cache read through block tables — the semantics are stated in
//! [`super::kernels`] and in docs/semantics.md.
//!
//! ```
//! use ejc_ir::op::Operation;
//! let op = ejc_ir::ops::get("page_attention").unwrap();
//! assert_eq!(op.plan_names(), ["single", "split_k"]);
//! let dims: Vec<&str> = op.dims().iter().map(|d| d.name).collect();
//! assert_eq!(dims, ["num_seqs", "heads_q", "heads_kv", "head_dim", "page_size", "max_context", "min_context", "num_pages"]);
//! ```

use std::collections::BTreeMap;

use serde_json::json;

use super::kernels::{build, combine_tile, param_docs, DecodeKernel, Role};
use super::reference::{random_inputs, reference, PagedShape};
use crate::ir::Kernel;
use crate::manifest::{Launch, Temporary};
use crate::op::{
    self, AxisDecl, AxisKind, CallView, Config, DimDecl, HostCall, KernelInstance, Keys, Operation, PlanDecl, RoleDecl,
    ScalarDecl, Sizes, Work,
};
use crate::spec::{Decoder, Fields, Spec};
use crate::tensor::HostTensor;
use crate::types::DType;

/// The operation (registered in [`crate::ops`]).
pub struct PageAttention;

/// What a variant computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PagedFeatures {
    /// A run-time soft cap `logits_soft_cap`: `c · tanh(x / c)` on the scaled scores.
    pub soft_cap: bool,
}

impl PagedFeatures {
    pub fn to_json(self) -> op::Features {
        let mut f = op::Features::new();
        if self.soft_cap {
            f.insert("logits_soft_cap".into(), json!("runtime"));
        }
        f
    }

    pub fn from_json(f: &op::Features) -> Result<PagedFeatures, String> {
        for (k, v) in f {
            match (k.as_str(), v.as_str()) {
                ("logits_soft_cap", Some("runtime")) => {}
                ("logits_soft_cap", _) => {
                    return Err(format!("page_attention's logits_soft_cap is `runtime`, not {v}"))
                }
                _ => return Err(format!("unknown page_attention feature `{k}`")),
            }
        }
        Ok(PagedFeatures { soft_cap: f.contains_key("logits_soft_cap") })
    }
}

fn features(f: &op::Features) -> Result<PagedFeatures, String> {
    PagedFeatures::from_json(f)
}

/// Keys per block of the decode-style kernels (paged, ragged decode, ragged paged).
pub(crate) const KEY_BLOCK: AxisDecl = AxisDecl {
    name: "block_n",
    kind: AxisKind::Tile,
    required: true,
    noun: "key block",
    allowed: "16, 32, 64 or 128",
    list_allowed: "a non-empty list of key blocks from 16, 32, 64 or 128",
    check: |v| (![16, 32, 64, 128].contains(&v)).then_some("unsupported key block"),
};

/// Their pipeline stages.
pub(crate) const STAGES: AxisDecl = AxisDecl {
    name: "num_stages",
    kind: AxisKind::Launch,
    required: false,
    noun: "stage count",
    allowed: "1 to 8",
    list_allowed: "a non-empty list of stage counts from 1 to 8",
    check: |v| (!(1..=8).contains(&v)).then_some("unsupported stage count"),
};

/// Their split-K plans' key splits (a run-time axis the tuner picks).
pub(crate) const SPLITS: AxisDecl = AxisDecl {
    name: "num_splits",
    kind: AxisKind::Runtime,
    required: false,
    noun: "split count",
    allowed: "2 to 128",
    list_allowed: "a list of split counts from 2 to 128 (the split-K plan's; the tuner picks)",
    check: |v| (!(2..=128).contains(&v)).then_some("unsupported split count"),
};

pub(crate) const AXES: &[AxisDecl] = &[
    AxisDecl {
        name: "block_h",
        kind: AxisKind::Tile,
        required: true,
        noun: "head block",
        allowed: "16, 32 or 64 (query heads of one KV head per program)",
        list_allowed: "a non-empty list of head blocks from 16, 32 or 64",
        check: |v| (![16, 32, 64].contains(&v)).then_some("unsupported head block"),
    },
    KEY_BLOCK,
    AxisDecl {
        name: "num_warps",
        kind: AxisKind::Launch,
        required: true,
        noun: "warp count",
        allowed: "1, 2 or 4",
        list_allowed: "a non-empty list of warp counts from 1, 2 or 4",
        check: |v| (![1, 2, 4].contains(&v)).then_some("unsupported warp count"),
    },
    STAGES,
    SPLITS,
];

const DIMS: &[DimDecl] = &[
    DimDecl { name: "num_seqs", default: 5, optional: false, doc: "sequences (one query token each)" },
    DimDecl { name: "heads_q", default: 8, optional: false, doc: "query heads" },
    DimDecl { name: "heads_kv", default: 2, optional: false, doc: "KV heads (divides heads_q)" },
    DimDecl {
        name: "head_dim",
        default: 64,
        optional: false,
        doc: "head dimension (compiled in: one of the spec's head_dims)",
    },
    DimDecl { name: "page_size", default: 16, optional: false, doc: "tokens per page (>= 1)" },
    DimDecl { name: "max_context", default: 333, optional: false, doc: "sequence 0's context (the longest)" },
    DimDecl {
        name: "min_context",
        default: 0,
        optional: true,
        doc: "the other sequences' contexts are drawn from [min_context, max_context]; 0 also makes sequences 2 and 3 one key and none",
    },
    DimDecl {
        name: "num_pages",
        default: 0,
        optional: true,
        doc: "pages in the caches (default: enough for every sequence, each page used once; fewer shares pages)",
    },
];

const OUTPUTS: &[&str] = &["out"];

fn shape_of(dims: &Sizes) -> Result<PagedShape, String> {
    let g = |k: &str| -> Result<usize, String> {
        dims.get(k).map(|v| (*v).max(0) as usize).ok_or_else(|| format!("size `{k}` is missing"))
    };
    let s = PagedShape {
        num_seqs: g("num_seqs")?,
        heads_q: g("heads_q")?,
        heads_kv: g("heads_kv")?,
        head_dim: g("head_dim")?,
        page_size: g("page_size")?,
        max_context: g("max_context")?,
        min_context: dims.get("min_context").copied().unwrap_or(0).max(0) as usize,
        num_pages: dims.get("num_pages").copied().filter(|n| *n > 0).map(|n| n as usize),
    };
    if s.page_size == 0 {
        return Err("size `page_size` must be at least 1".into());
    }
    if s.heads_kv == 0 || s.heads_q == 0 || !s.heads_q.is_multiple_of(s.heads_kv) {
        return Err(format!("heads_q ({}) must be a positive multiple of heads_kv ({})", s.heads_q, s.heads_kv));
    }
    if s.min_context > s.max_context {
        return Err(format!("min_context ({}) is above max_context ({})", s.min_context, s.max_context));
    }
    Ok(s)
}

pub(crate) fn scale_of(call: &dyn CallView) -> Result<f64, String> {
    let s = call.scalar("softmax_scale").ok_or("scalar argument `softmax_scale` is missing")?;
    if !s.is_finite() {
        return Err(format!("scalar argument `softmax_scale` = {s} must be finite"));
    }
    Ok(s)
}

/// The compile-time keys of a decode call: query's head dim (`shape`: query's shape in
/// words, for the error).
pub(crate) fn query_keys(call: &dyn CallView, shape: &str) -> Result<Keys, String> {
    let q = call.tensor("query").ok_or("argument `query` is missing")?;
    if q.shape.len() != 3 {
        return Err(format!("argument `query`: shape {:?} is not {shape}", q.shape));
    }
    Ok(Keys::from([("head_dim".to_string(), q.shape[2] as u32)]))
}

/// A soft-capped variant's `logits_soft_cap`: present, positive and finite.
pub(crate) fn check_soft_cap(call: &dyn CallView) -> Result<(), String> {
    let c = call.scalar("logits_soft_cap").ok_or("scalar argument `logits_soft_cap` is missing")?;
    if !(c > 0.0 && c.is_finite()) {
        return Err(format!("scalar argument `logits_soft_cap` = {c} must be positive and finite"));
    }
    Ok(())
}

/// The decode operations' plans: `single`, and `split_k` where the spec lists
/// `num_splits` (partial, then combine, through f32 temporaries).
pub(crate) fn decode_plans(spec: &Spec) -> Vec<PlanDecl> {
    let mut plans = vec![PlanDecl::single(&["block_h", "block_n"])];
    if let Some(max_splits) = spec.schedule.values("num_splits").iter().max() {
        let (combine_rows, combine_warps) = combine_tile(*max_splits);
        plans.push(PlanDecl {
            name: "split_k",
            roles: vec![
                RoleDecl { name: "partial", tile_axes: vec!["block_h", "block_n"], fixed: Config::new() },
                RoleDecl {
                    name: "combine",
                    tile_axes: vec![],
                    fixed: Config::from([
                        ("block_s".to_string(), combine_rows),
                        ("num_warps".to_string(), combine_warps),
                    ]),
                },
            ],
            temporaries: vec![
                Temporary {
                    name: "o_partial".into(),
                    dtype: "f32".into(),
                    shape: ["num_splits", "num_seqs", "heads_q", "head_dim"].map(String::from).to_vec(),
                    fill: "none".into(),
                    given: false,
                },
                Temporary {
                    name: "lse_partial".into(),
                    dtype: "f32".into(),
                    shape: ["num_splits", "num_seqs", "heads_q"].map(String::from).to_vec(),
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

/// `<spec>_<variant>_<dtype>_d<D>_h<block_h>_n<block_n>`, `…_split`, `…_combine`.
pub(crate) fn decode_kernel_id(spec_name: &str, k: &KernelInstance) -> String {
    let hd = k.keys.get("head_dim").copied().unwrap_or(0);
    let base = format!("{spec_name}_{}_{}_d{hd}", k.variant.name, k.dtype);
    let (h, n) = (k.tile.get("block_h").copied().unwrap_or(0), k.tile.get("block_n").copied().unwrap_or(0));
    match k.role {
        "partial" => format!("{base}_h{h}_n{n}_split"),
        "combine" => format!("{base}_combine"),
        _ => format!("{base}_h{h}_n{n}"),
    }
}

/// A decode kernel's tile IR: `kernel` makes the [`DecodeKernel`] from the role, dtype,
/// head dim and tiling (the combine's rows are `block_s`); the attributes are printed
/// metadata (snapshots, dumps) nothing reads back.
pub(crate) fn decode_build(
    spec: &Spec,
    k: &KernelInstance,
    kernel: impl Fn(Role, DType, usize, usize, usize) -> DecodeKernel,
) -> Result<Kernel, String> {
    let head_dim = *k.keys.get("head_dim").ok_or("the instance has no head_dim")? as usize;
    let role = match k.role {
        "partial" => Role::Partial,
        "combine" => Role::Combine,
        _ => Role::Main,
    };
    let tile = |axis: &str| k.tile.get(axis).map(|v| *v as usize).ok_or(format!("the instance has no {axis}"));
    let (block_h, block_n) = match role {
        Role::Combine => (tile("block_s")?, 0),
        _ => (tile("block_h")?, tile("block_n")?),
    };
    let mut built = build(&k.id, &kernel(role, k.dtype, head_dim, block_h, block_n)).map_err(|e| e.to_string())?;
    built.attrs = vec![
        ("op".into(), spec.op.clone()),
        ("variant".into(), k.variant.name.clone()),
        ("dtype".into(), k.dtype.to_string()),
        ("head_dim".into(), head_dim.to_string()),
        ("role".into(), k.role.to_string()),
    ];
    match role {
        Role::Combine => built.attrs.push(("block_s".into(), block_h.to_string())),
        _ => built.attrs.extend([("block_h".into(), block_h.to_string()), ("block_n".into(), block_n.to_string())]),
    }
    Ok(built)
}

impl Operation for PageAttention {
    fn name(&self) -> &'static str {
        "page_attention"
    }

    fn summary(&self) -> &'static str {
        "decode attention over a paged KV cache (block tables, GQA packed, split-K), one query token per sequence"
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
        &["logits_soft_cap"]
    }

    fn variant_allowed(&self) -> &'static str {
        "a mapping such as `logits_soft_cap: runtime`; `{}` for plain softmax attention"
    }

    fn decode_variant(&self, d: &mut Decoder, f: &Fields) -> op::Features {
        let soft_cap = match f.value("logits_soft_cap") {
            Some(v) => d.choice(v, &f.path("logits_soft_cap"), "soft cap", &["runtime"]).is_some(),
            None => false,
        };
        PagedFeatures { soft_cap }.to_json()
    }

    fn describe(&self, f: &op::Features) -> String {
        match features(f) {
            Ok(p) if p.soft_cap => "softmax(scale q.k), soft-capped at run time".into(),
            Ok(_) => "softmax(scale q.k)".into(),
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
        decode_build(spec, k, |role, dtype, head_dim, block_h, block_n| {
            DecodeKernel::paged(role, f.soft_cap, dtype, head_dim, block_h, block_n)
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
        query_keys(call, "[num_seqs, heads_q, head_dim]")
    }

    fn dims_of(&self, sizes: &Sizes) -> Sizes {
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0);
        Sizes::from([
            ("num_seqs".to_string(), g("num_seqs")),
            ("heads_q".to_string(), g("heads_q")),
            ("heads_kv".to_string(), g("heads_kv")),
            ("head_dim".to_string(), g("head_dim")),
            ("page_size".to_string(), g("page_size")),
            ("max_context".to_string(), g("max_context")),
            ("min_context".to_string(), g("min_context")),
            ("num_pages".to_string(), g("num_pages")),
        ])
    }

    fn scalars(&self, f: &op::Features) -> Vec<ScalarDecl> {
        let mut out = vec![ScalarDecl { name: "softmax_scale", doc: "multiplies q.k (default 1/sqrt(head_dim))" }];
        if features(f).map(|f| f.soft_cap).unwrap_or(false) {
            out.push(ScalarDecl { name: "logits_soft_cap", doc: "soft cap c > 0" });
        }
        out
    }

    fn validate(&self, f: &op::Features, dtype: DType, keys: &Keys, call: &dyn CallView) -> Result<Sizes, String> {
        let f = features(f)?;
        let head_dim = keys.get("head_dim").copied().unwrap_or(0) as usize;
        let get =
            |n: &str, dt: DType, rank: usize, what: &str| op::tensor_arg(call, n, self.param_doc(n), dt, rank, what);
        let q = get("query", dtype, 3, "[num_seqs, heads_q, head_dim]")?;
        let k = get("key_cache", dtype, 4, "[num_pages, heads_kv, page_size, head_dim]")?;
        let v = get("value_cache", dtype, 4, "[num_pages, heads_kv, page_size, head_dim]")?;
        let lens = get("context_lens", DType::I32, 1, "[num_seqs]")?;
        let tables = get("block_tables", DType::I32, 2, "[num_seqs, max_pages]")?;
        let out = get("out", dtype, 3, "[num_seqs, heads_q, head_dim]")?;
        let (n, hq, d) = (q.shape[0], q.shape[1], q.shape[2]);
        if d != head_dim {
            return Err(format!(
                "argument `query` has head_dim {d}, but this kernel is compiled for head_dim {head_dim}"
            ));
        }
        let (pages, hkv, page, kd) = (k.shape[0], k.shape[1], k.shape[2], k.shape[3]);
        if kd != d {
            return Err(format!("argument `key_cache` has head_dim {kd}, `query` {d}"));
        }
        if v.shape != k.shape {
            return Err(format!("argument `value_cache` has shape {:?}, `key_cache` {:?}", v.shape, k.shape));
        }
        if hkv == 0 || !hq.is_multiple_of(hkv) {
            return Err(format!("heads_q ({hq}) must be a multiple of `key_cache`'s heads_kv ({hkv})"));
        }
        if page == 0 {
            return Err("argument `key_cache` has page size 0 (its third extent)".into());
        }
        if lens.shape[0] != n || tables.shape[0] != n {
            return Err(format!(
                "`context_lens` {:?} and `block_tables` {:?} must have one row per sequence ({n})",
                lens.shape, tables.shape
            ));
        }
        if out.shape != q.shape {
            return Err(format!("argument `out` has shape {:?}, expected {:?}", out.shape, q.shape));
        }
        scale_of(call)?;
        if f.soft_cap {
            check_soft_cap(call)?;
        }
        // Every page a kernel will read must be in the cache: a bad index would read
        // outside it (on the GPU, a fault for every later call).
        let width = tables.shape[1];
        let len_values = call.int_values("context_lens")?;
        let table = call.int_values("block_tables")?;
        let (mut total, mut longest) = (0i64, 0i64);
        for (s, &len) in len_values.iter().enumerate() {
            let cap = width as i64 * page as i64;
            if len < 0 || len > cap {
                return Err(format!(
                    "context_lens[{s}] = {len} is outside [0, {cap}] (block_tables' {width} pages of {page} tokens)"
                ));
            }
            for p in 0..(len as usize).div_ceil(page) {
                let id = table[s * width + p];
                if id < 0 || id >= pages as i64 {
                    return Err(format!(
                        "block_tables[{s}, {p}] = {id} is not a page of the cache (0..{pages}); sequence {s} reads it"
                    ));
                }
            }
            total += len;
            longest = longest.max(len);
        }
        Ok(Sizes::from([
            ("num_seqs".to_string(), n as i64),
            ("heads_q".to_string(), hq as i64),
            ("heads_kv".to_string(), hkv as i64),
            ("group".to_string(), (hq / hkv) as i64),
            ("head_dim".to_string(), d as i64),
            ("page_size".to_string(), page as i64),
            ("num_pages".to_string(), pages as i64),
            ("max_pages".to_string(), width as i64),
            ("max_context".to_string(), longest),
            ("min_context".to_string(), len_values.iter().copied().min().unwrap_or(0)),
            ("total_context".to_string(), total),
        ]))
    }

    fn cache_desc(&self, wanted: &op::Features, dtype: DType, sizes: &Sizes) -> serde_json::Value {
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0);
        let b = |n: i64| (n.max(16) as u64).next_power_of_two();
        json!({
            "num_seqs": b(g("num_seqs")), "heads_q": g("heads_q"), "heads_kv": g("heads_kv"),
            "head_dim": g("head_dim"), "page_size": g("page_size"), "context": b(g("max_context")),
            "dtype": dtype.to_string(), "features": wanted,
        })
    }

    fn random_call(&self, f: &op::Features, dtype: DType, dims: &Sizes, seed: u64) -> Result<HostCall, String> {
        let p = features(f)?;
        let shape = shape_of(dims)?;
        let x = random_inputs(dtype, &shape, seed);
        let out = HostTensor::full(dtype, &[shape.num_seqs, shape.heads_q, shape.head_dim], f64::NAN);
        let tensors = BTreeMap::from([
            ("query".to_string(), x.query),
            ("key_cache".to_string(), x.key_cache),
            ("value_cache".to_string(), x.value_cache),
            ("context_lens".to_string(), x.context_lens),
            ("block_tables".to_string(), x.block_tables),
            ("out".to_string(), out),
        ]);
        let mut scalars = BTreeMap::from([("softmax_scale".to_string(), 1.0 / (shape.head_dim.max(1) as f64).sqrt())]);
        if p.soft_cap {
            scalars.insert("logits_soft_cap".to_string(), 2.5);
        }
        Ok(HostCall { tensors, scalars })
    }

    fn call_elements(&self, _f: &op::Features, dims: &Sizes) -> Result<u64, String> {
        let s = shape_of(dims)?;
        let q = op::elements(&[s.num_seqs, s.heads_q + 1, s.head_dim])?;
        let cache = op::elements(&[s.pages(), s.heads_kv, s.page_size, s.head_dim])?;
        let table = op::elements(&[s.num_seqs, s.max_pages()])?;
        op::total_elements(&[q, q, cache, cache, table, s.num_seqs as u64])
    }

    fn reference(&self, f: &op::Features, call: &HostCall) -> Result<BTreeMap<String, HostTensor>, String> {
        let p = features(f)?;
        let t = |n: &str| call.tensors.get(n).ok_or_else(|| format!("the call has no `{n}`"));
        let scale = scale_of(call)?;
        let cap = if p.soft_cap {
            Some(call.scalars.get("logits_soft_cap").copied().ok_or("the call has no `logits_soft_cap`")?)
        } else {
            None
        };
        let out = reference(
            t("query")?,
            t("key_cache")?,
            t("value_cache")?,
            t("context_lens")?,
            t("block_tables")?,
            scale,
            cap,
        )?;
        Ok(BTreeMap::from([("out".to_string(), out)]))
    }

    fn outputs(&self, _f: &op::Features) -> Vec<&'static str> {
        OUTPUTS.to_vec()
    }

    fn small_dims(&self, sizes: &Sizes) -> Sizes {
        let mut d = self.dims_of(sizes);
        d.insert("num_seqs".into(), d["num_seqs"].min(4));
        d.insert("max_context".into(), d["max_context"].min(150));
        d.insert("min_context".into(), d["min_context"].min(d["max_context"]));
        d.insert("num_pages".into(), 0);
        d
    }

    fn check_dims(&self, keys: &Keys) -> Vec<Sizes> {
        let d = keys.get("head_dim").copied().unwrap_or(64) as i64;
        // [seqs, heads_q, heads_kv, page, max_context, num_pages (0: each page once)]:
        // contexts off the page size with an empty and a one-key sequence, MQA with a
        // group above 16 (two head blocks), pages shared between sequences, page size 1,
        // a page size off every key block, one sequence of one key.
        [
            [5, 8, 2, 16, 333, 0],
            [4, 20, 1, 32, 77, 0],
            [6, 4, 4, 16, 130, 9],
            [4, 2, 1, 1, 45, 0],
            [4, 12, 3, 24, 201, 0],
            [1, 8, 1, 64, 1, 0],
        ]
        .iter()
        .map(|[n, hq, hkv, p, ctx, pages]| {
            Sizes::from([
                ("num_seqs".to_string(), *n),
                ("heads_q".to_string(), *hq),
                ("heads_kv".to_string(), *hkv),
                ("head_dim".to_string(), d),
                ("page_size".to_string(), *p),
                ("max_context".to_string(), *ctx),
                ("min_context".to_string(), 0),
                ("num_pages".to_string(), *pages),
            ])
        })
        .collect()
    }

    fn work(&self, _f: &op::Features, dtype: DType, sizes: &Sizes) -> Work {
        // Memory-bound: every key and value row a sequence attends to is read once (per
        // KV head: the query heads of a group share it), the query read and the output
        // written once. Reported as GB/s.
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0).max(0) as f64;
        let total = match sizes.get("total_context") {
            Some(t) => *t as f64,
            None => g("num_seqs") * (g("max_context") + g("min_context")) / 2.0,
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
