//! `#[ej_kernel]`'s compile errors, pinned: each file in `tests/ui/` is rejected with
//! the message in the `.stderr` beside it (a span on the offending token and what is
//! allowed instead). `TRYBUILD=overwrite` regenerates them; review the diff.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn compile_errors() {
    // scripts/test.sh builds the workspace through clippy's driver (lints while
    // compiling); the pinned messages are rustc's, so trybuild's builds run without it.
    std::env::remove_var("RUSTC_WORKSPACE_WRAPPER");
    std::env::remove_var("CLIPPY_ARGS");
    let first = std::panic::catch_unwind(|| {
        let t = trybuild::TestCases::new();
        t.compile_fail("tests/ui/*.rs");
    });
    if first.is_ok() {
        return;
    }
    // trybuild builds every case in one `cargo check --keep-going` and reads rustc's JSON
    // diagnostics; when cargo itself fails (or its output cannot be matched to the cases)
    // it says nothing about why and reports every case as "compiled" (seen once in CI,
    // never reproduced). Say what cargo says, then start from a clean trybuild project
    // and run the cases once more: a real regression fails again, with trybuild's diff.
    eprintln!("\n[ui] trybuild failed; what cargo says about its project:");
    diagnose();
    let project = trybuild_dir();
    eprintln!("[ui] removing {} and running the cases again", project.display());
    let _ = std::fs::remove_dir_all(&project);
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}

/// `<target>/tests/trybuild`, where trybuild keeps its project and build.
fn trybuild_dir() -> PathBuf {
    // CARGO_TARGET_TMPDIR is `<target>/tmp`.
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).parent().expect("target dir").join("tests/trybuild")
}

/// Re-run trybuild's batch build of its project with cargo's stderr shown, and count
/// the error diagnostics rustc gave per case.
fn diagnose() {
    let dir = trybuild_dir();
    let project = dir.join(env!("CARGO_PKG_NAME"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(&project)
        .env("CARGO_TARGET_DIR", &dir)
        .args(["--offline", "check", "--bins", "--keep-going", "--color=never", "--message-format=json"])
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            eprintln!("[ui] could not run cargo in {}: {e}", project.display());
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let errors = stdout.lines().filter(|l| l.contains("\"level\":\"error\"")).count();
    let messages = stdout.lines().filter(|l| l.starts_with("{\"reason\":\"compiler-message\"")).count();
    eprintln!("[ui] cargo check --bins: {} ({messages} compiler messages, {errors} errors)", out.status);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The cases' own failures are expected; what is left is cargo's.
    let lines: Vec<&str> =
        stderr.lines().filter(|l| !l.starts_with("error: could not compile `ejc-macros-tests` (bin ")).collect();
    for l in &lines[lines.len().saturating_sub(40)..] {
        eprintln!("[ui]   {l}");
    }
    if let Ok(o) = Command::new("df").arg("-h").arg(&dir).output() {
        eprint!("[ui] {}", String::from_utf8_lossy(&o.stdout));
    }
}
