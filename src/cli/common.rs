//! What `ejc run`, `bench` and `tune` share: reading the spec, the dtype, the sizes,
//! the configuration and the run-time scalars from flags (every bad value is an error
//! naming the flag), building an instance's kernels, and running a plan on a back end.
//! Nothing here knows which operation it runs: the spec names it, and the operation
//! ([`ejc_ir::op::Operation`]) says what its sizes, scalars, plans and reference are.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ejc_codegen::cpu::{compile_object, jit::JitLibrary, Isa};
use ejc_ir::ir::Kernel;
use ejc_ir::op::{
    self, parse_dims, parse_shape, with_defaults, Config, HostCall, KernelInstance, Keys, Operation, PlanDecl, Sizes,
};
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{ScheduleSpace, Spec, Target, Variant};
use ejc_ir::types::DType;
use ejc_runtime::call::Call;
use ejc_runtime::cpu::CpuKernel;
use ejc_runtime::exec::{HostLaunch, HostLaunchSpec, HostPlan};

use super::{load_spec, Outcome};

/// Flags common to `run`, `bench` and `tune`.
pub struct ProblemFlags {
    pub spec: PathBuf,
    pub variants: Vec<String>,
    pub dtype: String,
    /// The positional shorthand: the operation's sizes in order.
    pub shape: Option<String>,
    /// `NAME=N,...`, repeatable.
    pub sizes: Vec<String>,
    /// `NAME=V,...` schedule values (tile axes, run-time axes), repeatable.
    pub config: Vec<String>,
    pub block_m: Option<u32>,
    pub block_n: Option<u32>,
    /// The plan to run (`run`); the plans to time (`bench`, `tune`).
    pub plan: Option<String>,
    /// `NAME=V`, repeatable: run-time scalars.
    pub scalars: Vec<String>,
    /// Shorthands for the attention scalars.
    pub window: Option<String>,
    pub softcap: Option<f64>,
    pub dropout: Option<f64>,
    pub isa: Option<String>,
    /// `--memory-limit`: the host memory a call may allocate (default
    /// [`ejc_ir::limits::memory_limit`]).
    pub memory_limit: Option<String>,
}

/// The validated problem.
pub struct Problem {
    pub spec: Spec,
    pub op: &'static dyn Operation,
    pub dtype: DType,
    /// The call's sizes as the user states them (the operation's defaults filled in).
    pub dims: Sizes,
    pub keys: Keys,
    pub variant_names: Vec<String>,
    /// Explicit schedule values (`--config`, `--block-m`, `--block-n`).
    pub config: Config,
    pub plan: Option<String>,
    /// Explicit scalars (`--scalar` and the shorthands).
    pub scalars: BTreeMap<String, f64>,
    pub isa: Isa,
}

pub fn list<T: std::fmt::Display>(xs: &[T]) -> String {
    xs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

fn parse_window(s: &str) -> Result<(i64, i64), String> {
    let nums: Result<Vec<i64>, _> = s.split(',').map(|p| p.trim().parse::<i64>()).collect();
    match nums {
        Ok(n) if n.len() == 2 && n[0] >= 0 && n[1] >= 0 => {
            // Kernels take the window as 32-bit signed sizes: a larger value would wrap.
            if let Some(big) = n.iter().find(|x| **x > i32::MAX as i64) {
                return Err(format!(
                    "{big} is larger than kernels' 32-bit window sizes allow (at most {}; a window as long as \
                     the sequence already sees every key)",
                    i32::MAX
                ));
            }
            Ok((n[0], n[1]))
        }
        _ => Err(format!("`{s}` is not LEFT,RIGHT with two non-negative integers")),
    }
}

/// Bytes of host memory per element of a call, as `run`/`bench`/`tune` hold it: the
/// call's tensors (f64 on the host), the reference's or the previous run's copy, and the
/// kernel-format buffers (f32 or narrower) with slack.
const HOST_BYTES_PER_ELEMENT: u64 = 3 * 8;

impl Problem {
    pub fn from_flags(f: &ProblemFlags) -> Result<Problem, Outcome> {
        let err = |m: String| Outcome::Error(format!("error: {m}"));
        let spec = load_spec(&f.spec)?;
        let op = spec.operation();
        let dtype: DType = match f.dtype.parse() {
            Ok(d) if spec.dtypes.contains(&d) => d,
            Ok(d) => {
                return Err(err(format!("--dtype {d}: spec `{}` declares dtypes {}", spec.name, list(&spec.dtypes))))
            }
            Err(e) => return Err(err(format!("--dtype: {e}"))),
        };
        let mut dims = match &f.shape {
            Some(s) => parse_shape(op, s).map_err(|e| err(format!("--shape: {e}")))?,
            None => Sizes::new(),
        };
        for s in &f.sizes {
            parse_dims(op, s, &mut dims).map_err(|e| err(format!("--size: {e}")))?;
        }
        let dims = with_defaults(op, &dims);
        let keys = op.keys_of(&dims);
        for (k, v) in &keys {
            if !spec.key_values(k).contains(v) {
                let what = if f.shape.is_some() { "--shape" } else { "--size" };
                return Err(err(format!(
                    "{what}: {k} {v} is not one of spec `{}`'s {k} values ({}); {k} is compiled into each kernel",
                    spec.name,
                    list(spec.key_values(k))
                )));
            }
        }
        // Schedule values: `--config` and the tiling shorthands.
        let mut config = Config::new();
        for c in &f.config {
            for part in c.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (k, v) =
                    part.split_once('=').ok_or_else(|| err(format!("--config: `{part}` is not NAME=VALUE")))?;
                let v: u32 = v.trim().parse().map_err(|_| err(format!("--config: `{part}`: not a number")))?;
                config.insert(k.trim().to_string(), v);
            }
        }
        if let Some(m) = f.block_m {
            config.insert("block_m".into(), m);
        }
        if let Some(n) = f.block_n {
            config.insert("block_n".into(), n);
        }
        for (k, v) in &config {
            if !op.axes().iter().any(|a| a.name == k) {
                let names: Vec<&str> = op.axes().iter().map(|a| a.name).collect();
                return Err(err(format!(
                    "--config: {} has no schedule axis `{k}` (axes: {})",
                    op.name(),
                    names.join(", ")
                )));
            }
            let listed = spec.schedule.all_values(k);
            if !listed.contains(v) {
                let tiling = format!("{k}={v} is not in spec `{}`'s schedule ({k}: {})", spec.name, list(&listed));
                return Err(err(if k.starts_with("block_") { format!("tiling: {tiling}") } else { tiling }));
            }
        }
        if let Some(p) = &f.plan {
            if !op.plan_names().contains(&p.as_str()) {
                return Err(err(format!("--plan {p}: {} has plans {}", op.name(), op.plan_names().join(", "))));
            }
        }
        // Scalars: `--scalar` and the attention shorthands.
        let mut scalars = BTreeMap::new();
        for s in &f.scalars {
            let (k, v) = s.split_once('=').ok_or_else(|| err(format!("--scalar: `{s}` is not NAME=VALUE")))?;
            let v: f64 = v.trim().parse().map_err(|_| err(format!("--scalar: `{s}`: not a number")))?;
            scalars.insert(k.trim().to_string(), v);
        }
        if let Some(w) = &f.window {
            let (l, r) = parse_window(w).map_err(|e| err(format!("--window: {e}")))?;
            scalars.insert("window_left".into(), l as f64);
            scalars.insert("window_right".into(), r as f64);
        }
        if let Some(c) = f.softcap {
            if !(c > 0.0 && c.is_finite()) {
                return Err(err(format!("--softcap {c}: the soft cap must be a positive finite number")));
            }
            if let Err(e) = ejc_ir::limits::check_scalar(DType::F32, c) {
                return Err(err(format!("--softcap: {e} (kernels compute the soft cap in f32)")));
            }
            scalars.insert("logits_soft_cap".into(), c);
        }
        if let Some(p) = f.dropout {
            if !(0.0..1.0).contains(&p) {
                return Err(err(format!("--dropout {p}: the probability must be in [0, 1)")));
            }
            scalars.insert("dropout_p".into(), p);
        }
        for name in &f.variants {
            if spec.variant(name).is_none() {
                let names: Vec<&str> = spec.variants.iter().map(|v| v.name.as_str()).collect();
                return Err(err(format!("--variant {name}: spec `{}` has variants {}", spec.name, names.join(", "))));
            }
        }
        let known: Vec<&str> = spec.variants.iter().flat_map(|v| op.scalars(&v.features)).map(|s| s.name).collect();
        for k in scalars.keys() {
            if !known.contains(&k.as_str()) {
                return Err(err(format!(
                    "--scalar {k}: no variant of spec `{}` takes it (its scalars: {})",
                    spec.name,
                    {
                        let mut k = known.clone();
                        k.sort();
                        k.dedup();
                        k.join(", ")
                    }
                )));
            }
        }
        let variant_names = if f.variants.is_empty() {
            spec.variants.iter().map(|v| v.name.clone()).collect()
        } else {
            f.variants.clone()
        };
        let isa = match &f.isa {
            None => Isa::host(),
            Some(s) => {
                let isa: Isa = s.parse().map_err(|e: String| err(format!("--isa: {e}")))?;
                if !isa.runs_here() {
                    return Err(err(format!(
                        "--isa {isa}: this machine cannot run it (it runs up to {})",
                        Isa::host_max()
                    )));
                }
                isa
            }
        };
        let p = Problem { spec, op, dtype, dims, keys, variant_names, config, plan: f.plan.clone(), scalars, isa };
        p.check_memory(f.memory_limit.as_deref())?;
        Ok(p)
    }

    /// Refuse sizes whose tensors overflow 64-bit counts or would take more host memory
    /// than the limit, before anything is allocated.
    fn check_memory(&self, flag: Option<&str>) -> Result<(), Outcome> {
        let err = |m: String| Outcome::Error(format!("error: {m}"));
        let limit = match flag {
            Some(t) => ejc_ir::limits::parse_bytes(t).map_err(|e| err(format!("--memory-limit: {e}")))?,
            None => ejc_ir::limits::memory_limit().map_err(err)?,
        };
        for v in self.variants() {
            let n = self
                .op
                .call_elements(&v.features, &self.dims)
                .map_err(|e| err(format!("variant `{}`: {e}", v.name)))?;
            let bytes = n.checked_mul(HOST_BYTES_PER_ELEMENT);
            if bytes.is_none_or(|b| b > limit) {
                let need = bytes.map_or("more than 64 bits can count".to_string(), |b| {
                    format!("about {}", ejc_ir::limits::show_bytes(b))
                });
                let why = match flag {
                    Some(_) => "--memory-limit".to_string(),
                    None => match ejc_ir::limits::physical_memory() {
                        Some(m) => format!("3/4 of this machine's {}", ejc_ir::limits::show_bytes(m)),
                        None => "the default".to_string(),
                    },
                };
                return Err(err(format!(
                    "sizes {}: a call of variant `{}` holds {n} elements, {need} of host memory (the inputs, \
                     outputs and reference at {HOST_BYTES_PER_ELEMENT} bytes each), more than the limit of {} \
                     ({why}); use smaller sizes, or raise the limit with --memory-limit SIZE or EJC_MEMORY_LIMIT \
                     (e.g. 200G, or none)",
                    self.dims_text(),
                    v.name,
                    ejc_ir::limits::show_bytes(limit)
                )));
            }
        }
        Ok(())
    }

    pub fn variants(&self) -> Vec<&Variant> {
        self.variant_names.iter().filter_map(|n| self.spec.variant(n)).collect()
    }

    /// `batch=2,seq_q=77,...`
    pub fn dims_text(&self) -> String {
        op::dims_text(self.op, &self.dims)
    }

    /// A random call of the problem's sizes for a variant, with the explicit scalars
    /// (the variant's own where it has no such parameter are left alone).
    pub fn call(&self, v: &Variant, seed: u64) -> Result<(HostCall, Sizes), Outcome> {
        self.call_for(v, seed, false)
    }

    /// [`Problem::call`] for timing alone: inputs an operation derives from its reference
    /// (the flash backward's `out` and `lse`) may be cheap stand-ins at large sizes.
    pub fn timing_call(&self, v: &Variant, seed: u64) -> Result<(HostCall, Sizes), Outcome> {
        self.call_for(v, seed, true)
    }

    fn call_for(&self, v: &Variant, seed: u64, timing: bool) -> Result<(HostCall, Sizes), Outcome> {
        let e = |m: String| Outcome::Error(format!("error: variant `{}`: {m}", v.name));
        let mut call = if timing {
            self.op.timing_call(&v.features, self.dtype, &self.dims, seed, &self.scalars).map_err(e)?
        } else {
            self.op.random_call(&v.features, self.dtype, &self.dims, seed).map_err(e)?
        };
        for (k, x) in &self.scalars {
            if let Some(slot) = call.scalars.get_mut(k) {
                *slot = *x;
            }
        }
        let sizes = self.op.validate(&v.features, self.dtype, &self.keys, &call).map_err(e)?;
        Ok((call, sizes))
    }

    /// The plans of a variant to run or time: `--plan`, else every plan the spec builds
    /// (`run` takes the first).
    pub fn plans(&self, v: &Variant) -> Vec<PlanDecl> {
        op::spec_plans(&self.spec, v).into_iter().filter(|p| self.plan.as_deref().is_none_or(|n| n == p.name)).collect()
    }

    /// The schedule this problem's kernels have on `target` (the spec's overrides for
    /// its dtype and keys applied).
    pub fn schedule(&self, target: &Target) -> ScheduleSpace {
        self.spec.schedule.resolve(Some(target), self.dtype, &self.keys)
    }

    /// The target a host back end runs: `interp` the tile IR, `cpu` this problem's ISA.
    pub fn host_target(&self, backend: &str) -> Target {
        if backend == "cpu" {
            Target::Cpu(Some(self.isa.name().to_string()))
        } else {
            Target::Ir
        }
    }

    /// Every configuration of a plan's tile axes and run-time axes (the explicit ones
    /// fixed) in the problem's schedule on `target`, or only the first of each when
    /// `first`.
    pub fn plan_configs(&self, plan: &PlanDecl, first: bool, target: &Target) -> Vec<Config> {
        let schedule = self.schedule(target);
        let mut axes: Vec<&str> = Vec::new();
        for r in &plan.roles {
            for a in &r.tile_axes {
                if !axes.contains(a) {
                    axes.push(a);
                }
            }
        }
        axes.extend(plan.runtime_axes.iter().copied());
        let mut out = vec![Config::new()];
        for a in axes {
            let vals: Vec<u32> = match self.config.get(a) {
                Some(v) => vec![*v],
                None if first => schedule.values(a).iter().take(1).copied().collect(),
                None => schedule.values(a).to_vec(),
            };
            // An axis the schedule does not list (an optional one) is left out, as the
            // build leaves it out of the tile points (`ScheduleSpace::points`).
            if vals.is_empty() {
                continue;
            }
            out = out
                .into_iter()
                .flat_map(|c| {
                    vals.iter().map(move |v| {
                        let mut c = c.clone();
                        c.insert(a.to_string(), *v);
                        c
                    })
                })
                .collect();
        }
        out
    }

    /// The kernels (tile IR after the pass pipeline) of a plan's roles at `config`.
    pub fn kernels(&self, v: &Variant, plan: &PlanDecl, config: &Config) -> Result<BTreeMap<String, Kernel>, Outcome> {
        let mut out = BTreeMap::new();
        for role in &plan.roles {
            let mut tile: Config =
                role.tile_axes.iter().filter_map(|a| config.get(*a).map(|x| (a.to_string(), *x))).collect();
            tile.extend(role.fixed.clone());
            let mut k = KernelInstance {
                id: String::new(),
                variant: v,
                dtype: self.dtype,
                keys: self.keys.clone(),
                role: role.name,
                tile,
            };
            k.id = self.op.kernel_id(&self.spec.name, &k);
            let kernel = self
                .op
                .build(&self.spec, &k)
                .and_then(|k| run_pipeline(&k, &default_pipeline()).map_err(|e| e.to_string()))
                .map_err(|e| Outcome::Error(format!("error: variant `{}`: {e}", v.name)))?;
            out.insert(role.name.to_string(), kernel);
        }
        Ok(out)
    }
}

/// The refusal for a back end `ejc` does not know (None for interp, cpu, mlir, cuda).
pub fn unsupported_backend(backend: &str) -> Option<Outcome> {
    match backend {
        "interp" | "cpu" | "mlir" | "cuda" => None,
        other => Some(Outcome::Error(format!("error: unknown backend `{other}`"))),
    }
}

/// A kernel compiled for the host by MLIR, as a plan launches it.
type MlirLaunch = ejc_codegen::mlir::exec::CpuKernel;

/// A plan's kernels ready to run on one host back end.
pub enum Prepared {
    Interp(BTreeMap<String, Kernel>),
    /// Native code for this CPU, compiled in-process (JIT).
    Cpu {
        // Keeps the JIT-compiled code alive while the kernels point into it.
        _jit: JitLibrary,
        kernels: BTreeMap<String, (CpuKernel, Kernel)>,
        threads: usize,
    },
    /// Through MLIR: translated, lowered by MLIR's pipelines, compiled by its
    /// ExecutionEngine (or loaded from the on-disk cache).
    Mlir {
        kernels: BTreeMap<String, (MlirLaunchBox, Kernel)>,
        threads: usize,
        seconds: f64,
        cached: bool,
    },
}

/// An MLIR-compiled kernel (boxed so `Prepared` stays small).
pub struct MlirLaunchBox(Box<MlirLaunch>);

impl Prepared {
    pub fn new(
        backend: &str,
        kernels: BTreeMap<String, Kernel>,
        isa: Isa,
        threads: usize,
    ) -> Result<Prepared, Outcome> {
        match backend {
            "interp" => Ok(Prepared::Interp(kernels)),
            "cpu" => {
                let list: Vec<Kernel> = kernels.values().cloned().collect();
                let obj = compile_object(&list, isa)
                    .map_err(|e| Outcome::Error(format!("error: compiling for {isa}: {e}")))?;
                let jit = JitLibrary::load(&obj.object).map_err(|e| Outcome::Error(format!("error: {e}")))?;
                let mut out = BTreeMap::new();
                for ((role, k), code) in kernels.into_iter().zip(&obj.kernels) {
                    let entry = jit.entry(&k.name).map_err(|e| Outcome::Error(format!("error: {e}")))?;
                    out.insert(role, (CpuKernel { entry, scratch_bytes: code.scratch_bytes as usize }, k));
                }
                Ok(Prepared::Cpu { _jit: jit, kernels: out, threads })
            }
            "mlir" => {
                let mut out = BTreeMap::new();
                let (mut seconds, mut cached) = (0.0, true);
                for (role, k) in kernels {
                    let c = ejc_codegen::mlir::exec::CpuKernel::compile(&k)
                        .map_err(|e| Outcome::Error(format!("error: {e}")))?;
                    seconds += c.compile_seconds;
                    cached &= c.cached;
                    out.insert(role, (MlirLaunchBox(Box::new(c)), k));
                }
                Ok(Prepared::Mlir { kernels: out, threads, seconds, cached })
            }
            other => Err(unsupported_backend(other)
                .unwrap_or_else(|| Outcome::Error(format!("error: unknown backend `{other}`")))),
        }
    }

    /// A plan of host kernels ready to run on `call` (compiled back ends).
    pub fn host_plan<'k>(
        &'k self,
        plan: &PlanDecl,
        call: &Call,
        sizes: &Sizes,
        config: &Config,
    ) -> Result<HostPlan<'k>, String> {
        let launch_of = |role: &str| -> Result<(&'k dyn HostLaunch, &'k Kernel), String> {
            match self {
                Prepared::Cpu { kernels, .. } => kernels
                    .get(role)
                    .map(|(c, k)| (c as &dyn HostLaunch, k))
                    .ok_or_else(|| format!("no kernel for role `{role}`")),
                Prepared::Mlir { kernels, .. } => kernels
                    .get(role)
                    .map(|(c, k)| (c.0.as_ref() as &dyn HostLaunch, k))
                    .ok_or_else(|| format!("no kernel for role `{role}`")),
                Prepared::Interp(_) => Err("the interpreter runs through `run`".into()),
            }
        };
        let mut specs = Vec::new();
        for l in &plan.launches {
            let (kernel, k) = launch_of(&l.role)?;
            specs.push(HostLaunchSpec {
                kernel,
                params: op::ParamSig::of_kernel(k),
                grid: k.grid.clone(),
                launch: l.clone(),
            });
        }
        HostPlan::new(&specs, &plan.temporaries, call, sizes, config).map_err(|e| e.to_string())
    }

    fn threads(&self) -> usize {
        match self {
            Prepared::Cpu { threads, .. } | Prepared::Mlir { threads, .. } => *threads,
            Prepared::Interp(_) => 1,
        }
    }

    /// Run the plan once on a host call; the call with its outputs written.
    pub fn run(&self, plan: &PlanDecl, host: &HostCall, sizes: &Sizes, config: &Config) -> Result<HostCall, String> {
        match self {
            Prepared::Interp(kernels) => {
                let mut call = host.clone();
                op::run_plan_interp(plan, kernels, &mut call, sizes, config)?;
                Ok(call)
            }
            _ => {
                let mut call = Call::from_host(host);
                let mut p = self.host_plan(plan, &call, sizes, config)?;
                p.run(&mut call, self.threads()).map_err(|e| e.to_string())?;
                let mut out = host.clone();
                for (n, t) in &call.tensors {
                    if let Some(b) = t.host() {
                        out.tensors.insert(n.clone(), b.to_host());
                    }
                }
                Ok(out)
            }
        }
    }

    /// What compiling cost, for the MLIR back end (seconds, and whether the on-disk
    /// cache had every kernel).
    pub fn compile_info(&self) -> Option<(f64, bool)> {
        match self {
            Prepared::Mlir { seconds, cached, .. } => Some((*seconds, *cached)),
            _ => None,
        }
    }

    /// The kernels' names, in role order (`flash_causal_bf16_d64_m64_n32`).
    pub fn names(&self) -> Vec<String> {
        match self {
            Prepared::Interp(k) => k.values().map(|k| k.name.clone()).collect(),
            Prepared::Cpu { kernels, .. } => kernels.values().map(|(_, k)| k.name.clone()).collect(),
            Prepared::Mlir { kernels, .. } => kernels.values().map(|(_, k)| k.name.clone()).collect(),
        }
    }
}
