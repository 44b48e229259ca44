//! Tile IR → LLVM IR for x86-64.
//!
//! How tiles become machine code:
//!
//! * **Scalars** are SSA values.
//! * **Tiles** live in a per-thread scratch buffer (the ABI's `scratch`), each at a
//!   fixed offset decided at compile time, in a *layout* chosen for its consumer:
//!   row-major, column-major, or the bf16 pair layouts that `vdpbf16ps` reads.
//! * **Element-wise ops are lazy**: an op whose result has one use is not computed
//!   on its own; its consumer evaluates the whole expression per element, in one
//!   loop, vectorised along the contiguous axis of the destination. Scale, soft cap,
//!   mask and dropout thus cost one pass over the scores, not one each.
//! * **`tile.dot`** is a register-blocked micro-kernel (MR rows × NR columns of
//!   accumulators held in vector registers, FMA or `vdpbf16ps`). Its operands are
//!   materialised in the layouts it needs; for `q · kᵀ` it computes `sᵀ = k · qᵀ`, so
//!   that the key tile is used as loaded (row-major) and only the query tile, loaded
//!   once per program, is stored transposed. The scores then sit column-major, and the
//!   online softmax works across rows with vertical vector ops (no horizontal
//!   reductions).
//! * **AMX** (`cpu:amx`): bf16 products of whole tiles run on `tdpbf16ps` instead
//!   (`gemm_amx`: 16 × 16 f32 accumulator tiles, up to 2 × 2, K in steps of 32; A rows
//!   along K, B in K-pairs). The column-major P feeds the row-major A tile through
//!   16 × 16 register transposes (`transpose16`) rather than element gathers.
//! * **Control flow**: `scf.for` is an LLVM loop with phis for scalars and a buffer
//!   per carried tile; `scf.if` branches with phis / result buffers.
//!
//! The entry point and its argument layout are the ABI in `ejc_ir::cpu_abi`.

use std::collections::HashMap;

use ejc_ir::cpu_abi::{tensor_slots, Isa, MAX_RANK, SCRATCH_ALIGN, TENSOR_SIZE};
use ejc_ir::defuse::DefUse;
use ejc_ir::ir::{AxisIndex, BinOp, Block, CmpPred, Kernel, Op, OpKind, UnOp, Value};
use ejc_ir::types::{DType, Type};
use llvm_sys::LLVMIntPredicate::*;
use llvm_sys::LLVMRealPredicate::*;

use crate::arith::Arith;
use crate::llvm::{Ir, B, T, V};
use crate::math;
use crate::CodegenError;

/// What compiling one kernel produced, besides its function.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct KernelCode {
    pub entry: String,
    /// Bytes of scratch the kernel needs per thread.
    pub scratch_bytes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// (r, c) at r·C + c.
    RowMajor,
    /// (r, c) at c·R + r.
    ColMajor,
    /// Rows in interleaved pairs: (r, c) at ((r/2)·C + c)·2 + r%2.
    PairRows,
    /// Columns in interleaved pairs: (r, c) at ((c/2)·R + r)·2 + c%2.
    PairCols,
}

/// A materialised tile. Rank-1 tiles have `rows == 1` and are contiguous.
#[derive(Clone, Copy, Debug)]
struct Buf {
    ptr: V,
    rows: usize,
    cols: usize,
    storage: DType,
    layout: Layout,
    /// Run-time row stride (elements) of a row-major view into a tensor; None for
    /// scratch buffers, whose rows are `cols` apart.
    rstride: Option<V>,
}

/// A consumer's wish for how a tile is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Want {
    layout: Layout,
    storage: DType,
}

#[derive(Clone, Copy, Debug)]
enum Val {
    Scalar(V),
    Buf(Buf),
    /// Computed where used (an element-wise op with one use).
    Lazy,
    /// Index into the tensor table.
    Tensor(usize),
}

struct TensorInfo {
    data: V,
    shape: Vec<V>,
    strides: Vec<V>,
    dtype: DType,
}

/// Per axis of a tile access: the index (or range start), its optional limit, and
/// the range's size (None for a fixed index), all i64.
type AxisAccess = (V, Option<V>, Option<usize>);

/// A loop body that carries values: (builder, induction variable, carried) → next.
type CarryBody<'b, 'k> = dyn FnMut(&mut Lowering<'k>, V, &[V]) -> R<Vec<V>> + 'b;

/// One coordinate of an element access.
#[derive(Clone, Copy, Debug)]
enum Idx {
    Zero,
    /// A scalar i64 index.
    S(V),
    /// `lanes` consecutive indices from an i64 base.
    Vc(V, usize),
}

#[derive(Clone, Copy, Debug)]
struct At {
    r: Idx,
    c: Idx,
}

fn key(i: Idx) -> usize {
    match i {
        Idx::Zero => 0,
        Idx::S(v) => v as usize,
        Idx::Vc(v, _) => (v as usize) | 1,
    }
}

pub struct Lowering<'k> {
    ir: Ir,
    kernel: &'k Kernel,
    isa: Isa,
    vals: Vec<Option<Val>>,
    /// Definitions and uses of the kernel's values.
    du: DefUse<'k>,
    tensors: Vec<TensorInfo>,
    scratch: V,
    scratch_top: u64,
    wants: HashMap<Value, Want>,
    /// For each tile.dot, whether it computes Cᵀ = Bᵀ·Aᵀ.
    transposed_dots: Vec<*const Op>,
    pid: [V; 3],
    memo: HashMap<(Value, usize, usize), V>,
}

type R<X> = Result<X, CodegenError>;

fn unsupported(kernel: &Kernel, what: String) -> CodegenError {
    CodegenError::Kernel { kernel: kernel.name.clone(), message: format!("CPU back end: {what}") }
}

impl<'k> Lowering<'k> {
    /// # Safety
    /// `ir` must be positioned in a fresh function with the ABI's signature.
    pub fn new(ir: Ir, kernel: &'k Kernel, isa: Isa) -> Lowering<'k> {
        let scratch = ir.param(5);
        Lowering {
            ir,
            kernel,
            isa,
            vals: vec![None; kernel.values.len()],
            du: DefUse::new(kernel),
            tensors: Vec::new(),
            scratch,
            scratch_top: 0,
            wants: HashMap::new(),
            transposed_dots: Vec::new(),
            pid: [std::ptr::null_mut(); 3],
            memo: HashMap::new(),
        }
    }

    fn ty(&self, v: Value) -> &'k Type {
        self.kernel.ty(v)
    }

    fn err(&self, what: String) -> CodegenError {
        unsupported(self.kernel, what)
    }

    // ---------------------------------------------------------------- entry

    /// Emit the whole kernel; returns its scratch size.
    pub fn run(mut self) -> R<u64> {
        self.plan_dots();
        let ir = &self.ir;
        let entry = ir.block("entry");
        ir.at_end(entry);
        // Tensor and scalar parameters.
        let (tp, sp, gp) = (ir.param(0), ir.param(1), ir.param(2));
        let (mut ti, mut si) = (0i64, 0i64);
        for p in &self.kernel.params {
            match &p.ty {
                Type::Tensor(d, rank) => {
                    let base = ir.gep_const(ir.i8(), tp, ti * TENSOR_SIZE as i64);
                    let data = ir.load(ir.ptr(), base, 8);
                    // Axis a: field a % 4 of the tensor's descriptor a / 4 (ranks above
                    // 4 continue in the next descriptors; `cpu_abi::descriptors`).
                    let field = |a: usize, off: i64| {
                        let at = (a / MAX_RANK) as i64 * TENSOR_SIZE as i64 + off + 8 * (a % MAX_RANK) as i64;
                        ir.load(ir.i64(), ir.gep_const(ir.i8(), base, at), 8)
                    };
                    let shape = (0..*rank).map(|a| field(a, 8)).collect();
                    let strides = (0..*rank).map(|a| field(a, 40)).collect();
                    self.vals[p.value.index()] = Some(Val::Tensor(self.tensors.len()));
                    self.tensors.push(TensorInfo { data, shape, strides, dtype: *d });
                    ti += tensor_slots(*rank) as i64;
                }
                Type::Scalar(d) => {
                    let raw = ir.load(ir.i64(), ir.gep_const(ir.i64(), sp, si), 8);
                    let v = match d {
                        DType::F32 => ir.bitcast(ir.trunc(raw, ir.i32()), ir.f32()),
                        DType::I32 | DType::U32 => ir.trunc(raw, ir.i32()),
                        DType::I1 => ir.trunc(raw, ir.i1()),
                        other => return Err(self.err(format!("scalar parameters of type {other} are not supported"))),
                    };
                    self.vals[p.value.index()] = Some(Val::Scalar(v));
                    si += 1;
                }
                Type::Tile(..) => return Err(self.err("tile parameters".into())),
            }
        }
        let g: Vec<V> = (0..3).map(|i| ir.load(ir.i64(), ir.gep_const(ir.i64(), gp, i), 8)).collect();
        let (begin, end) = (ir.param(3), ir.param(4));
        // for p in begin..end
        let head = ir.block("program");
        let body = ir.block("program.body");
        let exit = ir.block("exit");
        let pre = ir.current();
        ir.br(head);
        ir.at_end(head);
        let p = ir.phi(ir.i64());
        ir.add_incoming(p, begin, pre);
        ir.cond_br(ir.icmp(LLVMIntSLT, p, end), body, exit);
        ir.at_end(body);
        let pid0 = ir.srem(p, g[0]);
        let t = ir.sdiv(p, g[0]);
        let pid1 = ir.srem(t, g[1]);
        let pid2 = ir.sdiv(t, g[1]);
        self.pid = [ir.trunc(pid0, ir.i32()), ir.trunc(pid1, ir.i32()), ir.trunc(pid2, ir.i32())];
        let kbody = &self.kernel.body;
        self.block(kbody)?;
        let ir = &self.ir;
        let next = ir.add(p, ir.ci64(1));
        ir.add_incoming(p, next, ir.current());
        ir.br(head);
        ir.at_end(exit);
        ir.ret_void();
        Ok(self.scratch_top)
    }

    // ---------------------------------------------------------------- planning

    /// Decide each dot's orientation and the layouts its operands should be built in.
    fn plan_dots(&mut self) {
        let mut plans = Vec::new();
        ejc_ir::ir::walk_ops(&self.kernel.body, &mut |op: &'k Op| {
            if let OpKind::Dot { trans_a, trans_b } = op.kind {
                plans.push((op, trans_a, trans_b));
            }
        });
        for (op, trans_a, trans_b) in plans {
            let pairs = self.dot_path(op) != DotPath::F32;
            let storage = if pairs { DType::BF16 } else { DType::F32 };
            let transposed = trans_b && !trans_a;
            if transposed {
                self.transposed_dots.push(op as *const Op);
            }
            // Layout needs, stated for each operand's *stored* shape (a tile several
            // products read is built for the first; the others convert it).
            let (a, b) = Self::operand_wants(transposed, pairs, trans_b);
            if let Some(a) = a {
                self.wants.entry(op.operands[0]).or_insert(Want { layout: a, storage });
            }
            self.wants.entry(op.operands[1]).or_insert(Want { layout: b, storage });
        }
    }

    /// The layouts a product needs its operands stored in: `a`'s when fixed (the A-role
    /// of a normal product is read one element, or one bf16 pair, at a time, so its
    /// layout is chosen when the dot is emitted, to match how it is produced), and `b`'s.
    fn operand_wants(transposed: bool, pairs: bool, trans_b: bool) -> (Option<Layout>, Layout) {
        if !transposed {
            let b = match (pairs, trans_b) {
                (false, false) => Layout::RowMajor,
                (false, true) => Layout::ColMajor,
                (true, false) => Layout::PairRows,
                (true, true) => Layout::PairCols,
            };
            (None, b)
        } else {
            // Cᵀ = bᵀ·aᵀ: A-role = bᵀ with b stored [N, K] (read as loaded, pairs along
            // K are adjacent), B-role = aᵀ with a stored [M, K]: vectors along M.
            (Some(if pairs { Layout::PairCols } else { Layout::ColMajor }), Layout::RowMajor)
        }
    }

    /// How a dot's products are computed: bf16 products go to AMX tiles where the ISA
    /// has them and the sizes are whole tiles (16 rows and columns, K in steps of 32), to
    /// `vdpbf16ps` on AVX512_BF16, and otherwise in f32 (on an AMX machine a bf16 product
    /// that does not fit the tiles is faster widened to f32 than through `vdpbf16ps`:
    /// docs/perf.md).
    fn dot_path(&self, op: &Op) -> DotPath {
        let a = op.operands[0];
        if self.ty(a).dtype() != DType::BF16 {
            return DotPath::F32;
        }
        if self.isa.has_amx() {
            let (m, n) = self.dims(op.results[0]);
            let trans_a = matches!(op.kind, OpKind::Dot { trans_a: true, .. });
            let k = if trans_a { self.dims(a).0 } else { self.dims(a).1 };
            return if m % AMX_ROWS == 0 && n % AMX_ROWS == 0 && k % AMX_K == 0 { DotPath::Amx } else { DotPath::F32 };
        }
        if self.isa.has_bf16_dot() {
            DotPath::Pairs
        } else {
            DotPath::F32
        }
    }

    fn is_transposed(&self, op: &Op) -> bool {
        self.transposed_dots.contains(&(op as *const Op))
    }

    /// The layout a tile prefers when nobody asks: the layout of the data it is made
    /// from, so that its materialisation reads contiguously.
    fn preferred_layout(&self, v: Value, depth: usize) -> Layout {
        if let Some(w) = self.wants.get(&v) {
            return w.layout;
        }
        match self.vals[v.index()] {
            Some(Val::Buf(b)) if b.rows > 1 && b.cols > 1 => {
                return match b.layout {
                    Layout::ColMajor | Layout::PairCols => Layout::ColMajor,
                    _ => Layout::RowMajor,
                }
            }
            _ => {}
        }
        if depth > 16 {
            return Layout::RowMajor;
        }
        if let Some(op) = self.du.def(v) {
            let shape = self.ty(v).shape().to_vec();
            if matches!(
                op.kind,
                OpKind::Binary(_)
                    | OpKind::Unary(_)
                    | OpKind::Cmp(_)
                    | OpKind::Select
                    | OpKind::Cast { .. }
                    | OpKind::SoftmaxRescale
                    | OpKind::If
            ) {
                let candidates: Vec<Value> = if matches!(op.kind, OpKind::If) {
                    let i = op.results.iter().position(|r| *r == v).unwrap_or(0);
                    op.regions.iter().filter_map(|r| r.ops.last().and_then(|y| y.operands.get(i).copied())).collect()
                } else {
                    op.operands.clone()
                };
                for o in candidates {
                    if self.ty(o).shape() == shape.as_slice() {
                        let l = self.preferred_layout(o, depth + 1);
                        if l != Layout::RowMajor {
                            return l;
                        }
                    }
                }
            }
        }
        Layout::RowMajor
    }

    // ---------------------------------------------------------------- helpers

    fn arith(&self) -> Arith<'_> {
        Arith { ir: &self.ir, soft_f16: self.isa == Isa::X86_64, soft_bf16: !self.isa.has_bf16_dot() }
    }
    fn compute_ty(&self, d: DType) -> T {
        self.arith().compute_ty(d)
    }
    fn convert(&self, x: V, from: DType, to: DType) -> V {
        self.arith().convert(x, from, to)
    }
    fn binary(&self, b: BinOp, dt: DType, x: V, y: V) -> V {
        self.arith().binary(b, dt, x, y)
    }
    fn unary(&self, u: UnOp, dt: DType, x: V) -> V {
        self.arith().unary(u, dt, x)
    }
    fn compare(&self, p: CmpPred, dt: DType, x: V, y: V) -> V {
        self.arith().compare(p, dt, x, y)
    }
    fn cast(&self, x: V, from: DType, to: DType) -> V {
        self.arith().cast(x, from, to)
    }

    fn storage_ty(&self, d: DType) -> T {
        match d {
            DType::I1 => self.ir.i8(),
            other => self.compute_ty(other),
        }
    }

    fn alloc(&mut self, rows: usize, cols: usize, storage: DType, layout: Layout) -> Buf {
        let bytes = (rows * cols * storage.size_bytes()) as u64;
        let align = SCRATCH_ALIGN as u64;
        let off = self.scratch_top.div_ceil(align) * align;
        self.scratch_top = off + bytes.max(1);
        let ptr = self.ir.gep_const(self.ir.i8(), self.scratch, off as i64);
        Buf { ptr, rows, cols, storage, layout, rstride: None }
    }

    /// (rows, cols) of a tile type; rank-1 tiles are one row.
    fn dims(&self, v: Value) -> (usize, usize) {
        let s = self.ty(v).shape();
        match s.len() {
            1 => (1, s[0]),
            2 => (s[0], s[1]),
            _ => (1, 1),
        }
    }

    fn scalar(&self, v: Value) -> R<V> {
        match self.vals[v.index()] {
            Some(Val::Scalar(x)) => Ok(x),
            other => Err(self.err(format!("value %{} is not a scalar ({other:?})", v.0))),
        }
    }

    /// Emit `for iv in (lo..hi).step_by(step)` over i64 constants.
    fn for_const(&mut self, lo: usize, hi: usize, step: usize, body: &mut dyn FnMut(&mut Self, V) -> R<()>) -> R<()> {
        if hi <= lo {
            return Ok(());
        }
        if hi - lo == step {
            // One iteration: no loop.
            let iv = self.ir.ci64(lo as i64);
            return body(self, iv);
        }
        let (lo_v, hi_v, st) = (self.ir.ci64(lo as i64), self.ir.ci64(hi as i64), self.ir.ci64(step as i64));
        let pre = self.ir.current();
        let head = self.ir.block("loop");
        let exit = self.ir.block("loop.exit");
        self.ir.br(head);
        self.ir.at_end(head);
        let iv = self.ir.phi(self.ir.i64());
        self.ir.add_incoming(iv, lo_v, pre);
        body(self, iv)?;
        let next = self.ir.add(iv, st);
        self.ir.add_incoming(iv, next, self.ir.current());
        self.ir.cond_br(self.ir.icmp(LLVMIntSLT, next, hi_v), head, exit);
        self.ir.at_end(exit);
        Ok(())
    }

    /// `for_const` carrying SSA values from one iteration to the next (phis);
    /// returns their final values.
    fn for_carry(
        &mut self,
        lo: usize,
        hi: usize,
        step: usize,
        init: Vec<V>,
        body: &mut CarryBody<'_, 'k>,
    ) -> R<Vec<V>> {
        if hi <= lo {
            return Ok(init);
        }
        let pre = self.ir.current();
        let head = self.ir.block("loop");
        let exit = self.ir.block("loop.exit");
        self.ir.br(head);
        self.ir.at_end(head);
        let iv = self.ir.phi(self.ir.i64());
        self.ir.add_incoming(iv, self.ir.ci64(lo as i64), pre);
        let phis: Vec<V> = init
            .iter()
            .map(|x| {
                let p = self.ir.phi(self.ir.type_of(*x));
                self.ir.add_incoming(p, *x, pre);
                p
            })
            .collect();
        let next_vals = body(self, iv, &phis)?;
        let latch = self.ir.current();
        let next = self.ir.add(iv, self.ir.ci64(step as i64));
        self.ir.add_incoming(iv, next, latch);
        for (p, x) in phis.iter().zip(&next_vals) {
            self.ir.add_incoming(*p, *x, latch);
        }
        self.ir.cond_br(self.ir.icmp(LLVMIntSLT, next, self.ir.ci64(hi as i64)), head, exit);
        self.ir.at_end(exit);
        Ok(next_vals)
    }

    /// Emit an if/else on an i1; returns nothing (callers pass values through memory
    /// or phis they build themselves).
    fn if_then(
        &mut self,
        cond: V,
        then: &mut dyn FnMut(&mut Self) -> R<()>,
        otherwise: &mut dyn FnMut(&mut Self) -> R<()>,
    ) -> R<()> {
        let t = self.ir.block("then");
        let e = self.ir.block("else");
        let m = self.ir.block("merge");
        self.ir.cond_br(cond, t, e);
        self.ir.at_end(t);
        then(self)?;
        self.ir.br(m);
        self.ir.at_end(e);
        otherwise(self)?;
        self.ir.br(m);
        self.ir.at_end(m);
        Ok(())
    }

    fn vec_width(&self, len: usize) -> usize {
        let vl = self.isa.lanes();
        if len >= vl && len.is_multiple_of(vl) {
            vl
        } else {
            1
        }
    }

    // ---------------------------------------------------------------- element access

    /// i64 index value(s) of an Idx.
    fn idx_value(&self, i: Idx) -> V {
        match i {
            Idx::Zero => self.ir.ci64(0),
            Idx::S(v) => v,
            Idx::Vc(base, n) => self.ir.add(self.ir.splat(base, n), self.ir.iota64(n)),
        }
    }

    fn lanes_of(i: Idx) -> usize {
        match i {
            Idx::Vc(_, n) => n,
            _ => 1,
        }
    }

    /// Pointer to element (r, c) of a buffer, for scalar indices (i64 values).
    fn elem_ptr(&self, b: &Buf, r: V, c: V) -> V {
        let ir = &self.ir;
        let (rr, cc) = (ir.ci64(b.rows as i64), ir.ci64(b.cols as i64));
        let two = ir.ci64(2);
        let idx = match b.layout {
            Layout::RowMajor => ir.add(ir.mul(r, b.rstride.unwrap_or(cc)), c),
            Layout::ColMajor => ir.add(ir.mul(c, rr), r),
            Layout::PairRows => {
                let pr = ir.sdiv(r, two);
                ir.add(ir.mul(ir.add(ir.mul(pr, cc), c), two), ir.srem(r, two))
            }
            Layout::PairCols => {
                let pc = ir.sdiv(c, two);
                ir.add(ir.mul(ir.add(ir.mul(pc, rr), r), two), ir.srem(c, two))
            }
        };
        ir.gep(self.storage_ty(b.storage), b.ptr, idx)
    }

    /// Convert a storage-typed value to the compute type of `want` dtype.
    fn decode_storage(&self, x: V, storage: DType, want: DType) -> V {
        let ir = &self.ir;
        let n = ir.lanes(x);
        let x = if storage == DType::I1 { ir.trunc(x, ir.vec(ir.i1(), n)) } else { x };
        self.convert(x, storage, want)
    }

    /// Read element(s) of a buffer at (r, c) (at most one vector coordinate).
    fn read(&self, b: &Buf, at: At, dtype: DType) -> V {
        let ir = &self.ir;
        let st = self.storage_ty(b.storage);
        let (r, c) = (at.r, at.c);
        // Contiguous vector cases.
        match (b.layout, r, c) {
            (_, Idx::Zero | Idx::S(_), Idx::Vc(base, n)) if b.rows == 1 || b.layout == Layout::RowMajor => {
                let rv = if let Idx::S(rv) = r { rv } else { ir.ci64(0) };
                let p = self.elem_ptr(b, rv, base);
                let x = ir.load(ir.vec(st, n), p, b.storage.size_bytes() as u32);
                return self.decode_storage(x, b.storage, dtype);
            }
            (Layout::ColMajor, Idx::Vc(base, n), Idx::Zero | Idx::S(_)) => {
                let cv = if let Idx::S(cv) = c { cv } else { ir.ci64(0) };
                let p = self.elem_ptr(b, base, cv);
                let x = ir.load(ir.vec(st, n), p, b.storage.size_bytes() as u32);
                return self.decode_storage(x, b.storage, dtype);
            }
            _ => {}
        }
        let n = Self::lanes_of(r).max(Self::lanes_of(c));
        if n == 1 {
            let p = self.elem_ptr(b, self.idx_value(r), self.idx_value(c));
            let x = ir.load(st, p, b.storage.size_bytes() as u32);
            return self.decode_storage(x, b.storage, dtype);
        }
        // Gather lane by lane.
        let mut out = ir.poison(ir.vec(st, n));
        for lane in 0..n {
            let pick = |i: Idx| match i {
                Idx::Zero => ir.ci64(0),
                Idx::S(v) => v,
                Idx::Vc(base, _) => ir.add(base, ir.ci64(lane as i64)),
            };
            let p = self.elem_ptr(b, pick(r), pick(c));
            out = ir.insert(out, ir.load(st, p, b.storage.size_bytes() as u32), lane);
        }
        self.decode_storage(out, b.storage, dtype)
    }

    /// Write element(s) (compute type of `dtype`) at (r, c).
    fn write(&self, b: &Buf, at: At, x: V, dtype: DType) {
        let ir = &self.ir;
        let n = ir.lanes(x);
        let x = self.convert(x, dtype, b.storage);
        let x = if b.storage == DType::I1 { ir.zext(x, ir.vec(ir.i8(), n)) } else { x };
        let align = b.storage.size_bytes() as u32;
        match (b.layout, at.r, at.c) {
            (_, Idx::Zero | Idx::S(_), Idx::Vc(base, _)) if b.rows == 1 || b.layout == Layout::RowMajor => {
                let rv = if let Idx::S(rv) = at.r { rv } else { ir.ci64(0) };
                ir.store(x, self.elem_ptr(b, rv, base), align);
                return;
            }
            (Layout::ColMajor, Idx::Vc(base, _), Idx::Zero | Idx::S(_)) => {
                let cv = if let Idx::S(cv) = at.c { cv } else { ir.ci64(0) };
                ir.store(x, self.elem_ptr(b, base, cv), align);
                return;
            }
            _ => {}
        }
        if n == 1 {
            ir.store(x, self.elem_ptr(b, self.idx_value(at.r), self.idx_value(at.c)), align);
            return;
        }
        for lane in 0..n {
            let pick = |i: Idx| match i {
                Idx::Zero => ir.ci64(0),
                Idx::S(v) => v,
                Idx::Vc(base, _) => ir.add(base, ir.ci64(lane as i64)),
            };
            ir.store(ir.extract(x, lane), self.elem_ptr(b, pick(at.r), pick(at.c)), align);
        }
    }

    /// Map a frame coordinate onto a value of shape `shape` (size-1 axes broadcast).
    fn map_at(shape: &[usize], at: At) -> At {
        match shape.len() {
            2 => {
                At { r: if shape[0] == 1 { Idx::Zero } else { at.r }, c: if shape[1] == 1 { Idx::Zero } else { at.c } }
            }
            1 => At { r: Idx::Zero, c: if shape[0] == 1 { Idx::Zero } else { at.c } },
            _ => At { r: Idx::Zero, c: Idx::Zero },
        }
    }

    // ---------------------------------------------------------------- lazy evaluation

    /// The element(s) of `v` at `at`, in its compute type.
    fn eval(&mut self, v: Value, at: At) -> R<V> {
        let ty = self.ty(v).clone();
        let at = Self::map_at(ty.shape(), at);
        let k = (v, key(at.r), key(at.c));
        if let Some(x) = self.memo.get(&k) {
            return Ok(*x);
        }
        let x = match self.vals[v.index()] {
            Some(Val::Scalar(x)) => x,
            Some(Val::Buf(b)) => self.read(&b, at, ty.dtype()),
            Some(Val::Tensor(_)) => return Err(self.err(format!("tensor %{} used as a tile", v.0))),
            None => return Err(self.err(format!("value %{} used before it is computed", v.0))),
            Some(Val::Lazy) => self.eval_op(v, at, &ty)?,
        };
        self.memo.insert(k, x);
        Ok(x)
    }

    fn eval_op(&mut self, v: Value, at: At, ty: &Type) -> R<V> {
        let op = self.du.def(v).ok_or_else(|| self.err(format!("no definition for %{}", v.0)))?;
        let dt = ty.dtype();
        Ok(match &op.kind {
            OpKind::Splat { .. } => self.eval(op.operands[0], at)?,
            OpKind::Arange { .. } => {
                let i = self.idx_value(at.c);
                let n = self.ir.lanes(i);
                self.ir.trunc(i, self.ir.vec(self.ir.i32(), n))
            }
            OpKind::ExpandDims { axis } => {
                let inner = if *axis == 1 { At { r: Idx::Zero, c: at.r } } else { At { r: Idx::Zero, c: at.c } };
                self.eval(op.operands[0], inner)?
            }
            OpKind::Broadcast { .. } => self.eval(op.operands[0], at)?,
            OpKind::Binary(b) => {
                let x = self.eval(op.operands[0], at)?;
                let y = self.eval(op.operands[1], at)?;
                self.binary(*b, dt, x, y)
            }
            OpKind::Unary(u) => {
                let x = self.eval(op.operands[0], at)?;
                self.unary(*u, dt, x)
            }
            OpKind::Cmp(p) => {
                let od = self.ty(op.operands[0]).dtype();
                let x = self.eval(op.operands[0], at)?;
                let y = self.eval(op.operands[1], at)?;
                self.compare(*p, od, x, y)
            }
            OpKind::Select => {
                let c = self.eval(op.operands[0], at)?;
                let x = self.eval(op.operands[1], at)?;
                let y = self.eval(op.operands[2], at)?;
                let n = self.ir.lanes(c).max(self.ir.lanes(x)).max(self.ir.lanes(y));
                self.ir.select(self.ir.widen(c, n), self.ir.widen(x, n), self.ir.widen(y, n))
            }
            OpKind::Cast { to } => {
                let from = self.ty(op.operands[0]).dtype();
                let x = self.eval(op.operands[0], at)?;
                self.cast(x, from, *to)
            }
            OpKind::SoftmaxRescale => {
                let x = self.eval(op.operands[0], at)?;
                let a = self.eval(op.operands[1], At { r: Idx::Zero, c: at.r })?;
                let n = self.ir.lanes(x).max(self.ir.lanes(a));
                self.ir.fmul(self.ir.widen(x, n), self.ir.widen(a, n))
            }
            OpKind::RandUniform { .. } => {
                let s: Vec<V> = op.operands.iter().map(|o| self.scalar(*o)).collect::<R<_>>()?;
                let ir = &self.ir;
                let rows = self.idx_value(at.r);
                let cols = self.idx_value(at.c);
                let n = ir.lanes(rows).max(ir.lanes(cols));
                let i32n = ir.vec(ir.i32(), n);
                let row = ir.add(ir.widen(ir.trunc(rows, ir.vec(ir.i32(), ir.lanes(rows))), n), ir.splat(s[4], n));
                let col = ir.add(ir.widen(ir.trunc(cols, ir.vec(ir.i32(), ir.lanes(cols))), n), ir.splat(s[5], n));
                let x0 = math::philox_first_word(ir, [row, col, ir.splat(s[3], n), ir.splat(s[2], n)], [s[0], s[1]]);
                let top = ir.lshr(x0, ir.splat(ir.ci32(8), n));
                let f = ir.uitofp(top, ir.vec(ir.f32(), n));
                let _ = i32n;
                ir.fmul(f, ir.splat(ir.cf32(1.0 / 16777216.0), n))
            }
            other => return Err(self.err(format!("`{}` cannot be evaluated element-wise", other.name()))),
        })
    }

    // ---------------------------------------------------------------- materialisation

    /// Make `v` a buffer with `want` (or its current / preferred layout).
    fn buffer(&mut self, v: Value, want: Option<Want>) -> R<Buf> {
        let dtype = self.ty(v).dtype();
        if let Some(Val::Buf(b)) = self.vals[v.index()] {
            let vector_like = b.rows == 1 || b.cols == 1;
            match want {
                None => return Ok(b),
                Some(w)
                    if w.storage == b.storage
                        && (w.layout == b.layout
                            || (vector_like && matches!(w.layout, Layout::RowMajor | Layout::ColMajor))) =>
                {
                    return Ok(b)
                }
                _ => {}
            }
        }
        let want = want.unwrap_or_else(|| Want { layout: self.preferred_layout(v, 0), storage: dtype });
        let (rows, cols) = self.dims(v);
        let buf = self.alloc(rows, cols, want.storage, want.layout);
        self.fill(&buf, v)?;
        Ok(buf)
    }

    /// Evaluate `v` element by element into `dst` (same shape).
    fn fill(&mut self, dst: &Buf, v: Value) -> R<()> {
        let dtype = self.ty(v).dtype();
        let (rows, cols) = (dst.rows, dst.cols);
        let dst = *dst;
        self.memo.clear();
        let layout = if rows == 1 { Layout::RowMajor } else { dst.layout };
        match layout {
            Layout::RowMajor
                if self.vec_width(cols) == 16
                    && rows.is_multiple_of(16)
                    && cols.is_multiple_of(16)
                    && self.preferred_layout(v, 0) == Layout::ColMajor =>
            {
                // A column-major source into a row-major tile (the softmax's column-major
                // P into the row-major A tile of an AMX product): read 16 columns as
                // vectors, transpose the 16 × 16 block in registers, write 16 rows, instead
                // of one scalar load per element.
                self.for_const(0, rows, 16, &mut |cg, r0| {
                    cg.for_const(0, cols, 16, &mut |cg, c0| {
                        let mut xs = Vec::with_capacity(16);
                        for k in 0..16 {
                            cg.memo.clear();
                            let c = cg.ir.add(c0, cg.ir.ci64(k));
                            let x = cg.eval(v, At { r: Idx::Vc(r0, 16), c: Idx::S(c) })?;
                            xs.push(cg.ir.widen(x, 16));
                        }
                        let ys = transpose16(&cg.ir, xs);
                        for (i, y) in ys.into_iter().enumerate() {
                            let r = cg.ir.add(r0, cg.ir.ci64(i as i64));
                            cg.write(&dst, At { r: Idx::S(r), c: Idx::Vc(c0, 16) }, y, dtype);
                        }
                        Ok(())
                    })
                })?;
            }
            Layout::RowMajor => {
                let w = self.vec_width(cols);
                self.for_const(0, rows, 1, &mut |cg, r| {
                    cg.for_const(0, cols, w, &mut |cg, c| {
                        cg.memo.clear();
                        let at = At { r: Idx::S(r), c: if w > 1 { Idx::Vc(c, w) } else { Idx::S(c) } };
                        let x = cg.eval(v, at)?;
                        let x = cg.ir.widen(x, w);
                        cg.write(&dst, at, x, dtype);
                        Ok(())
                    })
                })?;
            }
            Layout::ColMajor => {
                let w = self.vec_width(rows);
                self.for_const(0, cols, 1, &mut |cg, c| {
                    cg.for_const(0, rows, w, &mut |cg, r| {
                        cg.memo.clear();
                        let at = At { r: if w > 1 { Idx::Vc(r, w) } else { Idx::S(r) }, c: Idx::S(c) };
                        let x = cg.eval(v, at)?;
                        let x = cg.ir.widen(x, w);
                        cg.write(&dst, at, x, dtype);
                        Ok(())
                    })
                })?;
            }
            Layout::PairRows | Layout::PairCols => {
                // Interleave two rows (PairRows) or two columns (PairCols) and store
                // them as one contiguous run.
                let pair_rows = dst.layout == Layout::PairRows;
                let (outer, inner) = if pair_rows { (rows, cols) } else { (cols, rows) };
                if outer % 2 != 0 {
                    return Err(self.err(format!("a paired layout needs an even extent, got {outer}")));
                }
                let w = self.vec_width(inner);
                self.for_const(0, outer, 2, &mut |cg, o| {
                    cg.for_const(0, inner, w, &mut |cg, i| {
                        cg.memo.clear();
                        let o1 = cg.ir.add(o, cg.ir.ci64(1));
                        let iv = if w > 1 { Idx::Vc(i, w) } else { Idx::S(i) };
                        let (at0, at1) = if pair_rows {
                            (At { r: Idx::S(o), c: iv }, At { r: Idx::S(o1), c: iv })
                        } else {
                            (At { r: iv, c: Idx::S(o) }, At { r: iv, c: Idx::S(o1) })
                        };
                        let x0 = cg.eval(v, at0)?;
                        cg.memo.clear();
                        let x1 = cg.eval(v, at1)?;
                        let (x0, x1) = (cg.ir.widen(x0, w), cg.ir.widen(x1, w));
                        let (x0, x1) = (cg.convert(x0, dtype, dst.storage), cg.convert(x1, dtype, dst.storage));
                        let st = cg.storage_ty(dst.storage);
                        let p = if pair_rows { cg.elem_ptr(&dst, o, i) } else { cg.elem_ptr(&dst, i, o) };
                        if w == 1 {
                            cg.ir.store(x0, p, dst.storage.size_bytes() as u32);
                            cg.ir.store(x1, cg.ir.gep_const(st, p, 1), dst.storage.size_bytes() as u32);
                        } else {
                            let mask: Vec<usize> = (0..w).flat_map(|l| [l, l + w]).collect();
                            let both = cg.ir.shuffle(x0, x1, &mask);
                            cg.ir.store(both, p, dst.storage.size_bytes() as u32);
                        }
                        Ok(())
                    })
                })?;
            }
        }
        self.memo.clear();
        Ok(())
    }

    // ---------------------------------------------------------------- ops

    fn block(&mut self, b: &'k Block) -> R<()> {
        for op in &b.ops {
            if matches!(op.kind, OpKind::Yield) {
                continue; // handled by the region's owner
            }
            self.op(op)?;
        }
        Ok(())
    }

    /// Whether an element-wise result should be computed once into a buffer rather
    /// than where it is used.
    fn materialise_now(&self, op: &Op) -> bool {
        let trivial = matches!(
            op.kind,
            OpKind::Splat { .. } | OpKind::Arange { .. } | OpKind::ExpandDims { .. } | OpKind::Broadcast { .. }
        );
        !trivial && op.results.iter().any(|r| self.du.use_count(*r) > 1)
    }

    fn op(&mut self, op: &'k Op) -> R<()> {
        let res = |i: usize| op.results[i];
        match &op.kind {
            OpKind::ProgramId { axis } => self.vals[res(0).index()] = Some(Val::Scalar(self.pid[*axis as usize])),
            OpKind::TensorDim { axis } => {
                let Some(Val::Tensor(t)) = self.vals[op.operands[0].index()] else {
                    return Err(self.err("program.dim of a non-tensor".into()));
                };
                let d = self.ir.trunc(self.tensors[t].shape[*axis as usize], self.ir.i32());
                self.vals[res(0).index()] = Some(Val::Scalar(d));
            }
            OpKind::Const { value, dtype } => {
                let ir = &self.ir;
                let v = match dtype {
                    DType::F32 | DType::F64 => ir.cf32(*value),
                    DType::F16 => ir.cfloat(ir.f16(), *value),
                    DType::BF16 => ir.cfloat(ir.bf16(), *value),
                    DType::I32 => ir.ci32(*value as i64),
                    DType::U32 => ir.ci32(*value as i64 as u32 as i32 as i64),
                    DType::I1 => {
                        if *value != 0.0 {
                            ir.ctrue()
                        } else {
                            ir.cfalse()
                        }
                    }
                };
                self.vals[res(0).index()] = Some(Val::Scalar(v));
            }
            OpKind::Load { axes, pad } => self.load(op, axes, *pad)?,
            OpKind::Store { axes, accumulate } => self.store(op, axes, *accumulate)?,
            OpKind::Binary(_) | OpKind::Unary(_) | OpKind::Cmp(_) | OpKind::Select | OpKind::Cast { .. }
                if self.ty(res(0)).is_scalar() =>
            {
                let at = At { r: Idx::Zero, c: Idx::Zero };
                self.vals[res(0).index()] = Some(Val::Lazy);
                let x = self.eval(res(0), at)?;
                self.memo.clear();
                self.vals[res(0).index()] = Some(Val::Scalar(x));
            }
            OpKind::Splat { .. }
            | OpKind::Arange { .. }
            | OpKind::ExpandDims { .. }
            | OpKind::Broadcast { .. }
            | OpKind::Binary(_)
            | OpKind::Unary(_)
            | OpKind::Cmp(_)
            | OpKind::Select
            | OpKind::Cast { .. }
            | OpKind::SoftmaxRescale
            | OpKind::RandUniform { .. } => {
                self.vals[res(0).index()] = Some(Val::Lazy);
                if self.materialise_now(op) {
                    let want = self.wants.get(&res(0)).copied();
                    let b = self.buffer(res(0), want)?;
                    self.vals[res(0).index()] = Some(Val::Buf(b));
                }
            }
            OpKind::Reduce { op: r, axis } => self.reduce(op, *r, *axis)?,
            OpKind::Dot { trans_a, trans_b } => self.dot(op, *trans_a, *trans_b)?,
            OpKind::SoftmaxUpdate => self.softmax_update(op)?,
            OpKind::SoftmaxFinalize => self.softmax_finalize(op)?,
            OpKind::For => self.for_op(op)?,
            OpKind::If => self.if_op(op)?,
            OpKind::Yield => {}
            other @ (OpKind::MaskApply { .. } | OpKind::MaskBlockFull { .. } | OpKind::MaskKvRange { .. }) => {
                return Err(self.err(format!(
                    "`{}` must be lowered first (run the pass pipeline before code generation)",
                    other.name()
                )))
            }
        }
        Ok(())
    }

    // ---- memory ----

    /// Per-axis (index or start, optional limit) as i64 values.
    fn access(&self, axes: &[AxisIndex], operands: &[Value]) -> R<Vec<AxisAccess>> {
        let mut out = Vec::new();
        let mut it = operands.iter();
        for a in axes {
            let first = *it.next().ok_or_else(|| self.err("missing index operand".into()))?;
            let x = self.ir.sext(self.scalar(first)?, self.ir.i64());
            match a {
                AxisIndex::Index => out.push((x, None, None)),
                AxisIndex::Range { size, limit } => {
                    let l = if *limit {
                        let lv = *it.next().ok_or_else(|| self.err("missing limit operand".into()))?;
                        Some(self.ir.sext(self.scalar(lv)?, self.ir.i64()))
                    } else {
                        None
                    };
                    out.push((x, l, Some(*size)));
                }
            }
        }
        Ok(out)
    }

    fn tensor_of(&self, v: Value) -> R<usize> {
        match self.vals[v.index()] {
            Some(Val::Tensor(t)) => Ok(t),
            _ => Err(self.err("memory access to a non-tensor".into())),
        }
    }

    /// i1: `0 <= x < dim` (and `< limit`).
    fn in_range(&self, x: V, dim: V, limit: Option<V>) -> V {
        let ir = &self.ir;
        let n = ir.lanes(x);
        let ok = ir.and(ir.icmp(LLVMIntSGE, x, ir.splat(ir.ci64(0), n)), ir.icmp(LLVMIntSLT, x, ir.splat(dim, n)));
        match limit {
            Some(l) => ir.and(ok, ir.icmp(LLVMIntSLT, x, ir.splat(l, n))),
            None => ok,
        }
    }

    /// The shared structure of tile loads and stores: fixed-axis offset and validity,
    /// and which axes are the tile's rows and columns.
    #[allow(clippy::type_complexity)]
    fn plan_access(&self, t: usize, acc: &[AxisAccess]) -> (V, V, Vec<usize>) {
        let ir = &self.ir;
        let info = &self.tensors[t];
        let mut base = ir.ci64(0);
        let mut valid = ir.ctrue();
        let mut ranges = Vec::new();
        for (a, (x, lim, size)) in acc.iter().enumerate() {
            match size {
                None => {
                    base = ir.add(base, ir.mul(*x, info.strides[a]));
                    valid = ir.and(valid, self.in_range(*x, info.shape[a], *lim));
                }
                Some(_) => ranges.push(a),
            }
        }
        (base, valid, ranges)
    }

    fn load(&mut self, op: &'k Op, axes: &[AxisIndex], pad: f64) -> R<()> {
        let res = op.results[0];
        let dtype = self.ty(res).dtype();
        let t = self.tensor_of(op.operands[0])?;
        let acc = self.access(axes, &op.operands[1..])?;
        let (base, valid, ranges) = self.plan_access(t, &acc);
        let data = self.tensors[t].data;
        let st = self.storage_ty(self.tensors[t].dtype);
        let esize = self.tensors[t].dtype.size_bytes() as u32;
        let pad_v = self.constant_of(pad, dtype);
        if ranges.is_empty() {
            // A scalar: branch-free select between the loaded value and the pad (the
            // load itself is guarded, so nothing out of bounds is read).
            let slot = self.alloc(1, 1, dtype, Layout::RowMajor);
            self.ir.store(self.convert_store(pad_v, dtype), slot.ptr, esize);
            let valid2 = valid;
            self.if_then(
                valid2,
                &mut |cg| {
                    let x = cg.ir.load(st, cg.ir.gep(st, data, base), esize);
                    cg.ir.store(x, slot.ptr, esize);
                    Ok(())
                },
                &mut |_| Ok(()),
            )?;
            let x = self.ir.load(st, slot.ptr, esize);
            let x = self.decode_storage(x, dtype, dtype);
            self.vals[res.index()] = Some(Val::Scalar(x));
            return Ok(());
        }
        let want = self.wants.get(&res).copied().unwrap_or(Want { layout: Layout::RowMajor, storage: dtype });
        let (rows, cols) = self.dims(res);
        if ranges.len() == 2 && dtype != DType::I1 {
            // A view of the tensor (or a padded row-major copy), then, if a consumer
            // wants another layout or storage type, one pass that builds it.
            let staging = self.alloc(rows, cols, dtype, Layout::RowMajor);
            self.load_view(res, &acc, base, valid, (ranges[0], ranges[1]), staging, pad)?;
            if want.layout != Layout::RowMajor || want.storage != dtype {
                let b = self.buffer(res, Some(want))?;
                self.vals[res.index()] = Some(Val::Buf(b));
            }
            return Ok(());
        }
        let dst = self.alloc(rows, cols, want.storage, want.layout);
        // Row axis (when 2-D) and column axis.
        let (ra, ca) = if ranges.len() == 2 { (Some(ranges[0]), ranges[1]) } else { (None, ranges[0]) };
        let info_strides: Vec<V> = self.tensors[t].strides.clone();
        let info_shape: Vec<V> = self.tensors[t].shape.clone();
        let (cstart, climit, _) = acc[ca];
        let cstride = info_strides[ca];
        let cdim = info_shape[ca];
        let w = self.vec_width(cols);
        let mut body = |cg: &mut Self, r: V| -> R<()> {
            let ir = &cg.ir;
            // Row validity and offset.
            let (row_ok, row_off) = match ra {
                Some(ra) => {
                    let (rstart, rlimit, _) = acc[ra];
                    let ri = ir.add(rstart, r);
                    (ir.and(valid, cg.in_range(ri, info_shape[ra], rlimit)), ir.add(base, ir.mul(ri, info_strides[ra])))
                }
                None => (valid, base),
            };
            // Whole row inside the tensor and contiguous: vector copies.
            let cend = ir.add(cstart, ir.ci64(cols as i64));
            let mut full = ir.and(row_ok, ir.icmp(LLVMIntSGE, cstart, ir.ci64(0)));
            full = ir.and(full, ir.icmp(LLVMIntSLE, cend, cdim));
            if let Some(l) = climit {
                full = ir.and(full, ir.icmp(LLVMIntSLE, cend, l));
            }
            let fast = ir.and(full, ir.icmp(LLVMIntEQ, cstride, ir.ci64(1)));
            let r_idx = r;
            cg.if_then(
                fast,
                &mut |cg| {
                    cg.for_const(0, cols, w, &mut |cg, c| {
                        let ir = &cg.ir;
                        let off = ir.add(ir.add(row_off, cstart), c);
                        let p = ir.gep(st, data, off);
                        let x = ir.load(ir.vec(st, w), p, esize);
                        let x = cg.decode_storage(x, dtype, dtype);
                        let at = At { r: Idx::S(r_idx), c: if w > 1 { Idx::Vc(c, w) } else { Idx::S(c) } };
                        cg.write(&dst, at, x, dtype);
                        Ok(())
                    })
                },
                &mut |cg| {
                    // Element by element, with bounds checks and the pad value.
                    cg.for_const(0, cols, 1, &mut |cg, c| {
                        let ir = &cg.ir;
                        let ci = ir.add(cstart, c);
                        let ok = ir.and(row_ok, cg.in_range(ci, cdim, climit));
                        let off = ir.add(row_off, ir.mul(ci, cstride));
                        // Clamp the address to element 0 when out of range: the load
                        // must not touch memory outside the tensor.
                        let safe = ir.select(ok, off, ir.ci64(0));
                        let x = ir.load(st, ir.gep(st, data, safe), esize);
                        let x = cg.decode_storage(x, dtype, dtype);
                        let x = ir.select(ok, x, pad_v);
                        cg.write(&dst, At { r: Idx::S(r_idx), c: Idx::S(c) }, x, dtype);
                        Ok(())
                    })
                },
            )
        };
        self.for_const(0, rows, 1, &mut body)?;
        self.vals[res.index()] = Some(Val::Buf(dst));
        Ok(())
    }

    /// A row-major 2-D tile that is entirely inside its tensor with a unit column
    /// stride is not copied: the tile becomes a view of the tensor (its row stride is
    /// a run-time value). Otherwise it is copied into `dst` with padding. The choice
    /// is made at run time; consumers see one buffer either way.
    #[allow(clippy::too_many_arguments)]
    fn load_view(
        &mut self,
        res: Value,
        acc: &[AxisAccess],
        base: V,
        valid: V,
        (ra, ca): (usize, usize),
        dst: Buf,
        pad: f64,
    ) -> R<()> {
        // `dst` is a row-major staging buffer of the tensor's dtype.
        let dtype = self.ty(res).dtype();
        let t = self.tensor_of(self.du.def(res).expect("a defined value").operands[0])?;
        let (data, shape, strides) =
            (self.tensors[t].data, self.tensors[t].shape.clone(), self.tensors[t].strides.clone());
        let st = self.storage_ty(dtype);
        let esize = dtype.size_bytes() as u32;
        let (rows, cols) = (dst.rows, dst.cols);
        let pad_v = self.constant_of(pad, dtype);
        let ir = &self.ir;
        let (rstart, rlimit, _) = acc[ra];
        let (cstart, climit, _) = acc[ca];
        let inside = |start: V, n: usize, dim: V, limit: Option<V>| {
            let end = ir.add(start, ir.ci64(n as i64));
            let mut ok = ir.and(ir.icmp(LLVMIntSGE, start, ir.ci64(0)), ir.icmp(LLVMIntSLE, end, dim));
            if let Some(l) = limit {
                ok = ir.and(ok, ir.icmp(LLVMIntSLE, end, l));
            }
            ok
        };
        let mut direct = ir.and(valid, inside(rstart, rows, shape[ra], rlimit));
        direct = ir.and(direct, inside(cstart, cols, shape[ca], climit));
        direct = ir.and(direct, ir.icmp(LLVMIntEQ, strides[ca], ir.ci64(1)));
        let origin = ir.add(ir.add(base, ir.mul(rstart, strides[ra])), cstart);
        let view_ptr = ir.gep(st, data, origin);
        let ptr = ir.select(direct, view_ptr, dst.ptr);
        let rstride = ir.select(direct, strides[ra], ir.ci64(cols as i64));
        // Otherwise copy: whole rows with vector moves where they are inside the tensor
        // and contiguous, element by element (with padding) elsewhere.
        let cols_ok = {
            let ok = inside(cstart, cols, shape[ca], climit);
            ir.and(ok, ir.icmp(LLVMIntEQ, strides[ca], ir.ci64(1)))
        };
        self.if_then(direct, &mut |_| Ok(()), &mut |cg| {
            cg.for_const(0, rows, 1, &mut |cg, r| {
                let ir = &cg.ir;
                let ri = ir.add(rstart, r);
                let row_ok = ir.and(valid, cg.in_range(ri, shape[ra], rlimit));
                let row_off = ir.add(base, ir.mul(ri, strides[ra]));
                let fast = ir.and(row_ok, cols_ok);
                cg.if_then(
                    fast,
                    &mut |cg| {
                        let ir = &cg.ir;
                        let src = ir.gep(st, data, ir.add(row_off, cstart));
                        let dst_row = ir.gep(st, dst.ptr, ir.mul(r, ir.ci64(cols as i64)));
                        cg.copy_row(dst_row, src, cols * esize as usize);
                        Ok(())
                    },
                    &mut |cg| {
                        cg.for_const(0, cols, 1, &mut |cg, c| {
                            let ir = &cg.ir;
                            let ci = ir.add(cstart, c);
                            let ok = ir.and(row_ok, cg.in_range(ci, shape[ca], climit));
                            let off = ir.add(row_off, ir.mul(ci, strides[ca]));
                            let safe = ir.select(ok, off, ir.ci64(0));
                            let x = ir.load(st, ir.gep(st, data, safe), esize);
                            let x = ir.select(ok, x, pad_v);
                            let idx = ir.add(ir.mul(r, ir.ci64(cols as i64)), c);
                            ir.store(x, ir.gep(st, dst.ptr, idx), esize);
                            Ok(())
                        })
                    },
                )
            })
        })?;
        self.vals[res.index()] = Some(Val::Buf(Buf { ptr, rstride: Some(rstride), ..dst }));
        Ok(())
    }

    /// Copy `bytes` (a constant) with vector moves of the ISA's width, unrolled;
    /// `llvm.memcpy.inline` becomes `rep movsb` for rows of a few hundred bytes, whose
    /// start-up cost made the copies a quarter of an f32 kernel's time (perf, AVX2).
    fn copy_row(&self, dst: V, src: V, bytes: usize) {
        let ir = &self.ir;
        let width = 4 * self.isa.lanes();
        if !bytes.is_multiple_of(width) || bytes / width > 64 {
            ir.memcpy_inline(dst, src, bytes);
            return;
        }
        let t = ir.vec(ir.i32(), width / 4);
        for i in 0..bytes / width {
            let off = ir.ci64((i * width) as i64);
            let x = ir.load(t, ir.gep(ir.i8(), src, off), 1);
            ir.store(x, ir.gep(ir.i8(), dst, off), 1);
        }
    }

    fn constant_of(&self, x: f64, dtype: DType) -> V {
        let ir = &self.ir;
        match dtype {
            DType::F32 | DType::F64 => ir.cf32(x),
            DType::F16 => ir.cfloat(ir.f16(), x),
            DType::BF16 => ir.cfloat(ir.bf16(), x),
            DType::I32 | DType::U32 => ir.ci32(x as i64),
            DType::I1 => {
                if x != 0.0 {
                    ir.ctrue()
                } else {
                    ir.cfalse()
                }
            }
        }
    }

    fn convert_store(&self, x: V, dtype: DType) -> V {
        if dtype == DType::I1 {
            self.ir.zext(x, self.ir.i8())
        } else {
            x
        }
    }

    fn store(&mut self, op: &'k Op, axes: &[AxisIndex], accumulate: bool) -> R<()> {
        let n_ops = op.operands.len();
        let value = op.operands[n_ops - 1];
        let dtype = self.ty(value).dtype();
        let t = self.tensor_of(op.operands[0])?;
        let acc = self.access(axes, &op.operands[1..n_ops - 1])?;
        let (base, valid, ranges) = self.plan_access(t, &acc);
        let data = self.tensors[t].data;
        let st = self.storage_ty(dtype);
        let esize = dtype.size_bytes() as u32;
        if ranges.is_empty() {
            let x = self.scalar(value)?;
            let xs = self.convert_store(x, dtype);
            self.if_then(
                valid,
                &mut |cg| {
                    cg.ir.store_or_add(xs, cg.ir.gep(st, data, base), esize, accumulate);
                    Ok(())
                },
                &mut |_| Ok(()),
            )?;
            return Ok(());
        }
        let (rows, cols) = self.dims(value);
        let (ra, ca) = if ranges.len() == 2 { (Some(ranges[0]), ranges[1]) } else { (None, ranges[0]) };
        let strides: Vec<V> = self.tensors[t].strides.clone();
        let shape: Vec<V> = self.tensors[t].shape.clone();
        let (cstart, climit, _) = acc[ca];
        let (cstride, cdim) = (strides[ca], shape[ca]);
        let w = self.vec_width(cols);
        self.for_const(0, rows, 1, &mut |cg, r| {
            let ir = &cg.ir;
            let (row_ok, row_off) = match ra {
                Some(ra) => {
                    let (rstart, rlimit, _) = acc[ra];
                    let ri = ir.add(rstart, r);
                    (ir.and(valid, cg.in_range(ri, shape[ra], rlimit)), ir.add(base, ir.mul(ri, strides[ra])))
                }
                None => (valid, base),
            };
            let cend = ir.add(cstart, ir.ci64(cols as i64));
            let mut full = ir.and(row_ok, ir.icmp(LLVMIntSGE, cstart, ir.ci64(0)));
            full = ir.and(full, ir.icmp(LLVMIntSLE, cend, cdim));
            if let Some(l) = climit {
                full = ir.and(full, ir.icmp(LLVMIntSLE, cend, l));
            }
            // Atomic adds go element by element (no vector atomics).
            let fast = ir.and(full, ir.icmp(LLVMIntEQ, cstride, ir.ci64(1)));
            let fast = if accumulate { ir.cfalse() } else { fast };
            cg.if_then(
                fast,
                &mut |cg| {
                    cg.for_const(0, cols, w, &mut |cg, c| {
                        cg.memo.clear();
                        let at = At { r: Idx::S(r), c: if w > 1 { Idx::Vc(c, w) } else { Idx::S(c) } };
                        let x = cg.eval(value, at)?;
                        let ir = &cg.ir;
                        let x = ir.widen(x, w);
                        let x = if dtype == DType::I1 { ir.zext(x, ir.vec(ir.i8(), w)) } else { x };
                        let off = ir.add(ir.add(row_off, cstart), c);
                        ir.store(x, ir.gep(st, data, off), esize);
                        Ok(())
                    })
                },
                &mut |cg| {
                    cg.for_const(0, cols, 1, &mut |cg, c| {
                        cg.memo.clear();
                        let x = cg.eval(value, At { r: Idx::S(r), c: Idx::S(c) })?;
                        let ir = &cg.ir;
                        let ci = ir.add(cstart, c);
                        let ok = ir.and(row_ok, cg.in_range(ci, cdim, climit));
                        let xs = cg.convert_store(x, dtype);
                        let off = ir.add(row_off, ir.mul(ci, cstride));
                        cg.if_then(
                            ok,
                            &mut |cg| {
                                cg.ir.store_or_add(xs, cg.ir.gep(st, data, off), esize, accumulate);
                                Ok(())
                            },
                            &mut |_| Ok(()),
                        )
                    })
                },
            )?;
            cg.memo.clear();
            Ok(())
        })?;
        self.memo.clear();
        Ok(())
    }

    // ---- reductions and softmax ----

    fn reduce(&mut self, op: &'k Op, r: ejc_ir::ir::ReduceOp, axis: u8) -> R<()> {
        use ejc_ir::ir::ReduceOp;
        let input = op.operands[0];
        let dtype = self.ty(input).dtype();
        if !dtype.is_float() && dtype != DType::I32 && dtype != DType::U32 {
            return Err(self.err(format!("reduce on {dtype}")));
        }
        let shape = self.ty(input).shape().to_vec();
        let (rows, cols) = if shape.len() == 2 { (shape[0], shape[1]) } else { (1, shape[0]) };
        // Output: for rank 2, one value per kept index; for rank 1, a scalar.
        let (outer, inner, along_rows) =
            if shape.len() == 2 && axis == 0 { (cols, rows, true) } else { (rows, cols, false) };
        let res = op.results[0];
        let out = if shape.len() == 2 { Some(self.alloc(1, outer, dtype, Layout::RowMajor)) } else { None };
        let slot = self.alloc(1, 1, dtype, Layout::RowMajor);
        let ct = self.compute_ty(dtype);
        self.for_const(0, outer, 1, &mut |cg, o| {
            let init = match (r, dtype.is_float()) {
                (ReduceOp::Sum, true) => cg.ir.cfloat(ct, 0.0),
                (ReduceOp::Max, true) => cg.ir.cfloat(ct, f64::NEG_INFINITY),
                (ReduceOp::Min, true) => cg.ir.cfloat(ct, f64::INFINITY),
                (ReduceOp::Sum, false) => cg.ir.ci32(0),
                (ReduceOp::Max, false) => cg.ir.ci32(if dtype == DType::U32 { 0 } else { i32::MIN as i64 }),
                (ReduceOp::Min, false) => cg.ir.ci32(if dtype == DType::U32 { -1 } else { i32::MAX as i64 }),
            };
            cg.ir.store(init, slot.ptr, 4);
            cg.for_const(0, inner, 1, &mut |cg, i| {
                cg.memo.clear();
                let at = if along_rows { At { r: Idx::S(i), c: Idx::S(o) } } else { At { r: Idx::S(o), c: Idx::S(i) } };
                let x = cg.eval(input, at)?;
                let acc = cg.ir.load(ct, slot.ptr, 4);
                let bop = match r {
                    ReduceOp::Sum => BinOp::Add,
                    ReduceOp::Max => BinOp::Max,
                    ReduceOp::Min => BinOp::Min,
                };
                let nv = cg.binary(bop, dtype, acc, x);
                cg.ir.store(nv, slot.ptr, 4);
                Ok(())
            })?;
            if let Some(out) = out {
                let x = cg.ir.load(ct, slot.ptr, 4);
                cg.write(&out, At { r: Idx::Zero, c: Idx::S(o) }, x, dtype);
            }
            Ok(())
        })?;
        self.memo.clear();
        self.vals[res.index()] = Some(match out {
            Some(b) => Val::Buf(b),
            None => Val::Scalar(self.ir.load(ct, slot.ptr, 4)),
        });
        Ok(())
    }

    fn softmax_update(&mut self, op: &'k Op) -> R<()> {
        let s = self.buffer(
            op.operands[0],
            Some(Want { layout: self.preferred_layout(op.operands[0], 0), storage: DType::F32 }),
        )?;
        let m = self.buffer(op.operands[1], None)?;
        let l = self.buffer(op.operands[2], None)?;
        let m = self.as_f32_row(m, op.operands[1])?;
        let l = self.as_f32_row(l, op.operands[2])?;
        let (rows, cols) = (s.rows, s.cols);
        let layout = if s.layout == Layout::ColMajor || cols == 1 { Layout::ColMajor } else { Layout::RowMajor };
        let p = self.alloc(rows, cols, DType::F32, layout);
        let alpha = self.alloc(1, rows, DType::F32, Layout::RowMajor);
        let m_new = self.alloc(1, rows, DType::F32, Layout::RowMajor);
        let l_new = self.alloc(1, rows, DType::F32, Layout::RowMajor);
        let s_read = Buf { layout, ..s };
        // A scale operand (`ejc_ir::passes::scale_fold`): m_new = max(m, c·rowmax(s)),
        // p = exp2(c·s − m_new).
        let scale = match op.operands.get(3) {
            Some(c) => Some(self.scalar(*c)?),
            None => None,
        };
        // max that ignores NaN like the interpreter (`if x > acc then x`), and maps to
        // a single vmaxps (llvm.maxnum would add NaN fix-ups).
        fn vmax(ir: &Ir, acc: V, x: V) -> V {
            ir.select(ir.fcmp(LLVMRealOGT, x, acc), x, acc)
        }
        // c·x, c splat to x's lanes.
        let scaled = |ir: &Ir, x: V| match scale {
            Some(c) => ir.fmul(ir.widen(c, ir.lanes(x)), x),
            None => x,
        };
        if layout == Layout::ColMajor {
            // Rows in vector lanes: every step is vertical.
            let w = self.vec_width(rows);
            self.for_const(0, rows, w, &mut |cg, r0| {
                let rows_at = |c: V| At { r: if w > 1 { Idx::Vc(r0, w) } else { Idx::S(r0) }, c: Idx::S(c) };
                let row_idx = At { r: Idx::Zero, c: if w > 1 { Idx::Vc(r0, w) } else { Idx::S(r0) } };
                let m_old = cg.read(&m, row_idx, DType::F32);
                let l_old = cg.read(&l, row_idx, DType::F32);
                let ninf = cg.ir.splat(cg.ir.cf32(f64::NEG_INFINITY), w);
                let start = if scale.is_some() { ninf } else { m_old };
                let mx = cg.for_carry(0, cols, 1, vec![start], &mut |cg, c, acc| {
                    let x = cg.read(&s_read, rows_at(c), DType::F32);
                    Ok(vec![vmax(&cg.ir, acc[0], x)])
                })?[0];
                let mx = if scale.is_some() { vmax(&cg.ir, m_old, scaled(&cg.ir, mx)) } else { mx };
                let ir = &cg.ir;
                let ninf = ir.splat(ir.cf32(f64::NEG_INFINITY), w);
                let none = ir.fcmp(LLVMRealOEQ, mx, ninf);
                let msafe = ir.select(none, ir.splat(ir.cf32(0.0), w), mx);
                let a = ir.select(none, ir.splat(ir.cf32(1.0), w), math::exp2(ir, ir.fsub(m_old, msafe)));
                cg.write(&m_new, row_idx, mx, DType::F32);
                cg.write(&alpha, row_idx, a, DType::F32);
                let zero = cg.ir.splat(cg.ir.cf32(0.0), w);
                let sum = cg.for_carry(0, cols, 1, vec![zero], &mut |cg, c, acc| {
                    let x = scaled(&cg.ir, cg.read(&s_read, rows_at(c), DType::F32));
                    let e = math::exp2(&cg.ir, cg.ir.fsub(x, msafe));
                    cg.write(&p, rows_at(c), e, DType::F32);
                    Ok(vec![cg.ir.fadd(acc[0], e)])
                })?[0];
                let ir = &cg.ir;
                let ln = ir.fadd(ir.fmul(l_old, a), sum);
                cg.write(&l_new, row_idx, ln, DType::F32);
                Ok(())
            })?;
        } else {
            // Rows one at a time, columns in lanes, horizontal reductions per row.
            let w = self.vec_width(cols);
            self.for_const(0, rows, 1, &mut |cg, r| {
                let row_idx = At { r: Idx::Zero, c: Idx::S(r) };
                let m_old = cg.read(&m, row_idx, DType::F32);
                let l_old = cg.read(&l, row_idx, DType::F32);
                let at = |c: V| At { r: Idx::S(r), c: if w > 1 { Idx::Vc(c, w) } else { Idx::S(c) } };
                let ninf = cg.ir.splat(cg.ir.cf32(f64::NEG_INFINITY), w);
                let vmaxv = cg.for_carry(0, cols, w, vec![ninf], &mut |cg, c, acc| {
                    let x = cg.read(&s_read, at(c), DType::F32);
                    Ok(vec![vmax(&cg.ir, acc[0], x)])
                })?[0];
                let ir = &cg.ir;
                let mx = vmax(ir, m_old, scaled(ir, ir.reduce_fmax(vmaxv)));
                let none = ir.fcmp(LLVMRealOEQ, mx, ir.cf32(f64::NEG_INFINITY));
                let msafe = ir.select(none, ir.cf32(0.0), mx);
                let a = ir.select(none, ir.cf32(1.0), math::exp2(ir, ir.fsub(m_old, msafe)));
                cg.write(&m_new, row_idx, mx, DType::F32);
                cg.write(&alpha, row_idx, a, DType::F32);
                let zero = cg.ir.splat(cg.ir.cf32(0.0), w);
                let vs = cg.for_carry(0, cols, w, vec![zero], &mut |cg, c, acc| {
                    let x = scaled(&cg.ir, cg.read(&s_read, at(c), DType::F32));
                    let e = math::exp2(&cg.ir, cg.ir.fsub(x, cg.ir.splat(msafe, w)));
                    cg.write(&p, at(c), e, DType::F32);
                    Ok(vec![cg.ir.fadd(acc[0], e)])
                })?[0];
                let ir = &cg.ir;
                let sum = ir.reduce_fadd(ir.cf32(0.0), vs);
                let ln = ir.fadd(ir.fmul(l_old, a), sum);
                cg.write(&l_new, row_idx, ln, DType::F32);
                Ok(())
            })?;
        }
        for (i, b) in [p, alpha, m_new, l_new].into_iter().enumerate() {
            self.vals[op.results[i].index()] = Some(Val::Buf(b));
        }
        Ok(())
    }

    /// A rank-1 f32 buffer view of a rank-1 value.
    fn as_f32_row(&mut self, b: Buf, v: Value) -> R<Buf> {
        if b.storage == DType::F32 && (b.rows == 1 || b.cols == 1) {
            let n = b.rows * b.cols;
            return Ok(Buf { rows: 1, cols: n, layout: Layout::RowMajor, ..b });
        }
        self.buffer(v, Some(Want { layout: Layout::RowMajor, storage: DType::F32 }))
    }

    fn softmax_finalize(&mut self, op: &'k Op) -> R<()> {
        let acc = self.buffer(op.operands[0], Some(Want { layout: Layout::RowMajor, storage: DType::F32 }))?;
        let m = self.buffer(op.operands[1], None)?;
        let l = self.buffer(op.operands[2], None)?;
        let m = self.as_f32_row(m, op.operands[1])?;
        let l = self.as_f32_row(l, op.operands[2])?;
        let (rows, cols) = (acc.rows, acc.cols);
        let o = self.alloc(rows, cols, DType::F32, Layout::RowMajor);
        let lse = self.alloc(1, rows, DType::F32, Layout::RowMajor);
        let w = self.vec_width(cols);
        self.for_const(0, rows, 1, &mut |cg, r| {
            let ir = &cg.ir;
            let row_idx = At { r: Idx::Zero, c: Idx::S(r) };
            let mv = cg.read(&m, row_idx, DType::F32);
            let lv = cg.read(&l, row_idx, DType::F32);
            let empty = ir.fcmp(LLVMRealOEQ, lv, ir.cf32(0.0));
            let lg = math::log2(ir, lv);
            let val = ir.fmul(ir.fadd(mv, lg), ir.cf32(std::f64::consts::LN_2));
            let val = ir.select(empty, ir.cf32(f64::NEG_INFINITY), val);
            cg.write(&lse, row_idx, val, DType::F32);
            let lsafe = ir.select(empty, ir.cf32(1.0), lv);
            cg.for_const(0, cols, w, &mut |cg, c| {
                let at = At { r: Idx::S(r), c: if w > 1 { Idx::Vc(c, w) } else { Idx::S(c) } };
                let x = cg.read(&acc, at, DType::F32);
                let ir = &cg.ir;
                let q = ir.fdiv(x, ir.splat(lsafe, w));
                let q = ir.select(ir.splat(empty, w), ir.splat(ir.cf32(0.0), w), q);
                cg.write(&o, at, q, DType::F32);
                Ok(())
            })
        })?;
        self.vals[op.results[0].index()] = Some(Val::Buf(o));
        self.vals[op.results[1].index()] = Some(Val::Buf(lse));
        Ok(())
    }

    // ---- the matrix multiply ----

    fn dot(&mut self, op: &'k Op, trans_a: bool, trans_b: bool) -> R<()> {
        let (a, b, acc) = (op.operands[0], op.operands[1], op.operands[2]);
        let transposed = self.is_transposed(op);
        let path = self.dot_path(op);
        let pairs = path != DotPath::F32;
        let storage = if pairs { DType::BF16 } else { DType::F32 };
        // This product's own needs: a tile other products read too may have been built
        // for another one's (`plan_dots`), and is then converted here.
        let (want_a, want_b) = Self::operand_wants(transposed, pairs, trans_b);
        let wa = match want_a {
            Some(layout) => Want { layout, storage },
            None => {
                // A-role of a normal product: any layout with K-pairs adjacent works;
                // follow how the operand is produced so that building it is contiguous.
                let pref = self.preferred_layout(a, 0);
                let layout = match (pairs, trans_a, pref) {
                    // AMX loads A's tile rows along K.
                    _ if path == DotPath::Amx => {
                        if trans_a {
                            Layout::ColMajor
                        } else {
                            Layout::RowMajor
                        }
                    }
                    (false, _, p) => p,
                    (true, false, Layout::ColMajor | Layout::PairCols) => Layout::PairCols,
                    (true, false, _) => Layout::RowMajor,
                    (true, true, Layout::RowMajor | Layout::PairRows) => Layout::PairRows,
                    (true, true, _) => Layout::ColMajor,
                };
                Want { layout, storage }
            }
        };
        let wb = Want { layout: want_b, storage };
        let abuf = self.buffer(a, Some(wa))?;
        let bbuf = self.buffer(b, Some(wb))?;
        let (m, n) = self.dims(op.results[0]);
        let k = if trans_a { self.dims(a).0 } else { self.dims(a).1 };
        // The product computed as C'[I, J] += A'(i, k) · B'(k, j):
        // normal: C' = C, A' = op(a), B' = op(b); transposed: C' = Cᵀ, A' = op(b)ᵀ, B' = op(a)ᵀ.
        let (ci, cj) = if transposed { (n, m) } else { (m, n) };
        let out = self.alloc(m, n, DType::F32, if transposed { Layout::ColMajor } else { Layout::RowMajor });
        // Accumulator input.
        let init = self.dot_init(acc, transposed)?;
        // Element access of the roles, as (buffer, swap) where swap says A'(i,k) is
        // buffer(k, i) rather than buffer(i, k).
        let (a_role, a_swap, b_role, b_swap) = if !transposed {
            (abuf, trans_a, bbuf, trans_b)
        } else {
            // A'(i=n, k) = op(b)(k, n) = b(n, k) when trans_b; B'(k, j=m) = op(a)(m, k) = a(m, k).
            (bbuf, !trans_b, abuf, !trans_a)
        };
        if path == DotPath::Amx && Self::amx_layouts((a_role, a_swap), (b_role, b_swap)) {
            self.gemm_amx(&out, ci, cj, k, init, (a_role, a_swap), (b_role, b_swap))?;
        } else {
            // Operand layouts that another consumer fixed first: `vdpbf16ps` reads them.
            self.gemm(&out, ci, cj, k, init, (a_role, a_swap), (b_role, b_swap), pairs)?;
        }
        self.vals[op.results[0].index()] = Some(Val::Buf(out));
        Ok(())
    }

    /// How the dot's accumulator starts: zero, a buffer, or a buffer scaled per row
    /// (`softmax.rescale` fused into the accumulator load).
    fn dot_init(&mut self, acc: Value, transposed: bool) -> R<Init> {
        let def = self.du.def(acc).map(|o| &o.kind);
        // A lazy splat of a scalar constant 0: the product starts from zero.
        if let (Some(op @ ejc_ir::ir::Op { kind: OpKind::Splat { .. }, .. }), Some(Val::Lazy)) =
            (self.du.def(acc), self.vals[acc.index()])
        {
            if matches!(self.vals[op.operands[0].index()], Some(Val::Scalar(_))) && self.du.constant(acc) == Some(0.0) {
                return Ok(Init::Zero);
            }
        }
        let layout = if transposed { Layout::ColMajor } else { Layout::RowMajor };
        if let (Some(OpKind::SoftmaxRescale), Some(Val::Lazy), false) = (def, self.vals[acc.index()], transposed) {
            let op = self.du.def(acc).expect("a defined value");
            let x = self.buffer(op.operands[0], Some(Want { layout, storage: DType::F32 }))?;
            let al = self.buffer(op.operands[1], None)?;
            let al = self.as_f32_row(al, op.operands[1])?;
            return Ok(Init::Scaled(x, al));
        }
        let b = self.buffer(acc, Some(Want { layout, storage: DType::F32 }))?;
        Ok(Init::Buf(b))
    }

    /// C'[I, J] = init + Σ_k A'(i, k) B'(k, j), register-blocked. `out` holds C' in
    /// row-major order of [I, J] (its `layout` field describes C).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &mut self,
        out: &Buf,
        ii: usize,
        jj: usize,
        kk: usize,
        init: Init,
        a: (Buf, bool),
        b: (Buf, bool),
        pairs: bool,
    ) -> R<()> {
        let vl = self.vec_width(jj);
        let regs = self.isa.registers();
        // Register blocking: MR rows x NRV vectors of accumulators, plus NRV B'
        // vectors and one broadcast, within the register file. Wider blocks load less
        // per FMA (MR + NRV loads for MR * NRV FMAs); rows that do not fill a block
        // are done by a smaller one.
        let nrv = [4usize, 2, 1]
            .into_iter()
            .find(|n| vl > 1 && jj.is_multiple_of(n * vl) && (*n <= 2 || regs >= 32))
            .unwrap_or(1);
        let nr = nrv * vl;
        let mr = [8usize, 6, 4, 2, 1].into_iter().find(|mr| mr * nrv + nrv < regs && *mr <= ii.max(1)).unwrap_or(1);
        let main_rows = ii - ii % mr;
        if pairs && (!kk.is_multiple_of(2) || vl != 16) {
            return Err(self.err("bf16 dot needs an even K and 16 lanes".into()));
        }
        let (abuf, a_swap) = a;
        let (bbuf, b_swap) = b;
        let out = *out;
        // Element index of C'(i, j) in `out`'s storage.
        let c_ptr = |cg: &Self, i: V, j: V| -> V {
            let ir = &cg.ir;
            let idx = ir.add(ir.mul(i, ir.ci64(jj as i64)), j);
            ir.gep(ir.f32(), out.ptr, idx)
        };
        let vt = self.ir.vec(self.ir.f32(), vl);
        let mut blocks = vec![(0usize, main_rows, mr)];
        if main_rows < ii {
            blocks.push((main_rows, ii, ii - main_rows));
        }
        for (lo, hi, mr) in blocks {
            self.for_const(lo, hi, mr, &mut |cg, i0| {
                cg.for_const(0, jj, nr, &mut |cg, j0| {
                    // Initial accumulators.
                    let mut accs: Vec<V> = Vec::with_capacity(mr * nrv);
                    for i in 0..mr {
                        for jv in 0..nrv {
                            let ir = &cg.ir;
                            let iv = ir.add(i0, ir.ci64(i as i64));
                            let jv_ = ir.add(j0, ir.ci64((jv * vl) as i64));
                            let x = match &init {
                                Init::Zero => ir.splat(ir.cf32(0.0), vl),
                                Init::Buf(b) => ir.load(vt, cg.elem_ptr_rm(b, iv, jv_, jj), 4),
                                Init::Scaled(b, al) => {
                                    let x = ir.load(vt, cg.elem_ptr_rm(b, iv, jv_, jj), 4);
                                    let s = ir.load(ir.f32(), ir.gep(ir.f32(), al.ptr, iv), 4);
                                    ir.fmul(x, ir.splat(s, vl))
                                }
                            };
                            accs.push(x);
                        }
                    }
                    // The K loop, with the accumulators as phis.
                    let ir = &cg.ir;
                    let pre = ir.current();
                    let head = ir.block("k");
                    let exit = ir.block("k.exit");
                    ir.br(head);
                    ir.at_end(head);
                    let kv = ir.phi(ir.i64());
                    ir.add_incoming(kv, ir.ci64(0), pre);
                    let phis: Vec<V> = accs
                        .iter()
                        .map(|x| {
                            let p = ir.phi(vt);
                            ir.add_incoming(p, *x, pre);
                            p
                        })
                        .collect();
                    let kstep = if pairs { 2 } else { 1 };
                    let mut next = phis.clone();
                    // B' vectors for this k.
                    let mut bv = Vec::with_capacity(nrv);
                    for jv in 0..nrv {
                        let j = ir.add(j0, ir.ci64((jv * vl) as i64));
                        let (r, c) = if b_swap { (j, kv) } else { (kv, j) };
                        let p = cg.elem_ptr(&bbuf, r, c);
                        if pairs {
                            bv.push(ir.load(ir.vec(ir.bf16(), 2 * vl), p, 2));
                        } else {
                            bv.push(ir.load(vt, p, 4));
                        }
                    }
                    for i in 0..mr {
                        let iv = ir.add(i0, ir.ci64(i as i64));
                        let (r, c) = if a_swap { (kv, iv) } else { (iv, kv) };
                        let p = cg.elem_ptr(&abuf, r, c);
                        let av = if pairs {
                            let pair = ir.load(ir.i32(), p, 4);
                            ir.bitcast(ir.splat(pair, vl), ir.vec(ir.bf16(), 2 * vl))
                        } else {
                            ir.splat(ir.load(ir.f32(), p, 4), vl)
                        };
                        for (jv, b) in bv.iter().enumerate() {
                            let slot = i * nrv + jv;
                            next[slot] = if pairs {
                                ir.call_intrinsic("llvm.x86.avx512bf16.dpbf16ps.512", &[], &[next[slot], av, *b])
                            } else {
                                ir.fma(av, *b, next[slot])
                            };
                        }
                    }
                    let kn = ir.add(kv, ir.ci64(kstep));
                    let latch = ir.current();
                    ir.add_incoming(kv, kn, latch);
                    for (p, x) in phis.iter().zip(&next) {
                        ir.add_incoming(*p, *x, latch);
                    }
                    ir.cond_br(ir.icmp(LLVMIntSLT, kn, ir.ci64(kk as i64)), head, exit);
                    ir.at_end(exit);
                    // Store.
                    for i in 0..mr {
                        for jv in 0..nrv {
                            let ir = &cg.ir;
                            let iv = ir.add(i0, ir.ci64(i as i64));
                            let j = ir.add(j0, ir.ci64((jv * vl) as i64));
                            ir.store(next[i * nrv + jv], c_ptr(cg, iv, j), 4);
                        }
                    }
                    Ok(())
                })
            })?;
        }
        Ok(())
    }

    /// Whether A' and B' are stored as AMX tiles read them: A' rows contiguous along K
    /// (bf16), B' in K-pairs along its rows (the VNNI layout, bf16).
    fn amx_layouts(a: (Buf, bool), b: (Buf, bool)) -> bool {
        let ((abuf, a_swap), (bbuf, b_swap)) = (a, b);
        let a_ok = match (a_swap, abuf.layout) {
            (false, Layout::RowMajor) => true,
            (true, Layout::ColMajor) => abuf.rstride.is_none(),
            _ => false,
        };
        let b_ok = matches!((b_swap, bbuf.layout), (false, Layout::PairRows) | (true, Layout::PairCols));
        a_ok && b_ok && abuf.storage == DType::BF16 && bbuf.storage == DType::BF16 && bbuf.rstride.is_none()
    }

    /// C'[I, J] = init + Σ_k A'(i, k) B'(k, j) on AMX tiles: 16 × 16 f32 accumulator
    /// tiles, up to 2 × 2 of them (with two A' and two B' tiles, the eight tile
    /// registers), K in steps of 32 (`tdpbf16ps`: a 16 × 32 bf16 A' tile times a
    /// 16 × (16 pairs) B' tile). Sizes are whole tiles (`dot_path`). LLVM writes the tile
    /// configuration (`ldtilecfg`) at the function's entry and releases the tiles on
    /// return.
    #[allow(clippy::too_many_arguments)]
    fn gemm_amx(
        &mut self,
        out: &Buf,
        ii: usize,
        jj: usize,
        kk: usize,
        init: Init,
        a: (Buf, bool),
        b: (Buf, bool),
    ) -> R<()> {
        let (abuf, a_swap) = a;
        let (bbuf, b_swap) = b;
        let out = *out;
        let (t, k) = (AMX_ROWS, AMX_K);
        // The accumulator's start, written into `out` (the C tiles load from it).
        let zero = matches!(init, Init::Zero);
        match &init {
            Init::Zero => {}
            Init::Buf(src) | Init::Scaled(src, _) => {
                let (src, scale) = match &init {
                    Init::Scaled(_, al) => (*src, Some(*al)),
                    _ => (*src, None),
                };
                let vt = self.ir.vec(self.ir.f32(), 16);
                self.for_const(0, ii, 1, &mut |cg, i| {
                    let ir = &cg.ir;
                    let s = scale.map(|al| ir.splat(ir.load(ir.f32(), ir.gep(ir.f32(), al.ptr, i), 4), 16));
                    for j in (0..jj).step_by(16) {
                        let j = ir.ci64(j as i64);
                        let x = ir.load(vt, cg.elem_ptr_rm(&src, i, j, jj), 4);
                        let x = match s {
                            Some(s) => ir.fmul(x, s),
                            None => x,
                        };
                        let at = ir.add(ir.mul(i, ir.ci64(jj as i64)), j);
                        ir.store(x, ir.gep(ir.f32(), out.ptr, at), 4);
                    }
                    Ok(())
                })?;
            }
        }
        let mt = if ii.is_multiple_of(2 * t) { 2 } else { 1 };
        let nt = if jj.is_multiple_of(2 * t) { 2 } else { 1 };
        // Row strides in bytes: A' rows hold K (bf16); B' rows hold K-pairs (2 bf16 per column).
        let a_stride = if a_swap {
            self.ir.ci64(2 * abuf.rows as i64)
        } else {
            let ir = &self.ir;
            match abuf.rstride {
                Some(r) => ir.mul(r, ir.ci64(2)),
                None => ir.ci64(2 * abuf.cols as i64),
            }
        };
        let b_stride = self.ir.ci64(4 * if b_swap { bbuf.rows } else { bbuf.cols } as i64);
        let c_stride = self.ir.ci64(4 * jj as i64);
        let (rows, colsb) = (self.ir.cint(self.ir.i16(), t as i64), self.ir.cint(self.ir.i16(), 64));
        self.for_const(0, ii, mt * t, &mut |cg, i0| {
            cg.for_const(0, jj, nt * t, &mut |cg, j0| {
                let ir = &cg.ir;
                let c_at = |x: usize, y: usize| {
                    let i = ir.add(i0, ir.ci64((x * t) as i64));
                    let j = ir.add(j0, ir.ci64((y * t) as i64));
                    ir.gep(ir.f32(), out.ptr, ir.add(ir.mul(i, ir.ci64(jj as i64)), j))
                };
                let mut c = Vec::with_capacity(mt * nt);
                for x in 0..mt {
                    for y in 0..nt {
                        c.push(if zero {
                            ir.call_intrinsic("llvm.x86.tilezero.internal", &[], &[rows, colsb])
                        } else {
                            ir.call_intrinsic(
                                "llvm.x86.tileloadd64.internal",
                                &[],
                                &[rows, colsb, c_at(x, y), c_stride],
                            )
                        });
                    }
                }
                for k0 in (0..kk).step_by(k) {
                    let kv = ir.ci64(k0 as i64);
                    let at: Vec<V> = (0..mt)
                        .map(|x| {
                            let i = ir.add(i0, ir.ci64((x * t) as i64));
                            let (r, cc) = if a_swap { (kv, i) } else { (i, kv) };
                            let p = cg.elem_ptr(&abuf, r, cc);
                            ir.call_intrinsic("llvm.x86.tileloadd64.internal", &[], &[rows, colsb, p, a_stride])
                        })
                        .collect();
                    let bt: Vec<V> = (0..nt)
                        .map(|y| {
                            let j = ir.add(j0, ir.ci64((y * t) as i64));
                            let (r, cc) = if b_swap { (j, kv) } else { (kv, j) };
                            let p = cg.elem_ptr(&bbuf, r, cc);
                            ir.call_intrinsic("llvm.x86.tileloadd64.internal", &[], &[rows, colsb, p, b_stride])
                        })
                        .collect();
                    for x in 0..mt {
                        for y in 0..nt {
                            let acc = c[x * nt + y];
                            c[x * nt + y] = ir.call_intrinsic(
                                "llvm.x86.tdpbf16ps.internal",
                                &[],
                                &[rows, colsb, colsb, acc, at[x], bt[y]],
                            );
                        }
                    }
                }
                for x in 0..mt {
                    for y in 0..nt {
                        ir.call_intrinsic(
                            "llvm.x86.tilestored64.internal",
                            &[],
                            &[rows, colsb, c_at(x, y), c_stride, c[x * nt + y]],
                        );
                    }
                }
                Ok(())
            })
        })
    }

    /// Pointer to C'(i, j) of an init buffer whose layout matches C' row-major.
    fn elem_ptr_rm(&self, b: &Buf, i: V, j: V, jj: usize) -> V {
        let ir = &self.ir;
        let stride = b.rstride.unwrap_or(ir.ci64(jj as i64));
        ir.gep(ir.f32(), b.ptr, ir.add(ir.mul(i, stride), j))
    }

    // ---- control flow ----

    fn for_op(&mut self, op: &'k Op) -> R<()> {
        let lo = self.scalar(op.operands[0])?;
        let hi = self.scalar(op.operands[1])?;
        let step = self.scalar(op.operands[2])?;
        let body = &op.regions[0];
        let inits = &op.operands[3..];
        // Carried tiles live in buffers owned by the loop.
        let mut carried_bufs: Vec<Option<Buf>> = Vec::new();
        for (i, init) in inits.iter().enumerate() {
            if self.ty(*init).is_tile() {
                let arg = body.args[i + 1];
                let layout = self.preferred_layout(*init, 0);
                let (rows, cols) = self.dims(*init);
                let dtype = self.ty(*init).dtype();
                let buf = self.alloc(rows, cols, dtype, layout);
                self.fill(&buf, *init)?;
                carried_bufs.push(Some(buf));
                self.vals[arg.index()] = Some(Val::Buf(buf));
            } else {
                carried_bufs.push(None);
            }
        }
        let ir = &self.ir;
        let pre = ir.current();
        let head = ir.block("for");
        let bodyb = ir.block("for.body");
        let exit = ir.block("for.exit");
        ir.br(head);
        ir.at_end(head);
        let iv = ir.phi(ir.i32());
        ir.add_incoming(iv, lo, pre);
        let mut phis = Vec::new();
        for (i, init) in inits.iter().enumerate() {
            if carried_bufs[i].is_none() {
                let x = self.scalar(*init)?;
                let p = self.ir.phi(self.ir.type_of(x));
                self.ir.add_incoming(p, x, pre);
                self.vals[body.args[i + 1].index()] = Some(Val::Scalar(p));
                phis.push(Some(p));
            } else {
                phis.push(None);
            }
        }
        let ir = &self.ir;
        ir.cond_br(ir.icmp(LLVMIntSLT, iv, hi), bodyb, exit);
        ir.at_end(bodyb);
        self.vals[body.args[0].index()] = Some(Val::Scalar(iv));
        self.block(body)?;
        // The yield: compute every yielded tile into a temporary first (a yielded
        // expression may read a carried buffer), then copy.
        let y = body.ops.last().ok_or_else(|| self.err("loop body without yield".into()))?;
        let mut temps = Vec::new();
        for (i, v) in y.operands.iter().enumerate() {
            if let Some(dst) = carried_bufs[i] {
                let fresh = match self.vals[v.index()] {
                    Some(Val::Buf(b)) => {
                        !carried_bufs.iter().flatten().any(|c| c.ptr == b.ptr)
                            && b.layout == dst.layout
                            && b.storage == dst.storage
                    }
                    _ => false,
                };
                if fresh {
                    temps.push(Some((self.buffer(*v, None)?, dst)));
                } else {
                    let t = self.alloc(dst.rows, dst.cols, dst.storage, dst.layout);
                    self.fill(&t, *v)?;
                    temps.push(Some((t, dst)));
                }
            } else {
                temps.push(None);
            }
        }
        for (src, dst) in temps.iter().flatten() {
            self.copy(src, dst);
        }
        let latch = self.ir.current();
        for (i, v) in y.operands.iter().enumerate() {
            if let Some(p) = phis[i] {
                let x = self.scalar(*v)?;
                self.ir.add_incoming(p, x, latch);
            }
        }
        let next = self.ir.add(iv, step);
        self.ir.add_incoming(iv, next, latch);
        self.ir.br(head);
        self.ir.at_end(exit);
        for (i, r) in op.results.iter().enumerate() {
            self.vals[r.index()] = Some(match (carried_bufs[i], phis[i]) {
                (Some(b), _) => Val::Buf(b),
                (None, Some(p)) => Val::Scalar(p),
                _ => unreachable!("each carried value is a tile or a scalar"),
            });
        }
        Ok(())
    }

    /// Copy a buffer into another of the same shape, layout and storage.
    fn copy(&mut self, src: &Buf, dst: &Buf) {
        let n = src.rows * src.cols;
        let es = src.storage.size_bytes();
        let bytes = n * es;
        let vl = 16usize;
        let ir = &self.ir;
        if bytes.is_multiple_of(64) {
            let t = ir.vec(ir.i32(), vl);
            let (s, d) = (src.ptr, dst.ptr);
            let _ = self.for_const(0, bytes / 64, 1, &mut |cg, i| {
                let ir = &cg.ir;
                let x = ir.load(t, ir.gep(t, s, i), 4);
                ir.store(x, ir.gep(t, d, i), 4);
                Ok(())
            });
        } else {
            let (s, d) = (src.ptr, dst.ptr);
            let _ = self.for_const(0, bytes, 1, &mut |cg, i| {
                let ir = &cg.ir;
                let x = ir.load(ir.i8(), ir.gep(ir.i8(), s, i), 1);
                ir.store(x, ir.gep(ir.i8(), d, i), 1);
                Ok(())
            });
        }
    }

    fn if_op(&mut self, op: &'k Op) -> R<()> {
        let cond = self.scalar(op.operands[0])?;
        // Result buffers for tiles; scalars through phis.
        let mut bufs: Vec<Option<Buf>> = Vec::new();
        for r in &op.results {
            if self.ty(*r).is_tile() {
                let layout = self.preferred_layout(*r, 0);
                let (rows, cols) = self.dims(*r);
                bufs.push(Some(self.alloc(rows, cols, self.ty(*r).dtype(), layout)));
            } else {
                bufs.push(None);
            }
        }
        let ir = &self.ir;
        let t = ir.block("if.then");
        let e = ir.block("if.else");
        let m = ir.block("if.merge");
        ir.cond_br(cond, t, e);
        let mut incoming: Vec<Vec<(V, B)>> = vec![Vec::new(); op.results.len()];
        for (region, bb) in op.regions.iter().zip([t, e]) {
            self.ir.at_end(bb);
            self.block(region)?;
            let y = region.ops.last().ok_or_else(|| self.err("if region without yield".into()))?;
            for (i, v) in y.operands.iter().enumerate() {
                match bufs[i] {
                    Some(dst) => self.fill(&dst, *v)?,
                    None => {
                        let x = self.scalar(*v)?;
                        incoming[i].push((x, self.ir.current()));
                    }
                }
            }
            self.ir.br(m);
        }
        self.ir.at_end(m);
        for (i, r) in op.results.iter().enumerate() {
            self.vals[r.index()] = Some(match bufs[i] {
                Some(b) => Val::Buf(b),
                None => {
                    let ty = self.ir.type_of(incoming[i][0].0);
                    let p = self.ir.phi(ty);
                    for (x, bb) in &incoming[i] {
                        self.ir.add_incoming(p, *x, *bb);
                    }
                    Val::Scalar(p)
                }
            });
        }
        Ok(())
    }
}

/// Transpose 16 vectors of 16 lanes: `out[i]` lane `k` = `xs[k]` lane `i`. Four stages;
/// stage `b` swaps bit `b` of the vector index with bit `b` of the lane index, one
/// two-input shuffle per vector (64 in all).
fn transpose16(ir: &Ir, mut xs: Vec<V>) -> Vec<V> {
    for b in 0..4 {
        let bit = 1usize << b;
        let lo: Vec<usize> = (0..16).map(|i| if i & bit == 0 { i } else { 16 + (i ^ bit) }).collect();
        let hi: Vec<usize> = (0..16).map(|i| if i & bit == 0 { i | bit } else { 16 + i }).collect();
        let mut next = xs.clone();
        for k in (0..16).filter(|k| k & bit == 0) {
            next[k] = ir.shuffle(xs[k], xs[k | bit], &lo);
            next[k | bit] = ir.shuffle(xs[k], xs[k | bit], &hi);
        }
        xs = next;
    }
    xs
}

/// Rows (and f32 columns) of an AMX accumulator tile.
const AMX_ROWS: usize = 16;
/// K consumed by one `tdpbf16ps` (16 pairs of bf16).
const AMX_K: usize = 32;

/// How a dot's products run (`Lowering::dot_path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DotPath {
    /// f32 FMAs (bf16/f16 inputs widened exactly).
    F32,
    /// `vdpbf16ps` on bf16 pairs.
    Pairs,
    /// AMX tiles (`tdpbf16ps`).
    Amx,
}

/// The accumulator input of a dot.
enum Init {
    Zero,
    Buf(Buf),
    Scaled(Buf, Buf),
}
