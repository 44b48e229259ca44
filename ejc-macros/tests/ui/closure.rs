// closure: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(block = 16)]
fn k(x: Tensor<f32, 1>, n: i32) {
    let f = |a: i32| a + 1;
    store(x, [span(0, BLOCK, n)], full1(BLOCK, 0.0));
}

fn main() {}
