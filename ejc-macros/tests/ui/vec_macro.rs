// vec macro: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel]
fn k(x: Tensor<f32, 1>) {
    let v = vec![1.0, 2.0];
}

fn main() {}
