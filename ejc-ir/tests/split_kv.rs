//! Split-KV flash attention (partial kernel, then combine kernel) on the interpreter
//! equals the reference, on every non-varlen variant of `specs/flash.yaml`, f32 and
//! bf16, awkward shapes and split counts from one to more splits than key blocks
//! (empty splits); the key loop of the partial kernel visits only its split's blocks.
//!
//! Inputs are fresh random numbers; the seed is printed (`EJC_TEST_SEED` replays).

mod common;

use common::seed;
use ejc_ir::flash::abi::{
    abi_params_combine, abi_params_partial, alloc_outputs, alloc_split_temps, bind_args_with, launch_grid_with,
    NUM_SPLITS,
};
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::reference;
use ejc_ir::flash::Features;
use ejc_ir::flash::{
    build_flash_combine_kernel, build_flash_kernel, build_flash_partial_kernel, FlashOutputs, FlashShape,
};
use ejc_ir::interp::{launch, launch_with_stats, Arg, Stats};
use ejc_ir::ir::{walk_ops, Kernel, OpKind};
use ejc_ir::passes::{default_pipeline, run_pipeline, Canonicalize, ClassifyMaskBlocks};
use ejc_ir::print::print_kernel;
use ejc_ir::spec::{self, Spec, Variant};
use ejc_ir::tensor::compare;
use ejc_ir::types::DType;
use rayon::prelude::*;

/// A flash variant's features, typed.
fn fx(v: &Variant) -> Features {
    Features::from_json(&v.features).expect("flash features")
}

fn spec() -> Spec {
    spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash.yaml")).expect("specs/flash.yaml loads")
}

/// Awkward shapes (b, sq, sk, hq, hkv, d): s_q != s_k both ways, s_k not a multiple of
/// the key block, GQA 8:2, MQA, a single query row.
const SHAPES: &[&str] = &["2,37,53,4,2,64", "1,45,21,2,1,64", "1,19,40,8,2,64", "2,29,29,4,1,64", "1,1,23,2,2,64"];

/// One split, a few, and more splits than key blocks (empty splits).
const SPLITS: &[usize] = &[1, 2, 3, 7, 64];

/// Both kernels after the default pipeline.
fn kernels(f: &Features, dtype: DType, d: usize, bm: usize, bn: usize) -> (Kernel, Kernel) {
    let p = build_flash_partial_kernel("partial", f, dtype, d, bm, bn).unwrap_or_else(|e| panic!("{e}"));
    let c = build_flash_combine_kernel("combine", f, dtype, d, bm).unwrap_or_else(|e| panic!("{e}"));
    (run_pipeline(&p, &default_pipeline()).unwrap(), run_pipeline(&c, &default_pipeline()).unwrap())
}

/// Run the partial kernel then the combine kernel with `splits` splits (the combine
/// told `combine_splits` of them); temporaries and outputs start as NaN.
fn run_split(
    partial: &Kernel,
    combine: &Kernel,
    f: &Features,
    dtype: DType,
    shape: &FlashShape,
    seed: u64,
    splits: usize,
    combine_splits: usize,
) -> (FlashOutputs, Stats) {
    let inputs = random_inputs(f, dtype, shape, seed);
    let rt = default_runtime(f, shape, seed);
    let outputs = alloc_outputs(&inputs);
    let (o_partial, lse_partial) = alloc_split_temps(&inputs, splits);
    let mut extra = vec![
        ("o_partial", Arg::Tensor(o_partial)),
        ("lse_partial", Arg::Tensor(lse_partial)),
        (NUM_SPLITS, Arg::Scalar(splits as f64)),
    ];
    let mut args = bind_args_with(partial, &rt, &inputs, &outputs, &extra).unwrap();
    let grid = launch_grid_with(partial, &inputs, &[(NUM_SPLITS, splits as i64)]).unwrap();
    let stats = launch_with_stats(partial, &mut args, grid).unwrap_or_else(|e| panic!("partial: {e}"));
    // The temporaries as the partial kernel left them.
    for (name, value) in extra.iter_mut().take(2) {
        let i = partial.params.iter().position(|p| p.name == *name).unwrap();
        *value = args[i].clone();
    }
    extra[2].1 = Arg::Scalar(combine_splits as f64);
    let mut args = bind_args_with(combine, &rt, &inputs, &outputs, &extra).unwrap();
    let grid = launch_grid_with(combine, &inputs, &[(NUM_SPLITS, combine_splits as i64)]).unwrap();
    launch(combine, &mut args, grid).unwrap_or_else(|e| panic!("combine: {e}"));
    let take = |n: &str| {
        let i = combine.params.iter().position(|p| p.name == n).unwrap();
        args[i].tensor().unwrap().clone()
    };
    (FlashOutputs { out: take("out"), lse: take("lse") }, stats)
}

/// Relative errors (out, lse) against the reference; NaN never passes.
fn errors(got: &FlashOutputs, f: &Features, dtype: DType, shape: &FlashShape, seed: u64) -> (f64, f64) {
    let inputs = random_inputs(f, dtype, shape, seed);
    let want = reference(f, &default_runtime(f, shape, seed), &inputs).expect("reference");
    let (out, _) = compare(&got.out.to_vec(), &want.out.to_vec());
    let (lse, _) = compare(&got.lse.to_vec(), &want.lse.to_vec());
    (out, lse)
}

#[test]
fn every_variant_matches_the_reference_for_every_split_count() {
    let spec = spec();
    let seed = seed();
    let cases: Vec<_> = spec
        .variants
        .iter()
        .filter(|v| !fx(v).varlen)
        .flat_map(|v| [(DType::F32, 1e-5), (DType::BF16, 1e-2)].map(move |(dtype, tol)| (v, dtype, tol)))
        .collect();
    // On every core (the interpreter is the slow part).
    let checked: usize = cases
        .par_iter()
        .map(|&(v, dtype, tol)| {
            let f = &fx(v);
            let mut checked = 0;
            // 16 x 16 blocks: several key blocks per split, and split boundaries
            // inside the causal / window diagonals.
            let (partial, combine) = kernels(f, dtype, 64, 16, 16);
            for (i, s) in SHAPES.iter().enumerate() {
                let shape = FlashShape::parse(s).unwrap();
                for &n in SPLITS {
                    let case_seed = seed.wrapping_add(i as u64);
                    let (got, _) = run_split(&partial, &combine, f, dtype, &shape, case_seed, n, n);
                    let (out, lse) = errors(&got, f, dtype, &shape, case_seed);
                    let label = format!("{} {dtype} shape={s} num_splits={n} seed={case_seed}", v.name);
                    assert!(out <= tol, "{label}: out rel_err={out:e} > {tol:e}");
                    assert!(lse <= tol, "{label}: lse rel_err={lse:e} > {tol:e}");
                    checked += 1;
                }
            }
            checked
        })
        .sum();
    eprintln!("{checked} split-KV cases match the reference");
}

/// The check above can fail: a combine that drops a non-empty split is caught.
#[test]
fn a_combine_missing_a_split_is_caught() {
    let f = Features { causal: true, sinks: true, ..Default::default() };
    let (partial, combine) = kernels(&f, DType::F32, 64, 16, 16);
    let shape = FlashShape::parse("2,37,53,4,2,64").unwrap();
    let seed = seed();
    let (got, _) = run_split(&partial, &combine, &f, DType::F32, &shape, seed, 3, 3);
    let (out, lse) = errors(&got, &f, DType::F32, &shape, seed);
    assert!(out <= 1e-5 && lse <= 1e-5, "out {out:e} lse {lse:e}");
    // 3 splits of 32 keys over 53: the second split (keys 32..53) is not empty.
    let (got, _) = run_split(&partial, &combine, &f, DType::F32, &shape, seed, 3, 1);
    let (out, lse) = errors(&got, &f, DType::F32, &shape, seed);
    assert!(out > 1e-2 && lse > 1e-3, "dropping a split went unnoticed: out {out:e} lse {lse:e}");
}

/// Rows that see no key in any split (causal, s_q > s_k, no sinks): output 0, LSE −∞,
/// never NaN, whatever the split count.
#[test]
fn rows_without_keys_give_zero_and_neg_inf() {
    let f = Features { causal: true, ..Default::default() };
    let (partial, combine) = kernels(&f, DType::F32, 64, 16, 16);
    let shape = FlashShape::parse("1,40,13,2,2,64").unwrap();
    for n in [1, 2, 64] {
        let (got, _) = run_split(&partial, &combine, &f, DType::F32, &shape, 11, n, n);
        for h in 0..2 {
            for i in 0..40 {
                let l = got.lse.get(&[0, h, i]);
                if i < 27 {
                    assert_eq!(l, f64::NEG_INFINITY, "num_splits={n} row {i} sees no key");
                    assert!((0..64).all(|d| got.out.get(&[0, i, h, d]) == 0.0), "num_splits={n} row {i}");
                } else {
                    assert!(l.is_finite(), "num_splits={n} row {i}: lse {l}");
                }
            }
        }
    }
}

/// `classify-mask-blocks` narrows the partial kernel's key loop to its split: over all
/// splits, every key block is visited once per query block (as one kernel would), not
/// once per split.
#[test]
fn the_key_loop_is_narrowed_to_the_split() {
    let f = Features::default();
    let (partial, combine) = kernels(&f, DType::F32, 64, 16, 16);
    // 32 query rows (2 blocks), 160 keys (10 blocks); one head, one batch entry.
    let shape = FlashShape::parse("1,32,160,1,1,64").unwrap();
    for n in [1, 2, 3, 10, 64] {
        let (got, stats) = run_split(&partial, &combine, &f, DType::F32, &shape, 5, n, n);
        // Two products (q·kᵀ, p·v) per visited block, two query blocks, 10 key blocks
        // in all (3 splits: 4 + 4 + 2 blocks; 64 splits: 10 of one block, 54 empty).
        assert_eq!(stats.count("tile.dot"), 2 * 2 * 10, "num_splits={n}");
        let (out, lse) = errors(&got, &f, DType::F32, &shape, 5);
        assert!(out <= 1e-5 && lse <= 1e-5, "num_splits={n}: out {out:e} lse {lse:e}");
    }
    // Without the pass, every split walks every key block (and masks them away).
    let raw = build_flash_partial_kernel("raw", &f, DType::F32, 64, 16, 16).unwrap();
    let (_, stats) = run_split(&raw, &combine, &f, DType::F32, &shape, 5, 2, 2);
    assert_eq!(stats.count("tile.dot"), 2 * 2 * 10 * 2);
    // The split's bounds are multiples of block_n: no visited block straddles them, so
    // the narrowed loop masks exactly what the forward kernel's does.
    let classify = |k: &Kernel| {
        let k = run_pipeline(k, &[Box::new(Canonicalize), Box::new(ClassifyMaskBlocks)]).unwrap();
        let mut terms = Vec::new();
        walk_ops(&k.body, &mut |op| {
            if let OpKind::MaskBlockFull { terms: t, .. } | OpKind::MaskApply { terms: t } = &op.kind {
                terms.push(t.clone());
            }
        });
        terms
    };
    let forward = build_flash_kernel("fwd", &f, DType::F32, 64, 16, 16).unwrap();
    assert_eq!(classify(&raw), classify(&forward));
}

#[test]
fn the_abi_grids_and_refusals() {
    let f = Features { causal: true, sinks: true, dropout: true, ..Default::default() };
    let partial = build_flash_partial_kernel("p", &f, DType::BF16, 64, 64, 64).unwrap();
    let combine = build_flash_combine_kernel("c", &f, DType::BF16, 64, 64).unwrap();
    let names = |k: &Kernel| k.params.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&partial),
        ["q", "k", "v", "o_partial", "lse_partial", "softmax_scale", "dropout_p", "seed_lo", "seed_hi", "num_splits"]
    );
    assert_eq!(names(&combine), ["o_partial", "lse_partial", "out", "lse", "sinks", "num_splits"]);
    // The kernels' parameters are the ABI's, types included.
    for (k, abi) in [(&partial, abi_params_partial(&f, DType::BF16)), (&combine, abi_params_combine(&f, DType::BF16))] {
        let want: Vec<_> = abi.iter().map(|a| (a.name.to_string(), a.ty.clone())).collect();
        let got: Vec<_> = k.params.iter().map(|p| (p.name.clone(), p.ty.clone())).collect();
        assert_eq!(got, want);
    }
    let grid = |k: &Kernel| k.grid.iter().map(|g| g.to_string()).collect::<Vec<_>>();
    assert_eq!(grid(&partial), ["cdiv(seq_q, 64)", "heads_q", "mul(batch, num_splits)"]);
    assert_eq!(grid(&combine), ["cdiv(seq_q, 64)", "heads_q", "batch"]);
    let varlen = Features { varlen: true, causal: true, ..Default::default() };
    let e = build_flash_partial_kernel("p", &varlen, DType::BF16, 64, 64, 64).unwrap_err();
    assert!(e.to_string().contains("varlen"), "{e}");
    let e = build_flash_combine_kernel("c", &varlen, DType::BF16, 64, 64).unwrap_err();
    assert!(e.to_string().contains("varlen"), "{e}");
}

/// The front-end IR of both kernels (gpt-oss: causal, a fixed window and sinks),
/// reviewed like every other snapshot.
#[test]
fn front_end_ir() {
    let spec = spec();
    let f = &fx(spec.variant("gpt_oss").unwrap());
    let p = build_flash_partial_kernel("flash_partial_gpt_oss_bf16_d64_m64_n32", f, DType::BF16, 64, 64, 32).unwrap();
    let c = build_flash_combine_kernel("flash_combine_gpt_oss_bf16_d64_m64", f, DType::BF16, 64, 64).unwrap();
    snap!("split_kv__partial_gpt_oss", print_kernel(&p));
    snap!("split_kv__combine_gpt_oss", print_kernel(&c));
}

#[test]
fn value_head_dim_of_its_own_splits_and_combines() {
    // v with a head dim apart from q/k's: the partial kernels' o_partial and the
    // combine's output have v's width.
    let seed = seed();
    for f in [Features::default(), Features { causal: true, sinks: true, ..Default::default() }] {
        for (d, dv) in [(32usize, 16usize), (16, 48)] {
            let dims = ejc_ir::flash::HeadDims { qk: d, v: dv };
            let p = build_flash_partial_kernel("partial", &f, DType::F32, dims, 16, 16).unwrap();
            let c = build_flash_combine_kernel("combine", &f, DType::F32, dv, 16).unwrap();
            let (p, c) =
                (run_pipeline(&p, &default_pipeline()).unwrap(), run_pipeline(&c, &default_pipeline()).unwrap());
            let shape = FlashShape::parse(&format!("2,19,53,4,2,{d},{dv}")).unwrap();
            for splits in [1, 3, 7] {
                let (got, _) = run_split(&p, &c, &f, DType::F32, &shape, seed, splits, splits);
                assert_eq!(got.out.shape, [2, 19, 4, dv]);
                let (out, lse) = errors(&got, &f, DType::F32, &shape, seed);
                assert!(
                    out <= 1e-5 && lse <= 1e-5,
                    "d {d} dv {dv} splits {splits}: out {out:e} lse {lse:e} seed {seed}"
                );
            }
        }
    }
}
