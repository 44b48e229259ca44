//! The verifier: rejects ill-formed or ill-typed IR with a message naming the op,
//! where it is, and the mismatch.
//!
//! ```
//! use ejc_ir::parse::parse_kernel;
//! let text = "kernel @bad() grid(1, 1, 1) {\n  %0 = const 1 : i32\n  %1 = const 2.0 : f32\n  %2 = arith.add %0, %1 : i32\n}\n";
//! let err = parse_kernel(text).unwrap_err();
//! assert!(err.to_string().contains("arith.add"), "{err}");
//! assert!(err.to_string().contains("dtypes differ"), "{err}");
//! ```
//!
//! Checks: every value is defined once and before its uses (SSA with structured
//! scopes: a value defined inside a region is not visible after it); every op's
//! recorded result types are what [`crate::infer::infer`] derives from its operands;
//! `scf.for` / `scf.if` regions have the right arguments and end in a `scf.yield`
//! whose types match; `scf.yield` appears only as a region's last op.

use std::fmt;

use crate::infer::infer;
use crate::ir::{Block, Kernel, Op, OpKind, Value};
use crate::types::{DType, Type};

#[derive(Clone, Debug, PartialEq)]
pub struct VerifyError {
    pub kernel: String,
    /// Where: e.g. `op 12 (scf.for) > region 0 > op 3 (arith.add)`.
    pub location: String,
    pub message: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid IR in kernel `{}` at {}: {}", self.kernel, self.location, self.message)
    }
}

impl std::error::Error for VerifyError {}

pub fn verify(kernel: &Kernel) -> Result<(), VerifyError> {
    let n = kernel.values.len();
    let mut v =
        Verifier { kernel, defined: vec![false; n], ever: vec![false; n], scopes: vec![Vec::new()], path: Vec::new() };
    for p in &kernel.params {
        v.define(p.value, &format!("parameter %{}", p.name))?;
        if kernel.ty(p.value) != &p.ty {
            return Err(v.err(format!(
                "parameter %{} has type {} but its value has {}",
                p.name,
                p.ty,
                kernel.ty(p.value)
            )));
        }
        if p.ty.is_tile() {
            return Err(v.err(format!("parameter %{} is a tile; parameters are tensors or scalars", p.name)));
        }
    }
    let mut names: Vec<&str> = kernel.params.iter().map(|p| p.name.as_str()).collect();
    names.sort();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(v.err(format!("two parameters are named %{}", w[0])));
    }
    v.block(&kernel.body, None)
}

struct Verifier<'k> {
    kernel: &'k Kernel,
    /// Values visible here.
    defined: Vec<bool>,
    /// Values defined anywhere so far, visible or not (one leaving its region is no
    /// longer visible, but may still not be defined again).
    ever: Vec<bool>,
    /// Values defined in each open scope, to retire them when the scope closes.
    scopes: Vec<Vec<Value>>,
    path: Vec<String>,
}

impl<'k> Verifier<'k> {
    fn err(&self, message: String) -> VerifyError {
        let location = if self.path.is_empty() { "kernel signature".to_string() } else { self.path.join(" > ") };
        VerifyError { kernel: self.kernel.name.clone(), location, message }
    }

    fn define(&mut self, v: Value, what: &str) -> Result<(), VerifyError> {
        if v.index() >= self.defined.len() {
            return Err(self.err(format!("{what} uses value #{} with no type entry", v.0)));
        }
        if self.ever[v.index()] {
            return Err(
                self.err(format!("{what} redefines a value that is already defined (SSA values are defined once)"))
            );
        }
        self.defined[v.index()] = true;
        self.ever[v.index()] = true;
        self.scopes.last_mut().expect("a scope is open").push(v);
        Ok(())
    }

    fn ty(&self, v: Value) -> &'k Type {
        self.kernel.ty(v)
    }

    /// `yields`: the types the region's terminating yield must have (None for the
    /// kernel body, which has no terminator).
    fn block(&mut self, block: &Block, yields: Option<&[Type]>) -> Result<(), VerifyError> {
        for (i, op) in block.ops.iter().enumerate() {
            self.path.push(format!("op {i} ({})", op.kind.name()));
            let is_last = i + 1 == block.ops.len();
            if matches!(op.kind, OpKind::Yield) {
                match yields {
                    None => return Err(self.err("`scf.yield` outside a region".into())),
                    Some(_) if !is_last => return Err(self.err("`scf.yield` must be the last op of its region".into())),
                    Some(want) => {
                        self.uses(op)?;
                        let got: Vec<Type> = op.operands.iter().map(|v| self.ty(*v).clone()).collect();
                        if got.as_slice() != want {
                            return Err(self.err(format!(
                                "yields ({}) but the region must yield ({})",
                                list(&got),
                                list(want)
                            )));
                        }
                    }
                }
            } else {
                self.op(op)?;
            }
            self.path.pop();
        }
        if yields.is_some() && !matches!(block.ops.last().map(|o| &o.kind), Some(OpKind::Yield)) {
            return Err(self.err("region does not end in `scf.yield`".into()));
        }
        Ok(())
    }

    fn uses(&self, op: &Op) -> Result<(), VerifyError> {
        for (i, v) in op.operands.iter().enumerate() {
            if v.index() >= self.defined.len() {
                return Err(self.err(format!("operand {i} uses value #{} with no type entry", v.0)));
            }
            if !self.defined[v.index()] {
                return Err(self
                    .err(format!("operand {i} is used before it is defined (or outside the region that defines it)")));
            }
        }
        Ok(())
    }

    fn region(&mut self, block: &Block, args: &[Type], yields: &[Type], which: &str) -> Result<(), VerifyError> {
        self.path.push(which.to_string());
        if block.args.len() != args.len() {
            return Err(self.err(format!("has {} argument(s), expected {}", block.args.len(), args.len())));
        }
        self.scopes.push(Vec::new());
        for (i, (a, t)) in block.args.iter().zip(args).enumerate() {
            self.define(*a, &format!("region argument {i}"))?;
            if self.ty(*a) != t {
                return Err(self.err(format!("argument {i} has type {}, expected {t}", self.ty(*a))));
            }
        }
        self.block(block, Some(yields))?;
        // Values of the region are not visible after it.
        for v in self.scopes.pop().expect("scope pushed above") {
            self.defined[v.index()] = false;
        }
        self.path.pop();
        Ok(())
    }

    fn op(&mut self, op: &Op) -> Result<(), VerifyError> {
        self.uses(op)?;
        if let Some((i, r)) = op.results.iter().enumerate().find(|(_, r)| r.index() >= self.defined.len()) {
            return Err(self.err(format!("result {i} uses value #{} with no type entry", r.0)));
        }
        let result_types: Vec<Type> = op.results.iter().map(|v| self.ty(*v).clone()).collect();
        match &op.kind {
            OpKind::For => {
                if op.operands.len() < 3 {
                    return Err(
                        self.err(format!("expects at least 3 operands (lo, hi, step), got {}", op.operands.len()))
                    );
                }
                for (i, name) in ["lower bound", "upper bound", "step"].iter().enumerate() {
                    let t = self.ty(op.operands[i]);
                    if *t != Type::Scalar(DType::I32) {
                        return Err(self.err(format!("{name} must be i32, found {t}")));
                    }
                }
                let inits: Vec<Type> = op.operands[3..].iter().map(|v| self.ty(*v).clone()).collect();
                if inits != result_types {
                    return Err(self.err(format!("carries ({}) but returns ({})", list(&inits), list(&result_types))));
                }
                if op.regions.len() != 1 {
                    return Err(self.err(format!("has {} regions, expected 1", op.regions.len())));
                }
                let mut args = vec![Type::Scalar(DType::I32)];
                args.extend(inits.iter().cloned());
                self.region(&op.regions[0], &args, &inits, "body")?;
            }
            OpKind::If => {
                if op.operands.len() != 1 {
                    return Err(self.err(format!("expects 1 operand (the condition), got {}", op.operands.len())));
                }
                let cond = self.ty(op.operands[0]);
                if *cond != Type::Scalar(DType::I1) {
                    return Err(self.err(format!("condition must be an i1 scalar, found {cond}")));
                }
                if op.regions.len() != 2 {
                    return Err(self.err(format!("has {} regions, expected 2 (then, else)", op.regions.len())));
                }
                self.region(&op.regions[0], &[], &result_types, "then")?;
                self.region(&op.regions[1], &[], &result_types, "else")?;
            }
            kind => {
                if !op.regions.is_empty() {
                    return Err(self.err("has regions but is not control flow".into()));
                }
                let operand_types: Vec<&Type> = op.operands.iter().map(|v| self.ty(*v)).collect();
                let want = infer(kind, &operand_types).map_err(|e| self.err(format!("`{}`: {e}", kind.name())))?;
                if want != result_types {
                    return Err(self.err(format!(
                        "`{}` produces ({}) but its results are typed ({})",
                        kind.name(),
                        list(&want),
                        list(&result_types)
                    )));
                }
            }
        }
        for (i, r) in op.results.iter().enumerate() {
            self.define(*r, &format!("result {i}"))?;
        }
        Ok(())
    }
}

fn list(ts: &[Type]) -> String {
    ts.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ")
}
