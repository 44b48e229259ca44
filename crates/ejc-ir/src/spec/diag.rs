//! (being written)
#[derive(Debug, Clone, PartialEq)]
pub struct Diagnostic;
#[derive(Debug, Clone, PartialEq)]
pub struct SpecError;
