//! The verifier's messages on ill-typed or ill-formed IR: each names the kernel, the
//! op's place (`op 3 (scf.for) > body > op 0 (arith.add)`) and the mismatch. Text
//! inputs go through `parse_kernel` (which verifies what it read); structural defects
//! the parser cannot express (a use before the definition, a value reused after its
//! region) are made by editing a parsed kernel. Messages are pinned by snapshots in
//! `snapshots/verify__<case>.snap`.

mod common;

use ejc_ir::ir::{Kernel, Value};
use ejc_ir::parse::parse_kernel;
use ejc_ir::verify::verify;

/// The verifier's message for `text`, which must parse but not verify.
fn text_error(text: &str) -> String {
    let e = parse_kernel(text).err().unwrap_or_else(|| panic!("verified, but should not:\n{text}"));
    // Verifier errors carry no line:column (they come from the tree, not the text).
    assert_eq!((e.line, e.column), (0, 0), "a parse error, not a verifier error: {e}");
    e.to_string()
}

fn kernel_error(k: &Kernel) -> String {
    verify(k).err().unwrap_or_else(|| panic!("verified, but should not:\n{k:#?}")).to_string()
}

/// Check that `message` names every one of `parts`, then snapshot it.
macro_rules! check {
    ($case:expr, $message:expr, [$($part:expr),* $(,)?]) => {{
        let message: String = $message;
        for part in [$($part),*] {
            assert!(message.contains(part), "`{part}` missing from: {message}");
        }
        snap!(concat!("verify__", $case), message);
    }};
}

fn wrap(body: &str) -> String {
    format!(
        "kernel @bad(%x: tensor<?xf32>, %m: tensor<?x?xbf16>, %n: i32, %f: f32) grid(1, 1, 1) {{\n  \
         %c0 = const 0 : i32\n  %c1 = const 1 : i32\n{body}}}\n"
    )
}

#[test]
fn dtype_mismatch_in_arith() {
    check!(
        "arith_dtype_mismatch",
        text_error(&wrap("  %0 = arith.add %n, %f : i32\n")),
        ["op 2 (arith.add)", "i32 and f32"]
    );
}

#[test]
fn shapes_that_do_not_broadcast() {
    let body = "  %a = tile.load %x[%c0 +: 4] {pad = 0.0} : tile<4xf32>\n  \
                %b = tile.load %x[%c0 +: 8] {pad = 0.0} : tile<8xf32>\n  \
                %0 = arith.mul %a, %b : tile<8xf32>\n";
    check!("broadcast_mismatch", text_error(&wrap(body)), ["op 4 (arith.mul)", "tile<4xf32>", "tile<8xf32>", "axis 0"]);
    let body = "  %a = tile.load %x[%c0 +: 4] {pad = 0.0} : tile<4xf32>\n  \
                %b = tile.expand_dims %a {axis = 1} : tile<4x1xf32>\n  \
                %0 = cmp.lt %a, %b : tile<4x1xi1>\n";
    check!("broadcast_rank_mismatch", text_error(&wrap(body)), ["op 4 (cmp.lt)", "ranks 1 and 2"]);
}

#[test]
fn dot_contraction_mismatch() {
    let body = "  %a = tile.load %m[%c0 +: 16, %c0 +: 8] {pad = 0.0} : tile<16x8xbf16>\n  \
                %b = tile.load %m[%c0 +: 16, %c0 +: 32] {pad = 0.0} : tile<16x32xbf16>\n  \
                %z = const 0.0 : f32\n  %acc = tile.splat %z {shape = [16, 32]} : tile<16x32xf32>\n  \
                %0 = tile.dot %a, %b, %acc : tile<16x32xf32>\n";
    check!("dot_contraction", text_error(&wrap(body)), ["op 6 (tile.dot)", "K = 8", "K = 16"]);
    // With `a` transposed the contraction is over its 16 rows, and the op verifies.
    let ok = "  %a = tile.load %m[%c0 +: 16, %c0 +: 8] {pad = 0.0} : tile<16x8xbf16>\n  \
              %b = tile.load %m[%c0 +: 16, %c0 +: 32] {pad = 0.0} : tile<16x32xbf16>\n  \
              %z = const 0.0 : f32\n  %acc = tile.splat %z {shape = [8, 32]} : tile<8x32xf32>\n  \
              %0 = tile.dot %a, %b, %acc {trans_a} : tile<8x32xf32>\n";
    parse_kernel(&wrap(ok)).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn dot_with_a_non_f32_accumulator() {
    let body = "  %a = tile.load %m[%c0 +: 16, %c0 +: 16] {pad = 0.0} : tile<16x16xbf16>\n  \
                %0 = tile.dot %a, %a, %a : tile<16x16xbf16>\n";
    check!("dot_accumulator", text_error(&wrap(body)), ["op 3 (tile.dot)", "accumulator must be f32, found bf16"]);
}

#[test]
fn load_with_the_wrong_number_of_indices() {
    let body = "  %0 = tile.load %m[%c0 +: 16] {pad = 0.0} : tile<16xbf16>\n";
    check!("load_index_count", text_error(&wrap(body)), ["op 2 (tile.load)", "1 axes of a rank-2 tensor"]);
}

#[test]
fn store_of_the_wrong_dtype() {
    let body = "  %a = tile.load %x[%c0 +: 16] {pad = 0.0} : tile<16xf32>\n  tile.store %m[%c0, %c0 +: 16], %a\n";
    check!("store_dtype", text_error(&wrap(body)), ["op 3 (tile.store)", "tile<16xf32>", "tile<16xbf16>"]);
}

#[test]
fn atomic_add_into_a_16_bit_tensor() {
    let body =
        "  %a = tile.load %m[%c0, %c0 +: 16] {pad = 0.0} : tile<16xbf16>\n  tile.atomic_add %m[%c0, %c0 +: 16], %a\n";
    check!("atomic_add_dtype", text_error(&wrap(body)), ["op 3 (tile.atomic_add)", "f32 tensor", "bf16"]);
}

#[test]
fn results_typed_differently_from_what_the_op_produces() {
    check!(
        "result_type",
        text_error(&wrap("  %0 = arith.add %n, %n : f32\n")),
        ["op 2 (arith.add)", "produces (i32)", "typed (f32)"]
    );
}

#[test]
fn yield_type_mismatch() {
    let body = "  %r = scf.for %i = %c0 to %n step %c1 iter_args(%a = %c0) : i32 {\n    \
                %b = arith.cast %a {to = f32} : f32\n    scf.yield %b\n  }\n";
    check!(
        "yield_type",
        text_error(&wrap(body)),
        ["op 2 (scf.for) > body > op 1 (scf.yield)", "yields (f32)", "(i32)"]
    );
    let body = "  %c = cmp.lt %n, %c1 : i1\n  %r = scf.if %c : i32 {\n    scf.yield %c0\n  } else {\n    \
                scf.yield %f\n  }\n";
    check!("if_yield_type", text_error(&wrap(body)), ["op 3 (scf.if) > else > op 0 (scf.yield)", "yields (f32)"]);
}

#[test]
fn yield_in_the_kernel_body() {
    check!("yield_outside_region", text_error(&wrap("  scf.yield %c0\n")), ["op 2 (scf.yield)", "outside a region"]);
}

#[test]
fn region_without_a_yield() {
    let body = "  %c = cmp.lt %n, %c1 : i1\n  scf.if %c {\n    %z = const 0 : i32\n  } else {\n    scf.yield\n  }\n";
    check!("missing_yield", text_error(&wrap(body)), ["op 3 (scf.if) > then", "does not end in `scf.yield`"]);
}

#[test]
fn for_with_non_i32_bounds() {
    let body = "  scf.for %i = %c0 to %f step %c1 {\n    scf.yield\n  }\n";
    check!("for_bounds", text_error(&wrap(body)), ["op 2 (scf.for)", "upper bound must be i32, found f32"]);
    let body = "  %s = const 1 : u32\n  scf.for %i = %c0 to %n step %s {\n    scf.yield\n  }\n";
    check!("for_step", text_error(&wrap(body)), ["op 3 (scf.for)", "step must be i32, found u32"]);
}

#[test]
fn if_with_a_non_i1_condition() {
    let body = "  scf.if %n {\n    scf.yield\n  } else {\n    scf.yield\n  }\n";
    check!("if_condition", text_error(&wrap(body)), ["op 2 (scf.if)", "i1", "found i32"]);
}

/// A valid kernel to break by editing:
///
/// ```text
/// op 0  %c0 = const 0
/// op 1  %c1 = const 1
/// op 2  %r = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %c0) { %t = %acc + %i; yield %t }
/// op 3  %s = arith.add %r, %c1
/// op 4  %c = cmp.lt %s, %n
/// op 5  %y = scf.if %c { %u = %s + %s; yield %u } else { %w = %s * %s; yield %w }
/// op 6  %f = arith.cast %y {to = f32}
/// op 7  tile.store %x[%c0], %f
/// ```
fn base() -> Kernel {
    common::parse(
        "kernel @edit(%x: tensor<?xf32>, %n: i32) grid(1, 1, 1) {
  %c0 = const 0 : i32
  %c1 = const 1 : i32
  %r = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %c0) : i32 {
    %t = arith.add %acc, %i : i32
    scf.yield %t
  }
  %s = arith.add %r, %c1 : i32
  %c = cmp.lt %s, %n : i1
  %y = scf.if %c : i32 {
    %u = arith.add %s, %s : i32
    scf.yield %u
  } else {
    %w = arith.mul %s, %s : i32
    scf.yield %w
  }
  %f = arith.cast %y {to = f32} : f32
  tile.store %x[%c0], %f
}
",
    )
}

/// Replace every use of `from` by `to`.
fn rename_uses(block: &mut ejc_ir::ir::Block, from: Value, to: Value) {
    for op in &mut block.ops {
        for v in &mut op.operands {
            if *v == from {
                *v = to;
            }
        }
        for r in &mut op.regions {
            rename_uses(r, from, to);
        }
    }
}

/// The result of the first op of region `region` of top-level op `op`.
fn inner(k: &Kernel, op: usize, region: usize) -> Value {
    k.body.ops[op].regions[region].ops[0].results[0]
}

#[test]
fn the_base_kernel_verifies() {
    verify(&base()).unwrap();
}

#[test]
fn use_before_definition() {
    let mut k = base();
    k.body.ops.swap(3, 4);
    check!("use_before_def", kernel_error(&k), ["op 3 (cmp.lt)", "operand 0 is used before it is defined"]);
}

#[test]
fn use_of_a_loop_value_after_the_loop() {
    let mut k = base();
    let t = inner(&k, 2, 0);
    k.body.ops[3].operands[0] = t;
    check!("use_after_loop", kernel_error(&k), ["op 3 (arith.add)", "operand 0", "outside the region that defines it"]);
}

#[test]
fn use_of_a_then_value_in_the_else_region() {
    let mut k = base();
    let u = inner(&k, 5, 0);
    k.body.ops[5].regions[1].ops[0].operands[1] = u;
    check!("use_across_branches", kernel_error(&k), ["op 5 (scf.if) > else > op 0 (arith.mul)", "operand 1"]);
}

#[test]
fn redefinition_of_a_value() {
    // In the same block.
    let mut k = base();
    k.body.ops[1].results[0] = k.body.ops[0].results[0];
    check!("redefinition", kernel_error(&k), ["op 1 (const)", "redefines"]);
    // A value of the loop body defined again after the loop: not visible there any
    // more, but still defined twice.
    let mut k = base();
    let (s, t) = (k.body.ops[3].results[0], inner(&k, 2, 0));
    k.body.ops[3].results[0] = t;
    rename_uses(&mut k.body, s, t);
    check!("redefinition_after_region", kernel_error(&k), ["op 3 (arith.add)", "redefines"]);
    // The same value defined in both branches of an if.
    let mut k = base();
    let u = inner(&k, 5, 0);
    k.body.ops[5].regions[1].ops[0].results[0] = u;
    k.body.ops[5].regions[1].ops[1].operands[0] = u;
    check!(
        "redefinition_in_sibling_regions",
        kernel_error(&k),
        ["op 5 (scf.if) > else > op 0 (arith.mul)", "redefines"]
    );
    // A loop's carried argument reusing a kernel value.
    let mut k = base();
    k.body.ops[2].regions[0].args[1] = k.body.ops[0].results[0];
    check!("redefinition_of_region_argument", kernel_error(&k), ["op 2 (scf.for) > body", "argument 1", "redefines"]);
}

#[test]
fn values_without_a_type_entry() {
    let mut k = base();
    k.body.ops[3].results[0] = Value(9999);
    check!("result_without_type", kernel_error(&k), ["op 3 (arith.add)", "#9999"]);
    let mut k = base();
    k.body.ops[3].operands[1] = Value(9999);
    check!("operand_without_type", kernel_error(&k), ["op 3 (arith.add)", "operand 1"]);
}

#[test]
fn malformed_control_flow() {
    // A for whose results do not match what it carries.
    let mut k = base();
    let extra = k.new_value(ejc_ir::types::Type::Scalar(ejc_ir::types::DType::I32));
    k.body.ops[2].results.push(extra);
    check!("for_result_count", kernel_error(&k), ["op 2 (scf.for)", "carries (i32) but returns (i32, i32)"]);
    // A yield that is not the last op of its region.
    let mut k = base();
    let body = &mut k.body.ops[2].regions[0];
    let y = body.ops[1].clone();
    body.ops.insert(0, y);
    check!("yield_not_last", kernel_error(&k), ["op 2 (scf.for) > body > op 0 (scf.yield)", "must be the last op"]);
    // An arithmetic op given a region.
    let mut k = base();
    k.body.ops[3].regions.push(Default::default());
    check!("regions_on_arith", kernel_error(&k), ["op 3 (arith.add)", "has regions"]);
    // An if with one region.
    let mut k = base();
    k.body.ops[5].regions.pop();
    check!("if_region_count", kernel_error(&k), ["op 5 (scf.if)", "1 regions, expected 2"]);
    // An op with the wrong number of operands.
    let mut k = base();
    let c1 = k.body.ops[1].results[0];
    k.body.ops[3].operands.push(c1);
    check!("operand_count", kernel_error(&k), ["op 3 (arith.add)", "expects 2 operand(s), got 3"]);
    // A store with a result.
    let mut k = base();
    let extra = k.new_value(ejc_ir::types::Type::Scalar(ejc_ir::types::DType::I32));
    k.body.ops[7].results.push(extra);
    check!("store_with_result", kernel_error(&k), ["op 7 (tile.store)", "produces ()"]);
}
