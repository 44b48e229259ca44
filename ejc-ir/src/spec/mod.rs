//! The YAML spec front end: what a spec file declares, after validation.
//!
//! ```no_run
//! let spec = ejc_ir::spec::load_file("specs/flash.yaml").unwrap();
//! for v in &spec.variants {
//!     println!("{}: {:?}", v.name, v.features);
//! }
//! ```
//!
//! A spec names an operation (`op:`); the fields every spec has (name, op, version,
//! description, dtypes, variants, schedule, overrides, plans, targets) are decoded here, and the
//! operation ([`crate::op::Operation`]) decodes its own: its top-level fields (flash's
//! `head_dims`, `layout`), each variant's features, and the rules of its schedule axes.
//!
//! Loading never panics: a spec that is not YAML, has unknown fields, wrong types or
//! impossible values gives [`SpecError`], a list of [`Diagnostic`]s, each with
//! `file:line:column`, the field path, what was found and what is allowed.
//! `docs/spec.md` documents the format.

pub mod decode;
mod diag;
pub mod yaml;

pub use decode::{load_file, load_str, Decoder, Fields};
pub use diag::{suggest, Diagnostic, SpecError, ROOT};

use crate::op::{Features, Keys};
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
    /// Input dtypes, in file order (deduplicated).
    pub dtypes: Vec<DType>,
    /// The operation's compile-time keys and the values the spec builds, in the op's
    /// order (flash: `head_dim` from `head_dims`).
    pub keys: Vec<(String, Vec<u32>)>,
    /// The combinations of keys the spec builds, when the operation pairs them (flash:
    /// a `head_dims` entry `{qk: 192, v: 128}` is `head_dim` 192 with `head_dim_v` 128);
    /// empty: every combination of `keys` ([`Spec::key_points`]).
    pub key_sets: Vec<Keys>,
    /// Named variants, in file order.
    pub variants: Vec<Variant>,
    pub schedule: ScheduleSpace,
    /// The plans to build (empty: every plan of the operation that the schedule allows).
    pub plans: Vec<String>,
    pub targets: Vec<Target>,
}

/// One named variant: a combination of the operation's features.
#[derive(Clone, Debug, PartialEq)]
pub struct Variant {
    pub name: String,
    pub description: Option<String>,
    /// The features in the spec's vocabulary (the operation reads them back typed).
    pub features: Features,
}

/// The schedule space: what the autotuner searches. Named axes, declared by the
/// operation, each with the values the spec lists, in the operation's axis order, and
/// the spec's `overrides:`, which refine it for some targets, dtypes or compile-time keys.
///
/// [`ScheduleSpace::values`] and [`ScheduleSpace::points`] read the base schedule only;
/// a kernel's own schedule is [`ScheduleSpace::resolve`]'s.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScheduleSpace {
    pub axes: Vec<(String, Vec<u32>)>,
    /// In file order; every matching one applies, a later one's axes replacing an
    /// earlier one's.
    pub overrides: Vec<ScheduleOverride>,
}

/// One entry of a spec's `overrides:`: for the kernels that match `when` (every
/// condition given must hold), the axes it lists replace the schedule's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScheduleOverride {
    /// The targets it applies to (empty: every target). `cpu` stands for every CPU ISA.
    pub targets: Vec<Target>,
    /// The dtypes it applies to (empty: every dtype).
    pub dtypes: Vec<DType>,
    /// Compile-time keys and the values it applies to (e.g. `head_dim` 192, 256).
    pub keys: Vec<(String, Vec<u32>)>,
    /// The axes it sets, each replacing the schedule's list.
    pub axes: Vec<(String, Vec<u32>)>,
}

impl ScheduleOverride {
    /// Whether this override applies to a kernel of `dtype` and `keys` built for `target`
    /// (`None`: no target in particular, which matches only overrides without one).
    pub fn matches(&self, target: Option<&Target>, dtype: DType, keys: &Keys) -> bool {
        let target_ok = self.targets.is_empty()
            || target.is_some_and(|t| {
                self.targets.iter().any(|w| w == t || (*w == Target::Cpu(None) && matches!(t, Target::Cpu(_))))
            });
        target_ok
            && (self.dtypes.is_empty() || self.dtypes.contains(&dtype))
            && self.keys.iter().all(|(k, vs)| keys.get(k).is_some_and(|v| vs.contains(v)))
    }
}

impl ScheduleSpace {
    /// The values of axis `name` in the base schedule (empty when the spec does not
    /// list it there).
    pub fn values(&self, name: &str) -> &[u32] {
        self.axes.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice()).unwrap_or(&[])
    }

    /// Every value the spec lists for axis `name`, in the base schedule or in any
    /// override (the base's order first).
    pub fn all_values(&self, name: &str) -> Vec<u32> {
        let mut out = self.values(name).to_vec();
        for o in &self.overrides {
            for (_, vs) in o.axes.iter().filter(|(n, _)| n == name) {
                for v in vs {
                    if !out.contains(v) {
                        out.push(*v);
                    }
                }
            }
        }
        out
    }

    /// The schedule of the kernels of `dtype` and `keys` built for `target`: the base
    /// schedule with every matching override applied, in file order.
    pub fn resolve(&self, target: Option<&Target>, dtype: DType, keys: &Keys) -> ScheduleSpace {
        let mut axes = self.axes.clone();
        for o in self.overrides.iter().filter(|o| o.matches(target, dtype, keys)) {
            for (name, vs) in &o.axes {
                match axes.iter_mut().find(|(n, _)| n == name) {
                    Some((_, old)) => *old = vs.clone(),
                    None => axes.push((name.clone(), vs.clone())),
                }
            }
        }
        ScheduleSpace { axes, overrides: Vec::new() }
    }

    /// Every combination of the given axes' values (outermost first); axes the spec does
    /// not list are left out. One empty combination when `names` is empty.
    pub fn points(&self, names: &[&str]) -> Vec<crate::op::Config> {
        let mut out = vec![crate::op::Config::new()];
        for n in names {
            let vals = self.values(n);
            if vals.is_empty() {
                continue;
            }
            out = out
                .into_iter()
                .flat_map(|c| {
                    vals.iter().map(move |v| {
                        let mut c = c.clone();
                        c.insert(n.to_string(), *v);
                        c
                    })
                })
                .collect();
        }
        out
    }
}

impl Spec {
    pub fn variant(&self, name: &str) -> Option<&Variant> {
        self.variants.iter().find(|v| v.name == name)
    }

    /// The values of compile-time key `name`.
    pub fn key_values(&self, name: &str) -> &[u32] {
        self.keys.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice()).unwrap_or(&[])
    }

    /// The compile-time keys in words, for summaries: `5 head_dims` (`plural`) or
    /// `5 head_dim`, or with paired keys `6 head_dim/head_dim_v pairs` (either way).
    pub fn key_terms(&self, plural: bool) -> Vec<String> {
        let s = if plural { "s" } else { "" };
        if self.key_sets.is_empty() {
            return self.keys.iter().map(|(k, v)| format!("{} {k}{s}", v.len())).collect();
        }
        let names: Vec<&str> = self.keys.iter().map(|(k, _)| k.as_str()).collect();
        vec![format!("{} {} pairs", self.key_sets.len(), names.join("/"))]
    }

    /// The combinations of compile-time keys the spec builds: its `key_sets` when the
    /// operation pairs keys, else every combination of `keys` (one empty one when the
    /// operation has none).
    pub fn key_points(&self) -> Vec<Keys> {
        if !self.key_sets.is_empty() {
            return self.key_sets.clone();
        }
        let mut out = vec![Keys::new()];
        for (n, vals) in &self.keys {
            out = out
                .into_iter()
                .flat_map(|k| {
                    vals.iter().map(move |v| {
                        let mut k = k.clone();
                        k.insert(n.clone(), *v);
                        k
                    })
                })
                .collect();
        }
        out
    }

    /// The operation this spec declares (the loader only returns specs whose op exists).
    pub fn operation(&self) -> &'static dyn crate::op::Operation {
        crate::ops::get(&self.op).expect("a loaded spec names a known operation")
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

impl std::str::FromStr for Target {
    type Err = String;
    /// Parse a target name as specs write it (`ir`, `cpu:avx2`, `ptx:sm_90a`, ...).
    fn from_str(s: &str) -> Result<Target, String> {
        decode::parse_target(s).ok_or_else(|| format!("unknown target `{s}` (known: {})", decode::TARGETS.join(", ")))
    }
}
