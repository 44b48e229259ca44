//! The demo crate's kernels, run from the library `build.rs` compiled, against plain
//! Rust written here. Inputs are fresh random numbers; the seed is printed
//! (`EJC_TEST_SEED` replays). Tolerances are DESIGN.md's (f32: ‖Δ‖/‖ref‖ ≤ 1e-5).

use ejc_dsl_demo::kernels::{alibi, causal_window, matmul_bf16, matmul_f16, prefix_lm, scaled_matmul, softmax_rows};
use ejc_dsl_demo::library;
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::{reference_with_mods, Mods};
use ejc_ir::flash::Features;
use ejc_ir::flash::FlashShape;
use ejc_ir::ir::MaskTerm;
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;
use ejc_runtime::call::Call;
use ejc_runtime::cpu::HostBuffer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::*;

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
fn the_generic_matmul_matches_plain_rust_in_both_types() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (name, dt) in [(matmul_bf16::NAME, DType::BF16), (matmul_f16::NAME, DType::F16)] {
        let kernel = library().kernel(name).unwrap();
        for &(m, k, n) in &[(70, 45, 93), (128, 64, 128), (1, 3, 130)] {
            let (a, b) = (random_16(&mut rng, dt, &[m, k]), random_16(&mut rng, dt, &[k, n]));
            let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[m, n], f64::NAN));
            let grid = [m.div_ceil(matmul_bf16::BM as usize) as i64, n.div_ceil(matmul_bf16::BN as usize) as i64, 1];
            let (a_, b_) = (HostBuffer::from_host(&a), HostBuffer::from_host(&b));
            match dt {
                DType::BF16 => matmul_bf16::launch(&kernel, grid, 2, &a_, &b_, &mut out),
                _ => matmul_f16::launch(&kernel, grid, 2, &a_, &b_, &mut out),
            }
            .unwrap();
            let want = matmul_ref(&a, &b, 1.0, false);
            assert_close(&out.to_host().to_vec(), &want, &format!("{name} {m}x{k}x{n} seed={seed}"));
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
        let want = softmax_ref(&x);
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

/// Where the GPU half cannot run, it says why instead of failing somewhere later:
/// without ejc-runtime's `cuda` feature, how to turn it on; with it but no driver (a
/// workspace build turns the feature on for every crate), that there is no driver.
#[test]
fn the_gpu_launch_says_why_it_cannot_run() {
    match ejc_runtime::dsl::Gpu::new() {
        Ok(gpu) => println!("a GPU here: {}", gpu.name()),
        Err(e) => {
            let e = e.to_string();
            let why = if ejc_runtime::dsl::CUDA_BUILT_IN { "no CUDA driver" } else { "without its `cuda` feature" };
            assert!(e.contains(why), "{e}");
        }
    }
}

#[test]
fn everything_is_registered_and_built() {
    let mut names: Vec<&str> = ejc_ir::dsl::registered().iter().map(|r| r.name()).collect();
    names.sort();
    assert_eq!(
        names,
        ["alibi", "causal_window", "matmul_bf16", "matmul_f16", "prefix_lm", "scaled_matmul", "softmax_rows"]
    );
    assert_eq!(
        library().names(),
        ["flash_causal_window", "flash_prefix_lm_alibi", "matmul_bf16", "matmul_f16", "scaled_matmul", "softmax_rows"]
            .map(String::from)
    );
    // The kernels also for the GPU (build.rs asks for sm_80 and sm_90a), the flash
    // kernels with mods only for the CPU; every PTX file passes ptxas where it is here.
    let dir = std::path::PathBuf::from(env!("EJC_DEMO_DIR"));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let mut ptx: Vec<(String, String, String)> = manifest["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["target"].as_str().unwrap().starts_with("ptx:"))
        .map(|a| {
            let s = |k: &str| a[k].as_str().unwrap().to_string();
            (s("kernel_id"), s("target"), s("file"))
        })
        .collect();
    ptx.sort();
    let want: Vec<(String, String)> = ["matmul_bf16", "matmul_f16", "scaled_matmul", "softmax_rows"]
        .iter()
        .flat_map(|k| ["ptx:sm_80", "ptx:sm_90a"].map(|t| (k.to_string(), t.to_string())))
        .collect();
    assert_eq!(ptx.iter().map(|(k, t, _)| (k.clone(), t.clone())).collect::<Vec<_>>(), want);
    match ejc_codegen::ptx::find_ptxas() {
        Some(tool) => {
            for (k, t, file) in &ptx {
                let arch: ejc_codegen::ptx::Arch = t.trim_start_matches("ptx:").parse().unwrap();
                let text = std::fs::read_to_string(dir.join(file)).unwrap();
                let r = ejc_codegen::ptx::ptxas(&tool, &text, arch).unwrap_or_else(|e| panic!("{k} {t}: {e}"));
                assert_eq!(r.spill_stores + r.spill_loads, 0, "{k} {t} spills: {r:?}");
            }
        }
        None => eprintln!("skipped ptxas on the demo's PTX: no ptxas (run scripts/setup.sh or set EJC_PTXAS)"),
    }
    let info = library().flash_info("flash_prefix_lm_alibi").unwrap();
    assert_eq!((info.mask_mod.as_deref(), info.score_mod.as_deref()), (Some("prefix_lm"), Some("alibi")));
}
