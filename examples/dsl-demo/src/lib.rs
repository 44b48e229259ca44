//! # ejc-dsl-demo
//!
//! A user crate of ejc: two kernels (`scaled_matmul`, `softmax_rows`), two mask mods
//! (`prefix_lm`, `causal_window`) and a score mod (`alibi`) written with
//! `#[ej_kernel]` in [`kernels`]; `build.rs` compiles them (and two flash kernels with
//! the mods fused in) to a CPU library; [`library`] opens it. `tests/demo.rs` checks
//! every kernel against plain Rust.
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

/// The kernels `build.rs` compiled (opened once).
pub fn library() -> &'static DslLibrary {
    static LIB: OnceLock<DslLibrary> = OnceLock::new();
    LIB.get_or_init(|| {
        DslLibrary::open(env!("EJC_DEMO_DIR")).unwrap_or_else(|e| panic!("the build's kernels cannot be opened: {e}"))
    })
}
