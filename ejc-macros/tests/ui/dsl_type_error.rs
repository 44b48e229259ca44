// dsl type error: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(block = 16)]
fn k(x: Tensor<Bf16, 2>, y: Tensor<f32, 2>, n: i32) {
    let a = load(x, [span(0, BLOCK, n), span(0, BLOCK, n)]);
    let acc = dot(a, a, 1.0);
    store(y, [span(0, BLOCK, n), span(0, BLOCK, n)], acc);
}

fn main() {}
