//! Running the CPU form: MLIR's ExecutionEngine compiles the lowered module (LLVM `O3`,
//! for this machine's CPU) and its object file is kept in the on-disk cache; a later
//! process loads that object with ORC ([`crate::cpu::jit::JitLibrary`]) and skips MLIR
//! and LLVM's code generation entirely.
//!
//! ```no_run
//! use ejc_codegen::mlir::exec::CpuKernel;
//! # fn demo(kernel: ejc_ir::ir::Kernel, tensors: Vec<ejc_ir::cpu_abi::EjcTensor>, scalars: Vec<u64>, grid: [i64; 3]) {
//! let k = CpuKernel::compile(&kernel).unwrap();
//! println!("compiled in {:.2}s (from cache: {})", k.compile_seconds, k.cached);
//! unsafe { k.launch(&tensors, &scalars, grid, 0).unwrap() };
//! # }
//! ```
//!
//! The call: the function MLIR's ExecutionEngine wraps as `_mlir_<name>(void **args)`,
//! with one pointer per LLVM-level argument of the translated `func.func`: for each
//! tensor the five fields of a rank-1 memref descriptor (allocated and aligned pointer,
//! offset, size, stride) followed by its extents and strides, each scalar, the three grid
//! extents, the program range, and the scratch memref. [`CpuKernel::launch`] builds that
//! from the same `EjcTensor` / scalar-slot arrays the CPU back end's ABI uses, so the
//! flash executors can run either.

use std::ffi::c_void;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Instant;

use ejc_ir::cpu_abi::{tensor_slots, EjcTensor, Isa, MAX_RANK, SCRATCH_ALIGN};
use ejc_ir::ir::Kernel;
use ejc_ir::types::Type;
use melior::ExecutionEngine;

use super::{cache_dir, cache_get, cache_key, cache_put, dump, Form, MlirError, Session, CPU_STAGES};
use crate::cpu::jit::JitLibrary;

type Packed = unsafe extern "C" fn(*mut *mut c_void);

/// What keeps the compiled code alive (held, never read).
#[allow(dead_code)]
enum Code {
    Engine(ExecutionEngine),
    Jit(JitLibrary),
}

/// A kernel compiled through MLIR for this CPU.
pub struct CpuKernel {
    _code: Code,
    packed: Packed,
    /// Rank of each tensor parameter, and how many scalars follow, in order.
    params: Vec<Option<usize>>,
    pub scratch_bytes: usize,
    pub name: String,
    /// Whether the object came from the on-disk cache (no MLIR pass, no LLVM codegen).
    pub cached: bool,
    /// Seconds from the kernel's tile IR to a callable function.
    pub compile_seconds: f64,
}

// The ExecutionEngine / ORC session is only used through immutable lookups done at
// creation; the code it holds is reentrant (each call has its own scratch).
unsafe impl Send for CpuKernel {}
unsafe impl Sync for CpuKernel {}

fn engine_err(k: &Kernel, m: impl Into<String>) -> MlirError {
    MlirError::Engine { kernel: k.name.clone(), message: m.into() }
}

impl ejc_ir::cpu_abi::HostLaunch for CpuKernel {
    unsafe fn launch(
        &self,
        tensors: &[EjcTensor],
        scalars: &[u64],
        grid: [i64; 3],
        threads: usize,
    ) -> Result<(), String> {
        CpuKernel::launch(self, tensors, scalars, grid, threads).map_err(|e| e.to_string())
    }
}

impl CpuKernel {
    /// Translate, lower and compile `k`, or load it from the on-disk cache
    /// ([`super::cache_dir`]; without one, it is compiled every time).
    pub fn compile(k: &Kernel) -> Result<CpuKernel, MlirError> {
        Self::compile_cached(k, cache_dir().as_deref())
    }

    /// [`CpuKernel::compile`] with the cache in `cache`.
    pub fn compile_in(k: &Kernel, cache: &std::path::Path) -> Result<CpuKernel, MlirError> {
        Self::compile_cached(k, Some(cache))
    }

    fn compile_cached(k: &Kernel, cache: Option<&std::path::Path>) -> Result<CpuKernel, MlirError> {
        let started = Instant::now();
        let s = Session::new();
        let (mut module, info) = s.translate(k, Form::Cpu)?;
        let text = module.as_operation().to_string();
        let stages: Vec<String> = CPU_STAGES.iter().map(|(_, p)| p.to_string()).collect();
        let key = cache_key(&text, &stages, &format!("cpu:{}:{}", std::env::consts::ARCH, Isa::host_max()));
        let path = cache.map(|c| c.join(format!("{key}.o")));
        let params = k
            .params
            .iter()
            .map(|p| match p.ty {
                Type::Tensor(_, r) => Some(r),
                _ => None,
            })
            .collect();
        let symbol = format!("_mlir_{}", info.entry);
        // Checked against its recorded SHA-256 before it is loaded (`cache_get`).
        if let Some(obj) = path.as_deref().and_then(cache_get) {
            if let Ok(jit) = JitLibrary::load(&obj) {
                if let Ok(f) = jit.entry(&symbol) {
                    let packed: Packed = unsafe { std::mem::transmute::<_, Packed>(f) };
                    return Ok(CpuKernel {
                        _code: Code::Jit(jit),
                        packed,
                        params,
                        scratch_bytes: info.scratch_bytes,
                        name: k.name.clone(),
                        cached: true,
                        compile_seconds: started.elapsed().as_secs_f64(),
                    });
                }
            }
            // A damaged cache entry: compile again and overwrite it.
        }
        dump(&k.name, Form::Cpu, "0-translated", &module)?;
        for (name, pipeline) in CPU_STAGES {
            s.run_stage(&mut module, &k.name, name, pipeline)?;
            dump(&k.name, Form::Cpu, name, &module)?;
        }
        let engine = ExecutionEngine::new(&module, 3, &[], true, false);
        // Compiler-runtime calls the process may lack (bf16 rounding on CPUs without
        // bf16 instructions): see `cpu::jit::runtime_symbols`.
        for (name, addr) in crate::cpu::jit::runtime_symbols() {
            // Safety: `addr` is a function of this process with the C ABI LLVM expects.
            unsafe { engine.register_symbol(name, addr as *mut ()) };
        }
        let f = engine.lookup(&symbol);
        if f.is_null() {
            return Err(engine_err(k, format!("no symbol `{symbol}` after compilation: {}", s.take_diagnostics())));
        }
        let packed: Packed = unsafe { std::mem::transmute::<*mut (), Packed>(f) };
        // Keep the object for the next process.
        if let Some(path) = &path {
            let tmp = std::env::temp_dir().join(format!("ejc-mlir-{}-{key}.o", std::process::id()));
            engine.dump_to_object_file(&tmp.to_string_lossy());
            if let Ok(obj) = std::fs::read(&tmp) {
                cache_put(path, &obj);
            }
            let _ = std::fs::remove_file(&tmp);
        }
        Ok(CpuKernel {
            _code: Code::Engine(engine),
            packed,
            params,
            scratch_bytes: info.scratch_bytes,
            name: k.name.clone(),
            cached: false,
            compile_seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Run every program of `grid` on `threads` workers (0 = all cores).
    ///
    /// # Safety
    /// As for the CPU back end's kernels: `tensors` and `scalars` must match the kernel's
    /// parameters (order, dtypes, ranks), shapes and strides must stay inside each
    /// tensor's memory, and outputs must not overlap inputs.
    pub unsafe fn launch(
        &self,
        tensors: &[EjcTensor],
        scalars: &[u64],
        grid: [i64; 3],
        threads: usize,
    ) -> Result<(), MlirError> {
        // Descriptors: one per tensor of rank <= 4, more for higher ranks (`cpu_abi`).
        let n_slots: usize = self.params.iter().flatten().map(|r| tensor_slots(*r)).sum();
        let n_scalars = self.params.iter().filter(|p| p.is_none()).count();
        if tensors.len() != n_slots || scalars.len() != n_scalars {
            return Err(MlirError::Engine {
                kernel: self.name.clone(),
                message: format!(
                    "takes {n_slots} tensor descriptors and {n_scalars} scalars, got {} and {}",
                    tensors.len(),
                    scalars.len()
                ),
            });
        }
        let engine = |message: String| MlirError::Engine { kernel: self.name.clone(), message };
        let total = grid[0]
            .max(0)
            .checked_mul(grid[1].max(0))
            .and_then(|t| t.checked_mul(grid[2].max(0)))
            .ok_or_else(|| engine(format!("the grid {grid:?} has more programs than 64 bits count")))?;
        if total == 0 {
            return Ok(());
        }
        let threads = ejc_ir::limits::worker_threads(threads).map_err(engine)?;
        // Argument values up to the program range, shared by every worker.
        let mut head: Vec<u64> = Vec::with_capacity(64);
        let (mut ti, mut si) = (0, 0);
        for p in &self.params {
            match p {
                Some(rank) => {
                    let t = &tensors[ti..ti + tensor_slots(*rank)];
                    ti += t.len();
                    head.extend([t[0].data as u64, t[0].data as u64, 0, i64::MAX as u64, 1]);
                    head.extend((0..*rank).map(|a| t[a / MAX_RANK].shape[a % MAX_RANK] as u64));
                    head.extend((0..*rank).map(|a| t[a / MAX_RANK].strides[a % MAX_RANK] as u64));
                }
                None => {
                    // Scalars sit in the low bits of their slot (little-endian).
                    head.push(scalars[si]);
                    si += 1;
                }
            }
        }
        head.extend(grid.iter().map(|g| *g as u64));
        let next = AtomicI64::new(0);
        let work = || {
            let mut scratch = vec![0u8; self.scratch_bytes + SCRATCH_ALIGN];
            let off = scratch.as_ptr().align_offset(SCRATCH_ALIGN);
            let sp = unsafe { scratch.as_mut_ptr().add(off) } as u64;
            // Then the range and the scratch memref; pointers to every value (the vector
            // is never resized after they are taken).
            let mut vals = head.clone();
            let begin_at = vals.len();
            vals.extend([0, 0, sp, sp, 0, self.scratch_bytes as u64, 1]);
            let mut ptrs: Vec<*mut c_void> = vals.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
            loop {
                let p = next.fetch_add(1, Ordering::Relaxed);
                if p >= total {
                    break;
                }
                unsafe {
                    *(ptrs[begin_at] as *mut u64) = p as u64;
                    *(ptrs[begin_at + 1] as *mut u64) = (p + 1) as u64;
                    (self.packed)(ptrs.as_mut_ptr());
                }
            }
        };
        if threads == 1 || total == 1 {
            work();
        } else {
            std::thread::scope(|s| {
                for _ in 0..threads.min(total as usize) {
                    s.spawn(work);
                }
            });
        }
        Ok(())
    }
}
