//! The persistent autotuning cache: one JSON file per machine, shared safely by every
//! process on that machine.
//!
//! ```no_run
//! use std::collections::BTreeMap;
//! use ejc_runtime::cache::{CacheEntry, PersistentCache, Timing};
//!
//! let dir = PersistentCache::default_dir().expect("HOME or EJC_CACHE_DIR is set");
//! let mut cache = PersistentCache::open(&dir, "NVIDIA H100|sm_90|driver 570.86");
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
//!   A writer that finds the lock taken says so on stderr before it waits.
//! - **A damaged file** (truncated, garbage, another format version) is moved aside to
//!   `<file>.corrupt` (never deleted), reported as a warning, and rebuilt by the next `put`.
//! - **A damaged entry** in a file that is otherwise fine costs only that entry: it is
//!   skipped with a warning, every other entry is used, and the next write keeps its raw
//!   text in `<file>.corrupt` (the first free `.corrupt.N`) before it rewrites the file
//!   without it.
//! - **An unwritable location** (a read-only directory or file system) is still read: its
//!   entries are used, and new results are kept in memory for this run, with a warning
//!   (again from every write that could not happen). Tuning still works, its results are
//!   just not kept.
//! - **Looking is not touching**: [`PersistentCache::open_read_only`] (`ejc cache ls`,
//!   `ejc cache show`) creates no directory or lock file and moves nothing aside.

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
    /// The entries that read, and those that do not (kept raw, to be set aside).
    Parsed(BTreeMap<String, CacheEntry>, Vec<BadEntry>),
    /// The file exists but is not a cache we can read; the text says why.
    Bad(String),
}

/// An entry of a readable file that is not a [`CacheEntry`] (hand-edited, or written by a
/// damaged process): its key, its JSON as found, and what is wrong with it.
struct BadEntry {
    key: String,
    raw: serde_json::Value,
    why: String,
}

/// The persistent cache: one JSON file per machine.
#[derive(Debug)]
pub struct PersistentCache {
    path: PathBuf,
    machine: String,
    entries: BTreeMap<String, CacheEntry>,
    /// `Some(problem)` once the cache is in memory only: why it cannot write (what `put`
    /// and `clear` report).
    memory_only: Option<String>,
    warnings: Vec<String>,
}

impl PersistentCache {
    /// Open (never fails): `dir` is where the file lives; `machine` is the device fingerprint
    /// (the file name is `tuning-<first 16 hex of sha256(machine)>.json`). A missing file is
    /// an empty cache. A file that does not parse gives a warning, an empty cache, and is
    /// moved aside to `<name>.corrupt` (rebuilt on the next `put`); an entry that does not
    /// parse is skipped with a warning. An unwritable location is read all the same (its
    /// entries are used) and makes the cache in-memory only for new results, with a warning.
    pub fn open(dir: &Path, machine: &str) -> PersistentCache {
        let mut cache = PersistentCache::unopened(dir, machine);
        // Probe writability now rather than at the first `put`: a tuning run that will not be
        // kept should say so before it spends minutes timing candidates. Creating the lock
        // file is the probe (it must exist for writes anyway).
        let probe = match std::fs::create_dir_all(dir) {
            Err(e) => Err(format!("cannot create tuning cache directory {} ({e})", dir.display())),
            Ok(()) => cache.open_lock_file().map(drop).map_err(|e| {
                format!(
                    "tuning cache directory {} is not writable (cannot open the lock file {}: {e})",
                    dir.display(),
                    cache.lock_path().display()
                )
            }),
        };
        match probe {
            Ok(()) => cache.reload(),
            Err(problem) => {
                // Read-only (a shared, pre-tuned cache; a read-only file system): what the file
                // holds is still the best answer there is.
                let warning = match cache.load_read_only() {
                    0 => format!("{problem}; tuning results are kept in memory only for this run"),
                    n => format!(
                        "{problem}; the {n} entr{} it holds {} used, but new tuning results are kept in memory only \
                         for this run",
                        if n == 1 { "y" } else { "ies" },
                        if n == 1 { "is" } else { "are" },
                    ),
                };
                cache.warnings.push(warning);
                cache.memory_only = Some(problem);
            }
        }
        cache
    }

    /// Open for looking only (`ejc cache ls`, `ejc cache show`): read the file if there is
    /// one, and nothing else — no directory or lock file is created, a damaged file is not
    /// moved aside (a warning says what is wrong), a damaged entry is skipped with a
    /// warning. `put` and `clear` on it change memory only and return a warning.
    pub fn open_read_only(dir: &Path, machine: &str) -> PersistentCache {
        let mut cache = PersistentCache::unopened(dir, machine);
        cache.memory_only =
            Some(format!("tuning cache {} was opened read-only; nothing is written to it", cache.path.display()));
        cache.load_read_only();
        cache
    }

    /// A cache that has no file at all (no cache directory, see
    /// [`ejc_ir::cache_dir::default_dir`]): memory only from the start; `why` says why,
    /// in its warning and in what `put` returns.
    pub fn in_memory(machine: &str, why: &str) -> PersistentCache {
        let mut cache = PersistentCache::unopened(Path::new(""), machine);
        cache.go_memory_only(why.to_string());
        cache
    }

    fn unopened(dir: &Path, machine: &str) -> PersistentCache {
        PersistentCache {
            path: dir.join(file_name(machine)),
            machine: machine.to_string(),
            entries: BTreeMap::new(),
            memory_only: None,
            warnings: Vec::new(),
        }
    }

    /// The default directory: $EJC_CACHE_DIR, else $XDG_CACHE_HOME/ejc, else
    /// $HOME/.cache/ejc, else none ([`ejc_ir::cache_dir::NO_DIR`] is the warning to give;
    /// [`PersistentCache::in_memory`] the cache to use).
    pub fn default_dir() -> Option<PathBuf> {
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
        if let Some(problem) = &self.memory_only {
            let warning = format!("{problem}; this tuning result is kept in memory only for this run");
            self.entries.insert(key.to_string(), entry);
            return Err(warning);
        }
        let result = self.with_lock(|cache| {
            // Why re-read under the lock: what we loaded at `open` may be minutes old. Another
            // process may have written since; writing our copy back would drop its results
            // (ejkernel's lost update). Under the lock nobody can write between this read and
            // our rename, so the merge is complete.
            let (mut disk, bad) = cache.read_locked()?;
            disk.insert(key.to_string(), entry.clone());
            cache.write_locked(&disk, &bad)?;
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
            Ok(DiskState::Parsed(entries, bad)) => {
                self.warn_skipped(&bad);
                Ok(entries)
            }
            // Moving the file aside must happen under the lock, after reading it again: a
            // writer may have replaced the bad file with a good one since our read, and that
            // one must not be moved aside.
            Ok(DiskState::Bad(_)) => self.with_lock(|cache| cache.read_locked().map(|(entries, _)| entries)),
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
        if let Some(problem) = &self.memory_only {
            let before = self.entries.len();
            self.entries.retain(|k, _| !matches(k));
            let removed = before - self.entries.len();
            return Err(format!("cannot clear: {problem}; removed {removed} entries from memory only"));
        }
        let result = self.with_lock(|cache| {
            let (mut disk, bad) = cache.read_locked()?;
            let before = disk.len();
            disk.retain(|k, _| !matches(k));
            let removed = before - disk.len();
            if removed > 0 {
                cache.write_locked(&disk, &bad)?;
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

    /// Every warning so far, oldest first: those of `open`, then any a later `put` or
    /// `clear` added (a file damaged behind our back, an entry set aside); a caller that
    /// prints them remembers how many it has printed.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Load the file without writing anything; returns how many entries it holds. For a
    /// cache that cannot (or must not) write: a damaged file or entry gives a warning and
    /// is left where it is.
    fn load_read_only(&mut self) -> usize {
        match self.read_state() {
            Ok(DiskState::Missing) => {}
            Ok(DiskState::Parsed(entries, bad)) => {
                self.warn_skipped(&bad);
                self.entries = entries;
            }
            Ok(DiskState::Bad(problem)) => self.warnings.push(format!(
                "tuning cache {} is unreadable ({problem}); it is ignored and left as it is",
                self.path.display()
            )),
            Err(e) => self.warnings.push(format!("cannot read tuning cache {} ({e})", self.path.display())),
        }
        self.entries.len()
    }

    fn warn_skipped(&mut self, bad: &[BadEntry]) {
        for b in bad {
            self.warnings.push(format!(
                "tuning cache {}: entry `{}` is unreadable ({}); it is skipped, the other entries are used",
                self.path.display(),
                b.key,
                b.why
            ));
        }
    }

    /// Switch to in-memory for the rest of this object's life, record the warning, and
    /// return it. Stopping all file access after one failure keeps a half-working disk from
    /// producing a warning per call.
    fn go_memory_only(&mut self, problem: String) -> String {
        let warning = format!("{problem}; tuning results are kept in memory only for this run");
        self.warnings.push(warning.clone());
        self.memory_only = Some(problem);
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
        // cache. Another process holding it (a long tuning run writing, a stopped process)
        // makes us wait: say so first, or a waiting `ejc tune` looks hung.
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                eprintln!(
                    "ejc: waiting for the tuning cache lock at {} (held by another process)...",
                    self.lock_path().display()
                );
                lock.lock()?;
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
        let result = f(self);
        drop(lock);
        result
    }

    /// Read and parse the file. Needs no lock: writers replace the file by rename, so a
    /// reader sees a complete old file or a complete new one, never a torn write.
    fn read_state(&self) -> std::io::Result<DiskState> {
        match std::fs::read(&self.path) {
            Ok(bytes) => Ok(match parse(&bytes, &self.machine) {
                Ok((entries, bad)) => DiskState::Parsed(entries, bad),
                Err(problem) => DiskState::Bad(problem),
            }),
            // No file, or no directory to hold one (a path through a regular file).
            Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => {
                Ok(DiskState::Missing)
            }
            Err(e) => Err(e),
        }
    }

    /// Read the file while holding the lock; a bad file is moved aside (with a warning) and
    /// counts as empty, so the write that follows rebuilds it. The entries that do not read
    /// come back apart: a write that follows keeps them aside first ([`Self::write_locked`]).
    fn read_locked(&mut self) -> std::io::Result<(BTreeMap<String, CacheEntry>, Vec<BadEntry>)> {
        match self.read_state()? {
            DiskState::Missing => Ok((BTreeMap::new(), Vec::new())),
            DiskState::Parsed(entries, bad) => Ok((entries, bad)),
            DiskState::Bad(problem) => {
                let aside = self.set_aside()?;
                self.warnings.push(format!(
                    "tuning cache {} is unreadable ({problem}); moved it to {} and starting with an empty cache \
                     (it is rebuilt as tuning results come in)",
                    self.path.display(),
                    aside.display()
                ));
                Ok((BTreeMap::new(), Vec::new()))
            }
        }
    }

    /// The first free name of `<name>.corrupt`, `<name>.corrupt.1`, ...: an earlier damaged
    /// file someone has not looked at yet is not overwritten.
    fn free_aside_name(&self) -> PathBuf {
        let mut aside = sibling(&self.path, ".corrupt");
        for n in 1..1000 {
            if !aside.exists() {
                break;
            }
            aside = sibling(&self.path, &format!(".corrupt.{n}"));
        }
        aside
    }

    /// Move the bad file to the first free `.corrupt` name.
    fn set_aside(&self) -> std::io::Result<PathBuf> {
        let aside = self.free_aside_name();
        std::fs::rename(&self.path, &aside)?;
        Ok(aside)
    }

    /// Keep the raw text of entries that do not read in the first free `.corrupt` name (a
    /// cache file of their own, so they can be mended and merged back by hand), before a
    /// write drops them from the file. Under the lock.
    fn keep_bad_aside(&mut self, bad: &[BadEntry]) -> std::io::Result<()> {
        if bad.is_empty() {
            return Ok(());
        }
        let raw: serde_json::Map<String, serde_json::Value> =
            bad.iter().map(|b| (b.key.clone(), b.raw.clone())).collect();
        let doc = serde_json::json!({"format": FORMAT, "machine": self.machine, "entries": raw});
        let mut bytes = serde_json::to_vec_pretty(&doc).map_err(std::io::Error::other)?;
        bytes.push(b'\n');
        let aside = self.free_aside_name();
        // `create_new`: never overwrite, even if the name was taken since we looked.
        let mut file = OpenOptions::new().write(true).create_new(true).open(&aside)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        let keys: Vec<String> = bad.iter().map(|b| format!("`{}`", b.key)).collect();
        self.warnings.push(format!(
            "tuning cache {}: dropped {} unreadable entr{} ({}) from the file; {} kept in {}",
            self.path.display(),
            bad.len(),
            if bad.len() == 1 { "y" } else { "ies" },
            keys.join(", "),
            if bad.len() == 1 { "its text is" } else { "their text is" },
            aside.display()
        ));
        Ok(())
    }

    /// Write `entries` as the whole file: temp file in the same directory, fsync, rename.
    /// The same directory because rename is atomic only within one file system. The fsync
    /// before the rename because otherwise, after a crash, the rename can reach the disk
    /// before the data and leave an empty file under the real name. `bad` (entries of the
    /// old file that did not read) are kept aside first: the new file no longer has them.
    fn write_locked(&mut self, entries: &BTreeMap<String, CacheEntry>, bad: &[BadEntry]) -> std::io::Result<()> {
        self.keep_bad_aside(bad)?;
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

/// Parse a cache file; the error says what is wrong in words a user can act on. Entries
/// are read one by one: one that is not a [`CacheEntry`] comes back apart (with why), it
/// does not cost the others.
#[allow(clippy::type_complexity)]
fn parse(bytes: &[u8], machine: &str) -> Result<(BTreeMap<String, CacheEntry>, Vec<BadEntry>), String> {
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
    // Entry by entry, so one bad entry costs only itself, and the message names it.
    let mut entries = BTreeMap::new();
    let mut bad = Vec::new();
    for (key, value) in raw {
        match CacheEntry::deserialize(&value) {
            Ok(entry) => {
                entries.insert(key, entry);
            }
            Err(e) => bad.push(BadEntry { key, raw: value, why: e.to_string() }),
        }
    }
    Ok((entries, bad))
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
