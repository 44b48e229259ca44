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
use ejc_ir::flash::abi::abi_params;
use ejc_ir::flash::FlashRuntime;
use ejc_ir::spec::Features;
use ejc_ir::types::{DType, Type};

use crate::cpu::HostBuffer;
use crate::flash::{launch_plan, tensor_names, FlashBuffers};

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

/// A tensor in device memory (same layout as the [`HostBuffer`] it came from).
pub struct DeviceBuffer {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
    /// Element offset of index [0, …] from the start of `mem`.
    pub offset: usize,
    mem: CudaSlice<u8>,
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
pub fn encode_tensor_map(t: &DeviceBuffer, p: &ejc_ir::manifest::TensorMapParam) -> Result<TensorMap, CudaError> {
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
            t.address() as *mut std::ffi::c_void,
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
}

impl Cuda {
    /// The first GPU, or why there is none.
    pub fn new() -> Result<Cuda, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let n = CudaContext::device_count().map_err(drv)?;
        if n < 1 {
            return Err(CudaError::Driver("the driver reports no GPU".into()));
        }
        let ctx = CudaContext::new(0).map_err(drv)?;
        let stream = ctx.default_stream();
        Ok(Cuda { ctx, stream, kernels: Mutex::new(HashMap::new()), scratch: Mutex::new(None) })
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
            mem,
            ptr,
        })
    }

    /// Copy a device buffer back (the whole allocation, same layout).
    pub fn download(&self, d: &DeviceBuffer) -> Result<HostBuffer, CudaError> {
        let bytes = self.stream.clone_dtoh(&d.mem).map_err(drv)?;
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
        tensors: &[&DeviceBuffer],
        scalars: &[Scalar],
        maps: &[TensorMap],
    ) -> Result<(), CudaError> {
        if maps.len() != k.tensor_maps.len() {
            return Err(CudaError::Invalid(format!(
                "`{}` takes {} tensor maps, {} given",
                k.entry,
                k.tensor_maps.len(),
                maps.len()
            )));
        }
        if grid.iter().any(|g| *g < 0 || *g > u32::MAX as i64) {
            return Err(CudaError::Invalid(format!("grid {grid:?} is out of range")));
        }
        if grid.contains(&0) {
            return Ok(());
        }
        let mut args = Vec::new();
        for t in tensors {
            args.push(Arg::U64(t.address()));
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
        let mut b = self.stream.launch_builder(&k.func);
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

/// A flash call with every tensor on the device.
pub struct FlashDevice {
    /// In ABI order (`tensor_names`).
    pub tensors: Vec<DeviceBuffer>,
    pub names: Vec<&'static str>,
    pub grid: [i64; 3],
    pub scalars: Vec<Scalar>,
    /// The scalars' parameter names, in the same order.
    pub scalar_names: Vec<String>,
    /// Tensor maps encoded for these tensors, by entry (see [`CudaKernel::tensor_maps`]).
    maps: Mutex<HashMap<String, Vec<TensorMap>>>,
}

impl FlashDevice {
    /// Check `call` against the kernel's ABI (errors name the argument), then upload.
    pub fn new(
        cuda: &Cuda,
        features: &Features,
        dtype: DType,
        head_dim: usize,
        block_m: usize,
        rt: &FlashRuntime,
        call: &mut FlashBuffers,
    ) -> Result<FlashDevice, CudaError> {
        let (grid, slots) =
            launch_plan(features, dtype, head_dim, block_m, rt, call).map_err(|e| CudaError::Invalid(e.to_string()))?;
        let mut scalars = Vec::new();
        let mut scalar_names = Vec::new();
        let mut si = 0;
        for p in abi_params(features, dtype) {
            if let Type::Scalar(d) = p.ty {
                scalar_names.push(p.name.to_string());
                let slot = slots[si];
                si += 1;
                scalars.push(match d {
                    DType::F32 => Scalar::F32(f32::from_bits(slot as u32)),
                    _ => Scalar::I32(slot as u32 as i32),
                });
            }
        }
        let names = tensor_names(features, dtype);
        let mut tensors = Vec::new();
        for n in &names {
            let b = call.get(n).ok_or_else(|| CudaError::Invalid(format!("the call has no `{n}`")))?;
            tensors.push(cuda.upload(b)?);
        }
        Ok(FlashDevice { tensors, names, grid, scalars, scalar_names, maps: Mutex::new(HashMap::new()) })
    }

    /// Whether these tensors meet the condition of an artifact's aligned entry (every
    /// tensor it names aligned; docs/abi.md, "Aligned entry").
    pub fn meets(&self, aligned: &ejc_ir::manifest::AlignedEntry) -> bool {
        let positive = aligned.positive.iter().all(|n| {
            self.scalar_names.iter().position(|x| x == n).is_some_and(|i| match self.scalars[i] {
                Scalar::F32(x) => x > 0.0,
                Scalar::I32(x) => x > 0,
            })
        });
        positive
            && aligned.tensors.iter().all(|t| {
                self.names.iter().position(|n| n == t).is_some_and(|i| {
                    let b = &self.tensors[i];
                    let strides: Vec<i64> = b.strides.iter().map(|s| *s as i64).collect();
                    ejc_ir::manifest::AlignedEntry::tensor_ok(b.address(), &strides)
                })
            })
    }

    /// Launch `k` on these tensors.
    pub fn launch(&self, cuda: &Cuda, k: &CudaKernel) -> Result<(), CudaError> {
        let refs: Vec<&DeviceBuffer> = self.tensors.iter().collect();
        let mut maps = Vec::new();
        if !k.tensor_maps.is_empty() && !self.grid.contains(&0) {
            let mut cache = self.maps.lock().map_err(|_| CudaError::Invalid("tensor-map cache poisoned".into()))?;
            if !cache.contains_key(&k.entry) {
                let mut ms = Vec::new();
                for p in &k.tensor_maps {
                    let i = self.names.iter().position(|n| *n == p.tensor).ok_or_else(|| {
                        CudaError::Invalid(format!(
                            "`{}` wants a tensor map of `{}`, not in the call",
                            k.entry, p.tensor
                        ))
                    })?;
                    ms.push(encode_tensor_map(&self.tensors[i], p)?);
                }
                cache.insert(k.entry.clone(), ms);
            }
            maps = cache[&k.entry].clone();
        }
        // Safety: `new` checked every tensor against the ABI; outputs are separate
        // allocations; the maps describe these tensors.
        unsafe { cuda.launch(k, self.grid, &refs, &self.scalars, &maps) }
    }

    /// Copy `out` and `lse` back into `call`.
    pub fn read_outputs(&self, cuda: &Cuda, call: &mut FlashBuffers) -> Result<(), CudaError> {
        for (n, d) in self.names.iter().zip(&self.tensors) {
            if *n == "out" || *n == "lse" {
                let h = cuda.download(d)?;
                if let Some(b) = call.get(n) {
                    *b = h;
                }
            }
        }
        Ok(())
    }
}

// ---- artifacts of a build: what `ejc-gpu` and `ejc run/bench --backend cuda` share

/// Load entry `entry` (the artifact's `entry`, or its aligned entry) of PTX artifact
/// `a` of build `m`: the driver JIT-compiles the module for this GPU.
pub fn load_entry(
    cuda: &Cuda,
    m: &crate::manifest::Loaded,
    a: &ejc_ir::manifest::Artifact,
    entry: &str,
) -> Result<CudaKernel, CudaError> {
    let path = m.path_of(a);
    let ptx = std::fs::read_to_string(&path).map_err(|e| CudaError::Invalid(format!("{}: {e}", path.display())))?;
    let threads = a.block.map(|b| b[0]).unwrap_or(128);
    let mut k = cuda.load(&ptx, entry, threads, a.dynamic_shared_memory)?;
    k.scratch_bytes = a.scratch_bytes;
    if let Some(al) = a.aligned.as_ref().filter(|al| al.entry == entry) {
        k.tensor_maps = al.tensor_maps.clone();
    }
    Ok(k)
}

/// The entry a launcher calls for `dev`: the aligned one when the call meets its
/// condition (docs/abi.md, "Aligned entry"), else the general one.
pub fn entry_for<'a>(a: &'a ejc_ir::manifest::Artifact, dev: &FlashDevice) -> &'a str {
    match &a.aligned {
        Some(al) if dev.meets(al) => &al.entry,
        _ => &a.entry,
    }
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

/// Median milliseconds of `reps` launches of `k` on `dev`, timed with CUDA events,
/// after `warmup` untimed launches.
pub fn median_ms(cuda: &Cuda, dev: &FlashDevice, k: &CudaKernel, warmup: usize, reps: usize) -> Result<f64, CudaError> {
    let mut run = || dev.launch(cuda, k);
    if warmup > 0 {
        cuda.time(warmup, &mut run)?;
    }
    let mut ts = cuda.time(reps.max(1), &mut run)?;
    ts.sort_by(|a, b| a.total_cmp(b));
    Ok(ts[ts.len() / 2] as f64)
}
