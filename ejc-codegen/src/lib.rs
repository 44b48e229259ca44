//! # ejc-codegen
//!
//! The back ends of ejc and the artifact writer: `ejc build` expands a spec into its
//! kernels, runs the pass pipeline on each, hands the result to every requested
//! target, and records what it wrote in `manifest.json`.
//!
//! ```no_run
//! use ejc_codegen::{build, BuildOptions};
//! use ejc_ir::spec::{self, Target};
//! let spec = spec::load_file("specs/flash.yaml").unwrap();
//! let opts = BuildOptions { out_dir: "out".into(), targets: vec![Target::Ir], ..Default::default() };
//! let report = build(&spec, &opts, &mut |_| {}).unwrap();
//! println!("{} artifacts", report.manifest.artifacts.len());
//! ```
//!
//! | target | module | status |
//! |---|---|---|
//! | `ir` | [`ir`] | tile IR text after the pass pipeline |
//! | `cpu[:isa]` | [`cpu`] | one shared library per ISA |
//! | `ptx:<arch>` | [`ptx`] | one PTX file per kernel × num_warps × num_stages |
//! | `mlir:cpu`, `mlir:gpu` | [`mlir`] | verified MLIR modules; the gpu form's PTX (`mlir:gpu:sm_80`) |

pub mod arith;
pub mod build;
pub mod cache;
pub mod cpu;
pub mod ir;
pub(crate) mod llvm;
pub(crate) mod math;
pub mod mlir;
pub mod ptx;
pub mod targets;

pub use build::{build, BuildOptions, BuildReport, Progress};

use std::path::PathBuf;

/// Errors of code generation. A target that is not implemented is an error, never a
/// silent skip.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    #[error("target `{target}` is not built yet: {why}")]
    NotImplemented { target: String, why: String },
    #[error("kernel `{kernel}`: {message}")]
    Kernel { kernel: String, message: String },
    #[error("cannot write {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    /// `EJC_DUMP_IR` names a place the IR dump cannot be written to (not a kernel's fault).
    #[error("EJC_DUMP_IR: could not write the IR dump to {path}: {error}")]
    Dump { path: PathBuf, error: std::io::Error },
    #[error("nothing to build: {0}")]
    Empty(String),
    #[error("LLVM: {0}")]
    Llvm(String),
    #[error("linking failed: {0}")]
    Link(String),
    #[error(transparent)]
    Mlir(#[from] mlir::MlirError),
}

/// The compiler version recorded in manifests and cache keys.
pub const COMPILER_VERSION: &str = env!("CARGO_PKG_VERSION");
