//! The MLIR back end: every variant of `specs/flash.yaml` translates to MLIR that MLIR's
//! verifier accepts (cpu and gpu forms); the cpu form, lowered by MLIR's pipelines and
//! run by its ExecutionEngine, matches the reference on fresh random inputs and awkward
//! shapes; the gpu form's PTX passes ptxas.
//!
//! Inputs are fresh random numbers; the seed is printed (`EJC_TEST_SEED` replays).

use ejc_codegen::mlir::{self, exec::CpuKernel, Form, GpuOptions};
use ejc_codegen::ptx::{ptxas, Arch};
use ejc_ir::flash::abi::abi_params;
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::reference;
use ejc_ir::flash::{build_kernel, FlashShape};
use ejc_ir::ir::Kernel;
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{self, Schedule, Spec, Variant};
use ejc_ir::tensor::compare;
use ejc_ir::types::{DType, Type};
use ejc_runtime::flash::{launch_plan, FlashBuffers};

fn spec() -> Spec {
    spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/flash.yaml")).unwrap()
}

fn seed() -> u64 {
    std::env::var("EJC_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    })
}

/// DESIGN.md's tolerances.
fn tol(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-5,
        DType::F16 => 5e-3,
        _ => 1e-2,
    }
}

fn kernel(spec: &Spec, v: &Variant, dtype: DType, head_dim: usize, bm: u32, bn: u32) -> Kernel {
    let k = build_kernel(spec, v, dtype, head_dim, &Schedule { block_m: bm, block_n: bn, num_warps: 0, num_stages: 0 })
        .unwrap();
    run_pipeline(&k, &default_pipeline()).unwrap()
}

/// Run `k` through the MLIR CPU path on `shape` and compare with the reference.
fn check(k: &CpuKernel, v: &Variant, dtype: DType, head_dim: usize, bm: usize, shape: &str, seed: u64) {
    let label = format!("{} shape={shape} seed={seed}", k.name);
    let shape = FlashShape::parse(shape).unwrap();
    let f = &v.features;
    let inputs = random_inputs(f, dtype, &shape, seed);
    let rt = default_runtime(f, &shape, seed);
    let want = reference(f, &rt, &inputs).unwrap();
    let mut call = FlashBuffers::from_inputs(&inputs);
    let (grid, scalars) = launch_plan(f, dtype, head_dim, bm, &rt, &mut call).unwrap();
    let mut tensors = Vec::new();
    for p in abi_params(f, dtype) {
        if let Type::Tensor(..) = p.ty {
            tensors.push(call.get(p.name).unwrap().abi());
        }
    }
    unsafe { k.launch(&tensors, &scalars, grid, 2) }.unwrap_or_else(|e| panic!("{label}: {e}"));
    let got = call.outputs();
    for (what, g, w) in [("out", &got.out, &want.out), ("lse", &got.lse, &want.lse)] {
        let (rel, max_abs) = compare(&g.to_vec(), &w.to_vec());
        assert!(rel <= tol(dtype), "{label} {what}: rel_err={rel:e} max_abs_err={max_abs:e}");
    }
}

#[test]
fn every_variant_translates_and_verifies_in_both_forms() {
    let spec = spec();
    for v in &spec.variants {
        for dtype in [DType::BF16, DType::F32] {
            for d in [64, 128] {
                let k = kernel(&spec, v, dtype, d, 64, 32);
                for form in [Form::Cpu, Form::Gpu { threads: 128 }] {
                    let (text, info) =
                        mlir::to_mlir(&k, form).unwrap_or_else(|e| panic!("{} ({form:?}): {e}", k.name));
                    assert!(text.contains(if form == Form::Cpu { "func.func" } else { "gpu.func" }));
                    assert!(info.scratch_bytes > 0);
                }
            }
        }
    }
}

#[test]
fn cpu_form_matches_the_reference_for_every_variant() {
    let spec = spec();
    let seed = seed();
    println!("seed {seed} (EJC_TEST_SEED replays)");
    let shapes = ["2,77,93,4,2,64", "1,19,140,8,2,64"];
    for v in &spec.variants {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let k = kernel(&spec, v, dtype, 64, 64, 32);
            let ck = CpuKernel::compile(&k).unwrap_or_else(|e| panic!("{e}"));
            for s in shapes {
                check(&ck, v, dtype, 64, 64, s, seed);
            }
        }
    }
}

#[test]
fn gpu_form_ptx_passes_ptxas_for_every_variant() {
    let spec = spec();
    let Some(tool) = ejc_codegen::ptx::find_ptxas() else {
        eprintln!("skipped: no ptxas (run scripts/setup.sh or set EJC_PTXAS)");
        return;
    };
    if mlir::find_libdevice().is_none() {
        eprintln!("skipped: no libdevice.10.bc beside ptxas (run scripts/setup.sh or set EJC_LIBDEVICE)");
        return;
    }
    let mut checked = 0;
    for v in &spec.variants {
        for (dtype, d) in [(DType::BF16, 64), (DType::F16, 128), (DType::F32, 64)] {
            let k = kernel(&spec, v, dtype, d, 64, 32);
            for arch in [Arch::Sm80, Arch::Sm90a] {
                let opts = GpuOptions { chip: arch.name().into(), threads: 128 };
                let p = mlir::compile_gpu(&k, opts).unwrap_or_else(|e| panic!("{} ({arch}): {e}", k.name));
                assert!(p.ptx.contains(".visible .entry entry("), "{}: no entry", k.name);
                assert!(p.ptx.contains(&format!(".target {}", arch.name())), "{}", k.name);
                assert!(!p.ptx.contains(".extern .func"), "{}: unresolved functions (libdevice not linked)", k.name);
                let r = ptxas(&tool, &p.ptx, arch).unwrap_or_else(|e| panic!("{} ({arch}): {e}", k.name));
                assert!(r.registers > 0, "{}: {r:?}", k.name);
                checked += 1;
            }
        }
    }
    eprintln!("{checked} MLIR-generated PTX files assembled by ptxas");
}
