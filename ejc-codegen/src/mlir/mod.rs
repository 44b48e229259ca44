//! The MLIR back end: tile IR → upstream MLIR (built with melior) → MLIR's own pass
//! pipelines → a CPU object run by MLIR's ExecutionEngine, or PTX through MLIR's NVVM
//! target.
//!
//! ```no_run
//! use ejc_codegen::mlir::{self, Form};
//! # fn demo(kernel: ejc_ir::ir::Kernel) {
//! // The verified module, as text (what `ejc build --target mlir:cpu` writes).
//! let (text, info) = mlir::to_mlir(&kernel, Form::Cpu).unwrap();
//! // Compiled for this CPU (or loaded from the on-disk cache), ready to launch.
//! let k = mlir::exec::CpuKernel::compile(&kernel).unwrap();
//! // PTX for a GPU, through gpu-module-to-binary{format=isa}.
//! let ptx = mlir::compile_gpu(&kernel, mlir::GpuOptions::default()).unwrap();
//! # }
//! ```
//!
//! The pipeline, as a flat list of stages (each written out by `EJC_DUMP_MLIR=<dir>`):
//!
//! | stage | cpu | gpu |
//! |---|---|---|
//! | `0-translated` | [`emit`]: func/scf/arith/math/vector/memref, verified | the same inside `gpu.module`/`gpu.func` |
//! | `1-expanded` | `arith-expand{include-bf16}` (bf16 conversions as integer ops), canonicalize, cse | the same, on the gpu module |
//! | `2-llvm` / `2-nvvm` | scf→cf, vector/math/arith/memref/cf/func → llvm | `nvvm-attach-target` (libdevice linked for math), `convert-gpu-to-nvvm` with the bare-pointer convention |
//! | `3-binary` | (the ExecutionEngine compiles the LLVM dialect, `O3`) | `gpu-module-to-binary{format=isa}`: PTX |
//!
//! The order matters: bf16 conversions are expanded while they are still `arith` ops;
//! `scf` goes to `cf` before `func` goes to `llvm`; unrealized casts are reconciled last.
//!
//! Compile once: compiled code (CPU objects, PTX) is cached on disk under
//! `$EJC_CACHE_DIR/mlir` (default `~/.cache/ejc/mlir`), keyed by the SHA-256 of the
//! translated module, the pipeline, the target and the compiler version, so a second
//! process start skips MLIR's passes and LLVM's code generation ([`exec::CpuKernel`]).

pub mod emit;
pub mod exec;

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use ejc_ir::ir::Kernel;
use melior::dialect::DialectRegistry;
use melior::ir::operation::OperationLike;
use melior::ir::Module;
use melior::pass::PassManager;
use melior::utility::{
    parse_pass_pipeline, register_all_dialects, register_all_llvm_translations, register_all_passes,
};
use melior::Context;

pub use emit::Translation;

/// Which program the translation builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Form {
    /// A `func.func` running programs `begin..end` of the grid on one CPU thread.
    Cpu,
    /// A `gpu.func` kernel in a `gpu.module`, one program per block of `threads` threads.
    Gpu { threads: usize },
}

impl Form {
    pub fn name(self) -> &'static str {
        match self {
            Form::Cpu => "cpu",
            Form::Gpu { .. } => "gpu",
        }
    }
}

/// Errors of the MLIR back end; each names the kernel and carries MLIR's diagnostics.
#[derive(Debug, thiserror::Error)]
pub enum MlirError {
    #[error("kernel `{kernel}`: MLIR translation: {message}")]
    Translate { kernel: String, message: String },
    #[error("kernel `{kernel}`: the generated MLIR does not verify:\n{diagnostics}")]
    Verify { kernel: String, diagnostics: String },
    #[error("kernel `{kernel}`: MLIR stage `{stage}` failed:\n{diagnostics}")]
    Pipeline { kernel: String, stage: String, diagnostics: String },
    #[error("kernel `{kernel}`: MLIR ExecutionEngine: {message}")]
    Engine { kernel: String, message: String },
    #[error("kernel `{kernel}`: {message}")]
    Gpu { kernel: String, message: String },
    #[error("cannot write {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
}

/// An MLIR context with every dialect, translation and pass registered, and MLIR's
/// diagnostics collected (so errors carry them instead of printing to stderr).
pub struct Session {
    pub ctx: Context,
    diags: Rc<RefCell<Vec<String>>>,
}

impl Default for Session {
    fn default() -> Self {
        Self::new()
    }
}

impl Session {
    pub fn new() -> Session {
        let registry = DialectRegistry::new();
        register_all_dialects(&registry);
        let ctx = Context::new();
        ctx.append_dialect_registry(&registry);
        ctx.load_all_available_dialects();
        register_all_llvm_translations(&ctx);
        register_all_passes();
        let diags = Rc::new(RefCell::new(Vec::new()));
        let sink = diags.clone();
        ctx.attach_diagnostic_handler(move |d| {
            sink.borrow_mut().push(format!("{}: {d}", d.location()));
            true
        });
        Session { ctx, diags }
    }

    fn take_diagnostics(&self) -> String {
        let d: Vec<String> = self.diags.borrow_mut().drain(..).collect();
        if d.is_empty() {
            "(MLIR gave no diagnostic)".into()
        } else {
            d.join("\n")
        }
    }

    /// Translate and verify.
    pub fn translate(&self, k: &Kernel, form: Form) -> Result<(Module<'_>, Translation), MlirError> {
        let (module, info) = emit::translate(&self.ctx, k, form)?;
        if !module.as_operation().verify() {
            return Err(MlirError::Verify { kernel: k.name.clone(), diagnostics: self.take_diagnostics() });
        }
        Ok((module, info))
    }

    /// Run one stage (a textual pass pipeline) on `module`.
    pub fn run_stage(&self, module: &mut Module, kernel: &str, stage: &str, pipeline: &str) -> Result<(), MlirError> {
        let pm = PassManager::new(&self.ctx);
        parse_pass_pipeline(pm.as_operation_pass_manager(), pipeline).map_err(|e| MlirError::Pipeline {
            kernel: kernel.into(),
            stage: stage.into(),
            diagnostics: format!("bad pipeline `{pipeline}`: {e}"),
        })?;
        pm.run(module).map_err(|_| MlirError::Pipeline {
            kernel: kernel.into(),
            stage: stage.into(),
            diagnostics: self.take_diagnostics(),
        })
    }
}

/// The verified module of `k` as text, and what the caller must know to run it.
pub fn to_mlir(k: &Kernel, form: Form) -> Result<(String, Translation), MlirError> {
    let s = Session::new();
    let (module, info) = s.translate(k, form)?;
    Ok((module.as_operation().to_string(), info))
}

/// [`to_mlir`] through the compiled-code cache (`mlir/`, keyed by the tile IR and the
/// form): a build of unchanged kernels translates nothing.
pub fn to_mlir_cached(k: &Kernel, form: Form) -> Result<(String, Translation), MlirError> {
    let cache = crate::cache::CodeCache::open("mlir");
    let key = cache
        .as_ref()
        .map(|_| crate::cache::CodeCache::key(&["mlir-text", &format!("{form:?}"), &ejc_ir::print::print_kernel(k)]));
    if let (Some(c), Some(key)) = (&cache, &key) {
        // First line: `<scratch bytes> <entry>`; then the module.
        let hit = c.peek(key, "mlir").and_then(|b| {
            let b = String::from_utf8(b).ok()?;
            let (head, text) = b.split_once('\n')?;
            let (scratch, entry) = head.split_once(' ')?;
            Some((text.to_string(), Translation { entry: entry.to_string(), scratch_bytes: scratch.parse().ok()? }))
        });
        if let Some(hit) = hit {
            return Ok(hit);
        }
    }
    let (text, info) = to_mlir(k, form)?;
    if let (Some(c), Some(key)) = (&cache, &key) {
        c.put(key, "mlir", format!("{} {}\n{text}", info.scratch_bytes, info.entry).as_bytes());
    }
    Ok((text, info))
}

/// The CPU stages after translation.
pub const CPU_STAGES: [(&str, &str); 2] = [
    ("1-expanded", "builtin.module(func.func(arith-expand{include-bf16=true}),canonicalize,cse)"),
    (
        "2-llvm",
        "builtin.module(convert-scf-to-cf,convert-vector-to-llvm,convert-math-to-llvm,convert-arith-to-llvm,\
expand-strided-metadata,finalize-memref-to-llvm,convert-cf-to-llvm,convert-func-to-llvm,reconcile-unrealized-casts)",
    ),
];

/// Options of the GPU form.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// `sm_80`, `sm_90a`, ...
    pub chip: String,
    /// Threads per block.
    pub threads: usize,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions { chip: "sm_80".into(), threads: 128 }
    }
}

/// The GPU stages after translation. `libdevice` supplies `math` functions (`__nv_expf`, ...).
pub fn gpu_stages(chip: &str, libdevice: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("1-expanded", "builtin.module(gpu.module(arith-expand{include-bf16=true},canonicalize,cse))".to_string()),
        (
            "2-nvvm",
            format!(
                "builtin.module(nvvm-attach-target{{chip={chip} features=+ptx80 O=3 l={}}},gpu.module(convert-scf-to-cf,\
convert-gpu-to-nvvm{{use-bare-ptr-memref-call-conv=1 index-bitwidth=64}},canonicalize,cse,reconcile-unrealized-casts))",
                libdevice.display()
            ),
        ),
        ("3-binary", "builtin.module(gpu-module-to-binary{format=isa})".to_string()),
    ]
}

/// Where CUDA's libdevice is: `$EJC_LIBDEVICE`, else beside the ptxas ejc uses
/// (`$EJC_PTXAS`, the PyPI wheel's `nvidia/cuda_nvcc/bin/ptxas` → `../nvvm/libdevice`).
pub fn find_libdevice() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("EJC_LIBDEVICE").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let ptxas = crate::ptx::find_ptxas()?;
    let p = ptxas.parent()?.parent()?.join("nvvm").join("libdevice").join("libdevice.10.bc");
    p.exists().then_some(p)
}

/// `EJC_DUMP_MLIR=<dir>`: write the module after each stage as
/// `<dir>/<kernel>.<form>.<stage>.mlir`.
pub(crate) fn dump(kernel: &str, form: Form, stage: &str, module: &Module) -> Result<(), MlirError> {
    let Some(dir) = std::env::var_os("EJC_DUMP_MLIR").filter(|d| !d.is_empty()) else { return Ok(()) };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir).map_err(|error| MlirError::Io { path: dir.clone(), error })?;
    let path = dir.join(format!("{kernel}.{}.{stage}.mlir", form.name()));
    std::fs::write(&path, module.as_operation().to_string()).map_err(|error| MlirError::Io { path, error })
}

/// The on-disk cache of compiled MLIR: `<cache dir>/mlir` ([`crate::cache`]), or none
/// (the cache is off, or there is no cache directory: code is then compiled every time).
pub fn cache_dir() -> Option<PathBuf> {
    crate::cache::dir("mlir")
}

/// The cache key of a compilation: the module text, every stage, the target, MLIR's
/// version and the compiler's ([`crate::cache::CodeCache::key`]).
pub(crate) fn cache_key(module_text: &str, stages: &[String], target: &str) -> String {
    let mut parts: Vec<&str> = vec!["mlir-22", target];
    parts.extend(stages.iter().map(String::as_str));
    parts.push(module_text);
    crate::cache::CodeCache::key(&parts)
}

pub(crate) use crate::cache::{get as cache_get, put as cache_put};

/// PTX of a kernel through the GPU form.
#[derive(Clone, Debug)]
pub struct GpuPtx {
    pub ptx: String,
    /// Always `entry`.
    pub entry: String,
    /// Threads per block.
    pub threads: usize,
    /// Global scratch bytes per block: the launcher appends a pointer to
    /// `blocks × scratch_bytes` bytes as the last parameter.
    pub scratch_bytes: usize,
    /// Whether the PTX came from the on-disk cache.
    pub cached: bool,
}

/// Compile `k`'s GPU form to PTX (cached on disk).
pub fn compile_gpu(k: &Kernel, opts: GpuOptions) -> Result<GpuPtx, MlirError> {
    let form = Form::Gpu { threads: opts.threads };
    let gpu_err = |m: String| MlirError::Gpu { kernel: k.name.clone(), message: m };
    let libdevice = find_libdevice().ok_or_else(|| {
        gpu_err(
            "CUDA's libdevice.10.bc (math functions for the NVVM target) was not found: set EJC_LIBDEVICE, or \
             EJC_PTXAS to a ptxas from the nvidia-cuda-nvcc wheel (scripts/setup.sh installs it)"
                .into(),
        )
    })?;
    // The translated module's text keys the PTX; it comes from the cache when the
    // kernel was translated before, so a hit costs no MLIR work at all.
    let (text, info) = to_mlir_cached(k, form)?;
    let stages = gpu_stages(&opts.chip, &libdevice);
    let stage_texts: Vec<String> = stages.iter().map(|(_, p)| p.clone()).collect();
    let key = cache_key(&text, &stage_texts, &format!("ptx:{}:{}", opts.chip, opts.threads));
    let path = cache_dir().map(|d| d.join(format!("{key}.ptx")));
    let done = |ptx: String, cached: bool| GpuPtx {
        ptx,
        entry: info.entry.clone(),
        threads: opts.threads,
        scratch_bytes: info.scratch_bytes,
        cached,
    };
    if let Some(ptx) = path.as_deref().and_then(cache_get).and_then(|b| String::from_utf8(b).ok()) {
        return Ok(done(ptx, true));
    }
    let s = Session::new();
    let (mut module, _) = s.translate(k, form)?;
    dump(&k.name, form, "0-translated", &module)?;
    for (name, pipeline) in &stages {
        s.run_stage(&mut module, &k.name, name, pipeline)?;
        dump(&k.name, form, name, &module)?;
    }
    let printed = module.as_operation().to_string();
    let ptx = extract_isa(&printed).ok_or_else(|| gpu_err("gpu-module-to-binary produced no PTX".into()))?;
    if let Some(path) = &path {
        cache_put(path, ptx.as_bytes());
    }
    Ok(done(ptx, false))
}

/// The PTX in a printed `gpu.binary` (`assembly = "..."`, MLIR's escaped string).
fn extract_isa(printed: &str) -> Option<String> {
    let start = printed.find("assembly = \"")? + "assembly = \"".len();
    let bytes = printed.as_bytes();
    let mut out = Vec::new();
    let mut i = start;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => return String::from_utf8(out).ok(),
            b'\\' => {
                let next = *bytes.get(i + 1)?;
                if next == b'\\' || next == b'"' {
                    out.push(next);
                    i += 2;
                } else {
                    let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                    out.push(u8::from_str_radix(hex, 16).ok()?);
                    i += 3;
                }
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isa_strings_unescape() {
        let printed = r#"gpu.binary @k [#gpu.object<#nvvm.target, assembly = "a\0Ab\09\22q\22\\z">]"#;
        assert_eq!(extract_isa(printed).unwrap(), "a\nb\t\"q\"\\z");
        assert!(extract_isa("no binary here").is_none());
    }
}
