//! `pipeline-dots`: software pipelining of a loop whose body runs two products, the
//! second accumulating into a loop-carried tile — attention's key loop:
//!
//! ```text
//! scf.for %j = lo to hi step s iter_args(%acc = acc0, %m = m0, %l = l0) {
//!   %s = tile.dot %q, load(k, j) ...          // stage 0: scores, masks, softmax
//!   %p, %alpha, %m', %l' = softmax.update ... //          (nothing here reads %acc)
//!   %a = softmax.rescale %acc, %alpha         // stage 1: everything that depends on
//!   %acc' = tile.dot %p16, load(v, j), %a     //          %acc, and the loads it alone uses
//!   scf.yield %acc', %m', %l'
//! }
//! ```
//!
//! becomes a prologue (stage 0 of the first iteration), a rotated loop whose iteration
//! `j` runs stage 1 of `j` and stage 0 of `j + s`, and an epilogue (stage 1 of the last
//! iteration):
//!
//! ```text
//! %x0.. = scf.if lo < hi { stage0(lo) } else { placeholders }
//! scf.for %j = lo to hi - s step s iter_args(%acc, %m, %l, %x.., %jp = lo) {
//!   stage0(j + s) up to its product      // the score product of block j+1 ...
//!   stage1(j, %x..)                      // ... and the value product of block j,
//!   rest of stage0(j + s)                //     issued back to back; then the softmax
//!   scf.yield %acc', %m', %l', %x'.., j + s
//! }
//! %acc = scf.if lo < hi { stage1(%jp, %x..) } else { %acc }
//! ```
//!
//! The values stage 1 takes from stage 0 (`%x`: the probabilities and the rescale
//! factor) are carried from one iteration to the next — except scalar indices computed
//! from the induction variable (a paged cache's block-table entry, the arithmetic around
//! it), which stage 1 computes again for its own block, so that its loads stay indexed
//! by the induction variable and a back end can still prefetch them. Optionally ([`rotate_loops`] with
//! `sink`), when the rest of stage 0 is a branch (the masks of partial blocks) followed by
//! branch-free work (the softmax), that work moves into both arms of the branch, so
//! nothing joins while the value product runs (see `sink_into_branch`). Every value is computed exactly
//! as before, so results are bit for bit the same; the point is the order: a back end
//! with asynchronous matrix instructions (Hopper's `wgmma`) can leave the value product
//! of block `j` running on the tensor cores while it computes the softmax of block
//! `j + 1`, as FlashAttention-3 does by hand.
//!
//! The pass is not in the default pipeline: back ends that gain from it run it (the
//! PTX target's `wgmma` configurations). Loops that do not have this shape are left
//! alone: a body with a nested loop or a store, no product that accumulates into a
//! carried tile, stage 0 reading stage 1's results, stage 1 reading another carried
//! value, or stage 1 reading a tile stage 0 loads (it would be carried in registers).

use std::collections::{HashMap, HashSet};

use super::Pass;
use crate::ir::{AxisIndex, BinOp, Block, CmpPred, Kernel, Op, OpKind, Value};
use crate::types::Type;

pub struct PipelineDots;

impl Pass for PipelineDots {
    fn name(&self) -> &'static str {
        "pipeline-dots"
    }

    fn run(&self, kernel: &mut Kernel) {
        rotate_loops(kernel, false);
    }
}

/// What rotating one loop produced, for back ends that pipeline its loads: each load of
/// stage 1 in the epilogue, with the load of the rotated loop whose tile stream it
/// continues (the same tile, one iteration after the loop's last).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rotation {
    /// `(epilogue load, loop load)` result values.
    pub epilogue_loads: Vec<(Value, Value)>,
}

/// The pass, returning what it did per rotated loop. With `sink`, the rest of stage 0
/// after a branch moves into the branch's arms ([`sink_into_branch`]; an experiment for
/// Hopper, not measured yet, so the pass itself leaves it off).
pub fn rotate_loops(kernel: &mut Kernel, sink: bool) -> Vec<Rotation> {
    let mut body = std::mem::take(&mut kernel.body);
    let mut out = Vec::new();
    rewrite_block(&mut body, &mut kernel.values, &mut out, sink);
    kernel.body = body;
    out
}

fn rewrite_block(block: &mut Block, values: &mut Vec<Type>, out: &mut Vec<Rotation>, sink: bool) {
    let ops = std::mem::take(&mut block.ops);
    for mut op in ops {
        for r in &mut op.regions {
            rewrite_block(r, values, out, sink);
        }
        if matches!(op.kind, OpKind::For) {
            if let Some(split) = analyse(&op) {
                let (ops, rotation) = rotate(&op, &split, values, sink);
                block.ops.extend(ops);
                out.push(rotation);
                continue;
            }
        }
        block.ops.push(op);
    }
}

/// How a loop body splits into the two stages.
struct Split {
    /// Index (among the carried values) of the accumulator.
    acc: usize,
    /// Top-level body ops (indices, yield excluded) of stage 1.
    stage1: HashSet<usize>,
    /// Values defined by stage 0 that stage 1 reads, in a fixed order.
    cross: Vec<Value>,
    /// Stage-0 ops stage 1 computes again for its own iteration instead of receiving
    /// their results: scalar indices from the induction variable (a block table's entry
    /// and the arithmetic around it), so that stage 1's loads stay indexed by the
    /// induction variable (prefetchable, TMA-copyable) rather than by a carried value.
    dup: Vec<usize>,
}

/// Every value an op reads, its nested regions included (values defined inside those
/// regions are read too, which is harmless for the dependence tests here).
fn reads(op: &Op, out: &mut Vec<Value>) {
    out.extend(&op.operands);
    for r in &op.regions {
        for o in &r.ops {
            reads(o, out);
        }
    }
}

fn has_nested_loop_or_store(op: &Op) -> bool {
    matches!(op.kind, OpKind::For | OpKind::Store { .. })
        || op.regions.iter().any(|r| r.ops.iter().any(has_nested_loop_or_store))
}

fn analyse(op: &Op) -> Option<Split> {
    let body = &op.regions[0];
    let (yield_op, ops) = body.ops.split_last()?;
    if yield_op.kind != OpKind::Yield || ops.iter().any(has_nested_loop_or_store) {
        return None;
    }
    let carried = &body.args[1..];
    let reads_of: Vec<Vec<Value>> = ops
        .iter()
        .map(|o| {
            let mut r = Vec::new();
            reads(o, &mut r);
            r
        })
        .collect();
    let def_index: HashMap<Value, usize> =
        ops.iter().enumerate().flat_map(|(i, o)| o.results.iter().map(move |r| (*r, i))).collect();
    // The accumulator: a carried value whose yield is a product that depends on it.
    let mut found = None;
    for (a, arg) in carried.iter().enumerate() {
        let Some(&d) = def_index.get(&yield_op.operands[a]) else { continue };
        if !matches!(ops[d].kind, OpKind::Dot { .. }) {
            continue;
        }
        let mut tainted: HashSet<Value> = HashSet::from([*arg]);
        let mut stage1 = HashSet::new();
        for (i, o) in ops.iter().enumerate() {
            if reads_of[i].iter().any(|v| tainted.contains(v)) {
                tainted.extend(&o.results);
                stage1.insert(i);
            }
        }
        if stage1.contains(&d) {
            found = Some((a, stage1));
            break;
        }
    }
    let (acc, mut stage1) = found?;
    // Loads that only stage 1 uses move with it: the value tile of block j is loaded
    // where its product is issued.
    let mut users: HashMap<Value, Vec<usize>> = HashMap::new();
    for (i, rs) in reads_of.iter().enumerate() {
        for v in rs {
            users.entry(*v).or_default().push(i);
        }
    }
    let yielded: HashSet<Value> = yield_op.operands.iter().copied().collect();
    for i in (0..ops.len()).rev() {
        let o = &ops[i];
        if stage1.contains(&i) {
            continue;
        }
        let only_stage1 = !o.results.is_empty()
            && o.results.iter().all(|r| {
                !yielded.contains(r)
                    && users.get(r).is_some_and(|us| !us.is_empty() && us.iter().all(|u| stage1.contains(u)))
            });
        if only_stage1 && matches!(o.kind, OpKind::Load { .. }) {
            stage1.insert(i);
        }
    }
    // Stage 0 must not read stage 1, and must contain a product (else nothing overlaps).
    let s1_values: HashSet<Value> = stage1.iter().flat_map(|i| ops[*i].results.iter().copied()).collect();
    for (i, rs) in reads_of.iter().enumerate() {
        if !stage1.contains(&i) && rs.iter().any(|v| s1_values.contains(v)) {
            return None;
        }
    }
    for (k, y) in yield_op.operands.iter().enumerate() {
        if (k == acc) != s1_values.contains(y) {
            return None;
        }
    }
    if !ops.iter().enumerate().any(|(i, o)| !stage1.contains(&i) && matches!(o.kind, OpKind::Dot { .. })) {
        return None;
    }
    // What stage 1 reads from stage 0; other carried values are not allowed (stage 1
    // runs an iteration behind them).
    let s0_values: HashSet<Value> =
        (0..ops.len()).filter(|i| !stage1.contains(i)).flat_map(|i| ops[i].results.iter().copied()).collect();
    let iv = body.args[0];
    // The ops computing `v` when it is a scalar index from the induction variable and
    // values from outside the loop (scalar arithmetic, loads at fixed indices).
    fn recompute(
        v: Value,
        iv: Value,
        ops: &[Op],
        def_index: &HashMap<Value, usize>,
        carried: &[Value],
        out: &mut Vec<usize>,
    ) -> bool {
        if v == iv {
            return true;
        }
        let Some(&d) = def_index.get(&v) else { return !carried.contains(&v) };
        let o = &ops[d];
        let scalar_load =
            matches!(&o.kind, OpKind::Load { axes, .. } if axes.iter().all(|a| matches!(a, AxisIndex::Index)));
        let arith = crate::defuse::is_scalar_arith(o);
        if !(scalar_load || arith) || !o.regions.is_empty() {
            return false;
        }
        let from = if scalar_load { 1 } else { 0 };
        if !o.operands[from..].iter().all(|x| recompute(*x, iv, ops, def_index, carried, out)) {
            return false;
        }
        if !out.contains(&d) {
            out.push(d);
        }
        true
    }
    let mut cross = Vec::new();
    let mut dup = Vec::new();
    for i in (0..ops.len()).filter(|i| stage1.contains(i)) {
        for v in &reads_of[i] {
            if carried.iter().enumerate().any(|(k, c)| k != acc && c == v) {
                return None;
            }
            if s0_values.contains(v) && !cross.contains(v) {
                let mut chain = Vec::new();
                if recompute(*v, iv, ops, &def_index, carried, &mut chain) {
                    for d in chain {
                        if !dup.contains(&d) {
                            dup.push(d);
                        }
                    }
                    continue;
                }
                // A tile stage 0 loads and stage 1 reads too (a backward loop's dO, read
                // by products of both stages) would be carried to the next iteration in
                // registers, where a back end keeps it in shared memory: not worth it.
                let tile_load = |o: &Op| match &o.kind {
                    OpKind::Load { axes, .. } => axes.iter().any(|a| matches!(a, AxisIndex::Range { .. })),
                    _ => false,
                };
                if ops.iter().any(|o| o.results.contains(v) && tile_load(o)) {
                    return None;
                }
                cross.push(*v);
            }
        }
    }
    dup.sort_unstable();
    Some(Split { acc, stage1, cross, dup })
}

/// Copies ops with fresh result values, renaming operands through `map`.
struct Cloner<'a> {
    values: &'a mut Vec<Type>,
    map: HashMap<Value, Value>,
}

impl Cloner<'_> {
    fn fresh(&mut self, like: Value) -> Value {
        let t = self.values[like.index()].clone();
        self.values.push(t);
        Value(self.values.len() as u32 - 1)
    }

    fn get(&self, v: Value) -> Value {
        self.map.get(&v).copied().unwrap_or(v)
    }

    /// A fresh value like `v`, recorded as `v`'s copy.
    fn rename(&mut self, v: Value) -> Value {
        let n = self.fresh(v);
        self.map.insert(v, n);
        n
    }

    fn clone_op(&mut self, op: &Op) -> Op {
        let operands = op.operands.iter().map(|v| self.get(*v)).collect();
        let regions = op
            .regions
            .iter()
            .map(|r| {
                let args = r.args.iter().map(|a| self.rename(*a)).collect();
                let ops = r.ops.iter().map(|o| self.clone_op(o)).collect();
                Block { args, ops }
            })
            .collect();
        let results = op.results.iter().map(|r| self.rename(*r)).collect();
        Op { kind: op.kind.clone(), operands, results, regions }
    }

    fn new_op(&mut self, kind: OpKind, operands: Vec<Value>, result: Type) -> (Op, Value) {
        self.values.push(result);
        let r = Value(self.values.len() as u32 - 1);
        (Op { kind, operands, results: vec![r], regions: vec![] }, r)
    }
}

/// Tail duplication: when `ops[from..]` holds an `scf.if` followed only by pure ops
/// without regions (the masks of partial blocks, then the softmax), move those ops into
/// both arms of the `if`, which then yields what the rest needs of them. So no branch
/// joins between the value product's issue and the softmax: Hopper's assembler
/// completes in-flight `wgmma`s at a join, which would serialise the product with the
/// softmax it is meant to overlap. Ops computing a `pinned` value (the next product's
/// register operand: the probabilities in 16 bits) stay after the join — writing a
/// register that an in-flight `wgmma` reads would serialise everything.
fn sink_into_branch(ops: &mut Vec<Op>, from: usize, live_out: &[Value], pinned: &[Value], c: &mut Cloner) {
    let Some(b) = ops[from..].iter().rposition(|o| !o.regions.is_empty()).map(|i| from + i) else { return };
    let tail = &ops[b + 1..];
    if ops[b].kind != OpKind::If || tail.is_empty() || tail.iter().any(|o| !o.regions.is_empty() || !o.kind.is_pure()) {
        return;
    }
    let tail: Vec<Op> = ops.drain(b + 1..).collect();
    // Ops that stay after the join: those computing a pinned value, and what depends on them.
    let mut stay_values: HashSet<Value> = HashSet::new();
    let (mut sunk, mut stay) = (Vec::new(), Vec::new());
    for o in tail {
        if o.results.iter().any(|r| pinned.contains(r)) || o.operands.iter().any(|v| stay_values.contains(v)) {
            stay_values.extend(&o.results);
            stay.push(o);
        } else {
            sunk.push(o);
        }
    }
    if sunk.is_empty() {
        ops.extend(stay);
        return;
    }
    // What the `if` must now yield: its own results and the sunk ops' that are used
    // after it (by the ops that stay, or the loop's yield).
    let mut used_after: HashSet<Value> = live_out.iter().copied().collect();
    for o in &stay {
        used_after.extend(&o.operands);
    }
    let defined: Vec<Value> =
        ops[b].results.iter().chain(sunk.iter().flat_map(|o| o.results.iter())).copied().collect();
    let out: Vec<Value> = defined.into_iter().filter(|v| used_after.contains(v)).collect();
    let mut branch = ops.pop().expect("the branch");
    for arm in &mut branch.regions {
        let y = arm.ops.pop().expect("a region ends in its yield");
        c.map = branch.results.iter().copied().zip(y.operands.iter().copied()).collect();
        for o in &sunk {
            let cloned = c.clone_op(o);
            arm.ops.push(cloned);
        }
        arm.ops.push(yield_of(out.iter().map(|v| c.get(*v)).collect()));
    }
    branch.results = out;
    ops.push(branch);
    ops.extend(stay);
}

fn yield_of(operands: Vec<Value>) -> Op {
    Op { kind: OpKind::Yield, operands, results: vec![], regions: vec![] }
}

/// A value of type `t` for a branch whose results are never used (zeros).
fn placeholder(c: &mut Cloner, t: &Type, ops: &mut Vec<Op>) -> Value {
    let dtype = t.dtype();
    let (k, zero) = c.new_op(OpKind::Const { value: 0.0, dtype }, vec![], Type::Scalar(dtype));
    ops.push(k);
    match t {
        Type::Tile(_, shape) => {
            let (s, v) = c.new_op(OpKind::Splat { shape: shape.clone() }, vec![zero], t.clone());
            ops.push(s);
            v
        }
        _ => zero,
    }
}

fn rotate(op: &Op, split: &Split, values: &mut Vec<Type>, sink: bool) -> (Vec<Op>, Rotation) {
    let body = &op.regions[0];
    let (yield_op, ops) = body.ops.split_last().expect("analysed loop has a yield");
    let (lo, hi, step) = (op.operands[0], op.operands[1], op.operands[2]);
    let inits = &op.operands[3..];
    let iv = body.args[0];
    let carried = &body.args[1..];
    let a = split.acc;
    let n = carried.len();
    let stage0: Vec<usize> = (0..ops.len()).filter(|i| !split.stage1.contains(i)).collect();
    let stage1: Vec<usize> = (0..ops.len()).filter(|i| split.stage1.contains(i)).collect();
    // What stage 1 runs: its ops and the stage-0 indices it computes again.
    let s1_run: Vec<usize> = (0..ops.len()).filter(|i| split.stage1.contains(i) || split.dup.contains(i)).collect();
    let others: Vec<usize> = (0..n).filter(|k| *k != a).collect();
    let mut out = Vec::new();
    let mut c = Cloner { values, map: HashMap::new() };
    let bool_ty = Type::Scalar(crate::types::DType::I1);
    let i32_ty = c.values[lo.index()].clone();
    let (has_op, has) = c.new_op(OpKind::Cmp(CmpPred::Lt), vec![lo, hi], bool_ty);
    out.push(has_op);

    // ---- prologue: stage 0 of the first iteration
    let pro_types: Vec<Type> = split
        .cross
        .iter()
        .map(|v| c.values[v.index()].clone())
        .chain(others.iter().map(|k| c.values[carried[*k].index()].clone()))
        .collect();
    c.map = HashMap::from([(iv, lo)]);
    for k in &others {
        c.map.insert(carried[*k], inits[*k]);
    }
    let mut then_ops: Vec<Op> = stage0.iter().map(|i| c.clone_op(&ops[*i])).collect();
    let then_yield: Vec<Value> =
        split.cross.iter().map(|v| c.get(*v)).chain(others.iter().map(|k| c.get(yield_op.operands[*k]))).collect();
    then_ops.push(yield_of(then_yield));
    let mut else_ops = Vec::new();
    let cross_types: Vec<Type> = split.cross.iter().map(|v| c.values[v.index()].clone()).collect();
    let mut else_yield: Vec<Value> = cross_types.iter().map(|t| placeholder(&mut c, t, &mut else_ops)).collect();
    else_yield.extend(others.iter().map(|k| inits[*k]));
    else_ops.push(yield_of(else_yield));
    let pro_results: Vec<Value> = pro_types
        .iter()
        .map(|t| {
            c.values.push(t.clone());
            Value(c.values.len() as u32 - 1)
        })
        .collect();
    out.push(Op {
        kind: OpKind::If,
        operands: vec![has],
        results: pro_results.clone(),
        regions: vec![Block { args: vec![], ops: then_ops }, Block { args: vec![], ops: else_ops }],
    });
    let (pro_cross, pro_carried) = pro_results.split_at(split.cross.len());

    // ---- the rotated loop
    let (hi2_op, hi2) = c.new_op(OpKind::Binary(BinOp::Sub), vec![hi, step], i32_ty.clone());
    out.push(hi2_op);
    let j = c.fresh(iv);
    let acc_arg = c.fresh(carried[a]);
    let other_args: Vec<Value> = others.iter().map(|k| c.fresh(carried[*k])).collect();
    let cross_args: Vec<Value> = split.cross.iter().map(|v| c.fresh(*v)).collect();
    let jp_arg = c.fresh(iv);
    let mut loop_ops = Vec::new();
    let (jn_op, jn) = c.new_op(OpKind::Binary(BinOp::Add), vec![j, step], i32_ty.clone());
    loop_ops.push(jn_op);
    // stage 0 of j + s, up to and including its first product
    c.map = HashMap::from([(iv, jn)]);
    for (k, arg) in others.iter().zip(&other_args) {
        c.map.insert(carried[*k], *arg);
    }
    let first_dot = stage0.iter().position(|i| matches!(ops[*i].kind, OpKind::Dot { .. })).unwrap_or(0);
    for i in &stage0[..=first_dot] {
        loop_ops.push(c.clone_op(&ops[*i]));
    }
    let s0_map = std::mem::take(&mut c.map);
    // stage 1 of j, reading the carried cross values
    c.map = HashMap::from([(iv, j), (carried[a], acc_arg)]);
    for (v, arg) in split.cross.iter().zip(&cross_args) {
        c.map.insert(*v, *arg);
    }
    for i in &s1_run {
        loop_ops.push(c.clone_op(&ops[*i]));
    }
    let acc_next = c.get(yield_op.operands[a]);
    let stage1_loads: Vec<(Value, Value)> = stage1
        .iter()
        .filter(|i| matches!(ops[**i].kind, OpKind::Load { .. }))
        .map(|i| (ops[*i].results[0], c.get(ops[*i].results[0])))
        .collect();
    // the rest of stage 0
    c.map = s0_map;
    let rest = loop_ops.len();
    for i in &stage0[first_dot + 1..] {
        loop_ops.push(c.clone_op(&ops[*i]));
    }
    let mut loop_yield = vec![acc_next];
    loop_yield.extend(others.iter().map(|k| c.get(yield_op.operands[*k])));
    loop_yield.extend(split.cross.iter().map(|v| c.get(*v)));
    loop_yield.push(jn);
    // The values stage 1's products read as operands (the probabilities), as computed
    // in this iteration for the next.
    let pinned: Vec<Value> = stage1
        .iter()
        .filter(|i| matches!(ops[**i].kind, OpKind::Dot { .. }))
        .flat_map(|i| ops[*i].operands[..2].iter().copied())
        .filter(|v| split.cross.contains(v))
        .map(|v| c.get(v))
        .collect();
    if sink {
        sink_into_branch(&mut loop_ops, rest, &loop_yield, &pinned, &mut c);
    }
    loop_ops.push(yield_of(loop_yield));
    let mut loop_args = vec![j, acc_arg];
    loop_args.extend(&other_args);
    loop_args.extend(&cross_args);
    loop_args.push(jp_arg);
    let mut loop_inits = vec![lo, hi2, step, inits[a]];
    loop_inits.extend(pro_carried);
    loop_inits.extend(pro_cross);
    loop_inits.push(lo);
    let loop_results: Vec<Value> = loop_args[1..].iter().map(|v| c.fresh(*v)).collect();
    // The original results of the carried values other than the accumulator stay the
    // loop's (so nothing after the loop needs renaming).
    let mut loop_results = loop_results;
    for (slot, k) in others.iter().enumerate() {
        loop_results[1 + slot] = op.results[*k];
    }
    out.push(Op {
        kind: OpKind::For,
        operands: loop_inits,
        results: loop_results.clone(),
        regions: vec![Block { args: loop_args, ops: loop_ops }],
    });
    let acc_loop = loop_results[0];
    let cross_loop = &loop_results[1 + others.len()..1 + others.len() + split.cross.len()];
    let jp_loop = *loop_results.last().expect("jp result");

    // ---- epilogue: stage 1 of the last iteration
    c.map = HashMap::from([(iv, jp_loop), (carried[a], acc_loop)]);
    for (v, r) in split.cross.iter().zip(cross_loop) {
        c.map.insert(*v, *r);
    }
    let mut then_ops: Vec<Op> = s1_run.iter().map(|i| c.clone_op(&ops[*i])).collect();
    then_ops.push(yield_of(vec![c.get(yield_op.operands[a])]));
    let rotation =
        Rotation { epilogue_loads: stage1_loads.iter().map(|(orig, in_loop)| (c.get(*orig), *in_loop)).collect() };
    out.push(Op {
        kind: OpKind::If,
        operands: vec![has],
        results: vec![op.results[a]],
        regions: vec![
            Block { args: vec![], ops: then_ops },
            Block { args: vec![], ops: vec![yield_of(vec![acc_loop])] },
        ],
    });
    (out, rotation)
}
