// store in if expression: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(block = 16)]
fn k(x: Tensor<f32, 1>, n: i32) {
    let t = if n > 0 {
        store(x, [span(0, BLOCK, n)], full1(BLOCK, 1.0));
        1
    } else {
        2
    };
}

fn main() {}
