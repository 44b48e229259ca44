//! Small helpers shared by the passes.

use std::collections::HashMap;

use crate::ir::{Block, Kernel, Op, OpKind, Value};
use crate::types::DType;

/// Replace operands according to `subst` (following chains), in `block` and all
/// nested regions.
pub fn substitute(block: &mut Block, subst: &HashMap<Value, Value>) {
    if subst.is_empty() {
        return;
    }
    for op in &mut block.ops {
        for v in &mut op.operands {
            *v = resolve(subst, *v);
        }
        for r in &mut op.regions {
            substitute(r, subst);
        }
    }
}

pub fn resolve(subst: &HashMap<Value, Value>, mut v: Value) -> Value {
    while let Some(n) = subst.get(&v) {
        v = *n;
    }
    v
}

/// Scalar constants of a kernel: value → (number, dtype).
pub fn constants(kernel: &Kernel) -> HashMap<Value, (f64, DType)> {
    let mut out = HashMap::new();
    crate::ir::walk_ops(&kernel.body, &mut |op: &Op| {
        if let OpKind::Const { value, dtype } = op.kind {
            out.insert(op.results[0], (value, dtype));
        }
    });
    out
}

/// How many times each value is used as an operand.
pub fn use_counts(kernel: &Kernel) -> Vec<usize> {
    crate::defuse::DefUse::new(kernel).use_counts()
}

/// Whether a block (or its nested regions) stores to memory.
pub fn has_store(block: &Block) -> bool {
    block.ops.iter().any(|op| matches!(op.kind, OpKind::Store { .. }) || op.regions.iter().any(has_store))
}

/// Appends new ops, typing their results with [`crate::infer::infer`]. Used by
/// passes that expand one op into several.
pub struct Emit<'k> {
    pub values: &'k mut Vec<crate::types::Type>,
    pub ops: Vec<Op>,
}

impl<'k> Emit<'k> {
    pub fn new(values: &'k mut Vec<crate::types::Type>) -> Self {
        Emit { values, ops: Vec::new() }
    }

    /// Emit `kind(operands)`; results get fresh values, or `reuse` when given (so the
    /// expansion can take over the replaced op's result and no use needs rewriting).
    pub fn op_into(&mut self, kind: OpKind, operands: Vec<Value>, reuse: Option<&[Value]>) -> Vec<Value> {
        let tys: Vec<crate::types::Type> = operands.iter().map(|v| self.values[v.index()].clone()).collect();
        let refs: Vec<&crate::types::Type> = tys.iter().collect();
        // The expanding passes build ops from already-verified operands; a type
        // error here is a bug in the pass, and the verifier after the pass names it.
        let result_types = crate::infer::infer(&kind, &refs).unwrap_or_default();
        let results = match reuse {
            Some(r) => r.to_vec(),
            None => result_types
                .into_iter()
                .map(|t| {
                    self.values.push(t);
                    Value(self.values.len() as u32 - 1)
                })
                .collect(),
        };
        self.ops.push(Op { kind, operands, results: results.clone(), regions: vec![] });
        results
    }

    pub fn op(&mut self, kind: OpKind, operands: Vec<Value>) -> Value {
        self.op_into(kind, operands, None)[0]
    }

    pub fn const_i32(&mut self, v: i64) -> Value {
        self.op(OpKind::Const { value: v as f64, dtype: DType::I32 }, vec![])
    }

    pub fn bin(&mut self, b: crate::ir::BinOp, x: Value, y: Value) -> Value {
        self.op(OpKind::Binary(b), vec![x, y])
    }

    pub fn cmp(&mut self, p: crate::ir::CmpPred, x: Value, y: Value) -> Value {
        self.op(OpKind::Cmp(p), vec![x, y])
    }
}
