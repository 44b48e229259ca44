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

use super::body::{expr, stmts, ModScope, Scope};
use crate::parse::attr::{Attr, Kind};
use crate::parse::body::{Bin, Expr_, Stmt};
use crate::parse::signature::{Elem, Param, ParamTy};

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

/// On the host, a tensor a mod reads is a `TensorView` (`doc[q_idx]` indexes it): the
/// function's `Tensor<T, R>` parameters become `ejc_ir::dsl::TensorView<'_, T, R>`.
pub fn host_signature(func: &mut ItemFn) {
    for input in func.sig.inputs.iter_mut() {
        let syn::FnArg::Typed(pt) = input else { continue };
        let syn::Type::Path(p) = &*pt.ty else { continue };
        let Some(last) = p.path.segments.last() else { continue };
        if last.ident != "Tensor" {
            continue;
        }
        let syn::PathArguments::AngleBracketed(args) = &last.arguments else { continue };
        if args.args.len() != 2 {
            continue;
        }
        let (t, r) = (&args.args[0], &args.args[1]);
        *pt.ty = syn::parse_quote!(::ejc_ir::dsl::TensorView<'_, #t, #r>);
    }
}

/// The operands of a conjunction (`a && b && c`), in order.
fn conjuncts<'e>(e: &'e Expr_, out: &mut Vec<&'e Expr_>) {
    match e {
        Expr_::Bin(Bin::And | Bin::BitAnd, a, b, _) => {
            conjuncts(a, out);
            conjuncts(b, out);
        }
        other => out.push(other),
    }
}

pub fn generate(f: &ItemFn, attr: &Attr, params: &[Param], body: &[Stmt], tail: &Expr_) -> syn::Result<TokenStream> {
    let name = &f.sig.ident;
    let name_str = name.to_string();
    let vis = &f.vis;
    let consts: HashMap<String, i64> = attr.consts.iter().map(|c| (c.name.to_string(), c.value)).collect();
    // The index parameters (after `score` in a score mod), then the tensors.
    let first = if attr.kind == Kind::ScoreMod { 1 } else { 0 };
    let index_names: Vec<String> = params[first..first + 4].iter().map(|p| p.name.to_string()).collect();
    let tensor_params: Vec<(&Param, Elem, usize)> = params[first + 4..]
        .iter()
        .filter_map(|p| match p.ty {
            ParamTy::Tensor { elem, rank } => Some((p, elem, rank)),
            ParamTy::Scalar(_) => None,
        })
        .collect();
    let mods = ModScope {
        b: index_names[0].clone(),
        h: index_names[1].clone(),
        q: index_names[2].clone(),
        kv: index_names[3].clone(),
        tensors: tensor_params.iter().map(|(p, _, r)| (p.name.to_string(), *r)).collect(),
        reads: Default::default(),
    };
    let mut scope = Scope {
        consts: consts.clone(),
        tensors: Vec::new(),
        readonly: params[..first + 4].iter().map(|p| p.name.to_string()).collect(),
        locals: vec![Vec::new()],
        tile_conditions: true,
        helpers: false,
        mods: Some(mods.clone()),
    };
    let code = stmts(body, &mut scope)?;
    let value = expr(tail, &scope)?;
    let v = quote!(::ejc_ir::ir::Value);
    let const_values = attr.consts.iter().map(|c| {
        let (n, v) = (&c.name, c.value);
        quote! { let #n: ::ejc_ir::ir::Value = __d.int(#v); }
    });
    let index_idents: Vec<&syn::Ident> = params[first..first + 4].iter().map(|p| &p.name).collect();
    let [ib, ih, iq, ikv] = [index_idents[0], index_idents[1], index_idents[2], index_idents[3]];
    let bind_indices = quote! {
        let #ib: #v = __ctx.b;
        let #ih: #v = __ctx.h;
        let #iq: #v = __ctx.q_idx;
        let #ikv: #v = __ctx.kv_idx;
    };
    let score_param = if attr.kind == Kind::ScoreMod {
        let s = &params[0].name;
        quote!(#s: #v,)
    } else {
        quote!()
    };

    // What every axis of every tensor is indexed by (for the runtime's shape checks).
    let reads = mods.reads.borrow();
    let tensor_items = tensor_params.iter().map(|(p, elem, rank)| {
        let n = p.name.to_string();
        let d = syn::Ident::new(elem.dtype(), proc_macro2::Span::call_site());
        let axes = (0..*rank).map(|a| {
            let mut roles: Vec<&str> = Vec::new();
            for (t, r) in reads.iter() {
                if *t == n && !roles.contains(&r[a]) {
                    roles.push(r[a]);
                }
            }
            let roles = roles.iter().map(|r| {
                let id = syn::Ident::new(
                    match *r {
                        "b" => "Batch",
                        "h" => "Head",
                        "q_idx" => "Query",
                        "kv_idx" => "Key",
                        _ => "Other",
                    },
                    proc_macro2::Span::call_site(),
                );
                quote!(::ejc_ir::dsl::ModRole::#id)
            });
            quote!(&[#(#roles),*])
        });
        quote! {
            ::ejc_ir::dsl::ModTensor { name: #n, dtype: ::ejc_ir::types::DType::#d, rank: #rank, axes: &[#(#axes),*] }
        }
    });
    let tensors = quote!(tensors: &[#(#tensor_items),*]);

    let (ty, variant, extra) = if attr.kind == Kind::MaskMod {
        // Affine analysis only on a body that is a single expression: its affine
        // conjuncts become mask terms; `exact` when they are the whole predicate.
        let (q, kv) = (params[2].name.to_string(), params[3].name.to_string());
        let (terms, exact) = if body.is_empty() {
            let mut parts = Vec::new();
            conjuncts(tail, &mut parts);
            let mut terms = Vec::new();
            let mut exact = true;
            for c in parts {
                match term(c, &q, &kv, &consts) {
                    Some(t) => terms.extend(t),
                    None => exact = false,
                }
            }
            ((!terms.is_empty() || exact).then_some(terms), exact)
        } else {
            (None, false)
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
        (quote!(::ejc_ir::dsl::MaskMod), quote!(MaskMod), quote!(, affine: #affine, exact: #exact, #tensors))
    } else {
        (quote!(::ejc_ir::dsl::ScoreMod), quote!(ScoreMod), quote!(, #tensors))
    };

    // The function itself, constants declared inside.
    let mut func = f.clone();
    let decls = attr.consts.iter().map(|c| {
        let (n, val) = (&c.name, c.value as i32);
        quote! { const #n: i32 = #val; }
    });
    let stmts_orig = &f.block.stmts;
    func.block = syn::parse_quote!({ #(#decls)* #(#stmts_orig)* });
    host_signature(&mut func);

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
            pub fn __ejc_expand(__d: &mut ::ejc_ir::dsl::Dsl, #score_param __ctx: &::ejc_ir::dsl::ModCtx) -> #v {
                #bind_indices
                #(#const_values)*
                #code
                #value
            }
        }

        ::ejc_ir::dsl::inventory::submit! { ::ejc_ir::dsl::Registration::#variant(#name::MOD) }
    })
}
