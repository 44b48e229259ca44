//! The operations ejc compiles, one module each, and the list the spine looks them up
//! in. Adding an operation: docs/adding-an-operation.md.
//!
//! ```
//! let names: Vec<&str> = ejc_ir::ops::all().iter().map(|o| o.name()).collect();
//! assert_eq!(names, ["flash_attention_fwd", "flash_attention_bwd", "mean_pooling", "page_attention", "ragged_decode_attention", "ragged_page_attention", "ragged_page_attention_v3", "blocksparse_attention", "blocksparse_attention_bwd"]);
//! ```

use crate::op::Operation;

pub mod blocksparse;
pub mod mean_pooling;
pub mod page_attention;
pub mod ragged_decode;
pub mod ragged_paged;

/// Every operation, in the order `ejc` lists them.
pub fn all() -> &'static [&'static dyn Operation] {
    &[
        &crate::flash::op::FlashAttentionFwd,
        &crate::flash::op_bwd::FlashAttentionBwd,
        &mean_pooling::op::MeanPooling,
        &page_attention::op::PageAttention,
        &ragged_decode::op::RaggedDecode,
        &ragged_paged::op::RaggedPaged,
        &ragged_paged::op_v3::RaggedPagedV3,
        &blocksparse::op::BlockSparse,
        &blocksparse::op_bwd::BlockSparseBwd,
    ]
}

/// The operation named `name`.
pub fn get(name: &str) -> Option<&'static dyn Operation> {
    all().iter().copied().find(|o| o.name() == name)
}
