//! Building kernels op by op.
//!
//! ```
//! use ejc_ir::builder::KernelBuilder;
//! use ejc_ir::ir::{BinOp, GridExpr};
//! use ejc_ir::types::{DType, Type};
//!
//! let mut b = KernelBuilder::new("scale");
//! let x = b.param("x", Type::Tensor(DType::F32, 1));
//! let s = b.param("s", Type::Scalar(DType::F32));
//! b.set_grid([GridExpr::cdiv(GridExpr::sym("n"), 32), GridExpr::Const(1), GridExpr::Const(1)]);
//! let pid = b.program_id(0);
//! let c32 = b.const_i32(32);
//! let start = b.binary(BinOp::Mul, pid, c32);
//! let tile = b.load(x, vec![b.range(start, 32, None)], 0.0);
//! let scaled = b.binary(BinOp::Mul, tile, s);
//! b.store(x, vec![b.range(start, 32, None)], scaled);
//! let kernel = b.finish().unwrap();
//! assert_eq!(kernel.op_count(), 6);
//! ```
//!
//! Ops are appended to the innermost open block; `for_loop` and `if_else` open regions
//! and run a closure that fills them. A type error does not panic: the builder keeps
//! the first error and [`KernelBuilder::finish`] returns it (front ends built at run
//! time, such as `#[ej_kernel]`, report it to their user). `finish` also verifies the
//! whole kernel.

use crate::infer::infer;
use crate::ir::{
    AxisIndex, BinOp, Block, CmpPred, GridExpr, Kernel, MaskTerm, Op, OpKind, Param, ReduceOp, UnOp, Value,
};
use crate::types::{DType, Type};
use crate::verify::{verify, VerifyError};

/// One axis of a load/store under construction; see [`AxisIndex`].
#[derive(Clone, Copy, Debug)]
pub enum Axis {
    Index(Value),
    Range { start: Value, size: usize, limit: Option<Value> },
}

pub struct KernelBuilder {
    name: String,
    params: Vec<Param>,
    grid: [GridExpr; 3],
    attrs: Vec<(String, String)>,
    values: Vec<Type>,
    /// Open blocks; ops go into the last one.
    stack: Vec<Block>,
    /// The first error, with the source location current when it happened.
    error: Option<(String, Option<&'static str>)>,
    /// Source location of the ops being built (front ends set it: `#[ej_kernel]` to
    /// the `file:line:column` of the DSL expression), reported with errors.
    location: Option<&'static str>,
}

impl KernelBuilder {
    pub fn new(name: &str) -> KernelBuilder {
        KernelBuilder {
            name: name.to_string(),
            params: Vec::new(),
            grid: [GridExpr::Const(1), GridExpr::Const(1), GridExpr::Const(1)],
            attrs: Vec::new(),
            values: Vec::new(),
            stack: vec![Block::default()],
            error: None,
            location: None,
        }
    }

    pub fn param(&mut self, name: &str, ty: Type) -> Value {
        let value = self.new_value(ty.clone());
        self.params.push(Param { name: name.to_string(), value, ty });
        value
    }

    pub fn set_grid(&mut self, grid: [GridExpr; 3]) {
        self.grid = grid;
    }

    pub fn attr(&mut self, key: &str, value: impl ToString) {
        self.attrs.push((key.to_string(), value.to_string()));
    }

    pub fn ty(&self, v: Value) -> &Type {
        &self.values[v.index()]
    }

    fn new_value(&mut self, ty: Type) -> Value {
        self.values.push(ty);
        Value(self.values.len() as u32 - 1)
    }

    /// Record an error (front ends report their own, e.g. an `if` on a tile); the
    /// first one is what [`KernelBuilder::finish`] returns.
    pub fn fail(&mut self, msg: String) {
        if self.error.is_none() {
            self.error = Some((msg, self.location));
        }
    }

    /// Set the source location that errors from now on are reported at.
    pub fn set_location(&mut self, location: &'static str) {
        self.location = Some(location);
    }

    /// Append a non-control op; returns its results.
    pub fn op(&mut self, kind: OpKind, operands: Vec<Value>) -> Vec<Value> {
        let tys: Vec<Type> = operands.iter().map(|v| self.ty(*v).clone()).collect();
        let refs: Vec<&Type> = tys.iter().collect();
        let result_types = match infer(&kind, &refs) {
            Ok(t) => t,
            Err(e) => {
                let msg = format!("`{}`: {e}", kind.name());
                self.fail(msg);
                // Keep building with a placeholder so callers need no error handling
                // at every step; `finish` reports the first error.
                vec![Type::Scalar(DType::F32); result_count(&kind)]
            }
        };
        let results: Vec<Value> = result_types.into_iter().map(|t| self.new_value(t)).collect();
        self.push(Op { kind, operands, results: results.clone(), regions: vec![] });
        results
    }

    fn op1(&mut self, kind: OpKind, operands: Vec<Value>) -> Value {
        self.op(kind, operands)[0]
    }

    fn push(&mut self, op: Op) {
        self.stack.last_mut().expect("builder always has an open block").ops.push(op);
    }

    // ---- program ----
    pub fn program_id(&mut self, axis: u8) -> Value {
        self.op1(OpKind::ProgramId { axis }, vec![])
    }
    pub fn dim(&mut self, tensor: Value, axis: u8) -> Value {
        self.op1(OpKind::TensorDim { axis }, vec![tensor])
    }

    // ---- constants ----
    pub fn constant(&mut self, value: f64, dtype: DType) -> Value {
        self.op1(OpKind::Const { value, dtype }, vec![])
    }
    pub fn const_i32(&mut self, v: i64) -> Value {
        self.constant(v as f64, DType::I32)
    }
    pub fn const_f32(&mut self, v: f64) -> Value {
        self.constant(v, DType::F32)
    }

    // ---- tiles ----
    pub fn arange(&mut self, len: usize) -> Value {
        self.op1(OpKind::Arange { len }, vec![])
    }
    pub fn splat(&mut self, scalar: Value, shape: &[usize]) -> Value {
        self.op1(OpKind::Splat { shape: shape.to_vec() }, vec![scalar])
    }
    /// A tile of `shape` filled with a constant.
    pub fn full(&mut self, value: f64, dtype: DType, shape: &[usize]) -> Value {
        let c = self.constant(value, dtype);
        self.splat(c, shape)
    }
    pub fn expand_dims(&mut self, t: Value, axis: u8) -> Value {
        self.op1(OpKind::ExpandDims { axis }, vec![t])
    }
    pub fn broadcast(&mut self, t: Value, shape: &[usize]) -> Value {
        self.op1(OpKind::Broadcast { shape: shape.to_vec() }, vec![t])
    }

    // ---- memory ----
    pub fn range(&self, start: Value, size: usize, limit: Option<Value>) -> Axis {
        Axis::Range { start, size, limit }
    }
    pub fn index(&self, v: Value) -> Axis {
        Axis::Index(v)
    }

    fn access(axes: &[Axis]) -> (Vec<AxisIndex>, Vec<Value>) {
        let mut kinds = Vec::new();
        let mut operands = Vec::new();
        for a in axes {
            match *a {
                Axis::Index(v) => {
                    kinds.push(AxisIndex::Index);
                    operands.push(v);
                }
                Axis::Range { start, size, limit } => {
                    kinds.push(AxisIndex::Range { size, limit: limit.is_some() });
                    operands.push(start);
                    operands.extend(limit);
                }
            }
        }
        (kinds, operands)
    }

    pub fn load(&mut self, tensor: Value, axes: Vec<Axis>, pad: f64) -> Value {
        let (kinds, idx) = Self::access(&axes);
        let mut operands = vec![tensor];
        operands.extend(idx);
        self.op1(OpKind::Load { axes: kinds, pad }, operands)
    }

    pub fn store(&mut self, tensor: Value, axes: Vec<Axis>, value: Value) {
        self.store_op(tensor, axes, value, false)
    }

    /// `tensor[axes] += value`, atomically (`tile.atomic_add`; f32 tensors): programs
    /// running at the same time may add into the same elements, in no fixed order.
    pub fn atomic_add(&mut self, tensor: Value, axes: Vec<Axis>, value: Value) {
        self.store_op(tensor, axes, value, true)
    }

    fn store_op(&mut self, tensor: Value, axes: Vec<Axis>, value: Value, accumulate: bool) {
        let (kinds, idx) = Self::access(&axes);
        let mut operands = vec![tensor];
        operands.extend(idx);
        operands.push(value);
        self.op(OpKind::Store { axes: kinds, accumulate }, operands);
    }

    // ---- arithmetic ----
    pub fn binary(&mut self, op: BinOp, a: Value, b: Value) -> Value {
        self.op1(OpKind::Binary(op), vec![a, b])
    }
    pub fn add(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Add, a, b)
    }
    pub fn sub(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Sub, a, b)
    }
    pub fn mul(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Mul, a, b)
    }
    pub fn div(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Div, a, b)
    }
    pub fn max(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Max, a, b)
    }
    pub fn min(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Min, a, b)
    }
    pub fn and(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::And, a, b)
    }
    pub fn unary(&mut self, op: UnOp, a: Value) -> Value {
        self.op1(OpKind::Unary(op), vec![a])
    }
    pub fn cmp(&mut self, pred: CmpPred, a: Value, b: Value) -> Value {
        self.op1(OpKind::Cmp(pred), vec![a, b])
    }
    pub fn select(&mut self, cond: Value, a: Value, b: Value) -> Value {
        self.op1(OpKind::Select, vec![cond, a, b])
    }
    pub fn cast(&mut self, a: Value, to: DType) -> Value {
        if self.ty(a).dtype() == to {
            return a;
        }
        self.op1(OpKind::Cast { to }, vec![a])
    }
    pub fn reduce(&mut self, op: ReduceOp, a: Value, axis: u8) -> Value {
        self.op1(OpKind::Reduce { op, axis }, vec![a])
    }
    pub fn dot(&mut self, a: Value, b: Value, acc: Value, trans_a: bool, trans_b: bool) -> Value {
        self.op1(OpKind::Dot { trans_a, trans_b }, vec![a, b, acc])
    }

    // ---- attention ----
    /// `(p, alpha, m_new, l_new)`.
    pub fn softmax_update(&mut self, s: Value, m: Value, l: Value) -> (Value, Value, Value, Value) {
        let r = self.op(OpKind::SoftmaxUpdate, vec![s, m, l]);
        (r[0], r[1], r[2], r[3])
    }
    pub fn softmax_rescale(&mut self, acc: Value, alpha: Value) -> Value {
        self.op1(OpKind::SoftmaxRescale, vec![acc, alpha])
    }
    /// `(o, lse)`.
    pub fn softmax_finalize(&mut self, acc: Value, m: Value, l: Value) -> (Value, Value) {
        let r = self.op(OpKind::SoftmaxFinalize, vec![acc, m, l]);
        (r[0], r[1])
    }
    pub fn mask_apply(&mut self, s: Value, i0: Value, j0: Value, terms: &[(MaskTerm, Value)]) -> Value {
        let mut operands = vec![s, i0, j0];
        operands.extend(terms.iter().map(|t| t.1));
        self.op1(OpKind::MaskApply { terms: terms.iter().map(|t| t.0).collect() }, operands)
    }
    #[allow(clippy::too_many_arguments)] // one per Philox counter/key word, as the op takes them
    pub fn rand_uniform(
        &mut self,
        seed_lo: Value,
        seed_hi: Value,
        batch: Value,
        head: Value,
        row0: Value,
        col0: Value,
        shape: &[usize],
    ) -> Value {
        self.op1(OpKind::RandUniform { shape: shape.to_vec() }, vec![seed_lo, seed_hi, batch, head, row0, col0])
    }

    // ---- control flow ----
    /// `for iv in (lo..hi).step_by(step)` carrying `inits`; `body(b, iv, carried)`
    /// returns the values to carry to the next iteration. Returns the final values.
    pub fn for_loop(
        &mut self,
        lo: Value,
        hi: Value,
        step: Value,
        inits: &[Value],
        body: impl FnOnce(&mut KernelBuilder, Value, &[Value]) -> Vec<Value>,
    ) -> Vec<Value> {
        let iv = self.new_value(Type::Scalar(DType::I32));
        let carried: Vec<Value> = inits
            .iter()
            .map(|v| {
                let t = self.ty(*v).clone();
                self.new_value(t)
            })
            .collect();
        let mut args = vec![iv];
        args.extend(&carried);
        self.stack.push(Block { args, ops: vec![] });
        let yields = body(self, iv, &carried);
        self.yield_values(yields);
        let region = self.stack.pop().expect("region pushed above");
        let results: Vec<Value> = inits
            .iter()
            .map(|v| {
                let t = self.ty(*v).clone();
                self.new_value(t)
            })
            .collect();
        let mut operands = vec![lo, hi, step];
        operands.extend(inits);
        self.push(Op { kind: OpKind::For, operands, results: results.clone(), regions: vec![region] });
        results
    }

    /// `if cond { then } else { otherwise }`; both closures return values of
    /// `result_types`.
    pub fn if_else(
        &mut self,
        cond: Value,
        result_types: &[Type],
        then: impl FnOnce(&mut KernelBuilder) -> Vec<Value>,
        otherwise: impl FnOnce(&mut KernelBuilder) -> Vec<Value>,
    ) -> Vec<Value> {
        self.if_regions(cond, Some(result_types), then, otherwise)
    }

    /// `if cond { then } else { otherwise }` whose result types are those of the values
    /// the `then` branch yields (the DSL's `if` expressions, whose types are only known
    /// once the branch is built).
    pub fn if_else_infer(
        &mut self,
        cond: Value,
        then: impl FnOnce(&mut KernelBuilder) -> Vec<Value>,
        otherwise: impl FnOnce(&mut KernelBuilder) -> Vec<Value>,
    ) -> Vec<Value> {
        self.if_regions(cond, None, then, otherwise)
    }

    fn if_regions(
        &mut self,
        cond: Value,
        result_types: Option<&[Type]>,
        then: impl FnOnce(&mut KernelBuilder) -> Vec<Value>,
        otherwise: impl FnOnce(&mut KernelBuilder) -> Vec<Value>,
    ) -> Vec<Value> {
        self.stack.push(Block::default());
        let y = then(self);
        let result_types: Vec<Type> = match result_types {
            Some(t) => t.to_vec(),
            None => y.iter().map(|v| self.ty(*v).clone()).collect(),
        };
        self.yield_values(y);
        let then_block = self.stack.pop().expect("region pushed above");
        self.stack.push(Block::default());
        let y = otherwise(self);
        self.yield_values(y);
        let else_block = self.stack.pop().expect("region pushed above");
        let results: Vec<Value> = result_types.iter().map(|t| self.new_value(t.clone())).collect();
        self.push(Op {
            kind: OpKind::If,
            operands: vec![cond],
            results: results.clone(),
            regions: vec![then_block, else_block],
        });
        results
    }

    /// Terminate the open region (the verifier checks the yielded types).
    fn yield_values(&mut self, values: Vec<Value>) {
        self.push(Op { kind: OpKind::Yield, operands: values, results: vec![], regions: vec![] });
    }

    /// Finish and verify the kernel.
    pub fn finish(mut self) -> Result<Kernel, VerifyError> {
        if let Some((message, at)) = self.error.take() {
            let location = at.map(|l| l.to_string()).unwrap_or_else(|| "while building".into());
            return Err(VerifyError { kernel: self.name, location, message });
        }
        assert_eq!(self.stack.len(), 1, "unbalanced regions in KernelBuilder");
        let body = self.stack.pop().unwrap_or_default();
        let kernel = Kernel {
            name: self.name,
            params: self.params,
            grid: self.grid,
            attrs: self.attrs,
            body,
            values: self.values,
        };
        verify(&kernel)?;
        Ok(kernel)
    }
}

/// How many results an op kind has (used for placeholders after a type error).
pub fn result_count(kind: &OpKind) -> usize {
    match kind {
        OpKind::Store { .. } | OpKind::Yield => 0,
        OpKind::SoftmaxUpdate => 4,
        OpKind::SoftmaxFinalize | OpKind::MaskKvRange { .. } => 2,
        OpKind::For | OpKind::If => 0,
        _ => 1,
    }
}
