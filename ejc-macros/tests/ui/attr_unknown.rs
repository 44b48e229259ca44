// attr unknown: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(fast_math)]
fn k(x: Tensor<f32, 1>, n: i32) {
}

fn main() {}
