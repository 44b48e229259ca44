//! The CPU executor: runs kernels with the C ABI of `ejc_ir::cpu_abi` over a launch
//! grid on a thread pool. Kernels come from shared libraries written by
//! `ejc build --target cpu` (loaded with libloading: no LLVM here) or from any other
//! source of an entry point (the JIT in ejc-codegen).
//!
//! ```no_run
//! use ejc_runtime::cpu::{CpuLibrary, HostBuffer};
//! let lib = CpuLibrary::open("out/cpu/flash.avx512bf16.so").unwrap();
//! let kernel = lib.kernel("flash_causal_f32_d64_m64_n32", 1 << 20).unwrap();
//! // kernel.launch(&mut tensors, &scalars, grid, threads)
//! ```
//!
//! Programs are handed out one at a time from an atomic counter, so a causal grid
//! (whose programs differ in cost) stays balanced. Each worker thread keeps its own
//! scratch buffer between launches.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use ejc_ir::cpu_abi::{EjcTensor, EntryFn, MAX_RANK, SCRATCH_ALIGN};
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;

#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("cannot load {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{path} has no kernel `{name}`")]
    NoSymbol { path: PathBuf, name: String },
    #[error("{0}")]
    Invalid(String),
    #[error("could not start worker threads: {0}")]
    Threads(String),
}

/// A host tensor in its device representation: raw little-endian elements of its
/// dtype (bf16/f16 as 16-bit patterns, i1 as bytes), with shape and strides.
#[derive(Clone, Debug, PartialEq)]
pub struct HostBuffer {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// In elements; may be 0 (broadcast) or anything that stays inside `bytes`.
    pub strides: Vec<isize>,
    /// Element offset of index [0, ...].
    pub offset: usize,
    pub bytes: Vec<u8>,
}

fn encode(dtype: DType, x: f64, out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
        DType::F64 => out.extend_from_slice(&x.to_le_bytes()),
        DType::F16 => out.extend_from_slice(&ejc_ir::types::f64_to_f16(x).to_bits().to_le_bytes()),
        DType::BF16 => out.extend_from_slice(&ejc_ir::types::f64_to_bf16(x).to_bits().to_le_bytes()),
        DType::I32 => out.extend_from_slice(&(x as i64 as i32).to_le_bytes()),
        DType::U32 => out.extend_from_slice(&(x as i64 as u32).to_le_bytes()),
        DType::I1 => out.push((x != 0.0) as u8),
    }
}

fn decode(dtype: DType, b: &[u8]) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::F64 => f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
        DType::F16 => half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f64(),
        DType::BF16 => half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f64(),
        DType::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::I1 => (b[0] != 0) as u8 as f64,
    }
}

impl HostBuffer {
    /// The device representation of a host tensor (same storage layout).
    pub fn from_host(t: &HostTensor) -> HostBuffer {
        let mut bytes = Vec::with_capacity(t.data.len() * t.dtype.size_bytes());
        for x in &t.data {
            encode(t.dtype, *x, &mut bytes);
        }
        HostBuffer { dtype: t.dtype, shape: t.shape.clone(), strides: t.strides.clone(), offset: t.offset, bytes }
    }

    /// A contiguous buffer of zeros. Panics where [`HostBuffer::try_zeros`] fails.
    pub fn zeros(dtype: DType, shape: &[usize]) -> HostBuffer {
        Self::try_zeros(dtype, shape).unwrap_or_else(|e| panic!("HostBuffer::zeros: {e}"))
    }

    /// A contiguous buffer of zeros, or an error when its size overflows 64 bits or
    /// the allocation fails (never an abort).
    pub fn try_zeros(dtype: DType, shape: &[usize]) -> Result<HostBuffer, String> {
        let bytes = ejc_ir::limits::checked_product(shape)?
            .checked_mul(dtype.size_bytes())
            .ok_or_else(|| format!("a {dtype} buffer of {shape:?} has more bytes than 64 bits count"))?;
        let mut data = Vec::new();
        data.try_reserve_exact(bytes).map_err(|_| {
            format!("cannot allocate {} for a {dtype} buffer of {shape:?}", ejc_ir::limits::show_bytes(bytes as u64))
        })?;
        data.resize(bytes, 0u8);
        Ok(HostBuffer {
            dtype,
            shape: shape.to_vec(),
            strides: HostTensor::contiguous_strides(shape),
            offset: 0,
            bytes: data,
        })
    }

    /// Back to a host tensor (same storage layout).
    pub fn to_host(&self) -> HostTensor {
        let es = self.dtype.size_bytes();
        let data = self.bytes.chunks_exact(es).map(|c| decode(self.dtype, c)).collect();
        HostTensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            offset: self.offset,
            data,
        }
    }

    /// Every element reachable through shape and strides lies inside `bytes`.
    pub fn check_bounds(&self) -> Result<(), String> {
        let n_elems = self.bytes.len() / self.dtype.size_bytes();
        // An empty axis, not a zero product: a product can wrap to zero.
        if self.shape.contains(&0) {
            return Ok(());
        }
        let (mut lo, mut hi) = (self.offset as i128, self.offset as i128);
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            let span = (n as i128 - 1) * s as i128;
            if span < 0 {
                lo += span
            } else {
                hi += span
            }
        }
        if lo < 0 || hi >= n_elems as i128 {
            return Err(format!(
                "shape {:?} with strides {:?} reaches outside its {n_elems} elements",
                self.shape, self.strides
            ));
        }
        Ok(())
    }

    /// The ABI view of this buffer (rank 4 at most: [`HostBuffer::descriptors`] for
    /// any rank). The pointer is valid while `self` is alive and not reallocated.
    pub fn abi(&mut self) -> EjcTensor {
        assert!(self.shape.len() <= MAX_RANK, "a rank-{} tensor takes several descriptors", self.shape.len());
        self.descriptors().remove(0)
    }

    /// The ABI descriptors of this buffer, any rank (one per four axes: the CPU ABI's
    /// continuation rule, docs/abi.md). The pointers are valid while `self` is alive
    /// and not reallocated.
    pub fn descriptors(&mut self) -> Vec<EjcTensor> {
        let data = unsafe { self.bytes.as_mut_ptr().add(self.offset * self.dtype.size_bytes()) };
        self.descriptors_at(data)
    }

    fn descriptors_at(&self, data: *mut u8) -> Vec<EjcTensor> {
        let shape: Vec<i64> = self.shape.iter().map(|&n| n as i64).collect();
        let strides: Vec<i64> = self.strides.iter().map(|&s| s as i64).collect();
        ejc_ir::cpu_abi::descriptors(data, &shape, &strides)
    }
}

/// One tensor argument of a typed launch ([`launch_checked`]): what the kernel's
/// parameter declares, and the buffer given for it. A kernel writes only the buffers
/// passed as [`TensorArg::write`] (the borrow checker then keeps them apart from
/// every other argument).
pub struct TensorArg<'a> {
    pub name: &'static str,
    pub dtype: DType,
    pub rank: usize,
    buf: ArgBuf<'a>,
}

enum ArgBuf<'a> {
    Read(&'a HostBuffer),
    Write(&'a mut HostBuffer),
}

impl<'a> TensorArg<'a> {
    /// A tensor the kernel only loads from.
    pub fn read(name: &'static str, dtype: DType, rank: usize, buf: &'a HostBuffer) -> Self {
        TensorArg { name, dtype, rank, buf: ArgBuf::Read(buf) }
    }
    /// A tensor the kernel stores to.
    pub fn write(name: &'static str, dtype: DType, rank: usize, buf: &'a mut HostBuffer) -> Self {
        TensorArg { name, dtype, rank, buf: ArgBuf::Write(buf) }
    }
    /// The buffer given.
    pub fn buffer(&self) -> &HostBuffer {
        match &self.buf {
            ArgBuf::Read(b) => b,
            ArgBuf::Write(b) => b,
        }
    }
    /// The buffer, when the kernel stores to it.
    pub(crate) fn written(&mut self) -> Option<&mut HostBuffer> {
        match &mut self.buf {
            ArgBuf::Write(b) => Some(b),
            ArgBuf::Read(_) => None,
        }
    }
    fn descriptors(&mut self) -> Vec<EjcTensor> {
        match &mut self.buf {
            ArgBuf::Write(b) => b.descriptors(),
            // Read-only arguments: the kernel never stores through this pointer.
            ArgBuf::Read(b) => {
                let data = unsafe { b.bytes.as_ptr().add(b.offset * b.dtype.size_bytes()) } as *mut u8;
                b.descriptors_at(data)
            }
        }
    }
}

/// A safe launch: every tensor's dtype and rank must be what `kernel_name`'s parameter
/// declares and its strides must stay inside its memory, the grid must be
/// non-negative; then the kernel runs (`#[ej_kernel]`'s `launch` wrappers call this).
/// Loads and stores are bounded by the tensors' shapes (docs/ir.md), so a checked
/// launch cannot touch memory outside the buffers.
pub fn launch_checked(
    kernel: &CpuKernel,
    kernel_name: &str,
    tensors: &mut [TensorArg],
    scalars: &[u64],
    grid: [i64; 3],
    threads: usize,
) -> Result<(), CpuError> {
    check_tensor_args(kernel_name, tensors)?;
    let abi: Vec<EjcTensor> = tensors.iter_mut().flat_map(|t| t.descriptors()).collect();
    // Safety: dtypes, ranks and bounds are checked above; written tensors are
    // exclusive borrows, so they overlap nothing else.
    unsafe { kernel.launch(&abi, scalars, grid, threads) }
}

/// What [`launch_checked`] checks before it launches: every tensor's dtype, rank and
/// bounds against its parameter.
pub fn check_tensor_args(kernel_name: &str, tensors: &[TensorArg]) -> Result<(), CpuError> {
    for t in tensors.iter() {
        let b = t.buffer();
        if b.dtype != t.dtype || b.shape.len() != t.rank || b.strides.len() != t.rank {
            return Err(CpuError::Invalid(format!(
                "`{kernel_name}`: `{}` must be a {} tensor of rank {}, got {} with shape {:?}",
                t.name, t.dtype, t.rank, b.dtype, b.shape
            )));
        }
        b.check_bounds().map_err(|e| CpuError::Invalid(format!("`{kernel_name}`: `{}`: {e}", t.name)))?;
    }
    Ok(())
}

/// A scalar argument's 64-bit slot (see the ABI).
pub fn scalar_slot(dtype: DType, x: f64) -> u64 {
    match dtype {
        DType::F32 => (x as f32).to_bits() as u64,
        DType::I32 => (x as i64 as i32) as u32 as u64,
        DType::U32 => (x as i64 as u32) as u64,
        DType::I1 => (x != 0.0) as u64,
        DType::F64 => x.to_bits(),
        DType::F16 => ejc_ir::types::f64_to_f16(x).to_bits() as u64,
        DType::BF16 => ejc_ir::types::f64_to_bf16(x).to_bits() as u64,
    }
}

/// A kernel entry point with the scratch it needs.
#[derive(Clone, Copy, Debug)]
pub struct CpuKernel {
    pub entry: EntryFn,
    pub scratch_bytes: usize,
}

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// The one pool every launch of at most this machine's hardware threads shares: its
/// workers are the hardware threads, so launches from several caller threads at once
/// queue on them instead of multiplying them (a pool per thread count would let a
/// 2-thread and a 16-thread launch run 18 workers on 16 cores).
fn shared_pool() -> Result<&'static rayon::ThreadPool, CpuError> {
    static POOL: OnceLock<Result<rayon::ThreadPool, String>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(ejc_ir::limits::available_threads())
            .thread_name(|i| format!("ejc-cpu-{i}"))
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| CpuError::Threads(e.clone()))
}

fn pools() -> &'static Mutex<HashMap<usize, Arc<rayon::ThreadPool>>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();
    POOLS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A pool of `threads` workers for a launch that asks for more threads than the machine
/// has (oversubscription on purpose), made once per size and kept.
fn oversized_pool(threads: usize) -> Result<Arc<rayon::ThreadPool>, CpuError> {
    let mut pools = pools().lock().map_err(|_| CpuError::Threads("thread pool registry poisoned".into()))?;
    if let Some(p) = pools.get(&threads) {
        return Ok(p.clone());
    }
    let p = Arc::new(
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ejc-cpu-x{i}"))
            .build()
            .map_err(|e| CpuError::Threads(e.to_string()))?,
    );
    pools.insert(threads, p.clone());
    Ok(p)
}

/// The workers a launch gets. `0` means every hardware thread, except when the caller is
/// itself a worker of someone else's rayon pool: its pool already keeps the cores busy,
/// so the launch runs on the calling thread (as BLAS libraries do inside a parallel
/// region). An explicit count is honoured.
fn launch_threads(requested: usize) -> Result<usize, CpuError> {
    let threads = ejc_ir::limits::worker_threads(requested).map_err(CpuError::Invalid)?;
    if requested == 0 && rayon::current_thread_index().is_some() {
        let ours = shared_pool()?.current_thread_index().is_some();
        if !ours {
            return Ok(1);
        }
    }
    Ok(threads)
}

/// Raw pointers the workers share: the kernel only reads the tensor table, the
/// scalars and the grid, and writes tensor data at indices no two programs share.
struct Shared {
    tensors: *const EjcTensor,
    scalars: *const u64,
    grid: *const i64,
}
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl CpuKernel {
    /// Run every program of `grid` on `threads` workers (0 = all cores).
    ///
    /// # Safety
    /// `tensors` and `scalars` must match the kernel's parameters (order, dtypes,
    /// ranks), every tensor's shape and strides must stay inside its memory, and
    /// output tensors must not overlap inputs: the kernel trusts all of this. The
    /// safe entry points (`ejc_runtime::flash`) check it first.
    pub unsafe fn launch(
        &self,
        tensors: &[EjcTensor],
        scalars: &[u64],
        grid: [i64; 3],
        threads: usize,
    ) -> Result<(), CpuError> {
        self.launch_raw(tensors.as_ptr(), scalars.as_ptr(), grid, threads)
    }

    /// [`CpuKernel::launch`] on raw pointers (the C API's form).
    ///
    /// # Safety
    /// As for `launch`; the pointers must stay valid for the call.
    pub unsafe fn launch_raw(
        &self,
        tensors: *const EjcTensor,
        scalars: *const u64,
        grid: [i64; 3],
        threads: usize,
    ) -> Result<(), CpuError> {
        if grid.iter().any(|g| *g < 0) {
            return Err(CpuError::Invalid(format!("negative grid {grid:?}")));
        }
        let total = grid[0].saturating_mul(grid[1]).saturating_mul(grid[2]);
        if total == 0 {
            return Ok(());
        }
        // Capped (ejc_ir::limits): a request for 100000 workers is an error, not a hang.
        let threads = launch_threads(threads)?;
        // Kernels built for `cpu:amx` need the process's permission to use the tiles;
        // asking costs one check after the first time, and fails harmlessly elsewhere.
        let _ = ejc_ir::cpu_abi::enable_amx();
        let shared = Shared { tensors, scalars, grid: grid.as_ptr() };
        let next = AtomicI64::new(0);
        let entry = self.entry;
        let scratch_bytes = self.scratch_bytes;
        let work = || {
            let s = &shared;
            SCRATCH.with(|cell| {
                let mut buf = cell.borrow_mut();
                if buf.len() < scratch_bytes + SCRATCH_ALIGN {
                    buf.resize(scratch_bytes + SCRATCH_ALIGN, 0);
                }
                let base = buf.as_mut_ptr();
                let scratch = unsafe { base.add(base.align_offset(SCRATCH_ALIGN)) };
                loop {
                    let p = next.fetch_add(1, Ordering::Relaxed);
                    if p >= total {
                        break;
                    }
                    unsafe { entry(s.tensors, s.scalars, s.grid, p, p + 1, scratch) };
                }
            });
        };
        let threads = threads.min(usize::try_from(total).unwrap_or(usize::MAX));
        if threads == 1 {
            work();
        } else if threads <= ejc_ir::limits::available_threads() {
            // `threads` jobs on the shared pool: each takes programs until none is left.
            shared_pool()?.scope(|s| {
                for _ in 0..threads {
                    s.spawn(|_| work());
                }
            });
        } else {
            oversized_pool(threads)?.broadcast(|_| work());
        }
        Ok(())
    }
}

/// A shared library of CPU kernels.
pub struct CpuLibrary {
    path: PathBuf,
    lib: libloading::Library,
}

impl CpuLibrary {
    pub fn open(path: impl AsRef<Path>) -> Result<CpuLibrary, CpuError> {
        let path = path.as_ref().to_path_buf();
        // Loading runs the library's initialisers; ejc's libraries have none.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| CpuError::Load { path: path.clone(), message: e.to_string() })?;
        Ok(CpuLibrary { path, lib })
    }

    /// The kernel with entry symbol `name`; `scratch_bytes` comes from the manifest.
    /// The kernel must not be used after the library is dropped.
    pub fn kernel(&self, name: &str, scratch_bytes: usize) -> Result<CpuKernel, CpuError> {
        let sym: libloading::Symbol<EntryFn> = unsafe { self.lib.get(name.as_bytes()) }
            .map_err(|_| CpuError::NoSymbol { path: self.path.clone(), name: name.to_string() })?;
        Ok(CpuKernel { entry: *sym, scratch_bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    static RUNNING: AtomicUsize = AtomicUsize::new(0);
    static PEAK: AtomicUsize = AtomicUsize::new(0);
    static FOREIGN: AtomicUsize = AtomicUsize::new(0);

    /// A kernel that records how many programs run at once and on which threads.
    unsafe extern "C" fn probe(_: *const EjcTensor, _: *const u64, _: *const i64, _: i64, _: i64, _: *mut u8) {
        let now = RUNNING.fetch_add(1, Ordering::SeqCst) + 1;
        PEAK.fetch_max(now, Ordering::SeqCst);
        if std::thread::current().name().is_some_and(|n| n.starts_with("user-")) {
            FOREIGN.fetch_add(1, Ordering::SeqCst);
        }
        std::thread::sleep(Duration::from_millis(2));
        RUNNING.fetch_sub(1, Ordering::SeqCst);
    }

    fn ejc_workers() -> usize {
        std::fs::read_dir("/proc/self/task")
            .map(|d| {
                d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                    .filter(|c| c.starts_with("ejc-cpu-"))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Several callers, each asking for a different number of threads (and for all of
    /// them), at once: never more programs running than hardware threads, and no more
    /// ejc workers than hardware threads. Then a caller that is itself a worker of
    /// another rayon pool: its launches run on its own thread.
    #[test]
    fn launches_from_many_threads_do_not_oversubscribe() {
        let cores = ejc_ir::limits::available_threads();
        let k = CpuKernel { entry: probe, scratch_bytes: 64 };
        let asks: Vec<usize> = (0..=cores).chain([0, 0]).collect();
        std::thread::scope(|s| {
            for &t in &asks {
                s.spawn(move || {
                    for _ in 0..3 {
                        unsafe { k.launch(&[], &[], [4 * cores as i64, 1, 1], t) }.unwrap();
                    }
                });
            }
        });
        let callers_inline = asks.iter().filter(|t| **t == 1).count();
        let peak = PEAK.load(Ordering::SeqCst);
        assert!(peak <= cores + callers_inline, "{peak} programs ran at once on {cores} hardware threads");
        assert!(ejc_workers() <= cores, "{} ejc workers on {cores} hardware threads", ejc_workers());

        let user = rayon::ThreadPoolBuilder::new().num_threads(2).thread_name(|i| format!("user-{i}")).build().unwrap();
        FOREIGN.store(0, Ordering::SeqCst);
        user.install(|| {
            rayon::join(
                || unsafe { k.launch(&[], &[], [8, 1, 1], 0) }.unwrap(),
                || unsafe { k.launch(&[], &[], [8, 1, 1], 0) }.unwrap(),
            )
        });
        assert_eq!(FOREIGN.load(Ordering::SeqCst), 16, "a launch inside another pool left its thread");
    }
}
