// generic kernel: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel]
fn k<T: Elem>(x: Tensor<T, 1>, n: i32) {
}

fn main() {}
