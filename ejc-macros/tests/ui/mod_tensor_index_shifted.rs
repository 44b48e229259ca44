// a mod's tensor indexed by q_idx + 1: rejected with a span on the index
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(mask_mod)]
fn m(_b: i32, _h: i32, q_idx: i32, kv_idx: i32, doc: Tensor<i32, 1>) -> bool {
    doc[q_idx + 1] == doc[kv_idx]
}

fn main() {}
