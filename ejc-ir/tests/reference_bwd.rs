//! The reference backward (`reference::reference_bwd`) against central finite
//! differences of the reference forward, in f64, on every variant of
//! `specs/flash.yaml`, and against identities that must hold exactly: fully masked
//! rows give zero gradients, GQA's dK and dV are the sums over each group, and a value
//! head dim of its own changes nothing but dV's width.
//!
//! Inputs are fresh random numbers: the seed is printed (set `EJC_TEST_SEED` to replay).

mod common;

use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::{reference, reference_bwd, FlashGrads};
use ejc_ir::flash::{Features, FlashInputs, FlashRuntime, FlashShape};
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A dense f64 copy (broadcast axes materialised), so every element is its own input.
fn own(t: &HostTensor) -> HostTensor {
    HostTensor::from_vec(DType::F64, &t.shape, t.to_vec())
}

fn f64_inputs(f: &Features, shape: &FlashShape, seed: u64) -> FlashInputs {
    let x = random_inputs(f, DType::F64, shape, seed);
    FlashInputs {
        q: own(&x.q),
        k: own(&x.k),
        v: own(&x.v),
        bias: x.bias.as_ref().map(own),
        sinks: x.sinks.as_ref().map(own),
        ..x
    }
}

fn random_like(shape: &[usize], rng: &mut StdRng) -> HostTensor {
    let n = shape.iter().product();
    HostTensor::from_vec(DType::F64, shape, (0..n).map(|_| rng.random_range(-1.0..1.0)).collect())
}

/// `L = Σ dout ∘ out` of the reference forward.
fn loss(f: &Features, rt: &FlashRuntime, x: &FlashInputs, dout: &HostTensor) -> f64 {
    let y = reference(f, rt, x).unwrap();
    y.out.to_vec().iter().zip(dout.to_vec()).map(|(a, b)| a * b).sum()
}

fn field<'a>(x: &'a mut FlashInputs, name: &str) -> &'a mut HostTensor {
    match name {
        "q" => &mut x.q,
        "k" => &mut x.k,
        "v" => &mut x.v,
        "bias" => x.bias.as_mut().unwrap(),
        "sinks" => x.sinks.as_mut().unwrap(),
        _ => unreachable!("no input {name}"),
    }
}

/// Every element of the input `name` of `x`, perturbed by ±h: the central difference
/// of the loss against the analytic gradient `g`.
fn check_input(
    what: &str,
    name: &str,
    f: &Features,
    rt: &FlashRuntime,
    x: &FlashInputs,
    dout: &HostTensor,
    g: &HostTensor,
) -> usize {
    let h = 1e-5;
    let mut x = x.clone();
    let shape = field(&mut x, name).shape.clone();
    assert_eq!(g.shape, shape, "{what}: d{name} shape");
    let n: usize = shape.iter().product();
    let mut worst = 0.0f64;
    for flat in 0..n {
        let mut idx = vec![0; shape.len()];
        let mut r = flat;
        for a in (0..shape.len()).rev() {
            idx[a] = r % shape[a];
            r /= shape[a];
        }
        let x0 = field(&mut x, name).get(&idx);
        field(&mut x, name).set(&idx, x0 + h);
        let up = loss(f, rt, &x, dout);
        field(&mut x, name).set(&idx, x0 - h);
        let down = loss(f, rt, &x, dout);
        field(&mut x, name).set(&idx, x0);
        let fd = (up - down) / (2.0 * h);
        let an = g.get(&idx);
        let err = (fd - an).abs() / (1.0 + an.abs());
        worst = worst.max(err);
        assert!(err < 1e-6, "{what}: d{name}{idx:?}: analytic {an:e}, finite difference {fd:e}");
    }
    assert!(worst.is_finite());
    n
}

fn check_all(what: &str, f: &Features, rt: &FlashRuntime, x: &FlashInputs, dout: &HostTensor, g: &FlashGrads) -> usize {
    let mut n = check_input(what, "q", f, rt, x, dout, &g.dq);
    n += check_input(what, "k", f, rt, x, dout, &g.dk);
    n += check_input(what, "v", f, rt, x, dout, &g.dv);
    if f.bias {
        n += check_input(what, "bias", f, rt, x, dout, g.dbias.as_ref().unwrap());
    }
    if f.sinks {
        n += check_input(what, "sinks", f, rt, x, dout, g.dsinks.as_ref().unwrap());
    }
    n
}

#[test]
fn every_variant_matches_finite_differences() {
    let seed = common::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut checked = 0;
    for (name, f) in common::flash_variants() {
        // s_q ≠ s_k, GQA 2:1, a value head dim of its own; the window and the mask leave
        // rows that see nothing.
        let shape = FlashShape::new(2, 5, 7, 4, 2, 8).with_head_dim_v(6);
        let x = f64_inputs(&f, &shape, seed);
        let rt = FlashRuntime { dropout_p: 0.3, ..default_runtime(&f, &shape, seed) };
        let y = reference(&f, &rt, &x).unwrap();
        let dout = random_like(&y.out.shape, &mut rng);
        let g = reference_bwd(&f, &rt, &x, &dout).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(g.dbias.is_some(), f.bias, "{name}");
        assert_eq!(g.dsinks.is_some(), f.sinks, "{name}");
        checked += check_all(&format!("{name} seed={seed}"), &f, &rt, &x, &dout, &g);
    }
    assert!(checked > 15 * 500, "{checked} elements checked");
}

#[test]
fn rows_that_see_nothing_give_zero_gradients() {
    // A causal call with more queries than keys and a window: the first rows see no key;
    // every gradient stays finite, and a row's dq is 0 where it sees nothing.
    let f = Features { causal: true, mask: true, ..Default::default() };
    let shape = FlashShape::new(1, 9, 4, 2, 1, 8);
    let x = f64_inputs(&f, &shape, 3);
    let rt = default_runtime(&f, &shape, 3);
    let dout = HostTensor::full(DType::F64, &[1, 9, 2, 8], 1.0);
    let g = reference_bwd(&f, &rt, &x, &dout).unwrap();
    let y = reference(&f, &rt, &x).unwrap();
    for t in [&g.dq, &g.dk, &g.dv] {
        assert!(t.to_vec().iter().all(|v| v.is_finite()));
    }
    let mut empty = 0;
    for h in 0..2 {
        for i in 0..9 {
            if y.lse.get(&[0, h, i]) == f64::NEG_INFINITY {
                empty += 1;
                assert!((0..8).all(|d| g.dq.get(&[0, i, h, d]) == 0.0), "row {i} head {h}");
            }
        }
    }
    assert!(empty >= 5 * 2, "causal with 9 queries over 4 keys leaves 5 empty rows per head ({empty})");
}

#[test]
fn gqa_gradients_are_the_group_sums_of_mha_with_repeated_kv() {
    let f = Features { causal: true, sinks: true, ..Default::default() };
    let shape = FlashShape::new(2, 6, 9, 4, 2, 8);
    let x = f64_inputs(&f, &shape, 5);
    let rt = default_runtime(&f, &shape, 5);
    let mut rng = StdRng::seed_from_u64(5);
    let dout = random_like(&[2, 6, 4, 8], &mut rng);
    let g = reference_bwd(&f, &rt, &x, &dout).unwrap();
    // The same call with every KV head repeated for its two query heads.
    let repeat = |t: &HostTensor| {
        let [b, s, h, d] = [t.shape[0], t.shape[1], t.shape[2], t.shape[3]];
        let mut r = HostTensor::zeros(DType::F64, &[b, s, 2 * h, d]);
        for (bi, si, hi, di) in itertools(b, s, 2 * h, d) {
            r.set(&[bi, si, hi, di], t.get(&[bi, si, hi / 2, di]));
        }
        r
    };
    let mha = FlashInputs { k: repeat(&x.k), v: repeat(&x.v), ..x.clone() };
    let gm = reference_bwd(&f, &rt, &mha, &dout).unwrap();
    assert_eq!(g.dq.to_vec(), gm.dq.to_vec());
    assert_eq!(g.dsinks.unwrap().to_vec(), gm.dsinks.unwrap().to_vec());
    for (grouped, full) in [(&g.dk, &gm.dk), (&g.dv, &gm.dv)] {
        for (bi, si, hi, di) in itertools(2, 9, 2, 8) {
            let sum = full.get(&[bi, si, 2 * hi, di]) + full.get(&[bi, si, 2 * hi + 1, di]);
            assert!((grouped.get(&[bi, si, hi, di]) - sum).abs() <= 1e-12 * (1.0 + sum.abs()));
        }
    }
}

fn itertools(a: usize, b: usize, c: usize, d: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    (0..a).flat_map(move |i| (0..b).flat_map(move |j| (0..c).flat_map(move |k| (0..d).map(move |l| (i, j, k, l)))))
}

#[test]
fn dout_must_have_the_outputs_shape() {
    let f = Features::default();
    let shape = FlashShape::new(1, 3, 4, 2, 1, 8).with_head_dim_v(4);
    let x = f64_inputs(&f, &shape, 1);
    let rt = default_runtime(&f, &shape, 1);
    let e = reference_bwd(&f, &rt, &x, &HostTensor::zeros(DType::F64, &[1, 3, 2, 8])).unwrap_err();
    assert!(e.contains("dout has shape [1, 3, 2, 8]; expected [1, 3, 2, 4]"), "{e}");
}
