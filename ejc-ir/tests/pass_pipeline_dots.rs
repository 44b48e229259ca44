//! `pipeline-dots`: the key loop is rotated (prologue, loop running stage 1 of block j
//! and stage 0 of block j+1, epilogue); every value is computed as before, so results
//! are identical bit for bit, empty loops included; loops of other shapes are left alone.

mod common;

use common::{apply, assert_same_semantics, seed, ArgSpec};
use ejc_ir::flash::abi::run_interp;
use ejc_ir::flash::build_flash_kernel;
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::FlashShape;
use ejc_ir::ir::{walk_ops, OpKind};
use ejc_ir::passes::{default_pipeline, rotate_loops, run_pipeline, Pass, PipelineDots};
use ejc_ir::print::print_kernel;
use ejc_ir::spec;
use ejc_ir::types::DType;

/// Two products per iteration: `s = q·kᵀ`, a row max, `acc = acc·a + p·v`.
const TWO_DOTS: &str = r#"kernel @two_dots(%q: tensor<?x?xbf16>, %k: tensor<?x?xbf16>, %v: tensor<?x?xbf16>, %out: tensor<?x?xf32>, %n: i32) grid(1, 1, 1) {
  %0 = const 0 : i32
  %1 = const 16 : i32
  %2 = const 0.0 : f32
  %3 = tile.load %q[%0 +: 16, %0 +: 16] {pad = 0.0} : tile<16x16xbf16>
  %4 = tile.splat %2 {shape = [16, 16]} : tile<16x16xf32>
  %5 = tile.splat %2 {shape = [16]} : tile<16xf32>
  %6, %7 = scf.for %8 = %0 to %n step %1 iter_args(%9 = %4, %10 = %5) : tile<16x16xf32>, tile<16xf32> {
    %11 = tile.load %k[%8 +: 16, %0 +: 16] {pad = 0.0} : tile<16x16xbf16>
    %12 = tile.dot %3, %11, %4 {trans_b} : tile<16x16xf32>
    %13 = reduce.max %12 {axis = 1} : tile<16xf32>
    %14 = arith.max %10, %13 : tile<16xf32>
    %15 = math.exp2 %12 : tile<16x16xf32>
    %16 = arith.cast %15 {to = bf16} : tile<16x16xbf16>
    %17 = softmax.rescale %9, %14 : tile<16x16xf32>
    %18 = tile.load %v[%8 +: 16, %0 +: 16] {pad = 0.0} : tile<16x16xbf16>
    %19 = tile.dot %16, %18, %17 : tile<16x16xf32>
    scf.yield %19, %14
  }
  tile.store %out[%0 +: 16, %0 +: 16], %6
}
"#;

#[test]
fn rotates_a_two_product_loop() {
    let (before, after, printed) = apply(&PipelineDots, TWO_DOTS);
    snap!("pass_pipeline_dots__two_dots", printed.clone());
    // A prologue `if`, the rotated loop (carrying the probabilities and the row max
    // across), and an epilogue `if`.
    let top: Vec<&str> = after.body.ops.iter().map(|o| o.kind.name()).collect();
    let ifs = top.iter().filter(|n| **n == "scf.if").count();
    assert_eq!(ifs, 2, "{printed}");
    let lp = after.body.ops.iter().find(|o| o.kind == OpKind::For).unwrap();
    assert_eq!(lp.results.len(), 2 + 2 + 1, "acc, max, the two stage-0 values stage 1 reads, the pending index");
    // In the loop, the value product comes right after the score product.
    let body: Vec<&str> = lp.regions[0].ops.iter().map(|o| o.kind.name()).collect();
    let dots: Vec<usize> = body.iter().enumerate().filter(|(_, n)| **n == "tile.dot").map(|(i, _)| i).collect();
    assert_eq!(dots.len(), 2, "{printed}");
    assert!(body[dots[0]..dots[1]].iter().all(|n| !n.starts_with("math") && !n.starts_with("reduce")), "{printed}");
    // The value load of the epilogue continues the loop's: back ends may prefetch it
    // with the loop's copies.
    let mut k = before.clone();
    let rotations = rotate_loops(&mut k, false);
    assert_eq!(k, after);
    assert_eq!(rotations.len(), 1);
    let [(epi, in_loop)] = rotations[0].epilogue_loads[..] else { panic!("{rotations:?}") };
    let epilogue = after.body.ops.iter().rfind(|o| o.kind == OpKind::If).unwrap();
    assert!(epilogue.regions[0].ops.iter().any(|o| o.results.contains(&epi)), "{printed}");
    assert!(lp.regions[0].ops.iter().any(|o| o.results.contains(&in_loop) && o.kind.name() == "tile.load"));
    // Same results, loops of 0, 1, 2 and 3 iterations included.
    for n in [0.0, 5.0, 16.0, 17.0, 40.0] {
        let spec =
            ArgSpec::new().shape("q", &[16, 16]).shape("k", &[48, 16]).shape("v", &[48, 16]).shape("out", &[16, 16]);
        assert_same_semantics(&before, &after, &spec.scalar("n", n), [1, 1, 1], 2, seed());
    }
}

#[test]
fn leaves_other_loops_alone() {
    // One product: nothing to overlap it with.
    let one = TWO_DOTS
        .replace("%19 = tile.dot %16, %18, %17 : tile<16x16xf32>", "%19 = arith.add %17, %12 : tile<16x16xf32>");
    let (before, after, _) = apply(&PipelineDots, &one);
    assert_eq!(print_kernel(&before), print_kernel(&after));
    // The score product reads the accumulator: stage 0 would depend on stage 1.
    let dep = TWO_DOTS.replace("%12 = tile.dot %3, %11, %4 {trans_b}", "%12 = tile.dot %3, %11, %9 {trans_b}");
    let (before, after, _) = apply(&PipelineDots, &dep);
    assert_eq!(print_kernel(&before), print_kernel(&after));
    // The value product reads the key tile the score product reads: that tile would be
    // carried to the next iteration in registers.
    let shared = TWO_DOTS.replace("%19 = tile.dot %16, %18, %17", "%19 = tile.dot %16, %11, %17");
    let (before, after, _) = apply(&PipelineDots, &shared);
    assert_eq!(print_kernel(&before), print_kernel(&after));
}

/// Awkward shapes (b, sq, sk, hq, hkv, d): s_q ≠ s_k both ways, lengths off the block
/// size, GQA, MQA, a single query row, and rows that see no key at all (causal with
/// s_q > s_k), so loops run 0, 1 and many iterations.
const SHAPES: &[&str] = &["2,37,53,4,2,64", "1,45,21,2,1,64", "1,19,40,8,2,64", "1,1,23,2,2,64", "1,70,9,2,2,64"];

#[test]
fn every_flash_variant_gives_identical_results() {
    let spec = spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash.yaml")).unwrap();
    let seed = seed();
    for v in &spec.variants {
        let raw = build_flash_kernel(&v.name, &fx(v), DType::BF16, 64, 16, 16).unwrap();
        let opt = run_pipeline(&raw, &default_pipeline()).unwrap();
        let rotated = run_pipeline(&opt, &[Box::new(PipelineDots) as Box<dyn Pass>]).unwrap();
        // The key loop was rotated: it now carries the probabilities.
        let mut carried_bf16 = false;
        walk_ops(&rotated.body, &mut |o| {
            if o.kind == OpKind::For {
                carried_bf16 |= o.results.iter().any(|r| rotated.ty(*r).dtype() == DType::BF16);
            }
        });
        assert!(carried_bf16, "{}: the key loop was not rotated\n{}", v.name, print_kernel(&rotated));
        // And with the softmax sunk into the masks' branch: after the value product, the
        // branch (when there is one) also holds the softmax that follows it; only the
        // 16-bit probabilities (the next product's operand) are made after its join.
        let mut sunk = opt.clone();
        rotate_loops(&mut sunk, true);
        ejc_ir::verify::verify(&sunk).unwrap_or_else(|e| panic!("{}: {e}\n{}", v.name, print_kernel(&sunk)));
        walk_ops(&sunk.body, &mut |o| {
            if o.kind == OpKind::For && o.results.iter().any(|r| sunk.ty(*r).dtype() == DType::BF16) {
                let body = &o.regions[0].ops;
                let last_dot = body.iter().rposition(|x| matches!(x.kind, OpKind::Dot { .. })).unwrap();
                let after: Vec<&str> = body[last_dot + 1..].iter().map(|x| x.kind.name()).collect();
                if let Some(b) = after.iter().position(|n| *n == "scf.if") {
                    assert_eq!(
                        &after[b..],
                        ["scf.if", "arith.cast", "scf.yield"],
                        "{}: after the branch: {after:?}",
                        v.name
                    );
                }
            }
        });
        for (i, shape) in SHAPES.iter().enumerate() {
            let s = seed.wrapping_add(i as u64);
            let shape = FlashShape::parse(shape).unwrap();
            let inputs = random_inputs(&fx(v), DType::BF16, &shape, s);
            let rt = default_runtime(&fx(v), &shape, s);
            let a = run_interp(&opt, &rt, &inputs).unwrap();
            for (how, k) in [("rotated", &rotated), ("rotated and sunk", &sunk)] {
                let b = run_interp(k, &rt, &inputs).unwrap();
                assert!(
                    common::same_bits(&a.out.to_vec(), &b.out.to_vec())
                        && common::same_bits(&a.lse.to_vec(), &b.lse.to_vec()),
                    "{} shape={shape} seed={s}: the {how} kernel differs",
                    v.name
                );
            }
        }
    }
}

/// A flash variant's features, typed.
#[allow(dead_code)]
fn fx(v: &ejc_ir::spec::Variant) -> ejc_ir::flash::Features {
    ejc_ir::flash::Features::from_json(&v.features).expect("flash features")
}

/// Key block j lives in page `table[j / 16]` (a paged cache): stage 1's value load is
/// indexed through that scalar load. The pass computes the page again in stage 1 for its
/// own block instead of carrying it, so the rotated loop's value load is indexed by the
/// loop's induction variable (prefetchable); results are identical.
#[test]
fn recomputes_block_table_indices_in_stage_1() {
    let paged = r#"kernel @paged(%q: tensor<?x?xbf16>, %k: tensor<?x?x?xbf16>, %v: tensor<?x?x?xbf16>, %table: tensor<?xi32>, %out: tensor<?x?xf32>, %n: i32) grid(1, 1, 1) {
  %0 = const 0 : i32
  %1 = const 16 : i32
  %2 = const 0.0 : f32
  %3 = tile.load %q[%0 +: 16, %0 +: 16] {pad = 0.0} : tile<16x16xbf16>
  %4 = tile.splat %2 {shape = [16, 16]} : tile<16x16xf32>
  %5 = tile.splat %2 {shape = [16]} : tile<16xf32>
  %6, %7 = scf.for %8 = %0 to %n step %1 iter_args(%9 = %4, %10 = %5) : tile<16x16xf32>, tile<16xf32> {
    %b = arith.div %8, %1 : i32
    %p = tile.load %table[%b] {pad = 0.0} : i32
    %11 = tile.load %k[%p, %0 +: 16, %0 +: 16] {pad = 0.0} : tile<16x16xbf16>
    %12 = tile.dot %3, %11, %4 {trans_b} : tile<16x16xf32>
    %13 = reduce.max %12 {axis = 1} : tile<16xf32>
    %14 = arith.max %10, %13 : tile<16xf32>
    %15 = math.exp2 %12 : tile<16x16xf32>
    %16 = arith.cast %15 {to = bf16} : tile<16x16xbf16>
    %17 = softmax.rescale %9, %14 : tile<16x16xf32>
    %18 = tile.load %v[%p, %0 +: 16, %0 +: 16] {pad = 0.0} : tile<16x16xbf16>
    %19 = tile.dot %16, %18, %17 : tile<16x16xf32>
    scf.yield %19, %14
  }
  tile.store %out[%0 +: 16, %0 +: 16], %6
}
"#;
    let (before, after, printed) = apply(&PipelineDots, paged);
    let lp = after.body.ops.iter().find(|o| o.kind == OpKind::For).expect("a rotated loop");
    // Carried: acc, max, the two stage-0 tiles stage 1 reads, the pending index — no
    // page index.
    assert_eq!(lp.results.len(), 5, "{printed}");
    let scalars = lp.results[..4].iter().filter(|r| matches!(after.ty(**r), ejc_ir::types::Type::Scalar(_))).count();
    assert_eq!(scalars, 0, "{printed}");
    // Inside the rotated loop, two table loads: stage 0's (block j + s) and stage 1's (j).
    let mut table_loads = 0;
    walk_ops(&lp.regions[0], &mut |o: &ejc_ir::ir::Op| {
        if matches!(o.kind, OpKind::Load { .. }) && o.operands[0] == after.params[3].value {
            table_loads += 1;
        }
    });
    assert_eq!(table_loads, 2, "{printed}");
    for n in [0.0, 5.0, 16.0, 40.0, 64.0] {
        let spec = ArgSpec::new()
            .shape("q", &[16, 16])
            .shape("k", &[4, 16, 16])
            .shape("v", &[4, 16, 16])
            .shape("table", &[4])
            .shape("out", &[16, 16])
            .ints(0, 3);
        assert_same_semantics(&before, &after, &spec.scalar("n", n), [1, 1, 1], 2, seed());
    }
}
