//! Global memory: access windows, register-tile loads and stores (element by element,
//! 32-bit rows, a loop's moving window).

use super::*;

impl<'k> Lowering<'k> {
    /// Per tile axis: (tensor axis, start i32, limit, size); plus the fixed-index
    /// byte offset (i64) and its validity.
    pub(super) fn access(&self, t: usize, axes: &[AxisIndex], operands: &[Value]) -> R<Access> {
        self.access_subst(t, axes, operands, None)
    }

    /// The access of load `op`, with scalar `subst.0` replaced by `subst.1` (a loop's
    /// induction variable by a later iteration's).
    pub(super) fn load_access(&self, op: &Op, subst: Option<(Value, V)>) -> R<Access> {
        let OpKind::Load { axes, .. } = &op.kind else { return Err(self.err("not a load".into())) };
        let t = self.tensor_of(op.operands[0])?;
        self.access_subst(t, axes, &op.operands[1..], subst)
    }

    pub(super) fn access_subst(
        &self,
        t: usize,
        axes: &[AxisIndex],
        operands: &[Value],
        subst: Option<(Value, V)>,
    ) -> R<Access> {
        let ir = &self.ir;
        let info = &self.tensors[t];
        let scalar = |v: Value| -> R<V> {
            match subst {
                Some((from, to)) => self.scalar_at(v, from, to),
                None => self.scalar(v),
            }
        };
        let mut it = operands.iter();
        let mut off = ir.ci64(0);
        let mut valid = ir.ctrue();
        let mut ranges = Vec::new();
        let mut coords = Vec::new();
        for (ta, a) in axes.iter().enumerate() {
            let first = *it.next().ok_or_else(|| self.err("missing index operand".into()))?;
            let x = scalar(first)?;
            coords.push(x);
            let x64 = ir.sext(x, ir.i64());
            match a {
                AxisIndex::Index => {
                    let ok = ir.and(ir.icmp(LLVMIntSGE, x64, ir.ci64(0)), ir.icmp(LLVMIntSLT, x64, info.shape[ta]));
                    valid = ir.and(valid, ok);
                    off = ir.add(off, ir.mul(x64, info.strides[ta]));
                }
                AxisIndex::Range { size, limit } => {
                    let l = if *limit {
                        let lv = *it.next().ok_or_else(|| self.err("missing limit operand".into()))?;
                        Some(ir.sext(scalar(lv)?, ir.i64()))
                    } else {
                        None
                    };
                    ranges.push(RangeAx { axis: ta, start: x64, limit: l, size: *size });
                }
            }
        }
        Ok(Access { off, valid, ranges, coords })
    }

    /// Scalar `v` with the scalar `from` (a loop's induction variable) replaced by
    /// `to`: scalar arithmetic between them is computed again, and scalar loads (a block
    /// table's entry) are loaded again (a load of block `j + s` after `pipeline-dots`,
    /// issued iterations ahead).
    pub(super) fn scalar_at(&self, v: Value, from: Value, to: V) -> R<V> {
        if v == from {
            return Ok(to);
        }
        let op = self.du.def(v);
        let lowered = self.vals[v.index()].is_some();
        if lowered && !self.scalar_depends_on(v, from) {
            return self.scalar(v);
        }
        match op.map(|o| &o.kind) {
            Some(OpKind::Const { value, dtype }) => Ok(self.constant(*value, *dtype)),
            Some(
                kind @ (OpKind::Binary(_) | OpKind::Unary(_) | OpKind::Cmp(_) | OpKind::Select | OpKind::Cast { .. }),
            ) => {
                let op = op.expect("matched");
                let xs: Vec<V> = op.operands.iter().map(|x| self.scalar_at(*x, from, to)).collect::<R<_>>()?;
                let dtypes: Vec<DType> = op.operands.iter().map(|o| self.ty(*o).dtype()).collect();
                let dtypes = if matches!(kind, OpKind::Select) { dtypes[1..].to_vec() } else { dtypes };
                Ok(self.elem_op(kind, &dtypes, &xs))
            }
            Some(OpKind::Load { axes, pad }) if matches!(self.ty(v), Type::Scalar(_)) => {
                let op = op.expect("matched");
                let t = self.tensor_of(op.operands[0])?;
                let acc = self.access_subst(t, axes, &op.operands[1..], Some((from, to)))?;
                let padv = self.constant(*pad, self.tensors[t].dtype);
                Ok(self.load_elem(t, acc.off, acc.valid, padv))
            }
            _ => self.scalar(v),
        }
    }

    /// Whether scalar `v` is computed from `from` by scalar arithmetic and scalar loads.
    pub(super) fn scalar_depends_on(&self, v: Value, from: Value) -> bool {
        if v == from {
            return true;
        }
        match self.du.def(v) {
            Some(op) if is_scalar_arith(op) && matches!(self.ty(v), Type::Scalar(_)) => {
                op.operands.iter().any(|x| self.scalar_depends_on(*x, from))
            }
            Some(op) if matches!(op.kind, OpKind::Load { .. }) && matches!(self.ty(v), Type::Scalar(_)) => {
                op.operands[1..].iter().any(|x| self.scalar_depends_on(*x, from))
            }
            _ => false,
        }
    }

    /// Whether tensor index `x` (i64) is inside axis `ta` and under `limit`.
    pub(super) fn in_range(&self, t: usize, ta: usize, x: V, limit: Option<V>) -> V {
        let ir = &self.ir;
        let ok = ir.and(ir.icmp(LLVMIntSGE, x, ir.ci64(0)), ir.icmp(LLVMIntSLT, x, self.tensors[t].shape[ta]));
        match limit {
            Some(l) => ir.and(ok, ir.icmp(LLVMIntSLT, x, l)),
            None => ok,
        }
    }

    /// `if cond { then() }` (no results).
    pub(super) fn if_then(&mut self, cond: V, then: &mut dyn FnMut(&mut Self) -> R<()>) -> R<()> {
        let t = self.ir.block("then");
        let j = self.ir.block("join");
        self.ir.cond_br(cond, t, j);
        self.ir.at_end(t);
        then(self)?;
        self.ir.br(j);
        self.ir.at_end(j);
        Ok(())
    }

    /// Load element `idx` (i64 element offset) of tensor `t` if `ok`, else `pad`.
    pub(super) fn load_elem(&self, t: usize, idx: V, ok: V, pad: V) -> V {
        let dtype = self.tensors[t].dtype;
        let st = self.storage_ty(dtype);
        let data = self.tensors[t].data;
        self.load_guarded(dtype, ok, pad, &|ir| ir.gep(st, data, idx))
    }

    /// Load a `dtype` element from the address `addr` builds (in the guarded block) if
    /// `ok`, else `pad`.
    pub(super) fn load_guarded(&self, dtype: DType, ok: V, pad: V, addr: &dyn Fn(&Ir) -> V) -> V {
        let st = self.storage_ty(dtype);
        let pre = self.ir.current();
        let lb = self.ir.block("ld");
        let j = self.ir.block("ld.join");
        self.ir.cond_br(ok, lb, j);
        self.ir.at_end(lb);
        let raw = self.ir.load(st, addr(&self.ir), dtype.size_bytes() as u32);
        let x = if dtype == DType::I1 { self.ir.icmp(LLVMIntNE, raw, self.ir.cint(self.ir.i8(), 0)) } else { raw };
        let lend = self.ir.current();
        self.ir.br(j);
        self.ir.at_end(j);
        let phi = self.ir.phi(self.compute_ty(dtype));
        self.ir.add_incoming(phi, x, lend);
        self.ir.add_incoming(phi, pad, pre);
        phi
    }

    pub(super) fn load(&mut self, op: &'k Op, axes: &[AxisIndex], pad: f64) -> R<()> {
        let r = op.results[0];
        let t = self.tensor_of(op.operands[0])?;
        let acc = self.access(t, axes, &op.operands[1..])?;
        let dtype = self.tensors[t].dtype;
        let padv = self.constant(pad, dtype);
        if acc.ranges.is_empty() {
            let x = self.load_elem(t, acc.off, acc.valid, padv);
            self.set(r, GV::Scalar(x));
            return Ok(());
        }
        if self.plan.smem_loads.contains(&r) {
            let s = self.load_smem(op, t, &acc, pad)?;
            self.set(r, GV::Smem(s));
            return Ok(());
        }
        // Straight into registers.
        let (rows, cols) = self.axes_of(r)?;
        // A tile at a loop's moving window (only its fixed indices change per iteration):
        // one pointer per row slot plus constant column offsets.
        if self.window_moves(axes, &op.operands[1..]) {
            let e = self.window_access(t, &acc, rows, cols, &mut |cg, _, p, ok| {
                Ok(Some(cg.load_guarded(dtype, ok, padv, &|_| p)))
            })?;
            self.set(r, GV::Dist(Dist { rows, cols, e }));
            return Ok(());
        }
        let e = match (rows, cols, dtype.size_bytes(), acc.ranges.len()) {
            (Ax::Mma(_), Ax::Mma(c), 4 | 2, 2) => self.load_rows(t, &acc, rows, c, padv),
            _ => self.load_elems(t, &acc, rows, cols, padv),
        };
        self.set(r, GV::Dist(Dist { rows, cols, e }));
        Ok(())
    }

    /// A register tile, one predicated load per element (row slot major).
    pub(super) fn load_elems(&mut self, t: usize, acc: &Access, rows: Ax, cols: Ax, padv: V) -> Vec<V> {
        let (rcs, ccs) = (self.row_coords(rows), self.col_coords(cols));
        let mut e = Vec::new();
        for rc in &rcs {
            for cc in &ccs {
                let (idx, ok) = self.elem_address(t, acc, rows, *rc, *cc);
                e.push(self.load_elem(t, idx, ok, padv));
            }
        }
        e
    }

    /// A 2-D register tile of a 32- or 16-bit type (`c` columns), row by row when it can
    /// be.
    ///
    /// Element by element, each column slot has its own offset `(start + col) · stride`
    /// and bounds test, both invariant in a loop over the other axes, so LLVM hoists
    /// them out of it: two 64-bit values per column slot stay live across the loop,
    /// more registers than the tile itself at 128 columns (the split-KV combine, which
    /// reads each split's `[block_m, head_dim]` f32 output in a loop, spilled). When the
    /// columns are contiguous and all inside the tensor — checked at run time, once per
    /// load — a row slot needs one offset and one bounds test, and its elements sit at
    /// constant offsets from it. A 16-bit tile (the flash kernels' bias) then also reads
    /// the two adjacent columns a thread holds as one 32-bit load, where the rows start
    /// 4-byte aligned (checked with the rest): half the loads, and none of the per-element
    /// address arithmetic that made a bias block cost more than its products.
    /// Otherwise the element path, kept from hoisting.
    pub(super) fn load_rows(&mut self, t: usize, acc: &Access, rows: Ax, c: usize, padv: V) -> Vec<V> {
        let (ra, ca) = (acc.ranges[0], acc.ranges[1]);
        let dtype = self.tensors[t].dtype;
        let pairs = dtype.size_bytes() == 2;
        let mut whole = self.whole_columns(t, ca, c);
        if pairs {
            // Every row's first element 4-byte aligned: the data pointer, the offset of
            // the first row's first column, and the row stride (in elements) even.
            let ir = &self.ir;
            let data_i = ir.ptr_to_int(self.tensors[t].data, ir.i64());
            let first = ir.add(data_i, ir.mul(ir.add(acc.off, ca.start), ir.ci64(2)));
            whole = ir.and(whole, ir.icmp(LLVMIntEQ, ir.and(first, ir.ci64(3)), ir.ci64(0)));
            let rs = self.tensors[t].strides[ra.axis];
            whole = ir.and(whole, ir.icmp(LLVMIntEQ, ir.and(rs, ir.ci64(1)), ir.ci64(0)));
        }
        let ir = &self.ir;
        let (fast, slow, join) = (ir.block("ld.rows"), ir.block("ld.elems"), ir.block("ld.rows.join"));
        ir.cond_br(whole, fast, slow);

        self.ir.at_end(fast);
        let col0 = self.ir.add(ca.start, self.ir.sext(Self::col_base(&self.ir, self.lane), self.ir.i64()));
        let et = self.compute_ty(dtype);
        let pad2 = if pairs { Some(self.pack2(padv, padv, dtype)) } else { None };
        let mut fast_e = Vec::new();
        for rc in self.row_coords(rows) {
            let ir = &self.ir;
            let row = ir.add(ra.start, ir.sext(rc, ir.i64()));
            let ok = ir.and(acc.valid, self.in_range(t, ra.axis, row, ra.limit));
            let first = ir.add(ir.add(acc.off, ir.mul(row, self.tensors[t].strides[ra.axis])), col0);
            match pad2 {
                Some(pad2) => {
                    let (st, data) = (self.storage_ty(dtype), self.tensors[t].data);
                    for o in Self::col_offsets(c).into_iter().step_by(2) {
                        let idx = self.ir.add(first, self.ir.ci64(o));
                        let w = self.load_guarded(DType::I32, ok, pad2, &|ir| ir.gep(st, data, idx));
                        let v = self.ir.bitcast(w, self.ir.vec(et, 2));
                        fast_e.push(self.ir.extract(v, 0));
                        fast_e.push(self.ir.extract(v, 1));
                    }
                }
                None => {
                    for o in Self::col_offsets(c) {
                        let idx = self.ir.add(first, self.ir.ci64(o));
                        fast_e.push(self.load_elem(t, idx, ok, padv));
                    }
                }
            }
        }
        let fast_end = self.ir.current();
        self.ir.br(join);

        self.ir.at_end(slow);
        // The element path, with the column start made opaque: its per-column values
        // are then recomputed at each use rather than hoisted (see above).
        let mut cols = ca;
        cols.start = nvvm::opaque_i64(&self.ir, ca.start);
        let slow_acc = Access { off: acc.off, valid: acc.valid, ranges: vec![ra, cols], coords: acc.coords.clone() };
        let slow_e = self.load_elems(t, &slow_acc, rows, Ax::Mma(c), padv);
        let slow_end = self.ir.current();
        self.ir.br(join);

        self.ir.at_end(join);
        fast_e
            .into_iter()
            .zip(slow_e)
            .map(|(a, b)| {
                let phi = self.ir.phi(et);
                self.ir.add_incoming(phi, a, fast_end);
                self.ir.add_incoming(phi, b, slow_end);
                phi
            })
            .collect()
    }

    /// i1: the `c` columns of range `ca` of tensor `t` are contiguous (stride 1) and all
    /// inside the tensor (and under the range's limit).
    pub(super) fn whole_columns(&self, t: usize, ca: RangeAx, c: usize) -> V {
        let ir = &self.ir;
        let info = &self.tensors[t];
        let end = ir.add(ca.start, ir.ci64(c as i64));
        let mut whole = ir.icmp(LLVMIntEQ, info.strides[ca.axis], ir.ci64(1));
        whole = ir.and(whole, ir.icmp(LLVMIntSGE, ca.start, ir.ci64(0)));
        whole = ir.and(whole, ir.icmp(LLVMIntSLE, end, info.shape[ca.axis]));
        match ca.limit {
            Some(l) => ir.and(whole, ir.icmp(LLVMIntSLE, end, l)),
            None => whole,
        }
    }

    pub(super) fn store(&mut self, op: &'k Op, axes: &[AxisIndex], accumulate: bool) -> R<()> {
        let n = op.operands.len();
        let value = op.operands[n - 1];
        let t = self.tensor_of(op.operands[0])?;
        let acc = self.access(t, axes, &op.operands[1..n - 1])?;
        let dtype = self.tensors[t].dtype;
        let vd = self.ty(value).dtype();
        let st = self.storage_ty(dtype);
        let esize = dtype.size_bytes() as u32;
        let data = self.tensors[t].data;
        if acc.ranges.is_empty() {
            let x = self.scalar(value)?;
            let x = self.to_storage(x, vd, dtype);
            let ir = &self.ir;
            // One thread writes a scalar.
            let first = ir.and(ir.icmp(LLVMIntEQ, self.warp, ir.ci32(0)), ir.icmp(LLVMIntEQ, self.lane, ir.ci32(0)));
            let ok = ir.and(acc.valid, first);
            let p = ir.gep(st, data, acc.off);
            self.if_then(ok, &mut |cg| {
                cg.ir.store_or_add(x, p, esize, accumulate);
                Ok(())
            })?;
            return Ok(());
        }
        let d = self.dist(value)?;
        let (rows, cols) = (d.rows, d.cols);
        // Replicated elements are written by one thread only: rows replicate over the
        // lanes of a quad (lane % 4) when columns are broadcast; columns replicate over
        // lane / 4 and over warps when rows are broadcast.
        let ir = &self.ir;
        let mut owner = ir.ctrue();
        if cols == Ax::One {
            owner = ir.and(owner, ir.icmp(LLVMIntEQ, ir.and(self.lane, ir.ci32(3)), ir.ci32(0)));
        }
        if rows == Ax::One {
            owner = ir.and(owner, ir.icmp(LLVMIntULT, self.lane, ir.ci32(4)));
            owner = ir.and(owner, ir.icmp(LLVMIntEQ, self.warp, ir.ci32(0)));
        }
        // Rows other warps replicate (fewer than 16 × num_warps: `row_warps`).
        if let Ax::Mma(r) = rows {
            if self.row_warps(r) < self.warps {
                owner = self.ir.and(owner, self.row_owner(r));
            }
        }
        if self.window_moves(axes, &op.operands[1..n - 1]) {
            let xs: Vec<V> = d.e.iter().map(|x| self.to_storage(*x, vd, dtype)).collect();
            self.window_access(t, &acc, rows, cols, &mut |cg, i, p, ok| {
                let ok = cg.ir.and(ok, owner);
                cg.if_then(ok, &mut |cg| {
                    cg.ir.store_or_add(xs[i], p, esize, accumulate);
                    Ok(())
                })?;
                Ok(None)
            })?;
            return Ok(());
        }
        let (rcs, ccs) = (self.row_coords(rows), self.col_coords(cols));
        // 16-bit outputs whose columns are contiguous and 4-byte aligned are written two
        // columns at a time (the pair a thread holds), rounded pairwise from f32 when the
        // value was just cast; the choice is made at run time, once.
        let col_axis = match acc.ranges.len() {
            2 => Some(acc.ranges[1]),
            1 if rows == Ax::One => Some(acc.ranges[0]),
            _ => None,
        };
        if let (Some(ca), Ax::Mma(_), 2, false) = (col_axis, cols, dtype.size_bytes(), accumulate) {
            let src = match self.du.def(value) {
                Some(o) if matches!(o.kind, OpKind::Cast { .. }) && self.ty(o.operands[0]).dtype() == DType::F32 => {
                    Some(self.dist(o.operands[0])?)
                }
                _ => None,
            };
            let ir = &self.ir;
            let strides = &self.tensors[t].strides;
            let data_i = ir.ptr_to_int(data, ir.i64());
            let first = ir.add(data_i, ir.mul(ir.add(acc.off, ca.start), ir.ci64(2)));
            let mut even = ir.icmp(LLVMIntEQ, ir.and(first, ir.ci64(3)), ir.ci64(0));
            even = ir.and(even, ir.icmp(LLVMIntEQ, strides[ca.axis], ir.ci64(1)));
            if acc.ranges.len() == 2 {
                let ra = acc.ranges[0];
                even = ir.and(even, ir.icmp(LLVMIntEQ, ir.and(strides[ra.axis], ir.ci64(1)), ir.ci64(0)));
            }
            let pb = ir.block("st.pairs");
            let eb = ir.block("st.elems");
            let jb = ir.block("st.done");
            ir.cond_br(even, pb, eb);
            self.ir.at_end(pb);
            let nc = Self::ncols(cols);
            for (ri, rc) in rcs.iter().enumerate() {
                for pair in 0..nc / 2 {
                    let (i0, i1) = (ri * nc + 2 * pair, ri * nc + 2 * pair + 1);
                    let (idx, ok0) = self.elem_address(t, &acc, rows, *rc, ccs[2 * pair]);
                    let (_, ok1) = self.elem_address(t, &acc, rows, *rc, ccs[2 * pair + 1]);
                    let ok1 = self.ir.and(ok1, owner);
                    let ok0 = self.ir.and(ok0, owner);
                    let packed = match &src {
                        Some(f) => self.pack2_f32(f.e[i0], f.e[i1], dtype),
                        None => {
                            let (a, b) = (self.to_storage(d.e[i0], vd, dtype), self.to_storage(d.e[i1], vd, dtype));
                            self.pack2(a, b, dtype)
                        }
                    };
                    let single = self.to_storage(d.e[i0], vd, dtype);
                    let p = self.ir.gep(st, data, idx);
                    self.if_then(ok1, &mut |cg| {
                        cg.ir.store(packed, p, 4);
                        Ok(())
                    })?;
                    let only_first = self.ir.and(ok0, self.ir.not(ok1));
                    self.if_then(only_first, &mut |cg| {
                        cg.ir.store(single, p, esize);
                        Ok(())
                    })?;
                }
            }
            self.ir.br(jb);
            self.ir.at_end(eb);
            self.store_elems(t, &acc, &d, (&rcs, &ccs), owner, vd, dtype, accumulate)?;
            self.ir.br(jb);
            self.ir.at_end(jb);
            return Ok(());
        }
        self.store_elems(t, &acc, &d, (&rcs, &ccs), owner, vd, dtype, accumulate)
    }

    /// One predicated store per element.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn store_elems(
        &mut self,
        t: usize,
        acc: &Access,
        d: &Dist,
        coords: (&[V], &[V]),
        owner: V,
        vd: DType,
        dtype: DType,
        accumulate: bool,
    ) -> R<()> {
        let st = self.storage_ty(dtype);
        let esize = dtype.size_bytes() as u32;
        let data = self.tensors[t].data;
        let mut i = 0;
        for rc in coords.0 {
            for cc in coords.1 {
                let (idx, ok) = self.elem_address(t, acc, d.rows, *rc, *cc);
                let x = self.to_storage(d.e[i], vd, dtype);
                i += 1;
                let ok = self.ir.and(ok, owner);
                let p = self.ir.gep(st, data, idx);
                self.if_then(ok, &mut |cg| {
                    cg.ir.store_or_add(x, p, esize, accumulate);
                    Ok(())
                })?;
            }
        }
        Ok(())
    }

    /// Element offset (i64) and in-bounds flag of element (`rc`, `cc`) — a row and a
    /// column coordinate of the thread — of a register tile accessed through `acc`.
    pub(super) fn elem_address(&self, t: usize, acc: &Access, rows: Ax, rc: V, cc: V) -> (V, V) {
        // Which tile axis each range is: with two ranges, (rows, cols); with one, the
        // non-trivial axis of the layout.
        let (row_rng, col_rng) = match acc.ranges.len() {
            2 => (Some(acc.ranges[0]), Some(acc.ranges[1])),
            _ if rows == Ax::One => (None, Some(acc.ranges[0])),
            _ => (Some(acc.ranges[0]), None),
        };
        let strides = &self.tensors[t].strides;
        let ir = &self.ir;
        let mut idx = acc.off;
        let mut ok = acc.valid;
        for (rng, coord) in [(row_rng, rc), (col_rng, cc)] {
            if let Some(g) = rng {
                let x = ir.add(g.start, ir.sext(coord, ir.i64()));
                ok = ir.and(ok, self.in_range(t, g.axis, x, g.limit));
                idx = ir.add(idx, ir.mul(x, strides[g.axis]));
            }
        }
        (idx, ok)
    }

    /// Whether a register tile's access (`axes`, `operands`: the index operands) is a
    /// *moving window* of the innermost loop: inside a loop, with every range start and
    /// limit defined outside it, so that only its fixed indices change per iteration
    /// (mean pooling's `x[b, t, h0.., :]` for each token `t`).
    ///
    /// Addressed element by element like other accesses, its per-element offsets and
    /// bounds are loop invariants, and LLVM's LICM hoists each of them out of the loop
    /// — one 64-bit offset and one flag per element held over the whole loop, which
    /// spills a `[16, 128]` tile on one warp. [`Self::window_access`] addresses it
    /// from one pointer per row slot instead.
    pub(super) fn window_moves(&self, axes: &[AxisIndex], operands: &[Value]) -> bool {
        let Some(inside) = self.loop_values.last() else { return false };
        let mut it = operands.iter();
        for a in axes {
            let n = a.operand_count();
            let ops: Vec<&Value> = it.by_ref().take(n).collect();
            if matches!(a, AxisIndex::Range { .. }) && ops.iter().any(|v| inside.contains(v)) {
                return false;
            }
        }
        true
    }

    /// Emit `elem(cg, i, ptr, ok)` for each of the thread's elements `i` (row slot
    /// major) of a register tile in layout (`rows`, `cols`) accessed through `acc` at a
    /// moving window; the values it returns (loads) are merged over the two paths.
    ///
    /// * When the column axis has unit stride and the thread's columns are all inside
    ///   it (uniform in practice: tiles span the head dim), every element is its row's
    ///   pointer plus a constant, which folds into the instruction: the loop holds one
    ///   offset and one flag per row slot.
    /// * Otherwise the column start and stride go through [`nvvm::opaque_i64`] in the
    ///   loop body, so the per-element offsets and flags are computed where they are used
    ///   rather than hoisted out of the loop and held (LICM hoists invariants out of
    ///   branches too).
    pub(super) fn window_access(
        &mut self,
        t: usize,
        acc: &Access,
        rows: Ax,
        cols: Ax,
        elem: &mut WindowElem<'_, 'k>,
    ) -> R<Vec<V>> {
        let (row_rng, col_rng) = match acc.ranges.len() {
            2 => (Some(acc.ranges[0]), Some(acc.ranges[1])),
            _ if rows == Ax::One => (None, Some(acc.ranges[0])),
            _ => (Some(acc.ranges[0]), None),
        };
        let st = self.storage_ty(self.tensors[t].dtype);
        let data = self.tensors[t].data;
        // Per row slot: the element offset of its column 0 and its flag.
        let mut row_parts = Vec::new();
        for rc in self.row_coords(rows) {
            let ir = &self.ir;
            let (mut idx, mut ok) = (acc.off, acc.valid);
            if let Some(g) = row_rng {
                let x = ir.add(g.start, ir.sext(rc, ir.i64()));
                ok = ir.and(ok, self.in_range(t, g.axis, x, g.limit));
                idx = ir.add(idx, ir.mul(x, self.tensors[t].strides[g.axis]));
            }
            row_parts.push((idx, ok));
        }
        let Some(g) = col_rng else {
            // No column axis in memory: one element per row slot.
            let mut out = Vec::new();
            for (i, (idx, ok)) in row_parts.into_iter().enumerate() {
                let p = self.ir.gep(st, data, idx);
                out.extend(elem(self, i, p, ok)?);
            }
            return Ok(out);
        };
        // Column slots: the thread's first column `c0` plus constant offsets (see
        // `col_coords`).
        let ir = &self.ir;
        let (c0, ks): (V, Vec<i64>) = match cols {
            Ax::One => (ir.ci32(0), vec![0]),
            Ax::Mma(c) => (
                ir.shl(ir.and(self.lane, ir.ci32(3)), ir.ci32(1)),
                (0..c / 8).flat_map(|nf| [(nf * 8) as i64, (nf * 8 + 1) as i64]).collect(),
            ),
        };
        let stride = self.tensors[t].strides[g.axis];
        let x0 = ir.add(g.start, ir.sext(c0, ir.i64()));
        let mut cend = self.tensors[t].shape[g.axis];
        if let Some(l) = g.limit {
            cend = ir.select(ir.icmp(LLVMIntSLT, l, cend), l, cend);
        }
        let last = ks.last().copied().unwrap_or(0);
        let inside = ir.and(ir.icmp(LLVMIntSGE, x0, ir.ci64(0)), ir.icmp(LLVMIntSLT, ir.add(x0, ir.ci64(last)), cend));
        let fast = ir.and(inside, ir.icmp(LLVMIntEQ, stride, ir.ci64(1)));
        let fb = ir.block("win.fast");
        let sb = ir.block("win.general");
        let jb = ir.block("win.done");
        ir.cond_br(fast, fb, sb);
        let mut arms: Vec<(B, Vec<V>)> = Vec::new();
        for general in [false, true] {
            self.ir.at_end(if general { sb } else { fb });
            let ir = &self.ir;
            let (x0, stride) =
                if general { (nvvm::opaque_i64(ir, x0), nvvm::opaque_i64(ir, stride)) } else { (x0, ir.ci64(1)) };
            let mut vals = Vec::new();
            for (ri, (idx, ok)) in row_parts.iter().enumerate() {
                let ir = &self.ir;
                let row = ir.gep(st, data, ir.add(*idx, ir.mul(x0, stride)));
                for (ci, k) in ks.iter().enumerate() {
                    let ir = &self.ir;
                    let (p, ok) = if general {
                        let col_ok = self.in_range(t, g.axis, ir.add(x0, ir.ci64(*k)), g.limit);
                        (ir.gep(st, row, ir.mul(ir.ci64(*k), stride)), self.ir.and(*ok, col_ok))
                    } else {
                        (ir.gep_const(st, row, *k), *ok)
                    };
                    vals.extend(elem(self, ri * ks.len() + ci, p, ok)?);
                }
            }
            arms.push((self.ir.current(), vals));
            self.ir.br(jb);
        }
        self.ir.at_end(jb);
        let mut out = Vec::with_capacity(arms[0].1.len());
        for i in 0..arms[0].1.len() {
            let phi = self.ir.phi(self.ir.type_of(arms[0].1[i]));
            for (bb, vals) in &arms {
                self.ir.add_incoming(phi, vals[i], *bb);
            }
            out.push(phi);
        }
        Ok(out)
    }

    pub(super) fn to_storage(&self, x: V, from: DType, to: DType) -> V {
        let x = self.arith().cast(x, from, to);
        if to == DType::I1 {
            self.ir.zext(x, self.ir.i8())
        } else {
            x
        }
    }
}
