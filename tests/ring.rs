//! Ring attention simulated on the CPU: N ranks as threads of this process, each with
//! its own runtime over the ring specs' CPU kernels, keys and values passed around the
//! ring. Every case is checked against the single-device f64 reference of the whole
//! sequence (forward: out and lse; backward: dq, dk, dv, dsinks), on fresh random
//! inputs (the seed is printed).

use std::path::PathBuf;
use std::process::Command;

use ejc_ir::flash::ring::RingLayout;
use ejc_ir::flash::{Features, SoftCap, Window};
use ejc_ir::op::HostCall;
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;
use ejc_runtime::api::RuntimeOptions;
use ejc_runtime::cpu::HostBuffer;
use ejc_runtime::ring::{simulate_with, RingInputs, RingOptions};

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ejc-ring-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The ring specs' kernels for the CPU (f32, head_dim 64), built once per process.
fn kernels() -> (PathBuf, PathBuf) {
    static DIRS: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();
    DIRS.get_or_init(|| {
        let dirs = (temp("fwd"), temp("bwd"));
        for (spec, dir) in [("specs/ring.yaml", &dirs.0), ("specs/ring_bwd.yaml", &dirs.1)] {
            let spec = format!("{}/{spec}", env!("CARGO_MANIFEST_DIR"));
            let o = Command::new(env!("CARGO_BIN_EXE_ejc"))
                .args(["build", &spec, "-o", dir.to_str().unwrap(), "--target", "cpu"])
                .args(["--dtype", "f32", "--head-dim", "64", "-q"])
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        }
        dirs
    })
    .clone()
}

struct Case {
    n: usize,
    layout: RingLayout,
    local: usize,
    causal: bool,
    window: Option<(i64, i64)>,
    softcap: Option<f64>,
    sinks: bool,
    segments: bool,
    backward: bool,
}

fn run(c: &Case) {
    let fwd = ejc_ir::ops::get("flash_attention_fwd").unwrap();
    let bwd = ejc_ir::ops::get("flash_attention_bwd").unwrap();
    let f = Features {
        causal: c.causal,
        sliding_window: c.window.map(|_| Window::Runtime),
        logits_soft_cap: c.softcap.map(|_| SoftCap::Runtime),
        sinks: c.sinks,
        segment_ids: c.segments,
        ..Default::default()
    };
    let fj = f.to_json();
    let s = (c.n * c.local) as i64;
    let dims = [("batch", 2), ("seq_q", s), ("seq_k", s), ("heads_q", 4), ("heads_kv", 2), ("head_dim", 64)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let label = format!(
        "n={} {:?} L={} causal={} window={:?} softcap={:?} sinks={} segments={} (seed {seed})",
        c.n, c.layout, c.local, c.causal, c.window, c.softcap, c.sinks, c.segments
    );
    println!("{label}");
    let mut host: HostCall = bwd.random_call(&fj, DType::F32, &dims, seed).unwrap();
    // One sequence: the keys' segment ids are the queries'.
    if c.segments {
        let ids = host.tensors["q_segment_ids"].clone();
        host.tensors.insert("kv_segment_ids".into(), ids);
    }
    if let Some((l, r)) = c.window {
        host.scalars.insert("window_left".into(), l as f64);
        host.scalars.insert("window_right".into(), r as f64);
    }
    if let Some(cap) = c.softcap {
        host.scalars.insert("logits_soft_cap".into(), cap);
    }
    let want_f = fwd.reference(&fj, &host).unwrap();
    // The backward's reference from the forward's out and lse as kernels store them.
    host.tensors.insert("out".into(), want_f["out"].clone());
    host.tensors.insert("lse".into(), want_f["lse"].clone());
    let want_b = bwd.reference(&fj, &host).unwrap();

    let buf = |n: &str| HostBuffer::from_host(&host.tensors[n]);
    let (q, k, v) = (buf("q"), buf("k"), buf("v"));
    let (qs, ks) = (c.segments.then(|| buf("q_segment_ids")), c.segments.then(|| buf("kv_segment_ids")));
    let sinks = c.sinks.then(|| buf("sinks"));
    let dout = buf("dout");
    let inputs = RingInputs {
        q: &q,
        k: &k,
        v: &v,
        q_segment_ids: qs.as_ref(),
        kv_segment_ids: ks.as_ref(),
        sinks: sinks.as_ref(),
    };
    let opts = RingOptions {
        layout: c.layout,
        causal: c.causal,
        window: c.window,
        logits_soft_cap: c.softcap,
        softmax_scale: host.scalars.get("softmax_scale").copied(),
        deterministic: false,
        threads: 1,
        ..Default::default()
    };
    let (fk, bk) = kernels();
    let cache = temp(&format!("cache-{seed}"));
    let rto = RuntimeOptions { kernels: vec![fk, bk], cache_dir: Some(cache.clone()), ..Default::default() };
    let r = simulate_with(c.n, &inputs, &opts, c.backward.then_some(&dout), &rto).unwrap();
    println!("  launches per rank (forward, backward): {:?}", r.launches);

    let mut got = host.clone();
    got.tensors.insert("out".into(), r.out.to_host());
    got.tensors.insert("lse".into(), r.lse.to_host());
    for (name, rel, _) in ejc_ir::op::compare_outputs(fwd, &fj, &got, &want_f) {
        println!("  {name}: rel {rel:e}");
        assert!(rel <= 1e-5, "{label}: {name} rel_err {rel:e}");
    }
    if c.backward {
        let (dq, dk, dv, dsinks) = r.grads.unwrap();
        for (n, t) in [("dq", dq), ("dk", dk), ("dv", dv)] {
            got.tensors.insert(n.into(), t.to_host());
        }
        if let Some(t) = dsinks {
            got.tensors.insert("dsinks".into(), t.to_host());
        }
        for (name, rel, abs) in ejc_ir::op::compare_outputs(bwd, &fj, &got, &want_b) {
            println!("  {name}: rel {rel:e}");
            // dQ of rows that see one key is exactly 0: judged by the absolute error.
            assert!(rel <= 1e-4 || (rel.is_infinite() && abs <= 1e-5), "{label}: {name} rel_err {rel:e}");
        }
    }
    let _ = std::fs::remove_dir_all(&cache);
}

/// Zig-zag over four ranks, causal, GQA 4:2, soft cap, sinks: forward and backward.
#[test]
fn zigzag_causal_softcap_sinks_over_four_ranks() {
    run(&Case {
        n: 4,
        layout: RingLayout::ZigZag,
        local: 14,
        causal: true,
        window: None,
        softcap: Some(8.0),
        sinks: true,
        segments: false,
        backward: true,
    });
}

/// Contiguous over three ranks, a two-sided window that reaches across ranks, segment
/// ids (padding rows see nothing: zero output, −∞ LSE, zero gradients).
#[test]
fn contiguous_window_segments_over_three_ranks() {
    run(&Case {
        n: 3,
        layout: RingLayout::Contiguous,
        local: 13,
        causal: false,
        window: Some((17, 5)),
        softcap: None,
        sinks: false,
        segments: true,
        backward: true,
    });
}

/// A causal sliding window over zig-zag ranks: most blocks are skipped or banded off
/// the diagonal (negative band sides).
#[test]
fn zigzag_causal_window_over_two_and_three_ranks() {
    for n in [2, 3] {
        run(&Case {
            n,
            layout: RingLayout::ZigZag,
            local: 18,
            causal: true,
            window: Some((11, 0)),
            softcap: None,
            sinks: true,
            segments: false,
            backward: true,
        });
    }
}

/// One rank is plain flash attention; non-causal contiguous over four.
#[test]
fn one_rank_and_noncausal_rings() {
    for (n, layout) in [(1, RingLayout::Contiguous), (4, RingLayout::Contiguous), (2, RingLayout::ZigZag)] {
        run(&Case {
            n,
            layout,
            local: 10,
            causal: false,
            window: None,
            softcap: None,
            sinks: false,
            segments: false,
            backward: true,
        });
    }
}

/// Bad rings are refused with the reason, before any kernel runs.
#[test]
fn bad_rings_are_refused() {
    let x = HostBuffer::from_host(&HostTensor::full(DType::F32, &[1, 14, 2, 64], 0.5));
    let i = RingInputs::new(&x, &x, &x);
    let rto = RuntimeOptions { kernels: vec![kernels().0], cache_dir: Some(temp("bad-cache")), ..Default::default() };
    let e = simulate_with(4, &i, &RingOptions::default(), None, &rto).err().unwrap().to_string();
    assert!(e.contains("does not split over 4 ranks"), "{e}");
    let e = simulate_with(2, &i, &RingOptions::default(), None, &rto).err().unwrap().to_string();
    assert!(e.contains("odd"), "{e}");
    let o = RingOptions { window: Some((-1, 0)), layout: RingLayout::Contiguous, ..Default::default() };
    let e = simulate_with(2, &i, &o, None, &rto).err().unwrap().to_string();
    assert!(e.contains("both sides must be >= 0"), "{e}");
}
