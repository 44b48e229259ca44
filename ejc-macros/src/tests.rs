//! Snapshots of what `#[ej_kernel]` generates (formatted with prettyplease), for a
//! kernel with a loop, an `if` and a store, and for a mask mod and a score mod.

use quote::quote;

use crate::generate::expand;

fn expanded(attr: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> String {
    let tokens = expand(attr, item).unwrap_or_else(|e| panic!("{e}"));
    let file: syn::File = syn::parse2(tokens).unwrap_or_else(|e| panic!("generated code does not parse: {e}"));
    prettyplease::unparse(&file)
}

macro_rules! snap {
    ($name:expr, $text:expr) => {
        insta::with_settings!({snapshot_path => concat!(env!("CARGO_MANIFEST_DIR"), "/../snapshots"), prepend_module_to_snapshot => false}, {
            insta::assert_snapshot!($name, $text);
        })
    };
}

#[test]
fn kernel_expansion() {
    let text = expanded(
        quote!(block = 64),
        quote! {
            /// `out[i] = alpha · x[i] + y[i]`, clamped at `limit` when `clamp`.
            pub fn axpy(x: Tensor<f32, 1>, y: Tensor<f32, 1>, out: Tensor<f32, 1>, alpha: f32, limit: f32, clamp: bool) {
                let n = dim(x, 0);
                let start = program_id(0) * BLOCK;
                let mut v = load(x, [span(start, BLOCK, n)]) * alpha + load(y, [span(start, BLOCK, n)]);
                if clamp {
                    v = minimum(v, full1(BLOCK, limit));
                }
                store(out, [span(start, BLOCK, n)], v);
            }
        },
    );
    snap!("ej_kernel__expansion_kernel", text);
}

#[test]
fn mod_expansion() {
    let mask = expanded(
        quote!(mask_mod, window = 128),
        quote! {
            pub fn sliding(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
                kv_idx <= q_idx && q_idx - kv_idx < WINDOW
            }
        },
    );
    let score = expanded(
        quote!(score_mod),
        quote! {
            pub fn soft_cap(score: f32, _b: i32, _h: i32, _q_idx: i32, _kv_idx: i32) -> f32 {
                30.0 * tanh(score / 30.0)
            }
        },
    );
    // A mod reading a tensor: its host function takes a `TensorView`, its expansion reads
    // the block's rows and keys (`mod_read`), and `MOD.tensors` says what indexes each axis.
    let doc = expanded(
        quote!(mask_mod),
        quote! {
            pub fn document(b: i32, _h: i32, q_idx: i32, kv_idx: i32, doc: Tensor<i32, 2>) -> bool {
                doc[[b, q_idx]] == doc[[b, kv_idx]]
            }
        },
    );
    snap!("ej_kernel__expansion_mods", format!("{mask}\n// ----\n\n{score}\n// ----\n\n{doc}"));
}

#[test]
fn errors_carry_spans_and_say_what_is_allowed() {
    let e = expand(
        quote!(),
        quote!(
            fn k(x: Tensor<f32, 1>) {
                let f = || 1;
            }
        ),
    )
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("closures are not part of the tile DSL"), "{e}");
    let e = expand(
        quote!(mask_mod),
        quote!(
            fn m(q: i32) -> bool {
                true
            }
        ),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("fn(b: i32, h: i32, q_idx: i32, kv_idx: i32) -> bool"), "{e}");
}
