//! Ring attention's schedule: which tokens each rank holds, and which flash launches a
//! rank runs when it holds another rank's keys and values.
//!
//! A sequence of `n · local` tokens is split over `n` ranks. Every rank keeps its
//! queries; keys and values travel around the ring (rank `r` sends to `r + 1`), so at
//! step `t` rank `r` holds the keys of rank `r − t`. Each step is one or more ordinary
//! flash launches on a block of local query rows and a block of the held key rows,
//! merged by log-sum-exp afterwards (docs/semantics.md, "Ring attention").
//!
//! - [`RingLayout::Contiguous`]: rank `r` holds tokens `[r·local, (r+1)·local)`. With a
//!   causal mask rank `n − 1` does `n` times the work of rank 0.
//! - [`RingLayout::ZigZag`]: the sequence is cut in `2n` chunks and rank `r` holds
//!   chunks `r` and `2n − 1 − r`, so every rank does the same causal work.
//!
//! A launch's mask is the global one seen from the block: the bottom-right-aligned
//! band of the flash kernels (`i + δ − left ≤ j ≤ i + δ + right`, `δ = sk − sq`) with
//! sides that may be negative (a band that lies wholly off the diagonal). Blocks the
//! mask hides are not launched; blocks it leaves whole run without a mask.
//!
//! ```
//! use ejc_ir::flash::ring::{launches, RingLayout, RingMask};
//! // Two ranks, 8 tokens each, causal, zig-zag: at step 1 rank 0 holds rank 1's keys
//! // (chunks 1 and 2) and its queries are chunks 0 and 3.
//! let ls = launches(RingLayout::ZigZag, 2, 8, 0, 1, RingMask { causal: true, window: None }).unwrap();
//! // Chunk 3 sees chunks 1 and 2 whole; chunk 0 sees neither.
//! assert_eq!(ls.len(), 1);
//! assert_eq!((ls[0].q.clone(), ls[0].kv.clone(), ls[0].band), (4..8, 0..8, None));
//! ```

use std::ops::Range;

/// How the tokens of a sequence are dealt to the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RingLayout {
    /// Rank `r` holds `[r·local, (r+1)·local)`.
    Contiguous,
    /// The sequence in `2n` equal chunks; rank `r` holds chunks `r` and `2n − 1 − r`
    /// (`local` must be even).
    ZigZag,
}

impl RingLayout {
    pub fn name(self) -> &'static str {
        match self {
            RingLayout::Contiguous => "contiguous",
            RingLayout::ZigZag => "zigzag",
        }
    }
}

impl std::str::FromStr for RingLayout {
    type Err = String;
    fn from_str(s: &str) -> Result<RingLayout, String> {
        match s {
            "contiguous" => Ok(RingLayout::Contiguous),
            "zigzag" | "zig-zag" => Ok(RingLayout::ZigZag),
            other => Err(format!("unknown ring layout `{other}` (contiguous or zigzag)")),
        }
    }
}

/// The global mask of the sequence: causal, and a `(left, right)` window (inclusive,
/// counts of keys; both sides `>= 0`). Positions are global token indices, and the
/// query and key sequences are the same sequence (so the diagonal is `j = i`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingMask {
    pub causal: bool,
    pub window: Option<(i64, i64)>,
}

/// A piece of a rank's tokens: `len` tokens at global position `global`, stored at
/// local row `local`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub global: usize,
    pub local: usize,
    pub len: usize,
}

/// One flash launch of a step: local query rows `q` against rows `kv` of the keys held
/// (the sending rank's local rows), with `band` the kernel window `(left, right)` in the
/// block's own bottom-right-aligned coordinates, or `None` for an unmasked block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingLaunch {
    pub q: Range<usize>,
    pub kv: Range<usize>,
    pub band: Option<(i64, i64)>,
}

/// Check the ring's sizes: `n >= 1` ranks, `local >= 1` tokens each (even for zig-zag),
/// a window with sides `>= 0`.
pub fn check(layout: RingLayout, n: usize, local: usize, mask: RingMask) -> Result<(), String> {
    if n == 0 {
        return Err("a ring needs at least one rank".into());
    }
    if local == 0 {
        return Err("every rank needs at least one token".into());
    }
    if layout == RingLayout::ZigZag && !local.is_multiple_of(2) {
        return Err(format!(
            "the zig-zag layout gives each rank two equal chunks: {local} tokens per rank is odd (use contiguous, or pad)"
        ));
    }
    if let Some((l, r)) = mask.window {
        if l < 0 || r < 0 {
            return Err(format!("sliding window ({l}, {r}): both sides must be >= 0"));
        }
    }
    Ok(())
}

/// The pieces rank `rank` holds, in local-row order.
pub fn pieces(layout: RingLayout, n: usize, local: usize, rank: usize) -> Vec<Piece> {
    match layout {
        RingLayout::Contiguous => vec![Piece { global: rank * local, local: 0, len: local }],
        RingLayout::ZigZag => {
            let h = local / 2;
            vec![
                Piece { global: rank * h, local: 0, len: h },
                Piece { global: (2 * n - 1 - rank) * h, local: h, len: h },
            ]
        }
    }
}

/// Which local row of which rank holds global token `g`.
pub fn owner(layout: RingLayout, n: usize, local: usize, g: usize) -> (usize, usize) {
    match layout {
        RingLayout::Contiguous => (g / local, g % local),
        RingLayout::ZigZag => {
            let h = local / 2;
            let c = g / h;
            if c < n {
                (c, g % h)
            } else {
                (2 * n - 1 - c, h + g % h)
            }
        }
    }
}

/// The rank whose keys rank `rank` holds at step `step`.
pub fn source(n: usize, rank: usize, step: usize) -> usize {
    (rank + n - step % n) % n
}

/// How the mask meets a block of `lq` query rows at global `qg` and `lk` keys at `kg`:
/// `None` when it hides every pair, else the block's kernel band (`None` inside: no
/// mask needed).
fn block_band(mask: RingMask, (qg, lq): (usize, usize), (kg, lk): (usize, usize)) -> Option<Option<(i64, i64)>> {
    let (lo, hi) = interval(mask, qg, kg);
    band_of(lo, hi, lq, lk)
}

/// The visible pairs of a block with queries at global `qg` and keys at `kg`, as the
/// interval `lo ≤ j − i ≤ hi` of its local indices (`i64::MIN` / `MAX`: open), before
/// the block's own size clips it.
fn interval(mask: RingMask, qg: usize, kg: usize) -> (i64, i64) {
    let delta = qg as i64 - kg as i64;
    let (mut lo, mut hi) = (i64::MIN, i64::MAX);
    if mask.causal {
        hi = hi.min(delta);
    }
    if let Some((l, r)) = mask.window {
        lo = lo.max(delta - l);
        hi = hi.min(delta + r);
    }
    (lo, hi)
}

/// The interval `lo ≤ j − i ≤ hi` clipped to an `lq × lk` block: `None` when it shows no
/// pair, else the kernel band (`None` inside: every pair shows).
fn band_of(lo: i64, hi: i64, lq: usize, lk: usize) -> Option<Option<(i64, i64)>> {
    let (lq, lk) = (lq as i64, lk as i64);
    let (min_d, max_d) = (-(lq - 1), lk - 1);
    if lo > hi || hi < min_d || lo > max_d {
        return None;
    }
    if lo <= min_d && hi >= max_d {
        return Some(None);
    }
    // Kernel band: j ≥ i + δ − left, j ≤ i + δ + right with δ = lk − lq. An open side
    // is the whole block (the kernels clamp a side to sq + sk).
    let d = lk - lq;
    let span = lq + lk;
    let left = if lo <= min_d { span } else { d - lo };
    let right = if hi >= max_d { span } else { hi - d };
    Some(Some((left, right)))
}

/// One launch over all of a rank's rows, when the mask seen through the layout's pieces
/// is a single band in local coordinates (zig-zag's causal diagonal step: the two
/// chunks' causal blocks and the whole block between them are the local causal mask).
/// The kernels skip the tiles a band hides, so one launch does the same work as the
/// pieces' launches without their merges.
fn whole_block(qp: &[Piece], kp: &[Piece], mask: RingMask) -> Option<RingLaunch> {
    let (lq, lk) = (qp.iter().map(|p| p.len).sum::<usize>(), kp.iter().map(|p| p.len).sum::<usize>());
    let shift = |q: &Piece, k: &Piece| k.local as i64 - q.local as i64;
    // The visibility of a piece pair in its own coordinates: empty, or the clipped interval.
    let seen = |lo: i64, hi: i64, q: &Piece, k: &Piece| {
        let (min_d, max_d) = (-(q.len as i64 - 1), k.len as i64 - 1);
        let (lo, hi) = (lo.max(min_d), hi.min(max_d));
        (lo <= hi).then_some((lo, hi))
    };
    let pairs: Vec<(&Piece, &Piece)> = qp.iter().flat_map(|q| kp.iter().map(move |k| (q, k))).collect();
    // Candidates: each pair's interval moved into the whole block's coordinates
    // (local j − i = piece j' − i' + shift).
    for &(cq, ck) in &pairs {
        let (lo, hi) = interval(mask, cq.global, ck.global);
        let s = shift(cq, ck);
        let (lo, hi) = (lo.saturating_add(s), hi.saturating_add(s));
        let same = pairs.iter().all(|&(q, k)| {
            let (plo, phi) = interval(mask, q.global, k.global);
            let s = shift(q, k);
            seen(plo, phi, q, k) == seen(lo.saturating_sub(s), hi.saturating_sub(s), q, k)
        });
        if same {
            return band_of(lo, hi, lq, lk).map(|band| RingLaunch { q: 0..lq, kv: 0..lk, band });
        }
    }
    None
}

/// The launches of rank `rank` at the step where it holds rank `src`'s keys, after the
/// blocks the mask hides are dropped and unmasked neighbours are merged.
pub fn launches(
    layout: RingLayout,
    n: usize,
    local: usize,
    rank: usize,
    src: usize,
    mask: RingMask,
) -> Result<Vec<RingLaunch>, String> {
    check(layout, n, local, mask)?;
    if rank >= n || src >= n {
        return Err(format!("rank {rank} / source {src} outside a ring of {n}"));
    }
    let qp = pieces(layout, n, local, rank);
    let kp = pieces(layout, n, local, src);
    if qp.len() > 1 {
        if let Some(one) = whole_block(&qp, &kp, mask) {
            return Ok(vec![one]);
        }
    }
    // Per query piece: the key pieces it sees, each with its band.
    let mut out: Vec<RingLaunch> = Vec::new();
    for q in &qp {
        let mut row: Vec<RingLaunch> = Vec::new();
        for k in &kp {
            if let Some(band) = block_band(mask, (q.global, q.len), (k.global, k.len)) {
                let l = RingLaunch { q: q.local..q.local + q.len, kv: k.local..k.local + k.len, band };
                // Unmasked neighbours along the keys merge.
                match row.last_mut() {
                    Some(prev) if prev.band.is_none() && band.is_none() && prev.kv.end == l.kv.start => {
                        prev.kv.end = l.kv.end
                    }
                    _ => row.push(l),
                }
            }
        }
        for l in row {
            // ... and along the queries, where the keys are the same.
            match out.iter_mut().find(|p| p.band.is_none() && l.band.is_none() && p.kv == l.kv && p.q.end == l.q.start)
            {
                Some(prev) => prev.q.end = l.q.end,
                None => out.push(l),
            }
        }
    }
    Ok(out)
}

/// Whether the kernel band `(left, right)` of a `lq × lk` block shows local pair
/// `(i, j)` (the flash kernels' rule).
pub fn band_shows(band: Option<(i64, i64)>, lq: usize, lk: usize, i: usize, j: usize) -> bool {
    match band {
        None => true,
        Some((left, right)) => {
            let d = lk as i64 - lq as i64;
            let (i, j) = (i as i64, j as i64);
            j >= i + d - left && j <= i + d + right
        }
    }
}

/// The global mask's rule for tokens `(qi, kj)`.
pub fn mask_shows(mask: RingMask, qi: usize, kj: usize) -> bool {
    let (i, j) = (qi as i64, kj as i64);
    (!mask.causal || j <= i) && mask.window.is_none_or(|(l, r)| j >= i - l && j <= i + r)
}

/// Work of rank `rank` over the whole ring, in visible (query, key) pairs — for the
/// load-balance figure of the two layouts.
pub fn rank_pairs(layout: RingLayout, n: usize, local: usize, rank: usize, mask: RingMask) -> Result<u64, String> {
    let mut total = 0u64;
    for step in 0..n {
        for l in launches(layout, n, local, rank, source(n, rank, step), mask)? {
            let (lq, lk) = (l.q.len(), l.kv.len());
            total += match l.band {
                None => (lq * lk) as u64,
                Some(_) => {
                    let mut c = 0u64;
                    for i in 0..lq {
                        for j in 0..lk {
                            c += band_shows(l.band, lq, lk, i, j) as u64;
                        }
                    }
                    c
                }
            };
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every visible (query, key) pair of the sequence is computed exactly once over
    /// the ring, and no hidden one: both layouts, causal or not, windows of every kind.
    #[test]
    fn launches_cover_the_visible_pairs_exactly_once() {
        let masks = [
            RingMask { causal: false, window: None },
            RingMask { causal: true, window: None },
            RingMask { causal: true, window: Some((5, 0)) },
            RingMask { causal: false, window: Some((3, 7)) },
            RingMask { causal: false, window: Some((0, 0)) },
            RingMask { causal: true, window: Some((17, 2)) },
        ];
        for layout in [RingLayout::Contiguous, RingLayout::ZigZag] {
            for n in [1, 2, 3, 4] {
                for local in [2, 6, 10] {
                    for mask in masks {
                        let s = n * local;
                        let mut seen = vec![0u8; s * s];
                        for rank in 0..n {
                            let qp = pieces(layout, n, local, rank);
                            for step in 0..n {
                                let src = source(n, rank, step);
                                let kp = pieces(layout, n, local, src);
                                let glob = |ps: &[Piece], row: usize| {
                                    let p = ps.iter().find(|p| (p.local..p.local + p.len).contains(&row)).unwrap();
                                    p.global + row - p.local
                                };
                                for l in launches(layout, n, local, rank, src, mask).unwrap() {
                                    let (lq, lk) = (l.q.len(), l.kv.len());
                                    for i in 0..lq {
                                        for j in 0..lk {
                                            if band_shows(l.band, lq, lk, i, j) {
                                                let (gi, gj) = (glob(&qp, l.q.start + i), glob(&kp, l.kv.start + j));
                                                seen[gi * s + gj] += 1;
                                            }
                                        }
                                    }
                                }
                            }
                        }
                        for gi in 0..s {
                            for gj in 0..s {
                                let want = mask_shows(mask, gi, gj) as u8;
                                assert_eq!(
                                    seen[gi * s + gj],
                                    want,
                                    "{layout:?} n={n} local={local} {mask:?}: pair ({gi}, {gj})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn owner_inverts_pieces() {
        for layout in [RingLayout::Contiguous, RingLayout::ZigZag] {
            let (n, local) = (3, 8);
            for rank in 0..n {
                for p in pieces(layout, n, local, rank) {
                    for t in 0..p.len {
                        assert_eq!(owner(layout, n, local, p.global + t), (rank, p.local + t));
                    }
                }
            }
        }
    }

    /// Zig-zag balances causal work: every rank the same; contiguous: rank n−1 does
    /// about 2n−1 times rank 0's.
    #[test]
    fn zigzag_balances_causal_work() {
        let m = RingMask { causal: true, window: None };
        let z: Vec<u64> = (0..4).map(|r| rank_pairs(RingLayout::ZigZag, 4, 16, r, m).unwrap()).collect();
        assert!(z.iter().all(|x| *x == z[0]), "{z:?}");
        let c: Vec<u64> = (0..4).map(|r| rank_pairs(RingLayout::Contiguous, 4, 16, r, m).unwrap()).collect();
        assert_eq!(c[0], 16 * 17 / 2);
        assert_eq!(c[3], 3 * 256 + 16 * 17 / 2);
    }

    #[test]
    fn one_launch_where_the_pieces_make_one_band() {
        let causal = RingMask { causal: true, window: None };
        // Zig-zag's diagonal step: the local causal mask, one launch on every rank.
        for rank in 0..4 {
            let ls = launches(RingLayout::ZigZag, 4, 16, rank, rank, causal).unwrap();
            assert_eq!(ls, vec![RingLaunch { q: 0..16, kv: 0..16, band: Some((32, 0)) }], "rank {rank}");
        }
        // Off the diagonal the pieces are no band: whole blocks, merged.
        let ls = launches(RingLayout::ZigZag, 4, 16, 3, 1, causal).unwrap();
        assert_eq!(ls, vec![RingLaunch { q: 0..16, kv: 0..8, band: None }]);
        let ls = launches(RingLayout::ZigZag, 4, 16, 1, 3, causal).unwrap();
        assert_eq!(ls, vec![RingLaunch { q: 8..16, kv: 0..16, band: None }]);
        // A window cuts the diagonal step into pieces that are not one band.
        let w = RingMask { causal: true, window: Some((3, 0)) };
        assert!(launches(RingLayout::ZigZag, 2, 16, 0, 0, w).unwrap().len() > 1);
    }

    #[test]
    fn bad_rings_are_refused() {
        let m = RingMask::default();
        assert!(check(RingLayout::ZigZag, 2, 7, m).unwrap_err().contains("odd"));
        assert!(check(RingLayout::Contiguous, 0, 8, m).is_err());
        assert!(check(RingLayout::Contiguous, 2, 8, RingMask { causal: false, window: Some((-1, 0)) }).is_err());
    }
}
