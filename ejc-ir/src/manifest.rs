//! `manifest.json`: what `ejc build` wrote, and how to launch it. The schema is a
//! public interface (docs/abi.md); the codegen crate writes it and the runtime reads
//! it, so it lives here, where both can see it without the runtime linking LLVM.
//!
//! ```
//! use ejc_ir::manifest::Manifest;
//! let m = Manifest::parse(r#"{"format": "ejc-manifest/2", "compiler": {"name": "ejc", "version": "0.1.0"},
//!   "spec": {"name": "pool", "file": "specs/mean_pooling.yaml", "sha256": "00", "op": "mean_pooling", "version": 1},
//!   "plans": [], "artifacts": []}"#).unwrap();
//! assert_eq!(m.spec.op, "mean_pooling");
//! ```
//!
//! Version 2 is operation-neutral: an artifact names its operation's *instance* (the
//! variant, the dtype and the op's compile-time keys such as `head_dim`), the *role* it
//! plays in a plan, its configuration, and its parameters and grid as the kernel
//! declares them. A *plan* is how one call of an instance runs: one launch or several,
//! in order, with temporaries between them. A reader of version 1 is refused with a
//! message saying to rebuild ([`Manifest::parse`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Format tag; bumped when a field changes meaning.
pub const FORMAT: &str = "ejc-manifest/2";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub compiler: Compiler,
    pub spec: SpecInfo,
    /// How each instance's calls run; an artifact is launched only as part of a plan.
    pub plans: Vec<Plan>,
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

/// An operation's instance: what a call must match exactly (the variant, the dtype and
/// the operation's compile-time keys). Sizes that are not compiled in (sequence
/// lengths, batch, heads) are not part of it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Instance {
    pub variant: String,
    /// `bf16`, `f16`, `f32` (`none` for `#[ej_kernel]` kernels, which are generic).
    pub dtype: String,
    /// The operation's compile-time keys, e.g. `{"head_dim": 128}`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, u32>,
}

impl Instance {
    /// `causal bf16 head_dim=128`.
    pub fn describe(&self) -> String {
        let mut s = format!("{} {}", self.variant, self.dtype);
        for (k, v) in &self.keys {
            s.push_str(&format!(" {k}={v}"));
        }
        s
    }
}

/// A temporary buffer of a plan: allocated by the launcher before the first launch,
/// contiguous (row-major), its extents size formulas (`GridExpr` text) of the call's
/// sizes and the configuration's values.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Temporary {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<String>,
    /// What the launcher fills it with before the first launch (`none`: nothing; the
    /// plan writes every element it reads).
    #[serde(default = "fill_none", skip_serializing_if = "is_fill_none")]
    pub fill: String,
    /// Whether a call may give it (a precomputed block-sparse layout): a call tensor of
    /// its name, dtype and shape is then used instead, and the launches that only
    /// produce given temporaries are skipped (`ejc_ir::op::given_temporaries`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub given: bool,
}

fn fill_none() -> String {
    "none".into()
}

fn is_fill_none(s: &String) -> bool {
    s == "none"
}

/// One launch of a plan: the kernel playing `role` (the artifact of that role, instance
/// and back end that the configuration selects), with its parameters bound.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Launch {
    pub role: String,
    /// Parameter → what it is bound to, where that is not the call's tensor or scalar
    /// of the same name: a temporary's name, or (for a scalar) a size formula of the
    /// call's sizes and the configuration's values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub bind: BTreeMap<String, String>,
    /// The earlier launches (indices into the plan's `launches`) this one waits for.
    /// Absent: every earlier launch (the plan runs in order). Present: only those (and,
    /// through them, theirs), so a launcher may run it at the same time as the others —
    /// on another CUDA stream. The plan promises that launches with no path between
    /// them touch disjoint elements of what either one writes (docs/abi.md, "Plans").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Vec<usize>>,
    /// The temporaries this launch writes, where a call may give them instead (see
    /// [`Temporary::given`]): when the call gives every one, the launch is skipped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub produces: Vec<String>,
}

impl Launch {
    /// A launch of `role` with no bindings, after every earlier launch.
    pub fn of(role: &str) -> Launch {
        Launch { role: role.into(), bind: BTreeMap::new(), after: None, produces: Vec::new() }
    }
}

/// Which earlier launches each launch of `launches` waits for directly (`after`, or every
/// earlier one where it is absent), checked: an index must name an earlier launch.
pub fn launch_waits(launches: &[Launch]) -> Result<Vec<Vec<usize>>, String> {
    launches
        .iter()
        .enumerate()
        .map(|(i, l)| match &l.after {
            None => Ok((0..i).collect()),
            Some(a) => {
                if let Some(bad) = a.iter().find(|&&j| j >= i) {
                    return Err(format!(
                        "launch {i} (`{}`) waits for launch {bad}, which is not an earlier one",
                        l.role
                    ));
                }
                let mut a = a.clone();
                a.sort_unstable();
                a.dedup();
                Ok(a)
            }
        })
        .collect()
}

/// Another order the launches may run in: at each step the *latest-listed* launch whose
/// waits are done. A plan whose `after` lists are honest gives the same results in this
/// order as in the listed one (the interpreter's tests run both).
pub fn late_order(launches: &[Launch]) -> Result<Vec<usize>, String> {
    let waits = launch_waits(launches)?;
    let mut done = vec![false; launches.len()];
    let mut order = Vec::with_capacity(launches.len());
    while order.len() < launches.len() {
        let next = (0..launches.len())
            .rev()
            .find(|&i| !done[i] && waits[i].iter().all(|&j| done[j]))
            .expect("waits name earlier launches only, so one is always ready");
        done[next] = true;
        order.push(next);
    }
    Ok(order)
}

/// How one call of an instance runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// `single` (one kernel), `split_kv`, ...: the operation's name for the algorithm.
    pub name: String,
    pub instance: Instance,
    /// The instance's features, as the spec states them (what calls are matched on).
    pub features: BTreeMap<String, serde_json::Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub temporaries: Vec<Temporary>,
    pub launches: Vec<Launch>,
    /// Configuration values that no kernel is compiled for but the plan reads at run
    /// time (e.g. `num_splits`): the autotuner tries each.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub axes: BTreeMap<String, Vec<u32>>,
    /// Configuration keys (tile axes) every launch's artifact must agree on: a launcher
    /// pairs only such artifacts (roles that exchange a table laid out per tile share
    /// the tile's sizes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared: Vec<String>,
}

/// One kernel × candidate configuration × target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Artifact {
    /// Kernel id: `flash_causal_bf16_d128_m64_n32`.
    pub kernel_id: String,
    pub instance: Instance,
    /// The role this kernel plays in the instance's plans (`main`, `partial`, `combine`).
    pub role: String,
    /// The instance's features, as the spec states them.
    pub features: BTreeMap<String, serde_json::Value>,
    /// The schedule values this target uses (the tile program's, e.g. `block_m`,
    /// `block_n`, and for GPU targets `num_warps`, `num_stages` and the code path).
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
    /// Parameters in call order, as the kernel declares them.
    pub params: Vec<AbiParamInfo>,
    /// Launch grid (x, y, z) as size formulas (the kernel's): e.g.
    /// `["cdiv(seq_q, 64)", "heads_q", "batch"]`; `caller` where the caller chooses
    /// (`#[ej_kernel]` kernels).
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
    /// Read a manifest. Version 1 (written before operations had instances and plans)
    /// is refused with a message: rebuilding is the only way to get plans for it.
    pub fn parse(text: &str) -> Result<Manifest, String> {
        #[derive(Deserialize)]
        struct Head {
            format: Option<String>,
        }
        let head: Head = serde_json::from_str(text).map_err(|e| format!("not a valid ejc manifest: {e}"))?;
        match head.format.as_deref() {
            Some(FORMAT) => {}
            Some("ejc-manifest/1") => {
                return Err("manifest format `ejc-manifest/1` was written by an older ejc, before operations had \
instances and plans; this ejc reads `ejc-manifest/2`: rebuild it with `ejc build`"
                    .into())
            }
            Some(other) => {
                return Err(format!("manifest format `{other}` is not supported (this ejc reads `{FORMAT}`)"))
            }
            None => return Err("not a valid ejc manifest: it has no `format`".into()),
        }
        let m: Manifest = serde_json::from_str(text).map_err(|e| format!("not a valid ejc manifest: {e}"))?;
        for p in &m.plans {
            launch_waits(&p.launches).map_err(|e| format!("plan `{}` ({}): {e}", p.name, p.instance.describe()))?;
        }
        Ok(m)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("manifest types serialize infallibly") + "\n"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_1_is_refused_with_a_reason() {
        let v1 = r#"{"format": "ejc-manifest/1", "compiler": {"name": "ejc", "version": "0.1.0"},
          "spec": {"name": "flash", "file": "f", "sha256": "00", "op": "flash_attention_fwd", "version": 1},
          "artifacts": []}"#;
        let e = Manifest::parse(v1).unwrap_err();
        assert!(e.contains("rebuild it with `ejc build`"), "{e}");
        assert!(Manifest::parse(r#"{"format": "x"}"#).unwrap_err().contains("not supported"));
        assert!(Manifest::parse("[]").unwrap_err().contains("not a valid"));
    }

    #[test]
    fn waits_default_to_every_earlier_launch_and_must_look_back() {
        let mut ls = vec![Launch::of("pack"), Launch::of("decode"), Launch::of("prefill"), Launch::of("unpack")];
        assert_eq!(launch_waits(&ls).unwrap(), vec![vec![], vec![0], vec![0, 1], vec![0, 1, 2]]);
        assert_eq!(late_order(&ls).unwrap(), vec![0, 1, 2, 3]);
        ls[1].after = Some(vec![0]);
        ls[2].after = Some(vec![0]);
        ls[3].after = Some(vec![2, 1, 2]);
        assert_eq!(launch_waits(&ls).unwrap()[3], vec![1, 2]);
        // The two middle launches are independent: the late order runs `prefill` first.
        assert_eq!(late_order(&ls).unwrap(), vec![0, 2, 1, 3]);
        ls[1].after = Some(vec![1]);
        let e = launch_waits(&ls).unwrap_err();
        assert!(e.contains("launch 1 (`decode`) waits for launch 1"), "{e}");
    }
}
