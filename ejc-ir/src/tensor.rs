//! Host tensors: the data the interpreter and the reference work on.
//!
//! Values are held as `f64`, already rounded to the tensor's element type, so a bf16
//! tensor holds exactly the values a device would load. Strides are in elements and
//! may be zero (broadcast) or arbitrary (views of a larger buffer).
//!
//! ```
//! use ejc_ir::tensor::HostTensor;
//! use ejc_ir::types::DType;
//! let mut t = HostTensor::zeros(DType::BF16, &[2, 3]);
//! t.set(&[1, 2], 1.0 + 1.0 / 1024.0); // rounded to bf16 on store
//! assert_eq!(t.get(&[1, 2]), 1.0);
//! ```

use crate::types::DType;

#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Element strides, one per axis. Zero broadcasts an axis.
    pub strides: Vec<isize>,
    /// Element offset of index `[0, 0, ...]` in `data`.
    pub offset: usize,
    pub data: Vec<f64>,
}

impl HostTensor {
    /// Row-major strides for `shape`.
    pub fn contiguous_strides(shape: &[usize]) -> Vec<isize> {
        let mut strides = vec![0isize; shape.len()];
        let mut acc = 1isize;
        for i in (0..shape.len()).rev() {
            strides[i] = acc;
            acc *= shape[i].max(1) as isize;
        }
        strides
    }

    pub fn zeros(dtype: DType, shape: &[usize]) -> HostTensor {
        Self::full(dtype, shape, 0.0)
    }

    pub fn full(dtype: DType, shape: &[usize], value: f64) -> HostTensor {
        let n = shape.iter().product();
        HostTensor {
            dtype,
            shape: shape.to_vec(),
            strides: Self::contiguous_strides(shape),
            offset: 0,
            data: vec![dtype.round(value); n],
        }
    }

    /// A contiguous tensor from row-major values; each value is rounded to `dtype`.
    ///
    /// Panics if `data.len()` is not the product of `shape` (a programming error).
    pub fn from_vec(dtype: DType, shape: &[usize], data: Vec<f64>) -> HostTensor {
        let n: usize = shape.iter().product();
        assert_eq!(data.len(), n, "HostTensor::from_vec: {} values for shape {:?}", data.len(), shape);
        HostTensor {
            dtype,
            shape: shape.to_vec(),
            strides: Self::contiguous_strides(shape),
            offset: 0,
            data: data.into_iter().map(|x| dtype.round(x)).collect(),
        }
    }

    /// A view of `base`'s storage with another shape and strides (e.g. a broadcast with
    /// stride 0, or a non-contiguous slice). Panics if the view reaches outside storage.
    pub fn view(base: &HostTensor, shape: &[usize], strides: &[isize], offset: usize) -> HostTensor {
        let t = HostTensor {
            dtype: base.dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
            data: base.data.clone(),
        };
        assert!(t.in_storage(), "HostTensor::view reaches outside its storage");
        t
    }

    /// [`HostTensor::view`] that takes `base`'s storage instead of copying it (for
    /// large inputs: a copy of a 2^31-element tensor costs seconds and 17 GB).
    pub fn into_view(self, shape: &[usize], strides: &[isize], offset: usize) -> HostTensor {
        let t = HostTensor { shape: shape.to_vec(), strides: strides.to_vec(), offset, ..self };
        assert!(t.in_storage(), "HostTensor::into_view reaches outside its storage");
        t
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether every index of the shape maps inside `data`.
    pub fn in_storage(&self) -> bool {
        // An empty axis, not a zero product: a product can wrap to zero.
        if self.shape.contains(&0) {
            return true;
        }
        // i128: no extent or stride of 64 bits can overflow it.
        let mut lo = self.offset as i128;
        let mut hi = self.offset as i128;
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            let span = (n as i128 - 1) * s as i128;
            if span < 0 {
                lo += span;
            } else {
                hi += span;
            }
        }
        lo >= 0 && hi < self.data.len() as i128
    }

    /// Storage position of a multi-index (no bounds check beyond debug asserts).
    pub fn position(&self, idx: &[usize]) -> usize {
        debug_assert_eq!(idx.len(), self.shape.len());
        let mut p = self.offset as isize;
        for (i, (&x, &s)) in idx.iter().zip(&self.strides).enumerate() {
            debug_assert!(x < self.shape[i], "index {x} out of bounds for axis {i} of {:?}", self.shape);
            p += x as isize * s;
        }
        p as usize
    }

    pub fn get(&self, idx: &[usize]) -> f64 {
        self.data[self.position(idx)]
    }

    /// Store `value` rounded to the element type.
    pub fn set(&mut self, idx: &[usize], value: f64) {
        let p = self.position(idx);
        self.data[p] = self.dtype.round(value);
    }

    /// All values in row-major order of the logical shape.
    pub fn to_vec(&self) -> Vec<f64> {
        let mut out = Vec::with_capacity(self.numel());
        let mut idx = vec![0usize; self.rank()];
        if self.numel() == 0 {
            return out;
        }
        loop {
            out.push(self.get(&idx));
            let mut ax = self.rank();
            loop {
                if ax == 0 {
                    return out;
                }
                ax -= 1;
                idx[ax] += 1;
                if idx[ax] < self.shape[ax] {
                    break;
                }
                idx[ax] = 0;
            }
        }
    }
}

/// ‖a − b‖₂ / ‖b‖₂ and max |a − b| over two equally long slices, the way DESIGN.md
/// measures a kernel against the reference. Positions where both are the same
/// infinity count as equal; any NaN makes both figures NaN so it never passes.
pub fn compare(actual: &[f64], expected: &[f64]) -> (f64, f64) {
    assert_eq!(actual.len(), expected.len(), "compare: lengths differ");
    let mut num = 0.0f64;
    let mut den = 0.0f64;
    let mut max_abs = 0.0f64;
    for (&a, &e) in actual.iter().zip(expected) {
        if a.is_nan() || e.is_nan() {
            return (f64::NAN, f64::NAN);
        }
        if a == e {
            if e.is_finite() {
                den += e * e;
            }
            continue;
        }
        let d = a - e;
        if !d.is_finite() {
            return (f64::INFINITY, f64::INFINITY);
        }
        num += d * d;
        den += e * e;
        max_abs = max_abs.max(d.abs());
    }
    let rel = if den > 0.0 {
        (num / den).sqrt()
    } else if num == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    (rel, max_abs)
}

/// Where two tensors of one shape differ, in words, for a failed check: how many
/// elements are off by more than `tol` times the expected values' RMS (or are NaN), the
/// indices along each axis that hold one (as ranges), and the worst few elements. A
/// kernel bug usually has a shape (one tile's rows, the upper half of the head dim, one
/// page): this shows it without a debugger. Empty when no element is that far off.
pub fn mismatch_pattern(actual: &HostTensor, expected: &HostTensor, tol: f64) -> String {
    let (a, e) = (actual.to_vec(), expected.to_vec());
    if a.len() != e.len() || actual.shape != expected.shape {
        return format!("shapes differ: {:?} against {:?}", actual.shape, expected.shape);
    }
    let finite: Vec<f64> = e.iter().copied().filter(|x| x.is_finite()).collect();
    let rms = (finite.iter().map(|x| x * x).sum::<f64>() / finite.len().max(1) as f64).sqrt();
    let limit = tol * rms.max(f64::MIN_POSITIVE);
    let off = |i: usize| {
        let d = (a[i] - e[i]).abs();
        a[i].is_nan() != e[i].is_nan() || (a[i] != e[i] && (d.is_nan() || d > limit))
    };
    let shape = &expected.shape;
    let rank = shape.len();
    let mut hit: Vec<Vec<bool>> = shape.iter().map(|&n| vec![false; n]).collect();
    let index = |mut i: usize| {
        let mut idx = vec![0usize; rank];
        for ax in (0..rank).rev() {
            idx[ax] = i % shape[ax];
            i /= shape[ax];
        }
        idx
    };
    let mut worst: Vec<(f64, usize)> = Vec::new();
    let mut count = 0usize;
    for i in (0..e.len()).filter(|&i| off(i)) {
        count += 1;
        for (ax, &x) in index(i).iter().enumerate() {
            hit[ax][x] = true;
        }
        let d = if a[i].is_nan() { f64::INFINITY } else { (a[i] - e[i]).abs() };
        worst.push((d, i));
        if worst.len() > 64 {
            worst.sort_by(|x, y| y.0.total_cmp(&x.0));
            worst.truncate(4);
        }
    }
    if count == 0 {
        return String::new();
    }
    worst.sort_by(|x, y| y.0.total_cmp(&x.0));
    worst.truncate(4);
    let ranges = |h: &[bool]| {
        let mut out: Vec<String> = Vec::new();
        let mut i = 0;
        while i < h.len() {
            if !h[i] {
                i += 1;
                continue;
            }
            let s = i;
            while i < h.len() && h[i] {
                i += 1;
            }
            out.push(if i - 1 == s { s.to_string() } else { format!("{s}-{}", i - 1) });
        }
        if out.len() > 8 {
            let n = out.len();
            out.truncate(8);
            out.push(format!("… ({n} runs)"));
        }
        out.join(",")
    };
    let axes: Vec<String> =
        hit.iter().enumerate().map(|(ax, h)| format!("axis {ax} of {}: {}", shape[ax], ranges(h))).collect();
    let w: Vec<String> =
        worst.iter().map(|&(_, i)| format!("{:?} got {:.4e} want {:.4e}", index(i), a[i], e[i])).collect();
    format!(
        "{count} of {} elements off by more than {tol:.0e} x the RMS ({rms:.3e}); {}; worst: {}",
        e.len(),
        axes.join("; "),
        w.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_is_described_by_its_indices() {
        let want = HostTensor::from_vec(DType::F32, &[4, 3], (0..12).map(|i| 1.0 + i as f64).collect());
        let mut got = want.clone();
        assert_eq!(mismatch_pattern(&got, &want, 1e-3), "");
        got.data[3 * 2 + 1] += 5.0; // [2, 1]
        got.data[3 * 3 + 1] = f64::NAN; // [3, 1]
        let text = mismatch_pattern(&got, &want, 1e-3);
        assert!(text.starts_with("2 of 12 elements"), "{text}");
        assert!(text.contains("axis 0 of 4: 2-3; axis 1 of 3: 1;"), "{text}");
        assert!(text.contains("worst: [3, 1] got NaN"), "{text}");
    }

    #[test]
    fn strided_views_and_broadcast() {
        let base = HostTensor::from_vec(DType::F32, &[2, 3], vec![0., 1., 2., 3., 4., 5.]);
        let t = HostTensor::view(&base, &[3, 2], &[1, 3], 0);
        assert_eq!(t.to_vec(), vec![0., 3., 1., 4., 2., 5.]);
        let b = HostTensor::view(&base, &[4, 3], &[0, 1], 3);
        assert_eq!(b.get(&[3, 2]), 5.0);
    }

    #[test]
    fn compare_handles_infinities_and_nan() {
        let inf = f64::NEG_INFINITY;
        assert_eq!(compare(&[1.0, inf], &[1.0, inf]), (0.0, 0.0));
        assert!(compare(&[f64::NAN], &[1.0]).0.is_nan());
        assert_eq!(compare(&[inf], &[1.0]).0, f64::INFINITY);
        let (r, m) = compare(&[1.0, 2.0], &[1.0, 2.5]);
        assert!((m - 0.5).abs() < 1e-12 && r > 0.0);
    }
}
