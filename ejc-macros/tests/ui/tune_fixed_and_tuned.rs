// one name both fixed and tuned
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(b = 16, tune(b = [16, 32]))]
fn k(x: Tensor<f32, 1>) {
    store(x, [span(0, B, dim(x, 0))], full1(B, 0.0));
}

fn main() {}
