//! `classify-mask-blocks` alone on small hand-written attention loops (4 x 4 blocks,
//! head dim 4). Snapshots in `snapshots/pass_classify_mask_blocks__<case>.snap`.
//!
//! Each case runs on the interpreter before and after the pass over several
//! (seq_q, seq_k) shapes: the outputs must agree bit for bit, and the op counts show
//! whether the loop was narrowed (fewer key blocks visited) or only guarded.

mod common;

use common::{apply, assert_same_semantics, seed, ArgSpec};
use ejc_ir::interp::Stats;
use ejc_ir::ir::{walk_ops, Kernel, MaskTerm, OpKind};
use ejc_ir::passes::ClassifyMaskBlocks;

/// A flash-attention loop over key blocks. `lo`/`step` are the loop's lower bound and
/// step (`%c0`, `%c4`, ...), `terms`/`xs` the mask's terms and operands; `carry_extra`
/// and `body_extra` add a fourth carried value / extra ops to the body (`%extra` is a
/// spare `[seq_q, seq_k]` output, `%s` the unmasked and `%sm` the masked scores).
struct Loop<'a> {
    name: &'a str,
    lo: &'a str,
    step: &'a str,
    terms: &'a str,
    xs: &'a str,
    /// (init, type, body ops ending in the value to yield as `%x2`, after-loop ops using `%x`)
    carry_extra: Option<(&'a str, &'a str, &'a str, &'a str)>,
    body_extra: &'a str,
}

impl<'a> Loop<'a> {
    fn causal(name: &'a str) -> Loop<'a> {
        Loop {
            name,
            lo: "%c0",
            step: "%c4",
            terms: "col_lt, row_lt, col_le_row",
            xs: "%sk, %sq, %diag",
            carry_extra: None,
            body_extra: "",
        }
    }

    fn text(&self) -> String {
        let (c_init, c_ty, c_body, c_after) = match self.carry_extra {
            Some((init, ty, body, after)) => {
                (format!(", %xi = {init}"), format!(", {ty}"), body.to_string(), after.to_string())
            }
            None => (String::new(), String::new(), String::new(), String::new()),
        };
        let (c_res, c_yield) = if self.carry_extra.is_some() { (", %x", ", %x2") } else { ("", "") };
        format!(
            r#"kernel @{name}(%q: tensor<?x?xf32>, %k: tensor<?x?xf32>, %v: tensor<?x?xf32>, %out: tensor<?x?xf32>, %extra: tensor<?x?xf32>, %w: i32) grid(cdiv(seq_q, 4), 1, 1) {{
  %pid = program.id {{axis = 0}} : i32
  %c0 = const 0 : i32
  %c4 = const 4 : i32
  %c8 = const 8 : i32
  %i0 = arith.mul %pid, %c4 : i32
  %sq = program.dim %q {{axis = 0}} : i32
  %sk = program.dim %k {{axis = 0}} : i32
  %diag = arith.sub %sk, %sq : i32
  %left = arith.sub %diag, %w : i32
  %qt = tile.load %q[%i0 +: 4, %c0 +: 4] {{pad = 0.0}} : tile<4x4xf32>
  %ninf = const -inf : f32
  %zero = const 0.0 : f32
  %m0 = tile.splat %ninf {{shape = [4]}} : tile<4xf32>
  %l0 = tile.splat %zero {{shape = [4]}} : tile<4xf32>
  %acc0 = tile.splat %zero {{shape = [4, 4]}} : tile<4x4xf32>
  %acc, %m, %l{c_res} = scf.for %j0 = {lo} to %sk step {step} iter_args(%a = %acc0, %mi = %m0, %li = %l0{c_init}) : tile<4x4xf32>, tile<4xf32>, tile<4xf32>{c_ty} {{
    %kt = tile.load %k[%j0 +: 4, %c0 +: 4] {{pad = 0.0}} : tile<4x4xf32>
    %s = tile.dot %qt, %kt, %acc0 {{trans_b}} : tile<4x4xf32>
    %sm = mask.apply %s, %i0, %j0, {xs} {{terms = [{terms}]}} : tile<4x4xf32>
    %p, %alpha, %mn, %ln = softmax.update %sm, %mi, %li : tile<4x4xf32>, tile<4xf32>, tile<4xf32>, tile<4xf32>
    %a2 = softmax.rescale %a, %alpha : tile<4x4xf32>
    %vt = tile.load %v[%j0 +: 4, %c0 +: 4] {{pad = 0.0}} : tile<4x4xf32>
    %a3 = tile.dot %p, %vt, %a2 : tile<4x4xf32>
{body_extra}{c_body}    scf.yield %a3, %mn, %ln{c_yield}
  }}
  %o, %lse = softmax.finalize %acc, %m, %l : tile<4x4xf32>, tile<4xf32>
  tile.store %out[%i0 +: 4, %c0 +: 4], %o
{c_after}}}
"#,
            name = self.name,
            lo = self.lo,
            step = self.step,
            xs = self.xs,
            terms = self.terms,
            body_extra = self.body_extra,
        )
    }
}

/// Shapes (seq_q, seq_k): equal, s_q < s_k, s_q > s_k (rows that see nothing), a
/// single query row, lengths that are not multiples of the block.
const SHAPES: &[(usize, usize)] = &[(13, 13), (9, 17), (17, 6), (1, 23), (8, 8)];

/// Run before/after on every shape (window `%w` random in 0..=5) and return the
/// summed op counts.
fn check_semantics(before: &Kernel, after: &Kernel) -> (Stats, Stats) {
    let seed = seed();
    let mut totals = (Stats::default(), Stats::default());
    for (n, &(sq, sk)) in SHAPES.iter().enumerate() {
        let spec = ArgSpec::new()
            .shape("q", &[sq, 4])
            .shape("k", &[sk, 4])
            .shape("v", &[sk, 4])
            .shape("out", &[sq, 4])
            .shape("extra", &[sq, sk])
            .ints(0, 5);
        let grid = [sq.div_ceil(4), 1, 1];
        let (a, b) = assert_same_semantics(before, after, &spec, grid, 3, seed.wrapping_add(100 * n as u64));
        for (t, s) in [(&mut totals.0, a), (&mut totals.1, b)] {
            for (op, c) in s.op_counts {
                *t.op_counts.entry(op).or_insert(0) += c;
            }
        }
    }
    totals
}

/// The pass narrowed a loop: it computed the visible key range with `mask.kv_range`
/// (and took the loop's bounds from it).
fn narrowed(k: &Kernel) -> bool {
    let mut has_range = false;
    walk_ops(&k.body, &mut |op| has_range |= matches!(op.kind, OpKind::MaskKvRange { .. }));
    has_range
}

fn guards(k: &Kernel) -> usize {
    let mut n = 0;
    walk_ops(&k.body, &mut |op| n += matches!(op.kind, OpKind::MaskBlockFull { .. }) as usize);
    n
}

#[test]
fn narrows_a_causal_loop_and_guards_the_mask() {
    let (before, after, text) = apply(&ClassifyMaskBlocks, &Loop::causal("causal").text());
    assert!(narrowed(&after), "{text}");
    assert_eq!(guards(&after), 1, "{text}");
    snap!("pass_classify_mask_blocks__causal", text);
    let (a, b) = check_semantics(&before, &after);
    // Above the diagonal the blocks are never visited: fewer dots, and the per-element
    // masking runs only on the partial (diagonal) blocks.
    assert!(b.count("tile.dot") < a.count("tile.dot"), "{a:?}\n{b:?}");
    assert!(b.count("mask.apply") < b.count("mask.block_full"), "{b:?}");
}

#[test]
fn narrows_a_sliding_window_loop_at_both_ends() {
    let l = Loop {
        terms: "col_lt, row_lt, col_ge_row, col_le_row",
        xs: "%sk, %sq, %left, %diag",
        ..Loop::causal("window")
    };
    let (before, after, text) = apply(&ClassifyMaskBlocks, &l.text());
    assert!(narrowed(&after), "{text}");
    snap!("pass_classify_mask_blocks__window", text);
    let (a, b) = check_semantics(&before, &after);
    assert!(b.count("tile.dot") < a.count("tile.dot"), "{a:?}\n{b:?}");
    // The window's right edge is the causal diagonal (right = 0), so visiting fewer
    // blocks than the narrowed causal loop means blocks left of the window (with the
    // window width %w <= 5, e.g. block 0 for rows 12..16) are skipped too.
    let causal = common::run_pass(&ClassifyMaskBlocks, &common::parse(&Loop::causal("causal").text()));
    let (_, c) = check_semantics(&common::parse(&Loop::causal("causal").text()), &causal);
    assert!(b.count("tile.dot") < c.count("tile.dot"), "window {b:?}\ncausal {c:?}");
}

#[test]
fn does_not_narrow_when_a_masked_block_still_changes_a_carried_value() {
    // The loop also sums the *unmasked* scores into a fourth carried value: a block
    // above the diagonal changes that sum, so skipping it would change the result.
    let l = Loop {
        carry_extra: Some((
            "%l0",
            "tile<4xf32>",
            "    %rs = reduce.sum %s {axis = 1} : tile<4xf32>\n    %x2 = arith.add %xi, %rs : tile<4xf32>\n",
            "  tile.store %extra[%i0 +: 4, %c0], %x\n",
        )),
        ..Loop::causal("unmasked_sum")
    };
    let (before, after, text) = apply(&ClassifyMaskBlocks, &l.text());
    assert!(!narrowed(&after), "{text}");
    assert_eq!(guards(&after), 1, "the guard never changes a result, so it is still added\n{text}");
    snap!("pass_classify_mask_blocks__unmasked_sum", text);
    let (a, b) = check_semantics(&before, &after);
    assert_eq!(a.count("tile.dot"), b.count("tile.dot"));
}

#[test]
fn does_not_narrow_a_loop_that_stores() {
    // Every iteration writes its masked scores out: skipping a block would leave its
    // part of `%extra` unwritten, although no carried value changes.
    let l = Loop { body_extra: "    tile.store %extra[%i0 +: 4, %j0 +: 4], %sm\n", ..Loop::causal("stores") };
    let (before, after, text) = apply(&ClassifyMaskBlocks, &l.text());
    snap!("pass_classify_mask_blocks__stores", text);
    check_semantics(&before, &after);
    assert!(!narrowed(&after), "{text}");
}

#[test]
fn does_not_narrow_a_loop_starting_elsewhere_than_zero() {
    let l = Loop { lo: "%c4", ..Loop::causal("lo4") };
    let (before, after, text) = apply(&ClassifyMaskBlocks, &l.text());
    assert!(!narrowed(&after), "{text}");
    assert_eq!(guards(&after), 1, "{text}");
    snap!("pass_classify_mask_blocks__lower_bound_4", text);
    let (a, b) = check_semantics(&before, &after);
    assert_eq!(a.count("tile.dot"), b.count("tile.dot"));
}

#[test]
fn does_not_narrow_a_loop_whose_step_is_not_the_block_width() {
    let l = Loop { step: "%c8", ..Loop::causal("step8") };
    let (before, after, text) = apply(&ClassifyMaskBlocks, &l.text());
    assert!(!narrowed(&after), "{text}");
    assert_eq!(guards(&after), 1, "{text}");
    snap!("pass_classify_mask_blocks__step_8", text);
    let (a, b) = check_semantics(&before, &after);
    assert_eq!(a.count("tile.dot"), b.count("tile.dot"));
}

#[test]
fn leaves_a_mask_not_indexed_by_the_loop_alone() {
    // The mask's key start is not the induction variable: the pass cannot tell which
    // key block the scores are, and changes nothing.
    let l = Loop { body_extra: "", ..Loop::causal("not_iv") };
    let text = l.text().replace("mask.apply %s, %i0, %j0,", "mask.apply %s, %i0, %c0,");
    let (before, after, printed) = apply(&ClassifyMaskBlocks, &text);
    assert_eq!(printed, ejc_ir::print::print_kernel(&before));
    check_semantics(&before, &after);
}

#[test]
fn the_pass_is_idempotent() {
    let (_, once, text) = apply(&ClassifyMaskBlocks, &Loop::causal("twice").text());
    let twice = common::run_pass(&ClassifyMaskBlocks, &once);
    assert_eq!(ejc_ir::print::print_kernel(&twice), text);
}

/// The terms of the first `mask.block_full` and `mask.apply` of a kernel.
fn mask_terms(k: &Kernel) -> (Vec<MaskTerm>, Vec<MaskTerm>) {
    let (mut full, mut apply) = (None, None);
    walk_ops(&k.body, &mut |op| match &op.kind {
        OpKind::MaskBlockFull { terms, .. } => {
            full.get_or_insert(terms.clone());
        }
        OpKind::MaskApply { terms } => {
            apply.get_or_insert(terms.clone());
        }
        _ => {}
    });
    (full.unwrap_or_default(), apply.unwrap_or_default())
}

#[test]
fn drops_column_bounds_that_are_multiples_of_the_block_width() {
    // A key range [%klo, %khi) whose ends are multiples of the block width 4 (split-KV's
    // key split), and the sequence end. The loop is narrowed to the range; no visited
    // block straddles its ends, so they are tested neither per block nor per element.
    let l = Loop { terms: "col_lt, row_lt, col_ge, col_lt", xs: "%sk, %sq, %klo, %khi", ..Loop::causal("split_range") };
    let text = l.text().replace(
        "  %qt = tile.load",
        "  %klo = arith.mul %w, %c4 : i32\n  %khi = arith.add %klo, %c8 : i32\n  %qt = tile.load",
    );
    let (before, after, printed) = apply(&ClassifyMaskBlocks, &text);
    assert!(narrowed(&after), "{printed}");
    let kept = vec![MaskTerm::ColLt, MaskTerm::RowLt];
    assert_eq!(mask_terms(&after), (kept.clone(), kept), "{printed}");
    snap!("pass_classify_mask_blocks__split_range", printed);
    // %w in 0..=5: ranges starting at keys 0..=20, some past the sequence's end.
    let (a, b) = check_semantics(&before, &after);
    assert!(b.count("tile.dot") < a.count("tile.dot"), "{a:?}\n{b:?}");
}

#[test]
fn keeps_column_bounds_that_may_cut_a_block() {
    // `%w` (any i32) and `%w · 4 + 2` may fall inside a block: both stay.
    let l = Loop { terms: "col_lt, row_lt, col_ge, col_lt", xs: "%sk, %sq, %w, %khi", ..Loop::causal("cut_range") };
    let text = l.text().replace(
        "  %qt = tile.load",
        "  %klo = arith.mul %w, %c4 : i32\n  %c2 = const 2 : i32\n  %khi = arith.add %klo, %c2 : i32\n  %qt = tile.load",
    );
    let (before, after, printed) = apply(&ClassifyMaskBlocks, &text);
    assert!(narrowed(&after), "{printed}");
    let all = vec![MaskTerm::ColLt, MaskTerm::RowLt, MaskTerm::ColGe, MaskTerm::ColLt];
    assert_eq!(mask_terms(&after), (all.clone(), all), "{printed}");
    check_semantics(&before, &after);
}
