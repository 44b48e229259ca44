//! Accepted nonsense that gave wrong results later: values beyond the kernels' 32-bit
//! parameters, soft caps finite as f64 but not as f32, targets named twice, tilings
//! outside the schedule. Each is refused where it is stated (spec or flag).

use crate::common::*;

fn flash_with(find: &str, replace: &str) -> String {
    let spec = std::fs::read_to_string(FLASH).unwrap();
    assert!(spec.contains(find), "{find}");
    spec.replacen(find, replace, 1)
}

#[test]
fn windows_beyond_32_bits_are_refused_in_the_spec() {
    let dir = TempDir::new("spec-window");
    for w in ["[4294967296, 0]", "[2147483648, 0]", "4294967295"] {
        let path = dir.path().join("w.yaml");
        std::fs::write(&path, flash_with("sliding_window: [128, 0]", &format!("sliding_window: {w}"))).unwrap();
        let o = ejc(&["check", path.to_str().unwrap()], dir.path());
        assert_eq!(code(&o), 2, "{w}: {}", text(&o.stderr));
        assert!(text(&o.stderr).contains("32-bit"), "{w}: {}", text(&o.stderr));
    }
    // The largest 32-bit window is fine.
    let path = dir.path().join("ok.yaml");
    std::fs::write(&path, flash_with("sliding_window: [128, 0]", "sliding_window: [2147483647, 0]")).unwrap();
    let o = ejc(&["check", path.to_str().unwrap()], dir.path());
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
}

#[test]
fn soft_caps_outside_f32_are_refused_in_the_spec_and_the_flag() {
    let dir = TempDir::new("spec-cap");
    for cap in ["1e39", "1e-46"] {
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, flash_with("logits_soft_cap: 50.0", &format!("logits_soft_cap: {cap}"))).unwrap();
        let o = ejc(&["check", path.to_str().unwrap()], dir.path());
        assert_eq!(code(&o), 2, "{cap}: {}", text(&o.stderr));
        assert!(text(&o.stderr).contains("f32"), "{cap}: {}", text(&o.stderr));
        let o = ejc(&["run", FLASH, "--variant", "softcap", "--dtype", "f32", "--softcap", cap], dir.path());
        assert_eq!(code(&o), 2, "--softcap {cap}: {}", text(&o.stderr));
        for backend in ["interp", "cpu"] {
            let o = ejc(
                &[
                    "run",
                    FLASH,
                    "--backend",
                    backend,
                    "--variant",
                    "softcap",
                    "--dtype",
                    "f32",
                    "--scalar",
                    &format!("logits_soft_cap={cap}"),
                ],
                dir.path(),
            );
            assert_eq!(code(&o), 2, "--scalar {cap} on {backend}: {}", text(&o.stderr));
        }
    }
}

#[test]
fn windows_beyond_32_bits_are_refused_at_the_flag_and_at_the_kernel_call() {
    let dir = TempDir::new("flag-window");
    for backend in ["interp", "cpu", "mlir"] {
        let base = ["run", FLASH, "--backend", backend, "--variant", "sliding_window", "--dtype", "f32"];
        let o = ejc(&[&base[..], &["--window", "4294967296,4294967296"]].concat(), dir.path());
        assert_eq!(code(&o), 2, "{backend}: {}", text(&o.stderr));
        assert!(text(&o.stderr).contains("32-bit"), "{}", text(&o.stderr));
        // The generic scalar flag reaches the kernel's parameter check.
        let o = ejc(&[&base[..], &["--scalar", "window_left=4294967296"]].concat(), dir.path());
        assert_eq!(code(&o), 2, "{backend}: {}", text(&o.stderr));
        assert!(text(&o.stderr).contains("i32"), "{backend}: {}", text(&o.stderr));
        // The largest 32-bit window still runs, and is right.
        let o = ejc(&[&base[..], &["--window", "2147483647,2147483647"]].concat(), dir.path());
        assert_eq!(code(&o), 0, "{backend}: {}{}", text(&o.stdout), text(&o.stderr));
    }
}

#[test]
fn a_target_named_twice_is_built_once_and_the_runtime_loads_the_manifest() {
    let dir = TempDir::new("targets");
    let out = dir.path().join("out");
    let host = ejc_codegen_host_isa();
    let o = ejc(
        &[
            "build",
            FLASH,
            "-o",
            out.to_str().unwrap(),
            "--target",
            "cpu",
            "--target",
            &format!("cpu:{host}"),
            "--target",
            "ir",
            "--target",
            "ir",
            "--variant",
            "causal",
            "--dtype",
            "f32",
            "--head-dim",
            "64",
            "--block-m",
            "64",
            "--block-n",
            "32",
        ],
        dir.path(),
    );
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("named more than once"), "{}", text(&o.stderr));
    let m = ejc_runtime::manifest::load(out.join("manifest.json")).expect("the runtime loads the manifest");
    let mut ids: Vec<&str> = m.manifest.artifacts.iter().map(|a| a.artifact_id.as_str()).collect();
    let n = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), n, "duplicate artifact ids");
    assert_eq!(n, 2, "one kernel x (cpu, ir)");
}

/// The ISA `--target cpu` builds for on this machine (what `ejc bench` prints).
fn ejc_codegen_host_isa() -> String {
    let cache = TempDir::new("isa");
    let o = ejc(
        &["run", FLASH, "--backend", "cpu", "--variant", "causal", "--dtype", "f32", "--shape", "1,8,8,1,1,64"],
        cache.path(),
    );
    let out = text(&o.stdout);
    out.split_whitespace().find_map(|w| w.strip_prefix("isa=")).expect("run prints isa=").to_string()
}

#[test]
fn a_build_of_zero_artifacts_is_an_error_and_leaves_nothing() {
    let dir = TempDir::new("zero-artifacts");
    // PTX takes bf16/f16 only: f32 selects kernels that no target here builds.
    let out = dir.path().join("out");
    let o = ejc(&["build", FLASH, "-o", out.to_str().unwrap(), "--target", "ptx:sm_80", "--dtype", "f32"], dir.path());
    assert_eq!(code(&o), 2, "{}{}", text(&o.stdout), text(&o.stderr));
    assert!(text(&o.stderr).contains("no kernel of the selection can be built"), "{}", text(&o.stderr));
    assert!(!out.exists(), "left {}", out.display());
}

#[test]
fn a_tiling_outside_the_schedule_builds_nothing_and_says_so() {
    let dir = TempDir::new("block-m");
    for (flag, value) in [("--block-m", "48"), ("--block-n", "7"), ("--num-warps", "3"), ("--head-dim", "48")] {
        let out = dir.path().join(format!("out{}", flag.trim_start_matches('-')));
        let o = ejc(&["build", FLASH, "-o", out.to_str().unwrap(), "--target", "cpu", flag, value], dir.path());
        assert_eq!(code(&o), 2, "{flag} {value}: {}", text(&o.stderr));
        let err = text(&o.stderr);
        assert!(err.contains(value) && !err.contains("cc"), "{flag} {value}: {err}");
        assert!(!out.exists(), "{flag} {value}: left {}", out.display());
    }
}
