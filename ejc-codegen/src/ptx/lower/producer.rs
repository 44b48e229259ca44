//! The warp-specialised entry: barriers, the consumers' program and the producer's
//! (its loops' bulk tensor copies into the rings, on full/empty mbarriers).

use super::*;

impl<'k> Lowering<'k> {
    /// The warp-specialised entry: barriers, then the consumers' program (the kernel)
    /// and the producer's (see [`super::ws`]). `pi`: the first parameter after the
    /// ABI's (the tensor maps).
    pub(super) fn run_ws(&mut self, ws: &WsLowering, pi: u32, tid: V) -> R<()> {
        let body = &self.kernel.body;
        let tmaps: Vec<V> = (0..ws.tma.len()).map(|i| self.ir.param(pi + i as u32)).collect();
        if !ws.tma.is_empty() {
            // The mbarriers (full and empty, per load and ring slot) at the bottom of
            // shared memory, initialised by one thread before anyone uses them.
            let bytes = 16 * ws.tma.len() * self.stages;
            self.alloc.reserve_bottom(bytes);
            let first = self.ir.icmp(LLVMIntEQ, tid, self.ir.ci32(0));
            let n = ws.tma.len();
            let consumers = self.warps * 32;
            self.if_then(first, &mut |cg| {
                for li in 0..n {
                    for slot in 0..cg.stages {
                        let (full, empty) = cg.tma_bars(li, cg.ir.ci32(slot as i64));
                        nvvm::mbarrier_init(&cg.ir, full, 1);
                        nvvm::mbarrier_init(&cg.ir, empty, consumers);
                    }
                }
                nvvm::mbarrier_init_fence(&cg.ir);
                Ok(())
            })?;
            nvvm::barrier(&self.ir);
            // The rings first, below everything else: the producer starts copying at
            // once, so no tile of the consumers may ever share their memory.
            for t in &ws.tma {
                let op = self.du.def(t.load).ok_or_else(|| self.err("a TMA load is not in the kernel".into()))?;
                let tmpl = Smem::new(t.rows, t.cols, t.dtype, SmemLayout::Swizzle128, self.ir.ci32(0));
                let stride = tmpl.bytes().div_ceil(tmpl.align()) * tmpl.align();
                self.region(op, 0, stride * self.stages, tmpl.align());
            }
        }
        let params: Vec<Option<GV>> = self.vals.clone();
        let pb = self.ir.block("producer");
        let cb = self.ir.block("consumer");
        let is_producer = self.ir.icmp(LLVMIntUGE, self.warp, self.ir.ci32(self.warps as i64));
        self.ir.cond_br(is_producer, pb, cb);
        // ---- consumers: the kernel
        self.ir.at_end(cb);
        if let Some((more, _)) = ws.regs {
            nvvm::setmaxnreg(&self.ir, more, true);
        }
        self.block(body)?;
        self.planned_waits(None)?;
        self.ir.ret_void();
        // ---- producer: one thread issues the copies of the loops' tiles
        self.ir.at_end(pb);
        if let Some((_, fewer)) = ws.regs {
            nvvm::setmaxnreg(&self.ir, fewer, false);
        }
        if !ws.tma.is_empty() {
            self.vals = params;
            self.producer = true;
            let elected = self.ir.icmp(LLVMIntEQ, tid, self.ir.ci32((self.warps * 32) as i64));
            self.if_then(elected, &mut |cg| cg.producer_block(body, &tmaps))?;
            self.producer = false;
        }
        self.ir.ret_void();
        Ok(())
    }

    /// The producer's share of block `b`: the scalars (loop bounds, tile indices) and
    /// the loops' copies.
    pub(super) fn producer_block(&mut self, b: &'k Block, tmaps: &[V]) -> R<()> {
        for op in &b.ops {
            let scalar_results = op.results.iter().all(|r| matches!(self.ty(*r), Type::Scalar(_)));
            match &op.kind {
                OpKind::ProgramId { .. } | OpKind::TensorDim { .. } | OpKind::Const { .. } => self.op(op)?,
                OpKind::Binary(_) | OpKind::Unary(_) | OpKind::Cmp(_) | OpKind::Select | OpKind::Cast { .. }
                    if scalar_results =>
                {
                    self.op(op)?
                }
                OpKind::Load { axes, .. } if axes.iter().all(|a| matches!(a, AxisIndex::Index)) => self.op(op)?,
                OpKind::For => self.producer_for(op, tmaps)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// The producer's loop for `op`: for each iteration and TMA load, wait until the
    /// consumers are done with the ring slot, then copy the iteration's tile into it.
    pub(super) fn producer_for(&mut self, op: &'k Op, tmaps: &[V]) -> R<()> {
        let loads: Vec<(&'k Op, usize)> =
            self.prefetchable(op).into_iter().filter_map(|o| self.tma_index(o.results[0]).map(|i| (o, i))).collect();
        if loads.is_empty() {
            return Ok(());
        }
        let tma = self.ws.as_ref().map(|w| w.tma.clone()).unwrap_or_default();
        let lo = self.scalar(op.operands[0])?;
        let hi = self.scalar(op.operands[1])?;
        let step = self.scalar(op.operands[2])?;
        let iv_value = op.regions[0].args[0];
        let st = self.stages as i64;
        let mut infos = Vec::new();
        let mut top = hi;
        for (o, li) in &loads {
            let t = &tma[*li];
            let tmpl = Smem::new(t.rows, t.cols, t.dtype, SmemLayout::Swizzle128, self.ir.ci32(0));
            let stride = tmpl.bytes().div_ceil(tmpl.align()) * tmpl.align();
            let base = self.alloc.get((self.du.id(o), 0)).ok_or_else(|| {
                self.err(format!("producer: the ring of load %{} was not allocated", o.results[0].index()))
            })?;
            let lhi = if self.stream_next.contains_key(&o.results[0]) { self.ir.add(hi, step) } else { hi };
            top = self.ir.select(self.ir.icmp(LLVMIntSLT, top, lhi), lhi, top);
            infos.push((*o, *li, base, stride, lhi));
        }
        let control::LoopHead { head, body, exit, iv, counter, .. } = self.loop_head("prod", lo);
        self.ir.cond_br(self.ir.icmp(LLVMIntSLT, iv, top), body, exit);
        self.ir.at_end(body);
        let slot = self.ir.urem(counter, self.ir.ci32(st));
        let phase = self.ir.and(self.ir.udiv(counter, self.ir.ci32(st)), self.ir.ci32(1));
        for (o, li, base, stride, lhi) in infos {
            let t = tma[li].clone();
            let tmap = tmaps[li];
            let more = self.ir.icmp(LLVMIntSLT, iv, lhi);
            self.if_then(more, &mut |cg| {
                let (full, empty) = cg.tma_bars(li, slot);
                let ir = &cg.ir;
                nvvm::mbarrier_wait(ir, empty, ir.xor(phase, ir.ci32(1)));
                nvvm::mbarrier_arrive_expect_tx(ir, full, t.bytes());
                let acc = cg.load_access(o, Some((iv_value, iv)))?;
                let ir = &cg.ir;
                let buf = ir.add(ir.ci32(base as i64), ir.mul(slot, ir.ci32(stride as i64)));
                // Innermost axis first.
                let mut coords: Vec<V> = acc.coords.iter().rev().copied().collect();
                let col0 = coords[0];
                for c in 0..t.cols / 64 {
                    coords[0] = ir.add(col0, ir.ci32((c * 64) as i64));
                    let dst = ir.add(buf, ir.ci32((c * t.rows * 128) as i64));
                    let dst = ir.ptr_to_int(cg.sptr(dst), ir.i32());
                    nvvm::tma_load(ir, dst, tmap, &coords, full);
                }
                Ok(())
            })?;
        }
        let latch = self.ir.current();
        self.ir.add_incoming(iv, self.ir.add(iv, step), latch);
        self.ir.add_incoming(counter, self.ir.add(counter, self.ir.ci32(1)), latch);
        self.ir.br(head);
        self.ir.at_end(exit);
        Ok(())
    }
}
