//! Which targets this build of ejc can generate.
//!
//! `ir`, `cpu` and `ptx` exist. The others answer with a clear error naming the issue that
//! brings them, so `ejc build --target mlir:cpu` fails loudly instead of writing
//! nothing.

use ejc_ir::spec::Target;

use crate::CodegenError;

/// `Ok` when this compiler can generate `target`.
pub fn check_supported(target: &Target) -> Result<(), CodegenError> {
    let why = match target {
        Target::Ir | Target::Cpu(_) | Target::Ptx(_) => return Ok(()),
        Target::Mlir(_) => "the MLIR back end (tile IR -> upstream MLIR via melior) is issue #6",
    };
    Err(CodegenError::NotImplemented { target: target.to_string(), why: why.to_string() })
}
