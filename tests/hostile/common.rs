//! Running `ejc` (and `ejc-gpu`) as a child process, with the helpers every module shares.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

pub const FLASH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/flash.yaml");
pub const POOLING: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/specs/mean_pooling.yaml");

/// `ejc ARGS` in the repository root, with a private cache directory so that no test
/// touches the user's cache.
pub fn ejc(args: &[&str], cache: &Path) -> Output {
    ejc_cmd(args, cache).output().expect("ejc runs")
}

/// `EJC_HOSTILE_BIN` runs the suite against another `ejc` binary (an older build, to
/// see each test fail before its fix).
pub fn ejc_cmd(args: &[&str], cache: &Path) -> Command {
    let bin = std::env::var("EJC_HOSTILE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_ejc").to_string());
    let mut c = Command::new(bin);
    c.args(args).current_dir(env!("CARGO_MANIFEST_DIR")).env("EJC_CACHE_DIR", cache);
    c
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The exit code; a panic (101) or a signal (none) is never acceptable.
pub fn code(o: &Output) -> i32 {
    let c = o.status.code();
    assert!(c.is_some(), "ejc died of a signal: {:?}\n{}", o.status, text(&o.stderr));
    let c = c.unwrap();
    assert_ne!(c, 101, "ejc panicked:\n{}", text(&o.stderr));
    c
}

/// A fresh temporary directory, removed when dropped.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("ejc-hostile-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
