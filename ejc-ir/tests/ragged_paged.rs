//! Ragged paged attention (`specs/ragged_paged.yaml`): every plan (`packed`: pack, main,
//! unpack; `classed`: main once per class of sequence; `split_k` at 1 and 5 splits: pack,
//! partial, combine, unpack; `classed_split` at 1, 3 and 5: the small class split, merged
//! per sequence) on the interpreter, after the pass pipeline, against the f64 reference —
//! every variant, f32 and bf16, row blocks of 16, 64 and 128 and key blocks of 16, 32
//! and 64, on the operation's awkward batches (a prefill chunk, decode tokens, a one-token
//! sequence, an empty one and random mixes; contexts off the page size; GQA 4:1 and 5:1,
//! MHA, shared pages; padding rows). v3 the same way, its cache writes compared byte for
//! byte. Then the operations' refusals.
//!
//! Inputs are fresh random numbers; the seed is printed (`EJC_TEST_SEED` replays).
//! Outputs start as NaN, so an element no program writes fails.

mod common;

use std::collections::BTreeMap;

use common::seed;
use ejc_ir::op::{run_plan_interp, run_plan_interp_in, CallView, Config, KernelInstance, LaunchOrder, Operation};
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{self, Spec};
use ejc_ir::types::DType;
use rayon::prelude::*;

fn load(file: &str) -> Spec {
    let path = format!("{}/../specs/{file}", env!("CARGO_MANIFEST_DIR"));
    spec::load_file(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn spec() -> Spec {
    load("ragged_paged.yaml")
}

fn op() -> &'static dyn Operation {
    ejc_ir::ops::get("ragged_page_attention").unwrap()
}

#[test]
fn the_packed_plan_matches_the_reference_on_awkward_batches() {
    packed_plan_matches(spec(), op(), false);
}

/// v3: the cache writes, then the same attention; the updated cache is compared byte for
/// byte with the reference's, the output within the dtype's tolerance.
#[test]
fn v3_writes_the_cache_byte_for_byte_and_matches_the_reference() {
    packed_plan_matches(load("ragged_paged_v3.yaml"), ejc_ir::ops::get("ragged_page_attention_v3").unwrap(), true);
}

fn packed_plan_matches(spec: Spec, op: &'static dyn Operation, exact_cache: bool) {
    let seed = seed();
    let keys = BTreeMap::from([("head_dim".to_string(), 64u32)]);
    let mut cases = Vec::new();
    for variant in &spec.variants {
        for dtype in [DType::F32, DType::BF16] {
            for (bm, bn) in [(16, 16), (64, 32), (128, 64)] {
                for plan in op.plans(&spec, &variant.features) {
                    // Split-K on one tiling (its kernels are main's): one split, and five
                    // (more than some row blocks' key blocks: empty splits).
                    // `classed_split` the same, and at three splits on 128-key blocks' plans.
                    let splits: &[u32] = match plan.name {
                        "split_k" | "classed_split" if (bm, bn) == (64, 32) => &[1, 5],
                        "classed_split" if (bm, bn) == (128, 64) => &[3],
                        "split_k" | "classed_split" => &[],
                        _ => &[0],
                    };
                    for &n in splits {
                        for (i, dims) in op.check_dims(&keys).into_iter().enumerate() {
                            cases.push((variant, dtype, (bm, bn), plan.clone(), n, i, dims));
                        }
                    }
                }
            }
        }
    }
    let failures: Vec<String> = cases
        .par_iter()
        .filter_map(|(variant, dtype, (bm, bn), plan, n, i, dims)| {
            let tile = Config::from([("block_m".to_string(), *bm), ("block_n".to_string(), *bn)]);
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
                let built = op.build(&spec, &k).unwrap_or_else(|e| panic!("{}: {e}", k.id));
                kernels.insert(role.name.to_string(), run_pipeline(&built, &default_pipeline()).unwrap());
            }
            let case_seed = seed ^ (*i as u64 * 7919) ^ ((*bm as u64) << 20) ^ ((*n as u64) << 40);
            let mut call = op.random_call(&variant.features, *dtype, dims, case_seed).unwrap();
            let sizes = op.validate(&variant.features, *dtype, &keys, &call).unwrap();
            let want = op.reference(&variant.features, &call).unwrap();
            let what = format!("{} {dtype} m{bm} n{bn} {} splits={n} case {i} {dims:?}", variant.name, plan.name);
            let config = Config::from([("num_splits".to_string(), *n)]);
            let fresh = call.clone();
            if let Err(e) = run_plan_interp(plan, &kernels, &mut call, &sizes, &config) {
                return Some(format!("{what}: {e}"));
            }
            // Launches the plan declares independent (`after`: the classes' launches, which
            // a GPU runs on two streams) must give the same bits in the other order.
            if plan.launches.iter().any(|l| l.after.is_some()) {
                let mut late = fresh;
                if let Err(e) = run_plan_interp_in(plan, &kernels, &mut late, &sizes, &config, LaunchOrder::Late) {
                    return Some(format!("{what} (late order): {e}"));
                }
                for name in op.outputs(&variant.features) {
                    let (a, b) = (call.tensors[name].to_vec(), late.tensors[name].to_vec());
                    if a.iter().zip(&b).any(|(x, y)| x.to_bits() != y.to_bits()) {
                        return Some(format!("{what}: `{name}` depends on the order of launches declared independent"));
                    }
                }
            }
            if exact_cache {
                let (got, want) = (call.tensors["kv_pages"].to_vec(), want["kv_pages"].to_vec());
                if got.len() != want.len() || got.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()) {
                    return Some(format!("{what}: the updated cache differs from the reference's"));
                }
            }
            common::worst_output(op, &variant.features, *dtype, &call, &want, &what)
        })
        .collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// The FLOPs `ejc-gpu bench` reports: `validate` counts the (token, key) pairs each query
/// head scores, with and without a window, as a plain walk over the call's sequences does.
#[test]
fn the_work_counts_every_scored_pair() {
    let spec = spec();
    let keys = BTreeMap::from([("head_dim".to_string(), 64u32)]);
    for name in ["full", "sliding_window"] {
        let variant = spec.variant(name).unwrap();
        for (i, dims) in op().check_dims(&keys).into_iter().enumerate() {
            let call = op().random_call(&variant.features, DType::BF16, &dims, seed() ^ i as u64).unwrap();
            let sizes = op().validate(&variant.features, DType::BF16, &keys, &call).unwrap();
            let (lens, qsl) = (call.int_values("context_lens").unwrap(), call.int_values("query_start_loc").unwrap());
            let w = call.scalar("sliding_window");
            let mut pairs = 0i64;
            for s in 0..lens.len() {
                let (q_len, ctx) = (qsl[s + 1] - qsl[s], lens[s]);
                for t in 0..q_len {
                    let p = ctx - q_len + t;
                    pairs += (0..=p).filter(|&j| w.is_none_or(|w| j > p - w as i64)).count() as i64;
                }
            }
            assert_eq!(sizes["score_pairs"], pairs, "{name} case {i}");
            let work = op().work(&variant.features, DType::BF16, &sizes);
            let want = 4.0 * pairs as f64 * sizes["heads_q"] as f64 * 64.0;
            assert_eq!(work.flops, want, "{name} case {i}");
        }
    }
}

#[test]
fn bad_calls_are_refused_with_the_argument_named() {
    let (spec, op) = (spec(), op());
    let v = spec.variants.iter().find(|v| v.name == "gpt_oss").unwrap();
    let f = &v.features;
    let keys = BTreeMap::from([("head_dim".to_string(), 64u32)]);
    let dims = op.check_dims(&keys)[0].clone();
    let good = op.random_call(f, DType::F32, &dims, 1).unwrap();
    assert!(op.validate(f, DType::F32, &keys, &good).is_ok());
    let refused = |edit: &dyn Fn(&mut ejc_ir::op::HostCall), needle: &str| {
        let mut bad = good.clone();
        edit(&mut bad);
        let e = op.validate(f, DType::F32, &keys, &bad).unwrap_err();
        assert!(e.contains(needle), "wanted `{needle}` in: {e}");
    };
    refused(
        &|c| c.tensors.get_mut("block_tables").unwrap().set(&[0, 0], 1e6),
        "block_tables[0, 0] = 1000000 is not a page",
    );
    refused(&|c| c.tensors.get_mut("context_lens").unwrap().set(&[1], 1e6), "context_lens[1] = 1000000 is outside");
    // Sequence 0's prefill chunk is longer than a context of 1.
    refused(&|c| c.tensors.get_mut("context_lens").unwrap().set(&[0], 1.0), "sequence 0 has");
    refused(&|c| c.tensors.get_mut("query_start_loc").unwrap().set(&[0], 1.0), "query_start_loc[0] must be 0");
    refused(&|c| c.tensors.get_mut("query_start_loc").unwrap().set(&[1], 1e6), "non-decreasing");
    refused(
        &|c| {
            c.scalars.insert("sliding_window".into(), 0.0);
        },
        "sliding_window",
    );
    refused(&|c| drop(c.tensors.remove("sinks")), "argument `sinks`");
    refused(
        &|c| drop(c.tensors.insert("kv_pages".into(), ejc_ir::tensor::HostTensor::zeros(DType::F32, &[4, 16, 3, 64]))),
        "kv_pages",
    );
}

#[test]
fn v3_refuses_colliding_writes_quantised_caches_and_bad_distributions() {
    let spec = load("ragged_paged_v3.yaml");
    let op = ejc_ir::ops::get("ragged_page_attention_v3").unwrap();
    let f = &spec.variants[0].features;
    let keys = BTreeMap::from([("head_dim".to_string(), 64u32)]);
    let dims = op.check_dims(&keys)[0].clone();
    let good = op.random_call(f, DType::F32, &dims, 3).unwrap();
    let sizes = op.validate(f, DType::F32, &keys, &good).unwrap();
    assert_eq!(sizes["num_seqs"], 5, "the last of 6 slots is inactive");
    let refused = |edit: &dyn Fn(&mut ejc_ir::op::HostCall), needle: &str| {
        let mut bad = good.clone();
        edit(&mut bad);
        let e = op.validate(f, DType::F32, &keys, &bad).unwrap_err();
        assert!(e.contains(needle), "wanted `{needle}` in: {e}");
    };
    refused(
        &|c| {
            c.scalars.insert("k_scale".into(), 0.5);
        },
        "no fp8 type",
    );
    refused(&|c| c.tensors.get_mut("distribution").unwrap().set(&[2], 9.0), "d2 <=");
    // Distribution (1, 2, 5): making sequence 1 (a 70-token prefill) decode-only breaks the promise.
    refused(&|c| c.tensors.get_mut("distribution").unwrap().set(&[0], 2.0), "decode-only");
    // Sequence 0's (a decode) last page is sequence 1's first, which its prefill fills.
    refused(
        &|c| {
            let page = c.tensors["kv_pages"].shape[1];
            let last = (c.tensors["kv_lens"].get(&[0]) as usize - 1) / page;
            let t = c.tensors.get_mut("block_tables").unwrap();
            let shared = t.get(&[1, 0]);
            t.set(&[0, last], shared);
        },
        "which another new token writes too",
    );
}

/// `classify` lists the sequences of more than 16 packed rows, in order, whatever comes
/// before them: here a sequence of exactly 16 rows (small) before a large one, and more
/// sequences than one step of its count (CLASSIFY_STEP) so that the count crosses steps.
#[test]
fn classify_lists_the_large_sequences_in_order() {
    use ejc_ir::interp::{launch, Arg};
    use ejc_ir::ops::ragged_paged::kernels::{build, Class, Role, RpaKernel, CLASSIFY_STEP};
    use ejc_ir::tensor::HostTensor;
    let k = RpaKernel {
        role: Role::Classify,
        soft_cap: false,
        window: false,
        sinks: false,
        dtype: DType::BF16,
        head_dim: 64,
        block_m: 0,
        block_n: 0,
        class: Class::All,
    };
    let kernel = run_pipeline(&build("classify", &k).unwrap(), &default_pipeline()).unwrap();
    let group = 4usize;
    // Tokens per sequence: 4 (16 rows: small), 1, 5 (20: large), 4, 0, 6 (large), then a
    // pattern past CLASSIFY_STEP sequences.
    let mut q_lens = vec![4usize, 1, 5, 4, 0, 6];
    q_lens.extend((0..CLASSIFY_STEP + 7).map(|i| [1, 4, 5, 0, 9][i % 5]));
    let want: Vec<f64> = (0..q_lens.len()).filter(|&i| q_lens[i] * group > 16).map(|i| i as f64).collect();
    let mut qsl = vec![0.0];
    for q in &q_lens {
        qsl.push(qsl.last().unwrap() + *q as f64);
    }
    let n = q_lens.len();
    let mut args = vec![
        Arg::Tensor(HostTensor::from_vec(DType::I32, &[n + 1], qsl)),
        Arg::Tensor(HostTensor::from_vec(DType::I32, &[n + 1], vec![-1.0; n + 1])),
        Arg::Scalar(group as f64),
    ];
    launch(&kernel, &mut args, [n, 1, 1]).unwrap();
    let Arg::Tensor(ids) = &args[1] else { unreachable!() };
    let got = ids.to_vec();
    assert_eq!(&got[..want.len()], &want[..], "large_ids");
    assert!(got[want.len()..].iter().all(|x| *x == -1.0), "nothing written past the list: {got:?}");
}
