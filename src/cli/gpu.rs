//! `ejc run|bench SPEC --backend cuda`: the PTX target compiled in this process for the
//! GPU at hand (`sm_90a` on compute capability 9.0, else the nearest lower arch), every
//! candidate written to a temporary build, and run through ejc-runtime's CUDA executor —
//! the same artifacts, plans and launch path as `ejc build --target ptx` + `ejc-gpu`
//! (which is what a GPU machine without LLVM runs instead).
//!
//! Without a CUDA driver both say so and exit 0 (`skipped: ...`), like `ejc-gpu`.

use std::path::PathBuf;
use std::sync::Arc;

use ejc_codegen::ptx::Arch;
use ejc_codegen::{build, BuildOptions};
use ejc_ir::op::{compare_outputs, config_id, tolerance, HostCall, Sizes};
use ejc_ir::spec::{Target, Variant};
use ejc_runtime::call::Call;
use ejc_runtime::cuda::{download_into, runs_on, upload_call, Cuda, CudaError, CudaPlan};
use ejc_runtime::registry::{Candidate, Platform, Query, Registry};
use serde_json::json;

use super::common::Problem;
use super::Outcome;

/// The GPU, or the outcome that says there is none.
pub fn open() -> Result<Arc<Cuda>, Outcome> {
    match Cuda::new() {
        Ok(c) => Ok(Arc::new(c)),
        Err(CudaError::NoDriver) => Err(Outcome::Skipped(
            "skipped: no CUDA driver on this machine: `--backend cuda` needs an NVIDIA GPU and its driver \
(`ejc build --target ptx` writes the kernels anywhere; docs/gpu.md)"
                .into(),
        )),
        Err(e) => Err(Outcome::Error(format!("error: {e}"))),
    }
}

/// The PTX arch to build for a GPU of compute capability `cc` (e.g. 90).
pub fn arch_for(cc: u32) -> Result<Arch, String> {
    Ok(match cc {
        90 => Arch::Sm90a,
        91.. => Arch::Sm90,
        89 => Arch::Sm89,
        86..=88 => Arch::Sm86,
        80..=85 => Arch::Sm80,
        _ => {
            return Err(format!(
                "compute capability {}.{} is older than the PTX target's oldest arch (sm_80: mma.sync, cp.async)",
                cc / 10,
                cc % 10
            ))
        }
    })
}

/// A build in a temporary directory, removed when dropped.
pub struct TempBuild {
    pub dir: PathBuf,
    pub registry: Registry,
}

impl Drop for TempBuild {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Build the candidates of `variants` of the problem's instance (at the problem's
/// explicit configuration values, every other value of the schedule) for `target`,
/// saying on stderr what it does.
pub fn build_candidates(p: &Problem, variants: &[&Variant], target: Target, quiet: bool) -> Result<TempBuild, Outcome> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("ejc-build-{}-{nanos}", std::process::id()));
    let opts = BuildOptions {
        out_dir: dir.clone(),
        targets: vec![target.clone()],
        variants: variants.iter().map(|v| v.name.clone()).collect(),
        dtypes: vec![p.dtype],
        keys: p.keys.iter().map(|(k, v)| (k.clone(), vec![*v])).collect(),
        axes: p.config.iter().map(|(k, v)| (k.clone(), vec![*v])).collect(),
        plans: p.plan.iter().cloned().collect(),
        ..BuildOptions::default()
    };
    if !quiet {
        eprintln!("compiling the candidates for {target} ...");
    }
    let started = std::time::Instant::now();
    let cleanup = || {
        let _ = std::fs::remove_dir_all(&dir);
    };
    let mut bar = super::progress::BuildProgress::bars_only();
    if let Err(e) = build(&p.spec, &opts, &mut |e| bar.event(e)) {
        cleanup();
        return Err(Outcome::Error(format!("error: {e}")));
    }
    let mut registry = Registry::new();
    if let Err(e) = registry.load_manifest(&dir) {
        cleanup();
        return Err(Outcome::Error(format!("error: {e}")));
    }
    if !quiet {
        eprintln!(
            "  {} kernel artifact(s) in {:.1}s (the driver compiles each PTX module again when it is first loaded)",
            registry.entries().len(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(TempBuild { dir, registry })
}

/// Refuse, before looking for a GPU, what the PTX target has no candidate for (decided
/// from the kernels' IR by the PTX candidate policy: e.g. f32 products).
pub fn precheck(p: &Problem, variants: &[&Variant]) -> Result<(), Outcome> {
    use ejc_codegen::ptx::candidates::{candidates, Skip};
    // Before a GPU is found: the schedule of the oldest arch (the policy checks sm_80).
    let sm80 = Target::Ptx(Arch::Sm80.name().into());
    let schedule = p.schedule(&sm80);
    let spec_warps = match schedule.values("num_warps") {
        [] => &[1, 2, 4, 8][..],
        w => w,
    };
    for v in variants {
        let Some(plan) = p.plans(v).into_iter().next() else { continue };
        let config = p.plan_configs(&plan, true, &sm80).remove(0);
        for (role, k) in p.kernels(v, &plan, &config)? {
            // A role may fix its warps (split-KV's combine runs on one warp).
            let fixed = plan.roles.iter().find(|r| r.name == role.as_str()).and_then(|r| r.fixed.get("num_warps"));
            let warps = fixed.map_or(spec_warps, std::slice::from_ref);
            if let Err(skip) = candidates(&k, Arch::Sm80, warps, &[1], &[]) {
                let why = match skip {
                    Skip::F32Products => "f32 products: tensor cores take 16-bit operands (tf32 would miss f32's 1e-5 tolerance): use --dtype bf16 or f16, or --backend cpu for f32"
                        .to_string(),
                    other => other.to_string(),
                };
                return Err(Outcome::Error(format!("error: --backend cuda: `{}` has no PTX candidate: {why}", k.name)));
            }
        }
    }
    Ok(())
}

/// The GPU and the arch to build for.
fn gpu_for() -> Result<(Arc<Cuda>, Arch), Outcome> {
    let cuda = open()?;
    let arch = arch_for(cuda.compute_capability())
        .map_err(|e| Outcome::Error(format!("error: {}: {e}", cuda.device_name())))?;
    Ok((cuda, arch))
}

/// The candidates of a variant in a build, on this GPU.
fn candidates<'r>(b: &'r TempBuild, p: &Problem, v: &Variant, cc: u32) -> Vec<Candidate<'r>> {
    let q = Query::new(p.op.name()).platform(Platform::Cuda).variant(&v.name).dtype(p.dtype).keys(&p.keys);
    b.registry
        .families(&q)
        .map(|fams| {
            fams.into_iter()
                .filter(|f| runs_on(&f.backend, cc))
                .flat_map(|f| f.candidates())
                .filter(|c| p.config.iter().all(|(k, v)| c.config.get(k).is_none_or(|x| x == v)))
                .collect()
        })
        .unwrap_or_default()
}

/// Why a build has no candidate for the problem (the PTX target's notes).
fn none_built(p: &Problem, v: &Variant) -> Outcome {
    let why = match p.dtype {
        ejc_ir::types::DType::F32 => {
            " (f32 products: tensor cores take 16-bit operands; tf32 would miss f32's 1e-5 tolerance): use --dtype bf16 \
or f16, or --backend cpu for f32"
        }
        _ => "",
    };
    Outcome::Error(format!("error: --backend cuda: variant `{}` has no PTX candidate{why}", v.name))
}

fn label(c: &Candidate) -> String {
    let ids: Vec<&str> =
        c.launches.iter().map(|e| e.artifact_id.rsplit('/').next().unwrap_or(&e.artifact_id)).collect();
    let axes: String = c.plan.plan.axes.keys().filter_map(|a| c.config.get(a).map(|v| format!(" {a}={v}"))).collect();
    format!("{}:{}{axes}", c.plan.plan.name, ids.join("+"))
}

/// Run a candidate on a host call; its outputs and whether an aligned entry ran.
fn run_candidate(
    cuda: &Arc<Cuda>,
    p: &Problem,
    v: &Variant,
    c: &Candidate,
    host: &HostCall,
    sizes: &Sizes,
) -> Result<(HostCall, bool), String> {
    let dev = upload_call(cuda, &Call::from_host(host)).map_err(|e| e.to_string())?;
    let plan = CudaPlan::for_candidate(cuda, c, &dev, sizes).map_err(|e| e.to_string())?;
    plan.launch(cuda).map_err(|e| e.to_string())?;
    cuda.synchronize().map_err(|e| e.to_string())?;
    let mut back = Call::default();
    let outs = p.op.outputs(&v.features);
    download_into(cuda, &dev, &outs, &mut back).map_err(|e| e.to_string())?;
    let mut got = host.clone();
    for n in outs {
        if let Some(t) = back.host_tensor(n) {
            got.tensors.insert(n.to_string(), t);
        }
    }
    Ok((got, plan.aligned.iter().any(|a| *a)))
}

/// `ejc run --backend cuda`: every candidate at the problem's configuration (the
/// first value of each axis not given), against the reference.
pub fn run(p: &Problem, seed: u64, json_out: bool) -> Outcome {
    let variants = p.variants();
    if let Err(o) = precheck(p, &variants) {
        return o;
    }
    let (cuda, arch) = match gpu_for() {
        Ok(g) => g,
        Err(o) => return o,
    };
    // The first tiling unless one is given: `run` checks a configuration, `bench` times them all.
    let mut fixed = p.config.clone();
    for a in p.op.axes().iter().filter(|a| a.kind == ejc_ir::op::AxisKind::Tile) {
        if let Some(v) = p.schedule(&Target::Ptx(arch.name().into())).values(a.name).first() {
            fixed.entry(a.name.to_string()).or_insert(*v);
        }
    }
    let narrowed = Problem { config: fixed, ..clone_problem(p) };
    let built = match build_candidates(&narrowed, &variants, Target::Ptx(arch.name().into()), json_out) {
        Ok(b) => b,
        Err(o) => return o,
    };
    let tol = tolerance(p.dtype);
    if !json_out {
        println!(
            "backend=cuda device={} arch={arch} dtype={} sizes={} config={} seed={seed} tolerance={tol:e}",
            cuda.device_name(),
            p.dtype,
            p.dims_text(),
            config_id(&narrowed.config)
        );
    }
    let (mut failed, mut total) = (0, 0);
    for v in &variants {
        let (host, sizes) = match p.call(v, seed) {
            Ok(c) => c,
            Err(o) => return o,
        };
        let want = match p.op.reference(&v.features, &host) {
            Ok(r) => r,
            Err(e) => return Outcome::Error(format!("error: variant `{}`: reference: {e}", v.name)),
        };
        let cands = candidates(&built, &narrowed, v, cuda.compute_capability());
        if cands.is_empty() {
            return none_built(p, v);
        }
        for c in &cands {
            total += 1;
            let (errs, aligned, error) = match run_candidate(&cuda, p, v, c, &host, &sizes) {
                Ok((got, aligned)) => (compare_outputs(p.op, &v.features, &got, &want), aligned, None),
                Err(e) => (Vec::new(), false, Some(e)),
            };
            // NaN compares false: it never passes.
            let ok = error.is_none() && errs.iter().all(|(_, rel, _)| *rel <= tol);
            if !ok {
                failed += 1;
            }
            let (text, fields) = super::run::error_fields(&errs);
            if json_out {
                let mut row = json!({"variant": v.name, "candidate": label(c), "aligned_entry": aligned,
                       "backend": "cuda", "device": cuda.device_name(), "dtype": p.dtype.to_string(),
                       "sizes": p.dims_text(), "seed": seed, "tolerance": tol, "ok": ok, "error": error});
                if let Some(m) = row.as_object_mut() {
                    m.extend(fields);
                }
                println!("{row}");
            } else {
                let tail = error.map(|e| format!("  {e}")).unwrap_or(text);
                println!(
                    "{:<6} {:<16} {:<44} {:<8} {tail}",
                    if ok { "ok" } else { "FAIL" },
                    v.name,
                    label(c),
                    if aligned { "aligned" } else { "general" }
                );
            }
        }
    }
    if failed > 0 {
        if !json_out {
            println!("{failed} of {total} kernels outside the tolerance (seed {seed})");
        }
        return Outcome::CheckFailed;
    }
    Outcome::Ok
}

fn clone_problem(p: &Problem) -> Problem {
    Problem {
        spec: p.spec.clone(),
        op: p.op,
        dtype: p.dtype,
        dims: p.dims.clone(),
        keys: p.keys.clone(),
        variant_names: p.variant_names.clone(),
        config: p.config.clone(),
        plan: p.plan.clone(),
        scalars: p.scalars.clone(),
        isa: p.isa,
    }
}

/// `ejc bench --backend cuda`: time every candidate (every plan and configuration
/// unless flags narrow them) on the same inputs with CUDA events; report the fastest.
pub fn bench(p: &Problem, v: &Variant, warmup: usize, reps: usize, json_out: bool) -> Outcome {
    if let Err(o) = precheck(p, &[v]) {
        return o;
    }
    let (cuda, arch) = match gpu_for() {
        Ok(g) => g,
        Err(o) => return o,
    };
    let built = match build_candidates(p, &[v], Target::Ptx(arch.name().into()), json_out) {
        Ok(b) => b,
        Err(o) => return o,
    };
    let seed = rand::random::<u64>() >> 11;
    let (host, sizes) = match p.timing_call(v, seed) {
        Ok(c) => c,
        Err(o) => return o,
    };
    let work = p.op.work(&v.features, p.dtype, &sizes);
    let dev = match upload_call(&cuda, &Call::from_host(&host)) {
        Ok(d) => d,
        Err(e) => return Outcome::Error(format!("error: {e}")),
    };
    let cands = candidates(&built, p, v, cuda.compute_capability());
    if cands.is_empty() {
        return none_built(p, v);
    }
    let mut rows = Vec::new();
    for c in &cands {
        // A candidate that fails to load or launch is infinitely slow, not fatal.
        match CudaPlan::for_candidate(&cuda, c, &dev, &sizes).and_then(|plan| plan.median_ms(&cuda, warmup, reps)) {
            Ok(ms) => {
                let (r, unit) = super::bench::rate(&work, ms * 1e-3);
                if !json_out {
                    eprintln!("  {:<64} {ms:8.4} ms  {r:9.1} {unit}", label(c));
                }
                rows.push((c, ms, r));
            }
            Err(e) => {
                if !json_out {
                    eprintln!("  {:<64} failed: {e}", label(c));
                }
            }
        }
    }
    rows.sort_by(|x, y| x.1.total_cmp(&y.1));
    let Some((best, ms, r)) = rows.first() else {
        return Outcome::Error("error: no candidate ran on this GPU".into());
    };
    let (_, unit) = super::bench::rate(&work, 1.0);
    if json_out {
        let all: Vec<_> = rows
            .iter()
            .map(|(c, ms, r)| json!({"candidate": label(c), "config": c.config, "median_ms": ms, "rate": r}))
            .collect();
        println!(
            "{}",
            json!({"variant": v.name, "op": p.op.name(), "backend": "cuda", "device": cuda.device_name(), "arch": arch.name(),
                   "dtype": p.dtype.to_string(), "sizes": p.dims_text(), "candidate": label(best), "config": best.config,
                   "median_ms": ms, "rate": r, "unit": unit, "flops": work.flops, "bytes": work.bytes, "reps": reps,
                   "candidates": all})
        );
    } else {
        println!(
            "cuda {} {} sizes={} device={}: {ms:.4} ms  {r:.1} {unit}  ({}, fastest of {}, median of {reps})",
            v.name,
            p.dtype,
            p.dims_text(),
            cuda.device_name(),
            label(best),
            rows.len()
        );
    }
    Outcome::Ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_follows_the_compute_capability() {
        assert_eq!(arch_for(90), Ok(Arch::Sm90a));
        assert_eq!(arch_for(80), Ok(Arch::Sm80));
        assert_eq!(arch_for(86), Ok(Arch::Sm86));
        assert_eq!(arch_for(89), Ok(Arch::Sm89));
        assert_eq!(arch_for(100), Ok(Arch::Sm90));
        assert!(arch_for(75).unwrap_err().contains("7.5"));
    }
}
