//! What the cargo-fuzz targets share with the CI fuzz suite (`tests/fuzz.rs`): the
//! targets themselves and the structure-aware mutator, compiled from `tests/fuzz/`.

#[path = "../../tests/fuzz/mutate.rs"]
pub mod mutate;
#[path = "../../tests/fuzz/targets.rs"]
pub mod targets;

use std::sync::OnceLock;

use mutate::{Dialect, Rng};
use targets::{Scratch, MAX_LEN};

/// This process's scratch directory (one per process: `-jobs`/`-fork` runs do not share).
pub fn scratch(tag: &'static str) -> &'static Scratch {
    static S: OnceLock<Scratch> = OnceLock::new();
    S.get_or_init(|| Scratch::new(tag))
}

/// The custom mutator: half the time libFuzzer's own (bit flips, its dictionary,
/// coverage-guided cross-over), half the time ejc's structure-aware one with the
/// target's seeds for splicing.
pub fn mutator(
    target: &'static str,
    dialect: Dialect,
    data: &mut [u8],
    size: usize,
    max_size: usize,
    seed: u32,
) -> usize {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    let mut rng = Rng::new(u64::from(seed));
    if rng.chance(1, 2) {
        return libfuzzer_sys::fuzzer_mutate(data, size, max_size);
    }
    let seeds = SEEDS.get_or_init(|| targets::seeds(target));
    let out = mutate::mutate(&data[..size], seeds, dialect, &mut rng, max_size.min(MAX_LEN));
    data[..out.len()].copy_from_slice(&out);
    out.len()
}
