//! `scale-fold` (`ejc_ir::passes::scale_fold`): the scores' last multiply moves into
//! `softmax.update` as its scale operand where the scale is a positive constant or a
//! parameter whose sign is the launch condition. Results are identical bit for bit
//! (the interpreter computes in f64, where scaling commutes with the maximum for
//! c > 0); with a negative scale they are not, which is why the condition is returned.
//! Snapshot in `snapshots/pass_scale_fold__online_softmax.snap`.

mod common;

use common::{assert_same_semantics, parse, seed, ArgSpec};
use ejc_ir::flash::abi::run_interp;
use ejc_ir::flash::build_flash_kernel;
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::FlashShape;
use ejc_ir::interp::Arg;
use ejc_ir::ir::{walk_ops, Kernel, OpKind};
use ejc_ir::passes::{default_pipeline, run_pipeline, scale_fold, ScaleFold};
use ejc_ir::print::print_kernel;
use ejc_ir::spec;
use ejc_ir::types::DType;

/// An online softmax over key blocks, its scores scaled by `%c` (the parameter, or
/// what replaces `%c` in the tests) and masked past `%n` keys.
const ONLINE: &str = r#"kernel @online(%q: tensor<?x?xbf16>, %k: tensor<?x?xbf16>, %v: tensor<?x?xbf16>, %out: tensor<?x?xf32>, %n: i32, %c: f32) grid(1, 1, 1) {
  %0 = const 0 : i32
  %1 = const 16 : i32
  %2 = const 0.0 : f32
  %ninf = const -inf : f32
  %3 = tile.load %q[%0 +: 16, %0 +: 16] {pad = 0.0} : tile<16x16xbf16>
  %4 = tile.splat %2 {shape = [16, 16]} : tile<16x16xf32>
  %5 = tile.splat %ninf {shape = [16]} : tile<16xf32>
  %6 = tile.splat %2 {shape = [16]} : tile<16xf32>
  %fill = tile.splat %ninf {shape = [16, 16]} : tile<16x16xf32>
  %cols = tile.arange {len = 16} : tile<16xi32>
  %scale = SCALE
  %7, %8, %9 = scf.for %j = %0 to %n step %1 iter_args(%acc = %4, %m = %5, %l = %6) : tile<16x16xf32>, tile<16xf32>, tile<16xf32> {
    %11 = tile.load %k[%j +: 16, %0 +: 16] {pad = 0.0} : tile<16x16xbf16>
    %12 = tile.dot %3, %11, %4 {trans_b} : tile<16x16xf32>
    %13 = arith.mul %12, %scale : tile<16x16xf32>
    %end = arith.sub %n, %j : i32
    %col = tile.expand_dims %cols {axis = 0} : tile<1x16xi32>
    %keep = cmp.lt %col, %end : tile<1x16xi1>
    %full = cmp.ge %end, %1 : i1
    %s = scf.if %full : tile<16x16xf32> {
      scf.yield %13
    } else {
      %sel = arith.select %keep, %13, %fill : tile<16x16xf32>
      scf.yield %sel
    }
    %p, %alpha, %m2, %l2 = softmax.update %s, %m, %l : tile<16x16xf32>, tile<16xf32>, tile<16xf32>, tile<16xf32>
    %acc2 = softmax.rescale %acc, %alpha : tile<16x16xf32>
    %pb = arith.cast %p {to = bf16} : tile<16x16xbf16>
    %18 = tile.load %v[%j +: 16, %0 +: 16] {pad = 0.0} : tile<16x16xbf16>
    %19 = tile.dot %pb, %18, %acc2 : tile<16x16xf32>
    scf.yield %19, %m2, %l2
  }
  %o, %lse = softmax.finalize %7, %8, %9 : tile<16x16xf32>, tile<16xf32>
  tile.store %out[%0 +: 16, %0 +: 16], %o
}
"#;

fn online(scale: &str) -> Kernel {
    parse(&ONLINE.replace("SCALE", scale))
}

/// Run the pass on a copy; the result verifies and round-trips through the printer.
fn fold(k: &Kernel) -> (Kernel, ScaleFold) {
    let mut after = k.clone();
    let f = scale_fold(&mut after);
    ejc_ir::verify::verify(&after)
        .unwrap_or_else(|e| panic!("invalid IR after scale-fold: {e}\n{}", print_kernel(&after)));
    let printed = print_kernel(&after);
    assert_eq!(print_kernel(&parse(&printed)), printed, "the pass output does not round-trip");
    (after, f)
}

fn scaled_updates(k: &Kernel) -> usize {
    let mut n = 0;
    walk_ops(&k.body, &mut |o| n += usize::from(o.kind == OpKind::SoftmaxUpdate && o.operands.len() == 4));
    n
}

fn spec_with(n: f64, c: f64) -> ArgSpec {
    ArgSpec::new()
        .shape("q", &[16, 16])
        .shape("k", &[48, 16])
        .shape("v", &[48, 16])
        .shape("out", &[16, 16])
        .scalar("n", n)
        .scalar("c", c)
}

#[test]
fn folds_a_parameter_scale_through_the_masks_branch() {
    let before = online("arith.mul %c, %c : f32");
    // `%scale = arith.mul %c, %c` is not known positive: nothing folds.
    let (after, f) = fold(&before);
    assert_eq!(f, ScaleFold::default());
    assert_eq!(after, before);
    // A parameter times a positive constant: the parameter's sign is the condition.
    let text =
        ONLINE.replace("%scale = SCALE", "%k2 = const 1.4426950408889634 : f32\n  %scale = arith.mul %c, %k2 : f32");
    let before = parse(&text);
    let (after, f) = fold(&before);
    assert_eq!(f, ScaleFold { folded: 1, positive: vec!["c".into()] });
    assert_eq!(scaled_updates(&after), 1);
    let printed = print_kernel(&after);
    snap!("pass_scale_fold__online_softmax", printed.clone());
    // The branch now yields the unscaled product (%20) and its select; the multiply is dead.
    assert!(printed.contains("scf.yield %20\n") && printed.contains("arith.select %24, %20, %8"), "{printed}");
    let du = ejc_ir::defuse::DefUse::new(&after);
    let mut muls = Vec::new();
    walk_ops(&after.body, &mut |o| {
        if o.kind == OpKind::Binary(ejc_ir::ir::BinOp::Mul)
            && matches!(after.ty(o.results[0]), ejc_ir::types::Type::Tile(..))
        {
            muls.push(o.results[0]);
        }
    });
    assert_eq!(muls.len(), 1);
    assert_eq!(du.use_count(muls[0]), 0, "{printed}");
    // Identical results for c > 0, over 0 to 3 key blocks, partial ones included.
    for n in [0.0, 7.0, 16.0, 40.0] {
        for c in [0.125, 1.0, 3.5] {
            assert_same_semantics(&before, &after, &spec_with(n, c), [1, 1, 1], 2, seed());
        }
    }
    // For c < 0 the rewrite does not hold (max(c·s) ≠ c·max(s)): the launch condition is needed.
    let args = common::random_args(&before, &spec_with(40.0, -0.5), &mut common::rng(seed()));
    let (a, _) = common::run(&before, &args, [1, 1, 1]).unwrap();
    let (b, _) = common::run(&after, &args, [1, 1, 1]).unwrap();
    let out = |r: &[Arg]| r[3].tensor().unwrap().to_vec();
    assert!(!common::same_bits(&out(&a), &out(&b)), "a negative scale should change the result");
}

#[test]
fn positive_constants_fold_without_a_condition_and_inner_scales_stay() {
    let (after, f) = fold(&online("const 0.5 : f32"));
    assert_eq!(f, ScaleFold { folded: 1, positive: vec![] });
    assert_eq!(scaled_updates(&after), 1);
    for c in [-1.0, 0.0] {
        let (_, f) = fold(&online(&format!("const {c:?} : f32")));
        assert_eq!(f.folded, 0, "c = {c}");
    }
    // A scale computed inside the loop is not in scope at every softmax: not folded.
    let inner = ONLINE
        .replace("%scale = SCALE\n", "")
        .replace("%13 = arith.mul %12, %scale", "%scale = arith.mul %c, %c : f32\n    %13 = arith.mul %12, %scale");
    let (_, f) = fold(&parse(&inner));
    assert_eq!(f.folded, 0);
}

/// Awkward shapes (b, sq, sk, hq, hkv, d), as in pass_pipeline_dots.rs.
const SHAPES: &[&str] = &["2,37,53,4,2,64", "1,45,21,2,1,64", "1,19,40,8,2,64", "1,70,9,2,2,64"];

#[test]
fn every_flash_variant_folds_and_gives_identical_results() {
    let spec = spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash.yaml")).unwrap();
    let seed = seed();
    for v in &spec.variants {
        let fx = ejc_ir::flash::Features::from_json(&v.features).expect("flash features");
        let raw = build_flash_kernel(&v.name, &fx, DType::BF16, 64, 16, 16).unwrap();
        let opt = run_pipeline(&raw, &default_pipeline()).unwrap();
        let (folded, f) = fold(&opt);
        // What each variant's last factor is: the softmax scale (times log2 e), the
        // run-time soft cap (times log2 e), or a constant (log2 e after a bias or a
        // score mod; 50·log2 e after gemma2's tanh).
        let want: &[&str] = match v.name.as_str() {
            "softcap" => &["logits_soft_cap"],
            "gemma2" | "bias" | "bias_dropout" => &[],
            _ => &["softmax_scale"],
        };
        assert_eq!(f.folded, 1, "{}: {}", v.name, print_kernel(&opt));
        assert_eq!(f.positive, want, "{}", v.name);
        for (i, shape) in SHAPES.iter().enumerate() {
            let s = seed.wrapping_add(i as u64);
            let shape = FlashShape::parse(shape).unwrap();
            let inputs = random_inputs(&fx, DType::BF16, &shape, s);
            let rt = default_runtime(&fx, &shape, s);
            let a = run_interp(&opt, &rt, &inputs).unwrap();
            let b = run_interp(&folded, &rt, &inputs).unwrap();
            assert!(
                common::same_bits(&a.out.to_vec(), &b.out.to_vec())
                    && common::same_bits(&a.lse.to_vec(), &b.lse.to_vec()),
                "{} shape={shape} seed={s}: the folded kernel differs",
                v.name
            );
        }
    }
}
