#![no_main]
//! The `manifest` target of tests/fuzz/targets.rs under libFuzzer.

use ejc_fuzz::mutate::Dialect;
use libfuzzer_sys::{fuzz_mutator, fuzz_target};

fuzz_target!(|data: &[u8]| {
    if data.len() <= ejc_fuzz::targets::MAX_LEN {
        ejc_fuzz::targets::manifest(data, ejc_fuzz::scratch("manifest"));
    }
});

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    ejc_fuzz::mutator("manifest", Dialect::Json, data, size, max_size, seed)
});
