//! The demo crate's kernels, run from the library `build.rs` compiled, against plain
//! Rust written here. Inputs are fresh random numbers; the seed is printed
//! (`EJC_TEST_SEED` replays). Tolerances are DESIGN.md's (f32: ‖Δ‖/‖ref‖ ≤ 1e-5).

use ejc_dsl_demo::kernels::{
    accumulate, accumulate_config, alibi, alibi_slopes, causal_window, document_causal, matmul_bf16,
    matmul_bf16_config, matmul_f16, prefix_lm, rms_norm_bf16, rms_norm_bf16_config, rms_norm_f32, rms_norm_f32_config,
    scaled_matmul, softmax_bf16, softmax_f32,
};
use ejc_dsl_demo::library;
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::{reference_with_mods, Mods};
use ejc_ir::flash::Features;
use ejc_ir::flash::FlashShape;
use ejc_ir::interp::Arg;
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
fn softmax_matches_plain_rust_in_both_types() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let kernel = library().kernel(softmax_f32::NAME).unwrap();
    for &(r, c) in &[(13, 77), (8, 32), (3, 1), (21, 200)] {
        let mut x = random(&mut rng, &[r, c]);
        for v in x.data.iter_mut() {
            *v *= 8.0; // a wider range than [-1, 1): the max subtraction matters
        }
        let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[r, c], f64::NAN));
        let grid = [r.div_ceil(softmax_f32::BR as usize) as i64, 1, 1];
        softmax_f32::launch(&kernel, grid, 2, &HostBuffer::from_host(&x), &mut out).unwrap();
        let want = softmax_ref(&x);
        assert_close(&out.to_host().to_vec(), &want, &format!("softmax_f32 {r}x{c} seed={seed}"));

        // The same body in bf16: the reference reads the rounded input; the output's
        // rounding (2^-9 relative) bounds the error.
        let xb = HostTensor::from_vec(DType::BF16, &x.shape, x.to_vec());
        let mut out = HostBuffer::from_host(&HostTensor::full(DType::BF16, &[r, c], f64::NAN));
        let k16 = library().kernel(softmax_bf16::NAME).unwrap();
        softmax_bf16::launch(&k16, grid, 2, &HostBuffer::from_host(&xb), &mut out).unwrap();
        let (rel, _) = ejc_ir::tensor::compare(&out.to_host().to_vec(), &softmax_ref(&xb));
        assert!(rel <= 4e-3, "softmax_bf16 {r}x{c}: rel_err={rel:e} seed={seed}");
    }
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

/// `flash_document_slopes`'s IR as build.rs compiles it (f32, d 64, 32 x 32), after the
/// pass pipeline.
fn flash_document_slopes_ir() -> ejc_ir::ir::Kernel {
    let hooks = ejc_ir::flash::FlashHooks { mask_mod: Some(document_causal::MOD), score_mod: Some(alibi_slopes::MOD) };
    let k =
        ejc_ir::flash::build_flash_kernel_with("doc", &Features::default(), DType::F32, 64, 32, 32, &hooks).unwrap();
    ejc_ir::passes::run_pipeline(&k, &ejc_ir::passes::default_pipeline()).unwrap()
}

/// Run a flash kernel's IR compiled by MLIR for this CPU on `call` (the runtime's host
/// plan binds the call's tensors by name, the mods' ones included).
fn run_through_mlir(ir: &ejc_ir::ir::Kernel, f: &Features, call: &mut Call) {
    use ejc_ir::op::Operation;
    let kernel = ejc_codegen::mlir::exec::CpuKernel::compile(ir).unwrap();
    let op = &ejc_ir::flash::op::FlashAttentionFwd;
    let keys = std::collections::BTreeMap::from([("head_dim".to_string(), 64u32)]);
    let sizes = op.validate(&f.to_json(), DType::F32, &keys, call).unwrap();
    let spec = ejc_runtime::exec::HostLaunchSpec {
        kernel: &kernel,
        params: ejc_ir::op::ParamSig::of_kernel(ir),
        grid: ir.grid.clone(),
        launch: ejc_ir::manifest::Launch::of("main"),
    };
    let mut plan = ejc_runtime::exec::HostPlan::new(&[spec], &[], call, &sizes, &Default::default()).unwrap();
    plan.run(call, 2).unwrap();
}

#[test]
fn flash_with_mods_reading_tensors_matches_the_reference() {
    // FlexAttention's document mask, `doc[[b, q_idx]] == doc[[b, kv_idx]]` (and causal),
    // with ALiBi slopes read per head: the mods read tensors the call passes as `doc` and
    // `slopes`; the reference runs the same functions on the host.
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let f = Features::default();
    for shape in ["2,77,77,4,2,64", "1,150,150,2,1,64"] {
        let DocumentCall { shape, inputs, rt, host, doc, slopes } = document_call(&mut rng, shape, 40, seed);
        let (b, s, h) = (shape.batch, shape.seq_q, shape.heads_q);
        let mut call = Call::from_host(&host);
        library().run_flash("flash_document_slopes", &mut call, 2).unwrap();
        let docs = ejc_ir::dsl::TensorView::new(&doc, [b, s]);
        let sl = ejc_ir::dsl::TensorView::new(&slopes, [h]);
        let mask = |b: i64, h: i64, i: i64, j: i64| document_causal(b as i32, h as i32, i as i32, j as i32, docs);
        let score = |x: f64, b: i64, h: i64, i: i64, j: i64| {
            alibi_slopes(x as f32, b as i32, h as i32, i as i32, j as i32, sl) as f64
        };
        let want = reference_with_mods(&f, &rt, &inputs, &Mods { mask: Some(&mask), score: Some(&score) }).unwrap();
        // The same kernel's IR on the interpreter and through MLIR to this CPU.
        let ir = flash_document_slopes_ir();
        let extra = [
            ("doc", Arg::Tensor(host.tensors["doc"].clone())),
            ("slopes", Arg::Tensor(host.tensors["slopes"].clone())),
        ];
        let (interp, _) = ejc_ir::flash::abi::run_interp_with_args(&ir, &rt, &inputs, &extra).unwrap();
        let mut mlir_call = Call::from_host(&host);
        run_through_mlir(&ir, &f, &mut mlir_call);
        for (what, got) in [("interp", interp.out.to_vec()), ("mlir", mlir_call.host_tensor("out").unwrap().to_vec())] {
            assert_close(
                &got,
                &want.out.to_vec(),
                &format!("{what} flash + document_causal + alibi_slopes {shape} seed={seed}"),
            );
        }
        let (out, lse) = (call.host_tensor("out").unwrap(), call.host_tensor("lse").unwrap());
        assert_close(
            &out.to_vec(),
            &want.out.to_vec(),
            &format!("flash + document_causal + alibi_slopes out {shape} seed={seed}"),
        );
        assert_close(
            &lse.to_vec(),
            &want.lse.to_vec(),
            &format!("flash + document_causal + alibi_slopes lse {shape} seed={seed}"),
        );
    }
    // A call without the tensors, or with them too short, is refused with what is needed.
    let shape = FlashShape::parse("1,50,50,2,1,64").unwrap();
    let inputs = random_inputs(&f, DType::F32, &shape, seed);
    let rt = default_runtime(&f, &shape, seed);
    let mut host = ejc_ir::flash::op::host_call(&f, &rt, &inputs);
    let run = |host: &ejc_ir::op::HostCall| {
        library().run_flash("flash_document_slopes", &mut Call::from_host(host), 1).unwrap_err().to_string()
    };
    let e = run(&host);
    assert!(e.contains("mods read a tensor `doc` (i32, [b, q_idx|kv_idx]), which the call does not provide"), "{e}");
    host.tensors.insert("doc".into(), HostTensor::full(DType::I32, &[1, 49], 0.0));
    host.tensors.insert("slopes".into(), HostTensor::full(DType::F32, &[2], 0.5));
    let e = run(&host);
    assert!(
        e.contains(
            "`doc` has shape [1, 49]; `flash_document_slopes`'s mods index its axis 1 by `q_idx`, which runs to 50"
        ),
        "{e}"
    );
    host.tensors.insert("doc".into(), HostTensor::full(DType::F32, &[1, 50], 0.0));
    let e = run(&host);
    assert!(
        e.contains("argument `doc` (read by `flash_document_slopes`'s mods) must be a i32 tensor of rank 2"),
        "{e}"
    );
    // The causal conjunct is affine: the kernel skips the blocks above the diagonal and
    // applies the document test per element on the others.
    assert_eq!(document_causal::MOD.affine, Some(&[(MaskTerm::ColLeRow, 0)][..]));
    // The mods' reads, as the runtime checks them.
    let t = document_causal::MOD.tensors;
    assert_eq!((t.len(), t[0].name, t[0].dtype, t[0].rank), (1, "doc", DType::I32, 2));
    use ejc_ir::dsl::ModRole::*;
    assert_eq!(t[0].axes, &[&[Batch][..], &[Query, Key][..]]);
    assert_eq!(alibi_slopes::MOD.tensors[0].axes, &[&[Head][..]]);
}

#[test]
fn launch_checks_its_arguments() {
    let kernel = library().kernel(softmax_f32::NAME).unwrap();
    let x = HostBuffer::from_host(&HostTensor::full(DType::BF16, &[4, 4], 1.0));
    let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[4, 4], 0.0));
    let e = softmax_f32::launch(&kernel, [1, 1, 1], 1, &x, &mut out).unwrap_err().to_string();
    assert!(e.contains("`softmax_f32`: `x` must be a f32 tensor of rank 2, got bf16"), "{e}");
    let x = HostBuffer::from_host(&HostTensor::full(DType::F32, &[16], 1.0));
    let e = softmax_f32::launch(&kernel, [1, 1, 1], 1, &x, &mut out).unwrap_err().to_string();
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
        [
            "accumulate",
            "alibi",
            "alibi_slopes",
            "causal_window",
            "document_causal",
            "matmul_bf16",
            "matmul_f16",
            "prefix_lm",
            "rms_norm_bf16",
            "rms_norm_f32",
            "scaled_matmul",
            "softmax_bf16",
            "softmax_f32"
        ]
    );
    assert_eq!(
        library().names(),
        [
            "accumulate",
            "flash_causal_window",
            "flash_document_slopes",
            "flash_prefix_lm_alibi",
            "matmul_bf16",
            "matmul_f16",
            "rms_norm_bf16",
            "rms_norm_f32",
            "scaled_matmul",
            "softmax_bf16",
            "softmax_f32"
        ]
        .map(String::from)
    );
    // Every kernel also for the GPU (build.rs asks for sm_80 and sm_90a), the flash
    // kernels with mods too; every PTX file passes ptxas where it is here.
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
    let kernels = [
        "accumulate",
        "flash_causal_window",
        "flash_document_slopes",
        "flash_prefix_lm_alibi",
        "matmul_bf16",
        "matmul_f16",
        "rms_norm_bf16",
        "rms_norm_f32",
        "scaled_matmul",
        "softmax_bf16",
        "softmax_f32",
    ];
    let want: Vec<(String, String)> =
        kernels.iter().flat_map(|k| ["ptx:sm_80", "ptx:sm_90a"].map(|t| (k.to_string(), t.to_string()))).collect();
    let mut built: Vec<(String, String)> = ptx.iter().map(|(k, t, _)| (k.clone(), t.clone())).collect();
    built.dedup();
    assert_eq!(built, want);
    // Every point of a schedule space is its own entry: the matmul's 4 tiles times the
    // warps and stages each allows (a 64-row tile splits over 4 warps, not 8), on
    // sm_90a each with and without warp specialisation.
    let points = |k: &str, t: &str| ptx.iter().filter(|(k2, t2, _)| k2 == k && t2 == t).count();
    assert_eq!(points("matmul_bf16", "ptx:sm_80"), 10);
    assert_eq!(points("matmul_bf16", "ptx:sm_90a"), 20);
    assert_eq!(points("rms_norm_f32", "ptx:sm_80"), 6);
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

/// Every point of a tuned kernel's schedule space (pinned one at a time), then the
/// tuner's own choice, against plain Rust: the matmul (tile), RMSNorm in f32 and bf16
/// (rows and column block).
#[test]
fn tuned_kernels_match_plain_rust_at_every_point() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let lib = library();

    let mm = lib.tuned_kernel(matmul_bf16::NAME).unwrap().without_persistent_cache();
    let ids: Vec<String> = mm.points().iter().map(|p| p.id.clone()).collect();
    assert_eq!(ids, ["bm128_bn128", "bm128_bn256", "bm64_bn128", "bm64_bn256"], "the schedule space, default first");
    let (m, k, n) = (77, 70, 263);
    let (a, b) = (random_16(&mut rng, DType::BF16, &[m, k]), random_16(&mut rng, DType::BF16, &[k, n]));
    let want = matmul_ref(&a, &b, 1.0, false);
    let (a_, b_) = (HostBuffer::from_host(&a), HostBuffer::from_host(&b));
    let grid = |c: &matmul_bf16_config| [m.div_ceil(c.BM as usize) as i64, n.div_ceil(c.BN as usize) as i64, 1];
    for id in ids.iter().map(Some).chain([None]) {
        let mut mm = lib.tuned_kernel(matmul_bf16::NAME).unwrap().without_persistent_cache();
        if let Some(id) = id {
            mm.pin(id).unwrap();
        }
        let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[m, n], f64::NAN));
        matmul_bf16::launch_tuned(&mm, grid, 2, &a_, &b_, &mut out).unwrap();
        let choice = mm.last_choice().unwrap();
        match id {
            Some(id) => assert_eq!((choice.point.as_str(), choice.source), (id.as_str(), "pinned")),
            None => {
                assert_eq!(choice.source, "tuned");
                assert_eq!(choice.timings.len(), 4, "{choice:?}");
                assert!(choice.timings.iter().all(|t| t.median_ms.is_some()), "{choice:?}");
            }
        }
        assert_close(&out.to_host().to_vec(), &want, &format!("matmul_bf16 at {choice:?} seed={seed}"));
    }

    for (r, c) in [(45, 700), (16, 256), (3, 1)] {
        let eps = 1e-5f32;
        let x = random(&mut rng, &[r, c]);
        let w = random(&mut rng, &[c]);
        let grid32 = |cf: &rms_norm_f32_config| [r.div_ceil(cf.BR as usize) as i64, 1, 1];
        let grid16 = |cf: &rms_norm_bf16_config| [r.div_ceil(cf.BR as usize) as i64, 1, 1];
        let k32 = lib.tuned_kernel(rms_norm_f32::NAME).unwrap().without_persistent_cache();
        let k16 = lib.tuned_kernel(rms_norm_bf16::NAME).unwrap().without_persistent_cache();
        assert_eq!(k32.points().len(), 6);
        for id in k32.points().iter().map(|p| Some(p.id.clone())).chain([None]) {
            let (mut p32, mut p16) = (
                lib.tuned_kernel(rms_norm_f32::NAME).unwrap().without_persistent_cache(),
                lib.tuned_kernel(rms_norm_bf16::NAME).unwrap().without_persistent_cache(),
            );
            let (p32, p16) = match &id {
                Some(id) => {
                    p32.pin(id).unwrap();
                    p16.pin(id).unwrap();
                    (&p32, &p16)
                }
                None => (&k32, &k16),
            };
            let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[r, c], f64::NAN));
            let (x_, w_) = (HostBuffer::from_host(&x), HostBuffer::from_host(&w));
            rms_norm_f32::launch_tuned(p32, grid32, 2, &x_, &w_, &mut out, eps).unwrap();
            let want = rms_norm_ref(&x, &w, eps as f64);
            assert_close(&out.to_host().to_vec(), &want, &format!("rms_norm_f32 {r}x{c} at {id:?} seed={seed}"));

            // bf16 in and out: the reference reads the rounded inputs; the output's
            // rounding (2^-9 relative) bounds the error.
            let bf16 = |t: &HostTensor| HostTensor::from_vec(DType::BF16, &t.shape, t.to_vec());
            let (xb, wb) = (bf16(&x), bf16(&w));
            let mut out = HostBuffer::from_host(&HostTensor::full(DType::BF16, &[r, c], f64::NAN));
            rms_norm_bf16::launch_tuned(
                p16,
                grid16,
                2,
                &HostBuffer::from_host(&xb),
                &HostBuffer::from_host(&wb),
                &mut out,
                eps,
            )
            .unwrap();
            let want = rms_norm_ref(&xb, &wb, eps as f64);
            let got = out.to_host().to_vec();
            let (rel, _) = ejc_ir::tensor::compare(&got, &want);
            assert!(rel <= 4e-3, "rms_norm_bf16 {r}x{c} at {id:?}: rel_err={rel:e} seed={seed}");
        }
    }
}

/// Tuning runs the kernel many times on the caller's tensors: a kernel that reads its
/// output (`out += alpha · x`) must still see the output as it was, once.
#[test]
fn tuning_puts_the_output_back_before_the_chosen_point_runs() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let n = 5000;
    let (x, y) = (random(&mut rng, &[n]), random(&mut rng, &[n]));
    let k = library().tuned_kernel(accumulate::NAME).unwrap().without_persistent_cache();
    let mut out = HostBuffer::from_host(&y);
    let grid = |c: &accumulate_config| [n.div_ceil(c.B as usize) as i64, 1, 1];
    accumulate::launch_tuned(&k, grid, 2, &HostBuffer::from_host(&x), &mut out, 0.5).unwrap();
    assert_eq!(k.last_choice().unwrap().source, "tuned");
    let want: Vec<f64> = (0..n).map(|i| y.get(&[i]) + 0.5 * x.get(&[i])).collect();
    assert_close(&out.to_host().to_vec(), &want, &format!("accumulate after tuning seed={seed}"));
    // The second call knows its point and runs once more.
    accumulate::launch_tuned(&k, grid, 2, &HostBuffer::from_host(&x), &mut out, 0.5).unwrap();
    assert_eq!(k.last_choice().unwrap().source, "memory");
    let want: Vec<f64> = want.iter().zip(0..n).map(|(w, i)| w + 0.5 * x.get(&[i])).collect();
    assert_close(&out.to_host().to_vec(), &want, &format!("accumulate, second call seed={seed}"));
}

/// The choice outlives the process: a second kernel object on the same cache
/// directory finds it there; another shape tunes again; an unknown pin is refused.
#[test]
fn the_tuned_choice_is_kept_in_the_cache() {
    let dir = std::env::temp_dir().join(format!("ejc-demo-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = |n: usize| {
        let k = library().tuned_kernel(accumulate::NAME).unwrap().with_cache_dir(&dir);
        let x = HostBuffer::from_host(&HostTensor::full(DType::F32, &[n], 1.0));
        let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[n], 0.0));
        accumulate::launch_tuned(&k, |c| [n.div_ceil(c.B as usize) as i64, 1, 1], 1, &x, &mut out, 2.0).unwrap();
        assert!(out.to_host().to_vec().iter().all(|&v| v == 2.0));
        k.last_choice().unwrap().source
    };
    assert_eq!(run(3000), "tuned");
    assert_eq!(run(3000), "cache");
    assert_eq!(run(3001), "tuned", "another shape is another call");
    let mut k = library().tuned_kernel(accumulate::NAME).unwrap();
    let e = k.pin("b7").unwrap_err().to_string();
    assert!(e.contains("no point `b7`") && e.contains("b128, b1024"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The MLIR back end on the demo's kernels: each one's IR (after the pass pipeline, as
/// the build compiles it) through MLIR to this CPU (`ejc_codegen::mlir::exec`), against
/// plain Rust; and the build's `mlir:cpu` / `mlir:gpu:sm_80` artifacts are there.
#[test]
fn the_kernels_through_mlir_match_plain_rust() {
    use ejc_codegen::mlir::exec::CpuKernel as MlirKernel;
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let compiled = |k: ejc_ir::ir::Kernel| {
        let k = ejc_ir::passes::run_pipeline(&k, &ejc_ir::passes::default_pipeline()).unwrap();
        MlirKernel::compile(&k).unwrap()
    };
    let run = |k: &MlirKernel, bufs: &mut [&mut HostBuffer], scalars: &[u64], grid: [i64; 3]| {
        let abi: Vec<_> = bufs.iter_mut().flat_map(|b| b.descriptors()).collect();
        // Safety: the buffers are the kernel's parameters in order, with their dtypes.
        unsafe { k.launch(&abi, scalars, grid, 2) }.unwrap();
    };

    let (m, k, n) = (45, 70, 37);
    let (a, b) = (random(&mut rng, &[m, k]), random(&mut rng, &[k, n]));
    let mm = compiled(scaled_matmul::kernel().unwrap());
    let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[m, n], f64::NAN));
    let (mut a_, mut b_) = (HostBuffer::from_host(&a), HostBuffer::from_host(&b));
    let scalars = [ejc_runtime::cpu::scalar_slot(DType::F32, 0.75), 1];
    let grid = [m.div_ceil(scaled_matmul::BM as usize) as i64, n.div_ceil(scaled_matmul::BN as usize) as i64, 1];
    run(&mm, &mut [&mut a_, &mut b_, &mut out], &scalars, grid);
    assert_close(&out.to_host().to_vec(), &matmul_ref(&a, &b, 0.75, true), &format!("mlir scaled_matmul seed={seed}"));

    let (r, c) = (21, 200);
    let x = random(&mut rng, &[r, c]);
    let sm = compiled(softmax_f32::kernel().unwrap());
    let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[r, c], f64::NAN));
    run(&sm, &mut [&mut HostBuffer::from_host(&x), &mut out], &[], [r.div_ceil(softmax_f32::BR as usize) as i64, 1, 1]);
    assert_close(&out.to_host().to_vec(), &softmax_ref(&x), &format!("mlir softmax_f32 seed={seed}"));

    let w = random(&mut rng, &[c]);
    let rn = compiled(rms_norm_f32::kernel().unwrap());
    let mut out = HostBuffer::from_host(&HostTensor::full(DType::F32, &[r, c], f64::NAN));
    let eps = [ejc_runtime::cpu::scalar_slot(DType::F32, 1e-5)];
    let grid = [r.div_ceil(rms_norm_f32::BR as usize) as i64, 1, 1];
    run(&rn, &mut [&mut HostBuffer::from_host(&x), &mut HostBuffer::from_host(&w), &mut out], &eps, grid);
    assert_close(&out.to_host().to_vec(), &rms_norm_ref(&x, &w, 1e-5), &format!("mlir rms_norm_f32 seed={seed}"));

    let dir = std::path::PathBuf::from(env!("EJC_DEMO_DIR"));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    for target in ["mlir:cpu", "mlir:gpu:sm_80"] {
        let n = manifest["artifacts"].as_array().unwrap().iter().filter(|a| a["target"] == target).count();
        // One per point: accumulate 2, matmul 4 + 4, RMSNorm 6 + 6, scaled_matmul 1, softmax 6 + 6.
        assert_eq!(n, 35, "{target} artifacts");
    }
}
