//! What the back-end test files share: the flash spec, the seed, DESIGN.md's tolerances
//! and a kernel after the pass pipeline.
#![allow(dead_code)] // each test binary uses its own subset

use ejc_ir::flash::build_kernel;
use ejc_ir::ir::Kernel;
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{self, Schedule, Spec, Variant};
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
    let k = build_kernel(spec, v, dtype, head_dim, &Schedule { block_m: bm, block_n: bn, num_warps: 0, num_stages: 0 })
        .unwrap();
    run_pipeline(&k, &default_pipeline()).unwrap()
}
