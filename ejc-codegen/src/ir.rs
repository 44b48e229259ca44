//! The `ir` target: the tile IR of every kernel after the pass pipeline, as text
//! (`<out>/ir/<kernel_id>.tir`), which `ejc_ir::parse::parse_kernel` reads back.

use std::path::Path;

use ejc_ir::ir::Kernel;
use ejc_ir::print::print_kernel;

use crate::CodegenError;

/// The file of a kernel, relative to the build directory.
pub fn file_of(kernel: &Kernel) -> String {
    format!("ir/{}.tir", kernel.name)
}

/// Write one kernel; returns the path relative to `out_dir` and the text written.
pub fn write(out_dir: &Path, kernel: &Kernel) -> Result<(String, String), CodegenError> {
    let rel = file_of(kernel);
    let path = out_dir.join(&rel);
    let text = print_kernel(kernel);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|error| CodegenError::Io { path: dir.to_path_buf(), error })?;
    }
    std::fs::write(&path, &text).map_err(|error| CodegenError::Io { path, error })?;
    Ok((rel, text))
}
