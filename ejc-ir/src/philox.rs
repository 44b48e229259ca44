//! Philox 4x32-10, the counter-based random number generator behind dropout.
//!
//! ```
//! use ejc_ir::philox::{dropout_uniform, philox4x32_10};
//! // Random123's first known-answer vector.
//! assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
//! // The uniform deciding whether element (row 3, col 7) of (batch 0, head 1) is dropped.
//! let u = dropout_uniform(42, 0, 1, 3, 7);
//! assert!((0.0..1.0).contains(&u));
//! ```
//!
//! A counter-based generator is a pure function of (counter, key): every back end can
//! compute the random number of any attention element on its own, in any order, without
//! sharing state, and the reference gets the very same dropout mask. This is the
//! generator of Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11),
//! bit for bit as Random123's `philox4x32_R(10, ...)` and curand's Philox4_32_10 define it.

/// Round multipliers.
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
/// Key schedule increments (golden ratio and sqrt(3) - 1, as 32-bit fractions).
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Number of rounds: 10 is the variant Random123 recommends and curand ships.
const ROUNDS: usize = 10;

/// High and low 32-bit halves of the full 64-bit product.
#[inline]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

#[inline]
fn round(c: [u32; 4], k: [u32; 2]) -> [u32; 4] {
    let (hi0, lo0) = mulhilo(M0, c[0]);
    let (hi1, lo1) = mulhilo(M1, c[2]);
    [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
}

/// One Philox 4x32 block with 10 rounds: four random words for `counter` under `key`.
///
/// The key is bumped by the Weyl constants between rounds (9 bumps for 10 rounds), as
/// in Random123's `philox4x32_R`; the known-answer vectors below depend on exactly that.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for r in 0..ROUNDS {
        if r > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        c = round(c, k);
    }
    c
}

/// The uniform in [0, 1) that decides dropout for attention element (`row`, `col`) of
/// (`batch`, `head`): `counter = [row, col, head, batch]`, `key = [seed_lo, seed_hi]`,
/// and the top 24 bits of the first output word scaled by 2^-24.
///
/// 24 bits make the value exactly representable in f32, so a kernel that compares in
/// f32 (`u >= p`) decides exactly as the reference does in f64. `row` and `col` are
/// positions inside the sequence (for varlen, local to the sequence and `batch` is the
/// sequence index); `head` is the query head.
pub fn dropout_uniform(seed: u64, batch: u32, head: u32, row: u32, col: u32) -> f64 {
    let key = [seed as u32, (seed >> 32) as u32];
    let x = philox4x32_10([row, col, head, batch], key);
    f64::from(x[0] >> 8) * (1.0 / 16_777_216.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's `kat_vectors` for philox4x32_10.
    #[test]
    fn random123_known_answers() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn mulhilo_splits_the_product() {
        assert_eq!(mulhilo(u32::MAX, u32::MAX), (0xFFFF_FFFE, 0x0000_0001));
        assert_eq!(mulhilo(M0, 1), (0, M0));
    }

    #[test]
    fn dropout_uniform_is_a_24_bit_fraction_of_word_0() {
        let seed = 0x0123_4567_89ab_cdef_u64;
        let x = philox4x32_10([5, 6, 7, 8], [0x89ab_cdef, 0x0123_4567]);
        let u = dropout_uniform(seed, 8, 7, 5, 6);
        assert_eq!(u, (x[0] >> 8) as f64 / 16_777_216.0);
        assert_eq!(u as f32 as f64, u, "must be exact in f32");
    }

    #[test]
    fn dropout_uniform_is_roughly_uniform() {
        let n = 40_000;
        let mut below_quarter = 0;
        let mut sum = 0.0;
        for i in 0..n {
            let u = dropout_uniform(7, 1, 2, i / 200, i % 200);
            assert!((0.0..1.0).contains(&u));
            sum += u;
            below_quarter += usize::from(u < 0.25);
        }
        let mean = sum / n as f64;
        let frac = below_quarter as f64 / n as f64;
        // Standard errors: 0.0014 for the mean, 0.0022 for the fraction; allow ~5 sigma.
        assert!((mean - 0.5).abs() < 0.008, "mean {mean}");
        assert!((frac - 0.25).abs() < 0.012, "fraction below 0.25: {frac}");
    }

    #[test]
    fn every_coordinate_changes_the_stream() {
        let base = dropout_uniform(1, 0, 0, 0, 0);
        for u in [
            dropout_uniform(2, 0, 0, 0, 0),
            dropout_uniform(1 << 32, 0, 0, 0, 0),
            dropout_uniform(1, 1, 0, 0, 0),
            dropout_uniform(1, 0, 1, 0, 0),
            dropout_uniform(1, 0, 0, 1, 0),
            dropout_uniform(1, 0, 0, 0, 1),
        ] {
            assert_ne!(u, base);
        }
    }
}
