//! The MLIR back end: every variant of `specs/flash.yaml` translates to MLIR that MLIR's
//! verifier accepts (cpu and gpu forms); the cpu form, lowered by MLIR's pipelines and
//! run by its ExecutionEngine, matches the reference on fresh random inputs and awkward
//! shapes; the gpu form's PTX passes ptxas.
//!
//! Inputs are fresh random numbers; the seed is printed (`EJC_TEST_SEED` replays).

mod common;
use common::{kernel, seed, spec, tol};
use ejc_codegen::mlir::{self, exec::CpuKernel, Form, GpuOptions};
use ejc_codegen::ptx::{ptxas, Arch};
use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::reference;
use ejc_ir::flash::FlashShape;
use ejc_ir::ir::Kernel;
use ejc_ir::spec::Variant;
use ejc_ir::tensor::compare;
use ejc_ir::types::{DType, Type};
use rayon::prelude::*;

/// The MLIR CPU kernel, as the runtime's plan executor launches it.
fn check(k: &CpuKernel, ir: &Kernel, v: &Variant, dtype: DType, shape: &str, seed: u64) {
    let label = format!("{} shape={shape} seed={seed}", k.name);
    let shape = FlashShape::parse(shape).unwrap();
    let f = &fx(v);
    let inputs = random_inputs(f, dtype, &shape, seed);
    let rt = default_runtime(f, &shape, seed);
    let want = reference(f, &rt, &inputs).unwrap();
    let params = ejc_ir::op::ParamSig::of_kernel(ir);
    let (out, lse) = common::run_flash(k, params, ir.grid.clone(), f, dtype, &inputs, &rt, 2)
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    for (what, g, w) in [("out", &out, &want.out), ("lse", &lse, &want.lse)] {
        let (rel, max_abs) = compare(&g.to_vec(), &w.to_vec());
        assert!(rel <= tol(dtype), "{label} {what}: rel_err={rel:e} max_abs_err={max_abs:e}");
    }
}

#[test]
fn every_kernel_of_the_spec_translates_and_verifies_in_both_forms() {
    // All 720 tile programs of the MLIR targets: every variant x dtype x head dim x the
    // tilings of its schedule there (six at d 64/128, one at d 96/192/256: the spec's
    // overrides).
    let spec = spec();
    let target = ejc_ir::spec::Target::Mlir("cpu".into());
    let mut n = 0;
    for v in &spec.variants {
        for &dtype in &spec.dtypes {
            for keys in spec.key_points() {
                let d = keys["head_dim"] as usize;
                let schedule = spec.schedule.resolve(Some(&target), dtype, &keys);
                for &bm in schedule.values("block_m") {
                    for &bn in schedule.values("block_n") {
                        let k = kernel(&spec, v, dtype, d, bm, bn);
                        for form in [Form::Cpu, Form::Gpu { threads: 128 }] {
                            let (text, info) =
                                mlir::to_mlir(&k, form).unwrap_or_else(|e| panic!("{} ({form:?}): {e}", k.name));
                            assert!(text.contains(if form == Form::Cpu { "func.func" } else { "gpu.func" }));
                            assert!(info.scratch_bytes > 0);
                            n += 1;
                        }
                    }
                }
            }
        }
    }
    assert_eq!(n, 2 * 720);
}

#[test]
fn cpu_form_matches_the_reference_for_every_variant() {
    let spec = spec();
    let seed = seed();
    println!("seed {seed} (EJC_TEST_SEED replays)");
    let shapes = ["2,77,93,4,2,64", "1,19,140,8,2,64"];
    let cases: Vec<_> =
        spec.variants.iter().flat_map(|v| [DType::F32, DType::BF16, DType::F16].map(move |dtype| (v, dtype))).collect();
    // On every core: each case is an MLIR lowering and a JIT compilation.
    cases.par_iter().for_each(|&(v, dtype)| {
        let k = kernel(&spec, v, dtype, 64, 64, 32);
        let ck = CpuKernel::compile(&k).unwrap_or_else(|e| panic!("{e}"));
        for s in shapes {
            check(&ck, &k, v, dtype, s, seed);
        }
    });
}

#[test]
fn cpu_form_matches_the_reference_on_every_tiling_at_head_dim_128() {
    let spec = spec();
    let seed = seed();
    println!("seed {seed} (EJC_TEST_SEED replays)");
    let cases: Vec<_> = ["causal", "varlen_causal", "sinks"]
        .into_iter()
        .flat_map(|name| common::tilings(&spec).into_iter().map(move |t| (name, t)))
        .collect();
    cases.par_iter().for_each(|&(name, (bm, bn))| {
        let v = spec.variant(name).unwrap();
        let k = kernel(&spec, v, DType::BF16, 128, bm, bn);
        let ck = CpuKernel::compile(&k).unwrap_or_else(|e| panic!("{e}"));
        check(&ck, &k, v, DType::BF16, "2,150,131,4,2,128", seed);
    });
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
    let cases: Vec<_> = spec
        .variants
        .iter()
        .flat_map(|v| [(DType::BF16, 64), (DType::F16, 128), (DType::F32, 64)].map(move |(dtype, d)| (v, dtype, d)))
        .flat_map(|(v, dtype, d)| [Arch::Sm80, Arch::Sm90a].map(move |arch| (v, dtype, d, arch)))
        .collect();
    // On every core: each case runs MLIR's NVVM pipeline and ptxas (seconds).
    cases.par_iter().for_each(|&(v, dtype, d, arch)| {
        let k = kernel(&spec, v, dtype, d, 64, 32);
        let opts = GpuOptions { chip: arch.name().into(), threads: 128 };
        let p = mlir::compile_gpu(&k, opts).unwrap_or_else(|e| panic!("{} ({arch}): {e}", k.name));
        assert!(p.ptx.contains(".visible .entry entry("), "{}: no entry", k.name);
        assert!(p.ptx.contains(&format!(".target {}", arch.name())), "{}", k.name);
        assert!(!p.ptx.contains(".extern .func"), "{}: unresolved functions (libdevice not linked)", k.name);
        let r = ptxas(&tool, &p.ptx, arch).unwrap_or_else(|e| panic!("{} ({arch}): {e}", k.name));
        assert!(r.registers > 0, "{}: {r:?}", k.name);
    });
    let checked = cases.len();
    eprintln!("{checked} MLIR-generated PTX files assembled by ptxas");
}

/// A kernel that uses every op family the flash kernels do not (or not in these
/// shapes): rank-1 and broadcast operands, reductions along both axes, products with
/// either operand transposed, integer bit operations on u32, casts, a loop carrying a
/// tile and a scalar, an `if` yielding a tile, Philox uniforms, and a scalar store.
fn ops_kernel() -> Kernel {
    use ejc_ir::builder::KernelBuilder;
    use ejc_ir::ir::{BinOp, CmpPred, GridExpr, ReduceOp, UnOp};
    let mut b = KernelBuilder::new("ops");
    let x = b.param("x", Type::Tensor(DType::F32, 2));
    let w = b.param("w", Type::Tensor(DType::BF16, 2));
    let out = b.param("out", Type::Tensor(DType::F32, 2));
    let bits = b.param("bits", Type::Tensor(DType::U32, 2));
    let rows = b.param("rows", Type::Tensor(DType::F32, 1));
    let s = b.param("s", Type::Scalar(DType::F32));
    let seed = b.param("seed", Type::Scalar(DType::U32));
    b.set_grid([GridExpr::cdiv(GridExpr::sym("n"), 8), GridExpr::Const(1), GridExpr::Const(1)]);
    let pid = b.program_id(0);
    let c8 = b.const_i32(8);
    let c0 = b.const_i32(0);
    let r0 = b.mul(pid, c8);
    let n = b.dim(x, 0);
    let xt = b.load(x, vec![b.range(r0, 8, Some(n)), b.range(c0, 16, None)], 0.0);
    let wt = b.load(w, vec![b.range(c0, 16, None), b.range(c0, 8, None)], 0.0);
    let xb = b.cast(xt, DType::BF16);
    let acc0 = b.full(0.0, DType::F32, &[8, 8]);
    let d1 = b.dot(xb, wt, acc0, false, false);
    let d2 = b.dot(xb, xb, acc0, false, true);
    let d3 = b.dot(wt, wt, acc0, true, false);
    let t = b.mul(d2, s);
    let sum = b.add(d1, t);
    let sum = b.add(sum, d3);
    let rmax = b.reduce(ReduceOp::Max, sum, 1);
    let cmin = b.reduce(ReduceOp::Min, sum, 0);
    let e = b.expand_dims(rmax, 1);
    let f = b.expand_dims(cmin, 0);
    let z = b.sub(sum, e);
    let z = b.add(z, f);
    let tenth = b.const_f32(0.1);
    let zz = b.mul(z, tenth);
    let z2 = b.unary(UnOp::Exp2, zz);
    let th = b.unary(UnOp::Tanh, zz);
    let ab = b.unary(UnOp::Abs, zz);
    let one = b.const_f32(1.0);
    let ab1 = b.add(ab, one);
    let lg = b.unary(UnOp::Log2, ab1);
    let rs = b.unary(UnOp::Rsqrt, ab1);
    let sq = b.unary(UnOp::Sqrt, ab1);
    let ex = b.unary(UnOp::Exp, th);
    let ln = b.unary(UnOp::Log, ab1);
    let mut acc = b.add(z2, lg);
    for v in [rs, sq, ex, ln] {
        acc = b.add(acc, v);
    }
    // A loop carrying a tile and a scalar; an if yielding a tile.
    let c3 = b.const_i32(3);
    let c1 = b.const_i32(1);
    let fin = b.for_loop(c0, c3, c1, &[acc, s], |b, iv, carried| {
        let k = b.cast(iv, DType::F32);
        let kk = b.mul(k, carried[1]);
        let a2 = b.add(carried[0], kk);
        let h = b.const_f32(0.5);
        let s2 = b.mul(carried[1], h);
        vec![a2, s2]
    });
    let is0 = b.cmp(CmpPred::Eq, pid, c0);
    let ty = b.ty(fin[0]).clone();
    let picked = b.if_else(is0, &[ty], |b| vec![b.unary(UnOp::Neg, fin[0])], |_| vec![fin[0]]);
    b.store(out, vec![b.range(r0, 8, Some(n)), b.range(c0, 8, None)], picked[0]);
    // u32 bit mixing over a broadcast index tile.
    let ar8 = b.arange(8);
    let rid = b.add(ar8, r0);
    let rid = b.expand_dims(rid, 1);
    let ar16 = b.arange(16);
    let cid = b.expand_dims(ar16, 0);
    let c16 = b.const_i32(16);
    let lin = b.mul(rid, c16);
    let lin = b.add(lin, cid);
    let lin = b.broadcast(lin, &[8, 16]);
    let u = b.cast(lin, DType::U32);
    let mulc = b.constant(2654435761.0, DType::U32);
    let h = b.mul(u, mulc);
    let hi = b.binary(BinOp::MulHi, h, seed);
    let c3u = b.constant(3.0, DType::U32);
    let sh = b.binary(BinOp::Shl, u, c3u);
    let mix = b.binary(BinOp::Xor, hi, sh);
    let c7u = b.constant(7.0, DType::U32);
    let rem = b.binary(BinOp::Rem, mix, c7u);
    let c1u = b.constant(1.0, DType::U32);
    let shr = b.binary(BinOp::Shr, mix, c1u);
    let both = b.binary(BinOp::Or, shr, rem);
    b.store(bits, vec![b.range(r0, 8, Some(n)), b.range(c0, 16, None)], both);
    // Philox uniforms choose a sign per element; row sums go to a rank-1 tensor.
    let zero_u = b.constant(0.0, DType::U32);
    let uni = b.rand_uniform(seed, zero_u, c0, c1, r0, c0, &[8, 16]);
    let half = b.const_f32(0.5);
    let keep = b.cmp(CmpPred::Lt, uni, half);
    let neg = b.unary(UnOp::Neg, xt);
    let signed = b.select(keep, xt, neg);
    let rsum = b.reduce(ReduceOp::Sum, signed, 1);
    b.store(rows, vec![b.range(r0, 8, Some(n))], rsum);
    // A scalar reduction stored at one element: the program's own first row, which no
    // other program writes (at one shared element, two programs running on two threads
    // raced, and the result depended on which finished last).
    let total = b.reduce(ReduceOp::Sum, rsum, 0);
    b.store(rows, vec![b.index(r0)], total);
    b.finish().unwrap()
}

#[test]
fn generic_ops_match_the_interpreter() {
    use ejc_ir::interp::{launch, Arg};
    use ejc_ir::tensor::HostTensor;
    use ejc_runtime::cpu::{scalar_slot, HostBuffer};
    use rand::{Rng, SeedableRng};
    let seed = seed();
    println!("seed {seed} (EJC_TEST_SEED replays)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let k = ops_kernel();
    let n = 13; // two programs, the second one cut at row 13
    let mut normal = |len: usize| (0..len).map(|_| rng.random_range(-2.0..2.0)).collect::<Vec<f64>>();
    let x = HostTensor::from_vec(DType::F32, &[n, 16], normal(n * 16));
    let w = HostTensor::from_vec(DType::BF16, &[16, 8], normal(128));
    let (s, seed_u) = (0.37, (seed % 4_000_000_000) as f64);
    let outs = [
        HostTensor::zeros(DType::F32, &[n, 8]),
        HostTensor::zeros(DType::U32, &[n, 16]),
        HostTensor::zeros(DType::F32, &[n]),
    ];
    let mut args = vec![Arg::Tensor(x.clone()), Arg::Tensor(w.clone())];
    args.extend(outs.iter().cloned().map(Arg::Tensor));
    args.extend([Arg::Scalar(s), Arg::Scalar(seed_u)]);
    launch(&k, &mut args, [2, 1, 1]).unwrap();
    let ck = CpuKernel::compile(&k).unwrap_or_else(|e| panic!("{e}"));
    let mut bufs: Vec<HostBuffer> = [&x, &w].into_iter().chain(outs.iter()).map(HostBuffer::from_host).collect();
    let tensors: Vec<_> = bufs.iter_mut().map(|b| b.abi()).collect();
    let scalars = [scalar_slot(DType::F32, s), scalar_slot(DType::U32, seed_u)];
    unsafe { ck.launch(&tensors, &scalars, [2, 1, 1], 2) }.unwrap();
    for (i, name) in [(2, "out"), (3, "bits"), (4, "rows")] {
        let want = args[i].tensor().unwrap().to_vec();
        let got = bufs[i].to_host().to_vec();
        assert!(want.iter().filter(|x| **x != 0.0).count() > want.len() / 2, "{name}: a trivial reference");
        if name == "bits" {
            assert_eq!(got, want, "{name} (seed {seed})");
        } else {
            let (rel, max_abs) = compare(&got, &want);
            assert!(rel <= 1e-5, "{name} (seed {seed}): rel_err={rel:e} max_abs_err={max_abs:e}");
        }
    }
}

macro_rules! snapshot {
    ($name:expr, $text:expr) => {
        insta::with_settings!({snapshot_path => concat!(env!("CARGO_MANIFEST_DIR"), "/../snapshots"), prepend_module_to_snapshot => false}, {
            insta::assert_snapshot!($name, $text);
        });
    };
}

#[test]
fn translated_modules_snapshots() {
    let k = ops_kernel();
    snapshot!("mlir__ops_cpu", mlir::to_mlir(&k, Form::Cpu).unwrap().0);
    snapshot!("mlir__ops_gpu", mlir::to_mlir(&k, Form::Gpu { threads: 128 }).unwrap().0);
    let spec = spec();
    let causal = spec.variant("causal").unwrap();
    let k = kernel(&spec, causal, DType::BF16, 64, 64, 32);
    snapshot!("mlir__flash_causal_bf16_d64_m64_n32_cpu", mlir::to_mlir(&k, Form::Cpu).unwrap().0);
}

#[test]
fn compiled_code_is_cached_on_disk() {
    let dir = std::env::temp_dir().join(format!("ejc-mlir-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let spec = spec();
    let v = spec.variant("softcap").unwrap();
    let k = kernel(&spec, v, DType::F32, 64, 64, 32);
    let cold = CpuKernel::compile_in(&k, &dir).unwrap();
    assert!(!cold.cached);
    let warm = CpuKernel::compile_in(&k, &dir).unwrap();
    assert!(warm.cached, "the second compile must come from {}", dir.display());
    println!("cold {:.3}s, warm {:.3}s", cold.compile_seconds, warm.compile_seconds);
    check(&warm, &k, v, DType::F32, "1,70,90,4,2,64", seed());
    // One changed byte (a patched constant, a flipped bit) fails the entry's SHA-256: it is
    // compiled again, not loaded.
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 0x01;
        std::fs::write(&path, bytes).unwrap();
    }
    let patched = CpuKernel::compile_in(&k, &dir).unwrap();
    assert!(!patched.cached, "a patched object must not be loaded");
    check(&patched, &k, v, DType::F32, "1,70,90,4,2,64", seed());
    assert!(CpuKernel::compile_in(&k, &dir).unwrap().cached, "and the entry is written again");
    // A damaged entry is recompiled, not trusted.
    for e in std::fs::read_dir(&dir).unwrap() {
        std::fs::write(e.unwrap().path(), b"not an object").unwrap();
    }
    let again = CpuKernel::compile_in(&k, &dir).unwrap();
    assert!(!again.cached);
    check(&again, &k, v, DType::F32, "1,70,90,4,2,64", seed());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Mean pooling (forward and backward × dense and varlen × f32 / bf16) through MLIR's
/// CPU path, against the reference on awkward shapes.
#[test]
fn mean_pooling_cpu_form_matches_the_reference() {
    use common::{pool_kernel, pool_kernels, pool_name, PoolCall, POOL_SHAPES};
    let seed = seed();
    println!("seed {seed} (EJC_TEST_SEED replays)");
    for k in pool_kernels(&[DType::F32, DType::BF16], 64, 16) {
        let kernel = pool_kernel(&k);
        let name = pool_name(&k);
        let ck = CpuKernel::compile(&kernel).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (j, &shape) in POOL_SHAPES.iter().enumerate() {
            let s = seed + j as u64;
            let mut call = PoolCall::new(&kernel, &k, shape, s);
            let tensors = call.tensors();
            // Safety: the tensors are the kernel's parameters, in order, inside their buffers.
            unsafe { ck.launch(&tensors, &call.scalars, call.grid, 2) }.unwrap_or_else(|e| panic!("{name}: {e}"));
            call.check(&format!("{name} (mlir cpu) seed={s}"));
        }
    }
}

/// Mean pooling's gpu form: PTX that ptxas accepts, for sm_80 and sm_90a.
#[test]
fn mean_pooling_gpu_form_passes_ptxas() {
    use common::{pool_kernel, pool_kernels, pool_name};
    let Some(tool) = ejc_codegen::ptx::find_ptxas() else {
        eprintln!("skipped: no ptxas (run scripts/setup.sh or set EJC_PTXAS)");
        return;
    };
    if mlir::find_libdevice().is_none() {
        eprintln!("skipped: no libdevice.10.bc beside ptxas (run scripts/setup.sh or set EJC_LIBDEVICE)");
        return;
    }
    for k in pool_kernels(&[DType::BF16, DType::F32], 64, 16) {
        let kernel = pool_kernel(&k);
        let name = pool_name(&k);
        for arch in [Arch::Sm80, Arch::Sm90a] {
            let p = mlir::compile_gpu(&kernel, GpuOptions { chip: arch.name().into(), threads: 128 })
                .unwrap_or_else(|e| panic!("{name} ({arch}): {e}"));
            assert!(p.ptx.contains(".visible .entry entry("), "{name}: no entry");
            ptxas(&tool, &p.ptx, arch).unwrap_or_else(|e| panic!("{name} ({arch}): {e}"));
        }
    }
}

/// A flash variant's features, typed.
#[allow(dead_code)]
fn fx(v: &ejc_ir::spec::Variant) -> ejc_ir::flash::Features {
    ejc_ir::flash::Features::from_json(&v.features).expect("flash features")
}

/// Split-KV (partial kernel, then combine kernel) through the MLIR CPU form equals the
/// reference: every non-varlen variant, f32 and bf16, one split to more splits than
/// key blocks (empty splits). The partial kernel's `o_partial` is a rank-5 tensor.
#[test]
fn cpu_form_runs_split_kv_partial_then_combine() {
    use common::{check_split_kv, split_kv_kernels};
    let spec = spec();
    let seed = seed();
    println!("seed {seed} (EJC_TEST_SEED replays)");
    let cases: Vec<_> = spec
        .variants
        .iter()
        .filter(|v| !fx(v).varlen)
        .flat_map(|v| [DType::F32, DType::BF16].map(move |dtype| (v, dtype)))
        .collect();
    cases.par_iter().for_each(|&(v, dtype)| {
        let (p, c) = split_kv_kernels(&spec, v, dtype, 64, 64, 32);
        let partial = CpuKernel::compile(&p).unwrap_or_else(|e| panic!("{e}"));
        let combine = CpuKernel::compile(&c).unwrap_or_else(|e| panic!("{e}"));
        for shape in ["2,77,93,4,2,64", "1,1,23,2,2,64", "1,19,140,8,2,64"] {
            for num_splits in [1, 3, 64] {
                let ks = [(&partial as _, &p), (&combine as _, &c)];
                check_split_kv(&spec, v, dtype, ks, shape, seed, num_splits, 2);
            }
        }
    });
}

/// The generality cases (`tests/kernels/*.tir`) in MLIR's CPU form against the
/// interpreter.
#[test]
fn the_kernel_suite_matches_the_interpreter() {
    use common::suite::{assert_matches, pipelined, run_host, suite};
    let seed = seed();
    eprintln!("seed = {seed}");
    for c in suite() {
        let k = pipelined(&c);
        let ck = CpuKernel::compile(&k).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let args = c.args(&k, seed).unwrap();
        // The interpreter runs the kernel as written, before the passes.
        let want = c.reference(&c.parse().unwrap(), &args).unwrap();
        let grid = c.grid(&k).unwrap();
        // Safety: the tensors are the kernel's parameters, in order, inside their buffers.
        let got = run_host(&k, &args, grid, |t, s, g| unsafe { ck.launch(t, s, g, 2) }.map_err(|e| e.to_string()))
            .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        assert_matches(&c, &k, &got, &want, &format!("mlir:cpu seed={seed}"));
    }
}
