//! Kernels with a schedule space (`#[ej_kernel(tune(bm = [64, 128], warps = [4, 8]))]`):
//! every point compiled, and the one to run chosen per call.
//!
//! ```no_run
//! use ejc_runtime::dsl::DslLibrary;
//! let lib = DslLibrary::open(env!("CARGO_MANIFEST_DIR")).unwrap();
//! let mm = lib.tuned_kernel("matmul_bf16").unwrap();
//! // matmul_bf16::launch_tuned(&mm, threads, |c| [cdiv(m, c.BM), cdiv(n, c.BN), 1], &a, &b, &mut out)
//! ```
//!
//! The choice for a call goes down a chain, first answer wins:
//!
//! 1. a point pinned with [`TunedKernel::pin`] / [`GpuTunedKernel::pin`];
//! 2. this process's earlier choice for the same call;
//! 3. the persistent tuning cache (`ejc cache ls`; the same file and key scheme as the
//!    operations', [`crate::cache`]), keyed by the machine, the build and kernel, the
//!    call (every tensor's dtype and shape, and the thread count on the CPU — never the
//!    data or the scalars), the candidate set and the compiler;
//! 4. tuning: every point runs once to warm up and then is timed (the median of up to
//!    five runs, fewer when one takes long), the fastest wins and is stored at 2 and 3.
//!    A point that fails to launch is reported in the entry and skipped.
//!
//! Tuning runs the kernel many times on the caller's tensors. The tensors it stores to
//! are saved first and put back before the chosen point runs, so a kernel that
//! accumulates into its output (`out += ...`) still gives the right answer.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Instant;

use ejc_ir::manifest::Artifact;
use serde_json::json;

use super::{DslLibrary, GpuError, GpuKernel, GpuTensorArg};
use crate::cache::{CacheEntry, PersistentCache, Timing};
use crate::cpu::{launch_checked, CpuError, CpuKernel, TensorArg};
use crate::key::{call_hash, candidates_checksum, CacheKey};

/// One point of a kernel's schedule space as built.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// `bm64_bn128_w8_s2` (the constants, then the GPU's warps and stages).
    pub id: String,
    /// The tuned constants and every fixed one, by their names in the body (`BM`).
    pub consts: BTreeMap<String, i64>,
    /// What the manifest records: the constants in lower case, `num_warps`, `num_stages`.
    pub config: BTreeMap<String, u32>,
}

/// Which point a call ran, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub point: String,
    /// `pinned`, `memory`, `cache` or `tuned`.
    pub source: &'static str,
    /// Every point's outcome when this call tuned (empty otherwise).
    pub timings: Vec<Timing>,
}

/// The decision machinery both devices share.
struct Space {
    kernel: String,
    /// `dsl:<build>/<kernel>@<target>`.
    op: String,
    machine: String,
    compiler: String,
    points: Vec<Point>,
    pinned: Option<usize>,
    memo: Mutex<HashMap<String, usize>>,
    cache: Mutex<PersistentCache>,
    /// The cache is in memory because the caller asked: no warning on each result.
    memory_only: bool,
    last: Mutex<Option<Choice>>,
}

fn open_cache(machine: &str) -> PersistentCache {
    match PersistentCache::default_dir() {
        Some(dir) => PersistentCache::open(&dir, machine),
        None => PersistentCache::in_memory(machine, "no cache directory (set EJC_CACHE_DIR or HOME)"),
    }
}

impl Space {
    fn new(lib: &DslLibrary, kernel: &str, target: &str, machine: String, points: Vec<Point>) -> Space {
        let build = lib.loaded.manifest.spec.name.clone();
        Space {
            kernel: kernel.to_string(),
            op: format!("dsl:{build}/{kernel}@{target}"),
            compiler: lib.loaded.manifest.compiler.version.clone(),
            cache: Mutex::new(open_cache(&machine)),
            machine,
            points,
            pinned: None,
            memo: Mutex::new(HashMap::new()),
            memory_only: false,
            last: Mutex::new(None),
        }
    }

    fn pin(&mut self, id: &str) -> Result<(), String> {
        let i = self.points.iter().position(|p| p.id == id).ok_or_else(|| {
            format!(
                "`{}` has no point `{id}` (it has: {})",
                self.kernel,
                self.points.iter().map(|p| p.id.as_str()).collect::<Vec<_>>().join(", ")
            )
        })?;
        self.pinned = Some(i);
        Ok(())
    }

    fn key(&self, call: &serde_json::Value) -> CacheKey {
        let ids: Vec<String> = self.points.iter().map(|p| p.id.clone()).collect();
        CacheKey {
            device: self.machine.clone(),
            op: self.op.clone(),
            call: call_hash(call),
            candidates: candidates_checksum(&ids),
            compiler: self.compiler.clone(),
        }
    }

    /// The point a call runs without measuring anything, if the chain has one.
    fn known(&self, call: &serde_json::Value) -> Option<(usize, &'static str)> {
        if let Some(i) = self.pinned {
            return Some((i, "pinned"));
        }
        let key = self.key(call);
        if let Some(&i) = self.memo.lock().ok()?.get(&key.call) {
            return Some((i, "memory"));
        }
        let cache = self.cache.lock().ok()?;
        let e = cache.get(&key.to_string())?;
        let i = self.points.iter().position(|p| p.config == e.config)?;
        drop(cache);
        self.memo.lock().ok()?.insert(key.call, i);
        Some((i, "cache"))
    }

    /// Time every point with `measure` (milliseconds, or why it failed), keep the
    /// fastest.
    fn tune(
        &self,
        call: &serde_json::Value,
        measure: &mut dyn FnMut(usize) -> Result<f64, String>,
    ) -> Result<(usize, Vec<Timing>), String> {
        let mut timings = Vec::new();
        let mut best: Option<(usize, f64)> = None;
        for (i, p) in self.points.iter().enumerate() {
            let (ms, status) = match measure(i) {
                Ok(ms) => (Some(ms), "ok".to_string()),
                Err(why) => (None, format!("failed: {why}")),
            };
            if let Some(ms) = ms {
                if best.is_none_or(|(_, b)| ms < b) {
                    best = Some((i, ms));
                }
            }
            timings.push(Timing { config_id: p.id.clone(), median_ms: ms, status });
        }
        let Some((i, _)) = best else {
            let why: Vec<String> = timings.iter().map(|t| format!("{}: {}", t.config_id, t.status)).collect();
            return Err(format!("`{}`: no point of the schedule space ran ({})", self.kernel, why.join("; ")));
        };
        let key = self.key(call);
        let entry = CacheEntry {
            config: self.points[i].config.clone(),
            timings: timings.clone(),
            call: format!("{} {call}", self.kernel),
            device: self.machine.clone(),
            op: self.op.clone(),
            call_hash: key.call.clone(),
            candidates: key.candidates.clone(),
            compiler: self.compiler.clone(),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        if let Ok(mut c) = self.cache.lock() {
            if let Err(w) = c.put(&key.to_string(), entry) {
                if !self.memory_only {
                    eprintln!("warning: {w}");
                }
            }
        }
        if let Ok(mut m) = self.memo.lock() {
            m.insert(key.call, i);
        }
        if std::env::var("EJC_LOG").is_ok_and(|v| v != "0" && !v.is_empty()) {
            eprintln!("[ejc] tuned `{}` for {call}: {}", self.kernel, self.points[i].id);
        }
        Ok((i, timings))
    }

    fn record(&self, i: usize, source: &'static str, timings: Vec<Timing>) {
        if let Ok(mut l) = self.last.lock() {
            *l = Some(Choice { point: self.points[i].id.clone(), source, timings });
        }
    }
}

/// Median of `f`'s milliseconds: one warm-up, then up to five runs (fewer once half a
/// second is spent).
fn median_ms(f: &mut dyn FnMut() -> Result<f64, String>) -> Result<f64, String> {
    f()?;
    let mut t = Vec::new();
    let mut spent = 0.0;
    while t.len() < 5 && (t.is_empty() || spent < 500.0) {
        let ms = f()?;
        spent += ms;
        t.push(ms);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn points_of(arts: &[&Artifact]) -> Vec<Point> {
    arts.iter()
        .map(|a| {
            let consts = a
                .features
                .get("consts")
                .and_then(|c| serde_json::from_value::<BTreeMap<String, i64>>(c.clone()).ok())
                .unwrap_or_default();
            let id = a.features.get("point").and_then(|p| p.as_str()).unwrap_or("default").to_string();
            Point { id, consts, config: a.config.clone() }
        })
        .collect()
}

/// A kernel's every point, loaded for this CPU (the widest ISA it runs).
pub struct TunedKernel {
    space: Space,
    kernels: Vec<CpuKernel>,
}

impl TunedKernel {
    /// The points, in the build's order (the default first).
    pub fn points(&self) -> &[Point] {
        &self.space.points
    }
    /// Always run point `id` (e.g. `bm64_bn128`): the first link of the chain.
    pub fn pin(&mut self, id: &str) -> Result<(), CpuError> {
        self.space.pin(id).map_err(CpuError::Invalid)
    }
    /// Which point the last launch ran, and why.
    pub fn last_choice(&self) -> Option<Choice> {
        self.space.last.lock().ok().and_then(|l| l.clone())
    }
    /// Keep tuning results in memory only (tests; read-only machines).
    pub fn without_persistent_cache(mut self) -> TunedKernel {
        self.space.cache = Mutex::new(PersistentCache::in_memory(&self.space.machine, "asked for"));
        self.space.memory_only = true;
        self
    }
    /// Keep tuning results in the cache file under `dir` instead of the default
    /// (`$EJC_CACHE_DIR`, else the user's cache directory).
    pub fn with_cache_dir(mut self, dir: &std::path::Path) -> TunedKernel {
        self.space.cache = Mutex::new(PersistentCache::open(dir, &self.space.machine));
        self
    }
}

/// A checked launch of a tuned kernel on the CPU (the generated `launch_tuned` calls
/// this): `grid` maps a point's constants to its grid. See the module docs for how the
/// point is chosen.
pub fn launch_tuned_checked(
    kernel: &TunedKernel,
    kernel_name: &str,
    tensors: &mut [TensorArg],
    scalars: &[u64],
    grid: &dyn Fn(&BTreeMap<String, i64>) -> [i64; 3],
    threads: usize,
) -> Result<(), CpuError> {
    let space = &kernel.space;
    let threads_n = crate::key::cpu_threads(threads);
    let call = json!({
        "tensors": tensors.iter().map(|t| json!([t.name, t.buffer().dtype.to_string(), t.buffer().shape])).collect::<Vec<_>>(),
        "threads": threads_n,
    });
    let run = |i: usize, tensors: &mut [TensorArg]| {
        launch_checked(&kernel.kernels[i], kernel_name, tensors, scalars, grid(&space.points[i].consts), threads)
    };
    let i = match space.known(&call) {
        Some((i, source)) => {
            space.record(i, source, Vec::new());
            i
        }
        None => {
            // The arguments are checked once here, so that a wrong one is the caller's
            // error rather than every point's failure.
            crate::cpu::check_tensor_args(kernel_name, tensors)?;
            let saved: Vec<(usize, Vec<u8>)> =
                tensors.iter_mut().enumerate().filter_map(|(j, t)| t.written().map(|b| (j, b.bytes.clone()))).collect();
            let (i, timings) = {
                let mut measure = |i: usize| {
                    median_ms(&mut || {
                        let t0 = Instant::now();
                        run(i, tensors).map_err(|e| e.to_string())?;
                        Ok(t0.elapsed().as_secs_f64() * 1e3)
                    })
                };
                space.tune(&call, &mut measure).map_err(CpuError::Invalid)?
            };
            for (j, bytes) in saved {
                if let Some(b) = tensors[j].written() {
                    b.bytes = bytes;
                }
            }
            space.record(i, "tuned", timings);
            i
        }
    };
    run(i, tensors)
}

impl DslLibrary {
    /// Kernel `name` with every point of its schedule space, for its generated
    /// `launch_tuned` wrapper (a kernel without `tune` has one point).
    pub fn tuned_kernel(&self, name: &str) -> Result<TunedKernel, CpuError> {
        let (first, isa) = self.artifact(name)?;
        let arts: Vec<&Artifact> =
            self.loaded.manifest.artifacts.iter().filter(|a| a.kernel_id == name && a.target == first.target).collect();
        let mut kernels = Vec::new();
        for a in &arts {
            kernels.push(self.load_cpu(a)?);
        }
        let machine = crate::key::cpu_fingerprint();
        let space = Space::new(self, name, &format!("cpu:{}", isa.name()), machine, points_of(&arts));
        Ok(TunedKernel { space, kernels })
    }
}

/// A kernel's every point, loaded on a GPU (the build's PTX for it).
pub struct GpuTunedKernel {
    space: Space,
    kernels: Vec<GpuKernel>,
}

impl GpuTunedKernel {
    /// The points, in the build's order (the default first).
    pub fn points(&self) -> &[Point] {
        &self.space.points
    }
    /// Always run point `id` (e.g. `bm128_bn128_w8_s2`).
    pub fn pin(&mut self, id: &str) -> Result<(), GpuError> {
        self.space.pin(id).map_err(GpuError::Invalid)
    }
    /// Which point the last launch ran, and why.
    pub fn last_choice(&self) -> Option<Choice> {
        self.space.last.lock().ok().and_then(|l| l.clone())
    }
    /// Keep tuning results in memory only.
    pub fn without_persistent_cache(mut self) -> GpuTunedKernel {
        self.space.cache = Mutex::new(PersistentCache::in_memory(&self.space.machine, "asked for"));
        self.space.memory_only = true;
        self
    }
    /// Keep tuning results in the cache file under `dir`.
    pub fn with_cache_dir(mut self, dir: &std::path::Path) -> GpuTunedKernel {
        self.space.cache = Mutex::new(PersistentCache::open(dir, &self.space.machine));
        self
    }
    /// The artifact's target (`ptx:sm_90a`).
    pub fn target(&self) -> &str {
        &self.kernels[0].target
    }
}

/// A checked launch of a tuned kernel on the GPU (the generated `launch_gpu_tuned`
/// calls this). Tuning times each point with CUDA events and waits for the GPU; a call
/// whose choice is known only queues the launch.
// Without CUDA a `Gpu` cannot exist, so the tuning branch is unreachable there.
#[cfg_attr(not(feature = "cuda"), allow(unreachable_code, unused_variables))]
pub fn launch_gpu_tuned_checked(
    kernel: &GpuTunedKernel,
    kernel_name: &str,
    tensors: &[GpuTensorArg],
    scalars: &[(ejc_ir::types::DType, f64)],
    grid: &dyn Fn(&BTreeMap<String, i64>) -> [i64; 3],
) -> Result<(), GpuError> {
    let space = &kernel.space;
    let call = json!({
        "tensors": tensors.iter().map(|t| json!([t.name, t.buf.dtype().to_string(), t.buf.shape()])).collect::<Vec<_>>(),
    });
    let run = |i: usize| {
        super::launch_gpu_checked(&kernel.kernels[i], kernel_name, tensors, scalars, grid(&space.points[i].consts))
    };
    let i = match space.known(&call) {
        Some((i, source)) => {
            space.record(i, source, Vec::new());
            i
        }
        None => {
            super::check_gpu_tensor_args(kernel_name, tensors)?;
            let gpu = super::Gpu::of_kernel(&kernel.kernels[0]);
            let saved = gpu.save(tensors)?;
            let mut measure = |i: usize| {
                median_ms(&mut || {
                    let t = gpu.time(1, &mut || run(i)).map_err(|e| e.to_string())?;
                    Ok(t[0] as f64)
                })
            };
            let (i, timings) = space.tune(&call, &mut measure).map_err(GpuError::Invalid)?;
            gpu.restore(tensors, saved)?;
            space.record(i, "tuned", timings);
            i
        }
    };
    run(i)
}

impl DslLibrary {
    /// Kernel `name` on `gpu` with every point of its schedule space, for its generated
    /// `launch_gpu_tuned` wrapper: the points of the build's PTX for this GPU.
    pub fn gpu_tuned_kernel(&self, gpu: &super::Gpu, name: &str) -> Result<GpuTunedKernel, GpuError> {
        self.not_flash(name)?;
        let target = self.gpu_target(gpu, name)?;
        let arts: Vec<&Artifact> =
            self.loaded.manifest.artifacts.iter().filter(|a| a.kernel_id == name && a.target == target).collect();
        let mut kernels = Vec::new();
        for a in &arts {
            kernels.push(self.load_gpu(gpu, a)?);
        }
        let space = Space::new(self, name, &target, gpu.fingerprint(), points_of(&arts));
        Ok(GpuTunedKernel { space, kernels })
    }
}
