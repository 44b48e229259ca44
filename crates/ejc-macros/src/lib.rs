//! # ejc-macros
//!
//! `#[ej_kernel]`: kernels written as Rust functions in the tile DSL. Not built yet —
//! that is issue #7. Until then the attribute exists so that using it gives a clear
//! compile error at the attribute, rather than "cannot find attribute".

use proc_macro::TokenStream;

/// Not built yet (issue #7): expands to a `compile_error!` naming the issue.
#[proc_macro_attribute]
pub fn ej_kernel(_attr: TokenStream, _item: TokenStream) -> TokenStream {
    "compile_error!(\"#[ej_kernel] is not built yet: the Rust tile-DSL front end is issue #7; declare kernels in a YAML spec (docs/spec.md) for now\");"
        .parse()
        .unwrap_or_default()
}
