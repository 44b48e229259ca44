// kv_idx on an earlier axis than q_idx: rejected (the read is a [BM, BN] tile)
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(mask_mod)]
fn m(_b: i32, _h: i32, q_idx: i32, kv_idx: i32, allowed: Tensor<bool, 2>) -> bool {
    allowed[[kv_idx, q_idx]]
}

fn main() {}
