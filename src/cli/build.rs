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
    pub head_dims: Vec<usize>,
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
            match t.parse::<Target>() {
                Ok(t) => targets.push(t),
                Err(e) => return Outcome::Error(format!("error: --target: {e}")),
            }
        }
    }
    let mut dtypes = Vec::new();
    for d in &req.dtypes {
        match d.parse::<DType>() {
            Ok(d) => dtypes.push(d),
            Err(e) => return Outcome::Error(format!("error: --dtype: {e}")),
        }
    }
    let opts = BuildOptions {
        out_dir: req.out.clone(),
        targets,
        variants: req.variants.clone(),
        dtypes,
        head_dims: req.head_dims.clone(),
    };
    let quiet = req.quiet;
    let started = std::time::Instant::now();
    let mut on_progress = |p: Progress| {
        if quiet {
            return;
        }
        match p {
            Progress::Start { kernels, targets } => eprintln!("building {kernels} kernels for {targets} target(s)"),
            Progress::Kernel { done, total, .. } if done > 0 && done % 100 == 0 => eprintln!("  {done}/{total}"),
            _ => {}
        }
    };
    match build(&spec, &opts, &mut on_progress) {
        Ok(report) => {
            if !quiet {
                let targets: Vec<String> = opts.targets.iter().map(|t| t.to_string()).collect();
                println!(
                    "wrote {} artifacts ({} kernels x targets {}) and {} in {:.2}s",
                    report.manifest.artifacts.len(),
                    report.kernels,
                    targets.join(", "),
                    report.manifest_path.display(),
                    started.elapsed().as_secs_f64()
                );
            }
            Outcome::Ok
        }
        Err(e) => Outcome::Error(format!("error: {e}")),
    }
}
