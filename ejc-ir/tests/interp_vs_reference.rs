//! The interpreter running the spec's IR equals the reference, on every variant of
//! `specs/flash.yaml`, over awkward shapes, before and after the pass pipeline.
//!
//! Inputs are fresh random numbers: the seed is printed on failure (set
//! `EJC_TEST_SEED` to replay one run).

mod common;

use ejc_ir::flash::abi::{run_interp, run_interp_with_stats};
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::reference;
use ejc_ir::flash::Features;
use ejc_ir::flash::{build_flash_kernel, main_kernel, FlashOutputs, FlashShape};
use ejc_ir::ir::Kernel;
use ejc_ir::passes::{default_pipeline, run_pipeline, Canonicalize, ClassifyMaskBlocks};
use ejc_ir::spec::{self, Spec};
use ejc_ir::tensor::compare;
use ejc_ir::types::DType;

fn spec() -> Spec {
    spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash.yaml")).expect("specs/flash.yaml loads")
}

/// Awkward shapes (b, sq, sk, hq, hkv, d): s_q != s_k both ways, lengths that are
/// not multiples of any block, GQA 8:2, MQA, and a single-row query.
const SHAPES: &[&str] = &["2,37,53,4,2,64", "1,45,21,2,1,64", "1,19,40,8,2,64", "2,29,29,4,1,64", "1,1,23,2,2,64"];

fn check(label: &str, got: &FlashOutputs, want: &FlashOutputs, tol: f64) {
    let (rel, max_abs) = compare(&got.out.to_vec(), &want.out.to_vec());
    assert!(rel <= tol, "{label}: out rel_err={rel:e} max_abs_err={max_abs:e} > {tol:e}");
    let (rel, max_abs) = compare(&got.lse.to_vec(), &want.lse.to_vec());
    assert!(rel <= tol, "{label}: lse rel_err={rel:e} max_abs_err={max_abs:e} > {tol:e}");
}

fn run_case(kernel: &Kernel, f: &Features, dtype: DType, shape: &str, seed: u64, tol: f64) -> FlashOutputs {
    let shape = FlashShape::parse(shape).unwrap();
    let inputs = random_inputs(f, dtype, &shape, seed);
    let rt = default_runtime(f, &shape, seed);
    let want = reference(f, &rt, &inputs).expect("reference");
    let got = run_interp(kernel, &rt, &inputs).unwrap_or_else(|e| panic!("{}: {e}", kernel.name));
    check(&format!("{} shape={shape} seed={seed}", kernel.name), &got, &want, tol);
    got
}

#[test]
fn every_variant_f32_matches_reference_before_and_after_passes() {
    let spec = spec();
    let seed = common::seed();
    for v in &spec.variants {
        // A 16 x 16 tiling gives several query and key blocks on these shapes, so
        // every block class (skip / full / partial) occurs.
        let raw = build_flash_kernel(&v.name, &fx(v), DType::F32, 64, 16, 16).unwrap();
        let opt = run_pipeline(&raw, &default_pipeline()).unwrap();
        for (i, shape) in SHAPES.iter().enumerate() {
            let s = seed.wrapping_add(i as u64);
            let a = run_case(&raw, &fx(v), DType::F32, shape, s, 1e-6);
            let b = run_case(&opt, &fx(v), DType::F32, shape, s, 1e-6);
            // Skipping a fully masked block is exact: the pipeline changes no bit.
            assert_eq!(a.out.to_vec(), b.out.to_vec(), "{}: passes changed the output", v.name);
        }
    }
}

#[test]
fn spec_schedule_points_match_reference() {
    let spec = spec();
    let seed = common::seed();
    for v in &spec.variants {
        for (bm, bn) in spec.schedule.points(&["block_m", "block_n"]).iter().map(|c| (c["block_m"], c["block_n"])) {
            let k = main_kernel(&spec, v, DType::F32, 64, bm, bn).unwrap();
            let k = run_pipeline(&k, &default_pipeline()).unwrap();
            run_case(&k, &fx(v), DType::F32, "1,150,131,2,1,64", seed, 1e-6);
        }
    }
}

#[test]
fn head_dim_128_and_half_precision_inputs() {
    let spec = spec();
    let seed = common::seed();
    for v in &spec.variants {
        for (dtype, tol) in [(DType::BF16, 1e-2), (DType::F16, 5e-3), (DType::F32, 1e-6)] {
            let k = build_flash_kernel(&v.name, &fx(v), dtype, 128, 32, 16).unwrap();
            let k = run_pipeline(&k, &default_pipeline()).unwrap();
            run_case(&k, &fx(v), dtype, "2,41,35,4,2,128", seed, tol);
        }
    }
}

#[test]
fn fully_masked_rows_give_zero_output_and_neg_inf_lse() {
    // Causal with s_q > s_k: the first s_q - s_k query rows see no key.
    let f = Features { causal: true, ..Default::default() };
    let k = run_pipeline(&build_flash_kernel("c", &f, DType::F32, 64, 16, 16).unwrap(), &default_pipeline()).unwrap();
    let got = run_case(&k, &f, DType::F32, "2,40,13,2,2,64", common::seed(), 1e-6);
    let (out, lse) = (got.out.to_vec(), got.lse.to_vec());
    assert!(out.iter().chain(&lse).all(|x| !x.is_nan()), "NaN in output");
    for b in 0..2 {
        for h in 0..2 {
            for i in 0..40 {
                let l = got.lse.get(&[b, h, i]);
                if i < 27 {
                    assert_eq!(l, f64::NEG_INFINITY, "row {i} sees no key");
                    assert!((0..64).all(|d| got.out.get(&[b, i, h, d]) == 0.0));
                } else {
                    assert!(l.is_finite());
                }
            }
        }
    }
}

#[test]
fn causal_blocks_are_skipped_and_only_partial_blocks_masked() {
    // 64 x 64 causal, 16 x 16 blocks: 4 query blocks see 1, 2, 3, 4 key blocks
    // (10 of 16); only the 4 diagonal blocks are partial.
    let f = Features { causal: true, ..Default::default() };
    let raw = build_flash_kernel("c", &f, DType::F32, 64, 16, 16).unwrap();
    let opt = run_pipeline(&raw, &default_pipeline()).unwrap();
    let shape = FlashShape::parse("1,64,64,1,1,64").unwrap();
    let inputs = random_inputs(&f, DType::F32, &shape, 3);
    let rt = default_runtime(&f, &shape, 3);
    let (_, raw_stats) = run_interp_with_stats(&raw, &rt, &inputs).unwrap();
    let (_, opt_stats) = run_interp_with_stats(&opt, &rt, &inputs).unwrap();
    assert_eq!(raw_stats.count("tile.dot"), 2 * 16);
    assert_eq!(opt_stats.count("tile.dot"), 2 * 10);
    assert_eq!(raw_stats.count("mask.apply"), 16);
    // Every visited block tests `block_full`; only the 4 partial (diagonal) blocks
    // apply the per-element mask. Seen before lowering, where the mask ops are ops.
    let classified = run_pipeline(&raw, &[Box::new(Canonicalize), Box::new(ClassifyMaskBlocks)]).unwrap();
    let (_, stats) = run_interp_with_stats(&classified, &rt, &inputs).unwrap();
    assert_eq!(stats.count("mask.block_full"), 10);
    assert_eq!(stats.count("mask.apply"), 4);
    assert_eq!(opt_stats.count("scf.if"), 10);
}

#[test]
fn sliding_window_skips_blocks_on_both_sides() {
    // Window (16, 0) with causal on 64 x 64 and 16 x 16 blocks: each query block sees
    // its diagonal block and the one before it.
    let f = Features {
        causal: true,
        sliding_window: Some(ejc_ir::flash::Window::Fixed { left: 16, right: 0 }),
        ..Default::default()
    };
    let opt = run_pipeline(&build_flash_kernel("w", &f, DType::F32, 64, 16, 16).unwrap(), &default_pipeline()).unwrap();
    let shape = FlashShape::parse("1,64,64,1,1,64").unwrap();
    let inputs = random_inputs(&f, DType::F32, &shape, 5);
    let rt = default_runtime(&f, &shape, 5);
    let (got, stats) = run_interp_with_stats(&opt, &rt, &inputs).unwrap();
    assert_eq!(stats.count("tile.dot"), 2 * 7);
    check("window", &got, &reference(&f, &rt, &inputs).unwrap(), 1e-6);
}

/// A flash variant's features, typed.
#[allow(dead_code)]
fn fx(v: &ejc_ir::spec::Variant) -> ejc_ir::flash::Features {
    ejc_ir::flash::Features::from_json(&v.features).expect("flash features")
}

#[test]
fn value_head_dim_of_its_own_every_variant() {
    // v (and the output) with a head dim apart from q/k's, narrower and wider, on every
    // variant, before and after the pass pipeline; then the spec's own 192/128 kernel.
    let spec = spec();
    let seed = common::seed();
    for v in &spec.variants {
        for (i, (d, dv)) in [(32usize, 16usize), (16, 48)].into_iter().enumerate() {
            let dims = ejc_ir::flash::HeadDims { qk: d, v: dv };
            let raw = build_flash_kernel(&v.name, &fx(v), DType::F32, dims, 16, 16).unwrap();
            let opt = run_pipeline(&raw, &default_pipeline()).unwrap();
            let shape = format!("2,37,53,4,2,{d},{dv}");
            let s = seed.wrapping_add(i as u64);
            let a = run_case(&raw, &fx(v), DType::F32, &shape, s, 1e-6);
            let b = run_case(&opt, &fx(v), DType::F32, &shape, s, 1e-6);
            assert_eq!(a.out.shape[2..], [4, dv]);
            assert_eq!(a.out.to_vec(), b.out.to_vec(), "{}: passes changed the output", v.name);
        }
    }
    let v = spec.variant("causal").unwrap();
    let dims = ejc_ir::flash::HeadDims { qk: 192, v: 128 };
    let k = main_kernel(&spec, v, DType::BF16, dims, 64, 64).unwrap();
    assert_eq!(k.name, "flash_causal_bf16_d192v128_m64_n64");
    let k = run_pipeline(&k, &default_pipeline()).unwrap();
    run_case(&k, &fx(v), DType::BF16, "1,70,83,2,1,192,128", seed, 1e-2);
}
