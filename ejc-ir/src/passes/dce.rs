//! `dce`: remove ops whose results are never used.
//!
//! An op goes when it is pure and none of its results has a use. A `scf.for` or
//! `scf.if` goes when none of its results has a use and its regions store nothing.
//! Repeated until nothing changes, since removing a use can free its producer.

use super::util::{has_store, use_counts};
use super::Pass;
use crate::ir::{Block, Kernel, OpKind};

pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }

    fn run(&self, kernel: &mut Kernel) {
        loop {
            let counts = use_counts(kernel);
            let mut removed = false;
            sweep(&mut kernel.body, &counts, &mut removed);
            if !removed {
                break;
            }
        }
    }
}

fn sweep(block: &mut Block, counts: &[usize], removed: &mut bool) {
    block.ops.retain(|op| {
        let unused = op.results.iter().all(|r| counts[r.index()] == 0);
        let removable = match op.kind {
            OpKind::Yield | OpKind::Store { .. } => false,
            OpKind::For | OpKind::If => unused && !op.regions.iter().any(has_store),
            _ => unused && op.kind.is_pure(),
        };
        if removable {
            *removed = true;
        }
        !removable
    });
    for op in &mut block.ops {
        for r in &mut op.regions {
            sweep(r, counts, removed);
        }
    }
}
