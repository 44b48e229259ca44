//! A kernel: `fn name(params) { body }` → `struct name {}` with `kernel()` (builds
//! the tile IR), `launch(...)` (typed, checked CPU launch), `DEF` and `NAME`, an
//! `inventory` registration, and a type-checked, never-run copy of the function.

use std::collections::HashMap;

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use syn::ItemFn;

use super::body::{stmts, Scope};
use crate::parse::attr::Attr;
use crate::parse::body::{Expr_, Stmt};
use crate::parse::signature::{Elem, Param, ParamTy};

fn dtype(e: Elem) -> TokenStream {
    let d = syn::Ident::new(e.dtype(), Span::call_site());
    quote!(::ejc_ir::types::DType::#d)
}

/// Tensors a body stores to (these take `&mut` in `launch`).
fn stored(list: &[Stmt], out: &mut Vec<String>) {
    for s in list {
        match s {
            Stmt::Expr(Expr_::Call(f, args, _)) if f == "store" => {
                if let Some(Expr_::Var(id)) = args.first() {
                    let n = id.to_string();
                    if !out.contains(&n) {
                        out.push(n);
                    }
                }
            }
            Stmt::For { body, .. } => stored(body, out),
            Stmt::If { then, els, .. } => {
                stored(then, out);
                stored(els, out);
            }
            _ => {}
        }
    }
}

/// The typecheck copy: the user's function, renamed, with the constants declared.
/// Rewrites `a < b` (and `<=`, `>`, `>=`, `==`, `!=`) in the type-checked copy into
/// `ejc_ir::dsl::Compare` calls: `bool` for scalars, `Tile<bool>` for tiles (Rust's
/// comparison traits must return `bool`, so tiles could not be compared with `<`).
struct Comparisons;

impl syn::visit_mut::VisitMut for Comparisons {
    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        syn::visit_mut::visit_expr_mut(self, e);
        if let syn::Expr::Binary(b) = e {
            let m = match b.op {
                syn::BinOp::Lt(_) => "lt",
                syn::BinOp::Le(_) => "le",
                syn::BinOp::Gt(_) => "gt",
                syn::BinOp::Ge(_) => "ge",
                syn::BinOp::Eq(_) => "eq",
                syn::BinOp::Ne(_) => "ne",
                _ => return,
            };
            let m = format_ident!("cmp_{}", m);
            let (l, r) = (&b.left, &b.right);
            *e = syn::parse_quote!(::ejc_ir::dsl::Compare::#m(#l, #r));
        }
    }
}

/// `stmts` with their comparisons rewritten as [`Comparisons`] does.
pub fn comparisons_rewritten(stmts: &[syn::Stmt]) -> Vec<syn::Stmt> {
    let mut body = stmts.to_vec();
    for s in body.iter_mut() {
        syn::visit_mut::VisitMut::visit_stmt_mut(&mut Comparisons, s);
    }
    body
}

/// `f`'s body as rustc checks it: the attribute's integers as `const`s, then the
/// statements with their comparisons rewritten (kernels' copies and helpers).
pub fn checked_block(f: &ItemFn, attr: &Attr) -> syn::Block {
    let consts = attr.consts.iter().map(|c| {
        let (n, v) = (&c.name, c.value as i32);
        quote! { const #n: i32 = #v; }
    });
    let body = comparisons_rewritten(&f.block.stmts);
    syn::parse_quote!({ #(#consts)* #(#body)* })
}

pub fn typecheck_copy(f: &ItemFn, attr: &Attr) -> TokenStream {
    let mut copy = f.clone();
    copy.sig.ident = format_ident!("__ejc_typecheck_{}", f.sig.ident);
    copy.vis = syn::Visibility::Inherited;
    copy.attrs.retain(|a| !a.path().is_ident("doc"));
    *copy.block = checked_block(f, attr);
    quote! {
        // rustc checks the body against the DSL's types (`ejc_ir::dsl`); it never runs.
        const _: () = {
            #[allow(unused, non_snake_case, clippy::all, clippy::pedantic)]
            #copy
        };
    }
}

pub fn generate(f: &ItemFn, attr: &Attr, params: &[Param], body: &[Stmt]) -> syn::Result<TokenStream> {
    let name = &f.sig.ident;
    let name_str = name.to_string();
    let vis = &f.vis;
    let docs: Vec<&syn::Attribute> = f.attrs.iter().filter(|a| a.path().is_ident("doc")).collect();

    // IR parameters, in declaration order.
    let ir_params: Vec<TokenStream> = params
        .iter()
        .map(|p| {
            let n = &p.name;
            let ns = n.to_string();
            let ty = match &p.ty {
                ParamTy::Tensor { elem, rank } => {
                    let d = dtype(*elem);
                    let r = *rank;
                    quote!(::ejc_ir::types::Type::Tensor(#d, #r))
                }
                ParamTy::Scalar(e) => {
                    let d = dtype(*e);
                    quote!(::ejc_ir::types::Type::Scalar(#d))
                }
            };
            quote! { let #n: ::ejc_ir::ir::Value = __b.param(#ns, #ty); }
        })
        .collect();

    // One IR builder per point of the schedule space (constants fold at expansion, so
    // each point is its own code); the first is the default.
    let points = attr.points();
    let tuned = !attr.tuned.is_empty();
    let attr0 = attr.at(&points[0]);
    let mut point_fns = Vec::new();
    for (i, point) in points.iter().enumerate() {
        let a = attr.at(point);
        let mut scope = Scope {
            consts: a.consts.iter().map(|c| (c.name.to_string(), c.value)).collect::<HashMap<_, _>>(),
            tensors: params
                .iter()
                .filter(|p| matches!(p.ty, ParamTy::Tensor { .. }))
                .map(|p| p.name.to_string())
                .collect(),
            readonly: params
                .iter()
                .filter(|p| matches!(p.ty, ParamTy::Scalar(_)))
                .map(|p| p.name.to_string())
                .collect(),
            locals: vec![Vec::new()],
            tile_conditions: false,
            helpers: true,
            mods: None,
        };
        let code = stmts(body, &mut scope).map_err(|e| {
            if i == 0 {
                return e;
            }
            let at: Vec<String> =
                point.iter().map(|(n, v)| format!("{} = {v}", n.to_string().to_lowercase())).collect();
            syn::Error::new(e.span(), format!("{e} (at the schedule point {})", at.join(", ")))
        })?;
        let const_values = a.consts.iter().map(|c| {
            let (n, v) = (&c.name, c.value);
            quote! { let #n: ::ejc_ir::ir::Value = __d.int(#v); }
        });
        let fname = format_ident!("__ej_point_{}", i);
        point_fns.push(quote! {
            #[allow(unused_mut, unused_variables, non_snake_case, unused_braces)]
            fn #fname() -> ::core::result::Result<::ejc_ir::ir::Kernel, ::ejc_ir::dsl::DslError> {
                let mut __b = ::ejc_ir::builder::KernelBuilder::new(#name_str);
                #(#ir_params)*
                __b.attr("frontend", "ej_kernel");
                {
                    let __d = &mut ::ejc_ir::dsl::Dsl::new(&mut __b);
                    #(#const_values)*
                    #code
                }
                __b.finish().map_err(::ejc_ir::dsl::DslError::from)
            }
        });
    }
    let def_points = if tuned {
        let ps = points.iter().enumerate().map(|(i, point)| {
            let names = point.iter().map(|(n, _)| n.to_string());
            let values = point.iter().map(|(_, v)| *v);
            let fname = format_ident!("__ej_point_{}", i);
            quote! { ::ejc_ir::dsl::TunePoint { consts: &[#((#names, #values)),*], build: #name::#fname } }
        });
        quote!(&[#(#ps),*])
    } else {
        quote!(&[])
    };
    let (warps, stages) = (&attr.warps, &attr.stages);
    let const_items = attr0.consts.iter().map(|c| {
        let (n, v) = (&c.name, c.value);
        let lower = n.to_string().to_lowercase();
        let doc = match attr.tuned.iter().find(|(t, _)| t == n) {
            Some((_, vs)) => format!("The default of `#[ej_kernel(tune({lower} = {vs:?}))]`"),
            None => format!("`#[ej_kernel({lower} = {v})]`"),
        };
        quote! { #[doc = #doc] pub const #n: i64 = #v; }
    });

    // launch(): tensors by reference (&mut when stored to), scalars by value.
    let mut written = Vec::new();
    stored(body, &mut written);
    let mut launch_params = Vec::new();
    let mut tensor_args = Vec::new();
    let mut scalar_args = Vec::new();
    let mut gpu_params = Vec::new();
    let mut gpu_tensor_args = Vec::new();
    let mut gpu_scalar_args = Vec::new();
    for p in params {
        let n = &p.name;
        let ns = n.to_string();
        match &p.ty {
            ParamTy::Tensor { elem, rank } => {
                let d = dtype(*elem);
                if written.contains(&ns) {
                    launch_params.push(quote!(#n: &mut ::ejc_runtime::cpu::HostBuffer));
                    tensor_args.push(quote!(::ejc_runtime::cpu::TensorArg::write(#ns, #d, #rank, #n)));
                    gpu_params.push(quote!(#n: &mut ::ejc_runtime::dsl::GpuBuffer));
                    gpu_tensor_args.push(quote!(::ejc_runtime::dsl::GpuTensorArg::write(#ns, #d, #rank, #n)));
                } else {
                    launch_params.push(quote!(#n: &::ejc_runtime::cpu::HostBuffer));
                    tensor_args.push(quote!(::ejc_runtime::cpu::TensorArg::read(#ns, #d, #rank, #n)));
                    gpu_params.push(quote!(#n: &::ejc_runtime::dsl::GpuBuffer));
                    gpu_tensor_args.push(quote!(::ejc_runtime::dsl::GpuTensorArg::read(#ns, #d, #rank, #n)));
                }
            }
            ParamTy::Scalar(e) => {
                let (rust, value) = match e {
                    Elem::F32 => (quote!(f32), quote!(#n as f64)),
                    Elem::I32 => (quote!(i32), quote!(#n as f64)),
                    Elem::U32 => (quote!(u32), quote!(#n as f64)),
                    _ => (quote!(bool), quote!(if #n { 1.0 } else { 0.0 })),
                };
                let d = dtype(*e);
                launch_params.push(quote!(#n: #rust));
                gpu_params.push(quote!(#n: #rust));
                scalar_args.push(quote!(::ejc_runtime::cpu::scalar_slot(#d, #value)));
                gpu_scalar_args.push(quote!((#d, #value)));
            }
        }
    }
    let launch_doc = format!(
        "Run `{name_str}` on the CPU over `grid` (programs along axes 0, 1, 2) on `threads` workers (0 = all cores). \
         Tensors are checked against the parameters' dtypes and ranks first."
    );
    let gpu_doc = format!(
        "Queue `{name_str}` on the GPU over `grid` (blocks along axes 0, 1, 2; the block size is the build's). \
         Tensors are checked against the parameters' dtypes and ranks first; `Gpu::download` waits for the result. \
         Needs ejc-runtime's `cuda` feature and a build with `DslBuild::ptx`."
    );
    let typecheck = typecheck_copy(f, &attr0);

    let tuned_items = if tuned {
        let config = format_ident!("{}_config", name);
        let fields: Vec<&syn::Ident> = attr0.consts.iter().map(|c| &c.name).collect();
        let field_strs: Vec<String> = fields.iter().map(|f| f.to_string()).collect();
        let defaults: Vec<i64> = attr0.consts.iter().map(|c| c.value).collect();
        let config_doc = format!(
            "The constants of one point of `{name_str}`'s schedule space, for the grid closure of \
             `{name_str}::launch_tuned` / `launch_gpu_tuned`."
        );
        let tuned_doc = format!(
            "Run `{name_str}` on the CPU at the point of its schedule space the chain picks for this call (a pin, \
             this process's choice, the tuning cache, or tuning now: ejc_runtime::dsl's docs); `grid` gives the \
             grid of a point. Otherwise as `launch`."
        );
        let gpu_tuned_doc = format!(
            "Queue `{name_str}` on the GPU at the point the chain picks for this call (tuning first, with CUDA \
             events, when nothing is known); `grid` gives the grid of a point. Otherwise as `launch_gpu`."
        );
        quote! {
            #[doc = #config_doc]
            #[allow(non_camel_case_types, non_snake_case)]
            #[derive(Clone, Copy, Debug, PartialEq, Eq)]
            #vis struct #config { #(pub #fields: i64),* }

            #[allow(clippy::all)]
            impl #name {
                #[doc = #tuned_doc]
                #[allow(clippy::too_many_arguments)]
                pub fn launch_tuned(
                    kernel: &::ejc_runtime::dsl::TunedKernel,
                    grid: impl Fn(&#config) -> [i64; 3],
                    threads: usize,
                    #(#launch_params),*
                ) -> ::core::result::Result<(), ::ejc_runtime::cpu::CpuError> {
                    let mut __tensors: ::std::vec::Vec<::ejc_runtime::cpu::TensorArg> = ::std::vec![#(#tensor_args),*];
                    let __scalars: &[u64] = &[#(#scalar_args),*];
                    let __grid = |__m: &::std::collections::BTreeMap<::std::string::String, i64>| {
                        grid(&#config { #(#fields: __m.get(#field_strs).copied().unwrap_or(#defaults)),* })
                    };
                    ::ejc_runtime::dsl::launch_tuned_checked(kernel, #name_str, &mut __tensors, __scalars, &__grid, threads)
                }

                #[doc = #gpu_tuned_doc]
                #[allow(clippy::too_many_arguments)]
                pub fn launch_gpu_tuned(
                    kernel: &::ejc_runtime::dsl::GpuTunedKernel,
                    grid: impl Fn(&#config) -> [i64; 3],
                    #(#gpu_params),*
                ) -> ::core::result::Result<(), ::ejc_runtime::dsl::GpuError> {
                    let __tensors: ::std::vec::Vec<::ejc_runtime::dsl::GpuTensorArg> = ::std::vec![#(#gpu_tensor_args),*];
                    let __scalars: &[(::ejc_ir::types::DType, f64)] = &[#(#gpu_scalar_args),*];
                    let __grid = |__m: &::std::collections::BTreeMap<::std::string::String, i64>| {
                        grid(&#config { #(#fields: __m.get(#field_strs).copied().unwrap_or(#defaults)),* })
                    };
                    ::ejc_runtime::dsl::launch_gpu_tuned_checked(kernel, #name_str, &__tensors, __scalars, &__grid)
                }
            }
        }
    } else {
        TokenStream::new()
    };

    Ok(quote! {
        #(#docs)*
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, Default)]
        #vis struct #name {}

        #[allow(clippy::all)]
        impl #name {
            /// The kernel's name (its entry symbol in a build).
            pub const NAME: &'static str = #name_str;
            #(#const_items)*
            /// What the build-script helper compiles.
            pub const DEF: ::ejc_ir::dsl::KernelDef = ::ejc_ir::dsl::KernelDef {
                name: #name_str,
                build: #name::kernel,
                points: #def_points,
                warps: &[#(#warps),*],
                stages: &[#(#stages),*],
            };

            /// Build the kernel's tile IR (verified; a kernel with a schedule space at its
            /// default point).
            pub fn kernel() -> ::core::result::Result<::ejc_ir::ir::Kernel, ::ejc_ir::dsl::DslError> {
                #name::__ej_point_0()
            }

            #(#point_fns)*

            #[doc = #launch_doc]
            #[allow(clippy::too_many_arguments)]
            pub fn launch(
                kernel: &::ejc_runtime::cpu::CpuKernel,
                grid: [i64; 3],
                threads: usize,
                #(#launch_params),*
            ) -> ::core::result::Result<(), ::ejc_runtime::cpu::CpuError> {
                let mut __tensors: ::std::vec::Vec<::ejc_runtime::cpu::TensorArg> = ::std::vec![#(#tensor_args),*];
                let __scalars: &[u64] = &[#(#scalar_args),*];
                ::ejc_runtime::cpu::launch_checked(kernel, #name_str, &mut __tensors, __scalars, grid, threads)
            }

            #[doc = #gpu_doc]
            #[allow(clippy::too_many_arguments)]
            pub fn launch_gpu(
                kernel: &::ejc_runtime::dsl::GpuKernel,
                grid: [i64; 3],
                #(#gpu_params),*
            ) -> ::core::result::Result<(), ::ejc_runtime::dsl::GpuError> {
                let __tensors: ::std::vec::Vec<::ejc_runtime::dsl::GpuTensorArg> = ::std::vec![#(#gpu_tensor_args),*];
                let __scalars: &[(::ejc_ir::types::DType, f64)] = &[#(#gpu_scalar_args),*];
                ::ejc_runtime::dsl::launch_gpu_checked(kernel, #name_str, &__tensors, __scalars, grid)
            }
        }

        #tuned_items

        ::ejc_ir::dsl::inventory::submit! { ::ejc_ir::dsl::Registration::Kernel(#name::DEF) }

        #typecheck
    })
}
