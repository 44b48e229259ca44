//! Ragged paged attention (`ragged_page_attention`, ejkernel's v2): the new tokens of a
//! batch of sequences — prefill chunks and single decode tokens mixed — each sequence's
//! queries aligned to the end of its context, against a paged KV cache whose pages hold
//! K and V interleaved on the head axis. Causal, with a run-time sliding window (the `w`
//! most recent positions), soft cap and attention sinks. The operation ([`op::RaggedPaged`]),
//! its f64 reference ([`reference`]) and its tile programs ([`kernels`]): queries packed so
//! that one pass over a KV head's pages serves every query head of its group.

pub mod kernels;
pub mod op;
pub mod op_v3;
pub mod reference;
pub mod reference_v3;
