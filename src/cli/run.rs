//! `ejc run SPEC --backend B`: run kernels on random inputs against the reference.

use ejc_ir::flash::inputs::random_inputs;
use ejc_ir::flash::reference::reference;
use ejc_ir::tensor::compare;
use ejc_ir::types::DType;
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

/// DESIGN.md's tolerance on ||out - ref|| / ||ref||.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 5e-3,
        _ => 1e-2,
    }
}

/// The interpreter is exact but slow: refuse problems that would take minutes.
const INTERP_MAX_SCORES: usize = 1 << 27;

pub fn run(req: &Request) -> Outcome {
    // Refused before reading the spec.
    if let Some(o) = unsupported_backend(req.backend) {
        return o;
    }
    let p = match Problem::from_flags(&req.problem) {
        Ok(p) => p,
        Err(o) => return o,
    };
    if req.backend == "cuda" {
        let seed = req.seed.unwrap_or_else(|| rand::random::<u64>() >> 11);
        return super::gpu::run(&p, seed, req.json);
    }
    let s = &p.shape;
    let scores = s.batch.saturating_mul(s.heads_q).saturating_mul(s.seq_q).saturating_mul(s.seq_k);
    if req.backend == "interp" && scores > INTERP_MAX_SCORES {
        return Outcome::Error(format!(
            "error: --shape {s}: {scores} attention scores is too much for the interpreter (at most {INTERP_MAX_SCORES}); use a smaller shape or --backend cpu"
        ));
    }
    let tiling = p.tiling.unwrap_or((p.spec.schedule.block_m[0], p.spec.schedule.block_n[0]));
    let seed = req.seed.unwrap_or_else(|| rand::random::<u64>() >> 11);
    let tol = tolerance(p.dtype);
    if !req.json {
        let isa = if req.backend == "cpu" { format!(" isa={}", p.isa) } else { String::new() };
        println!(
            "backend={}{isa} dtype={} shape={s} tiling={}x{} seed={seed} tolerance={tol:e}",
            req.backend, p.dtype, tiling.0, tiling.1
        );
    }
    let mut failed = 0;
    let variants = p.variants();
    for v in &variants {
        let kernel = match p.kernel(v, tiling) {
            Ok(k) => k,
            Err(o) => return o,
        };
        let name = kernel.name.clone();
        let exec = match Prepared::new(req.backend, kernel, p.isa, req.threads) {
            Ok(e) => e,
            Err(o) => return o,
        };
        if let (Some((secs, cached)), false) = (exec.compile_info(), req.json) {
            eprintln!(
                "  {name}: compiled through MLIR in {secs:.2}s{}",
                if cached { " (from the on-disk cache)" } else { "" }
            );
        }
        let rt = p.runtime(v, seed);
        let inputs = random_inputs(&v.features, p.dtype, s, seed);
        let want = match reference(&v.features, &rt, &inputs) {
            Ok(r) => r,
            Err(e) => return Outcome::Error(format!("error: variant `{}`: reference: {e}", v.name)),
        };
        let started = std::time::Instant::now();
        let got = match exec.run(v, &p, &rt, &inputs) {
            Ok(g) => g,
            Err(e) => return Outcome::Error(format!("error: variant `{}`: {e}", v.name)),
        };
        let elapsed = started.elapsed().as_secs_f64();
        let (rel, max_abs) = compare(&got.out.to_vec(), &want.out.to_vec());
        let (lse_rel, _) = compare(&got.lse.to_vec(), &want.lse.to_vec());
        // NaN compares false: it never passes.
        let ok = rel <= tol && lse_rel <= tol;
        if !ok {
            failed += 1;
        }
        if req.json {
            println!(
                "{}",
                json!({"variant": v.name, "kernel": name, "backend": req.backend, "dtype": p.dtype.to_string(),
                       "shape": s.to_string(), "seed": seed, "rel_err": rel, "max_abs_err": max_abs,
                       "lse_rel_err": lse_rel, "tolerance": tol, "ok": ok, "seconds": elapsed})
            );
        } else {
            println!(
                "{:<6} {:<16} rel_err={rel:.3e} max_abs_err={max_abs:.3e} lse_rel_err={lse_rel:.3e}  ({elapsed:.2}s)",
                if ok { "ok" } else { "FAIL" },
                v.name
            );
        }
    }
    if failed > 0 {
        if !req.json {
            println!("{failed} of {} kernels outside the tolerance (seed {seed})", variants.len());
        }
        return Outcome::CheckFailed;
    }
    Outcome::Ok
}
