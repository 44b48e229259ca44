use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

// A helper with a return type ends its body with the value.
#[ej_kernel(helper)]
fn half(x: Tile<f32>) -> Tile<f32> {
    let y = x * 0.5;
}

fn main() {}
