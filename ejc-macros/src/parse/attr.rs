//! `#[ej_kernel]`, `#[ej_kernel(block = 64, d = 128)]`, `#[ej_kernel(mask_mod)]`,
//! `#[ej_kernel(score_mod, slope_shift = 3)]`.

use proc_macro2::TokenStream;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, ExprUnary, Ident, Lit, Meta, Token, UnOp};

/// What the function is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Kernel,
    MaskMod,
    ScoreMod,
    /// A function kernels call (inlined into each caller's IR).
    Helper,
}

/// A compile-time integer: `block = 64` becomes `BLOCK`, usable in the body.
#[derive(Clone, Debug)]
pub struct ConstArg {
    pub name: Ident,
    pub value: i64,
}

#[derive(Clone, Debug)]
pub struct Attr {
    pub kind: Kind,
    pub consts: Vec<ConstArg>,
    /// `dtypes(T = [f32, Bf16])`: a kernel generic over `T`, one kernel per listed type.
    pub dtypes: Option<(Ident, Vec<Ident>)>,
}

/// `T = [f32, Bf16]` inside `dtypes(...)`.
struct Dtypes(Ident, Vec<Ident>);

impl Parse for Dtypes {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let t: Ident = input.parse()?;
        input.parse::<Token![=]>()?;
        let list;
        syn::bracketed!(list in input);
        let tys: Punctuated<Ident, Token![,]> = Punctuated::parse_terminated(&list)?;
        Ok(Dtypes(t, tys.into_iter().collect()))
    }
}

struct Args(Punctuated<Meta, Token![,]>);

impl Parse for Args {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        Ok(Args(Punctuated::parse_terminated(input)?))
    }
}

fn int_value(e: &Expr) -> Option<i64> {
    match e {
        Expr::Lit(ExprLit { lit: Lit::Int(i), .. }) => i.base10_parse().ok(),
        Expr::Unary(ExprUnary { op: UnOp::Neg(_), expr, .. }) => int_value(expr).map(|v| -v),
        _ => None,
    }
}

pub fn parse(attr: TokenStream) -> syn::Result<Attr> {
    let args: Args = syn::parse2(attr)?;
    let mut kind = Kind::Kernel;
    let mut consts: Vec<ConstArg> = Vec::new();
    let mut dtypes = None;
    for meta in args.0 {
        match &meta {
            Meta::List(l) if l.path.is_ident("dtypes") => {
                let Dtypes(t, tys) = syn::parse2(l.tokens.clone())
                    .map_err(|e| syn::Error::new(e.span(), "write the element types as `dtypes(T = [f32, Bf16])`"))?;
                if let Some(bad) = tys.iter().find(|t| super::signature::Elem::from_name(&t.to_string()).is_none()) {
                    return Err(syn::Error::new_spanned(
                        bad,
                        format!("`{bad}` is not an element type (f32, Bf16, F16, i32, u32, bool)"),
                    ));
                }
                if tys.is_empty() {
                    return Err(syn::Error::new_spanned(l, "list at least one element type: `dtypes(T = [f32])`"));
                }
                dtypes = Some((t, tys));
            }
            Meta::Path(p) if p.is_ident("mask_mod") => kind = Kind::MaskMod,
            Meta::Path(p) if p.is_ident("score_mod") => kind = Kind::ScoreMod,
            Meta::Path(p) if p.is_ident("kernel") => kind = Kind::Kernel,
            Meta::Path(p) if p.is_ident("helper") => kind = Kind::Helper,
            Meta::NameValue(nv) => {
                let Some(key) = nv.path.get_ident() else {
                    return Err(syn::Error::new_spanned(&nv.path, "expected a name: `#[ej_kernel(block = 64)]`"));
                };
                let Some(value) = int_value(&nv.value) else {
                    return Err(syn::Error::new_spanned(
                        &nv.value,
                        "compile-time parameters are integers: `#[ej_kernel(block = 64)]`",
                    ));
                };
                let upper = Ident::new(&key.to_string().to_uppercase(), key.span());
                if consts.iter().any(|c| c.name == upper) {
                    return Err(syn::Error::new_spanned(key, format!("`{key}` is given twice")));
                }
                consts.push(ConstArg { name: upper, value });
            }
            other => return Err(syn::Error::new_spanned(
                other,
                "unknown #[ej_kernel] argument; allowed: `kernel` (the default), `mask_mod`, `score_mod`, `helper`, \
                     `dtypes(T = [f32, Bf16])`, and integer parameters `name = 64` (read in the body as `NAME`)",
            )),
        }
    }
    Ok(Attr { kind, consts, dtypes })
}
