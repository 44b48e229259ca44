//! The executor API end to end: a program calls `flash_attention` on the CPU; the
//! first process autotunes and stores the choice, a second process finds it in the
//! persistent cache (its log says so). Also: registry lookups over a real build.

use std::path::PathBuf;
use std::process::Command;

const SPEC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/flash.yaml");

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ejc-runtime-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn build(out: &std::path::Path, variants: &[&str]) {
    let mut args =
        vec!["build", SPEC, "-o", out.to_str().unwrap(), "--target", "cpu", "--dtype", "f32", "--head-dim", "64", "-q"];
    for v in variants {
        args.extend(["--variant", v]);
    }
    let o = Command::new(env!("CARGO_BIN_EXE_ejc")).args(&args).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Build an example of this package (a no-op when up to date) and return its path.
/// `--workspace`: with the features `cargo test --workspace` (CI) resolved, so the
/// example it built is reused; a build of this package alone would resolve other
/// features and compile every dependency a second time (three minutes on 2 cores).
fn example(name: &str) -> PathBuf {
    let o = Command::new(env!("CARGO"))
        .args(["build", "-q", "--workspace", "--example", name, "--message-format=json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(o.status.success(), "building example {name}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["target"]["name"] == name)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .expect("cargo reports the example's executable")
}

/// Build `variant` of a spec for the CPU (`extra`: more `ejc build` arguments) into a
/// fresh directory named after `name`; returns it, a fresh cache directory, and the
/// variant's features.
fn build_variant(spec: &str, name: &str, variant: &str, extra: &[&str]) -> (PathBuf, PathBuf, ejc_ir::op::Features) {
    let kernels = temp(name);
    let cache = temp(&format!("{name}-cache"));
    let o = Command::new(env!("CARGO_BIN_EXE_ejc"))
        .args(["build", spec, "-o", kernels.to_str().unwrap(), "--target", "cpu", "--variant", variant, "-q"])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let f = ejc_ir::spec::load_file(spec).unwrap().variant(variant).unwrap().features.clone();
    (kernels, cache, f)
}

/// Every output of `call` against the reference's `want` for `host`, within `tol`.
fn check_outputs(
    op: &dyn ejc_ir::op::Operation,
    f: &ejc_ir::op::Features,
    host: &ejc_ir::op::HostCall,
    want: &std::collections::BTreeMap<String, ejc_ir::tensor::HostTensor>,
    call: &ejc_runtime::call::Call,
    tol: f64,
    label: &str,
) {
    let mut got = host.clone();
    for n in op.outputs(f) {
        got.tensors.insert(n.to_string(), call.host_tensor(n).unwrap());
    }
    for (name, rel, _) in ejc_ir::op::compare_outputs(op, f, &got, want) {
        assert!(rel <= tol, "{label}: {name} rel_err {rel:e}");
    }
}

/// A runtime over `kernels` (its cache in `cache`) and a fresh random call of flash-family
/// operation `op` at `[batch, seq_q, seq_k, heads_q, heads_kv, head_dim]`, with the
/// reference's outputs for it; the seed is printed.
fn flash_case(
    op: &dyn ejc_ir::op::Operation,
    f: &ejc_ir::op::Features,
    kernels: &std::path::Path,
    cache: &std::path::Path,
    sizes: [i64; 6],
    dtype: ejc_ir::types::DType,
) -> (ejc_runtime::api::Runtime, ejc_ir::op::HostCall, std::collections::BTreeMap<String, ejc_ir::tensor::HostTensor>) {
    use ejc_runtime::api::{Runtime, RuntimeOptions};
    let names = ["batch", "seq_q", "seq_k", "heads_q", "heads_kv", "head_dim"];
    let dims: ejc_ir::op::Sizes = names.iter().zip(sizes).map(|(k, v)| (k.to_string(), v)).collect();
    let opts = RuntimeOptions {
        kernels: vec![kernels.to_path_buf()],
        cache_dir: Some(cache.to_path_buf()),
        ..Default::default()
    };
    let rt = Runtime::new(opts).unwrap();
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    println!("seed {seed}");
    let host = op.random_call(f, dtype, &dims, seed).unwrap();
    let want = op.reference(f, &host).unwrap();
    (rt, host, want)
}

#[test]
fn tunes_once_then_the_second_process_hits_the_persistent_cache() {
    let kernels = temp("kernels");
    let cache = temp("cache");
    build(&kernels, &["causal"]);
    let exe = example("flash_call");
    let run = || {
        let o = Command::new(&exe)
            .env("EJC_KERNELS", &kernels)
            .env("EJC_CACHE_DIR", &cache)
            .env("EJC_LOG", "1")
            .output()
            .expect("the flash_call example runs");
        let (out, err) =
            (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned());
        assert!(o.status.success(), "{out}{err}");
        (out, err)
    };
    let (out1, log1) = run();
    assert!(out1.contains("source=autotune"), "{out1}");
    assert!(log1.contains("ejc: autotuning 6 candidates"), "{log1}");
    let (out2, log2) = run();
    assert!(out2.contains("source=persistent cache"), "{out2}");
    assert!(log2.contains("from the persistent cache"), "{log2}");
    assert!(!log2.contains("autotuning"), "{log2}");
    // Same choice both times.
    let cfg = |s: &str| s.split("config=").nth(1).and_then(|x| x.split(" source").next()).map(str::to_string);
    assert_eq!(cfg(&out1), cfg(&out2));
    let _ = std::fs::remove_dir_all(&kernels);
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn registry_finds_families_and_says_what_exists() {
    use ejc_ir::flash::CallFeatures;
    use ejc_ir::types::DType;
    use ejc_runtime::registry::{Query, Registry};
    let kernels = temp("registry");
    build(&kernels, &["full", "causal", "gpt_oss"]);
    let mut reg = Registry::new();
    assert_eq!(reg.load_manifest(&kernels).unwrap(), 18);
    reg.check_signatures().unwrap();
    let q = Query::new("flash_attention_fwd").dtype(DType::F32).key("head_dim", 64);
    let f = |c: CallFeatures| c.to_json();
    let causal = reg.families(&q.clone().features(f(CallFeatures { causal: true, ..Default::default() }))).unwrap();
    assert_eq!((causal.len(), causal[0].instance.variant.as_str(), causal[0].entries.len()), (1, "causal", 6));
    assert_eq!(causal[0].plans.len(), 1, "one plan: single");
    assert_eq!(causal[0].candidates().len(), 6, "one per tiling");
    // gpt_oss has a compile-time window (128, 0): only that window matches it.
    let w = CallFeatures { causal: true, window: Some((128, 0)), sinks: true, ..Default::default() };
    assert_eq!(reg.families(&q.clone().features(f(w.clone()))).unwrap()[0].instance.variant, "gpt_oss");
    let err =
        reg.families(&q.clone().features(f(CallFeatures { window: Some((64, 0)), ..w }))).unwrap_err().to_string();
    assert!(
        err.contains("no kernel for") && err.contains("causal [f32] head_dim=64 on cpu:") && err.contains("gpt_oss"),
        "{err}"
    );
    let err = reg.families(&Query::new("flash_attention_fwd").dtype(DType::BF16)).unwrap_err().to_string();
    assert!(err.contains("bf16") && err.contains("full [f32]"), "{err}");
    // Two implementations of one kernel with different parameters are caught.
    let mut bad = reg.entries()[0].clone();
    bad.params.pop();
    bad.backend = "cpu:other".into();
    reg.add(bad);
    assert!(reg.check_signatures().unwrap_err().to_string().contains("takes"));
    let _ = std::fs::remove_dir_all(&kernels);
}

#[test]
fn bad_arguments_are_errors_naming_the_argument() {
    use ejc_ir::tensor::HostTensor;
    use ejc_ir::types::DType;
    use ejc_runtime::api::{Runtime, RuntimeOptions};
    use ejc_runtime::cpu::HostBuffer;
    use ejc_runtime::flash::{FlashArgs, FlashOptions, SlidingWindow};
    let kernels = temp("args");
    build(&kernels, &["full"]);
    let mut rt = Runtime::new(RuntimeOptions {
        kernels: vec![kernels.clone()],
        cache_dir: Some(temp("args-cache")),
        ..Default::default()
    })
    .unwrap();
    let t = |d: DType, s: &[usize]| HostBuffer::from_host(&HostTensor::full(d, s, 0.5));
    let (q, k, v) = (t(DType::F32, &[1, 10, 2, 64]), t(DType::F32, &[1, 12, 2, 64]), t(DType::F32, &[1, 12, 2, 64]));
    let call = |a: FlashArgs, o: FlashOptions, rt: &mut Runtime| match rt.flash_attention(&a, &o) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    };
    let k16 = t(DType::BF16, &[1, 12, 2, 64]);
    assert!(call(FlashArgs::new(&q, &k16, &v), FlashOptions::default(), &mut rt).contains("argument `k`: dtype bf16"));
    let k3 = t(DType::F32, &[12, 2, 64]);
    assert!(call(FlashArgs::new(&q, &k3, &v), FlashOptions::default(), &mut rt).contains("argument `k`: shape"));
    let o = FlashOptions { sliding_window: Some(SlidingWindow::LeftRight(-1, 2)), ..Default::default() };
    assert!(call(FlashArgs::new(&q, &k, &v), o, &mut rt).contains("argument `sliding_window`"));
    let o = FlashOptions { dropout_p: Some(1.5), ..Default::default() };
    assert!(call(FlashArgs::new(&q, &k, &v), o, &mut rt).contains("argument `dropout_p`"));
    // A feature this build has no kernel for: the error lists what exists.
    let o = FlashOptions { causal: true, ..Default::default() };
    let e = call(FlashArgs::new(&q, &k, &v), o, &mut rt);
    assert!(e.contains("full [f32] head_dim=64"), "{e}");
    // A mismatched v is caught by the operation's check, naming v.
    let v2 = t(DType::F32, &[1, 11, 2, 64]);
    let e = call(FlashArgs::new(&q, &k, &v2), FlashOptions::default(), &mut rt);
    assert!(e.contains("`v`"), "{e}");
    // And a good call works, with an explicit configuration that is used as given.
    let cfg = ejc_runtime::registry::Config::from([("block_m".to_string(), 64), ("block_n".to_string(), 32)]);
    let r = rt
        .flash_attention(&FlashArgs::new(&q, &k, &v), &FlashOptions { config: Some(cfg.clone()), ..Default::default() })
        .unwrap();
    assert_eq!((r.config, r.source), (cfg, ejc_runtime::chain::Source::Override));
    let _ = std::fs::remove_dir_all(&kernels);
}

#[test]
fn the_autotuner_drops_wrong_candidates_and_prunes_oversized_ones() {
    use std::cell::RefCell;

    use ejc_ir::flash::CallFeatures;
    use ejc_ir::types::DType;
    use ejc_runtime::chain::Tunable;
    use ejc_runtime::exec::CpuLibs;
    use ejc_runtime::registry::{Candidate, Query, Registry};
    use ejc_runtime::tune::{Device, Tuner};
    let kernels = temp("tuner");
    build(&kernels, &["full", "causal"]);
    let mut reg = Registry::new();
    reg.load_manifest(&kernels).unwrap();
    let q = Query::new("flash_attention_fwd").dtype(DType::F32).key("head_dim", 64);
    let wanted = CallFeatures { causal: true, ..Default::default() }.to_json();
    let causal = reg.families(&q.clone().features(wanted.clone())).unwrap().remove(0);
    let full = reg.families(&q.features(CallFeatures::default().to_json())).unwrap().remove(0);
    // Two honest causal candidates, and a full-attention kernel posing as a third causal
    // candidate: it computes the wrong thing.
    let mut cands: Vec<Candidate> = causal.candidates()[..2].to_vec();
    let mut impostor = cands[0].clone();
    impostor.launches = vec![full.entries[0]];
    impostor.config.insert("block_m".into(), 999);
    cands.push(impostor.clone());
    let op = ejc_ir::ops::get("flash_attention_fwd").unwrap();
    let dims = ejc_ir::op::Sizes::from(
        [("batch", 1), ("seq_q", 96), ("seq_k", 96), ("heads_q", 2), ("heads_kv", 2), ("head_dim", 64)]
            .map(|(k, v)| (k.to_string(), v)),
    );
    let call = op.random_call(&causal.features, DType::F32, &dims, 1).unwrap();
    let sizes = op.validate(&causal.features, DType::F32, &causal.instance.keys, &call).unwrap();
    let libs = RefCell::new(CpuLibs::default());
    let mut t = Tuner::new(
        op,
        causal.features.clone(),
        wanted,
        DType::F32,
        causal.instance.keys.clone(),
        sizes,
        call.scalars.clone(),
        cands,
        Device::Cpu { libs: &libs, threads: 2 },
    );
    t.progress = false;
    t.reps = 1;
    let r = t.autotune(&t.candidates());
    let status: Vec<&str> = r.timings.iter().map(|x| x.status.as_str()).collect();
    assert_eq!(status[..2], ["ok", "ok"], "{status:?}");
    assert!(status[2].starts_with("wrong result"), "{status:?}");
    assert!(r.winner.is_some_and(|w| w != impostor.config));
    // A scratch budget smaller than every kernel prunes them all.
    t.scratch_limit = 1024;
    let r = t.autotune(&t.candidates());
    assert!(r.winner.is_none() && r.timings.iter().all(|x| x.status.starts_with("pruned")), "{:?}", r.timings);
    let _ = std::fs::remove_dir_all(&kernels);
}

#[test]
fn two_tune_processes_writing_one_cache_at_once_lose_nothing() {
    let cache = temp("tune-race");
    let spawn = |variant: &str| {
        Command::new(env!("CARGO_BIN_EXE_ejc"))
            .args(["tune", SPEC, "--variant", variant, "--dtype", "f32", "--shape", "1,128,128,2,2,64", "--reps", "1"])
            .args(["--threads", "1", "--cache-dir", cache.to_str().unwrap()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let children: Vec<_> = ["full", "causal", "sliding_window", "softcap"].into_iter().map(spawn).collect();
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let ls = Command::new(env!("CARGO_BIN_EXE_ejc"))
        .args(["cache", "ls", "--cache-dir", cache.to_str().unwrap()])
        .output()
        .unwrap();
    let ls = String::from_utf8_lossy(&ls.stdout);
    assert!(ls.contains("(4 entries)"), "{ls}");
    let _ = std::fs::remove_dir_all(&cache);
}

/// The runtime is not flash's: mean pooling goes through the same generic call —
/// registry family by op and instance, validation by the operation, the chain with
/// autotuning and its persistent cache — and matches the reference, forward and backward,
/// dense and varlen.
#[test]
fn any_operation_runs_through_the_generic_call() {
    use ejc_ir::op::{compare_outputs, Sizes};
    use ejc_ir::types::DType;
    use ejc_runtime::api::{CallOptions, Runtime, RuntimeOptions};
    use ejc_runtime::call::Call;
    use ejc_runtime::chain::Source;
    let kernels = temp("pool");
    let cache = temp("pool-cache");
    let pool = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/mean_pooling.yaml");
    let o = Command::new(env!("CARGO_BIN_EXE_ejc"))
        .args(["build", pool, "-o", kernels.to_str().unwrap(), "--target", "cpu", "--dtype", "f32", "--head-dim", "64"])
        .arg("-q")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let op = ejc_ir::ops::get("mean_pooling").unwrap();
    let dims = Sizes::from(
        [("batch", 3), ("seq", 53), ("heads", 5), ("head_dim", 64), ("chunk_size", 6)].map(|(k, v)| (k.to_string(), v)),
    );
    let open = || {
        let opts =
            RuntimeOptions { kernels: vec![kernels.clone()], cache_dir: Some(cache.clone()), ..Default::default() };
        Runtime::new(opts).unwrap()
    };
    let mut rt = open();
    for (backward, varlen) in [(false, false), (true, false), (false, true), (true, true)] {
        let f = ejc_ir::ops::mean_pooling::op::PoolFeatures { backward, varlen }.to_json();
        let host = op.random_call(&f, DType::F32, &dims, 9).unwrap();
        let want = op.reference(&f, &host).unwrap();
        let mut call = Call::from_host(&host);
        let r = rt.call("mean_pooling", &f, &mut call, &CallOptions { threads: 2, ..Default::default() }).unwrap();
        assert_eq!((r.source, r.plan.as_str()), (Source::Autotune, "single"), "{r:?}");
        let mut got = host.clone();
        for n in op.outputs(&f) {
            got.tensors.insert(n.to_string(), call.host_tensor(n).unwrap());
        }
        for (name, rel, _) in compare_outputs(op, &f, &got, &want) {
            assert!(rel <= 1e-5, "backward={backward} varlen={varlen}: {name} rel_err {rel:e}");
        }
    }
    // A second process (a new runtime) finds the choices in the persistent cache — for the
    // same thread count, which is part of the key.
    let mut rt = open();
    let f = ejc_ir::ops::mean_pooling::op::PoolFeatures::default().to_json();
    let host = op.random_call(&f, DType::F32, &dims, 10).unwrap();
    let two = CallOptions { threads: 2, ..Default::default() };
    let r = rt.call("mean_pooling", &f, &mut Call::from_host(&host), &two).unwrap();
    assert_eq!(r.source, Source::Persistent);
    // A call that fits no instance says what exists.
    let mut bad = Call::from_host(
        &op.random_call(
            &f,
            DType::F32,
            &Sizes::from([("head_dim".to_string(), 128)])
                .into_iter()
                .chain(dims.clone().into_iter().filter(|(k, _)| k != "head_dim"))
                .collect(),
            1,
        )
        .unwrap(),
    );
    let e = rt.call("mean_pooling", &f, &mut bad, &CallOptions::default()).unwrap_err().to_string();
    assert!(e.contains("head_dim 128") && e.contains("head_dim=64"), "{e}");
    let _ = std::fs::remove_dir_all(&kernels);
    let _ = std::fs::remove_dir_all(&cache);
}

/// The decode operations through the runtime's generic call on the CPU: paged attention
/// (a page size of 24 that no key block divides, an empty and a one-key sequence) and
/// ragged decode attention (gpt-oss's window and sinks), and ragged paged attention (a
/// mixed batch, gpt-oss's window and sinks: its one plan of pack, main and unpack through
/// temporaries). The tuner times the plans (one kernel; split-K at every split count;
/// the packed plan's tilings), and v3 (its cache writes first, checked byte for byte);
/// whatever the tuner keeps matches the reference, a
/// second runtime finds the choice in the persistent cache, and a block table pointing
/// outside the cache is refused before any kernel runs.
#[test]
fn decode_operations_run_through_the_generic_call() {
    use ejc_ir::op::{compare_outputs, Sizes};
    use ejc_ir::types::DType;
    use ejc_runtime::api::{CallOptions, Runtime, RuntimeOptions};
    use ejc_runtime::call::Call;
    use ejc_runtime::chain::Source;
    // (operation, spec file, variant, sizes)
    type Case = (&'static str, &'static str, &'static str, &'static [(&'static str, i64)]);
    let cases: [Case; 4] = [
        (
            "page_attention",
            "page_attention.yaml",
            "full",
            &[
                ("num_seqs", 5),
                ("heads_q", 8),
                ("heads_kv", 2),
                ("head_dim", 64),
                ("page_size", 24),
                ("max_context", 150),
            ],
        ),
        (
            "ragged_decode_attention",
            "ragged_decode.yaml",
            "gpt_oss",
            &[("batch", 5), ("seq", 150), ("heads_q", 8), ("heads_kv", 2), ("head_dim", 64)],
        ),
        (
            "ragged_page_attention",
            "ragged_paged.yaml",
            "gpt_oss",
            &[
                ("num_seqs", 6),
                ("heads_q", 8),
                ("heads_kv", 2),
                ("head_dim", 64),
                ("page_size", 7),
                ("max_context", 150),
                ("max_q_len", 45),
            ],
        ),
        (
            "ragged_page_attention_v3",
            "ragged_paged_v3.yaml",
            "sliding_window",
            &[
                ("num_seqs", 8),
                ("heads_q", 8),
                ("heads_kv", 2),
                ("head_dim", 64),
                ("page_size", 7),
                ("max_context", 150),
                ("max_q_len", 45),
            ],
        ),
    ];
    for (name, file, variant, dims) in cases {
        let kernels = temp(&format!("{name}-kernels"));
        let cache = temp(&format!("{name}-cache"));
        let spec = format!("{}/specs/{file}", env!("CARGO_MANIFEST_DIR"));
        let o = Command::new(env!("CARGO_BIN_EXE_ejc"))
            .args(["build", &spec, "-o", kernels.to_str().unwrap(), "--target", "cpu", "--dtype", "f32"])
            .args(["--head-dim", "64", "--variant", variant, "--block-n", "32", "-q"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let op = ejc_ir::ops::get(name).unwrap();
        let f =
            ejc_ir::spec::load_file(&spec).unwrap().variants.into_iter().find(|v| v.name == variant).unwrap().features;
        let dims: Sizes = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let open = || {
            let opts =
                RuntimeOptions { kernels: vec![kernels.clone()], cache_dir: Some(cache.clone()), ..Default::default() };
            Runtime::new(opts).unwrap()
        };
        let two = CallOptions { threads: 2, ..Default::default() };
        let host = op.random_call(&f, DType::F32, &dims, 21).unwrap();
        let want = op.reference(&f, &host).unwrap();
        let mut call = Call::from_host(&host);
        let r = open().call(name, &f, &mut call, &two).unwrap();
        assert_eq!(r.source, Source::Autotune, "{name}: {r:?}");
        let mut got = host.clone();
        for name in op.outputs(&f) {
            got.tensors.insert(name.into(), call.host_tensor(name).unwrap());
        }
        if name == "ragged_page_attention_v3" {
            // The cache the call updated in place, byte for byte.
            assert_eq!(got.tensors["kv_pages"].to_vec(), want["kv_pages"].to_vec(), "{name}: the cache writes");
        }
        for (out, rel, _) in compare_outputs(op, &f, &got, &want) {
            assert!(rel <= 1e-5, "{name} ({}): {out} rel_err {rel:e}", r.plan);
        }
        let r = open().call(name, &f, &mut Call::from_host(&host), &two).unwrap();
        assert_eq!(r.source, Source::Persistent, "{name}");
        if name == "page_attention" {
            let mut bad = host.clone();
            bad.tensors.get_mut("block_tables").unwrap().set(&[0, 0], 1e6);
            let e = open().call(name, &f, &mut Call::from_host(&bad), &two).unwrap_err().to_string();
            assert!(e.contains("block_tables[0, 0] = 1000000 is not a page"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&kernels);
        let _ = std::fs::remove_dir_all(&cache);
    }
}

/// Block-sparse attention's plan pairs a layout only with the attention kernel of its own
/// tiling (the plan's shared tile axes): with four tilings built, the registry offers four
/// candidates, not sixteen, and whichever the tuner keeps matches the reference.
#[test]
fn blocksparse_candidates_pair_layout_and_attention_of_one_tiling() {
    use ejc_ir::op::{compare_outputs, Sizes};
    use ejc_ir::types::DType;
    use ejc_runtime::api::{CallOptions, Runtime, RuntimeOptions};
    use ejc_runtime::call::Call;
    use ejc_runtime::registry::{Query, Registry};
    let dir = temp("blocksparse");
    std::fs::create_dir_all(&dir).unwrap();
    let spec = dir.join("bs.yaml");
    std::fs::write(
        &spec,
        "name: bs\nop: blocksparse_attention\nversion: 1\ndtypes: [f32]\nhead_dims: [64]\nvariants:\n  document:\n    \
         segment_ids: true\nschedule:\n  block_m: [16, 32]\n  block_n: [16, 32]\n  num_warps: [4]\n  num_stages: [2]\n\
         targets: [cpu]\n",
    )
    .unwrap();
    let (kernels, cache, f) = build_variant(spec.to_str().unwrap(), "blocksparse-kernels", "document", &[]);
    let mut reg = Registry::new();
    assert_eq!(reg.load_manifest(&kernels).unwrap(), 8, "4 tilings x (layout, main)");
    let fams = reg.families(&Query::new("blocksparse_attention")).unwrap();
    let cands = fams[0].candidates();
    assert_eq!(cands.len(), 4, "one candidate per tiling: {:?}", cands.iter().map(|c| c.id()).collect::<Vec<_>>());
    for c in &cands {
        let tile = |i: usize| (c.launches[i].config.get("block_m"), c.launches[i].config.get("block_n"));
        assert_eq!(tile(0), tile(1), "{}", c.id());
    }
    let op = ejc_ir::ops::get("blocksparse_attention").unwrap();
    let dims: Sizes = [("batch", 2), ("heads_q", 4), ("heads_kv", 2), ("seq_q", 93), ("seq_k", 77), ("head_dim", 64)]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
    let host = op.random_call(&f, DType::F32, &dims, 9).unwrap();
    let want = op.reference(&f, &host).unwrap();
    let opts = RuntimeOptions { kernels: vec![kernels.clone()], cache_dir: Some(cache.clone()), ..Default::default() };
    let mut call = Call::from_host(&host);
    let r = Runtime::new(opts).unwrap().call("blocksparse_attention", &f, &mut call, &CallOptions::default()).unwrap();
    let mut got = host.clone();
    for name in op.outputs(&f) {
        got.tensors.insert(name.into(), call.host_tensor(name).unwrap());
    }
    for (out, rel, _) in compare_outputs(op, &f, &got, &want) {
        assert!(rel <= 1e-5, "{} {:?}: {out} rel_err {rel:e}", r.plan, r.config);
    }
    // A call that gives its layout (built on the host for 16 x 32): only that tiling's
    // candidate takes it, its layout kernel is skipped, and the result still matches.
    let mut rt = Runtime::new(RuntimeOptions {
        kernels: vec![kernels.clone()],
        cache_dir: Some(cache.clone()),
        ..Default::default()
    })
    .unwrap();
    let (count, idx) = ejc_ir::ops::blocksparse::op::host_layout(&f, &host, 16, 32).unwrap();
    let mut given = host.clone();
    given.tensors.insert("block_count".into(), count);
    given.tensors.insert("block_idx".into(), idx);
    let mut call = Call::from_host(&given);
    let r = rt.call("blocksparse_attention", &f, &mut call, &CallOptions::default()).unwrap();
    assert_eq!((r.config.get("block_m"), r.config.get("block_n")), (Some(&16), Some(&32)), "{:?}", r.config);
    let mut got = host.clone();
    for name in op.outputs(&f) {
        got.tensors.insert(name.into(), call.host_tensor(name).unwrap());
    }
    for (out, rel, _) in compare_outputs(op, &f, &got, &want) {
        assert!(rel <= 1e-5, "given layout {:?}: {out} rel_err {rel:e}", r.config);
    }
    // A layout for a tiling no candidate has.
    let (count, idx) = ejc_ir::ops::blocksparse::op::host_layout(&f, &host, 64, 64).unwrap();
    given.tensors.insert("block_count".into(), count);
    given.tensors.insert("block_idx".into(), idx);
    let e = rt
        .call("blocksparse_attention", &f, &mut Call::from_host(&given), &CallOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no built candidate of `blocksparse_attention` takes the layout this call gives"), "{e}");
    for d in [dir, kernels, cache] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// `specs/flash_decode.yaml` through the runtime's generic call on the CPU: the tuner's
/// candidates hold both plans (one kernel; split-KV at every split count), whichever it
/// keeps matches the reference, and an explicit split-KV configuration runs two kernels
/// (partial, combine) whose result matches the reference too.
#[test]
fn decode_calls_tune_over_both_plans_and_split_kv_matches_the_reference() {
    use ejc_ir::op::{plan_marker, Config};
    use ejc_ir::types::DType;
    use ejc_runtime::api::CallOptions;
    use ejc_runtime::call::Call;
    use ejc_runtime::chain::Source;
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/flash_decode.yaml");
    let extra = ["--dtype", "bf16", "--head-dim", "64", "--config", "num_splits=2", "--config", "num_splits=8"];
    let (kernels, cache, f) = build_variant(spec, "decode", "gpt_oss", &extra);
    let manifest = std::fs::read_to_string(kernels.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"split_kv\"") && manifest.contains("_combine"), "{manifest}");
    let op = ejc_ir::ops::get("flash_attention_fwd").unwrap();
    // Decode-like: 3 query rows against 700 keys (the 128-key window and the sinks see
    // rows of every split), GQA 8:2.
    let (mut rt, host, want) = flash_case(op, &f, &kernels, &cache, [2, 3, 700, 8, 2, 64], DType::BF16);
    let check = |call: &Call, label: &str| check_outputs(op, &f, &host, &want, call, 1e-2, label);
    // The tuner: 2 one-kernel tilings + 2 tilings x 2 split counts.
    let mut call = Call::from_host(&host);
    let r = rt.call("flash_attention_fwd", &f, &mut call, &CallOptions { threads: 2, ..Default::default() }).unwrap();
    assert_eq!(r.source, Source::Autotune, "{r:?}");
    check(&call, &format!("tuned ({} {:?})", r.plan, r.config));
    // The tuning file (beside it: its lock file, and the compiled-code cache's folders).
    let file = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "json"))
        .expect("a tuning file");
    let tuned = std::fs::read_to_string(file).unwrap();
    assert!(tuned.contains("plan:split_kv") || r.plan == "single", "{tuned}");
    // Split-KV by hand: 8 splits of 700 keys, the two kernels in order.
    let config = Config::from([
        ("block_m".to_string(), 64),
        ("block_n".to_string(), 64),
        ("num_splits".to_string(), 8),
        (plan_marker("split_kv"), 1),
    ]);
    let mut call = Call::from_host(&host);
    let opts = CallOptions { config: Some(config), threads: 2, ..Default::default() };
    let r = rt.call("flash_attention_fwd", &f, &mut call, &opts).unwrap();
    assert_eq!((r.plan.as_str(), r.kernels.len()), ("split_kv", 2), "{r:?}");
    assert!(r.kernels[0].ends_with("_split") && r.kernels[1].ends_with("_combine"), "{r:?}");
    check(&call, "split_kv num_splits=8");
    let _ = std::fs::remove_dir_all(&kernels);
    let _ = std::fs::remove_dir_all(&cache);
}

/// dbias through the generic call on the CPU (`bias_grad`: causal, a run-time window and
/// a bias): both plans write every element of it (the blocks the band skips too: the
/// call's `dbias` starts as NaN) and match the f64 reference; a call that asks for the
/// gradient without giving a `dbias` tensor is refused with the argument named.
#[test]
fn backward_returns_dbias_on_both_plans_and_names_a_missing_dbias() {
    use ejc_ir::op::{plan_marker, Config};
    use ejc_ir::types::DType;
    use ejc_runtime::api::CallOptions;
    use ejc_runtime::call::Call;
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/flash_bwd.yaml");
    let (kernels, cache, f) = build_variant(spec, "dbias", "local_bias_grad", &["--dtype", "f32", "--head-dim", "64"]);
    let op = ejc_ir::ops::get("flash_attention_bwd").unwrap();
    assert_eq!(op.outputs(&f), ["dq", "dk", "dv", "dbias"]);
    let (mut rt, host, want) = flash_case(op, &f, &kernels, &cache, [2, 150, 97, 4, 2, 64], DType::F32);
    // The test's window (a third of seq_k to the left, causal): most of dbias is outside the band.
    let zeros = want["dbias"].to_vec().iter().filter(|x| **x == 0.0).count();
    assert!(zeros > want["dbias"].numel() / 2, "{zeros} zeros");
    // What the call asks for: the variant's features with its window's values.
    let wanted = op.wanted(&f, &host);
    for plan in ["two_pass", "atomic"] {
        let (first, rest): (&str, &[&str]) = if plan == "two_pass" {
            ("block_m", &["dkdv.block_m", "dkdv.block_n", "dq.block_m", "dq.block_n"])
        } else {
            ("block_m", &["dkdv_dq.block_m", "dkdv_dq.block_n", "dq_convert.block_m"])
        };
        // The CPU's tiling (specs/flash_bwd.yaml's override): 32 query rows, 128 keys.
        let config: Config = std::iter::once(first)
            .chain(rest.iter().copied())
            .map(|k| (k.to_string(), if k.ends_with("block_n") { 128 } else { 32 }))
            // The first plan's configurations carry no marker.
            .chain((plan != "two_pass").then(|| (plan_marker(plan), 1)))
            .collect();
        let mut call = Call::from_host(&host);
        let opts = CallOptions { config: Some(config), threads: 2, ..Default::default() };
        let r = rt.call("flash_attention_bwd", &wanted, &mut call, &opts).unwrap();
        assert_eq!(r.plan, plan, "{r:?}");
        let dbias = call.host_tensor("dbias").unwrap();
        assert!(dbias.to_vec().iter().all(|x| x.is_finite()), "{plan}: dbias left unwritten");
        check_outputs(op, &f, &host, &want, &call, 1e-5, plan);
    }
    let mut without = host.clone();
    without.tensors.remove("dbias");
    let mut call = Call::from_host(&without);
    let e = rt.call("flash_attention_bwd", &wanted, &mut call, &CallOptions::default()).unwrap_err().to_string();
    assert!(e.contains("`dbias`"), "{e}");
    let _ = std::fs::remove_dir_all(&kernels);
    let _ = std::fs::remove_dir_all(&cache);
}

/// The flash backward through the generic call on the CPU: the tuner times both plans
/// (two_pass, and atomic with dQ by atomic adds) and either result matches the f64
/// reference; a call that asks to be `deterministic` gets two_pass only, under a cache
/// key of its own, and an explicit atomic configuration is then refused.
#[test]
fn backward_calls_tune_over_both_plans_and_deterministic_calls_get_two_pass() {
    use ejc_ir::op::{plan_marker, Config};
    use ejc_ir::types::DType;
    use ejc_runtime::api::CallOptions;
    use ejc_runtime::call::Call;
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/flash_bwd.yaml");
    let (kernels, cache, f) = build_variant(spec, "bwd", "gpt_oss", &["--dtype", "f32", "--head-dim", "64"]);
    let manifest = std::fs::read_to_string(kernels.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"two_pass\"") && manifest.contains("\"atomic\""), "{manifest}");
    let op = ejc_ir::ops::get("flash_attention_bwd").unwrap();
    let (mut rt, host, want) = flash_case(op, &f, &kernels, &cache, [2, 90, 150, 4, 2, 64], DType::F32);
    let check = |call: &Call, label: &str| check_outputs(op, &f, &host, &want, call, 1e-5, label);
    let mut call = Call::from_host(&host);
    let tuned =
        rt.call("flash_attention_bwd", &f, &mut call, &CallOptions { threads: 2, ..Default::default() }).unwrap();
    check(&call, &format!("tuned ({})", tuned.plan));
    let det = CallOptions { threads: 2, deterministic: true, ..Default::default() };
    for _ in 0..2 {
        let mut call = Call::from_host(&host);
        let r = rt.call("flash_attention_bwd", &f, &mut call, &det).unwrap();
        assert_eq!(r.plan, "two_pass", "{r:?}");
        assert_ne!(r.key, tuned.key, "a deterministic call is cached apart");
        check(&call, "deterministic");
    }
    // The atomic plan by hand: right, and refused to a deterministic call.
    // Every role's tiling is part of a configuration (the first role's unprefixed).
    // The CPU's tiling (32 x 128; the dsinks role keeps its own 64 rows).
    let atomic: Config = [
        ("block_m", 32),
        ("dkdv_dq.block_m", 32),
        ("dkdv_dq.block_n", 128),
        ("dq_convert.block_m", 32),
        ("dsinks.block_m", 64),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .chain([(plan_marker("atomic"), 1)])
    .collect();
    let mut call = Call::from_host(&host);
    let opts = CallOptions { config: Some(atomic.clone()), threads: 2, ..Default::default() };
    let r = rt.call("flash_attention_bwd", &f, &mut call, &opts).unwrap();
    assert_eq!(r.plan, "atomic", "{r:?}");
    assert!(r.kernels.iter().any(|k| k.contains("_dkdv_dq_")) && r.kernels.len() == 4, "{r:?}");
    check(&call, "atomic");
    let mut call = Call::from_host(&host);
    let opts = CallOptions { config: Some(atomic), threads: 2, deterministic: true, ..Default::default() };
    let e = rt.call("flash_attention_bwd", &f, &mut call, &opts).unwrap_err().to_string();
    assert!(e.contains("not one of the built configurations"), "{e}");
    let _ = std::fs::remove_dir_all(&kernels);
    let _ = std::fs::remove_dir_all(&cache);
}
