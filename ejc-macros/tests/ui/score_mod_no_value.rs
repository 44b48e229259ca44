// score mod no value: rejected with a span on the offending token
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(score_mod)]
fn s(score: f32, b: i32, h: i32, q_idx: i32, kv_idx: i32) -> f32 {
    let x = score * 2.0;
}

fn main() {}
