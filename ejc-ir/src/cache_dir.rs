//! Where ejc keeps what it caches on a machine (the runtime's tuning cache, the MLIR
//! back end's compiled code): one policy for every crate.
//!
//! ```
//! let dir = ejc_ir::cache_dir::default_dir();
//! assert!(!dir.as_os_str().is_empty());
//! ```

use std::ffi::OsString;
use std::path::PathBuf;

/// `$EJC_CACHE_DIR`, else `$XDG_CACHE_HOME/ejc`, else `$HOME/.cache/ejc`, else
/// `./.ejc-cache`.
pub fn default_dir() -> PathBuf {
    default_dir_from(std::env::var_os("EJC_CACHE_DIR"), std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME"))
}

/// [`default_dir`] with the environment passed in, so tests need not touch the process
/// environment. Empty values count as unset, and a relative XDG_CACHE_HOME is ignored, as
/// the XDG base-directory spec says.
pub fn default_dir_from(ejc: Option<OsString>, xdg: Option<OsString>, home: Option<OsString>) -> PathBuf {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(ejc) {
        return dir;
    }
    if let Some(xdg) = set(xdg).filter(|p| p.is_absolute()) {
        return xdg.join("ejc");
    }
    if let Some(home) = set(home) {
        return home.join(".cache").join("ejc");
    }
    PathBuf::from(".ejc-cache")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> Option<OsString> {
        Some(OsString::from(s))
    }

    #[test]
    fn default_dir_order() {
        assert_eq!(default_dir_from(os("/e"), os("/x"), os("/h")), PathBuf::from("/e"));
        assert_eq!(default_dir_from(os("rel/e"), None, None), PathBuf::from("rel/e"));
        assert_eq!(default_dir_from(None, os("/x"), os("/h")), PathBuf::from("/x/ejc"));
        assert_eq!(default_dir_from(os(""), os("/x"), os("/h")), PathBuf::from("/x/ejc"));
        assert_eq!(default_dir_from(None, None, os("/h")), PathBuf::from("/h/.cache/ejc"));
        assert_eq!(default_dir_from(None, os("relative"), os("/h")), PathBuf::from("/h/.cache/ejc"));
        assert_eq!(default_dir_from(None, os(""), os("")), PathBuf::from(".ejc-cache"));
        assert_eq!(default_dir_from(None, None, None), PathBuf::from(".ejc-cache"));
    }
}
