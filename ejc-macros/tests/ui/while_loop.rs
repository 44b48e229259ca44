// while loop: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel]
fn k(x: Tensor<f32, 1>, n: i32) {
    let mut i = 0;
    while i < n {
        i = i + 1;
    }
}

fn main() {}
