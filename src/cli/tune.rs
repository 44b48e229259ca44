//! `ejc tune SPEC --variant V --size ... [--backend cpu|cuda]`: autotune one call and
//! store the winner (with every timing) in this machine's tuning cache.
//!
//! The candidates are the spec's for the call's instance — every plan, every
//! configuration — compiled here into a temporary build for this CPU or for the GPU at
//! hand; the call then goes through `ejc_runtime::api::Runtime::call` with autotuning,
//! exactly as a program's call would, so the cache key is the one the runtime builds
//! for the same call on a build of the same spec: a configuration tuned here serves
//! library calls later, without tuning again.

use std::path::PathBuf;

use ejc_ir::op::compare_outputs;
use ejc_ir::spec::Target;
use ejc_runtime::api::{CallOptions, PlatformChoice, Runtime, RuntimeOptions};
use ejc_runtime::cache::PersistentCache;
use ejc_runtime::call::Call;
use ejc_runtime::chain::{Policy, Source};
use ejc_runtime::registry::config_id;

use super::common::{Problem, ProblemFlags};
use super::Outcome;

pub struct Request {
    pub problem: ProblemFlags,
    pub backend: &'static str,
    pub threads: usize,
    pub cache_dir: Option<PathBuf>,
    /// Tune again even if the cache has this call.
    pub force: bool,
    /// Only the operation's deterministic plans (`CallOptions::deterministic`).
    pub deterministic: bool,
    pub reps: usize,
}

pub fn run(req: &Request) -> Outcome {
    match req.backend {
        "cpu" | "cuda" => {}
        "interp" | "mlir" => {
            return Outcome::Error(format!(
                "error: tuning runs on the cpu or cuda backend ({} is not what the runtime launches)",
                req.backend
            ))
        }
        other => return Outcome::Error(format!("error: unknown backend `{other}`")),
    }
    if let Err(e) = ejc_ir::limits::worker_threads(req.threads) {
        return Outcome::Error(format!("error: --threads: {e}"));
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
    let (target, platform) = if req.backend == "cuda" {
        if let Err(o) = super::gpu::precheck(&p, &[v]) {
            return o;
        }
        let cuda = match super::gpu::open() {
            Ok(c) => c,
            Err(o) => return o,
        };
        let arch = match super::gpu::arch_for(cuda.compute_capability()) {
            Ok(a) => a,
            Err(e) => return Outcome::Error(format!("error: {}: {e}", cuda.device_name())),
        };
        (Target::Ptx(arch.name().into()), PlatformChoice::Cuda)
    } else {
        (Target::Cpu(Some(p.isa.name().into())), PlatformChoice::Cpu)
    };
    eprintln!("building the candidates of `{}` ({} {}) ...", v.name, p.dtype, p.dims_text());
    let built = match super::gpu::build_candidates(&p, &[v], target, true) {
        Ok(b) => b,
        Err(o) => return o,
    };
    let policy = Policy { allow_heuristics: false, allow_retune: true, ..Policy::default() };
    let opts = RuntimeOptions {
        kernels: vec![built.dir.clone()],
        cache_dir: req.cache_dir.clone(),
        policy: Some(policy),
        log: false,
    };
    let mut rt = match Runtime::new(opts) {
        Ok(r) => r,
        Err(e) => return Outcome::Error(format!("error: {e}")),
    };
    let seed = rand::random::<u64>() >> 11;
    let (host, _) = match p.timing_call(v, seed) {
        Ok(c) => c,
        Err(o) => return o,
    };
    let wanted = p.op.wanted(&v.features, &host);
    let mut call = Call::from_host(&host);
    let o = CallOptions {
        platform,
        config: None,
        threads: req.threads,
        deterministic: req.deterministic,
        asynchronous: false,
    };
    // `--force`: this call's entry goes first (the key is known only once the call is
    // checked, so a first call finds it and a second one tunes).
    let mut r = match rt.call(p.op.name(), &wanted, &mut call, &o) {
        Ok(r) => r,
        Err(e) => return Outcome::Error(format!("error: {e}")),
    };
    if req.force && r.source == Source::Persistent {
        if let Some(c) = rt.chain(&r.device).persistent_mut() {
            if let Err(w) = c.clear(Some(&r.key)) {
                eprintln!("warning: --force: the cached entry stays: {w}");
            }
        }
        rt = match Runtime::new(RuntimeOptions {
            kernels: vec![built.dir.clone()],
            cache_dir: req.cache_dir.clone(),
            policy: Some(policy),
            log: false,
        }) {
            Ok(fresh) => fresh,
            Err(e) => return Outcome::Error(format!("error: {e}")),
        };
        let mut again = Call::from_host(&host);
        r = match rt.call(p.op.name(), &wanted, &mut again, &o) {
            Ok(r) => r,
            Err(e) => return Outcome::Error(format!("error: {e}")),
        };
    }
    // The winner's result on this call, against the reference.
    let want = match p.op.reference(&v.features, &host) {
        Ok(w) => w,
        Err(e) => return Outcome::Error(format!("error: reference: {e}")),
    };
    let mut got = host.clone();
    for n in p.op.outputs(&v.features) {
        if let Some(t) = call.host_tensor(n) {
            got.tensors.insert(n.to_string(), t);
        }
    }
    let errs = compare_outputs(p.op, &v.features, &got, &want);
    // The entry as this run's cache holds it (in memory too, where it could not be
    // written), and whether the file has it: looked at read-only, nothing is written here.
    let entry = rt.chain(&r.device).persistent().and_then(|c| c.get(&r.key)).cloned();
    let dir = req.cache_dir.clone().or_else(PersistentCache::default_dir);
    let disk = dir.as_ref().map(|d| PersistentCache::open_read_only(d, &r.device));
    println!("call: {} {} {} {}", p.op.name(), p.dtype, p.dims_text(), p.op.describe(&wanted));
    println!("key:  {}", r.key);
    if let Some(entry) = &entry {
        if r.source == Source::Persistent {
            println!("(cached: tuned before; --force tunes again)");
        }
        let (sizes_ok, work) = match p.timing_call(v, seed) {
            Ok((_, sizes)) => (true, p.op.work(&v.features, p.dtype, &sizes)),
            Err(_) => (false, Default::default()),
        };
        let (_, unit) = super::bench::rate(&work, 1.0);
        println!("{:<44} {:>10} {:>10}  status", "config", "median ms", unit);
        for t in &entry.timings {
            match t.median_ms {
                Some(ms) if sizes_ok => {
                    let (r, _) = super::bench::rate(&work, ms * 1e-3);
                    println!("{:<44} {:>10.3} {:>10.1}  {}", t.config_id, ms, r, t.status)
                }
                _ => println!("{:<44} {:>10} {:>10}  {}", t.config_id, "-", "-", t.status),
            }
        }
    }
    let errs_text: Vec<String> = errs.iter().map(|(n, rel, _)| format!("{n} rel_err={rel:.2e}")).collect();
    println!("winner: {} ({}) plan {}: {}", config_id(&r.config), r.source, r.plan, errs_text.join(" "));
    match &disk {
        Some(d) if d.get(&r.key).is_some() => println!("stored in {}", d.path().display()),
        Some(d) => println!(
            "not stored: the tuning cache {} could not be written (see the warning above); the result served this \
             run only",
            d.path().display()
        ),
        None => println!("not stored: no cache directory (set EJC_CACHE_DIR, or pass --cache-dir)"),
    }
    Outcome::Ok
}
