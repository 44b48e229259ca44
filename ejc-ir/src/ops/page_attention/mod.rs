//! Paged decode attention (`page_attention`): one query token per sequence against a
//! KV cache stored in fixed-size pages that block tables map to each sequence — vLLM's
//! layout and ejkernel's `page_attention`. The operation ([`op::PageAttention`], what
//! the spine sees), the tile programs ([`kernels`]: GQA-packed, one kernel or split-K)
//! and their f64 reference with random calls ([`reference`]).
//!
//! ```
//! use ejc_ir::ops::page_attention::kernels::{build, DecodeKernel, Role};
//! use ejc_ir::types::DType;
//!
//! let k = DecodeKernel::paged(Role::Main, false, DType::F16, 128, 16, 64);
//! let kernel = build("paged_main", &k).unwrap();
//! assert_eq!(kernel.params.last().unwrap().name, "softmax_scale");
//! ```

pub mod kernels;
pub mod op;
pub mod reference;
