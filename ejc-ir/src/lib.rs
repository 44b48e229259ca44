//! # ejc-ir
//!
//! The tile IR of ejc and everything that works on it without a back end: types and
//! ops, the builder, the verifier, the text printer and parser, the passes, the
//! interpreter, the YAML spec front end and the reference semantics of every
//! attention variant.
//!
//! ```no_run
//! use ejc_ir::{flash, spec, types::DType};
//! let spec = spec::load_file("specs/flash.yaml").unwrap();
//! let variant = spec.variant("causal").unwrap();
//! let schedule = spec.schedule.points()[0];
//! let kernel = flash::build_kernel(&spec, variant, DType::BF16, 128, &schedule).unwrap();
//! println!("{}", ejc_ir::print::print_kernel(&kernel));
//! ```
//!
//! This crate links no LLVM and no CUDA: the runtime and deployed programs depend on it.

pub mod builder;
pub mod cache_dir;
pub mod cpu_abi;
pub mod dsl;
pub mod flash;
pub mod infer;
pub mod interp;
pub mod ir;
pub mod manifest;
pub mod ops;
pub mod parse;
pub mod passes;
pub mod philox;
pub mod print;
pub mod spec;
pub mod tensor;
pub mod types;
pub mod verify;
