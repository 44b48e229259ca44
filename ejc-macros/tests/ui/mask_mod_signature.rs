// mask mod signature: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(mask_mod)]
fn m(q_idx: i32, kv_idx: i32) -> bool {
    kv_idx <= q_idx
}

fn main() {}
