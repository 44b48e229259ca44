//! The `ejc` command line, end to end: exit codes, output, artifacts.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const SPEC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/flash.yaml");

fn ejc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ejc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("ejc runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn code(o: &Output) -> i32 {
    // A panic exits 101: never acceptable.
    let c = o.status.code().unwrap_or(-1);
    assert_ne!(c, 101, "ejc panicked:\n{}", text(&o.stderr));
    c
}

#[test]
fn check_valid_spec() {
    let o = ejc(&["check", SPEC]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.starts_with("ok: "), "{out}");
    assert!(
        out.contains(
            "15 variants x 3 dtypes x 6 head_dim/head_dim_v pairs = 270 instances; 1395 tile programs (all verified)"
        ),
        "{out}"
    );
    // Per target (the spec's overrides): one tiling at d 96/192/256 on the CPU, four on
    // the GPU, and the 192-row tile at d 64 on sm_90a alone.
    assert!(out.contains("cpu: 720 tile programs;"), "{out}");
    assert!(out.contains("ptx:sm_80: 1260 tile programs,"), "{out}");
    assert!(out.contains("ptx:sm_90a: 1395 tile programs,"), "{out}");
}

#[test]
fn check_every_broken_spec_exits_2_with_a_located_diagnostic() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/specs/broken");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let o = ejc(&["check", path.to_str().unwrap()]);
        assert_eq!(code(&o), 2, "{}: expected exit 2", path.display());
        let err = text(&o.stderr);
        assert!(
            err.contains("error: ") && err.contains(path.file_name().unwrap().to_str().unwrap()),
            "{}: {err}",
            path.display()
        );
        n += 1;
    }
    assert!(n >= 20, "only {n} broken specs");
}

#[test]
fn check_block_m_seven_shows_file_line_column_path_found_allowed() {
    let o = ejc(&["check", "tests/specs/broken/block_m_seven.yaml"]);
    assert_eq!(code(&o), 2);
    let err = text(&o.stderr);
    assert!(err.contains("tests/specs/broken/block_m_seven.yaml:"), "{err}");
    assert!(err.contains("schedule.block_m"), "{err}");
    assert!(err.contains("found: 7"), "{err}");
    assert!(err.contains("allowed: a power of two from 16 to 256"), "{err}");
}

#[test]
fn check_missing_and_non_yaml_inputs() {
    let o = ejc(&["check", "no/such/spec.yaml"]);
    assert_eq!(code(&o), 2);
    assert!(text(&o.stderr).contains("no/such/spec.yaml"));
    // A binary file.
    let o = ejc(&["check", env!("CARGO_BIN_EXE_ejc")]);
    assert_eq!(code(&o), 2);
}

#[test]
fn list_table_and_json() {
    let o = ejc(&["list", SPEC]);
    assert_eq!(code(&o), 0);
    let out = text(&o.stdout);
    assert!(out.contains("flash_gemma2_bf16_d128_m64_n32"), "{out}");
    assert!(out.contains("causal + sliding_window=runtime + logits_soft_cap=50"), "{out}");
    let o = ejc(&["list", SPEC, "--json"]);
    assert_eq!(code(&o), 0);
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["kernels"].as_array().unwrap().len(), 1395);
    // The 192-row tile is Hopper's alone (an override), with its 12-warp configurations.
    assert!(out.contains("flash_full_bf16_d64_m192_n64  (built for ptx:sm_90a "), "{out}");
    let k =
        doc["kernels"].as_array().unwrap().iter().find(|k| k["kernel_id"] == "flash_full_bf16_d64_m192_n64").unwrap();
    assert_eq!(k["targets"], serde_json::json!(["ptx:sm_90a"]));
    assert!(k["gpu_configs"]["ptx:sm_90a"].as_array().unwrap().iter().any(|c| c == "s2_w12"), "{k}");
}

#[test]
fn build_gives_each_target_its_schedule() {
    // `--block-m 192` is a value of an override (sm_90a at d 64): the IR target has no such
    // kernel, sm_90a builds it (one configuration here).
    let out = temp_dir("overrides");
    let o = ejc(&[
        "build",
        SPEC,
        "-o",
        out.to_str().unwrap(),
        "--target",
        "ir",
        "--target",
        "ptx:sm_90a",
        "--variant",
        "full",
        "--dtype",
        "bf16",
        "--head-dim",
        "64",
        "--block-m",
        "192",
        "--block-n",
        "64",
        "--num-warps",
        "12",
        "--num-stages",
        "2",
        "--path",
        "ws",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    let ids: Vec<&str> = m.artifacts.iter().map(|a| a.artifact_id.as_str()).collect();
    assert!(
        !ids.is_empty() && ids.iter().all(|i| i.starts_with("flash_full_bf16_d64_m192_n64@ptx:sm_90a/w12_s2")),
        "{ids:?}"
    );
    // At d 256 the CPU has one tiling: 128-row tiles are the GPU's.
    let o = ejc(&[
        "build",
        SPEC,
        "-o",
        out.to_str().unwrap(),
        "--target",
        "ir",
        "--variant",
        "full",
        "--dtype",
        "f32",
        "--head-dim",
        "256",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    let ids: Vec<&str> = m.artifacts.iter().map(|a| a.artifact_id.as_str()).collect();
    assert_eq!(ids, ["flash_full_f32_d256_m64_n64@ir"]);
    let _ = std::fs::remove_dir_all(&out);
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ejc-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn build_writes_ir_and_a_manifest_the_runtime_verifies() {
    let out = temp_dir("build");
    // Without --target: the spec's targets that this ejc builds (ir, cpu), the others named.
    let o =
        ejc(&["build", SPEC, "-o", out.to_str().unwrap(), "--variant", "causal", "--dtype", "f32", "--head-dim", "64"]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    assert!(!text(&o.stderr).contains("not built yet"), "every target of the spec is built: {}", text(&o.stderr));
    assert!(text(&o.stderr).contains("f32 kernels left out"), "ptx says why f32 has no artifacts");
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    assert_eq!(
        m.artifacts.len(),
        30,
        "6 tilings x (ir, cpu, mlir:cpu, mlir:gpu, mlir:gpu:sm_80 PTX); no f32 PTX from the ptx back end"
    );
    let o = ejc(&["build", SPEC, "-o", out.to_str().unwrap(), "--target", "ir"]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let loaded = ejc_runtime::manifest::load(&out).expect("manifest verifies");
    let m = &loaded.manifest;
    assert_eq!(m.artifacts.len(), 720);
    assert_eq!(m.spec.op, "flash_attention_fwd");
    // One plan per instance (variant x dtype x head_dim): flash.yaml has no split-KV axis.
    assert_eq!(m.plans.len(), 270);
    assert!(m.plans.iter().all(|p| p.name == "single" && p.launches.len() == 1 && p.launches[0].role == "main"));
    for a in &m.artifacts {
        let text = std::fs::read_to_string(loaded.path_of(a)).unwrap();
        let k = ejc_ir::parse::parse_kernel(&text).unwrap_or_else(|e| panic!("{}: {e}", a.file));
        assert_eq!(k.name, a.entry);
        let names: Vec<&str> = k.params.iter().map(|p| p.name.as_str()).collect();
        let abi: Vec<&str> = a.params.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, abi, "{}: manifest ABI differs from the kernel", a.artifact_id);
    }
    let causal = m.artifacts.iter().find(|a| a.kernel_id == "flash_causal_f16_d128_m128_n64").unwrap();
    assert_eq!(causal.grid, ["cdiv(seq_q, 128)".to_string(), "heads_q".into(), "batch".into()]);
    assert_eq!(causal.config["block_m"], 128);
    // Tampering is detected.
    std::fs::write(loaded.path_of(causal), "kernel @x() grid(1, 1, 1) {\n}\n").unwrap();
    let err = ejc_runtime::manifest::load(&out).unwrap_err().to_string();
    assert!(err.contains("SHA-256"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn build_filters_and_unsupported_targets() {
    let out = temp_dir("filter");
    let o = ejc(&[
        "build",
        SPEC,
        "-o",
        out.to_str().unwrap(),
        "--target",
        "ir",
        "--variant",
        "causal",
        "--dtype",
        "bf16",
        "--head-dim",
        "64",
        "-q",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    assert!(o.stdout.is_empty() && o.stderr.is_empty(), "-q prints nothing");
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    assert_eq!(m.artifacts.len(), 6, "one variant x one dtype x one head dim x 6 tilings");
    let _ = std::fs::remove_dir_all(&out);

    let out = temp_dir("unsupported");
    for (t, needle) in [("mlir:tpu", "mlir:tpu"), ("ptx:sm_70", "sm_70"), ("metal", "metal")] {
        let o = ejc(&["build", SPEC, "-o", out.to_str().unwrap(), "--target", t]);
        assert_eq!(code(&o), 2);
        assert!(text(&o.stderr).contains(needle), "{}", text(&o.stderr));
        assert!(!out.join("manifest.json").exists(), "nothing is written for a refused target");
    }
    // PTX: one tiling; 8 warps do not divide 64 rows, so 4 warps x the spec's 2 stage counts.
    let o = ejc(&[
        "build",
        SPEC,
        "-o",
        out.to_str().unwrap(),
        "--target",
        "ptx:sm_90a",
        "--variant",
        "causal",
        "--dtype",
        "bf16",
        "--head-dim",
        "64",
        "--block-m",
        "64",
        "--block-n",
        "32",
        "--path",
        "mma",
        "--path",
        "wgmma",
        "--report",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    // 2 stage counts x {mma.sync, wgmma} (sm_90a: Hopper's warpgroup MMA is one more candidate;
    // `--path` leaves out the warp-specialised ones).
    assert_eq!(m.artifacts.len(), 4, "{:?}", m.artifacts.iter().map(|a| &a.artifact_id).collect::<Vec<_>>());
    for a in &m.artifacts {
        assert!(a.file.starts_with("ptx/sm_90a/") && a.file.ends_with(".ptx"), "{}", a.file);
        assert_eq!(a.block, Some([128, 1, 1]));
        assert!(a.dynamic_shared_memory > 0);
        assert_eq!(a.config.get("num_warps"), Some(&4));
        let wgmma = a.artifact_id.ends_with("_wgmma");
        assert_eq!(a.config.contains_key("wgmma"), wgmma, "{}", a.artifact_id);
        let ptx = std::fs::read_to_string(out.join(&a.file)).unwrap();
        assert_eq!(ptx.contains("wgmma.mma_async"), wgmma, "{}", a.artifact_id);
    }
    if ejc_codegen::ptx::find_ptxas().is_some() {
        assert!(text(&o.stdout).contains("regs"), "--report prints ptxas's figures: {}", text(&o.stdout));
    }
    let _ = std::fs::remove_dir_all(&out);
    for (args, needle) in [
        (vec!["--target", "ptx:sm_70"], "unknown target"),
        (vec!["--variant", "nope"], "has no variant `nope`"),
        (vec!["--dtype", "fp8"], "unknown dtype"),
        (vec!["--head-dim", "80"], "does not declare head_dim 80"),
    ] {
        let mut a = vec!["build", SPEC, "-o", out.to_str().unwrap()];
        a.extend(args);
        let o = ejc(&a);
        assert_eq!(code(&o), 2);
        assert!(text(&o.stderr).contains(needle), "{needle}: {}", text(&o.stderr));
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn run_interp_passes_for_every_variant() {
    let o = ejc(&["run", SPEC, "--backend", "interp", "--dtype", "f32", "--shape", "2,45,61,4,2,64", "--seed", "11"]);
    assert_eq!(code(&o), 0, "{}{}", text(&o.stdout), text(&o.stderr));
    let out = text(&o.stdout);
    assert_eq!(out.lines().filter(|l| l.starts_with("ok ")).count(), 15, "{out}");
    assert!(out.contains("rel_err=") && out.contains("max_abs_err=") && out.contains("seed=11"), "{out}");
}

#[test]
fn run_json_and_flags() {
    let o = ejc(&[
        "run",
        SPEC,
        "--variant",
        "sliding_window",
        "--variant",
        "dropout",
        "--window",
        "3,0",
        "--dropout",
        "0.5",
        "--json",
        "--shape",
        "1,20,20,2,2,128",
        "--block-m",
        "128",
        "--block-n",
        "64",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let rows: Vec<serde_json::Value> = text(&o.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r["ok"] == true && r["rel_err"].as_f64().unwrap() < 1e-2));
}

#[test]
fn run_refuses_what_it_cannot_do() {
    for (args, needle) in [
        (vec!["--backend", "cpu", "--isa", "neon"], "unknown CPU ISA"),
        (vec!["--backend", "cuda", "--dtype", "f32"], "tensor cores take 16-bit operands"),
        (vec!["--variant", "nope"], "--variant nope"),
        (vec!["--dtype", "i32"], "declares dtypes"),
        (vec!["--shape", "1,2,3"], "expected 6"),
        (vec!["--shape", "1,8,8,3,2,64"], "multiple of heads_kv"),
        (vec!["--shape", "1,8,8,2,2,80"], "head_dim 80"),
        (vec!["--variant", "causal", "--shape", "1,16384,16384,4,4,128"], "too much for the interpreter"),
        (vec!["--shape", "64,4096,4096,32,8,128"], "more than the limit"),
        (vec!["--block-m", "48"], "not in spec"),
        (vec!["--window", "-1,2"], "--window"),
        (vec!["--dropout", "1.5"], "[0, 1)"),
        (vec!["--softcap", "0"], "positive"),
    ] {
        let mut a = vec!["run", SPEC];
        a.extend(args);
        let o = ejc(&a);
        assert_eq!(code(&o), 2, "{needle}");
        assert!(text(&o.stderr).contains(needle), "{needle}: {}", text(&o.stderr));
    }
}

/// Without a GPU (CI), `--backend cuda` says so and exits 0; with one, it checks every
/// candidate configuration of the tiling (both entries' worth of launch path) against
/// the reference.
#[test]
fn cuda_backend_runs_or_says_there_is_no_gpu() {
    let o = ejc(&["run", SPEC, "--backend", "cuda", "--variant", "causal", "--shape", "1,70,90,2,1,64"]);
    let out = text(&o.stdout);
    if ejc_runtime::cuda::driver_present() {
        assert_eq!(code(&o), 0, "{out}{}", text(&o.stderr));
        assert!(out.lines().filter(|l| l.starts_with("ok ")).count() >= 2, "{out}");
    } else {
        eprintln!("no CUDA driver: checking that --backend cuda says so");
        assert_eq!(code(&o), 0, "{}", text(&o.stderr));
        assert!(out.contains("skipped: no CUDA driver"), "{out}");
        let o = ejc(&["bench", SPEC, "--backend", "cuda", "--variant", "full", "--shape", "1,256,256,2,2,64"]);
        assert_eq!(code(&o), 0, "{}", text(&o.stderr));
        assert!(text(&o.stdout).contains("skipped: no CUDA driver"), "{}", text(&o.stdout));
    }
}

#[test]
fn help_teaches() {
    let o = ejc(&["--help"]);
    assert_eq!(code(&o), 0);
    let out = text(&o.stdout);
    for s in ["check", "list", "build", "run", "Examples:", "Exit status"] {
        assert!(out.contains(s), "{s}: {out}");
    }
    let o = ejc(&["run", "--help"]);
    assert!(text(&o.stdout).contains("batch,seq_q,seq_k,heads_q,heads_kv,head_dim"));
    // `build --help` names the dumps that show what the compiler did.
    let o = ejc(&["build", "--help"]);
    for s in ["EJC_DUMP_IR", "EJC_DUMP_SCHEDULE", "EJC_DUMP_LLVM", "EJC_DUMP_MLIR"] {
        assert!(text(&o.stdout).contains(s), "{s}: {}", text(&o.stdout));
    }
}

#[test]
fn run_cpu_backend_passes_for_every_variant() {
    let o = ejc(&["run", SPEC, "--backend", "cpu", "--dtype", "bf16", "--shape", "2,45,61,4,2,64", "--threads", "2"]);
    assert_eq!(code(&o), 0, "{}{}", text(&o.stdout), text(&o.stderr));
    let out = text(&o.stdout);
    assert_eq!(out.lines().filter(|l| l.starts_with("ok ")).count(), 15, "{out}");
    assert!(out.contains("backend=cpu isa="), "{out}");
}

#[test]
fn the_backward_runs_on_every_host_backend_for_every_variant() {
    // specs/flash_bwd.yaml: dq, dk, dv (and dsinks, dbias) against the f64 reference backward,
    // through the plan executor, both plans (two_pass: preprocess, dkdv, dq, dsinks;
    // atomic: preprocess_dq, dkdv_dq with dQ by atomic adds, dq_convert, dsinks), with
    // GQA 2:1, s_q != s_k and lengths off the blocks (64 x 64; 32 x 128 on the CPU).
    const BWD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/flash_bwd.yaml");
    let o = ejc(&["check", BWD]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("17 variants x 3 dtypes x 2 head_dims = 102 instances; 1236 tile programs"));
    for (backend, dtype, shape, plan) in [
        ("interp", "f32", "2,45,61,4,2,64", "two_pass"),
        ("interp", "f32", "2,45,61,4,2,64", "atomic"),
        ("cpu", "bf16", "2,70,37,4,2,64", "two_pass"),
        ("cpu", "bf16", "2,70,37,4,2,64", "atomic"),
        ("cpu", "f32", "1,33,95,4,1,128", "two_pass"),
        ("cpu", "f32", "1,33,95,4,1,128", "atomic"),
    ] {
        let args =
            ["run", BWD, "--backend", backend, "--dtype", dtype, "--shape", shape, "--threads", "2", "--plan", plan];
        let o = ejc(&args);
        assert_eq!(code(&o), 0, "{backend} {dtype} {plan}: {}{}", text(&o.stdout), text(&o.stderr));
        let out = text(&o.stdout);
        assert_eq!(out.lines().filter(|l| l.starts_with("ok ")).count(), 17, "{out}");
        assert_eq!(out.matches("dsinks_rel_err=").count(), 2, "sinks and gpt_oss: {out}");
        assert_eq!(out.matches("dbias_rel_err=").count(), 2, "bias_grad and local_bias_grad: {out}");
        assert!(out.contains(&format!(" plan={plan} ")), "{out}");
    }
    for plan in ["two_pass", "atomic"] {
        let args = [
            "run",
            BWD,
            "--backend",
            "mlir",
            "--dtype",
            "f32",
            "--variant",
            "causal_window",
            "--variant",
            "gpt_oss",
            "--variant",
            "local_bias_grad",
            "--plan",
            plan,
        ];
        let o = ejc(&args);
        assert_eq!(code(&o), 0, "{}{}", text(&o.stdout), text(&o.stderr));
        assert_eq!(text(&o.stdout).lines().filter(|l| l.starts_with("ok ")).count(), 3);
        assert_eq!(text(&o.stdout).matches("dbias_rel_err=").count(), 1);
    }
}

#[test]
fn bench_prints_time_and_gflops() {
    let o = ejc(&[
        "bench",
        SPEC,
        "--variant",
        "causal",
        "--dtype",
        "f32",
        "--shape",
        "1,256,256,2,2,64",
        "--reps",
        "3",
        "--json",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let row: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(row["gflops"].as_f64().unwrap() > 0.0 && row["median_ms"].as_f64().unwrap() > 0.0, "{row}");
    assert_eq!(row["tilings"].as_array().unwrap().len(), 6, "every tiling of the spec is timed");
    // One variant only, and the interpreter is not a benchmark back end.
    assert_eq!(code(&ejc(&["bench", SPEC])), 2);
    assert_eq!(code(&ejc(&["bench", SPEC, "--variant", "full", "--backend", "interp"])), 2);
}

#[test]
fn build_cpu_target_writes_a_library_the_runtime_loads() {
    let out = temp_dir("cpu");
    let o = ejc(&[
        "build",
        SPEC,
        "-o",
        out.to_str().unwrap(),
        "--target",
        "cpu",
        "--target",
        "ir",
        "--variant",
        "gemma2",
        "--dtype",
        "f32",
        "--head-dim",
        "64",
        "-q",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let loaded = ejc_runtime::manifest::load(&out).unwrap();
    let cpu: Vec<_> = loaded.manifest.artifacts.iter().filter(|a| a.target.starts_with("cpu:")).collect();
    assert_eq!(cpu.len(), 6);
    let lib = ejc_runtime::cpu::CpuLibrary::open(loaded.path_of(cpu[0])).unwrap();
    for a in cpu {
        lib.kernel(&a.entry, a.scratch_bytes as usize).unwrap();
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn tune_stores_the_winner_and_cache_commands_show_it() {
    let cache = temp_dir("tune-cache");
    let args = [
        "tune",
        SPEC,
        "--variant",
        "full",
        "--dtype",
        "f32",
        "--shape",
        "1,128,128,2,2,64",
        "--reps",
        "1",
        "--threads",
        "2",
    ];
    let mut a: Vec<&str> = args.to_vec();
    a.extend(["--cache-dir", cache.to_str().unwrap()]);
    let o = ejc(&a);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.contains("winner: m") && out.contains("(autotune)") && out.contains("stored in"), "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with('m') && l.contains(" ok")).count(), 6, "{out}");
    // Again: answered by the cache.
    let o = ejc(&a);
    assert!(text(&o.stdout).contains("(persistent cache)"), "{}", text(&o.stdout));
    let c = cache.to_str().unwrap();
    let ls = text(&ejc(&["cache", "ls", "--cache-dir", c]).stdout);
    assert!(ls.contains("(1 entries)") && ls.contains("flash_attention_fwd f32"), "{ls}");
    let show = text(&ejc(&["cache", "show", "0", "--cache-dir", c]).stdout);
    assert!(show.contains("candidates:") && show.matches(" ms  ok").count() == 6, "{show}");
    assert_eq!(code(&ejc(&["cache", "show", "no-such-entry", "--cache-dir", c])), 2);
    assert!(text(&ejc(&["cache", "clear", "--cache-dir", c]).stdout).contains("removed 1"));
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn tune_deterministic_times_only_deterministic_plans_and_caches_apart() {
    // The flash backward has two plans; `--deterministic` tunes two_pass alone (atomic's dQ
    // is summed by atomic adds in no fixed order), under a cache entry of its own.
    let cache = temp_dir("tune-det-cache");
    let c = cache.to_str().unwrap();
    let bwd = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/flash_bwd.yaml");
    let args = ["tune", bwd, "--variant", "causal", "--dtype", "f32", "--shape", "1,100,90,2,1,64"];
    let rest = ["--reps", "1", "--threads", "2", "--cache-dir", c];
    let o = ejc(&[&args[..], &rest[..], &["--deterministic"]].concat());
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.contains("plan two_pass") && !out.contains("plan:atomic"), "{out}");
    let o = ejc(&[&args[..], &rest[..]].concat());
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.contains("(autotune)") && out.contains("plan:atomic=1"), "both plans timed: {out}");
    let ls = text(&ejc(&["cache", "ls", "--cache-dir", c]).stdout);
    assert!(ls.contains("(2 entries)") && ls.matches("[deterministic]").count() == 1, "{ls}");
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn mlir_target_writes_modules_and_ptx() {
    let out = temp_dir("mlir");
    let o = ejc(&[
        "build",
        SPEC,
        "-o",
        out.to_str().unwrap(),
        "--target",
        "mlir",
        "--variant",
        "causal",
        "--variant",
        "varlen",
        "--dtype",
        "bf16",
        "--head-dim",
        "64",
        "--block-m",
        "64",
        "--block-n",
        "32",
        "--report",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let loaded = ejc_runtime::manifest::load(&out).expect("manifest verifies");
    let targets: Vec<&str> = loaded.manifest.artifacts.iter().map(|a| a.target.as_str()).collect();
    assert_eq!(targets.iter().filter(|t| **t == "mlir:cpu").count(), 2, "{targets:?}");
    assert_eq!(targets.iter().filter(|t| **t == "mlir:gpu").count(), 2, "{targets:?}");
    assert_eq!(targets.iter().filter(|t| **t == "mlir:gpu:sm_80").count(), 2, "{targets:?}");
    for a in &loaded.manifest.artifacts {
        let body = std::fs::read_to_string(loaded.path_of(a)).unwrap();
        match a.target.as_str() {
            "mlir:cpu" => assert!(body.contains(&format!("func.func @{}(", a.entry)) && a.scratch_bytes > 0),
            "mlir:gpu" => assert!(body.contains("gpu.module @ejc") && body.contains("gpu.func @entry(")),
            _ => {
                assert!(body.contains(".visible .entry entry("), "{}", a.file);
                assert_eq!(a.block, Some([128, 1, 1]));
                assert!(a.scratch_bytes > 0, "the gpu form needs global scratch");
            }
        }
    }
    // --report: ptxas on the MLIR-made PTX too (when this machine has ptxas).
    if ejc_codegen::ptx::find_ptxas().is_some() {
        assert!(text(&o.stdout).contains("@mlir:gpu:sm_80"), "{}", text(&o.stdout));
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn run_backend_mlir_dumps_every_stage_and_caches() {
    let dump = temp_dir("mlir-dump");
    let cache = temp_dir("mlir-cache");
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_ejc"))
            .args([
                "run",
                SPEC,
                "--backend",
                "mlir",
                "--variant",
                "gemma2",
                "--dtype",
                "f16",
                "--shape",
                "1,50,70,4,2,64",
            ])
            .env("EJC_DUMP_MLIR", &dump)
            .env("EJC_CACHE_DIR", &cache)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("ejc runs")
    };
    let o = run();
    assert_eq!(code(&o), 0, "{}{}", text(&o.stdout), text(&o.stderr));
    assert!(text(&o.stdout).contains("ok     gemma2"), "{}", text(&o.stdout));
    assert!(text(&o.stderr).contains("compiled through MLIR in"), "{}", text(&o.stderr));
    let mut stages: Vec<String> =
        std::fs::read_dir(&dump).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    stages.sort();
    let kernel = "flash_gemma2_f16_d64_m64_n32.cpu";
    assert_eq!(
        stages,
        [format!("{kernel}.0-translated.mlir"), format!("{kernel}.1-expanded.mlir"), format!("{kernel}.2-llvm.mlir")]
    );
    let llvm = std::fs::read_to_string(dump.join(format!("{kernel}.2-llvm.mlir"))).unwrap();
    assert!(llvm.contains("llvm.func @flash_gemma2") && !llvm.contains("scf.for"), "fully lowered");
    // A second process finds the compiled object in the cache.
    let o = run();
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("(from the on-disk cache)"), "{}", text(&o.stderr));
    let _ = std::fs::remove_dir_all(&dump);
    let _ = std::fs::remove_dir_all(&cache);
}

/// `--path ws`: the warp-specialised candidates (a producer warp or warpgroup, tensor maps
/// for the aligned entry); `--report --drop-spilling` leaves out the one that spills
/// (one warpgroup holding 128 rows of a d = 128 accumulator) and keeps the other.
#[test]
fn build_warp_specialised_candidates_and_drop_the_spilling_ones() {
    let out = temp_dir("ws");
    let mut args = vec![
        "build",
        SPEC,
        "-o",
        out.to_str().unwrap(),
        "--target",
        "ptx:sm_90a",
        "--variant",
        "full",
        "--dtype",
        "bf16",
        "--head-dim",
        "128",
        "--block-m",
        "128",
        "--block-n",
        "64",
        "--num-stages",
        "2",
        "--path",
        "ws",
    ];
    let o = ejc(&args);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    let ids: Vec<&str> = m.artifacts.iter().map(|a| a.artifact_id.as_str()).collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    for a in &m.artifacts {
        assert_eq!(a.config.get("ws"), Some(&1), "{}", a.artifact_id);
        let w = a.config["num_warps"];
        // A producer warpgroup with two consumer warpgroups, one producer warp with one.
        assert_eq!(a.block, Some([(w + if w == 8 { 4 } else { 1 }) * 32, 1, 1]), "{}", a.artifact_id);
        let al = a.aligned.as_ref().expect("an aligned entry");
        let maps: Vec<(&str, &[u32])> = al.tensor_maps.iter().map(|t| (t.tensor.as_str(), &t.box_dims[..])).collect();
        assert_eq!(maps, [("k", &[1, 64, 1, 64][..]), ("v", &[1, 64, 1, 64][..])], "{}", a.artifact_id);
    }
    // EJC_DUMP_SCHEDULE: each entry's schedule, also when the code comes from the cache.
    let dump = temp_dir("ws-schedule");
    let o = Command::new(env!("CARGO_BIN_EXE_ejc"))
        .args(&args)
        .env("EJC_DUMP_SCHEDULE", &dump)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("ejc runs");
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let mut files: Vec<String> =
        std::fs::read_dir(&dump).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    let k = "flash_full_bf16_d128_m128_n64";
    let want: Vec<String> = ["_aligned_w4", "_aligned_w8", "_w4", "_w8"]
        .iter()
        .map(|e| format!("{k}{e}_s2_wgmma_ws.sm_90a.schedule.txt"))
        .collect();
    assert_eq!(files, want);
    let aligned = std::fs::read_to_string(dump.join(&want[1])).unwrap();
    for needle in ["(sm_90a, 8 warps, 2 stages, wgmma, ws)", "TMA ring (producer)", "ping-pong", "wgmma.wait_group"] {
        assert!(aligned.contains(needle), "no {needle:?} in\n{aligned}");
    }
    assert!(aligned.contains("each op headed by its id") && aligned.contains("\n#0 "), "{aligned}");
    let general = std::fs::read_to_string(dump.join(&want[3])).unwrap();
    assert!(general.contains("cp.async ring") && !general.contains("TMA"), "{general}");
    let _ = std::fs::remove_dir_all(&dump);
    if ejc_codegen::ptx::find_ptxas().is_none() {
        eprintln!("skipped --drop-spilling: no ptxas (run scripts/setup.sh)");
        let _ = std::fs::remove_dir_all(&out);
        return;
    }
    args.extend(["--report", "--drop-spilling"]);
    let o = ejc(&args);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("left out 1 candidate(s)"), "{}", text(&o.stdout));
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    let ids: Vec<&str> = m.artifacts.iter().map(|a| a.artifact_id.as_str()).collect();
    assert_eq!(ids, ["flash_full_bf16_d128_m128_n64@ptx:sm_90a/w8_s2_wgmma_ws"]);
    assert!(!out.join("ptx/sm_90a/flash_full_bf16_d128_m128_n64_w4_s2_wgmma_ws.ptx").exists());
    let _ = std::fs::remove_dir_all(&out);
}

/// The command line is operation-neutral: mean pooling runs, builds and lists like flash
/// (its sizes by name or positionally), on every host back end and for PTX.
#[test]
fn mean_pooling_through_the_command_line() {
    let pool = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/mean_pooling.yaml");
    for backend in ["interp", "cpu", "mlir"] {
        let o = ejc(&[
            "run",
            pool,
            "--backend",
            backend,
            "--dtype",
            "f32",
            "--size",
            "batch=3,seq=67,chunk_size=5",
            "--seed",
            "4",
        ]);
        let out = text(&o.stdout);
        assert_eq!(code(&o), 0, "{backend}: {out}{}", text(&o.stderr));
        assert_eq!(out.lines().filter(|l| l.starts_with("ok ")).count(), 4, "{backend}: {out}");
        assert!(out.contains("sizes=batch=3,seq=67,heads=4,head_dim=64,chunk_size=5"), "{out}");
    }
    // The positional shorthand is the operation's sizes in order.
    let o = ejc(&["run", pool, "--variant", "varlen_bwd", "--shape", "4,40,17,128,3", "--dtype", "bf16"]);
    assert_eq!(code(&o), 0, "{}{}", text(&o.stdout), text(&o.stderr));
    let o = ejc(&["run", pool, "--shape", "4,40,17,128"]);
    assert!(
        code(&o) == 2 && text(&o.stderr).contains("expected 5: batch,seq,heads,head_dim,chunk_size"),
        "{}",
        text(&o.stderr)
    );
    let out = temp_dir("pool-build");
    let mut args = vec!["build", pool, "-o", out.to_str().unwrap(), "--target", "ptx:sm_80", "--target", "ptx:sm_90a"];
    args.extend(["--dtype", "bf16", "--head-dim", "64", "-q"]);
    let o = ejc(&args);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    assert_eq!(m.spec.op, "mean_pooling");
    assert_eq!(m.plans.len(), 4, "one plan per variant");
    // block_h 16 runs on one warp; block_h 64 on one or four (16 rows per warp).
    assert_eq!(m.artifacts.len(), 2 * 4 * 3, "{:?}", m.artifacts.iter().map(|a| &a.artifact_id).collect::<Vec<_>>());
    assert!(m.artifacts.iter().all(|a| a.grid[1].starts_with("cdiv(heads, ")), "the grid is the kernel's");
    let _ = std::fs::remove_dir_all(&out);
}

/// A decode operation (`op`, specs/`file`) through the command line: both plans (`--config block_n=32`, and
/// split-K with `splits`) of every variant on every host back end, f32 and bf16, each
/// variant's result against the reference (`variants` lines `ok`); then the PTX of one
/// variant (bf16, d 128) for sm_80 and sm_90a through ptxas: no candidate spills, and
/// `per_arch` artifacts per arch.
fn decode_op_through_the_command_line(
    op: &str,
    file: &str,
    sizes: &str,
    splits: &str,
    variants: usize,
    ptx: (&str, usize),
) {
    let spec = format!("{}/specs/{file}", env!("CARGO_MANIFEST_DIR"));
    let split = format!("num_splits={splits}");
    for backend in ["interp", "cpu", "mlir"] {
        for dtype in ["f32", "bf16"] {
            for plan in [&["--config", "block_n=32"][..], &["--plan", "split_k", "--config", &split]] {
                let mut args = vec!["run", &spec, "--backend", backend, "--dtype", dtype, "--size", sizes];
                args.extend(plan);
                let o = ejc(&args);
                let out = text(&o.stdout);
                assert_eq!(code(&o), 0, "{backend} {dtype} {plan:?}: {out}{}", text(&o.stderr));
                assert_eq!(out.lines().filter(|l| l.starts_with("ok ")).count(), variants, "{backend}: {out}");
                assert!(sizes.split(',').all(|kv| out.contains(kv)), "the sizes asked for: {out}");
            }
        }
    }
    let (variant, per_arch) = ptx;
    let out = temp_dir(&format!("{file}-build"));
    let mut args = vec!["build", &spec, "-o", out.to_str().unwrap(), "--target", "ptx:sm_80", "--target", "ptx:sm_90a"];
    args.extend(["--dtype", "bf16", "--head-dim", "128", "--variant", variant, "-q"]);
    let have_ptxas = ejc_codegen::ptx::find_ptxas().is_some();
    if have_ptxas {
        args.extend(["--report", "--drop-spilling"]);
    } else {
        eprintln!("skipped the ptxas report: no ptxas (run scripts/setup.sh); PTX is still generated");
    }
    let o = ejc(&args);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    if have_ptxas {
        assert!(text(&o.stdout).contains("left out 0 candidate(s)"), "{}", text(&o.stdout));
    }
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    assert_eq!(m.spec.op, op);
    assert_eq!(m.plans.len(), 2, "single and split_k");
    let ids: Vec<&String> = m.artifacts.iter().map(|a| &a.artifact_id).collect();
    assert_eq!(m.artifacts.len(), 2 * per_arch, "{ids:?}");
    assert!(m.artifacts.iter().all(|a| a.grid[1] == "num_seqs"), "the grid is the kernel's");
    let _ = std::fs::remove_dir_all(&out);
}

/// Paged decode attention: sizes off every block (contexts off the page size with an
/// empty and a one-key sequence, a page size of 24 that no key block divides, GQA 20:4
/// in two head blocks of 16); PTX of the soft-cap variant: 3 tilings x 2 stage counts
/// for main and partial, and the combine, per arch. Its positional shorthand.
#[test]
fn page_attention_through_the_command_line() {
    let sizes = "num_seqs=6,heads_q=20,heads_kv=4,page_size=24,max_context=301";
    decode_op_through_the_command_line(
        "page_attention",
        "page_attention.yaml",
        sizes,
        "8",
        2,
        ("softcap", 2 * 3 * 2 + 1),
    );
    // The positional shorthand is the operation's sizes in order (the last two optional).
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/page_attention.yaml");
    let o = ejc(&["run", spec, "--shape", "4,8,2,64,16", "--backend", "interp"]);
    assert!(code(&o) == 2 && text(&o.stderr).contains("num_seqs,heads_q,heads_kv,head_dim,page_size,max_context"));
}

/// Ragged decode attention: every variant (window, soft cap, gpt-oss's window and sinks),
/// ranges off every block with an empty and a one-key row, GQA 20:4; PTX of the gpt-oss
/// variant: 2 tilings x 2 stage counts for main and partial, and the combine, per arch.
#[test]
fn ragged_decode_through_the_command_line() {
    let sizes = "batch=6,seq=301,heads_q=20,heads_kv=4";
    decode_op_through_the_command_line(
        "ragged_decode_attention",
        "ragged_decode.yaml",
        sizes,
        "16",
        4,
        ("gpt_oss", 2 * 2 * 2 + 1),
    );
}

/// Ragged paged attention (mixed prefill and decode, K/V interleaved pages), v2 and v3:
/// every variant on the interpreter, CPU and MLIR with a page size of 5 that no key block
/// divides, GQA 10:2, a prefill chunk of 41 tokens past a block of rows (v3: its cache
/// writes compared too), the four plans (split-K and classed split-K at 4 splits); PTX
/// through ptxas of one variant: pack, unpack, combine, 9 tilings of main, of partial and
/// of classed's large-sequence program per arch (16 rows on one warp, 64 on four, 128 on
/// four and on eight, 16/32/64 keys; sm_90a's 64- and 128-row ones also with wgmma and
/// warp specialisation; never 64 rows on one warp, whose accumulator would spill),
/// classed's 3 small-sequence programs and their 3 split ones (16 rows, one warp) with
/// their per-sequence combine, the classed plans' `classify` (the large class's list), and
/// v3's write. 128 rows on four warps
/// spill at d = 128 (an accumulator of 128 registers and the scores besides, which the
/// back end's accumulator rule lets through): `--drop-spilling` leaves out exactly those.
#[test]
fn ragged_page_attention_through_the_command_line() {
    // `spilled`: the candidates ptxas's report leaves out (128 rows on 4 warps only).
    for (file, variants, variant, per_arch, spilled) in
        [("ragged_paged.yaml", 4, "gpt_oss", 148, 17), ("ragged_paged_v3.yaml", 3, "sliding_window", 150, 22)]
    {
        let spec = format!("{}/specs/{file}", env!("CARGO_MANIFEST_DIR"));
        let sizes = "num_seqs=6,heads_q=10,heads_kv=2,page_size=5,max_context=133,max_q_len=41";
        for backend in ["interp", "cpu", "mlir"] {
            for (dtype, plan) in [
                ("f32", "packed"),
                ("bf16", "packed"),
                ("bf16", "split_k"),
                ("f32", "classed"),
                ("bf16", "classed_split"),
            ] {
                let o = ejc(&[
                    "run",
                    &spec,
                    "--backend",
                    backend,
                    "--dtype",
                    dtype,
                    "--size",
                    sizes,
                    "--plan",
                    plan,
                    "--config",
                    "num_splits=4",
                ]);
                let out = text(&o.stdout);
                assert_eq!(code(&o), 0, "{file} {backend} {dtype}: {out}{}", text(&o.stderr));
                assert_eq!(out.lines().filter(|l| l.starts_with("ok ")).count(), variants, "{backend}: {out}");
                assert!(out.contains(&format!("plan={plan}")), "{out}");
                if file.ends_with("v3.yaml") {
                    assert!(out.contains("kv_pages_rel_err=0.000e0"), "the cache writes are exact: {out}");
                }
            }
        }
        let out = temp_dir(&format!("{file}-build"));
        let mut args =
            vec!["build", &spec, "-o", out.to_str().unwrap(), "--target", "ptx:sm_80", "--target", "ptx:sm_90a"];
        args.extend(["--dtype", "bf16", "--head-dim", "128", "--variant", variant, "-q"]);
        let have_ptxas = ejc_codegen::ptx::find_ptxas().is_some();
        if have_ptxas {
            args.extend(["--report", "--drop-spilling"]);
        } else {
            eprintln!("skipped the ptxas report: no ptxas (run scripts/setup.sh); PTX is still generated");
        }
        let o = ejc(&args);
        assert_eq!(code(&o), 0, "{}", text(&o.stderr));
        if have_ptxas {
            let report = text(&o.stdout);
            assert!(report.contains(&format!("left out {spilled} candidate(s)")), "{report}");
            for line in report.lines().filter(|l| l.ends_with("SPILLS")) {
                assert!(line.contains("_m128_") && line.contains("/w4_"), "only 128 rows on 4 warps spill: {line}");
            }
        }
        let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
        assert_eq!(m.plans.len(), 4, "packed, classed, split_k and classed_split");
        let ids: Vec<&String> = m.artifacts.iter().map(|a| &a.artifact_id).collect();
        let kept = if have_ptxas { per_arch - spilled } else { per_arch };
        assert_eq!(m.artifacts.len(), kept, "{ids:?}");
        assert!(!ids.iter().any(|i| i.contains("_m64_") && i.contains("/w1_")), "64 rows on one warp: {ids:?}");
        assert!(m.artifacts.iter().any(|a| a.grid[0] == "cdiv(max_q_rows, 64)"), "main's grid: {ids:?}");
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// Block-sparse attention from the command line: every variant on the CPU (bf16) and MLIR
/// (f32) back ends against the reference on an awkward call (a mask per head, Sq ≠ Sk,
/// lengths off the blocks, GQA), and the PTX of one variant and tiling through ptxas
/// (its layout and attention kernels on both archs, Hopper's paths among them).
#[test]
fn blocksparse_attention_through_the_command_line() {
    let spec = format!("{}/specs/blocksparse.yaml", env!("CARGO_MANIFEST_DIR"));
    let sizes = "batch=2,heads_q=4,heads_kv=2,seq_q=211,seq_k=190,mask_heads=4";
    for (backend, dtype) in [("cpu", "bf16"), ("mlir", "f32")] {
        let o = ejc(&["run", &spec, "--backend", backend, "--dtype", dtype, "--size", sizes]);
        let out = text(&o.stdout);
        assert_eq!(code(&o), 0, "{backend} {dtype}: {out}{}", text(&o.stderr));
        assert_eq!(out.lines().filter(|l| l.starts_with("ok ")).count(), 13, "{backend}: {out}");
        assert!(out.contains("plan=layout"), "{out}");
    }
    let out = temp_dir("blocksparse-build");
    let mut args = vec!["build", &spec, "-o", out.to_str().unwrap(), "--target", "ptx:sm_80", "--target", "ptx:sm_90a"];
    args.extend([
        "--dtype",
        "bf16",
        "--head-dim",
        "64",
        "--variant",
        "document",
        "--block-m",
        "64",
        "--block-n",
        "64",
        "-q",
    ]);
    let have_ptxas = ejc_codegen::ptx::find_ptxas().is_some();
    if have_ptxas {
        args.push("--report");
    } else {
        eprintln!("skipped the ptxas report: no ptxas (run scripts/setup.sh); PTX is still generated");
    }
    let o = ejc(&args);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    if have_ptxas {
        let report = text(&o.stdout);
        assert!(!report.contains("SPILLS"), "64 x 64 tiles at d = 64 spill nowhere: {report}");
        assert!(report.contains("_layout@ptx:sm_90a/w4_s2"), "{report}");
        assert!(report.contains("blocksparse_document_bf16_d64_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws"), "{report}");
    }
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    assert_eq!(m.plans.len(), 1, "the layout plan");
    assert!(m.artifacts.iter().any(|a| a.grid[0] == "cdiv(seq_q, 64)"), "the grid over query blocks");
    let _ = std::fs::remove_dir_all(&out);
}

/// Block-sparse attention's backward from the command line: every variant on the CPU (bf16)
/// and MLIR (f32) back ends against the f64 reference on an awkward call (a mask per head
/// over GQA, Sq ≠ Sk, lengths off the blocks), and the PTX of two variants through ptxas on
/// both archs (every role; at d = 64 the documents' kernels do not spill).
#[test]
fn blocksparse_backward_through_the_command_line() {
    let spec = format!("{}/specs/blocksparse_bwd.yaml", env!("CARGO_MANIFEST_DIR"));
    let sizes = "batch=2,heads_q=4,heads_kv=2,seq_q=211,seq_k=190,mask_heads=4";
    for (backend, dtype) in [("cpu", "bf16"), ("mlir", "f32")] {
        let o = ejc(&["run", &spec, "--backend", backend, "--dtype", dtype, "--size", sizes]);
        let out = text(&o.stdout);
        assert_eq!(code(&o), 0, "{backend} {dtype}: {out}{}", text(&o.stderr));
        assert_eq!(out.lines().filter(|l| l.starts_with("ok ")).count(), 14, "{backend}: {out}");
        assert!(out.contains("dk_rel_err=") && out.contains("dsinks_rel_err="), "{out}");
        assert!(out.contains("dbias_rel_err="), "{out}");
    }
    let out = temp_dir("blocksparse-bwd-build");
    let mut args = vec!["build", &spec, "-o", out.to_str().unwrap(), "--target", "ptx:sm_80", "--target", "ptx:sm_90a"];
    args.extend([
        "--dtype",
        "bf16",
        "--head-dim",
        "64",
        "--variant",
        "document",
        "--variant",
        "window_sinks_softcap",
        "-q",
    ]);
    let have_ptxas = ejc_codegen::ptx::find_ptxas().is_some();
    if have_ptxas {
        args.push("--report");
    } else {
        eprintln!("skipped the ptxas report: no ptxas (run scripts/setup.sh); PTX is still generated");
    }
    let o = ejc(&args);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    if have_ptxas {
        let report = text(&o.stdout);
        // (The sinks and soft-cap variant's dK/dV spills a few bytes on some paths.)
        let spills = report.lines().any(|l| l.contains("_document_") && l.contains("SPILLS"));
        assert!(!spills, "64 x 64 tiles at d = 64 spill nowhere in `document`: {report}");
        for role in ["layout", "layout_t", "preprocess", "dkdv", "dq", "dsinks"] {
            assert!(report.contains(&format!("_d64_{role}")), "{role}: {report}");
        }
        assert!(report.contains("_dkdv_m64_n64@ptx:sm_90a/w4_s2_wgmma_ws"), "{report}");
    }
    let m = ejc_runtime::manifest::load(&out).unwrap().manifest;
    assert_eq!(m.plans.len(), 2, "the layout plan of each variant");
    let launches: Vec<usize> = m.plans.iter().map(|p| p.launches.len()).collect();
    assert!(launches.contains(&5) && launches.contains(&6), "dsinks with sinks only: {launches:?}");
    let _ = std::fs::remove_dir_all(&out);
}

/// `ejc build` with its compiled-code cache in `cache`; stdout's last line.
fn build_cached(spec: &std::path::Path, out: &std::path::Path, cache: &std::path::Path, extra: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_ejc"))
        .args(["build", spec.to_str().unwrap(), "-o", out.to_str().unwrap()])
        .args(extra)
        .env("EJC_CACHE_DIR", cache)
        .env_remove("EJC_CODE_CACHE")
        .output()
        .expect("ejc runs");
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    text(&o.stdout).lines().last().unwrap_or_default().to_string()
}

#[test]
fn build_compiles_each_kernel_once_and_an_edited_variant_alone() {
    let dir = temp_dir("code-cache");
    std::fs::create_dir_all(&dir).unwrap();
    let spec = dir.join("small.yaml");
    let write = |cap: &str| {
        let yaml = format!(
            "name: small\nop: flash_attention_fwd\nversion: 1\nlayout: bshd\ndtypes: [f32, bf16]\nhead_dims: [64]\n\
             variants:\n  full: {{}}\n  causal:\n    causal: true\n  capped:\n    logits_soft_cap: {cap}\n\
             schedule:\n  block_m: [64]\n  block_n: [32]\n  num_warps: [4]\n  num_stages: [2]\n\
             targets: [cpu, \"ptx:sm_80\"]\n"
        );
        std::fs::write(&spec, yaml).unwrap();
    };
    let (cache, out) = (dir.join("cache"), dir.join("out"));
    let cpu = ["--target", "cpu", "--dtype", "f32"];
    write("30.0");
    let first = build_cached(&spec, &out, &cache, &cpu);
    assert!(first.ends_with("(3 compiled, 0 from the compiled-code cache)"), "{first}");
    let so = |out: &std::path::Path| {
        let m = ejc_runtime::manifest::load(out).unwrap().manifest;
        m.artifacts.iter().map(|a| a.sha256.clone()).collect::<Vec<_>>()
    };
    let cold = so(&out);
    let again = build_cached(&spec, &out, &cache, &cpu);
    assert!(again.ends_with("(0 compiled, 3 from the compiled-code cache)"), "{again}");
    assert_eq!(so(&out), cold, "a library linked from cached objects is the same library");
    // One variant changed: only its kernel is compiled.
    write("20.0");
    let edited = build_cached(&spec, &out, &cache, &cpu);
    assert!(edited.ends_with("(1 compiled, 2 from the compiled-code cache)"), "{edited}");
    // PTX: cached code is the code a fresh compilation writes.
    let ptx = ["--target", "ptx:sm_80", "--dtype", "bf16"];
    let first = build_cached(&spec, &out, &cache, &ptx);
    assert!(first.ends_with("(3 compiled, 0 from the compiled-code cache)"), "{first}");
    let fresh = dir.join("fresh");
    let nocache = build_cached(&spec, &fresh, &cache, &[&ptx[..], &["--no-cache"]].concat());
    assert!(!nocache.contains("compiled-code cache"), "--no-cache neither reads nor writes it: {nocache}");
    let warm = build_cached(&spec, &out, &cache, &ptx);
    assert!(warm.ends_with("(0 compiled, 3 from the compiled-code cache)"), "{warm}");
    let files = |d: &std::path::Path| {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(d.join("ptx/sm_80"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(files(&out), files(&fresh));
    // `ejc cache ls` counts the entries; `clear --code` removes them and nothing else.
    let o =
        Command::new(env!("CARGO_BIN_EXE_ejc")).args(["cache", "ls"]).env("EJC_CACHE_DIR", &cache).output().unwrap();
    assert!(text(&o.stdout).contains("/ptx (3 entries"), "{}", text(&o.stdout));
    assert!(text(&o.stdout).contains("/cpu (4 entries"), "{}", text(&o.stdout));
    let o = Command::new(env!("CARGO_BIN_EXE_ejc"))
        .args(["cache", "clear", "--code"])
        .env("EJC_CACHE_DIR", &cache)
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    assert!(!cache.join("ptx").exists() && !cache.join("cpu").exists());
    let cold = build_cached(&spec, &out, &cache, &cpu);
    assert!(cold.ends_with("(3 compiled, 0 from the compiled-code cache)"), "{cold}");
    let _ = std::fs::remove_dir_all(&dir);
}
