// a mod reading a bf16 tensor: rejected (the mod also runs on the host)
use ejc_ir::dsl::*;
use ejc_macros::ej_kernel;

#[ej_kernel(score_mod)]
fn s(score: f32, _b: i32, h: i32, _q_idx: i32, _kv_idx: i32, slopes: Tensor<Bf16, 1>) -> f32 {
    score
}

fn main() {}
