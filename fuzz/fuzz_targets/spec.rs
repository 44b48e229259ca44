#![no_main]
//! The `spec` target of tests/fuzz/targets.rs under libFuzzer.

use ejc_fuzz::mutate::Dialect;
use libfuzzer_sys::{fuzz_mutator, fuzz_target};

fuzz_target!(|data: &[u8]| {
    if data.len() <= ejc_fuzz::targets::MAX_LEN {
        ejc_fuzz::targets::spec(data, ejc_fuzz::scratch("spec"));
    }
});

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    ejc_fuzz::mutator("spec", Dialect::Yaml, data, size, max_size, seed)
});
