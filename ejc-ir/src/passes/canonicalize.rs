//! `canonicalize`: constant folding, algebraic identities and common-subexpression
//! elimination, repeated until nothing changes.
//!
//! ```text
//! %3 = const 0 : i32              %3 = const 0 : i32
//! %12 = arith.mul %0, %11 : i32   %12 = arith.mul %0, %11 : i32
//! %13 = arith.add %3, %12 : i32   (uses of %13 become %12)
//! %17 = const 0.0 : f32           %17 = const 0.0 : f32
//! %19 = const 0.0 : f32           (uses of %19 become %17)
//! ```
//!
//! * Folding: scalar integer and boolean `arith.*`, `math.*` and `cmp.*` ops whose
//!   operands are all constants become constants, computed with the interpreter's own
//!   semantics (so folding can never disagree with execution). Floats are not folded:
//!   a device computes them in f32 and the interpreter in f64, and a folded constant
//!   would match only one of them. Integer division by zero is left for run time.
//! * Identities: `x + 0`, `x - 0`, `min(x, i32::MAX)` (integers), `x * 1`, `x / 1`,
//!   `x and true`, `x or false`, when the
//!   result has x's type (no broadcast hides behind the identity). `x + 0.0` is not
//!   folded for floats: it turns −0 into +0.
//! * CSE: a pure op (loads excepted: a store may sit between two loads) equal to an
//!   earlier one in an enclosing scope is replaced by it. Ops inside a region may
//!   reuse values from outside it, never the reverse.

use std::collections::HashMap;

use super::util::{resolve, substitute};
use super::Pass;
use crate::interp::fold_scalar;
use crate::ir::{BinOp, Block, Kernel, Op, OpKind, Value};
use crate::types::{DType, Type};

pub struct Canonicalize;

impl Pass for Canonicalize {
    fn name(&self) -> &'static str {
        "canonicalize"
    }

    fn run(&self, kernel: &mut Kernel) {
        for _ in 0..16 {
            let mut cx = Cx {
                values: &kernel.values,
                consts: HashMap::new(),
                subst: HashMap::new(),
                scopes: vec![HashMap::new()],
                changed: false,
            };
            let body = std::mem::take(&mut kernel.body);
            let mut body = cx.block(body);
            let changed = cx.changed;
            let subst = std::mem::take(&mut cx.subst);
            substitute(&mut body, &subst);
            kernel.body = body;
            if !changed {
                break;
            }
        }
    }
}

struct Cx<'k> {
    values: &'k [Type],
    consts: HashMap<Value, (f64, DType)>,
    subst: HashMap<Value, Value>,
    /// CSE tables, innermost last.
    scopes: Vec<HashMap<String, Vec<Value>>>,
    changed: bool,
}

impl<'k> Cx<'k> {
    fn block(&mut self, mut block: Block) -> Block {
        let ops = std::mem::take(&mut block.ops);
        for mut op in ops {
            for v in &mut op.operands {
                *v = resolve(&self.subst, *v);
            }
            if !op.regions.is_empty() {
                let regions = std::mem::take(&mut op.regions);
                op.regions = regions
                    .into_iter()
                    .map(|r| {
                        self.scopes.push(HashMap::new());
                        let r = self.block(r);
                        self.scopes.pop();
                        r
                    })
                    .collect();
            }
            if let Some(op) = self.simplify(op) {
                block.ops.push(op);
            }
        }
        block
    }

    fn ty(&self, v: Value) -> &Type {
        &self.values[v.index()]
    }

    fn constant(&self, v: Value) -> Option<f64> {
        self.consts.get(&v).map(|c| c.0)
    }

    /// Rewrite one op; None drops it (its results were substituted).
    fn simplify(&mut self, mut op: Op) -> Option<Op> {
        // Fold scalar ops with constant operands.
        if matches!(
            op.kind,
            OpKind::Binary(_) | OpKind::Unary(_) | OpKind::Cmp(_) | OpKind::Select | OpKind::Cast { .. }
        ) && self.ty(op.results[0]).is_scalar()
        {
            let args: Option<Vec<(f64, DType)>> = op.operands.iter().map(|v| self.consts.get(v).copied()).collect();
            if let Some(args) = args {
                let out_ty = self.ty(op.results[0]).dtype();
                if let Some(value) = fold_scalar(&op.kind, &args, out_ty) {
                    op.kind = OpKind::Const { value, dtype: out_ty };
                    op.operands.clear();
                    self.changed = true;
                }
            }
        }
        // Identities.
        if let OpKind::Binary(b) = op.kind {
            let (x, y) = (op.operands[0], op.operands[1]);
            let rt = self.ty(op.results[0]).clone();
            let is = |v: Value, c: f64, cx: &Cx| cx.constant(v) == Some(c);
            let int = rt.dtype().is_int();
            let keep = match b {
                BinOp::Add if int && is(y, 0.0, self) => Some(x),
                BinOp::Add if int && is(x, 0.0, self) => Some(y),
                BinOp::Sub if int && is(y, 0.0, self) => Some(x),
                BinOp::Mul if is(y, 1.0, self) => Some(x),
                BinOp::Mul if is(x, 1.0, self) => Some(y),
                BinOp::Div if is(y, 1.0, self) => Some(x),
                BinOp::Min if rt.dtype() == DType::I32 && is(y, i32::MAX as f64, self) => Some(x),
                BinOp::Min if rt.dtype() == DType::I32 && is(x, i32::MAX as f64, self) => Some(y),
                BinOp::Or if rt.dtype() == DType::I1 && is(y, 0.0, self) => Some(x),
                BinOp::Or if rt.dtype() == DType::I1 && is(x, 0.0, self) => Some(y),
                BinOp::And if rt.dtype() == DType::I1 && is(y, 1.0, self) => Some(x),
                BinOp::And if rt.dtype() == DType::I1 && is(x, 1.0, self) => Some(y),
                _ => None,
            };
            if let Some(v) = keep {
                if *self.ty(v) == rt {
                    self.subst.insert(op.results[0], v);
                    self.changed = true;
                    return None;
                }
            }
        }
        if let OpKind::Const { value, dtype } = op.kind {
            self.consts.insert(op.results[0], (value, dtype));
        }
        // CSE.
        if op.kind.is_pure() && op.regions.is_empty() && !matches!(op.kind, OpKind::Load { .. }) {
            let key = format!(
                "{:?}|{:?}|{:?}",
                op.kind,
                op.operands,
                op.results.iter().map(|r| self.ty(*r)).collect::<Vec<_>>()
            );
            if let Some(prev) = self.scopes.iter().rev().find_map(|s| s.get(&key)) {
                for (r, p) in op.results.iter().zip(prev.clone()) {
                    self.subst.insert(*r, p);
                }
                self.changed = true;
                return None;
            }
            self.scopes.last_mut().expect("scope open").insert(key, op.results.clone());
        }
        Some(op)
    }
}
