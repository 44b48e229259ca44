//! `ejc cache ls|show|clear`: what the persistent tuning cache holds — one file per
//! device (this CPU, and each GPU tuned here).

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
    /// Remove the compiled-code cache (`ejc_codegen::cache`).
    ClearCode,
}

pub fn run(action: Action, cache_dir: Option<PathBuf>) -> Outcome {
    let Some(dir) = cache_dir.or_else(PersistentCache::default_dir) else {
        return Outcome::Error(
            "error: no tuning cache directory: none of EJC_CACHE_DIR, XDG_CACHE_HOME or HOME is set (pass --cache-dir)"
                .into(),
        );
    };
    if let Action::ClearCode = action {
        return clear_code(&dir);
    }
    // This CPU's file first (shown even when empty), then every other device's.
    let cpu = cpu_fingerprint();
    let mut devices = vec![cpu.clone()];
    devices.extend(PersistentCache::machines(&dir).into_iter().filter(|m| *m != cpu));
    let mut shown = 0;
    let mut index = 0;
    for device in &devices {
        // Looking never writes (no directory, no lock file, nothing moved aside): a cache
        // that is read-only, or damaged, is listed as it is.
        // Clearing a cache file that does not exist writes nothing either.
        let look = PersistentCache::open_read_only(&dir, device);
        let mut cache = match action {
            Action::Clear if look.path().exists() => PersistentCache::open(&dir, device),
            _ => look,
        };
        for w in cache.warnings() {
            eprintln!("warning: {w}");
        }
        match one(&action, &mut cache, device, &mut index) {
            Ok(n) => shown += n,
            Err(o) => return o,
        }
    }
    if let Action::Ls = action {
        for kind in ejc_codegen::cache::KINDS {
            let d = dir.join(kind);
            let (n, bytes) = ejc_codegen::cache::usage(&d);
            println!("compiled code: {} ({n} entries, {:.1} MiB)", d.display(), bytes as f64 / (1 << 20) as f64);
        }
    }
    if let Action::Show(filter) = &action {
        if shown == 0 {
            return Outcome::Error(format!("error: no cache entry matches `{filter}` in {}", dir.display()));
        }
    }
    Outcome::Ok
}

/// One device's file; how many entries were shown. `index` numbers entries across files.
fn one(action: &Action, cache: &mut PersistentCache, device: &str, index: &mut usize) -> Result<usize, Outcome> {
    let mut n = 0;
    match action {
        Action::Ls => {
            println!("{} ({} entries) — {device}", cache.path().display(), cache.entries().count());
            for (_, e) in cache.entries() {
                println!("{:3}  {:<10} {}  [{}]", *index, config_id(&e.config), e.call, e.op);
                *index += 1;
            }
        }
        Action::Show(filter) => {
            for (key, e) in cache.entries() {
                let i = *index;
                *index += 1;
                if !filter.is_empty() && !key.contains(filter) && !e.call.contains(filter) && *filter != i.to_string() {
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
        }
        Action::Clear if !cache.path().exists() => {
            println!("removed 0 entries: {} does not exist ({device})", cache.path().display())
        }
        Action::Clear => match cache.clear(None) {
            Ok(n) => println!("removed {n} entries from {} ({device})", cache.path().display()),
            Err(e) => return Err(Outcome::Error(format!("error: {e}"))),
        },
        Action::ClearCode => {}
    }
    Ok(n)
}

/// `clear --code`: remove every back end's compiled code (nothing is written where there
/// is none).
fn clear_code(dir: &std::path::Path) -> Outcome {
    for kind in ejc_codegen::cache::KINDS {
        let d = dir.join(kind);
        if !d.exists() {
            continue;
        }
        let (n, bytes) = ejc_codegen::cache::usage(&d);
        if let Err(e) = std::fs::remove_dir_all(&d) {
            return Outcome::Error(format!("error: cannot remove {}: {e}", d.display()));
        }
        println!("removed {} ({n} entries, {:.1} MiB)", d.display(), bytes as f64 / (1 << 20) as f64);
    }
    Outcome::Ok
}
