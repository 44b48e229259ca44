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
//! `dsl:<name>`: each kernel is an instance whose variant is the kernel's name, with one
//! `single` plan, so the build also loads into a [`crate::registry::Registry`] like any
//! other. Flash kernels with mods carry the flash features plus `mask_mod` /
//! `score_mod` names. A build may hold several ISAs; the widest one this CPU runs is
//! used.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ejc_ir::cpu_abi::Isa;
use ejc_ir::flash::Features;
use ejc_ir::manifest::Artifact;
use ejc_ir::types::DType;

use crate::call::Call;
use crate::cpu::{CpuError, CpuKernel, CpuLibrary};
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
        if a.instance.dtype == "none" {
            return Err(invalid(format!("`{name}` is a generic kernel; launch it with its generated wrapper")));
        }
        let mut f: BTreeMap<String, serde_json::Value> = a.features.clone();
        let name_of = |v: Option<serde_json::Value>| v.and_then(|v| v.as_str().map(str::to_string));
        let mask_mod = name_of(f.remove("mask_mod"));
        let score_mod = name_of(f.remove("score_mod"));
        Ok(FlashKernelInfo {
            features: Features::from_json(&f).map_err(invalid)?,
            dtype: a.instance.dtype.parse().map_err(invalid)?,
            head_dim: a.instance.keys.get("head_dim").copied().unwrap_or(0) as usize,
            block_m: a.config.get("block_m").copied().unwrap_or(0) as usize,
            mask_mod,
            score_mod,
        })
    }

    /// Run flash kernel `name` on a call (tensors and scalars named as the flash
    /// kernels' parameters, e.g. from `ejc_ir::flash::op::host_call`); checked like any
    /// flash call; the outputs land in the call's `out` and `lse`.
    pub fn run_flash(&self, name: &str, call: &mut Call, threads: usize) -> Result<(), CpuError> {
        use ejc_ir::op::Operation;
        let info = self.flash_info(name)?;
        let (a, _) = self.artifact(name)?;
        let op = &ejc_ir::flash::op::FlashAttentionFwd;
        let keys = a.instance.keys.clone();
        let sizes = op.validate(&info.features.to_json(), info.dtype, &keys, call).map_err(invalid)?;
        let kernel = self.kernel(name)?;
        let grid = {
            let mut g = Vec::new();
            for e in &a.grid {
                g.push(ejc_ir::ir::GridExpr::parse(e).map_err(invalid)?);
            }
            [g[0].clone(), g[1].clone(), g[2].clone()]
        };
        let spec = crate::exec::HostLaunchSpec {
            kernel: &kernel,
            params: crate::exec::param_sigs(&a.params).map_err(invalid)?,
            grid,
            launch: ejc_ir::manifest::Launch::of("main"),
        };
        let mut plan =
            crate::exec::HostPlan::new(&[spec], &[], call, &sizes, &a.config).map_err(|e| invalid(e.to_string()))?;
        plan.run(call, threads).map_err(|e| invalid(e.to_string()))
    }
}
