use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(helper)]
fn twice(x: i32) -> i32 {
    x + x
}

// A mod is also a host function: it calls only the DSL's functions.
#[ej_kernel(mask_mod)]
pub fn doubled(_b: i32, _h: i32, q_idx: i32, kv_idx: i32) -> bool {
    kv_idx <= twice(q_idx)
}

fn main() {}
