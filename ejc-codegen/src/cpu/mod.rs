//! The CPU back end: tile IR → LLVM IR → x86-64 machine code.
//!
//! ```no_run
//! use ejc_codegen::cpu::{compile_object, Isa};
//! # let kernels: Vec<ejc_ir::ir::Kernel> = vec![];
//! let obj = compile_object(&kernels, Isa::host()).unwrap();
//! ejc_codegen::cpu::link_shared_library(&[&obj.object], "out/cpu/flash.avx512.so".as_ref()).unwrap();
//! ```
//!
//! Each kernel becomes one exported function with the C ABI of `ejc_ir::cpu_abi`. The
//! pipeline per module: emit ([`lower`]), verify, optimise with LLVM's `default<O3>`,
//! emit an object file; [`link_shared_library`] links objects into a `.so` with the
//! system C compiler, and [`jit`] loads an object into the running process (ORC).

pub mod jit;
pub mod lower;

pub use ejc_ir::cpu_abi::Isa;

use std::path::Path;

use ejc_ir::ir::Kernel;
use inkwell::context::Context;
use inkwell::module::Module;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple};
use inkwell::OptimizationLevel;

use crate::CodegenError;

/// An object file holding some kernels.
pub struct CompiledObject {
    pub object: Vec<u8>,
    pub isa: Isa,
    pub kernels: Vec<lower::KernelCode>,
}

fn target_machine(isa: Isa) -> Result<TargetMachine, CodegenError> {
    Target::initialize_x86(&InitializationConfig::default());
    let triple = TargetTriple::create("x86_64-unknown-linux-gnu");
    let target = Target::from_triple(&triple).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    let (cpu, features) = isa.llvm_cpu_features();
    target
        .create_target_machine(
            &triple,
            cpu,
            features,
            OptimizationLevel::Aggressive,
            RelocMode::PIC,
            CodeModel::Default,
        )
        .ok_or_else(|| CodegenError::Llvm(format!("LLVM cannot create a target machine for {isa}")))
}

/// Emit the LLVM module of `kernels` (verified, not yet optimised).
pub fn emit_module<'ctx>(
    ctx: &'ctx Context,
    kernels: &[Kernel],
    isa: Isa,
) -> Result<(Module<'ctx>, Vec<lower::KernelCode>), CodegenError> {
    let module = ctx.create_module("ejc_cpu");
    let tm = target_machine(isa)?;
    module.set_triple(&tm.get_triple());
    module.set_data_layout(&tm.get_target_data().get_data_layout());
    let mut codes = Vec::new();
    for kernel in kernels {
        let code = emit_function(ctx, &module, kernel, isa)?;
        codes.push(code);
    }
    module.verify().map_err(|e| CodegenError::Llvm(format!("generated LLVM IR does not verify: {}", e.to_string())))?;
    Ok((module, codes))
}

fn emit_function(ctx: &Context, module: &Module, kernel: &Kernel, isa: Isa) -> Result<lower::KernelCode, CodegenError> {
    use llvm_sys::core::*;
    let (cpu, features) = isa.llvm_cpu_features();
    unsafe {
        let c = ctx.raw();
        let m = module.as_mut_ptr();
        let ptr = LLVMPointerTypeInContext(c, 0);
        let i64t = LLVMInt64TypeInContext(c);
        let mut params = [ptr, ptr, ptr, i64t, i64t, ptr];
        let fty = LLVMFunctionType(LLVMVoidTypeInContext(c), params.as_mut_ptr(), 6, 0);
        let name = std::ffi::CString::new(kernel.name.clone())
            .map_err(|_| CodegenError::Llvm("kernel name has a NUL".into()))?;
        let f = LLVMAddFunction(m, name.as_ptr(), fty);
        let add_str = |k: &str, v: &str| {
            let a = LLVMCreateStringAttribute(
                c,
                k.as_ptr() as *const _,
                k.len() as u32,
                v.as_ptr() as *const _,
                v.len() as u32,
            );
            LLVMAddAttributeAtIndex(f, u32::MAX, a); // function attribute index
        };
        add_str("target-cpu", cpu);
        if !features.is_empty() {
            add_str("target-features", features);
        }
        // Use the full register width for the explicit vectors the code generator
        // emits (x86-64-v4 otherwise prefers 256-bit vectors).
        add_str("min-legal-vector-width", "512");
        add_str("prefer-vector-width", "512");
        // No calls to memcpy/memset: the library imports nothing (and a libc call
        // resolved through a library without libc as a dependency may pick a slow
        // variant); LLVM keeps copies and fills as inline vector loops.
        add_str("no-builtins", "");
        // The scratch buffer is private to the call: it aliases nothing else.
        let noalias = LLVMGetEnumAttributeKindForName("noalias".as_ptr() as *const _, 7);
        LLVMAddAttributeAtIndex(f, 6, LLVMCreateEnumAttribute(c, noalias, 0));
        let ir = crate::llvm::Ir::new(c, m, f);
        let scratch = lower::Lowering::new(ir, kernel, isa).run()?;
        Ok(lower::KernelCode { entry: kernel.name.clone(), scratch_bytes: scratch })
    }
}

/// Compile kernels for `isa` into one object file (`default<O3>`).
///
/// Objects are cached on disk ([`crate::cache`]), keyed by the kernels' tile IR and the
/// ISA: a kernel compiled before (by `ejc build`, `ejc run`, a test) is not compiled
/// again.
pub fn compile_object(kernels: &[Kernel], isa: Isa) -> Result<CompiledObject, CodegenError> {
    let parts = || {
        let (cpu, features) = isa.llvm_cpu_features();
        let mut parts = vec!["cpu".to_string(), isa.name().to_string(), cpu.to_string(), features.to_string()];
        parts.extend(kernels.iter().map(ejc_ir::print::print_kernel));
        parts
    };
    let (codes, object) = crate::cache::cached("cpu", "o", parts, || {
        compile_object_uncached(kernels, isa).map(|o| (o.kernels, o.object))
    })?;
    Ok(CompiledObject { object, isa, kernels: codes })
}

fn compile_object_uncached(kernels: &[Kernel], isa: Isa) -> Result<CompiledObject, CodegenError> {
    let ctx = Context::create();
    let (module, kernels_code) = emit_module(&ctx, kernels, isa)?;
    let tm = target_machine(isa)?;
    module
        .run_passes("default<O3>", &tm, PassBuilderOptions::create())
        .map_err(|e| CodegenError::Llvm(format!("LLVM optimisation failed: {}", e.to_string())))?;
    let buf = tm
        .write_to_memory_buffer(&module, FileType::Object)
        .map_err(|e| CodegenError::Llvm(format!("LLVM could not emit an object: {}", e.to_string())))?;
    Ok(CompiledObject { object: buf.as_slice().to_vec(), isa, kernels: kernels_code })
}

/// The optimised LLVM IR of kernels, as text (for inspection and snapshots).
pub fn optimized_llvm_ir(kernels: &[Kernel], isa: Isa) -> Result<String, CodegenError> {
    let ctx = Context::create();
    let (module, _) = emit_module(&ctx, kernels, isa)?;
    let tm = target_machine(isa)?;
    module
        .run_passes("default<O3>", &tm, PassBuilderOptions::create())
        .map_err(|e| CodegenError::Llvm(format!("LLVM optimisation failed: {}", e.to_string())))?;
    Ok(module.print_to_string().to_string())
}

/// Assembly of kernels (for inspection).
pub fn assembly(kernels: &[Kernel], isa: Isa) -> Result<String, CodegenError> {
    let ctx = Context::create();
    let (module, _) = emit_module(&ctx, kernels, isa)?;
    let tm = target_machine(isa)?;
    module
        .run_passes("default<O3>", &tm, PassBuilderOptions::create())
        .map_err(|e| CodegenError::Llvm(format!("LLVM optimisation failed: {}", e.to_string())))?;
    let buf = tm
        .write_to_memory_buffer(&module, FileType::Assembly)
        .map_err(|e| CodegenError::Llvm(format!("LLVM could not emit assembly: {}", e.to_string())))?;
    Ok(String::from_utf8_lossy(buf.as_slice()).into_owned())
}

/// Link object files into a shared library with the system C compiler (`cc`, or
/// `$CC`). The kernels import nothing, so the library needs no other library.
pub fn link_shared_library(objects: &[&[u8]], out: &Path) -> Result<(), CodegenError> {
    let dir = out.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|error| CodegenError::Io { path: dir.to_path_buf(), error })?;
    let tmp = tempdir_for(out)?;
    let mut paths = Vec::new();
    for (i, obj) in objects.iter().enumerate() {
        let p = tmp.join(format!("part{i}.o"));
        if let Err(error) = std::fs::write(&p, obj) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(CodegenError::Io { path: p, error });
        }
        paths.push(p);
    }
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let partial = out.with_extension("so.tmp");
    let status = std::process::Command::new(&cc)
        .arg("-shared")
        .arg("-nostdlib")
        .arg("-o")
        .arg(&partial)
        .args(&paths)
        .output()
        .map_err(|e| CodegenError::Link(format!("cannot run `{cc}` to link {}: {e}", out.display())));
    let _ = std::fs::remove_dir_all(&tmp);
    let status = status?;
    if !status.status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(CodegenError::Link(format!(
            "`{cc} -shared` failed for {}: {}",
            out.display(),
            String::from_utf8_lossy(&status.stderr)
        )));
    }
    std::fs::rename(&partial, out).map_err(|error| {
        let _ = std::fs::remove_file(&partial);
        CodegenError::Io { path: out.to_path_buf(), error }
    })
}

fn tempdir_for(out: &Path) -> Result<std::path::PathBuf, CodegenError> {
    let base = std::env::temp_dir().join(format!(
        "ejc-link-{}-{}",
        std::process::id(),
        out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    ));
    std::fs::create_dir_all(&base).map_err(|error| CodegenError::Io { path: base.clone(), error })?;
    Ok(base)
}
