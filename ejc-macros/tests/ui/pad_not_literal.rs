use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

// The pad is a literal, not a computed value.
#[ej_kernel(block = 16)]
pub fn pad_not_literal(x: Tensor<f32, 1>, out: Tensor<f32, 1>, p: f32) {
    let t = load_pad(x, [span(0, BLOCK, 16)], p);
    store(out, [span(0, BLOCK, 16)], t);
}

fn main() {}
