//! `ejc check SPEC`: the spec is valid and every kernel it declares builds,
//! passes the pipeline and verifies.

use std::path::Path;

use ejc_ir::flash::instances;
use ejc_ir::passes::{default_pipeline, run_pipeline};

use super::{load_spec, Outcome};

pub fn run(path: &Path) -> Outcome {
    let spec = match load_spec(path) {
        Ok(s) => s,
        Err(o) => return o,
    };
    let pipeline = default_pipeline();
    let all = instances(&spec);
    for inst in &all {
        // A front-end or pass failure here is a compiler bug, but it is reported
        // with the kernel's id rather than a panic.
        let built = inst
            .build(&spec)
            .map_err(|e| e.to_string())
            .and_then(|k| run_pipeline(&k, &pipeline).map_err(|e| e.to_string()));
        if let Err(e) = built {
            return Outcome::Error(format!("error: {}: kernel `{}` does not build: {e}", path.display(), inst.id));
        }
    }
    let tilings = spec.schedule.tilings().len();
    let points = spec.schedule.points().len();
    let kernels = spec.variants.len() * spec.dtypes.len() * spec.head_dims.len();
    let targets: Vec<String> = spec.targets.iter().map(|t| t.to_string()).collect();
    println!(
        "ok: {}: `{}` ({}@{}): {} variants x {} dtypes x {} head dims = {} kernels; x {} tilings = {} tile programs \
         (all verified); {} schedule points each = {} candidates; targets: {}",
        path.display(),
        spec.name,
        spec.op,
        spec.version,
        spec.variants.len(),
        spec.dtypes.len(),
        spec.head_dims.len(),
        kernels,
        tilings,
        all.len(),
        points,
        kernels * points,
        targets.join(", ")
    );
    Outcome::Ok
}
