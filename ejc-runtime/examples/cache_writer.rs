//! A test helper for `tests/cache.rs`: one process writing tuning results into a shared
//! persistent cache, so the test can run several at once and look for lost updates.
//!
//! ```text
//! cache_writer <dir> <machine> <prefix> <count> [reopen|keep]
//!     put <count> entries with keys `<prefix>-<i>`; `reopen` opens the cache afresh before
//!     every put (many short-lived processes), `keep` (the default) opens it once (one
//!     long-lived process whose in-memory copy goes stale while the others write)
//! cache_writer --default-dir
//!     print `PersistentCache::default_dir()`, or `(none)` (tests set the environment of
//!     this process, not their own)
//! ```
//!
//! Exit status: 0 done, 1 a `put` failed, 2 usage, 3 the cache gave a warning (in these
//! tests any warning means something went wrong, e.g. a torn file was seen).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

use ejc_runtime::cache::{CacheEntry, PersistentCache, Timing};

const USAGE: &str = "usage: cache_writer <dir> <machine> <prefix> <count> [reopen|keep] | cache_writer --default-dir";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--default-dir") {
        match PersistentCache::default_dir() {
            Some(dir) => println!("{}", dir.display()),
            None => println!("(none)"),
        }
        return ExitCode::SUCCESS;
    }
    let (dir, machine, prefix, count, reopen) = match args.as_slice() {
        [dir, machine, prefix, count, rest @ ..] if rest.len() <= 1 => {
            let Ok(count) = count.parse::<u32>() else {
                eprintln!("count `{count}` is not a number\n{USAGE}");
                return ExitCode::from(2);
            };
            let reopen = match rest.first().map(String::as_str) {
                None | Some("keep") => false,
                Some("reopen") => true,
                Some(other) => {
                    eprintln!("mode `{other}` is neither `reopen` nor `keep`\n{USAGE}");
                    return ExitCode::from(2);
                }
            };
            (Path::new(dir), machine.as_str(), prefix.as_str(), count, reopen)
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };

    let mut cache = PersistentCache::open(dir, machine);
    for i in 0..count {
        if reopen && i > 0 {
            cache = PersistentCache::open(dir, machine);
        }
        if let Err(warning) = cache.put(&format!("{prefix}-{i}"), entry(machine, prefix, i)) {
            eprintln!("put {prefix}-{i}: {warning}");
            return ExitCode::from(1);
        }
        if !cache.warnings().is_empty() {
            eprintln!("warnings after put {prefix}-{i}: {:?}", cache.warnings());
            return ExitCode::from(3);
        }
    }
    ExitCode::SUCCESS
}

fn entry(machine: &str, prefix: &str, i: u32) -> CacheEntry {
    CacheEntry {
        config: BTreeMap::from([("block_m".to_string(), 16 << (i % 4)), ("index".to_string(), i)]),
        timings: vec![
            Timing {
                config_id: format!("m{}", 16 << (i % 4)),
                median_ms: Some(f64::from(i) + 0.5),
                status: "ok".into(),
            },
            Timing {
                config_id: "m256".into(),
                median_ms: None,
                status: "failed to launch: too much shared memory".into(),
            },
        ],
        call: format!("writer {prefix}, call {i}"),
        device: machine.to_string(),
        op: "flash_attention@v1".into(),
        call_hash: format!("{i:016x}"),
        candidates: "test".into(),
        compiler: "ejc test".into(),
        created: 1_700_000_000 + u64::from(i),
    }
}
