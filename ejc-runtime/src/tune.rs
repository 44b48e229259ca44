//! The autotuner, for any operation, on the CPU or a GPU.
//!
//! ```no_run
//! # use ejc_runtime::tune::Tuner;
//! # use ejc_runtime::chain::Tunable;
//! # fn demo(t: Tuner) {
//! let report = t.autotune(&t.candidates());
//! for timing in &report.timings {
//!     println!("{} {:?} {}", timing.config_id, timing.median_ms, timing.status);
//! }
//! # }
//! ```
//!
//! For every candidate (a plan with an artifact per launch; [`crate::registry::Candidate`])
//! the search visits — all of a plan's when it has at most
//! [`crate::search::FULL_SEARCH_LIMIT`], else a staged search through its choices
//! ([`crate::search`]) — in order:
//!
//! 1. **feasibility** (CPU): a candidate whose per-thread scratch exceeds the L2 cache
//!    is pruned (its tiles would stream from L3 on every block);
//! 2. **correctness**: it runs a small case of the call (the operation's
//!    [`ejc_ir::op::Operation::small_dims`], same instance, the call's scalars) on fresh
//!    random inputs and is compared with the operation's reference, output by output; a
//!    wrong candidate is dropped and the report says why;
//! 3. **speed**: it runs a call of the same sizes on fresh random inputs (never zeros) —
//!    warm-up runs, then timed runs (wall clock on the CPU, CUDA events on a GPU), the
//!    median kept. A candidate that fails to run counts as infinitely slow.
//!
//! Every outcome goes into the report, so a cached choice can be explained later.

use std::cell::RefCell;

use ejc_ir::op::{compare_outputs, tolerance, Features, HostCall, Keys, Operation, Scalars, Sizes};
use ejc_ir::types::DType;

use crate::cache::Timing;
use crate::call::Call;
use crate::chain::{Tunable, TuneReport};
use crate::exec::{CpuLibs, HostPlan};
use crate::registry::{Candidate, Config};

/// Tolerance on ‖out − ref‖ / ‖ref‖ (DESIGN.md).
pub use ejc_ir::op::tolerance as design_tolerance;

/// The per-core L2 size in bytes, from sysfs (2 MiB when unknown).
pub fn l2_bytes() -> u64 {
    let parse = |s: &str| {
        let s = s.trim();
        let (num, mul) = match s.strip_suffix('K') {
            Some(n) => (n, 1024),
            None => match s.strip_suffix('M') {
                Some(n) => (n, 1024 * 1024),
                None => (s, 1),
            },
        };
        num.parse::<u64>().ok().map(|n| n * mul)
    };
    std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index2/size")
        .ok()
        .and_then(|s| parse(&s))
        .unwrap_or(2 << 20)
}

/// Where candidates run.
pub enum Device<'a> {
    Cpu {
        libs: &'a RefCell<CpuLibs>,
        threads: usize,
    },
    #[cfg(feature = "cuda")]
    Cuda {
        cuda: &'a std::sync::Arc<crate::cuda::Cuda>,
    },
}

/// One call to tune.
pub struct Tuner<'r, 'a> {
    pub op: &'static dyn Operation,
    /// The instance's features (the spec's: a run-time window is `runtime`).
    pub features: Features,
    /// What the call asks for (with its values), for the description.
    pub wanted: Features,
    pub dtype: DType,
    pub keys: Keys,
    /// The call's sizes.
    pub sizes: Sizes,
    /// The call's run-time scalars: candidates are checked and timed with them.
    pub scalars: Scalars,
    pub candidates: Vec<Candidate<'r>>,
    pub device: Device<'a>,
    pub warmup: usize,
    pub reps: usize,
    /// CPU candidates needing more scratch per thread than this are pruned.
    pub scratch_limit: u64,
    /// Show a progress bar on stderr (hidden when stderr is not a terminal).
    pub progress: bool,
    /// Seed of the random inputs (fresh per tuning by default).
    pub seed: u64,
    /// The candidates are the deterministic plans only (`CallOptions::deterministic`):
    /// said in the cache entry's description.
    pub deterministic: bool,
}

impl<'r, 'a> Tuner<'r, 'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        op: &'static dyn Operation,
        features: Features,
        wanted: Features,
        dtype: DType,
        keys: Keys,
        sizes: Sizes,
        scalars: Scalars,
        candidates: Vec<Candidate<'r>>,
        device: Device<'a>,
    ) -> Self {
        Tuner {
            op,
            features,
            wanted,
            dtype,
            keys,
            sizes,
            scalars,
            candidates,
            device,
            warmup: 2,
            reps: 7,
            scratch_limit: l2_bytes(),
            progress: true,
            seed: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1),
            deterministic: false,
        }
    }

    fn find(&self, c: &Config) -> Option<&Candidate<'r>> {
        self.candidates.iter().find(|x| x.config == *c)
    }

    /// A random call of `dims` with the call's scalars where it has them.
    /// For timing (`timing`), the operation may make reference-derived inputs cheaply.
    fn sample(&self, dims: &Sizes, seed: u64, timing: bool) -> Result<(HostCall, Sizes), String> {
        let call = if timing {
            self.op.timing_call(&self.features, self.dtype, dims, seed, &self.scalars)?
        } else {
            self.op.random_call_with(&self.features, self.dtype, dims, seed, &self.scalars)?
        };
        let sizes = self.op.validate(&self.features, self.dtype, &self.keys, &call)?;
        Ok((call, sizes))
    }

    /// Run a candidate once on a host call; its outputs.
    fn run_once(&self, cand: &Candidate, host: &HostCall, sizes: &Sizes) -> Result<HostCall, String> {
        let mut call = Call::from_host(host);
        match &self.device {
            Device::Cpu { libs, threads } => {
                let mut libs = libs.borrow_mut();
                crate::exec::run_cpu(&mut libs, cand, &mut call, sizes, *threads).map_err(|e| e.to_string())?;
            }
            #[cfg(feature = "cuda")]
            Device::Cuda { cuda } => {
                let dev = crate::cuda::upload_call(cuda, &call).map_err(|e| e.to_string())?;
                let plan = crate::cuda::CudaPlan::for_candidate(cuda, cand, &dev, sizes).map_err(|e| e.to_string())?;
                plan.launch(cuda).map_err(|e| e.to_string())?;
                cuda.synchronize().map_err(|e| e.to_string())?;
                let outs = self.op.outputs(&self.features);
                crate::cuda::download_into(cuda, &dev, &outs, &mut call).map_err(|e| e.to_string())?;
            }
        }
        let mut out = host.clone();
        for n in self.op.outputs(&self.features) {
            if let Some(t) = call.host_tensor(n) {
                out.tensors.insert(n.to_string(), t);
            }
        }
        Ok(out)
    }

    /// Check one candidate on a small case against the reference.
    fn verify(&self, cand: &Candidate) -> Result<(), String> {
        let small = self.op.small_dims(&self.sizes);
        let (call, sizes) = self.sample(&small, self.seed ^ 0x5eed, false)?;
        let want = self.op.reference(&self.features, &call).map_err(|e| format!("reference: {e}"))?;
        let got = self.run_once(cand, &call, &sizes).map_err(|e| format!("failed to run: {e}"))?;
        let tol = tolerance(self.dtype);
        let errs = compare_outputs(self.op, &self.features, &got, &want);
        // NaN compares false: it never passes. A reference that is exactly zero (a
        // ring block whose rows see one key each has dQ = 0) has an infinite relative
        // error for any rounding noise: there the absolute error is judged.
        if errs.iter().all(|(_, rel, abs)| *rel <= tol || (rel.is_infinite() && *abs <= tol)) {
            Ok(())
        } else {
            let parts: Vec<String> = errs.iter().map(|(n, rel, _)| format!("{n} rel_err={rel:.2e}")).collect();
            Err(format!("wrong result: {} (tolerance {tol:e})", parts.join(" ")))
        }
    }

    /// Median milliseconds on a call of the tuned sizes. On a GPU, `uploaded` holds the
    /// call's tensors on the device, uploaded by the first candidate timed and reused by
    /// the others (each overwrites the outputs; a serving step's cache is hundreds of MB,
    /// and uploading it per candidate cost seconds each).
    fn time(
        &self,
        cand: &Candidate,
        host: &HostCall,
        sizes: &Sizes,
        uploaded: &std::cell::OnceCell<Result<Call, String>>,
    ) -> Result<f64, String> {
        match &self.device {
            Device::Cpu { libs, threads } => {
                let _ = uploaded;
                let mut call = Call::from_host(host);
                let (owned, kernels) = {
                    let mut libs = libs.borrow_mut();
                    HostPlan::for_candidate(&mut libs, cand, &call, sizes).map_err(|e| e.to_string())?
                };
                let mut plan = owned.prepare(&kernels, &call, sizes, &cand.config).map_err(|e| e.to_string())?;
                let mut times = Vec::with_capacity(self.reps);
                for i in 0..self.warmup + self.reps {
                    let t = std::time::Instant::now();
                    plan.run(&mut call, *threads).map_err(|e| format!("failed to run: {e}"))?;
                    if i >= self.warmup {
                        times.push(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
                times.sort_by(|a, b| a.total_cmp(b));
                Ok(times[times.len() / 2])
            }
            #[cfg(feature = "cuda")]
            Device::Cuda { cuda } => {
                let dev = uploaded
                    .get_or_init(|| crate::cuda::upload_call(cuda, &Call::from_host(host)).map_err(|e| e.to_string()))
                    .as_ref()
                    .map_err(|e| e.clone())?;
                let plan = crate::cuda::CudaPlan::for_candidate(cuda, cand, dev, sizes).map_err(|e| e.to_string())?;
                plan.median_ms(cuda, self.warmup, self.reps).map_err(|e| e.to_string())
            }
        }
    }

    fn pruned(&self, cand: &Candidate) -> Option<String> {
        if !matches!(self.device, Device::Cpu { .. }) {
            return None;
        }
        let scratch = cand.launches.iter().map(|e| e.scratch_bytes).max().unwrap_or(0);
        (scratch > self.scratch_limit).then(|| {
            format!(
                "pruned: needs {} KiB of scratch per thread, more than the {} KiB L2",
                scratch / 1024,
                self.scratch_limit / 1024
            )
        })
    }
}

impl Tunable for Tuner<'_, '_> {
    fn candidates(&self) -> Vec<Config> {
        self.candidates.iter().map(|c| c.config.clone()).collect()
    }

    fn heuristic(&self) -> Option<Config> {
        let configs = self.candidates();
        self.op.heuristic(&configs).and_then(|i| configs.get(i).cloned())
    }

    fn autotune(&self, candidates: &[Config]) -> TuneReport {
        let found: Vec<(usize, &Candidate)> =
            candidates.iter().enumerate().filter_map(|(i, c)| self.find(c).map(|cand| (i, cand))).collect();
        let points: Vec<crate::search::Point> = found.iter().map(|(_, cand)| cand.point()).collect();
        let bar = if self.progress {
            let b = indicatif::ProgressBar::new(crate::search::search_bound(&points) as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template("{spinner} tuning [{bar:30}] {pos}/{len} ETA {eta:>4} {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            Some(b)
        } else {
            None
        };
        // One set of fresh random inputs for the timing runs, shared by all candidates
        // so that they are compared on the same data.
        let dims = self.op.dims_of(&self.sizes);
        let sample = self.sample(&dims, self.seed, true);
        let uploaded = std::cell::OnceCell::new();
        let mut timings = Vec::new();
        // Which candidates are timed: every one of a plan with few, a staged search
        // through a plan with many (`crate::search`); a configuration that was not built
        // is reported as such.
        for c in candidates.iter().filter(|c| self.find(c).is_none()) {
            timings.push(Timing { config_id: ejc_ir::op::config_id(c), median_ms: None, status: "not built".into() });
        }
        let best = crate::search::staged_search(&points, |k| {
            let (i, cand) = found[k];
            let id = ejc_ir::op::config_id(&candidates[i]);
            if let Some(b) = &bar {
                b.set_message(id.clone());
            }
            let outcome = match &sample {
                Err(e) => Err(format!("no inputs: {e}")),
                Ok((host, sizes)) => match self.pruned(cand) {
                    Some(why) => Err(why),
                    None => self.verify(cand).and_then(|()| self.time(cand, host, sizes, &uploaded)),
                },
            };
            if let Some(b) = &bar {
                b.inc(1);
            }
            match outcome {
                Ok(ms) => {
                    timings.push(Timing { config_id: id, median_ms: Some(ms), status: "ok".into() });
                    Some(ms)
                }
                Err(status) => {
                    timings.push(Timing { config_id: id, median_ms: None, status });
                    None
                }
            }
        });
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        TuneReport { timings, winner: best.map(|k| candidates[found[k].0].clone()) }
    }

    fn describe(&self) -> String {
        let dims = self.op.dims_of(&self.sizes);
        let dims: Vec<String> =
            self.op.dims().iter().filter_map(|d| dims.get(d.name).map(|v| format!("{}={v}", d.name))).collect();
        let mut text =
            format!("{} {} {} {}", self.op.name(), self.dtype, dims.join(","), self.op.describe(&self.wanted));
        #[allow(irrefutable_let_patterns)] // without the `cuda` feature the CPU is the only device
        if let Device::Cpu { threads, .. } = &self.device {
            let n = crate::key::cpu_threads(*threads);
            text.push_str(&format!(" ({n} thread{})", if n == 1 { "" } else { "s" }));
        }
        if self.deterministic {
            text.push_str(" [deterministic]");
        }
        text
    }
}
