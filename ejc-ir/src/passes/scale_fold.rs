//! `scale-fold`: move the scores' last multiply into the online softmax.
//!
//! Attention scales the product before the masks and the online softmax:
//!
//! ```text
//! %s  = arith.mul %qk, %c                 // c = softmax_scale · log2(e), or c · log2(e) after a soft cap
//! %sm = scf.if %full { yield %s } else { %m = arith.select %keep, %s, %neg_inf; yield %m }
//! %p, %alpha, %m_new, %l_new = softmax.update %sm, %m_i, %l_i
//! ```
//!
//! which costs a multiply per score, and the softmax then subtracts the row maximum: a
//! second instruction per score before the exponential. When `c > 0`, scaling commutes
//! with the row maximum and with a −∞ fill, so the scores can stay unscaled up to the
//! softmax, which takes `c` as its fourth operand (`softmax.update %sm, %m_i, %l_i, %c`:
//! `m_new = max(m, c·rowmax(s))`, `p = exp2(c·s − m_new)`, docs/ir.md) and a back end
//! computes `p = exp2(fma(s, c, −m))`, one instruction instead of two (FlashAttention
//! does the same). The multiply becomes dead (`dce` removes it; back ends that run
//! this pass last leave that to their own optimiser).
//!
//! The pass folds only where it can say when the rewrite holds: `c` a positive constant
//! (always), or a scalar parameter `x` (or `x · k` with a constant `k > 0`), positive
//! exactly when `x > 0` — [`ScaleFold::positive`] lists those parameters, and a kernel
//! folded this way is only equal to the original for arguments that meet it. It is
//! therefore not in the default pipeline: the PTX target runs it for its aligned entry,
//! whose launch condition includes those parameters (docs/abi.md, "Aligned entry").
//! `c` must be a parameter or defined at the kernel's top level (so it is in scope at
//! the softmax).

use std::collections::HashMap;

use crate::defuse::DefUse;
use crate::ir::{walk_ops, BinOp, Block, Kernel, Op, OpKind, Value};
use crate::types::{DType, Type};

/// What [`scale_fold`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScaleFold {
    /// How many `softmax.update` ops took a scale operand.
    pub folded: usize,
    /// Scalar parameters that must be > 0 for the folded kernel to compute what the
    /// original did.
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

/// The scaled tile a `softmax.update`'s scores come from, through any number of
/// selects against −∞ (masks) and `scf.if` arms: (scaled tile, raw, c). Every value on
/// the way is used once, and the scaled tile only on the way, so replacing it by the
/// raw tile changes nothing else.
fn fold_site(kernel: &Kernel, du: &DefUse, s: Value) -> Option<(Value, Value, Value)> {
    fn walk(
        kernel: &Kernel,
        du: &DefUse,
        v: Value,
        found: &mut Option<(Value, Value, Value)>,
        refs: &mut usize,
    ) -> bool {
        if let Some((x, c)) = scaled_scores(kernel, du, v) {
            if found.is_some_and(|f| f.0 != v) {
                return false;
            }
            *found = Some((v, x, c));
            *refs += 1;
            return true;
        }
        if du.use_count(v) != 1 {
            return false;
        }
        let Some(d) = du.def_result(v) else { return false };
        match d.op.kind {
            OpKind::Select => {
                du.constant(d.op.operands[2]) == Some(f64::NEG_INFINITY)
                    && walk(kernel, du, d.op.operands[1], found, refs)
            }
            OpKind::If => d.op.regions.iter().all(|arm| {
                match arm.ops.last().filter(|y| y.kind == OpKind::Yield).map(|y| y.operands[d.result]) {
                    Some(y) => walk(kernel, du, y, found, refs),
                    None => false,
                }
            }),
            _ => false,
        }
    }
    let mut found = None;
    let mut refs = 0;
    if !walk(kernel, du, s, &mut found, &mut refs) {
        return None;
    }
    let (m0, x, c) = found?;
    (du.use_count(m0) == refs).then_some((m0, x, c))
}

/// Add `scale` as the fourth operand of the `softmax.update` ops (by first result).
fn add_scale_operands(block: &mut Block, scales: &HashMap<Value, Value>) {
    for op in &mut block.ops {
        if op.kind == OpKind::SoftmaxUpdate && op.operands.len() == 3 {
            if let Some(c) = scales.get(&op.results[0]) {
                op.operands.push(*c);
            }
        }
        for r in &mut op.regions {
            add_scale_operands(r, scales);
        }
    }
}

/// Rewrite `kernel` (see the module docs); returns what was folded and the launch
/// condition. The kernel is unchanged when nothing folds.
pub fn scale_fold(kernel: &mut Kernel) -> ScaleFold {
    let mut subst: HashMap<Value, Value> = HashMap::new(); // scaled tile → raw tile
    let mut scales: HashMap<Value, Value> = HashMap::new(); // softmax.update → c
    let mut out = ScaleFold::default();
    {
        let du = DefUse::new(kernel);
        let top: std::collections::HashSet<Value> = kernel
            .params
            .iter()
            .map(|p| p.value)
            .chain(kernel.body.ops.iter().flat_map(|o| o.results.iter().copied()))
            .collect();
        let mut updates = Vec::new();
        walk_ops(&kernel.body, &mut |op: &Op| {
            if op.kind == OpKind::SoftmaxUpdate && op.operands.len() == 3 {
                updates.push((op.operands[0], op.results[0]));
            }
        });
        for (s, p) in updates {
            let Some((m0, x, c)) = fold_site(kernel, &du, s) else { continue };
            if !top.contains(&c) {
                continue;
            }
            let Some(param) = positive_param(kernel, &du, c) else { continue };
            subst.insert(m0, x);
            scales.insert(p, c);
            out.folded += 1;
            if let Some(param) = param.filter(|n| !out.positive.contains(n)) {
                out.positive.push(param);
            }
        }
    }
    if out.folded > 0 {
        super::util::substitute(&mut kernel.body, &subst);
        add_scale_operands(&mut kernel.body, &scales);
    }
    out
}
