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

mod tune;
pub use tune::{launch_gpu_tuned_checked, launch_tuned_checked, Choice, GpuTunedKernel, Point, TunedKernel};

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
    /// The tensors the mods read (a call passes them by these names).
    pub mod_tensors: Vec<ejc_ir::dsl::ModTensorSpec>,
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

    /// The kernel `name`, ready for its generated `launch` wrapper (for a kernel with a
    /// schedule space, its default point; [`DslLibrary::tuned_kernel`] has them all).
    pub fn kernel(&self, name: &str) -> Result<CpuKernel, CpuError> {
        let (a, _) = self.artifact(name)?;
        self.load_cpu(a)
    }

    fn load_cpu(&self, a: &Artifact) -> Result<CpuKernel, CpuError> {
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
        let mod_tensors = match f.remove("mod_tensors") {
            Some(v) => serde_json::from_value(v).map_err(|e| invalid(format!("`{name}`: bad mod_tensors: {e}")))?,
            None => Vec::new(),
        };
        Ok(FlashKernelInfo {
            features: Features::from_json(&f).map_err(invalid)?,
            dtype: a.instance.dtype.parse().map_err(invalid)?,
            head_dim: a.instance.keys.get("head_dim").copied().unwrap_or(0) as usize,
            block_m: a.config.get("block_m").copied().unwrap_or(0) as usize,
            mask_mod,
            score_mod,
            mod_tensors,
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
        ejc_ir::dsl::check_mod_tensors(name, &info.mod_tensors, call, &sizes).map_err(invalid)?;
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

/// Whether this build of ejc-runtime has CUDA support (its `cuda` feature: cargo turns it
/// on for every crate of a build where one dependent asks for it).
pub const CUDA_BUILT_IN: bool = cfg!(feature = "cuda");

/// Why a DSL kernel could not run on the GPU.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// This build of ejc-runtime has no CUDA support.
    #[error(
        "ejc-runtime was built without its `cuda` feature: enable it (`ejc-runtime = {{ features = [\"cuda\"] }}`, \
         or a feature of your crate that turns it on) to run #[ej_kernel] kernels on a GPU"
    )]
    NoCuda,
    /// The driver, a missing GPU, or a refused launch.
    #[error("{0}")]
    Cuda(String),
    /// Arguments that do not fit the kernel, or a build without PTX for this GPU.
    #[error("{0}")]
    Invalid(String),
}

#[cfg(feature = "cuda")]
impl From<crate::cuda::CudaError> for GpuError {
    fn from(e: crate::cuda::CudaError) -> GpuError {
        match e {
            crate::cuda::CudaError::Invalid(m) => GpuError::Invalid(m),
            other => GpuError::Cuda(other.to_string()),
        }
    }
}

/// The GPU `#[ej_kernel]` kernels run on (the first one), with ejc-runtime's `cuda`
/// feature; without it every constructor returns [`GpuError::NoCuda`].
pub struct Gpu {
    #[cfg(feature = "cuda")]
    cuda: std::sync::Arc<crate::cuda::Cuda>,
    #[cfg(not(feature = "cuda"))]
    _none: std::convert::Infallible,
}

/// A tensor in the GPU's memory, for a kernel's generated `launch_gpu` wrapper.
pub struct GpuBuffer {
    #[cfg(feature = "cuda")]
    buf: crate::cuda::DeviceBuffer,
    #[cfg(not(feature = "cuda"))]
    _none: std::convert::Infallible,
}

/// A DSL kernel loaded on a GPU ([`DslLibrary::gpu_kernel`]).
pub struct GpuKernel {
    #[cfg(feature = "cuda")]
    kernel: crate::cuda::CudaKernel,
    /// The aligned entry (docs/abi.md), run where the call's tensors meet its condition.
    #[cfg(feature = "cuda")]
    aligned: Option<(crate::cuda::CudaKernel, ejc_ir::manifest::AlignedEntry)>,
    #[cfg(feature = "cuda")]
    cuda: std::sync::Arc<crate::cuda::Cuda>,
    /// The artifact's target (`ptx:sm_90a`).
    pub target: String,
    #[cfg(not(feature = "cuda"))]
    _none: std::convert::Infallible,
}

impl Gpu {
    /// The first GPU, or why there is none (no driver, no `cuda` feature).
    pub fn new() -> Result<Gpu, GpuError> {
        #[cfg(feature = "cuda")]
        {
            Ok(Gpu { cuda: std::sync::Arc::new(crate::cuda::Cuda::new()?) })
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(GpuError::NoCuda)
        }
    }

    /// The device and its compute capability, e.g. `NVIDIA H100 80GB HBM3 (sm_90)`.
    pub fn name(&self) -> String {
        #[cfg(feature = "cuda")]
        {
            self.cuda.device_name()
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self._none {}
        }
    }

    /// Copy a host tensor to the GPU (same shape, strides and offset).
    pub fn upload(&self, h: &crate::cpu::HostBuffer) -> Result<GpuBuffer, GpuError> {
        #[cfg(feature = "cuda")]
        {
            Ok(GpuBuffer { buf: self.cuda.upload(h)? })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = h;
            match self._none {}
        }
    }

    /// Copy a GPU tensor back (after the launches before it have finished).
    pub fn download(&self, d: &GpuBuffer) -> Result<crate::cpu::HostBuffer, GpuError> {
        #[cfg(feature = "cuda")]
        {
            self.cuda.synchronize()?;
            Ok(self.cuda.download(&d.buf)?)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = d;
            match self._none {}
        }
    }

    /// Wait for every launch queued so far.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        #[cfg(feature = "cuda")]
        {
            Ok(self.cuda.synchronize()?)
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self._none {}
        }
    }

    /// Milliseconds of GPU time of each of `reps` runs of `f` (CUDA events).
    pub fn time(&self, reps: usize, f: &mut dyn FnMut() -> Result<(), GpuError>) -> Result<Vec<f32>, GpuError> {
        #[cfg(feature = "cuda")]
        {
            let mut err = None;
            let t = self.cuda.time(reps, &mut || {
                f().map_err(|e| {
                    let m = e.to_string();
                    err = Some(e);
                    crate::cuda::CudaError::Invalid(m)
                })
            });
            match (t, err) {
                (_, Some(e)) => Err(e),
                (t, None) => Ok(t?),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (reps, f);
            match self._none {}
        }
    }
}

impl GpuBuffer {
    /// Element type and shape.
    pub fn dtype(&self) -> DType {
        #[cfg(feature = "cuda")]
        {
            self.buf.dtype
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self._none {}
        }
    }

    pub fn shape(&self) -> &[usize] {
        #[cfg(feature = "cuda")]
        {
            &self.buf.shape
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self._none {}
        }
    }
}

/// One tensor argument of a GPU launch (what the generated `launch_gpu` passes).
pub struct GpuTensorArg<'a> {
    pub name: &'static str,
    pub dtype: DType,
    pub rank: usize,
    buf: &'a GpuBuffer,
    /// The kernel stores to it (saved and put back around tuning).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    written: bool,
}

impl<'a> GpuTensorArg<'a> {
    /// A tensor the kernel only loads from.
    pub fn read(name: &'static str, dtype: DType, rank: usize, buf: &'a GpuBuffer) -> Self {
        GpuTensorArg { name, dtype, rank, buf, written: false }
    }
    /// A tensor the kernel stores to (an exclusive borrow: it aliases no other argument).
    pub fn write(name: &'static str, dtype: DType, rank: usize, buf: &'a mut GpuBuffer) -> Self {
        GpuTensorArg { name, dtype, rank, buf, written: true }
    }
}

/// What [`launch_gpu_checked`] checks first: every tensor's dtype and rank.
pub(crate) fn check_gpu_tensor_args(kernel_name: &str, tensors: &[GpuTensorArg]) -> Result<(), GpuError> {
    for t in tensors {
        if t.buf.dtype() != t.dtype || t.buf.shape().len() != t.rank {
            return Err(GpuError::Invalid(format!(
                "`{kernel_name}`: `{}` must be a {} tensor of rank {}, got {} with shape {:?}",
                t.name,
                t.dtype,
                t.rank,
                t.buf.dtype(),
                t.buf.shape()
            )));
        }
    }
    Ok(())
}

/// A checked GPU launch (the generated `launch_gpu` wrappers call this): every tensor's
/// dtype and rank must be the parameter's, the grid within CUDA's range; scalars are
/// `(dtype, value)` in the kernel's order. Loads and stores are bounded by the tensors'
/// shapes (docs/ir.md), so a checked launch touches nothing outside the buffers. The
/// launch is queued on the GPU's stream: [`Gpu::download`] waits for it.
pub fn launch_gpu_checked(
    kernel: &GpuKernel,
    kernel_name: &str,
    tensors: &[GpuTensorArg],
    scalars: &[(DType, f64)],
    grid: [i64; 3],
) -> Result<(), GpuError> {
    #[cfg(feature = "cuda")]
    {
        use crate::cuda::Scalar;
        check_gpu_tensor_args(kernel_name, tensors)?;
        let views: Vec<_> = tensors.iter().map(|t| t.buf.buf.view()).collect();
        let scalars: Vec<Scalar> = scalars
            .iter()
            .map(|&(d, x)| match d {
                DType::F32 => Scalar::F32(x as f32),
                DType::I1 => Scalar::I32((x != 0.0) as i32),
                DType::U32 => Scalar::I32(x as i64 as u32 as i32),
                _ => Scalar::I32(x as i64 as i32),
            })
            .collect();
        // The aligned entry where every tensor it names is 16-byte aligned with unit
        // innermost stride and 8-element outer strides (TMA's rules), with its maps;
        // `EJC_DSL_GENERAL=1` keeps to the general entry.
        let meets = |al: &ejc_ir::manifest::AlignedEntry| {
            al.tensors.iter().all(|t| {
                tensors.iter().zip(&views).any(|(a, v)| {
                    a.name == t && {
                        let st: Vec<i64> = v.strides.iter().map(|s| *s as i64).collect();
                        ejc_ir::manifest::AlignedEntry::tensor_ok(v.address, &st)
                    }
                })
            })
        };
        let general = std::env::var("EJC_DSL_GENERAL").is_ok_and(|v| v == "1");
        let (k, maps) = match &kernel.aligned {
            Some((k, al)) if meets(al) && !grid.contains(&0) && !general => {
                let mut maps = Vec::new();
                for p in &k.tensor_maps {
                    let i = tensors.iter().position(|t| t.name == p.tensor).ok_or_else(|| {
                        GpuError::Invalid(format!(
                            "`{}` wants a tensor map of `{}`, not a parameter",
                            k.entry, p.tensor
                        ))
                    })?;
                    maps.push(crate::cuda::encode_tensor_map(&views[i], p)?);
                }
                (k, maps)
            }
            _ => (&kernel.kernel, Vec::new()),
        };
        // Safety: dtypes and ranks are checked above, a written tensor is an exclusive
        // borrow (no other argument aliases it), and every access is bounded by the
        // shapes passed with the pointers (tensor maps zero-fill outside them).
        unsafe { kernel.cuda.launch(k, grid, &views, &scalars, &maps) }?;
        Ok(())
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (tensors, scalars, grid, kernel_name);
        match kernel._none {}
    }
}

impl DslLibrary {
    /// Kernel `name` loaded on `gpu`: the build's PTX for this GPU (`ptx:sm_90a` on
    /// compute capability 9.0, else `ptx:sm_80`; `DslBuild::ptx` at build time), for its
    /// generated `launch_gpu` wrapper (for a kernel with a schedule space, its default
    /// point; [`DslLibrary::gpu_tuned_kernel`] has them all).
    pub fn gpu_kernel(&self, gpu: &Gpu, name: &str) -> Result<GpuKernel, GpuError> {
        self.not_flash(name)?;
        let target = self.gpu_target(gpu, name)?;
        self.gpu_kernel_on(gpu, name, &target)
    }

    /// Kernel `name` from the build's artifact for `target` (`ptx:sm_80`, `ptx:sm_90a`,
    /// `mlir:gpu:sm_80` from `DslBuild::mlir`), at its default point.
    pub fn gpu_kernel_on(&self, gpu: &Gpu, name: &str, target: &str) -> Result<GpuKernel, GpuError> {
        self.not_flash(name)?;
        self.load_gpu(gpu, self.gpu_artifact(name, target)?)
    }

    /// The artifact of `name` (its default point) for `target`.
    fn gpu_artifact(&self, name: &str, target: &str) -> Result<&Artifact, GpuError> {
        let arts = &self.loaded.manifest.artifacts;
        arts.iter().find(|a| a.kernel_id == name && a.target == target).ok_or_else(|| {
            let mut have: Vec<&str> = arts.iter().filter(|a| a.kernel_id == name).map(|a| a.target.as_str()).collect();
            have.dedup();
            GpuError::Invalid(format!("kernel `{name}` has no `{target}` artifact (it has: {})", have.join(", ")))
        })
    }

    /// A flash kernel with mods runs through a flash call, not a kernel's launch.
    fn not_flash(&self, name: &str) -> Result<(), GpuError> {
        if self.loaded.manifest.artifacts.iter().any(|a| a.kernel_id == name && a.instance.dtype != "none") {
            return Err(GpuError::Invalid(format!(
                "`{name}` is a flash kernel with mods: run it with `DslLibrary::run_flash_gpu` (a flash call)"
            )));
        }
        Ok(())
    }

    /// The PTX target of `name` this GPU runs best: `ptx:sm_90a` where it runs (the exact
    /// architecture), then the newest portable one.
    fn gpu_target(&self, gpu: &Gpu, name: &str) -> Result<String, GpuError> {
        #[cfg(feature = "cuda")]
        {
            let cc = gpu.cuda.compute_capability();
            let mut found: Vec<&Artifact> =
                self.loaded.manifest.artifacts.iter().filter(|a| a.kernel_id == name).collect();
            if found.is_empty() {
                return Err(GpuError::Invalid(format!(
                    "the build has no kernel `{name}` (it has: {})",
                    self.names().join(", ")
                )));
            }
            found.retain(|a| crate::cuda::runs_on(&a.target, cc));
            // The PTX target's own code before MLIR's (asked for by name: `gpu_kernel_on`).
            found.sort_by_key(|a| {
                (a.target != "ptx:sm_90a", !a.target.starts_with("ptx:"), std::cmp::Reverse(a.target.clone()))
            });
            let a = found.first().ok_or_else(|| {
                GpuError::Invalid(format!(
                    "kernel `{name}` has no PTX for this GPU (compute capability {cc}); build it with \
                     `DslBuild::ptx(Arch::Sm80)` (every GPU from Ampere on) or `Arch::Sm90a` (Hopper)"
                ))
            })?;
            Ok(a.target.clone())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = name;
            match gpu._none {}
        }
    }

    fn load_gpu(&self, gpu: &Gpu, a: &Artifact) -> Result<GpuKernel, GpuError> {
        #[cfg(feature = "cuda")]
        {
            let (kernel, aligned) = self.load_entries(gpu, a)?;
            // Scalars are not named at the launch: an aligned entry that assumes a positive
            // one (a folded softmax scale) is not used.
            let aligned = aligned.filter(|(_, al)| al.positive.is_empty());
            Ok(GpuKernel { kernel, aligned, cuda: gpu.cuda.clone(), target: a.target.clone() })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = a;
            match gpu._none {}
        }
    }

    /// Artifact `a`'s general entry and its aligned one (with its tensor maps), loaded.
    #[cfg(feature = "cuda")]
    #[allow(clippy::type_complexity)]
    fn load_entries(
        &self,
        gpu: &Gpu,
        a: &Artifact,
    ) -> Result<(crate::cuda::CudaKernel, Option<(crate::cuda::CudaKernel, ejc_ir::manifest::AlignedEntry)>), GpuError>
    {
        let path = self.loaded.path_of(a);
        let ptx = std::fs::read_to_string(&path).map_err(|e| GpuError::Invalid(format!("{}: {e}", path.display())))?;
        let threads = a.block.map(|b| b[0]).unwrap_or(128);
        let mut kernel = gpu.cuda.load(&ptx, &a.entry, threads, a.dynamic_shared_memory)?;
        // MLIR's GPU form keeps its tiles in global scratch (the launch appends it).
        kernel.scratch_bytes = a.scratch_bytes;
        let aligned = match &a.aligned {
            Some(al) => {
                let mut k = gpu.cuda.load(&ptx, &al.entry, threads, a.dynamic_shared_memory)?;
                k.tensor_maps = al.tensor_maps.clone();
                Some((k, al.clone()))
            }
            None => None,
        };
        Ok((kernel, aligned))
    }
}

impl DslLibrary {
    /// Run flash kernel `name` (compiled with its mods by `DslBuild::flash`, for the GPU by
    /// `DslBuild::ptx`) on `gpu`: `call` holds host tensors as for [`DslLibrary::run_flash`];
    /// they are uploaded, checked like any flash call, the kernel runs (its aligned entry
    /// where the tensors allow it), and `out` and `lse` come back into `call`.
    pub fn run_flash_gpu(&self, gpu: &Gpu, name: &str, call: &mut Call) -> Result<(), GpuError> {
        #[cfg(feature = "cuda")]
        {
            use ejc_ir::op::Operation;
            let bad = |e: String| GpuError::Invalid(e);
            let info = self.flash_info(name).map_err(|e| bad(e.to_string()))?;
            let a = self.gpu_artifact(name, &self.gpu_target(gpu, name)?)?;
            let op = &ejc_ir::flash::op::FlashAttentionFwd;
            let features = info.features.to_json();
            let sizes = op.validate(&features, info.dtype, &a.instance.keys, call).map_err(bad)?;
            ejc_ir::dsl::check_mod_tensors(name, &info.mod_tensors, call, &sizes).map_err(bad)?;
            let (kernel, aligned) = self.load_entries(gpu, a)?;
            let mut grid = Vec::new();
            for e in &a.grid {
                grid.push(ejc_ir::ir::GridExpr::parse(e).map_err(bad)?);
            }
            let spec = crate::cuda::CudaLaunchSpec {
                kernel,
                aligned,
                params: crate::exec::param_sigs(&a.params).map_err(bad)?,
                grid: [grid[0].clone(), grid[1].clone(), grid[2].clone()],
                launch: ejc_ir::manifest::Launch::of("main"),
            };
            let dev = crate::cuda::upload_call(&gpu.cuda, call)?;
            let plan = crate::cuda::CudaPlan::new(vec![spec], &[], &dev, &sizes, &a.config, &gpu.cuda)?;
            plan.launch(&gpu.cuda)?;
            gpu.cuda.synchronize()?;
            crate::cuda::download_into(&gpu.cuda, &dev, &op.outputs(&features), call)?;
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (name, call);
            match gpu._none {}
        }
    }
}

/// Written tensors saved while a tuned kernel is timed.
pub(crate) struct Saved {
    #[cfg(feature = "cuda")]
    copies: Vec<(usize, crate::cuda::DeviceBuffer)>,
}

impl Gpu {
    /// The GPU `k` was loaded on.
    pub(crate) fn of_kernel(k: &GpuKernel) -> Gpu {
        #[cfg(feature = "cuda")]
        {
            Gpu { cuda: k.cuda.clone() }
        }
        #[cfg(not(feature = "cuda"))]
        {
            match k._none {}
        }
    }

    /// This GPU as the tuning cache names machines.
    pub fn fingerprint(&self) -> String {
        #[cfg(feature = "cuda")]
        {
            self.cuda.fingerprint()
        }
        #[cfg(not(feature = "cuda"))]
        {
            match self._none {}
        }
    }

    /// Copies of the tensors a launch stores to.
    pub(crate) fn save(&self, tensors: &[GpuTensorArg]) -> Result<Saved, GpuError> {
        #[cfg(feature = "cuda")]
        {
            let mut copies = Vec::new();
            for (j, t) in tensors.iter().enumerate().filter(|(_, t)| t.written) {
                let c = self
                    .cuda
                    .duplicate(&t.buf.buf)
                    .map_err(|e| GpuError::Invalid(format!("tuning saves `{}` first, and cannot: {e}", t.name)))?;
                copies.push((j, c));
            }
            Ok(Saved { copies })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = tensors;
            match self._none {}
        }
    }

    /// Put saved tensors back.
    pub(crate) fn restore(&self, tensors: &[GpuTensorArg], saved: Saved) -> Result<(), GpuError> {
        #[cfg(feature = "cuda")]
        {
            for (j, c) in &saved.copies {
                self.cuda.copy(c, &tensors[*j].buf.buf)?;
            }
            self.cuda.synchronize()?;
            Ok(())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (tensors, saved);
            match self._none {}
        }
    }
}
