// a scalar after a mod's indices: rejected, pointing at attribute constants
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(mask_mod)]
fn m(_b: i32, _h: i32, q_idx: i32, kv_idx: i32, width: i32) -> bool {
    kv_idx <= q_idx + width
}

fn main() {}
