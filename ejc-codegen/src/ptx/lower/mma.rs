//! Products: `mma.sync` fragments from registers or shared memory (`ldmatrix`), Hopper's
//! `wgmma` through descriptors, and the waits the schedule places.

use super::*;

/// Hopper's warpgroup MMA groups committed and not yet waited for, oldest first: the
/// product and the IR values (register tiles) it writes. Where they are waited for is
/// the schedule's ([`Schedule::waits`]): where first read, so that independent work —
/// the softmax of the next key block, after `pipeline-dots` — runs while the tensor
/// cores work.
#[derive(Default)]
pub(super) struct WgQueue {
    pending: Vec<(OpId, Vec<Value>)>,
}

impl WgQueue {
    pub(super) fn push(&mut self, product: OpId, result: Value) {
        self.pending.push((product, vec![result]));
    }

    /// The products in flight, oldest first.
    pub(super) fn in_flight(&self) -> Vec<OpId> {
        self.pending.iter().map(|(d, _)| *d).collect()
    }

    /// The product in flight that writes `v`, if any.
    pub(super) fn holding(&self, v: Value) -> Option<OpId> {
        self.pending.iter().find(|(_, vs)| vs.contains(&v)).map(|(d, _)| *d)
    }

    /// Complete the products up to `upto` (an index, oldest first): how many stay in
    /// flight, and the values the completed ones write.
    pub(super) fn complete(&mut self, upto: usize) -> (usize, Vec<Value>) {
        let newer = self.pending.len() - 1 - upto;
        let values = self.pending.drain(..=upto).flat_map(|(_, vs)| vs).collect();
        (newer, values)
    }
}

impl<'k> Lowering<'k> {
    /// Lane `l`'s `ldmatrix` row address for an `a` fragment (m-fragment `mf` of this
    /// warp, k-step `ks`) of a shared tile `[M, K]`.
    pub(super) fn a_frag_ldmatrix(&self, s: &Smem, mf: usize, ks: usize) -> [V; 4] {
        let row0 = self.mfrag_row0(s.rows, mf);
        let ir = &self.ir;
        let row = ir.add(row0, ir.and(self.lane, ir.ci32(15)));
        let chunk = ir.add(ir.ci32((ks * 2) as i64), ir.lshr(self.lane, ir.ci32(4)));
        let off = ir.add(s.off, s.chunk_off(ir, row, chunk));
        let r = nvvm::ldmatrix(ir, self.sptr(off), 4, false);
        [r[0], r[1], r[2], r[3]]
    }

    /// The same fragment of `op(a) = aᵀ` from a shared tile `[K, M]` (a `trans_a`
    /// product): `ldmatrix.trans` of the 8 × 8 blocks at k-rows `ks·16 + {0, 8}` and the
    /// fragment's m-columns, matrix `i` being m-half `i % 2`, k-half `i / 2` as above.
    pub(super) fn a_frag_ldmatrix_trans(&self, s: &Smem, mf: usize, ks: usize) -> [V; 4] {
        let row0 = self.mfrag_row0(s.cols, mf);
        let ir = &self.ir;
        let l8 = ir.and(self.lane, ir.ci32(7));
        let mi = ir.lshr(self.lane, ir.ci32(3));
        let row = ir.add(ir.ci32((ks * 16) as i64), ir.add(ir.mul(ir.lshr(mi, ir.ci32(1)), ir.ci32(8)), l8));
        let chunk = ir.add(ir.lshr(row0, ir.ci32(3)), ir.and(mi, ir.ci32(1)));
        let off = ir.add(s.off, s.chunk_off(ir, row, chunk));
        let r = nvvm::ldmatrix(ir, self.sptr(off), 4, true);
        [r[0], r[1], r[2], r[3]]
    }

    pub(super) fn a_frags_from_smem(&mut self, s: &Smem) -> R<Vec<Vec<[V; 4]>>> {
        if !s.rows.is_multiple_of(16 * self.row_warps(s.rows)) || !s.cols.is_multiple_of(16) {
            return Err(self.err(format!(
                "a dot's `a` tile [{}, {}] needs rows a multiple of 16 (of 16 × num_warps when more) and a k a \
                 multiple of 16",
                s.rows, s.cols
            )));
        }
        let fm = s.rows / (16 * self.row_warps(s.rows));
        Ok((0..fm).map(|mf| (0..s.cols / 16).map(|ks| self.a_frag_ldmatrix(s, mf, ks)).collect()).collect())
    }

    /// Pack two 16-bit floats into the i32 an mma fragment register holds.
    pub(super) fn pack2(&self, lo: V, hi: V, dtype: DType) -> V {
        let ir = &self.ir;
        let et = self.compute_ty(dtype);
        let v = ir.insert(ir.undef(ir.vec(et, 2)), lo, 0);
        let v = ir.insert(v, hi, 1);
        ir.bitcast(v, ir.i32())
    }

    /// Round two f32 to a packed 16-bit pair in one instruction (`cvt.rn.bf16x2.f32`).
    pub(super) fn pack2_f32(&self, lo: V, hi: V, dtype: DType) -> V {
        let ir = &self.ir;
        let v = ir.insert(ir.undef(ir.vec(ir.f32(), 2)), lo, 0);
        let v = ir.insert(v, hi, 1);
        let h = ir.fptrunc(v, ir.vec(self.compute_ty(dtype), 2));
        ir.bitcast(h, ir.i32())
    }

    pub(super) fn dot(&mut self, op: &'k Op, trans_a: bool, trans_b: bool) -> R<()> {
        let (av, bv, cv) = (op.operands[0], op.operands[1], op.operands[2]);
        let Type::Tile(adt, ashape) = self.ty(av).clone() else { return Err(self.err("dot operand".into())) };
        let bdt = self.ty(bv).dtype();
        if adt == DType::F32 && bdt == DType::F32 {
            return self.dot_fma(op, trans_a, trans_b);
        }
        if adt != bdt || !matches!(adt, DType::BF16 | DType::F16) {
            return Err(self.err(format!(
                "`tile.dot` takes two bf16, two f16 or two f32 operands on the PTX targets (got {adt} · {bdt})"
            )));
        }
        let f16 = adt == DType::F16;
        // `trans_a`: a is [k, m].
        let (m, k) = if trans_a { (ashape[1], ashape[0]) } else { (ashape[0], ashape[1]) };
        let acc = self.dist(cv)?;
        let Ax::Mma(n) = acc.cols else { return Err(self.err("dot result must have 8 or more columns".into())) };
        if k % 16 != 0 || n % 8 != 0 || m % (16 * self.row_warps(m)) != 0 {
            return Err(self.err(format!(
                "`tile.dot` [{m}, {k}] · [{k}, {n}] needs m a multiple of 16 (of 16 × num_warps when more), k of \
                 16, n of 8"
            )));
        }
        // Fewer rows than 16 × num_warps: every warp computes the one fragment it holds
        // (`row_warps`).
        let fm = m / (16 * self.row_warps(m));
        let (nn, ks_n) = (n / 8, k / 16);
        // a fragments: [mf][ks] in registers, or read from shared memory per k-step
        // (fewer registers live).
        let mut a_smem: Option<Smem> = None;
        // `trans_a`: the [k, m] tile in shared memory (loaded there, or a register tile
        // stored there first), read by `ldmatrix.trans`.
        let mut a_trans: Option<(Smem, bool)> = None;
        let afr: Vec<Vec<[V; 4]>> = match self.get(av)?.clone() {
            _ if trans_a => {
                let (mut s, staged) = match self.get(av)?.clone() {
                    GV::Smem(s) => (s, false),
                    _ => (self.dist_to_smem(op, 0, av)?, true),
                };
                self.ready(&mut s);
                a_trans = Some((s, staged));
                Vec::new()
            }
            GV::Smem(s) => match &s.afrags {
                Some(f) => f.clone(),
                None => {
                    if !s.rows.is_multiple_of(16 * self.row_warps(s.rows)) || !s.cols.is_multiple_of(16) {
                        return Err(self.err(format!(
                            "a dot's `a` tile [{}, {}] needs rows a multiple of 16 (of 16 × num_warps when more) \
                             and k of 16",
                            s.rows, s.cols
                        )));
                    }
                    let mut s = s.clone();
                    self.ready(&mut s);
                    a_smem = Some(s);
                    Vec::new()
                }
            },
            _ => {
                // Registers: the accumulator layout of [m, k] (k in 8-column groups);
                // an a fragment for k-step ks is groups 2ks and 2ks+1. A tile just cast
                // from f32 (the softmax probabilities) is rounded pairwise from the f32.
                let from_f32 = match self.du.def(av) {
                    Some(o)
                        if matches!(o.kind, OpKind::Cast { .. }) && self.ty(o.operands[0]).dtype() == DType::F32 =>
                    {
                        Some(o.operands[0])
                    }
                    _ => None,
                };
                let (d, wide) = match from_f32 {
                    Some(src) => (self.dist(src)?, true),
                    None => (self.dist(av)?, false),
                };
                let pack =
                    |cg: &Self, lo: V, hi: V| if wide { cg.pack2_f32(lo, hi, adt) } else { cg.pack2(lo, hi, adt) };
                let nc = Self::ncols(d.cols);
                let mut out = Vec::new();
                for mf in 0..fm {
                    let mut row = Vec::new();
                    for ks in 0..ks_n {
                        let g = |h: usize, grp: usize, j: usize| Self::elem(&d, mf * 2 + h, grp * 2 + j, nc);
                        let (g0, g1) = (2 * ks, 2 * ks + 1);
                        row.push([
                            pack(self, g(0, g0, 0), g(0, g0, 1)),
                            pack(self, g(1, g0, 0), g(1, g0, 1)),
                            pack(self, g(0, g1, 0), g(0, g1, 1)),
                            pack(self, g(1, g1, 0), g(1, g1, 1)),
                        ]);
                    }
                    out.push(row);
                }
                out
            }
        };
        let bs = match self.get(bv)?.clone() {
            GV::Smem(mut s) => {
                self.ready(&mut s);
                s
            }
            _ => self.dist_to_smem(op, 1, bv)?,
        };
        let mut c = acc.e.clone();
        let ncols = Self::ncols(acc.cols);
        // The schedule chose the path and said where the operands live: check that the
        // operands built here are those.
        let id = self.du.id(op);
        let planned =
            self.sched.dots.get(&id).cloned().ok_or_else(|| self.err(format!("schedule: no plan for {id}")))?;
        let a_here = match (&a_smem, self.get(av)?) {
            _ if trans_a => match &a_trans {
                Some((s, true)) => AOperand::Staged(s.layout),
                Some((s, false)) => AOperand::Shared(s.layout),
                None => return Err(self.err("internal error: a trans_a operand without its tile".into())),
            },
            // A query tile whose copy is still pending with no loop prologue to wait in
            // is read per use after all.
            (Some(sm), _) if planned.a == AOperand::Fragments && sm.layout == SmemLayout::Padded => AOperand::Fragments,
            (Some(sm), _) => AOperand::Shared(sm.layout),
            (None, GV::Smem(_)) => AOperand::Fragments,
            _ => AOperand::Registers,
        };
        let b_here = match self.get(bv)? {
            GV::Smem(_) => BOperand::Shared(bs.layout),
            _ => BOperand::Staged(bs.layout),
        };
        let wgmma_here = self.wgmma && bs.wgmma_readable() && n <= 256 && m.is_multiple_of(64 * (self.warps / 4));
        if (planned.path == MmaPath::Wgmma) != wgmma_here
            || planned.a != a_here
            || planned.b != b_here
            || planned.trans_a != trans_a
        {
            return Err(self.err(format!(
                "internal error: the schedule planned {id} as {planned:?}, its operands are a {a_here:?}, b {b_here:?}"
            )));
        }
        if planned.path == MmaPath::Wgmma {
            // A product that starts from a zero tile needs no zeros in registers.
            let c = (!planned.from_zero).then_some(c);
            // A transposed `a` goes in registers, read by `ldmatrix.trans`.
            let afr = match &a_trans {
                Some((s, _)) => {
                    (0..fm).map(|mf| (0..ks_n).map(|ks| self.a_frag_ldmatrix_trans(s, mf, ks)).collect()).collect()
                }
                None => afr,
            };
            let c = self.dot_wgmma(f16, (m, n, k), trans_b, &afr, a_smem.as_ref(), &bs, c, ncols)?;
            self.set(op.results[0], GV::Dist(Dist { rows: acc.rows, cols: acc.cols, e: c }));
            // Asynchronous: waited for where the schedule says (where it is first read).
            self.wg.push(id, op.results[0]);
            return Ok(());
        }
        for ks in 0..ks_n {
            let a_k: Vec<[V; 4]> = match (&a_smem, &a_trans) {
                (_, Some((sm, _))) => (0..fm).map(|mf| self.a_frag_ldmatrix_trans(sm, mf, ks)).collect(),
                (Some(sm), None) => (0..fm).map(|mf| self.a_frag_ldmatrix(sm, mf, ks)).collect(),
                (None, None) => afr.iter().map(|row| row[ks]).collect(),
            };
            // b fragments two n-fragments at a time (one ldmatrix.x4), each pair used
            // right away.
            let mut nf = 0;
            while nf < nn {
                let cnt = if nf + 1 < nn { 4 } else { 2 };
                let ir = &self.ir;
                let l8 = ir.and(self.lane, ir.ci32(7));
                let mi = ir.lshr(self.lane, ir.ci32(3)); // matrix index 0..3
                let off = if trans_b {
                    // b tile is [n, k]: rows n, chunks k. Matrix i: n-group i/2, k-half i%2.
                    let row = ir.add(ir.ci32((nf * 8) as i64), ir.add(ir.mul(ir.lshr(mi, ir.ci32(1)), ir.ci32(8)), l8));
                    let chunk = ir.add(ir.ci32((ks * 2) as i64), ir.and(mi, ir.ci32(1)));
                    bs.chunk_off(ir, row, chunk)
                } else {
                    // b tile is [k, n]: rows k, chunks n. Matrix i: k-half i%2, n-group i/2.
                    let row = ir.add(ir.ci32((ks * 16) as i64), ir.add(ir.mul(ir.and(mi, ir.ci32(1)), ir.ci32(8)), l8));
                    let chunk = ir.add(ir.ci32(nf as i64), ir.lshr(mi, ir.ci32(1)));
                    bs.chunk_off(ir, row, chunk)
                };
                let off = ir.add(off, bs.off);
                let r = nvvm::ldmatrix(ir, self.sptr(off), cnt, !trans_b);
                let mut pairs = vec![(nf, [r[0], r[1]])];
                if cnt == 4 {
                    pairs.push((nf + 1, [r[2], r[3]]));
                }
                for (mf, a) in a_k.iter().enumerate() {
                    for (n, b) in &pairs {
                        let at = |h: usize, j: usize| (mf * 2 + h) * ncols + n * 2 + j;
                        let cin = [c[at(0, 0)], c[at(0, 1)], c[at(1, 0)], c[at(1, 1)]];
                        let d = nvvm::mma_m16n8k16(&self.ir, f16, *a, *b, cin);
                        c[at(0, 0)] = d[0];
                        c[at(0, 1)] = d[1];
                        c[at(1, 0)] = d[2];
                        c[at(1, 1)] = d[3];
                    }
                }
                nf += cnt / 2;
            }
        }
        self.set(op.results[0], GV::Dist(Dist { rows: acc.rows, cols: acc.cols, e: c }));
        Ok(())
    }

    /// A register tile of f32 stored row-major (as its shape says) in this op's shared
    /// region `slot`; its byte offset. Rows other warps replicate are written by their
    /// owners only.
    fn stage_f32(&mut self, op: &'k Op, slot: usize, v: Value) -> R<i64> {
        let Type::Tile(_, shape) = self.ty(v).clone() else { return Err(self.err("dot operand".into())) };
        let (rows, cols) = (shape[0], shape[1]);
        let d = self.dist(v)?;
        let base = self.region(op, slot, rows * cols * 4, 16) as i64;
        let (rc, cc) = (self.row_coords(d.rows), self.col_coords(d.cols));
        let nc = Self::ncols(d.cols);
        let owner = if d.rows == Ax::One {
            // Broadcast rows: one warp's quad 0 holds them (every thread the same).
            let ir = &self.ir;
            ir.and(ir.icmp(LLVMIntEQ, self.warp, ir.ci32(0)), ir.icmp(LLVMIntULT, self.lane, ir.ci32(4)))
        } else {
            self.row_owner(rows)
        };
        self.if_then(owner, &mut |cg| {
            for (ri, r) in rc.iter().enumerate() {
                for (ci, c) in cc.iter().enumerate() {
                    let ir = &cg.ir;
                    let off = ir.add(ir.ci32(base), ir.mul(ir.add(ir.mul(*r, ir.ci32(cols as i64)), *c), ir.ci32(4)));
                    ir.store(Self::elem(&d, ri, ci, nc), cg.sptr(off), 4);
                }
            }
            Ok(())
        })?;
        Ok(base)
    }

    /// A product of f32 tiles on the CUDA cores ([`MmaPath::Fma`]): both operands staged
    /// to shared memory, then each thread runs the k loop for the accumulator elements it
    /// holds (`fma.rn.f32`, k in order).
    fn dot_fma(&mut self, op: &'k Op, trans_a: bool, trans_b: bool) -> R<()> {
        let (av, bv, cv) = (op.operands[0], op.operands[1], op.operands[2]);
        let id = self.du.id(op);
        let planned =
            self.sched.dots.get(&id).cloned().ok_or_else(|| self.err(format!("schedule: no plan for {id}")))?;
        if planned.path != MmaPath::Fma || planned.trans_a != trans_a {
            return Err(self.err(format!("internal error: the schedule planned {id} as {planned:?}, an f32 product")));
        }
        let (Type::Tile(_, ash), Type::Tile(_, bsh)) = (self.ty(av).clone(), self.ty(bv).clone()) else {
            return Err(self.err("dot operands".into()));
        };
        let (m, k) = if trans_a { (ash[1], ash[0]) } else { (ash[0], ash[1]) };
        let n = if trans_b { bsh[0] } else { bsh[1] };
        let acc = self.dist(cv)?;
        let (rows, cols) = self.axes_of(op.results[0])?;
        // Readers of the staging regions (this op in a loop) are done before they change.
        self.sync();
        let a_base = self.stage_f32(op, 0, av)?;
        let b_base = self.stage_f32(op, 1, bv)?;
        self.sync();
        let (rc, cc) = (self.row_coords(rows), self.col_coords(cols));
        let (nr, nc) = (rc.len(), cc.len());
        // k = 0 .. K on the counted-loop builder the key loops use; the accumulators are
        // phis at its head, final at its exit.
        let lh = self.loop_head("fma.k", self.ir.ci32(0));
        let ir = &self.ir;
        let f32t = ir.f32();
        let kk = lh.iv;
        let mut phis = Vec::new();
        for ri in 0..nr {
            for ci in 0..nc {
                let p = ir.phi(f32t);
                ir.add_incoming(p, Self::elem(&acc, ri, ci, Self::ncols(acc.cols)), lh.pre);
                phis.push(p);
            }
        }
        ir.cond_br(ir.icmp(LLVMIntSLT, kk, ir.ci32(k as i64)), lh.body, lh.exit);
        ir.at_end(lh.body);
        // a(r, k) for each of the thread's rows, b(k, c) for each of its columns.
        let at = |r: V| {
            let (row, col, width) = if trans_a { (kk, r, m) } else { (r, kk, k) };
            let off = ir.add(ir.ci32(a_base), ir.mul(ir.add(ir.mul(row, ir.ci32(width as i64)), col), ir.ci32(4)));
            ir.load(f32t, self.sptr(off), 4)
        };
        let bt = |c: V| {
            let (row, col, width) = if trans_b { (c, kk, k) } else { (kk, c, n) };
            let off = ir.add(ir.ci32(b_base), ir.mul(ir.add(ir.mul(row, ir.ci32(width as i64)), col), ir.ci32(4)));
            ir.load(f32t, self.sptr(off), 4)
        };
        let avals: Vec<V> = rc.iter().map(|r| at(*r)).collect();
        let bvals: Vec<V> = cc.iter().map(|c| bt(*c)).collect();
        let latch = ir.current();
        for ri in 0..nr {
            for ci in 0..nc {
                let p = phis[ri * nc + ci];
                ir.add_incoming(p, ir.fma(avals[ri], bvals[ci], p), latch);
            }
        }
        ir.add_incoming(kk, ir.add(kk, ir.ci32(1)), latch);
        ir.add_incoming(lh.counter, ir.add(lh.counter, ir.ci32(1)), latch);
        ir.br(lh.head);
        ir.at_end(lh.exit);
        let out = phis;
        self.set(op.results[0], GV::Dist(Dist { rows, cols, e: out }));
        Ok(())
    }

    /// A dot on Hopper's warpgroup MMA: per 64-row block of this warpgroup and k-step,
    /// one `wgmma.m64n{n}k16` with B (and A when it is in shared memory) read through
    /// descriptors of a wgmma layout (core matrices, or 128-byte swizzled); the
    /// accumulators stay in the mma layout. `c` = None: the product starts from zero.
    /// The group is committed, not waited for: the caller records it as pending.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dot_wgmma(
        &mut self,
        f16: bool,
        (m, n, k): (usize, usize, usize),
        trans_b: bool,
        afr: &[Vec<[V; 4]>],
        a_smem: Option<&Smem>,
        bs: &Smem,
        c: Option<Vec<V>>,
        ncols: usize,
    ) -> R<Vec<V>> {
        let fm = m / (16 * self.warps);
        let ks_n = k / 16;
        let groups = self.warps / 4;
        // A: registers (given, or read from a padded tile) or a descriptor.
        let a_regs: Option<Vec<Vec<[V; 4]>>> = match a_smem {
            Some(sm) if sm.wgmma_readable() => None,
            Some(sm) => {
                Some((0..fm).map(|mf| (0..ks_n).map(|ks| self.a_frag_ldmatrix(sm, mf, ks)).collect()).collect())
            }
            None => Some(afr.to_vec()),
        };
        // Accumulators per 64-row block, in wgmma's register order.
        let slot = |mf: usize, j: usize, r: usize| (mf * 2 + r / 2) * ncols + j * 2 + r % 2;
        let mut accs: Option<Vec<Vec<V>>> = c.as_ref().map(|c| {
            (0..fm)
                .map(|mf| {
                    (0..n / 8).flat_map(|j| (0..4).map(move |r| (j, r))).map(|(j, r)| c[slot(mf, j, r)]).collect()
                })
                .collect()
        });
        // wgmma.fence after every register write the MMAs read.
        let mut regs: Vec<V> = accs.as_ref().map(|a| a.concat()).unwrap_or_default();
        if let Some(a) = &a_regs {
            for row in a {
                for f in row {
                    regs.extend_from_slice(f);
                }
            }
        }
        let fenced = nvvm::wgmma_fence(&self.ir, &regs);
        let mut it = fenced.into_iter();
        if let Some(accs) = accs.as_mut() {
            for acc in accs.iter_mut() {
                for x in acc.iter_mut() {
                    *x = it.next().expect("fenced accumulators");
                }
            }
        }
        let a_regs: Option<Vec<Vec<[V; 4]>>> = a_regs.map(|a| {
            a.iter()
                .map(|row| {
                    row.iter()
                        .map(|_| {
                            let mut f = [std::ptr::null_mut(); 4];
                            for x in f.iter_mut() {
                                *x = it.next().expect("fenced fragments");
                            }
                            f
                        })
                        .collect()
                })
                .collect()
        });
        let ir = &self.ir;
        let i32t = ir.i32();
        let b_base = ir.ptr_to_int(self.sptr(bs.off), i32t);
        let sw = bs.layout == SmemLayout::Swizzle128;
        // B [n, k] is K-major; B [k, n] is N-major (transposed by the instruction).
        let b_desc: Vec<V> = (0..ks_n)
            .map(|ks| {
                let (off, lbo, sbo) = match (bs.layout, trans_b) {
                    (SmemLayout::Swizzle128, true) => (ks / 4 * bs.block_bytes() + ks % 4 * 32, 16, 1024),
                    (SmemLayout::Swizzle128, false) => (ks * 2048, bs.block_bytes(), 1024),
                    (_, true) => (ks * 256, 128, bs.group_bytes()),
                    (_, false) => (ks * 2 * bs.group_bytes(), bs.group_bytes(), 128),
                };
                nvvm::wgmma_desc(ir, ir.add(b_base, ir.ci32(off as i64)), lbo, sbo, sw)
            })
            .collect();
        let a_base = a_smem.filter(|s| s.wgmma_readable()).map(|s| (ir.ptr_to_int(self.sptr(s.off), i32t), s));
        let g = ir.lshr(self.warp, ir.ci32(2));
        let mut out: Vec<Vec<V>> = Vec::new();
        for mf in 0..fm {
            let mut acc: Option<Vec<V>> = accs.as_ref().map(|a| a[mf].clone());
            for (ks, bd) in b_desc.iter().enumerate() {
                let ir = &self.ir;
                let a = match (&a_regs, &a_base) {
                    (Some(r), _) => nvvm::WgmmaA::Regs(r[mf][ks]),
                    (None, Some((base, s))) => {
                        // This warpgroup's 64-row block of the K-major tile.
                        let block = ir.add(ir.ci32((mf * groups) as i64), g);
                        let (block_stride, off, lbo, sbo, sw) = match s.layout {
                            SmemLayout::Swizzle128 => {
                                (64 * 128, ks / 4 * s.block_bytes() + ks % 4 * 32, 16, 1024, true)
                            }
                            _ => (8 * s.group_bytes(), ks * 256, 128, s.group_bytes(), false),
                        };
                        let start =
                            ir.add(*base, ir.add(ir.mul(block, ir.ci32(block_stride as i64)), ir.ci32(off as i64)));
                        nvvm::WgmmaA::Desc(nvvm::wgmma_desc(ir, start, lbo, sbo, sw))
                    }
                    (None, None) => return Err(self.err("wgmma: no A operand".into())),
                };
                acc = Some(nvvm::wgmma_m64k16(ir, f16, n, acc.as_deref(), &a, *bd, !trans_b));
            }
            out.push(acc.expect("k >= 16"));
        }
        nvvm::wgmma_commit(&self.ir);
        let mut c = c.unwrap_or_else(|| vec![std::ptr::null_mut(); 2 * fm * ncols]);
        let mut it = out.concat().into_iter();
        for mf in 0..fm {
            for j in 0..n / 8 {
                for r in 0..4 {
                    c[slot(mf, j, r)] = it.next().expect("wgmma accumulators");
                }
            }
        }
        Ok(c)
    }

    /// Wait for the pending warpgroup MMA groups up to and including `upto` (they
    /// complete in order): `wgmma.wait_group` with the number of newer groups, tied
    /// through the accumulators it makes final.
    pub(super) fn wg_wait(&mut self, upto: usize) -> R<()> {
        let (newer, values) = self.wg.complete(upto);
        let mut regs = Vec::new();
        for v in &values {
            match self.get(*v)? {
                GV::Dist(d) => regs.extend_from_slice(&d.e),
                _ => return Err(self.err(format!("pending product %{} is not a register tile", v.index()))),
            }
        }
        let waited = nvvm::wgmma_wait(&self.ir, newer, &regs);
        let mut it = waited.into_iter();
        for v in values {
            if let Some(GV::Dist(d)) = self.vals[v.index()].as_mut() {
                for x in d.e.iter_mut() {
                    *x = it.next().expect("waited accumulators");
                }
            }
        }
        Ok(())
    }

    /// The schedule's waits before op `id` (`None`: at the end of the program). Each
    /// must complete exactly the products in flight that it names, oldest first.
    pub(super) fn planned_waits(&mut self, id: Option<OpId>) -> R<()> {
        let waits = match id {
            Some(id) => self.sched.waits.get(&id).cloned().unwrap_or_default(),
            None => self.sched.final_waits.clone(),
        };
        for w in waits {
            let in_flight = self.wg.in_flight();
            if w.complete.is_empty()
                || in_flight.len() != w.complete.len() + w.in_flight
                || in_flight[..w.complete.len()] != w.complete[..]
            {
                return Err(self.err(format!(
                    "internal error: the schedule waits for {:?} leaving {} in flight, but {:?} are in flight",
                    w.complete, w.in_flight, in_flight
                )));
            }
            self.wg_wait(w.complete.len() - 1)?;
        }
        Ok(())
    }
}
