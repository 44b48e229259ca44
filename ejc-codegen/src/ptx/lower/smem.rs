//! Shared memory: regions, the tiles of dot operands (`cp.async` or element by element,
//! chosen at run time), pipelined rings, and register tiles staged for products.

use super::*;

/// The dynamic shared memory's allocation: a stack of regions, each owned by an op (and
/// operand slot) so that an op in a loop body reuses its region every iteration. A loop
/// or branch gives back what its body took ([`Self::mark`], [`Self::release`]): tiles
/// never outlive their region, and every later writer starts at a barrier.
#[derive(Default)]
pub(super) struct SmemAlloc {
    top: usize,
    /// The most in use at once (the launch's dynamic size).
    peak: usize,
    regions: HashMap<(OpId, usize), usize>,
}

impl SmemAlloc {
    /// The region of `key`, allocated `align`-byte aligned the first time.
    pub(super) fn region(&mut self, key: (OpId, usize), bytes: usize, align: usize) -> usize {
        if let Some(o) = self.regions.get(&key) {
            return *o;
        }
        let off = self.top.div_ceil(align) * align;
        self.top = off + bytes;
        self.peak = self.peak.max(self.top);
        self.regions.insert(key, off);
        off
    }

    pub(super) fn get(&self, key: (OpId, usize)) -> Option<usize> {
        self.regions.get(&key).copied()
    }

    /// Where the stack stands (to [`Self::release`] to later).
    pub(super) fn mark(&self) -> usize {
        self.top
    }

    pub(super) fn release(&mut self, mark: usize) {
        self.top = mark;
    }

    /// Give back everything from `off` up (a tile that lives on in registers).
    pub(super) fn free_from(&mut self, off: usize) {
        self.top = self.top.min(off);
    }

    /// Keep the bottom `bytes` (the mbarriers) for the whole kernel.
    pub(super) fn reserve_bottom(&mut self, bytes: usize) {
        self.top = bytes;
        self.peak = bytes;
    }

    /// The launch's dynamic shared memory, in bytes.
    pub(super) fn bytes(&self) -> usize {
        self.peak.max(self.top)
    }
}

impl<'k> Lowering<'k> {
    /// A shared-memory region for (op, slot), allocated once, `align`-byte aligned.
    pub(super) fn region(&mut self, op: &Op, slot: usize, bytes: usize, align: usize) -> usize {
        self.alloc.region((self.du.id(op), slot), bytes, align)
    }

    /// `ptr addrspace(3)` at byte `off` (i32) of the dynamic shared array.
    pub(super) fn sptr(&self, off: V) -> V {
        self.ir.gep(self.ir.i8(), self.smem, self.ir.sext(off, self.ir.i64()))
    }

    pub(super) fn smem_shape(&self, op: &Op, acc: &Access) -> R<(usize, usize, DType)> {
        let Type::Tile(dtype, shape) = self.ty(op.results[0]).clone() else {
            return Err(self.err("a shared-memory load must give a tile".into()));
        };
        if acc.ranges.len() != 2 || shape.len() != 2 {
            return Err(self.err("dot operands are loaded as 2-D tiles".into()));
        }
        if dtype.size_bytes() != 2 {
            return Err(self.err(format!(
                "dot operands must be bf16 or f16 on the PTX targets (got {dtype}); f32 attention runs on the CPU back end"
            )));
        }
        let (rows, cols) = (shape[0], shape[1]);
        if cols % 8 != 0 {
            return Err(self.err(format!("a dot operand tile needs a multiple of 8 columns (got [{rows}, {cols}])")));
        }
        Ok((rows, cols, dtype))
    }

    pub(super) fn load_smem(&mut self, op: &'k Op, t: usize, acc: &Access, pad: f64) -> R<Smem> {
        if let Some((s, _, Some((full, parity)))) = self.epilogue_tiles.get(&op.results[0]).cloned() {
            // The producer copied it into the loop's ring.
            self.epilogue_tiles.remove(&op.results[0]);
            nvvm::mbarrier_wait(&self.ir, full, parity);
            self.zero_past_limit(acc, &s)?;
            return Ok(s);
        }
        if let Some((s, fast, _)) = self.epilogue_tiles.remove(&op.results[0]) {
            // The loop before copied this tile into its ring (cp.async path): make it
            // visible; otherwise copy it here, into the same buffer.
            let ub = self.ir.block("epi.ring");
            let fb = self.ir.block("epi.fill");
            let jb = self.ir.block("epi.done");
            self.ir.cond_br(fast, ub, fb);
            self.ir.at_end(ub);
            if s.wgmma_readable() {
                nvvm::fence_proxy_async(&self.ir);
            }
            self.sync();
            self.ir.br(jb);
            self.ir.at_end(fb);
            self.fill_smem(t, acc, &s, pad)?;
            self.ir.br(jb);
            self.ir.at_end(jb);
            return Ok(s);
        }
        let (rows, cols, dtype) = self.smem_shape(op, acc)?;
        let mut s = Smem::new(rows, cols, dtype, self.smem_layout(op.results[0], cols, dtype), self.ir.ci32(0));
        let key = self.du.id(op);
        if let Some(pf) = self.prefetch.get(&key).cloned() {
            s.off = self.pipelined_load(&pf, t, acc, &s, pad)?;
        } else {
            let off = self.region(op, 0, s.bytes(), s.align());
            s.off = self.ir.ci32(off as i64);
            let esize = s.dtype.size_bytes() as i64;
            if self.assume_aligned && self.depth == 0 && {
                let f = self.smem_fast(t, acc, esize, pad);
                self.ir.is_true(f)
            } {
                // The aligned entry copies a tile loaded before a loop (the query tile)
                // without waiting: the loop's first pipelined wait covers it, so its
                // latency overlaps the prologue's copies of the first key/value tiles.
                self.sync();
                self.issue_cp_async(t, acc, &s)?;
                nvvm::cp_async_commit(&self.ir);
                s.pending = true;
            } else {
                self.fill_smem(t, acc, &s, pad)?;
            }
        }
        // Keep an `a` tile in registers when it is small: one m-fragment per warp (the
        // query tile of attention with 16 rows per warp, like FlashAttention-2 with Q
        // in registers). With more rows per warp its fragments would crowd out the
        // accumulators, so it stays in shared memory and `ldmatrix` reads it per use.
        let per_warp_frags = rows.div_ceil(16 * self.warps) * cols.div_ceil(16);
        if self.plan.a_only.contains(&op.results[0]) && per_warp_frags * 4 <= 32 && s.layout == SmemLayout::Padded {
            if s.pending && self.depth == 0 {
                // Read after the next loop's prologue (`for_op`); its shared
                // memory stays reserved (the loop's buffers must not reuse it while the
                // copy may still be landing).
                self.pending_afrags.push(op.results[0]);
                return Ok(s);
            }
            self.ready(&mut s);
            let frags = self.a_frags_from_smem(&s)?;
            s.afrags = Some(frags);
            if self.depth == 0 && !self.prefetch.contains_key(&key) {
                // The tile lives on in registers: its shared memory is free again once
                // every warp has read it.
                self.sync();
                if let Some(off) = self.alloc.get((key, 0)) {
                    self.alloc.free_from(off);
                }
            }
        }
        Ok(s)
    }

    /// Whether the tile of `acc` can be copied with 16-byte `cp.async`: unit stride on
    /// the column axis, rows a multiple of 8 elements apart, 16-byte aligned start,
    /// zero padding (i1, uniform).
    pub(super) fn smem_fast(&mut self, t: usize, acc: &Access, esize: i64, pad: f64) -> V {
        let (ra, ca) = (acc.ranges[0], acc.ranges[1]);
        if pad == 0.0 {
            self.aligned_tensors.insert(t);
            if self.assume_aligned && esize >= 2 {
                // Aligned data and strides: the start is aligned when the first column
                // is (a constant in every kernel so far, so the test folds away).
                let ir = &self.ir;
                let col_bytes = ir.mul(ca.start, ir.ci64(esize));
                return ir.icmp(LLVMIntEQ, ir.and(col_bytes, ir.ci64(15)), ir.ci64(0));
            }
        }
        let strides = &self.tensors[t].strides;
        let ir = &self.ir;
        let data_i = ir.ptr_to_int(self.tensors[t].data, ir.i64());
        let start_elems =
            ir.add(ir.add(acc.off, ir.mul(ra.start, strides[ra.axis])), ir.mul(ca.start, strides[ca.axis]));
        let start_bytes = ir.add(data_i, ir.mul(start_elems, ir.ci64(esize)));
        let aligned = ir.icmp(LLVMIntEQ, ir.and(start_bytes, ir.ci64(15)), ir.ci64(0));
        let unit = ir.icmp(LLVMIntEQ, strides[ca.axis], ir.ci64(1));
        let rows8 = ir.icmp(LLVMIntEQ, ir.and(strides[ra.axis], ir.ci64(7)), ir.ci64(0));
        let fast = ir.and(ir.and(aligned, unit), rows8);
        if pad == 0.0 {
            fast
        } else {
            ir.cfalse()
        }
    }

    /// Issue the `cp.async` copies of the tile of `acc` into `s` (16 bytes per thread
    /// per step; chunks outside the tensor are zero-filled). No commit, no wait.
    pub(super) fn issue_cp_async(&mut self, t: usize, acc: &Access, s: &Smem) -> R<()> {
        let (ra, ca) = (acc.ranges[0], acc.ranges[1]);
        let threads = self.warps * 32;
        let esize = s.dtype.size_bytes() as i64;
        let strides = self.tensors[t].strides.clone();
        let ir = &self.ir;
        let start_elems =
            ir.add(ir.add(acc.off, ir.mul(ra.start, strides[ra.axis])), ir.mul(ca.start, strides[ca.axis]));
        let per_chunk = 16 / esize as usize;
        let chunks_per_row = s.cols.div_ceil(per_chunk);
        let total = s.rows * chunks_per_row;
        if threads.is_multiple_of(chunks_per_row) && total.is_multiple_of(threads) {
            return self.issue_cp_async_rows(t, acc, s, start_elems);
        }
        let ir = &self.ir;
        let tid = ir.add(ir.mul(self.warp, ir.ci32(32)), self.lane);
        // Elements of a row inside the column bound and limit (loop-invariant).
        let mut cend = self.tensors[t].shape[ca.axis];
        if let Some(l) = ca.limit {
            cend = ir.select(ir.icmp(LLVMIntSLT, l, cend), l, cend);
        }
        let mut i = 0usize;
        while i < total {
            let ir = &self.ir;
            let c = ir.add(tid, ir.ci32(i as i64));
            let in_tile = ir.icmp(LLVMIntSLT, c, ir.ci32(total as i64));
            let row = ir.udiv(c, ir.ci32(chunks_per_row as i64));
            let ch = ir.urem(c, ir.ci32(chunks_per_row as i64));
            let gr = ir.add(ra.start, ir.sext(row, ir.i64()));
            let gc = ir.add(ca.start, ir.mul(ir.sext(ch, ir.i64()), ir.ci64(per_chunk as i64)));
            let row_ok = ir.and(acc.valid, self.in_range(t, ra.axis, gr, ra.limit));
            let ir = &self.ir;
            let left = ir.sub(cend, gc);
            let left = ir.select(ir.icmp(LLVMIntSLT, left, ir.ci64(0)), ir.ci64(0), left);
            let left = ir.select(ir.icmp(LLVMIntSGT, left, ir.ci64(per_chunk as i64)), ir.ci64(per_chunk as i64), left);
            let nbytes = ir.mul(ir.trunc(left, ir.i32()), ir.ci32(esize));
            let nbytes = ir.select(ir.and(row_ok, ir.icmp(LLVMIntSGE, gc, ir.ci64(0))), nbytes, ir.ci32(0));
            let idx = ir.add(ir.add(acc.off, ir.mul(gr, strides[ra.axis])), gc);
            // Nothing to read: point at the (aligned) tile start, never outside.
            let idx = ir.select(ir.icmp(LLVMIntSGT, nbytes, ir.ci32(0)), idx, start_elems);
            let src = ir.gep(self.storage_ty(s.dtype), self.tensors[t].data, idx);
            let dst_off = ir.add(s.off, s.chunk_off(ir, row, ch));
            let dst = self.sptr(dst_off);
            if total.is_multiple_of(threads) || i + threads <= total {
                nvvm::cp_async_16(&self.ir, dst, src, nbytes);
            } else {
                self.if_then(in_tile, &mut |cg| {
                    nvvm::cp_async_16(&cg.ir, dst, src, nbytes);
                    Ok(())
                })?;
            }
            i += threads;
        }
        Ok(())
    }

    /// [`Self::issue_cp_async`] when every thread copies the same column chunk of rows
    /// `r0, r0 + R, r0 + 2R, ...` (R = threads / chunks per row): one column bound, and
    /// source addresses as a chain `a + R·stride` — few registers live across a loop.
    pub(super) fn issue_cp_async_rows(&mut self, t: usize, acc: &Access, s: &Smem, start_elems: V) -> R<()> {
        let (ra, ca) = (acc.ranges[0], acc.ranges[1]);
        let threads = self.warps * 32;
        let esize = s.dtype.size_bytes() as i64;
        let per_chunk = 16 / esize as usize;
        let cpr = s.cols.div_ceil(per_chunk);
        let rstep = threads / cpr;
        let steps = s.rows * cpr / threads;
        let stride_r = self.tensors[t].strides[ra.axis];
        let ir = &self.ir;
        let tid = ir.add(ir.mul(self.warp, ir.ci32(32)), self.lane);
        let cm = s.layout == SmemLayout::CoreMatrix;
        let (r0, ch, rstep) = if cm && cpr.is_multiple_of(4) && self.warps.is_multiple_of(cpr / 4) {
            // Core-matrix layout: the 8 lanes of a quarter-warp write the 8 rows of one
            // core matrix (128 contiguous bytes: no bank conflict), and a warp covers 4
            // chunks of those rows (64 contiguous bytes of each source row).
            let cb = cpr / 4;
            let w = self.warp;
            let r0 = ir.add(ir.mul(ir.udiv(w, ir.ci32(cb as i64)), ir.ci32(8)), ir.and(self.lane, ir.ci32(7)));
            let ch = ir.add(ir.mul(ir.urem(w, ir.ci32(cb as i64)), ir.ci32(4)), ir.lshr(self.lane, ir.ci32(3)));
            (r0, ch, 8 * self.warps / cb)
        } else {
            (ir.udiv(tid, ir.ci32(cpr as i64)), ir.urem(tid, ir.ci32(cpr as i64)), rstep)
        };
        // Bytes of this thread's column chunk inside the tensor (the same on every row).
        let gc = ir.add(ca.start, ir.mul(ir.sext(ch, ir.i64()), ir.ci64(per_chunk as i64)));
        let mut cend = self.tensors[t].shape[ca.axis];
        if let Some(l) = ca.limit {
            cend = ir.select(ir.icmp(LLVMIntSLT, l, cend), l, cend);
        }
        let left = ir.sub(cend, gc);
        let left = ir.select(ir.icmp(LLVMIntSLT, left, ir.ci64(0)), ir.ci64(0), left);
        let left = ir.select(ir.icmp(LLVMIntSGT, left, ir.ci64(per_chunk as i64)), ir.ci64(per_chunk as i64), left);
        let col_ok = ir.and(acc.valid, ir.icmp(LLVMIntSGE, gc, ir.ci64(0)));
        let col_bytes = ir.select(col_ok, ir.mul(ir.trunc(left, ir.i32()), ir.ci32(esize)), ir.ci32(0));
        // Rows: [0, rend) of the tensor axis.
        let mut rend = self.tensors[t].shape[ra.axis];
        if let Some(l) = ra.limit {
            rend = ir.select(ir.icmp(LLVMIntSLT, l, rend), l, rend);
        }
        let gr0 = ir.add(ra.start, ir.sext(r0, ir.i64()));
        let data = self.tensors[t].data;
        let st = self.storage_ty(s.dtype);
        let fallback = ir.gep(st, data, start_elems);
        let mut src = ir.gep(st, data, ir.add(ir.add(acc.off, ir.mul(gr0, stride_r)), gc));
        let delta = ir.mul(stride_r, ir.ci64(rstep as i64));
        let dst0 = ir.add(s.off, s.chunk_off(ir, r0, ch));
        // Rows r0 + k·rstep: a constant step from dst0 when rstep keeps the row's place
        // in its 8-row group (always, for the padded layout).
        let const_step = s.layout == SmemLayout::Padded || rstep.is_multiple_of(8);
        let step_bytes = match s.layout {
            SmemLayout::Padded => rstep * s.row_bytes(),
            SmemLayout::CoreMatrix => rstep / 8 * s.group_bytes(),
            SmemLayout::Swizzle128 => rstep * 128,
        };
        for k in 0..steps {
            let ir = &self.ir;
            let gr = ir.add(gr0, ir.ci64((k * rstep) as i64));
            let row_ok = ir.and(ir.icmp(LLVMIntSGE, gr, ir.ci64(0)), ir.icmp(LLVMIntSLT, gr, rend));
            let nbytes = ir.select(row_ok, col_bytes, ir.ci32(0));
            let from = ir.select(ir.icmp(LLVMIntSGT, nbytes, ir.ci32(0)), src, fallback);
            let dst = if const_step {
                self.sptr(ir.add(dst0, ir.ci32((k * step_bytes) as i64)))
            } else {
                let row = ir.add(r0, ir.ci32((k * rstep) as i64));
                self.sptr(ir.add(s.off, s.chunk_off(ir, row, ch)))
            };
            nvvm::cp_async_16(ir, dst, from, nbytes);
            src = ir.gep(st, src, delta);
        }
        Ok(())
    }

    /// Copy the tile element by element (any strides, any pad), as a loop over the
    /// thread's share. No barriers.
    pub(super) fn fill_slow(&mut self, t: usize, acc: &Access, s: &Smem, pad: f64) -> R<()> {
        let (ra, ca) = (acc.ranges[0], acc.ranges[1]);
        let threads = (self.warps * 32) as i64;
        let esize = s.dtype.size_bytes() as i64;
        let strides = self.tensors[t].strides.clone();
        let total = (s.rows * s.cols) as i64;
        let padv = self.constant(pad, s.dtype);
        let pre = self.ir.current();
        let head = self.ir.block("smem.el.head");
        let body = self.ir.block("smem.el.body");
        let done = self.ir.block("smem.el.done");
        let tid0 = self.ir.add(self.ir.mul(self.warp, self.ir.ci32(32)), self.lane);
        self.ir.br(head);
        self.ir.at_end(head);
        let c = self.ir.phi(self.ir.i32());
        self.ir.add_incoming(c, tid0, pre);
        self.ir.cond_br(self.ir.icmp(LLVMIntSLT, c, self.ir.ci32(total)), body, done);
        self.ir.at_end(body);
        let ir = &self.ir;
        let row = ir.udiv(c, ir.ci32(s.cols as i64));
        let col = ir.urem(c, ir.ci32(s.cols as i64));
        let gr = ir.add(ra.start, ir.sext(row, ir.i64()));
        let gc = ir.add(ca.start, ir.sext(col, ir.i64()));
        let ok = self.in_range(t, ra.axis, gr, ra.limit);
        let ok = self.ir.and(acc.valid, ok);
        let ok = self.ir.and(ok, self.in_range(t, ca.axis, gc, ca.limit));
        let ir = &self.ir;
        let idx = ir.add(ir.add(acc.off, ir.mul(gr, strides[ra.axis])), ir.mul(gc, strides[ca.axis]));
        let x = self.load_elem(t, idx, ok, padv);
        let ir = &self.ir;
        let dst_off = ir.add(s.off, s.elem_off(ir, row, col));
        ir.store(x, self.sptr(dst_off), esize as u32);
        let next = self.ir.add(c, self.ir.ci32(threads));
        self.ir.add_incoming(c, next, self.ir.current());
        self.ir.br(head);
        self.ir.at_end(done);
        Ok(())
    }

    /// Copy the tile of `acc` into `s`, synchronously (barrier before: previous readers
    /// are done; barrier after: the data is visible to every warp).
    pub(super) fn fill_smem(&mut self, t: usize, acc: &Access, s: &Smem, pad: f64) -> R<()> {
        self.sync();
        let fast = self.smem_fast(t, acc, s.dtype.size_bytes() as i64, pad);
        let fb = self.ir.block("smem.vec");
        let sb = self.ir.block("smem.scalar");
        let jb = self.ir.block("smem.done");
        self.ir.cond_br(fast, fb, sb);
        self.ir.at_end(fb);
        self.issue_cp_async(t, acc, s)?;
        nvvm::cp_async_commit(&self.ir);
        nvvm::cp_async_wait(&self.ir, 0);
        self.ir.br(jb);
        self.ir.at_end(sb);
        self.fill_slow(t, acc, s, pad)?;
        self.ir.br(jb);
        self.ir.at_end(jb);
        if s.wgmma_readable() {
            nvvm::fence_proxy_async(&self.ir);
        }
        self.sync();
        Ok(())
    }

    /// Rows of a TMA tile past its row range's `limit` read as zero, as the load's
    /// semantics say, although the copy engine filled the whole box (it zero-fills only
    /// outside the tensor: a paged cache's rows past a sequence's context hold other
    /// data, perhaps not finite, and `0 · NaN` would reach the product). On a tile cut by
    /// its limit — uniform over the block, so a branch — each consumer warpgroup writes
    /// zeros over those rows itself and waits on its own named barrier (8 + warpgroup):
    /// a barrier over every consumer would deadlock against ping-pong's turn barriers. A
    /// row is 128 contiguous bytes of each 64-column block whatever the swizzle (the
    /// swizzle permutes 16-byte chunks within a row), so the stores need no swizzle
    /// arithmetic. Two warpgroups writing the same zeros over a row is benign: the
    /// slot's data is zero there either way.
    pub(super) fn zero_past_limit(&mut self, acc: &Access, s: &Smem) -> R<()> {
        let Some(ra) = acc.ranges.first().copied() else { return Ok(()) };
        let Some(limit) = ra.limit else { return Ok(()) };
        let ir = &self.ir;
        let rows = s.rows as i64;
        let n = ir.sub(limit, ra.start);
        let n = ir.select(ir.icmp(LLVMIntSLT, n, ir.ci64(0)), ir.ci64(0), n);
        let n = ir.trunc(n, ir.i32());
        let cut = ir.icmp(LLVMIntSLT, n, ir.ci32(rows));
        let off = s.off;
        let blocks = s.cols / 64;
        self.if_then(cut, &mut |cg| {
            let ir = &cg.ir;
            let tid = ir.add(ir.mul(cg.warp, ir.ci32(32)), cg.lane);
            let wg = ir.lshr(cg.warp, ir.ci32(2));
            let t = ir.and(tid, ir.ci32(127));
            let zero = ir.splat(ir.ci32(0), 4);
            // Chunk i: 64-column block i / (rows · 8), row (i / 8) mod rows, chunk i mod 8.
            let chunks = blocks as i64 * rows * 8;
            for k in 0..(chunks as usize).div_ceil(128) {
                let ir = &cg.ir;
                let i = ir.add(t, ir.ci32((k * 128) as i64));
                let row = ir.urem(ir.udiv(i, ir.ci32(8)), ir.ci32(rows));
                let past = ir.and(ir.icmp(LLVMIntSGE, row, n), ir.icmp(LLVMIntSLT, i, ir.ci32(chunks)));
                let at = ir.add(off, ir.mul(i, ir.ci32(16)));
                cg.if_then(past, &mut |cg| {
                    cg.ir.store(zero, cg.sptr(at), 16);
                    Ok(())
                })?;
            }
            nvvm::fence_proxy_async(&cg.ir);
            let id = cg.ir.add(cg.ir.ci32(8), wg);
            cg.ir.call_intrinsic("llvm.nvvm.barrier.cta.sync.aligned.count", &[], &[id, cg.ir.ci32(128)]);
            Ok(())
        })
    }

    /// A prefetched load at its place in the loop body: wait for this iteration's
    /// copy, make it visible, and start the copy `stages - 1` iterations ahead into the
    /// buffer the previous iteration used. Returns the buffer's offset (i32).
    pub(super) fn pipelined_load(&mut self, pf: &Prefetch<'k>, t: usize, acc: &Access, s: &Smem, pad: f64) -> R<V> {
        let st = self.stages as i64;
        let ir = &self.ir;
        let stage = ir.urem(pf.counter, ir.ci32(st));
        let off = ir.add(ir.ci32(pf.base as i64), ir.mul(stage, ir.ci32(pf.stride as i64)));
        if let Some(li) = pf.tma {
            // The producer copies it: wait for the slot's full barrier.
            let (full, _) = self.tma_bars(li, stage);
            let ir = &self.ir;
            let phase = ir.and(ir.udiv(pf.counter, ir.ci32(st)), ir.ci32(1));
            nvvm::mbarrier_wait(ir, full, phase);
            self.zero_past_limit(acc, &Smem { off, ..s.clone() })?;
            return Ok(off);
        }
        let fb = ir.block("pipe.fast");
        let sb = ir.block("pipe.slow");
        let jb = ir.block("pipe.done");
        ir.cond_br(pf.fast, fb, sb);
        // ---- cp.async pipeline
        self.ir.at_end(fb);
        nvvm::cp_async_wait(&self.ir, pf.in_flight as i64);
        if s.wgmma_readable() {
            nvvm::fence_proxy_async(&self.ir);
        }
        self.sync();
        let ir = &self.ir;
        let ahead = ir.ci32(st - 1);
        let next_iv = ir.add(pf.iv, ir.mul(pf.step, ahead));
        let next_stage = ir.urem(ir.add(pf.counter, ahead), ir.ci32(st));
        let next_off = ir.add(ir.ci32(pf.base as i64), ir.mul(next_stage, ir.ci32(pf.stride as i64)));
        let more = ir.icmp(LLVMIntSLT, next_iv, pf.hi);
        let (op, iv_value) = (pf.op, pf.iv_value);
        let next = Smem { off: next_off, ..s.clone() };
        self.if_then(more, &mut |cg| {
            let acc = cg.load_access(op, Some((iv_value, next_iv)))?;
            cg.issue_cp_async(t, &acc, &next)
        })?;
        nvvm::cp_async_commit(&self.ir);
        self.ir.br(jb);
        // The slow block below is dead when the fast path is certain (aligned entry):
        // from here on, copies committed before the loop are complete and visible.
        if self.ir.is_true(pf.fast) {
            self.covered = true;
        }
        // ---- element by element, synchronous
        self.ir.at_end(sb);
        self.sync();
        let here = Smem { off, ..s.clone() };
        self.fill_slow(t, acc, &here, pad)?;
        if s.wgmma_readable() {
            nvvm::fence_proxy_async(&self.ir);
        }
        self.sync();
        self.ir.br(jb);
        self.ir.at_end(jb);
        Ok(off)
    }

    /// Make a pending tile (see [`Smem::pending`]) readable: wait for every copy and
    /// barrier, unless a pipelined wait already covers it here.
    pub(super) fn ready(&mut self, s: &mut Smem) {
        if s.pending && !self.covered {
            nvvm::cp_async_wait(&self.ir, 0);
            if s.wgmma_readable() {
                nvvm::fence_proxy_async(&self.ir);
            }
            self.sync();
            s.pending = false;
        }
    }

    /// Read a shared-memory tile into the register layout.
    pub(super) fn smem_to_dist(&mut self, v: Value, s: &Smem) -> R<Dist> {
        let mut s = s.clone();
        self.ready(&mut s);
        let s = &s;
        let (rows, cols) = self.axes_of(v)?;
        let rc = self.row_coords(rows);
        let cc = self.col_coords(cols);
        let st = self.storage_ty(s.dtype);
        let mut e = Vec::new();
        for r in &rc {
            for c in &cc {
                let ir = &self.ir;
                let off = ir.add(s.off, s.elem_off(ir, *r, *c));
                e.push(ir.load(st, self.sptr(off), s.dtype.size_bytes() as u32));
            }
        }
        Ok(Dist { rows, cols, e })
    }

    /// Write a register tile (`[rows, cols]`, 16-bit) to a shared-memory region of
    /// `op` (for a `b` operand computed in registers).
    pub(super) fn dist_to_smem(&mut self, op: &'k Op, slot: usize, v: Value) -> R<Smem> {
        let Type::Tile(dtype, shape) = self.ty(v).clone() else {
            return Err(self.err("not a tile".into()));
        };
        if dtype.size_bytes() != 2 || shape.len() != 2 {
            return Err(
                self.err(format!("dot operands must be 2-D bf16 or f16 tiles on the PTX targets (got {})", self.ty(v)))
            );
        }
        let d = self.dist(v)?;
        let mut s =
            Smem::new(shape[0], shape[1], dtype, SmemLayout::for_tile(shape[1], dtype, self.wgmma), self.ir.ci32(0));
        let off = self.region(op, slot, s.bytes(), s.align());
        s.off = self.ir.ci32(off as i64);
        self.sync();
        let rc = self.row_coords(d.rows);
        let cc = self.col_coords(d.cols);
        let nc = cc.len();
        // Rows a warp replicates (`row_warps`) are written by their owner only.
        let owner = self.row_owner(shape[0]);
        let write = |cg: &mut Self| -> R<()> {
            for (ri, r) in rc.iter().enumerate() {
                for (ci, c) in cc.iter().enumerate() {
                    let ir = &cg.ir;
                    let off = ir.add(s.off, s.elem_off(ir, *r, *c));
                    ir.store(Self::elem(&d, ri, ci, nc), cg.sptr(off), 2);
                }
            }
            Ok(())
        };
        if self.ir.is_true(owner) {
            write(self)?;
        } else {
            self.if_then(owner, &mut |cg| write(cg))?;
        }
        if s.wgmma_readable() {
            nvvm::fence_proxy_async(&self.ir);
        }
        self.sync();
        Ok(s)
    }
}
