//! Autotuning flash-attention kernels on the CPU.
//!
//! ```no_run
//! # use ejc_runtime::tune::{FlashCandidate, FlashTuner};
//! # use ejc_runtime::chain::Tunable;
//! # fn demo(t: FlashTuner) {
//! let report = t.autotune(&t.candidates());
//! for timing in &report.timings {
//!     println!("{} {:?} {}", timing.config_id, timing.median_ms, timing.status);
//! }
//! # }
//! ```
//!
//! For every candidate, in order:
//!
//! 1. **feasibility**: a candidate whose per-thread scratch exceeds the L2 cache is
//!    pruned (its tiles would stream from L3 on every block);
//! 2. **correctness**: it runs a small case of the call (same features, dtype, head
//!    dim and head counts; short sequences that are not block multiples) on fresh
//!    random inputs and is compared with the reference; a wrong candidate is dropped
//!    and the report says why;
//! 3. **speed**: it runs the call's shape on fresh random inputs (never zeros) —
//!    warm-up runs, then timed runs, the median kept. A candidate that fails to run
//!    counts as infinitely slow.
//!
//! Every outcome goes into the report, so a cached choice can be explained later.

use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::reference;
use ejc_ir::flash::{FlashRuntime, FlashShape};
use ejc_ir::spec::Features;
use ejc_ir::tensor::compare;
use ejc_ir::types::DType;

use crate::cache::Timing;
use crate::chain::{Tunable, TuneReport};
use crate::cpu::CpuKernel;
use crate::flash::{run_cpu, FlashBuffers};
use crate::registry::{config_id, Config};

/// One candidate: a configuration and its compiled kernel.
#[derive(Clone, Copy, Debug)]
pub struct FlashCandidate<'c> {
    pub config: &'c Config,
    pub kernel: CpuKernel,
    pub block_m: usize,
}

/// Tolerance on ‖out − ref‖ / ‖ref‖ (DESIGN.md).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 5e-3,
        _ => 1e-2,
    }
}

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

/// A flash call to tune.
pub struct FlashTuner<'c> {
    pub features: Features,
    pub dtype: DType,
    pub head_dim: usize,
    pub shape: FlashShape,
    /// The call's run-time scalars (window, soft cap, dropout): candidates are timed
    /// with the call's own values.
    pub runtime: FlashRuntime,
    pub candidates: Vec<FlashCandidate<'c>>,
    pub threads: usize,
    pub warmup: usize,
    pub reps: usize,
    /// Candidates needing more scratch than this are pruned.
    pub scratch_limit: u64,
    /// Show a progress bar on stderr (hidden when stderr is not a terminal).
    pub progress: bool,
    /// Seed of the random inputs (fresh per tuning by default).
    pub seed: u64,
}

impl<'c> FlashTuner<'c> {
    pub fn new(
        features: Features,
        dtype: DType,
        head_dim: usize,
        shape: FlashShape,
        runtime: FlashRuntime,
        candidates: Vec<FlashCandidate<'c>>,
    ) -> Self {
        FlashTuner {
            features,
            dtype,
            head_dim,
            shape,
            runtime,
            candidates,
            threads: 0,
            warmup: 2,
            reps: 7,
            scratch_limit: l2_bytes(),
            progress: true,
            seed: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1),
        }
    }

    fn find(&self, c: &Config) -> Option<&FlashCandidate<'c>> {
        self.candidates.iter().find(|x| x.config == c)
    }

    /// Check one candidate on a small case against the reference.
    fn verify(&self, cand: &FlashCandidate) -> Result<(), String> {
        let s = &self.shape;
        let small = FlashShape {
            batch: s.batch.min(2),
            seq_q: s.seq_q.min(77),
            seq_k: s.seq_k.min(93),
            heads_q: s.heads_q,
            heads_kv: s.heads_kv,
            head_dim: s.head_dim,
        };
        let inputs = random_inputs(&self.features, self.dtype, &small, self.seed ^ 0x5eed);
        let mut rt = default_runtime(&self.features, &small, self.seed);
        rt.softmax_scale = self.runtime.softmax_scale;
        rt.window = self.runtime.window;
        rt.softcap = self.runtime.softcap;
        rt.dropout_p = self.runtime.dropout_p;
        let want = reference(&self.features, &rt, &inputs).map_err(|e| format!("reference: {e}"))?;
        let mut call = FlashBuffers::from_inputs(&inputs);
        run_cpu(&cand.kernel, &self.features, self.dtype, self.head_dim, cand.block_m, &rt, &mut call, self.threads)
            .map_err(|e| format!("failed to run: {e}"))?;
        let got = call.outputs();
        let (rel, _) = compare(&got.out.to_vec(), &want.out.to_vec());
        let (lrel, _) = compare(&got.lse.to_vec(), &want.lse.to_vec());
        let tol = tolerance(self.dtype);
        if rel <= tol && lrel <= tol {
            Ok(())
        } else {
            Err(format!("wrong result: rel_err={rel:.2e} lse_rel_err={lrel:.2e} (tolerance {tol:e})"))
        }
    }

    /// Median milliseconds on fresh random inputs of the call's shape.
    fn time(&self, cand: &FlashCandidate, call: &mut FlashBuffers) -> Result<f64, String> {
        let mut times = Vec::with_capacity(self.reps);
        for i in 0..self.warmup + self.reps {
            let t = std::time::Instant::now();
            run_cpu(
                &cand.kernel,
                &self.features,
                self.dtype,
                self.head_dim,
                cand.block_m,
                &self.runtime,
                call,
                self.threads,
            )
            .map_err(|e| format!("failed to run: {e}"))?;
            if i >= self.warmup {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        Ok(times[times.len() / 2])
    }
}

impl Tunable for FlashTuner<'_> {
    fn candidates(&self) -> Vec<Config> {
        self.candidates.iter().map(|c| c.config.clone()).collect()
    }

    /// 64 × 64 blocks when built (a balanced tiling for both products), else the first.
    fn heuristic(&self) -> Option<Config> {
        let pick = self
            .candidates
            .iter()
            .find(|c| c.config.get("block_m") == Some(&64) && c.config.get("block_n") == Some(&64))
            .or(self.candidates.first());
        pick.map(|c| c.config.clone())
    }

    fn autotune(&self, candidates: &[Config]) -> TuneReport {
        let bar = if self.progress {
            let b = indicatif::ProgressBar::new(candidates.len() as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template("{spinner} tuning [{bar:30}] {pos}/{len} {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            Some(b)
        } else {
            None
        };
        // One set of fresh random inputs for the timing runs, shared by all candidates
        // so that they are compared on the same data.
        let inputs = random_inputs(&self.features, self.dtype, &self.shape, self.seed);
        let mut call = FlashBuffers::from_inputs(&inputs);
        let mut timings = Vec::new();
        let mut best: Option<(f64, Config)> = None;
        for c in candidates {
            let id = config_id(c);
            if let Some(b) = &bar {
                b.set_message(id.clone());
            }
            let outcome = match self.find(c) {
                None => Err("not built".to_string()),
                Some(cand) if cand.kernel.scratch_bytes as u64 > self.scratch_limit => Err(format!(
                    "pruned: needs {} KiB of scratch per thread, more than the {} KiB L2",
                    cand.kernel.scratch_bytes / 1024,
                    self.scratch_limit / 1024
                )),
                Some(cand) => self.verify(cand).and_then(|()| self.time(cand, &mut call)),
            };
            match outcome {
                Ok(ms) => {
                    if best.as_ref().is_none_or(|(b, _)| ms < *b) {
                        best = Some((ms, c.clone()));
                    }
                    timings.push(Timing { config_id: id, median_ms: Some(ms), status: "ok".into() });
                }
                Err(status) => timings.push(Timing { config_id: id, median_ms: None, status }),
            }
            if let Some(b) = &bar {
                b.inc(1);
            }
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        TuneReport { timings, winner: best.map(|(_, c)| c) }
    }

    fn describe(&self) -> String {
        let s = &self.shape;
        let mut f = Vec::new();
        let x = &self.features;
        if x.causal {
            f.push("causal".to_string());
        }
        if x.sliding_window.is_some() {
            f.push(format!("window {:?}", self.runtime.window));
        }
        if x.logits_soft_cap.is_some() {
            f.push("soft cap".into());
        }
        for (n, on) in [
            ("sinks", x.sinks),
            ("bias", x.bias),
            ("mask", x.mask),
            ("segment ids", x.segment_ids),
            ("varlen", x.varlen),
            ("dropout", x.dropout),
        ] {
            if on {
                f.push(n.into());
            }
        }
        format!(
            "flash_attention_fwd {} q[{},{},{},{}] k/v[{},{},{},{}] {}",
            self.dtype,
            s.batch,
            s.seq_q,
            s.heads_q,
            s.head_dim,
            s.batch,
            s.seq_k,
            s.heads_kv,
            s.head_dim,
            if f.is_empty() { "full".to_string() } else { f.join(" + ") }
        )
    }
}
