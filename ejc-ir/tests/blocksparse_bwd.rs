//! Block-sparse attention's backward (`blocksparse_attention_bwd`) on the interpreter: its
//! reference (`reference_bwd`) against central finite differences of the reference forward
//! in f64 on every kind of mask; the whole plan (layout, its transpose, preprocess, dK/dV,
//! dQ, dsinks) after the pass pipeline against the reference on every variant of
//! `specs/blocksparse_bwd.yaml` and the operation's awkward calls; the transposed layout's
//! lists against a block classification written out on the host.
//!
//! Inputs are fresh random numbers; the seed is printed (`EJC_TEST_SEED` replays).
//! Outputs and temporaries start as NaN, so an element no program writes fails.

mod common;

use std::collections::BTreeMap;

use common::seed;
use ejc_ir::manifest::Launch;
use ejc_ir::op::{self, run_plan_interp, Config, Operation, PlanDecl};
use ejc_ir::ops::blocksparse::mask::MaskExpr;
use ejc_ir::ops::blocksparse::reference::{
    random_inputs, reference, reference_bwd, visible, BsFeatures, BsGrads, BsInputs, BsShape,
};
use ejc_ir::spec::{self, Spec, Variant};
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn spec() -> Spec {
    let path = format!("{}/../specs/blocksparse_bwd.yaml", env!("CARGO_MANIFEST_DIR"));
    spec::load_file(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn op() -> &'static dyn Operation {
    ejc_ir::ops::get("blocksparse_attention_bwd").unwrap()
}

fn keys() -> op::Keys {
    BTreeMap::from([("head_dim".to_string(), 64u32)])
}

fn tile(bm: u32, bn: u32) -> Config {
    Config::from([("block_m".to_string(), bm), ("block_n".to_string(), bn)])
}

/// The plan's kernels of `variant` at a tiling, after the pass pipeline.
fn kernels(spec: &Spec, variant: &Variant, dtype: DType, bm: u32, bn: u32) -> BTreeMap<String, ejc_ir::ir::Kernel> {
    common::plan_kernels_at(op(), spec, variant, dtype, &keys(), (bm, bn))
}

/// Every variant, f32 and bf16, two tilings, every awkward case: the plan against the
/// reference.
#[test]
fn every_variant_matches_the_reference_on_awkward_calls() {
    common::every_variant_matches_the_reference(op(), &spec(), &keys());
}

/// The transposed layout of each variant on an awkward call (four heads over two KV heads,
/// a mask per head) against the classification written out: key block `kb` of list `lhk`
/// holds, in order, the (head of the group, query block) pairs whose block is full, and
/// apart from them those whose block is partial.
#[test]
fn the_transposed_layout_lists_the_query_blocks_of_each_key_block() {
    let (spec, seed) = (spec(), seed());
    let dims = &op().check_dims(&keys())[1]; // 333 x 200, heads 4 over 1, a mask per head
    let mut dims = dims.clone();
    dims.insert("heads_kv".into(), 2);
    for variant in &spec.variants {
        let f = BsFeatures::from_json(&variant.features).unwrap();
        let mut call = op().random_call(&variant.features, DType::F32, &dims, seed).unwrap();
        let sizes = op().validate(&variant.features, DType::F32, &keys(), &call).unwrap();
        let x = inputs(&call);
        let (sq, sk, hq, hkv) = (dims["seq_q"] as usize, dims["seq_k"] as usize, 4, 2);
        let (bm, bn) = (32u32, 16u32);
        let ks = kernels(&spec, variant, DType::F32, bm, bn);
        let full_plan = &op().plans(&spec, &variant.features)[0];
        let syms = op::symbols(&sizes, &tile(bm, bn));
        for t in &full_plan.temporaries {
            let (dtype, shape) = op::temporary_shape(t, &syms, |_| None).unwrap();
            let fill = if t.fill == "zero" { 0.0 } else { f64::NAN };
            call.tensors.insert(t.name.clone(), HostTensor::full(dtype, &shape, fill));
        }
        let plan = PlanDecl {
            name: "layout",
            roles: full_plan.roles[..2].to_vec(),
            temporaries: vec![],
            launches: vec![Launch::of("layout"), Launch::of("layout_t")],
            runtime_axes: vec![],
            shared_axes: vec![],
        };
        run_plan_interp(&plan, &ks, &mut call, &sizes, &tile(bm, bn)).unwrap();
        let (count, idx) = (&call.tensors["kv_count"], &call.tensors["kv_idx"]);
        let (bm, bn) = (bm as usize, bn as usize);
        let nq = sq.div_ceil(bm);
        let (lb_n, per_head) = (count.shape[0], f.per_head());
        let groups = if per_head { hq / hkv } else { 1 };
        let mut seen = 0;
        for lb in 0..lb_n {
            for lhk in 0..count.shape[1] {
                for kb in 0..sk.div_ceil(bn) {
                    let n = |i: usize| {
                        let n = count.get(&[lb, lhk, kb, i]);
                        assert!(n.is_finite(), "{}: count ({lb}, {lhk}, {kb}, {i}) unwritten", variant.name);
                        n as usize
                    };
                    let slot = |s: usize| idx.get(&[lb, lhk * groups + s / nq, kb, s % nq]) as usize;
                    let last = groups * nq - 1;
                    let full: Vec<usize> = (0..n(0)).map(slot).collect();
                    let part: Vec<usize> = (0..n(1)).map(|t| slot(last - t)).collect();
                    let (mut want_full, mut want_part) = (Vec::new(), Vec::new());
                    for hg in 0..groups {
                        let head = lhk * groups + hg;
                        for qb in 0..nq {
                            let (mut any, mut all) = (false, true);
                            for i in qb * bm..((qb + 1) * bm).min(sq) {
                                for j in kb * bn..(kb + 1) * bn {
                                    let v = j < sk && visible(&f, &x, lb, head, i, j);
                                    any |= v;
                                    all &= v;
                                }
                            }
                            if all {
                                want_full.push(hg * nq + qb);
                            } else if any {
                                want_part.push(hg * nq + qb);
                            }
                        }
                    }
                    assert_eq!(full, want_full, "{}: full query blocks of ({lb}, {lhk}, {kb})", variant.name);
                    assert_eq!(part, want_part, "{}: partial query blocks of ({lb}, {lhk}, {kb})", variant.name);
                    seen += full.len() + part.len();
                }
            }
        }
        assert!(seen > 0, "{}: empty lists", variant.name);
    }
}

/// A backward call may give the forward's lists and the blocks' classes
/// (`host_layout_classes`): the layout kernel is skipped, the transposed lists are built
/// from the given classes, and the gradients match the reference; a lying layout (every
/// listed block called full) does not, which shows the given one is what ran.
#[test]
fn a_backward_call_may_give_the_layout() {
    use ejc_ir::op::compare_outputs;
    use ejc_ir::ops::blocksparse::op::host_layout_classes;
    let (spec, seed) = (spec(), seed());
    let dims = &op().check_dims(&keys())[0];
    let variant = spec.variant("strided").unwrap();
    let mut call = op().random_call(&variant.features, DType::F32, dims, seed).unwrap();
    let sizes = op().validate(&variant.features, DType::F32, &keys(), &call).unwrap();
    let want = op().reference(&variant.features, &call).unwrap();
    let ks = kernels(&spec, variant, DType::F32, 32, 32);
    let plan = &op().plans(&spec, &variant.features)[0];
    let (count, idx, class) = host_layout_classes(&variant.features, &call, 32, 32).unwrap();
    for (n, t) in [("block_count", &count), ("block_idx", &idx), ("block_class", &class)] {
        call.tensors.insert(n.into(), t.clone());
    }
    run_plan_interp(plan, &ks, &mut call, &sizes, &tile(32, 32)).unwrap();
    let tol = op::tolerance(DType::F32);
    for (name, rel, _) in compare_outputs(op(), &variant.features, &call, &want) {
        assert!(rel <= tol, "the host's layout given: {name} rel {rel:e} seed={seed}");
    }
    // Every listed block called full: the kernels skip the partial blocks' mask.
    let (mut lying_count, mut lying_idx, mut lying_class) = (count.clone(), idx.clone(), class.clone());
    let last = idx.shape[3] - 1;
    for qb in 0..count.shape[2] {
        let n = |i: usize| count.get(&[0, 0, qb, i]) as usize;
        let all: Vec<f64> = (0..n(0))
            .map(|t| idx.get(&[0, 0, qb, t]))
            .chain((0..n(1)).map(|t| idx.get(&[0, 0, qb, last - t])))
            .collect();
        lying_count.set(&[0, 0, qb, 0], all.len() as f64);
        lying_count.set(&[0, 0, qb, 1], 0.0);
        for (t, kb) in all.iter().enumerate() {
            lying_idx.set(&[0, 0, qb, t], *kb);
            lying_class.set(&[0, 0, qb, *kb as usize], 2.0);
        }
    }
    for (n, t) in [("block_count", lying_count), ("block_idx", lying_idx), ("block_class", lying_class)] {
        call.tensors.insert(n.into(), t);
    }
    run_plan_interp(plan, &ks, &mut call, &sizes, &tile(32, 32)).unwrap();
    let worst = compare_outputs(op(), &variant.features, &call, &want).into_iter().map(|c| c.1).fold(0.0, f64::max);
    assert!(worst > 1e-2, "a lying given layout still matched (rel {worst:e}) seed={seed}");
}

fn inputs(call: &op::HostCall) -> BsInputs {
    ejc_ir::ops::blocksparse::op::inputs_of(call).unwrap()
}

/// A dense f64 copy, so that every element is its own input.
fn own(t: &HostTensor) -> HostTensor {
    HostTensor::from_vec(DType::F64, &t.shape, t.to_vec())
}

fn field<'a>(x: &'a mut BsInputs, name: &str) -> &'a mut HostTensor {
    match name {
        "q" => &mut x.query,
        "k" => &mut x.key,
        "v" => &mut x.value,
        "sinks" => x.sinks.as_mut().unwrap(),
        "bias" => x.bias.as_mut().unwrap(),
        _ => unreachable!("no input {name}"),
    }
}

/// Every element of input `name`, perturbed by ±h: the central difference of `L = Σ dout ∘
/// out` against the analytic gradient `g`.
fn check_input(
    what: &str,
    name: &str,
    f: &BsFeatures,
    (scale, cap): (f64, Option<f64>),
    x: &BsInputs,
    dout: &HostTensor,
    g: &HostTensor,
) -> usize {
    let loss = |x: &BsInputs| {
        let (out, _) = reference(f, x, scale, cap).unwrap();
        out.to_vec().iter().zip(dout.to_vec()).map(|(a, b)| a * b).sum::<f64>()
    };
    let h = 1e-5;
    let mut x = x.clone();
    let shape = field(&mut x, name).shape.clone();
    assert_eq!(g.shape, shape, "{what}: d{name} shape");
    let n: usize = shape.iter().product();
    for flat in 0..n {
        let mut idx = vec![0; shape.len()];
        let mut r = flat;
        for a in (0..shape.len()).rev() {
            idx[a] = r % shape[a];
            r /= shape[a];
        }
        let x0 = field(&mut x, name).get(&idx);
        field(&mut x, name).set(&idx, x0 + h);
        let up = loss(&x);
        field(&mut x, name).set(&idx, x0 - h);
        let down = loss(&x);
        field(&mut x, name).set(&idx, x0);
        let fd = (up - down) / (2.0 * h);
        let an = g.get(&idx);
        let err = (fd - an).abs() / (1.0 + an.abs());
        assert!(err < 1e-6, "{what}: d{name}{idx:?}: analytic {an:e}, finite difference {fd:e}");
    }
    n
}

/// The reference gradients against finite differences on every kind of mask, at a size
/// where windows, chunks and strides cut through the rows (and some rows see nothing),
/// with GQA, a value head dim of its own, sinks and a soft cap.
#[test]
fn the_reference_gradients_match_finite_differences() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let base = BsFeatures::default();
    let cases: Vec<(&str, BsFeatures)> = vec![
        ("causal", base.clone()),
        ("full", BsFeatures { mask: MaskExpr::Full, ..base.clone() }),
        ("local", BsFeatures { mask: MaskExpr::Local { left: 3, right: 1 }, ..base.clone() }),
        ("chunked", BsFeatures { mask: MaskExpr::ChunkedCausal { chunk: 4 }, ..base.clone() }),
        (
            "strided",
            BsFeatures {
                mask: MaskExpr::And(vec![
                    MaskExpr::Causal { offset: 0 },
                    MaskExpr::Or(vec![MaskExpr::Local { left: 1, right: 0 }, MaskExpr::Strided { stride: 3 }]),
                ]),
                ..base.clone()
            },
        ),
        ("segments", BsFeatures { segment_ids: true, ..base.clone() }),
        ("array_mask", BsFeatures { mask: MaskExpr::Full, attention_mask: true, ..base.clone() }),
        (
            "window_sinks_softcap",
            BsFeatures { mask: MaskExpr::Local { left: 2, right: 0 }, sinks: true, soft_cap: true, ..base.clone() },
        ),
        ("causal_offset_sinks", BsFeatures { mask: MaskExpr::Causal { offset: -2 }, sinks: true, ..base.clone() }),
        ("positions", BsFeatures { mask: MaskExpr::Local { left: 3, right: 0 }, positions: true, ..base.clone() }),
        ("document_positions", BsFeatures { segment_ids: true, positions: true, ..base.clone() }),
        (
            "bias_local_softcap",
            BsFeatures {
                mask: MaskExpr::Local { left: 3, right: 1 },
                bias: true,
                bias_grad: true,
                soft_cap: true,
                ..base.clone()
            },
        ),
        (
            "bias_segments_sinks",
            BsFeatures { segment_ids: true, bias: true, bias_grad: true, sinks: true, ..base.clone() },
        ),
        (
            "head_masks",
            BsFeatures {
                head_masks: vec![
                    MaskExpr::Local { left: 2, right: 0 },
                    MaskExpr::Full,
                    MaskExpr::Strided { stride: 2 },
                ],
                ..base
            },
        ),
    ];
    let mut checked = 0;
    for (name, f) in cases {
        let s = BsShape {
            batch: 2,
            heads_q: 4,
            heads_kv: 2,
            seq_q: 9,
            seq_k: 11,
            head_dim: 4,
            head_dim_v: 3,
            doc_len: 0,
            mask_heads: 4,
        };
        let x = random_inputs(&f, DType::F64, &s, seed ^ checked as u64);
        // Run-time sizes that cut through these short rows.
        let x = BsInputs { window: x.window.map(|_| (3, 1)), chunk: x.chunk.map(|_| 4), ..x };
        let x = BsInputs {
            query: own(&x.query),
            key: own(&x.key),
            value: own(&x.value),
            sinks: x.sinks.as_ref().map(own),
            bias: x.bias.as_ref().map(own),
            ..x
        };
        let rt = (0.7, f.soft_cap.then_some(1.5));
        let (out, _) = reference(&f, &x, rt.0, rt.1).unwrap();
        let n = out.numel();
        let dout = HostTensor::from_vec(DType::F64, &out.shape, (0..n).map(|_| rng.random_range(-1.0..1.0)).collect());
        let g: BsGrads = reference_bwd(&f, &x, rt.0, rt.1, &dout).unwrap();
        assert_eq!(g.dsinks.is_some(), f.sinks, "{name}");
        let what = format!("{name} seed={seed}");
        checked += check_input(&what, "q", &f, rt, &x, &dout, &g.dq);
        checked += check_input(&what, "k", &f, rt, &x, &dout, &g.dk);
        checked += check_input(&what, "v", &f, rt, &x, &dout, &g.dv);
        if f.sinks {
            checked += check_input(&what, "sinks", &f, rt, &x, &dout, g.dsinks.as_ref().unwrap());
        }
        assert_eq!(g.dbias.is_some(), f.bias_grad, "{name}");
        if let Some(db) = &g.dbias {
            // dbias is dU: each logit's own (a bias element moves one logit).
            checked += check_input(&what, "bias", &f, rt, &x, &dout, db);
        }
        // Rows that see nothing give zero dq (never NaN).
        assert!(g.dq.to_vec().iter().all(|v| v.is_finite()), "{name}: dq not finite");
    }
    assert!(checked > 14 * 500, "{checked} elements checked");
}
