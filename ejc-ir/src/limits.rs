//! The limits ejc enforces on what it is asked to do, in one place: how large a spec file
//! may be, how many worker threads a CPU launch may start, how much host memory a call of
//! `ejc run`/`bench`/`tune` may allocate, and the ranges of kernel scalar parameters.
//! Each limit is checked before the work starts and refused with an error that says how
//! to raise it (docs/limits.md lists them all).
//!
//! ```
//! use ejc_ir::limits;
//! assert_eq!(limits::parse_bytes("512M"), Ok(512 << 20));
//! assert!(limits::check_scalar(ejc_ir::types::DType::I32, 3e9).is_err());
//! assert_eq!(limits::worker_threads(0).unwrap(), limits::available_threads());
//! ```

use std::io::Read;
use std::path::Path;

use crate::types::DType;

/// The largest spec file read (16 MiB; `EJC_MAX_SPEC_BYTES` raises it). Real specs are a
/// few kilobytes: the cap stops `ejc check /dev/zero` from reading until memory runs out.
pub const SPEC_BYTES: u64 = 16 << 20;

/// The most diagnostics a spec error keeps (the rest are counted, not kept).
pub const MAX_DIAGNOSTICS: usize = 100;

/// The most diagnostics printed; the rest are summarised in one line.
pub const SHOWN_DIAGNOSTICS: usize = 20;

/// The widest source excerpt a diagnostic echoes (characters around the column).
pub const EXCERPT_CHARS: usize = 120;

/// `name` from the environment as a byte count (`EJC_MAX_SPEC_BYTES=64M`), else `default`.
fn env_bytes(name: &str, default: u64) -> Result<u64, String> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => parse_bytes(&v).map_err(|e| format!("${name}: {e}")),
        _ => Ok(default),
    }
}

/// The spec size cap in force.
pub fn spec_bytes() -> Result<u64, String> {
    env_bytes("EJC_MAX_SPEC_BYTES", SPEC_BYTES)
}

/// Read at most `cap` bytes of a file; a longer file (or an endless one such as
/// `/dev/zero`) is an error naming `what` and the variable that raises the cap.
pub fn read_capped(path: &Path, cap: u64, what: &str, raise: &str) -> Result<Vec<u8>, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| e.to_string())?;
    if bytes.len() as u64 > cap {
        return Err(format!("the {what} is larger than {} (the limit; {raise} raises it)", show_bytes(cap)));
    }
    Ok(bytes)
}

/// `123`, `64K`, `512M`, `16G`, `1T` (binary units, optional `B`/`iB`), or `none`
/// (no limit: `u64::MAX`).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("none") {
        return Ok(u64::MAX);
    }
    let lower = t.to_ascii_lowercase();
    let body = lower.trim_end_matches("ib").trim_end_matches('b');
    let (num, shift) = match body.chars().last() {
        Some('k') => (&body[..body.len() - 1], 10),
        Some('m') => (&body[..body.len() - 1], 20),
        Some('g') => (&body[..body.len() - 1], 30),
        Some('t') => (&body[..body.len() - 1], 40),
        _ => (body, 0),
    };
    let bad = || format!("`{t}` is not a size (a byte count such as 512M, 16G or 1T, or `none`)");
    let n: f64 = num.trim().parse().map_err(|_| bad())?;
    if !(n.is_finite() && n >= 0.0) {
        return Err(bad());
    }
    let bytes = n * (1u64 << shift) as f64;
    if bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// `1.5 GiB`, `512 MiB`, `100 B`.
pub fn show_bytes(b: u64) -> String {
    const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (u, s) in UNITS {
        if b >= s {
            return format!("{:.1} {u}", b as f64 / s as f64);
        }
    }
    format!("{b} B")
}

/// The hardware threads this process may use.
pub fn available_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// The most worker threads a CPU launch starts: 4 × the hardware threads, at least 64
/// (`EJC_MAX_THREADS` sets it). More threads than that only queue behind each other.
pub fn max_threads() -> usize {
    std::env::var("EJC_MAX_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| *n >= 1)
        .unwrap_or_else(|| (4 * available_threads()).max(64))
}

/// The worker threads for a request (0 = every hardware thread), or an error when it is
/// above [`max_threads`].
pub fn worker_threads(requested: usize) -> Result<usize, String> {
    if requested == 0 {
        return Ok(available_threads());
    }
    let max = max_threads();
    if requested > max {
        return Err(format!(
            "{requested} worker threads is more than the limit of {max} (4 x this machine's {} hardware \
             threads, at least 64; EJC_MAX_THREADS raises it)",
            available_threads()
        ));
    }
    Ok(requested)
}

/// The host memory a command may allocate for one call's tensors: `EJC_MEMORY_LIMIT`
/// (a size, or `none`), else 3/4 of this machine's physical memory (16 GiB where it
/// cannot be read).
pub fn memory_limit() -> Result<u64, String> {
    let default = physical_memory().map_or(16 << 30, |m| m / 4 * 3);
    env_bytes("EJC_MEMORY_LIMIT", default)
}

/// Physical memory in bytes (Linux: `/proc/meminfo`'s MemTotal).
pub fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Whether `x` is a value a kernel scalar of `dtype` can take unchanged: an integer in
/// the type's range for integers, a finite value that stays finite (and non-zero when
/// it is) in the type for floats. Kernels take 32-bit scalars: a window of 2³² must be
/// refused, not wrapped to 0.
pub fn check_scalar(dtype: DType, x: f64) -> Result<(), String> {
    let int_range = |lo: f64, hi: f64, ty: &str| {
        if x.is_nan() || x.fract() != 0.0 {
            Err(format!("{x} is not an integer (the kernel takes an {ty})"))
        } else if x < lo || x > hi {
            Err(format!("{x} is outside the kernel's {ty} range [{lo}, {hi}]"))
        } else {
            Ok(())
        }
    };
    let float_range = |max: f64, min_normal: f64, ty: &str| {
        if x.is_nan() {
            // NaN is a value some callers pass on purpose (a NaN-filled check); keep it.
            Ok(())
        } else if x.is_finite() && x.abs() > max {
            Err(format!("{x} overflows the kernel's {ty} (largest finite {max:e})"))
        } else if x != 0.0 && x.abs() < min_normal {
            Err(format!("{x} underflows the kernel's {ty} (smallest normal {min_normal:e})"))
        } else {
            Ok(())
        }
    };
    match dtype {
        DType::I32 => int_range(i32::MIN as f64, i32::MAX as f64, "i32"),
        DType::U32 => int_range(0.0, u32::MAX as f64, "u32"),
        DType::F32 => float_range(f32::MAX as f64, f32::MIN_POSITIVE as f64, "f32"),
        DType::F16 => float_range(65504.0, 6.103515625e-5, "f16"),
        DType::BF16 => float_range(3.3895313892515355e38, f32::MIN_POSITIVE as f64, "bf16"),
        DType::F64 | DType::I1 => Ok(()),
    }
}

/// `s` with every control character except newline and tab written as `\u{..}`, so text
/// from a spec or a flag cannot move the cursor, recolour or clear the terminal.
pub fn escape_controls(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() && c != '\n' && c != '\t' {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The product of `dims`, or an error when it overflows 64 bits.
pub fn checked_product(dims: &[usize]) -> Result<usize, String> {
    dims.iter()
        .try_fold(1usize, |acc, d| acc.checked_mul(*d))
        .ok_or_else(|| format!("the shape {dims:?} has more elements than 64 bits count"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_bytes("100"), Ok(100));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("2t"), Ok(2 << 40));
        assert_eq!(parse_bytes("none"), Ok(u64::MAX));
        assert!(parse_bytes("-1G").is_err());
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("1e30T").is_err());
        assert_eq!(show_bytes(3 << 29), "1.5 GiB");
        assert_eq!(show_bytes(12), "12 B");
    }

    #[test]
    fn scalars_are_checked_against_the_kernel_types() {
        assert!(check_scalar(DType::I32, 2147483647.0).is_ok());
        assert!(check_scalar(DType::I32, 2147483648.0).is_err());
        assert!(check_scalar(DType::I32, 4294967296.0).is_err());
        assert!(check_scalar(DType::I32, 1.5).is_err());
        assert!(check_scalar(DType::F32, 50.0).is_ok());
        assert!(check_scalar(DType::F32, 1e39).is_err());
        assert!(check_scalar(DType::F32, 1e-46).is_err());
        assert!(check_scalar(DType::F32, 0.0).is_ok());
        assert!(check_scalar(DType::F32, f64::NEG_INFINITY).is_ok());
    }

    #[test]
    fn threads_are_capped() {
        assert!(worker_threads(1).is_ok());
        assert!(worker_threads(max_threads()).is_ok());
        let e = worker_threads(max_threads() + 1).unwrap_err();
        assert!(e.contains("EJC_MAX_THREADS"), "{e}");
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escape_controls("a\x1b[31mb\tc\nd"), "a\\u{1b}[31mb\tc\nd");
        assert!(matches!(escape_controls("plain"), std::borrow::Cow::Borrowed(_)));
    }

    #[test]
    fn products_are_checked() {
        assert_eq!(checked_product(&[2, 3, 4]), Ok(24));
        assert!(checked_product(&[1 << 40, 1 << 40]).is_err());
    }

    #[test]
    fn reads_are_capped() {
        let e = read_capped(Path::new("/dev/zero"), 1024, "spec", "X").unwrap_err();
        assert!(e.contains("larger than 1.0 KiB"), "{e}");
    }
}
