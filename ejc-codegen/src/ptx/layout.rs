//! Layout assignment: where each tile of a kernel lives on the GPU.
//!
//! Every 2-D tile `[R, C]` that is computed in registers is distributed like the
//! accumulator of `mma.m16n8k16`: warps split the rows (`R / num_warps` each, in
//! fragments of 16), and inside a fragment lane `l` holds rows `l/4` and `l/4 + 8`,
//! columns `(l%4)·2 + {0, 1}` of every 8-column group. An axis of extent 1 is
//! broadcast (every thread holds it). So two tiles with the same shape always share
//! a layout, broadcasting is free, and row reductions need two lane shuffles.
//!
//! A rank-1 tile takes one of the two axes: **rows** (the `m`, `l` of the online
//! softmax, the query positions) or **columns** (the key positions of a block). This
//! pass decides which, from how the tile is used (`expand_dims` axis, reductions, the
//! softmax ops), propagating through element-wise ops, loops and branches; a tile
//! that would need both is an error naming it.
//!
//! Loads whose result feeds `tile.dot` go to **shared memory** (`cp.async`), from
//! where `ldmatrix` reads operand fragments; loads used only as the `a` operand of
//! dots are read into registers right after they land (the query tile of attention,
//! kept in registers across the key loop).

use std::collections::{HashMap, HashSet};

use ejc_ir::defuse::DefUse;
use ejc_ir::ir::{walk_ops, Kernel, Op, OpKind, Value};
use ejc_ir::types::Type;

/// Which axis of the accumulator layout a rank-1 tile follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Orient {
    Rows,
    Cols,
}

#[derive(Debug, Default)]
pub struct Plan {
    /// Rank-1 tiles (everything else has a layout by its shape).
    pub orient: HashMap<Value, Orient>,
    /// `tile.load` results that go to shared memory (dot operands).
    pub smem_loads: HashSet<Value>,
    /// Of those, the ones used only as a dot's `a` operand (read into registers at
    /// the load).
    pub a_only: HashSet<Value>,
    /// Rank-1 tiles cheap to compute again (from `arange`, `splat` and element-wise
    /// ops of those): they take whichever orientation each use needs, so a query
    /// position range and a key position range may be the same IR value.
    pub remat: HashSet<Value>,
}

struct Uf {
    parent: Vec<usize>,
    orient: Vec<Option<Orient>>,
}

impl Uf {
    fn find(&mut self, x: usize) -> usize {
        let mut r = x;
        while self.parent[r] != r {
            r = self.parent[r];
        }
        let mut y = x;
        while self.parent[y] != r {
            let n = self.parent[y];
            self.parent[y] = r;
            y = n;
        }
        r
    }
    fn set(&mut self, x: usize, o: Orient) -> Result<(), ()> {
        let r = self.find(x);
        match self.orient[r] {
            Some(p) if p != o => Err(()),
            _ => {
                self.orient[r] = Some(o);
                Ok(())
            }
        }
    }
    fn union(&mut self, a: usize, b: usize) -> Result<(), ()> {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra == rb {
            return Ok(());
        }
        let o = match (self.orient[ra], self.orient[rb]) {
            (Some(x), Some(y)) if x != y => return Err(()),
            (Some(x), _) | (_, Some(x)) => Some(x),
            _ => None,
        };
        self.parent[rb] = ra;
        self.orient[ra] = o;
        Ok(())
    }
}

fn rank1(k: &Kernel, v: Value) -> bool {
    matches!(k.ty(v), Type::Tile(_, s) if s.len() == 1)
}

/// Rank-1 tiles built only from `arange`, `splat`, scalars and element-wise ops.
fn rematerialisable(kernel: &Kernel) -> HashSet<Value> {
    let mut out = HashSet::new();
    walk_ops(&kernel.body, &mut |op: &Op| {
        let r = match op.results.first() {
            Some(r) if rank1(kernel, *r) => *r,
            _ => return,
        };
        let ok = match &op.kind {
            OpKind::Arange { .. } | OpKind::Splat { .. } => true,
            OpKind::Binary(_) | OpKind::Unary(_) | OpKind::Cmp(_) | OpKind::Select | OpKind::Cast { .. } => {
                op.operands.iter().all(|o| matches!(kernel.ty(*o), Type::Scalar(_)) || out.contains(o))
            }
            _ => false,
        };
        if ok {
            out.insert(r);
        }
    });
    out
}

pub fn plan(kernel: &Kernel) -> Result<Plan, String> {
    let n = kernel.values.len();
    let remat = rematerialisable(kernel);
    let mut uf = Uf { parent: (0..n).collect(), orient: vec![None; n] };
    let mut conflict: Option<Value> = None;
    let du = DefUse::new(kernel);
    let mut dot_a: HashSet<Value> = HashSet::new();
    let mut dot_b: HashSet<Value> = HashSet::new();
    let mut other_use: HashSet<Value> = HashSet::new();
    {
        let mut set = |uf: &mut Uf, v: Value, o: Orient| {
            if rank1(kernel, v) && !remat.contains(&v) && uf.set(v.index(), o).is_err() {
                conflict.get_or_insert(v);
            }
        };
        let tie = |uf: &mut Uf, a: Value, b: Value, conflict: &mut Option<Value>| {
            let free = remat.contains(&a) || remat.contains(&b);
            if rank1(kernel, a) && rank1(kernel, b) && !free && uf.union(a.index(), b.index()).is_err() {
                conflict.get_or_insert(a);
            }
        };
        let mut c2: Option<Value> = None;
        walk_ops(&kernel.body, &mut |op: &Op| {
            match &op.kind {
                OpKind::Dot { trans_a, .. } => {
                    // A transposed `a` is read from shared memory (`ldmatrix.trans`) at
                    // every use, never kept as fragments of its untransposed layout.
                    if *trans_a {
                        dot_b.insert(op.operands[0]);
                    } else {
                        dot_a.insert(op.operands[0]);
                    }
                    dot_b.insert(op.operands[1]);
                    other_use.insert(op.operands[2]);
                }
                _ => other_use.extend(op.operands.iter().copied()),
            }
            match &op.kind {
                OpKind::ExpandDims { axis } => {
                    set(&mut uf, op.operands[0], if *axis == 1 { Orient::Rows } else { Orient::Cols })
                }
                OpKind::Reduce { axis, .. } => {
                    set(&mut uf, op.results[0], if *axis == 1 { Orient::Rows } else { Orient::Cols })
                }
                OpKind::SoftmaxUpdate => {
                    // (operand 3, a scale, is a scalar)
                    for v in op.operands[1..3].iter().chain(&op.results[1..]) {
                        set(&mut uf, *v, Orient::Rows);
                    }
                }
                OpKind::SoftmaxRescale => set(&mut uf, op.operands[1], Orient::Rows),
                OpKind::SoftmaxFinalize => {
                    for v in op.operands[1..].iter().chain(&op.results[1..]) {
                        set(&mut uf, *v, Orient::Rows);
                    }
                }
                OpKind::Binary(_) | OpKind::Unary(_) | OpKind::Cmp(_) | OpKind::Select | OpKind::Cast { .. } => {
                    let r = op.results[0];
                    for o in &op.operands {
                        tie(&mut uf, r, *o, &mut c2);
                    }
                }
                OpKind::For => {
                    // operands: lo, hi, step, inits…; region args: iv, carried…
                    let region = &op.regions[0];
                    let yields = region.ops.last().map(|y| y.operands.clone()).unwrap_or_default();
                    for (i, r) in op.results.iter().enumerate() {
                        tie(&mut uf, *r, op.operands[3 + i], &mut c2);
                        tie(&mut uf, *r, region.args[1 + i], &mut c2);
                        if let Some(y) = yields.get(i) {
                            tie(&mut uf, *r, *y, &mut c2);
                        }
                    }
                }
                OpKind::If => {
                    for region in &op.regions {
                        if let Some(y) = region.ops.last() {
                            for (r, v) in op.results.iter().zip(&y.operands) {
                                tie(&mut uf, *r, *v, &mut c2);
                            }
                        }
                    }
                }
                _ => {}
            }
        });
        if let Some(v) = c2 {
            conflict.get_or_insert(v);
        }
    }
    if let Some(v) = conflict {
        return Err(format!(
            "the rank-1 tile %{} is used both along rows and along columns; the PTX back end keeps one layout per tile",
            v.index()
        ));
    }
    let mut plan = Plan { remat, ..Plan::default() };
    for i in 0..n {
        let v = Value(i as u32);
        if rank1(kernel, v) {
            let r = uf.find(i);
            plan.orient.insert(v, uf.orient[r].unwrap_or(Orient::Rows));
        }
    }
    for v in dot_a.iter().chain(&dot_b) {
        if let Some(op) = du.def(*v) {
            // 16-bit operands only: f32 products run on the CUDA cores from registers.
            let tile16 = matches!(kernel.ty(*v), Type::Tile(d, s) if s.len() == 2 && d.size_bytes() == 2);
            if matches!(op.kind, OpKind::Load { .. }) && tile16 {
                plan.smem_loads.insert(*v);
            }
        }
    }
    for v in &plan.smem_loads {
        if dot_a.contains(v) && !dot_b.contains(v) && !other_use.contains(v) {
            plan.a_only.insert(*v);
        }
    }
    Ok(plan)
}
