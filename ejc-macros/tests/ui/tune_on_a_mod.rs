// a mod has no schedule space
#[allow(unused_imports)]
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(mask_mod, tune(w = [8, 16]))]
fn m(_b: i32, _h: i32, q: i32, kv: i32) -> bool {
    kv <= q
}

fn main() {}
