//! The backward kernels (`flash::backward`) on the interpreter against the reference
//! backward (`reference::reference_bwd`), on every variant of `specs/flash.yaml`, over
//! awkward shapes (lengths off the block sizes, s_q ≠ s_k both ways, GQA, MQA, a value
//! head dim of its own, varlen with an empty sequence), before and after the pass
//! pipeline. Fresh random inputs: the seed is printed (`EJC_TEST_SEED` replays one).

mod common;

use ejc_ir::flash::backward::{build_bwd_kernel, run_interp, Plan, Role};
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::{reference, reference_bwd};
use ejc_ir::flash::{Features, FlashOutputs, FlashShape, HeadDims};
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::tensor::{compare, HostTensor};
use ejc_ir::types::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn round(t: &HostTensor, dtype: DType) -> HostTensor {
    HostTensor::from_vec(dtype, &t.shape, t.to_vec().into_iter().map(|x| dtype.round(x)).collect())
}

/// A plan's kernels for a variant, at 16 × 16 tiles, before or after the pipeline.
fn plan_kernels(
    plan: Plan,
    name: &str,
    f: &Features,
    dtype: DType,
    dims: HeadDims,
    pipeline: bool,
) -> Vec<(Role, ejc_ir::ir::Kernel)> {
    plan.roles(f)
        .into_iter()
        .map(|r| {
            let k = build_bwd_kernel(&format!("{name}_{}", r.name()), r, f, dtype, dims, 16, 16)
                .unwrap_or_else(|e| panic!("{name} {}: {e}", r.name()));
            (r, if pipeline { run_pipeline(&k, &default_pipeline()).unwrap() } else { k })
        })
        .collect()
}

/// One call: the kernels' gradients against the reference's, relative error per tensor,
/// for both plans.
fn check(name: &str, f: &Features, dtype: DType, shape: &str, seed: u64, pipeline: bool, tol: f64) {
    for plan in Plan::ALL {
        check_plan(plan, name, f, dtype, shape, seed, pipeline, tol);
    }
}

#[allow(clippy::too_many_arguments)]
fn check_plan(plan: Plan, name: &str, f: &Features, dtype: DType, shape: &str, seed: u64, pipeline: bool, tol: f64) {
    let shape = FlashShape::parse(shape).unwrap();
    let dims = HeadDims { qk: shape.head_dim, v: shape.head_dim_v };
    let kernels = plan_kernels(plan, name, f, dtype, dims, pipeline);
    let x = random_inputs(f, dtype, &shape, seed);
    let rt = default_runtime(f, &shape, seed);
    let y = reference(f, &rt, &x).unwrap();
    let forward = FlashOutputs { out: round(&y.out, dtype), lse: round(&y.lse, DType::F32) };
    let mut rng = StdRng::seed_from_u64(seed);
    let n = y.out.numel();
    let dout =
        HostTensor::from_vec(dtype, &y.out.shape, (0..n).map(|_| dtype.round(rng.random_range(-1.0..1.0))).collect());
    let want = reference_bwd(f, &rt, &x, &dout).unwrap();
    let got = run_interp(&kernels, &rt, &x, &forward, &dout).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut pairs = vec![("dq", &got.dq, &want.dq), ("dk", &got.dk, &want.dk), ("dv", &got.dv, &want.dv)];
    if let (Some(g), Some(w)) = (&got.dsinks, &want.dsinks) {
        pairs.push(("dsinks", g, w));
    }
    assert_eq!(got.dbias.is_some(), f.bias_grad, "{name}: dbias returned iff bias_grad");
    if let (Some(g), Some(w)) = (&got.dbias, &want.dbias) {
        pairs.push(("dbias", g, w));
    }
    for (what, g, w) in pairs {
        let (rel, abs) = compare(&g.to_vec(), &w.to_vec());
        // dsinks is one sum per head of ±terms over every row (`−Σ exp(sink − lse)·delta`):
        // it can cancel to far below its terms, so f32 rounding of the terms is a larger
        // share of it than of any other output (seen at 2.5e-5 in f32 on a 45-row call);
        // its bound is ten times the others'.
        let tol = if what == "dsinks" { tol * 10.0 } else { tol };
        assert!(
            rel <= tol,
            "{name} {} {dtype} {what} shape={shape} seed={seed} pipeline={pipeline}: rel {rel:e} abs {abs:e}",
            plan.name()
        );
    }
}

/// (b, sq, sk, hq, hkv, d[, dv]).
const SHAPES: &[&str] = &["2,37,53,4,2,32", "1,45,21,2,1,16,24", "1,19,40,8,2,16", "1,1,23,2,2,32"];

#[test]
fn every_variant_f32_matches_the_reference() {
    let seed = common::seed();
    for (name, f) in common::flash_bwd_variants() {
        for (i, shape) in SHAPES.iter().enumerate() {
            check(&name, &f, DType::F32, shape, seed + i as u64, i % 2 == 1, 1e-5);
        }
    }
}

#[test]
fn every_variant_bf16_matches_the_reference() {
    let seed = common::seed();
    for (name, f) in common::flash_bwd_variants() {
        check(&name, &f, DType::BF16, "2,37,53,4,2,32", seed, true, 1e-2);
    }
}

#[test]
fn varlen_with_empty_sequences() {
    // Sequence 0 has queries but no key (its rows see nothing: dq = 0), sequence 1 no
    // query (its keys get dk = dv = 0), sequence 2 both; causal and not, with sinks.
    let seed = common::seed();
    for f in [
        Features { varlen: true, ..Default::default() },
        Features { varlen: true, causal: true, sinks: true, ..Default::default() },
    ] {
        let shape = FlashShape::new(3, 20, 30, 4, 2, 16);
        let mut x = random_inputs(&f, DType::F32, &shape, seed);
        let (tq, tk) = (x.q.shape[1], x.k.shape[1]);
        x.cu_seqlens_q = Some(HostTensor::from_vec(DType::I32, &[4], vec![0.0, 5.0, 5.0, tq as f64]));
        x.cu_seqlens_k = Some(HostTensor::from_vec(DType::I32, &[4], vec![0.0, 0.0, 7.0, tk as f64]));
        let dims = HeadDims { qk: 16, v: 16 };
        for plan in Plan::ALL {
            let kernels = plan_kernels(plan, "varlen", &f, DType::F32, dims, false);
            let rt = default_runtime(&f, &shape, seed);
            let y = reference(&f, &rt, &x).unwrap();
            let forward = FlashOutputs { out: round(&y.out, DType::F32), lse: round(&y.lse, DType::F32) };
            let dout = HostTensor::full(DType::F32, &y.out.shape, 0.25);
            let want = reference_bwd(&f, &rt, &x, &dout).unwrap();
            let got = run_interp(&kernels, &rt, &x, &forward, &dout).unwrap();
            for (what, g, w) in [("dq", &got.dq, &want.dq), ("dk", &got.dk, &want.dk), ("dv", &got.dv, &want.dv)] {
                let (rel, abs) = compare(&g.to_vec(), &w.to_vec());
                assert!(rel <= 1e-5, "{} {what} seed={seed}: rel {rel:e} abs {abs:e}", plan.name());
            }
            // Sequence 0's rows saw no key: their dq is exactly 0.
            assert!((0..5).all(|t| (0..4).all(|h| (0..16).all(|d| got.dq.get(&[0, t, h, d]) == 0.0))));
        }
    }
}

#[test]
fn narrow_windows_visit_only_their_blocks() {
    // Windows a block or two wide on long sequences, s_q < s_k and s_q > s_k: the dq key
    // loop and the dkdv query loop skip most blocks, and must skip only blocks that add 0.
    let seed = common::seed();
    for (f, window) in [
        (Features { sliding_window: Some(ejc_ir::flash::Window::Runtime), ..Default::default() }, (3, 17)),
        (
            Features { causal: true, sliding_window: Some(ejc_ir::flash::Window::Runtime), ..Default::default() },
            (20, 0),
        ),
        (Features { causal: true, ..Default::default() }, (0, 0)),
    ]
    .into_iter()
    // And each with a bias and its gradient: dbias is written on the visited blocks and
    // zeroed on every skipped one (below and above the band, in both plans).
    .flat_map(|(f, w)| [(f.clone(), w), (Features { bias: true, bias_grad: true, ..f }, w)])
    {
        for shape in ["1,70,131,2,1,16", "1,131,70,2,2,16", "2,97,97,4,2,16,32"] {
            let shape = FlashShape::parse(shape).unwrap();
            let dims = HeadDims { qk: shape.head_dim, v: shape.head_dim_v };
            for plan in Plan::ALL {
                let kernels = plan_kernels(plan, "window", &f, DType::F32, dims, true);
                let x = random_inputs(&f, DType::F32, &shape, seed);
                let rt = ejc_ir::flash::FlashRuntime { window, ..default_runtime(&f, &shape, seed) };
                let y = reference(&f, &rt, &x).unwrap();
                let forward = FlashOutputs { out: round(&y.out, DType::F32), lse: round(&y.lse, DType::F32) };
                let mut rng = StdRng::seed_from_u64(seed);
                let n = y.out.numel();
                let dout = HostTensor::from_vec(
                    DType::F32,
                    &y.out.shape,
                    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect(),
                );
                let want = reference_bwd(&f, &rt, &x, &dout).unwrap();
                let got = run_interp(&kernels, &rt, &x, &forward, &dout).unwrap();
                let mut pairs = vec![("dq", &got.dq, &want.dq), ("dk", &got.dk, &want.dk), ("dv", &got.dv, &want.dv)];
                if f.bias_grad {
                    let db = got.dbias.as_ref().expect("bias_grad returns dbias");
                    // Every element written (the run starts from NaN): the skipped blocks too.
                    let w = want.dbias.as_ref().unwrap();
                    let unwritten = db.to_vec().iter().filter(|x| x.is_nan()).count();
                    assert_eq!(unwritten, 0, "{} {} {shape}: dbias elements left unwritten", plan.name(), f.describe());
                    pairs.push(("dbias", db, w));
                }
                for (what, g, w) in pairs {
                    let (rel, abs) = compare(&g.to_vec(), &w.to_vec());
                    assert!(
                        rel <= 1e-5,
                        "{} {} window {window:?} {shape} {what} seed={seed}: rel {rel:e} abs {abs:e}",
                        plan.name(),
                        f.describe()
                    );
                }
            }
        }
    }
}
