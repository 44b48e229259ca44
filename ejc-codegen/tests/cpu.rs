//! The CPU back end against the reference: every variant of `specs/flash.yaml` ×
//! {f32, bf16, f16} × awkward shapes, through the JIT on the host ISA; every other
//! ISA this machine runs on a sample; and the ahead-of-time path (`.so` + manifest,
//! loaded by the runtime without LLVM).
//!
//! Inputs are fresh random numbers; the seed is printed (`EJC_TEST_SEED` replays).

mod common;
use common::{kernel, seed, spec, tol};
use ejc_codegen::cpu::{compile_object, jit::JitLibrary, Isa};
use ejc_codegen::{build, BuildOptions};
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::reference;
use ejc_ir::flash::FlashShape;
use ejc_ir::ir::GridExpr;
use ejc_ir::op::ParamSig;
use ejc_ir::spec::{Target, Variant};
use ejc_ir::tensor::compare;
use ejc_ir::types::DType;
use ejc_runtime::cpu::{CpuKernel, CpuLibrary};

/// s_q != s_k both ways, lengths that are not block multiples, GQA 8:2, MQA, one row.
const SHAPES: &[&str] = &["2,77,93,4,2,64", "1,45,21,2,1,64", "1,19,140,8,2,64", "2,29,29,4,1,64", "1,1,23,2,2,64"];

/// A kernel's parameters and grid, from its IR.
fn abi(k: &ejc_ir::ir::Kernel) -> (Vec<ParamSig>, [GridExpr; 3]) {
    (ParamSig::of_kernel(k), k.grid.clone())
}

#[allow(clippy::too_many_arguments)]
fn check(
    k: &CpuKernel,
    (params, grid): (Vec<ParamSig>, [GridExpr; 3]),
    v: &Variant,
    dtype: DType,
    shape: &str,
    seed: u64,
    label: &str,
) {
    let shape = FlashShape::parse(shape).unwrap();
    let f = &fx(v);
    let inputs = random_inputs(f, dtype, &shape, seed);
    let rt = default_runtime(f, &shape, seed);
    let want = reference(f, &rt, &inputs).unwrap();
    let (out, lse) =
        common::run_flash(k, params, grid, f, dtype, &inputs, &rt, 2).unwrap_or_else(|e| panic!("{label}: {e}"));
    for (what, g, w) in [("out", &out, &want.out), ("lse", &lse, &want.lse)] {
        let (rel, max_abs) = compare(&g.to_vec(), &w.to_vec());
        assert!(rel <= tol(dtype), "{label} {what} shape={shape} seed={seed}: rel_err={rel:e} max_abs_err={max_abs:e}");
    }
}

#[test]
fn every_variant_and_dtype_matches_the_reference_on_the_host_isa() {
    let spec = spec();
    let seed = seed();
    eprintln!("seed = {seed}");
    let isa = Isa::host();
    // One object for all kernels: one LLVM module, one JIT.
    let mut kernels = Vec::new();
    let mut cases = Vec::new();
    for v in &spec.variants {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let k = kernel(&spec, v, dtype, 64, 32, 32);
            cases.push((v, dtype, k.name.clone()));
            kernels.push(k);
        }
    }
    let obj = compile_object(&kernels, isa).unwrap();
    let jit = JitLibrary::load(&obj.object).unwrap();
    for (i, (v, dtype, name)) in cases.iter().enumerate() {
        let k = CpuKernel { entry: jit.entry(name).unwrap(), scratch_bytes: obj.kernels[i].scratch_bytes as usize };
        for (j, shape) in SHAPES.iter().enumerate() {
            check(&k, abi(&kernels[i]), v, *dtype, shape, seed + j as u64, &format!("{name} ({isa})"));
        }
    }
}

#[test]
fn head_dim_128_and_spec_tilings() {
    let spec = spec();
    let seed = seed();
    eprintln!("seed = {seed}");
    let mut kernels = Vec::new();
    let mut cases = Vec::new();
    for name in ["causal", "gemma2", "varlen_causal", "sinks"] {
        let v = spec.variant(name).unwrap();
        for (bm, bn) in common::tilings(&spec) {
            for dtype in [DType::F32, DType::BF16] {
                let k = kernel(&spec, v, dtype, 128, bm, bn);
                cases.push((v, dtype, k.name.clone()));
                kernels.push(k);
            }
        }
    }
    let obj = compile_object(&kernels, Isa::host()).unwrap();
    let jit = JitLibrary::load(&obj.object).unwrap();
    for (i, (v, dtype, name)) in cases.iter().enumerate() {
        let k = CpuKernel { entry: jit.entry(name).unwrap(), scratch_bytes: obj.kernels[i].scratch_bytes as usize };
        check(&k, abi(&kernels[i]), v, *dtype, "2,150,201,4,2,128", seed, name);
    }
}

#[test]
fn head_dims_96_192_256_and_192_128_every_variant() {
    // The larger head dims (FlashAttention-3's and cuDNN's 96, 192, 256, and 192 for q/k
    // with 128 for v) on every variant,
    // at the spec's CPU tiling for them (an override: 64 x 64), f32 and bf16, against the
    // reference on awkward sizes.
    let spec = spec();
    let seed = seed();
    eprintln!("seed = {seed}");
    let target = ejc_ir::spec::Target::Cpu(None);
    let mut kernels = Vec::new();
    let mut cases = Vec::new();
    // And q/k and v head dims apart (192/128, DeepSeek-V3's): the spec builds them.
    assert!(spec.key_points().contains(&ejc_ir::flash::key_set(192, 128)), "flash.yaml builds d 192 / dv 128");
    for (d, dv) in [(96u32, 96u32), (192, 192), (256, 256), (192, 128)] {
        for (i, v) in spec.variants.iter().enumerate() {
            // bf16 on every other variant: f32 on all of them.
            for dtype in [DType::F32, DType::BF16].into_iter().take(1 + (i % 2)) {
                let keys = ejc_ir::flash::key_set(d, dv);
                let sched = spec.schedule.resolve(Some(&target), dtype, &keys);
                let (bm, bn) = (sched.values("block_m")[0], sched.values("block_n")[0]);
                assert_eq!((sched.values("block_m").len(), sched.values("block_n").len()), (1, 1), "one CPU tiling");
                let dims = ejc_ir::flash::HeadDims { qk: d as usize, v: dv as usize };
                let k = kernel(&spec, v, dtype, dims, bm, bn);
                cases.push((v, dtype, (d, dv), k.name.clone()));
                kernels.push(k);
            }
        }
    }
    let obj = compile_object(&kernels, Isa::host()).unwrap();
    let jit = JitLibrary::load(&obj.object).unwrap();
    for (i, (v, dtype, (d, dv), name)) in cases.iter().enumerate() {
        let k = CpuKernel { entry: jit.entry(name).unwrap(), scratch_bytes: obj.kernels[i].scratch_bytes as usize };
        check(&k, abi(&kernels[i]), v, *dtype, &format!("2,70,83,4,2,{d},{dv}"), seed + i as u64, name);
    }
}

#[test]
fn every_isa_this_machine_runs() {
    let spec = spec();
    let seed = seed();
    eprintln!("seed = {seed}");
    let skipped: Vec<String> = Isa::ALL.into_iter().filter(|i| !i.runs_here()).map(|i| i.to_string()).collect();
    if !skipped.is_empty() {
        eprintln!("skipped (this CPU runs up to {}): {}", Isa::host_max(), skipped.join(", "));
    }
    for isa in Isa::ALL.into_iter().filter(|i| i.runs_here()) {
        let mut kernels = Vec::new();
        let mut cases = Vec::new();
        for name in ["full", "gemma2", "segment_ids", "dropout"] {
            let v = spec.variant(name).unwrap();
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let k = kernel(&spec, v, dtype, 64, 64, 32);
                cases.push((v, dtype, k.name.clone()));
                kernels.push(k);
            }
        }
        let obj = compile_object(&kernels, isa).unwrap();
        let jit = JitLibrary::load(&obj.object).unwrap();
        for (i, (v, dtype, name)) in cases.iter().enumerate() {
            let k = CpuKernel { entry: jit.entry(name).unwrap(), scratch_bytes: obj.kernels[i].scratch_bytes as usize };
            check(&k, abi(&kernels[i]), v, *dtype, "2,77,93,4,2,64", seed, &format!("{name} ({isa})"));
        }
    }
}

#[test]
fn ahead_of_time_library_through_the_manifest() {
    let spec = spec();
    let out = std::env::temp_dir().join(format!("ejc-cpu-aot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let opts = BuildOptions {
        out_dir: out.clone(),
        targets: vec![Target::Cpu(None)],
        variants: vec!["causal_window".into(), "mask".into()],
        dtypes: vec![DType::F32, DType::BF16],
        keys: [("head_dim".to_string(), vec![64])].into(),
        ..Default::default()
    };
    let report = build(&spec, &opts, &mut |_| {}).unwrap();
    assert_eq!(report.manifest.artifacts.len(), 2 * 2 * 6);
    // The runtime side: verified manifest, library loaded with libloading.
    let loaded = ejc_runtime::manifest::load(&out).unwrap();
    let seed = seed();
    let first = &loaded.manifest.artifacts[0];
    let lib = CpuLibrary::open(loaded.path_of(first)).unwrap();
    for a in &loaded.manifest.artifacts {
        assert!(a.target.starts_with("cpu:") && a.scratch_bytes > 0, "{}", a.artifact_id);
        let k = lib.kernel(&a.entry, a.scratch_bytes as usize).unwrap();
        let v = spec.variant(&a.instance.variant).unwrap();
        let dtype: DType = a.instance.dtype.parse().unwrap();
        let params = ejc_runtime::exec::param_sigs(&a.params).unwrap();
        let g: Vec<GridExpr> = a.grid.iter().map(|g| GridExpr::parse(g).unwrap()).collect();
        let grid = [g[0].clone(), g[1].clone(), g[2].clone()];
        check(&k, (params, grid), v, dtype, "2,130,111,4,2,64", seed, &a.artifact_id);
    }
    assert!(lib.kernel("no_such_kernel", 0).is_err());
    let _ = std::fs::remove_dir_all(&out);
}

/// Mean pooling (forward and backward × dense and varlen × f32 / bf16 / f16) compiled by
/// the CPU back end for the host ISA, against the reference on awkward shapes.
#[test]
fn mean_pooling_matches_the_reference() {
    use common::{pool_kernel, pool_kernels, pool_name, PoolCall, POOL_SHAPES};
    let seed = seed();
    eprintln!("seed = {seed}");
    let isa = Isa::host();
    let cases = pool_kernels(&[DType::F32, DType::BF16, DType::F16], 64, 16);
    let kernels: Vec<_> = cases.iter().map(pool_kernel).collect();
    let obj = compile_object(&kernels, isa).unwrap();
    let jit = JitLibrary::load(&obj.object).unwrap();
    for (i, (k, kernel)) in cases.iter().zip(&kernels).enumerate() {
        let name = pool_name(k);
        let ck = CpuKernel { entry: jit.entry(&name).unwrap(), scratch_bytes: obj.kernels[i].scratch_bytes as usize };
        for (j, &shape) in POOL_SHAPES.iter().enumerate() {
            let s = seed + j as u64;
            let mut call = PoolCall::new(kernel, k, shape, s);
            let tensors = call.tensors();
            // Safety: the tensors are the kernel's parameters, in order, inside their buffers.
            unsafe { ck.launch(&tensors, &call.scalars, call.grid, 2) }.unwrap_or_else(|e| panic!("{name}: {e}"));
            call.check(&format!("{name} ({isa}) seed={s}"));
        }
    }
}

/// A flash variant's features, typed.
#[allow(dead_code)]
fn fx(v: &ejc_ir::spec::Variant) -> ejc_ir::flash::Features {
    ejc_ir::flash::Features::from_json(&v.features).expect("flash features")
}

/// Split-KV (partial kernel, then combine kernel) through the CPU back end equals the
/// reference: every non-varlen variant, f32 and bf16, awkward shapes, one split to
/// more splits than key blocks (empty splits).
#[test]
fn split_kv_partial_then_combine_matches_the_reference() {
    use common::{check_split_kv, split_kv_kernels};
    let spec = spec();
    let seed = seed();
    eprintln!("seed = {seed}");
    let isa = Isa::host();
    let mut kernels = Vec::new();
    let mut cases = Vec::new();
    for v in spec.variants.iter().filter(|v| !fx(v).varlen) {
        for dtype in [DType::F32, DType::BF16] {
            let (p, c) = split_kv_kernels(&spec, v, dtype, 64, 32, 32);
            cases.push((v, dtype, kernels.len()));
            kernels.extend([p, c]);
        }
    }
    let obj = compile_object(&kernels, isa).unwrap();
    let jit = JitLibrary::load(&obj.object).unwrap();
    let cpu_kernel = |i: usize| CpuKernel {
        entry: jit.entry(&kernels[i].name).unwrap(),
        scratch_bytes: obj.kernels[i].scratch_bytes as usize,
    };
    for (v, dtype, i) in cases {
        let (partial, combine) = (cpu_kernel(i), cpu_kernel(i + 1));
        for (j, shape) in SHAPES.iter().enumerate() {
            for num_splits in [1, 2, 3, 7, 64] {
                let ks = [(&partial as _, &kernels[i]), (&combine as _, &kernels[i + 1])];
                check_split_kv(&spec, v, dtype, ks, shape, seed + j as u64, num_splits, 2);
            }
        }
    }
}

/// `cpu:amx`: bf16 products of whole tiles compile to AMX tile code (one tile
/// configuration, `tdpbf16ps`), products that do not fit (K = 48 is not a multiple of 32)
/// and f32 products to vector code; where this CPU has AMX they also run against the
/// reference (every variant, awkward shapes, both tile blockings: 1 x 2 and 2 x 2
/// accumulators). Other machines compile only, and say so.
#[test]
fn amx_kernels_use_tiles_and_match_the_reference_where_the_cpu_has_amx() {
    use ejc_codegen::cpu::assembly;
    let spec = spec();
    let full = spec.variant("full").unwrap();
    let asm = assembly(&[kernel(&spec, full, DType::BF16, 64, 64, 32)], Isa::Amx).unwrap();
    assert!(asm.contains("tdpbf16ps") && asm.contains("ldtilecfg") && asm.contains("tilerelease"), "no AMX code");
    let asm = assembly(&[kernel(&spec, full, DType::F32, 64, 64, 32)], Isa::Amx).unwrap();
    assert!(!asm.contains("tdpbf16ps") && asm.contains("vfmadd"), "f32 products on AMX tiles");
    let asm = assembly(&[kernel(&spec, full, DType::BF16, 48, 64, 48)], Isa::Amx).unwrap();
    assert!(!asm.contains("tdpbf16ps") && asm.contains("vfmadd"), "K = 48 is not whole AMX tiles");
    if !Isa::Amx.runs_here() {
        eprintln!(
            "skipped: running the AMX kernels (this CPU runs up to {}; {})",
            Isa::host_max(),
            ejc_ir::cpu_abi::enable_amx().err().unwrap_or_default()
        );
        return;
    }
    let seed = seed();
    eprintln!("seed = {seed}");
    let mut kernels = Vec::new();
    let mut cases = Vec::new();
    for v in &spec.variants {
        for (d, bm, bn) in [(64, 64, 32), (128, 128, 64)] {
            let k = kernel(&spec, v, DType::BF16, d, bm, bn);
            cases.push((v, d, k.name.clone()));
            kernels.push(k);
        }
    }
    let obj = compile_object(&kernels, Isa::Amx).unwrap();
    let jit = JitLibrary::load(&obj.object).unwrap();
    for (i, (v, d, name)) in cases.iter().enumerate() {
        let k = CpuKernel { entry: jit.entry(name).unwrap(), scratch_bytes: obj.kernels[i].scratch_bytes as usize };
        for shape in ["2,77,93,4,2,D", "1,1,23,2,2,D", "1,300,411,4,1,D"] {
            check(
                &k,
                abi(&kernels[i]),
                v,
                DType::BF16,
                &shape.replace('D', &d.to_string()),
                seed,
                &format!("{name} (amx)"),
            );
        }
    }
}

/// The generality cases (`tests/kernels/*.tir`: a transposed `a` from memory and from
/// registers, loops of three and four products) against the interpreter, on every ISA
/// this machine runs.
#[test]
fn the_kernel_suite_matches_the_interpreter() {
    use common::suite::{assert_matches, pipelined, run_host, suite};
    let seed = seed();
    eprintln!("seed = {seed}");
    let cases = suite();
    let kernels: Vec<_> = cases.iter().map(pipelined).collect();
    // One object per ISA holding each kernel once (cases share kernels).
    let mut unique: Vec<ejc_ir::ir::Kernel> = Vec::new();
    for k in &kernels {
        if !unique.iter().any(|u| u.name == k.name) {
            unique.push(k.clone());
        }
    }
    let mut failures = Vec::new();
    for isa in Isa::ALL.into_iter().filter(|i| i.runs_here()) {
        let obj = compile_object(&unique, isa).unwrap_or_else(|e| panic!("{isa}: {e}"));
        let jit = JitLibrary::load(&obj.object).unwrap();
        for (c, k) in cases.iter().zip(&kernels) {
            let i = unique.iter().position(|u| u.name == k.name).unwrap();
            let ck =
                CpuKernel { entry: jit.entry(&k.name).unwrap(), scratch_bytes: obj.kernels[i].scratch_bytes as usize };
            let args = c.args(k, seed).unwrap();
            // The interpreter runs the kernel as written, before the passes.
            let want = c.reference(&c.parse().unwrap(), &args).unwrap();
            let grid = c.grid(k).unwrap();
            // Safety: the tensors are the kernel's parameters, in order, inside their buffers.
            let got = run_host(k, &args, grid, |t, s, g| unsafe { ck.launch(t, s, g, 2) }.map_err(|e| e.to_string()))
                .unwrap_or_else(|e| panic!("{}: {e}", c.name));
            let label = format!("cpu ({isa}) seed={seed}");
            if let Err(e) = std::panic::catch_unwind(|| assert_matches(c, k, &got, &want, &label)) {
                failures.push(e.downcast_ref::<String>().cloned().unwrap_or_default());
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
