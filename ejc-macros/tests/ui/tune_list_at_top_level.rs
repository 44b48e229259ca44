// a list outside tune(...): only warps and stages may stand there
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(bm = [64, 128])]
fn k(x: Tensor<f32, 1>) {
    store(x, [span(0, BM, dim(x, 0))], full1(BM, 0.0));
}

fn main() {}
