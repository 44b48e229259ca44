//! Block-sparse attention as an [`Operation`]: see [`super`] and docs/semantics.md.
//!
//! ```
//! use ejc_ir::op::Operation;
//! let op = ejc_ir::ops::get("blocksparse_attention").unwrap();
//! assert_eq!(op.plan_names(), ["layout"]);
//! let dims: Vec<&str> = op.dims().iter().map(|d| d.name).collect();
//! assert_eq!(dims, ["batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "head_dim_v", "doc_len", "mask_heads"]);
//! ```

use std::collections::BTreeMap;

use serde_json::json;

use super::kernels::{build, param_docs, BsKernel, Role, LAYOUT_TENSORS};
use super::mask::{self, MaskExpr};
use super::reference::{random_inputs, reference, visible, BsFeatures, BsInputs, BsShape};
use crate::flash::op::{decode_head_dim_pairs, head_dim_keys, head_dim_v, qv_keys};
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
pub struct BlockSparse;

const VARIANT_FIELDS: &[&str] = &[
    "mask",
    "head_masks",
    "segment_ids",
    "attention_mask",
    "sinks",
    "logits_soft_cap",
    "positions",
    "bias",
    "bias_grad",
    "sliding_window",
    "chunk_size",
];

impl BsFeatures {
    /// The spec's vocabulary: `mask` (the algebra's JSON form) and the flags where set.
    pub fn to_json(&self) -> op::Features {
        let mut m = op::Features::new();
        m.insert("mask".into(), self.mask.to_json());
        if !self.head_masks.is_empty() {
            m.insert("head_masks".into(), self.head_masks.iter().map(MaskExpr::to_json).collect());
        }
        for (k, on) in [
            ("segment_ids", self.segment_ids),
            ("attention_mask", self.attention_mask),
            ("sinks", self.sinks),
            ("positions", self.positions),
            ("bias", self.bias),
            ("bias_grad", self.bias_grad),
        ] {
            if on {
                m.insert(k.into(), json!(true));
            }
        }
        if self.soft_cap {
            m.insert("logits_soft_cap".into(), json!("runtime"));
        }
        if self.runtime_window {
            m.insert("sliding_window".into(), json!("runtime"));
        }
        if self.runtime_chunk {
            m.insert("chunk_size".into(), json!("runtime"));
        }
        m
    }

    pub fn from_json(m: &op::Features) -> Result<BsFeatures, String> {
        for k in m.keys() {
            if !VARIANT_FIELDS.contains(&k.as_str()) {
                return Err(format!("unknown blocksparse_attention feature `{k}`"));
            }
        }
        let flag = |k: &str| m.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
        let mask = match m.get("mask") {
            Some(v) => MaskExpr::from_json(v)?,
            None => MaskExpr::Causal { offset: 0 },
        };
        let head_masks = match m.get("head_masks") {
            None => Vec::new(),
            Some(serde_json::Value::Array(v)) if !v.is_empty() => {
                v.iter().map(MaskExpr::from_json).collect::<Result<Vec<_>, _>>()?
            }
            Some(v) => return Err(format!("blocksparse_attention's head_masks is a non-empty list of masks, not {v}")),
        };
        let runtime = |k: &str| match m.get(k) {
            None | Some(serde_json::Value::Null) => Ok(false),
            Some(serde_json::Value::String(s)) if s == "runtime" => Ok(true),
            Some(v) => Err(format!("blocksparse_attention's {k} is `runtime`, not {v}")),
        };
        let soft_cap = runtime("logits_soft_cap")?;
        Ok(BsFeatures {
            mask,
            segment_ids: flag("segment_ids"),
            attention_mask: flag("attention_mask"),
            sinks: flag("sinks"),
            soft_cap,
            positions: flag("positions"),
            head_masks,
            bias: flag("bias"),
            bias_grad: flag("bias_grad"),
            runtime_window: runtime("sliding_window")?,
            runtime_chunk: runtime("chunk_size")?,
        })
    }

    /// `causal & local(128, 0) + segment_ids + sinks`.
    pub fn describe(&self) -> String {
        let mut parts = vec![self.mask.describe()];
        if !self.head_masks.is_empty() {
            let ms: Vec<String> = self.head_masks.iter().map(MaskExpr::describe).collect();
            parts.push(format!("head_masks [{}]", ms.join(", ")));
        }
        for (k, on) in [
            ("segment_ids", self.segment_ids),
            ("attention_mask", self.attention_mask),
            ("sinks", self.sinks),
            ("logits_soft_cap=runtime", self.soft_cap),
            ("positions", self.positions),
            ("bias", self.bias),
            ("bias_grad", self.bias_grad),
            ("sliding_window=runtime", self.runtime_window),
            ("chunk_size=runtime", self.runtime_chunk),
        ] {
            if on {
                parts.push(k.into());
            }
        }
        parts.join(" + ")
    }
}

/// A variant's fields (the forward's, and with `backward` the backward's `bias_grad`).
pub(super) fn decode_variant_of(d: &mut Decoder, f: &Fields, backward: bool) -> op::Features {
    let flag = |d: &mut Decoder, name: &str| match f.value(name) {
        Some(v) => d.bool(v, &f.path(name)).unwrap_or(false),
        None => false,
    };
    let mut out = BsFeatures {
        segment_ids: flag(d, "segment_ids"),
        attention_mask: flag(d, "attention_mask"),
        sinks: flag(d, "sinks"),
        positions: flag(d, "positions"),
        bias: flag(d, "bias"),
        bias_grad: flag(d, "bias_grad"),
        ..Default::default()
    };
    if let Some(v) = f.value("mask") {
        if let Some(m) = mask::decode(d, v, &f.path("mask")) {
            out.mask = m;
        }
    }
    if let Some(v) = f.value("head_masks") {
        let p = f.path("head_masks");
        if let Some(items) = d.list(v, &p, "a non-empty list of masks (head h takes the one at h mod n)") {
            if items.is_empty() {
                d.invalid(v, &p, "`head_masks` needs at least one mask", "a non-empty list of masks");
            }
            let ms: Vec<Option<MaskExpr>> =
                items.iter().enumerate().map(|(i, n)| mask::decode(d, n, &format!("{p}[{i}]"))).collect();
            out.head_masks = ms.into_iter().flatten().collect();
        }
    }
    if let Some(v) = f.value("logits_soft_cap") {
        out.soft_cap = d.choice(v, &f.path("logits_soft_cap"), "soft cap", &["runtime"]).is_some();
    }
    // Fixed sizes are the mask algebra's (`local: [l, r]`, `chunked_causal: c`); these two
    // take them per call.
    if let Some(v) = f.value("sliding_window") {
        out.runtime_window = d.choice(v, &f.path("sliding_window"), "sliding window", &["runtime"]).is_some();
    }
    if let Some(v) = f.value("chunk_size") {
        out.runtime_chunk = d.choice(v, &f.path("chunk_size"), "chunk size", &["runtime"]).is_some();
    }
    if let Some(v) = f.value("bias_grad") {
        let p = f.path("bias_grad");
        if !backward {
            d.invalid(
                v,
                &p,
                "`bias_grad` is a field of the backward (blocksparse_attention_bwd, specs/blocksparse_bwd.yaml)",
                "the forward's fields; `bias: true` for a bias",
            );
        } else if out.bias_grad && !out.bias {
            d.invalid(
                v,
                &p,
                "`bias_grad` asks for the gradient of a bias the variant does not have",
                "`bias: true` beside `bias_grad: true`",
            );
        }
    }
    out.to_json()
}

pub(super) fn features(f: &op::Features) -> Result<BsFeatures, String> {
    BsFeatures::from_json(f)
}

fn block_check(v: i64) -> Option<&'static str> {
    (![16, 32, 64, 128].contains(&v)).then_some("unsupported block size")
}

pub(super) const AXES: &[AxisDecl] = &[
    AxisDecl {
        name: "block_m",
        kind: AxisKind::Tile,
        required: true,
        noun: "block size",
        allowed: "16, 32, 64 or 128 (query rows per block of the layout and per program)",
        list_allowed: "a non-empty list of query blocks from 16, 32, 64 or 128",
        check: block_check,
    },
    AxisDecl {
        name: "block_n",
        kind: AxisKind::Tile,
        required: true,
        noun: "block size",
        allowed: "16, 32, 64 or 128 (keys per block of the layout)",
        list_allowed: "a non-empty list of key blocks from 16, 32, 64 or 128",
        check: block_check,
    },
    AxisDecl {
        name: "num_warps",
        kind: AxisKind::Launch,
        required: true,
        noun: "warp count",
        allowed: "1, 2, 4 or 8",
        list_allowed: "a non-empty list of warp counts from 1, 2, 4 or 8",
        check: |v| (![1, 2, 4, 8].contains(&v)).then_some("unsupported warp count"),
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
];

const DIMS: &[DimDecl] = &[
    DimDecl { name: "batch", default: 2, optional: false, doc: "batch size" },
    DimDecl { name: "heads_q", default: 4, optional: false, doc: "query heads" },
    DimDecl { name: "heads_kv", default: 2, optional: false, doc: "key/value heads (divides heads_q: GQA/MQA)" },
    DimDecl { name: "seq_q", default: 150, optional: false, doc: "query rows" },
    DimDecl { name: "seq_k", default: 170, optional: false, doc: "keys" },
    DimDecl {
        name: "head_dim",
        default: 64,
        optional: false,
        doc: "head dimension of query and key (compiled in: one of the spec's head_dims)",
    },
    DimDecl {
        name: "head_dim_v",
        default: 0,
        optional: true,
        doc: "head dimension of value and the output (compiled in; default: head_dim)",
    },
    DimDecl {
        name: "doc_len",
        default: 0,
        optional: true,
        doc: "segment_ids variants: 0 for random documents, else documents of lengths cycling through (2, 6, 4, 3, 5) x doc_len / 4",
    },
    DimDecl {
        name: "mask_heads",
        default: 1,
        optional: true,
        doc: "attention_mask variants: 1 (one mask for every head, a stride-0 view) or heads_q (a mask per head)",
    },
];

pub(super) fn shape_of(dims: &Sizes) -> Result<BsShape, String> {
    let g = |k: &str| -> Result<usize, String> {
        dims.get(k).map(|v| (*v).max(0) as usize).ok_or_else(|| format!("size `{k}` is missing"))
    };
    let head_dim = g("head_dim")?;
    let s = BsShape {
        batch: g("batch")?,
        heads_q: g("heads_q")?,
        heads_kv: g("heads_kv")?,
        seq_q: g("seq_q")?,
        seq_k: g("seq_k")?,
        head_dim,
        head_dim_v: dims.get("head_dim_v").copied().filter(|v| *v > 0).map_or(head_dim, |v| v as usize),
        doc_len: dims.get("doc_len").copied().unwrap_or(0).max(0) as usize,
        mask_heads: dims.get("mask_heads").copied().unwrap_or(1).max(1) as usize,
    };
    if s.heads_kv == 0 || s.heads_q == 0 || !s.heads_q.is_multiple_of(s.heads_kv) {
        return Err(format!("heads_q ({}) must be a positive multiple of heads_kv ({})", s.heads_q, s.heads_kv));
    }
    if s.mask_heads != 1 && s.mask_heads != s.heads_q {
        return Err(format!("mask_heads ({}) must be 1 or heads_q ({})", s.mask_heads, s.heads_q));
    }
    Ok(s)
}

fn dims_of(s: &BsShape) -> Sizes {
    Sizes::from([
        ("batch".to_string(), s.batch as i64),
        ("heads_q".to_string(), s.heads_q as i64),
        ("heads_kv".to_string(), s.heads_kv as i64),
        ("seq_q".to_string(), s.seq_q as i64),
        ("seq_k".to_string(), s.seq_k as i64),
        ("head_dim".to_string(), s.head_dim as i64),
        ("head_dim_v".to_string(), s.head_dim_v as i64),
        ("doc_len".to_string(), s.doc_len as i64),
        ("mask_heads".to_string(), s.mask_heads as i64),
    ])
}

/// A call's `softmax_scale`, and its `logits_soft_cap` where the variant has one.
pub(super) fn scale_and_cap(f: &BsFeatures, call: &HostCall) -> Result<(f64, Option<f64>), String> {
    let scale = call.scalars.get("softmax_scale").copied().ok_or("the call has no `softmax_scale`")?;
    let cap = match f.soft_cap {
        true => Some(call.scalars.get("logits_soft_cap").copied().ok_or("the call has no `logits_soft_cap`")?),
        false => None,
    };
    Ok((scale, cap))
}

/// A call's inputs as the reference takes them.
/// A call's block layout built on the host, for the tiling `block_m` × `block_n`: the
/// `block_count [LB, LH, NQ, 2]` and `block_idx [LB, LH, NQ, NK]` (i32) the plan's
/// `layout` kernel would write (module docs of `kernels`: full blocks in order from slot
/// 0, partial ones in order from slot NK − 1 down; unused slots 0), by evaluating the
/// variant's element mask (`reference::visible`) on every block. A call that gives
/// them under those names skips the layout kernel: a layout built once for a static
/// mask, or kept across calls that share segment ids, is reused (the seed's
/// `qkv_layouts`). The layout decides which keys are read: one that drops a visible
/// block, or calls a partial block full, gives a wrong result.
pub fn host_layout(
    f: &op::Features,
    call: &HostCall,
    block_m: usize,
    block_n: usize,
) -> Result<(HostTensor, HostTensor), String> {
    host_layout_classes(f, call, block_m, block_n).map(|(count, idx, _)| (count, idx))
}

/// [`host_layout`] and `block_class [LB, LH, NQ, NK]` (i32: 2 full, 1 partial, 0
/// skipped), the three tensors a backward call (`blocksparse_attention_bwd`) may give
/// instead of running its layout kernel (its transposed lists are still built from them).
pub fn host_layout_classes(
    f: &op::Features,
    call: &HostCall,
    block_m: usize,
    block_n: usize,
) -> Result<(HostTensor, HostTensor, HostTensor), String> {
    if block_m == 0 || block_n == 0 {
        return Err("block_m and block_n must be positive".into());
    }
    let bf = features(f)?;
    let x = inputs_of(call)?;
    let (b, h, sq) = (x.query.shape[0], x.query.shape[1], x.query.shape[2]);
    let sk = x.key.shape[2];
    let lb_n = if bf.data_dependent() { b } else { 1 };
    let lh_n = if bf.per_head() { h } else { 1 };
    let (nq, nk) = (sq.div_ceil(block_m), sk.div_ceil(block_n));
    let mut count = HostTensor::full(DType::I32, &[lb_n, lh_n, nq, 2], 0.0);
    let mut idx = HostTensor::full(DType::I32, &[lb_n, lh_n, nq, nk], 0.0);
    let mut class = HostTensor::full(DType::I32, &[lb_n, lh_n, nq, nk], 0.0);
    for lb in 0..lb_n {
        for lh in 0..lh_n {
            for qb in 0..nq {
                let rows = qb * block_m..((qb + 1) * block_m).min(sq);
                let (mut full, mut part) = (Vec::new(), Vec::new());
                for kb in 0..nk {
                    let cols = kb * block_n..(kb + 1) * block_n;
                    let inside = cols.end <= sk;
                    let (mut any, mut all) = (false, inside);
                    for i in rows.clone() {
                        for j in cols.start..cols.end.min(sk) {
                            let v = visible(&bf, &x, lb, lh, i, j);
                            any |= v;
                            all &= v;
                        }
                    }
                    if all && any {
                        full.push(kb);
                        class.set(&[lb, lh, qb, kb], 2.0);
                    } else if any {
                        part.push(kb);
                        class.set(&[lb, lh, qb, kb], 1.0);
                    }
                }
                count.set(&[lb, lh, qb, 0], full.len() as f64);
                count.set(&[lb, lh, qb, 1], part.len() as f64);
                for (t, kb) in full.iter().enumerate() {
                    idx.set(&[lb, lh, qb, t], *kb as f64);
                }
                for (t, kb) in part.iter().enumerate() {
                    idx.set(&[lb, lh, qb, nk - 1 - t], *kb as f64);
                }
            }
        }
    }
    Ok((count, idx, class))
}

pub fn inputs_of(call: &HostCall) -> Result<BsInputs, String> {
    let need = |n: &str| call.tensors.get(n).cloned().ok_or_else(|| format!("the call has no `{n}`"));
    let opt = |n: &str| call.tensors.get(n).cloned();
    Ok(BsInputs {
        query: need("query")?,
        key: need("key")?,
        value: need("value")?,
        q_segment_ids: opt("q_segment_ids"),
        kv_segment_ids: opt("kv_segment_ids"),
        attention_mask: opt("attention_mask"),
        sinks: opt("sinks"),
        q_positions: opt("q_positions"),
        kv_positions: opt("kv_positions"),
        bias: opt("bias"),
        window: match (call.scalars.get("window_left"), call.scalars.get("window_right")) {
            (Some(l), Some(r)) => Some((*l as i64, *r as i64)),
            _ => None,
        },
        chunk: call.scalars.get("chunk_size").map(|c| *c as i64),
    })
}

pub(super) fn expect_shape(call: &dyn CallView, name: &str, want: &[usize], dtype: DType) -> Result<(), String> {
    let t = call.tensor(name).ok_or_else(|| format!("argument `{name}` is missing"))?;
    if t.dtype != dtype {
        return Err(format!("argument `{name}` has dtype {}, the kernel takes {dtype}", t.dtype));
    }
    if t.shape != want {
        return Err(format!("argument `{name}` has shape {:?}, expected {want:?}", t.shape));
    }
    Ok(())
}

impl Operation for BlockSparse {
    fn name(&self) -> &'static str {
        "blocksparse_attention"
    }

    fn summary(&self) -> &'static str {
        "block-sparse attention (BHSD): a mask algebra, segment ids and boolean masks turned into a block layout \
         (full / partial key blocks per query block) that the attention kernel follows"
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

    fn decode_fields(&self, d: &mut Decoder, f: &Fields, keys: &mut Vec<(String, Vec<u32>)>, sets: &mut Vec<Keys>) {
        decode_head_dim_pairs(d, f, keys, sets);
    }

    fn variant_fields(&self) -> &'static [&'static str] {
        VARIANT_FIELDS
    }

    fn variant_allowed(&self) -> &'static str {
        "a mapping such as `mask: {local: [128, 0]}`, `head_masks: [causal, full]`, `segment_ids: true`, `positions: true`, `bias: true`, `sliding_window: runtime`; `{}` is causal attention (the seed's default)"
    }

    fn decode_variant(&self, d: &mut Decoder, f: &Fields) -> op::Features {
        decode_variant_of(d, f, false)
    }

    fn describe(&self, f: &op::Features) -> String {
        features(f).map(|f| f.describe()).unwrap_or_else(|e| e)
    }

    fn axes(&self) -> &'static [AxisDecl] {
        AXES
    }

    fn plan_names(&self) -> &'static [&'static str] {
        &["layout"]
    }

    fn plans(&self, _spec: &Spec, _f: &op::Features) -> Vec<PlanDecl> {
        let tile = vec!["block_m", "block_n"];
        let shape = |last: &str| {
            ["layout_batch", "layout_heads", "cdiv(seq_q, block_m)", last].iter().map(|s| s.to_string()).collect()
        };
        let temporaries = LAYOUT_TENSORS
            .iter()
            .zip(["2", "cdiv(seq_k, block_n)"])
            .map(|((name, _), last)| Temporary {
                name: name.to_string(),
                dtype: "i32".into(),
                shape: shape(last),
                fill: "none".into(),
                given: true,
            })
            .collect();
        vec![PlanDecl {
            name: "layout",
            roles: vec![
                RoleDecl { name: "layout", tile_axes: tile.clone(), fixed: Config::new() },
                RoleDecl { name: "main", tile_axes: tile, fixed: Config::new() },
            ],
            temporaries,
            // A call may give the layout (built by `host_layout`, or kept from an
            // earlier call): the `layout` launch is then skipped.
            launches: vec![
                Launch {
                    produces: LAYOUT_TENSORS.iter().map(|(n, _)| n.to_string()).collect(),
                    ..Launch::of("layout")
                },
                Launch::of("main"),
            ],
            runtime_axes: vec![],
            shared_axes: vec!["block_m", "block_n", "num_warps"],
        }]
    }

    fn kernel_id(&self, spec_name: &str, k: &KernelInstance) -> String {
        let hd = k.keys.get("head_dim").copied().unwrap_or(0);
        let dv = match k.keys.get("head_dim_v") {
            Some(v) => format!("v{v}"),
            None => String::new(),
        };
        let (m, n) = (k.tile.get("block_m").copied().unwrap_or(0), k.tile.get("block_n").copied().unwrap_or(0));
        let base = format!("{spec_name}_{}_{}_d{hd}{dv}_m{m}_n{n}", k.variant.name, k.dtype);
        match k.role {
            "layout" => format!("{base}_layout"),
            _ => base,
        }
    }

    fn build(&self, spec: &Spec, k: &KernelInstance) -> Result<Kernel, String> {
        let f = features(&k.variant.features)?;
        let hd = *k.keys.get("head_dim").ok_or("the instance has no head_dim")? as usize;
        let dv = head_dim_v(&k.keys).unwrap_or(hd as u32) as usize;
        let tile = |n: &str| k.tile.get(n).copied().map(|v| v as usize).ok_or(format!("no `{n}` for {}", k.id));
        let role = match k.role {
            "layout" => Role::Layout,
            "main" => Role::Main,
            other => return Err(format!("blocksparse_attention has no role `{other}`")),
        };
        let (block_m, block_n) = (tile("block_m")?, tile("block_n")?);
        let bk = BsKernel { role, features: f, dtype: k.dtype, head_dim: hd, head_dim_v: dv, block_m, block_n };
        let mut kernel = build(&k.id, &bk).map_err(|e| e.to_string())?;
        kernel.attrs = vec![
            ("op".into(), spec.op.clone()),
            ("variant".into(), k.variant.name.clone()),
            ("dtype".into(), k.dtype.to_string()),
            ("head_dim".into(), hd.to_string()),
            ("role".into(), k.role.to_string()),
            ("block_m".into(), block_m.to_string()),
            ("block_n".into(), block_n.to_string()),
        ];
        if dv != hd {
            kernel.attrs.push(("head_dim_v".into(), dv.to_string()));
        }
        Ok(kernel)
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
        head_dim_keys(dims)
    }

    fn call_keys(&self, call: &dyn CallView) -> Result<Keys, String> {
        qv_keys(call, ("query", "value"), "[batch, heads, seq, head_dim]")
    }

    fn dims_of(&self, sizes: &Sizes) -> Sizes {
        let mut d = sizes.clone();
        d.retain(|k, _| DIMS.iter().any(|x| x.name == k));
        d.entry("mask_heads".into()).or_insert(1);
        d.entry("doc_len".into()).or_insert(0);
        d
    }

    fn scalars(&self, f: &op::Features) -> Vec<ScalarDecl> {
        let mut out = vec![ScalarDecl { name: "softmax_scale", doc: "multiplies q.k (default 1/sqrt(head_dim))" }];
        let ff = features(f).ok();
        if ff.as_ref().is_some_and(|f| f.soft_cap) {
            out.push(ScalarDecl { name: "logits_soft_cap", doc: "soft cap c > 0" });
        }
        if ff.as_ref().is_some_and(|f| f.runtime_window) {
            out.push(ScalarDecl { name: "window_left", doc: "keys visible left of each row's position (0 to 2^30)" });
            out.push(ScalarDecl { name: "window_right", doc: "keys visible right of each row's position (0 to 2^30)" });
        }
        if ff.as_ref().is_some_and(|f| f.runtime_chunk) {
            out.push(ScalarDecl { name: "chunk_size", doc: "positions per chunk (1 to 2^30), causal within each" });
        }
        out
    }

    fn validate(&self, f: &op::Features, dtype: DType, keys: &Keys, call: &dyn CallView) -> Result<Sizes, String> {
        let f = features(f)?;
        let head_dim = keys.get("head_dim").copied().unwrap_or(0) as usize;
        let want_dv = head_dim_v(keys).unwrap_or(0) as usize;
        let get = |n: &str, dt: DType, what: &str| op::tensor_arg(call, n, self.param_doc(n), dt, 4, what);
        let q = get("query", dtype, "[batch, heads_q, seq_q, head_dim]")?;
        let k = get("key", dtype, "[batch, heads_kv, seq_k, head_dim]")?;
        let v = get("value", dtype, "[batch, heads_kv, seq_k, head_dim_v]")?;
        let (b, hq, sq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
        let (hkv, sk) = (k.shape[1], k.shape[2]);
        if d != head_dim {
            return Err(format!(
                "argument `query` has head_dim {d}, but this kernel is compiled for head_dim {head_dim}"
            ));
        }
        if k.shape[0] != b || k.shape[3] != d {
            return Err(format!(
                "argument `key` has shape {:?}; with query {:?} it must be [{b}, KVH, Sk, {d}]",
                k.shape, q.shape
            ));
        }
        if v.shape[..3] != k.shape[..3] {
            return Err(format!(
                "argument `value` has shape {:?}; with key {:?} it must be [{b}, {hkv}, {sk}, Dv]",
                v.shape, k.shape
            ));
        }
        let dv = v.shape[3];
        if dv != want_dv {
            return Err(format!(
                "argument `value` has head_dim {dv}, but this kernel is compiled for a value head_dim of {want_dv}"
            ));
        }
        if hkv == 0 || !hq.is_multiple_of(hkv) {
            return Err(format!("heads_q ({hq}) must be a multiple of heads_kv ({hkv})"));
        }
        if i32::try_from(sq.max(sk)).is_err() {
            return Err(format!("sequence lengths ({sq}, {sk}) must fit in i32"));
        }
        expect_shape(call, "out", &[b, hq, sq, dv], dtype)?;
        expect_shape(call, "lse", &[b, hq, sq], DType::F32)?;
        if f.segment_ids {
            expect_shape(call, "q_segment_ids", &[b, sq], DType::I32)?;
            expect_shape(call, "kv_segment_ids", &[b, sk], DType::I32)?;
        }
        if f.attention_mask {
            expect_shape(call, "attention_mask", &[b, hq, sq, sk], DType::I1)?;
        }
        if f.bias {
            expect_shape(call, "bias", &[b, hq, sq, sk], dtype)?;
        }
        if f.positions {
            expect_shape(call, "q_positions", &[b, sq], DType::I32)?;
            expect_shape(call, "kv_positions", &[b, sk], DType::I32)?;
        }
        if f.sinks {
            let s = call.tensor("sinks").ok_or("argument `sinks` is missing")?;
            if s.dtype != DType::F32 || s.shape.len() != 2 || s.shape[0] != hq {
                return Err(format!(
                    "argument `sinks` has shape {:?} ({}), expected [{hq}, n_sinks] f32",
                    s.shape, s.dtype
                ));
            }
        }
        let scale = call.scalar("softmax_scale").ok_or("scalar argument `softmax_scale` is missing")?;
        if !(scale as f32).is_finite() {
            return Err(format!("scalar argument `softmax_scale` = {scale} must be finite"));
        }
        if f.soft_cap {
            let c = call.scalar("logits_soft_cap").ok_or("scalar argument `logits_soft_cap` is missing")?;
            if !(c > 0.0 && (c as f32).is_finite()) {
                return Err(format!("scalar argument `logits_soft_cap` = {c} must be positive and finite"));
            }
        }
        let size = |n: &str, min: f64| -> Result<(), String> {
            let v = call.scalar(n).ok_or_else(|| format!("scalar argument `{n}` is missing"))?;
            if v.fract() != 0.0 || !(min..=mask::MAX_SIZE as f64).contains(&v) {
                return Err(format!("scalar argument `{n}` = {v} must be an integer from {min} to 2^30"));
            }
            Ok(())
        };
        if f.runtime_window {
            size("window_left", 0.0)?;
            size("window_right", 0.0)?;
        }
        if f.runtime_chunk {
            size("chunk_size", 1.0)?;
        }
        Ok(Sizes::from([
            ("batch".to_string(), b as i64),
            ("heads_q".to_string(), hq as i64),
            ("heads_kv".to_string(), hkv as i64),
            ("seq_q".to_string(), sq as i64),
            ("seq_k".to_string(), sk as i64),
            ("head_dim".to_string(), d as i64),
            ("head_dim_v".to_string(), dv as i64),
            ("layout_batch".to_string(), if f.data_dependent() { b as i64 } else { 1 }),
            ("layout_heads".to_string(), if f.per_head() { hq as i64 } else { 1 }),
        ]))
    }

    fn cache_desc(&self, wanted: &op::Features, dtype: DType, sizes: &Sizes) -> serde_json::Value {
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0);
        let b = |n: i64| (n.max(16) as u64).next_power_of_two();
        json!({
            "batch": g("batch"), "heads_q": g("heads_q"), "heads_kv": g("heads_kv"),
            "seq_q": b(g("seq_q")), "seq_k": b(g("seq_k")),
            "head_dim": g("head_dim"), "head_dim_v": g("head_dim_v"),
            "dtype": dtype.to_string(), "features": wanted,
        })
    }

    fn random_call(&self, f: &op::Features, dtype: DType, dims: &Sizes, seed: u64) -> Result<HostCall, String> {
        let f = features(f)?;
        let s = shape_of(dims)?;
        let x = random_inputs(&f, dtype, &s, seed);
        let mut tensors = BTreeMap::from([
            ("query".to_string(), x.query),
            ("key".to_string(), x.key),
            ("value".to_string(), x.value),
            ("out".to_string(), HostTensor::full(dtype, &[s.batch, s.heads_q, s.seq_q, s.head_dim_v], f64::NAN)),
            ("lse".to_string(), HostTensor::full(DType::F32, &[s.batch, s.heads_q, s.seq_q], f64::NAN)),
        ]);
        for (n, t) in [
            ("q_segment_ids", x.q_segment_ids),
            ("kv_segment_ids", x.kv_segment_ids),
            ("attention_mask", x.attention_mask),
            ("sinks", x.sinks),
            ("q_positions", x.q_positions),
            ("kv_positions", x.kv_positions),
            ("bias", x.bias),
        ] {
            if let Some(t) = t {
                tensors.insert(n.to_string(), t);
            }
        }
        let mut scalars = BTreeMap::from([("softmax_scale".to_string(), 1.0 / (s.head_dim.max(1) as f64).sqrt())]);
        if f.soft_cap {
            scalars.insert("logits_soft_cap".to_string(), 2.5);
        }
        if let Some((l, r)) = x.window {
            scalars.insert("window_left".to_string(), l as f64);
            scalars.insert("window_right".to_string(), r as f64);
        }
        if let Some(c) = x.chunk {
            scalars.insert("chunk_size".to_string(), c as f64);
        }
        Ok(HostCall { tensors, scalars })
    }

    fn call_elements(&self, f: &op::Features, dims: &Sizes) -> Result<u64, String> {
        let f = features(f)?;
        let s = shape_of(dims)?;
        let mut counts = vec![
            op::elements(&[s.batch, s.heads_q + 1, s.seq_q, s.head_dim])?,
            op::elements(&[s.batch, s.heads_kv, s.seq_k, s.head_dim])?,
            op::elements(&[s.batch, s.heads_kv, s.seq_k, s.head_dim_v])?,
            op::elements(&[s.batch, s.heads_q, s.seq_q, s.head_dim_v])?,
            op::elements(&[s.batch, s.heads_q, s.seq_q])?,
        ];
        if f.segment_ids {
            counts.push(op::elements(&[s.batch, s.seq_q + s.seq_k])?);
        }
        if f.attention_mask {
            counts.push(op::elements(&[s.batch, s.mask_heads, s.seq_q, s.seq_k])?);
        }
        if f.positions {
            counts.push(op::elements(&[s.batch, s.seq_q + s.seq_k])?);
        }
        if f.bias {
            counts.push(op::elements(&[s.heads_q, s.seq_q, s.seq_k])?);
        }
        op::total_elements(&counts)
    }

    fn reference(&self, f: &op::Features, call: &HostCall) -> Result<BTreeMap<String, HostTensor>, String> {
        let f = features(f)?;
        let x = inputs_of(call)?;
        let (scale, cap) = scale_and_cap(&f, call)?;
        let (out, lse) = reference(&f, &x, scale, cap)?;
        Ok(BTreeMap::from([("out".to_string(), out), ("lse".to_string(), lse)]))
    }

    fn outputs(&self, _f: &op::Features) -> Vec<&'static str> {
        vec!["out", "lse"]
    }

    fn small_dims(&self, sizes: &Sizes) -> Sizes {
        let mut d = self.dims_of(sizes);
        d.insert("batch".into(), d.get("batch").copied().unwrap_or(1).min(2));
        d.insert("seq_q".into(), d.get("seq_q").copied().unwrap_or(1).min(150));
        d.insert("seq_k".into(), d.get("seq_k").copied().unwrap_or(1).min(170));
        d
    }

    fn check_dims(&self, keys: &Keys) -> Vec<Sizes> {
        let d = keys.get("head_dim").copied().unwrap_or(64) as usize;
        let dv = head_dim_v(keys).unwrap_or(d as u32) as usize;
        // [batch, heads_q, heads_kv, seq_q, seq_k, mask_heads]: Sq ≠ Sk both ways, lengths
        // off every block size, GQA and MQA, one query row, a mask per head.
        [
            [2, 4, 2, 150, 170, 1],
            [1, 4, 1, 333, 200, 4],
            [2, 2, 2, 77, 301, 1],
            [1, 8, 2, 1, 45, 1],
            [1, 2, 1, 129, 129, 2],
        ]
        .iter()
        .map(|&[b, hq, hkv, sq, sk, mh]| {
            dims_of(&BsShape {
                batch: b,
                heads_q: hq,
                heads_kv: hkv,
                seq_q: sq,
                seq_k: sk,
                head_dim: d,
                head_dim_v: dv,
                doc_len: 0,
                mask_heads: mh,
            })
        })
        .collect()
    }

    fn work(&self, f: &op::Features, dtype: DType, sizes: &Sizes) -> Work {
        // The dense count (FlexAttention's convention for its TFLOP/s is the visited
        // blocks'; the bench reports both where it can): two products per visible pair,
        // counted from the mask algebra alone (segment ids and array masks unknown here).
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0).max(0) as f64;
        let (sq, sk) = (g("seq_q"), g("seq_k"));
        let dv = if g("head_dim_v") > 0.0 { g("head_dim_v") } else { g("head_dim") };
        let density = features(f).map(|f| mask_density(&f.mask, sq as i64, sk as i64)).unwrap_or(1.0);
        let flops = 2.0 * g("batch") * g("heads_q") * sq * sk * (g("head_dim") + dv) * density;
        let bytes = g("batch") * (g("heads_q") * sq * (g("head_dim") + dv) + g("heads_kv") * sk * (g("head_dim") + dv));
        Work { flops, bytes: bytes * dtype.size_bytes() as f64 }
    }

    /// 64 × 64 blocks where built, else the first.
    fn heuristic(&self, configs: &[Config]) -> Option<usize> {
        configs
            .iter()
            .position(|c| c.get("block_m") == Some(&64) && c.get("block_n") == Some(&64))
            .or((!configs.is_empty()).then_some(0))
    }
}

/// The fraction of (row, key) pairs the mask algebra shows, sampled on a grid of at most
/// 256 × 256 positions (the work count of a benchmark row, not a correctness matter).
pub fn mask_density(m: &MaskExpr, sq: i64, sk: i64) -> f64 {
    if sq <= 0 || sk <= 0 {
        return 0.0;
    }
    let (ny, nx) = (sq.min(256), sk.min(256));
    let mut seen = 0u64;
    for y in 0..ny {
        let i = y * sq / ny;
        for x in 0..nx {
            if m.visible(i, x * sk / nx) {
                seen += 1;
            }
        }
    }
    seen as f64 / (ny * nx) as f64
}
