// a rank-2 tensor read with one index: rejected with the rank and an example
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(mask_mod)]
fn m(_b: i32, _h: i32, q_idx: i32, kv_idx: i32, doc: Tensor<i32, 2>) -> bool {
    doc[q_idx] == doc[kv_idx]
}

fn main() {}
