//! The kernel registry: every kernel implementation this process knows, keyed by
//! operation, platform and back end, with a priority.
//!
//! ```no_run
//! use ejc_runtime::registry::{Query, Registry};
//! let mut reg = Registry::new();
//! reg.load_manifest("out").unwrap();
//! let q = Query::new("flash_attention_fwd").dtype(ejc_ir::types::DType::BF16).head_dim(128);
//! for family in reg.families(&q).unwrap() {
//!     println!("{} on {}: {} configurations", family.variant, family.backend, family.entries.len());
//! }
//! ```
//!
//! Entries come from build manifests (the ahead-of-time artifacts of `ejc build`) and,
//! later, from `#[ej_kernel]` registrations. One *family* is one kernel (operation,
//! variant, dtype, head dim) on one back end; its entries are the candidate
//! configurations the autotuner chooses among. A lookup that finds nothing says what
//! does exist. [`Registry::check_signatures`] checks that every implementation of an
//! operation takes the same parameters (ejkernel checks the same at import time).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use ejc_ir::cpu_abi::Isa;
use ejc_ir::manifest::AbiParamInfo;
use ejc_ir::spec::{Features, SoftCap, Window};
use ejc_ir::types::DType;

use crate::manifest::{load, ManifestError};

/// Where a kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Platform {
    Cpu,
    Cuda,
    Mlir,
}

impl Platform {
    pub fn name(self) -> &'static str {
        match self {
            Platform::Cpu => "cpu",
            Platform::Cuda => "cuda",
            Platform::Mlir => "mlir",
        }
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A configuration: the schedule values a kernel was built with.
pub type Config = BTreeMap<String, u32>;

/// `m64_n32` (block sizes) or `key=value` pairs for other configs.
pub fn config_id(c: &Config) -> String {
    match (c.get("block_m"), c.get("block_n")) {
        (Some(m), Some(n)) if c.len() == 2 => format!("m{m}_n{n}"),
        _ => c.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","),
    }
}

/// One registered kernel implementation (one configuration).
#[derive(Clone, Debug, PartialEq)]
pub struct KernelEntry {
    pub op: String,
    pub op_version: u32,
    pub platform: Platform,
    /// e.g. `cpu:avx512`.
    pub backend: String,
    /// Higher first; ties keep registration order.
    pub priority: i32,
    pub variant: String,
    pub features: Features,
    pub dtype: DType,
    pub head_dim: usize,
    pub config: Config,
    pub artifact: PathBuf,
    pub entry: String,
    pub scratch_bytes: u64,
    pub params: Vec<AbiParamInfo>,
    pub compiler_version: String,
}

/// The kernels of one family: same op, variant, dtype, head dim and back end.
#[derive(Clone, Debug)]
pub struct Family<'r> {
    pub op: String,
    pub variant: String,
    pub backend: String,
    pub platform: Platform,
    pub entries: Vec<&'r KernelEntry>,
}

/// What a caller looks for. Unset fields match anything.
#[derive(Clone, Debug, Default)]
pub struct Query {
    pub op: String,
    pub platform: Option<Platform>,
    pub backend: Option<String>,
    pub variant: Option<String>,
    /// The features the call needs (see [`features_match`]).
    pub features: Option<CallFeatures>,
    pub dtype: Option<DType>,
    pub head_dim: Option<usize>,
}

impl Query {
    pub fn new(op: &str) -> Query {
        Query { op: op.to_string(), ..Default::default() }
    }
    pub fn platform(mut self, p: Platform) -> Query {
        self.platform = Some(p);
        self
    }
    pub fn dtype(mut self, d: DType) -> Query {
        self.dtype = Some(d);
        self
    }
    pub fn head_dim(mut self, d: usize) -> Query {
        self.head_dim = Some(d);
        self
    }
    pub fn variant(mut self, v: &str) -> Query {
        self.variant = Some(v.to_string());
        self
    }
    pub fn features(mut self, f: CallFeatures) -> Query {
        self.features = Some(f);
        self
    }
}

/// The features a call needs, with the values of run-time window and soft cap (a
/// variant with a compile-time window serves only calls with that window).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CallFeatures {
    pub causal: bool,
    pub window: Option<(i64, i64)>,
    pub softcap: Option<f64>,
    pub sinks: bool,
    pub bias: bool,
    pub mask: bool,
    pub segment_ids: bool,
    pub varlen: bool,
    pub dropout: bool,
}

/// Whether a variant computes exactly what a call asks for.
pub fn features_match(v: &Features, call: &CallFeatures) -> bool {
    let window_ok = match (v.sliding_window, call.window) {
        (None, None) => true,
        (Some(Window::Runtime), Some(_)) => true,
        (Some(Window::Fixed { left, right }), Some((l, r))) => left as i64 == l && right as i64 == r,
        _ => false,
    };
    let softcap_ok = match (v.logits_soft_cap, call.softcap) {
        (None, None) => true,
        (Some(SoftCap::Runtime), Some(_)) => true,
        (Some(SoftCap::Fixed(c)), Some(x)) => (c as f32) == (x as f32),
        _ => false,
    };
    window_ok
        && softcap_ok
        && v.causal == call.causal
        && v.sinks == call.sinks
        && v.bias == call.bias
        && v.mask == call.mask
        && v.segment_ids == call.segment_ids
        && v.varlen == call.varlen
        && v.dropout == call.dropout
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("no kernel for {wanted}; the registry has: {available}")]
    NotFound { wanted: String, available: String },
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error("{0}")]
    Invalid(String),
}

#[derive(Clone, Debug, Default)]
pub struct Registry {
    entries: Vec<KernelEntry>,
}

pub fn features_from_json(m: &BTreeMap<String, serde_json::Value>) -> Result<Features, String> {
    let flag = |k: &str| m.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
    let sliding_window = match m.get("sliding_window") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) if s == "runtime" => Some(Window::Runtime),
        Some(serde_json::Value::Array(a)) if a.len() == 2 => {
            let n = |i: usize| a[i].as_u64().and_then(|x| u32::try_from(x).ok()).ok_or("bad window in manifest");
            Some(Window::Fixed { left: n(0)?, right: n(1)? })
        }
        Some(other) => return Err(format!("bad sliding_window in manifest: {other}")),
    };
    let logits_soft_cap = match m.get("logits_soft_cap") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) if s == "runtime" => Some(SoftCap::Runtime),
        Some(v) => Some(SoftCap::Fixed(v.as_f64().ok_or(format!("bad logits_soft_cap in manifest: {v}"))?)),
    };
    Ok(Features {
        causal: flag("causal"),
        sliding_window,
        logits_soft_cap,
        sinks: flag("sinks"),
        bias: flag("bias"),
        mask: flag("mask"),
        segment_ids: flag("segment_ids"),
        varlen: flag("varlen"),
        dropout: flag("dropout"),
    })
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Register one entry (kept sorted by priority, stable).
    pub fn add(&mut self, entry: KernelEntry) {
        let at = self.entries.iter().position(|e| e.priority < entry.priority).unwrap_or(self.entries.len());
        self.entries.insert(at, entry);
    }

    pub fn entries(&self) -> &[KernelEntry] {
        &self.entries
    }

    /// Register the runnable artifacts of a build (a `manifest.json` or its directory):
    /// CPU libraries whose ISA this machine runs. Returns how many were added.
    pub fn load_manifest(&mut self, path: impl AsRef<Path>) -> Result<usize, RegistryError> {
        let loaded = load(path)?;
        let m = &loaded.manifest;
        if m.spec.op.starts_with(crate::dsl::OP_PREFIX) {
            // Flash kernels with mods compute something else than plain flash attention:
            // they must never answer a plain call.
            return Err(RegistryError::Invalid(format!(
                "{} is an #[ej_kernel] build (op `{}`); open it with ejc_runtime::dsl::DslLibrary",
                loaded.dir.display(),
                m.spec.op
            )));
        }
        let mut n = 0;
        for a in &m.artifacts {
            let Some(isa) = a.target.strip_prefix("cpu:") else { continue };
            let isa: Isa = isa.parse().map_err(RegistryError::Invalid)?;
            if !isa.runs_here() {
                continue;
            }
            let features = features_from_json(&a.features).map_err(RegistryError::Invalid)?;
            let dtype: DType = a.dtype.parse().map_err(RegistryError::Invalid)?;
            self.add(KernelEntry {
                op: m.spec.op.clone(),
                op_version: m.spec.version,
                platform: Platform::Cpu,
                backend: a.target.clone(),
                // A wider ISA first: when a build holds several, the best one is chosen.
                priority: isa as i32,
                variant: a.variant.clone(),
                features,
                dtype,
                head_dim: a.head_dim,
                config: a.config.clone(),
                artifact: loaded.path_of(a),
                entry: a.entry.clone(),
                scratch_bytes: a.scratch_bytes,
                params: a.params.clone(),
                compiler_version: m.compiler.version.clone(),
            });
            n += 1;
        }
        Ok(n)
    }

    fn matches(e: &KernelEntry, q: &Query) -> bool {
        e.op == q.op
            && q.platform.is_none_or(|p| p == e.platform)
            && q.backend.as_deref().is_none_or(|b| b == e.backend)
            && q.variant.as_deref().is_none_or(|v| v == e.variant)
            && q.dtype.is_none_or(|d| d == e.dtype)
            && q.head_dim.is_none_or(|h| h == e.head_dim)
            && q.features.as_ref().is_none_or(|f| features_match(&e.features, f))
    }

    /// The families that answer a query, best priority first. Nothing found is an
    /// error that lists what exists for the operation.
    pub fn families(&self, q: &Query) -> Result<Vec<Family<'_>>, RegistryError> {
        let mut fams: Vec<Family<'_>> = Vec::new();
        for e in self.entries.iter().filter(|e| Self::matches(e, q)) {
            match fams.iter_mut().find(|f| {
                f.variant == e.variant
                    && f.backend == e.backend
                    && f.entries[0].dtype == e.dtype
                    && f.entries[0].head_dim == e.head_dim
            }) {
                Some(f) => f.entries.push(e),
                None => fams.push(Family {
                    op: e.op.clone(),
                    variant: e.variant.clone(),
                    backend: e.backend.clone(),
                    platform: e.platform,
                    entries: vec![e],
                }),
            }
        }
        if fams.is_empty() {
            return Err(RegistryError::NotFound { wanted: describe(q), available: self.describe_op(&q.op) });
        }
        Ok(fams)
    }

    /// What exists for an operation, grouped: `variant [dtypes] d[head dims] on backends`.
    pub fn describe_op(&self, op: &str) -> String {
        let mut groups: BTreeMap<(String, String), (Vec<String>, Vec<usize>)> = BTreeMap::new();
        for e in self.entries.iter().filter(|e| e.op == op) {
            let g = groups.entry((e.variant.clone(), e.backend.clone())).or_default();
            if !g.0.contains(&e.dtype.to_string()) {
                g.0.push(e.dtype.to_string());
            }
            if !g.1.contains(&e.head_dim) {
                g.1.push(e.head_dim);
            }
        }
        if groups.is_empty() {
            let ops: Vec<&str> = {
                let mut v: Vec<&str> = self.entries.iter().map(|e| e.op.as_str()).collect();
                v.sort();
                v.dedup();
                v
            };
            return if ops.is_empty() {
                "nothing (load a build with `ejc build --target cpu` first)".into()
            } else {
                format!("no `{op}` kernels (operations: {})", ops.join(", "))
            };
        }
        groups
            .iter()
            .map(|((v, b), (d, h))| {
                format!(
                    "{v} [{}] d{} on {b}",
                    d.join(","),
                    h.iter().map(|x| x.to_string()).collect::<Vec<_>>().join("/")
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Every implementation of one (operation, variant, dtype, head dim) must take the
    /// same parameters, whatever its platform, back end or configuration.
    pub fn check_signatures(&self) -> Result<(), RegistryError> {
        let mut seen: BTreeMap<(String, String, DType, usize), &KernelEntry> = BTreeMap::new();
        for e in &self.entries {
            let k = (e.op.clone(), e.variant.clone(), e.dtype, e.head_dim);
            match seen.get(&k) {
                None => {
                    seen.insert(k, e);
                }
                Some(first) if first.params != e.params => {
                    let names = |x: &KernelEntry| {
                        x.params.iter().map(|p| format!("{}:{}", p.name, p.dtype)).collect::<Vec<_>>().join(", ")
                    };
                    return Err(RegistryError::Invalid(format!(
                        "`{}` variant `{}`: {} ({}) takes ({}) but {} ({}) takes ({})",
                        e.op,
                        e.variant,
                        first.entry,
                        first.backend,
                        names(first),
                        e.entry,
                        e.backend,
                        names(e)
                    )));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

fn describe(q: &Query) -> String {
    let mut parts = vec![format!("`{}`", q.op)];
    if let Some(v) = &q.variant {
        parts.push(format!("variant {v}"));
    }
    if let Some(f) = &q.features {
        let mut fs = Vec::new();
        if f.causal {
            fs.push("causal".to_string());
        }
        if let Some((l, r)) = f.window {
            fs.push(format!("window ({l}, {r})"));
        }
        if let Some(c) = f.softcap {
            fs.push(format!("soft cap {c}"));
        }
        for (n, on) in [
            ("sinks", f.sinks),
            ("bias", f.bias),
            ("mask", f.mask),
            ("segment ids", f.segment_ids),
            ("varlen", f.varlen),
            ("dropout", f.dropout),
        ] {
            if on {
                fs.push(n.into());
            }
        }
        parts.push(if fs.is_empty() { "full attention".into() } else { fs.join(" + ") });
    }
    if let Some(d) = q.dtype {
        parts.push(d.to_string());
    }
    if let Some(h) = q.head_dim {
        parts.push(format!("head_dim {h}"));
    }
    if let Some(p) = q.platform {
        parts.push(format!("on {p}"));
    }
    parts.join(", ")
}
