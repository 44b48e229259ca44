//! `classify-mask-blocks`: pay for masking only where the mask is partial.
//!
//! Every `[bm, bn]` block of scores is, for an analysable mask, one of:
//! *skip* (every element masked), *full* (none masked) or *partial*. This pass finds
//! key loops `scf.for %j0 = 0 to %hi step bn` whose body applies `mask.apply %s, %i0,
//! %j0, ...` and
//!
//! 1. narrows the loop to `[lo, min(hi, hi'))` from `mask.kv_range` — the skip blocks
//!    at both ends are never visited (for causal attention about half the blocks);
//! 2. guards the masking with `mask.block_full`: full blocks take the scores as they
//!    are, only partial blocks pay for the per-element predicate.
//!
//! ```text
//! %r:3 = scf.for %j0 = %c0 to %sk step %c64 iter_args(...) {     %lo, %hi = mask.kv_range %i0, ...
//!   ...                                                            %hi2 = arith.min %sk, %hi
//!   %m = mask.apply %s, %i0, %j0, ...                         ==>  %r:3 = scf.for %j0 = %lo to %hi2 step %c64 ... {
//!   ...                                                              %full = mask.block_full %i0, %j0, ...
//! }                                                                  %m = scf.if %full { yield %s } else { mask.apply ... }
//! ```
//!
//! Step 2 never changes a result (on a full block the mask is the identity). Step 1
//! is only sound when an iteration over a skip block changes nothing, so the pass
//! proves it first: it follows the all-masked scores through the body (selects with a
//! −∞ fill, `softmax.update` giving p = 0 and alpha = 1, `softmax.rescale` by 1, casts,
//! products and `tile.dot` of a zero tile) and narrows only when every carried value
//! comes back unchanged (and the body stores nothing). A loop it cannot prove keeps
//! its full range (step 2 still applies).

use std::collections::HashMap;

use super::util::{constants, defined_in, has_store, Emit};
use super::Pass;
use crate::ir::{BinOp, Block, Kernel, MaskTerm, Op, OpKind, Value};

pub struct ClassifyMaskBlocks;

impl Pass for ClassifyMaskBlocks {
    fn name(&self) -> &'static str {
        "classify-mask-blocks"
    }

    fn run(&self, kernel: &mut Kernel) {
        let mut consts = constants(kernel);
        // A splat of a constant is that constant everywhere: record it too, so the
        // no-op proof knows the fill tiles hoisted out of loops.
        let mut splats = Vec::new();
        crate::ir::walk_ops(&kernel.body, &mut |op: &Op| {
            if let (OpKind::Splat { .. }, Some(c)) =
                (&op.kind, consts.get(&op.operands.first().copied().unwrap_or(Value(u32::MAX))))
            {
                splats.push((op.results[0], *c));
            }
        });
        consts.extend(splats);
        let mut body = std::mem::take(&mut kernel.body);
        rewrite_block(&mut body, &consts, &mut kernel.values);
        kernel.body = body;
    }
}

type Consts = HashMap<Value, (f64, crate::types::DType)>;

fn rewrite_block(block: &mut Block, consts: &Consts, values: &mut Vec<crate::types::Type>) {
    let ops = std::mem::take(&mut block.ops);
    for mut op in ops {
        for r in &mut op.regions {
            rewrite_block(r, consts, values);
        }
        if matches!(op.kind, OpKind::For) {
            let before = classify_loop(&mut op, consts, values);
            block.ops.extend(before);
        }
        block.ops.push(op);
    }
}

/// Rewrite one loop; returns the ops to insert before it.
fn classify_loop(op: &mut Op, consts: &Consts, values: &mut Vec<crate::types::Type>) -> Vec<Op> {
    let iv = op.regions[0].args[0];
    let mut inside = Vec::new();
    defined_in(&op.regions[0], &mut inside);
    let invariant = |v: &Value| !inside.contains(v);
    let step = consts.get(&op.operands[2]).map(|c| c.0);
    let lo_is_zero = consts.get(&op.operands[0]).map(|c| c.0) == Some(0.0);

    // Masks of this loop's key blocks: mask.apply at the body's top level, indexed by
    // the induction variable, with loop-invariant row start and term operands.
    let body = &op.regions[0];
    let masks: Vec<usize> = body
        .ops
        .iter()
        .enumerate()
        .filter(|(_, m)| {
            matches!(m.kind, OpKind::MaskApply { .. })
                && m.operands[2] == iv
                && invariant(&m.operands[1])
                && m.operands[3..].iter().all(invariant)
        })
        .map(|(i, _)| i)
        .collect();
    let Some(&first) = masks.first() else {
        return vec![];
    };

    let mut before = Vec::new();
    // 1. Narrow the loop when the first mask's skip blocks are provably no-ops.
    {
        let m = &body.ops[first];
        let bn = values[m.operands[0].index()].shape()[1];
        let bm = values[m.operands[0].index()].shape()[0];
        let OpKind::MaskApply { terms } = &m.kind else { unreachable!("filtered above") };
        let has_upper = terms.iter().any(|t| matches!(t, MaskTerm::ColLeRow | MaskTerm::ColLt));
        // A store in the body is an effect of every iteration, skip blocks included.
        if lo_is_zero && step == Some(bn as f64) && has_upper && !has_store(body) && skip_is_noop(body, first, consts) {
            let mut e = Emit::new(values);
            let mut operands = vec![m.operands[1]];
            operands.extend(&m.operands[3..]);
            let range = e.op_into(OpKind::MaskKvRange { terms: terms.clone(), bm, bn }, operands, None);
            let hi = e.bin(BinOp::Min, op.operands[1], range[1]);
            before = e.ops;
            op.operands[0] = range[0];
            op.operands[1] = hi;
        }
    }

    // 2. Guard every mask with a full-block test.
    let body = &mut op.regions[0];
    for &i in masks.iter().rev() {
        let mask = body.ops[i].clone();
        let OpKind::MaskApply { terms } = &mask.kind else { unreachable!("filtered above") };
        let ty = values[mask.results[0].index()].clone();
        let (bm, bn) = (ty.shape()[0], ty.shape()[1]);
        let mut e = Emit::new(values);
        let mut full_operands = vec![mask.operands[1], mask.operands[2]];
        full_operands.extend(&mask.operands[3..]);
        let full = e.op(OpKind::MaskBlockFull { terms: terms.clone(), bm, bn }, full_operands);
        let mut guard = e.ops;
        values.push(ty);
        let masked = Value(values.len() as u32 - 1);
        let then_block = Block {
            args: vec![],
            ops: vec![Op { kind: OpKind::Yield, operands: vec![mask.operands[0]], results: vec![], regions: vec![] }],
        };
        let else_block = Block {
            args: vec![],
            ops: vec![
                Op { kind: mask.kind.clone(), operands: mask.operands.clone(), results: vec![masked], regions: vec![] },
                Op { kind: OpKind::Yield, operands: vec![masked], results: vec![], regions: vec![] },
            ],
        };
        guard.push(Op {
            kind: OpKind::If,
            operands: vec![full],
            results: mask.results.clone(),
            regions: vec![then_block, else_block],
        });
        body.ops.splice(i..=i, guard);
    }
    before
}

/// What a value is, in an iteration whose scores are entirely masked.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Abs {
    /// Every element is −∞.
    NegInf,
    /// Every element is 0.
    Zero,
    /// Every element is 1.
    One,
    /// Equal to this value (a carried value at iteration start, or a loop invariant).
    Same(Value),
}

/// Does the body, run on a block whose `mask.apply` (op `mask_at`) masks everything,
/// yield its carried values unchanged?
fn skip_is_noop(body: &Block, mask_at: usize, consts: &Consts) -> bool {
    let carried = &body.args[1..];
    let mut abs: HashMap<Value, Abs> = carried.iter().map(|a| (*a, Abs::Same(*a))).collect();
    // Constants (and tiles splat from them) anywhere in the kernel, e.g. the −∞ fill
    // tile the front end hoists out of the loop.
    let mut consts: HashMap<Value, f64> = consts.iter().map(|(v, c)| (*v, c.0)).collect();
    for (v, c) in &consts {
        if *c == f64::NEG_INFINITY {
            abs.insert(*v, Abs::NegInf);
        } else if *c == 0.0 {
            abs.insert(*v, Abs::Zero);
        }
    }
    for (i, op) in body.ops.iter().enumerate() {
        let a: Vec<Option<Abs>> = op.operands.iter().map(|v| abs.get(v).copied()).collect();
        // A value with no abstract fact is only known to equal itself.
        let same = |k: usize| a[k].unwrap_or(Abs::Same(op.operands[k]));
        let out: Vec<Abs> = match &op.kind {
            _ if i == mask_at => vec![Abs::NegInf],
            OpKind::Const { value, .. } => {
                consts.insert(op.results[0], *value);
                vec![]
            }
            OpKind::Splat { .. } | OpKind::Broadcast { .. } => match a[0] {
                Some(x @ (Abs::NegInf | Abs::Zero)) => vec![x],
                _ => vec![],
            },
            OpKind::Select => match (a[1], a[2]) {
                (Some(x @ (Abs::NegInf | Abs::Zero)), Some(y)) if x == y => vec![x],
                _ => vec![],
            },
            OpKind::SoftmaxUpdate if a[0] == Some(Abs::NegInf) => vec![Abs::Zero, Abs::One, same(1), same(2)],
            OpKind::SoftmaxRescale if a[1] == Some(Abs::One) => vec![same(0)],
            OpKind::Binary(BinOp::Mul) if a[0] == Some(Abs::Zero) || a[1] == Some(Abs::Zero) => vec![Abs::Zero],
            OpKind::Cast { to } if to.is_float() => match a[0] {
                Some(x @ (Abs::Zero | Abs::NegInf)) => vec![x],
                _ => vec![],
            },
            OpKind::Dot { .. } if a[0] == Some(Abs::Zero) || a[1] == Some(Abs::Zero) => vec![same(2)],
            OpKind::Yield => {
                return op.operands.iter().zip(carried).all(|(v, c)| abs.get(v) == Some(&Abs::Same(*c)));
            }
            _ => vec![],
        };
        for (r, x) in op.results.iter().zip(out) {
            abs.insert(*r, x);
        }
    }
    false
}
