//! Reductions across a row's lanes, the online softmax, and Philox random numbers.

use super::*;

impl<'k> Lowering<'k> {
    /// Reduce `x` over the four lanes of a quad (the column slots of a row).
    pub(super) fn quad_reduce(&self, x: V, max: bool) -> V {
        let ir = &self.ir;
        let mut x = x;
        for m in [1, 2] {
            let y = nvvm::shfl_xor_f32(ir, x, m);
            x = if max { ir.maxnum(x, y) } else { ir.fadd(x, y) };
        }
        x
    }

    pub(super) fn row_fold(&self, d: &Dist, ri: usize, max: bool, f: &dyn Fn(V) -> V) -> V {
        let ir = &self.ir;
        let nc = Self::ncols(d.cols);
        // A balanced tree, not a chain: log2(nc) dependent steps instead of nc - 1.
        let mut xs: Vec<V> = (0..nc).map(|ci| f(Self::elem(d, ri, ci, nc))).collect();
        while xs.len() > 1 {
            let pair = |a: V, b: V| if max { ir.maxnum(a, b) } else { ir.fadd(a, b) };
            xs = xs.chunks(2).map(|p| p.iter().copied().reduce(pair).expect("chunks are not empty")).collect();
        }
        let mut acc = xs[0];
        if d.cols != Ax::One {
            acc = self.quad_reduce(acc, max);
        }
        acc
    }

    pub(super) fn reduce(&mut self, op: &'k Op, r: ReduceOp, axis: u8) -> R<()> {
        let x = self.dist(op.operands[0])?;
        let dt = self.ty(op.operands[0]).dtype();
        if axis != 1 && !matches!(self.ty(op.operands[0]), Type::Tile(_, s) if s.len() == 1) {
            return Err(self.err("reductions along axis 0 (across warps) are not supported yet".into()));
        }
        if dt != DType::F32 {
            return Err(self.err(format!("reductions of {dt} tiles are not supported yet (f32 only)")));
        }
        let max = matches!(r, ReduceOp::Max);
        if !matches!(r, ReduceOp::Max | ReduceOp::Sum) {
            return Err(self.err(format!("reduction {r:?} is not supported yet")));
        }
        let (rows, cols) = self.axes_of(op.results[0])?;
        if matches!(self.ty(op.operands[0]), Type::Tile(_, s) if s.len() == 1) {
            return Err(self.err("reducing a rank-1 tile to a scalar is not supported yet".into()));
        }
        let mut e = Vec::new();
        for ri in 0..self.nrows(x.rows) {
            e.push(self.row_fold(&x, ri, max, &|v| v));
        }
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
        // Unscaled scores (`scale_fold`): m = c · max(s), p = ex2(fma(s, c, −m)).
        let scale = match self.scaled_softmax.get(&op.results[0]) {
            Some(c) => Some(self.scalar(*c)?),
            None => None,
        };
        for ri in 0..nr {
            let rmax = self.row_fold(&s, ri, true, &|v| v);
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
            let psum = self.row_fold(&prow, 0, false, &|v| v);
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
