// attr not integer: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(block = "64")]
fn k(x: Tensor<f32, 1>, n: i32) {
}

fn main() {}
