//! Mean pooling over fixed-size chunks of the sequence axis (forward and backward,
//! dense and varlen): the operation ([`op::MeanPooling`], what the spine sees), the tile
//! programs ([`kernels`]) and their f64 reference with random inputs ([`reference`]).
//!
//! ```
//! use ejc_ir::ops::mean_pooling::kernels::{build, PoolKernel};
//! use ejc_ir::ops::mean_pooling::reference::{random_inputs, reference_fwd, PoolShape};
//! use ejc_ir::types::DType;
//!
//! let k = PoolKernel { backward: false, varlen: false, dtype: DType::F32, head_dim: 16, block_h: 16 };
//! let kernel = build("mean_pooling_fwd", &k).unwrap();
//! assert_eq!(kernel.params.len(), 3); // x, out, chunk_size
//! let shape = PoolShape { batch: 2, seq: 10, heads: 3, head_dim: 16, chunk: 4 };
//! let inputs = random_inputs(false, false, DType::F32, &shape, 7);
//! let out = reference_fwd(&inputs.input, None, 4).unwrap();
//! assert_eq!(out.shape, vec![2, 3, 3, 16]); // ceil(10 / 4) = 3 chunks
//! ```

pub mod kernels;
pub mod op;
pub mod reference;
