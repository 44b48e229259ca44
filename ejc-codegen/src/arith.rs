//! Element semantics shared by the back ends: the interpreter's arithmetic,
//! comparisons and casts on LLVM values (scalars or vectors), so that every back end
//! computes exactly what `ejc_ir::interp` defines.

use ejc_ir::ir::{BinOp, CmpPred, UnOp};
use ejc_ir::types::DType;
use llvm_sys::LLVMIntPredicate::*;
use llvm_sys::LLVMRealPredicate::*;
use llvm_sys::{LLVMIntPredicate, LLVMRealPredicate};

use crate::llvm::{Ir, T, V};
use crate::math;

/// Arithmetic on one builder. `soft_f16` / `soft_bf16`: narrow float conversions in
/// integer arithmetic (targets without the instructions, where LLVM would call
/// compiler-rt).
pub struct Arith<'a> {
    pub ir: &'a Ir,
    pub soft_f16: bool,
    pub soft_bf16: bool,
}

impl Arith<'_> {
    /// Bring two operands to the same lane count.
    fn unify(&self, x: V, y: V) -> (V, V) {
        let n = self.ir.lanes(x).max(self.ir.lanes(y));
        (self.ir.widen(x, n), self.ir.widen(y, n))
    }

    pub fn compute_ty(&self, d: DType) -> T {
        match d {
            DType::F32 | DType::F64 => self.ir.f32(),
            DType::F16 => self.ir.f16(),
            DType::BF16 => self.ir.bf16(),
            DType::I32 | DType::U32 => self.ir.i32(),
            DType::I1 => self.ir.i1(),
        }
    }

    /// Float ↔ float conversions between compute types (exact where widening).
    pub fn convert(&self, x: V, from: DType, to: DType) -> V {
        if from == to {
            return x;
        }
        let ir = self.ir;
        let n = ir.lanes(x);
        let tt = ir.vec(self.compute_ty(to), n);
        if !(from.is_float() && to.is_float()) {
            return self.cast(x, from, to);
        }
        // Every float conversion goes through f32; the narrow ones in integer
        // arithmetic where the ISA has no instruction for them (LLVM would otherwise
        // call compiler-rt, which a kernel library does not link).
        let f = match from {
            DType::F32 | DType::F64 => x,
            DType::BF16 => ir.fpext(x, ir.vec(ir.f32(), n)),
            DType::F16 if self.soft_f16 => math::f16_bits_to_f32(ir, ir.bitcast(x, ir.vec(ir.i16(), n))),
            _ => ir.fpext(x, ir.vec(ir.f32(), n)),
        };
        match to {
            DType::F32 | DType::F64 => f,
            DType::BF16 if self.soft_bf16 => ir.bitcast(math::f32_to_bf16_bits(ir, f), tt),
            DType::F16 if self.soft_f16 => ir.bitcast(math::f32_to_f16_bits(ir, f), tt),
            _ => ir.fptrunc(f, tt),
        }
    }

    pub fn binary(&self, b: BinOp, dt: DType, x: V, y: V) -> V {
        let ir = self.ir;
        let (x, y) = self.unify(x, y);
        let n = ir.lanes(x);
        if dt.is_float() {
            // bf16/f16 arithmetic: in f32, rounded back.
            let (x, y) = if dt == DType::F32 {
                (x, y)
            } else {
                (self.convert(x, dt, DType::F32), self.convert(y, dt, DType::F32))
            };
            let r = match b {
                BinOp::Add => ir.fadd(x, y),
                BinOp::Sub => ir.fsub(x, y),
                BinOp::Mul => ir.fmul(x, y),
                BinOp::Div => ir.fdiv(x, y),
                BinOp::Max => ir.fmaximum(x, y),
                BinOp::Min => ir.fminimum(x, y),
                _ => ir.poison(ir.type_of(x)),
            };
            return if dt == DType::F32 { r } else { self.convert(r, DType::F32, dt) };
        }
        let unsigned = dt == DType::U32;
        let it = ir.type_of(x);
        match b {
            BinOp::Add => ir.add(x, y),
            BinOp::Sub => ir.sub(x, y),
            BinOp::Mul => ir.mul(x, y),
            BinOp::Div | BinOp::Rem => {
                // Division by zero (and i32::MIN / -1) must not trap: divide by 1 there
                // instead (the result is unspecified by the IR).
                let zero = ir.splat(ir.cint(ir.elem(it), 0), n);
                let one = ir.splat(ir.cint(ir.elem(it), 1), n);
                let bad = if unsigned {
                    ir.icmp(LLVMIntEQ, y, zero)
                } else {
                    let m1 = ir.splat(ir.cint(ir.elem(it), -1), n);
                    ir.or(ir.icmp(LLVMIntEQ, y, zero), ir.icmp(LLVMIntEQ, y, m1))
                };
                let d = ir.select(bad, one, y);
                let q = match (b, unsigned) {
                    (BinOp::Div, true) => ir.udiv(x, d),
                    (BinOp::Div, false) => ir.sdiv(x, d),
                    (_, true) => ir.urem(x, d),
                    (_, false) => ir.srem(x, d),
                };
                if unsigned {
                    q
                } else {
                    // x / -1 = -x (wrapping), x % -1 = 0.
                    let m1 = ir.splat(ir.cint(ir.elem(it), -1), n);
                    let is_m1 = ir.icmp(LLVMIntEQ, y, m1);
                    let alt = if b == BinOp::Div { ir.sub(zero, x) } else { zero };
                    ir.select(is_m1, alt, q)
                }
            }
            BinOp::Max => ir.select(ir.icmp(if unsigned { LLVMIntUGT } else { LLVMIntSGT }, x, y), x, y),
            BinOp::Min => ir.select(ir.icmp(if unsigned { LLVMIntULT } else { LLVMIntSLT }, x, y), x, y),
            BinOp::And => ir.and(x, y),
            BinOp::Or => ir.or(x, y),
            BinOp::Xor => ir.xor(x, y),
            BinOp::Shl | BinOp::Shr => {
                let amt = ir.and(y, ir.splat(ir.cint(ir.elem(it), 31), n));
                match (b, unsigned) {
                    (BinOp::Shl, _) => ir.shl(x, amt),
                    (_, true) => ir.lshr(x, amt),
                    (_, false) => ir.ashr(x, amt),
                }
            }
            BinOp::MulHi => {
                let t64 = ir.vec(ir.i64(), n);
                let (a, c) =
                    if unsigned { (ir.zext(x, t64), ir.zext(y, t64)) } else { (ir.sext(x, t64), ir.sext(y, t64)) };
                let p = ir.mul(a, c);
                ir.trunc(ir.lshr(p, ir.splat(ir.ci64(32), n)), it)
            }
        }
    }

    pub fn unary(&self, u: UnOp, dt: DType, x: V) -> V {
        let ir = self.ir;
        if dt.is_float() {
            let xf = self.convert(x, dt, DType::F32);
            let n = ir.lanes(xf);
            let r = match u {
                UnOp::Neg => ir.fneg(xf),
                UnOp::Abs => ir.fabs(xf),
                UnOp::Exp => math::exp(ir, xf),
                UnOp::Exp2 => math::exp2(ir, xf),
                UnOp::Log => math::log(ir, xf),
                UnOp::Log2 => math::log2(ir, xf),
                UnOp::Tanh => math::tanh(ir, xf),
                UnOp::Sqrt => ir.sqrt(xf),
                UnOp::Rsqrt => ir.fdiv(ir.splat(ir.cf32(1.0), n), ir.sqrt(xf)),
                UnOp::Not => xf,
            };
            return self.convert(r, DType::F32, dt);
        }
        let it = ir.type_of(x);
        let n = ir.lanes(x);
        match u {
            UnOp::Neg => ir.sub(ir.splat(ir.cint(ir.elem(it), 0), n), x),
            UnOp::Abs => {
                let neg = ir.sub(ir.splat(ir.cint(ir.elem(it), 0), n), x);
                if dt == DType::U32 {
                    x
                } else {
                    ir.select(ir.icmp(LLVMIntSLT, x, ir.splat(ir.cint(ir.elem(it), 0), n)), neg, x)
                }
            }
            UnOp::Not => ir.not(x),
            _ => x,
        }
    }

    pub fn compare(&self, p: CmpPred, dt: DType, x: V, y: V) -> V {
        let ir = self.ir;
        let (x, y) = self.unify(x, y);
        if dt.is_float() {
            let (x, y) = (self.convert(x, dt, DType::F32), self.convert(y, dt, DType::F32));
            let pred: LLVMRealPredicate = match p {
                CmpPred::Lt => LLVMRealOLT,
                CmpPred::Le => LLVMRealOLE,
                CmpPred::Gt => LLVMRealOGT,
                CmpPred::Ge => LLVMRealOGE,
                CmpPred::Eq => LLVMRealOEQ,
                CmpPred::Ne => LLVMRealUNE,
            };
            return ir.fcmp(pred, x, y);
        }
        let u = dt == DType::U32;
        let pred: LLVMIntPredicate = match p {
            CmpPred::Lt => {
                if u {
                    LLVMIntULT
                } else {
                    LLVMIntSLT
                }
            }
            CmpPred::Le => {
                if u {
                    LLVMIntULE
                } else {
                    LLVMIntSLE
                }
            }
            CmpPred::Gt => {
                if u {
                    LLVMIntUGT
                } else {
                    LLVMIntSGT
                }
            }
            CmpPred::Ge => {
                if u {
                    LLVMIntUGE
                } else {
                    LLVMIntSGE
                }
            }
            CmpPred::Eq => LLVMIntEQ,
            CmpPred::Ne => LLVMIntNE,
        };
        ir.icmp(pred, x, y)
    }

    /// `arith.cast` with the interpreter's semantics.
    pub fn cast(&self, x: V, from: DType, to: DType) -> V {
        let ir = self.ir;
        let n = ir.lanes(x);
        let tt = ir.vec(self.compute_ty(to), n);
        if from == to {
            return x;
        }
        match (from, to) {
            (f, t) if f.is_float() && t.is_float() => self.convert(x, f, t),
            (DType::I1, t) if t.is_float() => ir.uitofp(x, tt),
            (DType::I1, _) => ir.zext(x, tt),
            (DType::I32, t) if t.is_float() => {
                let f = ir.sitofp(x, ir.vec(ir.f32(), n));
                self.convert(f, DType::F32, t)
            }
            (DType::U32, t) if t.is_float() => {
                let f = ir.uitofp(x, ir.vec(ir.f32(), n));
                self.convert(f, DType::F32, t)
            }
            (f, DType::I1) if f.is_float() => {
                let xf = self.convert(x, f, DType::F32);
                ir.fcmp(LLVMRealUNE, xf, ir.splat(ir.cf32(0.0), n))
            }
            (_, DType::I1) => ir.icmp(LLVMIntNE, x, ir.splat(ir.cint(ir.elem(ir.type_of(x)), 0), n)),
            (f, _) if f.is_float() => {
                // Truncate toward zero and wrap (through i64); NaN gives 0.
                let xf = self.convert(x, f, DType::F32);
                let i = ir.trunc(ir.fptosi(xf, ir.vec(ir.i64(), n)), tt);
                let nan = ir.fcmp(LLVMRealUNO, xf, xf);
                ir.select(nan, ir.splat(ir.ci32(0), n), i)
            }
            // i32 <-> u32: same bits.
            _ => x,
        }
    }
}
