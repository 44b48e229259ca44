//! Mean pooling as an [`Operation`]: chunk means of a sequence (forward) and their
//! gradient (backward), dense or varlen — the semantics are stated in [`super::kernels`]
//! and in docs/semantics.md.
//!
//! ```
//! use ejc_ir::op::Operation;
//! let op = ejc_ir::ops::get("mean_pooling").unwrap();
//! let dims: Vec<&str> = op.dims().iter().map(|d| d.name).collect();
//! assert_eq!(dims, ["batch", "seq", "heads", "head_dim", "chunk_size"]);
//! ```

use std::collections::BTreeMap;

use serde_json::json;

use super::kernels::{build, param_docs, PoolKernel};
use super::reference::{grid_symbols, random_inputs, reference_bwd, reference_fwd, PoolShape};
use crate::ir::Kernel;
use crate::op::{
    self, AxisDecl, AxisKind, CallView, DimDecl, HostCall, KernelInstance, Keys, Operation, PlanDecl, ScalarDecl,
    Sizes, Work,
};
use crate::spec::{Decoder, Fields, Spec};
use crate::tensor::HostTensor;
use crate::types::DType;

/// The operation (registered in [`crate::ops`]).
pub struct MeanPooling;

/// What a variant computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolFeatures {
    /// dout → dx instead of x → out.
    pub backward: bool,
    /// Packed sequences with `cu_seqlens`.
    pub varlen: bool,
}

impl PoolFeatures {
    pub fn to_json(self) -> op::Features {
        op::Features::from([("backward".into(), json!(self.backward)), ("varlen".into(), json!(self.varlen))])
    }

    pub fn from_json(f: &op::Features) -> Result<PoolFeatures, String> {
        for k in f.keys() {
            if k != "backward" && k != "varlen" {
                return Err(format!("unknown mean_pooling feature `{k}`"));
            }
        }
        let flag = |k: &str| f.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
        Ok(PoolFeatures { backward: flag("backward"), varlen: flag("varlen") })
    }

    /// The input tensor's name (x, or dout), and the output's (out, or dx).
    pub fn tensors(self) -> (&'static str, &'static str) {
        if self.backward {
            ("dout", "dx")
        } else {
            ("x", "out")
        }
    }
}

fn features(f: &op::Features) -> Result<PoolFeatures, String> {
    PoolFeatures::from_json(f)
}

const AXES: &[AxisDecl] = &[
    AxisDecl {
        name: "block_h",
        kind: AxisKind::Tile,
        required: true,
        noun: "head block",
        allowed: "16, 32, 64 or 128",
        list_allowed: "a non-empty list of head blocks from 16, 32, 64 or 128",
        check: |v| (![16, 32, 64, 128].contains(&v)).then_some("unsupported head block"),
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
];

const DIMS: &[DimDecl] = &[
    DimDecl { name: "batch", default: 2, optional: false, doc: "batch size (varlen: the number of packed sequences)" },
    DimDecl { name: "seq", default: 300, optional: false, doc: "tokens per sequence (varlen: the longest)" },
    DimDecl { name: "heads", default: 4, optional: false, doc: "heads" },
    DimDecl {
        name: "head_dim",
        default: 64,
        optional: false,
        doc: "head dimension (compiled in: one of the spec's head_dims)",
    },
    DimDecl { name: "chunk_size", default: 32, optional: false, doc: "tokens per chunk (>= 1)" },
];

fn shape_of(dims: &Sizes) -> Result<PoolShape, String> {
    let g = |k: &str| -> Result<usize, String> {
        dims.get(k).map(|v| (*v).max(0) as usize).ok_or_else(|| format!("size `{k}` is missing"))
    };
    let s = PoolShape {
        batch: g("batch")?,
        seq: g("seq")?,
        heads: g("heads")?,
        head_dim: g("head_dim")?,
        chunk: g("chunk_size")?,
    };
    if s.chunk == 0 {
        return Err("size `chunk_size` must be at least 1".into());
    }
    if s.batch == 0 || s.heads == 0 || s.head_dim == 0 {
        return Err("sizes `batch`, `heads` and `head_dim` must be at least 1".into());
    }
    Ok(s)
}

impl Operation for MeanPooling {
    fn name(&self) -> &'static str {
        "mean_pooling"
    }

    fn summary(&self) -> &'static str {
        "chunk means of a sequence [B, ceil(T/C), H, D] (native sparse attention's compression), and their gradient"
    }

    fn dtypes(&self) -> &'static [DType] {
        &[DType::BF16, DType::F16, DType::F32]
    }

    fn dtype_refusal(&self) -> &'static str {
        "cannot be pooled (bf16, f16 and f32 can)"
    }

    fn fields(&self) -> &'static [&'static str] {
        &["head_dims"]
    }

    fn decode_fields(&self, d: &mut Decoder, f: &Fields, keys: &mut Vec<(String, Vec<u32>)>, _sets: &mut Vec<Keys>) {
        op::decode_head_dims(d, f, keys)
    }

    fn variant_fields(&self) -> &'static [&'static str] {
        &["backward", "varlen"]
    }

    fn variant_allowed(&self) -> &'static str {
        "a mapping such as `backward: true`, `varlen: true`; `{}` for the dense forward"
    }

    fn decode_variant(&self, d: &mut Decoder, f: &Fields) -> op::Features {
        let flag = |d: &mut Decoder, name: &str| match f.value(name) {
            Some(v) => d.bool(v, &f.path(name)).unwrap_or(false),
            None => false,
        };
        PoolFeatures { backward: flag(d, "backward"), varlen: flag(d, "varlen") }.to_json()
    }

    fn describe(&self, f: &op::Features) -> String {
        match features(f) {
            Ok(p) => format!(
                "{}{}",
                if p.backward { "backward (dout -> dx)" } else { "forward (x -> chunk means)" },
                if p.varlen { " + varlen" } else { "" }
            ),
            Err(e) => e,
        }
    }

    fn axes(&self) -> &'static [AxisDecl] {
        AXES
    }

    fn plan_names(&self) -> &'static [&'static str] {
        &["single"]
    }

    fn plans(&self, _spec: &Spec, _f: &op::Features) -> Vec<PlanDecl> {
        vec![PlanDecl::single(&["block_h"])]
    }

    fn kernel_id(&self, spec_name: &str, k: &KernelInstance) -> String {
        let hd = k.keys.get("head_dim").copied().unwrap_or(0);
        let bh = k.tile.get("block_h").copied().unwrap_or(0);
        format!("{spec_name}_{}_{}_d{hd}_h{bh}", k.variant.name, k.dtype)
    }

    fn build(&self, spec: &Spec, k: &KernelInstance) -> Result<Kernel, String> {
        let f = features(&k.variant.features)?;
        let head_dim = *k.keys.get("head_dim").ok_or("the instance has no head_dim")? as usize;
        let block_h = *k.tile.get("block_h").ok_or("the instance has no block_h")? as usize;
        let mut kernel =
            build(&k.id, &PoolKernel { backward: f.backward, varlen: f.varlen, dtype: k.dtype, head_dim, block_h })
                .map_err(|e| e.to_string())?;
        // Printed metadata (snapshots, dumps); nothing reads it back.
        kernel.attrs = vec![
            ("op".into(), spec.op.clone()),
            ("variant".into(), k.variant.name.clone()),
            ("dtype".into(), k.dtype.to_string()),
            ("head_dim".into(), head_dim.to_string()),
            ("block_h".into(), block_h.to_string()),
        ];
        Ok(kernel)
    }

    fn param_doc(&self, name: &str) -> &'static str {
        param_docs().iter().find(|(n, _)| *n == name).map(|(_, d)| *d).unwrap_or("")
    }

    fn dims(&self) -> &'static [DimDecl] {
        DIMS
    }

    fn call_dtype(&self, call: &dyn CallView) -> Result<DType, String> {
        call.tensor("x")
            .or_else(|| call.tensor("dout"))
            .map(|t| t.dtype)
            .ok_or_else(|| "argument `x` (forward) or `dout` (backward) is missing".into())
    }

    fn keys_of(&self, dims: &Sizes) -> Keys {
        Keys::from([("head_dim".to_string(), dims.get("head_dim").copied().unwrap_or(0).max(0) as u32)])
    }

    fn call_keys(&self, call: &dyn CallView) -> Result<Keys, String> {
        let (name, t) = match call.tensor("x") {
            Some(t) => ("x", t),
            None => ("dout", call.tensor("dout").ok_or("argument `x` (forward) or `dout` (backward) is missing")?),
        };
        if t.shape.len() != 4 {
            return Err(format!("argument `{name}`: shape {:?} is not [batch, seq, heads, head_dim]", t.shape));
        }
        Ok(Keys::from([("head_dim".to_string(), t.shape[3] as u32)]))
    }

    fn dims_of(&self, sizes: &Sizes) -> Sizes {
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0);
        let varlen = sizes.contains_key("num_seqs");
        Sizes::from([
            ("batch".to_string(), if varlen { g("num_seqs") } else { g("batch") }),
            ("seq".to_string(), if varlen { g("max_seq") } else { g("seq") }),
            ("heads".to_string(), g("heads")),
            ("head_dim".to_string(), g("head_dim")),
            ("chunk_size".to_string(), g("chunk_size")),
        ])
    }

    fn scalars(&self, _f: &op::Features) -> Vec<ScalarDecl> {
        vec![ScalarDecl { name: "chunk_size", doc: "tokens per chunk (>= 1)" }]
    }

    fn validate(&self, f: &op::Features, dtype: DType, keys: &Keys, call: &dyn CallView) -> Result<Sizes, String> {
        let f = features(f)?;
        let (input, output) = f.tensors();
        let head_dim = keys.get("head_dim").copied().unwrap_or(0) as usize;
        let get = |n: &str| op::tensor_arg(call, n, self.param_doc(n), dtype, 4, "[batch, seq, heads, head_dim]");
        let (i, o) = (get(input)?, get(output)?);
        // The token tensor (x, dx) and the chunk tensor (out, dout).
        let (tokens, chunks, tn, cn) = if f.backward { (o, i, output, input) } else { (i, o, input, output) };
        if tokens.shape[3] != head_dim {
            return Err(format!(
                "argument `{tn}` has head_dim {}, but this kernel is compiled for head_dim {head_dim}",
                tokens.shape[3]
            ));
        }
        let c = call.scalar("chunk_size").ok_or("scalar argument `chunk_size` is missing")?;
        if !(c >= 1.0 && c <= i32::MAX as f64 && c.fract() == 0.0) {
            return Err(format!("scalar argument `chunk_size` = {c} must be an integer from 1 to 2^31 - 1"));
        }
        let chunk = c as usize;
        let cu = if f.varlen {
            let t = call.tensor("cu_seqlens").ok_or("argument `cu_seqlens` (varlen) is missing")?;
            if t.dtype != DType::I32 || t.shape.len() != 1 {
                return Err(format!("argument `cu_seqlens` must be i32 [num_seqs + 1], got {} {:?}", t.dtype, t.shape));
            }
            let values = call.int_values("cu_seqlens")?;
            let total = tokens.shape[1] as i64;
            if tokens.shape[0] != 1 {
                return Err(format!(
                    "varlen: `{tn}` must be packed as [1, total_T, H, D], got batch {}",
                    tokens.shape[0]
                ));
            }
            if values.is_empty()
                || values[0] != 0
                || values.windows(2).any(|w| w[1] < w[0])
                || *values.last().unwrap_or(&0) != total
            {
                return Err(format!(
                    "argument `cu_seqlens` must start at 0, never decrease and end at {total} (the packed tokens); got {values:?}"
                ));
            }
            Some(HostTensor::from_vec(DType::I32, &[values.len()], values.iter().map(|v| *v as f64).collect()))
        } else {
            None
        };
        let syms = grid_symbols(&tokens.shape, cu.as_ref(), chunk);
        let sym = |k: &str| syms.iter().find(|(n, _)| *n == k).map(|(_, v)| *v).unwrap_or(0);
        let want = [tokens.shape[0], sym("total_chunks") as usize, tokens.shape[2], head_dim];
        if chunks.shape != want {
            return Err(format!(
                "argument `{cn}` has shape {:?}, expected {want:?} (chunk size {chunk})",
                chunks.shape
            ));
        }
        let mut sizes = Sizes::from([
            ("batch".to_string(), tokens.shape[0] as i64),
            ("seq".to_string(), tokens.shape[1] as i64),
            ("heads".to_string(), tokens.shape[2] as i64),
            ("head_dim".to_string(), head_dim as i64),
            ("chunk_size".to_string(), chunk as i64),
        ]);
        for (k, v) in syms {
            sizes.insert(k.to_string(), v);
        }
        if let Some(cu) = &cu {
            let v = cu.to_vec();
            sizes.insert("max_seq".into(), v.windows(2).map(|w| (w[1] - w[0]) as i64).max().unwrap_or(0));
        }
        Ok(sizes)
    }

    fn cache_desc(&self, wanted: &op::Features, dtype: DType, sizes: &Sizes) -> serde_json::Value {
        let d = self.dims_of(sizes);
        let b = |n: i64| (n.max(16) as u64).next_power_of_two();
        json!({
            "tokens": [d["batch"], b(d["seq"]), d["heads"], d["head_dim"]], "dtype": dtype.to_string(),
            "chunk_size": d["chunk_size"], "features": wanted,
        })
    }

    fn random_call(&self, f: &op::Features, dtype: DType, dims: &Sizes, seed: u64) -> Result<HostCall, String> {
        let p = features(f)?;
        let shape = shape_of(dims)?;
        let inputs = random_inputs(p.backward, p.varlen, dtype, &shape, seed);
        let (input, output) = p.tensors();
        let mut tensors = BTreeMap::new();
        tensors.insert(input.to_string(), inputs.input);
        tensors.insert(output.to_string(), HostTensor::full(dtype, &inputs.out_shape, f64::NAN));
        if let Some(cu) = inputs.cu_seqlens {
            tensors.insert("cu_seqlens".to_string(), cu);
        }
        Ok(HostCall { tensors, scalars: BTreeMap::from([("chunk_size".to_string(), shape.chunk as f64)]) })
    }

    fn call_elements(&self, _f: &op::Features, dims: &Sizes) -> Result<u64, String> {
        let s = shape_of(dims)?;
        let x = op::elements(&[s.batch, s.seq, s.heads, s.head_dim])?;
        // The pooled side is never larger than the sequence side.
        op::total_elements(&[x, x, s.batch as u64 + 1])
    }

    fn reference(&self, f: &op::Features, call: &HostCall) -> Result<BTreeMap<String, HostTensor>, String> {
        let p = features(f)?;
        let (input, output) = p.tensors();
        let x = call.tensors.get(input).ok_or_else(|| format!("the call has no `{input}`"))?;
        let chunk = call.scalars.get("chunk_size").copied().ok_or("the call has no `chunk_size`")? as usize;
        let cu = call.tensors.get("cu_seqlens");
        let r = if p.backward {
            let dx = call.tensors.get(output).ok_or_else(|| format!("the call has no `{output}`"))?;
            reference_bwd(x, cu, chunk, &dx.shape)?
        } else {
            reference_fwd(x, cu, chunk)?
        };
        Ok(BTreeMap::from([(output.to_string(), r)]))
    }

    fn outputs(&self, f: &op::Features) -> Vec<&'static str> {
        vec![features(f).unwrap_or_default().tensors().1]
    }

    fn small_dims(&self, sizes: &Sizes) -> Sizes {
        let mut d = self.dims_of(sizes);
        d.insert("batch".into(), d["batch"].min(3));
        d.insert("seq".into(), d["seq"].min(77));
        d
    }

    fn check_dims(&self, keys: &Keys) -> Vec<Sizes> {
        let d = keys.get("head_dim").copied().unwrap_or(64) as i64;
        // T off the chunk size, C = 1, C > T, heads off every head block, one token.
        [[2, 77, 4, 8], [1, 45, 3, 1], [1, 19, 2, 32], [3, 130, 17, 7], [1, 1, 1, 5]]
            .iter()
            .map(|[b, t, h, c]| {
                Sizes::from([
                    ("batch".to_string(), *b),
                    ("seq".to_string(), *t),
                    ("heads".to_string(), *h),
                    ("head_dim".to_string(), d),
                    ("chunk_size".to_string(), *c),
                ])
            })
            .collect()
    }

    fn work(&self, _f: &op::Features, dtype: DType, sizes: &Sizes) -> Work {
        // Memory-bound: every token row is read (or written) once and every chunk row
        // written (or read) once; reported as GB/s.
        let d = self.dims_of(sizes);
        let g = |k: &str| d.get(k).copied().unwrap_or(0).max(0) as f64;
        let rows = g("batch") * g("seq") * g("heads");
        let chunks = g("batch") * (g("seq") / g("chunk_size").max(1.0)).ceil() * g("heads");
        Work { flops: 0.0, bytes: (rows + chunks) * g("head_dim") * dtype.size_bytes() as f64 }
    }
}
