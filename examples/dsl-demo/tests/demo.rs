//! The demo crate's kernels, run from the library `build.rs` compiled, against plain
//! Rust written here. Inputs are fresh random numbers; the seed is printed
//! (`EJC_TEST_SEED` replays). Tolerances are DESIGN.md's (f32: ‖Δ‖/‖ref‖ ≤ 1e-5).

use ejc_dsl_demo::kernels::{alibi, causal_window, prefix_lm, scaled_matmul, softmax_rows};
use ejc_dsl_demo::library;
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::{reference_with_mods, Mods};
use ejc_ir::flash::Features;
use ejc_ir::flash::FlashShape;
use ejc_ir::ir::MaskTerm;
use ejc_ir::tensor::{compare, HostTensor};
use ejc_ir::types::DType;
use ejc_runtime::call::Call;
use ejc_runtime::cpu::HostBuffer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn seed() -> u64 {
    let s = std::env::var("EJC_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    println!("seed = {s} (EJC_TEST_SEED={s} replays)");
    s
}

fn random(rng: &mut StdRng, shape: &[usize]) -> HostTensor {
    let n = shape.iter().product();
    HostTensor::from_vec(DType::F32, shape, (0..n).map(|_| rng.random_range(-1.0f32..1.0) as f64).collect())
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert!(got.iter().all(|x| x.is_finite()), "{what}: non-finite output");
    let (rel, max_abs) = compare(got, want);
    assert!(rel <= 1e-5, "{what}: rel_err={rel:e} max_abs_err={max_abs:e}");
}

/// Plain Rust: alpha · a·b, then relu. `b` is read through `get`, so views work.
fn matmul_ref(a: &HostTensor, b: &HostTensor, alpha: f64, relu: bool) -> Vec<f64> {
    let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|p| a.get(&[i, p]) * b.get(&[p, j])).sum();
            let x = alpha * dot;
            out[i * n + j] = if relu { x.max(0.0) } else { x };
        }
    }
    out
}

#[test]
fn scaled_matmul_matches_plain_rust() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let kernel = library().kernel(scaled_matmul::NAME).unwrap();
    // Not multiples of the 32 x 32 x 16 tiles, one round shape, a single element.
    for &(m, k, n, transposed_b) in &[(37, 70, 45, false), (64, 32, 96, false), (100, 33, 7, true), (1, 1, 1, false)] {
        for relu in [false, true] {
            let a = random(&mut rng, &[m, k]);
            // A transposed view: b[p, j] lives at j·k + p.
            let b = if transposed_b {
                let base = random(&mut rng, &[n, k]);
                HostTensor::view(&base, &[k, n], &[1, k as isize], 0)
            } else {
                random(&mut rng, &[k, n])
            };
            let alpha = rng.random_range(0.25f32..2.0);
            let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[m, n], f64::NAN));
            let grid =
                [m.div_ceil(scaled_matmul::BM as usize) as i64, n.div_ceil(scaled_matmul::BN as usize) as i64, 1];
            scaled_matmul::launch(
                &kernel,
                grid,
                2,
                &HostBuffer::from_host(&a),
                &HostBuffer::from_host(&b),
                &mut out,
                alpha,
                relu,
            )
            .unwrap();
            let want = matmul_ref(&a, &b, alpha as f64, relu);
            assert_close(&out.to_host().to_vec(), &want, &format!("scaled_matmul {m}x{k}x{n} relu={relu} seed={seed}"));
        }
    }
}

#[test]
fn softmax_rows_matches_plain_rust() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let kernel = library().kernel(softmax_rows::NAME).unwrap();
    for &(r, c) in &[(13, 77), (8, 32), (3, 1), (21, 200)] {
        let mut x = random(&mut rng, &[r, c]);
        for v in x.data.iter_mut() {
            *v *= 8.0; // a wider range than [-1, 1): the max subtraction matters
        }
        let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[r, c], f64::NAN));
        let grid = [r.div_ceil(softmax_rows::BR as usize) as i64, 1, 1];
        softmax_rows::launch(&kernel, grid, 2, &HostBuffer::from_host(&x), &mut out).unwrap();
        let mut want = Vec::new();
        for i in 0..r {
            let row: Vec<f64> = (0..c).map(|j| x.get(&[i, j])).collect();
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
            want.extend(row.iter().map(|v| (v - m).exp() / s));
        }
        assert_close(&out.to_host().to_vec(), &want, &format!("softmax_rows {r}x{c} seed={seed}"));
    }
}

/// Plain attention in f64 with a mask function and a score function.
fn attention_ref(
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    scale: f64,
    mask: &dyn Fn(usize, usize, usize, usize) -> bool,
    score: &dyn Fn(f64, usize, usize, usize, usize) -> f64,
) -> Vec<f64> {
    let (b_n, sq, hq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (sk, hkv) = (k.shape[1], k.shape[2]);
    let mut out = vec![0.0; b_n * sq * hq * d];
    for b in 0..b_n {
        for h in 0..hq {
            let hk = h / (hq / hkv);
            for i in 0..sq {
                let s: Vec<f64> = (0..sk)
                    .map(|j| {
                        if !mask(b, h, i, j) {
                            return f64::NEG_INFINITY;
                        }
                        let dot: f64 = (0..d).map(|x| q.get(&[b, i, h, x]) * k.get(&[b, j, hk, x])).sum();
                        score(dot * scale, b, h, i, j)
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = p.iter().sum();
                for x in 0..d {
                    let o: f64 = (0..sk).map(|j| p[j] * v.get(&[b, j, hk, x])).sum();
                    out[((b * sq + i) * hq + h) * d + x] = o / l;
                }
            }
        }
    }
    out
}

#[test]
fn flash_with_prefix_lm_and_alibi_matches_plain_rust() {
    let seed = seed();
    let f = Features::default();
    // Lengths that are not multiples of the 32 x 32 blocks, GQA 4:2.
    for shape in ["2,77,77,4,2,64", "1,45,45,4,1,64"] {
        let shape = FlashShape::parse(shape).unwrap();
        let inputs = random_inputs(&f, DType::F32, &shape, seed);
        let rt = default_runtime(&f, &shape, seed);
        let mut call = Call::from_host(&ejc_ir::flash::op::host_call(&f, &rt, &inputs));
        library().run_flash("flash_prefix_lm_alibi", &mut call, 2).unwrap();
        let got = call.host_tensor("out").unwrap().to_vec();
        let want = attention_ref(
            &inputs.q,
            &inputs.k,
            &inputs.v,
            rt.softmax_scale,
            &|b, h, i, j| prefix_lm(b as i32, h as i32, i as i32, j as i32),
            &|s, b, h, i, j| alibi(s as f32, b as i32, h as i32, i as i32, j as i32) as f64,
        );
        assert_close(&got, &want, &format!("flash + prefix_lm + alibi shape={shape} seed={seed}"));
    }
}

#[test]
fn flash_with_affine_mask_mod_matches_the_reference() {
    let seed = seed();
    // The mod is a conjunction of affine comparisons: it became mask terms.
    assert_eq!(causal_window::MOD.affine, Some(&[(MaskTerm::ColLeRow, 0), (MaskTerm::ColGeRow, -39)][..]));
    assert_eq!(prefix_lm::MOD.affine, None);
    let f = Features::default();
    let shape = FlashShape::parse("2,150,150,4,2,64").unwrap();
    let inputs = random_inputs(&f, DType::F32, &shape, seed);
    let rt = default_runtime(&f, &shape, seed);
    let mut call = Call::from_host(&ejc_ir::flash::op::host_call(&f, &rt, &inputs));
    library().run_flash("flash_causal_window", &mut call, 2).unwrap();
    let mask = |b: i64, h: i64, i: i64, j: i64| causal_window(b as i32, h as i32, i as i32, j as i32);
    let want = reference_with_mods(&f, &rt, &inputs, &Mods { mask: Some(&mask), score: None }).unwrap();
    let (out, lse) = (call.host_tensor("out").unwrap(), call.host_tensor("lse").unwrap());
    assert_close(&out.to_vec(), &want.out.to_vec(), &format!("flash + causal_window out seed={seed}"));
    assert_close(&lse.to_vec(), &want.lse.to_vec(), &format!("flash + causal_window lse seed={seed}"));
}

#[test]
fn launch_checks_its_arguments() {
    let kernel = library().kernel(softmax_rows::NAME).unwrap();
    let x = HostBuffer::from_host(&HostTensor::full(DType::BF16, &[4, 4], 1.0));
    let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[4, 4], 0.0));
    let e = softmax_rows::launch(&kernel, [1, 1, 1], 1, &x, &mut out).unwrap_err().to_string();
    assert!(e.contains("`softmax_rows`: `x` must be a f32 tensor of rank 2, got bf16"), "{e}");
    let x = HostBuffer::from_host(&HostTensor::full(DType::F32, &[16], 1.0));
    let e = softmax_rows::launch(&kernel, [1, 1, 1], 1, &x, &mut out).unwrap_err().to_string();
    assert!(e.contains("rank 2"), "{e}");
    let e = library().kernel("nope").unwrap_err().to_string();
    assert!(e.contains("no kernel `nope`") && e.contains("scaled_matmul"), "{e}");
}

#[test]
fn everything_is_registered_and_built() {
    let mut names: Vec<&str> = ejc_ir::dsl::registered().iter().map(|r| r.name()).collect();
    names.sort();
    assert_eq!(names, ["alibi", "causal_window", "prefix_lm", "scaled_matmul", "softmax_rows"]);
    assert_eq!(
        library().names(),
        ["flash_causal_window", "flash_prefix_lm_alibi", "scaled_matmul", "softmax_rows"].map(String::from)
    );
    let info = library().flash_info("flash_prefix_lm_alibi").unwrap();
    assert_eq!((info.mask_mod.as_deref(), info.score_mod.as_deref()), (Some("prefix_lm"), Some("alibi")));
}
