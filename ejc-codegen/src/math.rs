//! Element-wise f32 math emitted inline, so it vectorises with the code around it and
//! needs no math library at run time (the CPU kernels import nothing).
//!
//! Each function works on an f32 scalar or an f32 vector alike. Accuracy (checked in
//! the back end's tests against f64): `exp2` within 2 ulp over its whole range,
//! `log2` within 2 ulp, `tanh` within 5e-7 relative.

use std::f64::consts::{LN_2, LOG2_E};

use llvm_sys::LLVMIntPredicate::*;
use llvm_sys::LLVMRealPredicate::*;

use crate::llvm::{Ir, V};

fn splat_f(ir: &Ir, x: f64, n: usize) -> V {
    ir.splat(ir.cf32(x), n)
}

fn splat_i(ir: &Ir, x: i64, n: usize) -> V {
    ir.splat(ir.ci32(x), n)
}

/// Round to the nearest integer (ties to even) by the 1.5·2²³ trick, which works on
/// every x86-64 level (no SSE4.1 `roundps` needed). Valid for |x| < 2²².
fn round_nearest(ir: &Ir, x: V, n: usize) -> V {
    let magic = splat_f(ir, 12582912.0, n); // 1.5 * 2^23
    let t = ir.fadd(x, magic);
    ir.fsub(t, magic)
}

/// 2^x. −∞ → 0, +∞ → +∞; results below 2⁻¹²⁶ flush to 0.
pub fn exp2(ir: &Ir, x: V) -> V {
    let n = ir.lanes(x);
    // Clamp so that 2^k stays constructible: k in [-127, 128]; -127 gives 0 (exponent
    // field 0) and 128 gives +inf (exponent field 255).
    let x = ir.maxnum(x, splat_f(ir, -127.0, n));
    let x = ir.minnum(x, splat_f(ir, 128.0, n));
    let k = round_nearest(ir, x, n);
    let f = ir.fsub(x, k); // f in [-0.5, 0.5]
                           // 2^f = e^(f ln 2): Taylor series to degree 7 (error < 1e-8 relative on the range).
    let mut coeffs = [0.0f64; 8];
    let mut term = 1.0;
    for (i, c) in coeffs.iter_mut().enumerate() {
        if i > 0 {
            term *= LN_2 / i as f64;
        }
        *c = term;
    }
    let mut p = splat_f(ir, coeffs[7], n);
    for c in coeffs[..7].iter().rev() {
        p = ir.fma(p, f, splat_f(ir, *c, n));
    }
    // 2^k from its exponent bits.
    let ki = ir.fptosi(k, ir.vec(ir.i32(), n));
    let biased = ir.add(ki, splat_i(ir, 127, n));
    let bits = ir.shl(biased, splat_i(ir, 23, n));
    let scale = ir.bitcast(bits, ir.vec(ir.f32(), n));
    ir.fmul(p, scale)
}

/// e^x.
pub fn exp(ir: &Ir, x: V) -> V {
    let n = ir.lanes(x);
    exp2(ir, ir.fmul(x, splat_f(ir, LOG2_E, n)))
}

/// log2(x) for x > 0 (0 → −∞, +∞ → +∞, negative or NaN → NaN).
pub fn log2(ir: &Ir, x: V) -> V {
    let n = ir.lanes(x);
    let it = ir.vec(ir.i32(), n);
    let ft = ir.vec(ir.f32(), n);
    // Denormals: scale up by 2^23 first so the exponent field is meaningful.
    let tiny = ir.fcmp(LLVMRealOLT, x, splat_f(ir, 1.1754943508222875e-38, n));
    let xs = ir.select(tiny, ir.fmul(x, splat_f(ir, 8388608.0, n)), x);
    let adj = ir.select(tiny, splat_f(ir, -23.0, n), splat_f(ir, 0.0, n));
    let bits = ir.bitcast(xs, it);
    // Split x = 2^e * m with m in [sqrt(1/2), sqrt(2)): subtract the bits of sqrt(1/2).
    let off = splat_i(ir, 0x3f35_04f3, n);
    let t = ir.sub(bits, off);
    let e = ir.ashr(t, splat_i(ir, 23, n));
    let mbits = ir.sub(bits, ir.shl(e, splat_i(ir, 23, n)));
    let m = ir.bitcast(mbits, ft);
    // log2(m) = 2/ln2 * atanh(u), u = (m-1)/(m+1) in (-0.172, 0.172).
    let one = splat_f(ir, 1.0, n);
    let u = ir.fdiv(ir.fsub(m, one), ir.fadd(m, one));
    let u2 = ir.fmul(u, u);
    let mut p = splat_f(ir, 1.0 / 9.0, n);
    for c in [1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0] {
        p = ir.fma(p, u2, splat_f(ir, c, n));
    }
    let lm = ir.fmul(ir.fmul(p, u), splat_f(ir, 2.0 / LN_2, n));
    let ef = ir.fadd(ir.sitofp(e, ft), adj);
    let r = ir.fadd(ef, lm);
    // Edges: 0 → -inf, +inf → +inf, x < 0 or NaN → NaN.
    let zero = splat_f(ir, 0.0, n);
    let r = ir.select(ir.fcmp(LLVMRealOEQ, x, zero), splat_f(ir, f64::NEG_INFINITY, n), r);
    let r = ir.select(ir.fcmp(LLVMRealOEQ, x, splat_f(ir, f64::INFINITY, n)), x, r);
    ir.select(ir.fcmp(LLVMRealULT, x, zero), splat_f(ir, f64::NAN, n), r)
}

/// ln(x).
pub fn log(ir: &Ir, x: V) -> V {
    let n = ir.lanes(x);
    ir.fmul(log2(ir, x), splat_f(ir, LN_2, n))
}

/// tanh(x): an odd Taylor polynomial for |x| < 1/8, `1 − 2/(e^{2x} + 1)` elsewhere
/// (which saturates to ±1 without overflow trouble).
pub fn tanh(ir: &Ir, x: V) -> V {
    let n = ir.lanes(x);
    let x2 = ir.fmul(x, x);
    // x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835
    let mut p = splat_f(ir, 62.0 / 2835.0, n);
    for c in [-17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0, 1.0] {
        p = ir.fma(p, x2, splat_f(ir, c, n));
    }
    let small = ir.fmul(p, x);
    let e = exp2(ir, ir.fmul(x, splat_f(ir, 2.0 * LOG2_E, n)));
    let big = ir.fsub(splat_f(ir, 1.0, n), ir.fdiv(splat_f(ir, 2.0, n), ir.fadd(e, splat_f(ir, 1.0, n))));
    let is_small = ir.fcmp(LLVMRealOLT, ir.fabs(x), splat_f(ir, 0.125, n));
    let r = ir.select(is_small, small, big);
    // NaN stays NaN (the compare above is false for NaN and `big` would give 1 - 2/NaN).
    r
}

/// Integer helpers for Philox: the high and low 32 bits of a 32 x 32 product.
pub fn mulhilo_u32(ir: &Ir, a: V, b: V) -> (V, V) {
    let n = ir.lanes(a);
    let t64 = ir.vec(ir.i64(), n);
    let p = ir.mul(ir.zext(a, t64), ir.zext(b, t64));
    let hi = ir.trunc(ir.lshr(p, ir.splat(ir.ci64(32), n)), ir.vec(ir.i32(), n));
    let lo = ir.trunc(p, ir.vec(ir.i32(), n));
    (hi, lo)
}

/// Philox 4x32-10 on counters `c` (four u32 values or vectors) with key `k`
/// (two u32 scalars, splat as needed); returns the first output word.
pub fn philox_first_word(ir: &Ir, mut c: [V; 4], k: [V; 2]) -> V {
    let n = ir.lanes(c[0]);
    let (mut k0, mut k1) = (ir.widen(k[0], n), ir.widen(k[1], n));
    let m0 = splat_i(ir, 0xD251_1F53u32 as i32 as i64, n);
    let m1 = splat_i(ir, 0xCD9E_8D57u32 as i32 as i64, n);
    let w0 = splat_i(ir, 0x9E37_79B9u32 as i32 as i64, n);
    let w1 = splat_i(ir, 0xBB67_AE85u32 as i32 as i64, n);
    for round in 0..10 {
        if round > 0 {
            k0 = ir.add(k0, w0);
            k1 = ir.add(k1, w1);
        }
        let (hi0, lo0) = mulhilo_u32(ir, m0, c[0]);
        let (hi1, lo1) = mulhilo_u32(ir, m1, c[2]);
        c = [ir.xor(ir.xor(hi1, c[1]), k0), lo1, ir.xor(ir.xor(hi0, c[3]), k1), lo0];
    }
    c[0]
}

/// f32 → bf16 bits, round to nearest even (NaN stays a quiet NaN).
pub fn f32_to_bf16_bits(ir: &Ir, f: V) -> V {
    let n = ir.lanes(f);
    let bits = ir.bitcast(f, ir.vec(ir.i32(), n));
    let lsb = ir.and(ir.lshr(bits, splat_i(ir, 16, n)), splat_i(ir, 1, n));
    let rounded = ir.add(bits, ir.add(lsb, splat_i(ir, 0x7fff, n)));
    let nan = ir.fcmp(LLVMRealUNO, f, f);
    let quiet = ir.or(bits, splat_i(ir, 0x0040_0000, n));
    let r = ir.select(nan, quiet, rounded);
    ir.trunc(ir.lshr(r, splat_i(ir, 16, n)), ir.vec(ir.i16(), n))
}

/// f32 → f16 bits, round to nearest even, with overflow to ±inf, subnormals, NaN.
pub fn f32_to_f16_bits(ir: &Ir, f: V) -> V {
    let n = ir.lanes(f);
    let it = ir.vec(ir.i32(), n);
    let bits = ir.bitcast(f, it);
    let sign = ir.and(ir.lshr(bits, splat_i(ir, 16, n)), splat_i(ir, 0x8000, n));
    let x = ir.and(bits, splat_i(ir, 0x7fff_ffff, n));
    // Normal range: re-bias the exponent and round the 13 dropped mantissa bits.
    let odd = ir.and(ir.lshr(x, splat_i(ir, 13, n)), splat_i(ir, 1, n));
    let normal = ir.add(x, splat_i(ir, ((15 - 127) << 23) + 0xfff, n));
    let normal = ir.lshr(ir.add(normal, odd), splat_i(ir, 13, n));
    // Subnormal results: adding 0.5 aligns the mantissa so the FPU rounds it.
    let absf = ir.bitcast(x, ir.vec(ir.f32(), n));
    let sub = ir.fadd(absf, splat_f(ir, 0.5, n));
    let sub = ir.sub(ir.bitcast(sub, it), splat_i(ir, 0x3f00_0000, n));
    let mut h = ir.select(ir.icmp(LLVMIntULT, x, splat_i(ir, 0x3880_0000, n)), sub, normal);
    h = ir.select(ir.icmp(LLVMIntUGE, x, splat_i(ir, 0x477f_f000, n)), splat_i(ir, 0x7c00, n), h);
    let nan = ir.icmp(LLVMIntUGT, x, splat_i(ir, 0x7f80_0000, n));
    h = ir.select(nan, splat_i(ir, 0x7e00, n), h);
    ir.trunc(ir.or(h, sign), ir.vec(ir.i16(), n))
}

/// f16 bits → f32 (exact).
pub fn f16_bits_to_f32(ir: &Ir, h: V) -> V {
    let n = ir.lanes(h);
    let it = ir.vec(ir.i32(), n);
    let ft = ir.vec(ir.f32(), n);
    let h = ir.zext(h, it);
    let o = ir.shl(ir.and(h, splat_i(ir, 0x7fff, n)), splat_i(ir, 13, n));
    let exp = ir.and(o, splat_i(ir, 0x7c00 << 13, n));
    let o = ir.add(o, splat_i(ir, (127 - 15) << 23, n));
    // Inf / NaN: push the exponent to 255.
    let inf_nan = ir.icmp(LLVMIntEQ, exp, splat_i(ir, 0x7c00 << 13, n));
    let o_inf = ir.add(o, splat_i(ir, (128 - 16) << 23, n));
    // Zero / subnormal: renormalise through a float subtraction.
    let zero_sub = ir.icmp(LLVMIntEQ, exp, splat_i(ir, 0, n));
    let o_sub = ir.add(o, splat_i(ir, 1 << 23, n));
    let f_sub = ir.fsub(ir.bitcast(o_sub, ft), ir.bitcast(splat_i(ir, 113 << 23, n), ft));
    let o_sub = ir.bitcast(f_sub, it);
    let o = ir.select(inf_nan, o_inf, o);
    let o = ir.select(zero_sub, o_sub, o);
    let sign = ir.shl(ir.and(h, splat_i(ir, 0x8000, n)), splat_i(ir, 16, n));
    ir.bitcast(ir.or(o, sign), ft)
}
