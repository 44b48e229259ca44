//! Block-sparse attention (`blocksparse_attention`): softmax attention in the BHSD layout
//! under a mask built from the seed's mask algebra ([`mask`]), segment ids and an
//! explicit boolean mask, computed block by block over a *layout* that lists, for each
//! query block, the key blocks it must visit — the fully visible ones apart from the
//! partly visible ones (FlexAttention's `BlockMask`, the seed's `qkv_layouts`). Skipped
//! blocks are never read; full blocks run the unmasked loop body; only partial blocks
//! evaluate the mask per element.
//!
//! The plan `layout` builds the layout on the device (a kernel per query block) and then
//! runs attention over it. Semantics: docs/semantics.md, "Block-sparse attention".
//!
//! The backward (`blocksparse_attention_bwd`, [`op_bwd`], kernels in [`backward`]) builds
//! the same layout and its transpose (per key block, the query blocks that see it) and
//! runs FlashAttention-2's deterministic plan over them.

pub mod backward;
pub mod kernels;
pub mod mask;
pub mod op;
pub mod op_bwd;
pub mod reference;
