//! For the aligned entry: fold the scores' scale into the softmax's exponent.
//!
//! Attention scales the product before the masks and the online softmax:
//!
//! ```text
//! %s  = arith.mul %qk, %c                 // c = softmax_scale · log2(e)
//! %sm = scf.if %full { yield %s } else { %m = arith.select %keep, %s, %neg_inf; yield %m }
//! %p, %alpha, %m_new, %l_new = softmax.update %sm, %m_i, %l_i
//! ```
//!
//! which costs a multiply per score, and the softmax then subtracts the row maximum: a
//! second instruction per score before `ex2`. When `c > 0`, scaling commutes with the
//! row maximum and with a −∞ fill, so the scores can stay unscaled up to the softmax,
//! which computes `p = ex2(fma(s, c, −m))`, one instruction instead of two, with
//! `m = c · max(s)` (FlashAttention does the same). [`fold`] rewrites the kernel so
//! (the multiply becomes dead) and says which `softmax.update` ops take which scale,
//! and which scalar parameters must be positive for the rewrite to hold: the aligned
//! entry's launch condition (docs/abi.md).

use std::collections::HashMap;

use ejc_ir::ir::{BinOp, Block, Kernel, Op, OpKind, Value};
use ejc_ir::types::{DType, Type};

/// What [`fold`] did.
#[derive(Clone, Debug, Default)]
pub struct Folded {
    /// `softmax.update` ops (by their first result) whose scores arrive unscaled, and
    /// the scale (a scalar value) to apply in the exponent.
    pub scaled: HashMap<Value, Value>,
    /// Scalar parameters that must be > 0 at launch.
    pub positive: Vec<String>,
}

struct Def<'a> {
    op: &'a Op,
    /// Index of the value among the op's results.
    index: usize,
}

fn defs(kernel: &Kernel) -> (HashMap<Value, Def<'_>>, HashMap<Value, usize>) {
    let mut defs = HashMap::new();
    let mut uses: HashMap<Value, usize> = HashMap::new();
    ejc_ir::ir::walk_ops(&kernel.body, &mut |op: &Op| {
        for (index, r) in op.results.iter().enumerate() {
            defs.insert(*r, Def { op, index });
        }
        for v in &op.operands {
            *uses.entry(*v).or_default() += 1;
        }
    });
    (defs, uses)
}

fn const_of(defs: &HashMap<Value, Def<'_>>, v: Value) -> Option<f64> {
    match &defs.get(&v)?.op.kind {
        OpKind::Const { value, .. } => Some(*value),
        OpKind::Splat { .. } => const_of(defs, defs.get(&v)?.op.operands[0]),
        _ => None,
    }
}

/// The scalar parameter `c` is a positive multiple of (`c` itself, or `param · k` with
/// a constant k > 0).
fn positive_param(kernel: &Kernel, defs: &HashMap<Value, Def<'_>>, c: Value) -> Option<String> {
    let param = |v: Value| kernel.params.iter().find(|p| p.value == v && p.ty == Type::Scalar(DType::F32));
    if let Some(p) = param(c) {
        return Some(p.name.clone());
    }
    let d = defs.get(&c)?;
    if d.op.kind != OpKind::Binary(BinOp::Mul) {
        return None;
    }
    let (a, b) = (d.op.operands[0], d.op.operands[1]);
    for (x, k) in [(a, b), (b, a)] {
        if let (Some(p), Some(k)) = (param(x), const_of(defs, k)) {
            if k > 0.0 && k.is_finite() {
                return Some(p.name.clone());
            }
        }
    }
    None
}

/// A scaled score tile: `mul %x, %c` with `c` a scalar f32 → (x, c).
fn scaled_scores(kernel: &Kernel, defs: &HashMap<Value, Def<'_>>, s: Value) -> Option<(Value, Value)> {
    let d = defs.get(&s)?;
    if d.op.kind != OpKind::Binary(BinOp::Mul) {
        return None;
    }
    let (x, c) = (d.op.operands[0], d.op.operands[1]);
    let tile_f32 = matches!(kernel.ty(x), Type::Tile(DType::F32, _));
    (tile_f32 && kernel.ty(c) == &Type::Scalar(DType::F32)).then_some((x, c))
}

/// Rewrite `kernel` (see the module docs); returns what was folded.
pub fn fold(kernel: &mut Kernel) -> Folded {
    let mut plan: Vec<(Value, Value)> = Vec::new(); // (scaled tile, raw tile): uses of the first become the second
    let mut out = Folded::default();
    {
        let (defs, uses) = defs(kernel);
        let mut updates = Vec::new();
        ejc_ir::ir::walk_ops(&kernel.body, &mut |op: &Op| {
            if op.kind == OpKind::SoftmaxUpdate {
                updates.push((op.operands[0], op.results[0]));
            }
        });
        for (s, p) in updates {
            let Some(d) = defs.get(&s) else { continue };
            // Case 1: the softmax takes the scaled tile itself.
            let found = if let Some((x, c)) = scaled_scores(kernel, &defs, s) {
                (uses.get(&s) == Some(&1)).then_some((s, x, c))
            } else if matches!(d.op.kind, OpKind::If) && uses.get(&s) == Some(&1) {
                // Case 2: an `scf.if` whose arms yield the scaled tile, or a select of it
                // against −∞ (the masks).
                let k = d.index;
                let mut scaled: Option<(Value, Value, Value)> = None;
                let mut refs = 0;
                let mut ok = true;
                for arm in &d.op.regions {
                    let Some(y) = arm.ops.last().filter(|y| y.kind == OpKind::Yield).map(|y| y.operands[k]) else {
                        ok = false;
                        break;
                    };
                    let src = match defs.get(&y) {
                        Some(yd) if yd.op.kind == OpKind::Select && uses.get(&y) == Some(&1) => {
                            let fill = const_of(&defs, yd.op.operands[2]);
                            if fill != Some(f64::NEG_INFINITY) {
                                ok = false;
                                break;
                            }
                            yd.op.operands[1]
                        }
                        _ => y,
                    };
                    match scaled_scores(kernel, &defs, src) {
                        Some((x, c)) if scaled.is_none_or(|(m0, _, _)| m0 == src) => {
                            scaled = Some((src, x, c));
                            refs += 1;
                        }
                        _ => {
                            ok = false;
                            break;
                        }
                    }
                }
                match scaled {
                    Some((m0, x, c)) if ok && uses.get(&m0) == Some(&refs) => Some((m0, x, c)),
                    _ => None,
                }
            } else {
                None
            };
            let Some((m0, x, c)) = found else { continue };
            let Some(param) = positive_param(kernel, &defs, c) else { continue };
            plan.push((m0, x));
            out.scaled.insert(p, c);
            if !out.positive.contains(&param) {
                out.positive.push(param);
            }
        }
    }
    if !plan.is_empty() {
        let subst: HashMap<Value, Value> = plan.into_iter().collect();
        replace_uses(&mut kernel.body, &subst);
    }
    out
}

fn replace_uses(b: &mut Block, subst: &HashMap<Value, Value>) {
    for op in &mut b.ops {
        for v in &mut op.operands {
            if let Some(n) = subst.get(v) {
                *v = *n;
            }
        }
        for r in &mut op.regions {
            replace_uses(r, subst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flash(variant: &str) -> Kernel {
        let spec = ejc_ir::spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash.yaml")).unwrap();
        let v = spec.variant(variant).unwrap();
        let k = ejc_ir::flash::main_kernel(&spec, v, DType::BF16, 64, 128, 64).unwrap();
        ejc_ir::passes::run_pipeline(&k, &ejc_ir::passes::default_pipeline()).unwrap()
    }

    #[test]
    fn folds_the_scale_of_full_and_causal_but_not_of_the_soft_cap() {
        for (variant, folds) in [("full", true), ("causal", true), ("softcap", false), ("bias", false)] {
            let mut k = flash(variant);
            let before = k.clone();
            let f = fold(&mut k);
            assert_eq!(f.scaled.len(), usize::from(folds), "{variant}");
            assert_eq!(f.positive, if folds { vec!["softmax_scale".to_string()] } else { vec![] }, "{variant}");
            assert_eq!(k != before, folds, "{variant}: the kernel changes exactly when something folds");
        }
    }
}
