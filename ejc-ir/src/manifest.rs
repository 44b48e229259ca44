//! `manifest.json`: what `ejc build` wrote, and how to launch it. The schema is a
//! public interface (docs/abi.md); the codegen crate writes it and the runtime reads
//! it, so it lives here, where both can see it without the runtime linking LLVM.
//!
//! ```
//! use ejc_ir::manifest::Manifest;
//! let m = Manifest::parse(r#"{"format": "ejc-manifest/1", "compiler": {"name": "ejc", "version": "0.1.0"},
//!   "spec": {"name": "flash", "file": "specs/flash.yaml", "sha256": "00", "op": "flash_attention_fwd", "version": 1},
//!   "artifacts": []}"#).unwrap();
//! assert_eq!(m.spec.op, "flash_attention_fwd");
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Format tag; bumped when a field changes meaning.
pub const FORMAT: &str = "ejc-manifest/1";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub compiler: Compiler,
    pub spec: SpecInfo,
    pub artifacts: Vec<Artifact>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compiler {
    pub name: String,
    pub version: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecInfo {
    pub name: String,
    /// The spec file as given to `ejc build`.
    pub file: String,
    /// SHA-256 of the spec file's bytes.
    pub sha256: String,
    /// Operation (registry key) and its version: `op@version` in cache keys.
    pub op: String,
    pub version: u32,
}

/// One kernel × candidate configuration × target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Artifact {
    /// Kernel id (variant, dtype, head dim, tiling): `flash_causal_bf16_d128_m64_n32`.
    pub kernel_id: String,
    pub variant: String,
    /// The variant's features, as the spec states them.
    pub features: BTreeMap<String, serde_json::Value>,
    pub dtype: String,
    pub head_dim: usize,
    /// The schedule values this target uses (`block_m`, `block_n`, and for GPU
    /// targets `num_warps`, `num_stages`).
    pub config: BTreeMap<String, u32>,
    /// Unique within the manifest: `<kernel_id>@<target>` plus the config's extra
    /// values, e.g. `flash_causal_bf16_d128_m64_n32@ptx:sm_90a/w4_s2`.
    pub artifact_id: String,
    /// `ir`, `cpu:<isa>`, `ptx:<arch>`, `mlir:cpu`, `mlir:gpu` (the `.mlir` text), `mlir:gpu:<chip>`
    /// (PTX from MLIR's NVVM pipeline).
    pub target: String,
    /// Path of the artifact file, relative to the manifest's directory.
    pub file: String,
    /// SHA-256 of the file.
    pub sha256: String,
    /// Symbol to call (the kernel function's name in the file).
    pub entry: String,
    /// Parameters in call order.
    pub params: Vec<AbiParamInfo>,
    /// Launch grid (x, y, z) as formulas of the call's sizes (docs/abi.md lists the
    /// symbols): e.g. `["cdiv(seq_q, 64)", "heads_q", "batch"]`.
    pub grid: [String; 3],
    /// Threads per block (x, y, z) for GPU targets; absent where the target has no
    /// thread blocks (ir, cpu).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<[u32; 3]>,
    /// Dynamic shared memory in bytes (GPU targets; 0 elsewhere).
    pub dynamic_shared_memory: u32,
    /// Scratch memory the caller passes: per thread for CPU targets (`cpu:<isa>`,
    /// `mlir:cpu`); per block for `mlir:gpu:<chip>` PTX, whose launcher appends a pointer
    /// to `blocks × scratch_bytes` bytes of global memory as the last parameter
    /// (docs/abi.md). 0 (absent) elsewhere.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub scratch_bytes: u64,
    /// PTX targets: a second entry in the same file, compiled for aligned inputs (no
    /// element-by-element fallback for the tiles it copies to shared memory, so fewer
    /// registers and a faster loop). A launcher may call it instead of `entry`, with the
    /// same parameters, grid, block and shared memory, when every tensor it names is
    /// aligned: data address a multiple of 16 bytes, last stride 1, every other stride a
    /// multiple of 8 elements, and every scalar it names is > 0 (docs/abi.md, "Aligned
    /// entry").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aligned: Option<AlignedEntry>,
}

/// The aligned entry of a PTX artifact (see [`Artifact::aligned`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlignedEntry {
    pub entry: String,
    /// The tensors (parameter names) that must be aligned.
    pub tensors: Vec<String>,
    /// Scalar parameters that must be > 0 (the softmax scale, folded into the
    /// exponent); absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub positive: Vec<String>,
    /// Warp-specialised artifacts: tensor maps (`CUtensorMap`, 128 bytes, by value) the
    /// aligned entry takes after the ABI's parameters, in this order (docs/abi.md,
    /// "Tensor maps"); absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensor_maps: Vec<TensorMapParam>,
}

/// A tensor map the aligned entry of a warp-specialised artifact takes: a tiled map of
/// tensor `tensor` (its shape and strides, innermost axis first), box `box_dims` (in the
/// tensor's axis order), element strides 1, no interleave, swizzle `swizzle`, zero
/// fill out of bounds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorMapParam {
    pub tensor: String,
    #[serde(rename = "box")]
    pub box_dims: Vec<u32>,
    /// `128B`.
    pub swizzle: String,
}

impl AlignedEntry {
    /// Whether a tensor with this data address (bytes), strides (elements) meets the
    /// condition.
    pub fn tensor_ok(address: u64, strides: &[i64]) -> bool {
        address.is_multiple_of(16)
            && strides.last().is_none_or(|s| *s == 1)
            && strides.iter().rev().skip(1).all(|s| s % 8 == 0)
    }
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

/// One parameter of an artifact's launch ABI.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbiParamInfo {
    pub name: String,
    /// `tensor` or `scalar`.
    pub kind: String,
    pub dtype: String,
    /// Tensor rank (0 for scalars).
    pub rank: usize,
    pub meaning: String,
}

impl Manifest {
    pub fn parse(text: &str) -> Result<Manifest, String> {
        let m: Manifest = serde_json::from_str(text).map_err(|e| format!("not a valid ejc manifest: {e}"))?;
        if m.format != FORMAT {
            return Err(format!("manifest format `{}` is not supported (this ejc reads `{FORMAT}`)", m.format));
        }
        Ok(m)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("manifest types serialize infallibly") + "\n"
    }
}
