//! `ejc build SPEC [-o DIR] [--target T ...]`: write artifacts and the manifest.

use std::path::PathBuf;

use ejc_codegen::targets::check_supported;
use ejc_codegen::{build, BuildOptions, Progress};
use ejc_ir::spec::Target;
use ejc_ir::types::DType;

use super::{load_spec, Outcome};

pub struct Request {
    pub spec: PathBuf,
    pub out: PathBuf,
    pub targets: Vec<String>,
    pub variants: Vec<String>,
    pub dtypes: Vec<String>,
    /// `NAME=V[,V...]` values of the operation's compile-time keys (`--head-dim N` is
    /// `head_dim=N`).
    pub keys: Vec<(String, u32)>,
    /// `NAME=V` values of schedule axes (`--block-m N` is `block_m=N`, ...).
    pub axes: Vec<(String, u32)>,
    pub plans: Vec<String>,
    pub ptx_paths: Vec<String>,
    pub report: bool,
    /// With `report`: leave spilling PTX candidates out of the build.
    pub drop_spilling: bool,
    pub quiet: bool,
}

pub fn run(req: &Request) -> Outcome {
    let spec = match load_spec(&req.spec) {
        Ok(s) => s,
        Err(o) => return o,
    };
    let mut targets = Vec::new();
    if req.targets.is_empty() {
        // Default: what the spec lists and this ejc can build; say what is left out.
        let mut skipped = Vec::new();
        for t in &spec.targets {
            match check_supported(t) {
                Ok(()) => targets.push(t.clone()),
                Err(e) => skipped.push(format!("  {e}")),
            }
        }
        if !skipped.is_empty() && !req.quiet {
            eprintln!("note: skipping targets of the spec that this ejc cannot build yet:\n{}", skipped.join("\n"));
        }
        if targets.is_empty() {
            targets.push(Target::Ir);
        }
    } else {
        for t in &req.targets {
            if t == "ptx" {
                // Both code paths: sm_80 (runs on Ampere and later) and Hopper's sm_90a.
                targets.push(Target::Ptx("sm_80".into()));
                targets.push(Target::Ptx("sm_90a".into()));
                continue;
            }
            if t == "mlir" {
                // Both forms: the CPU module and the GPU module (+ its PTX).
                targets.push(Target::Mlir("cpu".into()));
                targets.push(Target::Mlir("gpu".into()));
                continue;
            }
            match t.parse::<Target>() {
                Ok(t) => targets.push(t),
                Err(e) => {
                    return Outcome::Error(format!(
                        "error: --target: {e} (or `ptx` for sm_80 + sm_90a, `mlir` for mlir:cpu + mlir:gpu)"
                    ))
                }
            }
        }
    }
    // One artifact per target: `cpu` is the host's ISA, so `--target cpu --target
    // cpu:avx2` on an AVX2 machine names one target twice (a manifest with duplicate
    // artifact ids, which the runtime's loader rejects).
    let mut unique: Vec<Target> = Vec::new();
    for t in targets {
        let t = match t {
            Target::Cpu(None) => Target::Cpu(Some(ejc_codegen::cpu::Isa::host().name().to_string())),
            Target::Cpu(Some(isa)) => match isa.parse::<ejc_codegen::cpu::Isa>() {
                Ok(i) => Target::Cpu(Some(i.name().to_string())),
                Err(e) => return Outcome::Error(format!("error: --target cpu:{isa}: {e}")),
            },
            other => other,
        };
        if unique.contains(&t) {
            if !req.quiet {
                eprintln!("note: target {t} is named more than once; it is built once");
            }
        } else {
            unique.push(t);
        }
    }
    let targets = unique;
    let mut dtypes = Vec::new();
    for d in &req.dtypes {
        match d.parse::<DType>() {
            Ok(d) => dtypes.push(d),
            Err(e) => return Outcome::Error(format!("error: --dtype: {e}")),
        }
    }
    let mut keys: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
    for (k, v) in &req.keys {
        keys.entry(k.clone()).or_default().push(*v);
    }
    let mut axes: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
    for (k, v) in &req.axes {
        axes.entry(k.clone()).or_default().push(*v);
    }
    let opts = BuildOptions {
        out_dir: req.out.clone(),
        targets,
        variants: req.variants.clone(),
        dtypes,
        keys,
        axes,
        plans: req.plans.clone(),
        ptx_paths: req.ptx_paths.clone(),
    };
    let quiet = req.quiet;
    let started = std::time::Instant::now();
    let mut bar = super::progress::BuildProgress::new(quiet);
    let mut on_progress = |p: Progress| bar.event(p);
    match build(&spec, &opts, &mut on_progress) {
        Ok(report) => {
            if !quiet {
                let targets: Vec<String> = opts.targets.iter().map(|t| t.to_string()).collect();
                let (found, compiled) = ejc_codegen::cache::stats();
                let cache = match (found, compiled) {
                    (0, 0) => String::new(),
                    _ => format!(" ({compiled} compiled, {found} from the compiled-code cache)"),
                };
                println!(
                    "wrote {} artifacts ({} kernels x targets {}) and {} in {:.2}s{cache}",
                    report.manifest.artifacts.len(),
                    report.kernels,
                    targets.join(", "),
                    ejc_ir::limits::escape_controls(&report.manifest_path.display().to_string()),
                    started.elapsed().as_secs_f64()
                );
            }
            if req.report {
                return ptx_report(&report.manifest, &req.out, req.drop_spilling.then_some(&report.manifest_path));
            }
            Outcome::Ok
        }
        Err(e) => Outcome::Error(format!("error: {e}")),
    }
}

/// `--report`: ptxas on every PTX artifact; one line per entry point, spills flagged.
/// With `drop` (the manifest's path): candidates with a spilling entry are removed.
fn ptx_report(manifest: &ejc_ir::manifest::Manifest, dir: &std::path::Path, drop: Option<&PathBuf>) -> Outcome {
    use ejc_codegen::ptx::{find_ptxas, ptxas_entries, Arch};
    let ptx: Vec<_> = manifest
        .artifacts
        .iter()
        .filter(|a| a.target.starts_with("ptx:") || a.target.starts_with("mlir:gpu:"))
        .collect();
    if ptx.is_empty() {
        println!("--report: no PTX artifacts in this build");
        return Outcome::Ok;
    }
    let Some(tool) = find_ptxas() else {
        return Outcome::Error(
            "error: --report needs ptxas: set EJC_PTXAS, or run scripts/setup.sh (it installs one into .tools/)".into(),
        );
    };
    println!("{:<72} {:>5} {:>7} {:>7} {:>8}", "artifact", "regs", "spill_st", "spill_ld", "smem");
    let mut spilled = 0;
    let mut dropped: Vec<String> = Vec::new();
    // ptxas on every core (it is single-threaded, ~1-3 s a file); lines print in order.
    let assemble = |a: &ejc_ir::manifest::Artifact| {
        let arch: Arch = a.target.trim_start_matches("ptx:").trim_start_matches("mlir:gpu:").parse()?;
        let text = std::fs::read_to_string(dir.join(&a.file)).map_err(|e| format!("{}: {e}", a.file))?;
        ptxas_entries(&tool, &text, arch).map_err(|e| format!("{}: {e}", a.artifact_id))
    };
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(ptx.len());
    eprintln!("assembling {} PTX file(s) with ptxas on {threads} thread(s) ...", ptx.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let (tx, rx) = std::sync::mpsc::channel();
    let mut ready = std::collections::BTreeMap::new();
    let mut ordered = Vec::with_capacity(ptx.len());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let (tx, next, ptx, assemble) = (tx.clone(), &next, &ptx, &assemble);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(a) = ptx.get(i) else { break };
                if tx.send((i, assemble(a))).is_err() {
                    break;
                }
            });
        }
        std::mem::drop(tx);
        for (i, r) in rx {
            ready.insert(i, r);
            while let Some(r) = ready.remove(&ordered.len()) {
                ordered.push(r);
            }
        }
    });
    for (a, reports) in ptx.iter().zip(ordered) {
        let reports = match reports {
            Ok(r) => r,
            Err(e) => return Outcome::Error(format!("error: {e}")),
        };
        for (entry, r) in reports {
            // The aligned entry (docs/abi.md) gets its own line.
            let id = match &a.aligned {
                Some(al) if al.entry == entry => format!("{} [aligned]", a.artifact_id),
                _ => a.artifact_id.clone(),
            };
            let flag = if r.spill_stores + r.spill_loads > 0 {
                spilled += 1;
                if drop.is_some() && dropped.last() != Some(&a.artifact_id) {
                    dropped.push(a.artifact_id.clone());
                }
                "  SPILLS"
            } else {
                ""
            };
            println!(
                "{:<72} {:>5} {:>7} {:>7} {:>8}{flag}",
                id, r.registers, r.spill_stores, r.spill_loads, a.dynamic_shared_memory
            );
        }
    }
    if let Some(path) = drop {
        let mut kept = manifest.clone();
        kept.artifacts.retain(|a| !dropped.contains(&a.artifact_id));
        // A plan needs an artifact for each role it launches.
        let arts = kept.artifacts.clone();
        kept.plans
            .retain(|p| p.launches.iter().all(|l| arts.iter().any(|a| a.instance == p.instance && a.role == l.role)));
        for a in manifest.artifacts.iter().filter(|a| dropped.contains(&a.artifact_id)) {
            let f = dir.join(&a.file);
            if let Err(e) = std::fs::remove_file(&f) {
                return Outcome::Error(format!("error: {}: {e}", f.display()));
            }
        }
        if let Err(e) = std::fs::write(path, kept.to_json()) {
            return Outcome::Error(format!("error: {}: {e}", path.display()));
        }
        println!(
            "--drop-spilling: left out {} candidate(s) with a spilling entry point; {} artifacts remain in {}",
            dropped.len(),
            kept.artifacts.len(),
            path.display()
        );
        // Kernels (per target) left with no candidate at all: say so, by name.
        let stem = |id: &str| id.split('/').next().unwrap_or(id).to_string();
        let mut orphans: Vec<String> = dropped.iter().map(|d| stem(d)).collect();
        orphans.sort();
        orphans.dedup();
        orphans.retain(|k| !kept.artifacts.iter().any(|a| stem(&a.artifact_id) == *k));
        if !orphans.is_empty() {
            println!(
                "warning: every candidate of {} kernel(s) spills, so none is left for them: {}",
                orphans.len(),
                orphans.join(", ")
            );
        }
    } else if spilled > 0 {
        println!(
            "{spilled} entry point(s) spill registers: a tuned configuration must not spill (--drop-spilling leaves them out)"
        );
    }
    Outcome::Ok
}
