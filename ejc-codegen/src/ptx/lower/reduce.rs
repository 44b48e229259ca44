//! Reductions (along a row's lanes; across a warp's rows and the warps, through shared
//! memory), the online softmax, and Philox random numbers.

use super::*;

impl<'k> Lowering<'k> {
    /// `a ∘ b` for a reduction's combining operation.
    fn combine(&self, r: ReduceOp, a: V, b: V) -> V {
        let ir = &self.ir;
        match r {
            ReduceOp::Sum => ir.fadd(a, b),
            ReduceOp::Max => ir.maxnum(a, b),
            ReduceOp::Min => ir.minnum(a, b),
        }
    }

    /// Combine `x` over the lanes whose index differs in the bits of `masks` (`[1, 2]`:
    /// the four lanes of a quad, a row's column slots; `[4, 8, 16]`: the eight quads, a
    /// warp's rows). Every lane gets the result.
    fn lanes_reduce(&self, x: V, r: ReduceOp, masks: &[u32]) -> V {
        let mut x = x;
        for &m in masks {
            let y = nvvm::shfl_xor_f32(&self.ir, x, m);
            x = self.combine(r, x, y);
        }
        x
    }

    /// Reduce `x` over the four lanes of a quad (the column slots of a row).
    pub(super) fn quad_reduce(&self, x: V, r: ReduceOp) -> V {
        self.lanes_reduce(x, r, &[1, 2])
    }

    /// A balanced tree over `xs`, not a chain: log2(n) dependent steps instead of n − 1.
    fn tree(&self, r: ReduceOp, mut xs: Vec<V>) -> V {
        while xs.len() > 1 {
            xs = xs
                .chunks(2)
                .map(|p| p.iter().copied().reduce(|a, b| self.combine(r, a, b)).expect("not empty"))
                .collect();
        }
        xs[0]
    }

    pub(super) fn row_fold(&self, d: &Dist, ri: usize, r: ReduceOp, f: &dyn Fn(V) -> V) -> V {
        let nc = Self::ncols(d.cols);
        let mut acc = self.tree(r, (0..nc).map(|ci| f(Self::elem(d, ri, ci, nc))).collect());
        if d.cols != Ax::One {
            acc = self.quad_reduce(acc, r);
        }
        acc
    }

    /// Combine, per slot, the values the warps hold (`xs`, one per slot, equal across a
    /// warp's lanes) through shared memory: every thread gets every slot's result, the
    /// values of the first `warps` warps (those that hold distinct rows: `row_warps`)
    /// combined in warp order. `slot_of(i)` is slot i's index (i32) among `slots` per
    /// warp.
    fn across_warps(
        &mut self,
        op: &'k Op,
        r: ReduceOp,
        (xs, warps): (Vec<V>, usize),
        slots: usize,
        slot_of: &dyn Fn(&Self, usize) -> V,
    ) -> Vec<V> {
        if warps == 1 {
            return xs;
        }
        let base = self.region(op, 0, self.warps * slots * 4, 16) as i64;
        // Earlier readers of the region (this op in a loop) are done before it is written.
        self.sync();
        let ir = &self.ir;
        // Lanes 0..3 write (they hold every slot of a warp between them).
        let writer = ir.icmp(LLVMIntULT, self.lane, ir.ci32(4));
        let warp_base = ir.mul(self.warp, ir.ci32((slots * 4) as i64));
        let then = ir.block("reduce.write");
        let join = ir.block("reduce.written");
        ir.cond_br(writer, then, join);
        ir.at_end(then);
        for (i, x) in xs.iter().enumerate() {
            let ir = &self.ir;
            let off = ir.add(ir.ci32(base), ir.add(warp_base, ir.mul(slot_of(self, i), ir.ci32(4))));
            ir.store(*x, self.sptr(off), 4);
        }
        self.ir.br(join);
        self.ir.at_end(join);
        self.sync();
        let mut out = Vec::new();
        for i in 0..xs.len() {
            let mut parts = Vec::new();
            for w in 0..warps {
                let ir = &self.ir;
                let off = ir.add(ir.ci32(base + (w * slots * 4) as i64), ir.mul(slot_of(self, i), ir.ci32(4)));
                parts.push(ir.load(ir.f32(), self.sptr(off), 4));
            }
            out.push(self.tree(r, parts));
        }
        out
    }

    pub(super) fn reduce(&mut self, op: &'k Op, r: ReduceOp, axis: u8) -> R<()> {
        let x = self.dist(op.operands[0])?;
        let dt = self.ty(op.operands[0]).dtype();
        if dt != DType::F32 {
            return Err(self.err(format!("reductions of {dt} tiles are not supported yet (f32 only)")));
        }
        let rank1 = matches!(self.ty(op.operands[0]), Type::Tile(_, s) if s.len() == 1);
        if rank1 {
            // To a scalar every thread holds.
            let v = match (x.rows, x.cols) {
                (Ax::One, Ax::One) => x.e[0],
                (Ax::One, _) => self.row_fold(&x, 0, r, &|v| v),
                (rows, _) => {
                    let mine: Vec<V> = (0..self.nrows(rows)).map(|ri| Self::elem(&x, ri, 0, 1)).collect();
                    let v = self.tree(r, mine);
                    let v = self.lanes_reduce(v, r, &[4, 8, 16]);
                    let zero = |s: &Self, _| s.ir.ci32(0);
                    let warps = self.row_warps(Self::extent(rows));
                    self.across_warps(op, r, (vec![v], warps), 1, &zero)[0]
                }
            };
            self.set(op.results[0], GV::Scalar(v));
            return Ok(());
        }
        let (rows, cols) = self.axes_of(op.results[0])?;
        if axis == 1 {
            let e = (0..self.nrows(x.rows)).map(|ri| self.row_fold(&x, ri, r, &|v| v)).collect();
            self.set(op.results[0], GV::Dist(Dist { rows, cols, e }));
            return Ok(());
        }
        // Axis 0: over the thread's rows, the warp's eight quads, then the warps.
        let nc = Self::ncols(x.cols);
        let e: Vec<V> = (0..nc)
            .map(|ci| {
                let mine = (0..self.nrows(x.rows)).map(|ri| Self::elem(&x, ri, ci, nc)).collect();
                let v = self.tree(r, mine);
                if x.rows == Ax::One {
                    v
                } else {
                    self.lanes_reduce(v, r, &[4, 8, 16])
                }
            })
            .collect();
        let e = if x.rows == Ax::One {
            e
        } else {
            // Slot ci of a thread is column col_base + offset(ci); as a slot index among
            // the warp's `cols`: that column.
            let width = Self::extent(x.cols);
            let offs = if x.cols == Ax::One { vec![0] } else { Self::col_offsets(width) };
            let col = move |s: &Self, ci: usize| {
                if width == 1 {
                    s.ir.ci32(0)
                } else {
                    s.ir.add(Self::col_base(&s.ir, s.lane), s.ir.ci32(offs[ci]))
                }
            };
            let warps = self.row_warps(Self::extent(x.rows));
            self.across_warps(op, r, (e, warps), width, &col)
        };
        self.set(op.results[0], GV::Dist(Dist { rows, cols, e }));
        Ok(())
    }

    pub(super) fn softmax_update(&mut self, op: &'k Op) -> R<()> {
        let s = self.dist(op.operands[0])?;
        let m = self.dist(op.operands[1])?;
        let l = self.dist(op.operands[2])?;
        let neg_inf = self.ir.cf32(f64::NEG_INFINITY);
        let nr = self.nrows(s.rows);
        let nc = Self::ncols(s.cols);
        let (mut pe, mut ae, mut me, mut le) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut p_all = vec![std::ptr::null_mut(); nr * nc];
        // A scale operand (`ejc_ir::passes::scale_fold`): m = c · max(s), p = ex2(fma(s, c, −m)).
        let scale = match op.operands.get(3) {
            Some(c) => Some(self.scalar(*c)?),
            None => None,
        };
        for ri in 0..nr {
            let rmax = self.row_fold(&s, ri, ReduceOp::Max, &|v| v);
            let ir = &self.ir;
            let rmax = match scale {
                Some(c) => ir.fmul(rmax, c),
                None => rmax,
            };
            let mi = Self::elem(&m, ri, 0, 1);
            let li = Self::elem(&l, ri, 0, 1);
            let m_new = ir.maxnum(mi, rmax);
            let dead = ir.fcmp(LLVMRealOEQ, m_new, neg_inf);
            let m_use = ir.select(dead, ir.cf32(0.0), m_new);
            let alpha = ir.select(dead, ir.cf32(1.0), nvvm::ex2(ir, ir.fsub(mi, m_use)));
            let neg_m = ir.fneg(m_use);
            for ci in 0..nc {
                let x = Self::elem(&s, ri, ci, nc);
                let e = match scale {
                    Some(c) => ir.fma(x, c, neg_m),
                    None => ir.fsub(x, m_use),
                };
                p_all[ri * nc + ci] = nvvm::ex2(ir, e);
            }
            let prow = Dist { rows: Ax::One, cols: s.cols, e: p_all[ri * nc..(ri + 1) * nc].to_vec() };
            let psum = self.row_fold(&prow, 0, ReduceOp::Sum, &|v| v);
            let ir = &self.ir;
            let l_new = ir.fma(li, alpha, psum);
            ae.push(alpha);
            me.push(m_new);
            le.push(l_new);
        }
        pe.extend(p_all);
        let (rr, rc) = self.axes_of(op.results[1])?;
        self.set(op.results[0], GV::Dist(Dist { rows: s.rows, cols: s.cols, e: pe }));
        self.set(op.results[1], GV::Dist(Dist { rows: rr, cols: rc, e: ae }));
        self.set(op.results[2], GV::Dist(Dist { rows: rr, cols: rc, e: me }));
        self.set(op.results[3], GV::Dist(Dist { rows: rr, cols: rc, e: le }));
        Ok(())
    }

    pub(super) fn softmax_finalize(&mut self, op: &'k Op) -> R<()> {
        let acc = self.dist(op.operands[0])?;
        let m = self.dist(op.operands[1])?;
        let l = self.dist(op.operands[2])?;
        let nr = self.nrows(acc.rows);
        let nc = Self::ncols(acc.cols);
        let (mut oe, mut lse) = (Vec::new(), Vec::new());
        for ri in 0..nr {
            let ir = &self.ir;
            let mi = Self::elem(&m, ri, 0, 1);
            let li = Self::elem(&l, ri, 0, 1);
            let empty = ir.fcmp(LLVMRealOEQ, li, ir.cf32(0.0));
            let lsafe = ir.select(empty, ir.cf32(1.0), li);
            let lg = math::log2(ir, lsafe);
            let v = ir.fmul(ir.fadd(mi, lg), ir.cf32(std::f64::consts::LN_2));
            lse.push(ir.select(empty, ir.cf32(f64::NEG_INFINITY), v));
            let inv = nvvm::rcp(ir, lsafe);
            for ci in 0..nc {
                let x = ir.fmul(Self::elem(&acc, ri, ci, nc), inv);
                oe.push(ir.select(empty, ir.cf32(0.0), x));
            }
        }
        let (lr, lc) = self.axes_of(op.results[1])?;
        self.set(op.results[0], GV::Dist(Dist { rows: acc.rows, cols: acc.cols, e: oe }));
        self.set(op.results[1], GV::Dist(Dist { rows: lr, cols: lc, e: lse }));
        Ok(())
    }

    pub(super) fn rand_uniform(&mut self, op: &'k Op) -> R<()> {
        let s: Vec<V> = op.operands.iter().map(|o| self.scalar(*o)).collect::<R<_>>()?;
        let (rows, cols) = self.axes_of(op.results[0])?;
        let rc = self.row_coords(rows);
        let cc = self.col_coords(cols);
        let mut e = Vec::new();
        for r in &rc {
            for c in &cc {
                let ir = &self.ir;
                let row = ir.add(*r, s[4]);
                let col = ir.add(*c, s[5]);
                let x0 = math::philox_first_word(ir, [row, col, s[3], s[2]], [s[0], s[1]]);
                let top = ir.lshr(x0, ir.ci32(8));
                let f = ir.uitofp(top, ir.f32());
                e.push(ir.fmul(f, ir.cf32(1.0 / 16777216.0)));
            }
        }
        self.set(op.results[0], GV::Dist(Dist { rows, cols, e }));
        Ok(())
    }
}
