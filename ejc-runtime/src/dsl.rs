//! Kernels a user crate compiled from `#[ej_kernel]` functions at build time
//! (`ejc_codegen::build::dsl` in its `build.rs`).
//!
//! ```no_run
//! use ejc_runtime::dsl::DslLibrary;
//! let lib = DslLibrary::open(env!("CARGO_MANIFEST_DIR")).unwrap(); // the build's manifest
//! let axpy = lib.kernel("axpy").unwrap();
//! // axpy::launch(&axpy, grid, threads, &x, &mut y, ...)  (the wrapper #[ej_kernel] generated)
//! ```
//!
//! The manifest is the one `ejc build` writes (docs/abi.md), with `op` =
//! `dsl:<name>`: generic kernels have variant `kernel`, flash kernels with mods have
//! variant `flash` and their features plus `mask_mod` / `score_mod` names. A build
//! may hold several ISAs; the widest one this CPU runs is used.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ejc_ir::cpu_abi::Isa;
use ejc_ir::flash::FlashRuntime;
use ejc_ir::manifest::Artifact;
use ejc_ir::spec::Features;
use ejc_ir::types::DType;

use crate::cpu::{CpuError, CpuKernel, CpuLibrary};
use crate::flash::FlashBuffers;
use crate::manifest::{load, Loaded};

/// The op prefix of manifests written by the build-script helper.
pub const OP_PREFIX: &str = "dsl:";

/// A flash kernel compiled with mods: what a call needs besides the kernel.
#[derive(Clone, Debug)]
pub struct FlashKernelInfo {
    pub features: Features,
    pub dtype: DType,
    pub head_dim: usize,
    pub block_m: usize,
    pub mask_mod: Option<String>,
    pub score_mod: Option<String>,
}

pub struct DslLibrary {
    loaded: Loaded,
    /// Opened libraries by file; kernels must not outlive them, so they live as long as `self`.
    libs: Mutex<HashMap<PathBuf, &'static CpuLibrary>>,
}

fn invalid(m: String) -> CpuError {
    CpuError::Invalid(m)
}

impl DslLibrary {
    /// Open a build (its `manifest.json`, or the directory holding it). The files'
    /// SHA-256 are checked against the manifest.
    pub fn open(path: impl AsRef<Path>) -> Result<DslLibrary, CpuError> {
        let loaded = load(path.as_ref()).map_err(|e| invalid(e.to_string()))?;
        if !loaded.manifest.spec.op.starts_with(OP_PREFIX) {
            return Err(invalid(format!(
                "{} is not an #[ej_kernel] build (op `{}`); flash builds of `ejc build` go through the registry",
                path.as_ref().display(),
                loaded.manifest.spec.op
            )));
        }
        Ok(DslLibrary { loaded, libs: Mutex::new(HashMap::new()) })
    }

    /// Names of the kernels in the build.
    pub fn names(&self) -> Vec<String> {
        let mut n: Vec<String> = self.loaded.manifest.artifacts.iter().map(|a| a.kernel_id.clone()).collect();
        n.sort();
        n.dedup();
        n
    }

    /// The artifact of `name` for the widest ISA this CPU runs.
    fn artifact(&self, name: &str) -> Result<(&Artifact, Isa), CpuError> {
        let mut best: Option<(&Artifact, Isa)> = None;
        for a in self.loaded.manifest.artifacts.iter().filter(|a| a.kernel_id == name) {
            let Some(isa) = a.target.strip_prefix("cpu:") else { continue };
            let isa: Isa = isa.parse().map_err(invalid)?;
            if isa.runs_here() && best.is_none_or(|(_, b)| isa > b) {
                best = Some((a, isa));
            }
        }
        best.ok_or_else(|| {
            if self.names().iter().any(|n| n == name) {
                invalid(format!("kernel `{name}` was built only for ISAs this CPU cannot run"))
            } else {
                invalid(format!("the build has no kernel `{name}` (it has: {})", self.names().join(", ")))
            }
        })
    }

    /// The kernel `name`, ready for its generated `launch` wrapper.
    pub fn kernel(&self, name: &str) -> Result<CpuKernel, CpuError> {
        let (a, _) = self.artifact(name)?;
        let path = self.loaded.path_of(a);
        let mut libs = self.libs.lock().map_err(|_| invalid("library table poisoned".into()))?;
        let lib = match libs.get(&path) {
            Some(l) => *l,
            None => {
                // Leaked on purpose: kernels are plain function pointers into the
                // library, which must stay loaded while any copy of them exists.
                let l: &'static CpuLibrary = Box::leak(Box::new(CpuLibrary::open(&path)?));
                libs.insert(path.clone(), l);
                l
            }
        };
        lib.kernel(&a.entry, a.scratch_bytes as usize)
    }

    /// What a flash kernel of the build was compiled for.
    pub fn flash_info(&self, name: &str) -> Result<FlashKernelInfo, CpuError> {
        let (a, _) = self.artifact(name)?;
        if a.variant != "flash" {
            return Err(invalid(format!("`{name}` is a generic kernel; launch it with its generated wrapper")));
        }
        let mut f: BTreeMap<String, serde_json::Value> = a.features.clone();
        let name_of = |v: Option<serde_json::Value>| v.and_then(|v| v.as_str().map(str::to_string));
        let mask_mod = name_of(f.remove("mask_mod"));
        let score_mod = name_of(f.remove("score_mod"));
        Ok(FlashKernelInfo {
            features: crate::registry::features_from_json(&f).map_err(invalid)?,
            dtype: a.dtype.parse().map_err(invalid)?,
            head_dim: a.head_dim,
            block_m: a.config.get("block_m").copied().unwrap_or(0) as usize,
            mask_mod,
            score_mod,
        })
    }

    /// Run flash kernel `name` on a call (checked like any flash call; outputs land in
    /// `call.out` / `call.lse`).
    pub fn run_flash(
        &self,
        name: &str,
        rt: &FlashRuntime,
        call: &mut FlashBuffers,
        threads: usize,
    ) -> Result<(), CpuError> {
        let info = self.flash_info(name)?;
        let kernel = self.kernel(name)?;
        crate::flash::run_cpu(&kernel, &info.features, info.dtype, info.head_dim, info.block_m, rt, call, threads)
    }
}
