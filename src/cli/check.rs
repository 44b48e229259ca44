//! `ejc check SPEC`: the spec is valid and every kernel it declares builds,
//! passes the pipeline and verifies.

use std::path::Path;

use ejc_ir::op::instances;
use ejc_ir::passes::{default_pipeline, run_pipeline, PassError};

use super::{load_spec, Outcome};

pub fn run(path: &Path) -> Outcome {
    let spec = match load_spec(path) {
        Ok(s) => s,
        Err(o) => return o,
    };
    let op = spec.operation();
    let pipeline = default_pipeline();
    let all = instances(&spec);
    for inst in &all {
        // A front-end or pass failure here is a compiler bug, but it is reported
        // with the kernel's id rather than a panic.
        let built = match op.build(&spec, inst) {
            Ok(k) => run_pipeline(&k, &pipeline),
            Err(e) => {
                return Outcome::Error(format!("error: {}: kernel `{}` does not build: {e}", path.display(), inst.id))
            }
        };
        match built {
            Ok(_) => {}
            // The environment's fault, not the kernel's: say which file could not be written.
            Err(e @ PassError::Dump { .. }) => return Outcome::Error(format!("error: {e}")),
            Err(e) => {
                return Outcome::Error(format!("error: {}: kernel `{}` does not build: {e}", path.display(), inst.id))
            }
        }
    }
    let launch: Vec<&str> =
        op.axes().iter().filter(|a| a.kind == ejc_ir::op::AxisKind::Launch).map(|a| a.name).collect();
    let instances_n = spec.variants.len() * spec.dtypes.len() * spec.key_points().len();
    let keys = spec.key_terms(true);
    println!(
        "ok: {}: `{}` ({}@{}): {} variants x {} dtypes{} = {} instances; {} tile programs (all verified); targets: {}",
        ejc_ir::limits::escape_controls(&path.display().to_string()),
        spec.name,
        spec.op,
        spec.version,
        spec.variants.len(),
        spec.dtypes.len(),
        keys.iter().map(|k| format!(" x {k}")).collect::<String>(),
        instances_n,
        all.len(),
        super::list::target_summary(&spec, &launch),
    );
    Outcome::Ok
}
