//! `#[ej_kernel]`'s compile errors, pinned: each file in `tests/ui/` is rejected with
//! the message in the `.stderr` beside it (a span on the offending token and what is
//! allowed instead). `TRYBUILD=overwrite` regenerates them; review the diff.

#[test]
fn compile_errors() {
    // scripts/test.sh builds the workspace through clippy's driver (lints while
    // compiling); the pinned messages are rustc's, so trybuild's builds run without it.
    std::env::remove_var("RUSTC_WORKSPACE_WRAPPER");
    std::env::remove_var("CLIPPY_ARGS");
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
