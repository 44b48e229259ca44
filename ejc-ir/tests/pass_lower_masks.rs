//! `lower-masks` alone: each mask op expanded into arithmetic (snapshots in
//! `snapshots/pass_lower_masks__<case>.snap`, checked on the interpreter before and
//! after), then property tests comparing the lowered arithmetic with the ops' direct
//! definitions (`ejc_ir::interp::{mask_holds, block_full, kv_range}`) over many random
//! blocks and term operands, and the definitions themselves with brute force:
//! `block_full` is exact, `kv_range` never drops a visible key and is tight for causal
//! and window masks.

mod common;

use common::{apply, assert_same_semantics, run, run_pass, seed, ArgSpec};
use ejc_ir::interp::{block_full, kv_range, mask_holds, Arg};
use ejc_ir::ir::{walk_ops, Kernel, MaskTerm, OpKind};
use ejc_ir::passes::LowerMasks;
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ALL_TERMS: [MaskTerm; 5] =
    [MaskTerm::ColLeRow, MaskTerm::ColGeRow, MaskTerm::ColLt, MaskTerm::ColGe, MaskTerm::RowLt];

/// A kernel applying all three mask ops with `terms` on a `[bm, bn]` block at
/// (`%i0`, `%j0`) with term operands `%x0..`: `%out` gets the mask (0 kept, −∞
/// masked), `%flags` gets `[block_full, lo, hi]`. `ops` picks which of the three
/// (`a`pply, `f`ull, `r`ange) it contains.
fn kernel_text(name: &str, terms: &[MaskTerm], bm: usize, bn: usize, ops: &str) -> String {
    let xs: String = (0..terms.len()).map(|i| format!(", %x{i}")).collect();
    let params: String = (0..terms.len()).map(|i| format!("%x{i}: i32, ")).collect();
    let names: Vec<&str> = terms.iter().map(|t| t.name()).collect();
    let terms = names.join(", ");
    let mut body = String::new();
    if ops.contains('a') {
        body += &format!(
            "  %zero = const 0.0 : f32\n  %s = tile.splat %zero {{shape = [{bm}, {bn}]}} : tile<{bm}x{bn}xf32>\n  \
             %m = mask.apply %s, %i0, %j0{xs} {{terms = [{terms}]}} : tile<{bm}x{bn}xf32>\n  \
             tile.store %out[%c0 +: {bm}, %c0 +: {bn}], %m\n"
        );
    }
    if ops.contains('f') {
        body += &format!(
            "  %full = mask.block_full %i0, %j0{xs} {{terms = [{terms}], block = [{bm}, {bn}]}} : i1\n  \
             %fi = arith.cast %full {{to = i32}} : i32\n  tile.store %flags[%c0], %fi\n"
        );
    }
    if ops.contains('r') {
        body += &format!(
            "  %lo, %hi = mask.kv_range %i0{xs} {{terms = [{terms}], block = [{bm}, {bn}]}} : i32, i32\n  \
             tile.store %flags[%c1], %lo\n  tile.store %flags[%c2], %hi\n"
        );
    }
    format!(
        "kernel @{name}(%i0: i32, %j0: i32, {params}%out: tensor<?x?xf32>, %flags: tensor<?xi32>) grid(1, 1, 1) {{\n  \
         %c0 = const 0 : i32\n  %c1 = const 1 : i32\n  %c2 = const 2 : i32\n{body}}}\n"
    )
}

fn mask_ops(k: &Kernel) -> usize {
    let mut n = 0;
    walk_ops(&k.body, &mut |op| {
        n += matches!(op.kind, OpKind::MaskApply { .. } | OpKind::MaskBlockFull { .. } | OpKind::MaskKvRange { .. })
            as usize
    });
    n
}

fn lower_case(name: &str, text: &str, bm: usize, bn: usize) {
    let (before, after, printed) = apply(&LowerMasks, text);
    assert_eq!(mask_ops(&after), 0, "{printed}");
    snap!(format!("pass_lower_masks__{name}"), printed);
    let spec = ArgSpec::new().shape("out", &[bm, bn]).shape("flags", &[3]).ints(-12, 12);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 64, seed());
}

#[test]
fn lowers_mask_apply() {
    lower_case("apply", &kernel_text("apply", &ALL_TERMS, 4, 8, "a"), 4, 8);
}

#[test]
fn lowers_mask_block_full() {
    lower_case("block_full", &kernel_text("block_full", &ALL_TERMS, 4, 8, "f"), 4, 8);
}

#[test]
fn lowers_mask_kv_range() {
    lower_case("kv_range", &kernel_text("kv_range", &ALL_TERMS, 4, 8, "r"), 4, 8);
}

#[test]
fn lowers_masks_without_terms() {
    // No term: everything is kept, every block is full, every key is in range.
    lower_case("no_terms", &kernel_text("no_terms", &[], 2, 4, "afr"), 2, 4);
}

#[test]
fn lowers_masks_inside_nested_regions() {
    let text = r#"kernel @nested(%i0: i32, %x: i32, %n: i32, %out: tensor<?x?xf32>, %flags: tensor<?xi32>) grid(1, 1, 1) {
  %c0 = const 0 : i32
  %c2 = const 2 : i32
  %zero = const 0.0 : f32
  %s = tile.splat %zero {shape = [2, 2]} : tile<2x2xf32>
  scf.for %j0 = %c0 to %n step %c2 {
    %full = mask.block_full %i0, %j0, %x {terms = [col_le_row], block = [2, 2]} : i1
    %m = scf.if %full : tile<2x2xf32> {
      scf.yield %s
    } else {
      %m2 = mask.apply %s, %i0, %j0, %x {terms = [col_le_row]} : tile<2x2xf32>
      scf.yield %m2
    }
    tile.store %out[%c0 +: 2, %j0 +: 2], %m
    scf.yield
  }
}
"#;
    let (before, after, printed) = apply(&LowerMasks, text);
    assert_eq!(mask_ops(&after), 0, "{printed}");
    snap!("pass_lower_masks__nested", printed);
    let spec = ArgSpec::new().shape("out", &[2, 9]).shape("flags", &[3]).ints(-3, 9);
    assert_same_semantics(&before, &after, &spec, [1, 1, 1], 32, seed());
}

// ---- property tests -------------------------------------------------------------

/// An i32 drawn to hit the interesting places: small values around 0 (negative
/// included), block-sized values, large ones and, in the `Full` domain, the extremes.
fn int(rng: &mut StdRng, range: Domain) -> i64 {
    if range == Domain::Indices {
        return int(rng, Domain::Realistic).abs();
    }
    match (range, rng.random_range(0..8)) {
        (_, 0..=3) => rng.random_range(-70..=70),
        (_, 4) => rng.random_range(-5000..=5000),
        (Domain::Realistic, _) => rng.random_range(-(1 << 28)..=(1 << 28)),
        (Domain::Full, 5) => rng.random_range(i32::MIN as i64..=i32::MAX as i64),
        (Domain::Full, 6) => i32::MAX as i64 - rng.random_range(0..=70),
        (_, _) => i32::MIN as i64 + rng.random_range(0..=70),
    }
}

/// The values operands take. `Realistic`: within ±2^28 (sequence lengths, windows and
/// block starts of real problems, negative ones included). `Full`: the whole i32
/// range, with many draws near its ends. `Indices`: `Realistic` but non-negative (row
/// and key block starts).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Domain {
    Realistic,
    Full,
    Indices,
}

fn random_terms(rng: &mut StdRng) -> Vec<MaskTerm> {
    let n = rng.random_range(0..=4);
    (0..n).map(|_| ALL_TERMS[rng.random_range(0..ALL_TERMS.len())]).collect()
}

fn random_block(rng: &mut StdRng) -> (usize, usize) {
    const SIZES: [usize; 8] = [1, 2, 3, 4, 5, 8, 16, 32];
    (SIZES[rng.random_range(0..SIZES.len())], SIZES[rng.random_range(0..SIZES.len())])
}

/// Run `kernel` (from [`kernel_text`] with all three ops) and read back the mask,
/// block_full, lo and hi.
fn eval(kernel: &Kernel, bm: usize, bn: usize, i0: i64, j0: i64, xs: &[i64]) -> (Vec<f64>, bool, i64, i64) {
    let mut args = vec![Arg::Scalar(i0 as f64), Arg::Scalar(j0 as f64)];
    args.extend(xs.iter().map(|x| Arg::Scalar(*x as f64)));
    args.push(Arg::Tensor(HostTensor::full(DType::F32, &[bm, bn], f64::NAN)));
    args.push(Arg::Tensor(HostTensor::full(DType::I32, &[3], -7.0)));
    let (out, _) = run(kernel, &args, [1, 1, 1]).unwrap_or_else(|e| panic!("{}: {e}", kernel.name));
    let n = out.len();
    let (Arg::Tensor(m), Arg::Tensor(f)) = (&out[n - 2], &out[n - 1]) else { unreachable!() };
    let f = f.to_vec();
    (m.to_vec(), f[0] != 0.0, f[1] as i64, f[2] as i64)
}

/// What the lowered ops compute equals what the ops are defined to compute (the
/// interpreter runs the unlowered ops with the definitions), over `cases` random
/// (terms, block) combinations with `samples` operand draws each. The block start
/// (i0, j0) is drawn from `starts`, the term operands from `domain`.
fn lowered_matches_definitions(starts: Domain, domain: Domain, cases: usize, samples: usize) -> Vec<String> {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut failures = Vec::new();
    for case in 0..cases {
        let terms = random_terms(&mut rng);
        let (bm, bn) = random_block(&mut rng);
        let raw = common::parse(&kernel_text("prop", &terms, bm, bn, "afr"));
        let lowered = run_pass(&LowerMasks, &raw);
        for _ in 0..samples {
            let (i0, j0) = (int(&mut rng, starts), int(&mut rng, starts));
            let xs: Vec<i64> = terms.iter().map(|_| int(&mut rng, domain)).collect();
            let want = eval(&raw, bm, bn, i0, j0, &xs);
            let got = eval(&lowered, bm, bn, i0, j0, &xs);
            // The unlowered interpreter is the definition, element by element.
            for r in 0..bm {
                for c in 0..bn {
                    let holds = mask_holds(&terms, &xs, i0 + r as i64, j0 + c as i64);
                    assert_eq!(want.0[r * bn + c] == 0.0, holds);
                }
            }
            assert_eq!(want.1, block_full(&terms, &xs, i0, j0, bm as i64, bn as i64));
            assert_eq!((want.2, want.3), kv_range(&terms, &xs, i0, bm as i64, bn as i64));
            let what =
                || format!("seed {seed} case {case}: terms {terms:?} block [{bm}, {bn}] i0 {i0} j0 {j0} xs {xs:?}");
            if !common::same_bits(&got.0, &want.0) {
                failures.push(format!("{}: mask.apply differs", what()));
            }
            if got.1 != want.1 {
                failures.push(format!("{}: mask.block_full is {}, defined {}", what(), got.1, want.1));
            }
            if (got.2, got.3) != (want.2, want.3) {
                failures.push(format!(
                    "{}: mask.kv_range is {:?}, defined {:?}",
                    what(),
                    (got.2, got.3),
                    (want.2, want.3)
                ));
            }
        }
    }
    failures
}

#[test]
fn lowered_mask_ops_equal_their_definitions() {
    let failures = lowered_matches_definitions(Domain::Realistic, Domain::Realistic, 160, 10);
    assert!(
        failures.is_empty(),
        "{} mismatches, e.g.\n{}",
        failures.len(),
        failures[..failures.len().min(8)].join("\n")
    );
}

/// Block starts are real row / key indices, but the term operands come from the
/// caller: a sliding window of `(left, i32::MAX)` ("no right bound") makes the
/// `col_le_row` operand `s_k - s_q + i32::MAX`, which is i32::MAX when s_q = s_k. The
/// definitions hold in exact integers; the lowered i32 arithmetic must not overflow
/// into a different answer.
#[test]
fn lowered_mask_ops_equal_their_definitions_for_operands_near_the_i32_limits() {
    let failures = lowered_matches_definitions(Domain::Indices, Domain::Full, 160, 10);
    assert!(
        failures.is_empty(),
        "{} mismatches, e.g.\n{}",
        failures.len(),
        failures[..failures.len().min(8)].join("\n")
    );
}

/// The keys a row `i` sees, `[a, b]` (i64::MIN / i64::MAX for no bound), computed
/// term by term, and whether the row is cared for (every `row_lt` holds).
fn row_interval(terms: &[MaskTerm], xs: &[i64], i: i64) -> (bool, i64, i64) {
    let (mut cared, mut a, mut b) = (true, i64::MIN, i64::MAX);
    for (t, &x) in terms.iter().zip(xs) {
        match t {
            MaskTerm::ColLeRow => b = b.min(i + x),
            MaskTerm::ColGeRow => a = a.max(i + x),
            MaskTerm::ColLt => b = b.min(x - 1),
            MaskTerm::ColGe => a = a.max(x),
            MaskTerm::RowLt => cared &= i < x,
        }
    }
    (cared, a, b)
}

/// Check the per-row intervals against `mask_holds` at and just outside their ends.
fn check_row_interval(terms: &[MaskTerm], xs: &[i64], i: i64, a: i64, b: i64) {
    // Rows are checked apart from their row_lt terms (those decide whether the row is
    // cared for, not which keys it sees).
    let (terms, xs): (Vec<MaskTerm>, Vec<i64>) =
        terms.iter().zip(xs).filter(|(t, _)| **t != MaskTerm::RowLt).map(|(t, x)| (*t, *x)).unzip();
    let holds = |j: i64| mask_holds(&terms, &xs, i, j);
    let (lo, hi) = (a.max(-(1 << 40)), b.min(1 << 40));
    if lo <= hi {
        assert!(holds(lo) && holds(hi), "{terms:?} {xs:?} row {i}: [{a}, {b}]");
        assert!(a == i64::MIN || !holds(a - 1), "{terms:?} {xs:?} row {i}: [{a}, {b}]");
        assert!(b == i64::MAX || !holds(b + 1), "{terms:?} {xs:?} row {i}: [{a}, {b}]");
    }
}

#[test]
fn block_full_is_true_exactly_when_every_cared_for_element_holds() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..4000 {
        let terms = random_terms(&mut rng);
        let (bm, bn) = random_block(&mut rng);
        let (i0, j0) = (int(&mut rng, Domain::Full), int(&mut rng, Domain::Full));
        let xs: Vec<i64> = terms.iter().map(|_| int(&mut rng, Domain::Full)).collect();
        let brute = (0..bm as i64).all(|r| {
            let i = i0 + r;
            let cared = terms.iter().zip(&xs).all(|(t, &x)| *t != MaskTerm::RowLt || i < x);
            !cared || (0..bn as i64).all(|c| mask_holds(&terms, &xs, i, j0 + c))
        });
        assert_eq!(
            block_full(&terms, &xs, i0, j0, bm as i64, bn as i64),
            brute,
            "seed {seed}: terms {terms:?} block [{bm}, {bn}] i0 {i0} j0 {j0} xs {xs:?}"
        );
    }
}

#[test]
fn kv_range_never_excludes_a_visible_key() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..4000 {
        let terms = random_terms(&mut rng);
        let (bm, bn) = random_block(&mut rng);
        let i0 = int(&mut rng, Domain::Full);
        let xs: Vec<i64> = terms.iter().map(|_| int(&mut rng, Domain::Full)).collect();
        let (lo, hi) = kv_range(&terms, &xs, i0, bm as i64, bn as i64);
        let what = format!("seed {seed}: terms {terms:?} block [{bm}, {bn}] i0 {i0} xs {xs:?} -> [{lo}, {hi})");
        assert!(lo >= 0 && lo % bn as i64 == 0, "{what}");
        for r in 0..bm as i64 {
            let (cared, a, b) = row_interval(&terms, &xs, i0 + r);
            check_row_interval(&terms, &xs, i0 + r, a, b);
            // Keys are >= 0; a row that sees some key j >= 0 must have all of them
            // inside [lo, hi).
            // (The largest key index an i32 sequence length allows is i32::MAX - 1.)
            let (first, last) = (a.max(0), b.min(i32::MAX as i64 - 1));
            if cared && first <= last {
                assert!(lo <= first && last < hi, "{what}: row {} sees keys [{first}, {last}]", i0 + r);
            }
        }
    }
}

#[test]
fn kv_range_is_tight_for_causal_and_window_masks() {
    // Causal (col_le_row), sliding window (col_ge_row and col_le_row with a non-empty window) and the
    // query bound: the first block visited holds a visible key and `hi - 1` is the
    // last visible key; when nothing is visible, nothing is visited.
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..4000 {
        let mut terms = vec![MaskTerm::ColLeRow];
        if rng.random_bool(0.5) {
            terms.push(MaskTerm::ColGeRow);
        }
        if rng.random_bool(0.3) {
            terms.push(MaskTerm::RowLt);
        }
        if rng.random_bool(0.5) {
            terms.reverse();
        }
        let (bm, bn) = random_block(&mut rng);
        let i0 = int(&mut rng, Domain::Realistic);
        let mut xs: Vec<i64> = terms.iter().map(|_| int(&mut rng, Domain::Realistic)).collect();
        // A window (left, right) >= 0 around diagonal d is col_ge_row d - left, col_le_row d + right.
        if let (Some(g), Some(l)) =
            (terms.iter().position(|t| *t == MaskTerm::ColGeRow), terms.iter().position(|t| *t == MaskTerm::ColLeRow))
        {
            if xs[g] > xs[l] {
                xs.swap(g, l);
            }
        }
        let (lo, hi) = kv_range(&terms, &xs, i0, bm as i64, bn as i64);
        let what = format!("seed {seed}: terms {terms:?} block [{bm}, {bn}] i0 {i0} xs {xs:?} -> [{lo}, {hi})");
        let mut visible: Option<(i64, i64)> = None;
        for r in 0..bm as i64 {
            let (cared, a, b) = row_interval(&terms, &xs, i0 + r);
            let first = a.max(0);
            if cared && first <= b {
                visible = Some(visible.map_or((first, b), |(x, y)| (x.min(first), y.max(b))));
            }
        }
        match visible {
            Some((first, last)) => {
                assert_eq!(lo, first.div_euclid(bn as i64) * bn as i64, "{what}: first visible key {first}");
                assert_eq!(hi, last + 1, "{what}: last visible key {last}");
            }
            None => assert!(hi <= lo, "{what}: nothing is visible"),
        }
    }
}
