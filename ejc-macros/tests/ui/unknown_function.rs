// unknown function: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(block = 16)]
fn k(x: Tensor<f32, 1>, n: i32) {
    let t = load(x, [span(0, BLOCK, n)]);
    store(x, [span(0, BLOCK, n)], softplus(t));
}

fn main() {}
