//! `dce` alone on small hand-written kernels: unused chains go, stores and what they
//! need stay, loops and ifs go only when nothing uses their results and they store
//! nothing. Snapshots in `snapshots/pass_dce__<case>.snap`; every case also runs on
//! the interpreter before and after the pass.

mod common;

use common::{apply, assert_same_semantics, seed, ArgSpec};
use ejc_ir::ir::{walk_ops, Kernel, OpKind};
use ejc_ir::passes::Dce;
use ejc_ir::print::print_kernel;

fn count(k: &Kernel, pred: impl Fn(&OpKind) -> bool) -> usize {
    let mut n = 0;
    walk_ops(&k.body, &mut |op| n += pred(&op.kind) as usize);
    n
}

#[test]
fn removes_unused_chains_and_keeps_what_stores_need() {
    let text = r#"kernel @chains(%x: tensor<?xf32>, %out: tensor<?xf32>, %n: i32) grid(1, 1, 1) {
  %c0 = const 0 : i32
  %c1 = const 1 : i32
  %a = tile.load %x[%c0 +: 8] {pad = 0.0} : tile<8xf32>
  %dead1 = math.exp %a : tile<8xf32>
  %dead2 = arith.mul %dead1, %dead1 : tile<8xf32>
  %dead3 = reduce.sum %dead2 {axis = 0} : f32
  %dead4 = arith.add %n, %c1 : i32
  %dead5 = tile.load %x[%dead4 +: 8] {pad = 0.0} : tile<8xf32>
  %live = arith.add %a, %a : tile<8xf32>
  tile.store %out[%c0 +: 8], %live
  %unused_dim = program.dim %x {axis = 0} : i32
  %unused_pid = program.id {axis = 0} : i32
}
"#;
    let (before, after, text) = apply(&Dce, text);
    assert_eq!(after.op_count(), 4, "{text}");
    snap!("pass_dce__chains", text);
    let spec = ArgSpec::new().shape("x", &[8]).shape("out", &[8]);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 4, seed());
}

#[test]
fn keeps_every_store_even_of_unused_looking_values() {
    let text = r#"kernel @stores(%x: tensor<?xi32>, %n: i32) grid(2, 1, 1) {
  %pid = program.id {axis = 0} : i32
  %v = arith.mul %n, %pid : i32
  tile.store %x[%pid], %v
  tile.store %x[%pid], %n
}
"#;
    let (before, after, text) = apply(&Dce, text);
    assert_eq!(print_kernel(&before), text, "nothing is dead");
    snap!("pass_dce__stores", text);
    assert_same_semantics(&before, &after, &ArgSpec::new().shape("x", &[3]), [2, 1, 1], 4, seed());
}

#[test]
fn removes_a_loop_with_unused_results_that_stores_nothing() {
    let text = r#"kernel @dead_loop(%x: tensor<?xf32>, %out: tensor<?xf32>, %n: i32) grid(1, 1, 1) {
  %c0 = const 0 : i32
  %c1 = const 1 : i32
  %zero = const 0.0 : f32
  %init = tile.splat %zero {shape = [4]} : tile<4xf32>
  %r, %count = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %init, %k = %c0) : tile<4xf32>, i32 {
    %t = tile.load %x[%i +: 4] {pad = 0.0} : tile<4xf32>
    %acc2 = arith.add %acc, %t : tile<4xf32>
    %k2 = arith.add %k, %c1 : i32
    scf.yield %acc2, %k2
  }
  %zero_cond = cmp.lt %n, %c0 : i1
  %unused_if = scf.if %zero_cond : i32 {
    scf.yield %c0
  } else {
    scf.yield %c1
  }
  %t0 = tile.load %x[%c0 +: 4] {pad = 0.0} : tile<4xf32>
  tile.store %out[%c0 +: 4], %t0
}
"#;
    let (before, after, text) = apply(&Dce, text);
    assert_eq!(count(&after, |k| matches!(k, OpKind::For | OpKind::If)), 0, "{text}");
    // The loop's inputs (the splat, `const 0.0`) and the if's condition went with them:
    // what is left is `const 0`, the load and the store.
    assert_eq!(after.op_count(), 3, "{text}");
    snap!("pass_dce__dead_loop", text);
    let spec = ArgSpec::new().shape("x", &[9]).shape("out", &[4]).ints(-2, 6);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 8, seed());
}

#[test]
fn keeps_a_loop_that_stores_and_cleans_inside_it() {
    let text = r#"kernel @live_loop(%x: tensor<?xf32>, %out: tensor<?xf32>, %n: i32) grid(1, 1, 1) {
  %c0 = const 0 : i32
  %c1 = const 1 : i32
  %c4 = const 4 : i32
  %unused = scf.for %i = %c0 to %n step %c1 iter_args(%k = %c0) : i32 {
    %t = tile.load %x[%i +: 4] {pad = 0.0} : tile<4xf32>
    %dead = math.exp %t : tile<4xf32>
    %t2 = arith.add %t, %t : tile<4xf32>
    %k2 = arith.add %k, %c4 : i32
    %cond = cmp.lt %i, %c4 : i1
    scf.if %cond {
      %dead_in_if = arith.mul %t2, %t2 : tile<4xf32>
      tile.store %out[%k +: 4], %t2
      scf.yield
    } else {
      scf.yield
    }
    scf.yield %k2
  }
  %cond2 = cmp.lt %n, %c1 : i1
  %c0f = const 7.0 : f32
  %ignored = scf.if %cond2 : i32 {
    tile.store %out[%c0], %c0f
    scf.yield %c0
  } else {
    scf.yield %c1
  }
}
"#;
    let (before, after, text) = apply(&Dce, text);
    // Both control-flow ops store, so both stay (results unused or not); the dead
    // ops inside their regions go, and the yields stay.
    assert_eq!(count(&after, |k| matches!(k, OpKind::For)), 1, "{text}");
    assert_eq!(count(&after, |k| matches!(k, OpKind::If)), 2, "{text}");
    assert_eq!(count(&after, |k| matches!(k, OpKind::Unary(_))), 0, "{text}");
    assert_eq!(count(&after, |k| matches!(k, OpKind::Binary(ejc_ir::ir::BinOp::Mul))), 0, "{text}");
    snap!("pass_dce__live_loop", text);
    let spec = ArgSpec::new().shape("x", &[11]).shape("out", &[20]).ints(-1, 6);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 8, seed());
}

#[test]
fn keeps_a_loop_whose_results_are_used_and_nested_dead_loops_go() {
    let text = r#"kernel @nested(%out: tensor<?xi32>, %n: i32) grid(1, 1, 1) {
  %c0 = const 0 : i32
  %c1 = const 1 : i32
  %sum = scf.for %i = %c0 to %n step %c1 iter_args(%s = %c0) : i32 {
    %inner = scf.for %j = %c0 to %i step %c1 iter_args(%t = %c0) : i32 {
      %t2 = arith.add %t, %j : i32
      scf.yield %t2
    }
    %s2 = arith.add %s, %i : i32
    scf.yield %s2
  }
  tile.store %out[%c0], %sum
}
"#;
    let (before, after, text) = apply(&Dce, text);
    assert_eq!(count(&after, |k| matches!(k, OpKind::For)), 1, "{text}");
    snap!("pass_dce__nested", text);
    let spec = ArgSpec::new().shape("out", &[1]).ints(-2, 9);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 8, seed());
}

#[test]
fn dce_on_a_front_end_kernel_keeps_its_outputs() {
    use ejc_ir::flash::abi::run_interp;
    use ejc_ir::flash::inputs::{default_runtime, random_inputs};
    use ejc_ir::flash::Features;
    use ejc_ir::flash::{build_flash_kernel, FlashShape};
    use ejc_ir::types::DType;
    let f = Features { causal: true, dropout: true, ..Default::default() };
    let raw = build_flash_kernel("k", &f, DType::F32, 16, 8, 8).unwrap();
    let opt = common::run_pass(&Dce, &raw);
    // The front end leaves a few unused constants (e.g. `const 1`); DCE drops them.
    assert!(opt.op_count() < raw.op_count());
    assert_eq!(count(&opt, |k| matches!(k, OpKind::Store { .. })), 2);
    let seed = seed();
    let shape = FlashShape::parse("1,13,9,2,2,16").unwrap();
    let inputs = random_inputs(&f, DType::F32, &shape, seed);
    let rt = default_runtime(&f, &shape, seed);
    let a = run_interp(&raw, &rt, &inputs).unwrap();
    let b = run_interp(&opt, &rt, &inputs).unwrap();
    assert!(common::same_bits(&a.out.to_vec(), &b.out.to_vec()), "seed {seed}");
    assert!(common::same_bits(&a.lse.to_vec(), &b.lse.to_vec()), "seed {seed}");
}
