use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

// An i32 tensor is padded with an i32 literal, not a float one.
#[ej_kernel(block = 16)]
pub fn pad_wrong_kind(ids: Tensor<i32, 1>, out: Tensor<i32, 1>) {
    let t = load_pad(ids, [span(0, BLOCK, 16)], -1.0);
    store(out, [span(0, BLOCK, 16)], t);
}

fn main() {}
