//! What the back-end test files share: the flash spec, the seed, DESIGN.md's tolerances,
//! a kernel after the pass pipeline, and mean-pooling kernels with their calls.
#![allow(dead_code)] // each test binary uses its own subset

pub mod suite;

use ejc_ir::flash::main_kernel;
use ejc_ir::ir::Kernel;
use ejc_ir::ops::mean_pooling::kernels::{build as build_pool, PoolKernel};
use ejc_ir::ops::mean_pooling::reference::{
    grid_symbols, random_inputs, reference_bwd, reference_fwd, PoolInputs, PoolShape,
};
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{self, Spec, Variant};
use ejc_ir::tensor::{compare, HostTensor};
use ejc_ir::types::DType;
use ejc_runtime::cpu::{scalar_slot, HostBuffer};

pub fn spec() -> Spec {
    spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash.yaml")).unwrap()
}

/// `specs/flash_decode.yaml`: the variants shipped with the `split_kv` plan.
pub fn decode_spec() -> Spec {
    spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash_decode.yaml")).unwrap()
}

/// Fresh unless `EJC_TEST_SEED` replays one.
pub fn seed() -> u64 {
    std::env::var("EJC_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    })
}

/// DESIGN.md's tolerances on ||out - ref|| / ||ref||.
pub fn tol(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-5,
        DType::F16 => 5e-3,
        _ => 1e-2,
    }
}

/// The tile IR of `v` at a tiling, after the pass pipeline.
pub fn kernel(
    spec: &Spec,
    v: &Variant,
    dtype: DType,
    head_dim: impl Into<ejc_ir::flash::HeadDims>,
    bm: u32,
    bn: u32,
) -> Kernel {
    let k = main_kernel(spec, v, dtype, head_dim, bm, bn).unwrap();
    run_pipeline(&k, &default_pipeline()).unwrap()
}

// ---- mean pooling (ejc_ir::ops::mean_pooling) ----

/// (batch, seq, heads, head_dim, chunk): T not a multiple of C, C = 1, C > T, H not a
/// multiple of the head block (and H = 1), several head blocks, a chunk size near
/// i32's maximum; varlen reads `batch` as the number of sequences (from 3 on, one of
/// them is empty).
pub const POOL_SHAPES: &[(usize, usize, usize, usize, usize)] = &[
    (2, 13, 5, 64, 4),
    (2, 7, 3, 64, 1),
    (3, 5, 2, 64, 8),
    (1, 20, 1, 64, 6),
    (5, 9, 20, 64, 4),
    (4, 30, 17, 64, 7),
    (3, 6, 2, 64, 2_000_000_000),
];

/// A mean-pooling kernel's name: its id as a C identifier.
pub fn pool_name(k: &PoolKernel) -> String {
    format!(
        "mean_pooling_{}{}_{}_d{}_h{}",
        if k.backward { "bwd" } else { "fwd" },
        if k.varlen { "_varlen" } else { "" },
        k.dtype,
        k.head_dim,
        k.block_h
    )
}

/// The tile IR of a mean-pooling kernel after the pass pipeline.
pub fn pool_kernel(k: &PoolKernel) -> Kernel {
    let name = pool_name(k);
    let built = build_pool(&name, k).unwrap_or_else(|e| panic!("{name}: {e}"));
    run_pipeline(&built, &default_pipeline()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// One mean-pooling call in the CPU ABI's form: fresh random inputs (seed `seed`), the
/// output buffer filled with NaN (an element no program writes fails), the scalar
/// `chunk_size`, the grid, and the reference output.
pub struct PoolCall {
    pub inputs: PoolInputs,
    pub input: HostBuffer,
    pub output: HostBuffer,
    pub cu_seqlens: Option<HostBuffer>,
    pub scalars: Vec<u64>,
    pub grid: [i64; 3],
    pub want: HostTensor,
}

impl PoolCall {
    pub fn new(kernel: &Kernel, k: &PoolKernel, shape: (usize, usize, usize, usize, usize), seed: u64) -> PoolCall {
        let (batch, seq, heads, head_dim, chunk) = shape;
        let shape = PoolShape { batch, seq, heads, head_dim, chunk };
        let inputs = random_inputs(k.backward, k.varlen, k.dtype, &shape, seed);
        let cu = inputs.cu_seqlens.as_ref();
        let (tokens, want) = if k.backward {
            (inputs.out_shape.clone(), reference_bwd(&inputs.input, cu, chunk, &inputs.out_shape).unwrap())
        } else {
            (inputs.input.shape.clone(), reference_fwd(&inputs.input, cu, chunk).unwrap())
        };
        let syms = grid_symbols(&tokens, cu, chunk);
        let lookup = |s: &str| syms.iter().find(|(n, _)| *n == s).map(|(_, v)| *v);
        let mut grid = [0i64; 3];
        for (i, e) in kernel.grid.iter().enumerate() {
            grid[i] = e.eval(&lookup).unwrap();
        }
        PoolCall {
            input: HostBuffer::from_host(&inputs.input),
            output: HostBuffer::from_host(&HostTensor::full(k.dtype, &inputs.out_shape, f64::NAN)),
            cu_seqlens: inputs.cu_seqlens.as_ref().map(HostBuffer::from_host),
            scalars: vec![scalar_slot(DType::I32, chunk as f64)],
            grid,
            want,
            inputs,
        }
    }

    /// The tensor arguments in ABI order (the pointers live as long as `self`).
    pub fn tensors(&mut self) -> Vec<ejc_ir::cpu_abi::EjcTensor> {
        let mut t = vec![self.input.abi(), self.output.abi()];
        t.extend(self.cu_seqlens.as_mut().map(|c| c.abi()));
        t
    }

    /// The output against the reference, with DESIGN.md's tolerance.
    pub fn check(&self, label: &str) {
        let got = self.output.to_host().to_vec();
        let (rel, max_abs) = compare(&got, &self.want.to_vec());
        let cu = self.inputs.cu_seqlens.as_ref().map(|c| c.to_vec());
        assert!(
            rel <= tol(self.want.dtype),
            "{label}: input {:?} cu_seqlens {cu:?}: rel_err={rel:e} max_abs_err={max_abs:e}",
            self.inputs.input.shape
        );
    }
}

/// Every mean-pooling kernel: forward and backward × dense and varlen × `dtypes`.
pub fn pool_kernels(dtypes: &[DType], head_dim: usize, block_h: usize) -> Vec<PoolKernel> {
    let mut out = Vec::new();
    for backward in [false, true] {
        for varlen in [false, true] {
            for &dtype in dtypes {
                out.push(PoolKernel { backward, varlen, dtype, head_dim, block_h });
            }
        }
    }
    out
}

/// Run one host kernel (parameters `params`, grid `grid`) on a flash call made from
/// `inputs` and `rt`, through the runtime's plan executor; the call's `out` and `lse`.
pub fn run_flash(
    launch: &dyn ejc_runtime::exec::HostLaunch,
    params: Vec<ejc_ir::op::ParamSig>,
    grid: [ejc_ir::ir::GridExpr; 3],
    f: &ejc_ir::flash::Features,
    dtype: DType,
    inputs: &ejc_ir::flash::FlashInputs,
    rt: &ejc_ir::flash::FlashRuntime,
    threads: usize,
) -> Result<(ejc_ir::tensor::HostTensor, ejc_ir::tensor::HostTensor), String> {
    use ejc_ir::op::Operation;
    let host = ejc_ir::flash::op::host_call(f, rt, inputs);
    let op = &ejc_ir::flash::op::FlashAttentionFwd;
    let keys = ejc_ir::flash::key_set(inputs.q.shape[3] as u32, inputs.v.shape[3] as u32);
    let sizes = op.validate(&f.to_json(), dtype, &keys, &host)?;
    let mut call = ejc_runtime::call::Call::from_host(&host);
    let spec = ejc_runtime::exec::HostLaunchSpec {
        kernel: launch,
        params,
        grid,
        launch: ejc_ir::manifest::Launch::of("main"),
    };
    let mut plan = ejc_runtime::exec::HostPlan::new(&[spec], &[], &call, &sizes, &Default::default())
        .map_err(|e| e.to_string())?;
    plan.run(&mut call, threads).map_err(|e| e.to_string())?;
    Ok((call.host_tensor("out").unwrap(), call.host_tensor("lse").unwrap()))
}

/// The spec's (block_m, block_n) tilings.
pub fn tilings(spec: &Spec) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    for &m in spec.schedule.values("block_m") {
        for &n in spec.schedule.values("block_n") {
            out.push((m, n));
        }
    }
    out
}

// ---- split-KV flash attention (the `split_kv` plan) ----

/// The test spec with a `num_splits` axis, so that flash offers its `split_kv` plan.
pub fn split_spec(spec: &Spec) -> Spec {
    let mut s = spec.clone();
    s.schedule.axes.push(("num_splits".into(), vec![1]));
    s
}

/// Flash's `split_kv` plan for variant `v`.
pub fn split_plan(spec: &Spec, v: &Variant) -> ejc_ir::op::PlanDecl {
    use ejc_ir::op::Operation;
    ejc_ir::flash::op::FlashAttentionFwd
        .plans(&split_spec(spec), &v.features)
        .into_iter()
        .find(|p| p.name == "split_kv")
        .unwrap_or_else(|| panic!("{}: no split_kv plan", v.name))
}

/// The two kernels of split-KV (partial, combine) at a tiling, named and built as `ejc
/// build` builds them, after the pass pipeline.
pub fn split_kv_kernels(spec: &Spec, v: &Variant, dtype: DType, head_dim: usize, bm: u32, bn: u32) -> (Kernel, Kernel) {
    use ejc_ir::op::{Config, KernelInstance, Keys, Operation};
    let op = &ejc_ir::flash::op::FlashAttentionFwd;
    let s = split_spec(spec);
    let plan = split_plan(spec, v);
    let mut built = Vec::new();
    for role in &plan.roles {
        let mut tile = Config::from([("block_m".to_string(), bm), ("block_n".to_string(), bn)]);
        tile.retain(|a, _| role.tile_axes.contains(&a.as_str()));
        tile.extend(role.fixed.clone());
        let mut k = KernelInstance {
            id: String::new(),
            variant: v,
            dtype,
            keys: Keys::from([("head_dim".to_string(), head_dim as u32)]),
            role: role.name,
            tile,
        };
        k.id = op.kernel_id(&s.name, &k);
        let kernel = op.build(&s, &k).unwrap_or_else(|e| panic!("{}: {e}", k.id));
        built.push(run_pipeline(&kernel, &default_pipeline()).unwrap_or_else(|e| panic!("{}: {e}", k.id)));
    }
    let c = built.pop().unwrap();
    (built.pop().unwrap(), c)
}

/// Run split-KV (the partial kernel, then the combine kernel) through the runtime's plan
/// executor with host launches of both kernels, on fresh random inputs of `shape`, and
/// compare `out` and `lse` with the reference.
#[allow(clippy::too_many_arguments)]
pub fn check_split_kv(
    spec: &Spec,
    v: &Variant,
    dtype: DType,
    kernels: [(&dyn ejc_runtime::exec::HostLaunch, &Kernel); 2],
    shape: &str,
    seed: u64,
    num_splits: u32,
    threads: usize,
) {
    use ejc_ir::op::{Config, Keys, Operation, ParamSig};
    let f = ejc_ir::flash::Features::from_json(&v.features).unwrap();
    let label = format!("{} {dtype} shape={shape} num_splits={num_splits} seed={seed}", kernels[0].1.name);
    let problem = ejc_ir::flash::FlashShape::parse(shape).unwrap();
    let inputs = ejc_ir::flash::inputs::random_inputs(&f, dtype, &problem, seed);
    let rt = ejc_ir::flash::inputs::default_runtime(&f, &problem, seed);
    let want = ejc_ir::flash::reference::reference(&f, &rt, &inputs).unwrap();
    let host = ejc_ir::flash::op::host_call(&f, &rt, &inputs);
    let op = &ejc_ir::flash::op::FlashAttentionFwd;
    let keys = Keys::from([("head_dim".to_string(), inputs.q.shape[3] as u32)]);
    let sizes = op.validate(&v.features, dtype, &keys, &host).unwrap_or_else(|e| panic!("{label}: {e}"));
    let plan = split_plan(spec, v);
    let specs: Vec<_> = kernels
        .iter()
        .zip(&plan.launches)
        .map(|((launch, ir), l)| ejc_runtime::exec::HostLaunchSpec {
            kernel: *launch,
            params: ParamSig::of_kernel(ir),
            grid: ir.grid.clone(),
            launch: l.clone(),
        })
        .collect();
    let config = Config::from([("num_splits".to_string(), num_splits)]);
    let mut call = ejc_runtime::call::Call::from_host(&host);
    let mut run = ejc_runtime::exec::HostPlan::new(&specs, &plan.temporaries, &call, &sizes, &config)
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    run.run(&mut call, threads).unwrap_or_else(|e| panic!("{label}: {e}"));
    for (what, w) in [("out", &want.out), ("lse", &want.lse)] {
        let g = call.host_tensor(what).unwrap();
        let (rel, max_abs) = compare(&g.to_vec(), &w.to_vec());
        assert!(rel <= tol(dtype), "{label} {what}: rel_err={rel:e} max_abs_err={max_abs:e}");
    }
}
