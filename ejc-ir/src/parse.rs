//! Parser for the text form written by [`crate::print`]; `print(parse(text)) == text`
//! for every printed kernel, and the parsed kernel is verified.
//!
//! ```
//! use ejc_ir::parse::parse_kernel;
//! let k = parse_kernel("kernel @k(%n: i32) grid(1, 1, 1) {\n  %0 = arith.add %n, %n : i32\n}\n").unwrap();
//! assert_eq!(k.op_count(), 1);
//! let e = parse_kernel("kernel @k() grid(1, 1, 1) {\n  %0 = arith.frob : i32\n}\n").unwrap_err();
//! assert_eq!(e.to_string(), "2:8: unknown op `arith.frob`");
//! ```
//!
//! Errors carry `line:column`. Names may be any `%identifier`; they are only
//! labels (the printer renumbers).

use std::collections::HashMap;
use std::fmt;

use crate::builder::result_count;
use crate::ir::{AxisIndex, Block, GridExpr, Kernel, MaskTerm, Op, OpKind, Param, Value};
use crate::ir::{BIN_OPS, CMP_PREDS, REDUCE_OPS, UN_OPS};
use crate::types::{DType, Type};
use crate::verify::verify;

#[derive(Clone, Debug, PartialEq)]
pub struct ParseError {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            f.write_str(&self.message)
        } else {
            write!(f, "{}:{}: {}", self.line, self.column, self.message)
        }
    }
}

impl std::error::Error for ParseError {}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    /// `%name`
    Val(String),
    /// `@name`
    Sym(String),
    Ident(String),
    Num(String),
    Str(String),
    Ty(Type),
    Punct(&'static str),
    Eof,
}

impl fmt::Display for Tok {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Val(s) => write!(f, "`%{s}`"),
            Tok::Sym(s) => write!(f, "`@{s}`"),
            Tok::Ident(s) | Tok::Num(s) => write!(f, "`{s}`"),
            Tok::Str(s) => write!(f, "{s:?}"),
            Tok::Ty(t) => write!(f, "`{t}`"),
            Tok::Punct(p) => write!(f, "`{p}`"),
            Tok::Eof => f.write_str("end of input"),
        }
    }
}

struct Lexer<'a> {
    src: &'a [u8],
    pos: usize,
    line: usize,
    col: usize,
}

const PUNCTS: [&str; 13] = ["+:", "(", ")", "[", "]", "{", "}", "<", ">", ",", ":", "=", "-"];

impl<'a> Lexer<'a> {
    fn err(&self, message: String) -> ParseError {
        ParseError { line: self.line, column: self.col, message }
    }

    fn bump(&mut self) -> u8 {
        let c = self.src[self.pos];
        self.pos += 1;
        if c == b'\n' {
            self.line += 1;
            self.col = 1;
        } else {
            self.col += 1;
        }
        c
    }

    fn peek(&self) -> Option<u8> {
        self.src.get(self.pos).copied()
    }

    /// The rest of a `\u{XXXX}` escape (after the `u`): one to six hex digits naming a
    /// character.
    fn unicode_escape(&mut self) -> Result<char, ParseError> {
        let bad = |l: &Self| l.err("bad `\\u{...}` escape in string".into());
        if self.peek() != Some(b'{') {
            return Err(bad(self));
        }
        self.bump();
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_hexdigit()) && self.pos - start < 6 {
            self.bump();
        }
        let digits = std::str::from_utf8(&self.src[start..self.pos]).unwrap_or_default();
        let c = u32::from_str_radix(digits, 16).ok().and_then(char::from_u32);
        match (c, self.peek()) {
            (Some(c), Some(b'}')) => {
                self.bump();
                Ok(c)
            }
            _ => Err(bad(self)),
        }
    }

    fn ident_tail(&mut self) -> String {
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c.is_ascii_alphanumeric() || c == b'_' || c == b'.' {
                self.bump();
            } else {
                break;
            }
        }
        String::from_utf8_lossy(&self.src[start..self.pos]).into_owned()
    }

    /// All tokens with their positions.
    fn run(mut self) -> Result<Vec<(Tok, usize, usize)>, ParseError> {
        let mut out = Vec::new();
        loop {
            while let Some(c) = self.peek() {
                if c.is_ascii_whitespace() {
                    self.bump();
                } else if c == b'/' && self.src.get(self.pos + 1) == Some(&b'/') {
                    while self.peek().is_some_and(|c| c != b'\n') {
                        self.bump();
                    }
                } else {
                    break;
                }
            }
            let (line, col) = (self.line, self.col);
            let Some(c) = self.peek() else {
                out.push((Tok::Eof, line, col));
                return Ok(out);
            };
            let tok = if c == b'%' || c == b'@' {
                self.bump();
                let name = self.ident_tail();
                if name.is_empty() {
                    return Err(self.err(format!("expected a name after `{}`", c as char)));
                }
                if c == b'%' {
                    Tok::Val(name)
                } else {
                    Tok::Sym(name)
                }
            } else if c == b'"' {
                self.bump();
                let mut s = String::new();
                loop {
                    match self.peek() {
                        None | Some(b'\n') => {
                            return Err(ParseError { line, column: col, message: "unterminated string".into() })
                        }
                        Some(b'"') => {
                            self.bump();
                            break;
                        }
                        Some(b'\\') => {
                            self.bump();
                            match self.peek() {
                                Some(b'"') | Some(b'\\') => s.push(self.bump() as char),
                                Some(b'n') => {
                                    self.bump();
                                    s.push('\n')
                                }
                                // The printer writes strings as Rust's `{:?}` does: these
                                // escapes too (control characters, `\u{..}` for the
                                // characters it will not show raw).
                                Some(b't') => {
                                    self.bump();
                                    s.push('\t')
                                }
                                Some(b'r') => {
                                    self.bump();
                                    s.push('\r')
                                }
                                Some(b'0') => {
                                    self.bump();
                                    s.push('\0')
                                }
                                Some(b'\'') => s.push(self.bump() as char),
                                Some(b'u') => {
                                    self.bump();
                                    s.push(self.unicode_escape()?);
                                }
                                _ => return Err(self.err("unknown escape in string".into())),
                            }
                        }
                        Some(_) => {
                            // Keep multi-byte UTF-8 intact.
                            let start = self.pos;
                            self.bump();
                            while self.peek().is_some_and(|b| (b & 0xC0) == 0x80) {
                                self.bump();
                            }
                            s.push_str(&String::from_utf8_lossy(&self.src[start..self.pos]));
                        }
                    }
                }
                Tok::Str(s)
            } else if c.is_ascii_digit()
                || (c == b'-' && self.src.get(self.pos + 1).is_some_and(|d| d.is_ascii_digit() || *d == b'i'))
            {
                let start = self.pos;
                self.bump();
                while let Some(d) = self.peek() {
                    let prev = self.src[self.pos - 1];
                    if d.is_ascii_alphanumeric()
                        || d == b'.'
                        || ((d == b'-' || d == b'+') && (prev == b'e' || prev == b'E'))
                    {
                        self.bump();
                    } else {
                        break;
                    }
                }
                Tok::Num(String::from_utf8_lossy(&self.src[start..self.pos]).into_owned())
            } else if c.is_ascii_alphabetic() || c == b'_' {
                let word = self.ident_tail();
                if (word == "tile" || word == "tensor") && self.peek() == Some(b'<') {
                    self.bump();
                    let start = self.pos;
                    while self.peek().is_some_and(|c| c != b'>' && c != b'\n') {
                        self.bump();
                    }
                    if self.peek() != Some(b'>') {
                        return Err(ParseError {
                            line,
                            column: col,
                            message: format!("unterminated `{word}<...>` type"),
                        });
                    }
                    let inner = String::from_utf8_lossy(&self.src[start..self.pos]).into_owned();
                    self.bump();
                    Tok::Ty(parse_shaped_type(&word, &inner).map_err(|m| ParseError {
                        line,
                        column: col,
                        message: m,
                    })?)
                } else {
                    Tok::Ident(word)
                }
            } else {
                let rest = &self.src[self.pos..];
                let Some(p) = PUNCTS.iter().find(|p| rest.starts_with(p.as_bytes())) else {
                    return Err(self.err(format!("unexpected character `{}`", c as char)));
                };
                for _ in 0..p.len() {
                    self.bump();
                }
                Tok::Punct(p)
            };
            out.push((tok, line, col));
        }
    }
}

fn parse_shaped_type(word: &str, inner: &str) -> Result<Type, String> {
    let parts: Vec<&str> = inner.split('x').collect();
    let (dims, dt) = parts.split_at(parts.len() - 1);
    let dtype: DType = dt[0].trim().parse()?;
    if word == "tensor" {
        if dims.iter().any(|d| d.trim() != "?") {
            return Err(format!("tensor dims must be `?` (run-time), found `tensor<{inner}>`"));
        }
        return Ok(Type::Tensor(dtype, dims.len()));
    }
    let mut shape = Vec::new();
    for d in dims {
        shape.push(d.trim().parse::<usize>().map_err(|_| format!("bad tile dimension `{d}` in `tile<{inner}>`"))?);
    }
    if shape.is_empty() {
        return Err(format!("`tile<{inner}>` has no dimensions"));
    }
    Ok(Type::Tile(dtype, shape))
}

/// Parse and verify one kernel.
pub fn parse_kernel(text: &str) -> Result<Kernel, ParseError> {
    let toks = Lexer { src: text.as_bytes(), pos: 0, line: 1, col: 1 }.run()?;
    let mut p = Parser { toks, pos: 0, values: Vec::new(), scopes: vec![HashMap::new()], op_start: 0, depth: 0 };
    let kernel = p.kernel()?;
    if p.peek() != &Tok::Eof {
        return Err(p.err(format!("unexpected {} after the kernel", p.peek())));
    }
    verify(&kernel).map_err(|e| ParseError { line: 0, column: 0, message: e.to_string() })?;
    Ok(kernel)
}

struct Parser {
    toks: Vec<(Tok, usize, usize)>,
    pos: usize,
    values: Vec<Type>,
    /// Visible names per open region.
    scopes: Vec<HashMap<String, Value>>,
    /// Token index of the op being parsed (its name), where errors about the op as a
    /// whole point.
    op_start: usize,
    /// How deeply nested the parse is now (regions, attribute lists, grid formulas).
    depth: usize,
}

/// Nesting deeper than this (regions in regions, lists in attribute lists, formulas in
/// grid formulas) is an error: the parser, the verifier, the printer and the passes
/// recurse on it, so an input nested thousands deep would overflow the stack. No kernel
/// comes near (flash's deepest region is 3 levels).
pub const MAX_NESTING: usize = 64;

/// An attribute value.
#[derive(Clone, Debug)]
enum Attr {
    Flag,
    Word(String),
    Num(String),
    List(Vec<Attr>),
}

impl Parser {
    /// Run `f` one nesting level deeper, or refuse past [`MAX_NESTING`].
    fn nested<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T, ParseError>) -> Result<T, ParseError> {
        if self.depth >= MAX_NESTING {
            return Err(self.err(format!("nested more than {MAX_NESTING} levels deep")));
        }
        self.depth += 1;
        let r = f(self);
        self.depth -= 1;
        r
    }

    /// The current token; past the end, the end-of-input token.
    fn tok(&self) -> &(Tok, usize, usize) {
        &self.toks[self.pos.min(self.toks.len() - 1)]
    }

    fn peek(&self) -> &Tok {
        &self.tok().0
    }

    fn err(&self, message: String) -> ParseError {
        let (_, line, column) = *self.tok();
        ParseError { line, column, message }
    }

    /// An error about the op being parsed as a whole, at its name.
    fn op_err(&self, message: String) -> ParseError {
        let (_, line, column) = self.toks[self.op_start];
        ParseError { line, column, message }
    }

    /// Take the current token. This advances even past the end of input, so that a
    /// caller's `self.pos -= 1` always lands back on the token it took.
    fn next(&mut self) -> Tok {
        let t = self.peek().clone();
        self.pos += 1;
        t
    }

    fn eat(&mut self, p: &str) -> bool {
        if matches!(self.peek(), Tok::Punct(q) if *q == p) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, p: &str) -> Result<(), ParseError> {
        if self.eat(p) {
            Ok(())
        } else {
            Err(self.err(format!("expected `{p}`, found {}", self.peek())))
        }
    }

    fn keyword(&mut self, kw: &str) -> Result<(), ParseError> {
        match self.peek() {
            Tok::Ident(w) if w == kw => {
                self.pos += 1;
                Ok(())
            }
            t => Err(self.err(format!("expected `{kw}`, found {t}"))),
        }
    }

    fn is_keyword(&self, kw: &str) -> bool {
        matches!(self.peek(), Tok::Ident(w) if w == kw)
    }

    fn int(&mut self) -> Result<i64, ParseError> {
        match self.peek().clone() {
            Tok::Num(n) => {
                let v = n.parse::<i64>().map_err(|_| self.err(format!("expected an integer, found `{n}`")))?;
                self.pos += 1;
                Ok(v)
            }
            t => Err(self.err(format!("expected an integer, found {t}"))),
        }
    }

    fn value_name(&mut self) -> Result<String, ParseError> {
        match self.peek().clone() {
            Tok::Val(n) => {
                self.pos += 1;
                Ok(n)
            }
            t => Err(self.err(format!("expected a value (`%name`), found {t}"))),
        }
    }

    /// The name of a value being defined; one already visible is an error at the name.
    fn def_name(&mut self) -> Result<String, ParseError> {
        let name = self.value_name()?;
        if self.scopes.iter().any(|s| s.contains_key(&name)) {
            self.pos -= 1;
            return Err(self.err(format!("value `%{name}` is defined twice")));
        }
        Ok(name)
    }

    /// A use of a value.
    fn use_value(&mut self) -> Result<Value, ParseError> {
        let name = self.value_name()?;
        for s in self.scopes.iter().rev() {
            if let Some(v) = s.get(&name) {
                return Ok(*v);
            }
        }
        self.pos -= 1;
        Err(self.err(format!("use of undefined value `%{name}`")))
    }

    fn define(&mut self, name: &str, ty: Type) -> Result<Value, ParseError> {
        if self.scopes.iter().any(|s| s.contains_key(name)) {
            return Err(self.err(format!("value `%{name}` is defined twice")));
        }
        self.values.push(ty);
        let v = Value(self.values.len() as u32 - 1);
        self.scopes.last_mut().expect("scope open").insert(name.to_string(), v);
        Ok(v)
    }

    fn ty(&mut self) -> Result<Type, ParseError> {
        match self.peek().clone() {
            Tok::Ty(t) => {
                self.pos += 1;
                Ok(t)
            }
            Tok::Ident(w) => {
                let d: DType = w.parse().map_err(|e: String| self.err(e))?;
                self.pos += 1;
                Ok(Type::Scalar(d))
            }
            t => Err(self.err(format!("expected a type, found {t}"))),
        }
    }

    fn grid_expr(&mut self) -> Result<GridExpr, ParseError> {
        match self.next() {
            Tok::Num(n) => n.parse().map(GridExpr::Const).map_err(|_| self.err(format!("bad grid constant `{n}`"))),
            Tok::Ident(w) if w == "cdiv" && self.eat("(") => {
                let a = self.nested(Self::grid_expr)?;
                self.expect(",")?;
                let b = self.int()?;
                if b <= 0 {
                    return Err(self.err("cdiv divisor must be positive".into()));
                }
                self.expect(")")?;
                Ok(GridExpr::cdiv(a, b))
            }
            Tok::Ident(w) if matches!(w.as_str(), "mul" | "add" | "max") && self.eat("(") => {
                let a = self.nested(Self::grid_expr)?;
                self.expect(",")?;
                let b = self.nested(Self::grid_expr)?;
                self.expect(")")?;
                Ok(match w.as_str() {
                    "mul" => GridExpr::times(a, b),
                    "add" => GridExpr::plus(a, b),
                    _ => GridExpr::max_of(a, b),
                })
            }
            Tok::Ident(w) => Ok(GridExpr::Sym(w)),
            t => {
                self.pos -= 1;
                Err(self.err(format!("expected a grid expression, found {t}")))
            }
        }
    }

    fn kernel(&mut self) -> Result<Kernel, ParseError> {
        self.keyword("kernel")?;
        let name = match self.next() {
            Tok::Sym(s) => s,
            t => {
                self.pos -= 1;
                return Err(self.err(format!("expected the kernel name `@name`, found {t}")));
            }
        };
        self.expect("(")?;
        let mut params = Vec::new();
        if !self.eat(")") {
            loop {
                let pname = self.def_name()?;
                if pname.bytes().all(|b| b.is_ascii_digit()) {
                    self.pos -= 1;
                    return Err(self.err(format!(
                        "parameter `%{pname}` is named by a number; parameters need a name (`%q`): the printer numbers the body's values"
                    )));
                }
                self.expect(":")?;
                let ty = self.ty()?;
                if ty.is_tile() {
                    return Err(self.err(format!("parameter `%{pname}` is a tile; parameters are tensors or scalars")));
                }
                let value = self.define(&pname, ty.clone())?;
                params.push(Param { name: pname, value, ty });
                if self.eat(")") {
                    break;
                }
                self.expect(",")?;
            }
        }
        self.keyword("grid")?;
        self.expect("(")?;
        let g0 = self.grid_expr()?;
        self.expect(",")?;
        let g1 = self.grid_expr()?;
        self.expect(",")?;
        let g2 = self.grid_expr()?;
        self.expect(")")?;
        let mut attrs = Vec::new();
        if self.is_keyword("attrs") {
            self.pos += 1;
            self.expect("{")?;
            loop {
                let key = match self.next() {
                    Tok::Ident(k) => k,
                    t => {
                        self.pos -= 1;
                        return Err(self.err(format!("expected an attribute name, found {t}")));
                    }
                };
                self.expect("=")?;
                let v = match self.next() {
                    Tok::Str(s) => s,
                    t => {
                        self.pos -= 1;
                        return Err(self.err(format!("expected a string, found {t}")));
                    }
                };
                attrs.push((key, v));
                if self.eat("}") {
                    break;
                }
                self.expect(",")?;
            }
        }
        self.expect("{")?;
        let body = self.ops_until_close()?;
        Ok(Kernel {
            name,
            params,
            grid: [g0, g1, g2],
            attrs,
            body: Block { args: vec![], ops: body },
            values: std::mem::take(&mut self.values),
        })
    }

    /// Ops up to and including the closing `}`.
    fn ops_until_close(&mut self) -> Result<Vec<Op>, ParseError> {
        let mut ops = Vec::new();
        while !self.eat("}") {
            if self.peek() == &Tok::Eof {
                return Err(self.err("expected `}` before the end of input".into()));
            }
            ops.push(self.op()?);
        }
        Ok(ops)
    }

    fn region(&mut self, args: Vec<(String, Type)>) -> Result<Block, ParseError> {
        self.nested(|p| p.region_body(args))
    }

    fn region_body(&mut self, args: Vec<(String, Type)>) -> Result<Block, ParseError> {
        self.scopes.push(HashMap::new());
        let mut values = Vec::new();
        for (n, t) in args {
            values.push(self.define(&n, t)?);
        }
        let ops = self.ops_until_close()?;
        self.scopes.pop();
        Ok(Block { args: values, ops })
    }

    fn op(&mut self) -> Result<Op, ParseError> {
        let mut result_names = Vec::new();
        if matches!(self.peek(), Tok::Val(_)) {
            loop {
                let name = self.def_name()?;
                if result_names.contains(&name) {
                    self.pos -= 1;
                    return Err(self.err(format!("value `%{name}` is defined twice")));
                }
                result_names.push(name);
                if !self.eat(",") {
                    break;
                }
            }
            self.expect("=")?;
        }
        let op_pos = self.pos;
        self.op_start = op_pos;
        let name = match self.next() {
            Tok::Ident(n) => n,
            t => {
                self.pos -= 1;
                return Err(self.err(format!("expected an op name, found {t}")));
            }
        };
        let unknown = |p: &Parser| ParseError {
            line: p.toks[op_pos].1,
            column: p.toks[op_pos].2,
            message: format!("unknown op `{name}`"),
        };
        match name.as_str() {
            "scf.for" => return self.for_op(result_names),
            "scf.if" => return self.if_op(result_names),
            "tile.load" | "tile.store" | "tile.atomic_add" => return self.access_op(&name, result_names),
            "const" => {
                let text = match self.next() {
                    Tok::Num(n) | Tok::Ident(n) => n,
                    t => {
                        self.pos -= 1;
                        return Err(self.err(format!("expected a constant, found {t}")));
                    }
                };
                self.expect(":")?;
                let ty = self.ty()?;
                let value = parse_float(&text).ok_or_else(|| self.err(format!("bad constant `{text}`")))?;
                let kind = OpKind::Const { value, dtype: ty.dtype() };
                return self.finish_generic(kind, vec![], result_names, vec![ty]);
            }
            _ => {}
        }
        // Generic form: operands, attributes, result types.
        let mut operands = Vec::new();
        if matches!(self.peek(), Tok::Val(_)) {
            loop {
                operands.push(self.use_value()?);
                if !self.eat(",") {
                    break;
                }
            }
        }
        let mut attrs: Vec<(String, Attr)> = Vec::new();
        if self.eat("{") {
            loop {
                let key = match self.next() {
                    Tok::Ident(k) => k,
                    t => {
                        self.pos -= 1;
                        return Err(self.err(format!("expected an attribute name, found {t}")));
                    }
                };
                let v = if self.eat("=") { self.attr_value()? } else { Attr::Flag };
                attrs.push((key, v));
                if self.eat("}") {
                    break;
                }
                self.expect(",")?;
            }
        }
        let mut types = Vec::new();
        if self.eat(":") {
            loop {
                types.push(self.ty()?);
                if !self.eat(",") {
                    break;
                }
            }
        }
        let kind = self.kind_of(&name, &attrs).map_err(|m| match m {
            None => unknown(self),
            Some(m) => {
                ParseError { line: self.toks[op_pos].1, column: self.toks[op_pos].2, message: format!("`{name}`: {m}") }
            }
        })?;
        self.finish_generic(kind, operands, result_names, types)
    }

    fn finish_generic(
        &mut self,
        kind: OpKind,
        operands: Vec<Value>,
        names: Vec<String>,
        types: Vec<Type>,
    ) -> Result<Op, ParseError> {
        let want = result_count(&kind);
        if names.len() != want || types.len() != want {
            return Err(self.op_err(format!(
                "`{}` has {want} result(s); found {} name(s) and {} type(s)",
                kind.name(),
                names.len(),
                types.len()
            )));
        }
        let mut results = Vec::new();
        for (n, t) in names.iter().zip(types) {
            results.push(self.define(n, t)?);
        }
        Ok(Op { kind, operands, results, regions: vec![] })
    }

    fn attr_value(&mut self) -> Result<Attr, ParseError> {
        match self.next() {
            Tok::Ident(w) => Ok(Attr::Word(w)),
            Tok::Num(n) => Ok(Attr::Num(n)),
            Tok::Punct("[") => {
                let mut items = Vec::new();
                if !self.eat("]") {
                    loop {
                        items.push(self.nested(Self::attr_value)?);
                        if self.eat("]") {
                            break;
                        }
                        self.expect(",")?;
                    }
                }
                Ok(Attr::List(items))
            }
            t => {
                self.pos -= 1;
                Err(self.err(format!("expected an attribute value, found {t}")))
            }
        }
    }

    /// The op kind of a generic op from its name and attributes. `Err(None)` = unknown
    /// op; `Err(Some(msg))` = bad attributes.
    fn kind_of(&self, name: &str, attrs: &[(String, Attr)]) -> Result<OpKind, Option<String>> {
        let get = |k: &str| attrs.iter().find(|(n, _)| n == k).map(|(_, v)| v);
        let known = |allowed: &[&str]| -> Result<(), Option<String>> {
            for (k, _) in attrs {
                if !allowed.contains(&k.as_str()) {
                    return Err(Some(format!(
                        "unknown attribute `{k}` (allowed: {})",
                        if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
                    )));
                }
            }
            Ok(())
        };
        let int_attr = |k: &str| -> Result<i64, Option<String>> {
            match get(k) {
                Some(Attr::Num(n)) => n.parse().map_err(|_| Some(format!("attribute `{k}` must be an integer"))),
                Some(_) => Err(Some(format!("attribute `{k}` must be an integer"))),
                None => Err(Some(format!("missing integer attribute `{k}`"))),
            }
        };
        let axis = || -> Result<u8, Option<String>> {
            let a = int_attr("axis")?;
            u8::try_from(a).map_err(|_| Some(format!("axis {a} out of range")))
        };
        let shape = |k: &str| -> Result<Vec<usize>, Option<String>> {
            match get(k) {
                Some(Attr::List(items)) => items
                    .iter()
                    .map(|i| match i {
                        Attr::Num(n) => {
                            n.parse::<usize>().map_err(|_| Some(format!("`{k}` must list non-negative integers")))
                        }
                        _ => Err(Some(format!("`{k}` must list integers"))),
                    })
                    .collect(),
                Some(_) => Err(Some(format!("attribute `{k}` must be a list of integers"))),
                None => Err(Some(format!("missing list attribute `{k}`"))),
            }
        };
        let terms = || -> Result<Vec<MaskTerm>, Option<String>> {
            match get("terms") {
                Some(Attr::List(items)) => items
                    .iter()
                    .map(|i| match i {
                        Attr::Word(w) => MaskTerm::from_name(w).ok_or_else(|| {
                            Some(format!("unknown mask term `{w}` (known: col_le_row, col_ge_row, col_lt, row_lt)"))
                        }),
                        _ => Err(Some("`terms` must list mask term names".to_string())),
                    })
                    .collect(),
                Some(_) => Err(Some("attribute `terms` must be a list of mask term names".to_string())),
                None => Err(Some("missing attribute `terms`".to_string())),
            }
        };
        let block = || -> Result<(usize, usize), Option<String>> {
            let b = shape("block")?;
            if b.len() != 2 {
                return Err(Some("`block` must be [bm, bn]".into()));
            }
            Ok((b[0], b[1]))
        };
        Ok(match name {
            "program.id" => {
                known(&["axis"])?;
                OpKind::ProgramId { axis: axis()? }
            }
            "program.dim" => {
                known(&["axis"])?;
                OpKind::TensorDim { axis: axis()? }
            }
            "tile.arange" => {
                known(&["len"])?;
                OpKind::Arange { len: int_attr("len")?.max(0) as usize }
            }
            "tile.splat" => {
                known(&["shape"])?;
                OpKind::Splat { shape: shape("shape")? }
            }
            "tile.broadcast" => {
                known(&["shape"])?;
                OpKind::Broadcast { shape: shape("shape")? }
            }
            "tile.expand_dims" => {
                known(&["axis"])?;
                OpKind::ExpandDims { axis: axis()? }
            }
            "rand.uniform" => {
                known(&["shape"])?;
                OpKind::RandUniform { shape: shape("shape")? }
            }
            "arith.select" => {
                known(&[])?;
                OpKind::Select
            }
            "arith.cast" => {
                known(&["to"])?;
                match get("to") {
                    Some(Attr::Word(w)) => OpKind::Cast { to: w.parse().map_err(Some)? },
                    Some(_) => return Err(Some("attribute `to` must be a dtype".into())),
                    None => return Err(Some("missing attribute `to`".into())),
                }
            }
            "tile.dot" => {
                known(&["trans_a", "trans_b"])?;
                OpKind::Dot { trans_a: get("trans_a").is_some(), trans_b: get("trans_b").is_some() }
            }
            "softmax.update" => {
                known(&[])?;
                OpKind::SoftmaxUpdate
            }
            "softmax.rescale" => {
                known(&[])?;
                OpKind::SoftmaxRescale
            }
            "softmax.finalize" => {
                known(&[])?;
                OpKind::SoftmaxFinalize
            }
            "mask.apply" => {
                known(&["terms"])?;
                OpKind::MaskApply { terms: terms()? }
            }
            "mask.block_full" => {
                known(&["terms", "block"])?;
                let (bm, bn) = block()?;
                OpKind::MaskBlockFull { terms: terms()?, bm, bn }
            }
            "mask.kv_range" => {
                known(&["terms", "block"])?;
                let (bm, bn) = block()?;
                OpKind::MaskKvRange { terms: terms()?, bm, bn }
            }
            "scf.yield" => {
                known(&[])?;
                OpKind::Yield
            }
            other => {
                let probe = |k: &OpKind| k.name() == other;
                if let Some(op) = BIN_OPS.iter().find(|o| probe(&OpKind::Binary(**o))) {
                    known(&[])?;
                    OpKind::Binary(*op)
                } else if let Some(op) = UN_OPS.iter().find(|o| probe(&OpKind::Unary(**o))) {
                    known(&[])?;
                    OpKind::Unary(*op)
                } else if let Some(p) = CMP_PREDS.iter().find(|o| probe(&OpKind::Cmp(**o))) {
                    known(&[])?;
                    OpKind::Cmp(*p)
                } else if let Some(op) = REDUCE_OPS.iter().find(|o| probe(&OpKind::Reduce { op: **o, axis: 0 })) {
                    known(&["axis"])?;
                    OpKind::Reduce { op: *op, axis: axis()? }
                } else {
                    return Err(None);
                }
            }
        })
    }

    fn access_op(&mut self, name: &str, result_names: Vec<String>) -> Result<Op, ParseError> {
        let tensor = self.use_value()?;
        self.expect("[")?;
        let mut axes = Vec::new();
        let mut operands = vec![tensor];
        loop {
            let start = self.use_value()?;
            operands.push(start);
            if self.eat("+:") {
                let size = self.int()?;
                if size <= 0 {
                    return Err(self.err("range size must be positive".into()));
                }
                let limit = if self.eat("<") {
                    operands.push(self.use_value()?);
                    true
                } else {
                    false
                };
                axes.push(AxisIndex::Range { size: size as usize, limit });
            } else {
                axes.push(AxisIndex::Index);
            }
            if self.eat("]") {
                break;
            }
            self.expect(",")?;
        }
        if name != "tile.load" {
            self.expect(",")?;
            operands.push(self.use_value()?);
            if !result_names.is_empty() {
                return Err(self.op_err(format!("`{name}` has no results")));
            }
            let accumulate = name == "tile.atomic_add";
            return Ok(Op { kind: OpKind::Store { axes, accumulate }, operands, results: vec![], regions: vec![] });
        }
        self.expect("{")?;
        self.keyword("pad")?;
        self.expect("=")?;
        let text = match self.next() {
            Tok::Num(n) | Tok::Ident(n) => n,
            t => {
                self.pos -= 1;
                return Err(self.err(format!("expected the pad value, found {t}")));
            }
        };
        let pad = parse_float(&text).ok_or_else(|| self.err(format!("bad pad value `{text}`")))?;
        self.expect("}")?;
        self.expect(":")?;
        let ty = self.ty()?;
        self.finish_generic(OpKind::Load { axes, pad }, operands, result_names, vec![ty])
    }

    fn for_op(&mut self, result_names: Vec<String>) -> Result<Op, ParseError> {
        let iv = self.def_name()?;
        self.expect("=")?;
        let lo = self.use_value()?;
        self.keyword("to")?;
        let hi = self.use_value()?;
        self.keyword("step")?;
        let step = self.use_value()?;
        let mut carried = Vec::new();
        let mut operands = vec![lo, hi, step];
        if self.is_keyword("iter_args") {
            self.pos += 1;
            self.expect("(")?;
            loop {
                let a = self.def_name()?;
                self.expect("=")?;
                let init = self.use_value()?;
                carried.push(a);
                operands.push(init);
                if self.eat(")") {
                    break;
                }
                self.expect(",")?;
            }
        }
        let mut types = Vec::new();
        if self.eat(":") {
            loop {
                types.push(self.ty()?);
                if !self.eat(",") {
                    break;
                }
            }
        }
        if types.len() != carried.len() || result_names.len() != carried.len() {
            return Err(self.op_err(format!(
                "`scf.for` carries {} value(s) but has {} result name(s) and {} type(s)",
                carried.len(),
                result_names.len(),
                types.len()
            )));
        }
        self.expect("{")?;
        let mut args = vec![(iv, Type::Scalar(DType::I32))];
        args.extend(carried.into_iter().zip(types.iter().cloned()));
        let body = self.region(args)?;
        // Results are defined after the body: the body cannot see them.
        let mut results = Vec::new();
        for (n, t) in result_names.iter().zip(types) {
            results.push(self.define(n, t)?);
        }
        Ok(Op { kind: OpKind::For, operands, results, regions: vec![body] })
    }

    fn if_op(&mut self, result_names: Vec<String>) -> Result<Op, ParseError> {
        let cond = self.use_value()?;
        let mut types = Vec::new();
        if self.eat(":") {
            loop {
                types.push(self.ty()?);
                if !self.eat(",") {
                    break;
                }
            }
        }
        if types.len() != result_names.len() {
            return Err(self.op_err(format!(
                "`scf.if` has {} result name(s) and {} type(s)",
                result_names.len(),
                types.len()
            )));
        }
        self.expect("{")?;
        let then_block = self.region(vec![])?;
        self.keyword("else")?;
        self.expect("{")?;
        let else_block = self.region(vec![])?;
        let mut results = Vec::new();
        for (n, t) in result_names.iter().zip(types) {
            results.push(self.define(n, t)?);
        }
        Ok(Op { kind: OpKind::If, operands: vec![cond], results, regions: vec![then_block, else_block] })
    }
}

fn parse_float(s: &str) -> Option<f64> {
    match s {
        "inf" => Some(f64::INFINITY),
        "-inf" => Some(f64::NEG_INFINITY),
        "NaN" | "nan" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}
