//! The executor API: one generic call for every operation, and the runtime that holds
//! the registry, the configuration chains and the loaded kernels.
//!
//! ```no_run
//! use ejc_runtime::api::{CallOptions, Runtime, RuntimeOptions};
//! use ejc_runtime::call::{Call, Tensor};
//! # fn demo(mut call: Call) {
//! // Kernels from `ejc build specs/mean_pooling.yaml --target cpu -o out` (or $EJC_KERNELS).
//! let mut rt = Runtime::new(RuntimeOptions::default()).unwrap();
//! let wanted = serde_json::from_str(r#"{"backward": false, "varlen": false}"#).unwrap();
//! let r = rt.call("mean_pooling", &wanted, &mut call, &CallOptions::default()).unwrap();
//! println!("{} with {:?} (from the {})", r.kernels.join(" + "), r.config, r.source);
//! # }
//! ```
//!
//! A call names its operation, the features it asks for (the spec's vocabulary, with
//! the call's values) and its tensors (inputs and outputs) and scalars by the names the
//! kernels' parameters have (docs/abi.md lists them per operation). The runtime picks
//! the platform (the GPU when the tensors are there; `PlatformChoice::Cuda` copies host
//! tensors there and the outputs back), the instance (the registry family whose variant
//! computes exactly those features, for the call's dtype and compile-time keys), checks
//! the call with the operation, and chooses the configuration — a plan and its kernels'
//! configurations — through the chain (override → overlay → memory → persistent →
//! autotune → heuristics). Typed front doors such as [`crate::flash::flash_attention`]
//! sit on top of this.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;

use ejc_ir::manifest::Instance;
use ejc_ir::op::{Features, Operation};

use crate::cache::PersistentCache;
use crate::call::Call;
use crate::chain::{Chain, ChainError, Event, Policy, Source};
use crate::cpu::CpuError;
use crate::exec::{CpuLibs, ExecError};
use crate::key::{call_key, cpu_fingerprint, cpu_threads, CacheKey};
use crate::registry::{config_id, Candidate, Config, Platform, Query, Registry, RegistryError};
use crate::tune::{Device, Tuner};

/// A family's candidates for a call: every one, or with `deterministic` those whose plan
/// the operation does not list as non-deterministic (an error when that leaves none).
fn candidates<'r>(
    op: &dyn Operation,
    fam: &crate::registry::Family<'r>,
    o: &CallOptions,
    call: &Call,
    sizes: &ejc_ir::op::Sizes,
) -> Result<Vec<Candidate<'r>>, ApiError> {
    let mut all = fam.candidates();
    // A call that gives a plan's temporaries (a precomputed block-sparse layout) fixes
    // the tiling they were built for: only the candidates of that tiling can take it.
    let info = |n: &str| call.tensors.get(n).map(crate::call::Tensor::info);
    let gives = all.iter().any(|c| c.plan.plan.temporaries.iter().any(|t| t.given && info(&t.name).is_some()));
    if gives {
        let mut why = None;
        all.retain(|c| {
            let syms = ejc_ir::op::symbols(sizes, &c.config);
            match ejc_ir::op::given_temporaries(&c.plan.plan.temporaries, &c.plan.plan.launches, &info, &syms) {
                Ok(_) => true,
                Err(e) => {
                    why.get_or_insert(e);
                    false
                }
            }
        });
        if all.is_empty() {
            return Err(ApiError::Call(format!(
                "no built candidate of `{}` takes the layout this call gives: {}",
                op.name(),
                why.unwrap_or_default()
            )));
        }
    }
    if !o.deterministic {
        return Ok(all);
    }
    let skip = op.nondeterministic_plans();
    let n = all.len();
    let kept: Vec<Candidate> = all.into_iter().filter(|c| !skip.contains(&c.plan.plan.name.as_str())).collect();
    if kept.is_empty() {
        return Err(ApiError::Unsupported(format!(
            "a deterministic call of `{}`: none of the {n} built candidates is deterministic (plans {} are not); \
build a deterministic plan or drop `deterministic`",
            op.name(),
            skip.join(", ")
        )));
    }
    Ok(kept)
}

/// Which platform runs the call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlatformChoice {
    /// The GPU when the call's tensors are in GPU memory, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// A GPU: host tensors are copied there and the outputs back.
    Cuda,
}

/// How to run a call.
#[derive(Clone, Debug, Default)]
pub struct CallOptions {
    pub platform: PlatformChoice,
    /// An explicit configuration: always used, never cached.
    pub config: Option<Config>,
    /// CPU worker threads (0 = all cores).
    pub threads: usize,
    /// Only plans that give the same bits on every run (the flash backward's `two_pass`,
    /// never its `atomic`, whose dQ is summed by atomic adds in no fixed order). The
    /// choice is cached apart from an unrestricted call's.
    pub deterministic: bool,
    /// On a GPU, with every tensor of the call already in GPU memory: return once the
    /// launches are queued on the runtime's stream instead of waiting for them, so the
    /// host prepares the next call while this one runs (ring attention's steps). Work queued
    /// later on the same stream sees the outputs; a kernel's failure surfaces at the next
    /// synchronisation. A call that copies host tensors to the GPU always waits.
    pub asynchronous: bool,
}

/// What ran.
#[derive(Clone, Debug)]
pub struct CallResult {
    pub instance: Instance,
    /// The back end (`cpu:avx512`, `ptx:sm_90a`).
    pub backend: String,
    /// The plan that ran (`single`, `split_kv`, ...).
    pub plan: String,
    /// The entry point of each launch, in order.
    pub kernels: Vec<String>,
    pub config: Config,
    pub source: Source,
    /// The cache key the configuration was chosen under.
    pub key: String,
    /// The device fingerprint (the chain and cache file it went through).
    pub device: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("argument `{arg}`: {message}")]
    Argument { arg: &'static str, message: String },
    /// The call does not fit the operation (named tensors, shapes, scalars).
    #[error("{0}")]
    Call(String),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Chain(#[from] ChainError),
    #[error(transparent)]
    Cpu(#[from] CpuError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("{0}")]
    Unsupported(String),
}

/// Where the runtime finds kernels and keeps its tuning cache.
#[derive(Clone, Debug, Default)]
pub struct RuntimeOptions {
    /// Build directories (or manifests) to load; default `$EJC_KERNELS` (colon-separated)
    /// or `./out`.
    pub kernels: Vec<PathBuf>,
    /// Default: `PersistentCache::default_dir()` (`$EJC_CACHE_DIR`, ...; none without HOME
    /// and the others: the tuning cache is then in memory only, with a warning).
    pub cache_dir: Option<PathBuf>,
    pub policy: Option<Policy>,
    /// Print the chain's events to stderr (also set by `EJC_LOG=1`).
    pub log: bool,
}

/// A registry, a configuration chain per device, and the kernels loaded so far.
pub struct Runtime {
    pub registry: Registry,
    /// One chain (and persistent cache file) per device fingerprint.
    chains: HashMap<String, Chain>,
    cache_dir: Option<PathBuf>,
    policy: Policy,
    log: bool,
    libs: RefCell<CpuLibs>,
    #[cfg(feature = "cuda")]
    cuda: Option<std::sync::Arc<crate::cuda::Cuda>>,
}

impl Runtime {
    pub fn new(opts: RuntimeOptions) -> Result<Runtime, ApiError> {
        let mut registry = Registry::new();
        let dirs = if opts.kernels.is_empty() {
            match std::env::var_os("EJC_KERNELS") {
                Some(v) => std::env::split_paths(&v).collect(),
                None => vec![PathBuf::from("out")],
            }
        } else {
            opts.kernels.clone()
        };
        for d in &dirs {
            registry.load_manifest(d)?;
        }
        registry.check_signatures()?;
        let log = opts.log || std::env::var("EJC_LOG").is_ok_and(|v| v != "0" && !v.is_empty());
        Ok(Runtime {
            registry,
            chains: HashMap::new(),
            cache_dir: opts.cache_dir.clone().or_else(PersistentCache::default_dir),
            policy: opts.policy.unwrap_or_default(),
            log,
            libs: RefCell::new(CpuLibs::default()),
            #[cfg(feature = "cuda")]
            cuda: None,
        })
    }

    /// The chain of a device (made on first use, with that device's cache file).
    pub fn chain(&mut self, device: &str) -> &mut Chain {
        if !self.chains.contains_key(device) {
            let cache = match &self.cache_dir {
                Some(dir) => PersistentCache::open(dir, device),
                None => PersistentCache::in_memory(device, ejc_ir::cache_dir::NO_DIR),
            };
            for w in cache.warnings() {
                eprintln!("ejc: warning: {w}");
            }
            let mut chain = Chain::new(self.policy, Some(cache));
            // Warnings always (a result that could not be stored, a cache entry ignored);
            // the rest with EJC_LOG.
            let log = self.log;
            chain.observe(Box::new(move |e: &Event| {
                if log || matches!(e, Event::Warning(_)) {
                    eprintln!("{e}")
                }
            }));
            self.chains.insert(device.to_string(), chain);
        }
        self.chains.get_mut(device).expect("inserted above")
    }

    /// Run on `cuda` (a GPU other than the first: one process per GPU) from now on.
    #[cfg(feature = "cuda")]
    pub fn set_cuda(&mut self, cuda: std::sync::Arc<crate::cuda::Cuda>) {
        self.cuda = Some(cuda);
    }

    /// The GPU (opened on first use).
    #[cfg(feature = "cuda")]
    pub fn cuda(&mut self) -> Result<std::sync::Arc<crate::cuda::Cuda>, ApiError> {
        if self.cuda.is_none() {
            let c = crate::cuda::Cuda::new().map_err(|e| ApiError::Unsupported(format!("platform cuda: {e}")))?;
            self.cuda = Some(std::sync::Arc::new(c));
        }
        Ok(self.cuda.clone().expect("set above"))
    }

    /// Run operation `op` on `call` (outputs written in place). `wanted`: the features
    /// the call asks for, in the spec's vocabulary with the call's values.
    pub fn call(
        &mut self,
        op_name: &str,
        wanted: &Features,
        call: &mut Call,
        o: &CallOptions,
    ) -> Result<CallResult, ApiError> {
        let op: &'static dyn Operation = ejc_ir::ops::get(op_name).ok_or_else(|| {
            let names: Vec<&str> = ejc_ir::ops::all().iter().map(|o| o.name()).collect();
            ApiError::Unsupported(format!("no operation `{op_name}` (operations: {})", names.join(", ")))
        })?;
        let dtype = op.call_dtype(call).map_err(ApiError::Call)?;
        let keys = op.call_keys(call).map_err(ApiError::Call)?;
        let platform = match o.platform {
            PlatformChoice::Cpu => Platform::Cpu,
            PlatformChoice::Cuda => Platform::Cuda,
            PlatformChoice::Auto if call.on_device() => Platform::Cuda,
            PlatformChoice::Auto => Platform::Cpu,
        };
        if platform == Platform::Cpu && !call.on_host() {
            return Err(ApiError::Unsupported("platform cpu: every tensor must be in host memory".into()));
        }
        let query = Query::new(op_name).platform(platform).dtype(dtype).keys(&keys).features(wanted.clone());
        match platform {
            Platform::Cpu => self.call_cpu(op, &query, wanted, call, o),
            Platform::Cuda => self.call_cuda(op, &query, wanted, call, o),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn key(
        &self,
        device: &str,
        op: &dyn Operation,
        fam: &crate::registry::Family,
        wanted: &Features,
        dtype: ejc_ir::types::DType,
        sizes: &ejc_ir::op::Sizes,
        ids: &[String],
    ) -> CacheKey {
        let compiler = fam.entries.first().map(|e| e.compiler_version.clone()).unwrap_or_default();
        call_key(device, op, fam.op_version, &compiler, wanted, dtype, sizes, ids)
    }

    fn call_cpu(
        &mut self,
        op: &'static dyn Operation,
        query: &Query,
        wanted: &Features,
        call: &mut Call,
        o: &CallOptions,
    ) -> Result<CallResult, ApiError> {
        let registry = std::mem::take(&mut self.registry);
        let result = (|| -> Result<CallResult, ApiError> {
            let fam = registry.families(query)?.remove(0);
            let dtype = fam.instance.dtype.parse().map_err(ApiError::Unsupported)?;
            let sizes = op.validate(&fam.features, dtype, &fam.instance.keys, call).map_err(ApiError::Call)?;
            let cands = candidates(op, &fam, o, call, &sizes)?;
            let ids: Vec<String> = cands.iter().map(|c| c.id()).collect();
            let device = cpu_fingerprint();
            // The thread count is part of what was measured: a winner on one thread need
            // not be the winner on all of them.
            let key = self.key(&device, op, &fam, wanted, dtype, &sizes, &ids).with_threads(cpu_threads(o.threads));
            let libs = std::mem::take(&mut self.libs);
            let choice = {
                let mut tuner = Tuner::new(
                    op,
                    fam.features.clone(),
                    wanted.clone(),
                    dtype,
                    fam.instance.keys.clone(),
                    sizes.clone(),
                    call.scalars.clone(),
                    cands.clone(),
                    Device::Cpu { libs: &libs, threads: o.threads },
                );
                tuner.progress = true;
                tuner.deterministic = o.deterministic;
                let explicit = o.config.as_ref().map(|c| explicit_config(c, &cands)).transpose();
                explicit.and_then(|c| Ok(self.chain(&device).choose(&key, c.as_ref(), &tuner)?))
            };
            self.libs = libs;
            let choice = choice?;
            let cand = cands.iter().find(|c| c.config == choice.config).ok_or_else(|| ApiError::Argument {
                arg: "config",
                message: format!(
                    "{} is not one of the built configurations ({})",
                    config_id(&choice.config),
                    ids.join(", ")
                ),
            })?;
            crate::exec::run_cpu(&mut self.libs.borrow_mut(), cand, call, &sizes, o.threads)?;
            Ok(CallResult {
                instance: fam.instance.clone(),
                backend: fam.backend.clone(),
                plan: cand.plan.plan.name.clone(),
                kernels: cand.launches.iter().map(|e| e.entry.clone()).collect(),
                config: choice.config,
                source: choice.source,
                key: key.to_string(),
                device: device.clone(),
            })
        })();
        self.registry = registry;
        result
    }

    #[cfg(not(feature = "cuda"))]
    fn call_cuda(
        &mut self,
        _op: &'static dyn Operation,
        _query: &Query,
        _wanted: &Features,
        _call: &mut Call,
        _o: &CallOptions,
    ) -> Result<CallResult, ApiError> {
        Err(ApiError::Unsupported("platform cuda: this ejc-runtime was built without its `cuda` feature".into()))
    }

    #[cfg(feature = "cuda")]
    fn call_cuda(
        &mut self,
        op: &'static dyn Operation,
        query: &Query,
        wanted: &Features,
        call: &mut Call,
        o: &CallOptions,
    ) -> Result<CallResult, ApiError> {
        let cuda = self.cuda()?;
        let err = |e: crate::cuda::CudaError| ApiError::Unsupported(e.to_string());
        // Host tensors go to the GPU for the call; the outputs come back.
        let uploaded = if call.on_host() { Some(crate::cuda::upload_call(&cuda, call).map_err(err)?) } else { None };
        let registry = std::mem::take(&mut self.registry);
        let result = (|| -> Result<CallResult, ApiError> {
            let dev_call: &Call = uploaded.as_ref().unwrap_or(call);
            let cc = cuda.compute_capability();
            let mut fams = registry.families(query)?;
            fams.retain(|f| crate::cuda::runs_on(&f.backend, cc));
            let fam = fams.into_iter().next().ok_or_else(|| {
                ApiError::Unsupported(format!(
                    "no kernel of {} for {} runs on {} (PTX for sm_80 runs on every GPU from Ampere on)",
                    op.name(),
                    query.dtype.clone().unwrap_or_default(),
                    cuda.device_name()
                ))
            })?;
            let dtype = fam.instance.dtype.parse().map_err(ApiError::Unsupported)?;
            let sizes = op.validate(&fam.features, dtype, &fam.instance.keys, dev_call).map_err(ApiError::Call)?;
            let cands = candidates(op, &fam, o, dev_call, &sizes)?;
            let ids: Vec<String> = cands.iter().map(|c| c.id()).collect();
            let device = cuda.fingerprint();
            let key = self.key(&device, op, &fam, wanted, dtype, &sizes, &ids);
            let choice = {
                let mut tuner = Tuner::new(
                    op,
                    fam.features.clone(),
                    wanted.clone(),
                    dtype,
                    fam.instance.keys.clone(),
                    sizes.clone(),
                    dev_call.scalars.clone(),
                    cands.clone(),
                    Device::Cuda { cuda: &cuda },
                );
                tuner.deterministic = o.deterministic;
                let explicit = o.config.as_ref().map(|c| explicit_config(c, &cands)).transpose()?;
                self.chain(&device).choose(&key, explicit.as_ref(), &tuner)?
            };
            let cand = cands.iter().find(|c| c.config == choice.config).ok_or_else(|| ApiError::Argument {
                arg: "config",
                message: format!(
                    "{} is not one of the built configurations ({})",
                    config_id(&choice.config),
                    ids.join(", ")
                ),
            })?;
            let plan = crate::cuda::CudaPlan::for_candidate(&cuda, cand, dev_call, &sizes).map_err(err)?;
            plan.launch(&cuda).map_err(err)?;
            // The plan's temporaries are freed in stream order when it drops, so only the
            // caller's need to read the outputs on the host asks for the wait.
            if !(o.asynchronous && uploaded.is_none()) {
                cuda.synchronize().map_err(err)?;
            }
            Ok(CallResult {
                instance: fam.instance.clone(),
                backend: fam.backend.clone(),
                plan: cand.plan.plan.name.clone(),
                kernels: cand.launches.iter().map(|e| e.entry.clone()).collect(),
                config: choice.config,
                source: choice.source,
                key: key.to_string(),
                device: device.clone(),
            })
        })();
        self.registry = registry;
        let r = result?;
        if let Some(dev) = &uploaded {
            let outs = op.outputs(&r_features(&self.registry, op, &r.instance));
            crate::cuda::download_into(&cuda, dev, &outs, call).map_err(err)?;
        }
        Ok(r)
    }
}

/// The features of an instance (for its output names).
#[cfg(feature = "cuda")]
fn r_features(reg: &Registry, op: &dyn Operation, i: &Instance) -> Features {
    reg.entries().iter().find(|e| e.op == op.name() && e.instance == *i).map(|e| e.features.clone()).unwrap_or_default()
}

/// The built configuration an explicit one names: itself when built, else the one
/// candidate that agrees on every value given (so `block_m=64,block_n=64,num_splits=8,
/// plan:split_kv=1` need not spell the combine role's fixed `combine.block_m=16`).
fn explicit_config(given: &Config, cands: &[Candidate]) -> Result<Config, ApiError> {
    if cands.iter().any(|c| c.config == *given) {
        return Ok(given.clone());
    }
    let fits: Vec<&Candidate> =
        cands.iter().filter(|c| given.iter().all(|(k, v)| c.config.get(k) == Some(v))).collect();
    let ids =
        |cs: &mut dyn Iterator<Item = &Candidate>| cs.map(|c| config_id(&c.config)).collect::<Vec<_>>().join(", ");
    match fits.as_slice() {
        [one] => Ok(one.config.clone()),
        [] => Err(ApiError::Argument {
            arg: "config",
            message: format!(
                "{} is not one of the built configurations ({})",
                config_id(given),
                ids(&mut cands.iter())
            ),
        }),
        more => Err(ApiError::Argument {
            arg: "config",
            message: format!(
                "{} fits several built configurations ({}): name more of its values",
                config_id(given),
                ids(&mut more.iter().copied())
            ),
        }),
    }
}
