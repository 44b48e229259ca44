//! `ejc bench SPEC --backend cpu|mlir|cuda`: time a variant on fresh random inputs.
//!
//! Work is counted by the operation (flash: FLOPs 4·b·h·s_q·s_k·d, halved for causal, as
//! in ANCHORS.md; memory-bound operations: the bytes a kernel must move). Times are
//! medians over `--reps` runs after `--warmup` runs. Every plan and configuration of the
//! spec is timed unless flags narrow it, and the fastest is reported (what the autotuner
//! would pick).

use ejc_ir::op::{config_id, Work};
use ejc_runtime::call::Call;
use serde_json::json;

use super::common::{unsupported_backend, Prepared, Problem, ProblemFlags};
use super::Outcome;

pub struct Request {
    pub problem: ProblemFlags,
    pub backend: &'static str,
    pub threads: usize,
    pub reps: usize,
    pub warmup: usize,
    pub json: bool,
}

/// `123.4 GFLOP/s` (or GB/s for work without FLOPs) at `seconds`.
pub fn rate(w: &Work, seconds: f64) -> (f64, &'static str) {
    if w.flops > 0.0 {
        (w.flops / seconds / 1e9, "GFLOP/s")
    } else {
        (w.bytes / seconds / 1e9, "GB/s")
    }
}

pub fn run(req: &Request) -> Outcome {
    match req.backend {
        "cpu" | "mlir" | "cuda" => {}
        "interp" => return Outcome::Error(
            "error: the interpreter is a correctness reference, not a benchmark back end (use --backend cpu, mlir or cuda)"
                .into(),
        ),
        other => {
            return unsupported_backend(other).unwrap_or(Outcome::Error(format!("error: unknown backend `{other}`")))
        }
    }
    if req.reps == 0 {
        return Outcome::Error("error: --reps must be at least 1".into());
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
            "error: bench times one variant: pass --variant (spec `{}` has {})",
            p.spec.name,
            p.variant_names.join(", ")
        ));
    }
    let v = variants[0];
    if req.backend == "cuda" {
        return super::gpu::bench(&p, v, req.warmup, req.reps, req.json);
    }
    let threads =
        if req.threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { req.threads };
    let seed = rand::random::<u64>() >> 11;
    let (host, sizes) = match p.timing_call(v, seed) {
        Ok(c) => c,
        Err(o) => return o,
    };
    let work = p.op.work(&v.features, p.dtype, &sizes);
    let mut results = Vec::new();
    for plan in p.plans(v) {
        for config in p.plan_configs(&plan, false, &p.host_target(req.backend)) {
            let kernels = match p.kernels(v, &plan, &config) {
                Ok(k) => k,
                Err(o) => return o,
            };
            let name: Vec<String> =
                plan.launches.iter().filter_map(|l| kernels.get(&l.role).map(|k| k.name.clone())).collect();
            let name = name.join(" + ");
            let prepared = match Prepared::new(req.backend, kernels, p.isa, threads) {
                Ok(e) => e,
                Err(o) => return o,
            };
            if let (Some((secs, cached)), false) = (prepared.compile_info(), req.json) {
                eprintln!(
                    "  {name}: compiled through MLIR in {secs:.2}s{}",
                    if cached { " (from the on-disk cache)" } else { "" }
                );
            }
            let mut call = Call::from_host(&host);
            let mut ready = match prepared.host_plan(&plan, &call, &sizes, &config) {
                Ok(r) => r,
                Err(e) => return Outcome::Error(format!("error: {name}: {e}")),
            };
            let mut times = Vec::with_capacity(req.reps);
            for i in 0..req.warmup + req.reps {
                let t = std::time::Instant::now();
                if let Err(e) = ready.run(&mut call, threads) {
                    return Outcome::Error(format!("error: {name}: {e}"));
                }
                if i >= req.warmup {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            times.sort_by(|a, b| a.total_cmp(b));
            let median = times[times.len() / 2];
            let (r, unit) = rate(&work, median);
            if !req.json {
                eprintln!("  {name} [{}]: {:.3} ms  {r:.1} {unit}", config_id(&config), median * 1e3);
            }
            results.push((config, name, plan.name, median, r));
        }
    }
    let Some(best) = results.iter().min_by(|a, b| a.3.total_cmp(&b.3)).cloned() else {
        return Outcome::Error(format!("error: variant `{}` has no plan to time", v.name));
    };
    let (config, name, plan, median, r) = best;
    let (_, unit) = rate(&work, 1.0);
    if req.json {
        let all: Vec<_> = results
            .iter()
            .map(|(c, n, pl, m, r)| {
                let mut row = json!({"kernel": n, "plan": pl, "config": c, "median_ms": m * 1e3, "rate": r});
                for (k, v) in c {
                    row[k] = json!(v);
                }
                if work.flops > 0.0 {
                    row["gflops"] = json!(r);
                }
                row
            })
            .collect();
        let mut doc = json!({"variant": v.name, "op": p.op.name(), "kernel": name, "plan": plan, "backend": req.backend,
               "isa": p.isa.name(), "dtype": p.dtype.to_string(), "sizes": p.dims_text(), "threads": threads,
               "config": config, "median_ms": median * 1e3, "rate": r, "unit": unit, "flops": work.flops,
               "bytes": work.bytes, "reps": req.reps, "tilings": all});
        if work.flops > 0.0 {
            doc["gflops"] = json!(r);
        }
        println!("{doc}");
    } else {
        println!(
            "{} {} {} {name} sizes={} threads={threads} isa={}: {:.3} ms  {r:.1} {unit}  (plan {plan}, {}, median of {})",
            req.backend,
            v.name,
            p.dtype,
            p.dims_text(),
            p.isa,
            median * 1e3,
            config_id(&config),
            req.reps
        );
    }
    Outcome::Ok
}
