//! Snapshots of the tile IR that `specs/flash.yaml` produces: one per variant at one
//! schedule point, and the printed IR after each pass of the default pipeline on one
//! kernel. A change here is reviewed, never accepted blindly (`cargo insta review`).

use ejc_ir::flash::main_kernel;
use ejc_ir::passes::{default_pipeline, run_pipeline_with};
use ejc_ir::print::print_kernel;
use ejc_ir::spec::{self, Spec};
use ejc_ir::types::DType;

fn spec() -> Spec {
    // The file label must not depend on the machine: snapshots record it.
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/flash.yaml")).unwrap();
    spec::load_str("specs/flash.yaml", &text).unwrap()
}

macro_rules! snap {
    ($name:expr, $text:expr) => {
        insta::with_settings!({snapshot_path => concat!(env!("CARGO_MANIFEST_DIR"), "/../snapshots"), prepend_module_to_snapshot => false}, {
            insta::assert_snapshot!($name, $text);
        })
    };
}

#[test]
fn spec_to_ir_per_variant() {
    let spec = spec();
    for v in &spec.variants {
        let k = main_kernel(&spec, v, DType::BF16, 64, 64, 32).unwrap();
        snap!(format!("spec_ir__{}", v.name), print_kernel(&k));
    }
}

#[test]
fn ir_after_each_pass() {
    let spec = spec();
    let k = main_kernel(&spec, spec.variant("gemma2").unwrap(), DType::BF16, 64, 64, 32).unwrap();
    let mut steps = Vec::new();
    run_pipeline_with(&k, &default_pipeline(), &mut |name, k| steps.push((name.to_string(), print_kernel(k)))).unwrap();
    for (i, (name, text)) in steps.iter().enumerate() {
        snap!(format!("pipeline__{i:02}_{name}"), text);
    }
}
