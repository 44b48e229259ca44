// a mod's tensor used as a value: rejected, pointing at indexing
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(mask_mod)]
fn m(_b: i32, _h: i32, q_idx: i32, kv_idx: i32, doc: Tensor<i32, 1>) -> bool {
    let d = doc;
    kv_idx <= q_idx
}

fn main() {}
