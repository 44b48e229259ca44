//! Ring attention on GPUs: the glue kernels ([`CudaGlue`]) and NCCL as the ring's
//! transport ([`NcclComm`]), one process per GPU.
//!
//! The glue (merging blocks by log-sum-exp, summing gradients in f32, the final sinks
//! and rounding) is elementwise work around the flash launches; it is compiled from
//! the CUDA C below with NVRTC when a ring first runs on a GPU. The flash launches
//! themselves are ejc's PTX artifacts, through [`crate::api::Runtime::call`].
//!
//! NCCL is loaded at run time (`libnccl.so`, as NVIDIA's `nvidia-nccl` wheel or a CUDA
//! installation provides it; `LD_LIBRARY_PATH` must reach it). Sends and receives run
//! on a stream of their own, so a step's transfer overlaps its flash launches; events
//! order the two streams. NVLink multicast (NVLS) is never asked for.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nccl::sys as nccl;
use ejc_ir::types::DType;

use crate::api::ApiError;
use crate::call::Tensor;
use crate::cuda::{Cuda, DeviceBuffer};
use crate::ring::{Communicator, Glue};

fn err(m: impl Into<String>) -> ApiError {
    ApiError::Unsupported(m.into())
}

const GLUE: &str = r#"
typedef unsigned short u16;
typedef long long i64;
__device__ __forceinline__ float ld_f32(const void* p, i64 i) { return ((const float*)p)[i]; }
__device__ __forceinline__ float ld_bf16(const void* p, i64 i) {
    return __uint_as_float(((unsigned)((const u16*)p)[i]) << 16);
}
__device__ __forceinline__ float ld_f16(const void* p, i64 i) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(((const u16*)p)[i])); return f;
}
__device__ __forceinline__ void st_f32(void* p, i64 i, float x) { ((float*)p)[i] = x; }
__device__ __forceinline__ void st_bf16(void* p, i64 i, float x) {
    u16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x)); ((u16*)p)[i] = h;
}
__device__ __forceinline__ void st_f16(void* p, i64 i, float x) {
    u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x)); ((u16*)p)[i] = h;
}
#define NEG_INF (__int_as_float(0xff800000))

extern "C" __global__ void fill_f32(float* p, i64 n, float x) {
    i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i < n) p[i] = x;
}

// One warp per (b, i, h) row of a block, its lanes along D (coalesced):
// acc[b, off+i, h, :], acc_lse[b, h, off+i].
#define MERGE(T) \
extern "C" __global__ void merge_##T(float* acc, float* acc_lse, const void* o, const float* lse, \
                                     i64 B, i64 Lb, i64 H, i64 D, i64 L, i64 off) { \
    i64 r = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5; \
    int lane = threadIdx.x & 31; \
    if (r >= B * Lb * H) return; \
    i64 h = r % H, i = (r / H) % Lb, b = r / (H * Lb); \
    float l2 = lse[(b * H + h) * Lb + i]; \
    i64 ia = (b * H + h) * L + off + i; \
    float l1 = acc_lse[ia]; \
    float m = fmaxf(l1, l2); \
    if (m == NEG_INF) return; \
    float w1 = expf(l1 - m), w2 = expf(l2 - m), s = w1 + w2; \
    float a1 = w1 / s, a2 = w2 / s; \
    float* ap = acc + ((b * L + off + i) * H + h) * D; \
    i64 po = ((b * Lb + i) * H + h) * D; \
    for (i64 d = lane; d < D; d += 32) ap[d] = a1 * ap[d] + a2 * ld_##T(o, po + d); \
    __syncwarp(); \
    if (lane == 0) acc_lse[ia] = m + logf(s); \
}

// acc[b, off+i, :] += x[b, i, :] over `inner` = H * D elements a row: blockIdx.x is the
// row (b, i), blockIdx.y * blockDim.x + threadIdx.x the element.
#define ACCUMULATE(T) \
extern "C" __global__ void accumulate_##T(float* acc, const void* x, i64 B, i64 Lx, i64 inner, i64 L, i64 off) { \
    i64 row = blockIdx.x, c = blockIdx.y * (i64)blockDim.x + threadIdx.x; \
    if (c >= inner) return; \
    i64 i = row % Lx, b = row / Lx; \
    acc[(b * L + off + i) * inner + c] += ld_##T(x, row * inner + c); \
}

// One warp per (b, i, h) row: the sinks join once, the output is rounded.
#define FINALIZE(T) \
extern "C" __global__ void finalize_##T(const float* acc, const float* acc_lse, const float* sinks, i64 n_sinks, \
                                        void* out, float* lse, i64 B, i64 L, i64 H, i64 D) { \
    i64 r = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5; \
    int lane = threadIdx.x & 31; \
    if (r >= B * L * H) return; \
    i64 h = r % H, i = (r / H) % L, b = r / (H * L); \
    float l2 = NEG_INF; \
    if (n_sinks > 0) { \
        float m = NEG_INF; \
        for (i64 t = 0; t < n_sinks; t++) m = fmaxf(m, sinks[h * n_sinks + t]); \
        if (m != NEG_INF) { \
            float s = 0.f; \
            for (i64 t = 0; t < n_sinks; t++) s += expf(sinks[h * n_sinks + t] - m); \
            l2 = m + logf(s); \
        } \
    } \
    i64 il = (b * H + h) * L + i; \
    float l1 = acc_lse[il]; \
    float m = fmaxf(l1, l2), lf = m, scale = 0.f; \
    if (m != NEG_INF) { lf = m + logf(expf(l1 - m) + expf(l2 - m)); scale = expf(l1 - lf); } \
    if (lane == 0) lse[il] = lf; \
    i64 p = ((b * L + i) * H + h) * D; \
    for (i64 d = lane; d < D; d += 32) st_##T(out, p + d, acc[p + d] * scale); \
}

#define CONVERT(T) \
extern "C" __global__ void convert_##T(const float* acc, void* out, i64 n) { \
    i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; \
    if (e < n) st_##T(out, e, acc[e]); \
}

// One block of 256 threads per (h, t): every row in a fixed order, a fixed tree: the
// same bits on every run.
#define DSINKS(T) \
extern "C" __global__ void dsinks_##T(const float* sinks, i64 n_sinks, const float* lse, const void* out, \
                                      const void* dout, float* ds, i64 B, i64 L, i64 H, i64 D) { \
    __shared__ float part[256]; \
    i64 h = blockIdx.x / n_sinks, t = blockIdx.x % n_sinks; \
    float sink = sinks[h * n_sinks + t], sum = 0.f; \
    for (i64 r = threadIdx.x; r < B * L; r += 256) { \
        i64 b = r / L, i = r % L; \
        i64 p = ((b * L + i) * H + h) * D; \
        float delta = 0.f; \
        for (i64 d = 0; d < D; d++) delta += ld_##T(out, p + d) * ld_##T(dout, p + d); \
        float l = lse[(b * H + h) * L + i]; \
        if (l != NEG_INF) sum += expf(sink - l) * delta; \
    } \
    part[threadIdx.x] = sum; \
    __syncthreads(); \
    for (int s = 128; s > 0; s >>= 1) { \
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s]; \
        __syncthreads(); \
    } \
    if (threadIdx.x == 0) ds[h * n_sinks + t] = -part[0]; \
}

// Uniform values in [-1, 1) from (seed, index): benchmark inputs made where they live.
#define RANDOM(T) \
extern "C" __global__ void random_##T(void* p, i64 n, unsigned long long seed) { \
    i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; \
    if (e >= n) return; \
    unsigned long long z = seed + (unsigned long long)e * 0x9E3779B97F4A7C15ull; \
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; \
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull; \
    z ^= z >> 31; \
    st_##T(p, e, 2.f * ((float)(z >> 40) * (1.0f / 16777216.0f)) - 1.f); \
}

#define ALL(T) MERGE(T) ACCUMULATE(T) FINALIZE(T) CONVERT(T) DSINKS(T) RANDOM(T)
ALL(f32) ALL(bf16) ALL(f16)
"#;

fn suffix(d: DType) -> Result<&'static str, ApiError> {
    match d {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        other => Err(err(format!("ring glue: no {other} kernels"))),
    }
}

fn dev(t: &Tensor) -> Result<&DeviceBuffer, ApiError> {
    match t {
        Tensor::Cuda(d) => Ok(d),
        Tensor::Host(_) => Err(err("the GPU glue was given a host tensor")),
    }
}

fn contiguous(t: &Tensor, what: &str) -> Result<u64, ApiError> {
    let d = dev(t)?;
    if d.strides != ejc_ir::tensor::HostTensor::contiguous_strides(&d.shape) {
        return Err(err(format!(
            "ring glue: `{what}` must be contiguous (shape {:?}, strides {:?})",
            d.shape, d.strides
        )));
    }
    Ok(d.address())
}

/// [`Glue`] on a GPU: NVRTC-compiled kernels on the GPU's stream.
#[derive(Clone)]
pub struct CudaGlue {
    cuda: Arc<Cuda>,
    fns: HashMap<String, CudaFunction>,
}

impl CudaGlue {
    /// Compile the glue for `cuda`'s GPU (NVRTC, about a second).
    pub fn new(cuda: Arc<Cuda>) -> Result<CudaGlue, ApiError> {
        let cc = cuda.compute_capability();
        let arch: &'static str = Box::leak(format!("compute_{cc}").into_boxed_str());
        let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), ..Default::default() };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(GLUE, opts)
            .map_err(|e| err(format!("NVRTC could not compile the ring glue: {e:?}")))?;
        let module =
            cuda.context().load_module(ptx).map_err(|e| err(format!("the driver rejected the ring glue: {e:?}")))?;
        let mut fns = HashMap::new();
        let mut names = vec!["fill_f32".to_string()];
        for t in ["f32", "bf16", "f16"] {
            for k in ["merge", "accumulate", "finalize", "convert", "dsinks", "random"] {
                names.push(format!("{k}_{t}"));
            }
        }
        for n in names {
            let f = module.load_function(&n).map_err(|e| err(format!("ring glue `{n}`: {e:?}")))?;
            fns.insert(n, f);
        }
        Ok(CudaGlue { cuda, fns })
    }

    fn f(&self, name: &str) -> Result<&CudaFunction, ApiError> {
        self.fns.get(name).ok_or_else(|| err(format!("no ring glue kernel `{name}`")))
    }

    fn cfg(n: i64) -> LaunchConfig {
        LaunchConfig { grid_dim: ((n.max(1) as u32).div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    /// One warp per row, 8 rows a block.
    fn warps(rows: i64) -> LaunchConfig {
        LaunchConfig { grid_dim: ((rows.max(1) as u32).div_ceil(8), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.cuda.stream()
    }

    /// Fill a contiguous float tensor with uniform values in [-1, 1) from `seed`.
    pub fn random(&self, t: &mut Tensor, seed: u64) -> Result<(), ApiError> {
        let p = contiguous(t, "random")?;
        let d = dev(t)?;
        let name = format!("random_{}", suffix(d.dtype)?);
        let n = d.shape.iter().product::<usize>() as i64;
        let mut k = self.stream().launch_builder(self.f(&name)?);
        k.arg(&p).arg(&n).arg(&seed);
        unsafe { k.launch(Self::cfg(n)) }.map_err(launch_err(&name))?;
        Ok(())
    }
}

/// A GPU as a ring's rank device: every rank of a simulation (threads sharing one GPU)
/// or the one rank of a process.
pub struct GpuDevice {
    pub cuda: Arc<Cuda>,
    pub glue: CudaGlue,
}

impl GpuDevice {
    pub fn new(cuda: Arc<Cuda>) -> Result<GpuDevice, ApiError> {
        let glue = CudaGlue::new(cuda.clone())?;
        Ok(GpuDevice { cuda, glue })
    }
}

impl crate::ring::RankDevice for GpuDevice {
    fn glue(&self) -> Result<Box<dyn Glue + '_>, ApiError> {
        Ok(Box::new(self.glue.clone()))
    }
    fn upload(&self, h: &crate::cpu::HostBuffer) -> Result<Tensor, ApiError> {
        self.cuda.upload(h).map(Tensor::Cuda).map_err(|e| err(e.to_string()))
    }
    fn download(&self, t: &Tensor) -> Result<crate::cpu::HostBuffer, ApiError> {
        let d = dev(t)?;
        // The whole allocation comes back; views are re-based on their own offset.
        self.cuda.download(d).map_err(|e| err(e.to_string()))
    }
    fn attach(&self, rt: &mut crate::api::Runtime) -> Result<(), ApiError> {
        rt.set_cuda(self.cuda.clone());
        Ok(())
    }
}

fn launch_err(name: &str) -> impl Fn(cudarc::driver::DriverError) -> ApiError + '_ {
    move |e| err(format!("launching ring glue `{name}`: {e:?}"))
}

impl Glue for CudaGlue {
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor, ApiError> {
        self.cuda.alloc(dtype, shape).map(Tensor::Cuda).map_err(|e| err(e.to_string()))
    }

    fn fill(&self, t: &mut Tensor, x: f32) -> Result<(), ApiError> {
        let p = contiguous(t, "fill")?;
        let d = dev(t)?;
        if d.dtype != DType::F32 {
            return Err(err("ring glue: fill takes f32 tensors"));
        }
        let n: i64 = d.shape.iter().product::<usize>() as i64;
        let mut b = self.stream().launch_builder(self.f("fill_f32")?);
        b.arg(&p).arg(&n).arg(&x);
        unsafe { b.launch(Self::cfg(n)) }.map_err(launch_err("fill_f32"))?;
        Ok(())
    }

    fn merge(
        &self,
        acc: &mut Tensor,
        acc_lse: &mut Tensor,
        o: &Tensor,
        lse: &Tensor,
        off: usize,
    ) -> Result<(), ApiError> {
        let (pa, pl, po, ps) =
            (contiguous(acc, "acc")?, contiguous(acc_lse, "acc_lse")?, contiguous(o, "o")?, contiguous(lse, "lse")?);
        let s = dev(acc)?.shape.clone();
        let od = dev(o)?;
        let name = format!("merge_{}", suffix(od.dtype)?);
        let (b, lb, h, d, l, off) =
            (s[0] as i64, od.shape[1] as i64, s[2] as i64, s[3] as i64, s[1] as i64, off as i64);
        let mut k = self.stream().launch_builder(self.f(&name)?);
        k.arg(&pa).arg(&pl).arg(&po).arg(&ps).arg(&b).arg(&lb).arg(&h).arg(&d).arg(&l).arg(&off);
        unsafe { k.launch(Self::warps(b * lb * h)) }.map_err(launch_err(&name))?;
        Ok(())
    }

    fn accumulate(&self, acc: &mut Tensor, x: &Tensor, off: usize) -> Result<(), ApiError> {
        let (pa, px) = (contiguous(acc, "acc")?, contiguous(x, "x")?);
        let s = dev(acc)?.shape.clone();
        let xd = dev(x)?;
        let name = format!("accumulate_{}", suffix(xd.dtype)?);
        let (b, lx, inner, l, off) = (s[0] as i64, xd.shape[1] as i64, (s[2] * s[3]) as i64, s[1] as i64, off as i64);
        let mut k = self.stream().launch_builder(self.f(&name)?);
        k.arg(&pa).arg(&px).arg(&b).arg(&lx).arg(&inner).arg(&l).arg(&off);
        let cfg = LaunchConfig {
            grid_dim: ((b * lx).max(1) as u32, (inner.max(1) as u32).div_ceil(256), 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { k.launch(cfg) }.map_err(launch_err(&name))?;
        Ok(())
    }

    fn finalize(
        &self,
        acc: &Tensor,
        acc_lse: &Tensor,
        sinks: Option<&Tensor>,
        out: &mut Tensor,
        lse: &mut Tensor,
    ) -> Result<(), ApiError> {
        let (pa, pl, po, ps) = (
            contiguous(acc, "acc")?,
            contiguous(acc_lse, "acc_lse")?,
            contiguous(out, "out")?,
            contiguous(lse, "lse")?,
        );
        let (psk, n_sinks) = match sinks {
            Some(t) => (contiguous(t, "sinks")?, dev(t)?.shape[1] as i64),
            None => (0u64, 0i64),
        };
        let s = dev(acc)?.shape.clone();
        let name = format!("finalize_{}", suffix(dev(out)?.dtype)?);
        let (b, l, h, d) = (s[0] as i64, s[1] as i64, s[2] as i64, s[3] as i64);
        let mut k = self.stream().launch_builder(self.f(&name)?);
        k.arg(&pa).arg(&pl).arg(&psk).arg(&n_sinks).arg(&po).arg(&ps).arg(&b).arg(&l).arg(&h).arg(&d);
        unsafe { k.launch(Self::warps(b * l * h)) }.map_err(launch_err(&name))?;
        Ok(())
    }

    fn convert(&self, acc: &Tensor, out: &mut Tensor) -> Result<(), ApiError> {
        let (pa, po) = (contiguous(acc, "acc")?, contiguous(out, "out")?);
        let n = dev(acc)?.shape.iter().product::<usize>() as i64;
        let name = format!("convert_{}", suffix(dev(out)?.dtype)?);
        let mut k = self.stream().launch_builder(self.f(&name)?);
        k.arg(&pa).arg(&po).arg(&n);
        unsafe { k.launch(Self::cfg(n)) }.map_err(launch_err(&name))?;
        Ok(())
    }

    fn dsinks(&self, sinks: &Tensor, lse: &Tensor, out: &Tensor, dout: &Tensor) -> Result<Tensor, ApiError> {
        let (psk, pl, po, pg) =
            (contiguous(sinks, "sinks")?, contiguous(lse, "lse")?, contiguous(out, "out")?, contiguous(dout, "dout")?);
        let ss = dev(sinks)?.shape.clone();
        let s = dev(out)?.shape.clone();
        let ds = self.alloc(DType::F32, &ss)?;
        let pd = contiguous(&ds, "dsinks")?;
        let name = format!("dsinks_{}", suffix(dev(out)?.dtype)?);
        let (n_sinks, b, l, h, d) = (ss[1] as i64, s[0] as i64, s[1] as i64, s[2] as i64, s[3] as i64);
        let mut k = self.stream().launch_builder(self.f(&name)?);
        k.arg(&psk).arg(&n_sinks).arg(&pl).arg(&po).arg(&pg).arg(&pd).arg(&b).arg(&l).arg(&h).arg(&d);
        let cfg =
            LaunchConfig { grid_dim: ((h * n_sinks).max(1) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        unsafe { k.launch(cfg) }.map_err(launch_err(&name))?;
        Ok(ds)
    }

    fn sync(&self) -> Result<(), ApiError> {
        self.stream().synchronize().map_err(|e| err(format!("{e:?}")))
    }

    fn rows(&self, t: &Tensor, axis: usize, r: Range<usize>) -> Result<Tensor, ApiError> {
        let mut d = dev(t)?.clone();
        if r.end > d.shape[axis] {
            return Err(err(format!("rows {r:?} of axis {axis} outside {:?}", d.shape)));
        }
        d.offset = (d.offset as isize + r.start as isize * d.strides[axis]) as usize;
        d.shape[axis] = r.len();
        Ok(Tensor::Cuda(d))
    }
}

/// An NCCL unique id (made by one rank, given to every other: a file, an environment
/// variable, the caller's own channel), as bytes.
pub fn nccl_unique_id() -> Result<Vec<u8>, ApiError> {
    let id = cudarc::nccl::result::get_uniqueid().map_err(|e| err(format!("ncclGetUniqueId: {e:?}")))?;
    Ok(id.internal.iter().map(|c| *c as u8).collect())
}

/// One rank of a ring over NCCL: this process's GPU, the communicator, and a stream for
/// the transfers.
pub struct NcclComm {
    rank: usize,
    size: usize,
    comm: nccl::ncclComm_t,
    cuda: Arc<Cuda>,
    stream: Arc<CudaStream>,
    events: HashMap<u8, CudaEvent>,
}

impl NcclComm {
    /// Join the communicator `id` (from [`nccl_unique_id`]) as `rank` of `size`, on
    /// `cuda`'s GPU. Every rank must call this (it blocks until all have).
    pub fn new(cuda: Arc<Cuda>, rank: usize, size: usize, id: &[u8]) -> Result<NcclComm, ApiError> {
        if id.len() != 128 {
            return Err(err(format!("an NCCL unique id has 128 bytes, not {}", id.len())));
        }
        let mut uid = nccl::ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(id) {
            *d = *s as _;
        }
        cuda.context().bind_to_thread().map_err(|e| err(format!("{e:?}")))?;
        // The transfers' stream has the highest priority: NCCL's kernel then takes the
        // first SM a flash block frees, instead of queueing behind every block of the
        // step's launch (which left the transfer to the step's end, where ranks waited on
        // each other). EJC_RING_COMM_PRIORITY=normal turns this off, for comparison.
        let stream = if std::env::var("EJC_RING_COMM_PRIORITY").is_ok_and(|v| v == "normal") {
            cuda.context().new_stream()
        } else {
            let (_, greatest) = cudarc::driver::result::stream::get_priority_range()
                .map_err(|e| err(format!("cuCtxGetStreamPriorityRange: {e:?}")))?;
            cuda.context().new_stream_with_priority(greatest)
        }
        .map_err(|e| err(format!("a stream for NCCL: {e:?}")))?;
        let mut comm = std::mem::MaybeUninit::uninit();
        unsafe { cudarc::nccl::result::comm_init_rank(comm.as_mut_ptr(), size as i32, uid, rank as i32) }
            .map_err(|e| err(format!("ncclCommInitRank (rank {rank} of {size}): {e:?}")))?;
        let comm = unsafe { comm.assume_init() };
        Ok(NcclComm { rank, size, comm, cuda, stream, events: HashMap::new() })
    }

    fn next(&self) -> i32 {
        ((self.rank + 1) % self.size) as i32
    }

    fn prev(&self) -> i32 {
        ((self.rank + self.size - 1) % self.size) as i32
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        unsafe {
            let _ = cudarc::nccl::result::comm_destroy(self.comm);
        }
    }
}

fn bytes_of(d: &DeviceBuffer) -> usize {
    d.shape.iter().product::<usize>() * d.dtype.size_bytes()
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    fn start(&mut self, tag: u8, send: &[&Tensor], recv: &[&Tensor]) -> Result<(), ApiError> {
        // The buffers received into were read by launches queued on the compute stream.
        let ev = self.cuda.stream().record_event(None).map_err(|e| err(format!("{e:?}")))?;
        self.stream.wait(&ev).map_err(|e| err(format!("{e:?}")))?;
        let s = self.stream.cu_stream() as nccl::cudaStream_t;
        cudarc::nccl::result::group_start().map_err(|e| err(format!("ncclGroupStart: {e:?}")))?;
        for (a, b) in send.iter().zip(recv) {
            let (a, b) = (dev(a)?, dev(b)?);
            for (t, what) in [(a, "send"), (b, "recv")] {
                if t.strides != ejc_ir::tensor::HostTensor::contiguous_strides(&t.shape) {
                    return Err(err(format!("NCCL {what}: a non-contiguous buffer {:?}", t.shape)));
                }
            }
            let n = bytes_of(a);
            if n != bytes_of(b) {
                return Err(err(format!("NCCL: sending {n} bytes into {}", bytes_of(b))));
            }
            unsafe {
                cudarc::nccl::result::send(
                    a.address() as *const _,
                    n,
                    nccl::ncclDataType_t::ncclUint8,
                    self.next(),
                    self.comm,
                    s,
                )
                .map_err(|e| err(format!("ncclSend: {e:?}")))?;
                cudarc::nccl::result::recv(
                    b.address() as *mut _,
                    n,
                    nccl::ncclDataType_t::ncclUint8,
                    self.prev(),
                    self.comm,
                    s,
                )
                .map_err(|e| err(format!("ncclRecv: {e:?}")))?;
            }
        }
        cudarc::nccl::result::group_end().map_err(|e| err(format!("ncclGroupEnd: {e:?}")))?;
        let done = self.stream.record_event(None).map_err(|e| err(format!("{e:?}")))?;
        self.events.insert(tag, done);
        Ok(())
    }

    fn wait(&mut self, tag: u8, _recv: &mut [&mut Tensor]) -> Result<(), ApiError> {
        let ev = self.events.remove(&tag).ok_or_else(|| err(format!("NCCL: no transfer {tag} in flight")))?;
        self.cuda.stream().wait(&ev).map_err(|e| err(format!("{e:?}")))
    }

    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), ApiError> {
        // All-gather, then a sum in rank order on the host: the same bits on every rank
        // and as the simulation's (a ring all-reduce sums in an order of its own).
        let d = dev(t)?.clone();
        if d.dtype != DType::F32 || d.strides != ejc_ir::tensor::HostTensor::contiguous_strides(&d.shape) {
            return Err(err("NCCL all-reduce: contiguous f32 tensors only"));
        }
        let n = d.shape.iter().product::<usize>();
        let all = self.cuda.alloc(DType::F32, &[self.size, n]).map_err(|e| err(e.to_string()))?;
        let s = self.cuda.stream().cu_stream() as nccl::cudaStream_t;
        unsafe {
            cudarc::nccl::result::all_gather(
                d.address() as *const _,
                all.address() as *mut _,
                n,
                nccl::ncclDataType_t::ncclFloat32,
                self.comm,
                s,
            )
        }
        .map_err(|e| err(format!("ncclAllGather: {e:?}")))?;
        let host = self.cuda.download(&all).map_err(|e| err(e.to_string()))?;
        let xs = crate::ring::f32s(&Tensor::Host(host))?;
        let parts: Vec<Vec<f32>> = xs.chunks(n.max(1)).map(|c| c.to_vec()).collect();
        let sum = crate::ring::sum_in_rank_order(&parts[..self.size]);
        let mut h = Tensor::Host(crate::cpu::HostBuffer::try_zeros(DType::F32, &d.shape).map_err(err)?);
        crate::ring::put_f32s(&mut h, &sum)?;
        let up = self.cuda.upload(h.host().expect("host")).map_err(|e| err(e.to_string()))?;
        self.cuda.copy(&up, &d).map_err(|e| err(e.to_string()))
    }
}
