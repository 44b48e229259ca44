//! In-process execution of compiled kernels through LLVM's ORC JIT (LLJIT), for
//! library users who have LLVM at hand and do not want to write a `.so`.
//!
//! ```no_run
//! use ejc_codegen::cpu::{compile_object, jit::JitLibrary, Isa};
//! # let kernels: Vec<ejc_ir::ir::Kernel> = vec![];
//! let obj = compile_object(&kernels, Isa::host()).unwrap();
//! let lib = JitLibrary::load(&obj.object).unwrap();
//! let entry = lib.entry("flash_causal_f32_d64_m64_n32").unwrap();
//! ```
//!
//! The object is the same one `ejc build --target cpu` links into a shared library, so
//! the JIT and the AOT path run identical machine code. Symbols the object does not
//! define (e.g. `memcpy`, should LLVM emit a call) resolve against the process, plus
//! the compiler-runtime calls of [`runtime_symbols`] that the process may lack.

use std::ffi::{CStr, CString};

use ejc_ir::cpu_abi::EntryFn;
use llvm_sys::error::{LLVMDisposeErrorMessage, LLVMErrorRef, LLVMGetErrorMessage};
use llvm_sys::orc2::lljit::*;
use llvm_sys::orc2::*;

use crate::CodegenError;

/// Kernels loaded into this process. Dropping it unloads them; entry points obtained
/// from it must not be called afterwards.
pub struct JitLibrary {
    jit: LLJITRef,
}

type LLJITRef = LLVMOrcLLJITRef;

// The JIT is used from several threads only through its immutable lookups and the
// code it emitted; ORC's session is thread-safe.
unsafe impl Send for JitLibrary {}
unsafe impl Sync for JitLibrary {}

fn take_error(e: LLVMErrorRef) -> Result<(), CodegenError> {
    if e.is_null() {
        return Ok(());
    }
    unsafe {
        let msg = LLVMGetErrorMessage(e);
        let s = CStr::from_ptr(msg).to_string_lossy().into_owned();
        LLVMDisposeErrorMessage(msg);
        Err(CodegenError::Llvm(format!("ORC JIT: {s}")))
    }
}

/// `__truncsfbf2` (f32 → bf16, round to nearest even, NaN kept quiet): LLVM calls it to
/// round to bf16 on a CPU without bf16 instructions (AVX2, Zen 3), and the process only
/// has it when its libgcc is GCC 13's or newer. The x86-64 ABI returns a bf16 in the low
/// 16 bits of xmm0 — where an f32 return puts its bits.
#[cfg(target_arch = "x86_64")]
extern "C" fn truncsfbf2(x: f32) -> f32 {
    f32::from_bits(u32::from(half::bf16::from_f32(x).to_bits()))
}

/// Compiler-runtime functions that JIT-compiled code may call and this process may not
/// export, with their addresses (the JITs define them before resolving anything else).
pub fn runtime_symbols() -> Vec<(&'static str, usize)> {
    #[cfg(target_arch = "x86_64")]
    return vec![("__truncsfbf2", truncsfbf2 as extern "C" fn(f32) -> f32 as usize)];
    #[cfg(not(target_arch = "x86_64"))]
    Vec::new()
}

impl JitLibrary {
    /// Load an object file (from [`super::compile_object`]) into a new JIT.
    pub fn load(object: &[u8]) -> Result<JitLibrary, CodegenError> {
        inkwell::targets::Target::initialize_native(&inkwell::targets::InitializationConfig::default())
            .map_err(|e| CodegenError::Llvm(format!("cannot initialise the native target: {e}")))?;
        unsafe {
            let mut jit: LLJITRef = std::ptr::null_mut();
            take_error(LLVMOrcCreateLLJIT(&mut jit, std::ptr::null_mut()))?;
            let lib = JitLibrary { jit };
            let dylib = LLVMOrcLLJITGetMainJITDylib(jit);
            let mut gen: LLVMOrcDefinitionGeneratorRef = std::ptr::null_mut();
            take_error(LLVMOrcCreateDynamicLibrarySearchGeneratorForProcess(
                &mut gen,
                LLVMOrcLLJITGetGlobalPrefix(jit),
                None,
                std::ptr::null_mut(),
            ))?;
            LLVMOrcJITDylibAddGenerator(dylib, gen);
            let mut pairs: Vec<LLVMOrcCSymbolMapPair> = Vec::new();
            for (sym, addr) in runtime_symbols() {
                let c = CString::new(sym).unwrap_or_default();
                pairs.push(LLVMOrcCSymbolMapPair {
                    Name: LLVMOrcLLJITMangleAndIntern(jit, c.as_ptr()),
                    Sym: LLVMJITEvaluatedSymbol {
                        Address: addr as LLVMOrcExecutorAddress,
                        Flags: LLVMJITSymbolFlags {
                            GenericFlags: LLVMJITSymbolGenericFlags::LLVMJITSymbolGenericFlagsExported as u8
                                | LLVMJITSymbolGenericFlags::LLVMJITSymbolGenericFlagsCallable as u8,
                            TargetFlags: 0,
                        },
                    },
                });
            }
            if !pairs.is_empty() {
                let mu = LLVMOrcAbsoluteSymbols(pairs.as_mut_ptr(), pairs.len());
                take_error(LLVMOrcJITDylibDefine(dylib, mu))?;
            }
            let name = CString::new("ejc-kernels").unwrap_or_default();
            let buf = llvm_sys::core::LLVMCreateMemoryBufferWithMemoryRangeCopy(
                object.as_ptr() as *const _,
                object.len(),
                name.as_ptr(),
            );
            // AddObjectFile takes ownership of the buffer.
            take_error(LLVMOrcLLJITAddObjectFile(jit, dylib, buf))?;
            Ok(lib)
        }
    }

    /// The entry point of kernel `name`.
    pub fn entry(&self, name: &str) -> Result<EntryFn, CodegenError> {
        let cname = CString::new(name).map_err(|_| CodegenError::Llvm(format!("bad symbol name {name:?}")))?;
        let mut addr: LLVMOrcExecutorAddress = 0;
        unsafe {
            take_error(LLVMOrcLLJITLookup(self.jit, &mut addr, cname.as_ptr()))?;
            if addr == 0 {
                return Err(CodegenError::Llvm(format!("ORC JIT: no symbol `{name}`")));
            }
            Ok(std::mem::transmute::<usize, EntryFn>(addr as usize))
        }
    }
}

impl Drop for JitLibrary {
    fn drop(&mut self) {
        unsafe {
            let _ = take_error(LLVMOrcDisposeLLJIT(self.jit));
        }
    }
}
