//! The code generator's fingerprint: a SHA-256 of this crate's sources and of ejc-ir's
//! (the tile IR, its types and passes). Compiled code is cached on disk keyed by it
//! (`src/cache.rs`), so an edited back end never reads code an older one compiled,
//! even when the version number stayed the same.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn main() {
    let here = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let mut srcs = Vec::new();
    for dir in [here.join("src"), here.join("../ejc-ir/src")] {
        if dir.is_dir() {
            println!("cargo:rerun-if-changed={}", dir.display());
            files(&dir, &mut srcs);
        }
    }
    srcs.sort();
    let mut h = Sha256::new();
    for p in &srcs {
        h.update(p.strip_prefix(&here).unwrap_or(p).to_string_lossy().as_bytes());
        h.update([0]);
        h.update(std::fs::read(p).unwrap_or_default());
        h.update([0]);
    }
    let hex: String = h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
    println!("cargo:rustc-env=EJC_CODEGEN_FINGERPRINT={hex}");
}
