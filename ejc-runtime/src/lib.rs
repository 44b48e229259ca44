//! # ejc-runtime
//!
//! What a program needs at run time, without LLVM: the artifacts `ejc build` wrote, a
//! registry of kernels, the configuration chain with its autotuner and caches, and the
//! executors (CPU; CUDA behind the `cuda` feature).
//!
//! ```no_run
//! use ejc_runtime::flash::{flash_attention, FlashArgs, FlashOptions};
//! # use ejc_runtime::cpu::HostBuffer;
//! # fn demo(q: HostBuffer, k: HostBuffer, v: HostBuffer) {
//! let r = flash_attention(&FlashArgs::new(&q, &k, &v), &FlashOptions { causal: true, ..Default::default() }).unwrap();
//! # }
//! ```
//!
//! | module | what |
//! |---|---|
//! | [`manifest`] | load and verify a build's manifest |
//! | [`registry`] | kernels and plans by operation and instance, platform, back end and priority; a family's candidates |
//! | [`key`] | cache keys: device fingerprint, `op@version`, call hash, candidate checksum, compiler |
//! | [`chain`] | override → overlay → memory → persistent → autotune → heuristics → error |
//! | [`cache`] | the persistent tuning cache (one file per machine) |
//! | [`call`] | a call of any operation: named tensors (host or GPU) and scalars |
//! | [`exec`] | running a plan on the CPU: temporaries, bindings, grids from the manifest |
//! | [`tune`] | the autotuner, for any operation, on the CPU or a GPU |
//! | [`search`] | which candidates a tuning times: a plan's all, or a staged search where they are many |
//! | [`api`] | `Runtime::call(op, features, call, options)`: platform, instance, configuration, run |
//! | [`flash`] | `flash_attention(q, k, v, &opts)`: the flash forward's typed front door |
//! | [`cuda`] (feature `cuda`) | the CUDA executor: PTX through the driver, launches with the manifest's ABI, event timing |
//! | [`dsl`] | kernels a crate compiled from `#[ej_kernel]` functions in its `build.rs` |
//! | [`cpu`] | the CPU executor (its C entry point is the `ejc-runtime-capi` crate) |

pub mod api;
pub mod cache;
pub mod call;
pub mod chain;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dsl;
pub mod exec;
pub mod flash;
pub mod key;
pub mod manifest;
pub mod registry;
pub mod ring;
#[cfg(feature = "cuda")]
pub mod ring_cuda;
pub mod search;
pub mod tune;

pub use flash::{flash_attention, FlashArgs, FlashOptions, FlashResult};
