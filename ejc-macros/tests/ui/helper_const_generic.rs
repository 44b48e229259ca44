use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

// Compile-time integers are attribute parameters, not const generics.
#[ej_kernel(helper)]
fn scaled<const N: i32>(x: Tile<f32>) -> Tile<f32> {
    x * 2.0
}

fn main() {}
