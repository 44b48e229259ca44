//! Compile the crate's kernels at build time: `src/kernels.rs` is included here, so
//! its `#[ej_kernel]` functions register themselves in this build script too.

#[path = "src/kernels.rs"]
#[allow(dead_code)]
mod kernels;

use ejc_codegen::build::dsl::{DslBuild, FlashKernel};
use ejc_ir::flash::Features;
use ejc_ir::flash::FlashHooks;
use ejc_ir::types::DType;

fn main() {
    println!("cargo:rerun-if-changed=src/kernels.rs");
    let flash = |hooks: FlashHooks| FlashKernel {
        features: Features::default(),
        dtype: DType::F32,
        head_dim: 64,
        block_m: 32,
        block_n: 32,
        hooks,
    };
    DslBuild::new("demo")
        .registered() // scaled_matmul, softmax_rows
        .ptx(ejc_codegen::ptx::Arch::Sm80)
        .ptx(ejc_codegen::ptx::Arch::Sm90a)
        .mlir() // and through MLIR: the modules as text, PTX by its NVVM pipeline
        .flash(
            "flash_prefix_lm_alibi",
            flash(FlashHooks { mask_mod: Some(kernels::prefix_lm::MOD), score_mod: Some(kernels::alibi::MOD) }),
        )
        .flash(
            "flash_causal_window",
            flash(FlashHooks { mask_mod: Some(kernels::causal_window::MOD), score_mod: None }),
        )
        .flash(
            "flash_document_slopes",
            flash(FlashHooks {
                mask_mod: Some(kernels::document_causal::MOD),
                score_mod: Some(kernels::alibi_slopes::MOD),
            }),
        )
        .compile()
        .unwrap_or_else(|e| panic!("compiling the #[ej_kernel] kernels failed: {e}"));
}
