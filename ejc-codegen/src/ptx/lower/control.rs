//! Control flow: `scf.for` (with its software pipeline: prologue, rings, ping-pong) and
//! `scf.if`, register tiles carried as phis.

use super::*;

/// See [`Lowering::loop_head`].
pub(super) struct LoopHead {
    /// The block the loop is entered from.
    pub pre: B,
    pub head: B,
    pub body: B,
    pub exit: B,
    pub iv: V,
    pub counter: V,
}

impl<'k> Lowering<'k> {
    /// The LLVM values a register value is made of (for phis), and a rebuild.
    pub(super) fn flatten(&mut self, v: Value) -> R<(Vec<V>, Shape)> {
        match self.get(v)?.clone() {
            GV::Scalar(x) => Ok((vec![x], Shape::Scalar)),
            GV::Dist(d) => Ok((d.e.clone(), Shape::Dist(d.rows, d.cols))),
            GV::Smem(_) => {
                let d = self.dist(v)?;
                Ok((d.e.clone(), Shape::Dist(d.rows, d.cols)))
            }
            GV::Lazy => {
                let d = self.dist(v)?;
                Ok((d.e.clone(), Shape::Dist(d.rows, d.cols)))
            }
            GV::Tensor(_) => Err(self.err("tensors cannot be loop-carried".into())),
        }
    }

    /// The layout a value of type `v` has in registers, and across region boundaries:
    /// 16-bit float tiles cross them as pairs packed in 32-bit registers (half the phis;
    /// the pairs a `dot` operand is made of).
    pub(super) fn shape_of(&self, v: Value) -> R<Shape> {
        match self.ty(v) {
            Type::Scalar(_) => Ok(Shape::Scalar),
            Type::Tile(d, _) => {
                let (r, c) = self.axes_of(v)?;
                let n = self.nrows(r) * Self::ncols(c);
                if matches!(d, DType::BF16 | DType::F16) && n.is_multiple_of(2) {
                    Ok(Shape::Packed(r, c, *d))
                } else {
                    Ok(Shape::Dist(r, c))
                }
            }
            Type::Tensor(..) => Err(self.err("tensors cannot be loop-carried".into())),
        }
    }

    pub(super) fn shape_len(&self, s: Shape) -> usize {
        match s {
            Shape::Scalar => 1,
            Shape::Dist(r, c) => self.nrows(r) * Self::ncols(c),
            Shape::Packed(r, c, _) => self.nrows(r) * Self::ncols(c) / 2,
        }
    }

    pub(super) fn rebuild(&self, s: Shape, xs: Vec<V>) -> GV {
        match s {
            Shape::Scalar => GV::Scalar(xs[0]),
            Shape::Dist(rows, cols) => GV::Dist(Dist { rows, cols, e: xs }),
            Shape::Packed(rows, cols, dtype) => {
                let ir = &self.ir;
                let pair = ir.vec(self.compute_ty(dtype), 2);
                let mut e = Vec::with_capacity(2 * xs.len());
                for x in xs {
                    let v = ir.bitcast(x, pair);
                    e.push(ir.extract(v, 0));
                    e.push(ir.extract(v, 1));
                }
                GV::Dist(Dist { rows, cols, e })
            }
        }
    }

    /// Flatten `v` into exactly the layout `want` (broadcast tiles are expanded).
    pub(super) fn flatten_as(&mut self, v: Value, want: Shape) -> R<Vec<V>> {
        if let Shape::Packed(r, c, dtype) = want {
            let e = self.flatten_as(v, Shape::Dist(r, c))?;
            return Ok(e.chunks(2).map(|p| self.pack2(p[0], p[1], dtype)).collect());
        }
        let (xs, have) = self.flatten(v)?;
        if have == want {
            return Ok(xs);
        }
        match (have, want) {
            (Shape::Dist(hr, hc), Shape::Dist(wr, wc)) => {
                let d = Dist { rows: hr, cols: hc, e: xs };
                let (nr, nc) = (self.nrows(wr), Self::ncols(wc));
                let mut out = Vec::new();
                for ri in 0..nr {
                    for ci in 0..nc {
                        out.push(Self::elem(&d, ri, ci, nc));
                    }
                }
                Ok(out)
            }
            (Shape::Scalar, Shape::Dist(..)) => Ok(vec![xs[0]; self.shape_len(want)]),
            _ => Err(self.err(format!("%{} changes layout across a region boundary", v.index()))),
        }
    }

    /// The head of a counted loop, entered from the current block: blocks `<name>.head`,
    /// `.body` and `.exit`, and at the head the induction variable (from `lo`) and the
    /// iteration counter (from 0) as phis. The builder is left at the head.
    pub(super) fn loop_head(&mut self, name: &str, lo: V) -> LoopHead {
        let pre = self.ir.current();
        let head = self.ir.block(&format!("{name}.head"));
        let body = self.ir.block(&format!("{name}.body"));
        let exit = self.ir.block(&format!("{name}.exit"));
        self.ir.br(head);
        self.ir.at_end(head);
        let iv = self.ir.phi(self.ir.i32());
        self.ir.add_incoming(iv, lo, pre);
        let counter = self.ir.phi(self.ir.i32());
        self.ir.add_incoming(counter, self.ir.ci32(0), pre);
        LoopHead { pre, head, body, exit, iv, counter }
    }

    /// The loads of loop `op` that the schedule copies ahead.
    pub(super) fn prefetchable(&self, op: &'k Op) -> Vec<&'k Op> {
        self.sched
            .loops
            .get(&self.du.id(op))
            .map(|l| l.prefetched.iter().map(|i| self.du.op(*i)).collect())
            .unwrap_or_default()
    }

    /// A loop's software-pipeline prologue: its buffers, and the copies of the first
    /// `stages - 1` iterations' prefetched tiles, issued. Needs only the loop's bounds
    /// (not its carried values), so [`Self::block`] may issue it before the op that
    /// computes those (the prologue `scf.if` of `pipeline-dots`).
    pub(super) fn for_prologue(&mut self, op: &'k Op) -> R<PipePrologue<'k>> {
        let lo = self.scalar(op.operands[0])?;
        let hi = self.scalar(op.operands[1])?;
        let step = self.scalar(op.operands[2])?;
        let region = &op.regions[0];
        // Shared memory allocated for the loop (its pipeline buffers, the tiles of its
        // body) is free again after it: tiles never outlive their region, and every
        // later writer starts at a barrier.
        let smem_top = self.alloc.mark();
        // ---- software pipeline: buffers, and the first `stages - 1` iterations' copies
        let pf_ops = self.prefetchable(op);
        let st = self.stages;
        let mut pf_info = Vec::new();
        let mut fast = self.ir.ctrue();
        for o in &pf_ops {
            let acc = self.load_access(o, Some((region.args[0], lo)))?;
            let (rows, cols, dtype) = self.smem_shape(o, &acc)?;
            let tmpl = Smem::new(rows, cols, dtype, self.smem_layout(o.results[0], cols, dtype), self.ir.ci32(0));
            let stride = tmpl.bytes().div_ceil(tmpl.align()) * tmpl.align();
            let base = self.region(o, 0, stride * st, tmpl.align());
            let t = self.tensor_of(o.operands[0])?;
            let OpKind::Load { pad, .. } = o.kind else { continue };
            let f = self.smem_fast(t, &acc, dtype.size_bytes() as i64, pad);
            fast = self.ir.and(fast, f);
            // A stream that an epilogue continues (`pipeline-dots`) is copied one
            // iteration further: the epilogue finds its tile in the ring.
            let hi = if self.stream_next.contains_key(&o.results[0]) { self.ir.add(hi, step) } else { hi };
            pf_info.push(PfLoad { op: o, tensor: t, tmpl, base, stride, hi });
        }
        let copier = self.sched.loops.get(&self.du.id(op)).map_or(Copier::None, |l| l.copier);
        if copier == Copier::Tma {
            // The producer copies every tile of the loop.
            return Ok(PipePrologue { smem_top, pf_info, fast: self.ir.ctrue() });
        }
        if !pf_ops.is_empty() {
            let fb = self.ir.block("pipe.prologue");
            let jb = self.ir.block("pipe.prologue.done");
            self.ir.cond_br(fast, fb, jb);
            self.ir.at_end(fb);
            // The shared memory may still be read by an earlier part of the program.
            self.sync();
            for k in 0..st - 1 {
                let ivk = self.ir.add(lo, self.ir.mul(step, self.ir.ci32(k as i64)));
                let iv_value = region.args[0];
                for l in pf_info.clone() {
                    let more = self.ir.icmp(LLVMIntSLT, ivk, l.hi);
                    self.if_then(more, &mut |cg| {
                        let acc = cg.load_access(l.op, Some((iv_value, ivk)))?;
                        let dst = Smem { off: cg.ir.ci32((l.base + k * l.stride) as i64), ..l.tmpl.clone() };
                        cg.issue_cp_async(l.tensor, &acc, &dst)
                    })?;
                    // One group per load and iteration, copied or not: the counts the
                    // loop's waits rely on stay uniform.
                    nvvm::cp_async_commit(&self.ir);
                }
            }
            self.ir.br(jb);
            self.ir.at_end(jb);
            // Tiles copied before the loop and kept as fragments: their copies are the
            // oldest groups, so waiting for all but the prologue's is waiting for them.
            if self.depth == 0 && self.ir.is_true(fast) && !self.pending_afrags.is_empty() {
                nvvm::cp_async_wait(&self.ir, ((st - 1) * pf_ops.len()) as i64);
                self.sync();
                for v in std::mem::take(&mut self.pending_afrags) {
                    if let GV::Smem(mut sm) = self.get(v)?.clone() {
                        sm.afrags = Some(self.a_frags_from_smem(&sm)?);
                        sm.pending = false;
                        self.set(v, GV::Smem(sm));
                    }
                }
            }
        }
        Ok(PipePrologue { smem_top, pf_info, fast })
    }

    pub(super) fn for_op(&mut self, op: &'k Op) -> R<()> {
        let id = self.du.id(op);
        let pro = match self.early_prologues.remove(&id) {
            Some(p) => p,
            None => self.for_prologue(op)?,
        };
        let PipePrologue { smem_top, pf_info, fast } = pro;
        let lo = self.scalar(op.operands[0])?;
        let hi = self.scalar(op.operands[1])?;
        let step = self.scalar(op.operands[2])?;
        let region = &op.regions[0];
        let st = self.stages;
        let n = op.results.len();
        let shapes: Vec<Shape> = op.results.iter().map(|r| self.shape_of(*r)).collect::<R<_>>()?;
        let mut inits = Vec::new();
        for (i, s) in shapes.iter().enumerate() {
            inits.push(self.flatten_as(op.operands[3 + i], *s)?);
        }

        let lp =
            self.sched.loops.get(&id).cloned().ok_or_else(|| self.err(format!("schedule: no plan for loop {id}")))?;
        let tma_loop = lp.copier == Copier::Tma;
        if tma_loop {
            nvvm::cp_async_wait(&self.ir, 0);
            nvvm::fence_proxy_async(&self.ir);
            self.sync();
        }
        // Ping-pong (the schedule's: two consumer warpgroups of a warp-specialised loop):
        // the warpgroups take turns issuing the body's products (named barriers 2 and 3),
        // so one's softmax runs while the other's products occupy the tensor cores.
        // Warpgroup 0 goes first.
        if lp.pingpong.is_some() {
            let g = self.ir.lshr(self.warp, self.ir.ci32(2));
            let n = self.ir.ci32((self.warps * 32) as i64);
            let wg1 = self.ir.icmp(LLVMIntEQ, g, self.ir.ci32(1));
            // No iteration: nobody waits, so nobody may arrive.
            let any = self.ir.and(wg1, self.ir.icmp(LLVMIntSLT, lo, hi));
            self.if_then(any, &mut |cg| {
                cg.ir.call_intrinsic("llvm.nvvm.barrier.cta.arrive.aligned.count", &[], &[cg.ir.ci32(2), n]);
                Ok(())
            })?;
        }
        let LoopHead { pre, head, body, exit, iv, counter } = self.loop_head("for", lo);
        let mut phis = Vec::new();
        for init in inits.iter() {
            let ps: Vec<V> = init
                .iter()
                .map(|x| {
                    let p = self.ir.phi(self.ir.type_of(*x));
                    self.ir.add_incoming(p, *x, pre);
                    p
                })
                .collect();
            phis.push(ps);
        }
        let cond = self.ir.icmp(LLVMIntSLT, iv, hi);
        self.ir.cond_br(cond, body, exit);
        self.ir.at_end(body);
        self.set(region.args[0], GV::Scalar(iv));
        for i in 0..n {
            self.set(region.args[1 + i], self.rebuild(shapes[i], phis[i].clone()));
        }
        let saved = std::mem::take(&mut self.prefetch);
        let p = pf_info.len();
        for l in &pf_info {
            self.prefetch.insert(
                self.du.id(l.op),
                Prefetch {
                    op: l.op,
                    iv_value: region.args[0],
                    iv,
                    step,
                    hi: l.hi,
                    counter,
                    fast,
                    base: l.base,
                    stride: l.stride,
                    in_flight: (st - 1) * p - 1,
                    tma: self.tma_index(l.op.results[0]),
                },
            );
        }
        self.depth += 1;
        let saved_pingpong = self.pingpong.take();
        if let Some((first, last_dot)) = lp.pingpong {
            let last = self.ir.icmp(LLVMIntSGE, self.ir.add(iv, step), hi);
            self.pingpong = Some((first, last_dot, last));
        }
        let covered = std::mem::replace(&mut self.covered, false);
        if tma_loop {
            // Copies committed before the loop (the query tile) are complete and visible
            // from here on: waited for once, before the loop's first iteration (below,
            // at the end of the loop's entry block).
            self.covered = true;
        }
        let inside = defined_in(region);
        self.loop_values.push(inside);
        let r = self.block(region);
        self.loop_values.pop();
        self.pingpong = saved_pingpong;
        self.covered = covered;
        self.depth -= 1;
        self.prefetch = saved;
        r?;
        let yields = region.ops.last().map(|y| y.operands.clone()).unwrap_or_default();
        let mut nexts = Vec::new();
        for i in 0..n {
            nexts.push(self.flatten_as(yields[i], shapes[i])?);
        }
        // The iteration's products are complete (its yield waited for them): its tiles
        // go back to the producer.
        for l in &pf_info {
            if let Some(li) = self.tma_index(l.op.results[0]) {
                let slot = self.ir.urem(counter, self.ir.ci32(st as i64));
                let (_, empty) = self.tma_bars(li, slot);
                nvvm::mbarrier_arrive(&self.ir, empty);
            }
        }
        let next_iv = self.ir.add(iv, step);
        let next_counter = self.ir.add(counter, self.ir.ci32(1));
        let latch = self.ir.current();
        self.ir.add_incoming(iv, next_iv, latch);
        self.ir.add_incoming(counter, next_counter, latch);
        for (ps, xs) in phis.iter().zip(&nexts) {
            for (p, x) in ps.iter().zip(xs) {
                self.ir.add_incoming(*p, *x, latch);
            }
        }
        self.ir.br(head);
        self.ir.at_end(exit);
        if !pf_info.is_empty() {
            // Nothing may still be copying into shared memory after the loop.
            nvvm::cp_async_wait(&self.ir, 0);
        }
        // The tiles the epilogue continues with: the `counter`-th of their ring.
        for l in &pf_info {
            if let Some(epi) = self.stream_next.get(&l.op.results[0]).copied() {
                let ir = &self.ir;
                let slot = ir.urem(counter, ir.ci32(st as i64));
                let off = ir.add(ir.ci32(l.base as i64), ir.mul(slot, ir.ci32(l.stride as i64)));
                let bar = self.tma_index(l.op.results[0]).map(|li| {
                    let (full, _) = self.tma_bars(li, slot);
                    let ir = &self.ir;
                    (full, ir.and(ir.udiv(counter, ir.ci32(st as i64)), ir.ci32(1)))
                });
                self.epilogue_tiles.insert(epi, (Smem { off, ..l.tmpl.clone() }, fast, bar));
            }
        }
        self.alloc.release(smem_top);
        for i in 0..n {
            self.set(op.results[i], self.rebuild(shapes[i], phis[i].clone()));
        }
        Ok(())
    }

    pub(super) fn if_op(&mut self, op: &'k Op) -> R<()> {
        let cond = self.scalar(op.operands[0])?;
        // Like loops, branches give their shared memory back.
        let smem_top = self.alloc.mark();
        let shapes: Vec<Shape> = op.results.iter().map(|r| self.shape_of(*r)).collect::<R<_>>()?;
        let tb = self.ir.block("if.then");
        let eb = self.ir.block("if.else");
        let jb = self.ir.block("if.join");
        self.ir.cond_br(cond, tb, eb);
        let mut arms: Vec<(B, Vec<Vec<V>>)> = Vec::new();
        for (bb, region) in [(tb, &op.regions[0]), (eb, &op.regions[1])] {
            self.ir.at_end(bb);
            // The arms exclude each other: they share the same shared memory.
            self.alloc.release(smem_top);
            self.block(region)?;
            let yields = region.ops.last().map(|y| y.operands.clone()).unwrap_or_default();
            let mut vals = Vec::new();
            for (i, s) in shapes.iter().enumerate() {
                vals.push(self.flatten_as(yields[i], *s)?);
            }
            arms.push((self.ir.current(), vals));
            self.ir.br(jb);
        }
        self.ir.at_end(jb);
        // Every phi first (they head the block), then the values built from them.
        let mut phis = Vec::new();
        for i in 0..shapes.len() {
            let mut xs = Vec::new();
            for j in 0..arms[0].1[i].len() {
                let t = self.ir.type_of(arms[0].1[i][j]);
                let p = self.ir.phi(t);
                for (bb, vals) in &arms {
                    self.ir.add_incoming(p, vals[i][j], *bb);
                }
                xs.push(p);
            }
            phis.push(xs);
        }
        for (i, (s, xs)) in shapes.iter().zip(phis).enumerate() {
            self.set(op.results[i], self.rebuild(*s, xs));
        }
        self.alloc.release(smem_top);
        Ok(())
    }
}
