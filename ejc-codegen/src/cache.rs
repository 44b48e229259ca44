//! The on-disk cache of compiled code, for every back end: PTX (`ptx/`), CPU objects
//! (`cpu/`) and MLIR's output (`mlir/`), and ptxas's reports (`ptxas/`), under the cache directory
//! ([`ejc_ir::cache_dir::default_dir`]: `$EJC_CACHE_DIR`, else `$XDG_CACHE_HOME/ejc`, else
//! `~/.cache/ejc`).
//!
//! An entry is keyed by the SHA-256 of everything that decides the code: the kernel's
//! tile IR as printed after the pass pipeline (the text round-trips, so it is the whole
//! program), the target and its options, the LLVM version, and the code generator's
//! fingerprint (a hash of ejc-codegen's and ejc-ir's sources, made by `build.rs`), so a
//! changed back end never reads what an older one wrote. A second build of an unchanged
//! spec runs no LLVM at all; a build where one variant changed compiles only that
//! variant's kernels.
//!
//! Entries are written through a temporary file and a rename (a concurrent reader never
//! sees half an entry) and carry the SHA-256 of their contents on their first line: a
//! damaged entry is reported, removed and compiled again, never run. A cache that cannot
//! be written is not an error. `EJC_CODE_CACHE=off` (or `ejc build --no-cache`) turns
//! the cache off for a process; `ejc cache clear --code` empties it.
//!
//! ```
//! use ejc_codegen::cache::CodeCache;
//! let dir = std::env::temp_dir().join(format!("ejc-doc-cache-{}", std::process::id()));
//! let cache = CodeCache::at(dir.join("ptx"));
//! let key = CodeCache::key(&["sm_90a", "kernel text"]);
//! assert!(cache.get(&key, "ptx").is_none());
//! cache.put(&key, "ptx", b"// PTX");
//! assert_eq!(cache.get(&key, "ptx").unwrap(), b"// PTX");
//! std::fs::remove_dir_all(&dir).unwrap();
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use sha2::{Digest, Sha256};

/// The layout of an entry: this tag and the SHA-256 of what follows on the first line,
/// then the contents. Part of every key too, so entries of another layout are never read.
pub const FORMAT: &str = "ejc-code-cache/1";

/// A hash of the code generator's sources (ejc-codegen and ejc-ir), made at build time.
pub const FINGERPRINT: &str = env!("EJC_CODEGEN_FINGERPRINT");

static DISABLED: AtomicBool = AtomicBool::new(false);
static HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);

/// Lookups of this process so far: (found, compiled), over every back end.
pub fn stats() -> (u64, u64) {
    (HITS.load(Ordering::Relaxed), MISSES.load(Ordering::Relaxed))
}

/// Turn the cache off for the rest of this process (`ejc build --no-cache`).
pub fn disable() {
    DISABLED.store(true, Ordering::Relaxed);
}

/// Whether the cache is on: not turned off by [`disable`] or `EJC_CODE_CACHE=off|0|no|false`.
pub fn enabled() -> bool {
    if DISABLED.load(Ordering::Relaxed) {
        return false;
    }
    !std::env::var("EJC_CODE_CACHE").is_ok_and(|v| matches!(v.as_str(), "off" | "0" | "no" | "false"))
}

/// The directory of one back end's entries (`<cache dir>/<kind>`), or none when the
/// cache is off or there is no cache directory (a warning says so once per process).
pub fn dir(kind: &str) -> Option<PathBuf> {
    if !enabled() {
        return None;
    }
    let dir = ejc_ir::cache_dir::default_dir().map(|d| d.join(kind));
    if dir.is_none() {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            eprintln!(
                "warning: {}; compiled code is not cached (every process compiles it again)",
                ejc_ir::cache_dir::NO_DIR
            )
        });
    }
    dir
}

/// One back end's entries.
#[derive(Clone, Debug)]
pub struct CodeCache {
    dir: PathBuf,
}

impl CodeCache {
    /// The cache of back end `kind` (`ptx`, `cpu`, `mlir`) in the default place, if on.
    pub fn open(kind: &str) -> Option<CodeCache> {
        dir(kind).map(CodeCache::at)
    }

    /// A cache in `dir` (tests, tools).
    pub fn at(dir: impl Into<PathBuf>) -> CodeCache {
        CodeCache { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key of `parts` (each separated, so `["ab", "c"]` and `["a", "bc"]` differ),
    /// with the compiler version, the code generator's fingerprint, the LLVM version and
    /// the entry layout.
    pub fn key(parts: &[&str]) -> String {
        let (major, minor, patch) = inkwell::support::get_llvm_version();
        let llvm = format!("llvm-{major}.{minor}.{patch}");
        digest([crate::COMPILER_VERSION, FINGERPRINT, llvm.as_str(), FORMAT].into_iter().chain(parts.iter().copied()))
    }

    /// The key of `parts` alone (and the entry layout), for results that depend on
    /// nothing of ejc's: ptxas's report of a PTX text, keyed by ptxas's version.
    pub fn key_without_compiler(parts: &[&str]) -> String {
        digest([FORMAT].into_iter().chain(parts.iter().copied()))
    }

    fn path(&self, key: &str, ext: &str) -> PathBuf {
        // Two-character fan-out keeps directories small (a full flash build is ~6,000 entries).
        self.dir.join(&key[..2.min(key.len())]).join(format!("{key}.{ext}"))
    }

    /// The entry `key` if there is one and it is intact.
    pub fn get(&self, key: &str, ext: &str) -> Option<Vec<u8>> {
        get(&self.path(key, ext))
    }

    /// [`CodeCache::get`] without counting the lookup in [`stats`] (for steps that are not
    /// compilations, such as MLIR's translation).
    pub fn peek(&self, key: &str, ext: &str) -> Option<Vec<u8>> {
        read_entry(&self.path(key, ext))
    }

    /// Store an entry (best effort).
    pub fn put(&self, key: &str, ext: &str, bytes: &[u8]) {
        put(&self.path(key, ext), bytes)
    }
}

/// `compile` through the cache of back end `kind`: what it returns is `(meta, code)`, kept as
/// one line of JSON (`meta`: entry names, shared memory, ...) followed by the code bytes.
/// `parts` (the key's inputs: target, options, printed tile IR) is only computed when the
/// cache is on. An entry that does not parse is compiled again and overwritten.
pub fn cached<M, E>(
    kind: &str,
    ext: &str,
    parts: impl FnOnce() -> Vec<String>,
    compile: impl FnOnce() -> Result<(M, Vec<u8>), E>,
) -> Result<(M, Vec<u8>), E>
where
    M: serde::Serialize + serde::de::DeserializeOwned,
{
    let Some(cache) = CodeCache::open(kind) else { return compile() };
    let parts = parts();
    let key = CodeCache::key(&parts.iter().map(String::as_str).collect::<Vec<_>>());
    let hit = cache.get(&key, ext).and_then(|mut b| {
        let nl = b.iter().position(|x| *x == b'\n')?;
        let meta = serde_json::from_slice(&b[..nl]).ok()?;
        b.drain(..=nl);
        Some((meta, b))
    });
    if let Some(hit) = hit {
        return Ok(hit);
    }
    let (meta, code) = compile()?;
    if let Ok(mut bytes) = serde_json::to_vec(&meta) {
        bytes.push(b'\n');
        bytes.extend_from_slice(&code);
        cache.put(&key, ext, &bytes);
    }
    Ok((meta, code))
}

/// SHA-256 of `parts`, each prefixed by its length (so `["ab", "c"]` and `["a", "bc"]`
/// differ), in hex.
fn digest<'a>(parts: impl IntoIterator<Item = &'a str>) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Write an entry at `path` through a temporary file and a rename; the first line
/// records the SHA-256 of `bytes` ([`get`] checks it). Failures are ignored: a cache that
/// cannot be written costs a compilation, never a build.
pub fn put(path: &Path, bytes: &[u8]) {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let mut file = format!("{FORMAT} sha256={}\n", hex(&Sha256::digest(bytes))).into_bytes();
    file.extend_from_slice(bytes);
    let tmp = path.with_extension(format!("tmp{}.{:?}", std::process::id(), std::thread::current().id()));
    match std::fs::write(&tmp, &file) {
        Ok(()) => {
            if std::fs::rename(&tmp, path).is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
        }
        Err(_) => {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

/// The entry at `path` if there is one and its recorded SHA-256 matches what follows. A
/// damaged entry is reported, removed, and `None` (the caller compiles again): code
/// loaded from disk is code this process runs, and a flipped bit must not run silently.
pub fn get(path: &Path) -> Option<Vec<u8>> {
    let found = read_entry(path);
    match found {
        Some(_) => HITS.fetch_add(1, Ordering::Relaxed),
        None => MISSES.fetch_add(1, Ordering::Relaxed),
    };
    found
}

fn read_entry(path: &Path) -> Option<Vec<u8>> {
    let mut file = std::fs::read(path).ok()?;
    let intact = (|| {
        let nl = file.iter().position(|b| *b == b'\n')?;
        let head = std::str::from_utf8(&file[..nl]).ok()?;
        let want = head.strip_prefix(FORMAT)?.strip_prefix(" sha256=")?;
        (hex(&Sha256::digest(&file[nl + 1..])) == want).then_some(nl + 1)
    })();
    match intact {
        Some(start) => {
            file.drain(..start);
            Some(file)
        }
        None => {
            eprintln!(
                "warning: compiled-code cache entry {} is damaged (its SHA-256 does not match the one recorded with \
                 it); discarded, compiling again",
                path.display()
            );
            let _ = std::fs::remove_file(path);
            None
        }
    }
}

/// Entries and bytes under `dir` (for `ejc cache ls`).
pub fn usage(dir: &Path) -> (usize, u64) {
    let mut n = (0, 0);
    let Ok(entries) = std::fs::read_dir(dir) else { return n };
    for e in entries.flatten() {
        let Ok(meta) = e.metadata() else { continue };
        if meta.is_dir() {
            let (c, b) = usage(&e.path());
            n = (n.0 + c, n.1 + b);
        } else {
            n = (n.0 + 1, n.1 + meta.len());
        }
    }
    n
}

/// The back ends whose compiled code is cached, as directory names under the cache
/// directory (`ptxas`: ptxas's reports of PTX files, for `ejc build --report` and the tests).
pub const KINDS: [&str; 4] = ["ptx", "cpu", "mlir", "ptxas"];

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("ejc-code-cache-{name}-{}", std::process::id()))
    }

    #[test]
    fn entries_round_trip_and_keys_separate_parts() {
        let d = tmp("rt");
        let c = CodeCache::at(&d);
        assert_ne!(CodeCache::key(&["ab", "c"]), CodeCache::key(&["a", "bc"]));
        let k = CodeCache::key(&["x"]);
        assert_eq!(k, CodeCache::key(&["x"]));
        assert!(c.get(&k, "o").is_none());
        c.put(&k, "o", b"\x00\x01object\n\xff");
        assert_eq!(c.get(&k, "o").unwrap(), b"\x00\x01object\n\xff");
        assert_eq!(usage(&d).0, 1);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_damaged_entry_is_removed_not_returned() {
        let d = tmp("damaged");
        let c = CodeCache::at(&d);
        let k = CodeCache::key(&["y"]);
        c.put(&k, "ptx", b"// good code");
        let p = c.path(&k, "ptx");
        let mut bytes = std::fs::read(&p).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        assert!(c.get(&k, "ptx").is_none());
        assert!(!p.exists(), "the damaged entry is removed");
        let _ = std::fs::remove_dir_all(&d);
    }
}
