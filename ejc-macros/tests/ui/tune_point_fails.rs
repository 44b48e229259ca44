// a shape error at one point only names the point
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(tune(b = [16, 0]))]
fn k(x: Tensor<f32, 1>) {
    store(x, [span(0, 16 / B, dim(x, 0))], full1(16 / B, 0.0));
}

fn main() {}
