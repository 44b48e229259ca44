// unsupported param: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel]
fn k(x: Vec<f32>, n: i32) {
}

fn main() {}
