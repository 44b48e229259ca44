//! `licm`: loop-invariant code motion. Pure ops inside a `scf.for` body whose
//! operands are all defined outside the loop move in front of the loop, so each runs
//! once instead of once per iteration.
//!
//! ```text
//! scf.for %j0 = ... {                      %r = tile.arange {len = 64}
//!   %r = tile.arange {len = 64}      ==>   %i = arith.add %r, %i0
//!   %i = arith.add %r, %i0                 scf.for %j0 = ... {
//!   ... uses %i, %j0 ...                     ... uses %i, %j0 ...
//! ```
//!
//! Ops nested in a `scf.if` of the body move too (the lowered mask of partial blocks
//! builds its row indices there): running a pure op when the branch would not have
//! is harmless, except for ops that can fault, so integer `div`/`rem` stay where they
//! are. Loads stay in the loop (a store in the loop could change what they read).
//! Loops nested in the body are processed first, so invariants bubble out of every
//! level.

use std::collections::HashSet;

use super::Pass;
use crate::defuse::defined_in;
use crate::ir::{BinOp, Block, Kernel, Op, OpKind, Value};

pub struct Licm;

impl Pass for Licm {
    fn name(&self) -> &'static str {
        "licm"
    }

    fn run(&self, kernel: &mut Kernel) {
        let mut body = std::mem::take(&mut kernel.body);
        hoist_in_block(&mut body);
        kernel.body = body;
    }
}

fn hoist_in_block(block: &mut Block) {
    let ops = std::mem::take(&mut block.ops);
    for mut op in ops {
        for r in &mut op.regions {
            hoist_in_block(r);
        }
        if matches!(op.kind, OpKind::For) {
            let mut inside = defined_in(&op.regions[0]);
            let mut hoisted = Vec::new();
            take_invariants(&mut op.regions[0], &mut inside, &mut hoisted);
            block.ops.extend(hoisted);
        }
        block.ops.push(op);
    }
}

fn movable(op: &Op) -> bool {
    op.regions.is_empty()
        && op.kind.is_pure()
        && !matches!(op.kind, OpKind::Load { .. } | OpKind::Binary(BinOp::Div) | OpKind::Binary(BinOp::Rem))
}

/// Move invariant ops of `block` (and of `scf.if` regions in it) to `out`, in
/// program order. `inside` holds the values still defined in the loop.
fn take_invariants(block: &mut Block, inside: &mut HashSet<Value>, out: &mut Vec<Op>) {
    let ops = std::mem::take(&mut block.ops);
    for mut op in ops {
        if movable(&op) && op.operands.iter().all(|v| !inside.contains(v)) {
            for r in &op.results {
                inside.remove(r);
            }
            out.push(op);
            continue;
        }
        if matches!(op.kind, OpKind::If) {
            for r in &mut op.regions {
                take_invariants(r, inside, out);
            }
        }
        block.ops.push(op);
    }
}
