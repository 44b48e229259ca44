//! Tile IR → upstream MLIR (`func`/`gpu`, `scf`, `arith`, `math`, `vector`, `memref`),
//! built operation by operation with melior.
//!
//! The translation keeps the tile program's structure: every `scf.for` / `scf.if` of the
//! tile IR becomes an `scf.for` / `scf.if`, scalars stay SSA values, and every tile lives
//! in a buffer (`memref<R x C x T>`, a view of the kernel's scratch memory) that the op
//! producing it fills **row by row with 1-D vectors** (`vector<C x T>`): element-wise ops
//! are `arith`/`math` ops on row vectors, reductions are `vector.reduction`, products are
//! `vector.fma` outer-product updates, the online-softmax ops are row loops.
//!
//! The two forms differ only in who runs the row loops:
//! - **cpu**: a `func.func` that runs programs `begin..end` of the grid; each row loop is
//!   sequential, and LLVM turns each row vector into SIMD code.
//! - **gpu**: a `gpu.func` kernel, one program per block: each row loop is spread over the
//!   block's threads (row `r` on thread `r mod T`) and ends in a `gpu.barrier`; rank-1
//!   tiles are written by thread 0. Buffers live in global memory (one scratch slice per
//!   block), so this form is a correct, portable lowering, not a fast one.
//!
//! Conventions: scalar SSA values are in *compute form* (f32 for bf16/f16/f32, i32 for
//! i32/u32, i1 for i1); buffers hold *storage form* (bf16/f16 stay 16-bit, i1 is one byte
//! holding 0 or 1).

use std::collections::HashMap;

use ejc_ir::ir::{AxisIndex, BinOp, Block as IrBlock, CmpPred, Kernel, Op, OpKind, ReduceOp, UnOp, Value as IrValue};
use ejc_ir::types::{DType, Type as IrType};
use melior::ir::block::BlockLike;
use melior::ir::operation::{OperationBuilder, OperationLike, OperationMutLike};
use melior::ir::{Attribute, Block, Identifier, Location, Module, Region, RegionLike, Type, Value, ValueLike};
use melior::Context;
use mlir_sys::MlirValue;

use super::{Form, MlirError};

/// The static size given to memrefs that stand for raw pointers in the GPU form: the
/// bare-pointer calling convention accepts only static shapes, and the size is never
/// used for addressing or checks.
pub const GPU_PTR_EXTENT: u64 = 1 << 40;

/// Bytes every scratch buffer is aligned to.
const ALIGN: usize = 64;

type V = MlirValue;
type R<T> = Result<T, MlirError>;

/// What the translation produced besides the module.
#[derive(Clone, Debug)]
pub struct Translation {
    /// The entry function's symbol.
    pub entry: String,
    /// Scratch bytes per program (gpu: per block) the caller provides.
    pub scratch_bytes: usize,
}

/// A tile's buffer: the memref value and the buffer's own shape (which differs from the
/// tile's logical shape when `tile.expand_dims` made an alias).
#[derive(Clone, Debug)]
struct Buf {
    mem: V,
    shape: Vec<usize>,
    dtype: DType,
}

struct TensorArg {
    mem: V,
    /// i64 extents and strides.
    ext: Vec<V>,
    strides: Vec<V>,
    dtype: DType,
}

/// Compute-form element type.
fn cty(d: DType) -> &'static str {
    match d {
        DType::F16 | DType::BF16 | DType::F32 => "f32",
        DType::F64 => "f64",
        DType::I32 | DType::U32 => "i32",
        DType::I1 => "i1",
    }
}

/// Storage-form element type.
fn sty(d: DType) -> &'static str {
    match d {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I1 => "i8",
        other => cty(other),
    }
}

/// `T` or `vector<W x T>`.
fn vt(elem: &str, width: Option<usize>) -> String {
    match width {
        Some(w) => format!("vector<{w}x{elem}>"),
        None => elem.to_string(),
    }
}

fn memref_ty(shape: &[usize], elem: &str) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("memref<{}x{elem}>", dims.join("x"))
}

/// Hex bit pattern of a float constant in compute form, exact.
fn float_attr(x: f64, elem: &str) -> String {
    match elem {
        "f64" => format!("{:#018x} : f64", x.to_bits()),
        _ => format!("{:#010x} : f32", (x as f32).to_bits()),
    }
}

pub(crate) struct Emitter<'c, 'k> {
    ctx: &'c Context,
    loc: Location<'c>,
    k: &'k Kernel,
    form: Form,
    scalars: HashMap<IrValue, V>,
    tiles: HashMap<IrValue, Buf>,
    tensors: HashMap<IrValue, TensorArg>,
    /// Next free scratch byte.
    next: usize,
    /// The scratch memref and the byte offset of this program's slice (index).
    scratch: Option<V>,
    base: Option<V>,
    pid: [Option<V>; 3],
    tid: Option<V>,
}

impl<'c, 'k> Emitter<'c, 'k> {
    fn new(ctx: &'c Context, k: &'k Kernel, form: Form) -> Self {
        let loc = Location::new(ctx, &k.name, 0, 0);
        Emitter {
            ctx,
            loc,
            k,
            form,
            scalars: HashMap::new(),
            tiles: HashMap::new(),
            tensors: HashMap::new(),
            next: 0,
            scratch: None,
            base: None,
            pid: [None; 3],
            tid: None,
        }
    }

    fn err(&self, message: impl Into<String>) -> MlirError {
        MlirError::Translate { kernel: self.k.name.clone(), message: message.into() }
    }

    fn ty(&self, s: &str) -> R<Type<'c>> {
        Type::parse(self.ctx, s).ok_or_else(|| self.err(format!("MLIR does not parse the type `{s}`")))
    }

    fn attr(&self, s: &str) -> R<Attribute<'c>> {
        Attribute::parse(self.ctx, s).ok_or_else(|| self.err(format!("MLIR does not parse the attribute `{s}`")))
    }

    /// Append one operation to `blk` and return its results.
    fn op(
        &self,
        blk: &Block<'c>,
        name: &str,
        operands: &[V],
        results: &[&str],
        attrs: &[(&str, &str)],
        regions: Vec<Region<'c>>,
    ) -> R<Vec<V>> {
        let ops: Vec<Value> = operands.iter().map(|r| unsafe { Value::from_raw(*r) }).collect();
        let tys: Vec<Type> = results.iter().map(|t| self.ty(t)).collect::<R<_>>()?;
        let mut named = Vec::new();
        for (k, v) in attrs {
            named.push((Identifier::new(self.ctx, k), self.attr(v)?));
        }
        let op = OperationBuilder::new(name, self.loc)
            .add_operands(&ops)
            .add_results(&tys)
            .add_attributes(&named)
            .add_regions_vec(regions)
            .build()
            .map_err(|e| self.err(format!("building `{name}`: {e}")))?;
        let op = blk.append_operation(op);
        (0..op.result_count())
            .map(|i| op.result(i).map(|r| r.to_raw()))
            .collect::<Result<_, _>>()
            .map_err(|e| self.err(format!("`{name}`: {e}")))
    }

    fn op1(&self, blk: &Block<'c>, name: &str, operands: &[V], result: &str, attrs: &[(&str, &str)]) -> R<V> {
        Ok(self.op(blk, name, operands, &[result], attrs, vec![])?[0])
    }

    fn constant(&self, blk: &Block<'c>, ty: &str, attr: &str) -> R<V> {
        self.op1(blk, "arith.constant", &[], ty, &[("value", attr)])
    }

    fn idx(&self, blk: &Block<'c>, n: i64) -> R<V> {
        self.constant(blk, "index", &format!("{n} : index"))
    }

    fn i32c(&self, blk: &Block<'c>, n: i64) -> R<V> {
        self.constant(blk, "i32", &format!("{} : i32", n as i32))
    }

    /// A compute-form constant of dtype `d`, splat to `width` lanes.
    fn const_of(&self, blk: &Block<'c>, d: DType, x: f64, width: Option<usize>) -> R<V> {
        let e = cty(d);
        let scalar = match e {
            "f32" | "f64" => float_attr(x, e),
            "i1" => (if x != 0.0 { "true" } else { "false" }).to_string(),
            _ => format!("{} : i32", x as i64 as i32),
        };
        match width {
            None => self.constant(blk, e, &scalar),
            Some(w) => {
                let t = vt(e, Some(w));
                let body = scalar.split(" : ").next().unwrap_or("0").to_string();
                self.constant(blk, &t, &format!("dense<{body}> : {t}"))
            }
        }
    }

    fn to_index(&self, blk: &Block<'c>, v: V, from: &str) -> R<V> {
        if from == "i32" {
            let w = self.op1(blk, "arith.extsi", &[v], "i64", &[])?;
            self.op1(blk, "arith.index_cast", &[w], "index", &[])
        } else {
            self.op1(blk, "arith.index_cast", &[v], "index", &[])
        }
    }

    // ---- scratch buffers ----

    fn alloc(&mut self, blk: &Block<'c>, shape: &[usize], dtype: DType) -> R<Buf> {
        let bytes = shape.iter().product::<usize>().max(1) * dtype.size_bytes();
        let off = self.next.div_ceil(ALIGN) * ALIGN;
        self.next = off + bytes;
        let scratch = self.scratch.ok_or_else(|| self.err("scratch used before the prologue"))?;
        let base = self.base.ok_or_else(|| self.err("scratch used before the prologue"))?;
        let o = self.idx(blk, off as i64)?;
        let at = self.op1(blk, "arith.addi", &[base, o], "index", &[])?;
        let mem = self.op1(blk, "memref.view", &[scratch, at], &memref_ty(shape, sty(dtype)), &[])?;
        Ok(Buf { mem, shape: shape.to_vec(), dtype })
    }

    fn alloc_value(&mut self, blk: &Block<'c>, v: IrValue) -> R<Buf> {
        let (d, shape) = match self.k.ty(v) {
            IrType::Tile(d, s) => (*d, s.clone()),
            other => return Err(self.err(format!("value #{} is a {other}, not a tile", v.0))),
        };
        let b = self.alloc(blk, &shape, d)?;
        self.tiles.insert(v, b.clone());
        Ok(b)
    }

    fn scalar(&self, v: IrValue) -> R<V> {
        self.scalars.get(&v).copied().ok_or_else(|| self.err(format!("scalar #{} has no MLIR value", v.0)))
    }

    fn scalars_of(&self, vs: &[IrValue]) -> R<Vec<V>> {
        vs.iter().map(|v| self.scalar(*v)).collect()
    }

    fn tile(&self, v: IrValue) -> R<Buf> {
        self.tiles.get(&v).cloned().ok_or_else(|| self.err(format!("tile #{} has no buffer", v.0)))
    }

    fn tensor(&self, v: IrValue) -> R<&TensorArg> {
        self.tensors.get(&v).ok_or_else(|| self.err(format!("value #{} is not a tensor parameter", v.0)))
    }

    /// Buffer indices of logical element (rr, cc) of a tile of logical shape `logical`.
    fn buf_index(&self, blk: &Block<'c>, b: &Buf, logical: &[usize], rr: V, cc: V) -> R<Vec<V>> {
        if b.shape.len() == 2 || (b.shape.len() == 1 && logical.len() == 1) {
            return Ok(if b.shape.len() == 2 { vec![rr, cc] } else { vec![cc] });
        }
        // A rank-1 buffer seen as [1, C] or [C, 1]: the linear index.
        let cols = self.idx(blk, logical[1] as i64)?;
        let m = self.op1(blk, "arith.muli", &[rr, cols], "index", &[])?;
        Ok(vec![self.op1(blk, "arith.addi", &[m, cc], "index", &[])?])
    }

    /// Storage → compute form.
    fn to_compute(&self, blk: &Block<'c>, v: V, d: DType, width: Option<usize>) -> R<V> {
        match d {
            DType::F16 | DType::BF16 => self.op1(blk, "arith.extf", &[v], &vt("f32", width), &[]),
            DType::I1 => self.op1(blk, "arith.trunci", &[v], &vt("i1", width), &[]),
            _ => Ok(v),
        }
    }

    /// Compute → storage form.
    fn to_storage(&self, blk: &Block<'c>, v: V, d: DType, width: Option<usize>) -> R<V> {
        match d {
            DType::F16 | DType::BF16 => self.op1(blk, "arith.truncf", &[v], &vt(sty(d), width), &[]),
            DType::I1 => self.op1(blk, "arith.extui", &[v], &vt("i8", width), &[]),
            _ => Ok(v),
        }
    }

    /// One element of tile `v` (logical indices rr, cc; rank-1 tiles use cc), compute form.
    fn read_elem(&self, blk: &Block<'c>, v: IrValue, rr: V, cc: V) -> R<V> {
        let b = self.tile(v)?;
        let logical = self.k.ty(v).shape().to_vec();
        let ix = self.buf_index(blk, &b, &logical, rr, cc)?;
        let mut ops = vec![b.mem];
        ops.extend(ix);
        let x = self.op1(blk, "memref.load", &ops, sty(b.dtype), &[])?;
        self.to_compute(blk, x, b.dtype, None)
    }

    /// Row `r` of `v` broadcast to `width` lanes, compute form: scalars are splat, size-1
    /// axes broadcast.
    fn read_row(&self, blk: &Block<'c>, v: IrValue, r: V, width: usize) -> R<V> {
        let t = self.k.ty(v).clone();
        let d = t.dtype();
        match &t {
            IrType::Scalar(_) => {
                let s = self.scalar(v)?;
                self.op1(blk, "vector.broadcast", &[s], &vt(cty(d), Some(width)), &[])
            }
            IrType::Tile(_, shape) => {
                let zero = self.idx(blk, 0)?;
                let (rows, cols) = if shape.len() == 2 { (shape[0], shape[1]) } else { (1, shape[0]) };
                let rr = if rows == 1 { zero } else { r };
                if cols == 1 && width != 1 {
                    let x = self.read_elem(blk, v, rr, zero)?;
                    return self.op1(blk, "vector.broadcast", &[x], &vt(cty(d), Some(width)), &[]);
                }
                if cols != width {
                    return Err(self.err(format!("a row of {t} does not broadcast to {width} lanes")));
                }
                let b = self.tile(v)?;
                let ix = self.buf_index(blk, &b, shape, rr, zero)?;
                let mut ops = vec![b.mem];
                ops.extend(ix);
                let x = self.op1(blk, "vector.load", &ops, &vt(sty(d), Some(width)), &[])?;
                self.to_compute(blk, x, d, Some(width))
            }
            IrType::Tensor(..) => Err(self.err("a tensor is not a tile")),
        }
    }

    /// Store a compute-form row vector as row `r` of buffer `b` (rank-1 buffers: r = 0).
    fn write_row(&self, blk: &Block<'c>, b: &Buf, r: V, x: V) -> R<()> {
        let width = *b.shape.last().unwrap_or(&1);
        let s = self.to_storage(blk, x, b.dtype, Some(width))?;
        let zero = self.idx(blk, 0)?;
        let mut ops = vec![s, b.mem];
        if b.shape.len() == 2 {
            ops.extend([r, zero]);
        } else {
            ops.push(zero);
        }
        self.op(blk, "vector.store", &ops, &[], &[], vec![])?;
        Ok(())
    }

    fn write_elem(&self, blk: &Block<'c>, b: &Buf, ix: &[V], x: V) -> R<()> {
        let s = self.to_storage(blk, x, b.dtype, None)?;
        let mut ops = vec![s, b.mem];
        ops.extend_from_slice(ix);
        self.op(blk, "memref.store", &ops, &[], &[], vec![])?;
        Ok(())
    }

    fn barrier(&self, blk: &Block<'c>) -> R<()> {
        if let Form::Gpu { .. } = self.form {
            self.op(blk, "gpu.barrier", &[], &[], &[], vec![])?;
        }
        Ok(())
    }

    /// `scf.for` over index `lo..hi step 1` with no carried values.
    fn for_index(
        &mut self,
        blk: &Block<'c>,
        lo: V,
        hi: V,
        step: V,
        body: impl FnOnce(&mut Self, &Block<'c>, V) -> R<()>,
    ) -> R<()> {
        let inner = Block::new(&[(self.ty("index")?, self.loc)]);
        let iv = inner.argument(0).map_err(|e| self.err(e.to_string()))?.to_raw();
        body(self, &inner, iv)?;
        self.op(&inner, "scf.yield", &[], &[], &[], vec![])?;
        let region = Region::new();
        region.append_block(inner);
        self.op(blk, "scf.for", &[lo, hi, step], &[], &[], vec![region])?;
        Ok(())
    }

    /// The rows `0..n` of a tile op: all of them in order (cpu), or spread over the
    /// block's threads and followed by a barrier (gpu).
    fn rows(&mut self, blk: &Block<'c>, n: usize, body: impl FnOnce(&mut Self, &Block<'c>, V) -> R<()>) -> R<()> {
        match self.form {
            // One row: no loop around it.
            Form::Cpu if n == 1 => {
                let zero = self.idx(blk, 0)?;
                body(self, blk, zero)
            }
            Form::Cpu => {
                let hi = self.idx(blk, n as i64)?;
                let (lo, step) = (self.idx(blk, 0)?, self.idx(blk, 1)?);
                self.for_index(blk, lo, hi, step, body)
            }
            Form::Gpu { threads } => {
                let hi = self.idx(blk, n as i64)?;
                let lo = self.tid.ok_or_else(|| self.err("thread id used before the prologue"))?;
                let step = self.idx(blk, threads as i64)?;
                self.for_index(blk, lo, hi, step, body)?;
                self.barrier(blk)
            }
        }
    }

    /// Copy tile `src` (any broadcastable logical shape) into buffer `dst`.
    fn copy_into(&mut self, blk: &Block<'c>, src: IrValue, dst: &Buf) -> R<()> {
        let (rows, cols) = if dst.shape.len() == 2 { (dst.shape[0], dst.shape[1]) } else { (1, dst.shape[0]) };
        let dst = dst.clone();
        self.rows(blk, rows, |e, b, r| {
            let x = e.read_row(b, src, r, cols)?;
            e.write_row(b, &dst, r, x)
        })
    }

    // ---- the kernel ----

    fn body(&mut self, blk: &Block<'c>, body: &IrBlock) -> R<()> {
        for op in &body.ops {
            self.emit_op(blk, op)?;
        }
        Ok(())
    }

    fn emit_op(&mut self, blk: &Block<'c>, op: &Op) -> R<()> {
        use OpKind::*;
        let res = |i: usize| op.results[i];
        match &op.kind {
            ProgramId { axis } => {
                let v = self.pid[*axis as usize].ok_or_else(|| self.err("program id before the prologue"))?;
                self.scalars.insert(res(0), v);
            }
            TensorDim { axis } => {
                let t = self.tensor(op.operands[0])?;
                let e = *t.ext.get(*axis as usize).ok_or_else(|| self.err(format!("tensor has no axis {axis}")))?;
                let v = self.op1(blk, "arith.trunci", &[e], "i32", &[])?;
                self.scalars.insert(res(0), v);
            }
            Const { value, dtype } => {
                let v = self.const_of(blk, *dtype, *value, None)?;
                self.scalars.insert(res(0), v);
            }
            Arange { len } => {
                let b = self.alloc_value(blk, res(0))?;
                let items: Vec<String> = (0..*len).map(|i| i.to_string()).collect();
                let t = vt("i32", Some(*len));
                self.rows(blk, 1, |e, b2, r| {
                    let c = e.constant(b2, &t, &format!("dense<[{}]> : {t}", items.join(", ")))?;
                    e.write_row(b2, &b, r, c)
                })?;
            }
            Splat { .. } | Broadcast { .. } => {
                let b = self.alloc_value(blk, res(0))?;
                self.copy_into(blk, op.operands[0], &b)?;
            }
            ExpandDims { .. } => {
                // Same elements, same order: an alias of the operand's buffer.
                let b = self.tile(op.operands[0])?;
                self.tiles.insert(res(0), b);
            }
            Load { axes, pad } => self.load(blk, op, axes, *pad)?,
            Store { axes, accumulate } => self.store(blk, op, axes, *accumulate)?,
            Binary(b) => {
                let d = self.k.ty(op.operands[0]).dtype();
                let b = *b;
                self.elementwise(blk, op, move |e, blk, x, w| e.binary(blk, b, d, x[0], x[1], w))?
            }
            Unary(u) => {
                let d = self.k.ty(op.operands[0]).dtype();
                let u = *u;
                self.elementwise(blk, op, move |e, blk, x, w| e.unary(blk, u, d, x[0], w))?
            }
            Cmp(p) => {
                let d = self.k.ty(op.operands[0]).dtype();
                let p = *p;
                self.elementwise(blk, op, move |e, blk, x, w| e.cmp(blk, p, d, x[0], x[1], w))?
            }
            Select => {
                let d = self.k.ty(res(0)).dtype();
                self.elementwise(blk, op, move |e, blk, x, w| {
                    e.op1(blk, "arith.select", &[x[0], x[1], x[2]], &vt(cty(d), w), &[])
                })?
            }
            Cast { to } => {
                let from = self.k.ty(op.operands[0]).dtype();
                let to = *to;
                self.elementwise(blk, op, move |e, blk, x, w| e.cast(blk, from, to, x[0], w))?
            }
            Reduce { op: r, axis } => self.reduce(blk, op, *r, *axis)?,
            Dot { trans_a, trans_b } => self.dot(blk, op, *trans_a, *trans_b)?,
            SoftmaxUpdate => self.softmax_update(blk, op)?,
            SoftmaxRescale => {
                let b = self.alloc_value(blk, res(0))?;
                let (acc, alpha) = (op.operands[0], op.operands[1]);
                let shape = self.k.ty(acc).shape().to_vec();
                self.rows(blk, shape[0], |e, blk, r| {
                    let zero = e.idx(blk, 0)?;
                    let row = e.read_row(blk, acc, r, shape[1])?;
                    let a = e.read_elem(blk, alpha, zero, r)?;
                    let a = e.op1(blk, "vector.broadcast", &[a], &vt("f32", Some(shape[1])), &[])?;
                    let y = e.op1(blk, "arith.mulf", &[row, a], &vt("f32", Some(shape[1])), &[])?;
                    e.write_row(blk, &b, r, y)
                })?;
            }
            SoftmaxFinalize => self.softmax_finalize(blk, op)?,
            MaskApply { .. } | MaskBlockFull { .. } | MaskKvRange { .. } => {
                return Err(self.err(format!(
                    "`{}` reaches the MLIR back end: run the tile-IR pass pipeline first (its `lower-masks` pass \
                     rewrites mask ops into arithmetic)",
                    op.kind.name()
                )))
            }
            RandUniform { shape } => self.rand_uniform(blk, op, shape)?,
            For => self.for_op(blk, op)?,
            If => self.if_op(blk, op)?,
            Yield => return Err(self.err("scf.yield outside a region")),
        }
        Ok(())
    }

    /// An element-wise op: on scalars when the result is a scalar, else row by row on
    /// vectors of the result's last extent.
    fn elementwise(
        &mut self,
        blk: &Block<'c>,
        op: &Op,
        f: impl Fn(&Self, &Block<'c>, &[V], Option<usize>) -> R<V>,
    ) -> R<()> {
        let res = op.results[0];
        let t = self.k.ty(res).clone();
        if t.is_scalar() {
            let xs: Vec<V> = op.operands.iter().map(|v| self.scalar(*v)).collect::<R<_>>()?;
            let y = f(self, blk, &xs, None)?;
            self.scalars.insert(res, y);
            return Ok(());
        }
        let shape = t.shape().to_vec();
        let (rows, cols) = if shape.len() == 2 { (shape[0], shape[1]) } else { (1, shape[0]) };
        let b = self.alloc_value(blk, res)?;
        let operands = op.operands.clone();
        self.rows(blk, rows, |e, blk, r| {
            let xs: Vec<V> = operands.iter().map(|v| e.read_row(blk, *v, r, cols)).collect::<R<_>>()?;
            let y = f(e, blk, &xs, Some(cols))?;
            e.write_row(blk, &b, r, y)
        })
    }

    fn binary(&self, blk: &Block<'c>, b: BinOp, d: DType, x: V, y: V, w: Option<usize>) -> R<V> {
        let t = vt(cty(d), w);
        let unsigned = d == DType::U32 || d == DType::I1;
        let name = if d.is_float() {
            match b {
                BinOp::Add => "arith.addf",
                BinOp::Sub => "arith.subf",
                BinOp::Mul => "arith.mulf",
                BinOp::Div => "arith.divf",
                BinOp::Max => "arith.maximumf",
                BinOp::Min => "arith.minimumf",
                other => return Err(self.err(format!("`{other:?}` on {d}"))),
            }
        } else {
            match b {
                BinOp::Add if d != DType::I1 => "arith.addi",
                BinOp::Sub if d != DType::I1 => "arith.subi",
                BinOp::Mul if d != DType::I1 => "arith.muli",
                BinOp::Div if d != DType::I1 => {
                    if unsigned {
                        "arith.divui"
                    } else {
                        "arith.divsi"
                    }
                }
                BinOp::Rem if d != DType::I1 => {
                    if unsigned {
                        "arith.remui"
                    } else {
                        "arith.remsi"
                    }
                }
                BinOp::Max => {
                    if unsigned {
                        "arith.maxui"
                    } else {
                        "arith.maxsi"
                    }
                }
                BinOp::Min => {
                    if unsigned {
                        "arith.minui"
                    } else {
                        "arith.minsi"
                    }
                }
                BinOp::And => "arith.andi",
                BinOp::Or => "arith.ori",
                BinOp::Xor => "arith.xori",
                BinOp::Shl | BinOp::Shr if d != DType::I1 => {
                    // Shift counts are taken mod 32 (the IR's semantics); MLIR's are poison
                    // past the width.
                    let m = self.const_of(blk, DType::I32, 31.0, w)?;
                    let s = self.op1(blk, "arith.andi", &[y, m], &t, &[])?;
                    let name = match (b, unsigned) {
                        (BinOp::Shl, _) => "arith.shli",
                        (_, true) => "arith.shrui",
                        _ => "arith.shrsi",
                    };
                    return self.op1(blk, name, &[x, s], &t, &[]);
                }
                BinOp::MulHi if d != DType::I1 => {
                    let name = if unsigned { "arith.mului_extended" } else { "arith.mulsi_extended" };
                    return Ok(self.op(blk, name, &[x, y], &[&t, &t], &[], vec![])?[1]);
                }
                other => return Err(self.err(format!("`{other:?}` on {d}"))),
            }
        };
        self.op1(blk, name, &[x, y], &t, &[])
    }

    fn unary(&self, blk: &Block<'c>, u: UnOp, d: DType, x: V, w: Option<usize>) -> R<V> {
        let t = vt(cty(d), w);
        if d.is_float() {
            let name = match u {
                UnOp::Neg => "arith.negf",
                UnOp::Abs => "math.absf",
                UnOp::Exp => "math.exp",
                UnOp::Exp2 => "math.exp2",
                UnOp::Log => "math.log",
                UnOp::Log2 => "math.log2",
                UnOp::Tanh => "math.tanh",
                UnOp::Sqrt => "math.sqrt",
                UnOp::Rsqrt => "math.rsqrt",
                UnOp::Not => return Err(self.err(format!("`not` on {d}"))),
            };
            return self.op1(blk, name, &[x], &t, &[]);
        }
        match u {
            UnOp::Neg => {
                let z = self.const_of(blk, d, 0.0, w)?;
                self.op1(blk, "arith.subi", &[z, x], &t, &[])
            }
            UnOp::Abs if d == DType::I32 => self.op1(blk, "math.absi", &[x], &t, &[]),
            UnOp::Abs => Ok(x),
            UnOp::Not => {
                let ones =
                    if d == DType::I1 { self.const_of(blk, d, 1.0, w)? } else { self.const_of(blk, d, -1.0, w)? };
                self.op1(blk, "arith.xori", &[x, ones], &t, &[])
            }
            other => Err(self.err(format!("`{other:?}` on {d}"))),
        }
    }

    fn cmp(&self, blk: &Block<'c>, p: CmpPred, d: DType, x: V, y: V, w: Option<usize>) -> R<V> {
        let t = vt("i1", w);
        if d.is_float() {
            // Ordered predicates (NaN compares false), `une` for != (NaN != x is true).
            let pred = match p {
                CmpPred::Eq => 1,
                CmpPred::Gt => 2,
                CmpPred::Ge => 3,
                CmpPred::Lt => 4,
                CmpPred::Le => 5,
                CmpPred::Ne => 13,
            };
            return self.op1(blk, "arith.cmpf", &[x, y], &t, &[("predicate", &format!("{pred} : i64"))]);
        }
        let unsigned = d == DType::U32 || d == DType::I1;
        let pred = match (p, unsigned) {
            (CmpPred::Eq, _) => 0,
            (CmpPred::Ne, _) => 1,
            (CmpPred::Lt, false) => 2,
            (CmpPred::Le, false) => 3,
            (CmpPred::Gt, false) => 4,
            (CmpPred::Ge, false) => 5,
            (CmpPred::Lt, true) => 6,
            (CmpPred::Le, true) => 7,
            (CmpPred::Gt, true) => 8,
            (CmpPred::Ge, true) => 9,
        };
        self.op1(blk, "arith.cmpi", &[x, y], &t, &[("predicate", &format!("{pred} : i64"))])
    }

    fn cast(&self, blk: &Block<'c>, from: DType, to: DType, x: V, w: Option<usize>) -> R<V> {
        let (cf, ct) = (cty(from), cty(to));
        let t = vt(ct, w);
        if from == DType::I1 {
            return match ct {
                "i1" => Ok(x),
                "i32" => self.op1(blk, "arith.extui", &[x], &t, &[]),
                _ => self.op1(blk, "arith.uitofp", &[x], &t, &[]),
            };
        }
        if to == DType::I1 {
            let z = self.const_of(blk, from, 0.0, w)?;
            return if from.is_float() {
                self.op1(blk, "arith.cmpf", &[x, z], &t, &[("predicate", "6 : i64")])
            // one
            } else {
                self.op1(blk, "arith.cmpi", &[x, z], &t, &[("predicate", "1 : i64")])
                // ne
            };
        }
        match (from.is_float(), to.is_float()) {
            (true, true) => {
                let y = match (cf, ct) {
                    ("f32", "f64") => self.op1(blk, "arith.extf", &[x], &t, &[])?,
                    ("f64", "f32") => self.op1(blk, "arith.truncf", &[x], &t, &[])?,
                    _ => x,
                };
                // To a 16-bit type: round there, then back to compute form.
                if matches!(to, DType::BF16 | DType::F16) {
                    let s = self.op1(blk, "arith.truncf", &[y], &vt(sty(to), w), &[])?;
                    self.op1(blk, "arith.extf", &[s], &t, &[])
                } else {
                    Ok(y)
                }
            }
            (false, false) => Ok(x), // i32 <-> u32: the same bits
            (true, false) => {
                let name = if to == DType::U32 { "arith.fptoui" } else { "arith.fptosi" };
                self.op1(blk, name, &[x], &t, &[])
            }
            (false, true) => {
                let name = if from == DType::U32 { "arith.uitofp" } else { "arith.sitofp" };
                let y = self.op1(blk, name, &[x], &t, &[])?;
                if matches!(to, DType::BF16 | DType::F16) {
                    let s = self.op1(blk, "arith.truncf", &[y], &vt(sty(to), w), &[])?;
                    self.op1(blk, "arith.extf", &[s], &t, &[])
                } else {
                    Ok(y)
                }
            }
        }
    }

    fn reduce(&mut self, blk: &Block<'c>, op: &Op, r: ReduceOp, axis: u8) -> R<()> {
        let src = op.operands[0];
        let st = self.k.ty(src).clone();
        let d = st.dtype();
        let shape = st.shape().to_vec();
        let e = cty(d);
        let unsigned = d == DType::U32;
        let (kind, combine) = match (r, d.is_float(), unsigned) {
            (ReduceOp::Sum, true, _) => ("add", "arith.addf"),
            (ReduceOp::Max, true, _) => ("maximumf", "arith.maximumf"),
            (ReduceOp::Min, true, _) => ("minimumf", "arith.minimumf"),
            (ReduceOp::Sum, false, _) => ("add", "arith.addi"),
            (ReduceOp::Max, false, false) => ("maxsi", "arith.maxsi"),
            (ReduceOp::Max, false, true) => ("maxui", "arith.maxui"),
            (ReduceOp::Min, false, false) => ("minsi", "arith.minsi"),
            (ReduceOp::Min, false, true) => ("minui", "arith.minui"),
        };
        let kind_attr = format!("#vector.kind<{kind}>");
        let res = op.results[0];
        if shape.len() == 1 {
            // Rank 1 → scalar, computed by every thread.
            let zero = self.idx(blk, 0)?;
            let row = self.read_row(blk, src, zero, shape[0])?;
            let s = self.op1(blk, "vector.reduction", &[row], e, &[("kind", &kind_attr)])?;
            self.scalars.insert(res, s);
            return Ok(());
        }
        let b = self.alloc_value(blk, res)?;
        if axis == 1 {
            self.rows(blk, shape[0], |em, blk, r| {
                let row = em.read_row(blk, src, r, shape[1])?;
                let s = em.op1(blk, "vector.reduction", &[row], e, &[("kind", &kind_attr)])?;
                em.write_elem(blk, &b, &[r], s)
            })
        } else {
            // Along the rows: one pass over them, combining whole rows.
            self.rows(blk, 1, |em, blk, _| {
                let zero = em.idx(blk, 0)?;
                let mut acc = em.read_row(blk, src, zero, shape[1])?;
                for i in 1..shape[0] {
                    let ri = em.idx(blk, i as i64)?;
                    let row = em.read_row(blk, src, ri, shape[1])?;
                    acc = em.op1(blk, combine, &[acc, row], &vt(e, Some(shape[1])), &[])?;
                }
                em.write_row(blk, &b, zero, acc)
            })
        }
    }

    fn dot(&mut self, blk: &Block<'c>, op: &Op, trans_a: bool, trans_b: bool) -> R<()> {
        let (a, b, acc) = (op.operands[0], op.operands[1], op.operands[2]);
        let sa = self.k.ty(a).shape().to_vec();
        let sc = self.k.ty(acc).shape().to_vec();
        let (m, n) = (sc[0], sc[1]);
        let kdim = if trans_a { sa[0] } else { sa[1] };
        let bd = self.k.ty(b).dtype();
        // B as [K, N] rows: a transposed copy when B is given as [N, K].
        let b_rows = if trans_b {
            let t = self.alloc(blk, &[kdim, n], bd)?;
            let tcopy = t.clone();
            self.rows(blk, kdim, |e, blk, p| {
                let (lo, hi, one) = (e.idx(blk, 0)?, e.idx(blk, n as i64)?, e.idx(blk, 1)?);
                e.for_index(blk, lo, hi, one, |e, blk, j| {
                    let x = e.read_elem(blk, b, j, p)?;
                    e.write_elem(blk, &tcopy, &[p, j], x)
                })
            })?;
            t
        } else {
            self.tile(b)?
        };
        let out = self.alloc_value(blk, op.results[0])?;
        let vf = vt("f32", Some(n));
        self.rows(blk, m, |e, blk, i| {
            let init = e.read_row(blk, acc, i, n)?;
            let (lo, hi, one) = (e.idx(blk, 0)?, e.idx(blk, kdim as i64)?, e.idx(blk, 1)?);
            let inner = Block::new(&[(e.ty("index")?, e.loc), (e.ty(&vf)?, e.loc)]);
            let p = inner.argument(0).map_err(|x| e.err(x.to_string()))?.to_raw();
            let c = inner.argument(1).map_err(|x| e.err(x.to_string()))?.to_raw();
            let aip = if trans_a { e.read_elem(&inner, a, p, i)? } else { e.read_elem(&inner, a, i, p)? };
            let ab = e.op1(&inner, "vector.broadcast", &[aip], &vf, &[])?;
            let zero = e.idx(&inner, 0)?;
            let mut ix = vec![b_rows.mem];
            ix.extend(e.buf_index(&inner, &b_rows, &[kdim, n], p, zero)?);
            let brow = e.op1(&inner, "vector.load", &ix, &vt(sty(bd), Some(n)), &[])?;
            let brow = e.to_compute(&inner, brow, bd, Some(n))?;
            let c2 = e.op1(&inner, "vector.fma", &[ab, brow, c], &vf, &[])?;
            e.op(&inner, "scf.yield", &[c2], &[], &[], vec![])?;
            let region = Region::new();
            region.append_block(inner);
            let r = e.op(blk, "scf.for", &[lo, hi, one, init], &[&vf], &[], vec![region])?;
            e.write_row(blk, &out, i, r[0])
        })
    }

    fn softmax_update(&mut self, blk: &Block<'c>, op: &Op) -> R<()> {
        let (s, m, l) = (op.operands[0], op.operands[1], op.operands[2]);
        let shape = self.k.ty(s).shape().to_vec();
        let n = shape[1];
        let p = self.alloc_value(blk, op.results[0])?;
        let alpha = self.alloc_value(blk, op.results[1])?;
        let m_new = self.alloc_value(blk, op.results[2])?;
        let l_new = self.alloc_value(blk, op.results[3])?;
        let vf = vt("f32", Some(n));
        // A scale operand (`ejc_ir::passes::scale_fold`): the row scaled by c first.
        let scale = match op.operands.get(3) {
            Some(c) => Some(self.scalar(*c)?),
            None => None,
        };
        self.rows(blk, shape[0], |e, blk, r| {
            let zero = e.idx(blk, 0)?;
            let row = e.read_row(blk, s, r, n)?;
            let row = match scale {
                Some(c) => {
                    let cb = e.op1(blk, "vector.broadcast", &[c], &vf, &[])?;
                    e.op1(blk, "arith.mulf", &[row, cb], &vf, &[])?
                }
                None => row,
            };
            let mi = e.read_elem(blk, m, zero, r)?;
            let li = e.read_elem(blk, l, zero, r)?;
            let mx = e.op1(blk, "vector.reduction", &[row], "f32", &[("kind", "#vector.kind<maximumf>")])?;
            let mn = e.op1(blk, "arith.maximumf", &[mi, mx], "f32", &[])?;
            let ninf = e.const_of(blk, DType::F32, f64::NEG_INFINITY, None)?;
            let dead = e.op1(blk, "arith.cmpf", &[mn, ninf], "i1", &[("predicate", "1 : i64")])?;
            // Rows with nothing visible yet: subtract 0 instead of -inf (no NaN), then p = 0.
            let zf = e.const_of(blk, DType::F32, 0.0, None)?;
            let msafe = e.op1(blk, "arith.select", &[dead, zf, mn], "f32", &[])?;
            let d = e.op1(blk, "arith.subf", &[mi, msafe], "f32", &[])?;
            let a = e.op1(blk, "math.exp2", &[d], "f32", &[])?;
            let one = e.const_of(blk, DType::F32, 1.0, None)?;
            let a = e.op1(blk, "arith.select", &[dead, one, a], "f32", &[])?;
            let mb = e.op1(blk, "vector.broadcast", &[msafe], &vf, &[])?;
            let x = e.op1(blk, "arith.subf", &[row, mb], &vf, &[])?;
            let pr = e.op1(blk, "math.exp2", &[x], &vf, &[])?;
            let zv = e.const_of(blk, DType::F32, 0.0, Some(n))?;
            let pr = e.op1(blk, "arith.select", &[dead, zv, pr], &vf, &[])?;
            let sum = e.op1(blk, "vector.reduction", &[pr], "f32", &[("kind", "#vector.kind<add>")])?;
            let la = e.op1(blk, "arith.mulf", &[li, a], "f32", &[])?;
            let ln = e.op1(blk, "arith.addf", &[la, sum], "f32", &[])?;
            e.write_row(blk, &p, r, pr)?;
            e.write_elem(blk, &alpha, &[r], a)?;
            e.write_elem(blk, &m_new, &[r], mn)?;
            e.write_elem(blk, &l_new, &[r], ln)
        })
    }

    fn softmax_finalize(&mut self, blk: &Block<'c>, op: &Op) -> R<()> {
        let (acc, m, l) = (op.operands[0], op.operands[1], op.operands[2]);
        let shape = self.k.ty(acc).shape().to_vec();
        let n = shape[1];
        let o = self.alloc_value(blk, op.results[0])?;
        let lse = self.alloc_value(blk, op.results[1])?;
        let vf = vt("f32", Some(n));
        self.rows(blk, shape[0], |e, blk, r| {
            let zero = e.idx(blk, 0)?;
            let row = e.read_row(blk, acc, r, n)?;
            let mi = e.read_elem(blk, m, zero, r)?;
            let li = e.read_elem(blk, l, zero, r)?;
            let zf = e.const_of(blk, DType::F32, 0.0, None)?;
            let empty = e.op1(blk, "arith.cmpf", &[li, zf], "i1", &[("predicate", "1 : i64")])?;
            let one = e.const_of(blk, DType::F32, 1.0, None)?;
            let lsafe = e.op1(blk, "arith.select", &[empty, one, li], "f32", &[])?;
            let lb = e.op1(blk, "vector.broadcast", &[lsafe], &vf, &[])?;
            let y = e.op1(blk, "arith.divf", &[row, lb], &vf, &[])?;
            let zv = e.const_of(blk, DType::F32, 0.0, Some(n))?;
            let y = e.op1(blk, "arith.select", &[empty, zv, y], &vf, &[])?;
            let lg = e.op1(blk, "math.log2", &[lsafe], "f32", &[])?;
            let s = e.op1(blk, "arith.addf", &[mi, lg], "f32", &[])?;
            let ln2 = e.const_of(blk, DType::F32, std::f64::consts::LN_2, None)?;
            let s = e.op1(blk, "arith.mulf", &[s, ln2], "f32", &[])?;
            let ninf = e.const_of(blk, DType::F32, f64::NEG_INFINITY, None)?;
            let s = e.op1(blk, "arith.select", &[empty, ninf, s], "f32", &[])?;
            e.write_row(blk, &o, r, y)?;
            e.write_elem(blk, &lse, &[r], s)
        })
    }

    fn rand_uniform(&mut self, blk: &Block<'c>, op: &Op, shape: &[usize]) -> R<()> {
        let xs: Vec<V> = op.operands.iter().map(|v| self.scalar(*v)).collect::<R<_>>()?;
        let n = shape[1];
        let b = self.alloc_value(blk, op.results[0])?;
        let vi = vt("i32", Some(n));
        self.rows(blk, shape[0], |e, blk, r| {
            let splat = |e: &Self, blk: &Block<'c>, x: V| e.op1(blk, "vector.broadcast", &[x], &vi, &[]);
            let r32 = e.op1(blk, "arith.index_cast", &[r], "i32", &[])?;
            let row = e.op1(blk, "arith.addi", &[xs[4], r32], "i32", &[])?;
            let items: Vec<String> = (0..n).map(|i| i.to_string()).collect();
            let iota = e.constant(blk, &vi, &format!("dense<[{}]> : {vi}", items.join(", ")))?;
            let col0 = splat(e, blk, xs[5])?;
            let mut c = [
                splat(e, blk, row)?,
                e.op1(blk, "arith.addi", &[col0, iota], &vi, &[])?,
                splat(e, blk, xs[3])?,
                splat(e, blk, xs[2])?,
            ];
            let mut key = [splat(e, blk, xs[0])?, splat(e, blk, xs[1])?];
            let m0 = e.const_of(blk, DType::I32, 0xD251_1F53u32 as i32 as f64, Some(n))?;
            let m1 = e.const_of(blk, DType::I32, 0xCD9E_8D57u32 as i32 as f64, Some(n))?;
            let w0 = e.const_of(blk, DType::I32, 0x9E37_79B9u32 as i32 as f64, Some(n))?;
            let w1 = e.const_of(blk, DType::I32, 0xBB67_AE85u32 as i32 as f64, Some(n))?;
            for round in 0..10 {
                if round > 0 {
                    key = [
                        e.op1(blk, "arith.addi", &[key[0], w0], &vi, &[])?,
                        e.op1(blk, "arith.addi", &[key[1], w1], &vi, &[])?,
                    ];
                }
                let p0 = e.op(blk, "arith.mului_extended", &[m0, c[0]], &[&vi, &vi], &[], vec![])?;
                let p1 = e.op(blk, "arith.mului_extended", &[m1, c[2]], &[&vi, &vi], &[], vec![])?;
                let x0 = e.op1(blk, "arith.xori", &[p1[1], c[1]], &vi, &[])?;
                let x0 = e.op1(blk, "arith.xori", &[x0, key[0]], &vi, &[])?;
                let x2 = e.op1(blk, "arith.xori", &[p0[1], c[3]], &vi, &[])?;
                let x2 = e.op1(blk, "arith.xori", &[x2, key[1]], &vi, &[])?;
                c = [x0, p1[0], x2, p0[0]];
            }
            let eight = e.const_of(blk, DType::I32, 8.0, Some(n))?;
            let top = e.op1(blk, "arith.shrui", &[c[0], eight], &vi, &[])?;
            let f = e.op1(blk, "arith.uitofp", &[top], &vt("f32", Some(n)), &[])?;
            let scale = e.const_of(blk, DType::F32, 1.0 / 16777216.0, Some(n))?;
            let u = e.op1(blk, "arith.mulf", &[f, scale], &vt("f32", Some(n)), &[])?;
            e.write_row(blk, &b, r, u)
        })
    }

    /// Per-access values of a load/store: for each axis its start (index), its bound
    /// (min of extent and limit, index) and stride; `fixed_ok` and `base` fold the
    /// `Index` axes.
    fn access(&self, blk: &Block<'c>, t: IrValue, axes: &[AxisIndex], operands: &[V]) -> R<Access> {
        let ta = self.tensor(t)?;
        let (mut it, mut ranges) = (operands.iter(), Vec::new());
        let zero = self.idx(blk, 0)?;
        let tru = self.const_of(blk, DType::I1, 1.0, None)?;
        let (mut ok, mut base) = (tru, zero);
        for (ax, a) in axes.iter().enumerate() {
            let start = *it.next().ok_or_else(|| self.err("missing index operand"))?;
            let start = self.to_index(blk, start, "i32")?;
            let ext = self.op1(blk, "arith.index_cast", &[ta.ext[ax]], "index", &[])?;
            let stride = self.op1(blk, "arith.index_cast", &[ta.strides[ax]], "index", &[])?;
            match a {
                AxisIndex::Index => {
                    let ge = self.op1(blk, "arith.cmpi", &[start, zero], "i1", &[("predicate", "5 : i64")])?;
                    let lt = self.op1(blk, "arith.cmpi", &[start, ext], "i1", &[("predicate", "2 : i64")])?;
                    ok = self.op1(blk, "arith.andi", &[ok, ge], "i1", &[])?;
                    ok = self.op1(blk, "arith.andi", &[ok, lt], "i1", &[])?;
                    let m = self.op1(blk, "arith.muli", &[start, stride], "index", &[])?;
                    base = self.op1(blk, "arith.addi", &[base, m], "index", &[])?;
                }
                AxisIndex::Range { size, limit } => {
                    let mut bound = ext;
                    if *limit {
                        let l = *it.next().ok_or_else(|| self.err("missing limit operand"))?;
                        let l = self.to_index(blk, l, "i32")?;
                        bound = self.op1(blk, "arith.minsi", &[bound, l], "index", &[])?;
                    }
                    ranges.push(RangeAxis { start, bound, stride, size: *size });
                }
            }
        }
        Ok(Access { ok, base, ranges, mem: ta.mem, dtype: ta.dtype })
    }

    /// In-bounds flag and offset contribution of position `x = start + i` on one axis.
    fn axis_at(&self, blk: &Block<'c>, ax: &RangeAxis, i: V) -> R<(V, V)> {
        let zero = self.idx(blk, 0)?;
        let x = self.op1(blk, "arith.addi", &[ax.start, i], "index", &[])?;
        let ge = self.op1(blk, "arith.cmpi", &[x, zero], "i1", &[("predicate", "5 : i64")])?;
        let lt = self.op1(blk, "arith.cmpi", &[x, ax.bound], "i1", &[("predicate", "2 : i64")])?;
        let ok = self.op1(blk, "arith.andi", &[ge, lt], "i1", &[])?;
        let off = self.op1(blk, "arith.muli", &[x, ax.stride], "index", &[])?;
        Ok((ok, off))
    }

    /// Visit every element of a load/store tile: rows spread by [`Self::rows`], columns
    /// in a loop; `f` gets the element's in-bounds flag, its offset in the tensor and its
    /// tile indices (row 0 for rank-1 tiles).
    fn for_each_element(
        &mut self,
        blk: &Block<'c>,
        acc: &Access,
        f: impl Fn(&mut Self, &Block<'c>, V, V, V, V) -> R<()>,
    ) -> R<()> {
        let two = acc.ranges.len() == 2;
        let rows = if two { acc.ranges[0].size } else { 1 };
        self.rows(blk, rows, |e, blk, r| {
            let (mut ok, mut off) = (acc.ok, acc.base);
            if two {
                let (o, x) = e.axis_at(blk, &acc.ranges[0], r)?;
                ok = e.op1(blk, "arith.andi", &[ok, o], "i1", &[])?;
                off = e.op1(blk, "arith.addi", &[off, x], "index", &[])?;
            }
            let zero = e.idx(blk, 0)?;
            let r = if two { r } else { zero };
            let col = &acc.ranges[acc.ranges.len() - 1];
            let (lo, hi, one) = (e.idx(blk, 0)?, e.idx(blk, col.size as i64)?, e.idx(blk, 1)?);
            e.for_index(blk, lo, hi, one, |e, blk, c| {
                let (o, x) = e.axis_at(blk, col, c)?;
                let ok = e.op1(blk, "arith.andi", &[ok, o], "i1", &[])?;
                let off = e.op1(blk, "arith.addi", &[off, x], "index", &[])?;
                f(e, blk, ok, off, r, c)
            })
        })
    }

    /// Load one tensor element at `off` when `ok`, else `pad`; storage form of the tensor.
    fn guarded_load(&self, blk: &Block<'c>, acc: &Access, ok: V, off: V, pad: f64) -> R<V> {
        let s = sty(acc.dtype);
        let then = Block::new(&[]);
        let mut x = self.op1(&then, "memref.load", &[acc.mem, off], s, &[])?;
        if acc.dtype == DType::I1 {
            // Any nonzero byte means true.
            let z = self.constant(&then, "i8", "0 : i8")?;
            let t = self.op1(&then, "arith.cmpi", &[x, z], "i1", &[("predicate", "1 : i64")])?;
            x = self.op1(&then, "arith.extui", &[t], "i8", &[])?;
        }
        self.op(&then, "scf.yield", &[x], &[], &[], vec![])?;
        let els = Block::new(&[]);
        let p = self.const_of(&els, acc.dtype, acc.dtype.round(pad), None)?;
        let p = self.to_storage(&els, p, acc.dtype, None)?;
        self.op(&els, "scf.yield", &[p], &[], &[], vec![])?;
        let (r1, r2) = (Region::new(), Region::new());
        r1.append_block(then);
        r2.append_block(els);
        Ok(self.op(blk, "scf.if", &[ok], &[s], &[], vec![r1, r2])?[0])
    }

    fn guarded_store(&self, blk: &Block<'c>, acc: &Access, ok: V, off: V, x: V, accumulate: bool) -> R<()> {
        let then = Block::new(&[]);
        if accumulate {
            // f32 only (the verifier's rule); the old value is not used. `kind` 0 is
            // `addf` (arith::AtomicRMWKind, an I64EnumAttr).
            self.op(&then, "memref.atomic_rmw", &[x, acc.mem, off], &["f32"], &[("kind", "0 : i64")], vec![])?;
        } else {
            self.op(&then, "memref.store", &[x, acc.mem, off], &[], &[], vec![])?;
        }
        self.op(&then, "scf.yield", &[], &[], &[], vec![])?;
        let els = Block::new(&[]);
        self.op(&els, "scf.yield", &[], &[], &[], vec![])?;
        let (r1, r2) = (Region::new(), Region::new());
        r1.append_block(then);
        r2.append_block(els);
        self.op(blk, "scf.if", &[ok], &[], &[], vec![r1, r2])?;
        Ok(())
    }

    fn load(&mut self, blk: &Block<'c>, op: &Op, axes: &[AxisIndex], pad: f64) -> R<()> {
        let acc = self.access(blk, op.operands[0], axes, &self.scalars_of(&op.operands[1..])?)?;
        let res = op.results[0];
        match acc.ranges.len() {
            0 => {
                let x = self.guarded_load(blk, &acc, acc.ok, acc.base, pad)?;
                let x = self.to_compute(blk, x, acc.dtype, None)?;
                self.scalars.insert(res, x);
                Ok(())
            }
            1 | 2 => {
                let b = self.alloc_value(blk, res)?;
                let two = acc.ranges.len() == 2;
                self.for_each_element(blk, &acc, |e, blk, ok, off, r, c| {
                    let x = e.guarded_load(blk, &acc, ok, off, pad)?;
                    let mut ix = vec![x, b.mem];
                    if two {
                        ix.push(r);
                    }
                    ix.push(c);
                    e.op(blk, "memref.store", &ix, &[], &[], vec![])?;
                    Ok(())
                })
            }
            n => Err(self.err(format!("a load with {n} range axes (tiles have rank 1 or 2)"))),
        }
    }

    fn store(&mut self, blk: &Block<'c>, op: &Op, axes: &[AxisIndex], accumulate: bool) -> R<()> {
        let n = op.operands.len();
        let value = op.operands[n - 1];
        let acc = self.access(blk, op.operands[0], axes, &self.scalars_of(&op.operands[1..n - 1])?)?;
        match acc.ranges.len() {
            0 => {
                let x = self.scalar(value)?;
                let x = self.to_storage(blk, x, acc.dtype, None)?;
                self.rows(blk, 1, |e, blk, _| e.guarded_store(blk, &acc, acc.ok, acc.base, x, accumulate))
            }
            1 | 2 => self.for_each_element(blk, &acc, |e, blk, ok, off, r, c| {
                let x = e.read_elem(blk, value, r, c)?;
                let x = e.to_storage(blk, x, acc.dtype, None)?;
                e.guarded_store(blk, &acc, ok, off, x, accumulate)
            }),
            n => Err(self.err(format!("a store with {n} range axes (tiles have rank 1 or 2)"))),
        }
    }

    fn for_op(&mut self, blk: &Block<'c>, op: &Op) -> R<()> {
        let (lo, hi, step) = (self.scalar(op.operands[0])?, self.scalar(op.operands[1])?, self.scalar(op.operands[2])?);
        let inits = &op.operands[3..];
        let body = &op.regions[0];
        // Carried tiles live in one buffer each for the whole loop.
        let mut carried_bufs: Vec<Option<Buf>> = Vec::new();
        let mut scalar_inits = Vec::new();
        let mut scalar_tys = Vec::new();
        for (i, init) in inits.iter().enumerate() {
            let arg = body.args[i + 1];
            if self.k.ty(arg).is_tile() {
                let buf = self.alloc_value(blk, arg)?;
                self.copy_into(blk, *init, &buf)?;
                carried_bufs.push(Some(buf));
            } else {
                scalar_inits.push(self.scalar(*init)?);
                scalar_tys.push(cty(self.k.ty(arg).dtype()).to_string());
                carried_bufs.push(None);
            }
        }
        let mut arg_tys = vec![(self.ty("i32")?, self.loc)];
        for t in &scalar_tys {
            arg_tys.push((self.ty(t)?, self.loc));
        }
        let inner = Block::new(&arg_tys);
        let iv = inner.argument(0).map_err(|e| self.err(e.to_string()))?.to_raw();
        self.scalars.insert(body.args[0], iv);
        let mut si = 1;
        for (i, cb) in carried_bufs.iter().enumerate() {
            if cb.is_none() {
                let a = inner.argument(si).map_err(|e| self.err(e.to_string()))?.to_raw();
                self.scalars.insert(body.args[i + 1], a);
                si += 1;
            }
        }
        let n = body.ops.len();
        let Some(Op { kind: OpKind::Yield, operands: yields, .. }) = body.ops.last() else {
            return Err(self.err("scf.for body does not end in scf.yield"));
        };
        for o in &body.ops[..n - 1] {
            self.emit_op(&inner, o)?;
        }
        // Write carried tiles back; through temporaries when a yielded tile is one of
        // this loop's own carried values (a swap would otherwise read what it overwrote).
        let own: Vec<IrValue> = body.args[1..].to_vec();
        let swap = yields.iter().enumerate().any(|(i, y)| own.iter().position(|a| a == y).is_some_and(|j| j != i));
        let mut staged = Vec::new();
        for (i, y) in yields.iter().enumerate() {
            if let Some(buf) = &carried_bufs[i] {
                if *y == body.args[i + 1] {
                    continue;
                }
                if swap {
                    let t = self.alloc(&inner, &buf.shape, buf.dtype)?;
                    self.copy_into(&inner, *y, &t)?;
                    staged.push((t, buf.clone()));
                } else {
                    self.copy_into(&inner, *y, buf)?;
                }
            }
        }
        for (src, buf) in staged {
            let (rows, cols) = if buf.shape.len() == 2 { (buf.shape[0], buf.shape[1]) } else { (1, buf.shape[0]) };
            self.rows(&inner, rows, |e, b, r| {
                let zero = e.idx(b, 0)?;
                let mut ix = vec![src.mem];
                if src.shape.len() == 2 {
                    ix.extend([r, zero]);
                } else {
                    ix.push(zero);
                }
                let x = e.op1(b, "vector.load", &ix, &vt(sty(src.dtype), Some(cols)), &[])?;
                let x = e.to_compute(b, x, src.dtype, Some(cols))?;
                e.write_row(b, &buf, r, x)
            })?;
        }
        let scalar_yields: Vec<V> = yields
            .iter()
            .enumerate()
            .filter(|(i, _)| carried_bufs[*i].is_none())
            .map(|(_, y)| self.scalar(*y))
            .collect::<R<_>>()?;
        self.op(&inner, "scf.yield", &scalar_yields, &[], &[], vec![])?;
        let region = Region::new();
        region.append_block(inner);
        let mut operands = vec![lo, hi, step];
        operands.extend(scalar_inits);
        let tys: Vec<&str> = scalar_tys.iter().map(|s| s.as_str()).collect();
        let outs = self.op(blk, "scf.for", &operands, &tys, &[], vec![region])?;
        let mut oi = 0;
        for (i, cb) in carried_bufs.into_iter().enumerate() {
            match cb {
                Some(buf) => {
                    self.tiles.insert(op.results[i], buf);
                }
                None => {
                    self.scalars.insert(op.results[i], outs[oi]);
                    oi += 1;
                }
            }
        }
        Ok(())
    }

    fn if_op(&mut self, blk: &Block<'c>, op: &Op) -> R<()> {
        let cond = self.scalar(op.operands[0])?;
        let mut res_bufs: Vec<Option<Buf>> = Vec::new();
        let mut scalar_tys = Vec::new();
        for r in &op.results {
            if self.k.ty(*r).is_tile() {
                res_bufs.push(Some(self.alloc_value(blk, *r)?));
            } else {
                res_bufs.push(None);
                scalar_tys.push(cty(self.k.ty(*r).dtype()).to_string());
            }
        }
        let mut regions = Vec::new();
        for region in &op.regions {
            let inner = Block::new(&[]);
            let n = region.ops.len();
            let Some(Op { kind: OpKind::Yield, operands: yields, .. }) = region.ops.last() else {
                return Err(self.err("scf.if region does not end in scf.yield"));
            };
            for o in &region.ops[..n - 1] {
                self.emit_op(&inner, o)?;
            }
            let mut sy = Vec::new();
            for (i, y) in yields.iter().enumerate() {
                match &res_bufs[i] {
                    Some(buf) => self.copy_into(&inner, *y, buf)?,
                    None => sy.push(self.scalar(*y)?),
                }
            }
            self.op(&inner, "scf.yield", &sy, &[], &[], vec![])?;
            let r = Region::new();
            r.append_block(inner);
            regions.push(r);
        }
        let tys: Vec<&str> = scalar_tys.iter().map(|s| s.as_str()).collect();
        let outs = self.op(blk, "scf.if", &[cond], &tys, &[], regions)?;
        // Result tiles are the buffers allocated above.
        let mut oi = 0;
        for (i, rb) in res_bufs.into_iter().enumerate() {
            if rb.is_none() {
                self.scalars.insert(op.results[i], outs[oi]);
                oi += 1;
            }
        }
        Ok(())
    }
}

struct RangeAxis {
    start: V,
    bound: V,
    stride: V,
    size: usize,
}

struct Access {
    ok: V,
    base: V,
    ranges: Vec<RangeAxis>,
    mem: V,
    dtype: DType,
}

/// The MLIR signature of a kernel's parameters: each tensor as (memref, rank × i64
/// extents, rank × i64 strides), each scalar as its compute type (i1 as i32).
fn param_types(k: &Kernel, form: Form) -> Vec<String> {
    let mut tys = Vec::new();
    for p in &k.params {
        match &p.ty {
            IrType::Tensor(d, rank) => {
                tys.push(match form {
                    Form::Cpu => format!("memref<?x{}>", sty(*d)),
                    Form::Gpu { .. } => format!("memref<{GPU_PTR_EXTENT}x{}>", sty(*d)),
                });
                for _ in 0..2 * rank {
                    tys.push("i64".into());
                }
            }
            IrType::Scalar(d) => tys.push(if *d == DType::I1 { "i32".into() } else { cty(*d).into() }),
            IrType::Tile(..) => tys.push("none".into()),
        }
    }
    tys
}

/// Bind the parameters of `entry` (block arguments from index 0) to the kernel's values.
fn bind_params(e: &mut Emitter, entry: &Block) -> R<usize> {
    let mut i = 0;
    let arg = |e: &Emitter, i: usize| entry.argument(i).map(|a| a.to_raw()).map_err(|x| e.err(x.to_string()));
    for p in &e.k.params.clone() {
        match &p.ty {
            IrType::Tensor(d, rank) => {
                let mem = arg(e, i)?;
                let ext = (0..*rank).map(|j| arg(e, i + 1 + j)).collect::<R<_>>()?;
                let strides = (0..*rank).map(|j| arg(e, i + 1 + rank + j)).collect::<R<_>>()?;
                e.tensors.insert(p.value, TensorArg { mem, ext, strides, dtype: *d });
                i += 1 + 2 * rank;
            }
            IrType::Scalar(d) => {
                let mut v = arg(e, i)?;
                if *d == DType::I1 {
                    let z = e.i32c(entry, 0)?;
                    v = e.op1(entry, "arith.cmpi", &[v, z], "i1", &[("predicate", "1 : i64")])?;
                }
                e.scalars.insert(p.value, v);
                i += 1;
            }
            IrType::Tile(..) => return Err(e.err("a tile cannot be a kernel parameter")),
        }
    }
    Ok(i)
}

fn fn_type(params: &[String]) -> String {
    format!("({}) -> ()", params.join(", "))
}

/// Translate `k` into a new module of `ctx`. The module is not verified yet.
pub fn translate<'c>(ctx: &'c Context, k: &Kernel, form: Form) -> R<(Module<'c>, Translation)> {
    // The gpu form addresses its scratch slice with the slice size, known only once
    // everything is emitted: emit once to measure, then for real.
    let slice = match form {
        Form::Cpu => 0,
        Form::Gpu { .. } => emit_module(ctx, k, form, 0)?.1.scratch_bytes.div_ceil(ALIGN) * ALIGN,
    };
    emit_module(ctx, k, form, slice)
}

fn emit_module<'c>(ctx: &'c Context, k: &Kernel, form: Form, slice: usize) -> R<(Module<'c>, Translation)> {
    let mut e = Emitter::new(ctx, k, form);
    let module = Module::new(e.loc);
    let mut params = param_types(k, form);
    match form {
        Form::Cpu => {
            // ..., grid0, grid1, grid2, begin, end, scratch
            params.extend(["i64", "i64", "i64", "i64", "i64", "memref<?xi8>"].map(String::from));
            let arg_tys: Vec<(Type, Location)> =
                params.iter().map(|t| e.ty(t).map(|t| (t, e.loc))).collect::<R<_>>()?;
            let entry = Block::new(&arg_tys);
            let n = bind_params(&mut e, &entry)?;
            let a = |i: usize| entry.argument(i).map(|a| a.to_raw()).map_err(|x| e.err(x.to_string()));
            let (g0, g1, begin, end, scratch) = (a(n)?, a(n + 1)?, a(n + 3)?, a(n + 4)?, a(n + 5)?);
            e.scratch = Some(scratch);
            e.base = Some(e.idx(&entry, 0)?);
            let one = e.constant(&entry, "i64", "1 : i64")?;
            // for p in begin..end: (pid0, pid1, pid2) from p.
            let inner = Block::new(&[(e.ty("i64")?, e.loc)]);
            let p = inner.argument(0).map_err(|x| e.err(x.to_string()))?.to_raw();
            let p0 = e.op1(&inner, "arith.remsi", &[p, g0], "i64", &[])?;
            let q = e.op1(&inner, "arith.divsi", &[p, g0], "i64", &[])?;
            let p1 = e.op1(&inner, "arith.remsi", &[q, g1], "i64", &[])?;
            let p2 = e.op1(&inner, "arith.divsi", &[q, g1], "i64", &[])?;
            for (i, x) in [p0, p1, p2].into_iter().enumerate() {
                e.pid[i] = Some(e.op1(&inner, "arith.trunci", &[x], "i32", &[])?);
            }
            e.body(&inner, &k.body)?;
            e.op(&inner, "scf.yield", &[], &[], &[], vec![])?;
            let region = Region::new();
            region.append_block(inner);
            e.op(&entry, "scf.for", &[begin, end, one], &[], &[], vec![region])?;
            e.op(&entry, "func.return", &[], &[], &[], vec![])?;
            let body = Region::new();
            body.append_block(entry);
            let f = OperationBuilder::new("func.func", e.loc)
                .add_attributes(&[
                    (Identifier::new(ctx, "sym_name"), e.attr(&format!("\"{}\"", k.name))?),
                    (Identifier::new(ctx, "function_type"), e.attr(&fn_type(&params))?),
                ])
                .add_regions([body])
                .build()
                .map_err(|x| e.err(format!("building func.func: {x}")))?;
            module.body().append_operation(f);
            Ok((module, Translation { entry: k.name.clone(), scratch_bytes: e.next.div_ceil(ALIGN) * ALIGN }))
        }
        Form::Gpu { threads } => {
            params.push(format!("memref<{GPU_PTR_EXTENT}xi8>"));
            let arg_tys: Vec<(Type, Location)> =
                params.iter().map(|t| e.ty(t).map(|t| (t, e.loc))).collect::<R<_>>()?;
            let entry = Block::new(&arg_tys);
            let n = bind_params(&mut e, &entry)?;
            let scratch = entry.argument(n).map_err(|x| e.err(x.to_string()))?.to_raw();
            let dim = |e: &Emitter, name: &str, d: &str| e.op1(&entry, name, &[], "index", &[("dimension", d)]);
            let bx = dim(&e, "gpu.block_id", "#gpu<dim x>")?;
            let by = dim(&e, "gpu.block_id", "#gpu<dim y>")?;
            let bz = dim(&e, "gpu.block_id", "#gpu<dim z>")?;
            let gx = dim(&e, "gpu.grid_dim", "#gpu<dim x>")?;
            let gy = dim(&e, "gpu.grid_dim", "#gpu<dim y>")?;
            e.tid = Some(dim(&e, "gpu.thread_id", "#gpu<dim x>")?);
            for (i, x) in [bx, by, bz].into_iter().enumerate() {
                e.pid[i] = Some(e.op1(&entry, "arith.index_cast", &[x], "i32", &[])?);
            }
            // This block's scratch slice: linear block id × slice bytes.
            let t = e.op1(&entry, "arith.muli", &[bz, gy], "index", &[])?;
            let t = e.op1(&entry, "arith.addi", &[t, by], "index", &[])?;
            let t = e.op1(&entry, "arith.muli", &[t, gx], "index", &[])?;
            let lin = e.op1(&entry, "arith.addi", &[t, bx], "index", &[])?;
            let sb = e.idx(&entry, slice as i64)?;
            e.base = Some(e.op1(&entry, "arith.muli", &[lin, sb], "index", &[])?);
            e.scratch = Some(scratch);
            e.body(&entry, &k.body)?;
            e.op(&entry, "gpu.return", &[], &[], &[], vec![])?;
            let body = Region::new();
            body.append_block(entry);
            let f = OperationBuilder::new("gpu.func", e.loc)
                .add_attributes(&[
                    (Identifier::new(ctx, "sym_name"), e.attr("\"entry\"")?),
                    (Identifier::new(ctx, "function_type"), e.attr(&fn_type(&params))?),
                    (Identifier::new(ctx, "gpu.kernel"), Attribute::unit(ctx)),
                    (Identifier::new(ctx, "known_block_size"), e.attr(&format!("array<i32: {threads}, 1, 1>"))?),
                ])
                .add_regions([body])
                .build()
                .map_err(|x| e.err(format!("building gpu.func: {x}")))?;
            let gblock = Block::new(&[]);
            gblock.append_operation(f);
            let gregion = Region::new();
            gregion.append_block(gblock);
            let gm = OperationBuilder::new("gpu.module", e.loc)
                .add_attributes(&[(Identifier::new(ctx, "sym_name"), e.attr("\"ejc\"")?)])
                .add_regions([gregion])
                .build()
                .map_err(|x| e.err(format!("building gpu.module: {x}")))?;
            module.body().append_operation(gm);
            let scratch_bytes = e.next.div_ceil(ALIGN) * ALIGN;
            // The container-module marker goes on the top-level module.
            let mut m = module;
            m.as_operation_mut().set_attribute("gpu.container_module", Attribute::unit(ctx));
            Ok((m, Translation { entry: "entry".into(), scratch_bytes }))
        }
    }
}
