//! Every tier of the configuration chain, the ejkernel bugs it fixes, and cache-key
//! invalidation. A fake operation stands in for a kernel: its "tuning" is counted, so
//! the tests see exactly when the chain measures.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ejc_runtime::cache::{PersistentCache, Timing};
use ejc_runtime::chain::{push_overlay, Chain, ChainError, Event, Policy, Source, Tunable, TuneReport};
use ejc_runtime::key::CacheKey;
use ejc_runtime::registry::Config;

fn cfg(m: u32, n: u32) -> Config {
    Config::from([("block_m".to_string(), m), ("block_n".to_string(), n)])
}

/// A fake operation: candidates with made-up times; `m128_n128` is "wrong".
struct Fake {
    tunes: Cell<usize>,
    heuristic: Option<Config>,
    all_fail: bool,
}

impl Fake {
    fn new() -> Fake {
        Fake { tunes: Cell::new(0), heuristic: Some(cfg(64, 64)), all_fail: false }
    }
}

impl Tunable for Fake {
    fn candidates(&self) -> Vec<Config> {
        vec![cfg(64, 32), cfg(64, 64), cfg(128, 64), cfg(128, 128)]
    }
    fn heuristic(&self) -> Option<Config> {
        self.heuristic.clone()
    }
    fn autotune(&self, candidates: &[Config]) -> TuneReport {
        self.tunes.set(self.tunes.get() + 1);
        let mut timings = Vec::new();
        let mut best = None;
        for c in candidates {
            let id = ejc_runtime::registry::config_id(c);
            if self.all_fail || id == "m128_n128" {
                timings.push(Timing { config_id: id, median_ms: None, status: "wrong result: rel_err=1".into() });
                continue;
            }
            let ms = if id == "m128_n64" { 1.0 } else { 2.0 };
            if best.as_ref().is_none_or(|(b, _)| ms < *b) {
                best = Some((ms, c.clone()));
            }
            timings.push(Timing { config_id: id, median_ms: Some(ms), status: "ok".into() });
        }
        TuneReport { timings, winner: best.map(|(_, c)| c) }
    }
    fn describe(&self) -> String {
        "fake call".into()
    }
}

fn key(call: &str) -> CacheKey {
    CacheKey {
        device: "cpu|test".into(),
        op: "fake@1".into(),
        call: call.into(),
        candidates: "c1".into(),
        compiler: "0.1.0".into(),
    }
}

fn temp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ejc-chain-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A chain whose events are recorded.
fn chain(policy: Policy, dir: &std::path::Path) -> (Chain, Arc<Mutex<Vec<String>>>) {
    let mut c = Chain::new(policy, Some(PersistentCache::open(dir, "test-machine")));
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = log.clone();
    c.observe(Box::new(move |e: &Event| l.lock().unwrap().push(e.to_string())));
    (c, log)
}

#[test]
fn autotune_then_memory_then_persistent_in_a_new_chain() {
    let dir = temp("tiers");
    let (mut c, log) = chain(Policy::default(), &dir);
    let t = Fake::new();
    let first = c.choose(&key("a"), None, &t).unwrap();
    assert_eq!((first.source, first.config.clone()), (Source::Autotune, cfg(128, 64)));
    assert_eq!(t.tunes.get(), 1);
    let second = c.choose(&key("a"), None, &t).unwrap();
    assert_eq!(second.source, Source::Memory);
    assert_eq!(t.tunes.get(), 1, "a memory hit does not tune");
    let events = log.lock().unwrap().join("\n");
    assert!(events.contains("autotuning 4 candidates") && events.contains("from the memory cache"), "{events}");
    // Another process: a fresh chain over the same directory.
    let (mut c2, log2) = chain(Policy::default(), &dir);
    let t2 = Fake::new();
    let third = c2.choose(&key("a"), None, &t2).unwrap();
    assert_eq!((third.source, third.config), (Source::Persistent, cfg(128, 64)));
    assert_eq!(t2.tunes.get(), 0);
    assert!(log2.lock().unwrap().join("\n").contains("from the persistent cache"));
    // The stored entry explains the choice: every candidate's outcome is kept.
    let entry = c2.persistent().unwrap().get(&key("a").to_string()).unwrap().clone();
    assert_eq!(entry.timings.len(), 4);
    assert!(entry.timings.iter().any(|t| t.status.starts_with("wrong result")));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn override_wins_and_is_never_stored() {
    let dir = temp("override");
    // Even with heuristics as the only fallback (ejkernel's fast path ignored cfg= there).
    let (mut c, _) = chain(Policy { allow_autotune: false, ..Policy::default() }, &dir);
    let t = Fake::new();
    let o = c.choose(&key("b"), Some(&cfg(64, 32)), &t).unwrap();
    assert_eq!((o.source, o.config), (Source::Override, cfg(64, 32)));
    assert!(c.persistent().unwrap().get(&key("b").to_string()).is_none(), "an override is not persisted");
    // And not remembered: the next call without one goes down the chain.
    let next = c.choose(&key("b"), None, &t).unwrap();
    assert_eq!(next.source, Source::Heuristic);
    let (c2, _) = chain(Policy::default(), &dir);
    assert!(c2.persistent().unwrap().get(&key("b").to_string()).is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn overlays_nest_and_the_newest_wins() {
    let dir = temp("overlay");
    let (mut c, _) = chain(Policy::default(), &dir);
    let t = Fake::new();
    let k = key("c").to_string();
    {
        let _outer = push_overlay(HashMap::from([(k.clone(), cfg(64, 32))]));
        assert_eq!(c.choose(&key("c"), None, &t).unwrap().config, cfg(64, 32));
        {
            let _inner = push_overlay(HashMap::from([(k.clone(), cfg(128, 128))]));
            let x = c.choose(&key("c"), None, &t).unwrap();
            assert_eq!((x.source, x.config), (Source::Overlay, cfg(128, 128)));
        }
        assert_eq!(c.choose(&key("c"), None, &t).unwrap().config, cfg(64, 32));
    }
    // Out of scope: the chain tunes.
    assert_eq!(c.choose(&key("c"), None, &t).unwrap().source, Source::Autotune);
    assert_eq!(t.tunes.get(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn heuristics_never_shadow_a_later_autotune() {
    let dir = temp("heuristic");
    let t = Fake::new();
    let (mut c, _) = chain(Policy { allow_autotune: false, ..Policy::default() }, &dir);
    let h = c.choose(&key("d"), None, &t).unwrap();
    assert_eq!((h.source, h.config), (Source::Heuristic, cfg(64, 64)));
    assert!(c.persistent().unwrap().get(&key("d").to_string()).is_none(), "a heuristic pick is not persisted");
    // Same chain, autotuning now allowed: the remembered heuristic does not stop it.
    c.policy.allow_autotune = true;
    let a = c.choose(&key("d"), None, &t).unwrap();
    assert_eq!((a.source, a.config), (Source::Autotune, cfg(128, 64)));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn retuning_a_key_is_refused_unless_allowed() {
    let dir = temp("retune");
    let t = Fake::new();
    let (mut c, _) = chain(Policy { persist_autotune: false, ..Policy::default() }, &dir);
    c.choose(&key("e"), None, &t).unwrap();
    // Forget the result (as if memory were cleared), keep the "tuned" record.
    let mut c2 = Chain::new(Policy { persist_autotune: false, ..Policy::default() }, None);
    c2.choose(&key("e"), None, &t).unwrap();
    assert_eq!(t.tunes.get(), 2, "a new chain (process) may tune");
    // In one chain, a key whose result is gone (all candidates failed) is not tuned twice.
    let failing = Fake { all_fail: true, heuristic: None, tunes: Cell::new(0) };
    let mut c3 = Chain::new(Policy::default(), None);
    assert!(matches!(c3.choose(&key("f"), None, &failing), Err(ChainError::NoConfig { .. })));
    assert!(matches!(c3.choose(&key("f"), None, &failing), Err(ChainError::Retune { .. })));
    c3.policy.allow_retune = true;
    assert!(matches!(c3.choose(&key("f"), None, &failing), Err(ChainError::NoConfig { .. })));
    assert_eq!(failing.tunes.get(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn failing_candidates_fall_back_to_heuristics_and_nothing_is_an_error() {
    let t = Fake { all_fail: true, heuristic: Some(cfg(64, 64)), tunes: Cell::new(0) };
    let mut c = Chain::new(Policy::default(), None);
    let x = c.choose(&key("g"), None, &t).unwrap();
    assert_eq!(x.source, Source::Heuristic);
    let none = Fake { all_fail: true, heuristic: None, tunes: Cell::new(0) };
    let mut c = Chain::new(Policy { allow_autotune: false, allow_heuristics: false, ..Policy::default() }, None);
    let e = c.choose(&key("h"), None, &none).unwrap_err().to_string();
    assert!(e.contains("disabled"), "{e}");
}

#[test]
fn a_new_candidate_set_or_compiler_misses_old_entries() {
    let dir = temp("invalidate");
    let t = Fake::new();
    let (mut c, _) = chain(Policy::default(), &dir);
    c.choose(&key("i"), None, &t).unwrap();
    let (mut fresh, _) = chain(Policy::default(), &dir);
    assert_eq!(fresh.choose(&key("i"), None, &t).unwrap().source, Source::Persistent);
    let new_candidates = CacheKey { candidates: "c2".into(), ..key("i") };
    assert_eq!(fresh.choose(&new_candidates, None, &t).unwrap().source, Source::Autotune);
    let new_compiler = CacheKey { compiler: "0.2.0".into(), ..key("i") };
    assert_eq!(fresh.choose(&new_compiler, None, &t).unwrap().source, Source::Autotune);
    assert_eq!(t.tunes.get(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_real_key_changes_with_candidates_and_compiler_but_not_with_values() {
    use ejc_ir::flash::CallFeatures;
    use ejc_ir::op::Sizes;
    use ejc_ir::types::DType;
    use ejc_runtime::key::call_key;
    let op = ejc_ir::ops::get("flash_attention_fwd").unwrap();
    let sizes = |sq: i64, sk: i64| {
        Sizes::from(
            [("batch", 1), ("seq_q", sq), ("seq_k", sk), ("heads_q", 8), ("heads_kv", 8), ("head_dim", 64)]
                .map(|(k, v)| (k.to_string(), v)),
        )
    };
    let ids = vec!["m64_n64".to_string(), "m128_n64".into()];
    let call = CallFeatures { causal: true, ..Default::default() }.to_json();
    let k = |ids: &[String], compiler: &str, s: &Sizes| call_key("cpu|x", op, 1, compiler, &call, DType::BF16, s, ids);
    let base = k(&ids, "0.1.0", &sizes(1000, 1000));
    assert_ne!(base, k(&ids[..1], "0.1.0", &sizes(1000, 1000)));
    assert_ne!(base, k(&ids, "0.1.1", &sizes(1000, 1000)));
    // Sequence lengths are bucketed to powers of two: 1000 and 1024 share a key.
    assert_eq!(base, k(&ids, "0.1.0", &sizes(1024, 1024)));
    assert_ne!(base, k(&ids, "0.1.0", &sizes(1025, 1000)));
    // A window's values are part of what a call asks for.
    let w = CallFeatures { causal: true, window: Some((8, 0)), ..Default::default() }.to_json();
    assert_ne!(base, call_key("cpu|x", op, 1, "0.1.0", &w, DType::BF16, &sizes(1000, 1000), &ids));
}

/// A cache entry whose configuration is not one of the call's candidates (edited by hand,
/// or written for another build under the same key) is not reported as the winner: a
/// warning, the entry ignored, the call tuned again, and the entry replaced.
#[test]
fn a_cached_winner_that_is_not_a_candidate_is_ignored_and_retuned() {
    let dir = temp("not-a-candidate");
    let (mut c, _) = chain(Policy::default(), &dir);
    c.choose(&key("e"), None, &Fake::new()).unwrap();
    // Edit the file: block_m 96 was never built.
    let path = c.persistent().unwrap().path().to_path_buf();
    let text = std::fs::read_to_string(&path).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["entries"][key("e").to_string()]["config"]["block_m"] = 96.into();
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();

    let (mut c2, log) = chain(Policy::default(), &dir);
    assert_eq!(c2.persistent().unwrap().get(&key("e").to_string()).unwrap().config, cfg(96, 64));
    let t = Fake::new();
    let choice = c2.choose(&key("e"), None, &t).unwrap();
    assert_eq!((choice.source, choice.config), (Source::Autotune, cfg(128, 64)));
    assert_eq!(t.tunes.get(), 1, "tuned again");
    let events = log.lock().unwrap().join("\n");
    assert!(events.contains("warning") && events.contains("m96_n64") && events.contains("not one of"), "{events}");
    let (c3, _) = chain(Policy::default(), &dir);
    assert_eq!(c3.persistent().unwrap().get(&key("e").to_string()).unwrap().config, cfg(128, 64), "replaced");
    let _ = std::fs::remove_dir_all(&dir);
}
