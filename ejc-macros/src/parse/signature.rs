//! The function's parameters: tensors and scalars for kernels; the fixed index
//! parameters of mask and score mods.

use syn::{FnArg, GenericArgument, ItemFn, Pat, PathArguments, ReturnType, Type};

use super::attr::Kind;

/// Element types of the DSL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    Bf16,
    F16,
    I32,
    U32,
    Bool,
}

impl Elem {
    pub fn from_name(s: &str) -> Option<Elem> {
        Some(match s {
            "f32" => Elem::F32,
            "Bf16" => Elem::Bf16,
            "F16" => Elem::F16,
            "i32" => Elem::I32,
            "u32" => Elem::U32,
            "bool" => Elem::Bool,
            _ => return None,
        })
    }
    /// The `ejc_ir::types::DType` variant's name.
    pub fn dtype(self) -> &'static str {
        match self {
            Elem::F32 => "F32",
            Elem::Bf16 => "BF16",
            Elem::F16 => "F16",
            Elem::I32 => "I32",
            Elem::U32 => "U32",
            Elem::Bool => "I1",
        }
    }
}

#[derive(Clone, Debug)]
pub enum ParamTy {
    Tensor { elem: Elem, rank: usize },
    Scalar(Elem),
}

#[derive(Clone, Debug)]
pub struct Param {
    pub name: syn::Ident,
    pub ty: ParamTy,
}

const ALLOWED: &str = "allowed parameter types: `Tensor<T, R>` (T one of f32, Bf16, F16, i32, u32, bool; R = 1..=4), \
                       `f32`, `i32`, `u32`, `bool`";

/// A type as written (`Vec<f32>`, not quote's `Vec < f32 >`).
pub fn type_str(ty: &Type) -> String {
    quote::quote!(#ty)
        .to_string()
        .replace(" < ", "<")
        .replace("< ", "<")
        .replace(" >", ">")
        .replace(" ,", ",")
        .replace(" :: ", "::")
}

fn param_type(ty: &Type) -> syn::Result<ParamTy> {
    let err = || syn::Error::new_spanned(ty, format!("unsupported parameter type `{}`; {ALLOWED}", type_str(ty)));
    let Type::Path(p) = ty else { return Err(err()) };
    let Some(last) = p.path.segments.last() else { return Err(err()) };
    let name = last.ident.to_string();
    if name == "Tensor" {
        let PathArguments::AngleBracketed(args) = &last.arguments else { return Err(err()) };
        let a: Vec<&GenericArgument> = args.args.iter().collect();
        if a.len() != 2 {
            return Err(err());
        }
        let elem = match a[0] {
            GenericArgument::Type(Type::Path(t)) => t.path.get_ident().and_then(|i| Elem::from_name(&i.to_string())),
            _ => None,
        }
        .ok_or_else(err)?;
        let rank = match a[1] {
            GenericArgument::Const(syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(i), .. })) => {
                i.base10_parse::<usize>().ok()
            }
            GenericArgument::Type(Type::Path(t)) => t.path.get_ident().and_then(|i| i.to_string().parse().ok()),
            _ => None,
        }
        .filter(|r| (1..=4).contains(r))
        .ok_or_else(err)?;
        return Ok(ParamTy::Tensor { elem, rank });
    }
    match Elem::from_name(&name) {
        Some(e) if matches!(e, Elem::F32 | Elem::I32 | Elem::U32 | Elem::Bool) && last.arguments.is_empty() => {
            Ok(ParamTy::Scalar(e))
        }
        _ => Err(err()),
    }
}

pub fn parse(f: &ItemFn, kind: Kind) -> syn::Result<Vec<Param>> {
    let sig = &f.sig;
    if let Some(g) = sig.generics.params.first() {
        return Err(syn::Error::new_spanned(
            g,
            "a generic kernel lists its element types: `#[ej_kernel(dtypes(T = [f32, Bf16]))]` makes one kernel \
             per type (`name_f32`, `name_bf16`); compile-time integers are `#[ej_kernel(name = 64)]`",
        ));
    }
    if let Some(a) = &sig.asyncness {
        return Err(syn::Error::new_spanned(a, "a kernel cannot be `async`"));
    }
    if let Some(u) = &sig.unsafety {
        return Err(syn::Error::new_spanned(u, "a kernel cannot be `unsafe`"));
    }
    let mut params = Vec::new();
    for input in &sig.inputs {
        let FnArg::Typed(pt) = input else {
            return Err(syn::Error::new_spanned(input, "a kernel is a free function (no `self`)"));
        };
        let Pat::Ident(id) = &*pt.pat else {
            return Err(syn::Error::new_spanned(&pt.pat, "parameters are plain names"));
        };
        let ty = param_type(&pt.ty)?;
        params.push(Param { name: id.ident.clone(), ty });
    }
    match kind {
        // Helpers have their own signature rules (generate::helper).
        Kind::Helper => {}
        Kind::Kernel => {
            if let ReturnType::Type(_, t) = &sig.output {
                return Err(syn::Error::new_spanned(t, "a kernel returns nothing: it writes its outputs with `store`"));
            }
        }
        Kind::MaskMod | Kind::ScoreMod => {
            let (n, what, ret) = if kind == Kind::MaskMod {
                (4, "fn(b: i32, h: i32, q_idx: i32, kv_idx: i32) -> bool", "bool")
            } else {
                (5, "fn(score: f32, b: i32, h: i32, q_idx: i32, kv_idx: i32) -> f32", "f32")
            };
            let ok_ret = matches!(&sig.output, ReturnType::Type(_, t) if quote::quote!(#t).to_string() == ret);
            let ok_params = params.len() >= n
                && params[..n].iter().enumerate().all(|(i, p)| {
                    let want = if kind == Kind::ScoreMod && i == 0 { Elem::F32 } else { Elem::I32 };
                    matches!(p.ty, ParamTy::Scalar(e) if e == want)
                });
            if !ok_ret || !ok_params {
                return Err(syn::Error::new_spanned(
                    &f.sig,
                    format!(
                        "a {} has the signature `{what}`, optionally followed by the tensors it reads \
                         (`doc: Tensor<i32, 1>`)",
                        if kind == Kind::MaskMod { "mask mod" } else { "score mod" }
                    ),
                ));
            }
            // The tensors a mod reads: host-representable elements (the mod is also a
            // plain Rust function over `TensorView`s).
            for (p, input) in params[n..].iter().zip(sig.inputs.iter().skip(n)) {
                match p.ty {
                    ParamTy::Tensor { elem: Elem::F32 | Elem::I32 | Elem::U32 | Elem::Bool, .. } => {}
                    ParamTy::Tensor { .. } => {
                        return Err(syn::Error::new_spanned(
                            input,
                            "a mod's tensor holds f32, i32, u32 or bool (the mod also runs on the host, which has \
                             no bf16/f16 arithmetic)",
                        ))
                    }
                    ParamTy::Scalar(_) => {
                        return Err(syn::Error::new_spanned(
                            input,
                            "after its indices a mod takes only tensors (`doc: Tensor<i32, 1>`); a constant is an \
                             attribute argument (`#[ej_kernel(mask_mod, prefix = 16)]`)",
                        ))
                    }
                }
            }
        }
    }
    Ok(params)
}
