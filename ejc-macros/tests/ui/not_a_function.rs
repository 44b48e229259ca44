// not a function: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel]
struct K {
    x: f32,
}

fn main() {}
