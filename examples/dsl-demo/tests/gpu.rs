//! The demo's kernels on a GPU (`cargo test -p ejc-dsl-demo --features cuda --test gpu`;
//! `scripts/gpu_prepare.sh --dsl`, then `scripts/gpu_run.sh --dsl` on the lent GPU):
//! each through its generated `launch_gpu`, on fresh random inputs of awkward shapes,
//! against the same plain-Rust references as the CPU tests. Without a GPU every test
//! says so and passes. `EJC_DEMO_DIR` points at the build's kernels on another machine.
#![cfg(feature = "cuda")]

use ejc_dsl_demo::kernels::{
    accumulate, matmul_bf16, matmul_f16, rms_norm_bf16, rms_norm_f32, scaled_matmul, softmax_bf16, softmax_f32,
};
use ejc_dsl_demo::library;
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;
use ejc_runtime::cpu::HostBuffer;
use ejc_runtime::dsl::{Gpu, GpuError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::*;

fn gpu() -> Option<Gpu> {
    match Gpu::new() {
        Ok(g) => {
            println!("GPU: {}", g.name());
            Some(g)
        }
        Err(e) => {
            eprintln!("skipped: no GPU here ({e})");
            None
        }
    }
}

fn nan(shape: &[usize]) -> HostBuffer {
    HostBuffer::from_host(&HostTensor::full(DType::F32, shape, f64::NAN))
}

#[test]
fn scaled_matmul_on_the_gpu() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let kernel = library().gpu_kernel(&gpu, scaled_matmul::NAME).unwrap();
    println!("scaled_matmul: {}", kernel.target);
    for &(m, k, n) in &[(37, 70, 45), (64, 32, 96), (1, 1, 1), (129, 257, 65)] {
        for relu in [false, true] {
            let (a, b) = (random(&mut rng, &[m, k]), random(&mut rng, &[k, n]));
            let alpha = rng.random_range(0.25f32..2.0);
            let (da, db) =
                (gpu.upload(&HostBuffer::from_host(&a)).unwrap(), gpu.upload(&HostBuffer::from_host(&b)).unwrap());
            let mut dout = gpu.upload(&nan(&[m, n])).unwrap();
            let grid =
                [m.div_ceil(scaled_matmul::BM as usize) as i64, n.div_ceil(scaled_matmul::BN as usize) as i64, 1];
            scaled_matmul::launch_gpu(&kernel, grid, &da, &db, &mut dout, alpha, relu).unwrap();
            let got = gpu.download(&dout).unwrap().to_host().to_vec();
            let want = matmul_ref(&a, &b, alpha as f64, relu);
            assert_close(&got, &want, &format!("gpu scaled_matmul {m}x{k}x{n} relu={relu} seed={seed}"));
        }
    }
}

#[test]
fn the_generic_matmul_on_the_gpu() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for (name, dt) in [(matmul_bf16::NAME, DType::BF16), (matmul_f16::NAME, DType::F16)] {
        let kernel = library().gpu_kernel(&gpu, name).unwrap();
        println!("{name}: {}", kernel.target);
        for &(m, k, n) in &[(70, 45, 93), (128, 64, 128), (1, 3, 130), (200, 300, 190)] {
            let (a, b) = (random_16(&mut rng, dt, &[m, k]), random_16(&mut rng, dt, &[k, n]));
            let da = gpu.upload(&HostBuffer::from_host(&a)).unwrap();
            let db = gpu.upload(&HostBuffer::from_host(&b)).unwrap();
            let mut dout = gpu.upload(&nan(&[m, n])).unwrap();
            let grid = [m.div_ceil(matmul_bf16::BM as usize) as i64, n.div_ceil(matmul_bf16::BN as usize) as i64, 1];
            match dt {
                DType::BF16 => matmul_bf16::launch_gpu(&kernel, grid, &da, &db, &mut dout),
                _ => matmul_f16::launch_gpu(&kernel, grid, &da, &db, &mut dout),
            }
            .unwrap();
            let got = gpu.download(&dout).unwrap().to_host().to_vec();
            assert_close(&got, &matmul_ref(&a, &b, 1.0, false), &format!("gpu {name} {m}x{k}x{n} seed={seed}"));
        }
    }
}

#[test]
fn softmax_on_the_gpu() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let kernel = library().gpu_kernel(&gpu, softmax_f32::NAME).unwrap();
    println!("softmax_f32: {}", kernel.target);
    for &(r, c) in &[(13, 77), (16, 32), (3, 1), (21, 200), (1000, 129)] {
        let mut x = random(&mut rng, &[r, c]);
        for v in x.data.iter_mut() {
            *v *= 8.0;
        }
        let dx = gpu.upload(&HostBuffer::from_host(&x)).unwrap();
        let mut dout = gpu.upload(&nan(&[r, c])).unwrap();
        let grid = [r.div_ceil(softmax_f32::BR as usize) as i64, 1, 1];
        softmax_f32::launch_gpu(&kernel, grid, &dx, &mut dout).unwrap();
        let got = gpu.download(&dout).unwrap().to_host().to_vec();
        assert_close(&got, &softmax_ref(&x), &format!("gpu softmax_f32 {r}x{c} seed={seed}"));

        // bf16 in and out, every point of the schedule space, then the tuner's choice.
        let xb = HostTensor::from_vec(DType::BF16, &x.shape, x.to_vec());
        let dxb = gpu.upload(&HostBuffer::from_host(&xb)).unwrap();
        let ids: Vec<String> = library()
            .gpu_tuned_kernel(&gpu, softmax_bf16::NAME)
            .unwrap()
            .points()
            .iter()
            .map(|p| p.id.clone())
            .collect();
        for id in ids.iter().map(Some).chain([None]) {
            let mut k16 = library().gpu_tuned_kernel(&gpu, softmax_bf16::NAME).unwrap().without_persistent_cache();
            if let Some(id) = id {
                k16.pin(id).unwrap();
            }
            let mut dout =
                gpu.upload(&HostBuffer::from_host(&HostTensor::full(DType::BF16, &[r, c], f64::NAN))).unwrap();
            let grid = |cf: &ejc_dsl_demo::kernels::softmax_bf16_config| [r.div_ceil(cf.BR as usize) as i64, 1, 1];
            softmax_bf16::launch_gpu_tuned(&k16, grid, &dxb, &mut dout).unwrap();
            let (rel, _) = ejc_ir::tensor::compare(&gpu.download(&dout).unwrap().to_host().to_vec(), &softmax_ref(&xb));
            assert!(rel <= 4e-3, "gpu softmax_bf16 {r}x{c} at {id:?}: rel_err={rel:e} seed={seed}");
        }
    }
}

#[test]
fn the_gpu_launch_checks_its_arguments() {
    let Some(gpu) = gpu() else { return };
    let kernel = library().gpu_kernel(&gpu, softmax_f32::NAME).unwrap();
    let x = gpu.upload(&HostBuffer::from_host(&HostTensor::full(DType::BF16, &[4, 4], 1.0))).unwrap();
    let mut out = gpu.upload(&nan(&[4, 4])).unwrap();
    let e = softmax_f32::launch_gpu(&kernel, [1, 1, 1], &x, &mut out).unwrap_err();
    assert!(matches!(e, GpuError::Invalid(_)), "{e}");
    assert!(e.to_string().contains("`softmax_f32`: `x` must be a f32 tensor of rank 2, got bf16"), "{e}");
    let e = library().gpu_kernel(&gpu, "flash_causal_window").err().unwrap().to_string();
    assert!(e.contains("is a flash kernel with mods: run it with `DslLibrary::run_flash_gpu`"), "{e}");
    let e = library().gpu_kernel(&gpu, "nope").err().unwrap().to_string();
    assert!(e.contains("no kernel `nope`"), "{e}");
}

/// Every point of the tuned kernels' schedule spaces on the GPU (pinned one at a time),
/// then the tuner's own choice, against plain Rust; tuning puts a read-and-written
/// output back before the chosen point runs.
#[test]
fn tuned_kernels_on_the_gpu() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let lib = library();

    // Rows of 300 elements are not 16-byte multiples: the general entry; 312 and 392
    // are, so the aligned entry runs (TMA on the warp-specialised points).
    let all = lib.gpu_tuned_kernel(&gpu, matmul_bf16::NAME).unwrap().without_persistent_cache();
    println!("matmul_bf16 on {}: {} points", all.target(), all.points().len());
    assert!(all.points().len() >= 8, "{:?}", all.points());
    for (m, k, n) in [(200, 300, 390), (200, 312, 392)] {
        let (a, b) = (random_16(&mut rng, DType::BF16, &[m, k]), random_16(&mut rng, DType::BF16, &[k, n]));
        let want = matmul_ref(&a, &b, 1.0, false);
        let (da, db) =
            (gpu.upload(&HostBuffer::from_host(&a)).unwrap(), gpu.upload(&HostBuffer::from_host(&b)).unwrap());
        for id in all.points().iter().map(|p| Some(p.id.clone())).chain([None]) {
            let mut kk = lib.gpu_tuned_kernel(&gpu, matmul_bf16::NAME).unwrap().without_persistent_cache();
            if let Some(id) = &id {
                kk.pin(id).unwrap();
            }
            let mut dout = gpu.upload(&nan(&[m, n])).unwrap();
            let grid = |c: &ejc_dsl_demo::kernels::matmul_bf16_config| {
                [m.div_ceil(c.BM as usize) as i64, n.div_ceil(c.BN as usize) as i64, 1]
            };
            matmul_bf16::launch_gpu_tuned(&kk, grid, &da, &db, &mut dout).unwrap();
            let got = gpu.download(&dout).unwrap().to_host().to_vec();
            let choice = kk.last_choice().unwrap();
            if id.is_none() {
                println!("matmul_bf16 {m}x{k}x{n} tuned: {choice:?}");
                assert!(choice.timings.iter().all(|t| t.median_ms.is_some()), "{choice:?}");
            }
            assert_close(&got, &want, &format!("gpu matmul_bf16 {m}x{k}x{n} at {} seed={seed}", choice.point));
        }
    }

    for (r, c) in [(45, 700), (1000, 129), (3, 1)] {
        let eps = 1e-5f32;
        let x = random(&mut rng, &[r, c]);
        let w = random(&mut rng, &[c]);
        let bf16 = |t: &HostTensor| HostTensor::from_vec(DType::BF16, &t.shape, t.to_vec());
        let (xb, wb) = (bf16(&x), bf16(&w));
        let up = |t: &HostTensor| gpu.upload(&HostBuffer::from_host(t)).unwrap();
        let (dx, dw, dxb, dwb) = (up(&x), up(&w), up(&xb), up(&wb));
        let ids: Vec<String> =
            lib.gpu_tuned_kernel(&gpu, rms_norm_f32::NAME).unwrap().points().iter().map(|p| p.id.clone()).collect();
        for id in ids.iter().map(Some).chain([None]) {
            let mut k32 = lib.gpu_tuned_kernel(&gpu, rms_norm_f32::NAME).unwrap().without_persistent_cache();
            let mut k16 = lib.gpu_tuned_kernel(&gpu, rms_norm_bf16::NAME).unwrap().without_persistent_cache();
            if let Some(id) = id {
                k32.pin(id).unwrap();
                k16.pin(id).unwrap();
            }
            let mut dout = gpu.upload(&nan(&[r, c])).unwrap();
            rms_norm_f32::launch_gpu_tuned(
                &k32,
                |cf| [r.div_ceil(cf.BR as usize) as i64, 1, 1],
                &dx,
                &dw,
                &mut dout,
                eps,
            )
            .unwrap();
            let got = gpu.download(&dout).unwrap().to_host().to_vec();
            assert_close(
                &got,
                &rms_norm_ref(&x, &w, eps as f64),
                &format!("gpu rms_norm_f32 {r}x{c} at {id:?} seed={seed}"),
            );
            let mut dout = up(&HostTensor::full(DType::BF16, &[r, c], f64::NAN));
            rms_norm_bf16::launch_gpu_tuned(
                &k16,
                |cf| [r.div_ceil(cf.BR as usize) as i64, 1, 1],
                &dxb,
                &dwb,
                &mut dout,
                eps,
            )
            .unwrap();
            let got = gpu.download(&dout).unwrap().to_host().to_vec();
            let (rel, _) = ejc_ir::tensor::compare(&got, &rms_norm_ref(&xb, &wb, eps as f64));
            assert!(rel <= 4e-3, "gpu rms_norm_bf16 {r}x{c} at {id:?}: rel_err={rel:e} seed={seed}");
        }
    }

    let n = 100_003;
    let (x, y) = (random(&mut rng, &[n]), random(&mut rng, &[n]));
    let k = lib.gpu_tuned_kernel(&gpu, accumulate::NAME).unwrap().without_persistent_cache();
    let dx = gpu.upload(&HostBuffer::from_host(&x)).unwrap();
    let mut dout = gpu.upload(&HostBuffer::from_host(&y)).unwrap();
    accumulate::launch_gpu_tuned(&k, |c| [n.div_ceil(c.B as usize) as i64, 1, 1], &dx, &mut dout, 0.5).unwrap();
    assert_eq!(k.last_choice().unwrap().source, "tuned");
    let want: Vec<f64> = (0..n).map(|i| y.get(&[i]) + 0.5 * x.get(&[i])).collect();
    assert_close(&gpu.download(&dout).unwrap().to_host().to_vec(), &want, &format!("gpu accumulate seed={seed}"));
}

/// The PTX MLIR's NVVM pipeline made (`DslBuild::mlir`, `mlir:gpu:sm_80`: tiles in
/// global scratch) for three of the kernels, against plain Rust.
#[test]
fn the_mlir_ptx_on_the_gpu() {
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let lib = library();
    let up = |t: &HostTensor| gpu.upload(&HostBuffer::from_host(t)).unwrap();
    let (m, k, n) = (45, 70, 133);
    let (a, b) = (random(&mut rng, &[m, k]), random(&mut rng, &[k, n]));
    let mm = lib.gpu_kernel_on(&gpu, scaled_matmul::NAME, "mlir:gpu:sm_80").unwrap();
    let mut dout = gpu.upload(&nan(&[m, n])).unwrap();
    let grid = [m.div_ceil(scaled_matmul::BM as usize) as i64, n.div_ceil(scaled_matmul::BN as usize) as i64, 1];
    scaled_matmul::launch_gpu(&mm, grid, &up(&a), &up(&b), &mut dout, 0.75, true).unwrap();
    let got = gpu.download(&dout).unwrap().to_host().to_vec();
    assert_close(&got, &matmul_ref(&a, &b, 0.75, true), &format!("mlir gpu scaled_matmul seed={seed}"));

    let (r, c) = (1000, 129);
    let x = random(&mut rng, &[r, c]);
    let sm = lib.gpu_kernel_on(&gpu, softmax_f32::NAME, "mlir:gpu:sm_80").unwrap();
    let mut dout = gpu.upload(&nan(&[r, c])).unwrap();
    softmax_f32::launch_gpu(&sm, [r.div_ceil(softmax_f32::BR as usize) as i64, 1, 1], &up(&x), &mut dout).unwrap();
    let got = gpu.download(&dout).unwrap().to_host().to_vec();
    assert_close(&got, &softmax_ref(&x), &format!("mlir gpu softmax_f32 seed={seed}"));

    let w = random(&mut rng, &[c]);
    let rn = lib.gpu_kernel_on(&gpu, rms_norm_f32::NAME, "mlir:gpu:sm_80").unwrap();
    let mut dout = gpu.upload(&nan(&[r, c])).unwrap();
    let grid = [r.div_ceil(rms_norm_f32::BR as usize) as i64, 1, 1];
    rms_norm_f32::launch_gpu(&rn, grid, &up(&x), &up(&w), &mut dout, 1e-5).unwrap();
    let got = gpu.download(&dout).unwrap().to_host().to_vec();
    assert_close(&got, &rms_norm_ref(&x, &w, 1e-5), &format!("mlir gpu rms_norm_f32 seed={seed}"));
    let e = lib.gpu_kernel_on(&gpu, softmax_f32::NAME, "mlir:gpu:sm_90a").err().unwrap().to_string();
    assert!(e.contains("no `mlir:gpu:sm_90a` artifact") && e.contains("ptx:sm_80"), "{e}");
}

/// The flash kernels the build compiled with the crate's mods, on the GPU through a
/// flash call (`run_flash_gpu`), against plain Rust attention with the mods applied.
#[test]
fn flash_with_mods_on_the_gpu() {
    use ejc_dsl_demo::kernels::{alibi, causal_window, prefix_lm};
    use ejc_ir::flash::inputs::{default_runtime, random_inputs};
    use ejc_ir::flash::{Features, FlashShape};
    use ejc_runtime::call::Call;
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let f = Features::default();
    for shape in ["2,77,77,4,2,64", "1,300,300,4,1,64"] {
        let shape = FlashShape::parse(shape).unwrap();
        let inputs = random_inputs(&f, DType::F32, &shape, seed);
        let rt = default_runtime(&f, &shape, seed);
        for name in ["flash_prefix_lm_alibi", "flash_causal_window"] {
            let mut call = Call::from_host(&ejc_ir::flash::op::host_call(&f, &rt, &inputs));
            library().run_flash_gpu(&gpu, name, &mut call).unwrap();
            let got = call.host_tensor("out").unwrap().to_vec();
            let want = if name == "flash_prefix_lm_alibi" {
                attention_ref(
                    &inputs.q,
                    &inputs.k,
                    &inputs.v,
                    rt.softmax_scale,
                    &|b, h, i, j| prefix_lm(b as i32, h as i32, i as i32, j as i32),
                    &|s, b, h, i, j| alibi(s as f32, b as i32, h as i32, i as i32, j as i32) as f64,
                )
            } else {
                attention_ref(
                    &inputs.q,
                    &inputs.k,
                    &inputs.v,
                    rt.softmax_scale,
                    &|b, h, i, j| causal_window(b as i32, h as i32, i as i32, j as i32),
                    &|s, _, _, _, _| s,
                )
            };
            assert_close(&got, &want, &format!("gpu {name} shape={shape} seed={seed}"));
        }
    }
}

/// Mods that read tensors (`doc[[b, q_idx]]`, `slopes[h]`) on the GPU: the tensors are
/// parameters of the flash kernel, passed in the call.
#[test]
fn flash_with_mods_reading_tensors_on_the_gpu() {
    use ejc_dsl_demo::kernels::{alibi_slopes, document_causal};
    use ejc_ir::dsl::TensorView;
    use ejc_runtime::call::Call;
    let Some(gpu) = gpu() else { return };
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for shape in ["2,77,77,4,2,64", "1,300,300,4,1,64"] {
        let DocumentCall { shape, inputs, rt, host, doc, slopes } = document_call(&mut rng, shape, 70, seed);
        let (b, s, h) = (shape.batch, shape.seq_q, shape.heads_q);
        let mut call = Call::from_host(&host);
        library().run_flash_gpu(&gpu, "flash_document_slopes", &mut call).unwrap();
        let got = call.host_tensor("out").unwrap().to_vec();
        let (docs, sl) = (TensorView::new(&doc, [b, s]), TensorView::new(&slopes, [h]));
        let want = attention_ref(
            &inputs.q,
            &inputs.k,
            &inputs.v,
            rt.softmax_scale,
            &|b, h, i, j| document_causal(b as i32, h as i32, i as i32, j as i32, docs),
            &|x, b, h, i, j| alibi_slopes(x as f32, b as i32, h as i32, i as i32, j as i32, sl) as f64,
        );
        assert_close(&got, &want, &format!("gpu flash_document_slopes shape={shape} seed={seed}"));
    }
}

fn median_ms(gpu: &Gpu, run: &mut dyn FnMut() -> Result<(), GpuError>) -> f32 {
    for _ in 0..3 {
        run().unwrap();
    }
    let mut t = gpu.time(20, run).unwrap();
    t.sort_by(f32::total_cmp);
    t[t.len() / 2]
}

/// Timing, not a check (`--ignored --nocapture`): the tuned bf16 matmul at 4096³
/// (TFLOP/s), RMSNorm (f32, bf16) and softmax at 16384 × 8192 (GB/s of one read and one
/// write), each after tuning, for the side-by-side with torch.matmul and a device copy
/// that `scripts/gpu_run.sh --dsl` prints next to them.
#[test]
#[ignore = "a timing, not a check: scripts/gpu_run.sh --dsl runs it beside torch.matmul and a copy"]
fn dsl_timings() {
    let Some(gpu) = gpu() else { return };
    let lib = library();
    let n = 4096usize;
    let a = gpu.upload(&HostBuffer::from_host(&HostTensor::full(DType::BF16, &[n, n], 0.5))).unwrap();
    let b = gpu.upload(&HostBuffer::from_host(&HostTensor::full(DType::BF16, &[n, n], 0.25))).unwrap();
    let mut out = gpu.upload(&HostBuffer::from_host(&HostTensor::full(DType::F32, &[n, n], 0.0))).unwrap();
    let mm = lib.gpu_tuned_kernel(&gpu, matmul_bf16::NAME).unwrap().without_persistent_cache();
    let grid =
        |c: &ejc_dsl_demo::kernels::matmul_bf16_config| [(n / c.BM as usize) as i64, (n / c.BN as usize) as i64, 1];
    matmul_bf16::launch_gpu_tuned(&mm, grid, &a, &b, &mut out).unwrap();
    let choice = mm.last_choice().unwrap();
    for t in &choice.timings {
        println!("  matmul_bf16 point {}: {:?} ms ({})", t.config_id, t.median_ms, t.status);
    }
    let ms = median_ms(&gpu, &mut || matmul_bf16::launch_gpu_tuned(&mm, grid, &a, &b, &mut out));
    println!(
        "ejc DSL matmul_bf16 {n}^3 ({}, tuned: {}): {ms:.3} ms, {:.0} TFLOP/s",
        mm.target(),
        choice.point,
        2.0 * (n as f64).powi(3) / ms as f64 / 1e9
    );
    drop((a, b, out));

    let (r, c) = (16384usize, 8192usize);
    for dt in [DType::F32, DType::BF16] {
        let x = gpu.upload(&HostBuffer::from_host(&HostTensor::full(dt, &[r, c], 0.5))).unwrap();
        let w = gpu.upload(&HostBuffer::from_host(&HostTensor::full(dt, &[c], 1.5))).unwrap();
        let mut o = gpu.upload(&HostBuffer::from_host(&HostTensor::full(dt, &[r, c], 0.0))).unwrap();
        let grid32 = |cf: &ejc_dsl_demo::kernels::rms_norm_f32_config| [r.div_ceil(cf.BR as usize) as i64, 1, 1];
        let grid16 = |cf: &ejc_dsl_demo::kernels::rms_norm_bf16_config| [r.div_ceil(cf.BR as usize) as i64, 1, 1];
        let (name, k) = if dt == DType::F32 {
            (rms_norm_f32::NAME, lib.gpu_tuned_kernel(&gpu, rms_norm_f32::NAME).unwrap().without_persistent_cache())
        } else {
            (rms_norm_bf16::NAME, lib.gpu_tuned_kernel(&gpu, rms_norm_bf16::NAME).unwrap().without_persistent_cache())
        };
        let mut run = || {
            if dt == DType::F32 {
                rms_norm_f32::launch_gpu_tuned(&k, grid32, &x, &w, &mut o, 1e-5)
            } else {
                rms_norm_bf16::launch_gpu_tuned(&k, grid16, &x, &w, &mut o, 1e-5)
            }
        };
        run().unwrap();
        let point = k.last_choice().unwrap().point;
        let ms = median_ms(&gpu, &mut run);
        let bytes = 2.0 * (r * c * dt.size_bytes()) as f64;
        println!("ejc DSL {name} {r}x{c} ({point}): {ms:.3} ms, {:.0} GB/s", bytes / ms as f64 / 1e6);
    }
    let x = gpu.upload(&HostBuffer::from_host(&HostTensor::full(DType::F32, &[r, c], 0.5))).unwrap();
    let mut o = gpu.upload(&HostBuffer::from_host(&HostTensor::full(DType::F32, &[r, c], 0.0))).unwrap();
    let sm = lib.gpu_tuned_kernel(&gpu, softmax_f32::NAME).unwrap().without_persistent_cache();
    let grid = |cf: &ejc_dsl_demo::kernels::softmax_f32_config| [r.div_ceil(cf.BR as usize) as i64, 1, 1];
    softmax_f32::launch_gpu_tuned(&sm, grid, &x, &mut o).unwrap();
    let point = sm.last_choice().unwrap().point;
    let ms = median_ms(&gpu, &mut || softmax_f32::launch_gpu_tuned(&sm, grid, &x, &mut o));
    let bytes = 2.0 * (r * c * 4) as f64;
    println!("ejc DSL softmax_f32 {r}x{c} f32 ({point}): {ms:.3} ms, {:.0} GB/s", bytes / ms as f64 / 1e6);
    let x = gpu.upload(&HostBuffer::from_host(&HostTensor::full(DType::BF16, &[r, c], 0.5))).unwrap();
    let mut o = gpu.upload(&HostBuffer::from_host(&HostTensor::full(DType::BF16, &[r, c], 0.0))).unwrap();
    let sm = lib.gpu_tuned_kernel(&gpu, softmax_bf16::NAME).unwrap().without_persistent_cache();
    let grid = |cf: &ejc_dsl_demo::kernels::softmax_bf16_config| [r.div_ceil(cf.BR as usize) as i64, 1, 1];
    softmax_bf16::launch_gpu_tuned(&sm, grid, &x, &mut o).unwrap();
    let point = sm.last_choice().unwrap().point;
    let ms = median_ms(&gpu, &mut || softmax_bf16::launch_gpu_tuned(&sm, grid, &x, &mut o));
    let bytes = 2.0 * (r * c * 2) as f64;
    println!("ejc DSL softmax_bf16 {r}x{c} ({point}): {ms:.3} ms, {:.0} GB/s", bytes / ms as f64 / 1e6);
}
