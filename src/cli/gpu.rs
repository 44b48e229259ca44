//! `ejc run|bench SPEC --backend cuda`: the PTX target compiled in this process for the
//! GPU at hand (`sm_90a` on compute capability 9.0, else the nearest lower arch), every
//! candidate configuration written to a temporary build, and run through ejc-runtime's
//! CUDA executor — the same artifacts and launch path as `ejc build --target ptx` +
//! `ejc-gpu` (which is what a GPU machine without LLVM runs instead).
//!
//! Without a CUDA driver both say so and exit 0 (`skipped: ...`), like `ejc-gpu`.

use std::path::PathBuf;

use ejc_codegen::ptx::Arch;
use ejc_codegen::{build, BuildOptions};
use ejc_ir::flash::inputs::random_inputs;
use ejc_ir::flash::reference::reference;
use ejc_ir::manifest::Artifact;
use ejc_ir::spec::{Target, Variant};
use ejc_ir::tensor::compare;
use ejc_ir::types::DType;
use ejc_runtime::cuda::{entry_for, load_entry, median_ms, Cuda, CudaError, FlashDevice};
use ejc_runtime::flash::FlashBuffers;
use ejc_runtime::manifest::{load, Loaded};
use serde_json::json;

use super::common::Problem;
use super::run::tolerance;
use super::Outcome;

/// The GPU, or the outcome that says there is none.
fn open() -> Result<Cuda, Outcome> {
    match Cuda::new() {
        Ok(c) => Ok(c),
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
struct TempBuild {
    dir: PathBuf,
    loaded: Loaded,
}

impl Drop for TempBuild {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Build every candidate configuration of `variants` (at `tiling`, or every tiling of
/// the schedule) for `arch`, saying on stderr what it does.
fn build_candidates(
    p: &Problem,
    variants: &[&Variant],
    tiling: Option<(u32, u32)>,
    arch: Arch,
    quiet: bool,
) -> Result<TempBuild, Outcome> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("ejc-cuda-{}-{nanos}", std::process::id()));
    let opts = BuildOptions {
        out_dir: dir.clone(),
        targets: vec![Target::Ptx(arch.name().to_string())],
        variants: variants.iter().map(|v| v.name.clone()).collect(),
        dtypes: vec![p.dtype],
        head_dims: vec![p.shape.head_dim],
        block_m: tiling.map(|t| vec![t.0]).unwrap_or_default(),
        block_n: tiling.map(|t| vec![t.1]).unwrap_or_default(),
        ..BuildOptions::default()
    };
    if !quiet {
        eprintln!("compiling the PTX candidates for {arch} ...");
    }
    let started = std::time::Instant::now();
    let report = build(&p.spec, &opts, &mut |_| {});
    let guard_dir = dir.clone();
    let cleanup = || {
        let _ = std::fs::remove_dir_all(&guard_dir);
    };
    if let Err(e) = report {
        cleanup();
        return Err(Outcome::Error(format!("error: {e}")));
    }
    let loaded = match load(&dir) {
        Ok(l) => l,
        Err(e) => {
            cleanup();
            return Err(Outcome::Error(format!("error: {e}")));
        }
    };
    if !quiet {
        eprintln!(
            "  {} candidate(s) in {:.1}s (the driver compiles each module again when it is first loaded)",
            loaded.manifest.artifacts.len(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(TempBuild { dir, loaded })
}

/// The GPU and the arch to build for, once the problem is one the PTX target runs.
fn gpu_for(p: &Problem) -> Result<(Cuda, Arch), Outcome> {
    if p.dtype == DType::F32 {
        return Err(Outcome::Error(
            "error: --backend cuda runs bf16 and f16 kernels (tensor cores take 16-bit operands; tf32 would miss f32's \
1e-5 tolerance): use --dtype bf16 or f16, or --backend cpu for f32"
                .into(),
        ));
    }
    let cuda = open()?;
    let arch = arch_for(cuda.compute_capability())
        .map_err(|e| Outcome::Error(format!("error: {}: {e}", cuda.device_name())))?;
    Ok((cuda, arch))
}

fn artifacts_of<'a>(b: &'a TempBuild, v: &Variant) -> Vec<&'a Artifact> {
    b.loaded.manifest.artifacts.iter().filter(|a| a.variant == v.name).collect()
}

fn config_of(a: &Artifact) -> String {
    a.artifact_id.rsplit('/').next().unwrap_or(&a.artifact_id).to_string()
}

/// `ejc run --backend cuda`: every candidate configuration of the tiling, both entries
/// where the call allows the aligned one, against the reference.
pub fn run(p: &Problem, seed: u64, json_out: bool) -> Outcome {
    let (cuda, arch) = match gpu_for(p) {
        Ok(g) => g,
        Err(o) => return o,
    };
    let tiling = p.tiling.unwrap_or((p.spec.schedule.block_m[0], p.spec.schedule.block_n[0]));
    let variants = p.variants();
    let built = match build_candidates(p, &variants, Some(tiling), arch, json_out) {
        Ok(b) => b,
        Err(o) => return o,
    };
    let s = &p.shape;
    let tol = tolerance(p.dtype);
    if !json_out {
        println!(
            "backend=cuda device={} arch={arch} dtype={} shape={s} tiling={}x{} seed={seed} tolerance={tol:e}",
            cuda.device_name(),
            p.dtype,
            tiling.0,
            tiling.1
        );
    }
    let (mut failed, mut total) = (0, 0);
    for v in &variants {
        let rt = p.runtime(v, seed);
        let inputs = random_inputs(&v.features, p.dtype, s, seed);
        let want = match reference(&v.features, &rt, &inputs) {
            Ok(r) => r,
            Err(e) => return Outcome::Error(format!("error: variant `{}`: reference: {e}", v.name)),
        };
        for a in artifacts_of(&built, v) {
            let bm = a.config.get("block_m").copied().unwrap_or(64) as usize;
            let mut call = FlashBuffers::from_inputs(&inputs);
            let dev = match FlashDevice::new(&cuda, &v.features, p.dtype, a.head_dim, bm, &rt, &mut call) {
                Ok(d) => d,
                Err(e) => return Outcome::Error(format!("error: variant `{}`: {e}", v.name)),
            };
            let entry = entry_for(a, &dev);
            let result = load_entry(&cuda, &built.loaded, a, entry).and_then(|k| {
                dev.launch(&cuda, &k)?;
                cuda.synchronize()?;
                dev.read_outputs(&cuda, &mut call)
            });
            total += 1;
            let (rel, max_abs, lse_rel, error) = match result {
                Ok(()) => {
                    let got = call.outputs();
                    let (rel, max_abs) = compare(&got.out.to_vec(), &want.out.to_vec());
                    let (lse_rel, _) = compare(&got.lse.to_vec(), &want.lse.to_vec());
                    (rel, max_abs, lse_rel, None)
                }
                Err(e) => (f64::NAN, f64::NAN, f64::NAN, Some(e.to_string())),
            };
            // NaN compares false: it never passes.
            let ok = error.is_none() && rel <= tol && lse_rel <= tol;
            if !ok {
                failed += 1;
            }
            let aligned = a.aligned.as_ref().is_some_and(|al| al.entry == entry);
            if json_out {
                println!(
                    "{}",
                    json!({"variant": v.name, "artifact": a.artifact_id, "entry": entry, "aligned_entry": aligned,
                           "backend": "cuda", "device": cuda.device_name(), "dtype": p.dtype.to_string(),
                           "shape": s.to_string(), "seed": seed, "rel_err": rel, "max_abs_err": max_abs,
                           "lse_rel_err": lse_rel, "tolerance": tol, "ok": ok, "error": error})
                );
            } else {
                let tail = match &error {
                    Some(e) => format!("  {e}"),
                    None => format!("rel_err={rel:.3e} max_abs_err={max_abs:.3e} lse_rel_err={lse_rel:.3e}"),
                };
                println!(
                    "{:<6} {:<16} {:<18} {:<8} {tail}",
                    if ok { "ok" } else { "FAIL" },
                    v.name,
                    config_of(a),
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

/// `ejc bench --backend cuda`: time every candidate configuration (every tiling unless
/// one is given) on the same inputs with CUDA events; report the fastest.
pub fn bench(p: &Problem, v: &Variant, flops: f64, warmup: usize, reps: usize, json_out: bool) -> Outcome {
    let (cuda, arch) = match gpu_for(p) {
        Ok(g) => g,
        Err(o) => return o,
    };
    let built = match build_candidates(p, &[v], p.tiling, arch, json_out) {
        Ok(b) => b,
        Err(o) => return o,
    };
    let seed = rand::random::<u64>() >> 11;
    let inputs = random_inputs(&v.features, p.dtype, &p.shape, seed);
    let rt = p.runtime(v, seed);
    let mut rows = Vec::new();
    for a in artifacts_of(&built, v) {
        let bm = a.config.get("block_m").copied().unwrap_or(64) as usize;
        let mut call = FlashBuffers::from_inputs(&inputs);
        let dev = match FlashDevice::new(&cuda, &v.features, p.dtype, a.head_dim, bm, &rt, &mut call) {
            Ok(d) => d,
            Err(e) => return Outcome::Error(format!("error: {e}")),
        };
        let entry = entry_for(a, &dev);
        // A candidate that fails to load or launch is infinitely slow, not fatal.
        match load_entry(&cuda, &built.loaded, a, entry).and_then(|k| median_ms(&cuda, &dev, &k, warmup, reps)) {
            Ok(ms) => {
                let tflops = flops / (ms * 1e-3) / 1e12;
                if !json_out {
                    eprintln!("  {:<58} {ms:8.3} ms  {tflops:7.1} TFLOP/s", a.artifact_id);
                }
                rows.push((a, ms, tflops));
            }
            Err(e) => {
                if !json_out {
                    eprintln!("  {:<58} failed: {e}", a.artifact_id);
                }
            }
        }
    }
    rows.sort_by(|x, y| x.1.total_cmp(&y.1));
    let Some((best, ms, tflops)) = rows.first() else {
        return Outcome::Error("error: no candidate ran on this GPU".into());
    };
    if json_out {
        let all: Vec<_> =
            rows.iter().map(|(a, ms, tf)| json!({"artifact": a.artifact_id, "median_ms": ms, "tflops": tf})).collect();
        println!(
            "{}",
            json!({"variant": v.name, "backend": "cuda", "device": cuda.device_name(), "arch": arch.name(),
                   "dtype": p.dtype.to_string(), "shape": p.shape.to_string(), "artifact": best.artifact_id,
                   "median_ms": ms, "tflops": tflops, "flops": flops, "reps": reps, "candidates": all})
        );
    } else {
        println!(
            "cuda {} {} {} shape={} device={}: {ms:.3} ms  {tflops:.1} TFLOP/s  ({}, fastest of {}, median of {reps})",
            v.name,
            p.dtype,
            best.kernel_id,
            p.shape,
            cuda.device_name(),
            config_of(best),
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
