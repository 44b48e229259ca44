//! `ejc tune SPEC --variant V --shape ...`: run the configuration chain with autotuning
//! for one call, print every candidate's time, the winner, and where it is stored.
//!
//! The candidates are the spec's tilings, compiled in-process for this CPU; the cache
//! key is the one `ejc_runtime::api` builds for the same call on a build of the same
//! spec, so a configuration tuned here serves library calls later.

use std::path::PathBuf;

use ejc_codegen::cpu::{compile_object, jit::JitLibrary};
use ejc_codegen::COMPILER_VERSION;
use ejc_runtime::api::flash_cache_key;
use ejc_runtime::cache::PersistentCache;
use ejc_runtime::chain::{Chain, Event, Policy, Source};
use ejc_runtime::cpu::CpuKernel;
use ejc_runtime::key::cpu_fingerprint;
use ejc_runtime::registry::{config_id, CallFeatures, Config};
use ejc_runtime::tune::{FlashCandidate, FlashTuner};

use super::common::{Problem, ProblemFlags};
use super::Outcome;

pub struct Request {
    pub problem: ProblemFlags,
    pub backend: &'static str,
    pub threads: usize,
    pub cache_dir: Option<PathBuf>,
    /// Tune again even if the cache has this call.
    pub force: bool,
    pub reps: usize,
}

pub fn run(req: &Request) -> Outcome {
    if req.backend != "cpu" {
        return super::common::unsupported_backend(req.backend).unwrap_or_else(|| {
            Outcome::Error(match req.backend {
                "cuda" => "error: `ejc tune` stores CPU choices only: the runtime's configuration chain does not pick \
CUDA kernels yet; `ejc bench --backend cuda` times every candidate on the GPU and names the fastest"
                    .into(),
                _ => "error: tuning runs on the cpu backend (the interpreter is a reference, not a target)".into(),
            })
        });
    }
    let p = match Problem::from_flags(&req.problem) {
        Ok(p) => p,
        Err(o) => return o,
    };
    let variants = p.variants();
    if variants.len() != 1 {
        return Outcome::Error(format!(
            "error: tune takes one variant: pass --variant (spec `{}` has {})",
            p.spec.name,
            p.variant_names.join(", ")
        ));
    }
    let v = variants[0];
    let tilings = match p.tiling {
        Some(t) => vec![t],
        None => p.spec.schedule.tilings(),
    };
    // Compile every candidate into one object, in-process.
    eprintln!("compiling {} candidates of `{}` for {} ...", tilings.len(), v.name, p.isa);
    let mut kernels = Vec::new();
    for t in &tilings {
        match p.kernel(v, *t) {
            Ok(k) => kernels.push(k),
            Err(o) => return o,
        }
    }
    let obj = match compile_object(&kernels, p.isa) {
        Ok(o) => o,
        Err(e) => return Outcome::Error(format!("error: {e}")),
    };
    let jit = match JitLibrary::load(&obj.object) {
        Ok(j) => j,
        Err(e) => return Outcome::Error(format!("error: {e}")),
    };
    let configs: Vec<Config> =
        tilings.iter().map(|(m, n)| Config::from([("block_m".to_string(), *m), ("block_n".to_string(), *n)])).collect();
    let mut candidates = Vec::new();
    for ((k, c), code) in kernels.iter().zip(&configs).zip(&obj.kernels) {
        let entry = match jit.entry(&k.name) {
            Ok(e) => e,
            Err(e) => return Outcome::Error(format!("error: {e}")),
        };
        candidates.push(FlashCandidate {
            config: c,
            kernel: CpuKernel { entry, scratch_bytes: code.scratch_bytes as usize },
            block_m: c["block_m"] as usize,
        });
    }
    let f = &v.features;
    let rt = p.runtime(v, rand::random());
    let call = CallFeatures {
        causal: f.causal,
        window: f.sliding_window.map(|_| match f.sliding_window {
            Some(ejc_ir::spec::Window::Fixed { left, right }) => (left as i64, right as i64),
            _ => rt.window,
        }),
        softcap: f.logits_soft_cap.map(|c| match c {
            ejc_ir::spec::SoftCap::Fixed(x) => x,
            ejc_ir::spec::SoftCap::Runtime => rt.softcap,
        }),
        sinks: f.sinks,
        bias: f.bias,
        mask: f.mask,
        segment_ids: f.segment_ids,
        varlen: f.varlen,
        dropout: f.dropout,
    };
    let ids: Vec<String> = configs.iter().map(config_id).collect();
    let key = flash_cache_key(&p.spec.op, p.spec.version, COMPILER_VERSION, &v.name, &ids, &p.shape, p.dtype, &call);
    let dir = req.cache_dir.clone().unwrap_or_else(PersistentCache::default_dir);
    let mut cache = PersistentCache::open(&dir, &cpu_fingerprint());
    for w in cache.warnings() {
        eprintln!("warning: {w}");
    }
    if req.force {
        let _ = cache.clear(Some(&key.to_string()));
    }
    let path = cache.path().to_path_buf();
    let persistent = cache.is_persistent();
    let mut chain = Chain::new(Policy { allow_heuristics: false, ..Policy::default() }, Some(cache));
    chain.observe(Box::new(|e: &Event| {
        if let Event::Warning(w) = e {
            eprintln!("warning: {w}");
        }
    }));
    let mut tuner = FlashTuner::new(f.clone(), p.dtype, p.shape.head_dim, p.shape, rt, candidates);
    tuner.threads = req.threads;
    tuner.reps = req.reps.max(1);
    let choice = match chain.choose(&key, None, &tuner) {
        Ok(c) => c,
        Err(e) => return Outcome::Error(format!("error: {e}")),
    };
    let flops = super::bench::flops(&p, v);
    println!("call: {}", ejc_runtime::chain::Tunable::describe(&tuner));
    println!("key:  {key}");
    let entry = chain.persistent().and_then(|c| c.get(&key.to_string())).cloned();
    match (choice.source, entry) {
        (Source::Autotune, _) | (Source::Persistent, _) if chain.persistent().is_some() => {
            let entry = chain.persistent().and_then(|c| c.get(&key.to_string())).cloned();
            if let Some(entry) = entry {
                if choice.source == Source::Persistent {
                    println!("(cached: tuned before; --force tunes again)");
                }
                println!("{:<12} {:>10} {:>10}  status", "config", "median ms", "GFLOP/s");
                for t in &entry.timings {
                    match t.median_ms {
                        Some(ms) => println!(
                            "{:<12} {:>10.3} {:>10.1}  {}",
                            t.config_id,
                            ms,
                            flops / (ms * 1e-3) / 1e9,
                            t.status
                        ),
                        None => println!("{:<12} {:>10} {:>10}  {}", t.config_id, "-", "-", t.status),
                    }
                }
            }
        }
        _ => {}
    }
    println!("winner: {} ({})", config_id(&choice.config), choice.source);
    if persistent {
        println!("stored in {}", path.display());
    } else {
        println!("not stored: the cache location {} is not writable (in-memory only)", path.display());
    }
    Outcome::Ok
}
