//! Calling ejc from a Rust program: `ejc_runtime::flash_attention` on host tensors.
//!
//! ```sh
//! ejc build specs/flash.yaml --target cpu --variant causal --dtype f32 -o out
//! EJC_KERNELS=out EJC_LOG=1 cargo run --example flash_call
//! ```
//!
//! The first run autotunes the call and stores the choice in this machine's tuning
//! cache; later runs find it there (`EJC_LOG=1` prints which tier answered). The
//! output is checked against ejc's reference implementation.

use ejc::ir::flash::inputs::random_inputs;
use ejc::ir::flash::reference::reference;
use ejc::ir::flash::{Features, FlashRuntime, FlashShape};
use ejc::ir::tensor::compare;
use ejc::ir::types::DType;
use ejc::runtime::cpu::HostBuffer;
use ejc::runtime::flash::{flash_attention, FlashArgs, FlashOptions};

fn main() {
    let shape = FlashShape::new(2, 200, 200, 4, 2, 64);
    let features = Features { causal: true, ..Default::default() };
    let inputs = random_inputs(&features, DType::F32, &shape, 42);
    let (q, k, v) =
        (HostBuffer::from_host(&inputs.q), HostBuffer::from_host(&inputs.k), HostBuffer::from_host(&inputs.v));
    let opts = FlashOptions { causal: true, threads: 2, ..Default::default() };
    let r = match flash_attention(&FlashArgs::new(&q, &k, &v), &opts) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let rt = FlashRuntime { softmax_scale: 1.0 / 8.0, window: (0, 0), softcap: 1.0, dropout_p: 0.0, seed: 0 };
    let want = reference(&features, &rt, &inputs).expect("reference");
    let out = r.out.host().expect("a host call's output is on the host").to_host();
    let (rel, _) = compare(&out.to_vec(), &want.out.to_vec());
    println!("kernel={} config={:?} source={} rel_err={rel:.2e}", r.kernels.join("+"), r.config, r.source);
    if rel > 1e-5 {
        std::process::exit(1);
    }
}
