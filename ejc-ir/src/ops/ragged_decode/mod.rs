//! Ragged decode attention (`ragged_decode_attention`): one query token per row against
//! a contiguous key/value buffer of which each row sees its own range
//! `[sequence_start, sequence_end)` — ejkernel's `ragged_decode_attention`, with a
//! sliding window left of the query, a soft cap and attention sinks. The operation
//! ([`op::RaggedDecode`]) and its f64 reference ([`reference`]); the tile programs are
//! paged attention's ([`super::page_attention::kernels`], [`Source::Ragged`]): GQA
//! packed, one kernel or split-K.
//!
//! [`Source::Ragged`]: super::page_attention::kernels::Source::Ragged
//!
//! ```
//! use ejc_ir::ops::page_attention::kernels::{build, DecodeKernel, Role, Source};
//! use ejc_ir::types::DType;
//!
//! let k = DecodeKernel { source: Source::Ragged, sinks: true, window: true,
//!     ..DecodeKernel::paged(Role::Main, false, DType::BF16, 64, 16, 32) };
//! let kernel = build("ragged_main", &k).unwrap();
//! let names: Vec<&str> = kernel.params.iter().map(|p| p.name.as_str()).collect();
//! assert_eq!(names, ["query", "key", "value", "sequence_start", "sequence_end", "sinks", "out",
//!                    "softmax_scale", "window_left"]);
//! ```

pub mod op;
pub mod reference;
