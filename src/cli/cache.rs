//! `ejc cache ls|show|clear`: what the persistent tuning cache of this machine holds.

use std::path::PathBuf;

use ejc_runtime::cache::PersistentCache;
use ejc_runtime::key::cpu_fingerprint;
use ejc_runtime::registry::config_id;

use super::Outcome;

pub enum Action {
    Ls,
    /// Entries whose key or call description contains this text (all when empty).
    Show(String),
    Clear,
}

pub fn run(action: Action, cache_dir: Option<PathBuf>) -> Outcome {
    let dir = cache_dir.unwrap_or_else(PersistentCache::default_dir);
    let mut cache = PersistentCache::open(&dir, &cpu_fingerprint());
    for w in cache.warnings() {
        eprintln!("warning: {w}");
    }
    match action {
        Action::Ls => {
            println!("{} ({} entries)", cache.path().display(), cache.entries().count());
            for (i, (_, e)) in cache.entries().enumerate() {
                println!("{i:3}  {:<10} {}  [{}]", config_id(&e.config), e.call, e.op);
            }
        }
        Action::Show(filter) => {
            let mut n = 0;
            for (i, (key, e)) in cache.entries().enumerate() {
                if !filter.is_empty() && !key.contains(&filter) && !e.call.contains(&filter) && filter != i.to_string()
                {
                    continue;
                }
                n += 1;
                println!("[{i}] {}", e.call);
                println!("  key:        {key}");
                println!("  device:     {}", e.device);
                println!("  op:         {}   compiler {}   candidates {}", e.op, e.compiler, e.candidates);
                println!("  chosen:     {}", config_id(&e.config));
                println!("  tuned at:   {} (unix seconds)", e.created);
                println!("  candidates:");
                for t in &e.timings {
                    match t.median_ms {
                        Some(ms) => println!("    {:<12} {:>10.3} ms  {}", t.config_id, ms, t.status),
                        None => println!("    {:<12} {:>10}     {}", t.config_id, "-", t.status),
                    }
                }
            }
            if n == 0 {
                return Outcome::Error(format!(
                    "error: no cache entry matches `{filter}` in {}",
                    cache.path().display()
                ));
            }
        }
        Action::Clear => match cache.clear(None) {
            Ok(n) => println!("removed {n} entries from {}", cache.path().display()),
            Err(e) => return Outcome::Error(format!("error: {e}")),
        },
    }
    Outcome::Ok
}
