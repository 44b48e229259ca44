//! `ejc run SPEC --backend B`: run kernels on random inputs against the reference.

use std::path::PathBuf;

use ejc_ir::flash::abi::run_interp;
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::reference;
use ejc_ir::flash::{build_kernel, FlashShape};
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{Schedule, SoftCap, Window};
use ejc_ir::tensor::compare;
use ejc_ir::types::DType;
use serde_json::json;

use super::{load_spec, Outcome};

pub struct Request {
    pub spec: PathBuf,
    pub backend: &'static str,
    pub variants: Vec<String>,
    pub dtype: String,
    pub shape: String,
    pub seed: Option<u64>,
    pub block_m: Option<u32>,
    pub block_n: Option<u32>,
    pub window: Option<String>,
    pub softcap: Option<f64>,
    pub dropout: Option<f64>,
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
    match req.backend {
        "interp" => {}
        "cpu" => {
            return Outcome::Error(
                "error: backend `cpu` is not built yet: the CPU back end is issue #3 (use --backend interp)".into(),
            )
        }
        "cuda" => {
            return Outcome::Error(
                "error: backend `cuda` is not built yet: the CUDA back end is issue #4 (use --backend interp)".into(),
            )
        }
        other => {
            return Outcome::Error(format!(
                "error: backend `{other}` is not built yet: the MLIR back end is issue #6 (use --backend interp)"
            ))
        }
    }
    let spec = match load_spec(&req.spec) {
        Ok(s) => s,
        Err(o) => return o,
    };
    let dtype: DType = match req.dtype.parse() {
        Ok(d) if spec.dtypes.contains(&d) => d,
        Ok(d) => {
            return Outcome::Error(format!(
                "error: --dtype {d}: spec `{}` declares dtypes {}",
                spec.name,
                list(&spec.dtypes)
            ))
        }
        Err(e) => return Outcome::Error(format!("error: --dtype: {e}")),
    };
    let shape = match FlashShape::parse(&req.shape) {
        Ok(s) => s,
        Err(e) => return Outcome::Error(format!("error: --shape: {e}")),
    };
    if !spec.head_dims.contains(&shape.head_dim) {
        return Outcome::Error(format!(
            "error: --shape: head_dim {} is not one of spec `{}`'s head_dims ({}); head_dim is compiled into each kernel",
            shape.head_dim,
            spec.name,
            list(&spec.head_dims)
        ));
    }
    let scores = shape.batch.saturating_mul(shape.heads_q).saturating_mul(shape.seq_q).saturating_mul(shape.seq_k);
    if scores > INTERP_MAX_SCORES {
        return Outcome::Error(format!(
            "error: --shape {shape}: {scores} attention scores is too much for the interpreter (at most {INTERP_MAX_SCORES}); use a smaller shape"
        ));
    }
    let block_m = req.block_m.unwrap_or(spec.schedule.block_m[0]);
    let block_n = req.block_n.unwrap_or(spec.schedule.block_n[0]);
    if !spec.schedule.block_m.contains(&block_m) || !spec.schedule.block_n.contains(&block_n) {
        return Outcome::Error(format!(
            "error: tiling {block_m}x{block_n} is not in spec `{}`'s schedule (block_m: {}; block_n: {})",
            spec.name,
            list(&spec.schedule.block_m),
            list(&spec.schedule.block_n)
        ));
    }
    let window = match &req.window {
        None => None,
        Some(w) => match parse_window(w) {
            Ok(w) => Some(w),
            Err(e) => return Outcome::Error(format!("error: --window: {e}")),
        },
    };
    if let Some(c) = req.softcap {
        if !(c > 0.0 && c.is_finite()) {
            return Outcome::Error(format!("error: --softcap {c}: the soft cap must be a positive finite number"));
        }
    }
    if let Some(p) = req.dropout {
        if !(0.0..1.0).contains(&p) {
            return Outcome::Error(format!("error: --dropout {p}: the probability must be in [0, 1)"));
        }
    }
    let variants: Vec<_> = if req.variants.is_empty() {
        spec.variants.iter().collect()
    } else {
        let mut v = Vec::new();
        for name in &req.variants {
            match spec.variant(name) {
                Some(x) => v.push(x),
                None => {
                    let names: Vec<&str> = spec.variants.iter().map(|v| v.name.as_str()).collect();
                    return Outcome::Error(format!(
                        "error: --variant {name}: spec `{}` has variants {}",
                        spec.name,
                        names.join(", ")
                    ));
                }
            }
        }
        v
    };
    let seed = req.seed.unwrap_or_else(|| rand::random::<u64>() >> 11);
    if !req.json {
        println!(
            "backend=interp dtype={dtype} shape={shape} tiling={block_m}x{block_n} seed={seed} tolerance={:e}",
            tolerance(dtype)
        );
    }
    let schedule = Schedule { block_m, block_n, num_warps: 0, num_stages: 0 };
    let pipeline = default_pipeline();
    let mut failed = 0;
    for v in &variants {
        let f = &v.features;
        let mut rt = default_runtime(f, &shape, seed);
        if let (Some(w), Some(Window::Runtime)) = (window, f.sliding_window) {
            rt.window = w;
        }
        if let (Some(c), Some(SoftCap::Runtime)) = (req.softcap, f.logits_soft_cap) {
            rt.softcap = c;
        }
        if let Some(p) = req.dropout {
            rt.dropout_p = p;
        }
        let kernel = match build_kernel(&spec, v, dtype, shape.head_dim, &schedule)
            .map_err(|e| e.to_string())
            .and_then(|k| run_pipeline(&k, &pipeline).map_err(|e| e.to_string()))
        {
            Ok(k) => k,
            Err(e) => return Outcome::Error(format!("error: variant `{}`: {e}", v.name)),
        };
        let inputs = random_inputs(f, dtype, &shape, seed);
        let want = match reference(f, &rt, &inputs) {
            Ok(r) => r,
            Err(e) => return Outcome::Error(format!("error: variant `{}`: reference: {e}", v.name)),
        };
        let started = std::time::Instant::now();
        let got = match run_interp(&kernel, &rt, &inputs) {
            Ok(g) => g,
            Err(e) => return Outcome::Error(format!("error: variant `{}`: {e}", v.name)),
        };
        let elapsed = started.elapsed().as_secs_f64();
        let (rel, max_abs) = compare(&got.out.to_vec(), &want.out.to_vec());
        let (lse_rel, _) = compare(&got.lse.to_vec(), &want.lse.to_vec());
        let tol = tolerance(dtype);
        // NaN compares false: it never passes.
        let ok = rel <= tol && lse_rel <= tol;
        if !ok {
            failed += 1;
        }
        if req.json {
            println!(
                "{}",
                json!({"variant": v.name, "kernel": kernel.name, "backend": "interp", "dtype": dtype.to_string(),
                       "shape": shape.to_string(), "seed": seed, "rel_err": rel, "max_abs_err": max_abs,
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

fn list<T: std::fmt::Display>(xs: &[T]) -> String {
    xs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

fn parse_window(s: &str) -> Result<(i64, i64), String> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let nums: Result<Vec<i64>, _> = parts.iter().map(|p| p.parse::<i64>()).collect();
    match nums {
        Ok(n) if n.len() == 2 && n[0] >= 0 && n[1] >= 0 => Ok((n[0], n[1])),
        _ => Err(format!("`{s}` is not LEFT,RIGHT with two non-negative integers")),
    }
}
