//! What `ejc run` and `ejc bench` share: reading the spec, the dtype, the shape, the
//! tiling and the run-time scalars from flags (every bad value is an error naming the
//! flag), and preparing a kernel on a back end.

use std::path::PathBuf;

use ejc_codegen::cpu::{compile_object, jit::JitLibrary, Isa};
use ejc_ir::flash::abi::run_interp;
use ejc_ir::flash::inputs::default_runtime;
use ejc_ir::flash::{build_kernel, FlashInputs, FlashOutputs, FlashRuntime, FlashShape};
use ejc_ir::ir::Kernel;
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{Schedule, SoftCap, Spec, Variant, Window};
use ejc_ir::types::DType;
use ejc_runtime::cpu::CpuKernel;
use ejc_runtime::flash::{launch_plan, run_cpu, tensor_names, FlashBuffers};

use super::{load_spec, Outcome};

/// Flags common to `run` and `bench`.
pub struct ProblemFlags {
    pub spec: PathBuf,
    pub variants: Vec<String>,
    pub dtype: String,
    pub shape: String,
    pub block_m: Option<u32>,
    pub block_n: Option<u32>,
    pub window: Option<String>,
    pub softcap: Option<f64>,
    pub dropout: Option<f64>,
    pub isa: Option<String>,
}

/// The validated problem.
pub struct Problem {
    pub spec: Spec,
    pub dtype: DType,
    pub shape: FlashShape,
    pub variant_names: Vec<String>,
    /// Explicit tiling, or None for "every tiling of the spec" (bench) / the first (run).
    pub tiling: Option<(u32, u32)>,
    pub window: Option<(i64, i64)>,
    pub softcap: Option<f64>,
    pub dropout: Option<f64>,
    pub isa: Isa,
}

pub fn list<T: std::fmt::Display>(xs: &[T]) -> String {
    xs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

fn parse_window(s: &str) -> Result<(i64, i64), String> {
    let nums: Result<Vec<i64>, _> = s.split(',').map(|p| p.trim().parse::<i64>()).collect();
    match nums {
        Ok(n) if n.len() == 2 && n[0] >= 0 && n[1] >= 0 => Ok((n[0], n[1])),
        _ => Err(format!("`{s}` is not LEFT,RIGHT with two non-negative integers")),
    }
}

impl Problem {
    pub fn from_flags(f: &ProblemFlags) -> Result<Problem, Outcome> {
        let err = |m: String| Outcome::Error(format!("error: {m}"));
        let spec = load_spec(&f.spec)?;
        let dtype: DType = match f.dtype.parse() {
            Ok(d) if spec.dtypes.contains(&d) => d,
            Ok(d) => {
                return Err(err(format!("--dtype {d}: spec `{}` declares dtypes {}", spec.name, list(&spec.dtypes))))
            }
            Err(e) => return Err(err(format!("--dtype: {e}"))),
        };
        let shape = FlashShape::parse(&f.shape).map_err(|e| err(format!("--shape: {e}")))?;
        if !spec.head_dims.contains(&shape.head_dim) {
            return Err(err(format!(
                "--shape: head_dim {} is not one of spec `{}`'s head_dims ({}); head_dim is compiled into each kernel",
                shape.head_dim,
                spec.name,
                list(&spec.head_dims)
            )));
        }
        let tiling = match (f.block_m, f.block_n) {
            (None, None) => None,
            (m, n) => {
                let m = m.unwrap_or(spec.schedule.block_m[0]);
                let n = n.unwrap_or(spec.schedule.block_n[0]);
                if !spec.schedule.block_m.contains(&m) || !spec.schedule.block_n.contains(&n) {
                    return Err(err(format!(
                        "tiling {m}x{n} is not in spec `{}`'s schedule (block_m: {}; block_n: {})",
                        spec.name,
                        list(&spec.schedule.block_m),
                        list(&spec.schedule.block_n)
                    )));
                }
                Some((m, n))
            }
        };
        let window = f.window.as_deref().map(parse_window).transpose().map_err(|e| err(format!("--window: {e}")))?;
        if let Some(c) = f.softcap {
            if !(c > 0.0 && c.is_finite()) {
                return Err(err(format!("--softcap {c}: the soft cap must be a positive finite number")));
            }
        }
        if let Some(p) = f.dropout {
            if !(0.0..1.0).contains(&p) {
                return Err(err(format!("--dropout {p}: the probability must be in [0, 1)")));
            }
        }
        for name in &f.variants {
            if spec.variant(name).is_none() {
                let names: Vec<&str> = spec.variants.iter().map(|v| v.name.as_str()).collect();
                return Err(err(format!("--variant {name}: spec `{}` has variants {}", spec.name, names.join(", "))));
            }
        }
        let variant_names = if f.variants.is_empty() {
            spec.variants.iter().map(|v| v.name.clone()).collect()
        } else {
            f.variants.clone()
        };
        let isa = match &f.isa {
            None => Isa::host(),
            Some(s) => {
                let isa: Isa = s.parse().map_err(|e: String| err(format!("--isa: {e}")))?;
                if !isa.runs_here() {
                    return Err(err(format!(
                        "--isa {isa}: this machine cannot run it (it runs up to {})",
                        Isa::host_max()
                    )));
                }
                isa
            }
        };
        Ok(Problem { spec, dtype, shape, variant_names, tiling, window, softcap: f.softcap, dropout: f.dropout, isa })
    }

    pub fn variants(&self) -> Vec<&Variant> {
        self.variant_names.iter().filter_map(|n| self.spec.variant(n)).collect()
    }

    /// The run-time scalars for a variant: defaults, then the flags.
    pub fn runtime(&self, v: &Variant, seed: u64) -> FlashRuntime {
        let f = &v.features;
        let mut rt = default_runtime(f, &self.shape, seed);
        if let (Some(w), Some(Window::Runtime)) = (self.window, f.sliding_window) {
            rt.window = w;
        }
        if let (Some(c), Some(SoftCap::Runtime)) = (self.softcap, f.logits_soft_cap) {
            rt.softcap = c;
        }
        if let Some(p) = self.dropout {
            rt.dropout_p = p;
        }
        rt
    }

    /// The tile IR of a variant at a tiling, after the pass pipeline.
    pub fn kernel(&self, v: &Variant, (block_m, block_n): (u32, u32)) -> Result<Kernel, Outcome> {
        let schedule = Schedule { block_m, block_n, num_warps: 0, num_stages: 0 };
        build_kernel(&self.spec, v, self.dtype, self.shape.head_dim, &schedule)
            .map_err(|e| e.to_string())
            .and_then(|k| run_pipeline(&k, &default_pipeline()).map_err(|e| e.to_string()))
            .map_err(|e| Outcome::Error(format!("error: variant `{}`: {e}", v.name)))
    }
}

/// The refusal for a back end `ejc` does not know (None for interp, cpu, mlir, cuda).
pub fn unsupported_backend(backend: &str) -> Option<Outcome> {
    match backend {
        "interp" | "cpu" | "mlir" | "cuda" => None,
        other => Some(Outcome::Error(format!("error: unknown backend `{other}`"))),
    }
}

/// A kernel ready to run on one back end.
pub enum Prepared {
    Interp(Kernel),
    Cpu {
        // Keeps the JIT-compiled code alive while `kernel` points into it.
        _jit: JitLibrary,
        kernel: CpuKernel,
        threads: usize,
        block_m: usize,
    },
    /// Through MLIR: translated, lowered by MLIR's pipelines, compiled by its
    /// ExecutionEngine (or loaded from the on-disk cache).
    Mlir {
        kernel: ejc_codegen::mlir::exec::CpuKernel,
        threads: usize,
        block_m: usize,
    },
}

impl Prepared {
    pub fn new(backend: &str, kernel: Kernel, isa: Isa, threads: usize) -> Result<Prepared, Outcome> {
        match backend {
            "interp" => Ok(Prepared::Interp(kernel)),
            "cpu" => {
                let block_m: usize = kernel.attr("block_m").and_then(|b| b.parse().ok()).unwrap_or(64);
                let obj = compile_object(std::slice::from_ref(&kernel), isa)
                    .map_err(|e| Outcome::Error(format!("error: compiling `{}` for {isa}: {e}", kernel.name)))?;
                let jit = JitLibrary::load(&obj.object).map_err(|e| Outcome::Error(format!("error: {e}")))?;
                let entry = jit.entry(&kernel.name).map_err(|e| Outcome::Error(format!("error: {e}")))?;
                let scratch = obj.kernels[0].scratch_bytes as usize;
                Ok(Prepared::Cpu { _jit: jit, kernel: CpuKernel { entry, scratch_bytes: scratch }, threads, block_m })
            }
            "mlir" => {
                let block_m: usize = kernel.attr("block_m").and_then(|b| b.parse().ok()).unwrap_or(64);
                let k = ejc_codegen::mlir::exec::CpuKernel::compile(&kernel)
                    .map_err(|e| Outcome::Error(format!("error: {e}")))?;
                Ok(Prepared::Mlir { kernel: k, threads, block_m })
            }
            other => Err(unsupported_backend(other)
                .unwrap_or_else(|| Outcome::Error(format!("error: unknown backend `{other}`")))),
        }
    }

    /// Run once on fresh buffers.
    pub fn run(
        &self,
        v: &Variant,
        p: &Problem,
        rt: &FlashRuntime,
        inputs: &FlashInputs,
    ) -> Result<FlashOutputs, String> {
        match self {
            Prepared::Interp(k) => run_interp(k, rt, inputs),
            _ => {
                let mut call = FlashBuffers::from_inputs(inputs);
                self.run_on(v, p, rt, &mut call)?;
                Ok(call.outputs())
            }
        }
    }

    /// Run a compiled kernel on `call`'s buffers (outputs land in `call`); what `bench`
    /// repeats.
    pub fn run_on(&self, v: &Variant, p: &Problem, rt: &FlashRuntime, call: &mut FlashBuffers) -> Result<(), String> {
        let head_dim = p.shape.head_dim;
        match self {
            Prepared::Interp(_) => Err("the interpreter runs through `run`".into()),
            Prepared::Cpu { kernel, threads, block_m, .. } => {
                run_cpu(kernel, &v.features, p.dtype, head_dim, *block_m, rt, call, *threads).map_err(|e| e.to_string())
            }
            Prepared::Mlir { kernel, threads, block_m } => {
                let (grid, scalars) =
                    launch_plan(&v.features, p.dtype, head_dim, *block_m, rt, call).map_err(|e| e.to_string())?;
                let mut tensors = Vec::new();
                for name in tensor_names(&v.features, p.dtype) {
                    tensors.push(call.get(name).ok_or_else(|| format!("the call has no `{name}`"))?.abi());
                }
                // Safety: launch_plan validated every tensor against the ABI (dtypes,
                // ranks, shapes, strides inside their buffers); outputs are separate.
                unsafe { kernel.launch(&tensors, &scalars, grid, *threads) }.map_err(|e| e.to_string())
            }
        }
    }

    /// What compiling cost, for the MLIR back end (seconds, and whether the on-disk
    /// cache had it).
    pub fn compile_info(&self) -> Option<(f64, bool)> {
        match self {
            Prepared::Mlir { kernel, .. } => Some((kernel.compile_seconds, kernel.cached)),
            _ => None,
        }
    }
}
