//! `canonicalize` alone on small hand-written kernels: constant folding, the
//! algebraic identities, CSE across nested regions. Each case snapshots the printed
//! result (`snapshots/pass_canonicalize__<case>.snap`) and, where the kernel can run,
//! checks with the interpreter on random inputs that the pass changed no output bit.

mod common;

use common::{apply, assert_same_semantics, rng, run, seed, ArgSpec};
use ejc_ir::interp::Arg;
use ejc_ir::ir::{walk_ops, OpKind};
use ejc_ir::passes::Canonicalize;
use ejc_ir::print::print_kernel;

fn count(k: &ejc_ir::ir::Kernel, pred: impl Fn(&OpKind) -> bool) -> usize {
    let mut n = 0;
    walk_ops(&k.body, &mut |op| n += pred(&op.kind) as usize);
    n
}

const FOLD_INTEGERS: &str = r#"kernel @fold(%out: tensor<?xi32>, %flags: tensor<?xi1>, %u: tensor<?xu32>) grid(1, 1, 1) {
  %a = const 7 : i32
  %b = const -3 : i32
  %max = const 2147483647 : i32
  %one = const 1 : i32
  %add = arith.add %a, %b : i32
  %sub = arith.sub %a, %b : i32
  %mul = arith.mul %a, %b : i32
  %div = arith.div %a, %b : i32
  %rem = arith.rem %a, %b : i32
  %mx = arith.max %a, %b : i32
  %mn = arith.min %a, %b : i32
  %and = arith.and %a, %b : i32
  %or = arith.or %a, %b : i32
  %xor = arith.xor %a, %b : i32
  %shl = arith.shl %a, %a : i32
  %shr = arith.shr %b, %one : i32
  %mulhi = arith.mulhi %max, %max : i32
  %wrap = arith.add %max, %one : i32
  %neg = math.neg %b : i32
  %abs = math.abs %b : i32
  %not = math.not %a : i32
  %chain = arith.mul %add, %sub : i32
  %i0 = const 0 : i32
  %i1 = const 1 : i32
  %i2 = const 2 : i32
  %i3 = const 3 : i32
  %i4 = const 4 : i32
  %i5 = const 5 : i32
  %i6 = const 6 : i32
  %i7 = const 7 : i32
  %i8 = const 8 : i32
  %i9 = const 9 : i32
  %i10 = const 10 : i32
  %i11 = const 11 : i32
  %i12 = const 12 : i32
  %i13 = const 13 : i32
  %i14 = const 14 : i32
  %i15 = const 15 : i32
  %i16 = const 16 : i32
  %i17 = const 17 : i32
  tile.store %out[%i0], %add
  tile.store %out[%i1], %sub
  tile.store %out[%i2], %mul
  tile.store %out[%i3], %div
  tile.store %out[%i4], %rem
  tile.store %out[%i5], %mx
  tile.store %out[%i6], %mn
  tile.store %out[%i7], %and
  tile.store %out[%i8], %or
  tile.store %out[%i9], %xor
  tile.store %out[%i10], %shl
  tile.store %out[%i11], %shr
  tile.store %out[%i12], %mulhi
  tile.store %out[%i13], %wrap
  tile.store %out[%i14], %neg
  tile.store %out[%i15], %abs
  tile.store %out[%i16], %not
  tile.store %out[%i17], %chain
  %lt = cmp.lt %b, %a : i1
  %eq = cmp.eq %a, %b : i1
  %sel = arith.select %lt, %a, %b : i32
  %t = const 1 : i1
  %f = const 0 : i1
  %band = arith.and %lt, %eq : i1
  %bxor = arith.xor %t, %lt : i1
  %bnot = math.not %f : i1
  %cast = arith.cast %lt {to = i32} : i32
  tile.store %flags[%i0], %lt
  tile.store %flags[%i1], %eq
  tile.store %flags[%i2], %band
  tile.store %flags[%i3], %bxor
  tile.store %flags[%i4], %bnot
  tile.store %out[%i5], %sel
  tile.store %out[%i6], %cast
  %ub = const 4294967295 : u32
  %ushift = arith.shr %ub, %ub : u32
  %unot = math.not %ub : u32
  %ucast = arith.cast %b {to = u32} : u32
  tile.store %u[%i0], %ushift
  tile.store %u[%i1], %unot
  tile.store %u[%i2], %ucast
}
"#;

#[test]
fn folds_scalar_integer_and_boolean_ops() {
    let (before, after, text) = apply(&Canonicalize, FOLD_INTEGERS);
    // Every computing op became a constant; only constants and stores are left.
    assert_eq!(count(&after, |k| !matches!(k, OpKind::Const { .. } | OpKind::Store { .. })), 0, "{text}");
    snap!("pass_canonicalize__fold_integers", text);
    let spec = ArgSpec::new().shape("out", &[18]).shape("flags", &[5]).shape("u", &[3]);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 1, seed());
}

#[test]
fn folded_values_are_what_the_interpreter_computes() {
    // Spot-check a few folds by hand (the semantic test compares with the interpreter;
    // this pins the interpreter's integer semantics too).
    let (_, after, _) = apply(&Canonicalize, FOLD_INTEGERS);
    let mut args = common::random_args(
        &after,
        &ArgSpec::new().shape("out", &[18]).shape("flags", &[5]).shape("u", &[3]),
        &mut rng(0),
    );
    ejc_ir::interp::launch(&after, &mut args, [1, 1, 1]).unwrap();
    let Arg::Tensor(out) = &args[0] else { unreachable!() };
    let Arg::Tensor(u) = &args[2] else { unreachable!() };
    let out = out.to_vec();
    // add, sub, mul, div (truncating), rem (sign of the dividend), max, min.
    assert_eq!(&out[0..5], &[4.0, 10.0, -21.0, -2.0, 1.0]);
    // 7 and -3, 7 or -3, 7 xor -3, 7 << 7, -3 >> 1 (arithmetic).
    assert_eq!(&out[7..12], &[5.0, -1.0, -6.0, 896.0, -2.0]);
    // mulhi(MAX, MAX) = (2^31 - 1)^2 >> 32 = 2^30 - 1; MAX + 1 wraps.
    assert_eq!(out[12], 1073741823.0);
    assert_eq!(out[13], -2147483648.0);
    assert_eq!(&out[14..18], &[3.0, 3.0, -8.0, 40.0]);
    // select(-3 < 7, 7, -3) = 7 and cast(true) = 1 overwrote slots 5 and 6.
    assert_eq!(&out[5..7], &[7.0, 1.0]);
    // u32: logical shift by 31 (4294967295 >> (4294967295 & 31)), not, cast of -3.
    assert_eq!(u.to_vec(), vec![1.0, 0.0, 4294967293.0]);
}

#[test]
fn float_ops_are_not_folded() {
    let text = r#"kernel @floats(%out: tensor<?xf32>, %flags: tensor<?xi1>) grid(1, 1, 1) {
  %a = const 1.5 : f32
  %b = const 0.1 : f32
  %sum = arith.add %a, %b : f32
  %prod = arith.mul %a, %b : f32
  %e = math.exp %b : f32
  %lt = cmp.lt %a, %b : i1
  %n = const 3 : i32
  %tof = arith.cast %n {to = f32} : f32
  %toi = arith.cast %a {to = i32} : i32
  %c0 = const 0 : i32
  %c1 = const 1 : i32
  %c2 = const 2 : i32
  tile.store %out[%c0], %sum
  tile.store %out[%c1], %prod
  tile.store %out[%c2], %e
  tile.store %out[%n], %tof
  tile.store %flags[%c0], %lt
  %toi2 = arith.cast %toi {to = f32} : f32
  tile.store %out[%toi], %toi2
}
"#;
    let (before, after, text) = apply(&Canonicalize, text);
    // Nothing folds: every op whose operands or result is a float stays.
    assert_eq!(print_kernel(&before), text);
    snap!("pass_canonicalize__floats_not_folded", text);
    let spec = ArgSpec::new().shape("out", &[4]).shape("flags", &[1]);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 1, seed());
}

#[test]
fn integer_division_by_zero_is_left_for_run_time() {
    let text = r#"kernel @div0(%out: tensor<?xi32>, %n: i32) grid(1, 1, 1) {
  %a = const 7 : i32
  %z = const 0 : i32
  %c = cmp.lt %n, %z : i1
  %r = scf.if %c : i32 {
    %d = arith.div %a, %z : i32
    %m = arith.rem %a, %z : i32
    %s = arith.add %d, %m : i32
    scf.yield %s
  } else {
    scf.yield %a
  }
  tile.store %out[%z], %r
}
"#;
    let (before, after, text) = apply(&Canonicalize, text);
    assert_eq!(
        count(&after, |k| matches!(k, OpKind::Binary(ejc_ir::ir::BinOp::Div | ejc_ir::ir::BinOp::Rem))),
        2,
        "{text}"
    );
    snap!("pass_canonicalize__division_by_zero", text);
    // n >= 0 never divides; n < 0 fails at run time, before and after alike.
    let spec = ArgSpec::new().shape("out", &[1]);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 16, seed());
    let err = run(
        &after,
        &[Arg::Tensor(ejc_ir::tensor::HostTensor::zeros(ejc_ir::types::DType::I32, &[1])), Arg::Scalar(-1.0)],
        [1, 1, 1],
    )
    .unwrap_err();
    assert!(err.contains("integer division by zero"), "{err}");
}

#[test]
fn identities() {
    let text = r#"kernel @identities(%x: i32, %y: u32, %f: f32, %b: i1, %t: tensor<?xi32>, %out: tensor<?xi32>, %fo: tensor<?xf32>, %bo: tensor<?xi1>, %uo: tensor<?xu32>) grid(1, 1, 1) {
  %c0 = const 0 : i32
  %c1 = const 1 : i32
  %cmax = const 2147483647 : i32
  %u0 = const 0 : u32
  %u1 = const 1 : u32
  %f0 = const 0.0 : f32
  %f1 = const 1.0 : f32
  %tt = const 1 : i1
  %ff = const 0 : i1
  %x1 = arith.add %x, %c0 : i32
  %x2 = arith.add %c0, %x1 : i32
  %x3 = arith.sub %x2, %c0 : i32
  %x4 = arith.mul %x3, %c1 : i32
  %x5 = arith.mul %c1, %x4 : i32
  %x6 = arith.div %x5, %c1 : i32
  %x7 = arith.min %x6, %cmax : i32
  %x8 = arith.min %cmax, %x7 : i32
  tile.store %out[%c0], %x8
  %y1 = arith.add %y, %u0 : u32
  %y2 = arith.mul %u1, %y1 : u32
  %y3 = arith.div %y2, %u1 : u32
  tile.store %uo[%c0], %y3
  %b1 = arith.or %b, %ff : i1
  %b2 = arith.or %ff, %b1 : i1
  %b3 = arith.and %b2, %tt : i1
  %b4 = arith.and %tt, %b3 : i1
  tile.store %bo[%c0], %b4
  %f2 = arith.mul %f, %f1 : f32
  %f3 = arith.div %f2, %f1 : f32
  %f4 = arith.mul %f1, %f3 : f32
  tile.store %fo[%c0], %f4
  %tile = tile.load %t[%c0 +: 8] {pad = 0} : tile<8xi32>
  %tile1 = arith.add %tile, %c0 : tile<8xi32>
  %tile2 = arith.mul %c1, %tile1 : tile<8xi32>
  tile.store %out[%c1 +: 8], %tile2
  %keep1 = arith.sub %c0, %x : i32
  %keep2 = arith.add %f, %f0 : f32
  %keep3 = arith.or %b, %tt : i1
  %keep4 = arith.min %y, %u1 : u32
  %keep5 = arith.mul %x, %c0 : i32
  %c9 = const 9 : i32
  %c10 = const 10 : i32
  tile.store %out[%c9], %keep1
  tile.store %fo[%c1], %keep2
  tile.store %bo[%c1], %keep3
  tile.store %uo[%c1], %keep4
  tile.store %out[%c10], %keep5
}
"#;
    let (before, after, text) = apply(&Canonicalize, text);
    // Every identity went: the stores take %x, %y, %b, %f and the loaded tile.
    for line in
        ["tile.store %out[%0], %x", "tile.store %uo[%0], %y", "tile.store %bo[%0], %b", "tile.store %fo[%0], %f"]
    {
        assert!(text.contains(line), "missing `{line}` in\n{text}");
    }
    // The look-alikes stay: 0 - x, the float x + 0.0 (it turns -0 into +0), x or true,
    // a u32 min, x * 0 (not an identity this pass knows).
    for op in ["arith.sub %0, %x", "arith.add %f, %5", "arith.or %b, %7", "arith.min %y, %4", "arith.mul %x, %0"] {
        assert!(text.contains(op), "missing `{op}` in\n{text}");
    }
    snap!("pass_canonicalize__identities", text);
    let spec = ArgSpec::new()
        .shape("t", &[8])
        .shape("out", &[11])
        .shape("fo", &[2])
        .shape("bo", &[2])
        .shape("uo", &[2])
        .ints(-1000, 1000);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 8, seed());
    // -0.0 + 0.0 is +0.0: the float add must stay to give it.
    let mut args = common::random_args(&before, &spec, &mut rng(1));
    args[2] = Arg::Scalar(-0.0);
    let (a, _) = run(&before, &args, [1, 1, 1]).unwrap();
    let (b, _) = run(&after, &args, [1, 1, 1]).unwrap();
    let (Arg::Tensor(a), Arg::Tensor(b)) = (&a[6], &b[6]) else { unreachable!() };
    assert!(common::same_bits(&a.to_vec(), &b.to_vec()));
    assert_eq!(a.to_vec()[1].to_bits(), 0.0f64.to_bits());
}

#[test]
fn cse_reuses_outer_values_inside_regions_but_never_inner_values_outside() {
    let text = r#"kernel @cse(%n: i32, %x: tensor<?xi32>, %out: tensor<?xi32>) grid(1, 1, 1) {
  %c0 = const 0 : i32
  %c1 = const 1 : i32
  %c3 = const 3 : i32
  %sq = arith.mul %n, %n : i32
  %r = scf.for %i = %c0 to %c3 step %c1 iter_args(%acc = %c0) : i32 {
    %c0b = const 0 : i32
    %sq2 = arith.mul %n, %n : i32
    %t = arith.add %acc, %sq2 : i32
    %u = arith.add %t, %i : i32
    %u2 = arith.add %t, %i : i32
    %v = arith.sub %u, %u2 : i32
    %w = arith.add %v, %c0b : i32
    scf.yield %w
  }
  %cond = cmp.lt %n, %c3 : i1
  %sel = scf.if %cond : i32 {
    %inner = arith.mul %n, %c3 : i32
    scf.yield %inner
  } else {
    %inner2 = arith.mul %n, %c3 : i32
    %inner3 = arith.add %inner2, %c1 : i32
    scf.yield %inner3
  }
  %after = arith.mul %n, %c3 : i32
  %s1 = arith.add %sel, %after : i32
  %s2 = arith.add %s1, %r : i32
  %s3 = arith.add %s2, %sq : i32
  tile.store %out[%c0], %s3
  %three = const 3 : i32
  %again = arith.mul %n, %three : i32
  tile.store %out[%c1], %again
}
"#;
    let (before, after, text) = apply(&Canonicalize, text);
    // In the loop: `%n * %n` and `const 0` reuse the outer ones; the duplicate
    // `%t + %i` is merged, so `%v` is `%u - %u`.
    let body = &after.body.ops.iter().find(|o| matches!(o.kind, OpKind::For)).unwrap().regions[0];
    assert_eq!(body.ops.len(), 4, "{text}");
    // `%n * %c3` appears three times: in each branch of the `if` (siblings never
    // share) and once after it (the branches' values are not visible there); the
    // last multiplication, by a second `const 3`, reuses the one after the `if`.
    assert_eq!(count(&after, |k| matches!(k, OpKind::Binary(ejc_ir::ir::BinOp::Mul))), 4, "{text}");
    snap!("pass_canonicalize__cse_nested_regions", text);
    let spec = ArgSpec::new().shape("out", &[2]);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 8, seed());
}

#[test]
fn cse_merges_multi_result_ops_and_keeps_distinct_constants_apart() {
    let text = r#"kernel @multi(%s: tensor<?x?xf32>, %o: tensor<?x?xf32>, %f: tensor<?xf32>) grid(1, 1, 1) {
  %c0 = const 0 : i32
  %c1 = const 1 : i32
  %ninf = const -inf : f32
  %zero = const 0.0 : f32
  %mzero = const -0.0 : f32
  %izero = const 0 : i32
  %m0 = tile.splat %ninf {shape = [4]} : tile<4xf32>
  %l0 = tile.splat %zero {shape = [4]} : tile<4xf32>
  %st = tile.load %s[%c0 +: 4, %c0 +: 4] {pad = 0.0} : tile<4x4xf32>
  %p, %alpha, %m, %l = softmax.update %st, %m0, %l0 : tile<4x4xf32>, tile<4xf32>, tile<4xf32>, tile<4xf32>
  %p2, %alpha2, %m2, %l2 = softmax.update %st, %m0, %l0 : tile<4x4xf32>, tile<4xf32>, tile<4xf32>, tile<4xf32>
  %q = arith.add %p, %p2 : tile<4x4xf32>
  tile.store %o[%c0 +: 4, %c0 +: 4], %q
  %ls = arith.add %l, %l2 : tile<4xf32>
  tile.store %f[%c0 +: 4], %ls
  %z1 = arith.add %zero, %mzero : f32
  tile.store %f[%izero], %z1
}
"#;
    let (before, after, text) = apply(&Canonicalize, text);
    assert_eq!(count(&after, |k| matches!(k, OpKind::SoftmaxUpdate)), 1, "{text}");
    // 0.0 and -0.0 are different constants, and i32 0 is not f32 0.0.
    assert!(text.contains("const -0.0 : f32") && text.contains("const 0.0 : f32"), "{text}");
    assert_eq!(count(&after, |k| matches!(k, OpKind::Const { .. })), 5, "{text}");
    snap!("pass_canonicalize__cse_multi_result", text);
    let spec = ArgSpec::new().shape("s", &[4, 4]).shape("o", &[4, 4]).shape("f", &[4]);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 4, seed());
}

#[test]
fn loads_are_not_deduplicated() {
    let text = r#"kernel @loads(%x: tensor<?xf32>, %out: tensor<?xf32>) grid(1, 1, 1) {
  %c0 = const 0 : i32
  %a = tile.load %x[%c0 +: 4] {pad = 0.0} : tile<4xf32>
  %a2 = arith.add %a, %a : tile<4xf32>
  tile.store %x[%c0 +: 4], %a2
  %b = tile.load %x[%c0 +: 4] {pad = 0.0} : tile<4xf32>
  %c = tile.load %x[%c0 +: 4] {pad = 0.0} : tile<4xf32>
  %d = arith.add %b, %c : tile<4xf32>
  tile.store %out[%c0 +: 4], %d
}
"#;
    let (before, after, text) = apply(&Canonicalize, text);
    assert_eq!(count(&after, |k| matches!(k, OpKind::Load { .. })), 3, "{text}");
    assert_eq!(print_kernel(&before), text, "nothing to change");
    snap!("pass_canonicalize__loads_not_cse", text);
    let spec = ArgSpec::new().shape("x", &[6]).shape("out", &[6]);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 4, seed());
}

#[test]
fn folding_feeds_identities_and_cse_until_nothing_changes() {
    // `%k = 2 - 2` folds to 0, which makes `%x + %k` an identity, which makes the two
    // adds of `%y` the same op: three rounds of the fixpoint.
    let text = r#"kernel @fixpoint(%x: i32, %out: tensor<?xi32>) grid(1, 1, 1) {
  %c2 = const 2 : i32
  %k = arith.sub %c2, %c2 : i32
  %y = arith.add %x, %k : i32
  %a = arith.mul %y, %c2 : i32
  %b = arith.mul %x, %c2 : i32
  %s = arith.sub %a, %b : i32
  tile.store %out[%k], %s
}
"#;
    let (before, after, text) = apply(&Canonicalize, text);
    assert_eq!(count(&after, |k| matches!(k, OpKind::Binary(ejc_ir::ir::BinOp::Mul))), 1, "{text}");
    snap!("pass_canonicalize__fixpoint", text);
    assert_same_semantics(&before, &after, &ArgSpec::new().shape("out", &[1]), [1, 1, 1], 4, seed());
    // And the pass is idempotent.
    let again = common::run_pass(&Canonicalize, &after);
    assert_eq!(print_kernel(&again), text);
}

#[test]
fn canonicalize_keeps_every_spec_kernel_equivalent() {
    // The front end's kernels through canonicalize alone, on a few variants that use
    // every construct (loops, ifs from varlen, dropout's u32 arithmetic).
    use ejc_ir::flash::abi::run_interp;
    use ejc_ir::flash::inputs::{default_runtime, random_inputs};
    use ejc_ir::flash::{build_flash_kernel, FlashShape};
    use ejc_ir::flash::{Features, Window};
    use ejc_ir::types::DType;
    let seed = seed();
    let cases = [
        Features { causal: true, sliding_window: Some(Window::Runtime), dropout: true, ..Default::default() },
        Features { varlen: true, causal: true, ..Default::default() },
        Features { segment_ids: true, sinks: true, ..Default::default() },
    ];
    for f in cases {
        let raw = build_flash_kernel("k", &f, DType::F32, 16, 8, 8).unwrap();
        let opt = common::run_pass(&Canonicalize, &raw);
        assert!(opt.op_count() < raw.op_count());
        let shape = FlashShape::parse("2,11,13,2,1,16").unwrap();
        let inputs = random_inputs(&f, DType::F32, &shape, seed);
        let rt = default_runtime(&f, &shape, seed);
        let a = run_interp(&raw, &rt, &inputs).unwrap();
        let b = run_interp(&opt, &rt, &inputs).unwrap();
        assert!(common::same_bits(&a.out.to_vec(), &b.out.to_vec()), "{f:?} seed {seed}");
        assert!(common::same_bits(&a.lse.to_vec(), &b.lse.to_vec()), "{f:?} seed {seed}");
    }
}
