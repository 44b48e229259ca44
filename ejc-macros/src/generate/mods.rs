//! Mask and score mods: the function stays (real Rust, callable on the host: it is
//! its own reference) and gains a type of the same name holding `MOD`, whose
//! `expand` builds the same computation in tile IR inside a flash kernel.
//!
//! A mask mod whose value is a conjunction of comparisons affine in `q_idx` and
//! `kv_idx` (e.g. `kv_idx <= q_idx && q_idx - kv_idx < WINDOW`) is also turned into
//! the flash kernel's analysable mask terms, so blocks it hides are skipped; any
//! other mask mod is applied per element on every block.

use std::collections::HashMap;

use proc_macro2::TokenStream;
use quote::quote;
use syn::ItemFn;

use super::body::{expr, stmts, Scope};
use crate::parse::attr::{Attr, Kind};
use crate::parse::body::{Bin, Expr_, Stmt};
use crate::parse::signature::Param;

/// `a·q + b·kv + c`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Lin {
    q: i64,
    kv: i64,
    c: i64,
}

fn lin(e: &Expr_, q: &str, kv: &str, consts: &HashMap<String, i64>) -> Option<Lin> {
    Some(match e {
        Expr_::Int(v, _) => Lin { q: 0, kv: 0, c: *v },
        Expr_::Var(id) => {
            let n = id.to_string();
            if n == q {
                Lin { q: 1, kv: 0, c: 0 }
            } else if n == kv {
                Lin { q: 0, kv: 1, c: 0 }
            } else {
                Lin { q: 0, kv: 0, c: *consts.get(&n)? }
            }
        }
        Expr_::Neg(x, _) => {
            let x = lin(x, q, kv, consts)?;
            Lin { q: -x.q, kv: -x.kv, c: -x.c }
        }
        Expr_::Bin(op, a, b, _) => {
            let (a, b) = (lin(a, q, kv, consts)?, lin(b, q, kv, consts)?);
            match op {
                Bin::Add => Lin { q: a.q + b.q, kv: a.kv + b.kv, c: a.c + b.c },
                Bin::Sub => Lin { q: a.q - b.q, kv: a.kv - b.kv, c: a.c - b.c },
                Bin::Mul if a.q == 0 && a.kv == 0 => Lin { q: a.c * b.q, kv: a.c * b.kv, c: a.c * b.c },
                Bin::Mul if b.q == 0 && b.kv == 0 => Lin { q: b.c * a.q, kv: b.c * a.kv, c: b.c * a.c },
                _ => return None,
            }
        }
        _ => return None,
    })
}

/// The mask terms `(name, x)` of one comparison, or None when it is not one the
/// flash kernel can analyse (`kv ≤ q + x`, `kv ≥ q + x`, `kv < x`, `kv ≥ x`).
fn term(e: &Expr_, q: &str, kv: &str, consts: &HashMap<String, i64>) -> Option<Vec<(&'static str, i64)>> {
    let (op, a, b) = match e {
        Expr_::Bin(op @ (Bin::Lt | Bin::Le | Bin::Gt | Bin::Ge), a, b, _) => (*op, a, b),
        Expr_::Bin(Bin::And | Bin::BitAnd, a, b, _) => {
            let mut t = term(a, q, kv, consts)?;
            t.extend(term(b, q, kv, consts)?);
            return Some(t);
        }
        Expr_::Bool(true, _) => return Some(Vec::new()),
        _ => return None,
    };
    let (l, r) = (lin(a, q, kv, consts)?, lin(b, q, kv, consts)?);
    // Normalise to A·q + B·kv + C >= 0.
    let d = Lin { q: r.q - l.q, kv: r.kv - l.kv, c: r.c - l.c };
    let n = match op {
        Bin::Le => d,
        Bin::Lt => Lin { c: d.c - 1, ..d },
        Bin::Ge => Lin { q: -d.q, kv: -d.kv, c: -d.c },
        _ => Lin { q: -d.q, kv: -d.kv, c: -d.c - 1 },
    };
    match (n.q, n.kv) {
        (1, -1) => Some(vec![("ColLeRow", n.c)]),  // kv <= q + C
        (-1, 1) => Some(vec![("ColGeRow", -n.c)]), // kv >= q - C
        (0, -1) => Some(vec![("ColLt", n.c + 1)]), // kv <= C
        (0, 1) => Some(vec![("ColGe", -n.c)]),     // kv >= -C
        _ => None,
    }
}

pub fn generate(f: &ItemFn, attr: &Attr, params: &[Param], body: &[Stmt], tail: &Expr_) -> syn::Result<TokenStream> {
    let name = &f.sig.ident;
    let name_str = name.to_string();
    let vis = &f.vis;
    let consts: HashMap<String, i64> = attr.consts.iter().map(|c| (c.name.to_string(), c.value)).collect();
    let mut scope = Scope {
        consts: consts.clone(),
        tensors: Vec::new(),
        readonly: params.iter().map(|p| p.name.to_string()).collect(),
        locals: vec![Vec::new()],
        tile_conditions: true,
        helpers: false,
    };
    let code = stmts(body, &mut scope)?;
    let value = expr(tail, &scope)?;
    let names: Vec<&syn::Ident> = params.iter().map(|p| &p.name).collect();
    let const_values = attr.consts.iter().map(|c| {
        let (n, v) = (&c.name, c.value);
        quote! { let #n: ::ejc_ir::ir::Value = __d.int(#v); }
    });
    let v = quote!(::ejc_ir::ir::Value);
    let expand_params = names.iter().map(|n| quote!(#n: #v));

    let (ty, variant, extra) = if attr.kind == Kind::MaskMod {
        // Affine analysis only on a body that is a single expression.
        let terms = if body.is_empty() {
            term(tail, &params[2].name.to_string(), &params[3].name.to_string(), &consts)
        } else {
            None
        };
        let affine = match terms {
            Some(t) => {
                let items = t.iter().map(|(k, x)| {
                    let k = syn::Ident::new(k, proc_macro2::Span::call_site());
                    quote!((::ejc_ir::ir::MaskTerm::#k, #x))
                });
                quote!(::core::option::Option::Some(&[#(#items),*]))
            }
            None => quote!(::core::option::Option::None),
        };
        (quote!(::ejc_ir::dsl::MaskMod), quote!(MaskMod), quote!(, affine: #affine))
    } else {
        (quote!(::ejc_ir::dsl::ScoreMod), quote!(ScoreMod), quote!())
    };

    // The function itself, constants declared inside.
    let mut func = f.clone();
    let decls = attr.consts.iter().map(|c| {
        let (n, val) = (&c.name, c.value as i32);
        quote! { const #n: i32 = #val; }
    });
    let stmts_orig = &f.block.stmts;
    func.block = syn::parse_quote!({ #(#decls)* #(#stmts_orig)* });

    Ok(quote! {
        #[allow(clippy::all)]
        #func

        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, Default)]
        #vis struct #name {}

        #[allow(clippy::all)]
        impl #name {
            /// The mod as a flash-kernel hook (`ejc_ir::flash::FlashHooks`).
            pub const MOD: #ty = ::ejc_ir::dsl::#variant { name: #name_str, expand: #name::__ejc_expand #extra };

            #[doc(hidden)]
            #[allow(unused_mut, unused_variables, non_snake_case, unused_braces)]
            pub fn __ejc_expand(__d: &mut ::ejc_ir::dsl::Dsl, #(#expand_params),*) -> #v {
                #(#const_values)*
                #code
                #value
            }
        }

        ::ejc_ir::dsl::inventory::submit! { ::ejc_ir::dsl::Registration::#variant(#name::MOD) }
    })
}
