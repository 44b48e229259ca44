//! Where ejc keeps what it caches on a machine (the runtime's tuning cache, the MLIR
//! back end's compiled code): one policy for every crate.
//!
//! ```
//! match ejc_ir::cache_dir::default_dir() {
//!     Some(dir) => assert!(!dir.as_os_str().is_empty()),
//!     None => eprintln!("warning: {}", ejc_ir::cache_dir::NO_DIR),
//! }
//! ```

use std::ffi::OsString;
use std::path::PathBuf;

/// Why there is no cache directory, for a one-line warning (callers keep their caches
/// in memory for the process, and say so after this text).
pub const NO_DIR: &str = "no cache directory: none of EJC_CACHE_DIR, XDG_CACHE_HOME or HOME is set (set \
                          EJC_CACHE_DIR to keep what ejc caches)";

/// `$EJC_CACHE_DIR`, else `$XDG_CACHE_HOME/ejc`, else `$HOME/.cache/ejc`, else none: a
/// process without any of them (a service, a sandbox) gets no persistent cache rather
/// than one in whatever its working directory happens to be ([`NO_DIR`] says so).
pub fn default_dir() -> Option<PathBuf> {
    default_dir_from(std::env::var_os("EJC_CACHE_DIR"), std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME"))
}

/// [`default_dir`] with the environment passed in, so tests need not touch the process
/// environment. Empty values count as unset, and a relative XDG_CACHE_HOME is ignored, as
/// the XDG base-directory spec says.
pub fn default_dir_from(ejc: Option<OsString>, xdg: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(ejc) {
        return Some(dir);
    }
    if let Some(xdg) = set(xdg).filter(|p| p.is_absolute()) {
        return Some(xdg.join("ejc"));
    }
    set(home).map(|home| home.join(".cache").join("ejc"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> Option<OsString> {
        Some(OsString::from(s))
    }

    fn some(p: &str) -> Option<PathBuf> {
        Some(PathBuf::from(p))
    }

    #[test]
    fn default_dir_order() {
        assert_eq!(default_dir_from(os("/e"), os("/x"), os("/h")), some("/e"));
        assert_eq!(default_dir_from(os("rel/e"), None, None), some("rel/e"));
        assert_eq!(default_dir_from(None, os("/x"), os("/h")), some("/x/ejc"));
        assert_eq!(default_dir_from(os(""), os("/x"), os("/h")), some("/x/ejc"));
        assert_eq!(default_dir_from(None, None, os("/h")), some("/h/.cache/ejc"));
        assert_eq!(default_dir_from(None, os("relative"), os("/h")), some("/h/.cache/ejc"));
    }

    /// Without HOME (and the others) there is no cache directory: never `./.ejc-cache`,
    /// which put a cache (and the code it loads) wherever the process happened to run.
    #[test]
    fn no_home_no_directory() {
        assert_eq!(default_dir_from(None, os(""), os("")), None);
        assert_eq!(default_dir_from(None, None, None), None);
        assert_eq!(default_dir_from(None, os("relative"), None), None);
    }
}
