//! `ejc-gpu` checks what it is given before it looks for a GPU: on a machine without a
//! CUDA driver (CI), a garbage path, a broken manifest or a bad flag is an error (exit 2),
//! and only a well-formed request is "skipped: no CUDA driver" (exit 0). On a GPU machine
//! the well-formed requests run instead, so those cases only assert where there is no
//! driver.
//!
//! The binary needs the `cuda` feature, which `cargo test --workspace` has (the `ejc`
//! package turns it on); alone: `cargo test -p ejc-runtime --features cuda --test gpu_args`.
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

/// A fresh directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("ejc-gpu-args-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
    fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ejc_gpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ejc-gpu")).args(args).output().expect("ejc-gpu runs")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Exit 2 with `needle` in the output, and no "skipped".
fn refused(args: &[&str], needle: &str) {
    let o = ejc_gpu(args);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "ejc-gpu {args:?} must be refused:\n{t}");
    assert!(t.contains(needle), "ejc-gpu {args:?}: the error says `{needle}`:\n{t}");
    assert!(!t.contains("skipped"), "ejc-gpu {args:?}: an error, not a skip:\n{t}");
}

/// A build of one mean-pooling PTX artifact, as `ejc build specs/mean_pooling.yaml
/// --target ptx:sm_80 --variant fwd --dtype bf16 --head-dim 64 --config block_h=16
/// --num-warps 1` writes it — but with a stand-in for the PTX (no driver loads it here).
fn gpu_build(dir: &Path) {
    let ptx = b"// stand-in PTX: never loaded without a driver\n";
    let file = "ptx/sm_80/pool_fwd_bf16_d64_h16_w1_s1.ptx";
    std::fs::create_dir_all(dir.join("ptx/sm_80")).unwrap();
    std::fs::write(dir.join(file), ptx).unwrap();
    let sha: String = Sha256::digest(ptx).iter().map(|b| format!("{b:02x}")).collect();
    let manifest = r#"{"format":"ejc-manifest/2","compiler":{"name":"ejc","version":"0.1.0"},
"spec":{"name":"pool","file":"specs/mean_pooling.yaml","sha256":"15c587b702a5da537c8e1d8db9e2a5f3f870c4ef2ff44ad3641fbd2cd11daf89","op":"mean_pooling","version":1},
"plans":[{"name":"single","instance":{"variant":"fwd","dtype":"bf16","keys":{"head_dim":64}},"features":{"backward":false,"varlen":false},"launches":[{"role":"main"}]}],
"artifacts":[{"kernel_id":"pool_fwd_bf16_d64_h16","instance":{"variant":"fwd","dtype":"bf16","keys":{"head_dim":64}},"role":"main",
"features":{"backward":false,"varlen":false},"config":{"block_h":16,"num_stages":1,"num_warps":1},
"artifact_id":"pool_fwd_bf16_d64_h16@ptx:sm_80/w1_s1","target":"ptx:sm_80","file":"FILE","sha256":"SHA","entry":"pool_fwd_bf16_d64_h16",
"params":[{"name":"x","kind":"tensor","dtype":"bf16","rank":4,"meaning":"input"},{"name":"out","kind":"tensor","dtype":"bf16","rank":4,"meaning":"output"},
{"name":"chunk_size","kind":"scalar","dtype":"i32","rank":0,"meaning":"scalar"}],
"grid":["num_chunks","cdiv(heads, 16)","batch"],"block":[32,1,1],"dynamic_shared_memory":0}]}"#;
    std::fs::write(dir.join("manifest.json"), manifest.replace("FILE", file).replace("SHA", &sha)).unwrap();
}

const CALL: [&str; 6] =
    ["--variant", "fwd", "--dtype", "bf16", "--size", "batch=1,seq=64,heads=16,head_dim=64,chunk_size=16"];

#[test]
fn garbage_paths_are_errors_before_the_driver_check() {
    let missing = "/nonexistent/ejc-gpu/build";
    for cmd in ["check", "bench", "tune", "call"] {
        let mut args = vec![cmd, missing];
        if cmd != "check" {
            args.extend(CALL);
        }
        refused(&args, missing);
    }
    refused(&["check"], "DIR");
}

#[test]
fn broken_manifests_are_errors_before_the_driver_check() {
    let tmp = TempDir::new("broken");
    std::fs::write(tmp.path().join("manifest.json"), b"{ not json").unwrap();
    refused(&["check", tmp.arg()], "manifest.json");
    refused(&["bench", tmp.arg(), "--variant", "fwd", "--dtype", "bf16"], "manifest.json");

    // A good manifest whose artifact was changed after the build.
    let build = TempDir::new("tampered");
    gpu_build(build.path());
    std::fs::write(build.path().join("ptx/sm_80/pool_fwd_bf16_d64_h16_w1_s1.ptx"), b"patched").unwrap();
    refused(&["check", build.arg()], "SHA-256");

    // A build without GPU artifacts has nothing for ejc-gpu to do.
    let cpu = TempDir::new("no-gpu");
    let empty = r#"{"format":"ejc-manifest/2","compiler":{"name":"ejc","version":"0.1.0"},
"spec":{"name":"pool","file":"specs/mean_pooling.yaml","sha256":"00","op":"mean_pooling","version":1},"plans":[],"artifacts":[]}"#;
    std::fs::write(cpu.path().join("manifest.json"), empty).unwrap();
    refused(&["check", cpu.arg()], "no GPU artifacts");
}

#[test]
fn bad_flags_are_errors_before_the_driver_check() {
    let build = TempDir::new("flags");
    gpu_build(build.path());
    let dir = build.arg();
    refused(&["check", dir, "--seed", "soon"], "--seed");
    refused(&["check", dir, "--shard", "3/2"], "--shard");
    refused(&["check", dir, "--frobnicate"], "unknown argument `--frobnicate`");
    refused(&["check", dir, "--filter"], "--filter needs a value");
    refused(&["check", dir, "--entry", "fastest"], "--entry takes general or aligned");
    refused(&["check", dir, "--size", "seq=-1"], "--size");
    refused(&["check", dir, "--shape", "1,2"], "--shape");
    refused(&["info", "extra"], "info takes no arguments");
    let with = |extra: &[&'static str]| -> Vec<&str> {
        let mut v = vec!["bench", dir];
        v.extend(CALL);
        v.extend(extra);
        v
    };
    refused(&with(&["--reps", "many"]), "--reps");
    refused(&with(&["--reps", "0"]), "--reps");
    refused(&with(&["--scalars", "window_left"]), "--scalars: `window_left` is not NAME=NUMBER");
    refused(&["bench", dir, "--dtype", "bf16"], "--variant is required");
    refused(&["bench", dir, "--variant", "fwd", "--dtype", "bf17"], "--dtype");
    refused(&["bench", dir, "--variant", "nope", "--dtype", "bf16"], "variant nope");
    refused(&["tune", dir, "--variant", "fwd", "--dtype", "bf16", "--size", "seq=oops"], "--size");
    refused(&["call", dir, "--variant", "fwd", "--dtype", "bf16", "--force"], "unknown argument `--force`");
}

/// Without a driver, a well-formed request is skipped (exit 0); with one, it runs.
#[test]
fn well_formed_requests_reach_the_driver_check() {
    let build = TempDir::new("good");
    gpu_build(build.path());
    let dir = build.arg();
    let cache = TempDir::new("cache");
    let mut requests: Vec<Vec<&str>> = vec![vec!["info"], vec!["check", dir, "--seed", "1", "--shard", "0/2"]];
    requests.push(vec!["check", dir, "--size", "seq=0", "--entry", "general"]);
    for cmd in ["bench", "tune", "call"] {
        let mut v = vec![cmd, dir];
        v.extend(CALL);
        if cmd != "bench" {
            v.extend(["--cache-dir", cache.arg()]);
        } else {
            v.extend(["--scalars", "softmax_scale=0.1"]);
        }
        requests.push(v);
    }
    let no_driver = text(&ejc_gpu(&["info"])).contains("no CUDA driver");
    if !no_driver {
        eprintln!("a CUDA driver is present: the skip cases do not apply here");
        return;
    }
    for args in requests {
        let o = ejc_gpu(&args);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(0), "ejc-gpu {args:?}:\n{t}");
        assert!(t.contains("skipped: no CUDA driver"), "ejc-gpu {args:?}:\n{t}");
    }
}
