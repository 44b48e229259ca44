//! From the parsed item to the generated code: [`kernel`] for kernels, [`mods`] for
//! mask and score mods, both on top of [`body`] (DSL statements → IR-building Rust).

pub mod body;
pub mod helper;
pub mod kernel;
pub mod mods;

use proc_macro2::TokenStream;
use quote::{format_ident, quote};
use syn::ItemFn;

use crate::parse::attr::{self, Kind};
use crate::parse::{body as pbody, signature};

/// Replaces a type parameter by a concrete element type everywhere in a function.
struct Substitute<'a>(&'a syn::Ident, &'a syn::Ident);

impl syn::visit_mut::VisitMut for Substitute<'_> {
    fn visit_path_mut(&mut self, p: &mut syn::Path) {
        if p.leading_colon.is_none() && p.segments.len() == 1 && p.segments[0].ident == *self.0 {
            p.segments[0].ident = self.1.clone();
        }
        syn::visit_mut::visit_path_mut(self, p);
    }
}

/// The whole expansion of `#[ej_kernel(attr)] item`.
pub fn expand(attr: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let mut attr = attr::parse(attr)?;
    let f: ItemFn = syn::parse2(item).map_err(|e| {
        syn::Error::new(
            e.span(),
            "#[ej_kernel] goes on a function: `#[ej_kernel] fn name(x: Tensor<f32, 2>, ...) { ... }`",
        )
    })?;
    // A kernel generic over its element type: one kernel per listed type, `name_<type>`
    // (`scale_rows_bf16`), the type substituted everywhere (casts included).
    if let Some((t, tys)) = attr.dtypes.take() {
        if attr.kind != Kind::Kernel {
            return Err(syn::Error::new(
                t.span(),
                "`dtypes(...)` makes generic kernels; helpers are generic by themselves",
            ));
        }
        let params: Vec<&syn::GenericParam> = f.sig.generics.params.iter().collect();
        let ok = matches!(params.as_slice(), [syn::GenericParam::Type(p)] if p.ident == t);
        if !ok {
            return Err(syn::Error::new_spanned(
                &f.sig.generics,
                format!("`dtypes({t} = [...])` needs the kernel generic over `{t}` alone: `fn name<{t}: Elem>(...)`"),
            ));
        }
        let mut out = TokenStream::new();
        for ty in &tys {
            let mut g = f.clone();
            g.sig.generics = syn::Generics::default();
            syn::visit_mut::VisitMut::visit_item_fn_mut(&mut Substitute(&t, ty), &mut g);
            g.sig.ident = format_ident!("{}_{}", f.sig.ident, ty.to_string().to_lowercase());
            out.extend(expand_one(&attr, g)?);
        }
        return Ok(out);
    }
    expand_one(&attr, f)
}

fn expand_one(attr: &attr::Attr, f: ItemFn) -> syn::Result<TokenStream> {
    if attr.kind == Kind::Helper {
        let (stmts, tail) = pbody::block(&f.block)?;
        return helper::generate(&f, attr, &stmts, tail.as_ref());
    }
    let params = signature::parse(&f, attr.kind)?;
    for c in attr.consts.iter().map(|c| &c.name).chain(attr.tuned.iter().map(|(n, _)| n)) {
        if params.iter().any(|p| p.name == *c) {
            return Err(syn::Error::new(c.span(), format!("`{c}` is both a parameter and an #[ej_kernel] constant")));
        }
    }
    let (stmts, tail) = pbody::block(&f.block)?;
    match attr.kind {
        Kind::Kernel => {
            if let Some(t) = tail {
                return Err(syn::Error::new(
                    t.span(),
                    "a kernel returns nothing: end its body with a statement (`store(...);`)",
                ));
            }
            kernel::generate(&f, attr, &params, &stmts)
        }
        Kind::Helper => unreachable!("helpers are generated above"),
        Kind::MaskMod | Kind::ScoreMod => {
            let Some(tail) = tail else {
                let what = if attr.kind == Kind::MaskMod { "`bool` (true = attend)" } else { "the new score (`f32`)" };
                return Err(syn::Error::new(f.sig.ident.span(), format!("a mod's body ends with its value: {what}")));
            };
            mods::generate(&f, attr, &params, &stmts, &tail)
        }
    }
}

/// What to emit next to an error: for a kernel, its signature on an empty body (no
/// second round of errors from the body); for a mod, the function as written.
pub fn fallback(attr: TokenStream, item: TokenStream) -> TokenStream {
    let Ok(f) = syn::parse2::<ItemFn>(item) else { return TokenStream::new() };
    // The kind, even when the rest of the attribute is wrong (so that a mod with a bad
    // argument is not also reported as a kernel returning a value).
    let kind = attr::parse(attr.clone()).map(|a| a.kind).unwrap_or_else(|_| {
        let words: Vec<String> = attr
            .into_iter()
            .filter_map(|t| match t {
                proc_macro2::TokenTree::Ident(i) => Some(i.to_string()),
                _ => None,
            })
            .collect();
        if words.iter().any(|w| w == "mask_mod") {
            Kind::MaskMod
        } else if words.iter().any(|w| w == "score_mod") {
            Kind::ScoreMod
        } else if words.iter().any(|w| w == "helper") {
            Kind::Helper
        } else {
            Kind::Kernel
        }
    });
    if kind != Kind::Kernel {
        let mut f = f;
        if matches!(kind, Kind::MaskMod | Kind::ScoreMod) {
            mods::host_signature(&mut f);
        }
        return quote!(#[allow(unused)] #f);
    }
    let mut sig = f.sig.clone();
    sig.ident = format_ident!("__ejc_signature_{}", f.sig.ident);
    quote! {
        const _: () = {
            #[allow(unused, non_snake_case, clippy::all)]
            #sig {}
        };
    }
}
