//! # ejc-ir
//!
//! The tile IR of ejc and everything that works on it without a back end: types and
//! ops, the builder, the verifier, the text printer and parser, the passes, the
//! interpreter, the YAML spec front end, the operation seam (`op`) and the operations
//! themselves (`ops`: flash attention, mean pooling), each with its reference semantics.
//!
//! ```no_run
//! use ejc_ir::{op, spec};
//! let spec = spec::load_file("specs/flash.yaml").unwrap();
//! let kernels = op::instances(&spec); // every tile program the spec declares
//! let kernel = spec.operation().build(&spec, &kernels[0]).unwrap();
//! println!("{}", ejc_ir::print::print_kernel(&kernel));
//! ```
//!
//! This crate links no LLVM and no CUDA: the runtime and deployed programs depend on it.

pub mod builder;
pub mod cache_dir;
pub mod cpu_abi;
pub mod defuse;
pub mod dsl;
pub mod flash;
pub mod infer;
pub mod interp;
pub mod ir;
pub mod kernel_case;
pub mod limits;
pub mod manifest;
pub mod op;
pub mod ops;
pub mod parse;
pub mod passes;
pub mod philox;
pub mod print;
pub mod spec;
pub mod tensor;
pub mod types;
pub mod verify;
