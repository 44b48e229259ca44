//! Caches and build outputs under stress: a read-only, damaged, hand-edited or locked
//! tuning cache; no HOME; a build that fails half-way; an unwritable `EJC_DUMP_IR`; a
//! patched object in the MLIR code cache.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use ejc_runtime::cache::PersistentCache;
use ejc_runtime::key::cpu_fingerprint;

use crate::common::*;

const SIZE: &str = "batch=1,seq=64,heads=16,head_dim=64,chunk_size=16";

/// `ejc tune` of one small mean-pooling call on `threads` CPU threads.
fn tune_args(threads: &'static str) -> Vec<&'static str> {
    vec!["tune", POOLING, "--variant", "fwd", "--dtype", "f32", "--size", SIZE, "--reps", "1", "--threads", threads]
}

fn tune(threads: &'static str, cache: &Path) -> Output {
    let o = ejc(&tune_args(threads), cache);
    assert_eq!(code(&o), 0, "ejc tune:\n{}\n{}", text(&o.stdout), text(&o.stderr));
    o
}

/// This CPU's tuning cache file in `dir`.
fn cache_file(dir: &Path) -> PathBuf {
    PersistentCache::open_read_only(dir, &cpu_fingerprint()).path().to_path_buf()
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Edit this CPU's cache file in `dir` as JSON.
fn edit_cache(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = cache_file(dir);
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(json["entries"].as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
}

/// The key `ejc tune` printed.
fn key_of(o: &Output) -> String {
    text(&o.stdout).lines().find_map(|l| l.strip_prefix("key:  ")).expect("tune prints its key").to_string()
}

/// A read-only tuning cache (a shared, pre-tuned one) is read and used, listed by `ejc
/// cache ls`, and a result that cannot be stored says so. The cache's lock file is made a
/// directory, which no one (root included) can open for writing; for other users the
/// directory is read-only too.
#[test]
fn a_read_only_cache_is_read_and_used() {
    let cache = TempDir::new("ro-cache");
    tune("1", cache.path());
    let lock = with_suffix(&cache_file(cache.path()), ".lock");
    std::fs::remove_file(&lock).unwrap();
    std::fs::create_dir(&lock).unwrap();
    set_mode(cache.path(), 0o555);

    let ls = ejc(&["cache", "ls"], cache.path());
    let listed = text(&ls.stdout);
    set_mode(cache.path(), 0o755);
    assert_eq!(code(&ls), 0, "{}", text(&ls.stderr));
    assert!(listed.contains("(1 entries)") && listed.contains("block_h="), "cache ls lists what it holds:\n{listed}");

    set_mode(cache.path(), 0o555);
    let again = ejc(&tune_args("1"), cache.path());
    let more = ejc(&tune_args("2"), cache.path()); // a new key: tuned, and cannot be stored
    set_mode(cache.path(), 0o755);
    assert_eq!(code(&again), 0, "{}", text(&again.stderr));
    let out = text(&again.stdout);
    assert!(out.contains("(persistent cache)"), "the cached winner is used:\n{out}\n{}", text(&again.stderr));
    assert!(out.contains("stored in"), "{out}");
    assert_eq!(code(&more), 0, "{}", text(&more.stderr));
    let (out, err) = (text(&more.stdout), text(&more.stderr));
    assert!(out.contains("(autotune)") && out.contains("not stored"), "{out}");
    assert!(
        err.contains("not writable") && err.contains("kept in memory only"),
        "the failed write is a warning:\n{err}"
    );
    assert_eq!(PersistentCache::open_read_only(cache.path(), &cpu_fingerprint()).entries().count(), 1);
}

/// One malformed entry costs only itself: the others are listed and used; `ejc cache ls`
/// writes nothing (no lock file, nothing moved aside); a tune that rewrites the file keeps
/// the bad entry's text in `.corrupt`.
#[test]
fn a_malformed_entry_costs_only_itself() {
    let cache = TempDir::new("bad-entry");
    let one = key_of(&tune("1", cache.path()));
    let two = key_of(&tune("2", cache.path()));
    assert_ne!(one, two);
    edit_cache(cache.path(), |entries| {
        entries[&two]["timings"] = serde_json::json!("broken");
    });
    let file = cache_file(cache.path());
    std::fs::remove_file(with_suffix(&file, ".lock")).unwrap();
    let before = std::fs::read(&file).unwrap();
    // The tuning file, and the compiled-code cache the tunes filled (`cpu/`).
    let listed = names(cache.path());
    assert!(listed.contains(&file.file_name().unwrap().to_string_lossy().into_owned()), "{listed:?}");

    let ls = ejc(&["cache", "ls"], cache.path());
    assert_eq!(code(&ls), 0, "{}", text(&ls.stderr));
    let (out, err) = (text(&ls.stdout), text(&ls.stderr));
    assert!(out.contains("(1 entries)"), "the good entry is listed:\n{out}");
    assert!(err.contains(&format!("entry `{two}`")) && err.contains("skipped"), "{err}");
    assert_eq!(names(cache.path()), listed, "cache ls wrote something");
    assert_eq!(std::fs::read(&file).unwrap(), before, "cache ls changed the file");
    let nowhere = cache.path().join("not-there");
    assert_eq!(code(&ejc(&["cache", "ls"], &nowhere)), 0);
    assert!(!nowhere.exists(), "cache ls created a directory");

    let used = ejc(&tune_args("1"), cache.path());
    assert!(text(&used.stdout).contains("(persistent cache)"), "the good entry is used:\n{}", text(&used.stdout));
    let retuned = tune("2", cache.path());
    assert!(text(&retuned.stdout).contains("(autotune)"));
    let aside = with_suffix(&file, ".corrupt");
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&aside).unwrap()).unwrap();
    assert_eq!(kept["entries"][&two]["timings"], "broken", "the bad entry's text is kept");
    assert!(text(&retuned.stderr).contains(&aside.display().to_string()), "{}", text(&retuned.stderr));
    assert_eq!(PersistentCache::open(cache.path(), &cpu_fingerprint()).entries().count(), 2);
}

/// Without HOME (and XDG_CACHE_HOME, EJC_CACHE_DIR) nothing lands in the working
/// directory: the tuning cache is in memory, with a warning.
#[test]
fn without_home_no_cache_in_the_working_directory() {
    let cwd = TempDir::new("no-home");
    let run = |args: &[&str]| {
        let mut c = ejc_cmd(args, cwd.path());
        c.env_remove("EJC_CACHE_DIR").env_remove("HOME").env_remove("XDG_CACHE_HOME").current_dir(cwd.path());
        c.output().unwrap()
    };
    let o = run(&tune_args("1"));
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("no cache directory"), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("not stored"), "{}", text(&o.stdout));
    let ls = run(&["cache", "ls"]);
    assert_eq!(code(&ls), 2);
    assert!(text(&ls.stderr).contains("no tuning cache directory"), "{}", text(&ls.stderr));
    let mlir = run(&["run", POOLING, "--backend", "mlir", "--variant", "fwd", "--dtype", "f32", "--size", SIZE]);
    assert_eq!(code(&mlir), 0, "{}", text(&mlir.stderr));
    assert_eq!(names(cwd.path()), Vec::<String>::new(), "nothing is written to the working directory");
}

/// A tune that must wait for another process's cache lock says so (and then finishes).
#[test]
fn a_waiting_tune_says_what_it_waits_for() {
    let cache = TempDir::new("lock-wait");
    let lock_path = with_suffix(PersistentCache::open(cache.path(), &cpu_fingerprint()).path(), ".lock");
    let lock = std::fs::OpenOptions::new().write(true).open(&lock_path).unwrap();
    lock.lock().unwrap();
    let mut child =
        ejc_cmd(&tune_args("1"), cache.path()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut said = None;
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if line.contains("waiting for the tuning cache lock") {
            said = Some(line);
            break;
        }
    }
    drop(lock); // let it go on either way
    let out = child.wait_with_output().unwrap();
    let said = said.expect("a tune waiting for the lock says so on stderr");
    assert!(said.contains(&lock_path.display().to_string()) && said.contains("another process"), "{said}");
    assert_eq!(code(&out), 0);
    assert!(text(&out.stdout).contains("stored in"), "{}", text(&out.stdout));
}

/// A cache entry edited to a configuration that is not a candidate is not the winner:
/// a warning, and the call is tuned again.
#[test]
fn a_cached_winner_that_is_not_a_candidate_is_retuned() {
    let cache = TempDir::new("not-a-candidate");
    let key = key_of(&tune("1", cache.path()));
    edit_cache(cache.path(), |entries| {
        entries[&key]["config"] = serde_json::json!({"block_h": 32});
    });
    let o = tune("1", cache.path());
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(err.contains("block_h=32") && err.contains("not one of this call's candidates"), "{err}");
    assert!(out.contains("(autotune)") && !out.contains("winner: block_h=32"), "{out}");
    let entry = PersistentCache::open_read_only(cache.path(), &cpu_fingerprint()).get(&key).cloned().unwrap();
    assert_ne!(entry.config.get("block_h"), Some(&32), "the bad entry is replaced");
}

/// A winner tuned on one thread is not reused for two: the thread count is in the key.
#[test]
fn the_thread_count_is_part_of_the_key() {
    let cache = TempDir::new("threads");
    let one = tune("1", cache.path());
    let two = tune("2", cache.path());
    assert_ne!(key_of(&one), key_of(&two));
    assert!(text(&two.stdout).contains("(autotune)"), "{}", text(&two.stdout));
    assert!(text(&tune("2", cache.path()).stdout).contains("(persistent cache)"));
    let ls = text(&ejc(&["cache", "ls"], cache.path()).stdout);
    assert!(ls.contains("(2 entries)") && ls.contains("(1 thread)") && ls.contains("(2 threads)"), "{ls}");
}

/// A build that fails removes what it wrote — its artifacts, the temporary manifest, the
/// output directory it created — and leaves what was there before.
#[test]
fn a_failed_build_leaves_nothing_behind() {
    let cache = TempDir::new("build-fail-cache");
    // Existing directory: the manifest cannot be written (a directory has its name), after
    // every artifact was.
    let out = TempDir::new("build-fail");
    std::fs::create_dir_all(out.path().join("manifest.json/inside")).unwrap();
    std::fs::create_dir_all(out.path().join("ir")).unwrap();
    std::fs::write(out.path().join("ir/mine.tir"), b"not ejc's").unwrap();
    let dir = out.path().to_str().unwrap();
    let o = ejc(&["build", POOLING, "--target", "ir", "--variant", "fwd", "-o", dir, "-q"], cache.path());
    assert_eq!(code(&o), 2, "{}", text(&o.stderr));
    assert_eq!(names(out.path()), ["ir", "manifest.json"], "no manifest.json.tmp");
    assert_eq!(names(&out.path().join("ir")), ["mine.tir"], "only what was there before");
    assert_eq!(names(&out.path().join("manifest.json")), ["inside"]);

    // A new directory, and a failure after it was made: it is removed again.
    let parent = TempDir::new("build-fail-new");
    let fresh = parent.path().join("a/b");
    let bad_dump = parent.path().join("a-file");
    std::fs::write(&bad_dump, b"").unwrap();
    let mut c = ejc_cmd(&["build", POOLING, "--target", "ir", "-o", fresh.to_str().unwrap()], cache.path());
    let o = c.env("EJC_DUMP_IR", bad_dump.join("dump")).output().unwrap();
    assert_eq!(code(&o), 2, "{}", text(&o.stderr));
    assert_eq!(names(parent.path()), ["a-file"], "the directories this build made are gone");
}

/// An `EJC_DUMP_IR` that cannot be written is reported as such (with the path and the OS
/// error), not as a kernel that does not build.
#[test]
fn an_unwritable_dump_dir_is_its_own_error() {
    let cache = TempDir::new("dump");
    let file = cache.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let dump = file.join("dump");
    let out = cache.path().join("out");
    for args in [vec!["check", POOLING], vec!["build", POOLING, "--target", "ir", "-o", out.to_str().unwrap()]] {
        let o = ejc_cmd(&args, cache.path()).env("EJC_DUMP_IR", &dump).output().unwrap();
        let err = text(&o.stderr);
        assert_eq!(code(&o), 2, "{err}");
        assert!(err.contains("could not write the IR dump to") && err.contains(&dump.display().to_string()), "{err}");
        assert!(err.contains("Not a directory"), "the OS error is given: {err}");
        assert!(!err.contains("does not build"), "{err}");
    }
}

/// A cached MLIR object whose bytes changed (a flipped bit, a patched constant) is not
/// loaded: a warning, it is compiled again, and the result is right.
#[test]
fn a_patched_mlir_object_is_recompiled() {
    let cache = TempDir::new("mlir-object");
    let args = ["run", POOLING, "--backend", "mlir", "--variant", "fwd", "--dtype", "f32", "--size", SIZE];
    let first = ejc(&args, cache.path());
    assert_eq!(code(&first), 0, "{}", text(&first.stderr));
    let objects: Vec<PathBuf> = std::fs::read_dir(cache.path().join("mlir"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "o"))
        .collect();
    assert_eq!(objects.len(), 1, "{objects:?}");
    let mut bytes = std::fs::read(&objects[0]).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&objects[0], &bytes).unwrap();

    let second = ejc(&args, cache.path());
    let (out, err) = (text(&second.stdout), text(&second.stderr));
    assert_eq!(code(&second), 0, "right results:\n{out}\n{err}");
    assert!(err.contains("damaged") && err.contains(&objects[0].display().to_string()), "a warning:\n{err}");
    assert!(!format!("{out}{err}").contains("from the on-disk cache"), "compiled again:\n{out}{err}");
    let third = ejc(&args, cache.path());
    assert!(format!("{}{}", text(&third.stdout), text(&third.stderr)).contains("from the on-disk cache"));
}

#[test]
fn clearing_an_absent_cache_writes_nothing() {
    let dir = TempDir::new("clear-absent");
    let cache = dir.path().join("never-made");
    let o = ejc(&["cache", "clear", "--cache-dir", cache.to_str().unwrap()], dir.path());
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("removed 0 entries"), "{}", text(&o.stdout));
    assert!(!cache.exists(), "`ejc cache clear` made {}", cache.display());
}
