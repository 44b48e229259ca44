//! Passes over the tile IR, one file each, and the pipeline that orders them.
//!
//! ```no_run
//! use ejc_ir::passes;
//! # fn demo(kernel: ejc_ir::ir::Kernel) {
//! let optimized = passes::run_pipeline(&kernel, &passes::default_pipeline()).unwrap();
//! # }
//! ```
//!
//! The default pipeline, in order, and why:
//!
//! 1. `canonicalize` — fold constants, apply identities, deduplicate pure ops. The
//!    mask pass recognises loops by their *constant* lower bound and step, so
//!    constants must be folded first.
//! 2. `classify-mask-blocks` — narrow each key loop to the key blocks its mask
//!    predicate can see, and mask only the blocks that are partial.
//! 3. `lower-masks` — expand the mask ops into scalar and tile arithmetic, so back
//!    ends only see primitive ops.
//! 4. `licm` — move what does not change across key blocks (the lowered mask's row
//!    indices, block-end offsets) in front of the loop.
//! 5. `canonicalize` — fold and deduplicate what lowering and hoisting exposed.
//! 6. `dce` — drop ops whose results nobody uses.
//!
//! Not in the default pipeline, because only some back ends gain from it:
//! `pipeline-dots` rotates a key loop so that the value product of block j and the
//! score product of block j+1 are issued together (the PTX target's `wgmma`
//! configurations run it, to overlap the softmax with the tensor cores). Nor is
//! `scale-fold` ([`scale_fold`]), which moves the scores' last multiply into the
//! softmax under a launch condition (a positive scale): the PTX target's aligned entry.
//!
//! The verifier runs after every pass. With `EJC_DUMP_IR=<dir>` set, the IR before
//! the first pass and after each pass is written to `<dir>/<kernel>/NN-<pass>.tir`.

mod canonicalize;
mod classify_mask_blocks;
mod dce;
mod licm;
mod lower_masks;
mod pipeline_dots;
mod scale_fold;
mod util;

pub use canonicalize::Canonicalize;
pub use classify_mask_blocks::ClassifyMaskBlocks;
pub use dce::Dce;
pub use licm::Licm;
pub use lower_masks::LowerMasks;
pub use pipeline_dots::{rotate_loops, PipelineDots, Rotation};
pub use scale_fold::{scale_fold, ScaleFold};

use std::path::PathBuf;

use crate::ir::Kernel;
use crate::print::print_kernel;
use crate::verify::{verify, VerifyError};

/// A transformation of a kernel. Passes never panic on valid IR; the pipeline
/// verifies their output.
pub trait Pass {
    /// Short name (`canonicalize`), used in dumps and snapshots.
    fn name(&self) -> &'static str;
    fn run(&self, kernel: &mut Kernel);
}

pub fn default_pipeline() -> Vec<Box<dyn Pass>> {
    vec![
        Box::new(Canonicalize),
        Box::new(ClassifyMaskBlocks),
        Box::new(LowerMasks),
        Box::new(Licm),
        Box::new(Canonicalize),
        Box::new(Dce),
    ]
}

/// Errors from running a pipeline: a pass produced invalid IR (a compiler bug,
/// reported with the pass's name) or the dump directory could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("pass `{pass}` produced invalid IR: {error}")]
    Invalid { pass: String, error: VerifyError },
    /// Not the kernel's fault: the dump `EJC_DUMP_IR` asks for could not be written.
    #[error("EJC_DUMP_IR: could not write the IR dump to {path}: {error}")]
    Dump { path: PathBuf, error: std::io::Error },
}

/// Run `passes` on a copy of `kernel`, verifying after each.
pub fn run_pipeline(kernel: &Kernel, passes: &[Box<dyn Pass>]) -> Result<Kernel, PassError> {
    run_pipeline_with(kernel, passes, &mut |_, _| {})
}

/// Like [`run_pipeline`], calling `observe(pass_name, kernel)` with the input (as
/// `input`) and after every pass (snapshot tests use this).
pub fn run_pipeline_with(
    kernel: &Kernel,
    passes: &[Box<dyn Pass>],
    observe: &mut dyn FnMut(&str, &Kernel),
) -> Result<Kernel, PassError> {
    let dump_dir =
        std::env::var_os("EJC_DUMP_IR").filter(|d| !d.is_empty()).map(|d| PathBuf::from(d).join(&kernel.name));
    let dump = |step: usize, name: &str, k: &Kernel| -> Result<(), PassError> {
        if let Some(dir) = &dump_dir {
            std::fs::create_dir_all(dir).map_err(|error| PassError::Dump { path: dir.clone(), error })?;
            let path = dir.join(format!("{step:02}-{name}.tir"));
            std::fs::write(&path, print_kernel(k)).map_err(|error| PassError::Dump { path, error })?;
        }
        Ok(())
    };
    let mut k = kernel.clone();
    observe("input", &k);
    dump(0, "input", &k)?;
    for (i, pass) in passes.iter().enumerate() {
        pass.run(&mut k);
        verify(&k).map_err(|error| PassError::Invalid { pass: pass.name().to_string(), error })?;
        observe(pass.name(), &k);
        dump(i + 1, pass.name(), &k)?;
    }
    Ok(k)
}
