//! The body of an `#[ej_kernel]` function → the DSL's own small syntax tree.
//!
//! Only the tile DSL is accepted: `let` bindings, assignments to `let mut` locals,
//! `for` loops over `range(lo, hi, step)` or `lo..hi`, `if`/`else` (statements and
//! expressions), arithmetic and comparison operators, `as` casts, literals, and calls
//! of the DSL's functions and methods. Everything else — closures, macros (`vec!`,
//! `format!` ...), heap types, references, `while`/`loop`/`match`, `return`, calls of
//! other functions — is an error on its own span that says what is allowed.

use proc_macro2::Span;
use syn::spanned::Spanned;
use syn::{BinOp, Block, Expr, Lit, Pat, Stmt as SynStmt, UnOp};

use super::signature::Elem;

/// DSL functions: name, argument counts accepted.
pub const FUNCTIONS: &[(&str, &[usize])] = &[
    ("program_id", &[1]),
    ("dim", &[2]),
    ("at", &[1]),
    ("span", &[3]),
    ("load", &[2]),
    ("load_pad", &[3]),
    ("store", &[3]),
    ("full", &[2]),
    ("full1", &[2]),
    ("arange", &[1]),
    ("dot", &[3]),
    ("dot_t", &[3]),
    ("sum", &[2]),
    ("max_along", &[2]),
    ("select", &[3]),
    ("exp2", &[1]),
    ("exp", &[1]),
    ("log2", &[1]),
    ("ln", &[1]),
    ("tanh", &[1]),
    ("sqrt", &[1]),
    ("abs", &[1]),
    ("maximum", &[2]),
    ("minimum", &[2]),
];

/// DSL methods: name, argument count.
pub const METHODS: &[(&str, usize)] = &[
    ("lt", 1),
    ("le", 1),
    ("gt", 1),
    ("ge", 1),
    ("eq", 1),
    ("expand", 1),
    ("cast", 0),
    ("exp2", 0),
    ("exp", 0),
    ("log2", 0),
    ("ln", 0),
    ("tanh", 0),
    ("sqrt", 0),
    ("abs", 0),
    ("max", 1),
    ("min", 1),
];

fn list(names: impl Iterator<Item = String>) -> String {
    names.collect::<Vec<_>>().join(", ")
}

#[derive(Clone, Debug)]
pub enum Stmt {
    Let { name: syn::Ident, init: Expr_ },
    Assign { name: syn::Ident, value: Expr_ },
    Expr(Expr_),
    For { var: syn::Ident, lo: Expr_, hi: Expr_, step: Expr_, body: Vec<Stmt> },
    If { cond: Expr_, then: Vec<Stmt>, els: Vec<Stmt> },
}

/// Binary operators (arithmetic, bitwise, comparison, logical).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bin {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    BitAnd,
    BitOr,
    BitXor,
    Shl,
    Shr,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
    And,
    Or,
}

#[derive(Clone, Debug)]
pub enum Expr_ {
    Int(i64, Span),
    Float(f64, Span),
    Bool(bool, Span),
    Var(syn::Ident),
    Bin(Bin, Box<Expr_>, Box<Expr_>, Span),
    Neg(Box<Expr_>, Span),
    Not(Box<Expr_>, Span),
    Call(String, Vec<Expr_>, Span),
    /// A call of a `#[ej_kernel(helper)]` function (any name the DSL does not provide).
    Helper(syn::Ident, Vec<Expr_>, Span),
    Method(Box<Expr_>, String, Vec<Expr_>, Option<Elem>, Span),
    Cast(Box<Expr_>, Elem, Span),
    If(Box<Expr_>, Vec<Stmt>, Box<Expr_>, Vec<Stmt>, Box<Expr_>, Span),
    Array(Vec<Expr_>, Span),
    /// `t[i]` / `t[[i, j]]`: a mod reading a tensor (kernels use `load`).
    Index(syn::Ident, Vec<Expr_>, Span),
}

impl Expr_ {
    pub fn span(&self) -> Span {
        match self {
            Expr_::Int(_, s) | Expr_::Float(_, s) | Expr_::Bool(_, s) | Expr_::Neg(_, s) | Expr_::Not(_, s) => *s,
            Expr_::Var(i) => i.span(),
            Expr_::Bin(_, _, _, s) | Expr_::Call(_, _, s) | Expr_::Method(_, _, _, _, s) | Expr_::Cast(_, _, s) => *s,
            Expr_::If(.., s) | Expr_::Array(_, s) | Expr_::Helper(_, _, s) | Expr_::Index(_, _, s) => *s,
        }
    }
}

fn err(span: Span, msg: impl Into<String>) -> syn::Error {
    syn::Error::new(span, msg.into())
}

/// What a body may contain, for error messages.
const STATEMENTS: &str = "`let` bindings, assignments, `for i in range(lo, hi, step)`, `if`/`else`, operators, \
                          literals and the DSL's functions (docs/dsl.md)";

/// A body: statements and an optional tail expression (mods return one).
pub fn block(b: &Block) -> syn::Result<(Vec<Stmt>, Option<Expr_>)> {
    let mut out = Vec::new();
    let mut tail = None;
    let n = b.stmts.len();
    for (i, s) in b.stmts.iter().enumerate() {
        match s {
            SynStmt::Local(l) => {
                let name = match &l.pat {
                    Pat::Ident(p) => p.ident.clone(),
                    Pat::Type(t) => match &*t.pat {
                        Pat::Ident(p) => p.ident.clone(),
                        other => return Err(err(other.span(), "bind one name: `let x = ...;`")),
                    },
                    other => return Err(err(other.span(), "bind one name: `let x = ...;` (no patterns)")),
                };
                let Some(init) = &l.init else {
                    return Err(err(l.span(), "a `let` needs a value: `let x = ...;`"));
                };
                if let Some((_, d)) = &init.diverge {
                    return Err(err(d.span(), "`let ... else` is not supported"));
                }
                out.push(Stmt::Let { name, init: expr(&init.expr)? });
            }
            SynStmt::Expr(e, semi) => {
                let last = i + 1 == n && semi.is_none();
                match e {
                    Expr::ForLoop(f) => out.push(for_loop(f)?),
                    // A trailing `if` is the body's value only where its branch ends in one
                    // (`if c { store(...); }` at the end of a kernel is a statement).
                    Expr::If(x) if !last || !gives_value(&x.then_branch) => out.push(if_stmt(x)?),
                    Expr::Assign(a) => out.push(assign(&a.left, expr(&a.right)?)?),
                    Expr::Binary(b) if compound(&b.op).is_some() => {
                        let op = compound(&b.op).unwrap_or(Bin::Add);
                        let name = target(&b.left)?;
                        let value =
                            Expr_::Bin(op, Box::new(Expr_::Var(name.clone())), Box::new(expr(&b.right)?), b.span());
                        out.push(Stmt::Assign { name, value });
                    }
                    _ if last => tail = Some(expr(e)?),
                    _ => out.push(Stmt::Expr(expr(e)?)),
                }
            }
            SynStmt::Item(item) => {
                return Err(err(
                    item.span(),
                    format!("items (fn, struct, use ...) cannot be declared inside a kernel; allowed: {STATEMENTS}"),
                ))
            }
            SynStmt::Macro(m) => return Err(macro_error(&m.mac)),
        }
    }
    Ok((out, tail))
}

/// Whether a block ends in a value (a last expression without `;` that is not itself a
/// statement form: a `for` loop, or an `if` whose branch gives none).
fn gives_value(b: &Block) -> bool {
    match b.stmts.last() {
        Some(SynStmt::Expr(Expr::ForLoop(_), None)) => false,
        Some(SynStmt::Expr(Expr::If(x), None)) => gives_value(&x.then_branch),
        Some(SynStmt::Expr(_, None)) => true,
        _ => false,
    }
}

fn macro_error(m: &syn::Macro) -> syn::Error {
    let name = m.path.segments.last().map(|s| s.ident.to_string()).unwrap_or_default();
    let why = match name.as_str() {
        "vec" | "format" => " (kernels do not allocate memory)",
        "println" | "print" | "eprintln" | "dbg" => " (kernels do not print)",
        _ => "",
    };
    err(m.path.span(), format!("macro `{name}!` is not supported in an #[ej_kernel] body{why}; allowed: {STATEMENTS}"))
}

fn compound(op: &BinOp) -> Option<Bin> {
    Some(match op {
        BinOp::AddAssign(_) => Bin::Add,
        BinOp::SubAssign(_) => Bin::Sub,
        BinOp::MulAssign(_) => Bin::Mul,
        BinOp::DivAssign(_) => Bin::Div,
        _ => return None,
    })
}

fn target(e: &Expr) -> syn::Result<syn::Ident> {
    match e {
        Expr::Path(p) if p.path.get_ident().is_some() => {
            Ok(p.path.get_ident().cloned().unwrap_or_else(|| syn::Ident::new("_", e.span())))
        }
        _ => Err(err(e.span(), "only local variables can be assigned")),
    }
}

fn assign(left: &Expr, value: Expr_) -> syn::Result<Stmt> {
    Ok(Stmt::Assign { name: target(left)?, value })
}

fn for_loop(f: &syn::ExprForLoop) -> syn::Result<Stmt> {
    let Pat::Ident(var) = &*f.pat else {
        return Err(err(f.pat.span(), "the loop variable is one name"));
    };
    let (lo, hi, step) = match &*f.expr {
        Expr::Range(r) => {
            let (Some(lo), Some(hi)) = (&r.start, &r.end) else {
                return Err(err(r.span(), "loop over `lo..hi` or `range(lo, hi, step)`"));
            };
            if matches!(r.limits, syn::RangeLimits::Closed(_)) {
                return Err(err(r.span(), "use `lo..hi` (exclusive) or `range(lo, hi, step)`"));
            }
            (expr(lo)?, expr(hi)?, Expr_::Int(1, r.span()))
        }
        Expr::Call(c) if matches!(&*c.func, Expr::Path(p) if p.path.is_ident("range")) => {
            if c.args.len() != 3 {
                return Err(err(c.span(), "`range(lo, hi, step)` takes three arguments"));
            }
            (expr(&c.args[0])?, expr(&c.args[1])?, expr(&c.args[2])?)
        }
        other => return Err(err(other.span(), "a kernel loops over `range(lo, hi, step)` or `lo..hi`")),
    };
    let (body, tail) = block(&f.body)?;
    if let Some(t) = tail {
        return Err(err(t.span(), "a loop body ends with a statement (add `;`)"));
    }
    Ok(Stmt::For { var: var.ident.clone(), lo, hi, step, body })
}

fn if_stmt(x: &syn::ExprIf) -> syn::Result<Stmt> {
    let cond = expr(&x.cond)?;
    let (then, tail) = block(&x.then_branch)?;
    if let Some(t) = tail {
        return Err(err(
            t.span(),
            "an `if` statement's branches end with statements (add `;`), or use it as a value: `let x = if ...`",
        ));
    }
    let els = match &x.else_branch {
        None => Vec::new(),
        Some((_, e)) => match &**e {
            Expr::Block(b) => {
                let (s, t) = block(&b.block)?;
                if let Some(t) = t {
                    return Err(err(t.span(), "an `if` statement's branches end with statements (add `;`)"));
                }
                s
            }
            Expr::If(inner) => vec![if_stmt(inner)?],
            other => return Err(err(other.span(), "expected a block")),
        },
    };
    Ok(Stmt::If { cond, then, els })
}

fn elem_of(ty: &syn::Type) -> syn::Result<Elem> {
    let name = match ty {
        syn::Type::Path(p) => p.path.get_ident().map(|i| i.to_string()),
        _ => None,
    };
    name.as_deref().and_then(Elem::from_name).ok_or_else(|| {
        err(
            ty.span(),
            format!(
                "unsupported type `{}`; the DSL's element types are f32, Bf16, F16, i32, u32, bool",
                super::signature::type_str(ty)
            ),
        )
    })
}

/// An expression of the DSL.
pub fn expr(e: &Expr) -> syn::Result<Expr_> {
    let span = e.span();
    Ok(match e {
        Expr::Lit(l) => match &l.lit {
            Lit::Int(i) => Expr_::Int(i.base10_parse()?, span),
            Lit::Float(f) => Expr_::Float(f.base10_parse()?, span),
            Lit::Bool(b) => Expr_::Bool(b.value, span),
            other => return Err(err(other.span(), "only integer, float and bool literals are part of the DSL")),
        },
        Expr::Path(p) => {
            if let Some(id) = p.path.get_ident() {
                Expr_::Var(id.clone())
            } else {
                let s = quote::quote!(#p).to_string().replace(' ', "");
                match s.as_str() {
                    "f32::INFINITY" => Expr_::Float(f64::INFINITY, span),
                    "f32::NEG_INFINITY" => Expr_::Float(f64::NEG_INFINITY, span),
                    _ => return Err(err(span, format!("unknown path `{s}`; the DSL knows local names, parameters, attribute constants, f32::INFINITY and f32::NEG_INFINITY"))),
                }
            }
        }
        Expr::Paren(p) => expr(&p.expr)?,
        Expr::Group(g) => expr(&g.expr)?,
        Expr::Binary(b) => {
            let op = match b.op {
                BinOp::Add(_) => Bin::Add,
                BinOp::Sub(_) => Bin::Sub,
                BinOp::Mul(_) => Bin::Mul,
                BinOp::Div(_) => Bin::Div,
                BinOp::Rem(_) => Bin::Rem,
                BinOp::BitAnd(_) => Bin::BitAnd,
                BinOp::BitOr(_) => Bin::BitOr,
                BinOp::BitXor(_) => Bin::BitXor,
                BinOp::Shl(_) => Bin::Shl,
                BinOp::Shr(_) => Bin::Shr,
                BinOp::Lt(_) => Bin::Lt,
                BinOp::Le(_) => Bin::Le,
                BinOp::Gt(_) => Bin::Gt,
                BinOp::Ge(_) => Bin::Ge,
                BinOp::Eq(_) => Bin::Eq,
                BinOp::Ne(_) => Bin::Ne,
                BinOp::And(_) => Bin::And,
                BinOp::Or(_) => Bin::Or,
                _ => return Err(err(span, "compound assignment is a statement: `x += y;`")),
            };
            Expr_::Bin(op, Box::new(expr(&b.left)?), Box::new(expr(&b.right)?), span)
        }
        Expr::Unary(u) => match u.op {
            UnOp::Neg(_) => match expr(&u.expr)? {
                Expr_::Int(v, _) => Expr_::Int(-v, span),
                Expr_::Float(v, _) => Expr_::Float(-v, span),
                other => Expr_::Neg(Box::new(other), span),
            },
            UnOp::Not(_) => Expr_::Not(Box::new(expr(&u.expr)?), span),
            _ => {
                return Err(err(
                    span,
                    "references and dereferences are not part of the DSL (tiles and tensors are passed by value)",
                ))
            }
        },
        Expr::Cast(c) => Expr_::Cast(Box::new(expr(&c.expr)?), elem_of(&c.ty)?, span),
        Expr::Call(c) => {
            let name = match &*c.func {
                Expr::Path(p) if p.path.get_ident().is_some() => {
                    p.path.get_ident().map(|i| i.to_string()).unwrap_or_default()
                }
                Expr::Path(p) => {
                    let s = quote::quote!(#p).to_string().replace(' ', "");
                    let why = if s.starts_with("Vec::") || s.starts_with("Box::") || s.starts_with("String::") {
                        " (kernels do not allocate memory)"
                    } else {
                        ""
                    };
                    return Err(err(
                        c.func.span(),
                        format!(
                            "call of `{s}` is not supported{why}; the tile DSL provides: {}",
                            list(FUNCTIONS.iter().map(|f| f.0.to_string()))
                        ),
                    ));
                }
                other => return Err(err(other.span(), "calls name a DSL function")),
            };
            let Some((_, counts)) = FUNCTIONS.iter().find(|f| f.0 == name) else {
                // Not the DSL's: a `#[ej_kernel(helper)]` function (rustc says so if it
                // is neither: the type-checked copy calls it by name).
                let id = syn::Ident::new(&name, c.func.span());
                return Ok(Expr_::Helper(id, c.args.iter().map(expr).collect::<syn::Result<_>>()?, span));
            };
            if !counts.contains(&c.args.len()) {
                return Err(err(
                    span,
                    format!(
                        "`{name}` takes {} argument(s), got {}",
                        counts.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(" or "),
                        c.args.len()
                    ),
                ));
            }
            Expr_::Call(name, c.args.iter().map(expr).collect::<syn::Result<_>>()?, span)
        }
        Expr::MethodCall(m) => {
            let name = m.method.to_string();
            let Some((_, n)) = METHODS.iter().find(|x| x.0 == name) else {
                return Err(err(
                    m.method.span(),
                    format!(
                        "unknown method `{name}`; the tile DSL provides: {}",
                        list(METHODS.iter().map(|f| f.0.to_string()))
                    ),
                ));
            };
            if m.args.len() != *n {
                return Err(err(span, format!("`.{name}` takes {n} argument(s), got {}", m.args.len())));
            }
            let turbofish = match &m.turbofish {
                None => None,
                Some(t) => match t.args.first() {
                    Some(syn::GenericArgument::Type(ty)) => Some(elem_of(ty)?),
                    _ => return Err(err(t.span(), "expected an element type: `.cast::<f32>()`")),
                },
            };
            if name == "cast" && turbofish.is_none() {
                return Err(err(m.method.span(), "`.cast` names its type: `.cast::<f32>()`"));
            }
            Expr_::Method(
                Box::new(expr(&m.receiver)?),
                name,
                m.args.iter().map(expr).collect::<syn::Result<_>>()?,
                turbofish,
                span,
            )
        }
        Expr::If(x) => {
            let cond = expr(&x.cond)?;
            let (ts, tt) = block(&x.then_branch)?;
            let Some(tt) = tt else {
                return Err(err(x.then_branch.span(), "an `if` used as a value ends each branch with a value"));
            };
            let Some((_, e)) = &x.else_branch else {
                return Err(err(span, "an `if` used as a value needs an `else`"));
            };
            let (es, et) = match &**e {
                Expr::Block(b) => block(&b.block)?,
                inner @ Expr::If(_) => (Vec::new(), Some(expr(inner)?)),
                other => return Err(err(other.span(), "expected a block")),
            };
            let Some(et) = et else {
                return Err(err(e.span(), "an `if` used as a value ends each branch with a value"));
            };
            Expr_::If(Box::new(cond), ts, Box::new(tt), es, Box::new(et), span)
        }
        Expr::Block(b) => {
            let (s, t) = block(&b.block)?;
            match (s.is_empty(), t) {
                (true, Some(t)) => t,
                _ => return Err(err(span, "blocks as values are not supported; use `let` bindings")),
            }
        }
        Expr::Array(a) => Expr_::Array(a.elems.iter().map(expr).collect::<syn::Result<_>>()?, span),
        Expr::Closure(_) => {
            return Err(err(span, format!("closures are not part of the tile DSL; allowed: {STATEMENTS}")))
        }
        Expr::Macro(m) => return Err(macro_error(&m.mac)),
        Expr::While(_) => return Err(err(span, "`while` loops are not supported; use `for i in range(lo, hi, step)`")),
        Expr::Loop(_) => return Err(err(span, "`loop` is not supported; use `for i in range(lo, hi, step)`")),
        Expr::Match(_) => return Err(err(span, "`match` is not supported; use `if`/`else`")),
        Expr::Return(_) | Expr::Break(_) | Expr::Continue(_) => {
            return Err(err(
                span,
                "early exits (`return`, `break`, `continue`) are not supported: tile programs are structured",
            ))
        }
        Expr::Reference(_) => {
            return Err(err(span, "references are not part of the DSL (tiles and tensors are passed by value)"))
        }
        Expr::Index(ix) => {
            let Expr::Path(p) = &*ix.expr else {
                return Err(err(ix.expr.span(), "only a tensor parameter is indexed: `doc[q_idx]`"));
            };
            let Some(id) = p.path.get_ident() else {
                return Err(err(ix.expr.span(), "only a tensor parameter is indexed: `doc[q_idx]`"));
            };
            let idx = match &*ix.index {
                Expr::Array(a) => a.elems.iter().map(expr).collect::<syn::Result<_>>()?,
                one => vec![expr(one)?],
            };
            Expr_::Index(id.clone(), idx, span)
        }
        Expr::Struct(_) | Expr::Tuple(_) => return Err(err(span, "structs and tuples are not part of the DSL")),
        Expr::Unsafe(_) => return Err(err(span, "`unsafe` is not part of the DSL")),
        Expr::Field(_) => return Err(err(span, "field access is not part of the DSL")),
        Expr::Range(_) => return Err(err(span, "ranges only appear in `for` loops")),
        other => {
            return Err(err(
                other.span(),
                format!("this expression is not part of the tile DSL; allowed: {STATEMENTS}"),
            ))
        }
    })
}
