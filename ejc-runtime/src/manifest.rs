//! Loading a build's `manifest.json` and checking it against the files beside it.
//!
//! A manifest is trusted only when every artifact it names exists and hashes to the
//! recorded SHA-256: a half-copied or hand-edited build directory is an error here,
//! not a crash (or a wrong kernel) later.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use ejc_ir::manifest::{Artifact, Manifest};
use sha2::{Digest, Sha256};

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("cannot read {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// A manifest and the directory its artifact paths are relative to.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub manifest: Manifest,
    pub dir: PathBuf,
}

impl Loaded {
    pub fn path_of(&self, a: &Artifact) -> PathBuf {
        self.dir.join(&a.file)
    }
}

/// Read and verify `path` (a `manifest.json`, or a build directory holding one).
pub fn load(path: impl AsRef<Path>) -> Result<Loaded, ManifestError> {
    let mut path = path.as_ref().to_path_buf();
    if path.is_dir() {
        path = path.join("manifest.json");
    }
    let text = std::fs::read_to_string(&path).map_err(|error| ManifestError::Io { path: path.clone(), error })?;
    let invalid = |message: String| ManifestError::Invalid { path: path.clone(), message };
    let manifest = Manifest::parse(&text).map_err(invalid)?;
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut ids = HashSet::new();
    for a in &manifest.artifacts {
        if !ids.insert(a.artifact_id.as_str()) {
            return Err(invalid(format!("artifact id `{}` appears twice", a.artifact_id)));
        }
        if Path::new(&a.file).is_absolute() || a.file.split('/').any(|c| c == "..") {
            return Err(invalid(format!(
                "artifact `{}`: file `{}` must be a relative path inside the build directory",
                a.artifact_id, a.file
            )));
        }
        let file = dir.join(&a.file);
        let bytes = std::fs::read(&file).map_err(|error| ManifestError::Io { path: file.clone(), error })?;
        let digest: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        if digest != a.sha256 {
            return Err(invalid(format!(
                "artifact `{}`: {} has SHA-256 {digest}, the manifest records {}",
                a.artifact_id, a.file, a.sha256
            )));
        }
    }
    Ok(Loaded { manifest, dir })
}
