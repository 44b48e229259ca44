//! `#[ej_kernel]` end to end, without a back end: the IR a kernel builds (snapshot),
//! errors the builder finds at run time (with the DSL expression's location), the
//! affine analysis of mask mods (checked element by element against the function
//! itself), and mods in a flash kernel on the interpreter against the reference
//! (seed printed; `EJC_TEST_SEED` replays).

use ejc_ir::dsl::*;
use ejc_ir::flash::abi::run_interp_with_stats;
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::{reference_with_mods, Mods};
use ejc_ir::flash::Features;
use ejc_ir::flash::{build_flash_kernel_with, FlashHooks, FlashShape};
use ejc_ir::interp::mask_holds;
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::print::print_kernel;
use ejc_ir::tensor::compare;
use ejc_ir::types::DType;
use ejc_macros::ej_kernel;

macro_rules! snap {
    ($name:expr, $text:expr) => {
        insta::with_settings!({snapshot_path => concat!(env!("CARGO_MANIFEST_DIR"), "/../snapshots"), prepend_module_to_snapshot => false}, {
            insta::assert_snapshot!($name, $text);
        })
    };
}

/// A mask mod as the host function it also is.
type MaskFn = fn(i32, i32, i32, i32) -> bool;
/// A score mod as the host function it also is.
type ScoreFn = fn(f32, i32, i32, i32, i32) -> f32;

fn seed() -> u64 {
    let s = std::env::var("EJC_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    println!("seed = {s} (EJC_TEST_SEED={s} replays)");
    s
}

/// Row sums of `x` (`[R, C]`, C in blocks), scaled, with a loop-carried accumulator
/// and an `if` on a scalar parameter.
#[ej_kernel(block_r = 16, block_c = 32)]
pub fn row_sums(x: Tensor<Bf16, 2>, out: Tensor<f32, 1>, scale: f32, absolute: bool) {
    let r0 = program_id(0) * BLOCK_R;
    let rows = dim(x, 0);
    let cols = dim(x, 1);
    let mut acc = full1(BLOCK_R, 0.0);
    for c0 in range(0, cols, BLOCK_C) {
        let t = load(x, [span(r0, BLOCK_R, rows), span(c0, BLOCK_C, cols)]).cast::<f32>();
        let t = if absolute { abs(t) } else { t };
        acc = acc + sum(t, 1);
    }
    store(out, [span(r0, BLOCK_R, rows)], acc * scale);
}

#[test]
fn a_kernel_builds_its_ir() {
    let k = row_sums::kernel().unwrap();
    assert_eq!((row_sums::NAME, row_sums::BLOCK_R, row_sums::BLOCK_C), ("row_sums", 16, 32));
    snap!("ej_kernel__row_sums_ir", print_kernel(&k));
    // It survives the pass pipeline (what back ends compile).
    run_pipeline(&k, &default_pipeline()).unwrap();
}

/// Tiles of different shapes added: rustc cannot see it (shapes are values), the
/// builder can, and says where.
#[ej_kernel]
pub fn shape_mismatch(out: Tensor<f32, 2>) {
    let a = full([16, 8], 1.0);
    let b = full([8, 16], 1.0);
    store(out, [span(0, 16, 16), span(0, 8, 8)], a + b);
}

/// A store under an `if` on a tile condition (rustc cannot see it: `n` could be
/// anything; here it is a tile).
#[ej_kernel]
pub fn store_under_tile_condition(out: Tensor<f32, 1>) {
    let n = arange(8);
    let big = n.gt(3);
    let v = select(big, full1(8, 1.0), full1(8, 0.0));
    store(out, [span(0, 8, 8)], v);
}

#[test]
fn build_errors_name_the_dsl_expression() {
    let e = shape_mismatch::kernel().unwrap_err();
    let here = file!();
    assert_eq!(e.kernel, "shape_mismatch");
    assert!(e.location.starts_with(here), "{e}");
    // At the `+` of `a + b`.
    let src = include_str!("kernels.rs");
    let line = src.lines().position(|l| l.ends_with("a + b);")).unwrap() + 1;
    let col = src.lines().nth(line - 1).unwrap().find("a + b").unwrap() + 1;
    assert_eq!(e.location, format!("{here}:{line}:{col}"), "{e}");
    assert!(e.message.contains("do not broadcast"), "{e}");
    store_under_tile_condition::kernel().unwrap();
}

#[ej_kernel(mask_mod)]
pub fn causal(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
    kv_idx <= q_idx
}

#[ej_kernel(mask_mod, window = 5)]
pub fn window(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
    q_idx - kv_idx < WINDOW && kv_idx - q_idx <= 2 * WINDOW - 3
}

#[ej_kernel(mask_mod, keys = 9)]
pub fn first_keys(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
    kv_idx < KEYS && q_idx >= kv_idx - 1 && true
}

#[ej_kernel(mask_mod)]
pub fn strided(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
    2 * kv_idx <= q_idx + 3
}

#[ej_kernel(mask_mod)]
pub fn per_head(_b: i32, h: i32, q_idx: i32, kv_idx: i32) -> bool {
    kv_idx <= q_idx + h
}

#[ej_kernel(mask_mod, prefix = 6)]
pub fn prefix(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
    kv_idx <= q_idx || kv_idx < PREFIX
}

/// Causal and a checkerboard: the causal conjunct is affine (blocks above the diagonal
/// are skipped), the other is applied per element on the blocks visited.
#[ej_kernel(mask_mod)]
pub fn causal_checker(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
    kv_idx <= q_idx && (q_idx + kv_idx) % 3 != 0
}

#[ej_kernel(mask_mod)]
pub fn checker(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
    let d = q_idx - kv_idx;
    d - d / 2 * 2 == 0
}

#[test]
fn affine_mask_mods_become_exact_mask_terms() {
    let affine: [(MaskMod, MaskFn); 3] = [(causal::MOD, causal), (window::MOD, window), (first_keys::MOD, first_keys)];
    for (m, f) in affine {
        let terms = m.affine.unwrap_or_else(|| panic!("{} should be affine", m.name));
        let (kinds, xs): (Vec<_>, Vec<_>) = terms.iter().copied().unzip();
        for i in 0..40 {
            for j in 0..40 {
                assert_eq!(mask_holds(&kinds, &xs, i, j), f(0, 0, i as i32, j as i32), "{} at ({i}, {j})", m.name);
            }
        }
    }
    // Not analysable: a coefficient of 2, a head-dependent offset, a disjunction, a body
    // with statements. These are applied per element.
    for m in [strided::MOD, per_head::MOD, prefix::MOD, checker::MOD] {
        assert!(m.affine.is_none(), "{}", m.name);
    }
    for m in [causal::MOD, window::MOD, first_keys::MOD] {
        assert!(m.exact, "{}", m.name);
    }
    // A conjunction with an affine part: that part becomes terms, the mod stays per element.
    let m = causal_checker::MOD;
    assert_eq!((m.affine, m.exact), (Some(&[(ejc_ir::ir::MaskTerm::ColLeRow, 0)][..]), false));
}

#[ej_kernel(score_mod, heads = 4)]
pub fn alibi(score: f32, _b: i32, h: i32, q_idx: i32, kv_idx: i32) -> f32 {
    let slope = exp2(-8.0 * (h + 1) as f32 / HEADS as f32);
    score - slope * (q_idx - kv_idx) as f32
}

/// A soft cap with a bonus on the diagonal: an `if` expression and an `if`
/// statement on tile conditions (element-wise selects in the kernel).
#[ej_kernel(score_mod)]
pub fn tanh_cap(score: f32, _b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> f32 {
    let mut capped = 5.0 * tanh(score / 5.0);
    if kv_idx > q_idx + 3 {
        capped = capped - 0.5;
    }
    if q_idx == kv_idx {
        capped + 1.0
    } else {
        capped
    }
}

/// Run a flash kernel with hooks on the interpreter; compare with the reference
/// calling the mods as plain Rust; return how many `tile.dot` ran.
fn run(mask: Option<(MaskMod, MaskFn)>, score: Option<(ScoreMod, ScoreFn)>, seed: u64) -> u64 {
    let f = Features::default();
    let hooks = FlashHooks { mask_mod: mask.map(|m| m.0), score_mod: score.map(|s| s.0) };
    let k = build_flash_kernel_with("hooked", &f, DType::F32, 16, 8, 8, &hooks).unwrap();
    let k = run_pipeline(&k, &default_pipeline()).unwrap();
    let shape = FlashShape::parse("2,37,37,4,2,16").unwrap();
    let inputs = random_inputs(&f, DType::F32, &shape, seed);
    let rt = default_runtime(&f, &shape, seed);
    let (got, stats) = run_interp_with_stats(&k, &rt, &inputs).unwrap();
    let mf = mask.map(|m| m.1);
    let sf = score.map(|s| s.1);
    let mask_fn = move |b: i64, h: i64, i: i64, j: i64| mf.is_none_or(|f| f(b as i32, h as i32, i as i32, j as i32));
    let score_fn = move |s: f64, b: i64, h: i64, i: i64, j: i64| match sf {
        Some(f) => f(s as f32, b as i32, h as i32, i as i32, j as i32) as f64,
        None => s,
    };
    let want = reference_with_mods(&f, &rt, &inputs, &Mods { mask: Some(&mask_fn), score: Some(&score_fn) }).unwrap();
    for (what, g, w) in [("out", &got.out, &want.out), ("lse", &got.lse, &want.lse)] {
        let (rel, _) = compare(&g.to_vec(), &w.to_vec());
        assert!(rel <= 1e-5, "{what}: rel_err={rel:e} (mask {:?}, seed {seed})", hooks.mask_mod);
    }
    stats.count("tile.dot")
}

#[test]
fn mods_in_a_flash_kernel_match_the_reference_and_affine_ones_skip_blocks() {
    let seed = seed();
    let dense = run(None, None, seed);
    let window_affine = run(Some((window::MOD, window)), None, seed);
    // The same predicate, declared non-affine: applied on every block.
    let opaque = MaskMod { affine: None, ..window::MOD };
    let window_opaque = run(Some((opaque, window)), None, seed);
    assert_eq!(window_opaque, dense, "a non-affine mod computes every block");
    // The band covers about half of the 8 x 8 blocks of a 37 x 37 score matrix.
    assert!(window_affine * 5 < dense * 3, "affine window: {window_affine} dots, dense: {dense}");
    run(Some((prefix::MOD, prefix)), Some((alibi::MOD, alibi)), seed);
    run(Some((checker::MOD, checker)), Some((tanh_cap::MOD, tanh_cap)), seed);
    run(Some((causal::MOD, causal)), Some((tanh_cap::MOD, tanh_cap)), seed);
    // The causal conjunct skips the blocks above the diagonal; the rest is still applied.
    let causal_only = run(Some((causal::MOD, causal)), None, seed);
    let partly = run(Some((causal_checker::MOD, causal_checker)), None, seed);
    assert_eq!(partly, causal_only, "causal && checker visits the causal blocks");
    let whole = run(Some((MaskMod { affine: None, ..causal_checker::MOD }, causal_checker)), None, seed);
    assert_eq!(whole, dense);
    assert!(partly * 3 < dense * 2, "causal && checker: {partly} dots, dense: {dense}");
}

/// The natural operators (issue 18): `+=` on a tile, `<` / `>=` between tiles and
/// scalars, numpy's rank promotion (`[B, C] * [C]`), an i32 tensor padded with an i32
/// literal, and a trailing `if` that only stores.
#[ej_kernel(b = 16, c = 32)]
pub fn natural_ops(x: Tensor<f32, 2>, w: Tensor<f32, 1>, ids: Tensor<i32, 1>, out: Tensor<f32, 2>, lim: f32) {
    let r0 = program_id(0) * B;
    let rows = dim(x, 0);
    let cols = dim(x, 1);
    let mut acc = full([B, C], 1.0);
    let t = load(x, [span(r0, B, rows), span(0, C, cols)]);
    acc += t;
    acc *= 2.0;
    let wv = load(w, [span(0, C, cols)]);
    let id = load_pad(ids, [span(0, C, cols)], -1);
    let y = acc * wv;
    let keep = (id >= 0) & (wv < lim) & (y > t);
    let y = select(keep, y, full([B, C], 0.0));
    if rows > 0 {
        store(out, [span(r0, B, rows), span(0, C, cols)], y);
    }
}

#[test]
fn natural_operators_broadcast_and_compare_like_numpy() {
    use ejc_ir::interp::{launch, Arg};
    use ejc_ir::tensor::HostTensor;
    use rand::{Rng, SeedableRng};
    let seed = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let k = natural_ops::kernel().unwrap();
    let text = print_kernel(&k);
    assert!(text.contains("tile.expand_dims"), "the rank-1 tiles are promoted: {text}");
    // 37 rows (3 programs, the last partial), 29 columns (the tile's 32 padded).
    let (r, c) = (37usize, 29usize);
    let x: Vec<f64> = (0..r * c).map(|_| rng.random_range(-1.0f32..1.0) as f64).collect();
    let w: Vec<f64> = (0..c).map(|_| rng.random_range(-1.0f32..1.0) as f64).collect();
    // ids: some negative (hidden), and the padded columns read -1.
    let ids: Vec<f64> = (0..c).map(|_| rng.random_range(-3i32..5) as f64).collect();
    let lim = 0.4f64;
    let mut args = vec![
        Arg::Tensor(HostTensor::from_vec(DType::F32, &[r, c], x.clone())),
        Arg::Tensor(HostTensor::from_vec(DType::F32, &[c], w.clone())),
        Arg::Tensor(HostTensor::from_vec(DType::I32, &[c], ids.clone())),
        Arg::Tensor(HostTensor::full(DType::F32, &[r, c], f64::NAN)),
        Arg::Scalar(lim),
    ];
    launch(&k, &mut args, [r.div_ceil(16), 1, 1]).unwrap();
    let got = args[3].tensor().unwrap().to_vec();
    let want: Vec<f64> = (0..r * c)
        .map(|e| {
            let (i, j) = (e / c, e % c);
            let t = x[i * c + j] as f32;
            let y = (1.0 + t) * 2.0 * w[j] as f32;
            let keep = ids[j] >= 0.0 && (w[j] as f32) < lim as f32 && y > t;
            if keep {
                y as f64
            } else {
                0.0
            }
        })
        .collect();
    let (rel, max_abs) = compare(&got, &want);
    assert!(rel <= 1e-6, "natural_ops seed={seed}: rel {rel:e}, max abs {max_abs:e}");
}

/// A helper generic over the element type.
#[ej_kernel(helper)]
pub fn square<T: Elem>(x: Tile<T>) -> Tile<T> {
    x * x
}

/// `x / sqrt(mean(x²) + eps)` along rows.
#[ej_kernel(helper)]
pub fn rms_norm_rows(x: Tile<f32>, eps: f32, cols: i32) -> Tile<f32> {
    let ms = sum(square(x), 1) / (cols as f32);
    x / sqrt(ms + eps).expand(1)
}

/// A helper that loads through a tensor and calls another helper.
#[ej_kernel(helper, c = 32)]
pub fn load_normed(x: Tensor<f32, 2>, r0: i32, rows: i32, cols: i32, eps: f32) -> Tile<f32> {
    let t = load(x, [span(r0, 16, rows), span(0, C, cols)]);
    rms_norm_rows(t, eps, cols)
}

/// RMSNorm of rows of up to 32 columns, through two helpers.
#[ej_kernel(b = 16, c = 32)]
pub fn rms_norm(x: Tensor<f32, 2>, out: Tensor<f32, 2>, eps: f32) {
    let r0 = program_id(0) * B;
    let rows = dim(x, 0);
    let cols = dim(x, 1);
    let y = load_normed(x, r0, rows, cols, eps);
    store(out, [span(r0, B, rows), span(0, C, cols)], y);
}

#[test]
fn helpers_are_inlined_and_match_plain_rust() {
    use ejc_ir::interp::{launch, Arg};
    use ejc_ir::tensor::HostTensor;
    use rand::{Rng, SeedableRng};
    let seed = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let k = rms_norm::kernel().unwrap();
    let (r, c) = (41usize, 27usize);
    let x: Vec<f64> = (0..r * c).map(|_| rng.random_range(-2.0f32..2.0) as f64).collect();
    let eps = 1e-3;
    let mut args = vec![
        Arg::Tensor(HostTensor::from_vec(DType::F32, &[r, c], x.clone())),
        Arg::Tensor(HostTensor::full(DType::F32, &[r, c], f64::NAN)),
        Arg::Scalar(eps),
    ];
    launch(&k, &mut args, [r.div_ceil(16), 1, 1]).unwrap();
    let got = args[1].tensor().unwrap().to_vec();
    let want: Vec<f64> = (0..r)
        .flat_map(|i| {
            let row = &x[i * c..(i + 1) * c];
            let ms = row.iter().map(|v| v * v).sum::<f64>() / c as f64;
            row.iter().map(move |v| v / (ms + eps).sqrt()).collect::<Vec<_>>()
        })
        .collect();
    let (rel, max_abs) = compare(&got, &want);
    assert!(rel <= 1e-5, "rms_norm seed={seed}: rel {rel:e}, max abs {max_abs:e}");
}

/// One kernel body, two element types: `row_scale_f32` and `row_scale_bf16`, each
/// `out = x · s` with `x` read as its type and computed in f32 (the cast names `T` too).
#[ej_kernel(b = 16, c = 32, dtypes(T = [f32, Bf16]))]
pub fn row_scale<T: Elem>(x: Tensor<T, 2>, out: Tensor<f32, 2>, s: f32) {
    let r0 = program_id(0) * B;
    let rows = dim(x, 0);
    let cols = dim(x, 1);
    let t = load(x, [span(r0, B, rows), span(0, C, cols)]).cast::<f32>();
    store(out, [span(r0, B, rows), span(0, C, cols)], t * s);
}

#[test]
fn a_generic_kernel_is_one_kernel_per_listed_type() {
    use ejc_ir::interp::{launch, Arg};
    use ejc_ir::tensor::HostTensor;
    use rand::{Rng, SeedableRng};
    let seed = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    assert_eq!((row_scale_f32::NAME, row_scale_bf16::NAME), ("row_scale_f32", "row_scale_bf16"));
    let (r, c) = (21usize, 30usize);
    let x: Vec<f64> = (0..r * c).map(|_| rng.random_range(-2.0f32..2.0) as f64).collect();
    for (k, dt) in [(row_scale_f32::kernel().unwrap(), DType::F32), (row_scale_bf16::kernel().unwrap(), DType::BF16)] {
        let xt = HostTensor::from_vec(dt, &[r, c], x.clone());
        let want: Vec<f64> = xt.to_vec().iter().map(|v| (*v as f32 * 1.5f32) as f64).collect();
        let mut args =
            vec![Arg::Tensor(xt), Arg::Tensor(HostTensor::full(DType::F32, &[r, c], f64::NAN)), Arg::Scalar(1.5)];
        launch(&k, &mut args, [r.div_ceil(16), 1, 1]).unwrap();
        let (rel, _) = compare(&args[1].tensor().unwrap().to_vec(), &want);
        assert!(rel <= 1e-6, "{} seed={seed}: rel {rel:e}", k.name);
        // The parameter really has the instance's type.
        assert!(print_kernel(&k).contains(&format!("%x: tensor<?x?x{dt}>")), "{}", print_kernel(&k));
    }
    let names: Vec<&str> = registered().iter().map(|r| r.name()).collect();
    assert!(names.contains(&"row_scale_f32") && names.contains(&"row_scale_bf16"), "{names:?}");
}
