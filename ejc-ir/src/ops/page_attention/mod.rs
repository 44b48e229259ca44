//! Paged decode attention (`page_attention`): one query token per sequence against a
//! KV cache stored in fixed-size pages that block tables map to each sequence — vLLM's
//! layout and ejkernel's `page_attention`. The operation ([`op::PageAttention`], what
//! the spine sees), the tile programs ([`kernels`]: GQA-packed, one kernel or split-K)
//! and their f64 reference with random calls ([`reference`]).
//!
//! ```
//! use ejc_ir::ops::page_attention::kernels::{build, PagedKernel, Role};
//! use ejc_ir::types::DType;
//!
//! let k = PagedKernel { role: Role::Main, soft_cap: false, dtype: DType::F16, head_dim: 128, block_h: 16, block_n: 64 };
//! let kernel = build("paged_main", &k).unwrap();
//! assert_eq!(kernel.params.last().unwrap().name, "softmax_scale");
//! ```

pub mod kernels;
pub mod op;
pub mod reference;
