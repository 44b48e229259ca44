//! The flash-attention forward family: problem description, reference semantics,
//! random inputs.

pub mod inputs;
pub mod problem;
pub mod reference;

pub use problem::{FlashInputs, FlashOutputs, FlashRuntime, FlashShape};
