//! The stable text form of the tile IR (what snapshots record and `ejc build --target
//! ir` writes). [`crate::parse`] reads it back.
//!
//! ```
//! use ejc_ir::parse::parse_kernel;
//! use ejc_ir::print::print_kernel;
//! let text = "kernel @k(%x: tensor<?xf32>) grid(cdiv(n, 16), 1, 1) {\n  %0 = program.id {axis = 0} : i32\n}\n";
//! let kernel = parse_kernel(text).unwrap();
//! assert_eq!(print_kernel(&kernel), text);
//! ```
//!
//! Names are normalised: parameters keep their names, every other value is numbered
//! `%0, %1, ...` in order of definition (an op's results before the arguments of its
//! regions), so two structurally equal kernels print identically whatever ids their
//! values had in memory. Attributes print in a fixed order; floats print in Rust's
//! shortest round-trip form.
//!
//! Grammar (informal):
//! ```text
//! kernel   := "kernel" "@" NAME "(" params ")" "grid" "(" gexpr "," gexpr "," gexpr ")"
//!             [ "attrs" "{" NAME "=" STRING ("," ...)* "}" ] "{" op* "}"
//! op       := [ results "=" ] OPNAME operands [ "{" attr ("," attr)* "}" ] [ ":" types ]
//! load     := results "=" "tile.load" %t "[" axis ("," axis)* "]" "{" "pad" "=" NUM "}" ":" type
//! store    := ("tile.store" | "tile.atomic_add") %t "[" axis ("," axis)* "]" "," %v
//! axis     := %i | %start "+:" INT [ "<" %limit ]
//! for      := results "=" "scf.for" %iv "=" %lo "to" %hi "step" %s
//!             [ "iter_args" "(" %a "=" %init ("," ...)* ")" ] [ ":" types ] "{" op* "}"
//! if       := [ results "=" ] "scf.if" %c [ ":" types ] "{" op* "}" "else" "{" op* "}"
//! ```

use std::collections::HashMap;
use std::fmt::Write;

use crate::ir::{AxisIndex, Block, Kernel, Op, OpKind, Value};
use crate::types::Type;

pub fn print_kernel(kernel: &Kernel) -> String {
    let mut p = Printer { kernel, names: HashMap::new(), next: 0, out: String::new(), ids: None };
    p.kernel();
    p.out
}

/// The same text with each op's line headed by its id ([`crate::defuse::OpId`], `#n`:
/// pre-order), for reading dumps that name ops by id (the PTX schedule). Not parseable.
pub fn print_kernel_with_ids(kernel: &Kernel) -> String {
    let mut p = Printer { kernel, names: HashMap::new(), next: 0, out: String::new(), ids: Some(0) };
    p.kernel();
    p.out
}

/// The name each value has in [`print_kernel`]'s text (`%q`, `%14`).
pub fn value_names(kernel: &Kernel) -> HashMap<Value, String> {
    let mut p = Printer { kernel, names: HashMap::new(), next: 0, out: String::new(), ids: None };
    p.kernel();
    p.names
}

/// A float in shortest round-trip form (`1.0`, `0.125`, `-inf`, `NaN`, `1e-7`).
pub fn format_float(x: f64) -> String {
    if x.is_nan() {
        "NaN".into()
    } else if x.is_infinite() {
        if x > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        }
    } else {
        format!("{x:?}")
    }
}

struct Printer<'k> {
    kernel: &'k Kernel,
    names: HashMap<Value, String>,
    next: usize,
    out: String,
    /// The next op's id, when lines are headed by ids.
    ids: Option<u32>,
}

impl<'k> Printer<'k> {
    fn name(&mut self, v: Value) -> String {
        if let Some(n) = self.names.get(&v) {
            return n.clone();
        }
        // A use of a value never defined: print it distinctly so the verifier's
        // complaint can be matched to the text.
        format!("%undef{}", v.0)
    }

    fn def(&mut self, v: Value) -> String {
        let n = format!("%{}", self.next);
        self.next += 1;
        self.names.insert(v, n.clone());
        n
    }

    fn kernel(&mut self) {
        let k = self.kernel;
        let mut params = Vec::new();
        for p in &k.params {
            let n = format!("%{}", p.name);
            self.names.insert(p.value, n.clone());
            params.push(format!("{n}: {}", p.ty));
        }
        let _ = write!(
            self.out,
            "kernel @{}({}) grid({}, {}, {})",
            k.name,
            params.join(", "),
            k.grid[0],
            k.grid[1],
            k.grid[2]
        );
        if !k.attrs.is_empty() {
            let mut attrs = k.attrs.clone();
            attrs.sort();
            let body: Vec<String> = attrs.iter().map(|(a, b)| format!("{a} = {b:?}")).collect();
            let _ = write!(self.out, " attrs {{{}}}", body.join(", "));
        }
        self.out.push_str(" {\n");
        self.block(&k.body, 1);
        self.out.push_str("}\n");
    }

    fn block(&mut self, b: &Block, depth: usize) {
        for op in &b.ops {
            self.op(op, depth);
        }
    }

    fn types(&self, vs: &[Value]) -> String {
        vs.iter().map(|v| self.kernel.ty(*v).to_string()).collect::<Vec<_>>().join(", ")
    }

    fn operands(&mut self, vs: &[Value]) -> String {
        vs.iter().map(|v| self.name(*v)).collect::<Vec<_>>().join(", ")
    }

    fn access(&mut self, axes: &[AxisIndex], operands: &[Value]) -> String {
        let mut parts = Vec::new();
        let mut it = operands.iter();
        for a in axes {
            match a {
                AxisIndex::Index => parts.push(self.name(*it.next().expect("verified operand count"))),
                AxisIndex::Range { size, limit } => {
                    let start = self.name(*it.next().expect("verified operand count"));
                    if *limit {
                        let l = self.name(*it.next().expect("verified operand count"));
                        parts.push(format!("{start} +: {size} < {l}"));
                    } else {
                        parts.push(format!("{start} +: {size}"));
                    }
                }
            }
        }
        parts.join(", ")
    }

    fn op(&mut self, op: &Op, depth: usize) {
        let (indent, close) = match self.ids.as_mut() {
            Some(n) => {
                let id = format!("#{n}");
                *n += 1;
                let pad = "  ".repeat(depth);
                (format!("{id:<6}{pad}"), format!("{:<6}{pad}", ""))
            }
            None => ("  ".repeat(depth), "  ".repeat(depth)),
        };
        let results: Vec<String> = op.results.iter().map(|r| self.def(*r)).collect();
        let lhs = if results.is_empty() { String::new() } else { format!("{} = ", results.join(", ")) };
        let name = op.kind.name();
        let tys = self.types(&op.results);
        let colon_tys = if tys.is_empty() { String::new() } else { format!(" : {tys}") };
        match &op.kind {
            OpKind::For => {
                let lo = self.name(op.operands[0]);
                let hi = self.name(op.operands[1]);
                let step = self.name(op.operands[2]);
                let body = &op.regions[0];
                let iv = self.def(body.args[0]);
                let mut carried = Vec::new();
                for (a, init) in body.args[1..].iter().zip(&op.operands[3..]) {
                    let an = self.def(*a);
                    let init = self.name(*init);
                    carried.push(format!("{an} = {init}"));
                }
                let iter =
                    if carried.is_empty() { String::new() } else { format!(" iter_args({})", carried.join(", ")) };
                let _ = writeln!(self.out, "{indent}{lhs}{name} {iv} = {lo} to {hi} step {step}{iter}{colon_tys} {{");
                self.block(body, depth + 1);
                let _ = writeln!(self.out, "{close}}}");
            }
            OpKind::If => {
                let c = self.name(op.operands[0]);
                let _ = writeln!(self.out, "{indent}{lhs}{name} {c}{colon_tys} {{");
                self.block(&op.regions[0], depth + 1);
                let _ = writeln!(self.out, "{close}}} else {{");
                self.block(&op.regions[1], depth + 1);
                let _ = writeln!(self.out, "{close}}}");
            }
            OpKind::Load { axes, pad } => {
                let t = self.name(op.operands[0]);
                let acc = self.access(axes, &op.operands[1..]);
                let _ =
                    writeln!(self.out, "{indent}{lhs}{name} {t}[{acc}] {{pad = {}}}{colon_tys}", format_float(*pad));
            }
            OpKind::Store { axes, .. } => {
                let t = self.name(op.operands[0]);
                let n = op.operands.len();
                let acc = self.access(axes, &op.operands[1..n - 1]);
                let v = self.name(op.operands[n - 1]);
                let _ = writeln!(self.out, "{indent}{name} {t}[{acc}], {v}");
            }
            OpKind::Const { value, dtype } => {
                let v = if dtype.is_float() { format_float(*value) } else { format!("{}", *value as i64) };
                let _ = writeln!(self.out, "{indent}{lhs}{name} {v}{colon_tys}");
            }
            kind => {
                let ops = self.operands(&op.operands);
                let attrs = attrs_of(kind);
                let mut line = format!("{indent}{lhs}{name}");
                if !ops.is_empty() {
                    line.push(' ');
                    line.push_str(&ops);
                }
                if !attrs.is_empty() {
                    let _ = write!(line, " {{{}}}", attrs.join(", "));
                }
                line.push_str(&colon_tys);
                self.out.push_str(&line);
                self.out.push('\n');
            }
        }
    }
}

fn shape_attr(s: &[usize]) -> String {
    format!("[{}]", s.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "))
}

/// The attribute list of a generic op, in print order.
fn attrs_of(kind: &OpKind) -> Vec<String> {
    use OpKind::*;
    match kind {
        ProgramId { axis } | TensorDim { axis } | ExpandDims { axis } => vec![format!("axis = {axis}")],
        Arange { len } => vec![format!("len = {len}")],
        Splat { shape } | Broadcast { shape } | RandUniform { shape } => vec![format!("shape = {}", shape_attr(shape))],
        Cast { to } => vec![format!("to = {to}")],
        Reduce { axis, .. } => vec![format!("axis = {axis}")],
        Dot { trans_a, trans_b } => {
            let mut v = Vec::new();
            if *trans_a {
                v.push("trans_a".to_string());
            }
            if *trans_b {
                v.push("trans_b".to_string());
            }
            v
        }
        MaskApply { terms } => {
            vec![format!("terms = [{}]", terms.iter().map(|t| t.name()).collect::<Vec<_>>().join(", "))]
        }
        MaskBlockFull { terms, bm, bn } | MaskKvRange { terms, bm, bn } => vec![
            format!("terms = [{}]", terms.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")),
            format!("block = [{bm}, {bn}]"),
        ],
        _ => vec![],
    }
}

/// Printed form of a type list, for messages.
pub fn type_list(ts: &[Type]) -> String {
    ts.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ")
}
