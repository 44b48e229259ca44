//! Result-type inference: the one place that knows what each op accepts.
//!
//! The builder calls it to type new values; the verifier calls it to check that the
//! types recorded in a kernel (for instance after parsing or after a pass) are the
//! ones the op produces. Structured control flow (`scf.*`) is checked by the verifier
//! itself, as its types come from regions.

use crate::ir::{AxisIndex, BinOp, OpKind, UnOp};
use crate::types::{DType, Type};

/// Result types of a non-control op applied to operands of the given types, or a
/// message saying which operand is wrong and why.
pub fn infer(kind: &OpKind, operands: &[&Type]) -> Result<Vec<Type>, String> {
    use OpKind::*;
    let n = operands.len();
    let expect_n = |want: usize| -> Result<(), String> {
        if n == want {
            Ok(())
        } else {
            Err(format!("expects {want} operand(s), got {n}"))
        }
    };
    let i32s = Type::Scalar(DType::I32);
    match kind {
        ProgramId { axis } => {
            expect_n(0)?;
            if *axis > 2 {
                return Err(format!("axis {axis} out of range (grids have axes 0, 1, 2)"));
            }
            Ok(vec![i32s])
        }
        TensorDim { axis } => {
            expect_n(1)?;
            match operands[0] {
                Type::Tensor(_, rank) if (*axis as usize) < *rank => Ok(vec![i32s]),
                Type::Tensor(_, rank) => Err(format!("axis {axis} out of range for a rank-{rank} tensor")),
                t => Err(format!("operand 0 must be a tensor, found {t}")),
            }
        }
        Const { value, dtype } => {
            expect_n(0)?;
            if dtype.is_int() && (value.fract() != 0.0 || !value.is_finite()) {
                return Err(format!("integer constant {value} is not an integer"));
            }
            Ok(vec![Type::Scalar(*dtype)])
        }
        Arange { len } => {
            expect_n(0)?;
            if *len == 0 {
                return Err("length must be at least 1".into());
            }
            Ok(vec![Type::tile(DType::I32, &[*len])])
        }
        Splat { shape } => {
            expect_n(1)?;
            check_shape(shape)?;
            match operands[0] {
                Type::Scalar(d) => Ok(vec![Type::Tile(*d, shape.clone())]),
                t => Err(format!("operand 0 must be a scalar, found {t}")),
            }
        }
        ExpandDims { axis } => {
            expect_n(1)?;
            match operands[0] {
                Type::Tile(d, s) if s.len() == 1 && *axis <= 1 => {
                    let mut shape = s.clone();
                    shape.insert(*axis as usize, 1);
                    Ok(vec![Type::Tile(*d, shape)])
                }
                Type::Tile(_, s) if s.len() != 1 => {
                    Err(format!("operand 0 must be a rank-1 tile, found rank {}", s.len()))
                }
                Type::Tile(..) => Err(format!("axis {axis} out of range (0 or 1)")),
                t => Err(format!("operand 0 must be a tile, found {t}")),
            }
        }
        Broadcast { shape } => {
            expect_n(1)?;
            check_shape(shape)?;
            match operands[0] {
                Type::Tile(d, s) if s.len() == shape.len() => {
                    for (a, (&x, &y)) in s.iter().zip(shape).enumerate() {
                        if x != y && x != 1 {
                            return Err(format!("axis {a} has size {x}, which cannot broadcast to {y}"));
                        }
                    }
                    Ok(vec![Type::Tile(*d, shape.clone())])
                }
                t => Err(format!("operand 0 must be a tile of rank {}, found {t}", shape.len())),
            }
        }
        Load { axes, pad } => {
            let (dtype, shape) = check_access(axes, operands, 0)?;
            if n != 1 + axes.iter().map(|a| a.operand_count()).sum::<usize>() {
                return Err(format!(
                    "expects {} operand(s), got {n}",
                    1 + axes.iter().map(|a| a.operand_count()).sum::<usize>()
                ));
            }
            if dtype.is_int() && pad.fract() != 0.0 {
                return Err(format!("pad value {pad} is not an integer for an {dtype} tensor"));
            }
            Ok(vec![if shape.is_empty() { Type::Scalar(dtype) } else { Type::Tile(dtype, shape) }])
        }
        Store { axes, accumulate } => {
            let (dtype, shape) = check_access(axes, operands, 1)?;
            if *accumulate && dtype != DType::F32 {
                return Err(format!("an atomic add needs an f32 tensor, not {dtype}"));
            }
            let want = 2 + axes.iter().map(|a| a.operand_count()).sum::<usize>();
            if n != want {
                return Err(format!("expects {want} operand(s), got {n}"));
            }
            let expected = if shape.is_empty() { Type::Scalar(dtype) } else { Type::Tile(dtype, shape) };
            let value = operands[n - 1];
            if *value != expected {
                return Err(format!("stored value has type {value}, but the destination needs {expected}"));
            }
            Ok(vec![])
        }
        Binary(op) => {
            expect_n(2)?;
            let (d, shape) = broadcast_pair(operands[0], operands[1])?;
            let ok = match op {
                BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Div | BinOp::Max | BinOp::Min => !d.is_bool(),
                BinOp::And | BinOp::Or | BinOp::Xor => d.is_int() || d.is_bool(),
                BinOp::Rem | BinOp::Shl | BinOp::Shr | BinOp::MulHi => d.is_int(),
            };
            if !ok {
                return Err(format!("is not defined on {d}"));
            }
            Ok(vec![make(d, shape)])
        }
        Unary(op) => {
            expect_n(1)?;
            let t = operands[0];
            if t.is_tensor() {
                return Err(format!("operand 0 must be a scalar or tile, found {t}"));
            }
            let d = t.dtype();
            let ok = match op {
                UnOp::Neg | UnOp::Abs => !d.is_bool(),
                UnOp::Not => d.is_int() || d.is_bool(),
                _ => d.is_float(),
            };
            if !ok {
                return Err(format!("is not defined on {d}"));
            }
            Ok(vec![t.clone()])
        }
        Cmp(_) => {
            expect_n(2)?;
            let (_, shape) = broadcast_pair(operands[0], operands[1])?;
            Ok(vec![make(DType::I1, shape)])
        }
        Select => {
            expect_n(3)?;
            if operands[0].dtype() != DType::I1 || operands[0].is_tensor() {
                return Err(format!("operand 0 (condition) must be i1, found {}", operands[0]));
            }
            let (d, shape) = broadcast_pair(operands[1], operands[2])?;
            let shape = broadcast_shapes(operands[0].shape(), &shape)
                .map_err(|e| format!("condition {} does not broadcast with the values: {e}", operands[0]))?;
            Ok(vec![make(d, shape)])
        }
        Cast { to } => {
            expect_n(1)?;
            if operands[0].is_tensor() {
                return Err(format!("operand 0 must be a scalar or tile, found {}", operands[0]));
            }
            Ok(vec![operands[0].with_dtype(*to)])
        }
        Reduce { axis, op } => {
            expect_n(1)?;
            match operands[0] {
                Type::Tile(d, s) if (*axis as usize) < s.len() => {
                    if d.is_bool() {
                        return Err(format!("reduce.{op:?} is not defined on i1").to_lowercase());
                    }
                    let mut shape = s.clone();
                    shape.remove(*axis as usize);
                    Ok(vec![make(*d, shape)])
                }
                Type::Tile(_, s) => Err(format!("axis {axis} out of range for a rank-{} tile", s.len())),
                t => Err(format!("operand 0 must be a tile, found {t}")),
            }
        }
        Dot { trans_a, trans_b } => {
            expect_n(3)?;
            let (a, b, acc) = (operands[0], operands[1], operands[2]);
            let (da, sa) = rank2(a, 0)?;
            let (db, sb) = rank2(b, 1)?;
            let (dc, sc) = rank2(acc, 2)?;
            if !da.is_float() || da != db {
                return Err(format!("operands 0 and 1 must share a float dtype, found {da} and {db}"));
            }
            if dc != DType::F32 {
                return Err(format!("accumulator must be f32, found {dc}"));
            }
            let (m, ka) = if *trans_a { (sa[1], sa[0]) } else { (sa[0], sa[1]) };
            let (kb, nn) = if *trans_b { (sb[1], sb[0]) } else { (sb[0], sb[1]) };
            if ka != kb {
                return Err(format!(
                    "contraction sizes differ: {a}{} has K = {ka}, {b}{} has K = {kb}",
                    if *trans_a { " (transposed)" } else { "" },
                    if *trans_b { " (transposed)" } else { "" }
                ));
            }
            if sc != [m, nn] {
                return Err(format!("accumulator has shape {:?}, expected [{m}, {nn}]", sc));
            }
            Ok(vec![acc.clone()])
        }
        SoftmaxUpdate => {
            // An optional fourth operand: the scores' scale (`scale-fold`).
            if n != 4 {
                expect_n(3)?;
            }
            let (m, nn) = f32_2d(operands[0], 0)?;
            f32_1d(operands[1], m, 1)?;
            f32_1d(operands[2], m, 2)?;
            if n == 4 && *operands[3] != Type::Scalar(DType::F32) {
                return Err(format!("operand 3 (the scale) must be f32, found {}", operands[3]));
            }
            let row = Type::tile(DType::F32, &[m]);
            Ok(vec![Type::tile(DType::F32, &[m, nn]), row.clone(), row.clone(), row])
        }
        SoftmaxRescale => {
            expect_n(2)?;
            let (m, _) = f32_2d(operands[0], 0)?;
            f32_1d(operands[1], m, 1)?;
            Ok(vec![operands[0].clone()])
        }
        SoftmaxFinalize => {
            expect_n(3)?;
            let (m, _) = f32_2d(operands[0], 0)?;
            f32_1d(operands[1], m, 1)?;
            f32_1d(operands[2], m, 2)?;
            Ok(vec![operands[0].clone(), Type::tile(DType::F32, &[m])])
        }
        MaskApply { terms } => {
            expect_n(3 + terms.len())?;
            let (m, nn) = f32_2d(operands[0], 0)?;
            scalars_i32(&operands[1..], 1)?;
            Ok(vec![Type::tile(DType::F32, &[m, nn])])
        }
        MaskBlockFull { terms, bm, bn } => {
            expect_n(2 + terms.len())?;
            check_shape(&[*bm, *bn])?;
            scalars_i32(operands, 0)?;
            Ok(vec![Type::Scalar(DType::I1)])
        }
        MaskKvRange { terms, bm, bn } => {
            expect_n(1 + terms.len())?;
            check_shape(&[*bm, *bn])?;
            scalars_i32(operands, 0)?;
            Ok(vec![i32s.clone(), i32s])
        }
        RandUniform { shape } => {
            expect_n(6)?;
            check_shape(shape)?;
            if shape.len() != 2 {
                return Err("shape must have rank 2 ([rows, cols])".into());
            }
            for (i, want) in [DType::U32, DType::U32, DType::I32, DType::I32, DType::I32, DType::I32].iter().enumerate()
            {
                if *operands[i] != Type::Scalar(*want) {
                    return Err(format!("operand {i} must be {want}, found {}", operands[i]));
                }
            }
            Ok(vec![Type::Tile(DType::F32, shape.clone())])
        }
        For | If | Yield => Err("structured control flow is typed by its regions".into()),
    }
}

fn make(d: DType, shape: Vec<usize>) -> Type {
    if shape.is_empty() {
        Type::Scalar(d)
    } else {
        Type::Tile(d, shape)
    }
}

fn check_shape(shape: &[usize]) -> Result<(), String> {
    if shape.is_empty() || shape.len() > 2 {
        return Err(format!("tile shape {shape:?} must have rank 1 or 2"));
    }
    if shape.contains(&0) {
        return Err(format!("tile shape {shape:?} has an empty axis"));
    }
    Ok(())
}

/// Element-wise operands: same dtype; scalars broadcast; tiles of equal rank whose
/// axes are equal or 1.
fn broadcast_pair(a: &Type, b: &Type) -> Result<(DType, Vec<usize>), String> {
    for (i, t) in [a, b].iter().enumerate() {
        if t.is_tensor() {
            return Err(format!("operand {i} must be a scalar or tile, found {t}"));
        }
    }
    if a.dtype() != b.dtype() {
        return Err(format!("operand dtypes differ: {a} and {b} (insert an arith.cast)"));
    }
    let shape =
        broadcast_shapes(a.shape(), b.shape()).map_err(|e| format!("operands {a} and {b} do not broadcast: {e}"))?;
    Ok((a.dtype(), shape))
}

/// numpy-style broadcast of two shapes (empty = scalar) of equal rank.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    if a.is_empty() {
        return Ok(b.to_vec());
    }
    if b.is_empty() {
        return Ok(a.to_vec());
    }
    if a.len() != b.len() {
        return Err(format!("ranks {} and {} differ (add an axis to one: `tile.expand_dims` in the IR, `.expand(axis)` in #[ej_kernel])", a.len(), b.len()));
    }
    let mut out = Vec::with_capacity(a.len());
    for (ax, (&x, &y)) in a.iter().zip(b).enumerate() {
        if x == y || y == 1 {
            out.push(x);
        } else if x == 1 {
            out.push(y);
        } else {
            return Err(format!("axis {ax}: sizes {x} and {y}"));
        }
    }
    Ok(out)
}

fn check_access(axes: &[AxisIndex], operands: &[&Type], extra: usize) -> Result<(DType, Vec<usize>), String> {
    let Some(first) = operands.first() else {
        return Err("expects a tensor operand".into());
    };
    let (dtype, rank) = match first {
        Type::Tensor(d, r) => (*d, *r),
        t => return Err(format!("operand 0 must be a tensor, found {t}")),
    };
    if axes.len() != rank {
        return Err(format!("indexes {} axes of a rank-{rank} tensor", axes.len()));
    }
    let want = 1 + axes.iter().map(|a| a.operand_count()).sum::<usize>() + extra;
    if operands.len() != want {
        return Err(format!("expects {want} operand(s), got {}", operands.len()));
    }
    let mut shape = Vec::new();
    for a in axes {
        if let AxisIndex::Range { size, .. } = a {
            if *size == 0 {
                return Err("a range axis has size 0".into());
            }
            shape.push(*size);
        }
    }
    if shape.len() > 2 {
        return Err(format!("accesses a rank-{} tile; tiles have rank 1 or 2", shape.len()));
    }
    for (i, t) in operands[1..operands.len() - extra].iter().enumerate() {
        if **t != Type::Scalar(DType::I32) {
            return Err(format!("index operand {} must be i32, found {t}", i + 1));
        }
    }
    Ok((dtype, shape))
}

fn rank2(t: &Type, i: usize) -> Result<(DType, [usize; 2]), String> {
    match t {
        Type::Tile(d, s) if s.len() == 2 => Ok((*d, [s[0], s[1]])),
        _ => Err(format!("operand {i} must be a rank-2 tile, found {t}")),
    }
}

fn f32_2d(t: &Type, i: usize) -> Result<(usize, usize), String> {
    match t {
        Type::Tile(DType::F32, s) if s.len() == 2 => Ok((s[0], s[1])),
        _ => Err(format!("operand {i} must be a rank-2 f32 tile, found {t}")),
    }
}

fn f32_1d(t: &Type, m: usize, i: usize) -> Result<(), String> {
    match t {
        Type::Tile(DType::F32, s) if s.as_slice() == [m] => Ok(()),
        _ => Err(format!("operand {i} must be tile<{m}xf32> (one value per row), found {t}")),
    }
}

fn scalars_i32(ops: &[&Type], first_index: usize) -> Result<(), String> {
    for (i, t) in ops.iter().enumerate() {
        if **t != Type::Scalar(DType::I32) {
            return Err(format!("operand {} must be i32, found {t}", i + first_index));
        }
    }
    Ok(())
}
