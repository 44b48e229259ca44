//! The persistent tuning cache on real files: round trips, concurrent writer processes,
//! damaged files, unwritable locations, clearing, and the default directory.
//!
//! Every test works in its own fresh directory under the system temp dir (removed on drop),
//! so the tests run in parallel without seeing each other.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use ejc_runtime::cache::{CacheEntry, PersistentCache, Timing};

const MACHINE: &str = "Test GPU 80GB|sm_90|driver 570.86";

/// A fresh directory, removed (with everything in it) on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ejc-cache-test-{tag}-{}-{n}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn entry(block_m: u32, call: &str) -> CacheEntry {
    CacheEntry {
        config: BTreeMap::from([("block_m".to_string(), block_m), ("block_n".to_string(), 32)]),
        timings: vec![
            Timing { config_id: format!("m{block_m}_n32"), median_ms: Some(0.25), status: "ok".into() },
            Timing { config_id: "m128_n128".into(), median_ms: None, status: "wrong result: rel_err=3.1e-1".into() },
        ],
        call: call.to_string(),
        device: MACHINE.into(),
        op: "flash_attention@v1".into(),
        call_hash: "0123456789abcdef".into(),
        candidates: "cafe".into(),
        compiler: "ejc 0.1.0".into(),
        created: 1_700_000_000,
    }
}

fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not valid JSON ({e}):\n{text}", path.display()))
}

/// The sibling `<file name><suffix>` of `path`.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

#[test]
fn put_get_round_trip_and_reopen() {
    let tmp = TempDir::new("roundtrip");
    let mut cache = PersistentCache::open(tmp.path(), MACHINE);
    assert!(cache.is_persistent());
    assert!(cache.warnings().is_empty(), "{:?}", cache.warnings());
    assert!(cache.get("k1").is_none());
    assert_eq!(cache.path().parent(), Some(tmp.path()));
    let name = cache.path().file_name().unwrap().to_str().unwrap().to_string();
    assert!(name.starts_with("tuning-") && name.ends_with(".json") && name.len() == 7 + 16 + 5, "{name}");

    let e1 = entry(64, "flash_attention q=[2,1024,8,64] bf16");
    cache.put("k1", e1.clone()).unwrap();
    assert_eq!(cache.get("k1"), Some(&e1));
    cache.put("k0", entry(32, "other")).unwrap();

    let reopened = PersistentCache::open(tmp.path(), MACHINE);
    assert!(reopened.warnings().is_empty(), "{:?}", reopened.warnings());
    assert_eq!(reopened.get("k1"), Some(&e1));
    let keys: Vec<&String> = reopened.entries().map(|(k, _)| k).collect();
    assert_eq!(keys, ["k0", "k1"], "entries come in key order");

    let json = read_json(cache.path());
    assert_eq!(json["format"], "ejc-tuning-cache/1");
    assert_eq!(json["machine"], MACHINE);
    assert_eq!(json["entries"]["k1"]["config"]["block_m"], 64);
    assert!(json["entries"]["k1"]["timings"][1]["median_ms"].is_null());
    let text = std::fs::read_to_string(cache.path()).unwrap();
    assert!(text.contains("\n  \"machine\""), "pretty-printed:\n{text}");

    // A second put with the same key replaces the entry.
    let e1b = entry(128, "replaced");
    cache.put("k1", e1b.clone()).unwrap();
    assert_eq!(PersistentCache::open(tmp.path(), MACHINE).get("k1"), Some(&e1b));
}

#[test]
fn two_machines_two_files() {
    let tmp = TempDir::new("machines");
    let mut a = PersistentCache::open(tmp.path(), "machine A");
    let mut b = PersistentCache::open(tmp.path(), "machine B");
    assert_ne!(a.path(), b.path());
    a.put("k", entry(16, "on A")).unwrap();
    b.put("k", entry(32, "on B")).unwrap();
    assert!(a.path().exists() && b.path().exists());
    assert_eq!(PersistentCache::open(tmp.path(), "machine A").get("k").unwrap().call, "on A");
    assert_eq!(PersistentCache::open(tmp.path(), "machine B").get("k").unwrap().call, "on B");
    assert_eq!(read_json(b.path())["machine"], "machine B");
}

#[test]
fn put_merges_with_what_others_wrote() {
    let tmp = TempDir::new("merge");
    let mut a = PersistentCache::open(tmp.path(), MACHINE);
    let mut b = PersistentCache::open(tmp.path(), MACHINE); // loaded before `a` writes: stale
    a.put("from-a", entry(16, "a")).unwrap();
    b.put("from-b", entry(32, "b")).unwrap();
    assert!(b.get("from-a").is_some(), "put re-reads the file, so b now sees a's entry");
    let disk = PersistentCache::open(tmp.path(), MACHINE);
    assert!(disk.get("from-a").is_some() && disk.get("from-b").is_some());

    // Ours wins on the same key.
    b.put("from-a", entry(64, "b overrides")).unwrap();
    assert_eq!(PersistentCache::open(tmp.path(), MACHINE).get("from-a").unwrap().call, "b overrides");

    // reload: disk wins, merging nothing.
    a.put("only-a", entry(16, "a again")).unwrap();
    assert!(b.get("only-a").is_none());
    b.reload();
    assert!(b.get("only-a").is_some());
    assert_eq!(b.get("from-a").unwrap().call, "b overrides");
}

#[test]
fn put_does_not_resurrect_cleared_entries() {
    let tmp = TempDir::new("resurrect");
    let mut a = PersistentCache::open(tmp.path(), MACHINE);
    a.put("old", entry(16, "old")).unwrap();
    let mut stale = PersistentCache::open(tmp.path(), MACHINE);
    assert!(stale.get("old").is_some());
    assert_eq!(a.clear(None).unwrap(), 1);
    stale.put("new", entry(32, "new")).unwrap();
    let disk = PersistentCache::open(tmp.path(), MACHINE);
    assert!(disk.get("old").is_none(), "a stale in-memory copy must not undo `cache clear`");
    assert!(disk.get("new").is_some());
}

/// Build `examples/cache_writer.rs` once (with the profile this test binary was built
/// with, and with the features of `cargo test --workspace`, as CI runs it, so no second
/// copy of the dependencies is compiled) and return its path, which cargo reports in its
/// JSON messages.
fn cache_writer() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-q", "--workspace", "--example", "cache_writer", "--message-format=json"]);
        // The test binary is `target/<profile dir>/deps/cache-<hash>`.
        let exe = std::env::current_exe().unwrap();
        match exe.parent().and_then(Path::parent).and_then(Path::file_name).and_then(|n| n.to_str()) {
            Some("release") => {
                cmd.arg("--release");
            }
            Some("debug") | None => {}
            Some(profile) => {
                cmd.args(["--profile", profile]);
            }
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "building cache_writer failed:\n{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "cache_writer")
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .expect("cargo named no cache_writer executable")
    })
}

/// Four processes write 25 entries each into one cache file at the same time, two of them
/// reopening the cache before every put and two keeping one stale in-memory copy. Without
/// the lock + re-read in `put`, each writer's rename would drop the others' entries.
#[test]
fn concurrent_writer_processes_lose_nothing() {
    const WRITERS: usize = 4;
    const PUTS: usize = 25;
    let bin = cache_writer();
    for round in 0..3 {
        let tmp = TempDir::new("concurrent");
        let children: Vec<_> = (0..WRITERS)
            .map(|w| {
                let mode = if w % 2 == 0 { "reopen" } else { "keep" };
                Command::new(bin)
                    .arg(tmp.path())
                    .args([MACHINE, &format!("w{w}"), &PUTS.to_string(), mode])
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (w, child) in children.into_iter().enumerate() {
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success(), "round {round}: writer {w} exited with {}", out.status);
        }
        let cache = PersistentCache::open(tmp.path(), MACHINE);
        assert!(cache.warnings().is_empty(), "{:?}", cache.warnings());
        let mut missing = Vec::new();
        for w in 0..WRITERS {
            for i in 0..PUTS {
                let key = format!("w{w}-{i}");
                match cache.get(&key) {
                    Some(e) => assert_eq!(e.config["index"], i as u32),
                    None => missing.push(key),
                }
            }
        }
        assert!(missing.is_empty(), "round {round}: lost updates: {missing:?}");
        assert_eq!(cache.entries().count(), WRITERS * PUTS);
        let json = read_json(cache.path());
        assert_eq!(json["entries"].as_object().unwrap().len(), WRITERS * PUTS);
        // No temp files left behind.
        let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }
}

/// The same race between threads of one process, each with its own `PersistentCache`:
/// the file lock is per open file, so threads exclude each other too.
#[test]
fn concurrent_writer_threads_lose_nothing() {
    let tmp = TempDir::new("threads");
    std::thread::scope(|s| {
        for t in 0..4 {
            let dir = tmp.path();
            s.spawn(move || {
                let mut cache = PersistentCache::open(dir, MACHINE);
                for i in 0..20 {
                    cache.put(&format!("t{t}-{i}"), entry(16, "thread")).unwrap();
                }
            });
        }
    });
    assert_eq!(PersistentCache::open(tmp.path(), MACHINE).entries().count(), 80);
}

/// Write `bytes` as the cache file, open it, and check the damage is reported, moved aside,
/// and repaired by the next put. Returns the warning.
fn check_damaged(tag: &str, bytes: &[u8], problem: &str) -> String {
    let tmp = TempDir::new(tag);
    let path = PersistentCache::open(tmp.path(), MACHINE).path().to_path_buf();
    std::fs::write(&path, bytes).unwrap();

    let mut cache = PersistentCache::open(tmp.path(), MACHINE);
    assert!(cache.is_persistent(), "{tag}: a damaged file is not a reason to stop persisting");
    assert_eq!(cache.entries().count(), 0, "{tag}");
    assert_eq!(cache.warnings().len(), 1, "{tag}: {:?}", cache.warnings());
    let warning = cache.warnings()[0].clone();
    assert!(warning.contains(&path.display().to_string()), "{tag}: the warning names the file: {warning}");
    assert!(warning.contains(problem), "{tag}: the warning says `{problem}`: {warning}");
    let aside = sibling(&path, ".corrupt");
    assert!(warning.contains(&aside.display().to_string()), "{tag}: {warning}");
    assert_eq!(std::fs::read(&aside).unwrap(), bytes, "{tag}: the bad file is kept, byte for byte");
    assert!(!path.exists(), "{tag}: moved, not copied");

    cache.put("k", entry(64, "rebuilt")).unwrap();
    assert_eq!(read_json(&path)["format"], "ejc-tuning-cache/1");
    let reopened = PersistentCache::open(tmp.path(), MACHINE);
    assert!(reopened.warnings().is_empty(), "{tag}: {:?}", reopened.warnings());
    assert_eq!(reopened.get("k").unwrap().call, "rebuilt");
    warning
}

/// A valid cache file with two entries, as bytes.
fn valid_file_bytes() -> Vec<u8> {
    let tmp = TempDir::new("valid");
    let mut cache = PersistentCache::open(tmp.path(), MACHINE);
    cache.put("k1", entry(64, "one")).unwrap();
    cache.put("k2", entry(32, "two")).unwrap();
    std::fs::read(cache.path()).unwrap()
}

#[test]
fn truncated_file_is_set_aside_and_rebuilt() {
    let bytes = valid_file_bytes();
    check_damaged("truncated", &bytes[..bytes.len() / 2], "not valid JSON");
}

#[test]
fn garbage_file_is_set_aside_and_rebuilt() {
    check_damaged("garbage", &[0xff, 0xfe, 0x00, 0x13, b'{', 0x80, 0x81, b'\n', 0x00], "not valid JSON");
    check_damaged("empty", b"", "not valid JSON");
}

#[test]
fn wrong_shape_is_set_aside_and_rebuilt() {
    check_damaged("array", b"[1, 2, 3]", "not a JSON object");
    check_damaged("no-format", br#"{"entries": {}}"#, "no `format` field");
    let other_machine = r#"{"format": "ejc-tuning-cache/1", "machine": "another GPU", "entries": {}}"#;
    check_damaged("other-machine", other_machine.as_bytes(), "another GPU");
}

#[test]
fn wrong_format_version_is_set_aside_and_rebuilt() {
    let text = String::from_utf8(valid_file_bytes()).unwrap().replace("ejc-tuning-cache/1", "ejc-tuning-cache/7");
    check_damaged("version", text.as_bytes(), "ejc-tuning-cache/7");
}

#[test]
fn an_earlier_corrupt_file_is_not_overwritten() {
    let tmp = TempDir::new("corrupt-twice");
    let path = PersistentCache::open(tmp.path(), MACHINE).path().to_path_buf();
    std::fs::write(&path, b"first damage").unwrap();
    let _ = PersistentCache::open(tmp.path(), MACHINE);
    std::fs::write(&path, b"second damage").unwrap();
    let cache = PersistentCache::open(tmp.path(), MACHINE);
    assert_eq!(std::fs::read(sibling(&path, ".corrupt")).unwrap(), b"first damage");
    assert_eq!(std::fs::read(sibling(&path, ".corrupt.1")).unwrap(), b"second damage");
    assert!(cache.warnings()[0].contains(".corrupt.1"), "{:?}", cache.warnings());
}

#[test]
fn damage_found_at_put_time_is_set_aside_too() {
    let tmp = TempDir::new("damage-at-put");
    let mut cache = PersistentCache::open(tmp.path(), MACHINE);
    cache.put("k1", entry(16, "one")).unwrap();
    std::fs::write(cache.path(), b"{\"format\": \"ejc-tun").unwrap(); // damaged behind our back
    cache.put("k2", entry(32, "two")).unwrap();
    assert!(cache.warnings().iter().any(|w| w.contains("not valid JSON")), "{:?}", cache.warnings());
    assert!(sibling(cache.path(), ".corrupt").exists());
    let reopened = PersistentCache::open(tmp.path(), MACHINE);
    assert!(reopened.get("k2").is_some());
}

/// A directory whose parent is a regular file cannot be created, even by root (for whom
/// permission bits would not stop a write).
#[test]
fn unwritable_location_is_memory_only() {
    let tmp = TempDir::new("unwritable");
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let dir = file.join("cache");

    let mut cache = PersistentCache::open(&dir, MACHINE);
    assert!(!cache.is_persistent());
    assert_eq!(cache.warnings().len(), 1, "{:?}", cache.warnings());
    let warning = cache.warnings()[0].clone();
    assert!(warning.contains(&dir.display().to_string()) && warning.contains("memory only"), "{warning}");

    let e = entry(64, "kept in memory");
    let err = cache.put("k", e.clone()).unwrap_err();
    assert!(err.contains(&dir.display().to_string()) && err.contains("kept in memory only"), "{err}");
    assert_eq!(cache.get("k"), Some(&e));
    cache.reload(); // nothing to reload from: memory is kept
    assert_eq!(cache.get("k"), Some(&e));
    assert_eq!(cache.warnings().len(), 1, "one warning, not one per call");

    let err = cache.clear(None).unwrap_err();
    assert!(err.contains("removed 1 entries from memory only"), "{err}");
    assert!(cache.get("k").is_none());
    assert!(!dir.exists());
}

#[test]
fn clear_all_or_by_prefix() {
    let tmp = TempDir::new("clear");
    let mut cache = PersistentCache::open(tmp.path(), MACHINE);
    for key in ["gpu|flash@v1|a", "gpu|flash@v1|b", "gpu|pool@v1|a"] {
        cache.put(key, entry(16, key)).unwrap();
    }
    // Another process adds an entry after we loaded: clear sees it too.
    PersistentCache::open(tmp.path(), MACHINE).put("gpu|flash@v1|c", entry(16, "late")).unwrap();

    assert_eq!(cache.clear(Some("gpu|flash@")).unwrap(), 3);
    let keys: Vec<String> = cache.entries().map(|(k, _)| k.clone()).collect();
    assert_eq!(keys, ["gpu|pool@v1|a"]);
    assert_eq!(PersistentCache::open(tmp.path(), MACHINE).entries().count(), 1);
    assert_eq!(cache.clear(Some("nothing-matches")).unwrap(), 0);

    assert_eq!(cache.clear(None).unwrap(), 1);
    assert_eq!(cache.entries().count(), 0);
    let json = read_json(cache.path());
    assert_eq!(json["entries"].as_object().unwrap().len(), 0);
    assert_eq!(json["format"], "ejc-tuning-cache/1");
    assert_eq!(cache.clear(None).unwrap(), 0);
}

/// `default_dir()` reads the environment; the environment of a child process is set here,
/// never this test process's own (other tests run on threads beside this one).
#[test]
fn default_dir_honours_ejc_cache_dir() {
    let run = |envs: &[(&str, &str)]| {
        let mut cmd = Command::new(cache_writer());
        cmd.arg("--default-dir").env_remove("EJC_CACHE_DIR").env_remove("XDG_CACHE_HOME").env_remove("HOME");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap().trim_end().to_string()
    };
    assert_eq!(run(&[("EJC_CACHE_DIR", "/tmp/ejc-x"), ("XDG_CACHE_HOME", "/xdg"), ("HOME", "/home/u")]), "/tmp/ejc-x");
    assert_eq!(run(&[("XDG_CACHE_HOME", "/xdg"), ("HOME", "/home/u")]), "/xdg/ejc");
    assert_eq!(run(&[("HOME", "/home/u")]), "/home/u/.cache/ejc");
    // No HOME: no cache directory at all (never `./.ejc-cache` in whatever directory the
    // process runs in); the runtime keeps its tuning cache in memory, with a warning.
    assert_eq!(run(&[]), "(none)");
    assert_eq!(run(&[("XDG_CACHE_HOME", "relative")]), "(none)");
}

#[test]
fn without_a_directory_the_cache_is_in_memory() {
    let mut cache = PersistentCache::in_memory(MACHINE, "no cache directory: HOME is not set");
    assert!(!cache.is_persistent());
    assert_eq!(cache.warnings().len(), 1);
    assert!(cache.warnings()[0].starts_with("no cache directory: HOME is not set"), "{:?}", cache.warnings());
    let err = cache.put("k", entry(16, "kept")).unwrap_err();
    assert!(err.contains("HOME is not set") && err.contains("memory only"), "{err}");
    assert!(cache.get("k").is_some());
}

/// A cache file with two good entries and one that is not a [`CacheEntry`] (as a hand edit
/// or a damaged writer leaves it): the text of the file.
fn file_with_a_bad_entry() -> String {
    let mut json: serde_json::Value = serde_json::from_slice(&valid_file_bytes()).unwrap();
    json["entries"]["bad"] = serde_json::json!({"config": "nope", "timings": 3});
    serde_json::to_string_pretty(&json).unwrap()
}

/// One malformed entry costs only itself: the others are read and used, the file is not
/// moved aside, and the next write keeps the bad entry's text in `.corrupt` before it
/// rewrites the file without it.
#[test]
fn a_bad_entry_costs_only_itself() {
    let tmp = TempDir::new("bad-entry");
    let path = PersistentCache::open(tmp.path(), MACHINE).path().to_path_buf();
    let text = file_with_a_bad_entry();
    std::fs::write(&path, &text).unwrap();

    let mut cache = PersistentCache::open(tmp.path(), MACHINE);
    assert!(cache.is_persistent());
    assert_eq!(cache.get("k1").unwrap().call, "one");
    assert_eq!(cache.get("k2").unwrap().call, "two");
    assert!(cache.get("bad").is_none());
    assert_eq!(cache.warnings().len(), 1, "{:?}", cache.warnings());
    let w = &cache.warnings()[0];
    assert!(w.contains("entry `bad`") && w.contains("skipped"), "{w}");
    assert!(path.exists(), "the file stays where it is");
    assert!(!sibling(&path, ".corrupt").exists(), "nothing is set aside by reading");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text, "opening does not rewrite");

    // A write drops the bad entry from the file, and keeps its text aside.
    cache.put("k3", entry(16, "three")).unwrap();
    let aside = sibling(&path, ".corrupt");
    let kept = read_json(&aside);
    assert_eq!(kept["entries"]["bad"], serde_json::json!({"config": "nope", "timings": 3}));
    assert_eq!(kept["machine"], MACHINE);
    assert!(cache.warnings().iter().any(|w| w.contains(&aside.display().to_string())), "{:?}", cache.warnings());
    let json = read_json(&path);
    let keys: Vec<&String> = json["entries"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["k1", "k2", "k3"]);
    let reopened = PersistentCache::open(tmp.path(), MACHINE);
    assert!(reopened.warnings().is_empty(), "{:?}", reopened.warnings());
    assert_eq!(reopened.entries().count(), 3);
}

/// `open_read_only` (what `ejc cache ls` uses) writes nothing: no directory, no lock
/// file, no `.corrupt` — not for a missing directory, a bad entry or a damaged file.
#[test]
fn read_only_open_never_writes() {
    let tmp = TempDir::new("read-only-open");
    let missing = tmp.path().join("not-yet");
    let cache = PersistentCache::open_read_only(&missing, MACHINE);
    assert_eq!(cache.entries().count(), 0);
    assert!(cache.warnings().is_empty(), "{:?}", cache.warnings());
    assert!(!missing.exists(), "no directory is created");

    let path = tmp.path().join(PersistentCache::open_read_only(tmp.path(), MACHINE).path().file_name().unwrap());
    std::fs::write(&path, file_with_a_bad_entry()).unwrap();
    let cache = PersistentCache::open_read_only(tmp.path(), MACHINE);
    assert_eq!(cache.entries().count(), 2);
    assert!(cache.warnings()[0].contains("entry `bad`"), "{:?}", cache.warnings());

    std::fs::write(&path, b"{ truncated").unwrap();
    let mut cache = PersistentCache::open_read_only(tmp.path(), MACHINE);
    assert_eq!(cache.entries().count(), 0);
    assert!(cache.warnings()[0].contains("left as it is"), "{:?}", cache.warnings());
    assert!(cache.put("k", entry(16, "x")).is_err(), "a read-only view does not write");
    let names: Vec<String> =
        std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, [path.file_name().unwrap().to_string_lossy().into_owned()], "nothing but the file itself");
}

/// A cache that can be read but not written (a shared, pre-tuned cache; a read-only file
/// system) is used: its entries are there, and a write fails with a warning. The lock
/// file is a directory here, which no one (root included) can open for writing; for other
/// users the directory is also made read-only.
#[test]
fn read_only_cache_is_read_and_used() {
    let tmp = TempDir::new("read-only");
    let mut writer = PersistentCache::open(tmp.path(), MACHINE);
    writer.put("k1", entry(64, "tuned before")).unwrap();
    let lock = sibling(writer.path(), ".lock");
    std::fs::remove_file(&lock).unwrap();
    std::fs::create_dir(&lock).unwrap();
    set_mode(tmp.path(), 0o555);

    let mut cache = PersistentCache::open(tmp.path(), MACHINE);
    assert_eq!(cache.get("k1").map(|e| e.call.as_str()), Some("tuned before"), "a read-only cache is read");
    assert!(!cache.is_persistent());
    assert_eq!(cache.warnings().len(), 1, "{:?}", cache.warnings());
    let w = &cache.warnings()[0];
    assert!(w.contains("not writable") && w.contains("1 entry it holds is used"), "{w}");
    let err = cache.put("k2", entry(32, "new")).unwrap_err();
    assert!(err.contains("not writable") && err.contains("memory only"), "{err}");
    assert!(cache.get("k2").is_some() && cache.get("k1").is_some());
    let err = cache.clear(None).unwrap_err();
    assert!(err.starts_with("cannot clear"), "{err}");
    set_mode(tmp.path(), 0o755);
    assert_eq!(PersistentCache::open(tmp.path(), MACHINE).entries().count(), 1, "the file is untouched");
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}
