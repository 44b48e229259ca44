use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

// The element types of a generic kernel are the DSL's.
#[ej_kernel(dtypes(T = [f32, f64]))]
fn k<T: Elem>(x: Tensor<T, 1>, n: i32) {}

fn main() {}
