//! Which targets this build of ejc can generate.
//!
//! Every target the spec format names exists: `ir`, `cpu[:isa]`, `ptx:<arch>`,
//! `mlir:cpu` and `mlir:gpu`. A target added to the format before its back end answers
//! here with a clear error, so a build fails loudly instead of writing nothing.

use ejc_ir::spec::Target;

use crate::CodegenError;

/// `Ok` when this compiler can generate `target`.
pub fn check_supported(target: &Target) -> Result<(), CodegenError> {
    match target {
        Target::Ir | Target::Cpu(_) | Target::Ptx(_) => Ok(()),
        Target::Mlir(form) if form == "cpu" || form == "gpu" => Ok(()),
        Target::Mlir(form) => Err(CodegenError::NotImplemented {
            target: target.to_string(),
            why: format!("unknown MLIR form `{form}` (forms: cpu, gpu)"),
        }),
    }
}
