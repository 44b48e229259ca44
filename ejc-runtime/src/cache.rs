//! The persistent autotuning cache: one JSON file per machine, shared safely by every
//! process on that machine.
//!
//! ```no_run
//! use std::collections::BTreeMap;
//! use ejc_runtime::cache::{CacheEntry, PersistentCache, Timing};
//!
//! let mut cache = PersistentCache::open(&PersistentCache::default_dir(), "NVIDIA H100|sm_90|driver 570.86");
//! for w in cache.warnings() {
//!     eprintln!("warning: {w}"); // a corrupt or unwritable cache is a warning, never an error
//! }
//! let key = "NVIDIA H100|sm_90|driver 570.86|flash_attention@v1|3f2a9c0d1e4b5a69|c0ffee|ejc 0.1.0";
//! if cache.get(key).is_none() {
//!     let entry = CacheEntry {
//!         config: BTreeMap::from([("block_m".to_string(), 64), ("block_n".to_string(), 32)]),
//!         timings: vec![Timing { config_id: "m64_n32".into(), median_ms: Some(0.42), status: "ok".into() }],
//!         call: "flash_attention q=[2,1024,8,64] bf16 causal".into(),
//!         device: "NVIDIA H100|sm_90|driver 570.86".into(),
//!         op: "flash_attention@v1".into(),
//!         call_hash: "3f2a9c0d1e4b5a69".into(),
//!         candidates: "c0ffee".into(),
//!         compiler: "ejc 0.1.0".into(),
//!         created: 1_700_000_000,
//!     };
//!     if let Err(warning) = cache.put(key, entry) {
//!         eprintln!("warning: {warning}"); // the result is still used for this run
//!     }
//! }
//! ```
//!
//! What this fixes in ejkernel's `PersistentCache` (EJKERNEL.md §2.9): there, every `put`
//! rewrote the whole file from the process's own in-memory copy, with no lock, so two
//! processes tuning at once silently dropped each other's results; and a damaged file
//! raised at start-up. Here:
//!
//! - **Concurrent processes.** Every write takes an exclusive lock on `<file>.lock`,
//!   re-reads the file, merges, and replaces the file atomically (temp file + fsync +
//!   rename). Readers need no lock: they only ever see a complete old or a complete new
//!   file.
//! - **A damaged file** (truncated, garbage, another format version) is moved aside to
//!   `<file>.corrupt` (never deleted), reported as a warning, and rebuilt by the next `put`.
//! - **An unwritable location** turns the cache into an in-memory one for this run, with a
//!   warning: tuning still works, its results are just not kept.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The `format` tag of the file. A file with another tag is not read (it is moved aside),
/// so a change to the layout of [`CacheEntry`] must change this tag.
const FORMAT: &str = "ejc-tuning-cache/1";

/// One tuning result, everything kept so `ejc cache show` can explain a choice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheEntry {
    /// The chosen configuration, e.g. {"block_m": 64, "block_n": 32}.
    pub config: BTreeMap<String, u32>,
    /// Every candidate's outcome: config id ("m64_n32"), median milliseconds (None = failed
    /// or dropped), and a status text ("ok", "wrong result: rel_err=...", "failed to launch: ...").
    pub timings: Vec<Timing>,
    /// Human-readable description of the call (op, shapes, dtype...), for `cache show`.
    pub call: String,
    /// The key's parts, for display: device fingerprint, "op@version", call hash,
    /// candidate-set checksum, compiler version.
    pub device: String,
    pub op: String,
    pub call_hash: String,
    pub candidates: String,
    pub compiler: String,
    /// Unix seconds when tuned.
    pub created: u64,
}

/// One candidate's outcome. JSON has no NaN or infinity: a non-finite `median_ms` is
/// written as `null` and reads back as `None`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub config_id: String,
    pub median_ms: Option<f64>,
    pub status: String,
}

/// The file as written. Field order puts the format tag first, so `head` on the file says
/// what it is; `entries` is a `BTreeMap`, so keys come out sorted and the file is
/// deterministic (diffable, and rewritten byte-identically when nothing changed).
#[derive(Serialize)]
struct FileOut<'a> {
    format: &'a str,
    machine: &'a str,
    entries: &'a BTreeMap<String, CacheEntry>,
}

/// What is on disk right now.
enum DiskState {
    Missing,
    Parsed(BTreeMap<String, CacheEntry>),
    /// The file exists but is not a cache we can read; the text says why.
    Bad(String),
}

/// The persistent cache: one JSON file per machine.
#[derive(Debug)]
pub struct PersistentCache {
    path: PathBuf,
    machine: String,
    entries: BTreeMap<String, CacheEntry>,
    /// `Some(warning)` once the cache is in memory only; that warning is what `put` returns.
    memory_only: Option<String>,
    warnings: Vec<String>,
}

impl PersistentCache {
    /// Open (never fails): `dir` is where the file lives; `machine` is the device fingerprint
    /// (the file name is `tuning-<first 16 hex of sha256(machine)>.json`). A missing file is
    /// an empty cache. A file that does not parse gives a warning, an empty cache, and is
    /// moved aside to `<name>.corrupt` (rebuilt on the next `put`). An unwritable location
    /// makes the cache in-memory only, with a warning.
    pub fn open(dir: &Path, machine: &str) -> PersistentCache {
        let mut cache = PersistentCache {
            path: dir.join(file_name(machine)),
            machine: machine.to_string(),
            entries: BTreeMap::new(),
            memory_only: None,
            warnings: Vec::new(),
        };
        // Probe writability now rather than at the first `put`: a tuning run that will not be
        // kept should say so before it spends minutes timing candidates. Creating the lock
        // file is the probe (it must exist for writes anyway).
        if let Err(e) = std::fs::create_dir_all(dir) {
            cache.go_memory_only(format!("cannot create tuning cache directory {} ({e})", dir.display()));
            return cache;
        }
        if let Err(e) = cache.open_lock_file() {
            cache.go_memory_only(format!("cannot write in tuning cache directory {} ({e})", dir.display()));
            return cache;
        }
        cache.reload();
        cache
    }

    /// The default directory: $EJC_CACHE_DIR, else $XDG_CACHE_HOME/ejc, else
    /// $HOME/.cache/ejc, else ./.ejc-cache.
    pub fn default_dir() -> PathBuf {
        ejc_ir::cache_dir::default_dir()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The devices whose cache files `dir` holds (each file names its device), sorted; a
    /// file that cannot be read is left out (opening it reports why).
    pub fn machines(dir: &Path) -> Vec<String> {
        #[derive(Deserialize)]
        struct Head {
            machine: String,
        }
        let mut out: Vec<String> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| {
                        p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with("tuning-") && n.ends_with(".json"))
                    })
                    .filter_map(|p| std::fs::read_to_string(p).ok())
                    .filter_map(|t| serde_json::from_str::<Head>(&t).ok().map(|h| h.machine))
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out.dedup();
        out
    }

    pub fn get(&self, key: &str) -> Option<&CacheEntry> {
        self.entries.get(key)
    }

    /// Store an entry, under the file lock: re-read the file, add this entry (it replaces one
    /// with the same key), write a temp file, fsync, rename. Nothing another process wrote is
    /// lost. On I/O failure the cache switches to in-memory (the entry is kept there) and the
    /// warning is returned as `Err`, for the caller to print; it is never a reason to abort.
    ///
    /// Only *this* entry is merged into what is on disk, not everything this process loaded
    /// earlier: an old copy we hold must neither overwrite a newer result another process
    /// wrote for the same key, nor bring back entries that `ejc cache clear` removed. After
    /// the write, memory holds exactly what the file holds.
    pub fn put(&mut self, key: &str, entry: CacheEntry) -> Result<(), String> {
        if let Some(warning) = &self.memory_only {
            self.entries.insert(key.to_string(), entry);
            return Err(warning.clone());
        }
        let result = self.with_lock(|cache| {
            // Why re-read under the lock: what we loaded at `open` may be minutes old. Another
            // process may have written since; writing our copy back would drop its results
            // (ejkernel's lost update). Under the lock nobody can write between this read and
            // our rename, so the merge is complete.
            let mut disk = cache.read_locked()?;
            disk.insert(key.to_string(), entry.clone());
            cache.write_locked(&disk)?;
            Ok(disk)
        });
        match result {
            Ok(disk) => {
                self.entries = disk;
                Ok(())
            }
            Err(e) => {
                self.entries.insert(key.to_string(), entry);
                Err(self.go_memory_only(format!("cannot write tuning cache {} ({e})", self.path.display())))
            }
        }
    }

    /// Re-read from disk (merging nothing: disk wins). A cache that is in memory only keeps
    /// what it has: it is not reading the file any more (reopen to try again).
    pub fn reload(&mut self) {
        if self.memory_only.is_some() {
            return;
        }
        let loaded = match self.read_state() {
            Ok(DiskState::Missing) => Ok(BTreeMap::new()),
            Ok(DiskState::Parsed(entries)) => Ok(entries),
            // Moving the file aside must happen under the lock, after reading it again: a
            // writer may have replaced the bad file with a good one since our read, and that
            // one must not be moved aside.
            Ok(DiskState::Bad(_)) => self.with_lock(|cache| cache.read_locked()),
            Err(e) => Err(e),
        };
        match loaded {
            Ok(entries) => self.entries = entries,
            Err(e) => {
                self.go_memory_only(format!("cannot read tuning cache {} ({e})", self.path.display()));
            }
        }
    }

    /// All entries (key order).
    pub fn entries(&self) -> impl Iterator<Item = (&String, &CacheEntry)> {
        self.entries.iter()
    }

    /// Remove every entry (under the lock), or only the keys starting with `prefix` when
    /// given. Returns how many were removed from the file, which is re-read first: entries
    /// other processes wrote since we loaded are cleared too. In memory only, the entries are
    /// removed from memory and the warning is returned as `Err` (the file was not touched).
    pub fn clear(&mut self, prefix: Option<&str>) -> Result<usize, String> {
        let matches = |key: &String| prefix.is_none_or(|p| key.starts_with(p));
        if let Some(warning) = &self.memory_only {
            let before = self.entries.len();
            self.entries.retain(|k, _| !matches(k));
            let removed = before - self.entries.len();
            return Err(format!("{warning}; removed {removed} entries from memory only"));
        }
        let result = self.with_lock(|cache| {
            let mut disk = cache.read_locked()?;
            let before = disk.len();
            disk.retain(|k, _| !matches(k));
            let removed = before - disk.len();
            if removed > 0 {
                cache.write_locked(&disk)?;
            }
            Ok((disk, removed))
        });
        match result {
            Ok((disk, removed)) => {
                self.entries = disk;
                Ok(removed)
            }
            Err(e) => {
                self.entries.retain(|k, _| !matches(k));
                Err(self.go_memory_only(format!("cannot write tuning cache {} ({e})", self.path.display())))
            }
        }
    }

    pub fn is_persistent(&self) -> bool {
        self.memory_only.is_none()
    }

    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Switch to in-memory for the rest of this object's life, record the warning, and
    /// return it. Stopping all file access after one failure keeps a half-working disk from
    /// producing a warning per call.
    fn go_memory_only(&mut self, problem: String) -> String {
        let warning = format!("{problem}; tuning results are kept in memory only for this run");
        self.warnings.push(warning.clone());
        self.memory_only = Some(warning.clone());
        warning
    }

    fn lock_path(&self) -> PathBuf {
        sibling(&self.path, ".lock")
    }

    /// The lock file is never deleted: deleting it would let one process lock the old inode
    /// while another locks a new file of the same name, and both would "hold" the lock.
    fn open_lock_file(&self) -> std::io::Result<File> {
        OpenOptions::new().create(true).truncate(false).write(true).open(self.lock_path())
    }

    /// Run `f` holding the exclusive lock on `<file>.lock`. The lock file is reopened every
    /// time (not kept open) so that a cache directory removed while we run is simply
    /// recreated, and the lock is released when the handle drops, even on an early return.
    fn with_lock<T>(&mut self, f: impl FnOnce(&mut Self) -> std::io::Result<T>) -> std::io::Result<T> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let lock = self.open_lock_file()?;
        // std's `File::lock` is `flock(LOCK_EX)` on Unix (`LockFileEx` on Windows): it is
        // released by the kernel if the process dies, so a crashed tuner never wedges the
        // cache. The MSRV lint fires because the workspace declares 1.85; `File::lock` is
        // stable since 1.89, the toolchain this workspace builds with.
        lock.lock()?;
        let result = f(self);
        drop(lock);
        result
    }

    /// Read and parse the file. Needs no lock: writers replace the file by rename, so a
    /// reader sees a complete old file or a complete new one, never a torn write.
    fn read_state(&self) -> std::io::Result<DiskState> {
        match std::fs::read(&self.path) {
            Ok(bytes) => Ok(match parse(&bytes, &self.machine) {
                Ok(entries) => DiskState::Parsed(entries),
                Err(problem) => DiskState::Bad(problem),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(DiskState::Missing),
            Err(e) => Err(e),
        }
    }

    /// Read the file while holding the lock; a bad file is moved aside (with a warning) and
    /// counts as empty, so the write that follows rebuilds it.
    fn read_locked(&mut self) -> std::io::Result<BTreeMap<String, CacheEntry>> {
        match self.read_state()? {
            DiskState::Missing => Ok(BTreeMap::new()),
            DiskState::Parsed(entries) => Ok(entries),
            DiskState::Bad(problem) => {
                let aside = self.set_aside()?;
                self.warnings.push(format!(
                    "tuning cache {} is unreadable ({problem}); moved it to {} and starting with an empty cache \
                     (it is rebuilt as tuning results come in)",
                    self.path.display(),
                    aside.display()
                ));
                Ok(BTreeMap::new())
            }
        }
    }

    /// Move the bad file to the first free name of `<name>.corrupt`, `<name>.corrupt.1`, ...:
    /// an earlier damaged file someone has not looked at yet is not overwritten either.
    fn set_aside(&self) -> std::io::Result<PathBuf> {
        let mut aside = sibling(&self.path, ".corrupt");
        for n in 1..1000 {
            if !aside.exists() {
                break;
            }
            aside = sibling(&self.path, &format!(".corrupt.{n}"));
        }
        std::fs::rename(&self.path, &aside)?;
        Ok(aside)
    }

    /// Write `entries` as the whole file: temp file in the same directory, fsync, rename.
    /// The same directory because rename is atomic only within one file system. The fsync
    /// before the rename because otherwise, after a crash, the rename can reach the disk
    /// before the data and leave an empty file under the real name.
    fn write_locked(&self, entries: &BTreeMap<String, CacheEntry>) -> std::io::Result<()> {
        let out = FileOut { format: FORMAT, machine: &self.machine, entries };
        let mut bytes = serde_json::to_vec_pretty(&out).map_err(std::io::Error::other)?;
        bytes.push(b'\n');
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let tmp = sibling(&self.path, &format!(".{}.{nanos}.tmp", std::process::id()));
        let written = (|| {
            let mut file = File::create(&tmp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
            std::fs::rename(&tmp, &self.path)
        })();
        if written.is_err() {
            // Best effort: a leftover temp file is harmless clutter, the error that matters
            // is the one returned.
            let _ = std::fs::remove_file(&tmp);
            return written;
        }
        // Make the rename itself durable. Best effort: not every platform can open a
        // directory for syncing, and the file is already complete either way.
        if let Some(dir) = self.path.parent() {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

/// `tuning-<first 16 hex of sha256(machine)>.json`: a fixed-length name whatever the
/// fingerprint holds (slashes, spaces, driver strings).
fn file_name(machine: &str) -> String {
    let digest = Sha256::digest(machine.as_bytes());
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("tuning-{hex}.json")
}

/// `path` with `suffix` appended to its file name (`a/b.json` + `.lock` = `a/b.json.lock`).
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().map(OsString::from).unwrap_or_default();
    name.push(suffix);
    path.with_file_name(name)
}

/// Parse a cache file; the error says what is wrong in words a user can act on.
fn parse(bytes: &[u8], machine: &str) -> Result<BTreeMap<String, CacheEntry>, String> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| format!("not valid JSON: {e}"))?;
    let serde_json::Value::Object(mut top) = value else {
        return Err("not a JSON object".to_string());
    };
    match top.get("format") {
        Some(serde_json::Value::String(f)) if f == FORMAT => {}
        Some(serde_json::Value::String(f)) => {
            return Err(format!("format `{f}`, this ejc reads `{FORMAT}`"));
        }
        Some(other) => return Err(format!("`format` is {other}, expected \"{FORMAT}\"")),
        None => return Err(format!("no `format` field (expected \"{FORMAT}\"; not an ejc tuning cache?)")),
    }
    match top.get("machine") {
        Some(serde_json::Value::String(m)) if m == machine => {}
        Some(serde_json::Value::String(m)) => {
            return Err(format!("written for machine `{m}`, not `{machine}`"));
        }
        _ => return Err("no `machine` string".to_string()),
    }
    let Some(serde_json::Value::Object(raw)) = top.remove("entries") else {
        return Err("no `entries` object".to_string());
    };
    // Entry by entry, so the message names the key that is wrong.
    let mut entries = BTreeMap::new();
    for (key, value) in raw {
        let entry = serde_json::from_value(value).map_err(|e| format!("entry `{key}`: {e}"))?;
        entries.insert(key, entry);
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_name_is_fixed_length() {
        let a = file_name("NVIDIA H100 80GB HBM3|sm_90|570.86/with slash");
        assert_eq!(a.len(), "tuning-".len() + 16 + ".json".len());
        assert!(a.starts_with("tuning-") && a.ends_with(".json"));
        assert_ne!(a, file_name("other"));
    }

    #[test]
    fn sibling_appends_to_the_name() {
        assert_eq!(sibling(Path::new("/a/b.json"), ".lock"), PathBuf::from("/a/b.json.lock"));
    }
}
