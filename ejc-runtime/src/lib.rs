//! # ejc-runtime
//!
//! What a program needs at run time, without LLVM: the artifacts `ejc build` wrote, a
//! registry of kernels, the configuration chain with its autotuner and caches, and the
//! executors (CPU; CUDA behind the `cuda` feature).
//!
//! ```no_run
//! use ejc_runtime::api::{flash_attention, FlashArgs, FlashOptions};
//! # use ejc_runtime::cpu::HostBuffer;
//! # fn demo(q: HostBuffer, k: HostBuffer, v: HostBuffer) {
//! let r = flash_attention(&FlashArgs::new(&q, &k, &v), &FlashOptions { causal: true, ..Default::default() }).unwrap();
//! # }
//! ```
//!
//! | module | what |
//! |---|---|
//! | [`manifest`] | load and verify a build's manifest |
//! | [`registry`] | kernels by operation, platform, back end and priority |
//! | [`key`] | cache keys: device fingerprint, `op@version`, call hash, candidate checksum, compiler |
//! | [`chain`] | override → overlay → memory → persistent → autotune → heuristics → error |
//! | [`cache`] | the persistent tuning cache (one file per machine) |
//! | [`tune`] | the autotuner for flash attention on the CPU |
//! | [`api`] | `flash_attention(q, k, v, &opts)` |
//! | [`cuda`] (feature `cuda`) | the CUDA executor: PTX through the driver, launches with the manifest's ABI, event timing |
//! | [`dsl`] | kernels a crate compiled from `#[ej_kernel]` functions in its `build.rs` |
//! | [`cpu`], [`flash`] | the CPU executor, flash call binding (its C entry point is the `ejc-runtime-capi` crate) |

pub mod api;
pub mod cache;
pub mod chain;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dsl;
pub mod flash;
pub mod key;
pub mod manifest;
pub mod registry;
pub mod tune;

pub use api::{flash_attention, FlashArgs, FlashOptions, FlashResult};
