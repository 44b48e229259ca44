#![no_main]
//! The `cli` target of tests/fuzz/targets.rs under libFuzzer.

use ejc_fuzz::mutate::Dialect;
use libfuzzer_sys::{fuzz_mutator, fuzz_target};

fuzz_target!(|data: &[u8]| {
    if data.len() <= ejc_fuzz::targets::MAX_LEN {
        ejc_fuzz::targets::cli(data);
    }
});

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    ejc_fuzz::mutator("cli", Dialect::Flags, data, size, max_size, seed)
});
