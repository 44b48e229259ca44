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

use ejc_ir::defuse::DefUse;
use ejc_ir::ir::{BinOp, Kernel, Op, OpKind, Value};
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

/// Whether the scalar `c` is positive: `Some(None)` for a positive constant,
/// `Some(Some(param))` when it is positive exactly when `param` is (`c` is `param` itself,
/// or `param · k` with a constant k > 0), `None` when neither is known.
fn positive_param(kernel: &Kernel, du: &DefUse, c: Value) -> Option<Option<String>> {
    let param = |v: Value| kernel.params.iter().find(|p| p.value == v && p.ty == Type::Scalar(DType::F32));
    if let Some(k) = du.constant(c) {
        return (k > 0.0 && k.is_finite()).then_some(None);
    }
    if let Some(p) = param(c) {
        return Some(Some(p.name.clone()));
    }
    let d = du.def(c)?;
    if d.kind != OpKind::Binary(BinOp::Mul) {
        return None;
    }
    let (a, b) = (d.operands[0], d.operands[1]);
    for (x, k) in [(a, b), (b, a)] {
        if let (Some(p), Some(k)) = (param(x), du.constant(k)) {
            if k > 0.0 && k.is_finite() {
                return Some(Some(p.name.clone()));
            }
        }
    }
    None
}

/// A scaled score tile: `mul %x, %c` with `c` a scalar f32 → (x, c).
fn scaled_scores(kernel: &Kernel, du: &DefUse, s: Value) -> Option<(Value, Value)> {
    let d = du.def(s)?;
    if d.kind != OpKind::Binary(BinOp::Mul) {
        return None;
    }
    let (x, c) = (d.operands[0], d.operands[1]);
    let tile_f32 = matches!(kernel.ty(x), Type::Tile(DType::F32, _));
    (tile_f32 && kernel.ty(c) == &Type::Scalar(DType::F32)).then_some((x, c))
}

/// Rewrite `kernel` (see the module docs); returns what was folded.
pub fn fold(kernel: &mut Kernel) -> Folded {
    let mut plan: Vec<(Value, Value)> = Vec::new(); // (scaled tile, raw tile): uses of the first become the second
    let mut out = Folded::default();
    {
        let du = DefUse::new(kernel);
        let mut updates = Vec::new();
        ejc_ir::ir::walk_ops(&kernel.body, &mut |op: &Op| {
            if op.kind == OpKind::SoftmaxUpdate {
                updates.push((op.operands[0], op.results[0]));
            }
        });
        for (s, p) in updates {
            let Some(d) = du.def_result(s) else { continue };
            // Case 1: the softmax takes the scaled tile itself.
            let found = if let Some((x, c)) = scaled_scores(kernel, &du, s) {
                (du.use_count(s) == 1).then_some((s, x, c))
            } else if matches!(d.op.kind, OpKind::If) && du.use_count(s) == 1 {
                // Case 2: an `scf.if` whose arms yield the scaled tile, or a select of it
                // against −∞ (the masks).
                let k = d.result;
                let mut scaled: Option<(Value, Value, Value)> = None;
                let mut refs = 0;
                let mut ok = true;
                for arm in &d.op.regions {
                    let Some(y) = arm.ops.last().filter(|y| y.kind == OpKind::Yield).map(|y| y.operands[k]) else {
                        ok = false;
                        break;
                    };
                    let src = match du.def(y) {
                        Some(yd) if yd.kind == OpKind::Select && du.use_count(y) == 1 => {
                            let fill = du.constant(yd.operands[2]);
                            if fill != Some(f64::NEG_INFINITY) {
                                ok = false;
                                break;
                            }
                            yd.operands[1]
                        }
                        _ => y,
                    };
                    match scaled_scores(kernel, &du, src) {
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
                    Some((m0, x, c)) if ok && du.use_count(m0) == refs => Some((m0, x, c)),
                    _ => None,
                }
            } else {
                None
            };
            let Some((m0, x, c)) = found else { continue };
            let Some(param) = positive_param(kernel, &du, c) else { continue };
            plan.push((m0, x));
            out.scaled.insert(p, c);
            if let Some(param) = param.filter(|n| !out.positive.contains(n)) {
                out.positive.push(param);
            }
        }
    }
    if !plan.is_empty() {
        let subst: HashMap<Value, Value> = plan.into_iter().collect();
        ejc_ir::passes::substitute(&mut kernel.body, &subst);
    }
    out
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
    fn folds_the_scale_the_soft_caps_factor_and_log2e_past_a_bias() {
        // The soft cap's multiply by c·log2(e) after the tanh folds instead of the scale:
        // its launch condition is the cap's sign (none for gemma2's fixed cap). Past a
        // bias only log2(e), a constant, folds: no launch condition.
        for (variant, folds, positive) in [
            ("full", true, Some("softmax_scale")),
            ("causal", true, Some("softmax_scale")),
            ("softcap", true, Some("logits_soft_cap")),
            ("gemma2", true, None),
            ("bias", true, None),
        ] {
            let mut k = flash(variant);
            let before = k.clone();
            let f = fold(&mut k);
            assert_eq!(f.scaled.len(), usize::from(folds), "{variant}");
            assert_eq!(f.positive, positive.map(|p| vec![p.to_string()]).unwrap_or_default(), "{variant}");
            assert_eq!(k != before, folds, "{variant}: the kernel changes exactly when something folds");
        }
    }
}
