//! Paged decode attention, and ragged decode attention (the same kernels over contiguous
//! ranges): both plans (one kernel; split-K's partial then combine) on the
//! interpreter, after the pass pipeline, against the f64 reference — every variant of
//! `specs/page_attention.yaml`, f32 and bf16, the operation's awkward cases (contexts
//! off the page size, an empty and a one-key sequence, MQA with two head blocks, shared
//! pages, page size 1, a page size off every key block), key blocks of 16, 32 and 64,
//! head blocks of 16 and 32, split counts from one to more splits than key blocks (45: a
//! partial chunk of the combine's 32). Then the reference against a direct softmax, and
//! the operation's refusals.
//!
//! Inputs are fresh random numbers; the seed is printed (`EJC_TEST_SEED` replays).
//! Outputs and temporaries start as NaN, so an element no program writes fails.

mod common;

use std::collections::BTreeMap;

use common::seed;
use ejc_ir::op::{run_plan_interp, Config, KernelInstance, Operation, Sizes};
use ejc_ir::ops::page_attention::reference::{random_inputs, reference, PagedShape};
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{self, Spec};
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;
use rayon::prelude::*;

fn load(file: &str) -> Spec {
    let path = format!("{}/../specs/{file}", env!("CARGO_MANIFEST_DIR"));
    spec::load_file(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn spec() -> Spec {
    load("page_attention.yaml")
}

fn op() -> &'static dyn Operation {
    ejc_ir::ops::get("page_attention").unwrap()
}

#[test]
fn both_plans_match_the_reference_on_awkward_calls() {
    plans_match_the_reference(&spec(), op());
}

/// Ragged decode attention runs the same kernels over contiguous ranges: every variant
/// (window, soft cap, sinks) on the same grid of tilings and split counts.
#[test]
fn ragged_decode_plans_match_the_reference_on_awkward_calls() {
    plans_match_the_reference(&load("ragged_decode.yaml"), ejc_ir::ops::get("ragged_decode_attention").unwrap());
}

/// Every case: (variant, dtype, tiling (block_h, block_n), plan, split count, dims).
fn plans_match_the_reference(spec: &Spec, op: &dyn Operation) {
    let seed = seed();
    let keys = BTreeMap::from([("head_dim".to_string(), 64u32)]);
    let mut cases = Vec::new();
    for variant in &spec.variants {
        for dtype in [DType::F32, DType::BF16] {
            for (bh, bn) in [(16, 16), (16, 64), (32, 32)] {
                for plan in op.plans(spec, &variant.features) {
                    let splits: &[usize] = if plan.name == "single" { &[0] } else { &[1, 3, 45, 64] };
                    for &n in splits {
                        for (i, dims) in op.check_dims(&keys).into_iter().enumerate() {
                            cases.push((variant, dtype, (bh, bn), plan.clone(), n, i, dims));
                        }
                    }
                }
            }
        }
    }
    let failures: Vec<String> = cases
        .par_iter()
        .filter_map(|(variant, dtype, (bh, bn), plan, n, i, dims)| {
            let tile = Config::from([("block_h".to_string(), *bh), ("block_n".to_string(), *bn)]);
            let mut kernels = BTreeMap::new();
            for role in &plan.roles {
                let mut t = tile.clone();
                t.extend(role.fixed.clone());
                let mut k = KernelInstance {
                    id: String::new(),
                    variant,
                    dtype: *dtype,
                    keys: keys.clone(),
                    role: role.name,
                    tile: t,
                };
                k.id = op.kernel_id(&spec.name, &k);
                let built = op.build(spec, &k).unwrap_or_else(|e| panic!("{}: {e}", k.id));
                kernels.insert(role.name.to_string(), run_pipeline(&built, &default_pipeline()).unwrap());
            }
            let case_seed = seed ^ (*i as u64 * 7919) ^ (*n as u64) << 20;
            let mut call = op.random_call(&variant.features, *dtype, dims, case_seed).unwrap();
            let sizes = op.validate(&variant.features, *dtype, &keys, &call).unwrap();
            let want = op.reference(&variant.features, &call).unwrap();
            let config = Config::from([("num_splits".to_string(), *n as u32)]);
            let what = format!("{} {dtype} h{bh} n{bn} {} splits={n} case {i} {dims:?}", variant.name, plan.name);
            if let Err(e) = run_plan_interp(plan, &kernels, &mut call, &sizes, &config) {
                return Some(format!("{what}: {e}"));
            }
            common::worst_output(op, &variant.features, *dtype, &call, &want, &what)
        })
        .collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// The reference against softmax written out for one sequence whose keys sit in pages
/// given in reverse order, with a soft cap.
#[test]
fn the_reference_reads_pages_through_the_block_table() {
    let (d, page) = (4, 3);
    let q = HostTensor::from_vec(DType::F32, &[1, 2, d], (0..2 * d).map(|i| (i as f64 * 0.37).sin()).collect());
    let cache: Vec<f64> = (0..3 * page * d).map(|i| (i as f64 * 0.53).cos()).collect();
    let k = HostTensor::from_vec(DType::F32, &[3, 1, page, d], cache.clone());
    let v = HostTensor::from_vec(DType::F32, &[3, 1, page, d], cache.iter().map(|x| x * 2.0 - 0.5).collect());
    let lens = HostTensor::from_vec(DType::I32, &[1], vec![7.0]);
    let table = HostTensor::from_vec(DType::I32, &[1, 3], vec![2.0, 0.0, 1.0]);
    let (scale, cap) = (0.7, 1.5);
    let out = reference(&q, &k, &v, &lens, &table, scale, Some(cap)).unwrap();
    for h in 0..2 {
        // Key j is in page table[j / 3], row j % 3; both heads read KV head 0. (The
        // output is rounded to f32.)
        let rows: Vec<(usize, usize)> = (0..7).map(|j| ([2, 0, 1][j / page], j % page)).collect();
        let x: Vec<f64> = rows
            .iter()
            .map(|&(p, r)| {
                let dot: f64 = (0..d).map(|c| q.get(&[0, h, c]) * k.get(&[p, 0, r, c])).sum();
                cap * (dot * scale / cap).tanh()
            })
            .collect();
        let w: Vec<f64> = x.iter().map(|x| x.exp()).collect();
        let total: f64 = w.iter().sum();
        for c in 0..d {
            let want: f64 = rows.iter().zip(&w).map(|(&(p, r), w)| w * v.get(&[p, 0, r, c])).sum::<f64>() / total;
            assert!(
                (out.get(&[0, h, c]) - want).abs() < 1e-6 * want.abs().max(1.0),
                "head {h} col {c}: {} vs {want}",
                out.get(&[0, h, c])
            );
        }
    }
}

#[test]
fn random_calls_share_pages_only_when_asked() {
    let shape = PagedShape {
        num_seqs: 6,
        heads_q: 4,
        heads_kv: 2,
        head_dim: 16,
        page_size: 8,
        max_context: 40,
        min_context: 20,
        num_pages: None,
    };
    let x = random_inputs(DType::BF16, &shape, 5);
    let used: Vec<f64> = x.block_tables.to_vec().into_iter().filter(|p| *p >= 0.0).collect();
    let mut distinct = used.clone();
    distinct.sort_by(f64::total_cmp);
    distinct.dedup();
    assert_eq!(used.len(), distinct.len(), "each page once by default");
    assert!(x.context_lens.to_vec().iter().all(|l| (20.0..=40.0).contains(l)));
    let shared = random_inputs(DType::BF16, &PagedShape { num_pages: Some(3), ..shape }, 5);
    assert!(shared.block_tables.to_vec().iter().all(|p| (-1.0..3.0).contains(p)));
}

#[test]
fn bad_calls_are_refused_with_the_argument_named() {
    let spec = spec();
    let op = op();
    let f = &spec.variants[0].features;
    let keys = BTreeMap::from([("head_dim".to_string(), 64u32)]);
    let dims: Sizes = op.check_dims(&keys)[0].clone();
    let good = op.random_call(f, DType::F32, &dims, 1).unwrap();
    assert!(op.validate(f, DType::F32, &keys, &good).is_ok());
    let mut bad = good.clone();
    let t = bad.tensors.get_mut("block_tables").unwrap();
    t.set(&[0, 0], 1e6);
    let e = op.validate(f, DType::F32, &keys, &bad).unwrap_err();
    assert!(e.contains("block_tables[0, 0] = 1000000 is not a page"), "{e}");
    let mut bad = good.clone();
    bad.tensors.get_mut("context_lens").unwrap().set(&[1], 1e6);
    let e = op.validate(f, DType::F32, &keys, &bad).unwrap_err();
    assert!(e.contains("context_lens[1] = 1000000 is outside"), "{e}");
    let mut bad = good.clone();
    bad.tensors.insert("key_cache".into(), HostTensor::zeros(DType::F32, &[4, 3, 16, 64]));
    let e = op.validate(f, DType::F32, &keys, &bad).unwrap_err();
    assert!(e.contains("multiple of `key_cache`'s heads_kv (3)") || e.contains("value_cache"), "{e}");
    let mut bad = good;
    bad.scalars.remove("softmax_scale");
    assert!(op.validate(f, DType::F32, &keys, &bad).unwrap_err().contains("softmax_scale"));
}

/// Ragged decode's reference against softmax written out: one row whose range is
/// `[2, 9)` of 10 keys, a window of 3 left of the query (token 8: keys 5..=8), a soft cap
/// and two sinks in the denominator; and its refusals.
#[test]
fn the_ragged_reference_windows_caps_and_sinks() {
    use ejc_ir::ops::ragged_decode::reference::{reference as ragged, RaggedInputs};
    let (t, d) = (10, 4);
    let f = |n: usize, k: f64| (0..n).map(|i| (i as f64 * k).sin()).collect::<Vec<f64>>();
    let x = RaggedInputs {
        query: HostTensor::from_vec(DType::F32, &[1, 2, d], f(2 * d, 0.31)),
        key: HostTensor::from_vec(DType::F32, &[1, t, 1, d], f(t * d, 0.47)),
        value: HostTensor::from_vec(DType::F32, &[1, t, 1, d], f(t * d, 0.29)),
        sequence_start: HostTensor::from_vec(DType::I32, &[1], vec![2.0]),
        sequence_end: HostTensor::from_vec(DType::I32, &[1], vec![9.0]),
        sinks: Some(HostTensor::from_vec(DType::F32, &[2, 2], vec![0.5, -1.0, 1.5, 0.25])),
    };
    let (scale, cap) = (0.8, 2.0);
    let out = ragged(&x, scale, Some(cap), Some(3), true).unwrap();
    for h in 0..2 {
        let keys = 5..9;
        let s: Vec<f64> = keys
            .clone()
            .map(|j| {
                let dot: f64 = (0..d).map(|c| x.query.get(&[0, h, c]) * x.key.get(&[0, j, 0, c])).sum();
                cap * (dot * scale / cap).tanh()
            })
            .collect();
        let sinks = [x.sinks.as_ref().unwrap().get(&[h, 0]), x.sinks.as_ref().unwrap().get(&[h, 1])];
        let total: f64 = s.iter().map(|v| v.exp()).sum::<f64>() + sinks.iter().map(|v| v.exp()).sum::<f64>();
        for c in 0..d {
            let want: f64 =
                keys.clone().zip(&s).map(|(j, s)| s.exp() * x.value.get(&[0, j, 0, c])).sum::<f64>() / total;
            let got = out.get(&[0, h, c]);
            assert!((got - want).abs() < 1e-6 * want.abs().max(1.0), "head {h} col {c}: {got} vs {want}");
        }
    }
    let mut bad = x.clone();
    bad.sequence_end = HostTensor::from_vec(DType::I32, &[1], vec![11.0]);
    assert!(ragged(&bad, scale, None, None, false).unwrap_err().contains("range [2, 11) is not inside [0, 10]"));
    let op = ejc_ir::ops::get("ragged_decode_attention").unwrap();
    let spec = load("ragged_decode.yaml");
    let feats = &spec.variants.iter().find(|v| v.name == "gpt_oss").unwrap().features;
    let keys = BTreeMap::from([("head_dim".to_string(), 64u32)]);
    let dims = op.check_dims(&keys)[0].clone();
    let good = op.random_call(feats, DType::F32, &dims, 3).unwrap();
    assert!(op.validate(feats, DType::F32, &keys, &good).is_ok());
    let mut bad = good.clone();
    bad.tensors.get_mut("sequence_start").unwrap().set(&[1], 400.0);
    let e = op.validate(feats, DType::F32, &keys, &bad).unwrap_err();
    assert!(e.contains("row 1: sequence_start 400"), "{e}");
    let mut bad = good.clone();
    bad.tensors.remove("sinks");
    assert!(op.validate(feats, DType::F32, &keys, &bad).unwrap_err().contains("argument `sinks`"));
    let mut bad = good;
    bad.scalars.insert("window_left".into(), -1.0);
    assert!(op.validate(feats, DType::F32, &keys, &bad).unwrap_err().contains("window_left"));
}
