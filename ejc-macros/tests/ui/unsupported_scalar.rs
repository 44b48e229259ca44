// unsupported scalar: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel]
fn k(x: Tensor<f32, 1>, n: f64) {
}

fn main() {}
