//! Block-sparse attention on the interpreter: the layout kernel's lists against a block
//! classification written out on the host (skipped blocks in no list, full and partial
//! blocks in order), the whole plan (layout, then attention) after the pass pipeline
//! against the f64 reference on every variant of `specs/blocksparse.yaml` (f32 and bf16,
//! the operation's awkward cases: lengths off every block size, Sq ≠ Sk both ways, GQA and
//! MQA, one query row, a mask per head), a layout that lies (the test can fail), the mask
//! algebra's forms and the spec's diagnostics.
//!
//! Inputs are fresh random numbers; the seed is printed (`EJC_TEST_SEED` replays).
//! Outputs and temporaries start as NaN, so an element no program writes fails.

mod common;

use std::collections::BTreeMap;

use common::seed;
use ejc_ir::ir::GridExpr;
use ejc_ir::manifest::Launch;
use ejc_ir::op::{self, compare_outputs, run_plan_interp, Config, Operation, PlanDecl, Sizes};
use ejc_ir::ops::blocksparse::mask::MaskExpr;
use ejc_ir::ops::blocksparse::op::host_layout;
use ejc_ir::ops::blocksparse::reference::{visible, BsFeatures, BsInputs};
use ejc_ir::spec::{self, Spec, Variant};
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;

fn spec() -> Spec {
    let path = format!("{}/../specs/blocksparse.yaml", env!("CARGO_MANIFEST_DIR"));
    spec::load_file(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn op() -> &'static dyn Operation {
    ejc_ir::ops::get("blocksparse_attention").unwrap()
}

fn keys() -> op::Keys {
    BTreeMap::from([("head_dim".to_string(), 64u32)])
}

/// The plan's kernels of `variant` at a tiling, after the pass pipeline.
fn kernels(spec: &Spec, variant: &Variant, dtype: DType, bm: u32, bn: u32) -> BTreeMap<String, ejc_ir::ir::Kernel> {
    common::plan_kernels_at(op(), spec, variant, dtype, &keys(), (bm, bn))
}

fn features(v: &Variant) -> BsFeatures {
    BsFeatures::from_json(&v.features).unwrap()
}

fn inputs(call: &op::HostCall) -> BsInputs {
    ejc_ir::ops::blocksparse::op::inputs_of(call).unwrap()
}

/// Every variant, f32 and bf16, two tilings, every awkward case: the plan against the
/// reference.
#[test]
fn every_variant_matches_the_reference_on_awkward_calls() {
    common::every_variant_matches_the_reference(op(), &spec(), &keys());
}

/// One query block's lists: its (layout batch, layout head, block), full and partial
/// key blocks.
type Lists = ((usize, usize, usize), Vec<i64>, Vec<i64>);

/// The layout kernel alone, its lists as call tensors.
fn run_layout(
    spec: &Spec,
    variant: &Variant,
    call: &mut op::HostCall,
    sizes: &Sizes,
    (bm, bn): (u32, u32),
) -> Vec<Lists> {
    let ks = kernels(spec, variant, DType::F32, bm, bn);
    let full_plan = &op().plans(spec, &variant.features)[0];
    let tile = Config::from([("block_m".to_string(), bm), ("block_n".to_string(), bn)]);
    let syms = op::symbols(sizes, &tile);
    for t in &full_plan.temporaries {
        let (dtype, shape) = op::temporary_shape(t, &syms, |_| None).unwrap();
        call.tensors.insert(t.name.clone(), HostTensor::full(dtype, &shape, f64::NAN));
    }
    let plan = PlanDecl {
        name: "layout",
        roles: full_plan.roles[..1].to_vec(),
        temporaries: vec![],
        launches: vec![Launch::of("layout")],
        runtime_axes: vec![],
        shared_axes: vec![],
    };
    run_plan_interp(&plan, &ks, call, sizes, &tile).unwrap();
    lists(&call.tensors["block_count"], &call.tensors["block_idx"])
}

/// A layout's lists, per query block.
fn lists(count: &HostTensor, idx: &HostTensor) -> Vec<Lists> {
    let last = idx.shape[3] - 1;
    let mut out = Vec::new();
    for lb in 0..count.shape[0] {
        for lh in 0..count.shape[1] {
            for qb in 0..count.shape[2] {
                let n = |i: usize| {
                    let n = count.get(&[lb, lh, qb, i]);
                    assert!(n.is_finite(), "count ({lb}, {lh}, {qb}, {i}) unwritten");
                    n as usize
                };
                // Full blocks from the front, partial ones from the back.
                let full = (0..n(0)).map(|t| idx.get(&[lb, lh, qb, t]) as i64).collect();
                let part = (0..n(1)).map(|t| idx.get(&[lb, lh, qb, last - t]) as i64).collect();
                out.push(((lb, lh, qb), full, part));
            }
        }
    }
    out
}

/// Each variant's layout on an awkward call against the classification written out: a
/// block is full when every row of the sequence in it sees every key of it, skipped when
/// none sees any, partial otherwise; the lists hold the block indices in order.
#[test]
fn the_layout_lists_exactly_the_full_and_partial_blocks() {
    let (spec, seed) = (spec(), seed());
    // 333 x 200, four heads, a mask per head.
    let dims = &op().check_dims(&keys())[1];
    // Run-time sizes also at block edges: a window whose right side reaches exactly the
    // first key of a block from a query block's last row (15 + 17 = 32, 63 + 17 = 80), and
    // chunks of 47, whose second starts on the last key of a 16-key block.
    let mut calls = Vec::new();
    for variant in &spec.variants {
        let call = op().random_call(&variant.features, DType::F32, dims, seed).unwrap();
        let edge = match variant.name.as_str() {
            "runtime_window" => vec![("window_left", 70.0), ("window_right", 17.0)],
            "runtime_chunked" => vec![("chunk_size", 47.0)],
            _ => vec![],
        };
        if !edge.is_empty() {
            let mut c = call.clone();
            for (n, v) in edge {
                c.scalars.insert(n.to_string(), v);
            }
            calls.push((variant, c, true));
        }
        calls.push((variant, call, false));
    }
    for (variant, mut call, edge) in calls {
        let f = features(variant);
        let sizes = op().validate(&variant.features, DType::F32, &keys(), &call).unwrap();
        let x = inputs(&call);
        let (sq, sk) = (sizes["seq_q"] as usize, sizes["seq_k"] as usize);
        let (mut n_full, mut n_part, mut n_skip) = (0, 0, 0);
        for (bm, bn) in [(16u32, 32u32), (64, 16)] {
            let got = run_layout(&spec, variant, &mut call, &sizes, (bm, bn));
            // The host's layout (what a call may give instead) is the kernel's.
            let host = op::HostCall { tensors: call.tensors.clone(), scalars: call.scalars.clone() };
            let (count, idx) = host_layout(&variant.features, &host, bm as usize, bn as usize).unwrap();
            assert_eq!(lists(&count, &idx), got, "{} m{bm} n{bn}: host_layout", variant.name);
            let (bm, bn) = (bm as usize, bn as usize);
            for ((lb, lh, qb), full, part) in got {
                let (mut want_full, mut want_part) = (Vec::new(), Vec::new());
                for kb in 0..sk.div_ceil(bn) {
                    let (mut any, mut all) = (false, true);
                    for i in qb * bm..((qb + 1) * bm).min(sq) {
                        for j in kb * bn..(kb + 1) * bn {
                            let v = j < sk && visible(&f, &x, lb, lh, i, j);
                            any |= v;
                            all &= v;
                        }
                    }
                    if all {
                        want_full.push(kb as i64);
                    } else if any {
                        want_part.push(kb as i64);
                    } else {
                        n_skip += 1;
                    }
                }
                assert_eq!(full, want_full, "{} m{bm} n{bn}: full blocks of ({lb}, {lh}, {qb})", variant.name);
                assert_eq!(part, want_part, "{} m{bm} n{bn}: partial blocks of ({lb}, {lh}, {qb})", variant.name);
                n_full += full.len();
                n_part += part.len();
            }
        }
        // Every sparse variant has blocks of all three kinds on this call, over the two
        // tilings (full attention skips none).
        if variant.name != "full" && !edge {
            assert!(n_full > 0 && n_part > 0 && n_skip > 0, "{}: {n_full} {n_part} {n_skip}", variant.name);
        }
    }
}

/// A layout that calls partial blocks full makes the kernel skip their mask: the
/// result must then differ from the reference (the end-to-end test can fail), while the
/// true layout matches.
#[test]
fn a_layout_that_lies_gives_a_wrong_result() {
    let spec = spec();
    let variant = spec.variant("strided").unwrap();
    let dims = &op().check_dims(&keys())[0];
    let fresh = || op().random_call(&variant.features, DType::F32, dims, 5).unwrap();
    let mut call = fresh();
    let sizes = op().validate(&variant.features, DType::F32, &keys(), &call).unwrap();
    let want = op().reference(&variant.features, &call).unwrap();
    let lists = run_layout(&spec, variant, &mut call, &sizes, (32, 32));
    // Every listed block moved to the front, as if full.
    for ((lb, lh, qb), full, part) in &lists {
        let all: Vec<i64> = full.iter().chain(part).copied().collect();
        let count = call.tensors.get_mut("block_count").unwrap();
        count.set(&[*lb, *lh, *qb, 0], all.len() as f64);
        count.set(&[*lb, *lh, *qb, 1], 0.0);
        let idx = call.tensors.get_mut("block_idx").unwrap();
        for (t, kb) in all.iter().enumerate() {
            idx.set(&[*lb, *lh, *qb, t], *kb as f64);
        }
    }
    let ks = kernels(&spec, variant, DType::F32, 32, 32);
    let plan = PlanDecl {
        name: "layout",
        roles: op().plans(&spec, &variant.features)[0].roles[1..].to_vec(),
        temporaries: vec![],
        launches: vec![Launch::of("main")],
        runtime_axes: vec![],
        shared_axes: vec![],
    };
    let tile = Config::from([("block_m".to_string(), 32), ("block_n".to_string(), 32)]);
    run_plan_interp(&plan, &ks, &mut call, &sizes, &tile).unwrap();
    let (_, rel, _) = compare_outputs(op(), &variant.features, &call, &want)[0];
    assert!(rel > 1e-2, "a lying layout still matched (rel {rel:e})");
    let mut call = fresh();
    run_plan_interp(&op().plans(&spec, &variant.features)[0], &ks, &mut call, &sizes, &tile).unwrap();
    let (_, rel, _) = compare_outputs(op(), &variant.features, &call, &want)[0];
    assert!(rel < 1e-5, "the true layout: rel {rel:e}");
}

/// A call that gives the layout (the seed's `qkv_layouts`): the plan skips its layout
/// kernel and follows the given one. The host's layout matches the reference; a lying
/// one (every listed block called full) gives a wrong result, which shows the given
/// layout is what the kernel read; a layout built for another tiling is refused.
#[test]
fn a_call_may_give_the_layout() {
    let spec = spec();
    let seed = seed();
    let dims = &op().check_dims(&keys())[0];
    for name in ["strided", "document"] {
        let variant = spec.variant(name).unwrap();
        let mut call = op().random_call(&variant.features, DType::F32, dims, seed).unwrap();
        let sizes = op().validate(&variant.features, DType::F32, &keys(), &call).unwrap();
        let want = op().reference(&variant.features, &call).unwrap();
        let ks = kernels(&spec, variant, DType::F32, 32, 32);
        let tile = Config::from([("block_m".to_string(), 32), ("block_n".to_string(), 32)]);
        let plan = &op().plans(&spec, &variant.features)[0];
        let (count, idx) = host_layout(&variant.features, &call, 32, 32).unwrap();
        call.tensors.insert("block_count".into(), count.clone());
        call.tensors.insert("block_idx".into(), idx.clone());
        run_plan_interp(plan, &ks, &mut call, &sizes, &tile).unwrap();
        let (_, rel, _) = compare_outputs(op(), &variant.features, &call, &want)[0];
        assert!(rel < 1e-5, "{name}, the host's layout given: rel {rel:e} seed={seed}");
        // Every listed block moved to the front, as if full.
        let (mut lying_count, mut lying_idx) = (count.clone(), idx.clone());
        for ((lb, lh, qb), full, part) in lists(&count, &idx) {
            let all: Vec<i64> = full.iter().chain(&part).copied().collect();
            lying_count.set(&[lb, lh, qb, 0], all.len() as f64);
            lying_count.set(&[lb, lh, qb, 1], 0.0);
            for (t, kb) in all.iter().enumerate() {
                lying_idx.set(&[lb, lh, qb, t], *kb as f64);
            }
        }
        call.tensors.insert("block_count".into(), lying_count);
        call.tensors.insert("block_idx".into(), lying_idx);
        run_plan_interp(plan, &ks, &mut call, &sizes, &tile).unwrap();
        let (_, rel, _) = compare_outputs(op(), &variant.features, &call, &want)[0];
        assert!(rel > 1e-2, "{name}: the given lying layout was not what ran (rel {rel:e}) seed={seed}");
        // Built for 64 x 32, given to a 32 x 32 plan.
        let (count64, idx64) = host_layout(&variant.features, &call, 64, 32).unwrap();
        call.tensors.insert("block_count".into(), count64);
        call.tensors.insert("block_idx".into(), idx64);
        let e = run_plan_interp(plan, &ks, &mut call, &sizes, &tile).unwrap_err();
        assert!(
            e.contains("argument `block_count` (a precomputed layout)") && e.contains("block_m=32, block_n=32"),
            "{e}"
        );
        // Half a layout is refused.
        call.tensors.insert("block_count".into(), count.clone());
        call.tensors.remove("block_idx");
        let e = run_plan_interp(plan, &ks, &mut call, &sizes, &tile).unwrap_err();
        assert!(e.contains("give all of them or none"), "{e}");
    }
}

#[test]
fn the_mask_algebra_round_trips_and_means_what_the_seed_means() {
    let m = MaskExpr::And(vec![
        MaskExpr::Causal { offset: -2 },
        MaskExpr::Or(vec![MaskExpr::Local { left: 3, right: 1 }, MaskExpr::ChunkedCausal { chunk: 8 }]),
    ]);
    assert_eq!(MaskExpr::from_json(&m.to_json()).unwrap(), m);
    assert_eq!(m.describe(), "causal(-2) & (local(3, 1) | chunked_causal(8))");
    // Causal(offset): kv <= q + offset, top-left aligned.
    let c = MaskExpr::Causal { offset: 0 };
    assert!(c.visible(5, 5) && !c.visible(5, 6) && c.visible(0, 0));
    // Local(left, right): inclusive on both sides.
    let l = MaskExpr::Local { left: 2, right: 1 };
    assert!(l.visible(10, 8) && !l.visible(10, 7) && l.visible(10, 11) && !l.visible(10, 12));
    // ChunkedCausal: same chunk and causal.
    let ch = MaskExpr::ChunkedCausal { chunk: 4 };
    assert!(ch.visible(7, 4) && !ch.visible(8, 7) && !ch.visible(5, 6));
    // Strided: (q − kv) mod s == 0, both ways.
    let s = MaskExpr::Strided { stride: 3 };
    assert!(s.visible(9, 3) && s.visible(3, 9) && !s.visible(9, 4));
    for bad in [r#"{"local": [1]}"#, r#"{"chunked_causal": 0}"#, r#"{"and": []}"#, r#""causl""#, r#"{"x": 1}"#] {
        assert!(MaskExpr::from_json(&serde_json::from_str(bad).unwrap()).is_err(), "{bad}");
    }
}

#[test]
fn a_bad_mask_in_a_spec_is_a_located_diagnostic() {
    let yaml = |mask: &str| {
        format!(
            "name: bs\nop: blocksparse_attention\nversion: 1\ndtypes: [f32]\nhead_dims: [64]\nvariants:\n  v:\n    \
             mask: {mask}\nschedule:\n  block_m: [64]\n  block_n: [64]\n  num_warps: [4]\n  num_stages: [2]\n\
             targets: [cpu]\n"
        )
    };
    for (mask, expect) in [
        ("{lokal: [1, 2]}", "unknown mask `lokal`; did you mean `local`?"),
        ("{local: [1]}", "a local mask is `[left, right]`"),
        ("{chunked_causal: 0}", "a chunk is from 1 to 2^30"),
        ("{and: [causal, {strided: -3}]}", "a stride is from 1 to 2^30"),
        ("causl", "causl"),
    ] {
        let e = spec::load_str("bs.yaml", &yaml(mask)).unwrap_err().to_string();
        assert!(e.contains(expect) && e.contains("bs.yaml:8:"), "{mask}: {e}");
    }
    // Per-head masks: a non-empty list of masks, each located.
    for (masks, expect) in [
        ("[]", "head_masks: the list is empty"),
        ("[full, lokal]", "head_masks[1]: unknown mask `lokal`"),
        ("causal", "head_masks: expected a list"),
    ] {
        let text = yaml("causal").replace("mask: causal", &format!("mask: causal\n    head_masks: {masks}"));
        let e = spec::load_str("bs.yaml", &text).unwrap_err().to_string();
        assert!(e.contains(expect) && e.contains("bs.yaml:9:"), "{masks}: {e}");
    }
    // `bias_grad`: the backward's field, and only beside a bias.
    for (op, fields, expect) in [
        ("blocksparse_attention", "bias: true\n    bias_grad: true", "`bias_grad` is a field of the backward"),
        ("blocksparse_attention_bwd", "bias_grad: true", "the gradient of a bias the variant does not have"),
    ] {
        let text = yaml("causal")
            .replace("op: blocksparse_attention", &format!("op: {op}"))
            .replace("mask: causal", &format!("mask: causal\n    {fields}"));
        let e = spec::load_str("bs.yaml", &text).unwrap_err().to_string();
        assert!(e.contains(expect) && e.contains("variants.v.bias_grad"), "{op}: {e}");
    }
    let ok = spec::load_str("bs.yaml", &yaml("{or: [causal, {local: [4, 4]}]}")).unwrap();
    let f = features(&ok.variants[0]);
    assert_eq!(f.mask, MaskExpr::Or(vec![MaskExpr::Causal { offset: 0 }, MaskExpr::Local { left: 4, right: 4 }]));
}

/// The layout's temporaries are sized by the tiling: `cdiv(seq_q, block_m)` divides by a
/// configuration value.
#[test]
fn a_size_formula_divides_by_a_configuration_value() {
    let e = GridExpr::parse("cdiv(seq_q, block_m)").unwrap();
    assert_eq!(e.to_string(), "cdiv(seq_q, block_m)");
    let v = |q: i64, m: i64| e.eval_in(&BTreeMap::from([("seq_q".to_string(), q), ("block_m".to_string(), m)]));
    assert_eq!(v(333, 64), Ok(6));
    assert_eq!(v(0, 64), Ok(0));
    assert!(v(10, 0).unwrap_err().contains("not positive"));
    assert_eq!(GridExpr::parse("cdiv(a, 4)").unwrap(), GridExpr::cdiv(GridExpr::sym("a"), 4));
    assert!(GridExpr::parse("cdiv(a, 0)").is_err());
}

/// The key range the layout kernel limits its loop to is a bound: no row of a block sees
/// a key outside it, for every mask of the spec and a few more.
#[test]
fn the_key_range_bounds_every_visible_key() {
    let mut masks: Vec<MaskExpr> = spec().variants.iter().map(|v| features(v).mask).collect();
    masks.extend([
        MaskExpr::Or(vec![MaskExpr::ChunkedCausal { chunk: 7 }, MaskExpr::Local { left: 3, right: 9 }]),
        MaskExpr::And(vec![MaskExpr::Causal { offset: -5 }, MaskExpr::Local { left: 0, right: 40 }]),
        MaskExpr::Or(vec![MaskExpr::Causal { offset: 2 }, MaskExpr::Strided { stride: 5 }]),
    ]);
    for m in &masks {
        for (first, last) in [(0, 15), (16, 31), (100, 163), (37, 37)] {
            let (lo, hi) = m.key_range(first, last);
            for q in first..=last {
                for kv in 0..400 {
                    if m.visible(q, kv) {
                        assert!(
                            lo.is_none_or(|lo| kv >= lo) && hi.is_none_or(|hi| kv < hi),
                            "{m:?} rows {first}..={last}: ({q}, {kv}) outside {lo:?}..{hi:?}"
                        );
                    }
                }
            }
        }
    }
    assert_eq!(MaskExpr::Causal { offset: 0 }.key_range(64, 127), (None, Some(128)));
    assert_eq!(MaskExpr::Local { left: 256, right: 0 }.key_range(512, 575), (Some(256), Some(576)));
}

/// Run-time window and chunk sizes outside their range (or not integers) are refused by
/// name before any kernel runs; in range they pass.
#[test]
fn run_time_mask_sizes_are_validated() {
    let spec = spec();
    for (variant, scalar, bad) in [
        ("runtime_window", "window_left", -1.0),
        ("runtime_window", "window_right", 2.5),
        ("runtime_window", "window_left", (1u64 << 31) as f64),
        ("runtime_chunked", "chunk_size", 0.0),
    ] {
        let v = spec.variants.iter().find(|v| v.name == variant).unwrap();
        let dims = &op().check_dims(&keys())[0];
        let mut call = op().random_call(&v.features, DType::F32, dims, seed()).unwrap();
        op().validate(&v.features, DType::F32, &keys(), &call).unwrap();
        call.scalars.insert(scalar.to_string(), bad);
        let e = op().validate(&v.features, DType::F32, &keys(), &call).unwrap_err();
        assert!(e.contains(scalar) && e.contains("2^30"), "{variant} {scalar}={bad}: {e}");
        call.scalars.remove(scalar);
        let e = op().validate(&v.features, DType::F32, &keys(), &call).unwrap_err();
        assert!(e.contains(&format!("`{scalar}` is missing")), "{variant}: {e}");
    }
}
