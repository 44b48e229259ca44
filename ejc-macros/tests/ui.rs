//! `#[ej_kernel]`'s compile errors, pinned: each file in `tests/ui/` is rejected with
//! the message in the `.stderr` beside it (a span on the offending token and what is
//! allowed instead). `TRYBUILD=overwrite` regenerates them; review the diff.

#[test]
fn compile_errors() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
