//! The tile IR data structures: kernels, blocks, ops and SSA values.
//!
//! ```
//! use ejc_ir::builder::KernelBuilder;
//! use ejc_ir::ir::GridExpr;
//! use ejc_ir::types::{DType, Type};
//!
//! let mut b = KernelBuilder::new("axpy");
//! let x = b.param("x", Type::Tensor(DType::F32, 1));
//! let y = b.param("y", Type::Tensor(DType::F32, 1));
//! let a = b.param("a", Type::Scalar(DType::F32));
//! b.set_grid([GridExpr::cdiv(GridExpr::sym("n"), 64), GridExpr::Const(1), GridExpr::Const(1)]);
//! let pid = b.program_id(0);
//! let c64 = b.const_i32(64);
//! let start = b.mul(pid, c64);
//! let xs = b.load(x, vec![b.range(start, 64, None)], 0.0);
//! let ys = b.load(y, vec![b.range(start, 64, None)], 0.0);
//! let ax = b.mul(a, xs);
//! let r = b.add(ax, ys);
//! b.store(y, vec![b.range(start, 64, None)], r);
//! let kernel = b.finish().unwrap(); // verified
//! assert_eq!(kernel.params.len(), 3);
//! ```
//!
//! The IR is a tree of [`Block`]s: each [`Op`] has operands and results (SSA value ids
//! whose types live in [`Kernel::values`]) and, for structured control flow, nested
//! regions. An op's attributes live in its [`OpKind`]; its operands are always a flat
//! list so that generic passes (DCE, CSE, renaming) can walk them without knowing the
//! op.

use std::fmt;

use crate::types::{DType, Type};

/// An SSA value: an index into [`Kernel::values`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Value(pub u32);

impl Value {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A kernel parameter: a tensor in memory or a run-time scalar.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    pub name: String,
    pub value: Value,
    pub ty: Type,
}

/// A size formula over named run-time quantities: a launch-grid extent (for flash:
/// `cdiv(seq_q, 64)`, `heads_q`, `batch`), or the extent of a plan's temporary. The
/// names are the call's sizes, which the operation computes (docs/abi.md lists them per
/// operation), and the configuration's values. The manifest writes formulas as text
/// ([`fmt::Display`]) and launchers read them back ([`GridExpr::parse`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GridExpr {
    Const(i64),
    Sym(String),
    /// ceil(a / b), b > 0.
    CeilDiv(Box<GridExpr>, i64),
    /// ceil(a / b) for a formula `b` (e.g. a tile size of the configuration), which must
    /// be positive when evaluated.
    CeilDivBy(Box<GridExpr>, Box<GridExpr>),
    Mul(Box<GridExpr>, Box<GridExpr>),
    Add(Box<GridExpr>, Box<GridExpr>),
    Max(Box<GridExpr>, Box<GridExpr>),
}

impl GridExpr {
    pub fn sym(s: &str) -> GridExpr {
        GridExpr::Sym(s.to_string())
    }

    pub fn cdiv(a: GridExpr, b: i64) -> GridExpr {
        GridExpr::CeilDiv(Box::new(a), b)
    }

    pub fn times(a: GridExpr, b: GridExpr) -> GridExpr {
        GridExpr::Mul(Box::new(a), Box::new(b))
    }

    pub fn plus(a: GridExpr, b: GridExpr) -> GridExpr {
        GridExpr::Add(Box::new(a), Box::new(b))
    }

    pub fn max_of(a: GridExpr, b: GridExpr) -> GridExpr {
        GridExpr::Max(Box::new(a), Box::new(b))
    }

    /// Evaluate with `lookup` giving each symbol's value. Overflow is an error, never a
    /// wrapped value.
    pub fn eval(&self, lookup: &dyn Fn(&str) -> Option<i64>) -> Result<i64, String> {
        let overflow = || format!("`{self}` overflows 64 bits");
        Ok(match self {
            GridExpr::Const(c) => *c,
            GridExpr::Sym(s) => lookup(s).ok_or_else(|| format!("size `{s}` has no value"))?,
            GridExpr::CeilDiv(a, b) => {
                let a = a.eval(lookup)?;
                a.checked_add(b - 1).ok_or_else(overflow)?.div_euclid(*b)
            }
            GridExpr::CeilDivBy(a, b) => {
                let (a, d) = (a.eval(lookup)?, b.eval(lookup)?);
                if d <= 0 {
                    return Err(format!("`{self}` divides by {b} = {d}, which is not positive"));
                }
                a.checked_add(d - 1).ok_or_else(overflow)?.div_euclid(d)
            }
            GridExpr::Mul(a, b) => a.eval(lookup)?.checked_mul(b.eval(lookup)?).ok_or_else(overflow)?,
            GridExpr::Add(a, b) => a.eval(lookup)?.checked_add(b.eval(lookup)?).ok_or_else(overflow)?,
            GridExpr::Max(a, b) => a.eval(lookup)?.max(b.eval(lookup)?),
        })
    }

    /// Evaluate with the values of a name → value map.
    pub fn eval_in(&self, values: &std::collections::BTreeMap<String, i64>) -> Result<i64, String> {
        self.eval(&|s| values.get(s).copied())
    }

    /// Symbols the formula uses.
    pub fn symbols(&self, out: &mut Vec<String>) {
        match self {
            GridExpr::Const(_) => {}
            GridExpr::Sym(s) => {
                if !out.contains(s) {
                    out.push(s.clone())
                }
            }
            GridExpr::CeilDiv(a, _) => a.symbols(out),
            GridExpr::Mul(a, b) | GridExpr::Add(a, b) | GridExpr::Max(a, b) | GridExpr::CeilDivBy(a, b) => {
                a.symbols(out);
                b.symbols(out)
            }
        }
    }

    /// Read a formula back from its text form (`cdiv(seq_q, 64)`, `mul(batch, 4)`,
    /// `add(a, b)`, `max(a, 1)`, a symbol or an integer).
    pub fn parse(text: &str) -> Result<GridExpr, String> {
        struct P<'a> {
            s: &'a [u8],
            i: usize,
            text: &'a str,
            /// Function calls open now: the parse recurses on each, so a formula nested
            /// thousands deep (a hand-edited manifest) would overflow the stack.
            depth: usize,
        }
        const MAX_NESTING: usize = 64;
        impl P<'_> {
            fn ws(&mut self) {
                while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
                    self.i += 1;
                }
            }
            fn err(&self, what: &str) -> String {
                format!("size formula `{}`: {what} at offset {}", self.text, self.i)
            }
            fn eat(&mut self, c: u8) -> Result<(), String> {
                self.ws();
                if self.s.get(self.i) == Some(&c) {
                    self.i += 1;
                    Ok(())
                } else {
                    Err(self.err(&format!("expected `{}`", c as char)))
                }
            }
            fn word(&mut self) -> &str {
                self.ws();
                let start = self.i;
                while self.i < self.s.len()
                    && (self.s[self.i].is_ascii_alphanumeric() || self.s[self.i] == b'_' || self.s[self.i] == b'-')
                {
                    self.i += 1;
                }
                std::str::from_utf8(&self.s[start..self.i]).unwrap_or_default()
            }
            fn expr(&mut self) -> Result<GridExpr, String> {
                let w = self.word().to_string();
                if w.is_empty() {
                    return Err(self.err("expected a formula"));
                }
                if let Ok(n) = w.parse::<i64>() {
                    return Ok(GridExpr::Const(n));
                }
                self.ws();
                if self.s.get(self.i) != Some(&b'(') {
                    return Ok(GridExpr::Sym(w));
                }
                if self.depth >= MAX_NESTING {
                    return Err(self.err(&format!("formula nested more than {MAX_NESTING} calls deep")));
                }
                self.depth += 1;
                self.eat(b'(')?;
                let a = self.expr()?;
                self.eat(b',')?;
                let e = if w == "cdiv" {
                    match self.expr()? {
                        GridExpr::Const(b) if b > 0 => GridExpr::cdiv(a, b),
                        GridExpr::Const(_) => return Err(self.err("cdiv's divisor must be positive")),
                        b => GridExpr::CeilDivBy(Box::new(a), Box::new(b)),
                    }
                } else {
                    let b = self.expr()?;
                    match w.as_str() {
                        "mul" => GridExpr::times(a, b),
                        "add" => GridExpr::plus(a, b),
                        "max" => GridExpr::max_of(a, b),
                        other => return Err(self.err(&format!("unknown function `{other}` (cdiv, mul, add, max)"))),
                    }
                };
                self.eat(b')')?;
                self.depth -= 1;
                Ok(e)
            }
        }
        let mut p = P { s: text.as_bytes(), i: 0, text, depth: 0 };
        let e = p.expr()?;
        p.ws();
        if p.i != p.s.len() {
            return Err(p.err("unexpected text"));
        }
        Ok(e)
    }
}

impl fmt::Display for GridExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GridExpr::Const(c) => write!(f, "{c}"),
            GridExpr::Sym(s) => f.write_str(s),
            GridExpr::CeilDiv(a, b) => write!(f, "cdiv({a}, {b})"),
            GridExpr::CeilDivBy(a, b) => write!(f, "cdiv({a}, {b})"),
            GridExpr::Mul(a, b) => write!(f, "mul({a}, {b})"),
            GridExpr::Add(a, b) => write!(f, "add({a}, {b})"),
            GridExpr::Max(a, b) => write!(f, "max({a}, {b})"),
        }
    }
}

/// A kernel: parameters, launch grid and body.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    pub name: String,
    pub params: Vec<Param>,
    /// Grid extents for program ids 0, 1, 2.
    pub grid: [GridExpr; 3],
    /// Free-form string attributes (variant, dtype, block sizes ...), printed sorted.
    pub attrs: Vec<(String, String)>,
    pub body: Block,
    /// Type of every value, indexed by [`Value`].
    pub values: Vec<Type>,
}

impl Kernel {
    pub fn ty(&self, v: Value) -> &Type {
        &self.values[v.index()]
    }

    pub fn param(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
    }

    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// A new value of type `ty` (used by passes that create ops).
    pub fn new_value(&mut self, ty: Type) -> Value {
        self.values.push(ty);
        Value(self.values.len() as u32 - 1)
    }

    /// Count the ops in the body, nested regions included.
    pub fn op_count(&self) -> usize {
        fn count(b: &Block) -> usize {
            b.ops.iter().map(|o| 1 + o.regions.iter().map(count).sum::<usize>()).sum()
        }
        count(&self.body)
    }
}

/// A straight-line list of ops with block arguments (a `for` body has the induction
/// variable and the loop-carried values as arguments). A region's last op is its
/// `yield` (the kernel body has none).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Block {
    pub args: Vec<Value>,
    pub ops: Vec<Op>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    pub kind: OpKind,
    pub operands: Vec<Value>,
    pub results: Vec<Value>,
    pub regions: Vec<Block>,
}

/// Element-wise binary operators. Integer `div`/`rem` truncate toward zero (C
/// semantics); `shr` is logical on `u32` and arithmetic on `i32`; `mulhi` is the high
/// 32 bits of the 64-bit product (integers only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Max,
    Min,
    And,
    Or,
    Xor,
    Shl,
    Shr,
    MulHi,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnOp {
    Neg,
    Abs,
    Exp,
    Exp2,
    Log,
    Log2,
    Tanh,
    Sqrt,
    Rsqrt,
    /// Logical / bitwise not.
    Not,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CmpPred {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

/// One axis of a tile load/store descriptor.
///
/// `Index` fixes the axis at a scalar index (one operand). `Range` makes the axis a
/// tile axis of `size` elements starting at a scalar `start` (one operand), bounded by
/// the tensor's extent and, with `limit`, by an extra exclusive scalar bound (a second
/// operand) — how varlen rows stop at the end of their sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AxisIndex {
    Index,
    Range { size: usize, limit: bool },
}

impl AxisIndex {
    pub fn operand_count(self) -> usize {
        match self {
            AxisIndex::Index => 1,
            AxisIndex::Range { limit, .. } => 1 + limit as usize,
        }
    }
}

/// An analysable term of a mask predicate over the row index `i` and the column index
/// `j` of a `[BM, BN]` block (in attention: a query row and a key column). Each takes
/// one scalar i32 operand `x`. Affine in (i, j), so a whole block can be classified
/// from its corners.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MaskTerm {
    /// `j <= i + x` (causal: x = s_k - s_q; window right: x = s_k - s_q + right).
    ColLeRow,
    /// `j >= i + x` (window left: x = s_k - s_q - left).
    ColGeRow,
    /// `j < x` (a column bound: the key sequence's end, the end of a key split).
    ColLt,
    /// `j >= x` (a column lower bound: the start of a key split).
    ColGe,
    /// `i < x` (row bound). Rows that fail it are *don't-care* rows: the predicate
    /// there is false, but block classification ignores them, since their results are
    /// never stored.
    RowLt,
}

impl MaskTerm {
    pub fn name(self) -> &'static str {
        match self {
            MaskTerm::ColLeRow => "col_le_row",
            MaskTerm::ColGeRow => "col_ge_row",
            MaskTerm::ColLt => "col_lt",
            MaskTerm::ColGe => "col_ge",
            MaskTerm::RowLt => "row_lt",
        }
    }

    pub fn from_name(s: &str) -> Option<MaskTerm> {
        [MaskTerm::ColLeRow, MaskTerm::ColGeRow, MaskTerm::ColLt, MaskTerm::ColGe, MaskTerm::RowLt]
            .into_iter()
            .find(|t| t.name() == s)
    }
}

/// Op families, for documentation, dumps and back-end dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    Program,
    Constant,
    Tile,
    Memory,
    Arith,
    Reduce,
    Dot,
    Softmax,
    Mask,
    Random,
    Control,
}

/// What an op does, with its attributes. Operand layout per kind is documented on
/// each variant (`[a, b]` = operand list).
#[derive(Clone, Debug, PartialEq)]
pub enum OpKind {
    // ---- program ----
    /// `[]` → i32: this program's index along grid axis 0, 1 or 2.
    ProgramId { axis: u8 },
    /// `[tensor]` → i32: the run-time extent of one tensor axis.
    TensorDim { axis: u8 },

    // ---- constants ----
    /// `[]` → scalar of `dtype`.
    Const { value: f64, dtype: DType },

    // ---- tile construction ----
    /// `[]` → tile<len x i32> = 0, 1, ..., len-1.
    Arange { len: usize },
    /// `[scalar]` → tile of `shape` filled with the scalar.
    Splat { shape: Vec<usize> },
    /// `[tile]` → the tile with a size-1 axis inserted at `axis`.
    ExpandDims { axis: u8 },
    /// `[tile]` → tile of `shape`; axes of size 1 are repeated (same rank).
    Broadcast { shape: Vec<usize> },

    // ---- memory ----
    /// `[tensor, axis operands...]` → a tile (or a scalar when no axis is a range) of
    /// the tensor's dtype. Elements outside the tensor or past a range's limit read as
    /// `pad`.
    Load { axes: Vec<AxisIndex>, pad: f64 },
    /// `[tensor, axis operands..., value]` → nothing. Elements outside the tensor or
    /// past a range's limit are not written. The value's dtype must be the tensor's.
    ///
    /// With `accumulate` (`tile.atomic_add`), each element is *added* to the tensor's
    /// atomically instead of replacing it: programs that run at the same time may add
    /// into the same elements (the flash backward's dQ). f32 tensors only. The order of
    /// the additions is not fixed, so the sum is not reproducible bit for bit.
    Store { axes: Vec<AxisIndex>, accumulate: bool },

    // ---- element-wise arithmetic (scalars broadcast; size-1 axes broadcast) ----
    /// `[a, b]` → same type.
    Binary(BinOp),
    /// `[a]` → same type.
    Unary(UnOp),
    /// `[a, b]` → i1 of the broadcast shape.
    Cmp(CmpPred),
    /// `[cond (i1), a, b]` → a's dtype.
    Select,
    /// `[a]` → same shape with dtype `to`. Floats round to nearest even; float → int
    /// truncates; i1 → number is 0/1.
    Cast { to: DType },

    // ---- reductions ----
    /// `[tile]` → the tile with `axis` removed (rank-1 → scalar).
    Reduce { op: ReduceOp, axis: u8 },

    // ---- matrix multiply ----
    /// `[a, b, acc]` → acc's type: acc + op(a) · op(b), op = transpose when asked.
    /// a, b: same float dtype; acc: f32 `[M, N]`.
    Dot { trans_a: bool, trans_b: bool },

    // ---- online softmax (exp2 domain) ----
    /// `[s [M,N] f32, m [M] f32, l [M] f32]` → `(p [M,N], alpha [M], m_new [M], l_new [M])`
    /// with `m_new = max(m, rowmax(s))`, `p = exp2(s - m_new)`, `alpha = exp2(m - m_new)`,
    /// `l_new = l * alpha + rowsum(p)`; a row whose `m_new` is −∞ gets p = 0, alpha = 1.
    SoftmaxUpdate,
    /// `[acc [M,D] f32, alpha [M] f32]` → `acc * alpha[:, None]`.
    SoftmaxRescale,
    /// `[acc [M,D] f32, m [M] f32, l [M] f32]` → `(o [M,D] f32, lse [M] f32)` with
    /// `o = acc / l` and `lse = (m + log2 l) · ln 2` (natural log); a row with `l == 0`
    /// gets o = 0 and lse = −∞.
    SoftmaxFinalize,

    // ---- analysable masks ----
    /// `[s [BM,BN], i0, j0, x_1..x_n]` → s with masked elements replaced by −∞.
    /// Element (r, c) is query `i = i0 + r`, key `j = j0 + c`; it is kept iff every term
    /// holds (with its operand `x_t`).
    MaskApply { terms: Vec<MaskTerm> },
    /// `[i0, j0, x_1..x_n]` → i1: true iff every term holds on every (non-don't-care)
    /// element of the `[bm, bn]` block, i.e. the block needs no masking.
    MaskBlockFull { terms: Vec<MaskTerm>, bm: usize, bn: usize },
    /// `[i0, x_1..x_n]` → `(lo, hi)` i32: the key range `[lo, hi)` outside which every
    /// `[bm, bn]` block of query block `i0` is entirely masked. `lo` is a multiple of
    /// `bn`; `lo >= 0`; `hi` may be <= lo (nothing visible).
    MaskKvRange { terms: Vec<MaskTerm>, bm: usize, bn: usize },

    // ---- random ----
    /// `[seed_lo u32, seed_hi u32, batch i32, head i32, row0 i32, col0 i32]` →
    /// tile<[m, n] x f32> uniform in [0, 1): Philox 4x32-10 with counter
    /// (row0 + r, col0 + c, head, batch) and key (seed_lo, seed_hi); u = (x0 >> 8) · 2⁻²⁴.
    RandUniform { shape: Vec<usize> },

    // ---- structured control flow ----
    /// `[lo, hi, step, init...]` → finals. One region whose args are
    /// `(iv, carried...)`, ending in `yield carried'...`. Iterates iv = lo, lo+step, ...
    /// while iv < hi (step > 0).
    For,
    /// `[cond]` → results. Two regions (then, else), each ending in `yield`.
    If,
    /// `[values...]` terminates a region.
    Yield,
}

impl OpKind {
    /// The printed op name, `family.name`.
    pub fn name(&self) -> &'static str {
        use OpKind::*;
        match self {
            ProgramId { .. } => "program.id",
            TensorDim { .. } => "program.dim",
            Const { .. } => "const",
            Arange { .. } => "tile.arange",
            Splat { .. } => "tile.splat",
            ExpandDims { .. } => "tile.expand_dims",
            Broadcast { .. } => "tile.broadcast",
            Load { .. } => "tile.load",
            Store { accumulate: false, .. } => "tile.store",
            Store { accumulate: true, .. } => "tile.atomic_add",
            Binary(op) => match op {
                BinOp::Add => "arith.add",
                BinOp::Sub => "arith.sub",
                BinOp::Mul => "arith.mul",
                BinOp::Div => "arith.div",
                BinOp::Rem => "arith.rem",
                BinOp::Max => "arith.max",
                BinOp::Min => "arith.min",
                BinOp::And => "arith.and",
                BinOp::Or => "arith.or",
                BinOp::Xor => "arith.xor",
                BinOp::Shl => "arith.shl",
                BinOp::Shr => "arith.shr",
                BinOp::MulHi => "arith.mulhi",
            },
            Unary(op) => match op {
                UnOp::Neg => "math.neg",
                UnOp::Abs => "math.abs",
                UnOp::Exp => "math.exp",
                UnOp::Exp2 => "math.exp2",
                UnOp::Log => "math.log",
                UnOp::Log2 => "math.log2",
                UnOp::Tanh => "math.tanh",
                UnOp::Sqrt => "math.sqrt",
                UnOp::Rsqrt => "math.rsqrt",
                UnOp::Not => "math.not",
            },
            Cmp(p) => match p {
                CmpPred::Lt => "cmp.lt",
                CmpPred::Le => "cmp.le",
                CmpPred::Gt => "cmp.gt",
                CmpPred::Ge => "cmp.ge",
                CmpPred::Eq => "cmp.eq",
                CmpPred::Ne => "cmp.ne",
            },
            Select => "arith.select",
            Cast { .. } => "arith.cast",
            Reduce { op, .. } => match op {
                ReduceOp::Sum => "reduce.sum",
                ReduceOp::Max => "reduce.max",
                ReduceOp::Min => "reduce.min",
            },
            Dot { .. } => "tile.dot",
            SoftmaxUpdate => "softmax.update",
            SoftmaxRescale => "softmax.rescale",
            SoftmaxFinalize => "softmax.finalize",
            MaskApply { .. } => "mask.apply",
            MaskBlockFull { .. } => "mask.block_full",
            MaskKvRange { .. } => "mask.kv_range",
            RandUniform { .. } => "rand.uniform",
            For => "scf.for",
            If => "scf.if",
            Yield => "scf.yield",
        }
    }

    pub fn family(&self) -> Family {
        use OpKind::*;
        match self {
            ProgramId { .. } | TensorDim { .. } => Family::Program,
            Const { .. } => Family::Constant,
            Arange { .. } | Splat { .. } | ExpandDims { .. } | Broadcast { .. } => Family::Tile,
            Load { .. } | Store { .. } => Family::Memory,
            Binary(_) | Unary(_) | Cmp(_) | Select | Cast { .. } => Family::Arith,
            Reduce { .. } => Family::Reduce,
            Dot { .. } => Family::Dot,
            SoftmaxUpdate | SoftmaxRescale | SoftmaxFinalize => Family::Softmax,
            MaskApply { .. } | MaskBlockFull { .. } | MaskKvRange { .. } => Family::Mask,
            RandUniform { .. } => Family::Random,
            For | If | Yield => Family::Control,
        }
    }

    /// True when the op has no effect besides its results: it may be removed when
    /// unused, deduplicated and hoisted. Stores and control flow are not pure.
    pub fn is_pure(&self) -> bool {
        !matches!(self, OpKind::Store { .. } | OpKind::For | OpKind::If | OpKind::Yield)
    }
}

/// All binary operators, for parsers and tests.
pub const BIN_OPS: [BinOp; 13] = [
    BinOp::Add,
    BinOp::Sub,
    BinOp::Mul,
    BinOp::Div,
    BinOp::Rem,
    BinOp::Max,
    BinOp::Min,
    BinOp::And,
    BinOp::Or,
    BinOp::Xor,
    BinOp::Shl,
    BinOp::Shr,
    BinOp::MulHi,
];

pub const UN_OPS: [UnOp; 10] = [
    UnOp::Neg,
    UnOp::Abs,
    UnOp::Exp,
    UnOp::Exp2,
    UnOp::Log,
    UnOp::Log2,
    UnOp::Tanh,
    UnOp::Sqrt,
    UnOp::Rsqrt,
    UnOp::Not,
];

pub const CMP_PREDS: [CmpPred; 6] = [CmpPred::Lt, CmpPred::Le, CmpPred::Gt, CmpPred::Ge, CmpPred::Eq, CmpPred::Ne];

pub const REDUCE_OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];

/// Walk every op of a block, depth first, in program order.
pub fn walk_ops<'a>(block: &'a Block, f: &mut dyn FnMut(&'a Op)) {
    for op in &block.ops {
        f(op);
        for r in &op.regions {
            walk_ops(r, f);
        }
    }
}
