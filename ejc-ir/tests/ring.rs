//! Ring attention's blocks: flash kernels with a band whose sides may be negative (a
//! block off the diagonal), forward and backward, on the interpreter against the f64
//! reference; and the ring schedule's coverage (also in the module's unit tests).

mod common;

use std::collections::BTreeMap;

use common::seed;
use ejc_ir::op::{self, compare_outputs, run_plan_interp, Config, KernelInstance};
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{self, Spec};
use ejc_ir::types::DType;
use rayon::prelude::*;

fn load(file: &str) -> Spec {
    let path = format!("{}/../specs/{file}", env!("CARGO_MANIFEST_DIR"));
    spec::load_file(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every banded variant of the ring specs, both plans of each op, with bands that sit
/// wholly to one side of the diagonal, straddle it, or hide everything.
#[test]
fn banded_blocks_with_negative_sides_match_the_reference() {
    let seed = seed();
    let bands: &[(i64, i64)] = &[(-5, 20), (30, -7), (-3, 3), (-40, 60), (4, -2), (0, 0), (-50, -50)];
    let mut cases = Vec::new();
    for (file, name) in [("ring.yaml", "flash_attention_fwd"), ("ring_bwd.yaml", "flash_attention_bwd")] {
        let spec = load(file);
        let op = ejc_ir::ops::get(name).unwrap();
        for variant in spec.variants.iter().filter(|v| v.name.ends_with("band")) {
            for plan in op.plans(&spec, &variant.features) {
                for (i, band) in bands.iter().enumerate() {
                    cases.push((spec.clone(), op, variant.clone(), plan.clone(), i, *band));
                }
            }
        }
    }
    let failures: Vec<String> = cases
        .par_iter()
        .filter_map(|(spec, op, variant, plan, i, (left, right))| {
            let keys = BTreeMap::from([("head_dim".to_string(), 64u32)]);
            let tile = Config::from([("block_m".to_string(), 16), ("block_n".to_string(), 16)]);
            let mut kernels = BTreeMap::new();
            for role in &plan.roles {
                let mut t = tile.clone();
                t.extend(role.fixed.clone());
                let mut k = KernelInstance {
                    id: String::new(),
                    variant,
                    dtype: DType::F32,
                    keys: keys.clone(),
                    role: role.name,
                    tile: t,
                };
                k.id = op.kernel_id(&spec.name, &k);
                let built = op.build(spec, &k).unwrap_or_else(|e| panic!("{}: {e}", k.id));
                kernels.insert(role.name.to_string(), run_pipeline(&built, &default_pipeline()).unwrap());
            }
            // Square blocks as a ring cuts them, and one taller than wide.
            let (sq, sk) = if i % 2 == 0 { (37, 37) } else { (45, 29) };
            let dims = [("batch", 2), ("seq_q", sq), ("seq_k", sk), ("heads_q", 4), ("heads_kv", 2), ("head_dim", 64)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
            let mut call = op.random_call(&variant.features, DType::F32, &dims, seed ^ (*i as u64 * 7919)).unwrap();
            call.scalars.insert("window_left".into(), *left as f64);
            call.scalars.insert("window_right".into(), *right as f64);
            if op.name() == "flash_attention_bwd" {
                // The forward's out and lse for this band.
                let f = ejc_ir::ops::get("flash_attention_fwd").unwrap().reference(&variant.features, &call).unwrap();
                let f32s = |t: &ejc_ir::tensor::HostTensor| {
                    ejc_ir::tensor::HostTensor::from_vec(
                        DType::F32,
                        &t.shape,
                        t.to_vec().into_iter().map(|x| DType::F32.round(x)).collect(),
                    )
                };
                call.tensors.insert("out".into(), f32s(&f["out"]));
                call.tensors.insert("lse".into(), f32s(&f["lse"]));
            }
            let sizes = op.validate(&variant.features, DType::F32, &keys, &call).unwrap();
            let want = op.reference(&variant.features, &call).unwrap();
            let what = format!("{} {} {} band ({left}, {right}) [{sq}x{sk}]", op.name(), variant.name, plan.name);
            let config = Config::from([("num_splits".to_string(), 3u32)]);
            if let Err(e) = run_plan_interp(plan, &kernels, &mut call, &sizes, &config) {
                return Some(format!("{what}: {e}"));
            }
            compare_outputs(*op, &variant.features, &call, &want)
                .into_iter()
                // A band of one key per row has an exactly zero dQ: there the absolute
                // error (rounding noise) is what can be judged.
                .find(|(_, rel, abs)| rel.is_nan() || (*rel > 1e-5 && !(rel.is_infinite() && *abs <= 1e-5)))
                .map(|(name, rel, abs)| format!("{what}: {name} rel {rel:.3e} (abs {abs:.3e})"))
        })
        .collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// A side below -2^30 is refused (the kernels' i32 band arithmetic stays in range); any
/// side above, also one past the whole block, is a call (the tuner checks ring blocks on
/// small calls). The public front doors refuse any negative side.
#[test]
fn sides_past_the_whole_block_are_refused() {
    let op = ejc_ir::ops::get("flash_attention_fwd").unwrap();
    let spec = load("ring.yaml");
    let f = &spec.variant("band").unwrap().features;
    let dims = [("batch", 1), ("seq_q", 20), ("seq_k", 30), ("heads_q", 2), ("heads_kv", 1), ("head_dim", 64)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let keys = BTreeMap::from([("head_dim".to_string(), 64u32)]);
    let mut call = op.random_call(f, DType::F32, &dims, 3).unwrap();
    call.scalars.insert("window_left".into(), -5000.0);
    assert!(op.validate(f, DType::F32, &keys, &call).is_ok());
    call.scalars.insert("window_left".into(), -((1u64 << 30) as f64) - 1.0);
    let e = op.validate(f, DType::F32, &keys, &call).unwrap_err();
    assert!(e.contains("window_left"), "{e}");
    let _ = op::tolerance(DType::F32);
}
