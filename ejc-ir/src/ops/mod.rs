//! Operations beyond flash attention, each in its own module: kernel builders, the
//! reference semantics and random inputs.

pub mod mean_pooling;
