//! The CUDA executor (feature `cuda`): loads PTX through the driver (which JIT-compiles
//! it for the GPU at hand), keeps loaded modules, launches kernels with the
//! manifest's ABI and times them with CUDA events.
//!
//! ```no_run
//! use ejc_runtime::cuda::Cuda;
//! let cuda = Cuda::new().unwrap_or_else(|e| { eprintln!("{e}"); std::process::exit(0) });
//! println!("{}", cuda.device_name());
//! ```
//!
//! libcuda is opened at run time (cudarc's dynamic loading), so building needs no CUDA
//! installation; without a driver [`Cuda::new`] returns [`CudaError::NoDriver`] and
//! nothing panics.
//!
//! A tensor is passed as `(ptr, shape[rank]: i64, strides[rank]: i64)` (strides in
//! elements), a scalar as its value (`f32`, `i32`; `u32` and `i1` as `i32`): the ABI
//! the PTX target generates (docs/abi.md). Kernels from MLIR's gpu form (`mlir:gpu:<chip>`
//! artifacts) keep their tiles in global memory: [`CudaKernel::scratch_bytes`] per block,
//! passed as one extra pointer after the ABI's parameters.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use ejc_ir::ir::GridExpr;
use ejc_ir::manifest::{AlignedEntry, Launch, Temporary, TensorMapParam};
use ejc_ir::op::{bind, grid_of, symbols, temporary_shape, Bound, Config, ParamSig, Sizes};
use ejc_ir::types::{DType, Type};

use crate::call::{Call, Tensor};
use crate::cpu::HostBuffer;
use crate::exec::param_sigs;
use crate::registry::{Candidate, KernelEntry};

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver: libcuda could not be loaded on this machine (GPU work is skipped)")]
    NoDriver,
    #[error("CUDA: {0}")]
    Driver(String),
    #[error("{0}")]
    Invalid(String),
}

fn drv(e: cudarc::driver::DriverError) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

/// Whether a CUDA driver can be loaded here (no panic either way).
pub fn driver_present() -> bool {
    // Safety: only probes for the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// A tensor in device memory (same layout as the [`HostBuffer`] it came from). Clones
/// share the memory (a view, not a copy).
#[derive(Clone)]
pub struct DeviceBuffer {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
    /// Element offset of index [0, …] from the start of `mem`.
    pub offset: usize,
    mem: Arc<CudaSlice<u8>>,
    ptr: u64,
}

impl DeviceBuffer {
    /// Device address of element [0, …].
    pub fn address(&self) -> u64 {
        self.ptr + (self.offset * self.dtype.size_bytes()) as u64
    }
}

/// A kernel ready to launch.
#[derive(Clone)]
pub struct CudaKernel {
    func: CudaFunction,
    pub entry: String,
    pub threads: u32,
    pub smem_bytes: u32,
    /// Global scratch bytes per block (manifest `scratch_bytes`; MLIR gpu-form kernels):
    /// when nonzero, the launch appends a pointer to `blocks × scratch_bytes` bytes.
    pub scratch_bytes: u64,
    /// Tensor maps the entry takes after the ABI's parameters (the aligned entry of a
    /// warp-specialised artifact; docs/abi.md, "Tensor maps").
    pub tensor_maps: Vec<ejc_ir::manifest::TensorMapParam>,
}

/// A `CUtensorMap`, passed by value (128 bytes, 64-byte aligned).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub struct TensorMap(pub [u64; 16]);

// Safety: plain bytes, the layout the driver expects for a `.param .align 64 .b8 [128]`.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

/// Encode the tiled tensor map `p` of tensor `t` (`cuTensorMapEncodeTiled`): its shape
/// and strides innermost first, box `p.box_dims`, 128-byte swizzle, zeros outside.
pub fn encode_tensor_map(t: &DevTensor, p: &TensorMapParam) -> Result<TensorMap, CudaError> {
    use cudarc::driver::sys::*;
    let rank = t.shape.len();
    let bad = |m: String| CudaError::Invalid(format!("tensor map of `{}`: {m}", p.tensor));
    if p.box_dims.len() != rank || !(1..=5).contains(&rank) {
        return Err(bad(format!("box {:?} for a tensor of rank {rank}", p.box_dims)));
    }
    if p.swizzle != "128B" {
        return Err(bad(format!("swizzle `{}` is not supported (128B is)", p.swizzle)));
    }
    let dtype = match t.dtype {
        DType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        other => return Err(bad(format!("{other} tensors have no tensor map here"))),
    };
    let es = t.dtype.size_bytes() as u64;
    if t.strides.last() != Some(&1) || t.strides.iter().any(|s| *s < 0) {
        return Err(bad(format!("strides {:?}: the last must be 1 and none negative", t.strides)));
    }
    let dims: Vec<u64> = t.shape.iter().rev().map(|d| (*d as u64).max(1)).collect();
    let strides: Vec<u64> = t.strides.iter().rev().skip(1).map(|s| *s as u64 * es).collect();
    let boxes: Vec<u32> = p.box_dims.iter().rev().copied().collect();
    let ones = vec![1u32; rank];
    let mut map = CUtensorMap { opaque: [0; 16] };
    // Safety: every array has `rank` (strides `rank - 1`) entries; the address is the
    // tensor's device address.
    let r = unsafe {
        cuTensorMapEncodeTiled(
            &mut map,
            dtype,
            rank as u32,
            t.address as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            ones.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != CUresult::CUDA_SUCCESS {
        return Err(bad(format!(
            "cuTensorMapEncodeTiled failed ({r:?}) for shape {:?}, strides {:?}, box {:?}",
            t.shape, t.strides, p.box_dims
        )));
    }
    Ok(TensorMap(map.opaque))
}

/// One scalar argument.
#[derive(Clone, Copy, Debug)]
pub enum Scalar {
    F32(f32),
    I32(i32),
}

enum Arg {
    U64(u64),
    I64(i64),
    F32(f32),
    I32(i32),
}

pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Loaded modules by PTX text hash and entry.
    kernels: Mutex<HashMap<(u64, String), CudaKernel>>,
    /// Global scratch for kernels that need it, grown on demand and kept.
    scratch: Mutex<Option<CudaSlice<u8>>>,
    /// Streams besides `stream` for the launches a plan declares independent (made on
    /// first use, kept).
    side: Mutex<Vec<Arc<CudaStream>>>,
}

/// Keep the memory that stream-ordered allocations free in the device's default pool
/// instead of handing it back to the driver at every synchronisation (the pool's default
/// release threshold is 0), so that a call which allocates its scratch after a sync does
/// not map its pages again (docs/perf.md, ring attention, has the measured difference).
/// An allocation that fails gives the pool's cached memory back and tries once more
/// ([`Cuda::alloc`]). `EJC_CUDA_POOL=trim` keeps the driver's default. Best effort: a driver
/// without memory pools is left as is.
fn keep_pool_memory(ctx: &CudaContext) {
    use cudarc::driver::sys;
    if std::env::var("EJC_CUDA_POOL").is_ok_and(|v| v == "trim") {
        return;
    }
    if let Some(pool) = default_pool(ctx) {
        let mut threshold = u64::MAX;
        // SAFETY: the attribute takes a pointer to a u64 (cuMemPoolSetAttribute's contract).
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            );
        }
    }
}

/// The device's default memory pool (where `cuMemAllocAsync` allocates), if the driver has one.
fn default_pool(ctx: &CudaContext) -> Option<cudarc::driver::sys::CUmemoryPool> {
    use cudarc::driver::sys;
    ctx.bind_to_thread().ok()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; the device handle comes from a live context.
    let ok = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) } == sys::CUresult::CUDA_SUCCESS;
    (ok && !pool.is_null()).then_some(pool)
}

impl Cuda {
    /// The first GPU, or why there is none.
    pub fn new() -> Result<Cuda, CudaError> {
        Self::on(0)
    }

    /// GPU `ordinal` (one process per GPU: ring attention), or why there is none.
    pub fn on(ordinal: usize) -> Result<Cuda, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let n = CudaContext::device_count().map_err(drv)?;
        if n < 1 {
            return Err(CudaError::Driver("the driver reports no GPU".into()));
        }
        if ordinal >= n as usize {
            return Err(CudaError::Driver(format!("GPU {ordinal} asked for; the driver reports {n}")));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        keep_pool_memory(&ctx);
        let stream = ctx.default_stream();
        Ok(Cuda {
            ctx,
            stream,
            kernels: Mutex::new(HashMap::new()),
            scratch: Mutex::new(None),
            side: Mutex::new(Vec::new()),
        })
    }

    pub fn device_name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (ma, mi) = self.ctx.compute_capability().unwrap_or((0, 0));
        format!("{name} (sm_{ma}{mi})")
    }

    /// Compute capability as `major * 10 + minor`.
    pub fn compute_capability(&self) -> u32 {
        let (ma, mi) = self.ctx.compute_capability().unwrap_or((0, 0));
        (ma * 10 + mi) as u32
    }

    pub fn upload(&self, h: &HostBuffer) -> Result<DeviceBuffer, CudaError> {
        h.check_bounds().map_err(CudaError::Invalid)?;
        // At least one byte: a zero-size allocation has no address.
        let bytes: &[u8] = if h.bytes.is_empty() { &[0u8] } else { &h.bytes };
        let mem = self.stream.clone_htod(bytes).map_err(drv)?;
        let ptr = {
            let (p, _sync) = mem.device_ptr(&self.stream);
            p
        };
        Ok(DeviceBuffer {
            dtype: h.dtype,
            shape: h.shape.clone(),
            strides: h.strides.clone(),
            offset: h.offset,
            mem: Arc::new(mem),
            ptr,
        })
    }

    /// Copy a device buffer back (the whole allocation, same layout).
    pub fn download(&self, d: &DeviceBuffer) -> Result<HostBuffer, CudaError> {
        let bytes = self.stream.clone_dtoh(d.mem.as_ref()).map_err(drv)?;
        Ok(HostBuffer { dtype: d.dtype, shape: d.shape.clone(), strides: d.strides.clone(), offset: d.offset, bytes })
    }

    /// Load `entry` from PTX text (cached by content).
    pub fn load(&self, ptx: &str, entry: &str, threads: u32, smem_bytes: u32) -> Result<CudaKernel, CudaError> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        ptx.hash(&mut h);
        let key = (h.finish(), entry.to_string());
        let mut cache = self.kernels.lock().map_err(|_| CudaError::Invalid("kernel cache poisoned".into()))?;
        if let Some(k) = cache.get(&key) {
            return Ok(k.clone());
        }
        let module = self
            .ctx
            .load_module(Ptx::from_src(ptx.to_string()))
            .map_err(|e| CudaError::Driver(format!("the driver rejected the PTX of `{entry}`: {e:?}")))?;
        let func = module.load_function(entry).map_err(drv)?;
        if smem_bytes > 48 * 1024 {
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_bytes as i32,
            )
            .map_err(|e| CudaError::Driver(format!("`{entry}` needs {smem_bytes} bytes of shared memory: {e:?}")))?;
        }
        let k = CudaKernel {
            func,
            entry: entry.to_string(),
            threads,
            smem_bytes,
            scratch_bytes: 0,
            tensor_maps: Vec::new(),
        };
        cache.insert(key, k.clone());
        Ok(k)
    }

    /// Launch `k` over `grid` with tensors and scalars in ABI order.
    ///
    /// # Safety
    /// The tensors must match the kernel's parameters (dtypes, ranks) and outputs must
    /// not overlap inputs; the flash binding checks this first.
    pub unsafe fn launch(
        &self,
        k: &CudaKernel,
        grid: [i64; 3],
        tensors: &[DevTensor],
        scalars: &[Scalar],
        maps: &[TensorMap],
    ) -> Result<(), CudaError> {
        self.launch_on(&self.stream, k, grid, tensors, scalars, maps)
    }

    /// [`Cuda::launch`] on `stream` (this GPU's, or one of [`Cuda::side_streams`]). A kernel
    /// with global scratch runs on this GPU's stream only (the scratch is one buffer).
    ///
    /// # Safety
    /// As for [`Cuda::launch`]; and whatever the launch reads must be ready on `stream`.
    pub unsafe fn launch_on(
        &self,
        stream: &Arc<CudaStream>,
        k: &CudaKernel,
        grid: [i64; 3],
        tensors: &[DevTensor],
        scalars: &[Scalar],
        maps: &[TensorMap],
    ) -> Result<(), CudaError> {
        // An empty grid launches nothing; its tensor maps are not made (a map cannot
        // describe an empty axis), so the count is checked only for real launches.
        if grid.contains(&0) && grid.iter().all(|g| *g >= 0) {
            return Ok(());
        }
        if maps.len() != k.tensor_maps.len() {
            return Err(CudaError::Invalid(format!(
                "`{}` takes {} tensor maps, {} given",
                k.entry,
                k.tensor_maps.len(),
                maps.len()
            )));
        }
        // CUDA's limits: x < 2^31, y and z <= 65535. A larger grid is refused here with
        // the sizes that made it, not by the driver with an opaque code.
        const MAX: [i64; 3] = [(1 << 31) - 1, 65535, 65535];
        if let Some(i) = (0..3).find(|&i| grid[i] < 0 || grid[i] > MAX[i]) {
            return Err(CudaError::Invalid(format!(
                "`{}`: grid {grid:?} is out of CUDA's range (axis {i} at most {}); the call is too large for \
                 this kernel's launch",
                k.entry, MAX[i]
            )));
        }
        let mut args = Vec::new();
        for t in tensors {
            args.push(Arg::U64(t.address));
            args.extend(t.shape.iter().map(|s| Arg::I64(*s as i64)));
            args.extend(t.strides.iter().map(|s| Arg::I64(*s as i64)));
        }
        for s in scalars {
            args.push(match s {
                Scalar::F32(x) => Arg::F32(*x),
                Scalar::I32(x) => Arg::I32(*x),
            });
        }
        // Held until the launch is queued: another launch may not shrink it meanwhile.
        let mut scratch = self.scratch.lock().map_err(|_| CudaError::Invalid("scratch poisoned".into()))?;
        if k.scratch_bytes > 0 {
            if !Arc::ptr_eq(stream, &self.stream) {
                return Err(CudaError::Invalid(format!(
                    "`{}` uses global scratch: it runs on the GPU's own stream only",
                    k.entry
                )));
            }
            let need = (grid[0] * grid[1] * grid[2]) as usize * k.scratch_bytes as usize;
            if scratch.as_ref().is_none_or(|s| s.len() < need) {
                *scratch = None;
                *scratch = Some(self.stream.alloc_zeros::<u8>(need).map_err(|e| {
                    CudaError::Driver(format!("`{}` needs {need} bytes of global scratch: {e:?}", k.entry))
                })?);
            }
            let (p, _sync) = scratch.as_ref().map(|s| s.device_ptr(&self.stream)).expect("allocated above");
            args.push(Arg::U64(p));
        }
        let mut b = stream.launch_builder(&k.func);
        for a in &args {
            match a {
                Arg::U64(x) => b.arg(x),
                Arg::I64(x) => b.arg(x),
                Arg::F32(x) => b.arg(x),
                Arg::I32(x) => b.arg(x),
            };
        }
        for m in maps {
            b.arg(m);
        }
        let cfg = LaunchConfig {
            grid_dim: (grid[0] as u32, grid[1] as u32, grid[2] as u32),
            block_dim: (k.threads, 1, 1),
            shared_mem_bytes: k.smem_bytes,
        };
        b.launch(cfg).map_err(|e| CudaError::Driver(format!("launching `{}`: {e:?}", k.entry)))?;
        Ok(())
    }

    /// The stream every launch of this GPU goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `n` streams besides [`Cuda::stream`] (non-blocking: they do not wait for the
    /// default stream by themselves; a plan orders them with events), made once and kept.
    pub fn side_streams(&self, n: usize) -> Result<Vec<Arc<CudaStream>>, CudaError> {
        let mut side = self.side.lock().map_err(|_| CudaError::Invalid("streams poisoned".into()))?;
        while side.len() < n {
            side.push(self.ctx.new_stream().map_err(drv)?);
        }
        Ok(side[..n].to_vec())
    }

    /// The GPU's context (to make more streams, load more modules).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(drv)
    }

    /// Milliseconds of GPU time for each of `reps` runs of `f` (CUDA events).
    pub fn time(&self, reps: usize, f: &mut dyn FnMut() -> Result<(), CudaError>) -> Result<Vec<f32>, CudaError> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut out = Vec::new();
        for _ in 0..reps {
            let a = self.stream.record_event(flags).map_err(drv)?;
            f()?;
            let b = self.stream.record_event(flags).map_err(drv)?;
            out.push(a.elapsed_ms(&b).map_err(drv)?);
        }
        Ok(out)
    }
}

/// A tensor argument as a launch passes it: device address of element [0, …], shape,
/// strides (elements).
#[derive(Clone, Debug, PartialEq)]
pub struct DevTensor {
    pub dtype: DType,
    pub address: u64,
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
}

impl DeviceBuffer {
    pub fn view(&self) -> DevTensor {
        DevTensor {
            dtype: self.dtype,
            address: self.address(),
            shape: self.shape.clone(),
            strides: self.strides.clone(),
        }
    }
}

impl Cuda {
    /// A contiguous buffer of `shape` in GPU memory, zeroed.
    pub fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<DeviceBuffer, CudaError> {
        let bytes = ejc_ir::limits::checked_product(shape)
            .ok()
            .and_then(|n| n.checked_mul(dtype.size_bytes()))
            .ok_or_else(|| {
                CudaError::Driver(format!("a {dtype} buffer of {shape:?} has more bytes than 64 bits count"))
            })?
            .max(1);
        let mem = match self.stream.alloc_zeros::<u8>(bytes) {
            Ok(m) => m,
            Err(_) => {
                // The pool keeps freed memory (keep_pool_memory): hand it back, then once more.
                self.stream.synchronize().map_err(drv)?;
                if let Some(pool) = default_pool(&self.ctx) {
                    // SAFETY: a live pool handle; trimming only releases unused memory.
                    unsafe { cudarc::driver::sys::cuMemPoolTrimTo(pool, 0) };
                }
                self.stream
                    .alloc_zeros::<u8>(bytes)
                    .map_err(|e| CudaError::Driver(format!("allocating {bytes} bytes: {e:?}")))?
            }
        };
        let ptr = {
            let (p, _sync) = mem.device_ptr(&self.stream);
            p
        };
        Ok(DeviceBuffer {
            dtype,
            shape: shape.to_vec(),
            strides: ejc_ir::tensor::HostTensor::contiguous_strides(shape),
            offset: 0,
            mem: Arc::new(mem),
            ptr,
        })
    }

    /// Copy `src` into `dst` on this GPU's stream (both contiguous, the same bytes).
    pub fn copy(&self, src: &DeviceBuffer, dst: &DeviceBuffer) -> Result<(), CudaError> {
        let bytes = |d: &DeviceBuffer| d.shape.iter().product::<usize>() * d.dtype.size_bytes();
        for d in [src, dst] {
            if d.strides != ejc_ir::tensor::HostTensor::contiguous_strides(&d.shape) {
                return Err(CudaError::Invalid(format!("copy: a non-contiguous buffer {:?}", d.shape)));
            }
        }
        if bytes(src) != bytes(dst) {
            return Err(CudaError::Invalid(format!("copy: {} bytes into {}", bytes(src), bytes(dst))));
        }
        if bytes(src) == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(drv)?;
        // Safety: both ranges lie inside live allocations (shape, contiguous strides).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst.address(), src.address(), bytes(src), self.stream.cu_stream())
        }
        .map_err(drv)
    }

    /// A new contiguous buffer holding a copy of `src`.
    pub fn duplicate(&self, src: &DeviceBuffer) -> Result<DeviceBuffer, CudaError> {
        let d = self.alloc(src.dtype, &src.shape)?;
        self.copy(src, &d)?;
        Ok(d)
    }

    /// This GPU as the tuning cache names machines: name, compute capability, driver.
    pub fn fingerprint(&self) -> String {
        let mut v: std::ffi::c_int = 0;
        // Safety: one out-parameter; the driver was loaded by `Cuda::new`.
        let ok =
            unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) } == cudarc::driver::sys::CUresult::CUDA_SUCCESS;
        let driver = if ok { format!("{}.{}", v / 1000, (v % 1000) / 10) } else { "unknown".into() };
        format!("cuda|{}|driver {driver}", self.device_name())
    }
}

/// Load the kernel of registry entry `e` (its general entry, or `entry`).
pub fn load_kernel(cuda: &Cuda, e: &KernelEntry, entry: &str) -> Result<CudaKernel, CudaError> {
    let ptx = std::fs::read_to_string(&e.artifact)
        .map_err(|err| CudaError::Invalid(format!("{}: {err}", e.artifact.display())))?;
    let threads = e.block.map(|b| b[0]).unwrap_or(128);
    let mut k = cuda.load(&ptx, entry, threads, e.dynamic_shared_memory)?;
    k.scratch_bytes = e.scratch_bytes;
    if let Some(al) = e.aligned.as_ref().filter(|al| al.entry == entry) {
        k.tensor_maps = al.tensor_maps.clone();
    }
    Ok(k)
}

/// Whether a `ptx:<arch>` / `mlir:gpu:<arch>` artifact runs on a GPU of compute
/// capability `cc` (e.g. 90): sm_80 code runs on every GPU from sm_80 on (the driver
/// JIT-compiles it), `sm_90a` only on 9.0.
pub fn runs_on(target: &str, cc: u32) -> bool {
    match target.strip_prefix("ptx:").or_else(|| target.strip_prefix("mlir:gpu:")) {
        Some("sm_90a") => cc == 90,
        Some(a) => a.trim_start_matches("sm_").parse::<u32>().map(|x| x <= cc).unwrap_or(false),
        None => false,
    }
}

/// One launch of a plan on the GPU: the general kernel, the aligned one with its
/// condition, parameters, grid, binding.
pub struct CudaLaunchSpec {
    pub kernel: CudaKernel,
    pub aligned: Option<(CudaKernel, AlignedEntry)>,
    pub params: Vec<ParamSig>,
    pub grid: [GridExpr; 3],
    pub launch: Launch,
}

impl CudaLaunchSpec {
    /// The launch of registry entry `e` in `launch` (both entries loaded).
    pub fn of_entry(cuda: &Cuda, e: &KernelEntry, launch: &Launch) -> Result<CudaLaunchSpec, CudaError> {
        let kernel = load_kernel(cuda, e, &e.entry)?;
        let aligned = match &e.aligned {
            Some(al) => Some((load_kernel(cuda, e, &al.entry)?, al.clone())),
            None => None,
        };
        let params = param_sigs(&e.params).map_err(CudaError::Invalid)?;
        let grid = e.grid.clone().ok_or_else(|| CudaError::Invalid(format!("`{}` has no launch grid", e.entry)))?;
        Ok(CudaLaunchSpec { kernel, aligned, params, grid, launch: launch.clone() })
    }
}

struct ReadyLaunch {
    kernel: CudaKernel,
    grid: [i64; 3],
    tensors: Vec<DevTensor>,
    scalars: Vec<Scalar>,
    maps: Vec<TensorMap>,
}

/// How a plan's launches spread over streams ("lanes"): lane 0 is the GPU's own stream,
/// lane `k > 0` its `k`-th side stream ([`Cuda::side_streams`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lanes {
    /// Per launch: its lane.
    pub lane: Vec<usize>,
    /// Per launch: the launches on other lanes it must wait for (by events); a launch
    /// earlier on its own lane is ordered by the stream.
    pub cross: Vec<Vec<usize>>,
    /// Lanes in use (1: the plan runs in order on one stream).
    pub count: usize,
}

impl Lanes {
    /// Lanes for launches that wait for `waits` (each launch's direct waits, as
    /// [`ejc_ir::manifest::launch_waits`] gives them): a launch continues the lane of its
    /// latest wait where that wait is its lane's last launch so far, else it opens a lane.
    /// So a plan in order stays on lane 0, and launches a plan declares independent of
    /// each other run on different streams. `one`: every launch on lane 0.
    pub fn assign(waits: &[Vec<usize>], one: bool) -> Lanes {
        let n = waits.len();
        if one {
            return Lanes { lane: vec![0; n], cross: vec![Vec::new(); n], count: 1 };
        }
        let mut lane: Vec<usize> = Vec::with_capacity(n);
        let mut last: Vec<usize> = Vec::new(); // per lane: its latest launch
        let mut cross = Vec::with_capacity(n);
        for (i, w) in waits.iter().enumerate() {
            let cont = w.iter().rev().map(|&d| lane[d]).find(|&l| w.contains(&last[l]));
            let l = match cont {
                Some(l) => l,
                None if last.is_empty() => 0,
                None => last.len(),
            };
            if l == last.len() {
                last.push(i);
            } else {
                last[l] = i;
            }
            lane.push(l);
            // The latest wait on each other lane (it orders the earlier ones there).
            let mut per: std::collections::BTreeMap<usize, usize> = std::collections::BTreeMap::new();
            for &d in w {
                if lane[d] != l {
                    let e = per.entry(lane[d]).or_insert(d);
                    *e = (*e).max(d);
                }
            }
            cross.push(per.into_values().collect());
        }
        Lanes { lane, cross, count: last.len().max(1) }
    }
}

/// Where a multi-lane plan's streams meet: the events a launch on another lane waits for.
struct LaneSync {
    side: Vec<Arc<CudaStream>>,
    /// Recorded on the GPU's stream before the first launch; every side stream waits for it.
    start: cudarc::driver::CudaEvent,
    /// Per side stream: recorded after its last launch; the GPU's stream waits for it.
    end: Vec<cudarc::driver::CudaEvent>,
    /// Per launch: recorded after it where a launch on another lane waits for it.
    done: Vec<Option<cudarc::driver::CudaEvent>>,
}

/// A plan ready to launch on a call's device tensors: kernels chosen (the aligned entry
/// where the tensors meet its condition), temporaries allocated, arguments bound and
/// tensor maps encoded — so that timing it measures the GPU, not the preparation.
/// Launches the plan declares independent (`after`) go to separate streams, joined back
/// into the GPU's stream before [`CudaPlan::launch`] returns (`EJC_PLAN_STREAMS=one`: all
/// on one stream, in order, for comparison).
pub struct CudaPlan {
    launches: Vec<ReadyLaunch>,
    _temps: Vec<DeviceBuffer>,
    /// Per launch: whether its aligned entry runs.
    pub aligned: Vec<bool>,
    /// The streams the launches run on.
    pub lanes: Lanes,
    sync: Option<LaneSync>,
    /// The order launches are enqueued in (the listed one unless [`CudaPlan::issue_late`]).
    issue: Vec<usize>,
}

/// Which entry of an artifact with an aligned one a plan calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EntryChoice {
    /// The aligned entry where the call's tensors and scalars meet its condition (what a
    /// launcher does), else the general one.
    #[default]
    Best,
    /// Always the general entry (checks run both).
    General,
}

impl CudaPlan {
    pub fn new(
        specs: Vec<CudaLaunchSpec>,
        temporaries: &[Temporary],
        call: &Call,
        sizes: &Sizes,
        config: &Config,
        cuda: &Cuda,
    ) -> Result<CudaPlan, CudaError> {
        Self::new_with(specs, temporaries, call, sizes, config, cuda, EntryChoice::Best)
    }

    pub fn new_with(
        specs: Vec<CudaLaunchSpec>,
        temporaries: &[Temporary],
        call: &Call,
        sizes: &Sizes,
        config: &Config,
        cuda: &Cuda,
        choice: EntryChoice,
    ) -> Result<CudaPlan, CudaError> {
        let bad = |m: String| CudaError::Invalid(m);
        let syms = symbols(sizes, config);
        // Temporaries the call gives (a precomputed layout): not allocated, and the
        // launches that only produce them skipped.
        let info = |n: &str| call.tensors.get(n).map(Tensor::info);
        let plan_launches: Vec<Launch> = specs.iter().map(|s| s.launch.clone()).collect();
        let given = ejc_ir::op::given_temporaries(temporaries, &plan_launches, &info, &syms).map_err(bad)?;
        let specs: Vec<CudaLaunchSpec> = specs
            .into_iter()
            .zip(given.launches)
            .filter_map(|(s, l)| l.map(|launch| CudaLaunchSpec { launch, ..s }))
            .collect();
        let temporaries = &given.temporaries[..];
        let mut temps = Vec::new();
        let mut views: std::collections::BTreeMap<String, DevTensor> = std::collections::BTreeMap::new();
        for t in temporaries {
            let (dtype, shape) =
                temporary_shape(t, &syms, |n| call.tensors.get(n).map(|x| x.info().dtype)).map_err(bad)?;
            let d = cuda.alloc(dtype, &shape)?;
            views.insert(t.name.clone(), d.view());
            temps.push(d);
        }
        for (n, t) in &call.tensors {
            match t {
                Tensor::Cuda(d) => {
                    views.insert(n.clone(), d.view());
                }
                Tensor::Host(_) => return Err(bad(format!("argument `{n}` is in host memory, not on the GPU"))),
            }
        }
        let lookup = |n: &str| call.tensors.get(n).map(Tensor::info);
        let plan_launches: Vec<Launch> = specs.iter().map(|s| s.launch.clone()).collect();
        let waits = ejc_ir::manifest::launch_waits(&plan_launches).map_err(bad)?;
        // The global scratch is one buffer: a plan with a kernel that uses it stays on one stream.
        let one = std::env::var("EJC_PLAN_STREAMS").is_ok_and(|v| v == "one")
            || specs.iter().any(|s| s.kernel.scratch_bytes > 0);
        let lanes = Lanes::assign(&waits, one);
        let mut launches = Vec::new();
        let mut aligned_used = Vec::new();
        for s in specs {
            let bound = bind(&s.params, &s.launch, temporaries, &lookup, &call.scalars, &syms).map_err(bad)?;
            let grid = grid_of(&s.grid, &syms).map_err(bad)?;
            let mut tensors = Vec::new();
            let mut names = Vec::new();
            let mut scalars = Vec::new();
            let mut scalar_names = Vec::new();
            for (p, b) in s.params.iter().zip(&bound) {
                match (b, &p.ty) {
                    (Bound::Tensor(n), _) => {
                        tensors.push(views[n].clone());
                        names.push(p.name.clone());
                    }
                    (Bound::Scalar(v), Type::Scalar(DType::F32)) => {
                        scalars.push(Scalar::F32(*v as f32));
                        scalar_names.push(p.name.clone());
                    }
                    (Bound::Scalar(v), _) => {
                        scalars.push(Scalar::I32(*v as i64 as u32 as i32));
                        scalar_names.push(p.name.clone());
                    }
                }
            }
            let meets = |al: &AlignedEntry| {
                al.tensors.iter().all(|t| {
                    names.iter().position(|n| n == t).is_some_and(|i| {
                        let st: Vec<i64> = tensors[i].strides.iter().map(|s| *s as i64).collect();
                        AlignedEntry::tensor_ok(tensors[i].address, &st)
                    })
                }) && al.positive.iter().all(|n| {
                    scalar_names.iter().position(|x| x == n).is_some_and(|i| match scalars[i] {
                        Scalar::F32(x) => x > 0.0,
                        Scalar::I32(x) => x > 0,
                    })
                })
            };
            let (kernel, used) = match s.aligned {
                Some((k, al)) if choice == EntryChoice::Best && meets(&al) => (k, true),
                _ => (s.kernel, false),
            };
            let mut maps = Vec::new();
            if !grid.contains(&0) {
                for p in &kernel.tensor_maps {
                    let i = names.iter().position(|n| *n == p.tensor).ok_or_else(|| {
                        bad(format!("`{}` wants a tensor map of `{}`, not a parameter", kernel.entry, p.tensor))
                    })?;
                    maps.push(encode_tensor_map(&tensors[i], p)?);
                }
            }
            aligned_used.push(used);
            launches.push(ReadyLaunch { kernel, grid, tensors, scalars, maps });
        }
        let sync = if lanes.count > 1 {
            let event = || cuda.ctx.new_event(None).map_err(drv);
            let mut done = Vec::new();
            for i in 0..launches.len() {
                let needed = lanes.cross.iter().any(|c| c.contains(&i));
                done.push(if needed { Some(event()?) } else { None });
            }
            Some(LaneSync {
                side: cuda.side_streams(lanes.count - 1)?,
                start: event()?,
                end: (1..lanes.count).map(|_| event()).collect::<Result<_, _>>()?,
                done,
            })
        } else {
            None
        };
        let issue = (0..launches.len()).collect();
        Ok(CudaPlan { launches, _temps: temps, aligned: aligned_used, lanes, sync, issue })
    }

    /// Prepare a registry candidate (PTX entries) for `call`.
    pub fn for_candidate(cuda: &Cuda, cand: &Candidate, call: &Call, sizes: &Sizes) -> Result<CudaPlan, CudaError> {
        Self::for_candidate_with(cuda, cand, call, sizes, EntryChoice::Best)
    }

    /// [`CudaPlan::for_candidate`], choosing entries by `choice`.
    pub fn for_candidate_with(
        cuda: &Cuda,
        cand: &Candidate,
        call: &Call,
        sizes: &Sizes,
        choice: EntryChoice,
    ) -> Result<CudaPlan, CudaError> {
        let mut specs = Vec::new();
        for (e, launch) in cand.launches.iter().zip(&cand.plan.plan.launches) {
            specs.push(CudaLaunchSpec::of_entry(cuda, e, launch)?);
        }
        CudaPlan::new_with(specs, &cand.plan.plan.temporaries, call, sizes, &cand.config, cuda, choice)
    }

    /// The same plan with every launch on the GPU's stream, in the listed order (to measure
    /// what the streams buy; `EJC_PLAN_STREAMS=one` does this for every plan).
    pub fn on_one_stream(mut self) -> CudaPlan {
        let n = self.launches.len();
        self.lanes = Lanes { lane: vec![0; n], cross: vec![Vec::new(); n], count: 1 };
        self.sync = None;
        self.issue = (0..n).collect();
        self
    }

    /// The same plan with its launches enqueued in [`ejc_ir::manifest::late_order`] (the
    /// latest-listed ready launch first): where launches run on several streams, which is
    /// enqueued first decides which takes the GPU's free multiprocessors first (`ejc-gpu
    /// bench` measures both).
    pub fn issue_late(mut self, plan: &[Launch]) -> Result<CudaPlan, CudaError> {
        self.issue = ejc_ir::manifest::late_order(plan).map_err(CudaError::Invalid)?;
        Ok(self)
    }

    /// Enqueue every launch (asynchronous: [`Cuda::synchronize`] waits). Launches on side
    /// streams start after what the GPU's stream held before this call, and the GPU's
    /// stream waits for all of them before anything enqueued after it.
    pub fn launch(&self, cuda: &Cuda) -> Result<(), CudaError> {
        let Some(sync) = &self.sync else {
            for l in &self.launches {
                // Safety: `new` checked every tensor's dtype and rank against the kernel's
                // parameters; tensors are separate allocations; the maps describe them.
                unsafe { cuda.launch(&l.kernel, l.grid, &l.tensors, &l.scalars, &l.maps)? };
            }
            return Ok(());
        };
        let main = cuda.stream();
        let stream = |lane: usize| if lane == 0 { main } else { &sync.side[lane - 1] };
        sync.start.record(main).map_err(drv)?;
        for s in &sync.side {
            s.wait(&sync.start).map_err(drv)?;
        }
        for &i in &self.issue {
            let l = &self.launches[i];
            let st = stream(self.lanes.lane[i]);
            for &d in &self.lanes.cross[i] {
                st.wait(sync.done[d].as_ref().expect("made for every launch another lane waits for")).map_err(drv)?;
            }
            // Safety: as above; and what the launch reads was written by the launches it
            // waits for (the plan's `after`), ordered by its stream or the events.
            unsafe { cuda.launch_on(st, &l.kernel, l.grid, &l.tensors, &l.scalars, &l.maps)? };
            if let Some(e) = &sync.done[i] {
                e.record(st).map_err(drv)?;
            }
        }
        for (s, e) in sync.side.iter().zip(&sync.end) {
            e.record(s).map_err(drv)?;
            main.wait(e).map_err(drv)?;
        }
        Ok(())
    }

    /// Median milliseconds of `reps` runs (CUDA events) after `warmup` untimed ones.
    /// Each launch's median time alone, in order, on the default stream: the plan runs
    /// once first, so every launch finds what earlier ones write (a multi-launch plan's
    /// breakdown: a layout against the attention that reads it, a partial against its
    /// combine).
    pub fn median_ms_per_launch(&self, cuda: &Cuda, warmup: usize, reps: usize) -> Result<Vec<f64>, CudaError> {
        self.launch(cuda)?;
        cuda.synchronize()?;
        let mut out = Vec::with_capacity(self.launches.len());
        for l in &self.launches {
            // Safety: as in `launch`; run alone, after the whole plan has run once.
            let mut run = || unsafe { cuda.launch(&l.kernel, l.grid, &l.tensors, &l.scalars, &l.maps) };
            if warmup > 0 {
                cuda.time(warmup, &mut run)?;
            }
            let mut ts = cuda.time(reps.max(1), &mut run)?;
            ts.sort_by(|a, b| a.total_cmp(b));
            out.push(ts[ts.len() / 2] as f64);
        }
        Ok(out)
    }

    pub fn median_ms(&self, cuda: &Cuda, warmup: usize, reps: usize) -> Result<f64, CudaError> {
        let mut run = || self.launch(cuda);
        if warmup > 0 {
            cuda.time(warmup, &mut run)?;
        }
        let mut ts = cuda.time(reps.max(1), &mut run)?;
        ts.sort_by(|a, b| a.total_cmp(b));
        Ok(ts[ts.len() / 2] as f64)
    }
}

/// Copy every host tensor of `call` to the GPU (device tensors stay).
pub fn upload_call(cuda: &std::sync::Arc<Cuda>, call: &Call) -> Result<Call, CudaError> {
    let mut out = Call { cuda: Some(cuda.clone()), ..Call::default() };
    out.scalars = call.scalars.clone();
    for (n, t) in &call.tensors {
        match t {
            Tensor::Host(h) => {
                out.tensors.insert(n.clone(), Tensor::Cuda(cuda.upload(h)?));
            }
            Tensor::Cuda(_) => return Err(CudaError::Invalid(format!("`{n}` is already on the GPU"))),
        }
    }
    Ok(out)
}

/// Copy tensors `names` of a device call back into host call `into`.
pub fn download_into(cuda: &Cuda, from: &Call, names: &[&str], into: &mut Call) -> Result<(), CudaError> {
    for n in names {
        if let Some(Tensor::Cuda(d)) = from.tensors.get(*n) {
            into.tensors.insert(n.to_string(), Tensor::Host(cuda.download(d)?));
        }
    }
    Ok(())
}

#[cfg(test)]
mod lane_tests {
    use super::Lanes;
    use ejc_ir::manifest::{launch_waits, Launch};

    fn launches(after: &[Option<Vec<usize>>]) -> Vec<Vec<usize>> {
        let ls: Vec<Launch> = after.iter().map(|a| Launch { after: a.clone(), ..Launch::of("k") }).collect();
        launch_waits(&ls).unwrap()
    }

    #[test]
    fn a_plan_in_order_stays_on_one_stream() {
        let l = Lanes::assign(&launches(&[None, None, None]), false);
        assert_eq!(l, Lanes { lane: vec![0, 0, 0], cross: vec![vec![], vec![], vec![]], count: 1 });
    }

    #[test]
    fn independent_classes_get_two_streams_and_meet_again() {
        // pack; decode after pack; prefill after pack; unpack after both.
        let w = launches(&[None, Some(vec![0]), Some(vec![0]), Some(vec![1, 2])]);
        let l = Lanes::assign(&w, false);
        assert_eq!(l.lane, vec![0, 0, 1, 1]);
        assert_eq!(l.cross, vec![vec![], vec![], vec![0], vec![1]]);
        assert_eq!(l.count, 2);
        // v3's `classed_split`: write; pack; classify (waits for nothing); decode_split;
        // combine_small; prefill (after pack and classify); unpack.
        let w = launches(&[None, None, Some(vec![]), Some(vec![1]), Some(vec![3]), Some(vec![1, 2]), Some(vec![4, 5])]);
        let l = Lanes::assign(&w, false);
        assert_eq!(l.lane, vec![0, 0, 1, 0, 0, 1, 1]);
        assert_eq!(l.cross, vec![vec![], vec![], vec![], vec![], vec![], vec![1], vec![4]]);
        // Forced onto one stream: no waits across streams.
        let l = Lanes::assign(&w, true);
        assert_eq!((l.lane, l.count), (vec![0; 7], 1));
    }

    #[test]
    fn a_launch_waiting_for_nothing_after_the_first_opens_a_stream() {
        let w = launches(&[None, Some(vec![]), Some(vec![0, 1])]);
        let l = Lanes::assign(&w, false);
        assert_eq!(l.lane, vec![0, 1, 1]);
        assert_eq!(l.cross, vec![vec![], vec![], vec![0]]);
    }
}
