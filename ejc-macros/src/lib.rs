//! # ejc-macros
//!
//! `#[ej_kernel]`: kernels and attention mods written as Rust functions in ejc's tile
//! DSL (`ejc_ir::dsl`), compiled by the same pipeline as the YAML specs.
//!
//! ```ignore
//! use ejc_ir::dsl::*;
//! use ejc_macros::ej_kernel;
//!
//! #[ej_kernel(block = 64)]
//! pub fn axpy(x: Tensor<f32, 1>, y: Tensor<f32, 1>, out: Tensor<f32, 1>, alpha: f32, n: i32) {
//!     let start = program_id(0) * BLOCK;
//!     let xs = load(x, [span(start, BLOCK, n)]);
//!     let ys = load(y, [span(start, BLOCK, n)]);
//!     store(out, [span(start, BLOCK, n)], xs * alpha + ys);
//! }
//!
//! #[ej_kernel(mask_mod, prefix = 16)]
//! pub fn prefix_lm(b: i32, h: i32, q_idx: i32, kv_idx: i32) -> bool {
//!     kv_idx <= q_idx || kv_idx < PREFIX
//! }
//! ```
//!
//! A kernel becomes a type of the same name: `axpy::kernel()` builds its tile IR,
//! `axpy::launch(&cpu_kernel, grid, threads, &x, &y, &mut out, alpha, n)` runs it
//! (tensors it stores to are `&mut`), `axpy::DEF` is what the build-script helper
//! compiles, and the kernel is registered (`ejc_ir::dsl::registered()`). A mod stays
//! an ordinary function (its own reference on the host) and gains `prefix_lm::MOD`,
//! which a flash kernel takes as a hook.
//!
//! The body is checked twice: by rustc, against the DSL's types (a copy of the
//! function that is type-checked and never run), and by this macro, which rejects
//! everything outside the DSL with an error on the offending token. `docs/dsl.md`
//! lists what is supported.
//!
//! Generated code names `::ejc_ir` (and `::ejc_runtime` for kernels' `launch`): the
//! crate using the macro depends on both.

use proc_macro::TokenStream;

mod generate;
mod parse;
#[cfg(test)]
mod tests;

/// Compile a Rust function in the tile DSL into a kernel (default), a mask mod
/// (`#[ej_kernel(mask_mod)]`) or a score mod (`#[ej_kernel(score_mod)]`). Integer
/// arguments (`#[ej_kernel(block = 64)]`) are compile-time constants, read in the body
/// in upper case (`BLOCK`).
#[proc_macro_attribute]
pub fn ej_kernel(attr: TokenStream, item: TokenStream) -> TokenStream {
    let (attr, item): (proc_macro2::TokenStream, proc_macro2::TokenStream) = (attr.into(), item.into());
    match generate::expand(attr.clone(), item.clone()) {
        Ok(t) => t.into(),
        Err(e) => {
            // The error, plus what keeps the rest of the user's crate quiet: the
            // function's signature (so its imports count as used) or, for a mod, the
            // function itself (other code calls it).
            let mut out = e.to_compile_error();
            out.extend(generate::fallback(attr, item));
            out.into()
        }
    }
}
