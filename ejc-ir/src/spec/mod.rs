//! The YAML spec front end: what a spec file declares, after validation.
//!
//! ```no_run
//! let spec = ejc_ir::spec::load_file("specs/flash.yaml").unwrap();
//! for v in &spec.variants {
//!     println!("{}: causal={}", v.name, v.features.causal);
//! }
//! ```
//!
//! Loading never panics: a spec that is not YAML, has unknown fields, wrong types or
//! impossible values gives [`SpecError`], a list of [`Diagnostic`]s, each with
//! `file:line:column`, the field path, what was found and what is allowed.
//! `docs/spec.md` documents the format.

mod decode;
mod diag;
mod yaml;

pub use decode::{load_file, load_str};
pub use diag::{Diagnostic, SpecError};

use crate::types::DType;

/// A validated spec file.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// The file name used in diagnostics and manifests (as given to the loader).
    pub file: String,
    /// SHA-256 (hex) of the file's bytes.
    pub hash: String,
    /// Family name, e.g. `flash`.
    pub name: String,
    /// The operation the family implements (registry key), e.g. `flash_attention_fwd`.
    pub op: String,
    /// Operation version (goes into cache keys as `op@version`).
    pub version: u32,
    pub description: Option<String>,
    /// Tensor layout of q/k/v/out. Only `bshd` exists today.
    pub layout: Layout,
    /// Input dtypes, in file order (deduplicated).
    pub dtypes: Vec<DType>,
    /// Head dimensions, in file order (deduplicated).
    pub head_dims: Vec<usize>,
    /// Named variants, in file order.
    pub variants: Vec<Variant>,
    pub schedule: ScheduleSpace,
    pub targets: Vec<Target>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Bshd,
}

/// One named variant: a combination of attention features.
#[derive(Clone, Debug, PartialEq)]
pub struct Variant {
    pub name: String,
    pub description: Option<String>,
    pub features: Features,
}

/// Attention features of one variant. Every combination is accepted except
/// `varlen` with `bias`, `mask` or `segment_ids` (the spec loader rejects those).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Features {
    /// Bottom-right aligned causal mask: query i sees key j iff j <= i + (s_k - s_q).
    pub causal: bool,
    /// Sliding window `(left, right)`, inclusive, after the causal shift.
    pub sliding_window: Option<Window>,
    /// Logit soft cap `c`: s <- c * tanh(s / c), after scale and bias, before masking.
    pub logits_soft_cap: Option<SoftCap>,
    /// Per-head attention sinks (extra logits in the softmax denominator, once).
    pub sinks: bool,
    /// Additive bias `[B|1, H|1, s_q, s_k]`.
    pub bias: bool,
    /// Boolean mask `[B|1, H|1, s_q, s_k]`, true = attend.
    pub mask: bool,
    /// Query / key segment ids `[B, s]`: equal ids attend, -1 = padding.
    pub segment_ids: bool,
    /// Packed variable-length batch through `cu_seqlens_q/k`.
    pub varlen: bool,
    /// Dropout on the attention probabilities (Philox 4x32-10).
    pub dropout: bool,
}

/// A sliding window whose sizes are either kernel parameters or baked in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// `window_left` / `window_right` are run-time kernel parameters.
    Runtime,
    /// Compile-time window sizes (both >= 0).
    Fixed { left: u32, right: u32 },
}

/// A logit soft cap that is either a kernel parameter or baked in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SoftCap {
    /// `logits_soft_cap` is a run-time kernel parameter.
    Runtime,
    /// A compile-time cap (> 0, finite).
    Fixed(f64),
}

/// The schedule space: what the autotuner searches. `block_m`/`block_n` change the tile
/// program; `num_warps`/`num_stages` are launch and code-generation choices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduleSpace {
    pub block_m: Vec<u32>,
    pub block_n: Vec<u32>,
    pub num_warps: Vec<u32>,
    pub num_stages: Vec<u32>,
}

/// One point of the schedule space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Schedule {
    pub block_m: u32,
    pub block_n: u32,
    pub num_warps: u32,
    pub num_stages: u32,
}

impl Schedule {
    /// `m64_n32_w4_s2`.
    pub fn id(&self) -> String {
        format!("m{}_n{}_w{}_s{}", self.block_m, self.block_n, self.num_warps, self.num_stages)
    }
}

impl ScheduleSpace {
    /// Every point, in the order block_m, block_n, num_warps, num_stages (outermost first).
    pub fn points(&self) -> Vec<Schedule> {
        let mut out = Vec::new();
        for &block_m in &self.block_m {
            for &block_n in &self.block_n {
                for &num_warps in &self.num_warps {
                    for &num_stages in &self.num_stages {
                        out.push(Schedule { block_m, block_n, num_warps, num_stages });
                    }
                }
            }
        }
        out
    }

    /// The distinct (block_m, block_n) tilings: each is one tile program.
    pub fn tilings(&self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for &m in &self.block_m {
            for &n in &self.block_n {
                out.push((m, n));
            }
        }
        out
    }
}

/// A compilation target named in the spec.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Tile IR text.
    Ir,
    /// Native CPU code; `None` = the host's best ISA.
    Cpu(Option<String>),
    /// PTX for an arch such as `sm_80` or `sm_90a`.
    Ptx(String),
    /// Upstream MLIR; `cpu` or `gpu` form.
    Mlir(String),
}

impl Target {
    /// The back end's name: `ir`, `cpu`, `ptx`, `mlir`.
    pub fn backend(&self) -> &'static str {
        match self {
            Target::Ir => "ir",
            Target::Cpu(_) => "cpu",
            Target::Ptx(_) => "ptx",
            Target::Mlir(_) => "mlir",
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Ir => f.write_str("ir"),
            Target::Cpu(None) => f.write_str("cpu"),
            Target::Cpu(Some(isa)) => write!(f, "cpu:{isa}"),
            Target::Ptx(a) => write!(f, "ptx:{a}"),
            Target::Mlir(k) => write!(f, "mlir:{k}"),
        }
    }
}

impl Spec {
    pub fn variant(&self, name: &str) -> Option<&Variant> {
        self.variants.iter().find(|v| v.name == name)
    }
}

impl std::str::FromStr for Target {
    type Err = String;
    /// Parse a target name as specs write it (`ir`, `cpu:avx2`, `ptx:sm_90a`, ...).
    fn from_str(s: &str) -> Result<Target, String> {
        decode::parse_target(s).ok_or_else(|| format!("unknown target `{s}` (known: {})", decode::TARGETS.join(", ")))
    }
}
