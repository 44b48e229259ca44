//! Fuzzing in CI (issue 21): structure-aware mutations of real inputs fed to every loader
//! of untrusted text — the spec loader (and `ejc check`'s building of what a spec
//! declares), the tile-IR parser, the manifest loader and registry, the tuning-cache
//! reader, and the CLI's size/shape/config/scalar/window parsers. The property: no panic,
//! no hang, and every refusal is an error value with a message (tests/fuzz/targets.rs).
//!
//! Seeds: every spec of `specs/` and `tests/specs/broken/`, the printed IR of real
//! kernels (and the IR snapshots), `tests/fuzz/seeds/` (a manifest, a tuning cache, CLI
//! flags), and every input a fuzzer ever crashed a loader with
//! (`tests/fuzz/regressions/<target>/`, and `targets::big_regressions`), run first,
//! unmutated.
//!
//! The budget is small by default (15 s for the five targets in a debug build on 2 cores:
//! 5,000 mutated specs and IR kernels, 3,000 manifests and CLI flag sets, 1,000 tuning
//! caches, whose target writes files) and set by the environment:
//!
//! - `EJC_FUZZ_CASES=N`: mutated inputs per target, for every target;
//! - `EJC_FUZZ_SECS=S`: stop a target after S seconds, whatever N says (default 20);
//! - `EJC_FUZZ_SEED=N`: the mutation seed (default fixed: CI is deterministic). A failure
//!   prints the seed and case, and writes the input to `target/fuzz-failures/`.
//!
//! An input that takes longer than `EJC_FUZZ_HANG_SECS` (default 20) fails as a hang. An
//! input that kills the process (a stack overflow) is left in
//! `target/fuzz-failures/<target>/last-input.bin`. The long runs are cargo-fuzz's:
//! `fuzz/` (README.md, "Fuzzing").

#[path = "fuzz/mutate.rs"]
mod mutate;
#[path = "fuzz/targets.rs"]
mod targets;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mutate::{Dialect, Rng};
use targets::{repo_root, Scratch, MAX_LEN};

fn env_num(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// An input as a Rust byte-string literal (printable ASCII kept, the rest escaped).
fn escaped(data: &[u8]) -> String {
    let body: String = data.iter().flat_map(|b| std::ascii::escape_default(*b)).map(char::from).collect();
    format!("b\"{body}\"")
}

/// Write a failing input under `target/fuzz-failures/` for replay and as a regression seed.
fn save_failure(target: &str, case: &str, data: &[u8]) -> PathBuf {
    let dir = repo_root().join("target/fuzz-failures").join(target);
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("{case}.bin"));
    let _ = std::fs::write(&path, data);
    path
}

/// Run `target` on every seed and regression input, then on mutations of them, within the
/// budget; fail with every input that panicked or hung.
fn fuzz(name: &'static str, dialect: Dialect, default_cases: u64, target: fn(&[u8], &Scratch) -> bool) {
    let seeds = targets::seeds(name);
    assert!(!seeds.is_empty(), "{name}: no seeds");
    let cases = env_num("EJC_FUZZ_CASES", default_cases);
    let secs = env_num("EJC_FUZZ_SECS", 20);
    let seed = env_num("EJC_FUZZ_SEED", 21);
    let hang = Duration::from_secs(env_num("EJC_FUZZ_HANG_SECS", 20));

    // The target runs on a worker thread with a main thread's stack (8 MiB, what `ejc`
    // itself has), so that a hang is reported with its input instead of stalling the run.
    let (to_worker, inputs) = mpsc::channel::<Vec<u8>>();
    let (to_main, results) = mpsc::channel::<Result<bool, String>>();
    let worker = std::thread::Builder::new()
        .name(format!("fuzz-{name}"))
        .stack_size(8 << 20)
        .spawn(move || {
            let scratch = Scratch::new(name);
            for data in inputs {
                let r = catch_unwind(AssertUnwindSafe(|| target(&data, &scratch))).map_err(|p| {
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "panic".into())
                });
                if to_main.send(r).is_err() {
                    break;
                }
            }
        })
        .expect("spawn the fuzz worker");

    let mut state = State { failures: Vec::new(), accepted: 0, good: Vec::new() };
    // The input being run, on disk: if it kills the process (a stack overflow, an abort),
    // it is there.
    let last = repo_root().join("target/fuzz-failures").join(name).join("last-input.bin");
    let _ = std::fs::create_dir_all(last.parent().unwrap());
    let run = |case: String, data: Vec<u8>, state: &mut State| -> bool {
        let _ = std::fs::write(&last, &data);
        let start = Instant::now();
        to_worker.send(data.clone()).expect("the fuzz worker is alive");
        let why = match results.recv_timeout(hang) {
            Ok(Ok(accepted)) => {
                if accepted {
                    state.accepted += 1;
                    if state.good.len() < 256 {
                        state.good.push(data);
                    }
                }
                return true;
            }
            Ok(Err(why)) => why,
            Err(_) => format!("no result after {:.0?}: a hang", start.elapsed()),
        };
        let file = save_failure(name, &case, &data);
        state.failures.push(format!(
            "{name} {case} (EJC_FUZZ_SEED={seed}): {}\n  input ({} bytes, saved to {}): {}",
            why.chars().take(1500).collect::<String>(),
            data.len(),
            file.display(),
            escaped(&data[..data.len().min(600)])
        ));
        // After a hang the worker is stuck: nothing more can run.
        !why.ends_with("a hang")
    };

    let start = Instant::now();
    let mut alive = true;
    for (i, s) in seeds.iter().enumerate() {
        alive = alive && run(format!("seed-{i}"), s.clone(), &mut state);
    }
    for (i, s) in targets::big_regressions(name).into_iter().enumerate() {
        alive = alive && run(format!("big-regression-{i}"), s, &mut state);
    }
    let mut rng = Rng::new(seed ^ mutate_tag(name));
    let mut n = 0;
    while alive && n < cases && start.elapsed() < Duration::from_secs(secs) && state.failures.len() < 10 {
        // Half the mutations start from an input the loader accepted, so that the fuzzer
        // gets past the first refusal into what follows a successful load.
        let from = if !state.good.is_empty() && rng.chance(1, 2) { &state.good } else { &seeds };
        let base = rng.pick(from).clone();
        let data = mutate::mutate(&base, &seeds, dialect, &mut rng, MAX_LEN);
        alive = run(format!("case-{n}"), data, &mut state);
        n += 1;
    }
    // Let the worker remove its scratch directory (unless it is stuck).
    drop(to_worker);
    if alive {
        let _ = worker.join();
        let _ = std::fs::remove_file(&last);
    }
    eprintln!(
        "fuzz {name}: {} seeds + {n} mutated inputs in {:.1?}, {} accepted (EJC_FUZZ_SEED={seed})",
        seeds.len(),
        start.elapsed(),
        state.accepted
    );
    let failures = &state.failures;
    assert!(failures.is_empty(), "{} failing input(s):\n{}", failures.len(), failures.join("\n"));
}

struct State {
    failures: Vec<String>,
    /// How many inputs the loader accepted.
    accepted: usize,
    /// Accepted inputs (the first 256), bases for further mutation.
    good: Vec<Vec<u8>>,
}

/// Each target its own stream of mutations under one seed.
fn mutate_tag(name: &str) -> u64 {
    name.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
}

#[test]
fn fuzz_spec_loader() {
    fuzz("spec", Dialect::Yaml, 5000, targets::spec);
}

#[test]
fn fuzz_ir_parser() {
    fuzz("ir", Dialect::Ir, 5000, |d, _| targets::ir(d));
}

#[test]
fn fuzz_manifest_loader() {
    fuzz("manifest", Dialect::Json, 3000, targets::manifest);
}

#[test]
fn fuzz_tuning_cache_reader() {
    fuzz("cache", Dialect::Json, 1000, targets::cache);
}

#[test]
fn fuzz_cli_parsers() {
    fuzz("cli", Dialect::Flags, 3000, |d, _| targets::cli(d));
}
