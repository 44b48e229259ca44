//! The executor API: one call for library users.
//!
//! ```no_run
//! use ejc_runtime::api::{flash_attention, FlashArgs, FlashOptions};
//! use ejc_runtime::cpu::HostBuffer;
//! # fn demo(q: HostBuffer, k: HostBuffer, v: HostBuffer) {
//! // Kernels from `ejc build specs/flash.yaml --target cpu -o out` (or $EJC_KERNELS).
//! let opts = FlashOptions { causal: true, ..Default::default() };
//! let r = flash_attention(&FlashArgs::new(&q, &k, &v), &opts).unwrap();
//! println!("{} with {:?} (from the {})", r.kernel, r.config, r.source);
//! # }
//! ```
//!
//! The call picks the platform (CUDA when a driver and a device are present — the CUDA
//! back end is not built yet, so today always the CPU), the kernel (the registry family
//! whose variant computes exactly the requested features), and its configuration
//! through the chain (override → overlay → memory → persistent → autotune →
//! heuristics). The options are ejkernel's `flash_attention` options. Every argument
//! is checked first and a bad one is an error that names it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use ejc_ir::flash::{FlashRuntime, FlashShape};
use ejc_ir::spec::Features;
use ejc_ir::types::DType;
use serde_json::json;

use crate::cache::PersistentCache;
use crate::chain::{Chain, ChainError, Event, Policy, Source};
use crate::cpu::{CpuError, CpuLibrary, HostBuffer};
use crate::flash::{run_cpu, FlashBuffers};
use crate::key::{bucket_pow2, call_hash, candidates_checksum, cpu_fingerprint, CacheKey};
use crate::registry::{config_id, CallFeatures, Config, Platform, Query, Registry, RegistryError};
use crate::tune::{FlashCandidate, FlashTuner};

/// Which platform runs the call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlatformChoice {
    /// CUDA when a driver and a device are present, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// ejkernel's `sliding_window`: an int or a (left, right) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlidingWindow {
    /// `w` means (w, 0) with causal, (w, w) without.
    Size(i64),
    LeftRight(i64, i64),
}

/// The options of a flash-attention call.
#[derive(Clone, Debug, Default)]
pub struct FlashOptions {
    pub causal: bool,
    pub sliding_window: Option<SlidingWindow>,
    pub logits_soft_cap: Option<f64>,
    /// Default 1/sqrt(head_dim).
    pub softmax_scale: Option<f64>,
    /// Dropout probability (0 or None: no dropout).
    pub dropout_p: Option<f64>,
    pub dropout_seed: u64,
    pub platform: PlatformChoice,
    /// An explicit configuration: always used, never cached.
    pub config: Option<Config>,
    /// Worker threads (0 = all cores).
    pub threads: usize,
}

/// The tensors of a call (device representation; see [`HostBuffer`]).
#[derive(Clone, Copy, Debug)]
pub struct FlashArgs<'a> {
    pub q: &'a HostBuffer,
    pub k: &'a HostBuffer,
    pub v: &'a HostBuffer,
    pub bias: Option<&'a HostBuffer>,
    pub mask: Option<&'a HostBuffer>,
    pub q_segment_ids: Option<&'a HostBuffer>,
    pub kv_segment_ids: Option<&'a HostBuffer>,
    pub cu_seqlens_q: Option<&'a HostBuffer>,
    pub cu_seqlens_k: Option<&'a HostBuffer>,
    /// `[heads_q, n]` or `[n]` (shared by every head).
    pub sinks: Option<&'a HostBuffer>,
}

impl<'a> FlashArgs<'a> {
    pub fn new(q: &'a HostBuffer, k: &'a HostBuffer, v: &'a HostBuffer) -> Self {
        FlashArgs {
            q,
            k,
            v,
            bias: None,
            mask: None,
            q_segment_ids: None,
            kv_segment_ids: None,
            cu_seqlens_q: None,
            cu_seqlens_k: None,
            sinks: None,
        }
    }
}

/// The result of a call.
#[derive(Clone, Debug)]
pub struct FlashResult {
    pub out: HostBuffer,
    /// f32 `[B, Hq, Sq]`, natural log.
    pub lse: HostBuffer,
    pub kernel: String,
    pub config: Config,
    pub source: Source,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("argument `{arg}`: {message}")]
    Argument { arg: &'static str, message: String },
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Chain(#[from] ChainError),
    #[error(transparent)]
    Cpu(#[from] CpuError),
    #[error("{0}")]
    Unsupported(String),
}

fn arg(arg: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::Argument { arg, message: message.into() }
}

/// Where the runtime finds kernels and keeps its tuning cache.
#[derive(Clone, Debug, Default)]
pub struct RuntimeOptions {
    /// Build directories (or manifests) to load; default `$EJC_KERNELS` (colon-separated)
    /// or `./out`.
    pub kernels: Vec<PathBuf>,
    /// Default: `PersistentCache::default_dir()` (`$EJC_CACHE_DIR`, ...).
    pub cache_dir: Option<PathBuf>,
    pub policy: Option<Policy>,
    /// Print the chain's events to stderr (also set by `EJC_LOG=1`).
    pub log: bool,
}

/// A registry, a configuration chain and the libraries loaded so far.
pub struct Runtime {
    pub registry: Registry,
    pub chain: Chain,
    libs: HashMap<PathBuf, CpuLibrary>,
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
        let machine = cpu_fingerprint();
        let dir = opts.cache_dir.clone().unwrap_or_else(PersistentCache::default_dir);
        let cache = PersistentCache::open(&dir, &machine);
        let warnings: Vec<String> = cache.warnings().to_vec();
        let mut chain = Chain::new(opts.policy.unwrap_or_default(), Some(cache));
        let log = opts.log || std::env::var("EJC_LOG").is_ok_and(|v| v != "0" && !v.is_empty());
        if log {
            chain.observe(Box::new(|e: &Event| eprintln!("{e}")));
        }
        for w in warnings {
            eprintln!("ejc: warning: {w}");
        }
        Ok(Runtime { registry, chain, libs: HashMap::new() })
    }

    fn library(&mut self, path: &std::path::Path) -> Result<&CpuLibrary, ApiError> {
        if !self.libs.contains_key(path) {
            let lib = CpuLibrary::open(path)?;
            self.libs.insert(path.to_path_buf(), lib);
        }
        Ok(&self.libs[path])
    }

    /// Flash-attention forward: output and log-sum-exp.
    pub fn flash_attention(&mut self, a: &FlashArgs, o: &FlashOptions) -> Result<FlashResult, ApiError> {
        // ---- arguments ----
        let q = a.q;
        let dtype = q.dtype;
        if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(arg("q", format!("dtype {dtype}: flash attention takes bf16, f16 or f32")));
        }
        for (name, t) in [("k", a.k), ("v", a.v)] {
            if t.dtype != dtype {
                return Err(arg(name, format!("dtype {} differs from q's {dtype}", t.dtype)));
            }
        }
        for (name, t) in [("q", a.q), ("k", a.k), ("v", a.v)] {
            if t.shape.len() != 4 {
                return Err(arg(name, format!("shape {:?} is not [batch, seq, heads, head_dim]", t.shape)));
            }
        }
        let (b, sq, hq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
        let (sk, hkv) = (a.k.shape[1], a.k.shape[2]);
        if a.cu_seqlens_q.is_some() != a.cu_seqlens_k.is_some() {
            return Err(arg(
                if a.cu_seqlens_q.is_some() { "cu_seqlens_k" } else { "cu_seqlens_q" },
                "varlen needs both cu_seqlens_q and cu_seqlens_k",
            ));
        }
        if a.q_segment_ids.is_some() != a.kv_segment_ids.is_some() {
            return Err(arg(
                if a.q_segment_ids.is_some() { "kv_segment_ids" } else { "q_segment_ids" },
                "segment ids need both q_segment_ids and kv_segment_ids",
            ));
        }
        let varlen = a.cu_seqlens_q.is_some();
        let window = match o.sliding_window {
            None => None,
            Some(SlidingWindow::Size(w)) => Some(if o.causal { (w, 0) } else { (w, w) }),
            Some(SlidingWindow::LeftRight(l, r)) => Some((l, r)),
        };
        if let Some((l, r)) = window {
            if l < 0 || r < 0 {
                return Err(arg("sliding_window", format!("({l}, {r}): both sides must be >= 0")));
            }
        }
        if let Some(c) = o.logits_soft_cap {
            if !(c > 0.0 && c.is_finite()) {
                return Err(arg("logits_soft_cap", format!("{c} must be a positive finite number")));
            }
        }
        let dropout = o.dropout_p.is_some_and(|p| p > 0.0);
        if let Some(p) = o.dropout_p {
            if !(0.0..1.0).contains(&p) {
                return Err(arg("dropout_p", format!("{p} must be in [0, 1)")));
            }
        }
        // Shared sinks `[n]` are the per-head form with a zero stride on the head axis.
        let sinks = a.sinks.map(|s| {
            let mut s = s.clone();
            if s.shape.len() == 1 {
                s.shape = vec![hq, s.shape[0]];
                s.strides = vec![0, s.strides[0]];
            }
            s
        });
        let call = CallFeatures {
            causal: o.causal,
            window,
            softcap: o.logits_soft_cap,
            sinks: a.sinks.is_some(),
            bias: a.bias.is_some(),
            mask: a.mask.is_some(),
            segment_ids: a.q_segment_ids.is_some(),
            varlen,
            dropout,
        };
        // ---- platform ----
        match o.platform {
            PlatformChoice::Cuda => {
                return Err(ApiError::Unsupported(
                    "platform cuda: flash_attention does not choose CUDA kernels yet; run PTX artifacts with \
ejc_runtime::cuda::FlashDevice (feature `cuda`) or the ejc-gpu runner (docs/gpu.md)"
                        .into(),
                ))
            }
            PlatformChoice::Auto | PlatformChoice::Cpu => {}
        }
        // ---- kernel family ----
        let query =
            Query::new("flash_attention_fwd").platform(Platform::Cpu).dtype(dtype).head_dim(d).features(call.clone());
        let family = self.registry.families(&query)?.remove(0);
        let entries: Vec<_> = family.entries.iter().map(|e| (*e).clone()).collect();
        let features: Features = entries[0].features.clone();
        // ---- key ----
        let mut shape = FlashShape { batch: b, seq_q: sq, seq_k: sk, heads_q: hq, heads_kv: hkv, head_dim: d };
        if varlen {
            // Sequences: the prefix sums' lengths; seq_q/seq_k: the longest.
            let cu =
                |x: &HostBuffer| x.to_host().to_vec().windows(2).map(|w| (w[1] - w[0]) as usize).collect::<Vec<_>>();
            let (lq, lk) = (cu(a.cu_seqlens_q.unwrap_or(a.q)), cu(a.cu_seqlens_k.unwrap_or(a.k)));
            shape.batch = lq.len();
            shape.seq_q = lq.iter().copied().max().unwrap_or(0);
            shape.seq_k = lk.iter().copied().max().unwrap_or(0);
        }
        let ids: Vec<String> = entries.iter().map(|e| config_id(&e.config)).collect();
        let key = flash_cache_key(
            &entries[0].op,
            entries[0].op_version,
            &entries[0].compiler_version,
            &family.variant,
            &ids,
            &shape,
            dtype,
            &call,
        );
        // ---- run-time scalars ----
        let rt = FlashRuntime {
            softmax_scale: o.softmax_scale.unwrap_or(1.0 / (d as f64).sqrt()),
            window: window.unwrap_or((0, 0)),
            softcap: o.logits_soft_cap.unwrap_or(1.0),
            dropout_p: o.dropout_p.unwrap_or(0.0),
            seed: o.dropout_seed,
        };
        // ---- configuration ----
        let mut kernels = Vec::new();
        for e in &entries {
            let lib = self.library(&e.artifact)?;
            kernels.push(lib.kernel(&e.entry, e.scratch_bytes as usize)?);
        }
        let candidates: Vec<FlashCandidate> = entries
            .iter()
            .zip(&kernels)
            .map(|(e, k)| FlashCandidate {
                config: &e.config,
                kernel: *k,
                block_m: e.config.get("block_m").copied().unwrap_or(64) as usize,
            })
            .collect();
        let mut tuner = FlashTuner::new(features.clone(), dtype, d, shape, rt, candidates);
        tuner.threads = o.threads;
        let choice = self.chain.choose(&key, o.config.as_ref(), &tuner)?;
        let Some(i) = entries.iter().position(|e| e.config == choice.config) else {
            return Err(arg(
                "config",
                format!("{} is not one of the built configurations ({})", config_id(&choice.config), ids.join(", ")),
            ));
        };
        // ---- run ----
        let out = HostBuffer::from_host(&ejc_ir::tensor::HostTensor::full(dtype, &q.shape, f64::NAN));
        let lse = HostBuffer::from_host(&ejc_ir::tensor::HostTensor::full(DType::F32, &[b, hq, sq], f64::NAN));
        let mut bufs = FlashBuffers {
            q: a.q.clone(),
            k: a.k.clone(),
            v: a.v.clone(),
            out,
            lse,
            bias: a.bias.cloned(),
            mask: a.mask.cloned(),
            q_segment_ids: a.q_segment_ids.cloned(),
            kv_segment_ids: a.kv_segment_ids.cloned(),
            cu_seqlens_q: a.cu_seqlens_q.cloned(),
            cu_seqlens_k: a.cu_seqlens_k.cloned(),
            sinks,
        };
        let e = &entries[i];
        let bm = e.config.get("block_m").copied().unwrap_or(64) as usize;
        run_cpu(&kernels[i], &features, dtype, d, bm, &rt, &mut bufs, o.threads)?;
        Ok(FlashResult {
            out: bufs.out,
            lse: bufs.lse,
            kernel: e.entry.clone(),
            config: choice.config,
            source: choice.source,
        })
    }
}

/// The cache key of a flash call: this machine, `op@version`, the call (shapes with
/// sequence lengths bucketed to powers of two, dtype, variant and static arguments),
/// the candidate set and the compiler version. `ejc tune` and the API build the same
/// key, so a configuration tuned from the command line serves the library's calls.
#[allow(clippy::too_many_arguments)]
pub fn flash_cache_key(
    op: &str,
    op_version: u32,
    compiler: &str,
    variant: &str,
    candidate_ids: &[String],
    shape: &FlashShape,
    dtype: DType,
    call: &CallFeatures,
) -> CacheKey {
    let desc = json!({
        "q": {"shape": [shape.batch, bucket_pow2(shape.seq_q), shape.heads_q, shape.head_dim], "dtype": dtype.to_string()},
        "k": {"shape": [shape.batch, bucket_pow2(shape.seq_k), shape.heads_kv, shape.head_dim], "dtype": dtype.to_string()},
        "variant": variant, "causal": call.causal, "window": call.window, "softcap": call.softcap,
        "dropout": call.dropout, "sinks": call.sinks, "bias": call.bias, "mask": call.mask,
        "segment_ids": call.segment_ids, "varlen": call.varlen,
    });
    CacheKey {
        device: cpu_fingerprint(),
        op: format!("{op}@{op_version}"),
        call: call_hash(&desc),
        candidates: candidates_checksum(candidate_ids),
        compiler: compiler.to_string(),
    }
}

fn global() -> &'static Mutex<Option<Runtime>> {
    static RT: OnceLock<Mutex<Option<Runtime>>> = OnceLock::new();
    RT.get_or_init(|| Mutex::new(None))
}

/// [`Runtime::flash_attention`] on a process-wide runtime, made on first use from the
/// environment (`$EJC_KERNELS`, `$EJC_CACHE_DIR`, `$EJC_LOG`).
pub fn flash_attention(a: &FlashArgs, o: &FlashOptions) -> Result<FlashResult, ApiError> {
    let mut g = global().lock().map_err(|_| ApiError::Unsupported("the runtime's lock is poisoned".into()))?;
    if g.is_none() {
        *g = Some(Runtime::new(RuntimeOptions::default())?);
    }
    g.as_mut().expect("set above").flash_attention(a, o)
}
