//! # ejc
//!
//! The `ejc` package: the command line (`src/main.rs`, with its subcommands in
//! [`cli`]) and a facade over the workspace's crates:
//!
//! | re-export | crate | what |
//! |---|---|---|
//! | [`ir`] | `ejc-ir` | tile IR, passes, interpreter, spec front end, reference |
//! | [`codegen`] | `ejc-codegen` | back ends and the artifact/manifest writer |
//! | [`runtime`] | `ejc-runtime` | manifests, registry, selection, executors |
//!
//! ```no_run
//! let spec = ejc::ir::spec::load_file("specs/flash.yaml").unwrap();
//! println!("{} kernels", ejc::ir::op::instances(&spec).len());
//! ```

pub use ejc_codegen as codegen;
pub use ejc_ir as ir;
pub use ejc_runtime as runtime;

pub mod cli;
