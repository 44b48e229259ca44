//! DSL statements and expressions → Rust that builds tile IR through
//! `ejc_ir::dsl::Dsl` (named `__d` in the generated code).
//!
//! Every DSL value is an `ejc_ir::ir::Value` in the generated code, held in a Rust
//! local of the user's own name, so that `let`, reassignment and shadowing read as
//! written. Loops and `if`s become the builder's structured `for_loop` / `if_else`:
//! the locals a loop (or branch) assigns that were declared outside it are its carried
//! values, passed in and yielded out explicitly.

use std::collections::HashMap;

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};

use crate::parse::body::{Bin, Expr_, Stmt};
use crate::parse::signature::Elem;

/// What the generator knows about names.
pub struct Scope {
    /// Attribute constants (compile-time integers).
    pub consts: HashMap<String, i64>,
    /// Tensor parameters (usable only in load/store/dim).
    pub tensors: Vec<String>,
    /// Scalar parameters and loop variables (read-only).
    pub readonly: Vec<String>,
    /// `let` locals, innermost scope last.
    pub locals: Vec<Vec<String>>,
    /// Whether an `if` may have a tile condition (mods: `q_idx`, `kv_idx` are tiles
    /// there, though plain `i32` to rustc). In kernels rustc already requires a `bool`.
    pub tile_conditions: bool,
    /// Whether `#[ej_kernel(helper)]` functions may be called (kernels and helpers; a
    /// mod is also a host function, where a helper cannot run).
    pub helpers: bool,
    /// In a mod: its index names and the tensors it may index.
    pub mods: Option<ModScope>,
}

/// A mod's names: the four indices and its tensors (name, rank); the reads the
/// generator meets are recorded (per tensor, per axis, what indexes it).
#[derive(Clone)]
pub struct ModScope {
    pub b: String,
    pub h: String,
    pub q: String,
    pub kv: String,
    pub tensors: Vec<(String, usize)>,
    pub reads: std::rc::Rc<std::cell::RefCell<Vec<Read>>>,
}

/// One tensor read of a mod: the tensor and, per axis, what indexes it.
pub type Read = (String, Vec<&'static str>);

/// Whether `e` is integer arithmetic of the names in `ok` and the constants.
fn scalar_index(e: &Expr_, ok: &[&str], scope: &Scope) -> bool {
    match e {
        Expr_::Int(..) => true,
        Expr_::Var(id) => {
            let n = id.to_string();
            ok.contains(&n.as_str()) || scope.consts.contains_key(&n)
        }
        Expr_::Neg(x, _) => scalar_index(x, ok, scope),
        Expr_::Bin(Bin::Add | Bin::Sub | Bin::Mul | Bin::Div | Bin::Rem, a, b, _) => {
            scalar_index(a, ok, scope) && scalar_index(b, ok, scope)
        }
        _ => false,
    }
}

/// `t[i]` / `t[[i, j]]` in a mod.
fn mod_read(id: &syn::Ident, idx: &[Expr_], span: Span, scope: &Scope) -> syn::Result<TokenStream> {
    let Some(m) = &scope.mods else {
        return Err(err(
            span,
            "indexing is not supported in a kernel; use `load(tensor, [at(i), span(start, n, limit)])`",
        ));
    };
    let n = id.to_string();
    let Some((_, rank)) = m.tensors.iter().find(|t| t.0 == n) else {
        return Err(err(id.span(), format!("`{n}` is not a tensor parameter of this mod; only those are indexed")));
    };
    if idx.len() != *rank {
        let example = match rank {
            1 => format!("`{n}[q_idx]`"),
            2 => format!("`{n}[[b, q_idx]]`"),
            3 => format!("`{n}[[b, h, q_idx]]`"),
            _ => format!("`{n}[[b, h, q_idx, kv_idx]]`"),
        };
        let what = if *rank == 1 { "one index".to_string() } else { format!("{rank} indices") };
        return Err(err(span, format!("`{n}` has rank {rank}: index it with {what}, e.g. {example}")));
    }
    let mut items = Vec::new();
    let mut roles = Vec::new();
    let (mut seen_q, mut seen_kv) = (false, false);
    for e in idx {
        let name = if let Expr_::Var(v) = e { Some(v.to_string()) } else { None };
        let (item, role) = match name.as_deref() {
            Some(x) if x == m.q && !seen_q && !seen_kv => {
                seen_q = true;
                (quote!(::ejc_ir::dsl::ModIndex::Query), "q_idx")
            }
            Some(x) if x == m.kv && !seen_kv => {
                seen_kv = true;
                (quote!(::ejc_ir::dsl::ModIndex::Key), "kv_idx")
            }
            Some(x) if x == m.q || x == m.kv => {
                return Err(err(
                    e.span(),
                    "a tensor read indexes by `q_idx` at most once and by `kv_idx` at most once, `q_idx` on an \
                     earlier axis than `kv_idx` (the read is a `[BM, BN]` tile)",
                ))
            }
            _ => {
                if !scalar_index(e, &[&m.b, &m.h], scope) {
                    return Err(err(
                        e.span(),
                        format!(
                            "a mod's tensor is indexed by `{}` or `{}` themselves, or by integer arithmetic of `{}`, \
                             `{}` and constants",
                            m.q, m.kv, m.b, m.h
                        ),
                    ));
                }
                let v = expr(e, scope)?;
                let role = match name.as_deref() {
                    Some(x) if x == m.b => "b",
                    Some(x) if x == m.h => "h",
                    _ => "expr",
                };
                (quote!(::ejc_ir::dsl::ModIndex::At({ #v })), role)
            }
        };
        items.push(item);
        roles.push(role);
    }
    m.reads.borrow_mut().push((n.clone(), roles));
    Ok(quote_spanned!(span=> { let __i = [#(#items),*]; __d.mod_read(__ctx, #n, &__i) }))
}

fn err(span: Span, msg: impl Into<String>) -> syn::Error {
    syn::Error::new(span, msg.into())
}

impl Scope {
    fn is_local(&self, n: &str) -> bool {
        self.locals.iter().any(|s| s.iter().any(|x| x == n))
    }
    fn known(&self, n: &str) -> bool {
        self.is_local(n)
            || self.consts.contains_key(n)
            || self.tensors.iter().any(|t| t == n)
            || self.readonly.iter().any(|t| t == n)
    }
    fn declare(&mut self, n: &str) {
        if let Some(s) = self.locals.last_mut() {
            s.push(n.to_string());
        }
    }
}

/// A compile-time integer: a literal, an attribute constant, or arithmetic of those.
pub fn const_int(e: &Expr_, scope: &Scope) -> syn::Result<i64> {
    let bad =
        || err(e.span(), "must be a compile-time integer: a literal or an #[ej_kernel] parameter such as `BLOCK`");
    match e {
        Expr_::Int(v, _) => Ok(*v),
        Expr_::Var(id) => scope.consts.get(&id.to_string()).copied().ok_or_else(bad),
        Expr_::Neg(x, _) => Ok(-const_int(x, scope)?),
        Expr_::Bin(op, a, b, _) => {
            let (a, b) = (const_int(a, scope)?, const_int(b, scope)?);
            match op {
                Bin::Add => Ok(a + b),
                Bin::Sub => Ok(a - b),
                Bin::Mul => Ok(a * b),
                Bin::Div if b != 0 => Ok(a / b),
                _ => Err(bad()),
            }
        }
        _ => Err(bad()),
    }
}

fn dtype(e: Elem) -> TokenStream {
    let d = syn::Ident::new(e.dtype(), Span::call_site());
    quote!(::ejc_ir::types::DType::#d)
}

/// Statements, in order.
pub fn stmts(list: &[Stmt], scope: &mut Scope) -> syn::Result<TokenStream> {
    let mut out = TokenStream::new();
    for s in list {
        out.extend(stmt(s, scope)?);
    }
    Ok(out)
}

/// Names assigned anywhere in `list` (not counting ones declared by `let` inside it).
fn assigned(list: &[Stmt], out: &mut Vec<String>, declared: &mut Vec<String>) {
    for s in list {
        match s {
            Stmt::Let { name, .. } => declared.push(name.to_string()),
            Stmt::Assign { name, .. } => {
                let n = name.to_string();
                if !declared.contains(&n) && !out.contains(&n) {
                    out.push(n);
                }
            }
            Stmt::For { body, .. } => assigned(body, out, &mut declared.clone()),
            Stmt::If { then, els, .. } => {
                assigned(then, out, &mut declared.clone());
                assigned(els, out, &mut declared.clone());
            }
            Stmt::Expr(_) => {}
        }
    }
}

/// An `f64` as a Rust expression (infinities have no literal).
fn float(v: f64) -> TokenStream {
    if v == f64::INFINITY {
        quote!(f64::INFINITY)
    } else if v == f64::NEG_INFINITY {
        quote!(f64::NEG_INFINITY)
    } else if v.is_nan() {
        quote!(f64::NAN)
    } else {
        quote!(#v)
    }
}

/// The span of a `store` anywhere in `list`.
fn find_store(list: &[Stmt]) -> Option<Span> {
    list.iter().find_map(|s| match s {
        Stmt::Expr(Expr_::Call(f, _, span)) if f == "store" => Some(*span),
        Stmt::For { body, .. } => find_store(body),
        Stmt::If { then, els, .. } => find_store(then).or_else(|| find_store(els)),
        _ => None,
    })
}

/// `file:line:column` of `span` in the user's source, as a `&'static str` expression.
pub fn location(span: Span) -> TokenStream {
    quote_spanned! {span=> ::core::concat!(::core::file!(), ":", ::core::line!(), ":", ::core::column!()) }
}

fn ident(n: &str) -> syn::Ident {
    syn::Ident::new(n, Span::call_site())
}

fn stmt(s: &Stmt, scope: &mut Scope) -> syn::Result<TokenStream> {
    Ok(match s {
        Stmt::Let { name, init } => {
            let v = expr(init, scope)?;
            scope.declare(&name.to_string());
            quote! { let mut #name: ::ejc_ir::ir::Value = #v; }
        }
        Stmt::Assign { name, value } => {
            let n = name.to_string();
            if !scope.is_local(&n) {
                let why = if scope.known(&n) {
                    "only `let` locals can be reassigned (parameters, loop variables and constants cannot)"
                } else {
                    "it is not declared; declare it with `let mut`"
                };
                return Err(err(name.span(), format!("cannot assign to `{n}`: {why}")));
            }
            let v = expr(value, scope)?;
            quote! { #name = #v; }
        }
        Stmt::Expr(Expr_::Call(f, args, span)) if f == "store" => store(args, *span, scope)?,
        Stmt::Expr(e) => {
            let v = expr(e, scope)?;
            quote! { let _ = #v; }
        }
        Stmt::For { var, lo, hi, step, body } => {
            let (lo, hi, step) = (expr(lo, scope)?, expr(hi, scope)?, expr(step, scope)?);
            let mut carried = Vec::new();
            assigned(body, &mut carried, &mut Vec::new());
            carried.retain(|n| scope.is_local(n));
            let names: Vec<syn::Ident> = carried.iter().map(|n| ident(n)).collect();
            let idx: Vec<usize> = (0..names.len()).collect();
            scope.locals.push(Vec::new());
            scope.readonly.push(var.to_string());
            let inner = stmts(body, scope);
            scope.readonly.pop();
            scope.locals.pop();
            let inner = inner?;
            quote! {
                {
                    let __lo = #lo;
                    let __hi = #hi;
                    let __step = #step;
                    let __init = [#(#names),*];
                    let __r = __d.b.for_loop(__lo, __hi, __step, &__init, |__bb, #var, __c| {
                        let __d = &mut ::ejc_ir::dsl::Dsl::new(__bb);
                        #( let mut #names: ::ejc_ir::ir::Value = __c[#idx]; )*
                        #inner
                        ::std::vec![#(#names),*]
                    });
                    #( #names = __r[#idx]; )*
                }
            }
        }
        Stmt::If { cond, then, els } => {
            let c = expr(cond, scope)?;
            let loc = location(cond.span());
            let mut carried = Vec::new();
            assigned(then, &mut carried, &mut Vec::new());
            assigned(els, &mut carried, &mut Vec::new());
            carried.retain(|n| scope.is_local(n));
            let names: Vec<syn::Ident> = carried.iter().map(|n| ident(n)).collect();
            let idx: Vec<usize> = (0..names.len()).collect();
            scope.locals.push(Vec::new());
            let t = stmts(then, scope);
            scope.locals.pop();
            scope.locals.push(Vec::new());
            let e = stmts(els, scope);
            scope.locals.pop();
            let (t, e) = (t?, e?);
            let control_flow = quote! {
                        // Control flow: a region per branch, assigned locals carried out.
                        let __tys: ::std::vec::Vec<::ejc_ir::types::Type> = ::std::vec![#(__d.ty(#names).clone()),*];
                        let __r = __d.b.if_else(__cond, &__tys,
                            |__bb| {
                                let __d = &mut ::ejc_ir::dsl::Dsl::new(__bb);
                                #( let mut #names: ::ejc_ir::ir::Value = #names; )*
                                #t
                                ::std::vec![#(#names),*]
                            },
                            |__bb| {
                                let __d = &mut ::ejc_ir::dsl::Dsl::new(__bb);
                                #( let mut #names: ::ejc_ir::ir::Value = #names; )*
                                #e
                                ::std::vec![#(#names),*]
                            });
                        #( #names = __r[#idx]; )*
            };
            if !scope.tile_conditions {
                return Ok(quote! { { let __cond = #c; #control_flow } });
            }
            quote! {
                {
                    let __cond = #c;
                    if __d.is_scalar(__cond) {
                        #control_flow
                    } else {
                        // A tile condition (in a mod, `q_idx == kv_idx`; mods have no
                        // stores): both branches,
                        // then an element-wise select of every assigned local.
                        let __t: ::std::vec::Vec<::ejc_ir::ir::Value> = {
                            #( let mut #names: ::ejc_ir::ir::Value = #names; )*
                            #t
                            ::std::vec![#(#names),*]
                        };
                        let __e: ::std::vec::Vec<::ejc_ir::ir::Value> = {
                            #( let mut #names: ::ejc_ir::ir::Value = #names; )*
                            #e
                            ::std::vec![#(#names),*]
                        };
                        __d.b.set_location(#loc);
                        #( #names = __d.select(__cond, __t[#idx], __e[#idx]); )*
                    }
                }
            }
        }
    })
}

/// The tensor named by a load/store/dim argument.
fn tensor(e: &Expr_, scope: &Scope) -> syn::Result<syn::Ident> {
    match e {
        Expr_::Var(id) if scope.tensors.contains(&id.to_string()) => Ok(id.clone()),
        other => Err(err(other.span(), "expected a tensor parameter")),
    }
}

/// `[at(i), span(start, n, limit), ...]` → `vec![Axis...]`.
fn axes(e: &Expr_, scope: &Scope) -> syn::Result<TokenStream> {
    let Expr_::Array(items, _) = e else {
        return Err(err(e.span(), "axes are an array: `[at(b), span(start, 64, end)]`"));
    };
    let mut out = Vec::new();
    for it in items {
        out.push(match it {
            Expr_::Call(f, a, _) if f == "at" => {
                let i = expr(&a[0], scope)?;
                quote! { { let __i = #i; ::ejc_ir::builder::Axis::Index(__i) } }
            }
            Expr_::Call(f, a, _) if f == "span" => {
                let start = expr(&a[0], scope)?;
                let size = const_int(&a[1], scope)?;
                if size <= 0 {
                    return Err(err(a[1].span(), "a span's size is a positive compile-time integer"));
                }
                let size = size as usize;
                let limit = match a.get(2) {
                    Some(l) => {
                        let l = expr(l, scope)?;
                        quote! { ::core::option::Option::Some({ #l }) }
                    }
                    None => quote! { ::core::option::Option::None },
                };
                quote! { { let __s = #start; let __l = #limit; ::ejc_ir::builder::Axis::Range { start: __s, size: #size, limit: __l } } }
            }
            other => return Err(err(other.span(), "each axis is `at(index)` or `span(start, size, limit)`")),
        });
    }
    Ok(quote! { { let mut __ax = ::std::vec::Vec::new(); #( __ax.push(#out); )* __ax } })
}

fn store(args: &[Expr_], span: Span, scope: &Scope) -> syn::Result<TokenStream> {
    let t = tensor(&args[0], scope)?;
    let ax = axes(&args[1], scope)?;
    let v = expr(&args[2], scope)?;
    let loc = location(span);
    Ok(quote! {
        {
            let __ax = #ax;
            let __v = #v;
            __d.b.set_location(#loc);
            __d.store(#t, __ax, __v);
        }
    })
}

fn unary(name: &str) -> Option<TokenStream> {
    Some(match name {
        "exp2" => quote!(::ejc_ir::ir::UnOp::Exp2),
        "exp" => quote!(::ejc_ir::ir::UnOp::Exp),
        "log2" => quote!(::ejc_ir::ir::UnOp::Log2),
        "ln" => quote!(::ejc_ir::ir::UnOp::Log),
        "tanh" => quote!(::ejc_ir::ir::UnOp::Tanh),
        "sqrt" => quote!(::ejc_ir::ir::UnOp::Sqrt),
        "abs" => quote!(::ejc_ir::ir::UnOp::Abs),
        _ => return None,
    })
}

/// `a op b`: operands first, then the location of the operator, then the op (so an
/// error in the op is reported at the operator, not at an operand).
fn bin2(op: TokenStream, a: TokenStream, b: TokenStream, cmp: bool, span: Span) -> TokenStream {
    let loc = location(span);
    let f = if cmp { quote!(cmp) } else { quote!(bin) };
    quote! { { let __lhs = #a; let __rhs = #b; __d.b.set_location(#loc); __d.#f(#op, __lhs, __rhs) } }
}

/// A one-operand op at `span`.
fn un(x: TokenStream, span: Span, op: TokenStream) -> TokenStream {
    let loc = location(span);
    quote! { { let __x = #x; __d.b.set_location(#loc); #op } }
}

/// An expression, as Rust code of type `Value`.
pub fn expr(e: &Expr_, scope: &Scope) -> syn::Result<TokenStream> {
    Ok(match e {
        Expr_::Int(v, _) => quote! { __d.int(#v) },
        Expr_::Float(v, _) => {
            let v = float(*v);
            quote! { __d.float(#v) }
        }
        Expr_::Bool(b, _) => quote! { __d.boolean(#b) },
        Expr_::Var(id) => {
            let n = id.to_string();
            if scope.mods.as_ref().is_some_and(|m| m.tensors.iter().any(|t| t.0 == n)) {
                return Err(err(
                    id.span(),
                    format!("tensor `{n}` is read by indexing it: `{n}[q_idx]`, `{n}[[b, kv_idx]]`"),
                ));
            }
            if scope.tensors.contains(&n) {
                return Err(err(id.span(), format!("tensor `{n}` is read with `load({n}, [...])`")));
            }
            if !scope.known(&n) {
                return Err(err(id.span(), format!("unknown name `{n}`")));
            }
            quote! { #id }
        }
        Expr_::Bin(op, a, b, span) => {
            let (x, y) = (expr(a, scope)?, expr(b, scope)?);
            let (path, cmp) = match op {
                Bin::Add => (quote!(::ejc_ir::ir::BinOp::Add), false),
                Bin::Sub => (quote!(::ejc_ir::ir::BinOp::Sub), false),
                Bin::Mul => (quote!(::ejc_ir::ir::BinOp::Mul), false),
                Bin::Div => (quote!(::ejc_ir::ir::BinOp::Div), false),
                Bin::Rem => (quote!(::ejc_ir::ir::BinOp::Rem), false),
                Bin::BitAnd | Bin::And => (quote!(::ejc_ir::ir::BinOp::And), false),
                Bin::BitOr | Bin::Or => (quote!(::ejc_ir::ir::BinOp::Or), false),
                Bin::BitXor => (quote!(::ejc_ir::ir::BinOp::Xor), false),
                Bin::Shl => (quote!(::ejc_ir::ir::BinOp::Shl), false),
                Bin::Shr => (quote!(::ejc_ir::ir::BinOp::Shr), false),
                Bin::Lt => (quote!(::ejc_ir::ir::CmpPred::Lt), true),
                Bin::Le => (quote!(::ejc_ir::ir::CmpPred::Le), true),
                Bin::Gt => (quote!(::ejc_ir::ir::CmpPred::Gt), true),
                Bin::Ge => (quote!(::ejc_ir::ir::CmpPred::Ge), true),
                Bin::Eq => (quote!(::ejc_ir::ir::CmpPred::Eq), true),
                Bin::Ne => (quote!(::ejc_ir::ir::CmpPred::Ne), true),
            };
            bin2(path, x, y, cmp, *span)
        }
        Expr_::Neg(x, span) => un(expr(x, scope)?, *span, quote!(__d.neg(__x))),
        Expr_::Not(x, span) => un(expr(x, scope)?, *span, quote!(__d.not(__x))),
        Expr_::Cast(x, t, span) => {
            let d = dtype(*t);
            un(expr(x, scope)?, *span, quote!(__d.cast(__x, #d)))
        }
        Expr_::Array(_, s) => {
            return Err(err(*s, "arrays only appear as the axes of load/store and the shape of full"))
        }
        Expr_::Index(id, idx, span) => mod_read(id, idx, *span, scope)?,
        Expr_::If(c, ts, tt, es, et, _) => {
            let c = expr(c, scope)?;
            for list in [ts, es] {
                let mut a = Vec::new();
                assigned(list, &mut a, &mut Vec::new());
                if let Some(n) = a.iter().find(|n| scope.is_local(n)) {
                    return Err(err(
                        e.span(),
                        format!("an `if` used as a value cannot assign `{n}`; use an `if` statement"),
                    ));
                }
                if let Some(s) = find_store(list) {
                    return Err(err(s, "an `if` used as a value cannot `store`; use an `if` statement"));
                }
            }
            let mut inner = Scope {
                consts: scope.consts.clone(),
                tensors: scope.tensors.clone(),
                readonly: scope.readonly.clone(),
                locals: scope.locals.clone(),
                tile_conditions: scope.tile_conditions,
                helpers: scope.helpers,
                mods: scope.mods.clone(),
            };
            inner.locals.push(Vec::new());
            let tstmts = stmts(ts, &mut inner)?;
            let tval = expr(tt, &inner)?;
            inner.locals.pop();
            inner.locals.push(Vec::new());
            let estmts = stmts(es, &mut inner)?;
            let eval = expr(et, &inner)?;
            let control_flow = quote! {
                        let __r = __d.b.if_else_infer(__cond,
                            |__bb| { let __d = &mut ::ejc_ir::dsl::Dsl::new(__bb); #tstmts ::std::vec![#tval] },
                            |__bb| { let __d = &mut ::ejc_ir::dsl::Dsl::new(__bb); #estmts ::std::vec![#eval] });
                        __r[0]
            };
            if !scope.tile_conditions {
                return Ok(quote! { { let __cond = #c; #control_flow } });
            }
            quote! {
                {
                    let __cond = #c;
                    if __d.is_scalar(__cond) {
                        #control_flow
                    } else {
                        // A tile condition: both branches, then an element-wise select.
                        let __t = { #tstmts #tval };
                        let __e = { #estmts #eval };
                        __d.select(__cond, __t, __e)
                    }
                }
            }
        }
        Expr_::Method(recv, name, args, turbofish, span) => {
            let r = expr(recv, scope)?;
            let cmp = |p: TokenStream| -> syn::Result<TokenStream> {
                let a = expr(&args[0], scope)?;
                Ok(bin2(p, r.clone(), a, true, *span))
            };
            match name.as_str() {
                "lt" => cmp(quote!(::ejc_ir::ir::CmpPred::Lt))?,
                "le" => cmp(quote!(::ejc_ir::ir::CmpPred::Le))?,
                "gt" => cmp(quote!(::ejc_ir::ir::CmpPred::Gt))?,
                "ge" => cmp(quote!(::ejc_ir::ir::CmpPred::Ge))?,
                "eq" => cmp(quote!(::ejc_ir::ir::CmpPred::Eq))?,
                "expand" => {
                    let axis = const_int(&args[0], scope)?;
                    if !(0..=1).contains(&axis) {
                        return Err(err(args[0].span(), "`.expand(axis)` takes axis 0 or 1"));
                    }
                    un(r, *span, quote!(__d.expand(__x, #axis)))
                }
                "cast" => {
                    let d = dtype(turbofish.unwrap_or(Elem::F32));
                    un(r, *span, quote!(__d.cast(__x, #d)))
                }
                "max" | "min" => {
                    let a = expr(&args[0], scope)?;
                    let op =
                        if name == "max" { quote!(::ejc_ir::ir::BinOp::Max) } else { quote!(::ejc_ir::ir::BinOp::Min) };
                    bin2(op, r, a, false, *span)
                }
                other => match unary(other) {
                    Some(op) => un(r, *span, quote!(__d.unary(#op, __x))),
                    None => return Err(err(*span, format!("unknown method `{other}`"))),
                },
            }
        }
        Expr_::Call(f, a, span) => call(f, a, *span, scope)?,
        Expr_::Helper(name, args, span) => {
            if !scope.helpers {
                return Err(err(
                    *span,
                    format!(
                        "`{name}` is not a DSL function; a mod calls only the DSL's (it is also a host function), \
                         #[ej_kernel(helper)] functions are called from kernels and helpers"
                    ),
                ));
            }
            // Tensors pass as themselves (the helper loads and stores through them).
            let vals = args
                .iter()
                .map(|a| match a {
                    Expr_::Var(id) if scope.tensors.contains(&id.to_string()) => Ok(quote!(#id)),
                    other => expr(other, scope),
                })
                .collect::<syn::Result<Vec<_>>>()?;
            let tmps: Vec<syn::Ident> = (0..vals.len()).map(|i| quote::format_ident!("__h{}", i)).collect();
            let loc = location(*span);
            // `<name>::` (a type path): an unknown name reads "cannot find type", not "crate".
            let callee = quote_spanned! {name.span()=> <#name>::__ej_emit };
            quote! { { #(let #tmps = #vals;)* __d.b.set_location(#loc); #callee(__d, #(#tmps),*) } }
        }
    })
}

fn call(f: &str, a: &[Expr_], span: Span, scope: &Scope) -> syn::Result<TokenStream> {
    let e = |i: usize| expr(&a[i], scope);
    let loc = location(span);
    let loc = quote! { __d.b.set_location(#loc); };
    let int_axis = |i: usize, hi: i64, what: &str| -> syn::Result<i64> {
        let v = const_int(&a[i], scope)?;
        if !(0..=hi).contains(&v) {
            return Err(err(a[i].span(), format!("{what} is a compile-time integer in 0..={hi}")));
        }
        Ok(v)
    };
    Ok(match f {
        "program_id" => {
            let axis = int_axis(0, 2, "the grid axis")?;
            quote! { { #loc __d.program_id(#axis) } }
        }
        "dim" => {
            let t = tensor(&a[0], scope)?;
            let axis = int_axis(1, 3, "the tensor axis")?;
            quote! { { #loc __d.dim(#t, #axis) } }
        }
        "at" | "span" => {
            return Err(err(span, format!("`{f}` describes an axis of `load` or `store`: `load(t, [{f}(...)])`")))
        }
        "load" | "load_pad" => {
            let t = tensor(&a[0], scope)?;
            let ax = axes(&a[1], scope)?;
            let pad = match a.get(2) {
                None => 0.0,
                Some(Expr_::Float(v, _)) => *v,
                Some(Expr_::Int(v, _)) => *v as f64,
                Some(Expr_::Bool(v, _)) => *v as u8 as f64,
                Some(other) => return Err(err(
                    other.span(),
                    "the pad value is a literal of the tensor's kind (`0.0`, `f32::NEG_INFINITY`, `-1`, `false` ...)",
                )),
            };
            let pad = float(pad);
            quote! { { let __ax = #ax; #loc __d.load(#t, __ax, #pad) } }
        }
        "store" => return Err(err(span, "`store` is a statement: `store(t, [...], value);`")),
        "full" | "full1" => {
            let shape: Vec<i64> = if f == "full" {
                let Expr_::Array(items, s) = &a[0] else {
                    return Err(err(a[0].span(), "the shape is an array of compile-time integers: `[BLOCK_M, D]`"));
                };
                if items.len() != 2 {
                    return Err(err(*s, "`full` makes rank-2 tiles (`full1` makes rank-1)"));
                }
                items.iter().map(|x| const_int(x, scope)).collect::<syn::Result<_>>()?
            } else {
                vec![const_int(&a[0], scope)?]
            };
            if let Some(bad) = shape.iter().position(|n| *n <= 0) {
                return Err(err(a[0].span(), format!("tile extents are positive (extent {bad} is {})", shape[bad])));
            }
            let v = e(1)?;
            quote! { { let __v = #v; #loc __d.full(&[#(#shape),*], __v) } }
        }
        "arange" => {
            let n = const_int(&a[0], scope)?;
            if n <= 0 {
                return Err(err(a[0].span(), "`arange(n)` takes a positive compile-time integer"));
            }
            quote! { { #loc __d.arange(#n) } }
        }
        "dot" | "dot_t" => {
            let (x, y, acc) = (e(0)?, e(1)?, e(2)?);
            let t = f == "dot_t";
            quote! { { let __a = #x; let __b = #y; let __c = #acc; #loc __d.dot(__a, __b, __c, #t) } }
        }
        "sum" | "max_along" => {
            let x = e(0)?;
            let axis = int_axis(1, 1, "the reduced axis")?;
            let op = if f == "sum" { quote!(::ejc_ir::ir::ReduceOp::Sum) } else { quote!(::ejc_ir::ir::ReduceOp::Max) };
            quote! { { let __x = #x; #loc __d.reduce(#op, __x, #axis) } }
        }
        "select" => {
            let (c, x, y) = (e(0)?, e(1)?, e(2)?);
            quote! { { let __c = #c; let __a = #x; let __b = #y; #loc __d.select(__c, __a, __b) } }
        }
        "maximum" | "minimum" => {
            let op = if f == "maximum" { quote!(::ejc_ir::ir::BinOp::Max) } else { quote!(::ejc_ir::ir::BinOp::Min) };
            bin2(op, e(0)?, e(1)?, false, span)
        }
        other => match unary(other) {
            Some(op) => un(e(0)?, span, quote!(__d.unary(#op, __x))),
            None => return Err(err(span, format!("unknown function `{other}`"))),
        },
    })
}
