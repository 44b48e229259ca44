//! `ejc run SPEC --backend B`: run kernels on random inputs against the reference.

use ejc_ir::op::{compare_outputs, tolerance};
use serde_json::json;

use super::common::{unsupported_backend, Prepared, Problem, ProblemFlags};
use super::Outcome;

pub struct Request {
    pub problem: ProblemFlags,
    pub backend: &'static str,
    pub seed: Option<u64>,
    pub threads: usize,
    pub json: bool,
}

/// The interpreter is exact but slow: refuse problems that would take minutes.
const INTERP_MAX_FLOPS: f64 = 4.0 * (1u64 << 27) as f64 * 128.0;

/// `out rel_err=… max_abs_err=… lse_rel_err=…`: the first output's errors unprefixed,
/// the others prefixed with their name.
pub fn error_fields(errs: &[(String, f64, f64)]) -> (String, serde_json::Map<String, serde_json::Value>) {
    let mut text = Vec::new();
    let mut map = serde_json::Map::new();
    for (i, (name, rel, abs)) in errs.iter().enumerate() {
        if i == 0 {
            text.push(format!("rel_err={rel:.3e} max_abs_err={abs:.3e}"));
            map.insert("rel_err".into(), json!(rel));
            map.insert("max_abs_err".into(), json!(abs));
        } else {
            text.push(format!("{name}_rel_err={rel:.3e}"));
            map.insert(format!("{name}_rel_err"), json!(rel));
        }
    }
    (text.join(" "), map)
}

pub fn run(req: &Request) -> Outcome {
    // Refused before reading the spec.
    if let Some(o) = unsupported_backend(req.backend) {
        return o;
    }
    if let Err(e) = ejc_ir::limits::worker_threads(req.threads) {
        return Outcome::Error(format!("error: --threads: {e}"));
    }
    let p = match Problem::from_flags(&req.problem) {
        Ok(p) => p,
        Err(o) => return o,
    };
    if req.backend == "cuda" {
        let seed = req.seed.unwrap_or_else(|| rand::random::<u64>() >> 11);
        return super::gpu::run(&p, seed, req.json);
    }
    let seed = req.seed.unwrap_or_else(|| rand::random::<u64>() >> 11);
    let tol = tolerance(p.dtype);
    if req.backend == "interp" {
        // Judged from the stated sizes, before any input is made.
        for v in p.variants() {
            let w = p.op.work(&v.features, p.dtype, &p.dims);
            if w.flops > INTERP_MAX_FLOPS {
                return Outcome::Error(format!(
                    "error: sizes {}: {:.1e} FLOPs is too much for the interpreter (at most {INTERP_MAX_FLOPS:.1e}); \
use smaller sizes or --backend cpu",
                    p.dims_text(),
                    w.flops
                ));
            }
        }
    }
    let mut failed = 0;
    let mut total = 0;
    let variants = p.variants();
    let mut header = false;
    for v in &variants {
        let Some(plan) = p.plans(v).into_iter().next() else {
            return Outcome::Error(format!(
                "error: variant `{}` has no plan {} in spec `{}`",
                v.name,
                p.plan.as_deref().unwrap_or(""),
                p.spec.name
            ));
        };
        let Some(config) = p.plan_configs(&plan, true, &p.host_target(req.backend)).into_iter().next() else {
            return Outcome::Error(format!("error: plan `{}` of variant `{}` has no configuration", plan.name, v.name));
        };
        if !req.json && !header {
            header = true;
            let isa = if req.backend == "cpu" { format!(" isa={}", p.isa) } else { String::new() };
            println!(
                "backend={}{isa} dtype={} sizes={} plan={} config={} seed={seed} tolerance={tol:e}",
                req.backend,
                p.dtype,
                p.dims_text(),
                plan.name,
                ejc_ir::op::config_id(&config)
            );
        }
        let kernels = match p.kernels(v, &plan, &config) {
            Ok(k) => k,
            Err(o) => return o,
        };
        let names: Vec<String> =
            plan.launches.iter().filter_map(|l| kernels.get(&l.role).map(|k| k.name.clone())).collect();
        let exec = match Prepared::new(req.backend, kernels, p.isa, req.threads) {
            Ok(e) => e,
            Err(o) => return o,
        };
        if let (Some((secs, cached)), false) = (exec.compile_info(), req.json) {
            eprintln!(
                "  {}: compiled through MLIR in {secs:.2}s{}",
                names.join(" + "),
                if cached { " (from the on-disk cache)" } else { "" }
            );
        }
        let (call, sizes) = match p.call(v, seed) {
            Ok(c) => c,
            Err(o) => return o,
        };
        let want = match p.op.reference(&v.features, &call) {
            Ok(r) => r,
            Err(e) => return Outcome::Error(format!("error: variant `{}`: reference: {e}", v.name)),
        };
        let started = std::time::Instant::now();
        let got = match exec.run(&plan, &call, &sizes, &config) {
            Ok(g) => g,
            Err(e) => return Outcome::Error(format!("error: variant `{}`: {e}", v.name)),
        };
        let elapsed = started.elapsed().as_secs_f64();
        let errs = compare_outputs(p.op, &v.features, &got, &want);
        // NaN compares false: it never passes.
        let ok = errs.iter().all(|(_, rel, _)| *rel <= tol);
        total += 1;
        if !ok {
            failed += 1;
        }
        let (text, fields) = error_fields(&errs);
        if req.json {
            let mut row = json!({"variant": v.name, "kernel": names.join(" + "), "plan": plan.name, "backend": req.backend,
                "dtype": p.dtype.to_string(), "sizes": p.dims_text(), "config": ejc_ir::op::config_id(&config),
                "seed": seed, "tolerance": tol, "ok": ok, "seconds": elapsed});
            if let Some(m) = row.as_object_mut() {
                m.extend(fields);
            }
            println!("{row}");
        } else {
            println!("{:<6} {:<16} {text}  ({elapsed:.2}s)", if ok { "ok" } else { "FAIL" }, v.name);
        }
    }
    if failed > 0 {
        if !req.json {
            println!("{failed} of {total} kernels outside the tolerance (seed {seed})");
        }
        return Outcome::CheckFailed;
    }
    Outcome::Ok
}
