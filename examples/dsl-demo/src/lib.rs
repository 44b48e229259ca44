//! # ejc-dsl-demo
//!
//! A user crate of ejc: kernels (`scaled_matmul`, `accumulate`; `matmul`, `softmax` and
//! `rms_norm`, generic over their element type and tuned: `matmul_bf16`, `matmul_f16`,
//! `softmax_f32`, `softmax_bf16`, `rms_norm_f32`, `rms_norm_bf16`),
//! two mask mods (`prefix_lm`, `causal_window`) and a score mod (`alibi`) written with
//! `#[ej_kernel]` in [`kernels`]; `build.rs` compiles them (and two flash kernels with
//! the mods fused in) to a CPU library and the kernels to PTX (`sm_80`, `sm_90a`);
//! [`library`] opens the build. `tests/demo.rs` checks every kernel against plain Rust
//! on the CPU, `tests/gpu.rs` (feature `cuda`) on a GPU.
//!
//! ```no_run
//! use ejc_dsl_demo::{kernels::scaled_matmul, library};
//! use ejc_runtime::cpu::HostBuffer;
//! # fn demo(a: HostBuffer, b: HostBuffer, mut out: HostBuffer) {
//! let k = library().kernel(scaled_matmul::NAME).unwrap();
//! let grid = [(100i64 + 31) / 32, (60 + 31) / 32, 1];
//! scaled_matmul::launch(&k, grid, 0, &a, &b, &mut out, 0.5, true).unwrap();
//! # }
//! ```

pub mod kernels;

use std::sync::OnceLock;

use ejc_runtime::dsl::DslLibrary;

/// The kernels `build.rs` compiled (opened once): the build directory, or the one
/// `EJC_DEMO_DIR` names at run time (a copy of it on another machine, e.g. a GPU host).
pub fn library() -> &'static DslLibrary {
    static LIB: OnceLock<DslLibrary> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = std::env::var("EJC_DEMO_DIR").unwrap_or_else(|_| env!("EJC_DEMO_DIR").to_string());
        DslLibrary::open(&dir).unwrap_or_else(|e| panic!("the build's kernels ({dir}) cannot be opened: {e}"))
    })
}
