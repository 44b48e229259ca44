//! Crashes and unbounded resources: sizes whose counts overflow, allocations beyond the
//! machine, thousands of threads, endless spec files, endless diagnostics and control
//! characters. Each is refused with a clear error (exit 2) before the work starts.

use std::time::{Duration, Instant};

use crate::common::*;

const OVERFLOW: &str = "batch=4294967296,seq_q=4294967296";

#[test]
fn sizes_whose_element_counts_overflow_64_bits_are_refused_by_run_bench_and_tune() {
    let cache = TempDir::new("overflow");
    for cmd in ["run", "bench", "tune"] {
        let o = ejc(
            &[cmd, FLASH, "--backend", "cpu", "--variant", "causal", "--dtype", "f32", "--size", OVERFLOW],
            cache.path(),
        );
        assert_eq!(code(&o), 2, "{cmd}: {}", text(&o.stderr));
        let err = text(&o.stderr);
        assert!(err.contains("64"), "{cmd}: {err}");
    }
    // The same through mean pooling's sizes.
    let o = ejc(
        &[
            "run",
            POOLING,
            "--backend",
            "cpu",
            "--dtype",
            "f32",
            "--size",
            "batch=4294967296,seq=4294967296,heads=4294967296",
        ],
        cache.path(),
    );
    assert_eq!(code(&o), 2, "{}", text(&o.stderr));
}

#[test]
fn sizes_beyond_the_memory_limit_are_refused_before_anything_is_allocated() {
    let cache = TempDir::new("memory");
    // 1000 x 100k x 100k: terabytes.
    let big = "batch=1000,seq_q=100000,seq_k=100000";
    for backend in ["cpu", "mlir", "interp"] {
        let started = Instant::now();
        let o = ejc(
            &["run", FLASH, "--backend", backend, "--variant", "causal", "--dtype", "f32", "--size", big],
            cache.path(),
        );
        assert_eq!(code(&o), 2, "{backend}: {}", text(&o.stderr));
        let err = text(&o.stderr);
        assert!(err.contains("host memory") && err.contains("--memory-limit"), "{backend}: {err}");
        assert!(started.elapsed() < Duration::from_secs(60), "{backend}: took {:?}", started.elapsed());
    }
    let o = ejc(&["bench", FLASH, "--variant", "causal", "--dtype", "f32", "--size", big], cache.path());
    assert_eq!(code(&o), 2, "{}", text(&o.stderr));
    // The limit can be lowered (and so raised) by flag and by environment.
    let small = ["run", FLASH, "--backend", "interp", "--variant", "causal", "--dtype", "f32"];
    let o = ejc(&[&small[..], &["--memory-limit", "1K"]].concat(), cache.path());
    assert_eq!(code(&o), 2, "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("more than the limit of 1.0 KiB"), "{}", text(&o.stderr));
    let o = ejc_cmd(&small, cache.path()).env("EJC_MEMORY_LIMIT", "1K").output().unwrap();
    assert_eq!(code(&o), 2, "{}", text(&o.stderr));
    let o = ejc(&[&small[..], &["--memory-limit", "none"]].concat(), cache.path());
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let o = ejc(&[&small[..], &["--memory-limit", "lots"]].concat(), cache.path());
    assert_eq!(code(&o), 2, "{}", text(&o.stderr));
}

#[test]
fn thread_counts_are_capped() {
    let cache = TempDir::new("threads");
    for cmd in ["run", "bench", "tune"] {
        let started = Instant::now();
        let o = ejc(
            &[
                cmd,
                FLASH,
                "--backend",
                "cpu",
                "--variant",
                "causal",
                "--dtype",
                "f32",
                "--shape",
                "1,64,64,1,1,64",
                "--threads",
                "100000",
            ],
            cache.path(),
        );
        assert_eq!(code(&o), 2, "{cmd}: {}", text(&o.stderr));
        assert!(text(&o.stderr).contains("EJC_MAX_THREADS"), "{cmd}: {}", text(&o.stderr));
        assert!(started.elapsed() < Duration::from_secs(30), "{cmd}: {:?}", started.elapsed());
    }
}

#[test]
fn the_runtime_refuses_thousands_of_worker_threads() {
    assert!(ejc_ir::limits::worker_threads(100_000).is_err());
    assert_eq!(ejc_ir::limits::worker_threads(0).unwrap(), ejc_ir::limits::available_threads());
}

#[test]
fn endless_and_oversized_spec_files_are_refused() {
    let cache = TempDir::new("reads");
    let started = Instant::now();
    let o = ejc(&["check", "/dev/zero"], cache.path());
    assert_eq!(code(&o), 2, "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("larger than 16.0 MiB"), "{}", text(&o.stderr));
    assert!(started.elapsed() < Duration::from_secs(30));
    // The cap is raised (here: lowered) by EJC_MAX_SPEC_BYTES.
    let o = ejc_cmd(&["check", FLASH], cache.path()).env("EJC_MAX_SPEC_BYTES", "100").output().unwrap();
    assert_eq!(code(&o), 2, "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("EJC_MAX_SPEC_BYTES"), "{}", text(&o.stderr));
}

/// The flash spec with its `dtypes:` line replaced.
fn spec_with_dtypes(line: &str) -> String {
    let spec = std::fs::read_to_string(FLASH).unwrap();
    spec.lines()
        .map(|l| if l.starts_with("dtypes:") { line.to_string() } else { l.to_string() })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn thousands_of_errors_print_a_screenful_and_a_count() {
    let dir = TempDir::new("output");
    let bad: Vec<String> = (0..20000).map(|i| format!("bogus{i}")).collect();
    let path = dir.path().join("many.yaml");
    std::fs::write(&path, spec_with_dtypes(&format!("dtypes: [{}]", bad.join(", ")))).unwrap();
    let o = ejc(&["check", path.to_str().unwrap()], dir.path());
    assert_eq!(code(&o), 2);
    let err = text(&o.stderr);
    assert!(err.len() < 20_000, "{} bytes of diagnostics", err.len());
    assert!(err.contains("... and 19980 more errors"), "{err}");
    assert!(err.contains("20000 errors in"), "{err}");
    // Each echoed line is an excerpt around the column, not the 200 kB line.
    assert!(err.lines().all(|l| l.chars().count() < 300), "{err}");
}

#[test]
fn control_characters_from_a_spec_or_a_path_never_reach_the_terminal_raw() {
    let dir = TempDir::new("controls");
    let spec = std::fs::read_to_string(FLASH).unwrap();
    let cases = [
        ("name.yaml", spec.replacen("name: flash", "name: \"fl\\e[31mash\\a\"", 1)),
        ("dtype.yaml", spec_with_dtypes("dtypes: [\"bf16\\e]0;pwned\\a\"]")),
        ("\x1b[2Jpath.yaml", "name: [".to_string()),
    ];
    for (file, body) in cases {
        let path = dir.path().join(file);
        std::fs::write(&path, body).unwrap();
        for cmd in ["check", "list", "build"] {
            let o = ejc(&[cmd, path.to_str().unwrap()], dir.path());
            assert_eq!(code(&o), 2, "{file} {cmd}: {}", text(&o.stderr));
            let all = [o.stdout.as_slice(), o.stderr.as_slice()].concat();
            assert!(
                !all.iter().any(|b| *b == 0x1b || *b == 0x07),
                "{file} {cmd}: raw control characters: {:?}",
                text(&all)
            );
            assert!(text(&o.stderr).contains("\\u{1b}"), "{file} {cmd}: {}", text(&o.stderr));
        }
    }
    // A flag's value too.
    let o = ejc(&["run", FLASH, "--variant", "caus\x1b[31mal"], dir.path());
    assert_eq!(code(&o), 2);
    assert!(!o.stderr.contains(&0x1b), "{}", text(&o.stderr));
}
