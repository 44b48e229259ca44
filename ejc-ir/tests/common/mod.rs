//! Helpers shared by the IR's own test files (`pass_*.rs`, `parse_print.rs`,
//! `verify_errors.rs`, the reference and backward tests): the run's seed, the flash
//! spec's variants, parsing hand-written IR, running one pass, snapshotting the
//! printed result, and checking that a pass keeps a kernel's meaning by running the
//! interpreter before and after it on fresh random inputs.
//!
//! Each test binary uses a different subset, hence the `dead_code` allowance.
#![allow(dead_code)]

use ejc_ir::interp::{launch_with_stats, Arg, Stats};
use ejc_ir::ir::Kernel;
use ejc_ir::parse::parse_kernel;
use ejc_ir::passes::Pass;
use ejc_ir::print::print_kernel;
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::{DType, Type};
use ejc_ir::verify::verify;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Snapshot `text` as `snapshots/<name>.snap` (the repository's snapshot folder).
/// A macro, so that the snapshot's `source:` names the test file.
#[macro_export]
macro_rules! snap {
    ($name:expr, $text:expr) => {
        insta::with_settings!({
            snapshot_path => concat!(env!("CARGO_MANIFEST_DIR"), "/../snapshots"),
            prepend_module_to_snapshot => false,
        }, {
            insta::assert_snapshot!($name, $text);
        })
    };
}

/// A fresh seed per test run, unless `EJC_TEST_SEED` pins one; printed so that a
/// failure can be replayed.
pub fn seed() -> u64 {
    let s = std::env::var("EJC_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    eprintln!("seed = {s} (replay with EJC_TEST_SEED={s})");
    s
}

/// Every variant of specs/flash.yaml, typed (the backward's tests run on the forward's
/// variants: the backward's spec has the same ones).
pub fn flash_variants() -> Vec<(String, ejc_ir::flash::Features)> {
    let spec = ejc_ir::spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash.yaml")).unwrap();
    spec.variants.iter().map(|v| (v.name.clone(), ejc_ir::flash::Features::from_json(&v.features).unwrap())).collect()
}

/// Every variant of specs/flash_bwd.yaml, typed: the forward's, and those that ask for
/// `dbias` (`bias_grad`).
pub fn flash_bwd_variants() -> Vec<(String, ejc_ir::flash::Features)> {
    let spec = ejc_ir::spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash_bwd.yaml")).unwrap();
    spec.variants.iter().map(|v| (v.name.clone(), ejc_ir::flash::Features::from_json(&v.features).unwrap())).collect()
}

/// A deterministic generator for a fixed seed.
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Parse (and verify) hand-written IR; a failure is a bug in the test.
pub fn parse(text: &str) -> Kernel {
    parse_kernel(text).unwrap_or_else(|e| panic!("test IR does not parse: {e}\n{text}"))
}

/// Run one pass on a copy of `kernel` and verify the result.
pub fn run_pass(pass: &dyn Pass, kernel: &Kernel) -> Kernel {
    let mut k = kernel.clone();
    pass.run(&mut k);
    if let Err(e) = verify(&k) {
        panic!("`{}` produced invalid IR: {e}\n{}", pass.name(), print_kernel(&k));
    }
    k
}

/// Parse `text`, run `pass`, and return (input, output, printed output).
pub fn apply(pass: &dyn Pass, text: &str) -> (Kernel, Kernel, String) {
    let before = parse(text);
    let after = run_pass(pass, &before);
    let printed = print_kernel(&after);
    // The printed output is itself valid, round-tripping IR.
    let reparsed = parse(&printed);
    assert_eq!(print_kernel(&reparsed), printed, "the pass output does not round-trip");
    (before, after, printed)
}

/// How the random arguments of a kernel are drawn: fixed tensor shapes and scalar
/// values by parameter name; everything else is random.
#[derive(Clone, Debug, Default)]
pub struct ArgSpec {
    pub shapes: Vec<(&'static str, Vec<usize>)>,
    pub scalars: Vec<(&'static str, f64)>,
    /// Range of random i32 scalars (inclusive).
    pub int_range: (i64, i64),
}

impl ArgSpec {
    pub fn new() -> ArgSpec {
        ArgSpec { shapes: vec![], scalars: vec![], int_range: (-20, 20) }
    }

    pub fn shape(mut self, name: &'static str, shape: &[usize]) -> ArgSpec {
        self.shapes.push((name, shape.to_vec()));
        self
    }

    pub fn scalar(mut self, name: &'static str, value: f64) -> ArgSpec {
        self.scalars.push((name, value));
        self
    }

    pub fn ints(mut self, lo: i64, hi: i64) -> ArgSpec {
        self.int_range = (lo, hi);
        self
    }
}

fn random_element(dtype: DType, rng: &mut StdRng, ints: (i64, i64)) -> f64 {
    match dtype {
        DType::I1 => rng.random_bool(0.5) as u8 as f64,
        DType::I32 => rng.random_range(ints.0..=ints.1) as f64,
        DType::U32 => rng.random::<u32>() as f64,
        _ => dtype.round(rng.random_range(-4.0..4.0)),
    }
}

/// Random arguments for `kernel`, in parameter order. Tensors without a fixed shape
/// get random extents in 1..=12 (loads and stores are bounds-checked, so any shape is
/// valid); tensor contents are random, never zeros.
pub fn random_args(kernel: &Kernel, spec: &ArgSpec, rng: &mut StdRng) -> Vec<Arg> {
    kernel
        .params
        .iter()
        .map(|p| match &p.ty {
            Type::Tensor(d, rank) => {
                let shape = spec
                    .shapes
                    .iter()
                    .find(|(n, _)| *n == p.name)
                    .map(|(_, s)| s.clone())
                    .unwrap_or_else(|| (0..*rank).map(|_| rng.random_range(1..=12)).collect());
                assert_eq!(shape.len(), *rank, "shape given for %{}", p.name);
                let n = shape.iter().product();
                let data = (0..n).map(|_| random_element(*d, rng, spec.int_range)).collect();
                Arg::Tensor(HostTensor::from_vec(*d, &shape, data))
            }
            Type::Scalar(d) => match spec.scalars.iter().find(|(n, _)| *n == p.name) {
                Some((_, x)) => Arg::Scalar(*x),
                None => Arg::Scalar(random_element(*d, rng, spec.int_range)),
            },
            Type::Tile(..) => unreachable!("the verifier rejects tile parameters"),
        })
        .collect()
}

/// Equal element by element, bit for bit (so `-0.0 != 0.0`), with NaN equal to NaN.
pub fn same_bits(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x.is_nan() && y.is_nan()) || x.to_bits() == y.to_bits())
}

/// Run `kernel` over `grid` on `args`: the arguments after the run (stores update
/// tensors in place) and the op counts, or the interpreter's error.
pub fn run(kernel: &Kernel, args: &[Arg], grid: [usize; 3]) -> Result<(Vec<Arg>, Stats), String> {
    let mut args = args.to_vec();
    let stats = launch_with_stats(kernel, &mut args, grid).map_err(|e| e.to_string())?;
    Ok((args, stats))
}

/// Run `before` and `after` on `trials` sets of random arguments and assert they
/// leave every tensor identical (or fail alike). Returns the op counts of both over
/// all trials, for tests that also check a pass saves work.
pub fn assert_same_semantics(
    before: &Kernel,
    after: &Kernel,
    spec: &ArgSpec,
    grid: [usize; 3],
    trials: usize,
    seed: u64,
) -> (Stats, Stats) {
    let mut totals = (Stats::default(), Stats::default());
    for t in 0..trials {
        let s = seed.wrapping_add(t as u64);
        let mut rng = StdRng::seed_from_u64(s);
        let args = random_args(before, spec, &mut rng);
        match (run(before, &args, grid), run(after, &args, grid)) {
            (Ok((a, sa)), Ok((b, sb))) => {
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    if let (Arg::Tensor(x), Arg::Tensor(y)) = (x, y) {
                        assert!(
                            same_bits(&x.to_vec(), &y.to_vec()),
                            "kernel `{}`, seed {s}: tensor %{} differs after the pass\nbefore: {:?}\nafter:  {:?}",
                            before.name,
                            before.params[i].name,
                            x.to_vec(),
                            y.to_vec()
                        );
                    }
                }
                for (total, stats) in [(&mut totals.0, sa), (&mut totals.1, sb)] {
                    for (op, n) in stats.op_counts {
                        *total.op_counts.entry(op).or_insert(0) += n;
                    }
                }
            }
            (Err(a), Err(b)) => assert_eq!(a, b, "kernel `{}`, seed {s}: both runs fail, differently", before.name),
            (a, b) => panic!(
                "kernel `{}`, seed {s}: one run fails and the other does not: before {:?}, after {:?}",
                before.name,
                a.err(),
                b.err()
            ),
        }
    }
    totals
}

/// The kernels of `op`'s first plan for `variant` at the tiling `(block_m, block_n)` (each
/// role takes the tile axes it declares), after the pass pipeline, by role.
pub fn plan_kernels_at(
    op: &dyn ejc_ir::op::Operation,
    spec: &ejc_ir::spec::Spec,
    variant: &ejc_ir::spec::Variant,
    dtype: DType,
    keys: &ejc_ir::op::Keys,
    (bm, bn): (u32, u32),
) -> std::collections::BTreeMap<String, Kernel> {
    use ejc_ir::passes::{default_pipeline, run_pipeline};
    let plan = &op.plans(spec, &variant.features)[0];
    let mut out = std::collections::BTreeMap::new();
    for role in &plan.roles {
        let mut tile = ejc_ir::op::Config::new();
        for a in &role.tile_axes {
            tile.insert(a.to_string(), if *a == "block_m" { bm } else { bn });
        }
        let mut k =
            ejc_ir::op::KernelInstance { id: String::new(), variant, dtype, keys: keys.clone(), role: role.name, tile };
        k.id = op.kernel_id(&spec.name, &k);
        let built = op.build(spec, &k).unwrap_or_else(|e| panic!("{}: {e}", k.id));
        out.insert(role.name.to_string(), run_pipeline(&built, &default_pipeline()).unwrap());
    }
    out
}

/// The first output of a plan's call off the reference by more than the dtype's
/// tolerance (NaN counts as off), as a failure line headed by `what`.
pub fn worst_output(
    op: &dyn ejc_ir::op::Operation,
    features: &ejc_ir::op::Features,
    dtype: DType,
    got: &ejc_ir::op::HostCall,
    want: &std::collections::BTreeMap<String, ejc_ir::tensor::HostTensor>,
    what: &str,
) -> Option<String> {
    let tol = ejc_ir::op::tolerance(dtype);
    ejc_ir::op::compare_outputs(op, features, got, want)
        .into_iter()
        .find(|(_, rel, _)| rel.is_nan() || *rel > tol)
        .map(|(name, rel, abs)| format!("{what}: {name} rel {rel:.3e} (abs {abs:.3e}) > {tol:e}"))
}

/// Every variant of `spec`, f32 (16 × 32 tiles) and bf16 (32 × 16), on each of `op`'s
/// awkward calls (`check_dims`): its first plan on the interpreter after the pass pipeline
/// against the reference, within the dtype's tolerance; every failure listed.
pub fn every_variant_matches_the_reference(
    op: &dyn ejc_ir::op::Operation,
    spec: &ejc_ir::spec::Spec,
    keys: &ejc_ir::op::Keys,
) {
    use ejc_ir::op::{run_plan_interp, Config};
    use rayon::prelude::*;
    let seed = seed();
    let mut cases = Vec::new();
    for variant in &spec.variants {
        for (dtype, bm, bn) in [(DType::F32, 16u32, 32u32), (DType::BF16, 32, 16)] {
            for (i, dims) in op.check_dims(keys).into_iter().enumerate() {
                cases.push((variant, dtype, bm, bn, i, dims));
            }
        }
    }
    let failures: Vec<String> = cases
        .par_iter()
        .filter_map(|(variant, dtype, bm, bn, i, dims)| {
            let ks = plan_kernels_at(op, spec, variant, *dtype, keys, (*bm, *bn));
            let plan = &op.plans(spec, &variant.features)[0];
            let mut call = op.random_call(&variant.features, *dtype, dims, seed ^ (*i as u64 * 7919)).unwrap();
            let sizes = op.validate(&variant.features, *dtype, keys, &call).unwrap();
            let want = op.reference(&variant.features, &call).unwrap();
            let what = format!("{} {dtype} m{bm} n{bn} case {i} {dims:?}", variant.name);
            let tile = Config::from([("block_m".to_string(), *bm), ("block_n".to_string(), *bn)]);
            if let Err(e) = run_plan_interp(plan, &ks, &mut call, &sizes, &tile) {
                return Some(format!("{what}: {e}"));
            }
            worst_output(op, &variant.features, *dtype, &call, &want, &what)
        })
        .collect();
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}
