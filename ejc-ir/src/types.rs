//! Element types and value types of the tile IR.
//!
//! ```
//! use ejc_ir::types::{DType, Type};
//! let t = Type::tile(DType::F32, &[64, 128]);
//! assert_eq!(t.to_string(), "tile<64x128xf32>");
//! assert_eq!("bf16".parse::<DType>().unwrap(), DType::BF16);
//! ```

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Element type of a scalar, a tile or a tensor.
///
/// `i1` tensors are stored one byte per element (like torch's `bool`). `f64` exists for
/// host-side tensors (the reference returns f64); kernels built by the front ends never
/// use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    I1,
    I32,
    U32,
    F16,
    BF16,
    F32,
    F64,
}

impl DType {
    pub const ALL: [DType; 7] = [DType::I1, DType::I32, DType::U32, DType::F16, DType::BF16, DType::F32, DType::F64];

    pub fn name(self) -> &'static str {
        match self {
            DType::I1 => "i1",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::U32)
    }

    pub fn is_bool(self) -> bool {
        self == DType::I1
    }

    /// Bytes per element in memory.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::I1 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::F64 => 8,
        }
    }

    /// Round `x` to the nearest value this type can hold, the way a device stores it:
    /// round-to-nearest-even for floats, truncation and two's-complement wrap for
    /// integers, `x != 0` for `i1`. NaN stays NaN for floats.
    pub fn round(self, x: f64) -> f64 {
        match self {
            DType::F64 => x,
            DType::F32 => x as f32 as f64,
            DType::F16 => f64_to_f16(x).to_f64(),
            DType::BF16 => f64_to_bf16(x).to_f64(),
            DType::I32 => wrap_int(x) as i32 as f64,
            DType::U32 => wrap_int(x) as u32 as f64,
            DType::I1 => {
                if x != 0.0 && !x.is_nan() {
                    1.0
                } else {
                    0.0
                }
            }
        }
    }
}

/// `x` rounded to the nearest `f16`, ties to even, correctly for every `f64`.
///
/// `half::f16::from_f64` and `half::bf16::from_f64` (half 2.7) look only at the upper 32
/// bits of the `f64`, so bits that decide a near-tie are dropped: `-1.8632821` (f32
/// `0xbfee8007`) came out as bf16 `0xbfee` where a device's `cvt.rn` gives `0xbfef`.
/// Rounding through f32 with round-to-odd keeps a sticky bit and cannot double-round
/// (f32 carries 13 and 16 more bits than f16 and bf16; two are enough).
pub fn f64_to_f16(x: f64) -> half::f16 {
    half::f16::from_f32(f64_to_f32_odd(x))
}

/// `x` rounded to the nearest `bf16`, ties to even, correctly for every `f64`
/// (see [`f64_to_f16`] for why not `half::bf16::from_f64`).
pub fn f64_to_bf16(x: f64) -> half::bf16 {
    half::bf16::from_f32(f64_to_f32_odd(x))
}

/// `x` rounded to f32 toward zero, with the last mantissa bit set when inexact
/// ("round to odd"): the inexactness survives as a sticky bit for a second rounding.
fn f64_to_f32_odd(x: f64) -> f32 {
    let t = x as f32;
    if x.is_nan() || f64::from(t) == x {
        return t;
    }
    // Sign-magnitude: one step down in the bits is one step toward zero (inf -> MAX).
    let mut bits = t.to_bits();
    if f64::from(t).abs() > x.abs() {
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}

/// Truncate toward zero and keep the low 64 bits (NaN and infinities become 0, as
/// no integer value is right for them).
fn wrap_int(x: f64) -> i64 {
    if !x.is_finite() {
        return 0;
    }
    let t = x.trunc();
    if t.abs() < 9.2e18 {
        t as i64
    } else {
        (t.rem_euclid(18446744073709551616.0)) as u64 as i64
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown dtype `{s}` (known: i1, i32, u32, f16, bf16, f32, f64)"))
    }
}

/// The type of an SSA value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Type {
    /// A scalar, uniform across the program instance.
    Scalar(DType),
    /// A tile with a static shape (rank 1 or 2).
    Tile(DType, Vec<usize>),
    /// A kernel parameter that names a tensor in memory: element type and rank. Shapes
    /// and strides are run-time values passed with the tensor.
    Tensor(DType, usize),
}

impl Type {
    pub fn tile(dtype: DType, shape: &[usize]) -> Type {
        Type::Tile(dtype, shape.to_vec())
    }

    pub fn dtype(&self) -> DType {
        match self {
            Type::Scalar(d) | Type::Tile(d, _) | Type::Tensor(d, _) => *d,
        }
    }

    /// The shape of a tile; an empty slice for scalars (and tensors).
    pub fn shape(&self) -> &[usize] {
        match self {
            Type::Tile(_, s) => s,
            _ => &[],
        }
    }

    pub fn is_scalar(&self) -> bool {
        matches!(self, Type::Scalar(_))
    }

    pub fn is_tile(&self) -> bool {
        matches!(self, Type::Tile(..))
    }

    pub fn is_tensor(&self) -> bool {
        matches!(self, Type::Tensor(..))
    }

    /// Number of elements of a tile (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.shape().iter().product()
    }

    /// The same shape with another element type.
    pub fn with_dtype(&self, dtype: DType) -> Type {
        match self {
            Type::Scalar(_) => Type::Scalar(dtype),
            Type::Tile(_, s) => Type::Tile(dtype, s.clone()),
            Type::Tensor(_, r) => Type::Tensor(dtype, *r),
        }
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Type::Scalar(d) => write!(f, "{d}"),
            Type::Tile(d, s) => {
                f.write_str("tile<")?;
                for n in s {
                    write!(f, "{n}x")?;
                }
                write!(f, "{d}>")
            }
            Type::Tensor(d, r) => {
                f.write_str("tensor<")?;
                for _ in 0..*r {
                    f.write_str("?x")?;
                }
                write!(f, "{d}>")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_device_storage() {
        assert_eq!(DType::BF16.round(1.0 + 1.0 / 256.0), 1.0); // tie, rounds to even
        assert_eq!(DType::BF16.round(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert_eq!(DType::F16.round(65520.0), f64::INFINITY);
        assert_eq!(DType::I32.round(-3.7), -3.0);
        assert_eq!(DType::I32.round(2147483648.0), -2147483648.0);
        assert_eq!(DType::U32.round(-1.0), 4294967295.0);
        assert_eq!(DType::I1.round(0.5), 1.0);
        assert!(DType::F32.round(f64::NAN).is_nan());
    }

    /// The correctly rounded encoding of `x >= 0`, by brute force: among the encodings
    /// next to `guess` (half's answer, at most one step off), the nearest value, ties to the
    /// even encoding.
    fn brute_force(x: f64, guess: u16, val: impl Fn(u16) -> f64) -> u16 {
        let near = [guess.wrapping_sub(1), guess, guess + 1].map(|c| (c, val(c)));
        let lo = near.iter().filter(|c| c.1 <= x).max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
        let hi = near.iter().filter(|c| c.1 >= x).min_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
        match (x - lo.1).total_cmp(&(hi.1 - x)) {
            std::cmp::Ordering::Less => lo.0,
            std::cmp::Ordering::Greater => hi.0,
            std::cmp::Ordering::Equal => [lo.0, hi.0].into_iter().find(|c| c & 1 == 0).unwrap(),
        }
    }

    #[test]
    fn half_precision_rounding_is_correct_at_near_ties() {
        // The value that exposed half's truncation: f32 0xbfee8007 is 7 f32 ulps past a
        // bf16 tie; the bits that say so are in the f64's lower word.
        let x = f64::from(f32::from_bits(0xbfee_8007));
        assert_eq!(f64_to_bf16(x).to_bits(), 0xbfef);
        assert_eq!(DType::BF16.round(x), f64::from(half::bf16::from_bits(0xbfef)));
        // A tie plus or minus the smallest f64 step: away from the tie both ways.
        let tie = 1.0 + 1.0 / 256.0;
        assert_eq!(f64_to_bf16(tie).to_bits(), 0x3f80);
        assert_eq!(f64_to_bf16(tie + f64::EPSILON).to_bits(), 0x3f81);
        assert_eq!(f64_to_bf16(-(tie + f64::EPSILON)).to_bits(), 0xbf81);
        let tie16 = 1.0 + 1.0 / 2048.0;
        assert_eq!(f64_to_f16(tie16).to_bits(), 0x3c00);
        assert_eq!(f64_to_f16(tie16 + f64::EPSILON).to_bits(), 0x3c01);
        assert_eq!(f64_to_f16(tie16 - f64::EPSILON).to_bits(), 0x3c00);
        // Specials and the edges of the range.
        assert!(f64_to_bf16(f64::NAN).is_nan());
        assert_eq!(f64_to_bf16(f64::INFINITY).to_bits(), 0x7f80);
        assert_eq!(f64_to_bf16(1e300).to_bits(), 0x7f80);
        assert_eq!(f64_to_bf16(-1e-300).to_bits(), 0x8000);
        assert_eq!(f64_to_f16(65519.99).to_bits(), 0x7bff);
        assert_eq!(f64_to_f16(65520.0).to_bits(), 0x7c00);
        assert_eq!(f64_to_f16(1e-300).to_bits(), 0x0000);
    }

    #[test]
    fn half_precision_rounding_matches_brute_force_on_random_values() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x05ee_db16);
        for i in 0..200_000 {
            // Random bits over 2^-23..2^27, values near bf16 ties (an f32 tie plus a little),
            // and small values (f16's subnormals).
            let x = match i % 3 {
                0 => f64::from_bits(rng.random::<u64>() & !(0x7ffu64 << 52) | (rng.random_range(1000u64..1050) << 52)),
                1 => {
                    f64::from(f32::from_bits(rng.random_range(0x3f00_0000u32..0x4100_0000) | 0x8000))
                        + rng.random_range(-1e-9..1e-9)
                }
                _ => rng.random_range(-1e-5..1e-5),
            };
            let x = x.abs();
            let want = brute_force(x, half::bf16::from_f64(x).to_bits(), |c| half::bf16::from_bits(c).into());
            assert_eq!(f64_to_bf16(x).to_bits(), want, "bf16 of {x:e}");
            assert_eq!(f64_to_bf16(-x).to_bits(), want | 0x8000, "bf16 of -{x:e}");
            if x < 65504.0 {
                let want = brute_force(x, half::f16::from_f64(x).to_bits(), |c| half::f16::from_bits(c).into());
                assert_eq!(f64_to_f16(x).to_bits(), want, "f16 of {x:e}");
            }
        }
    }

    #[test]
    fn type_display() {
        assert_eq!(Type::Scalar(DType::I32).to_string(), "i32");
        assert_eq!(Type::Tensor(DType::BF16, 4).to_string(), "tensor<?x?x?x?xbf16>");
        assert_eq!(Type::tile(DType::I1, &[16]).to_string(), "tile<16xi1>");
    }
}
