//! What the back-end test files share: the flash spec, the seed, DESIGN.md's tolerances
//! and a kernel after the pass pipeline.
#![allow(dead_code)] // each test binary uses its own subset

use ejc_ir::flash::main_kernel;
use ejc_ir::ir::Kernel;
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{self, Spec, Variant};
use ejc_ir::types::DType;

pub fn spec() -> Spec {
    spec::load_file(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash.yaml")).unwrap()
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
pub fn kernel(spec: &Spec, v: &Variant, dtype: DType, head_dim: usize, bm: u32, bn: u32) -> Kernel {
    let k = main_kernel(spec, v, dtype, head_dim, bm, bn).unwrap();
    run_pipeline(&k, &default_pipeline()).unwrap()
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

/// The spec's head dims.
pub fn head_dims(spec: &Spec) -> Vec<usize> {
    spec.key_values("head_dim").iter().map(|d| *d as usize).collect()
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
    let keys = ejc_ir::op::Keys::from([("head_dim".to_string(), inputs.q.shape[3] as u32)]);
    let sizes = op.validate(&f.to_json(), dtype, &keys, &host)?;
    let mut call = ejc_runtime::call::Call::from_host(&host);
    let spec = ejc_runtime::exec::HostLaunchSpec {
        kernel: launch,
        params,
        grid,
        launch: ejc_ir::manifest::Launch { role: "main".into(), bind: Default::default() },
    };
    let mut plan = ejc_runtime::exec::HostPlan::new(&[spec], &[], &call, &sizes, &Default::default())
        .map_err(|e| e.to_string())?;
    plan.run(&mut call, threads).map_err(|e| e.to_string())?;
    Ok((call.host_tensor("out").unwrap(), call.host_tensor("lse").unwrap()))
}
