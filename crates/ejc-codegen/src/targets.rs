//! Which targets this build of ejc can generate.
//!
//! `ir` and `cpu` exist. The others answer with a clear error naming the issue that
//! brings them, so `ejc build --target ptx:sm_90a` fails loudly instead of writing
//! nothing.

use ejc_ir::spec::Target;

use crate::CodegenError;

/// `Ok` when this compiler can generate `target`.
pub fn check_supported(target: &Target) -> Result<(), CodegenError> {
    let why = match target {
        Target::Ir | Target::Cpu(_) => return Ok(()),
        Target::Ptx(_) => "the CUDA back end (tile IR -> NVVM -> PTX) is issue #4",
        Target::Mlir(_) => "the MLIR back end (tile IR -> upstream MLIR via melior) is issue #6",
    };
    Err(CodegenError::NotImplemented { target: target.to_string(), why: why.to_string() })
}
