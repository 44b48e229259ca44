//! Where each value of a kernel is defined and where it is used: one walk over the
//! kernel, shared by the passes and every back end (before this, the CPU and PTX
//! lowerings, warp specialisation, scale folding and the layout planner each built
//! their own map).
//!
//! ```
//! use ejc_ir::builder::KernelBuilder;
//! use ejc_ir::defuse::DefUse;
//! use ejc_ir::ir::OpKind;
//! use ejc_ir::types::DType;
//! let mut b = KernelBuilder::new("k");
//! let x = b.const_f32(2.0);
//! let y = b.add(x, x);
//! let k = b.finish().unwrap();
//! let du = DefUse::new(&k);
//! assert!(matches!(du.def(x).unwrap().kind, OpKind::Const { dtype: DType::F32, .. }));
//! assert_eq!(du.use_count(x), 2);
//! assert_eq!(du.use_count(y), 0);
//! assert!(du.uses(x).iter().all(|u| u.op.results[0] == y));
//! ```

use std::collections::{HashMap, HashSet};

use crate::ir::{walk_ops, Block, Kernel, Op, OpKind, Value};
use crate::types::Type;

/// The op that defines a value, and which of its results the value is.
#[derive(Clone, Copy, Debug)]
pub struct Def<'k> {
    pub op: &'k Op,
    pub result: usize,
}

/// One use of a value: the op, and the operand position.
#[derive(Clone, Copy, Debug)]
pub struct Use<'k> {
    pub op: &'k Op,
    pub operand: usize,
}

/// A stable name for an op of a kernel: its position in a pre-order walk (an op before
/// the ops of its regions), printed `#n`. The same IR gives the same ids in every run
/// and on every back end, so schedules and dumps can name ops (where the back ends used
/// to key their maps by an op's address).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u32);

impl std::fmt::Display for OpId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Definitions and uses of every value of a kernel (nested regions included). Block
/// arguments and kernel parameters have no defining op.
pub struct DefUse<'k> {
    defs: Vec<Option<Def<'k>>>,
    uses: Vec<Vec<Use<'k>>>,
    /// Every op in pre-order: `ops[id]`.
    ops: Vec<&'k Op>,
    ids: HashMap<*const Op, OpId>,
}

impl<'k> DefUse<'k> {
    pub fn new(kernel: &'k Kernel) -> DefUse<'k> {
        Self::of_block(&kernel.body, kernel.values.len())
    }

    /// The analysis of `block` alone, for a kernel of `num_values` values.
    pub fn of_block(block: &'k Block, num_values: usize) -> DefUse<'k> {
        let mut defs = vec![None; num_values];
        let mut uses = vec![Vec::new(); num_values];
        let mut ops = Vec::new();
        let mut ids = HashMap::new();
        walk_ops(block, &mut |op: &'k Op| {
            ids.insert(op as *const Op, OpId(ops.len() as u32));
            ops.push(op);
            for (result, r) in op.results.iter().enumerate() {
                defs[r.index()] = Some(Def { op, result });
            }
            for (operand, v) in op.operands.iter().enumerate() {
                uses[v.index()].push(Use { op, operand });
            }
        });
        DefUse { defs, uses, ops, ids }
    }

    /// The id of `op`, an op of the analysed kernel.
    ///
    /// # Panics
    /// When `op` is not one of the kernel's ops (a caller's bug).
    pub fn id(&self, op: &Op) -> OpId {
        *self.ids.get(&(op as *const Op)).expect("an op of the analysed kernel")
    }

    /// The op with id `id`.
    pub fn op(&self, id: OpId) -> &'k Op {
        self.ops[id.0 as usize]
    }

    /// Every op, in pre-order (by id).
    pub fn ops(&self) -> &[&'k Op] {
        &self.ops
    }

    /// The constant `v` is, or splats: `Some(c)` when `v` is a `const` or a `splat` of
    /// one (through any number of splats).
    pub fn constant(&self, v: Value) -> Option<f64> {
        let op = self.def(v)?;
        match op.kind {
            OpKind::Const { value, .. } => Some(value),
            OpKind::Splat { .. } => self.constant(op.operands[0]),
            _ => None,
        }
    }

    /// The op defining `v`; none for parameters and block arguments.
    pub fn def(&self, v: Value) -> Option<&'k Op> {
        self.def_result(v).map(|d| d.op)
    }

    pub fn def_result(&self, v: Value) -> Option<Def<'k>> {
        self.defs.get(v.index()).copied().flatten()
    }

    /// Every use of `v`, in program order.
    pub fn uses(&self, v: Value) -> &[Use<'k>] {
        self.uses.get(v.index()).map_or(&[], |u| u.as_slice())
    }

    pub fn use_count(&self, v: Value) -> usize {
        self.uses(v).len()
    }

    /// How many times each value is used, indexed by value.
    pub fn use_counts(&self) -> Vec<usize> {
        self.uses.iter().map(Vec::len).collect()
    }

    /// `v` is used, and every use satisfies `pred`.
    pub fn used_only_as(&self, v: Value, pred: impl Fn(&Use<'k>) -> bool) -> bool {
        let u = self.uses(v);
        !u.is_empty() && u.iter().all(pred)
    }

    /// `x` is computed from a loop's induction variable `iv` and values from outside the
    /// loop by scalar arithmetic and scalar loads from tensors the kernel never writes (a
    /// paged cache's block table) alone (`inside`: the loop body's values,
    /// [`defined_in`]): an index a software pipeline or a copy engine can evaluate for
    /// another iteration.
    pub fn iteration_scalar(&self, kernel: &Kernel, x: Value, iv: Value, inside: &HashSet<Value>) -> bool {
        if x == iv || !inside.contains(&x) {
            return true;
        }
        match self.def(x) {
            Some(d) if is_scalar_arith(d) && d.regions.is_empty() => {
                matches!(kernel.ty(x), Type::Scalar(_))
                    && d.operands.iter().all(|y| self.iteration_scalar(kernel, *y, iv, inside))
            }
            Some(d) if matches!(d.kind, OpKind::Load { .. }) => {
                matches!(kernel.ty(x), Type::Scalar(_))
                    && self.read_only(d.operands[0])
                    && d.operands[1..].iter().all(|y| self.iteration_scalar(kernel, *y, iv, inside))
            }
            _ => false,
        }
    }

    /// No op of the kernel stores to tensor `t`.
    pub fn read_only(&self, t: Value) -> bool {
        self.uses(t).iter().all(|u| !matches!(u.op.kind, OpKind::Store { .. }))
    }

    /// The values used at least once, every use satisfying `pred`.
    pub fn values_used_only_as(&self, pred: impl Fn(&Use<'k>) -> bool) -> HashSet<Value> {
        (0..self.uses.len() as u32).map(Value).filter(|v| self.used_only_as(*v, &pred)).collect()
    }
}

/// Element-wise arithmetic, comparisons, selects, casts and constants: the ops that are
/// plain scalar arithmetic when their operands are scalars.
pub fn is_scalar_arith(op: &Op) -> bool {
    matches!(
        op.kind,
        OpKind::Const { .. }
            | OpKind::Binary(_)
            | OpKind::Unary(_)
            | OpKind::Cmp(_)
            | OpKind::Select
            | OpKind::Cast { .. }
    )
}

/// The values defined inside `block`: its arguments, and every result of its ops and of
/// their nested regions (a loop body's values, for example).
pub fn defined_in(block: &Block) -> HashSet<Value> {
    let mut out: HashSet<Value> = block.args.iter().copied().collect();
    walk_ops(block, &mut |op: &Op| {
        out.extend(op.results.iter().copied());
        for r in &op.regions {
            out.extend(r.args.iter().copied());
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::KernelBuilder;
    use crate::ir::OpKind;
    use crate::types::DType;

    #[test]
    fn loops_results_operands_and_nested_uses() {
        let mut b = KernelBuilder::new("k");
        let s = b.const_f32(1.0);
        let c0 = b.const_i32(0);
        let c4 = b.const_i32(4);
        let c1 = b.const_i32(1);
        let mut inner = None;
        let out = b.for_loop(c0, c4, c1, &[s], |b, iv, carried| {
            let k = b.cast(iv, DType::F32);
            let t = b.mul(k, carried[0]);
            inner = Some((iv, k, t));
            vec![b.add(t, s)]
        });
        let kern = b.finish().unwrap();
        let (iv, k, t) = inner.unwrap();
        let du = DefUse::new(&kern);
        // A loop's result is its op's result 0; its body's values are defined inside.
        let d = du.def_result(out[0]).unwrap();
        assert!(matches!(d.op.kind, OpKind::For) && d.result == 0);
        assert!(du.def(iv).is_none(), "a block argument has no defining op");
        assert!(matches!(du.def(k).unwrap().kind, OpKind::Cast { .. }));
        // `s` is the loop's initial value and is used inside the body too.
        assert_eq!(du.use_count(s), 2);
        assert_eq!(du.uses(t).len(), 1);
        assert_eq!(du.uses(t)[0].operand, 0);
        assert_eq!(du.use_counts()[s.index()], 2);
        assert!(du.used_only_as(k, |u| matches!(u.op.kind, OpKind::Binary(_))));
        assert!(!du.used_only_as(out[0], |_| true), "an unused value is not 'used only as'");
        assert_eq!(du.values_used_only_as(|u| matches!(u.op.kind, OpKind::Cast { .. })), [iv].into());
        let body = &kern.body.ops.iter().find(|o| matches!(o.kind, OpKind::For)).unwrap().regions[0];
        let inside = defined_in(body);
        assert!(inside.contains(&iv) && inside.contains(&k) && inside.contains(&t));
        assert!(!inside.contains(&s) && !inside.contains(&out[0]));
        // `k = f32(iv)` is scalar arithmetic of the induction variable; `t` reads the
        // carried value (a block argument other than the induction variable).
        assert!(du.iteration_scalar(&kern, k, iv, &inside));
        assert!(du.iteration_scalar(&kern, s, iv, &inside), "defined outside the loop");
        assert!(!du.iteration_scalar(&kern, t, iv, &inside));
    }

    /// Ids are pre-order (an op before its regions' ops), name the ops both ways, and
    /// head the lines of `print_kernel_with_ids` in the same order.
    #[test]
    fn op_ids_are_pre_order_and_match_the_numbered_text() {
        let mut b = KernelBuilder::new("k");
        let s = b.const_f32(1.0);
        let c0 = b.const_i32(0);
        let c4 = b.const_i32(4);
        let c1 = b.const_i32(1);
        let out = b.for_loop(c0, c4, c1, &[s], |b, iv, carried| {
            let k = b.cast(iv, DType::F32);
            vec![b.mul(k, carried[0])]
        });
        let _ = b.add(out[0], s);
        let kern = b.finish().unwrap();
        let du = DefUse::new(&kern);
        let kinds: Vec<&str> = du.ops().iter().map(|o| o.kind.name()).collect();
        assert_eq!(
            kinds,
            ["const", "const", "const", "const", "scf.for", "arith.cast", "arith.mul", "scf.yield", "arith.add"]
        );
        for (i, op) in du.ops().iter().enumerate() {
            assert_eq!(du.id(op), OpId(i as u32));
            assert!(std::ptr::eq(du.op(OpId(i as u32)), *op));
        }
        assert_eq!(OpId(7).to_string(), "#7");
        let text = crate::print::print_kernel_with_ids(&kern);
        let heads: Vec<&str> =
            text.lines().filter(|l| l.starts_with('#')).map(|l| l.split(' ').next().unwrap()).collect();
        let want: Vec<String> = (0..du.ops().len()).map(|i| format!("#{i}")).collect();
        assert_eq!(heads, want, "{text}");
        // The loop's closing brace carries no id; the plain text is unchanged by ids.
        assert!(text.lines().any(|l| l.trim() == "}"), "{text}");
        let plain = crate::print::print_kernel(&kern);
        let stripped: Vec<String> = text
            .lines()
            .map(|l| if l.starts_with('#') || l.starts_with("      ") { l[6..].to_string() } else { l.to_string() })
            .collect();
        assert_eq!(stripped.join("\n") + "\n", plain, "{text}");
    }

    #[test]
    fn constants_are_found_through_splats() {
        let mut b = KernelBuilder::new("k");
        let z = b.const_f32(0.0);
        let t = b.splat(z, &[4, 4]);
        let x = b.add(t, t);
        let kern = b.finish().unwrap();
        let du = DefUse::new(&kern);
        assert_eq!(du.constant(z), Some(0.0));
        assert_eq!(du.constant(t), Some(0.0));
        assert_eq!(du.constant(x), None);
    }
}
