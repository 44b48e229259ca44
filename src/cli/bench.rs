//! `ejc bench SPEC --backend cpu|mlir|cuda`: time a kernel on fresh random inputs.
//!
//! FLOPs are counted as in ANCHORS.md: 4·b·h·s_q·s_k·d, halved for causal variants
//! (other masks are counted as full attention). Times are medians over `--reps` runs
//! after `--warmup` runs. Without `--block-m/--block-n` every tiling of the spec is
//! timed and the fastest is reported (what the autotuner would pick).

use ejc_ir::flash::inputs::random_inputs;
use ejc_ir::spec::Variant;
use ejc_runtime::flash::FlashBuffers;
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

pub fn flops(p: &Problem, v: &Variant) -> f64 {
    let s = &p.shape;
    let f = 4.0 * (s.batch * s.heads_q) as f64 * s.seq_q as f64 * s.seq_k as f64 * s.head_dim as f64;
    if v.features.causal {
        f / 2.0
    } else {
        f
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
        return super::gpu::bench(&p, v, flops(&p, v), req.warmup, req.reps, req.json);
    }
    let tilings = match p.tiling {
        Some(t) => vec![t],
        None => p.spec.schedule.tilings(),
    };
    let threads =
        if req.threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { req.threads };
    let seed = rand::random::<u64>() >> 11;
    let inputs = random_inputs(&v.features, p.dtype, &p.shape, seed);
    let rt = p.runtime(v, seed);
    let fl = flops(&p, v);
    let mut results = Vec::new();
    for tiling in tilings {
        let kernel = match p.kernel(v, tiling) {
            Ok(k) => k,
            Err(o) => return o,
        };
        let name = kernel.name.clone();
        let prepared = match Prepared::new(req.backend, kernel, p.isa, threads) {
            Ok(e) => e,
            Err(o) => return o,
        };
        if let (Some((secs, cached)), false) = (prepared.compile_info(), req.json) {
            eprintln!(
                "  {name}: compiled through MLIR in {secs:.2}s{}",
                if cached { " (from the on-disk cache)" } else { "" }
            );
        }
        let mut call = FlashBuffers::from_inputs(&inputs);
        let mut times = Vec::with_capacity(req.reps);
        for i in 0..req.warmup + req.reps {
            let t = std::time::Instant::now();
            if let Err(e) = prepared.run_on(v, &p, &rt, &mut call) {
                return Outcome::Error(format!("error: {name}: {e}"));
            }
            if i >= req.warmup {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let median = times[times.len() / 2];
        let gflops = fl / median / 1e9;
        if !req.json && p.tiling.is_none() {
            eprintln!("  {name}: {:.3} ms  {gflops:.1} GFLOP/s", median * 1e3);
        }
        results.push((tiling, name, median, gflops));
    }
    let best = results.iter().min_by(|a, b| a.2.total_cmp(&b.2)).cloned().expect("at least one tiling");
    let (tiling, name, median, gflops) = best;
    if req.json {
        let all: Vec<_> = results
            .iter()
            .map(|(t, n, m, g)| json!({"kernel": n, "block_m": t.0, "block_n": t.1, "median_ms": m * 1e3, "gflops": g}))
            .collect();
        println!(
            "{}",
            json!({"variant": v.name, "kernel": name, "backend": req.backend, "isa": p.isa.name(), "dtype": p.dtype.to_string(),
                   "shape": p.shape.to_string(), "threads": threads, "block_m": tiling.0, "block_n": tiling.1,
                   "median_ms": median * 1e3, "gflops": gflops, "flops": fl, "reps": req.reps, "tilings": all})
        );
    } else {
        println!(
            "{} {} {} {} shape={} threads={threads} isa={}: {:.3} ms  {gflops:.1} GFLOP/s  (tiling {}x{}, median of {})",
            req.backend,
            v.name,
            p.dtype,
            name,
            p.shape,
            p.isa,
            median * 1e3,
            tiling.0,
            tiling.1,
            req.reps
        );
    }
    Outcome::Ok
}
