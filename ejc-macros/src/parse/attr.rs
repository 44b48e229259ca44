//! `#[ej_kernel]`, `#[ej_kernel(block = 64, d = 128)]`, `#[ej_kernel(mask_mod)]`,
//! `#[ej_kernel(score_mod, slope_shift = 3)]`.

use proc_macro2::TokenStream;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
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
    /// `tune(bm = [64, 128])`: constants with several values (upper-case names), each a
    /// dimension of the kernel's schedule space.
    pub tuned: Vec<(Ident, Vec<i64>)>,
    /// `tune(warps = [4, 8])` (or `warps = [4, 8]`): GPU warp counts to try.
    pub warps: Vec<u32>,
    /// `tune(stages = [2, 3])`: GPU pipeline depths to try.
    pub stages: Vec<u32>,
}

impl Attr {
    /// Every point of the schedule space (the tuned constants' values, the first value
    /// of each list first); one empty point when nothing is tuned.
    pub fn points(&self) -> Vec<Vec<(Ident, i64)>> {
        let mut points: Vec<Vec<(Ident, i64)>> = vec![Vec::new()];
        for (name, values) in &self.tuned {
            points = points
                .into_iter()
                .flat_map(|p| {
                    values.iter().map(move |v| {
                        let mut q = p.clone();
                        q.push((name.clone(), *v));
                        q
                    })
                })
                .collect();
        }
        points
    }

    /// This attribute with the point's values as fixed constants.
    pub fn at(&self, point: &[(Ident, i64)]) -> Attr {
        let mut a = self.clone();
        a.consts.extend(point.iter().map(|(n, v)| ConstArg { name: n.clone(), value: *v }));
        a.tuned.clear();
        a
    }
}

/// `bm = [64, 128]` inside `tune(...)`.
struct TuneItem(Ident, Vec<i64>, proc_macro2::Span);

impl Parse for TuneItem {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let name: Ident = input.parse()?;
        input.parse::<Token![=]>()?;
        let e: Expr = input.parse()?;
        let values = int_list(&e)?;
        Ok(TuneItem(name, values, e.span()))
    }
}

/// `[64, 128]`: a non-empty list of distinct integers.
fn int_list(e: &Expr) -> syn::Result<Vec<i64>> {
    let Expr::Array(a) = e else {
        return Err(syn::Error::new_spanned(e, "a tuned parameter lists its values: `bm = [64, 128]`"));
    };
    let mut values = Vec::new();
    for x in &a.elems {
        let Some(v) = int_value(x) else {
            return Err(syn::Error::new_spanned(x, "tuned values are integers: `bm = [64, 128]`"));
        };
        if values.contains(&v) {
            return Err(syn::Error::new_spanned(x, format!("`{v}` is listed twice")));
        }
        values.push(v);
    }
    if values.is_empty() {
        return Err(syn::Error::new_spanned(e, "list at least one value: `bm = [64]`"));
    }
    Ok(values)
}

/// Record `name = [values]` of `tune(...)` (or a top-level `warps = [...]`).
fn tune_item(attr: &mut Attr, name: &Ident, values: Vec<i64>, span: proc_macro2::Span) -> syn::Result<()> {
    let key = name.to_string();
    if key == "warps" || key == "stages" {
        let (allowed, list): (&[i64], _) =
            if key == "warps" { (&[1, 2, 4, 8], &mut attr.warps) } else { (&[1, 2, 3, 4], &mut attr.stages) };
        if let Some(bad) = values.iter().find(|v| !allowed.contains(v)) {
            return Err(syn::Error::new(span, format!("`{key}` may be {allowed:?}, not {bad}")));
        }
        if !list.is_empty() {
            return Err(syn::Error::new_spanned(name, format!("`{key}` is given twice")));
        }
        *list = values.into_iter().map(|v| v as u32).collect();
        return Ok(());
    }
    let upper = Ident::new(&key.to_uppercase(), name.span());
    if attr.tuned.iter().any(|(n, _)| *n == upper) || attr.consts.iter().any(|c| c.name == upper) {
        return Err(syn::Error::new_spanned(name, format!("`{key}` is given twice")));
    }
    attr.tuned.push((upper, values));
    Ok(())
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
    let mut tune_spans: Vec<Option<Ident>> = Vec::new();
    let mut attr =
        Attr { kind, consts: Vec::new(), dtypes: None, tuned: Vec::new(), warps: Vec::new(), stages: Vec::new() };
    for meta in args.0 {
        match &meta {
            Meta::List(l) if l.path.is_ident("tune") => {
                let items = l.parse_args_with(Punctuated::<TuneItem, Token![,]>::parse_terminated).map_err(|e| {
                    syn::Error::new(
                        e.span(),
                        format!("{e}; write the schedule space as `tune(bm = [64, 128], warps = [4, 8])`"),
                    )
                })?;
                if items.is_empty() {
                    return Err(syn::Error::new_spanned(
                        l,
                        "`tune()` lists at least one parameter: `tune(bm = [64, 128])`",
                    ));
                }
                for TuneItem(name, values, span) in items {
                    tune_item(&mut attr, &name, values, span)?;
                }
                tune_spans.push(l.path.get_ident().cloned());
            }
            Meta::NameValue(nv) if matches!(nv.value, Expr::Array(_)) => {
                let Some(key) = nv.path.get_ident() else {
                    return Err(syn::Error::new_spanned(&nv.path, "expected a name: `warps = [4, 8]`"));
                };
                if key != "warps" && key != "stages" {
                    return Err(syn::Error::new_spanned(
                        &nv.value,
                        format!("a constant with several values goes in the schedule space: `tune({key} = [...])`"),
                    ));
                }
                let values = int_list(&nv.value)?;
                tune_item(&mut attr, key, values, nv.value.span())?;
                tune_spans.push(Some(key.clone()));
            }
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
                if consts.iter().any(|c| c.name == upper) || attr.tuned.iter().any(|(n, _)| *n == upper) {
                    return Err(syn::Error::new_spanned(key, format!("`{key}` is given twice")));
                }
                consts.push(ConstArg { name: upper, value });
            }
            other => return Err(syn::Error::new_spanned(
                other,
                "unknown #[ej_kernel] argument; allowed: `kernel` (the default), `mask_mod`, `score_mod`, `helper`, \
                     `dtypes(T = [f32, Bf16])`, integer parameters `name = 64` (read in the body as `NAME`), and a \
                     schedule space `tune(bm = [64, 128], warps = [4, 8], stages = [2, 3])`",
            )),
        }
    }
    if kind != Kind::Kernel {
        if let Some(Some(at)) = tune_spans.first() {
            return Err(syn::Error::new_spanned(at, "only kernels have a schedule space (`tune`, `warps`, `stages`)"));
        }
    }
    if let Some((upper, _)) = attr.tuned.iter().find(|(n, _)| consts.iter().any(|c| c.name == *n)) {
        return Err(syn::Error::new_spanned(upper, format!("`{}` is given twice", upper.to_string().to_lowercase())));
    }
    attr.kind = kind;
    attr.consts = consts;
    attr.dtypes = dtypes;
    Ok(attr)
}
