//! The configuration chain: how a call's configuration is chosen.
//!
//! ```text
//! override → overlay (scoped) → memory cache → persistent cache → autotune → heuristics → error
//! ```
//!
//! ```no_run
//! use ejc_runtime::chain::{Chain, Event, Policy};
//! # fn demo(key: &ejc_runtime::key::CacheKey, tunable: &dyn ejc_runtime::chain::Tunable) {
//! let mut chain = Chain::new(Policy::default(), None);
//! chain.observe(Box::new(|e: &Event| eprintln!("{e}")));
//! let choice = chain.choose(key, None, tunable).unwrap();
//! println!("{:?} from {}", choice.config, choice.source);
//! # }
//! ```
//!
//! This is ejkernel's `ConfigSelectorChain` with its known bugs fixed:
//!
//! * an explicit configuration always wins — also when heuristics are the policy's
//!   fallback (ejkernel's fast path ignored it) — and it is **never** written to any
//!   cache (ejkernel persisted it, pinning that shape for every later call);
//! * a heuristic pick is kept in memory only and is ignored once autotuning is allowed,
//!   so it never shadows a later autotune (ejkernel persisted it too);
//! * re-tuning a key this process already tuned is refused unless the policy allows it;
//! * autotuning never runs on zero-filled inputs (the [`Tunable`] makes fresh random
//!   ones) and a candidate that fails counts as infinitely slow instead of aborting.
//!
//! Overlays are scoped and nestable per thread ([`push_overlay`]); the newest wins.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::cache::{CacheEntry, PersistentCache, Timing};
use crate::key::CacheKey;
use crate::registry::{config_id, Config};

/// Where a configuration came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Override,
    Overlay,
    Memory,
    Persistent,
    Autotune,
    Heuristic,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Override => "override",
            Source::Overlay => "overlay",
            Source::Memory => "memory cache",
            Source::Persistent => "persistent cache",
            Source::Autotune => "autotune",
            Source::Heuristic => "heuristics",
        })
    }
}

/// What the chain reports while it works.
#[derive(Clone, Debug)]
pub enum Event {
    /// A configuration was chosen at a tier.
    Chosen {
        source: Source,
        key: String,
        config: String,
    },
    AutotuneStart {
        key: String,
        candidates: usize,
    },
    AutotuneFinish {
        key: String,
        winner: Option<String>,
        timings: Vec<Timing>,
    },
    Warning(String),
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Chosen { source, key, config } => write!(f, "ejc: {config} from the {source} ({key})"),
            Event::AutotuneStart { key, candidates } => write!(f, "ejc: autotuning {candidates} candidates ({key})"),
            Event::AutotuneFinish { winner, timings, .. } => {
                let ok = timings.iter().filter(|t| t.median_ms.is_some()).count();
                write!(
                    f,
                    "ejc: autotune finished: {} ({ok} of {} candidates timed)",
                    winner.as_deref().unwrap_or("no winner"),
                    timings.len()
                )
            }
            Event::Warning(w) => write!(f, "ejc: warning: {w}"),
        }
    }
}

/// The chain's choices of behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub allow_autotune: bool,
    pub allow_heuristics: bool,
    /// Write autotune results to the persistent cache.
    pub persist_autotune: bool,
    /// Allow tuning a key again that this process already tuned.
    pub allow_retune: bool,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy { allow_autotune: true, allow_heuristics: true, persist_autotune: true, allow_retune: false }
    }
}

/// The outcome of tuning one key.
#[derive(Clone, Debug, Default)]
pub struct TuneReport {
    pub timings: Vec<Timing>,
    pub winner: Option<Config>,
}

/// What the chain needs from an operation's call.
pub trait Tunable {
    /// The candidate configurations (the spec's schedule space as built).
    fn candidates(&self) -> Vec<Config>;
    /// A configuration to use without measuring, if the operation has a rule for it.
    fn heuristic(&self) -> Option<Config>;
    /// Check every candidate against the reference on a small case, time the rest on
    /// fresh random inputs, and report every outcome.
    fn autotune(&self, candidates: &[Config]) -> TuneReport;
    /// A human-readable description of the call (stored with the cache entry).
    fn describe(&self) -> String;
}

#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("{key} was already tuned in this process; tuning it again needs Policy::allow_retune")]
    Retune { key: String },
    #[error("no configuration for {key}: {why}")]
    NoConfig { key: String, why: String },
}

/// A chosen configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub config: Config,
    pub source: Source,
}

thread_local! {
    static OVERLAYS: RefCell<Vec<HashMap<String, Config>>> = const { RefCell::new(Vec::new()) };
}

/// An overlay in force until the guard drops. Overlays nest; the newest wins.
pub struct OverlayGuard {
    depth: usize,
}

impl Drop for OverlayGuard {
    fn drop(&mut self) {
        OVERLAYS.with(|o| o.borrow_mut().truncate(self.depth));
    }
}

/// Make `map` (cache key → configuration) the newest overlay on this thread.
#[must_use = "the overlay ends when the guard drops"]
pub fn push_overlay(map: HashMap<String, Config>) -> OverlayGuard {
    OVERLAYS.with(|o| {
        let mut o = o.borrow_mut();
        let depth = o.len();
        o.push(map);
        OverlayGuard { depth }
    })
}

fn overlay_lookup(key: &str) -> Option<Config> {
    OVERLAYS.with(|o| o.borrow().iter().rev().find_map(|m| m.get(key).cloned()))
}

/// Receives the chain's events.
pub type Observer = Box<dyn FnMut(&Event) + Send>;

pub struct Chain {
    memory: HashMap<String, (Config, Source)>,
    persistent: Option<PersistentCache>,
    tuned: HashSet<String>,
    pub policy: Policy,
    observer: Option<Observer>,
}

impl Chain {
    /// A chain with an optional persistent cache.
    pub fn new(policy: Policy, persistent: Option<PersistentCache>) -> Chain {
        Chain { memory: HashMap::new(), persistent, tuned: HashSet::new(), policy, observer: None }
    }

    /// Report every event to `f` (replaces a previous observer).
    pub fn observe(&mut self, f: Observer) {
        self.observer = Some(f);
    }

    pub fn persistent(&self) -> Option<&PersistentCache> {
        self.persistent.as_ref()
    }

    pub fn persistent_mut(&mut self) -> Option<&mut PersistentCache> {
        self.persistent.as_mut()
    }

    fn emit(&mut self, e: Event) {
        if let Some(f) = self.observer.as_mut() {
            f(&e);
        }
    }

    fn chosen(&mut self, source: Source, key: &str, config: Config) -> Choice {
        self.emit(Event::Chosen { source, key: key.to_string(), config: config_id(&config) });
        Choice { config, source }
    }

    /// Choose a configuration for `key`.
    pub fn choose(
        &mut self,
        key: &CacheKey,
        override_config: Option<&Config>,
        t: &dyn Tunable,
    ) -> Result<Choice, ChainError> {
        let k = key.to_string();
        // 1. An explicit configuration wins, and is stored nowhere.
        if let Some(c) = override_config {
            return Ok(self.chosen(Source::Override, &k, c.clone()));
        }
        // 2. Overlays, newest first.
        if let Some(c) = overlay_lookup(&k) {
            return Ok(self.chosen(Source::Overlay, &k, c));
        }
        // 3. Memory. A heuristic pick only counts when autotuning may not run.
        if let Some((c, src)) = self.memory.get(&k).cloned() {
            if src != Source::Heuristic || !self.policy.allow_autotune {
                return Ok(self.chosen(Source::Memory, &k, c));
            }
        }
        // 4. The persistent cache (then remembered in memory) — if what it holds is one of
        // the candidates: a file is only data (edited by hand, written by a damaged process),
        // and a configuration that was never built must not be reported as the winner.
        if let Some(entry) = self.persistent.as_ref().and_then(|p| p.get(&k)).cloned() {
            if t.candidates().contains(&entry.config) {
                self.memory.insert(k.clone(), (entry.config.clone(), Source::Persistent));
                return Ok(self.chosen(Source::Persistent, &k, entry.config));
            }
            let path = self.persistent.as_ref().map(|p| p.path().display().to_string()).unwrap_or_default();
            self.emit(Event::Warning(format!(
                "the tuning cache {path} holds {} for {k}, which is not one of this call's candidates; the entry is \
                 ignored (tuning again replaces it)",
                config_id(&entry.config)
            )));
        }
        // 5. Autotune.
        if self.policy.allow_autotune {
            if self.tuned.contains(&k) && !self.policy.allow_retune {
                return Err(ChainError::Retune { key: k });
            }
            let candidates = t.candidates();
            self.emit(Event::AutotuneStart { key: k.clone(), candidates: candidates.len() });
            let report = t.autotune(&candidates);
            self.tuned.insert(k.clone());
            self.emit(Event::AutotuneFinish {
                key: k.clone(),
                winner: report.winner.as_ref().map(config_id),
                timings: report.timings.clone(),
            });
            if let Some(w) = report.winner.clone() {
                self.memory.insert(k.clone(), (w.clone(), Source::Autotune));
                if self.policy.persist_autotune {
                    let entry = CacheEntry {
                        config: w.clone(),
                        timings: report.timings.clone(),
                        call: t.describe(),
                        device: key.device.clone(),
                        op: key.op.clone(),
                        call_hash: key.call.clone(),
                        candidates: key.candidates.clone(),
                        compiler: key.compiler.clone(),
                        created: std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map(|d| d.as_secs())
                            .unwrap_or(0),
                    };
                    if let Some(p) = self.persistent.as_mut() {
                        // The put's own warnings (damage found under the lock, entries set
                        // aside), then its failure, if it failed.
                        let seen = p.warnings().len();
                        let result = p.put(&k, entry);
                        let mut warnings = p.warnings()[seen..].to_vec();
                        if let Err(w) = result {
                            if !warnings.contains(&w) {
                                warnings.push(w);
                            }
                        }
                        for w in warnings {
                            self.emit(Event::Warning(w));
                        }
                    }
                }
                return Ok(self.chosen(Source::Autotune, &k, w));
            }
            // Why, candidate by candidate: a warning that only says "failed" sends the
            // user to a debugger.
            let why: Vec<String> = report.timings.iter().map(|t| format!("{}: {}", t.config_id, t.status)).collect();
            self.emit(Event::Warning(format!(
                "every candidate failed for {k} ({}); falling back to heuristics",
                why.join("; ")
            )));
        }
        // 6. Heuristics: remembered in memory only.
        if self.policy.allow_heuristics {
            if let Some(c) = t.heuristic() {
                self.memory.insert(k.clone(), (c.clone(), Source::Heuristic));
                return Ok(self.chosen(Source::Heuristic, &k, c));
            }
        }
        // 7. Nothing.
        let why = if !self.policy.allow_autotune && !self.policy.allow_heuristics {
            "autotuning and heuristics are both disabled and no cache has it".to_string()
        } else {
            "no candidate worked and the operation has no heuristic".to_string()
        };
        Err(ChainError::NoConfig { key: k, why })
    }
}
