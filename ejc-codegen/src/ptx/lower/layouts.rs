//! Register-tile layouts: which thread holds which elements (`Ax`, `Dist`), and
//! rank-1 tiles oriented or rematerialised per use.

use super::*;

impl<'k> Lowering<'k> {
    /// The register layout of tile `v`.
    pub(super) fn axes_of(&self, v: Value) -> R<(Ax, Ax)> {
        let Type::Tile(_, shape) = self.ty(v) else {
            return Err(self.err(format!("%{} is not a tile", v.index())));
        };
        let ax = |n: usize| if n == 1 { Ax::One } else { Ax::Mma(n) };
        let (rows, cols) = match shape.len() {
            2 => (ax(shape[0]), ax(shape[1])),
            1 => match self.plan.orient.get(&v).copied().unwrap_or(Orient::Rows) {
                Orient::Rows => (ax(shape[0]), Ax::One),
                Orient::Cols => (Ax::One, ax(shape[0])),
            },
            _ => return Err(self.err(format!("tiles of rank {} are not supported", shape.len()))),
        };
        if let Ax::Mma(r) = rows {
            // Fewer rows than 16 × num_warps: replicated over the warps (`row_warps`).
            if r % (16 * self.row_warps(r)) != 0 {
                return Err(self.err(format!(
                    "a register tile of {r} rows needs a multiple of 16 rows, and of 16 × num_warps = {} when it \
                     has more (tile %{})",
                    16 * self.warps,
                    v.index()
                )));
            }
        }
        if let Ax::Mma(c) = cols {
            if c % 8 != 0 {
                return Err(
                    self.err(format!("a register tile of {c} columns needs a multiple of 8 (tile %{})", v.index()))
                );
            }
        }
        Ok((rows, cols))
    }

    pub(super) fn nrows(&self, a: Ax) -> usize {
        match a {
            Ax::One => 1,
            Ax::Mma(r) => 2 * r / (16 * self.row_warps(r)),
        }
    }

    /// The extent of a register-tile axis.
    pub(super) fn extent(a: Ax) -> usize {
        match a {
            Ax::One => 1,
            Ax::Mma(n) => n,
        }
    }

    pub(super) fn ncols(a: Ax) -> usize {
        match a {
            Ax::One => 1,
            Ax::Mma(c) => c / 4,
        }
    }

    /// Row index (i32, within the tile) of each of the thread's row slots.
    pub(super) fn row_coords(&self, a: Ax) -> Vec<V> {
        let ir = &self.ir;
        match a {
            Ax::One => vec![ir.ci32(0)],
            Ax::Mma(r) => {
                let per_warp = r / self.row_warps(r);
                let quad = ir.lshr(self.lane, ir.ci32(2));
                let mut out = Vec::new();
                for mf in 0..per_warp / 16 {
                    let base = self.ir.add(self.mfrag_row0(r, mf), quad);
                    for h in 0..2 {
                        out.push(self.ir.add(base, self.ir.ci32((h * 8) as i64)));
                    }
                }
                out
            }
        }
    }

    /// Column index (i32) of each of the thread's column slots.
    pub(super) fn col_coords(&self, a: Ax) -> Vec<V> {
        let ir = &self.ir;
        match a {
            Ax::One => vec![ir.ci32(0)],
            Ax::Mma(c) => {
                let base = Self::col_base(ir, self.lane);
                Self::col_offsets(c).into_iter().map(|o| ir.add(base, ir.ci32(o))).collect()
            }
        }
    }

    /// The thread's first column in the accumulator layout (i32): `(lane % 4) · 2`.
    pub(super) fn col_base(ir: &Ir, lane: V) -> V {
        ir.shl(ir.and(lane, ir.ci32(3)), ir.ci32(1))
    }

    /// Column slots of an `Ax::Mma(c)` axis, as offsets from [`Self::col_base`]: two
    /// adjacent columns in every 8-column group.
    pub(super) fn col_offsets(c: usize) -> Vec<i64> {
        (0..c / 8).flat_map(|nf| [nf * 8, nf * 8 + 1]).map(|o| o as i64).collect()
    }

    /// Tile `v` in registers (shared-memory tiles are read out).
    pub(super) fn dist(&mut self, v: Value) -> R<Dist> {
        match self.get(v)?.clone() {
            GV::Dist(d) => Ok(d),
            GV::Smem(s) => {
                let d = self.smem_to_dist(v, &s)?;
                Ok(d)
            }
            GV::Lazy => {
                let first = self.plan.orient.get(&v).copied().unwrap_or(Orient::Rows);
                let other = if first == Orient::Rows { Orient::Cols } else { Orient::Rows };
                match self.remat(v, first) {
                    Ok(d) => Ok(d),
                    Err(_) => self.remat(v, other),
                }
            }
            // A scalar broadcasts like a 1 × 1 tile.
            GV::Scalar(x) => Ok(Dist { rows: Ax::One, cols: Ax::One, e: vec![x] }),
            GV::Tensor(_) => Err(self.err(format!("tensor %{} used as a tile", v.index()))),
        }
    }

    /// Rank-1 tile `v` along `o` (rows or columns), computed again if it was built
    /// along the other axis (only rematerialisable tiles can be).
    pub(super) fn dist_oriented(&mut self, v: Value, o: Orient) -> R<Dist> {
        if matches!(self.get(v)?, GV::Lazy) {
            return self.remat(v, o);
        }
        let d = self.dist(v)?;
        let is_rank1 = matches!(self.ty(v), Type::Tile(_, s) if s.len() == 1);
        let along = if d.rows == Ax::One && d.cols != Ax::One { Orient::Cols } else { Orient::Rows };
        let single = d.rows == Ax::One && d.cols == Ax::One;
        if !is_rank1 || single || along == o {
            return Ok(d);
        }
        if !self.plan.remat.contains(&v) {
            return Err(self.err(format!("rank-1 tile %{} is needed along both axes", v.index())));
        }
        self.remat(v, o)
    }

    pub(super) fn oriented_axes(&self, v: Value, o: Orient) -> R<(Ax, Ax)> {
        let Type::Tile(_, shape) = self.ty(v) else { return Err(self.err("not a tile".into())) };
        let n = shape[0];
        let a = if n == 1 { Ax::One } else { Ax::Mma(n) };
        Ok(match o {
            Orient::Rows => (a, Ax::One),
            Orient::Cols => (Ax::One, a),
        })
    }

    /// Build rematerialisable rank-1 tile `v` along `o` (recursively).
    pub(super) fn remat(&mut self, v: Value, o: Orient) -> R<Dist> {
        let op = self.du.def(v).ok_or_else(|| self.err(format!("%{} has no definition", v.index())))?;
        let (rows, cols) = self.oriented_axes(v, o)?;
        match &op.kind {
            OpKind::Arange { .. } => {
                let e = if o == Orient::Cols { self.col_coords(cols) } else { self.row_coords(rows) };
                Ok(Dist { rows, cols, e })
            }
            OpKind::Splat { .. } => {
                let x = self.scalar(op.operands[0])?;
                let n = self.nrows(rows) * Self::ncols(cols);
                Ok(Dist { rows, cols, e: vec![x; n] })
            }
            _ => {
                let dtypes: Vec<DType> = op.operands.iter().map(|x| self.ty(*x).dtype()).collect();
                let dtypes = if matches!(op.kind, OpKind::Select) { dtypes[1..].to_vec() } else { dtypes };
                let mut ins = Vec::new();
                for x in &op.operands {
                    ins.push(if matches!(self.ty(*x), Type::Scalar(_)) { self.dist(*x)? } else { self.remat(*x, o)? });
                }
                let (nr, nc) = (self.nrows(rows), Self::ncols(cols));
                let mut e = Vec::new();
                for ri in 0..nr {
                    for ci in 0..nc {
                        let xs: Vec<V> = ins.iter().map(|d| Self::elem(d, ri, ci, nc)).collect();
                        e.push(self.elem_op(&op.kind, &dtypes, &xs));
                    }
                }
                Ok(Dist { rows, cols, e })
            }
        }
    }

    pub(super) fn elem(d: &Dist, ri: usize, ci: usize, ncols: usize) -> V {
        let r = if d.rows == Ax::One { 0 } else { ri };
        let c = if d.cols == Ax::One { 0 } else { ci };
        let _ = ncols;
        d.e[r * Self::ncols(d.cols) + c]
    }
}
