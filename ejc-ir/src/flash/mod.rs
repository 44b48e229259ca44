//! The flash-attention forward: its operation ([`op::FlashAttentionFwd`]), features,
//! front end (tile IR of each kernel), kernel ABI, reference semantics and random
//! inputs. Everything flash-specific lives here; the spine reaches it only through
//! [`crate::op::Operation`].
//!
//! ```no_run
//! use ejc_ir::flash::{self, FlashShape, Features};
//! use ejc_ir::types::DType;
//! let f = Features { causal: true, ..Default::default() };
//! let kernel = flash::build_flash_kernel("causal", &f, DType::F32, 64, 16, 16).unwrap();
//! let shape = FlashShape::parse("2,33,47,4,2,64").unwrap();
//! let inputs = flash::inputs::random_inputs(&f, DType::F32, &shape, 7);
//! let rt = flash::inputs::default_runtime(&f, &shape, 7);
//! let got = flash::abi::run_interp(&kernel, &rt, &inputs).unwrap();
//! let want = flash::reference::reference(&f, &rt, &inputs).unwrap();
//! let (rel, _) = ejc_ir::tensor::compare(&got.out.to_vec(), &want.out.to_vec());
//! assert!(rel <= 1e-6);
//! ```

pub mod abi;
pub mod backward;
pub mod combine;
pub mod features;
pub mod frontend;
pub mod inputs;
pub mod op;
pub mod op_bwd;
pub mod problem;
pub mod reference;
pub mod ring;

pub use combine::build_flash_combine_kernel;
pub use features::{CallFeatures, Features, SoftCap, Window};
pub use frontend::{build_flash_kernel, build_flash_kernel_with, build_flash_partial_kernel, FlashHooks, HeadDims};
pub use op::{head_dim_v, key_set, main_kernel};
pub use problem::{FlashInputs, FlashOutputs, FlashRuntime, FlashShape};
