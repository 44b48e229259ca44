//! The interpreter: runs tile IR on host tensors, one program instance at a time.
//!
//! ```
//! use ejc_ir::interp::{launch, Arg};
//! use ejc_ir::parse::parse_kernel;
//! use ejc_ir::tensor::HostTensor;
//! use ejc_ir::types::DType;
//!
//! let k = parse_kernel(r#"kernel @double(%x: tensor<?xf32>) grid(cdiv(n, 4), 1, 1) {
//!   %0 = program.id {axis = 0} : i32
//!   %1 = const 4 : i32
//!   %2 = arith.mul %0, %1 : i32
//!   %3 = tile.load %x[%2 +: 4] {pad = 0.0} : tile<4xf32>
//!   %4 = arith.add %3, %3 : tile<4xf32>
//!   tile.store %x[%2 +: 4], %4
//! }
//! "#).unwrap();
//! let mut args = vec![Arg::Tensor(HostTensor::from_vec(DType::F32, &[6], vec![1., 2., 3., 4., 5., 6.]))];
//! launch(&k, &mut args, [2, 1, 1]).unwrap();
//! assert_eq!(args[0].tensor().unwrap().to_vec(), vec![2., 4., 6., 8., 10., 12.]);
//! ```
//!
//! It is the slow, obviously-correct execution that back ends are compared with:
//! every float op is computed in f64; values are rounded to their element type only
//! where a device would round them (loads of bf16/f16/f32 tensors hold already-rounded
//! values; `arith.cast` and `tile.store` round). Integer ops wrap like the device's.
//! A bad kernel or argument is an [`InterpError`], never a panic.

use std::fmt;
use std::rc::Rc;

use crate::ir::{AxisIndex, BinOp, Block, CmpPred, Kernel, MaskTerm, Op, OpKind, ReduceOp, UnOp, Value};
use crate::philox::philox4x32_10;
use crate::tensor::HostTensor;
use crate::types::{DType, Type};

/// A kernel argument.
#[derive(Clone, Debug)]
pub enum Arg {
    Tensor(HostTensor),
    /// A scalar; integers are given as their value (u32 seeds as 0..2^32).
    Scalar(f64),
}

impl Arg {
    pub fn tensor(&self) -> Option<&HostTensor> {
        match self {
            Arg::Tensor(t) => Some(t),
            Arg::Scalar(_) => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct InterpError {
    pub message: String,
}

impl fmt::Display for InterpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for InterpError {}

fn err<T>(message: String) -> Result<T, InterpError> {
    Err(InterpError { message })
}

/// Run-time value of an SSA value.
#[derive(Clone, Debug)]
enum RVal {
    Scalar(f64),
    /// Row-major elements; the shape is the value's type.
    Tile(Rc<Vec<f64>>),
    /// Index into the argument list.
    Tensor(usize),
}

/// How many times each op ran, by op name (tests use it to see, e.g., that a causal
/// kernel skips the key blocks above the diagonal).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub op_counts: std::collections::BTreeMap<&'static str, u64>,
}

impl Stats {
    pub fn count(&self, op: &str) -> u64 {
        self.op_counts.get(op).copied().unwrap_or(0)
    }
}

/// Run `kernel` over `grid` with `args` in parameter order. Tensor arguments are
/// updated in place by stores.
pub fn launch(kernel: &Kernel, args: &mut [Arg], grid: [usize; 3]) -> Result<(), InterpError> {
    launch_with_stats(kernel, args, grid).map(|_| ())
}

/// [`launch`], also counting executed ops.
pub fn launch_with_stats(kernel: &Kernel, args: &mut [Arg], grid: [usize; 3]) -> Result<Stats, InterpError> {
    if args.len() != kernel.params.len() {
        return err(format!("kernel `{}` takes {} arguments, got {}", kernel.name, kernel.params.len(), args.len()));
    }
    let mut env: Vec<Option<RVal>> = vec![None; kernel.values.len()];
    for (i, (p, a)) in kernel.params.iter().zip(args.iter()).enumerate() {
        match (&p.ty, a) {
            (Type::Tensor(d, r), Arg::Tensor(t)) => {
                if t.dtype != *d || t.rank() != *r {
                    return err(format!(
                        "argument %{} must be a rank-{r} {d} tensor, got a rank-{} {} tensor",
                        p.name,
                        t.rank(),
                        t.dtype
                    ));
                }
                if !t.in_storage() {
                    return err(format!("argument %{}: shape and strides reach outside the tensor's storage", p.name));
                }
                env[p.value.index()] = Some(RVal::Tensor(i));
            }
            (Type::Scalar(d), Arg::Scalar(x)) => env[p.value.index()] = Some(RVal::Scalar(d.round(*x))),
            (t, _) => return err(format!("argument %{} must be a {t}", p.name)),
        }
    }
    let mut m = Machine { kernel, args, env, pid: [0; 3], stats: Stats::default() };
    for z in 0..grid[2] {
        for y in 0..grid[1] {
            for x in 0..grid[0] {
                m.pid = [x, y, z];
                m.block(&kernel.body)?;
            }
        }
    }
    Ok(m.stats)
}

/// The tile shape of an access and, per tile element, the tensor index it touches
/// (None where it falls outside the tensor or past a limit).
/// A tile's shape and its elements' positions in a tensor's data ([`Machine::access_positions`]).
type Access = (Vec<usize>, Vec<Option<usize>>);

struct Machine<'a> {
    kernel: &'a Kernel,
    args: &'a mut [Arg],
    env: Vec<Option<RVal>>,
    pid: [usize; 3],
    stats: Stats,
}

impl<'a> Machine<'a> {
    fn ty(&self, v: Value) -> &'a Type {
        self.kernel.ty(v)
    }

    fn get(&self, v: Value) -> Result<&RVal, InterpError> {
        self.env[v.index()]
            .as_ref()
            .ok_or_else(|| InterpError { message: format!("value #{} used before definition", v.0) })
    }

    fn scalar(&self, v: Value) -> Result<f64, InterpError> {
        match self.get(v)? {
            RVal::Scalar(x) => Ok(*x),
            _ => err(format!("value #{} is not a scalar", v.0)),
        }
    }

    fn int(&self, v: Value) -> Result<i64, InterpError> {
        Ok(self.scalar(v)? as i64)
    }

    /// Elements of a scalar or tile value, broadcast to `shape` (same rank or scalar).
    fn elems(&self, v: Value, shape: &[usize]) -> Result<Rc<Vec<f64>>, InterpError> {
        let vshape = self.ty(v).shape().to_vec();
        match self.get(v)? {
            RVal::Scalar(x) => Ok(Rc::new(vec![*x; shape.iter().product()])),
            RVal::Tile(data) if vshape == shape => Ok(data.clone()),
            RVal::Tile(data) => {
                // Broadcast size-1 axes (rank <= 2).
                let n: usize = shape.iter().product();
                let mut out = Vec::with_capacity(n);
                let cols = if shape.len() == 2 { shape[1] } else { 1 };
                for e in 0..n {
                    let (r, c) = if shape.len() == 2 { (e / cols, e % cols) } else { (e, 0) };
                    let idx = if vshape.len() == 2 {
                        let rr = if vshape[0] == 1 { 0 } else { r };
                        let cc = if vshape[1] == 1 { 0 } else { c };
                        rr * vshape[1] + cc
                    } else if vshape[0] == 1 {
                        0
                    } else {
                        r
                    };
                    out.push(data[idx]);
                }
                Ok(Rc::new(out))
            }
            RVal::Tensor(_) => err(format!("value #{} is a tensor, not a tile", v.0)),
        }
    }

    fn set(&mut self, v: Value, val: RVal) {
        self.env[v.index()] = Some(val);
    }

    fn set_elems(&mut self, v: Value, data: Vec<f64>) {
        let d = self.ty(v).dtype();
        let round = d.is_int() || d.is_bool();
        let data: Vec<f64> = if round { data.into_iter().map(|x| d.round(x)).collect() } else { data };
        if self.ty(v).is_scalar() {
            self.set(v, RVal::Scalar(data[0]));
        } else {
            self.set(v, RVal::Tile(Rc::new(data)));
        }
    }

    fn tensor(&self, v: Value) -> Result<usize, InterpError> {
        match self.get(v)? {
            RVal::Tensor(i) => Ok(*i),
            _ => err(format!("value #{} is not a tensor", v.0)),
        }
    }

    fn block(&mut self, b: &Block) -> Result<(), InterpError> {
        for op in &b.ops {
            self.op(op).map_err(|e| InterpError { message: format!("`{}`: {}", op.kind.name(), e.message) })?;
        }
        Ok(())
    }

    /// Run a region and return the values of its `scf.yield`.
    fn region(&mut self, b: &Block) -> Result<Vec<RVal>, InterpError> {
        let n = b.ops.len();
        for op in &b.ops[..n.saturating_sub(1)] {
            self.op(op).map_err(|e| InterpError { message: format!("`{}`: {}", op.kind.name(), e.message) })?;
        }
        match b.ops.last() {
            Some(Op { kind: OpKind::Yield, operands, .. }) => operands.iter().map(|v| self.get(*v).cloned()).collect(),
            _ => err("region does not end in scf.yield".into()),
        }
    }

    fn op(&mut self, op: &Op) -> Result<(), InterpError> {
        use OpKind::*;
        *self.stats.op_counts.entry(op.kind.name()).or_insert(0) += 1;
        let res = |i: usize| op.results[i];
        match &op.kind {
            ProgramId { axis } => self.set(res(0), RVal::Scalar(self.pid[*axis as usize] as f64)),
            TensorDim { axis } => {
                let t = self.tensor(op.operands[0])?;
                let n = self.args[t].tensor().map(|t| t.shape[*axis as usize]).unwrap_or(0);
                self.set(res(0), RVal::Scalar(DType::I32.round(n as f64)));
            }
            Const { value, dtype } => self.set(res(0), RVal::Scalar(dtype.round(*value))),
            Arange { len } => self.set(res(0), RVal::Tile(Rc::new((0..*len).map(|i| i as f64).collect()))),
            Splat { shape } => {
                let x = self.scalar(op.operands[0])?;
                self.set(res(0), RVal::Tile(Rc::new(vec![x; shape.iter().product()])));
            }
            ExpandDims { .. } => {
                let v = self.get(op.operands[0])?.clone();
                self.set(res(0), v);
            }
            Broadcast { shape } => {
                let d = self.elems(op.operands[0], shape)?;
                self.set(res(0), RVal::Tile(d));
            }
            Load { axes, pad } => self.load(op, axes, *pad)?,
            Store { axes, accumulate } => self.store(op, axes, *accumulate)?,
            Binary(b) => {
                let shape = self.ty(res(0)).shape().to_vec();
                let dt = self.ty(res(0)).dtype();
                let a = self.elems(op.operands[0], &shape)?;
                let c = self.elems(op.operands[1], &shape)?;
                let mut out = Vec::with_capacity(a.len());
                for (x, y) in a.iter().zip(c.iter()) {
                    out.push(binary(*b, dt, *x, *y)?);
                }
                self.set_elems(res(0), out);
            }
            Unary(u) => {
                let shape = self.ty(res(0)).shape().to_vec();
                let dt = self.ty(res(0)).dtype();
                let a = self.elems(op.operands[0], &shape)?;
                let out = a.iter().map(|x| unary(*u, dt, *x)).collect();
                self.set_elems(res(0), out);
            }
            Cmp(p) => {
                let shape = self.ty(res(0)).shape().to_vec();
                let a = self.elems(op.operands[0], &shape)?;
                let b = self.elems(op.operands[1], &shape)?;
                let out = a
                    .iter()
                    .zip(b.iter())
                    .map(|(x, y)| {
                        let r = match p {
                            CmpPred::Lt => x < y,
                            CmpPred::Le => x <= y,
                            CmpPred::Gt => x > y,
                            CmpPred::Ge => x >= y,
                            CmpPred::Eq => x == y,
                            CmpPred::Ne => x != y,
                        };
                        r as u8 as f64
                    })
                    .collect();
                self.set_elems(res(0), out);
            }
            Select => {
                let shape = self.ty(res(0)).shape().to_vec();
                let c = self.elems(op.operands[0], &shape)?;
                let a = self.elems(op.operands[1], &shape)?;
                let b = self.elems(op.operands[2], &shape)?;
                let out =
                    c.iter().zip(a.iter().zip(b.iter())).map(|(c, (a, b))| if *c != 0.0 { *a } else { *b }).collect();
                self.set_elems(res(0), out);
            }
            Cast { to } => {
                let shape = self.ty(res(0)).shape().to_vec();
                let from = self.ty(op.operands[0]).dtype();
                let a = self.elems(op.operands[0], &shape)?;
                let out: Vec<f64> = a.iter().map(|x| cast(from, *to, *x)).collect();
                self.set(res(0), if shape.is_empty() { RVal::Scalar(out[0]) } else { RVal::Tile(Rc::new(out)) });
            }
            Reduce { op: r, axis } => {
                let in_shape = self.ty(op.operands[0]).shape().to_vec();
                let a = self.elems(op.operands[0], &in_shape)?;
                let (rows, cols) = if in_shape.len() == 2 { (in_shape[0], in_shape[1]) } else { (1, in_shape[0]) };
                let init = match r {
                    ReduceOp::Sum => 0.0,
                    ReduceOp::Max => f64::NEG_INFINITY,
                    ReduceOp::Min => f64::INFINITY,
                };
                let fold = |acc: f64, x: f64| match r {
                    ReduceOp::Sum => acc + x,
                    ReduceOp::Max => {
                        if x.is_nan() || acc.is_nan() {
                            f64::NAN
                        } else {
                            acc.max(x)
                        }
                    }
                    ReduceOp::Min => {
                        if x.is_nan() || acc.is_nan() {
                            f64::NAN
                        } else {
                            acc.min(x)
                        }
                    }
                };
                let out: Vec<f64> = if in_shape.len() == 1 || *axis == 1 {
                    (0..rows).map(|i| (0..cols).fold(init, |acc, j| fold(acc, a[i * cols + j]))).collect()
                } else {
                    (0..cols).map(|j| (0..rows).fold(init, |acc, i| fold(acc, a[i * cols + j]))).collect()
                };
                self.set_elems(res(0), out);
            }
            Dot { trans_a, trans_b } => {
                let sa = self.ty(op.operands[0]).shape().to_vec();
                let sb = self.ty(op.operands[1]).shape().to_vec();
                let sc = self.ty(op.operands[2]).shape().to_vec();
                let a = self.elems(op.operands[0], &sa)?;
                let b = self.elems(op.operands[1], &sb)?;
                let c = self.elems(op.operands[2], &sc)?;
                let (m, n) = (sc[0], sc[1]);
                let k = if *trans_a { sa[0] } else { sa[1] };
                // Rows of A and columns of B as contiguous [m, k] and [n, k] slices; each
                // sum still runs in p order from c (the same bits as a plain triple loop).
                let rows_a: Vec<f64> = if *trans_a {
                    (0..m).flat_map(|i| (0..k).map(move |p| (i, p))).map(|(i, p)| a[p * sa[1] + i]).collect()
                } else {
                    a.to_vec()
                };
                let cols_b: Vec<f64> = if *trans_b {
                    b.to_vec()
                } else {
                    (0..n).flat_map(|j| (0..k).map(move |p| (j, p))).map(|(j, p)| b[p * sb[1] + j]).collect()
                };
                let mut out = vec![0.0; m * n];
                for i in 0..m {
                    let ra = &rows_a[i * k..(i + 1) * k];
                    for j in 0..n {
                        let cb = &cols_b[j * k..(j + 1) * k];
                        out[i * n + j] = ra.iter().zip(cb).fold(c[i * n + j], |s, (x, y)| s + x * y);
                    }
                }
                self.set_elems(res(0), out);
            }
            SoftmaxUpdate => {
                let ss = self.ty(op.operands[0]).shape().to_vec();
                let (mm, nn) = (ss[0], ss[1]);
                let s = self.elems(op.operands[0], &ss)?;
                let m = self.elems(op.operands[1], &[mm])?;
                let l = self.elems(op.operands[2], &[mm])?;
                // The scale operand (`scale-fold`): m_new = max(m, c·rowmax(s)), p = exp2(c·s − m_new).
                let c = match op.operands.get(3) {
                    Some(c) => Some(self.scalar(*c)?),
                    None => None,
                };
                let mut p = vec![0.0; mm * nn];
                let mut alpha = vec![1.0; mm];
                let mut m_new = vec![0.0; mm];
                let mut l_new = vec![0.0; mm];
                for i in 0..mm {
                    let row = &s[i * nn..(i + 1) * nn];
                    let mx = match c {
                        None => row.iter().fold(m[i], |a, &x| if x > a { x } else { a }),
                        Some(c) => {
                            let raw = row.iter().fold(f64::NEG_INFINITY, |a, &x| if x > a { x } else { a });
                            let scaled = c * raw;
                            if scaled > m[i] {
                                scaled
                            } else {
                                m[i]
                            }
                        }
                    };
                    m_new[i] = mx;
                    if mx == f64::NEG_INFINITY {
                        // Nothing visible yet: p = 0, keep acc/l as they are.
                        alpha[i] = 1.0;
                        l_new[i] = l[i];
                        continue;
                    }
                    alpha[i] = (m[i] - mx).exp2();
                    let mut sum = 0.0;
                    for j in 0..nn {
                        let x = match c {
                            None => row[j],
                            Some(c) => c * row[j],
                        };
                        let e = (x - mx).exp2();
                        p[i * nn + j] = e;
                        sum += e;
                    }
                    l_new[i] = l[i] * alpha[i] + sum;
                }
                self.set_elems(res(0), p);
                self.set_elems(res(1), alpha);
                self.set_elems(res(2), m_new);
                self.set_elems(res(3), l_new);
            }
            SoftmaxRescale => {
                let sa = self.ty(op.operands[0]).shape().to_vec();
                let acc = self.elems(op.operands[0], &sa)?;
                let alpha = self.elems(op.operands[1], &[sa[0]])?;
                let out = (0..acc.len()).map(|e| acc[e] * alpha[e / sa[1]]).collect();
                self.set_elems(res(0), out);
            }
            SoftmaxFinalize => {
                let sa = self.ty(op.operands[0]).shape().to_vec();
                let acc = self.elems(op.operands[0], &sa)?;
                let m = self.elems(op.operands[1], &[sa[0]])?;
                let l = self.elems(op.operands[2], &[sa[0]])?;
                let o = (0..acc.len())
                    .map(|e| {
                        let li = l[e / sa[1]];
                        if li == 0.0 {
                            0.0
                        } else {
                            acc[e] / li
                        }
                    })
                    .collect();
                let lse = (0..sa[0])
                    .map(
                        |i| if l[i] == 0.0 { f64::NEG_INFINITY } else { (m[i] + l[i].log2()) * std::f64::consts::LN_2 },
                    )
                    .collect();
                self.set_elems(res(0), o);
                self.set_elems(res(1), lse);
            }
            MaskApply { terms } => {
                let ss = self.ty(op.operands[0]).shape().to_vec();
                let s = self.elems(op.operands[0], &ss)?;
                let i0 = self.int(op.operands[1])?;
                let j0 = self.int(op.operands[2])?;
                let xs: Vec<i64> = op.operands[3..].iter().map(|v| self.int(*v)).collect::<Result<_, _>>()?;
                let mut out = s.as_ref().clone();
                for r in 0..ss[0] {
                    for c in 0..ss[1] {
                        if !mask_holds(terms, &xs, i0 + r as i64, j0 + c as i64) {
                            out[r * ss[1] + c] = f64::NEG_INFINITY;
                        }
                    }
                }
                self.set_elems(res(0), out);
            }
            MaskBlockFull { terms, bm, bn } => {
                let i0 = self.int(op.operands[0])?;
                let j0 = self.int(op.operands[1])?;
                let xs: Vec<i64> = op.operands[2..].iter().map(|v| self.int(*v)).collect::<Result<_, _>>()?;
                let full = block_full(terms, &xs, i0, j0, *bm as i64, *bn as i64);
                self.set(res(0), RVal::Scalar(full as u8 as f64));
            }
            MaskKvRange { terms, bm, bn } => {
                let i0 = self.int(op.operands[0])?;
                let xs: Vec<i64> = op.operands[1..].iter().map(|v| self.int(*v)).collect::<Result<_, _>>()?;
                let (lo, hi) = kv_range(terms, &xs, i0, *bm as i64, *bn as i64);
                self.set(res(0), RVal::Scalar(lo as f64));
                self.set(res(1), RVal::Scalar(hi as f64));
            }
            RandUniform { shape } => {
                let v: Vec<i64> = op.operands.iter().map(|v| self.int(*v)).collect::<Result<_, _>>()?;
                let key = [v[0] as u32, v[1] as u32];
                let mut out = Vec::with_capacity(shape[0] * shape[1]);
                for r in 0..shape[0] {
                    for c in 0..shape[1] {
                        let ctr = [(v[4] + r as i64) as u32, (v[5] + c as i64) as u32, v[3] as u32, v[2] as u32];
                        let x = philox4x32_10(ctr, key)[0];
                        out.push((x >> 8) as f64 * (1.0 / 16777216.0));
                    }
                }
                self.set_elems(res(0), out);
            }
            For => {
                let lo = self.int(op.operands[0])?;
                let hi = self.int(op.operands[1])?;
                let step = self.int(op.operands[2])?;
                if step <= 0 {
                    return err(format!("loop step must be positive, got {step}"));
                }
                let mut carried: Vec<RVal> =
                    op.operands[3..].iter().map(|v| self.get(*v).cloned()).collect::<Result<_, _>>()?;
                let body = &op.regions[0];
                let mut iv = lo;
                while iv < hi {
                    self.set(body.args[0], RVal::Scalar(iv as f64));
                    for (a, v) in body.args[1..].iter().zip(carried.drain(..)) {
                        self.set(*a, v);
                    }
                    carried = self.region(body)?;
                    iv += step;
                }
                for (r, v) in op.results.iter().zip(carried) {
                    self.set(*r, v);
                }
            }
            If => {
                let c = self.scalar(op.operands[0])?;
                let vals = self.region(&op.regions[if c != 0.0 { 0 } else { 1 }])?;
                for (r, v) in op.results.iter().zip(vals) {
                    self.set(*r, v);
                }
            }
            Yield => return err("scf.yield outside a region".into()),
        }
        Ok(())
    }

    /// For each tile element, the tensor multi-index it touches, or None when it is
    /// outside the tensor or past a range limit.
    /// Where each element of a load's or store's tile lives in `t`'s data (row-major over
    /// the tile), or `None` where it falls outside the tensor or past a range's limit.
    fn access_positions(&self, t: &HostTensor, axes: &[AxisIndex], operands: &[Value]) -> Result<Access, InterpError> {
        let mut it = operands.iter();
        let mut base = t.offset as isize;
        let mut inside = true;
        // (start, limit, stride, extent) per range axis, outermost first.
        let mut ranges: Vec<(i64, i64, isize, usize)> = Vec::new();
        let mut tile_shape = Vec::new();
        for (ax, a) in axes.iter().enumerate() {
            let start = self.int(*it.next().ok_or_else(|| InterpError { message: "missing index operand".into() })?)?;
            let extent = t.shape[ax] as i64;
            match a {
                AxisIndex::Index => {
                    if start < 0 || start >= extent {
                        inside = false;
                    } else {
                        base += start as isize * t.strides[ax];
                    }
                }
                AxisIndex::Range { size, limit } => {
                    // Valid indices: [0, extent), and below the limit when there is one.
                    let end = if *limit {
                        let l = self
                            .int(*it.next().ok_or_else(|| InterpError { message: "missing limit operand".into() })?)?;
                        l.min(extent)
                    } else {
                        extent
                    };
                    ranges.push((start, end, t.strides[ax], *size));
                    tile_shape.push(*size);
                }
            }
        }
        let n: usize = tile_shape.iter().product();
        let at = |r: &(i64, i64, isize, usize), i: usize| -> Option<isize> {
            let x = r.0 + i as i64;
            (x >= 0 && x < r.1).then_some(x as isize * r.2)
        };
        let mut out = Vec::with_capacity(n);
        if !inside {
            out.resize(n.max(1), None);
        } else {
            match ranges.as_slice() {
                [] => out.push(Some(base as usize)),
                [r] => out.extend((0..r.3).map(|i| at(r, i).map(|o| (base + o) as usize))),
                [r0, r1] => {
                    for i in 0..r0.3 {
                        match at(r0, i) {
                            None => out.extend(std::iter::repeat_n(None, r1.3)),
                            Some(o0) => out.extend((0..r1.3).map(|j| at(r1, j).map(|o1| (base + o0 + o1) as usize))),
                        }
                    }
                }
                _ => return err(format!("a tile of {} axes is not supported by the interpreter", ranges.len())),
            }
        }
        Ok((tile_shape, out))
    }

    fn load(&mut self, op: &Op, axes: &[AxisIndex], pad: f64) -> Result<(), InterpError> {
        let ti = self.tensor(op.operands[0])?;
        let Arg::Tensor(t) = &self.args[ti] else { return err("not a tensor".into()) };
        let (shape, idx) = self.access_positions(t, axes, &op.operands[1..])?;
        let pad = t.dtype.round(pad);
        let data: Vec<f64> = idx.iter().map(|p| p.map_or(pad, |p| t.data[p])).collect();
        if shape.is_empty() {
            self.set(op.results[0], RVal::Scalar(data[0]));
        } else {
            self.set(op.results[0], RVal::Tile(Rc::new(data)));
        }
        Ok(())
    }

    fn store(&mut self, op: &Op, axes: &[AxisIndex], accumulate: bool) -> Result<(), InterpError> {
        let ti = self.tensor(op.operands[0])?;
        let n = op.operands.len();
        let value = op.operands[n - 1];
        let vshape = self.ty(value).shape().to_vec();
        let data = self.elems(value, &vshape)?;
        let Arg::Tensor(t) = &self.args[ti] else { return err("not a tensor".into()) };
        let (_, idx) = self.access_positions(t, axes, &op.operands[1..n - 1])?;
        let Arg::Tensor(t) = &mut self.args[ti] else { return err("not a tensor".into()) };
        for (x, p) in data.iter().zip(idx) {
            if let Some(p) = p {
                // Programs run one after another here: an atomic add is a plain one
                // (rounded to the tensor's f32 as the device's is).
                let x = if accumulate { t.data[p] + *x } else { *x };
                t.data[p] = t.dtype.round(x);
            }
        }
        Ok(())
    }
}

fn cast(from: DType, to: DType, x: f64) -> f64 {
    if from.is_bool() {
        return to.round(if x != 0.0 { 1.0 } else { 0.0 });
    }
    to.round(x)
}

fn binary(op: BinOp, dt: DType, x: f64, y: f64) -> Result<f64, InterpError> {
    if dt.is_float() {
        return Ok(match op {
            BinOp::Add => x + y,
            BinOp::Sub => x - y,
            BinOp::Mul => x * y,
            BinOp::Div => x / y,
            // NaN-propagating, as the device's max/min are for attention's purposes.
            BinOp::Max => {
                if x.is_nan() || y.is_nan() {
                    f64::NAN
                } else {
                    x.max(y)
                }
            }
            BinOp::Min => {
                if x.is_nan() || y.is_nan() {
                    f64::NAN
                } else {
                    x.min(y)
                }
            }
            _ => return err(format!("{op:?} on {dt}")),
        });
    }
    // Integers and i1: exact in i64, wrapped by the caller's rounding.
    let (a, b) = (x as i64, y as i64);
    let bits = |v: i64| -> u64 {
        if dt == DType::U32 {
            v as u32 as u64
        } else {
            v as i32 as i64 as u64
        }
    };
    Ok(match op {
        BinOp::Add => (a + b) as f64,
        BinOp::Sub => (a - b) as f64,
        BinOp::Mul => a.wrapping_mul(b) as f64,
        BinOp::Div | BinOp::Rem => {
            if b == 0 {
                return err("integer division by zero".into());
            }
            if op == BinOp::Div {
                (a / b) as f64
            } else {
                (a % b) as f64
            }
        }
        BinOp::Max => a.max(b) as f64,
        BinOp::Min => a.min(b) as f64,
        BinOp::And => (a & b) as f64,
        BinOp::Or => (a | b) as f64,
        BinOp::Xor => (a ^ b) as f64,
        BinOp::Shl => ((bits(a) << (b & 31)) as u32) as f64,
        BinOp::Shr => {
            if dt == DType::U32 {
                ((a as u32) >> (b & 31)) as f64
            } else {
                ((a as i32) >> (b & 31)) as f64
            }
        }
        BinOp::MulHi => {
            if dt == DType::U32 {
                (((a as u32 as u64) * (b as u32 as u64)) >> 32) as f64
            } else {
                (((a as i32 as i64) * (b as i32 as i64)) >> 32) as f64
            }
        }
    })
}

fn unary(op: UnOp, dt: DType, x: f64) -> f64 {
    match op {
        UnOp::Neg => -x,
        UnOp::Abs => x.abs(),
        UnOp::Exp => x.exp(),
        UnOp::Exp2 => x.exp2(),
        UnOp::Log => x.ln(),
        UnOp::Log2 => x.log2(),
        UnOp::Tanh => x.tanh(),
        UnOp::Sqrt => x.sqrt(),
        UnOp::Rsqrt => 1.0 / x.sqrt(),
        UnOp::Not => {
            if dt.is_bool() {
                (x == 0.0) as u8 as f64
            } else {
                !(x as i64) as f64
            }
        }
    }
}

/// Does every term hold at (i, j)?
pub fn mask_holds(terms: &[MaskTerm], xs: &[i64], i: i64, j: i64) -> bool {
    terms.iter().zip(xs).all(|(t, &x)| match t {
        MaskTerm::ColLeRow => j <= i + x,
        MaskTerm::ColGeRow => j >= i + x,
        MaskTerm::ColLt => j < x,
        MaskTerm::ColGe => j >= x,
        MaskTerm::RowLt => i < x,
    })
}

/// The rows of a block that matter: `[i0, i0 + bm)` cut at every `row_lt` bound.
fn care_rows(terms: &[MaskTerm], xs: &[i64], i0: i64, bm: i64) -> (i64, i64) {
    let mut hi = i0 + bm - 1;
    for (t, &x) in terms.iter().zip(xs) {
        if *t == MaskTerm::RowLt {
            hi = hi.min(x - 1);
        }
    }
    (i0, hi)
}

/// `mask.block_full`: every term holds on every cared-for element of the block.
pub fn block_full(terms: &[MaskTerm], xs: &[i64], i0: i64, j0: i64, bm: i64, bn: i64) -> bool {
    let (ilo, ihi) = care_rows(terms, xs, i0, bm);
    if ihi < ilo {
        return true;
    }
    let (jlo, jhi) = (j0, j0 + bn - 1);
    terms.iter().zip(xs).all(|(t, &x)| match t {
        MaskTerm::ColLeRow => jhi <= ilo + x,
        MaskTerm::ColGeRow => jlo >= ihi + x,
        MaskTerm::ColLt => jhi < x,
        MaskTerm::ColGe => jlo >= x,
        MaskTerm::RowLt => true,
    })
}

/// `mask.kv_range`: `[lo, hi)` with lo a multiple of bn, lo >= 0.
pub fn kv_range(terms: &[MaskTerm], xs: &[i64], i0: i64, bm: i64, bn: i64) -> (i64, i64) {
    let (ilo, ihi) = care_rows(terms, xs, i0, bm);
    if ihi < ilo {
        return (0, 0);
    }
    let mut lo = 0i64;
    let mut hi = i32::MAX as i64;
    for (t, &x) in terms.iter().zip(xs) {
        match t {
            MaskTerm::ColLeRow => hi = hi.min(ihi + x + 1),
            MaskTerm::ColGeRow => lo = lo.max(ilo + x),
            MaskTerm::ColLt => hi = hi.min(x),
            MaskTerm::ColGe => lo = lo.max(x),
            MaskTerm::RowLt => {}
        }
    }
    // Both are i32 values: operands near the i32 limits can put the exact bounds
    // outside that range, where clamping changes no answer (nothing visible there).
    let lo = lo.min(i32::MAX as i64);
    (lo.div_euclid(bn) * bn, hi.max(i32::MIN as i64))
}

/// Evaluate a scalar element-wise op on constant operands exactly as the interpreter
/// would (the canonicalizer folds with it). None when the op is not foldable here
/// (not element-wise, an integer division by zero, or a float on either side: the
/// interpreter computes floats in f64 and a device in f32, so a folded float
/// constant could match neither).
pub fn fold_scalar(kind: &OpKind, args: &[(f64, DType)], out: DType) -> Option<f64> {
    if out.is_float() || args.iter().any(|a| a.1.is_float()) {
        return None;
    }
    let v = match kind {
        OpKind::Binary(b) => binary(*b, out, args[0].0, args[1].0).ok()?,
        OpKind::Unary(u) => unary(*u, out, args[0].0),
        OpKind::Cmp(p) => {
            let (x, y) = (args[0].0, args[1].0);
            let r = match p {
                CmpPred::Lt => x < y,
                CmpPred::Le => x <= y,
                CmpPred::Gt => x > y,
                CmpPred::Ge => x >= y,
                CmpPred::Eq => x == y,
                CmpPred::Ne => x != y,
            };
            r as u8 as f64
        }
        OpKind::Select => {
            if args[0].0 != 0.0 {
                args[1].0
            } else {
                args[2].0
            }
        }
        OpKind::Cast { to } => cast(args[0].1, *to, args[0].0),
        _ => return None,
    };
    Some(out.round(v))
}
