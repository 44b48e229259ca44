//! The subcommands of `ejc`, one module each. Each returns an [`Outcome`]; `main`
//! turns it into the exit status.

pub mod bench;
pub mod build;
pub mod cache;
pub mod check;
pub mod common;
pub mod gpu;
pub mod list;
pub mod progress;
pub mod run;
pub mod tune;

use std::path::Path;

use ejc_ir::spec::{self, Spec};

/// How a subcommand ended.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Exit 0.
    Ok,
    /// Exit 1: the command ran, and a result was outside its tolerance.
    CheckFailed,
    /// Exit 2: bad input or an unsupported request; the message goes to stderr.
    Error(String),
    /// Exit 0 with a message on stdout: the machine cannot do it (no GPU), nothing failed.
    Skipped(String),
}

/// Load a spec, or the outcome that reports its diagnostics.
pub fn load_spec(path: &Path) -> Result<Spec, Outcome> {
    spec::load_file(path).map_err(|e| {
        let n = e.count();
        Outcome::Error(format!("{e}\n\n{n} error{} in {}", if n == 1 { "" } else { "s" }, path.display()))
    })
}
