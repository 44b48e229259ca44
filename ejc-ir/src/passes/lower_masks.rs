//! `lower-masks`: expand `mask.apply`, `mask.block_full` and `mask.kv_range` into
//! scalar and tile arithmetic, so back ends see only primitive ops.
//!
//! ```text
//! %m = mask.apply %s, %i0, %j0, %sk {terms = [col_lt]}     %a = tile.arange {len = 16}
//!                                                          %c = arith.add %a, %j0
//!                                                    ==>   %c2 = tile.expand_dims %c {axis = 0}
//!                                                          %ok = cmp.lt %c2, %sk       (tile<1x16xi1>)
//!                                                          %m = arith.select %ok, %s, %ninf
//! ```
//!
//! The expansions follow the definitions of the ops in `ir.rs` term by term: rows
//! `i = i0 + r`, keys `j = j0 + c`; `row_lt` rows are don't-care rows for the block
//! tests. Each expansion takes over the replaced op's result values, so no use needs
//! rewriting. The definitions are over exact integers; the expansions compute in i32
//! without overflow for any term operand (given block origins within ±2^29): they
//! compare index differences (`j - i <= x`) rather than sums, and saturate the sums
//! `mask.kv_range` needs.

use super::util::Emit;
use super::Pass;
use crate::ir::{BinOp, Block, CmpPred, Kernel, MaskTerm, Op, OpKind, Value};
use crate::types::{DType, Type};

pub struct LowerMasks;

impl Pass for LowerMasks {
    fn name(&self) -> &'static str {
        "lower-masks"
    }

    fn run(&self, kernel: &mut Kernel) {
        let mut body = std::mem::take(&mut kernel.body);
        lower_block(&mut body, &mut kernel.values);
        kernel.body = body;
    }
}

fn lower_block(block: &mut Block, values: &mut Vec<Type>) {
    let ops = std::mem::take(&mut block.ops);
    for mut op in ops {
        for r in &mut op.regions {
            lower_block(r, values);
        }
        match &op.kind {
            OpKind::MaskApply { terms } => block.ops.extend(lower_apply(&op, terms, values)),
            OpKind::MaskBlockFull { terms, bm, bn } => block.ops.extend(lower_block_full(&op, terms, *bm, *bn, values)),
            OpKind::MaskKvRange { terms, bm, bn } => block.ops.extend(lower_kv_range(&op, terms, *bm, *bn, values)),
            _ => block.ops.push(op),
        }
    }
}

fn lower_apply(op: &Op, terms: &[MaskTerm], values: &mut Vec<Type>) -> Vec<Op> {
    let s = op.operands[0];
    let shape = values[s.index()].shape().to_vec();
    let (bm, bn) = (shape[0], shape[1]);
    let (i0, j0) = (op.operands[1], op.operands[2]);
    let xs = &op.operands[3..];
    let mut e = Emit::new(values);
    let r = e.op(OpKind::Arange { len: bm }, vec![]);
    let r = e.bin(BinOp::Add, r, i0);
    let rows = e.op(OpKind::ExpandDims { axis: 1 }, vec![r]); // [bm, 1]
    let c = e.op(OpKind::Arange { len: bn }, vec![]);
    let c = e.bin(BinOp::Add, c, j0);
    let cols = e.op(OpKind::ExpandDims { axis: 0 }, vec![c]); // [1, bn]
                                                              // `j <= i + x` is tested as `j - i <= x`: indices are small, x may be anything.
    let mut diagonal: Option<Value> = None;
    let mut keep: Option<Value> = None;
    for (t, &x) in terms.iter().zip(xs) {
        let cond = match t {
            MaskTerm::ColLeRow | MaskTerm::ColGeRow => {
                let d = *diagonal.get_or_insert_with(|| e.bin(BinOp::Sub, cols, rows));
                e.cmp(if *t == MaskTerm::ColLeRow { CmpPred::Le } else { CmpPred::Ge }, d, x)
            }
            MaskTerm::ColLt => e.cmp(CmpPred::Lt, cols, x),
            MaskTerm::ColGe => e.cmp(CmpPred::Ge, cols, x),
            MaskTerm::RowLt => e.cmp(CmpPred::Lt, rows, x),
        };
        keep = Some(match keep {
            None => cond,
            Some(k) => e.bin(BinOp::And, k, cond),
        });
    }
    let ninf = e.op(OpKind::Const { value: f64::NEG_INFINITY, dtype: DType::F32 }, vec![]);
    let fill = e.op(OpKind::Splat { shape: vec![bm, bn] }, vec![ninf]);
    let keep = match keep {
        Some(k) => k,
        // No term: the mask keeps everything. `select true` keeps the result value.
        None => e.op(OpKind::Const { value: 1.0, dtype: DType::I1 }, vec![]),
    };
    e.op_into(OpKind::Select, vec![keep, s, fill], Some(&op.results));
    e.ops
}

/// The cared-for rows of a block: the last one, `min(i0 + bm - 1, x - 1 for each
/// row_lt)`, and whether there is none (`x <= i0` for some row_lt; tested that way so
/// that `x - 1` never wraps where it matters).
fn care_rows(e: &mut Emit, terms: &[MaskTerm], xs: &[Value], i0: Value, bm: usize) -> (Value, Value) {
    let last = e.const_i32(bm as i64 - 1);
    let mut ihi = e.bin(BinOp::Add, i0, last);
    let one = e.const_i32(1);
    let mut none = e.op(OpKind::Const { value: 0.0, dtype: DType::I1 }, vec![]);
    for (t, &x) in terms.iter().zip(xs) {
        if *t == MaskTerm::RowLt {
            let b = e.bin(BinOp::Sub, x, one);
            ihi = e.bin(BinOp::Min, ihi, b);
            let empty = e.cmp(CmpPred::Le, x, i0);
            none = e.bin(BinOp::Or, none, empty);
        }
    }
    (ihi, none)
}

/// `a + x` clamped to the i32 range (the definitions are exact integers, and
/// `mask.kv_range` clamps its results to i32).
fn add_saturating(e: &mut Emit, a: Value, x: Value) -> Value {
    let max = e.const_i32(i32::MAX as i64);
    let min = e.const_i32(i32::MIN as i64);
    let zero = e.const_i32(0);
    // x > 0: overflows iff a > MAX - x;  x < 0: underflows iff a < MIN - x.
    let pos = e.cmp(CmpPred::Gt, x, zero);
    let room_up = e.bin(BinOp::Sub, max, x);
    let above = e.cmp(CmpPred::Gt, a, room_up);
    let over = e.bin(BinOp::And, pos, above);
    let neg = e.cmp(CmpPred::Lt, x, zero);
    let room_down = e.bin(BinOp::Sub, min, x);
    let below = e.cmp(CmpPred::Lt, a, room_down);
    let under = e.bin(BinOp::And, neg, below);
    let sum = e.bin(BinOp::Add, a, x);
    let sum = e.op(OpKind::Select, vec![under, min, sum]);
    e.op(OpKind::Select, vec![over, max, sum])
}

fn lower_block_full(op: &Op, terms: &[MaskTerm], bm: usize, bn: usize, values: &mut Vec<Type>) -> Vec<Op> {
    let (i0, j0) = (op.operands[0], op.operands[1]);
    let xs = &op.operands[2..];
    let mut e = Emit::new(values);
    let (ihi, none) = care_rows(&mut e, terms, xs, i0, bm);
    let last = e.const_i32(bn as i64 - 1);
    let jhi = e.bin(BinOp::Add, j0, last);
    let mut all = e.op(OpKind::Const { value: 1.0, dtype: DType::I1 }, vec![]);
    for (t, &x) in terms.iter().zip(xs) {
        // Corner tests, as differences of indices so nothing overflows:
        // `jhi <= i0 + x`  <=>  `jhi - i0 <= x`;  `j0 >= ihi + x`  <=>  `j0 - ihi >= x`.
        let cond = match t {
            MaskTerm::ColLeRow => {
                let d = e.bin(BinOp::Sub, jhi, i0);
                e.cmp(CmpPred::Le, d, x)
            }
            MaskTerm::ColGeRow => {
                let d = e.bin(BinOp::Sub, j0, ihi);
                e.cmp(CmpPred::Ge, d, x)
            }
            MaskTerm::ColLt => e.cmp(CmpPred::Lt, jhi, x),
            MaskTerm::ColGe => e.cmp(CmpPred::Ge, j0, x),
            MaskTerm::RowLt => continue,
        };
        all = e.bin(BinOp::And, all, cond);
    }
    e.op_into(OpKind::Binary(BinOp::Or), vec![none, all], Some(&op.results));
    e.ops
}

fn lower_kv_range(op: &Op, terms: &[MaskTerm], bm: usize, bn: usize, values: &mut Vec<Type>) -> Vec<Op> {
    let i0 = op.operands[0];
    let xs = &op.operands[1..];
    let mut e = Emit::new(values);
    let (ihi, none) = care_rows(&mut e, terms, xs, i0, bm);
    let zero = e.const_i32(0);
    let one = e.const_i32(1);
    let mut lo = zero;
    let mut hi = e.const_i32(i32::MAX as i64);
    for (t, &x) in terms.iter().zip(xs) {
        match t {
            MaskTerm::ColLeRow => {
                // ihi + x + 1, saturating (ihi + 1 is a row index: no overflow).
                let a = e.bin(BinOp::Add, ihi, one);
                let b = add_saturating(&mut e, a, x);
                hi = e.bin(BinOp::Min, hi, b);
            }
            MaskTerm::ColGeRow => {
                let b = add_saturating(&mut e, i0, x);
                lo = e.bin(BinOp::Max, lo, b);
            }
            MaskTerm::ColLt => hi = e.bin(BinOp::Min, hi, x),
            MaskTerm::ColGe => lo = e.bin(BinOp::Max, lo, x),
            MaskTerm::RowLt => {}
        }
    }
    // lo >= 0, so truncating division rounds down.
    let bn_c = e.const_i32(bn as i64);
    let blocks = e.bin(BinOp::Div, lo, bn_c);
    let lo = e.bin(BinOp::Mul, blocks, bn_c);
    e.op_into(OpKind::Select, vec![none, zero, lo], Some(&op.results[0..1]));
    e.op_into(OpKind::Select, vec![none, zero, hi], Some(&op.results[1..2]));
    e.ops
}
