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
//!
//! After narrowing, a column bound (`col_ge x`, `col_lt x`) whose `x` is a known
//! multiple of the block width (`bn` a power of two, `x` built from multiples of it by
//! `mul`, `add`, `sub`, `min`, `max`, `select`) never cuts a visited block — the loop
//! starts at a multiple of `bn` at or past every such `col_ge`, and ends at or before
//! every such `col_lt` — so it is dropped from the per-block test and the per-element
//! mask. Split-KV's key-range bounds are such terms: its key loop then masks exactly
//! what the one-kernel forward masks.

use std::collections::HashMap;

use super::util::{constants, has_store, Emit};
use super::Pass;
use crate::defuse::defined_in;
use crate::ir::{BinOp, Block, Kernel, MaskTerm, Op, OpKind, Value};
use crate::types::{DType, Type};

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
        let zeros = trailing_zeros(kernel, &consts);
        let mut body = std::mem::take(&mut kernel.body);
        rewrite_block(&mut body, &consts, &zeros, &mut kernel.values);
        kernel.body = body;
    }
}

type Consts = HashMap<Value, (f64, crate::types::DType)>;

/// Known trailing zero bits of i32 values (`x` is a multiple of `2^k`), as far as
/// integer arithmetic shows them. Exact under the device's wrapping arithmetic: a
/// product or sum of multiples of `2^k` stays one modulo `2^32`.
type Zeros = HashMap<Value, u32>;

fn trailing_zeros(kernel: &Kernel, consts: &Consts) -> Zeros {
    let mut tz = Zeros::new();
    crate::ir::walk_ops(&kernel.body, &mut |op: &Op| {
        let Some(&r) = op.results.first() else { return };
        if kernel.values[r.index()] != Type::Scalar(DType::I32) {
            return;
        }
        let of = |k: usize| op.operands.get(k).and_then(|v| tz.get(v)).copied().unwrap_or(0);
        let z = match &op.kind {
            OpKind::Const { .. } => match consts.get(&r) {
                Some((c, _)) => (*c as i64 as i32).trailing_zeros(),
                None => 0,
            },
            OpKind::Binary(BinOp::Mul) => (of(0) + of(1)).min(32),
            OpKind::Binary(BinOp::Add | BinOp::Sub | BinOp::Min | BinOp::Max) => of(0).min(of(1)),
            OpKind::Select => of(1).min(of(2)),
            _ => 0,
        };
        if z > 0 {
            tz.insert(r, z);
        }
    });
    tz
}

fn rewrite_block(block: &mut Block, consts: &Consts, zeros: &Zeros, values: &mut Vec<Type>) {
    let ops = std::mem::take(&mut block.ops);
    for mut op in ops {
        for r in &mut op.regions {
            rewrite_block(r, consts, zeros, values);
        }
        if matches!(op.kind, OpKind::For) {
            let before = classify_loop(&mut op, consts, zeros, values);
            block.ops.extend(before);
        }
        block.ops.push(op);
    }
}

/// Rewrite one loop; returns the ops to insert before it.
fn classify_loop(op: &mut Op, consts: &Consts, zeros: &Zeros, values: &mut Vec<Type>) -> Vec<Op> {
    let iv = op.regions[0].args[0];
    let inside = defined_in(&op.regions[0]);
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
    // Column bounds that no visited block straddles once the loop is narrowed.
    let mut aligned: Vec<(MaskTerm, Value)> = Vec::new();
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
            // The loop now runs j0 = lo, lo + bn, ... < hi with lo a multiple of bn, lo
            // at or past every col_ge bound and hi at or before every col_lt bound: a
            // bound that is itself a multiple of bn holds on every visited block.
            if bn.is_power_of_two() {
                let multiple = |x: &Value| zeros.get(x).is_some_and(|z| 1usize << (*z).min(31) >= bn);
                aligned = terms
                    .iter()
                    .zip(&m.operands[3..])
                    .filter(|(t, x)| matches!(t, MaskTerm::ColGe | MaskTerm::ColLt) && multiple(x))
                    .map(|(t, x)| (*t, *x))
                    .collect();
            }
        }
    }

    // 2. Guard every mask with a full-block test (without the aligned bounds).
    let body = &mut op.regions[0];
    for &i in masks.iter().rev() {
        let mut mask = body.ops[i].clone();
        drop_terms(&mut mask, &aligned);
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

/// Remove `(term, operand)` pairs in `drop` from a `mask.apply`.
fn drop_terms(mask: &mut Op, drop: &[(MaskTerm, Value)]) {
    let OpKind::MaskApply { terms } = &mask.kind else { return };
    let keep: Vec<bool> = terms.iter().zip(&mask.operands[3..]).map(|(t, x)| !drop.contains(&(*t, *x))).collect();
    let terms = terms.iter().zip(&keep).filter(|(_, k)| **k).map(|(t, _)| *t).collect();
    let xs = mask.operands[3..].iter().zip(&keep).filter(|(_, k)| **k).map(|(x, _)| *x);
    mask.operands = mask.operands[..3].iter().copied().chain(xs).collect();
    mask.kind = OpKind::MaskApply { terms };
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
            // (Without a scale operand: c·(−∞) is −∞ only for c > 0.)
            OpKind::SoftmaxUpdate if a[0] == Some(Abs::NegInf) && op.operands.len() == 3 => {
                vec![Abs::Zero, Abs::One, same(1), same(2)]
            }
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
