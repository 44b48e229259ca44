use ejc_codegen::cpu::{compile_object, jit::JitLibrary, Isa};
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::reference;
use ejc_ir::flash::{build_flash_kernel, FlashShape};
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::Features;
use ejc_ir::tensor::compare;
use ejc_ir::types::DType;
use ejc_runtime::cpu::CpuKernel;
use ejc_runtime::flash::{run_cpu, FlashBuffers};

#[test]
fn smoke() {
    let f = Features { causal: true, ..Default::default() };
    for isa in [Isa::host(), Isa::Avx512, Isa::Avx2, Isa::X86_64] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let k = build_flash_kernel("k", &f, dtype, 64, 32, 32).unwrap();
            let k = run_pipeline(&k, &default_pipeline()).unwrap();
            let obj = compile_object(&[k], isa).unwrap();
            let lib = JitLibrary::load(&obj.object).unwrap();
            let kernel =
                CpuKernel { entry: lib.entry("k").unwrap(), scratch_bytes: obj.kernels[0].scratch_bytes as usize };
            let shape = FlashShape::parse("2,77,93,4,2,64").unwrap();
            let inputs = random_inputs(&f, dtype, &shape, 1);
            let rt = default_runtime(&f, &shape, 1);
            let mut call = FlashBuffers::from_inputs(&inputs);
            run_cpu(&kernel, &f, dtype, 64, 32, &rt, &mut call, 2).unwrap();
            let got = call.outputs();
            let want = reference(&f, &rt, &inputs).unwrap();
            let (rel, max) = compare(&got.out.to_vec(), &want.out.to_vec());
            let (lrel, _) = compare(&got.lse.to_vec(), &want.lse.to_vec());
            eprintln!("{isa} {dtype}: rel {rel:e} max {max:e} lse {lrel:e} scratch {}", obj.kernels[0].scratch_bytes);
        }
    }
}
