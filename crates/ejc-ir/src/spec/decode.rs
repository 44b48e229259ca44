//! (being written)
use super::{Spec, SpecError};
/// Load and validate a spec file.
pub fn load_file(path: impl AsRef<std::path::Path>) -> Result<Spec, SpecError> { let _ = path; unimplemented!() }
/// Load and validate spec text; `file` names it in diagnostics.
pub fn load_str(file: &str, text: &str) -> Result<Spec, SpecError> { let _ = (file, text); unimplemented!() }
