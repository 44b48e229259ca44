//! `#[ej_kernel(helper)]`: a function kernels (and other helpers) call, inlined into
//! each caller's IR. The function stays, with the DSL's types (so the callers'
//! type-checked copies call it, and generic helpers are checked per use by rustc), and
//! a type of the same name gains `__ej_emit`, which the callers' IR-building code
//! calls with their `Dsl` and the arguments' values.
//!
//! Parameters: `Tile<T>`, `f32` / `i32` / `u32` / `bool`, a generic type parameter,
//! or `Tensor<T, R>` (loaded and stored through); the return: one of the value types,
//! or nothing. Generic type parameters are free (the IR's values are untyped until the
//! kernel is verified); const generics are not (use the attribute's integers).

use proc_macro2::TokenStream;
use quote::quote;
use syn::{FnArg, GenericParam, ItemFn, Pat, ReturnType, Type};

use super::body::{expr, stmts, Scope};
use super::kernel::checked_block;
use crate::parse::attr::Attr;
use crate::parse::body::{Expr_, Stmt};

fn err(span: proc_macro2::Span, msg: impl Into<String>) -> syn::Error {
    syn::Error::new(span, msg.into())
}

const ALLOWED: &str = "a helper's parameters are `Tile<T>`, `f32`, `i32`, `u32`, `bool`, a generic type parameter \
                       or `Tensor<T, R>`";

/// Whether `ty` is `Tensor<..>` (else it must be a value type).
fn is_tensor(ty: &Type, generics: &[String]) -> syn::Result<bool> {
    let bad = || err(syn::spanned::Spanned::span(ty), format!("unsupported parameter type; {ALLOWED}"));
    let Type::Path(p) = ty else { return Err(bad()) };
    let Some(last) = p.path.segments.last() else { return Err(bad()) };
    let name = last.ident.to_string();
    match name.as_str() {
        "Tensor" => Ok(true),
        "Tile" | "f32" | "i32" | "u32" | "bool" => Ok(false),
        n if generics.iter().any(|g| g == n) => Ok(false),
        _ => Err(bad()),
    }
}

pub fn generate(f: &ItemFn, attr: &Attr, body: &[Stmt], tail: Option<&Expr_>) -> syn::Result<TokenStream> {
    let sig = &f.sig;
    let name = &sig.ident;
    let mut generics = Vec::new();
    for g in &sig.generics.params {
        match g {
            GenericParam::Type(t) => generics.push(t.ident.to_string()),
            other => {
                return Err(err(
                    syn::spanned::Spanned::span(other),
                    "a helper is generic over types only (`fn h<T: Float>(x: Tile<T>)`); compile-time integers are \
                     #[ej_kernel(name = 64)] parameters",
                ))
            }
        }
    }
    let mut names = Vec::new();
    let mut values = Vec::new();
    for input in &sig.inputs {
        let FnArg::Typed(pt) = input else {
            return Err(err(syn::spanned::Spanned::span(input), "a helper is a free function (no `self`)"));
        };
        let Pat::Ident(id) = &*pt.pat else {
            return Err(err(syn::spanned::Spanned::span(&pt.pat), "parameters are plain names"));
        };
        if !is_tensor(&pt.ty, &generics)? {
            values.push(id.ident.clone());
        }
        names.push(id.ident.clone());
    }
    let returns = match &sig.output {
        ReturnType::Default => false,
        ReturnType::Type(_, t) => {
            if is_tensor(t, &generics)? {
                return Err(err(
                    syn::spanned::Spanned::span(t),
                    "a helper returns a value (a tile or a scalar), not a tensor",
                ));
            }
            true
        }
    };
    match (returns, tail) {
        (true, None) => return Err(err(name.span(), "this helper returns a value: end its body with it")),
        (false, Some(t)) => {
            return Err(err(t.span(), "this helper returns nothing: declare its return type (`-> Tile<f32>`)"))
        }
        _ => {}
    }
    let tensors: Vec<String> = names.iter().filter(|n| !values.contains(n)).map(|n| n.to_string()).collect();
    let mut scope = Scope {
        consts: attr.consts.iter().map(|c| (c.name.to_string(), c.value)).collect(),
        tensors,
        readonly: Vec::new(),
        locals: vec![values.iter().map(|v| v.to_string()).collect()],
        tile_conditions: false,
        helpers: true,
        mods: None,
    };
    let code = stmts(body, &mut scope)?;
    let value = match tail {
        Some(t) => expr(t, &scope)?,
        None => quote!(()),
    };
    let ret = if returns { quote!(::ejc_ir::ir::Value) } else { quote!(()) };
    let const_values = attr.consts.iter().map(|c| {
        let (n, v) = (&c.name, c.value);
        quote! { let #n: ::ejc_ir::ir::Value = __d.int(#v); }
    });
    // The function as written, comparisons rewritten for rustc (as in kernels' copies),
    // the attribute's integers as constants.
    let mut typed = f.clone();
    typed.attrs.retain(|a| !a.path().is_ident("ej_kernel"));
    *typed.block = checked_block(f, attr);
    let vis = &f.vis;
    let name_str = name.to_string();
    let doc = format!("What kernels calling `{name_str}` expand it into (generated by `#[ej_kernel(helper)]`).");
    Ok(quote! {
        #[allow(unused, non_snake_case, clippy::all)]
        #typed

        #[doc = #doc]
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, Default)]
        #vis struct #name {}

        #[allow(clippy::all)]
        impl #name {
            #[doc(hidden)]
            #[allow(unused_mut, unused_variables, non_snake_case, unused_braces, clippy::all)]
            pub fn __ej_emit(__d: &mut ::ejc_ir::dsl::Dsl<'_>, #(#names: ::ejc_ir::ir::Value),*) -> #ret {
                #(let mut #values = #values;)*
                #(#const_values)*
                #code
                #value
            }
        }
    })
}
