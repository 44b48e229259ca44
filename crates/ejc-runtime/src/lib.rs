//! # ejc-runtime
//!
//! What a program needs at run time, without LLVM: reading the artifacts `ejc build`
//! wrote. The registry, the configuration chain, the autotuner, the caches and the
//! executors come with their issues (#5 for the chain and CPU execution, #4 for
//! CUDA); this crate holds only what exists today.
//!
//! ```no_run
//! let loaded = ejc_runtime::manifest::load("out/manifest.json").unwrap();
//! for a in &loaded.manifest.artifacts {
//!     println!("{} -> {}", a.artifact_id, loaded.path_of(a).display());
//! }
//! ```

pub mod capi;
pub mod cpu;
pub mod flash;
pub mod manifest;
