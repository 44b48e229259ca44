//! The kernel registry: every kernel implementation and plan this process knows, keyed
//! by operation and instance, platform and back end, with a priority.
//!
//! ```no_run
//! use ejc_runtime::registry::{Query, Registry};
//! let mut reg = Registry::new();
//! reg.load_manifest("out").unwrap();
//! let q = Query::new("flash_attention_fwd").dtype("bf16").key("head_dim", 128);
//! for family in reg.families(&q).unwrap() {
//!     println!("{} on {}: {} candidates", family.instance.describe(), family.backend, family.candidates().len());
//! }
//! ```
//!
//! Entries come from build manifests (the ahead-of-time artifacts of `ejc build`,
//! `#[ej_kernel]` builds included: their operation is `dsl:<build>`). One *family* is
//! one instance (operation, variant, dtype, compile-time keys) on one back end; its
//! *candidates* are every way to run a call of it — each plan of the instance, with an
//! artifact chosen for each of the plan's roles and a value for each run-time axis —
//! which is what the autotuner chooses among. A lookup that finds nothing says what does
//! exist. [`Registry::check_signatures`] checks that every implementation of a kernel
//! takes the same parameters (ejkernel checks the same at import time).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use ejc_ir::cpu_abi::Isa;
use ejc_ir::ir::GridExpr;
use ejc_ir::manifest::{AbiParamInfo, AlignedEntry, Instance, Plan};
pub use ejc_ir::op::Config;
use ejc_ir::op::{plan_marker, Features};

use crate::manifest::{load, ManifestError};

pub use ejc_ir::op::config_id;

/// Where a kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Platform {
    Cpu,
    Cuda,
}

impl Platform {
    pub fn name(self) -> &'static str {
        match self {
            Platform::Cpu => "cpu",
            Platform::Cuda => "cuda",
        }
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One registered kernel implementation (one artifact: a kernel in one configuration
/// for one target).
#[derive(Clone, Debug, PartialEq)]
pub struct KernelEntry {
    pub op: String,
    pub op_version: u32,
    pub platform: Platform,
    /// The artifact's target, e.g. `cpu:avx512`, `ptx:sm_90a`.
    pub backend: String,
    /// Higher first; ties keep registration order.
    pub priority: i32,
    pub instance: Instance,
    pub role: String,
    pub features: Features,
    pub config: Config,
    pub artifact_id: String,
    /// The file holding the kernel.
    pub artifact: PathBuf,
    pub entry: String,
    pub scratch_bytes: u64,
    pub params: Vec<AbiParamInfo>,
    /// The launch grid; None where the caller chooses it (`#[ej_kernel]` kernels).
    pub grid: Option<[GridExpr; 3]>,
    pub block: Option<[u32; 3]>,
    pub dynamic_shared_memory: u32,
    pub aligned: Option<AlignedEntry>,
    pub compiler_version: String,
}

/// A plan of a build, for one instance.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanEntry {
    pub op: String,
    pub op_version: u32,
    pub plan: Plan,
    pub compiler_version: String,
}

/// One way to run a call: a plan, the artifact of each launch (in launch order), and
/// the configuration that names the choice (the first launch's configuration, the other
/// roles' prefixed with `role.`, the run-time axes' values, and `plan:<name>` for a plan
/// other than the instance's first).
#[derive(Clone, Debug)]
pub struct Candidate<'r> {
    pub plan: &'r PlanEntry,
    pub launches: Vec<&'r KernelEntry>,
    pub config: Config,
}

impl Candidate<'_> {
    pub fn id(&self) -> String {
        config_id(&self.config)
    }

    /// The candidate as the tuner's search sees it ([`crate::search`]): its plan, and its
    /// choices — the artifact of each launch, then each run-time axis's value.
    pub fn point(&self) -> crate::search::Point {
        let mut coords: Vec<String> = self.launches.iter().map(|e| e.artifact_id.clone()).collect();
        coords
            .extend(self.plan.plan.axes.keys().map(|a| self.config.get(a).map(|v| v.to_string()).unwrap_or_default()));
        crate::search::Point { group: self.plan.plan.name.clone(), coords }
    }
}

/// The kernels and plans of one instance on one back end.
#[derive(Clone, Debug)]
pub struct Family<'r> {
    pub op: String,
    pub op_version: u32,
    pub instance: Instance,
    pub features: Features,
    pub backend: String,
    pub platform: Platform,
    /// Plans, the instance's default first.
    pub plans: Vec<&'r PlanEntry>,
    pub entries: Vec<&'r KernelEntry>,
}

impl<'r> Family<'r> {
    /// Every candidate: each plan × an artifact per launched role × each value of the
    /// plan's run-time axes. Identical configurations (the same build loaded twice)
    /// appear once.
    pub fn candidates(&self) -> Vec<Candidate<'r>> {
        let mut out: Vec<Candidate<'r>> = Vec::new();
        let default_plan = self.plans.first().map(|p| p.plan.name.clone());
        for plan in &self.plans {
            let mut partial: Vec<(Vec<&'r KernelEntry>, Config)> = vec![(Vec::new(), Config::new())];
            for (i, launch) in plan.plan.launches.iter().enumerate() {
                let entries: Vec<&'r KernelEntry> =
                    self.entries.iter().copied().filter(|e| e.role == launch.role).collect();
                let mut next = Vec::new();
                for (chosen, config) in &partial {
                    // A role launched twice uses the same artifact both times.
                    if let Some(prev) = chosen.iter().find(|e| e.role == launch.role) {
                        let mut c = chosen.clone();
                        c.push(prev);
                        next.push((c, config.clone()));
                        continue;
                    }
                    for e in &entries {
                        // Artifacts that disagree on a shared tile axis never pair.
                        let clash = plan.plan.shared.iter().any(|k| {
                            e.config
                                .get(k)
                                .is_some_and(|v| chosen.iter().any(|p| p.config.get(k).is_some_and(|w| w != v)))
                        });
                        if clash {
                            continue;
                        }
                        let mut c = chosen.clone();
                        c.push(*e);
                        let mut config = config.clone();
                        for (k, v) in &e.config {
                            let key = if i == 0 { k.clone() } else { format!("{}.{k}", launch.role) };
                            config.insert(key, *v);
                        }
                        next.push((c, config));
                    }
                }
                partial = next;
            }
            for (axis, values) in &plan.plan.axes {
                partial = partial
                    .into_iter()
                    .flat_map(|(c, config)| {
                        values.iter().map(move |v| {
                            let mut config = config.clone();
                            config.insert(axis.clone(), *v);
                            (c.clone(), config)
                        })
                    })
                    .collect();
            }
            for (launches, mut config) in partial {
                if Some(&plan.plan.name) != default_plan.as_ref() {
                    config.insert(plan_marker(&plan.plan.name), 1);
                }
                if !out.iter().any(|c| c.config == config) {
                    out.push(Candidate { plan, launches, config });
                }
            }
        }
        out
    }
}

/// What a caller looks for. Unset fields match anything.
#[derive(Clone, Debug, Default)]
pub struct Query {
    pub op: String,
    pub platform: Option<Platform>,
    pub backend: Option<String>,
    pub variant: Option<String>,
    /// The features the call asks for, with its values; matched by the operation
    /// ([`ejc_ir::op::Operation::matches`]).
    pub features: Option<Features>,
    pub dtype: Option<String>,
    /// Compile-time keys that must match.
    pub keys: BTreeMap<String, u32>,
}

impl Query {
    pub fn new(op: &str) -> Query {
        Query { op: op.to_string(), ..Default::default() }
    }
    pub fn platform(mut self, p: Platform) -> Query {
        self.platform = Some(p);
        self
    }
    pub fn backend(mut self, b: &str) -> Query {
        self.backend = Some(b.to_string());
        self
    }
    pub fn dtype(mut self, d: impl ToString) -> Query {
        self.dtype = Some(d.to_string());
        self
    }
    pub fn key(mut self, k: &str, v: u32) -> Query {
        self.keys.insert(k.to_string(), v);
        self
    }
    pub fn keys(mut self, keys: &BTreeMap<String, u32>) -> Query {
        self.keys.extend(keys.iter().map(|(k, v)| (k.clone(), *v)));
        self
    }
    pub fn variant(mut self, v: &str) -> Query {
        self.variant = Some(v.to_string());
        self
    }
    pub fn features(mut self, f: Features) -> Query {
        self.features = Some(f);
        self
    }
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
    plans: Vec<PlanEntry>,
}

/// The platform and priority of an artifact's target, or None when this runtime does not
/// run it here (`ir` text, MLIR text, a CPU ISA this machine lacks).
fn runnable(target: &str) -> Result<Option<(Platform, i32)>, String> {
    if let Some(isa) = target.strip_prefix("cpu:") {
        let isa: Isa = isa.parse()?;
        // A wider ISA first: when a build holds several, the best one is chosen.
        return Ok(isa.runs_here().then_some((Platform::Cpu, isa as i32)));
    }
    if let Some(arch) = target.strip_prefix("ptx:") {
        // Architecture-specific code first (sm_90a over sm_80 on a Hopper GPU); whether
        // the GPU at hand runs it is decided when it is known.
        let n: i32 = arch.trim_start_matches("sm_").trim_end_matches('a').parse().unwrap_or(0);
        return Ok(Some((Platform::Cuda, 1000 + n * 2 + arch.ends_with('a') as i32)));
    }
    if target.starts_with("mlir:gpu:") {
        // MLIR's gpu form: correct, slower (tiles in global memory); the last choice.
        return Ok(Some((Platform::Cuda, 500)));
    }
    Ok(None)
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

    pub fn add_plan(&mut self, plan: PlanEntry) {
        if !self.plans.contains(&plan) {
            self.plans.push(plan);
        }
    }

    pub fn entries(&self) -> &[KernelEntry] {
        &self.entries
    }

    pub fn plans(&self) -> &[PlanEntry] {
        &self.plans
    }

    /// Register the runnable artifacts of a build (a `manifest.json` or its directory)
    /// and its plans: CPU libraries whose ISA this machine runs, PTX (the GPU is
    /// checked when a call runs). Returns how many kernels were added.
    pub fn load_manifest(&mut self, path: impl AsRef<Path>) -> Result<usize, RegistryError> {
        let loaded = load(path)?;
        let m = &loaded.manifest;
        let invalid =
            |a: &str, e: String| RegistryError::Invalid(format!("{}: artifact `{a}`: {e}", loaded.dir.display()));
        let mut n = 0;
        for a in &m.artifacts {
            let Some((platform, priority)) = runnable(&a.target).map_err(|e| invalid(&a.artifact_id, e))? else {
                continue;
            };
            let grid = if a.grid.iter().all(|g| g == "caller") {
                None
            } else {
                let mut g = Vec::new();
                for e in &a.grid {
                    g.push(GridExpr::parse(e).map_err(|e| invalid(&a.artifact_id, e))?);
                }
                Some([g[0].clone(), g[1].clone(), g[2].clone()])
            };
            self.add(KernelEntry {
                op: m.spec.op.clone(),
                op_version: m.spec.version,
                platform,
                backend: a.target.clone(),
                priority,
                instance: a.instance.clone(),
                role: a.role.clone(),
                features: a.features.clone(),
                config: a.config.clone(),
                artifact_id: a.artifact_id.clone(),
                artifact: loaded.path_of(a),
                entry: a.entry.clone(),
                scratch_bytes: a.scratch_bytes,
                params: a.params.clone(),
                grid,
                block: a.block,
                dynamic_shared_memory: a.dynamic_shared_memory,
                aligned: a.aligned.clone(),
                compiler_version: m.compiler.version.clone(),
            });
            n += 1;
        }
        for p in &m.plans {
            self.add_plan(PlanEntry {
                op: m.spec.op.clone(),
                op_version: m.spec.version,
                plan: p.clone(),
                compiler_version: m.compiler.version.clone(),
            });
        }
        Ok(n)
    }

    fn instance_matches(op: Option<&'static dyn ejc_ir::op::Operation>, i: &Instance, f: &Features, q: &Query) -> bool {
        q.variant.as_deref().is_none_or(|v| v == i.variant)
            && q.dtype.as_deref().is_none_or(|d| d == i.dtype)
            // A query that names keys names all of them: flash's `head_dim` 192 alone
            // asks for v of head dim 192 too, not for the `head_dim_v` 128 instance.
            && (q.keys.is_empty() || q.keys == i.keys)
            && q.features.as_ref().is_none_or(|w| match op {
                Some(op) => op.matches(f, w),
                None => f == w,
            })
    }

    /// The families that answer a query, best priority first. Nothing found is an
    /// error that lists what exists for the operation.
    pub fn families(&self, q: &Query) -> Result<Vec<Family<'_>>, RegistryError> {
        let op = ejc_ir::ops::get(&q.op);
        let mut fams: Vec<Family<'_>> = Vec::new();
        for e in self.entries.iter().filter(|e| {
            e.op == q.op
                && q.platform.is_none_or(|p| p == e.platform)
                && q.backend.as_deref().is_none_or(|b| b == e.backend)
                && Self::instance_matches(op, &e.instance, &e.features, q)
        }) {
            match fams.iter_mut().find(|f| f.instance == e.instance && f.backend == e.backend) {
                Some(f) => {
                    if !f.entries.iter().any(|x| x.config == e.config && x.role == e.role) {
                        f.entries.push(e)
                    }
                }
                None => fams.push(Family {
                    op: e.op.clone(),
                    op_version: e.op_version,
                    instance: e.instance.clone(),
                    features: e.features.clone(),
                    backend: e.backend.clone(),
                    platform: e.platform,
                    plans: Vec::new(),
                    entries: vec![e],
                }),
            }
        }
        for f in &mut fams {
            let mut plans: Vec<&PlanEntry> =
                self.plans.iter().filter(|p| p.op == f.op && p.plan.instance == f.instance).collect();
            // The operation's order of plans (its first is the default).
            let order = |p: &&PlanEntry| {
                op.and_then(|o| o.plan_names().iter().position(|n| *n == p.plan.name)).unwrap_or(usize::MAX)
            };
            plans.sort_by_key(order);
            plans.dedup_by(|a, b| a.plan == b.plan);
            // A plan runs only where every role it launches has an entry here.
            plans.retain(|p| p.plan.launches.iter().all(|l| f.entries.iter().any(|e| e.role == l.role)));
            f.plans = plans;
        }
        fams.retain(|f| !f.plans.is_empty());
        if fams.is_empty() {
            return Err(RegistryError::NotFound { wanted: describe(q), available: self.describe_op(&q.op) });
        }
        Ok(fams)
    }

    /// What exists for an operation, grouped: `variant [dtypes] keys on backends`.
    pub fn describe_op(&self, op: &str) -> String {
        let mut groups: BTreeMap<(String, String), (Vec<String>, Vec<String>)> = BTreeMap::new();
        for e in self.entries.iter().filter(|e| e.op == op) {
            let g = groups.entry((e.instance.variant.clone(), e.backend.clone())).or_default();
            if !g.0.contains(&e.instance.dtype) {
                g.0.push(e.instance.dtype.clone());
            }
            let keys = e.instance.keys.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
            if !keys.is_empty() && !g.1.contains(&keys) {
                g.1.push(keys);
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
                "nothing (load a build of `ejc build` first)".into()
            } else {
                format!("no `{op}` kernels (operations: {})", ops.join(", "))
            };
        }
        groups
            .iter()
            .map(|((v, b), (d, k))| {
                let keys = if k.is_empty() { String::new() } else { format!(" {}", k.join("/")) };
                format!("{v} [{}]{keys} on {b}", d.join(","))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Every implementation of one kernel (operation, instance, role) must take the same
    /// parameters, whatever its platform, back end or configuration.
    pub fn check_signatures(&self) -> Result<(), RegistryError> {
        let mut seen: BTreeMap<(String, Instance, String), &KernelEntry> = BTreeMap::new();
        for e in &self.entries {
            let k = (e.op.clone(), e.instance.clone(), e.role.clone());
            match seen.get(&k) {
                None => {
                    seen.insert(k, e);
                }
                Some(first) if first.params != e.params => {
                    let names = |x: &KernelEntry| {
                        x.params.iter().map(|p| format!("{}:{}", p.name, p.dtype)).collect::<Vec<_>>().join(", ")
                    };
                    return Err(RegistryError::Invalid(format!(
                        "`{}` {} ({}): {} ({}) takes ({}) but {} ({}) takes ({})",
                        e.op,
                        e.instance.describe(),
                        e.role,
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
        parts.push(match ejc_ir::ops::get(&q.op) {
            Some(op) => op.describe(f),
            None => serde_json::to_string(f).unwrap_or_default(),
        });
    }
    if let Some(d) = &q.dtype {
        parts.push(d.clone());
    }
    for (k, v) in &q.keys {
        parts.push(format!("{k} {v}"));
    }
    if let Some(p) = q.platform {
        parts.push(format!("on {p}"));
    }
    parts.join(", ")
}
