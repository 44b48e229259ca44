//! The PTX target: tile IR → LLVM IR with NVVM intrinsics → PTX (LLVM's NVPTX back
//! end), for `sm_80` and `sm_90a`.
//!
//! ```no_run
//! use ejc_codegen::ptx::{compile, Arch, CodePath, PtxConfig};
//! # fn demo(kernel: ejc_ir::ir::Kernel) {
//! let k = compile(&kernel, &PtxConfig { arch: Arch::Sm80, num_warps: 4, num_stages: 2, path: CodePath::MmaSync }).unwrap();
//! println!("{} bytes of PTX, {} bytes of shared memory", k.ptx.len(), k.code.smem_bytes);
//! # }
//! ```
//!
//! The pieces, in order: [`layout`] decides where every tile lives (registers in
//! the mma accumulator layout, or shared memory for dot operands); [`lower`] emits
//! one thread's program — twice: the general entry, and (where the kernel copies tiles
//! to shared memory) an aligned entry that assumes aligned tensors and, where
//! `ejc_ir::passes::scale_fold` applies, a positive softmax scale (docs/abi.md, "Aligned entry");
//! LLVM optimises the module (`default<O3>`) and prints PTX.
//! [`ptxas`] runs NVIDIA's assembler on the result when one is installed, for the
//! tests and `ejc build --report` (registers, spills, shared memory).
//!
//! Kernel parameters: for each tensor `(ptr, shape[rank]: i64, strides[rank]: i64)`
//! (strides in elements), for each scalar its value (`f32`, `i32`/`u32`, `i1` as
//! `i32`). The block is `num_warps × 32` threads; the grid is the manifest's.

pub mod candidates;
pub mod layout;
pub mod lower;
mod nvvm;
pub mod schedule;
pub mod ws;

use std::path::{Path, PathBuf};

use ejc_ir::ir::Kernel;
use ejc_ir::types::{DType, Type};
use inkwell::context::Context;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple};
use inkwell::OptimizationLevel;

pub use lower::PtxCode;

use crate::CodegenError;

/// A GPU architecture the PTX target generates for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arch {
    /// Ampere (A100) and later: `mma.sync`, `ldmatrix`, `cp.async`.
    Sm80,
    Sm86,
    Sm89,
    Sm90,
    /// Hopper (H100, H200) with its architecture-specific instructions.
    Sm90a,
}

impl Arch {
    pub const ALL: [Arch; 5] = [Arch::Sm80, Arch::Sm86, Arch::Sm89, Arch::Sm90, Arch::Sm90a];

    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm86 => "sm_86",
            Arch::Sm89 => "sm_89",
            Arch::Sm90 => "sm_90",
            Arch::Sm90a => "sm_90a",
        }
    }

    /// The most dynamic shared memory a block may use, in bytes.
    pub fn max_shared_memory(self) -> usize {
        match self {
            Arch::Sm80 => 166_912,
            Arch::Sm86 | Arch::Sm89 => 101_376,
            Arch::Sm90 | Arch::Sm90a => 232_448,
        }
    }

    /// ptxas's `-arch` value.
    pub fn ptxas_arch(self) -> &'static str {
        self.name()
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Arch {
    type Err = String;
    fn from_str(s: &str) -> Result<Arch, String> {
        Arch::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| format!("unknown GPU architecture `{s}` (known: sm_80, sm_86, sm_89, sm_90, sm_90a)"))
    }
}

/// Code-generation choices that are not part of the tile program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtxConfig {
    pub arch: Arch,
    pub num_warps: usize,
    /// Shared-memory buffers per prefetched load of a loop (1 = copy, wait, compute;
    /// 2 = double buffering: the next tile is copied while this one is used; ...).
    pub num_stages: usize,
    /// The instructions the products run on, and how their operands arrive.
    pub path: CodePath,
}

/// A PTX configuration's code path. Each Hopper path implies `wgmma`, so no combination
/// of choices is invalid (warp specialisation without `wgmma`, a sunk softmax on
/// `mma.sync`); `ejc build --path` names them `mma`, `wgmma` and `ws`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CodePath {
    /// `mma.sync.m16n8k16` per warp, operands by `ldmatrix` (every architecture).
    #[default]
    MmaSync,
    /// Hopper's warpgroup MMA (`sm_90a` only): products whose operands allow it run as
    /// `wgmma.mma_async` with B (and a shared-memory A) read through descriptors, and the
    /// register tiles follow the warpgroup row layout; `overlap` says how the key loop's
    /// products overlap its softmax.
    Wgmma { overlap: Overlap },
    /// `wgmma` with warp specialisation ([`ws`]): a producer warp or warpgroup copies
    /// the key loop's tiles with the bulk tensor copy engine in the aligned entry while
    /// the `num_warps` consumer warps compute; the block has `num_warps +`
    /// [`ws_producer_warps`] warps. `overlap` as for [`CodePath::Wgmma`].
    WarpSpecialised { overlap: Overlap },
}

/// How a Hopper path's key loop overlaps its products with the softmax.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Overlap {
    /// The loop as the tile program writes it: each product waits for the one before.
    /// The fewest registers live: the choice where the accumulator is wide (d = 256,
    /// where the rotated loop's second score tile does not fit 240 registers).
    Serial,
    /// The loop rotated by `pipeline-dots`: the next block's score product is issued
    /// before this block's softmax and value product, so the tensor cores work while the
    /// softmax runs.
    #[default]
    Rotated,
    /// Rotated, and the softmax sunk into both arms of the masks' branch, so that ptxas
    /// keeps the value product in flight over it (costs registers: on the H100 it helps
    /// head_dim 64 and hurts 128; docs/perf.md).
    Sunk,
}

impl CodePath {
    /// Products run as `wgmma` (where their operands allow).
    pub fn wgmma(self) -> bool {
        !matches!(self, CodePath::MmaSync)
    }

    /// Warp-specialised.
    pub fn ws(self) -> bool {
        matches!(self, CodePath::WarpSpecialised { .. })
    }

    /// The Hopper paths' loop overlap (`None` for `mma.sync`).
    pub fn overlap(self) -> Option<Overlap> {
        match self {
            CodePath::MmaSync => None,
            CodePath::Wgmma { overlap } | CodePath::WarpSpecialised { overlap } => Some(overlap),
        }
    }

    /// The softmax sunk into the masks' branch.
    pub fn sink(self) -> bool {
        self.overlap() == Some(Overlap::Sunk)
    }

    /// The key loop rotated by `pipeline-dots`.
    pub fn rotated(self) -> bool {
        matches!(self.overlap(), Some(Overlap::Rotated | Overlap::Sunk))
    }

    /// The name `ejc build --path` takes: `mma`, `wgmma` or `ws`.
    pub fn name(self) -> &'static str {
        match self {
            CodePath::MmaSync => "mma",
            CodePath::Wgmma { .. } => "wgmma",
            CodePath::WarpSpecialised { .. } => "ws",
        }
    }

    /// The file-name and configuration suffix: ``, `_wgmma`, `_wgmma_sink`,
    /// `_wgmma_serial`, `_wgmma_ws`, `_wgmma_ws_sink`, `_wgmma_ws_serial`.
    pub fn suffix(self) -> &'static str {
        match self {
            CodePath::MmaSync => "",
            CodePath::Wgmma { overlap: Overlap::Rotated } => "_wgmma",
            CodePath::Wgmma { overlap: Overlap::Sunk } => "_wgmma_sink",
            CodePath::Wgmma { overlap: Overlap::Serial } => "_wgmma_serial",
            CodePath::WarpSpecialised { overlap: Overlap::Rotated } => "_wgmma_ws",
            CodePath::WarpSpecialised { overlap: Overlap::Sunk } => "_wgmma_ws_sink",
            CodePath::WarpSpecialised { overlap: Overlap::Serial } => "_wgmma_ws_serial",
        }
    }

    /// The flags an artifact's manifest `config` records (`wgmma`, `ws`, `sink`,
    /// `serial`: 1 when on, absent otherwise), in that order.
    pub fn flags(self) -> Vec<&'static str> {
        let serial = self.overlap() == Some(Overlap::Serial);
        [("wgmma", self.wgmma()), ("ws", self.ws()), ("sink", self.sink()), ("serial", serial)]
            .into_iter()
            .filter_map(|(f, on)| on.then_some(f))
            .collect()
    }
}

/// One compiled kernel.
#[derive(Clone, Debug)]
pub struct PtxKernel {
    pub ptx: String,
    pub code: PtxCode,
}

/// 32-bit pointers for shared memory (`-nvptx-short-ptr`): shared addresses fit in 32
/// bits, and 64-bit ones cost two registers each and 64-bit arithmetic. The option is
/// process-wide and only concerns the NVPTX back end.
fn short_shared_pointers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let args = [c"ejc".as_ptr(), c"-nvptx-short-ptr".as_ptr()];
        // Safety: two valid NUL-terminated strings; LLVM copies what it keeps.
        unsafe { llvm_sys::support::LLVMParseCommandLineOptions(2, args.as_ptr(), std::ptr::null()) };
    });
}

fn target_machine(arch: Arch) -> Result<TargetMachine, CodegenError> {
    Target::initialize_nvptx(&InitializationConfig::default());
    short_shared_pointers();
    let triple = TargetTriple::create("nvptx64-nvidia-cuda");
    let target = Target::from_triple(&triple).map_err(|e| CodegenError::Llvm(e.to_string()))?;
    target
        .create_target_machine(
            &triple,
            arch.name(),
            "+ptx80",
            OptimizationLevel::Aggressive,
            RelocMode::Default,
            CodeModel::Default,
        )
        .ok_or_else(|| CodegenError::Llvm(format!("LLVM cannot create an NVPTX target machine for {arch}")))
}

/// The LLVM parameter list of a kernel (see the module docs).
fn llvm_params(ir: &crate::llvm::Ir, kernel: &Kernel) -> Result<Vec<crate::llvm::T>, CodegenError> {
    let mut out = Vec::new();
    for p in &kernel.params {
        match &p.ty {
            Type::Tensor(_, rank) => {
                out.push(ir.ptr_in(1));
                out.extend(std::iter::repeat_n(ir.i64(), 2 * rank));
            }
            Type::Scalar(DType::F32) => out.push(ir.f32()),
            Type::Scalar(DType::I32 | DType::U32 | DType::I1) => out.push(ir.i32()),
            other => {
                return Err(CodegenError::Kernel {
                    kernel: kernel.name.clone(),
                    message: format!("PTX back end: parameter `{}` of type {other} is not supported", p.name),
                })
            }
        }
    }
    Ok(out)
}

/// Whether `kernel`'s dots run as `wgmma` under `cfg`: the Hopper path, warps in whole
/// warpgroups, and the products' rows split into 64-row blocks over them.
pub fn wgmma_applies(kernel: &Kernel, cfg: &PtxConfig) -> bool {
    let rows = candidates::product_rows(kernel);
    cfg.path.wgmma() && cfg.num_warps.is_multiple_of(4) && rows > 0 && rows.is_multiple_of(64 * (cfg.num_warps / 4))
}

/// The producer's warps in a warp-specialised block of `num_warps` consumer warps: a
/// warpgroup when `setmaxnreg` gives its registers to two consumer warpgroups, else one
/// warp (with one consumer warpgroup `setmaxnreg` has nothing to give: 255 is the most a
/// thread may have, and a smaller block leaves room for more blocks per SM).
pub fn ws_producer_warps(num_warps: usize) -> usize {
    if num_warps >= 8 {
        4
    } else {
        1
    }
}

/// Whether warp specialisation applies to `kernel` under `cfg` (`Ok`), or why not.
pub fn ws_applies(kernel: &Kernel, cfg: &PtxConfig) -> Result<(), String> {
    ws_plan(&rotated(kernel, cfg)?.0, cfg).map(|_| ())
}

/// The TMA loads of the (rotated) kernel when `cfg` asks for warp specialisation.
fn ws_plan(kernel: &Kernel, cfg: &PtxConfig) -> Result<Vec<ws::TmaLoad>, String> {
    if !wgmma_applies(kernel, cfg) {
        return Err("warp specialisation needs the wgmma path (sm_90a, whole warpgroups)".into());
    }
    if cfg.num_stages < 2 || !matches!(cfg.num_warps, 4 | 8 | 12) {
        return Err("warp specialisation needs at least 2 stages and 4, 8 or 12 consumer warps".into());
    }
    let plan = layout::plan(kernel)?;
    ws::tma_loads(kernel, &plan)
}

/// `kernel` after `pipeline-dots` where the wgmma path applies, and the epilogue loads
/// that continue a loop's tile stream.
type Streams = Vec<(ejc_ir::ir::Value, ejc_ir::ir::Value)>;
fn rotated(kernel: &Kernel, cfg: &PtxConfig) -> Result<(Kernel, Streams), String> {
    rotated_counted(kernel, cfg).map(|(k, s, _)| (k, s))
}

/// [`rotated`], and how many loops `pipeline-dots` rotated.
fn rotated_counted(kernel: &Kernel, cfg: &PtxConfig) -> Result<(Kernel, Streams, usize), String> {
    let mut streams = Vec::new();
    if !wgmma_applies(kernel, cfg) {
        return Ok((kernel.clone(), streams, 0));
    }
    let mut pipelined = kernel.clone();
    // `sink`: also move the softmax into the masks' branch, so that ptxas keeps the
    // value product in flight over it (docs/gpu.md).
    if !cfg.path.rotated() {
        return Ok((kernel.clone(), streams, 0));
    }
    let sink = cfg.path.sink();
    let rotations = ejc_ir::passes::rotate_loops(&mut pipelined, sink);
    let n = rotations.len();
    for r in rotations {
        streams.extend(r.epilogue_loads);
    }
    ejc_ir::verify::verify(&pipelined).map_err(|e| format!("pipeline-dots produced invalid IR: {e}"))?;
    Ok((pipelined, streams, n))
}

/// The first product of `kernel` that reads, inside a loop, an `a` operand held in
/// registers and computed before that loop (in words), or `None`.
pub fn register_a_before_loop(kernel: &Kernel) -> Option<String> {
    use ejc_ir::defuse::defined_in;
    use ejc_ir::ir::{Block, OpKind};
    use std::collections::HashSet;
    let plan = layout::plan(kernel).ok()?;
    fn go(
        kernel: &Kernel,
        block: &Block,
        plan: &layout::Plan,
        loops: &mut Vec<HashSet<ejc_ir::ir::Value>>,
    ) -> Option<String> {
        for op in &block.ops {
            if let (OpKind::Dot { trans_a: false, .. }, Some(inside)) = (&op.kind, loops.last()) {
                let a = op.operands[0];
                let sixteen = kernel.ty(a).dtype().size_bytes() == 2;
                if sixteen && !plan.smem_loads.contains(&a) && !inside.contains(&a) {
                    return Some(format!(
                        "the product %{} in a loop reads %{} as register fragments computed before the loop",
                        op.results[0].index(),
                        a.index()
                    ));
                }
            }
            let is_loop = matches!(op.kind, OpKind::For);
            for r in &op.regions {
                if is_loop {
                    loops.push(defined_in(r));
                }
                let found = go(kernel, r, plan, loops);
                if is_loop {
                    loops.pop();
                }
                if found.is_some() {
                    return found;
                }
            }
        }
        None
    }
    go(kernel, &kernel.body, &plan, &mut Vec::new())
}

/// Why `cfg`'s Hopper path must not take `kernel` (`Some`): an entry whose key loop
/// is emitted unrotated — the serial paths, the warp-specialised artifacts' general entry,
/// a `_wgmma` loop `pipeline-dots` left as it was — with a product that reads register
/// fragments computed before the loop. That gave wrong results on the H200 from the loop's
/// second iteration (docs/gpu.md, "Known hazard"); the rotated loop does not. The
/// candidate policy leaves such paths out (`mma.sync` stays).
pub fn hopper_hazard(kernel: &Kernel, cfg: &PtxConfig) -> Option<String> {
    if !wgmma_applies(kernel, cfg) {
        return None;
    }
    let why = register_a_before_loop(kernel)?;
    let unrotated_entry =
        !cfg.path.rotated() || cfg.path.ws() || rotated_counted(kernel, cfg).map(|(_, _, n)| n).unwrap_or(0) == 0;
    unrotated_entry.then_some(why)
}

/// Build the (unoptimised) LLVM module of one kernel.
fn emit<'ctx>(
    ctx: &'ctx Context,
    kernel: &Kernel,
    cfg: &PtxConfig,
) -> Result<(inkwell::module::Module<'ctx>, PtxCode), CodegenError> {
    use llvm_sys::core::*;
    // On the wgmma path the products are asynchronous: rotate the key loop so that the
    // value product of block j and the score product of block j+1 are issued together
    // and the softmax of block j+1 overlaps the former (`pipeline-dots`).
    // The rotation also says which epilogue loads continue a loop's tile stream, so the
    // loop's copies can fetch their tiles ahead too.
    let kerr = |m: String| CodegenError::Kernel { kernel: kernel.name.clone(), message: format!("PTX back end: {m}") };
    let (pipelined, streams) = rotated(kernel, cfg).map_err(kerr)?;
    let original = kernel;
    let kernel = &pipelined;
    let tma = if cfg.path.ws() { Some(ws_plan(kernel, cfg).map_err(kerr)?) } else { None };
    // Two consumer warpgroups: 240 registers each, the producer 24 (64512 of 65536).
    // Three: 160 each, the producer 32 (65536).
    let regs = match cfg.num_warps {
        8 => Some((240, 24)),
        12 => Some((160, 32)),
        _ => None,
    };
    let producer_warps = ws_producer_warps(cfg.num_warps);
    let plan = layout::plan(kernel)
        .map_err(|m| CodegenError::Kernel { kernel: kernel.name.clone(), message: format!("PTX back end: {m}") })?;
    let module = ctx.create_module("ejc_ptx");
    let tm = target_machine(cfg.arch)?;
    module.set_triple(&tm.get_triple());
    module.set_data_layout(&tm.get_target_data().get_data_layout());
    unsafe {
        let c = ctx.raw();
        let m = module.as_mut_ptr();
        // A throwaway builder just for types.
        let probe = crate::llvm::Ir::new(c, m, std::ptr::null_mut());
        let mut params = llvm_params(&probe, kernel)?;
        drop(probe);
        let fty = LLVMFunctionType(LLVMVoidTypeInContext(c), params.as_mut_ptr(), params.len() as u32, 0);
        let add_entry_typed = |entry: &str, fty| -> Result<llvm_sys::prelude::LLVMValueRef, CodegenError> {
            let name = std::ffi::CString::new(entry).map_err(|_| CodegenError::Llvm("kernel name has a NUL".into()))?;
            let f = LLVMAddFunction(m, name.as_ptr(), fty);
            // Calling convention 71 = PTX_Kernel: an `.entry`.
            LLVMSetFunctionCallConv(f, 71);
            let threads =
                ((cfg.num_warps + if cfg.path.ws() { ws_producer_warps(cfg.num_warps) } else { 0 }) * 32).to_string();
            for (k, v) in [("nvvm.maxntid", threads.as_str()), ("nvvm.minctasm", "1")] {
                let a = LLVMCreateStringAttribute(
                    c,
                    k.as_ptr() as *const _,
                    k.len() as u32,
                    v.as_ptr() as *const _,
                    v.len() as u32,
                );
                LLVMAddAttributeAtIndex(f, u32::MAX, a);
            }
            // Tensor pointers never alias each other's written elements (the runtime
            // checks outputs against inputs).
            let noalias = LLVMGetEnumAttributeKindForName("noalias".as_ptr() as *const _, 7);
            for (i, p) in params.iter().enumerate() {
                if LLVMGetTypeKind(*p) == llvm_sys::LLVMTypeKind::LLVMPointerTypeKind {
                    LLVMAddAttributeAtIndex(f, i as u32 + 1, LLVMCreateEnumAttribute(c, noalias, 0));
                }
            }
            Ok(f)
        };
        let add_entry = |entry: &str| add_entry_typed(entry, fty);
        let arr = LLVMArrayType2(LLVMInt8TypeInContext(c), 0);
        let sname = std::ffi::CString::new("ejc_smem").unwrap_or_default();
        let smem = LLVMAddGlobalInAddressSpace(m, arr, sname.as_ptr(), 3);
        LLVMSetLinkage(smem, llvm_sys::LLVMLinkage::LLVMExternalLinkage);
        // 1024: wgmma's 128-byte swizzle repeats every 1024 bytes of address.
        LLVMSetAlignment(smem, 1024);
        let hopper = wgmma_applies(kernel, cfg);
        let f = add_entry(&kernel.name)?;
        let ir = crate::llvm::Ir::new(c, m, f);
        // The general entry of a warp-specialised artifact (unaligned tensors: no copy
        // engine, the producer idle) runs the loop unrotated: the rotation's extra live
        // tile would not fit the consumers' 240 registers next to the copies' addresses.
        let (general, general_plan, general_streams) = if cfg.path.ws() {
            let p = layout::plan(original).map_err(kerr)?;
            (original, p, &[][..])
        } else {
            (kernel, plan, &streams[..])
        };
        let mut code = lower::Lowering::new(
            ir,
            general,
            general_plan,
            cfg.num_warps,
            cfg.num_stages,
            smem,
            hopper,
            false,
            general_streams,
        )
        .with_ws(tma.as_ref().map(|_| lower::WsLowering { tma: Vec::new(), regs, producer_warps }))
        .run()?;
        // The same kernel once more, as a second entry that assumes the shared-memory
        // operands' tensors are aligned (see `PtxCode::aligned_tensors`): no element-by-element
        // fallback, so fewer registers live. Only when there is something to assume.
        // It also assumes a positive softmax scale, where that lets the scale fold into
        // the exponent (`ejc_ir::passes::scale_fold`).
        if !code.aligned_tensors.is_empty() {
            let entry = format!("{}_aligned", kernel.name);
            let f = match &tma {
                // The tensor maps follow the ABI's parameters, by value
                // (`.param .align 64 .b8 [128]`, `__grid_constant__`).
                Some(t) => {
                    let mut ps = params.clone();
                    ps.extend(std::iter::repeat_n(LLVMPointerTypeInContext(c, 0), t.len()));
                    let fty = LLVMFunctionType(LLVMVoidTypeInContext(c), ps.as_mut_ptr(), ps.len() as u32, 0);
                    let f = add_entry_typed(&entry, fty)?;
                    let map_ty = LLVMArrayType2(LLVMInt8TypeInContext(c), 128);
                    let byval = LLVMGetEnumAttributeKindForName("byval".as_ptr() as *const _, 5);
                    let align = LLVMGetEnumAttributeKindForName("align".as_ptr() as *const _, 5);
                    let gc = "nvvm.grid_constant";
                    for i in params.len()..ps.len() {
                        let idx = i as u32 + 1;
                        LLVMAddAttributeAtIndex(f, idx, LLVMCreateTypeAttribute(c, byval, map_ty));
                        LLVMAddAttributeAtIndex(f, idx, LLVMCreateEnumAttribute(c, align, 64));
                        let a =
                            LLVMCreateStringAttribute(c, gc.as_ptr() as *const _, gc.len() as u32, std::ptr::null(), 0);
                        LLVMAddAttributeAtIndex(f, idx, a);
                    }
                    f
                }
                None => add_entry(&entry)?,
            };
            let ir = crate::llvm::Ir::new(c, m, f);
            let mut folded_kernel = kernel.clone();
            let folded = ejc_ir::passes::scale_fold(&mut folded_kernel);
            let plan = layout::plan(&folded_kernel).map_err(|m| CodegenError::Kernel {
                kernel: kernel.name.clone(),
                message: format!("PTX back end: {m}"),
            })?;
            let a = lower::Lowering::new(
                ir,
                &folded_kernel,
                plan,
                cfg.num_warps,
                cfg.num_stages,
                smem,
                hopper,
                true,
                &streams,
            )
            .with_ws(tma.as_ref().map(|t| lower::WsLowering { tma: t.clone(), regs, producer_warps }))
            .run()?;
            code.tensor_maps = a.tensor_maps;
            code.schedules
                .extend(a.schedules.into_iter().map(|s| schedule::EntrySchedule { entry: entry.clone(), ..s }));
            code.positive_scalars = folded.positive;
            code.smem_bytes = code.smem_bytes.max(a.smem_bytes);
            code.aligned_entry = Some(entry);
        }
        module
            .verify()
            .map_err(|e| CodegenError::Llvm(format!("generated NVPTX LLVM IR does not verify: {}", e.to_string())))?;
        Ok((module, code))
    }
}

/// The schedule of each entry of `kernel` under `cfg` ([`schedule`]), as text headed by
/// the entry and the configuration. Emits the LLVM IR (no optimisation, no PTX), which is
/// where the schedule is made and checked.
pub fn schedules(kernel: &Kernel, cfg: &PtxConfig) -> Result<Vec<schedule::EntrySchedule>, CodegenError> {
    check_config(kernel, cfg)?;
    let ctx = Context::create();
    let (_, code) = emit(&ctx, kernel, cfg)?;
    let head = config_tag(cfg);
    Ok(code
        .schedules
        .into_iter()
        .map(|s| schedule::EntrySchedule { schedule: format!("{} ({head})\n{}", s.entry, s.schedule), ..s })
        .collect())
}

/// A configuration in words, for dumps: `sm_90a, 8 warps, 2 stages, wgmma, ws`.
fn config_tag(cfg: &PtxConfig) -> String {
    let mut t = format!("{}, {} warps, {} stages", cfg.arch.name(), cfg.num_warps, cfg.num_stages);
    for flag in cfg.path.flags() {
        t.push_str(", ");
        t.push_str(flag);
    }
    t
}

/// Where a dump of `name` under `cfg` goes: `<$var>/<name>_w<warps>_s<stages>[_wgmma][_ws][_sink].<arch>.<suffix>`
/// (the directory made), or `None` when `$var` is not set.
fn dump_path(var: &str, name: &str, cfg: &PtxConfig, suffix: &str) -> Result<Option<std::path::PathBuf>, CodegenError> {
    let Some(dir) = std::env::var_os(var).filter(|d| !d.is_empty()) else { return Ok(None) };
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir).map_err(|error| CodegenError::Io { path: dir.clone(), error })?;
    Ok(Some(dir.join(format!(
        "{name}_w{}_s{}{}.{}.{suffix}",
        cfg.num_warps,
        cfg.num_stages,
        cfg.path.suffix(),
        cfg.arch.name()
    ))))
}

/// `EJC_DUMP_SCHEDULE=<dir>`: each entry's schedule under `cfg` ([`dump_path`],
/// `….schedule.txt`), followed by the entry's tile IR with op ids.
fn dump_schedules(kernel: &Kernel, cfg: &PtxConfig) -> Result<(), CodegenError> {
    if std::env::var_os("EJC_DUMP_SCHEDULE").is_none_or(|d| d.is_empty()) {
        return Ok(());
    }
    for s in schedules(kernel, cfg)? {
        let Some(path) = dump_path("EJC_DUMP_SCHEDULE", &s.entry, cfg, "schedule.txt")? else { continue };
        let text = format!("{}\n--- the entry's tile IR, each op headed by its id ---\n{}", s.schedule, s.ir);
        std::fs::write(&path, text).map_err(|error| CodegenError::Io { path, error })?;
    }
    Ok(())
}

fn check_config(kernel: &Kernel, cfg: &PtxConfig) -> Result<(), CodegenError> {
    // The CUDA launch passes every tensor's (address, shape, strides) before the scalars
    // (docs/abi.md): a kernel whose entry took them interleaved would read garbage.
    let first_scalar = kernel.params.iter().position(|p| !matches!(p.ty, ejc_ir::types::Type::Tensor(..)));
    if let Some(late) =
        first_scalar.and_then(|i| kernel.params[i..].iter().find(|p| matches!(p.ty, ejc_ir::types::Type::Tensor(..))))
    {
        return Err(CodegenError::Kernel {
            kernel: kernel.name.clone(),
            message: format!(
                "PTX back end: tensor parameter `{}` is declared after a scalar; declare every tensor before the \
                 scalars (the launch ABI passes tensors first)",
                late.name
            ),
        });
    }
    if cfg.path.wgmma() && cfg.arch != Arch::Sm90a {
        return Err(CodegenError::Kernel {
            kernel: kernel.name.clone(),
            message: format!("PTX back end: wgmma needs the sm_90a target (got {})", cfg.arch.name()),
        });
    }
    if !matches!(cfg.num_warps, 1 | 2 | 4 | 8 | 12 | 16) {
        return Err(CodegenError::Kernel {
            kernel: kernel.name.clone(),
            message: format!("PTX back end: num_warps must be 1, 2, 4, 8, 12 or 16 (got {})", cfg.num_warps),
        });
    }
    Ok(())
}

/// Compile one kernel to PTX.
pub fn compile(kernel: &Kernel, cfg: &PtxConfig) -> Result<PtxKernel, CodegenError> {
    check_config(kernel, cfg)?;
    dump_schedules(kernel, cfg)?;
    // EJC_DUMP_LLVM asks for the LLVM IR, which only a compilation makes: no cache then.
    if std::env::var_os("EJC_DUMP_LLVM").is_some_and(|d| !d.is_empty()) {
        return compile_uncached(kernel, cfg);
    }
    // The printed tile IR is the whole program, the configuration the rest of the input.
    let parts = || vec!["ptx".into(), cfg.arch.name().into(), format!("{cfg:?}"), ejc_ir::print::print_kernel(kernel)];
    let (code, ptx) = crate::cache::cached("ptx", "ptx", parts, || {
        compile_uncached(kernel, cfg).map(|k| (k.code, k.ptx.into_bytes()))
    })?;
    let ptx = String::from_utf8(ptx).map_err(|_| CodegenError::Llvm("PTX that is not UTF-8".into()))?;
    Ok(PtxKernel { ptx, code })
}

fn compile_uncached(kernel: &Kernel, cfg: &PtxConfig) -> Result<PtxKernel, CodegenError> {
    let ctx = Context::create();
    let (module, code) = emit(&ctx, kernel, cfg)?;
    let tm = target_machine(cfg.arch)?;
    let dump = |stage: &str, text: String| -> Result<(), CodegenError> {
        // EJC_DUMP_LLVM=<dir>: the LLVM IR as emitted and as optimised, per configuration.
        let Some(path) = dump_path("EJC_DUMP_LLVM", &kernel.name, cfg, &format!("{stage}.ll"))? else { return Ok(()) };
        std::fs::write(&path, text).map_err(|error| CodegenError::Io { path, error })
    };
    dump("0-emitted", module.print_to_string().to_string())?;
    module
        .run_passes("default<O3>", &tm, PassBuilderOptions::create())
        .map_err(|e| CodegenError::Llvm(format!("LLVM optimisation failed: {}", e.to_string())))?;
    dump("1-optimized", module.print_to_string().to_string())?;
    let buf = tm
        .write_to_memory_buffer(&module, FileType::Assembly)
        .map_err(|e| CodegenError::Llvm(format!("LLVM could not emit PTX: {}", e.to_string())))?;
    let ptx = String::from_utf8_lossy(buf.as_slice()).trim_end_matches('\0').to_string();
    Ok(PtxKernel { ptx, code })
}

/// The optimised LLVM IR of a kernel, as text (for inspection).
pub fn llvm_ir(kernel: &Kernel, cfg: &PtxConfig) -> Result<String, CodegenError> {
    let ctx = Context::create();
    let (module, _) = emit(&ctx, kernel, cfg)?;
    let tm = target_machine(cfg.arch)?;
    module
        .run_passes("default<O3>", &tm, PassBuilderOptions::create())
        .map_err(|e| CodegenError::Llvm(format!("LLVM optimisation failed: {}", e.to_string())))?;
    Ok(module.print_to_string().to_string())
}

/// What `ptxas -v` says about a kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PtxasReport {
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_frame: u32,
    /// Static shared memory (the dynamic part is the manifest's).
    pub shared_static: u32,
}

/// Where `ptxas` is: `$EJC_PTXAS`, else `.tools/ptxas/...` under the workspace, else
/// `ptxas` on the PATH. None when there is none.
pub fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("EJC_PTXAS") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/ptxas/nvidia/cuda_nvcc/bin/ptxas");
    if here.is_file() {
        return Some(here);
    }
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join("ptxas")).find(|p| p.is_file()))
}

/// A use as the B operand of a product, or as its A operand when that is not
/// transposed (`trans_a`: read by `ldmatrix.trans`): tiles used only so are stored in
/// the core-matrix layout `wgmma` reads, and may be copied by TMA.
pub(crate) fn wgmma_operand(u: &ejc_ir::defuse::Use) -> bool {
    match u.op.kind {
        ejc_ir::ir::OpKind::Dot { trans_a, .. } => u.operand == 1 || (u.operand == 0 && !trans_a),
        _ => false,
    }
}

/// Assemble `ptx` for `arch` with `ptxas -v`; its messages. What ptxas says depends only
/// on the PTX, the target and ptxas itself, so a successful report is kept in the
/// compiled-code cache (`<cache dir>/ptxas`, keyed by those three: ptxas by its
/// `--version`): a second `--report` build, or test run, of unchanged PTX runs no ptxas.
/// A rejection is never kept.
fn run_ptxas(ptxas: &Path, ptx: &str, arch: Arch) -> Result<String, String> {
    run_ptxas_cached(crate::cache::CodeCache::open("ptxas").as_ref(), ptxas, ptx, arch)
}

fn run_ptxas_cached(
    cache: Option<&crate::cache::CodeCache>,
    ptxas: &Path,
    ptx: &str,
    arch: Arch,
) -> Result<String, String> {
    let key = cache
        .and_then(|_| ptxas_version(ptxas))
        .map(|version| crate::cache::CodeCache::key_without_compiler(&["ptxas", &version, arch.ptxas_arch(), ptx]));
    if let (Some(cache), Some(key)) = (cache, &key) {
        if let Some(text) = cache.peek(key, "txt").and_then(|b| String::from_utf8(b).ok()) {
            return Ok(text);
        }
    }
    let text = assemble(ptxas, ptx, arch)?;
    if let (Some(cache), Some(key)) = (cache, &key) {
        cache.put(key, "txt", text.as_bytes());
    }
    Ok(text)
}

/// `ptxas --version` (once per ptxas per process); none when it does not answer, and then
/// nothing is cached.
fn ptxas_version(ptxas: &Path) -> Option<String> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static SEEN: OnceLock<Mutex<HashMap<PathBuf, Option<String>>>> = OnceLock::new();
    let seen = SEEN.get_or_init(Default::default);
    if let Some(v) = seen.lock().ok()?.get(ptxas) {
        return v.clone();
    }
    let v = std::process::Command::new(ptxas)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .filter(|v| !v.trim().is_empty());
    seen.lock().ok()?.insert(ptxas.to_path_buf(), v.clone());
    v
}

fn assemble(ptxas: &Path, ptx: &str, arch: Arch) -> Result<String, String> {
    let dir = std::env::temp_dir().join(format!("ejc-ptxas-{}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let src = dir.join("k.ptx");
    std::fs::write(&src, ptx).map_err(|e| format!("{}: {e}", src.display()))?;
    let out = std::process::Command::new(ptxas)
        .arg(format!("-arch={}", arch.ptxas_arch()))
        .arg("-v")
        .arg(&src)
        .arg("-o")
        .arg(dir.join("k.cubin"))
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ptxas.display()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = out?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(format!("ptxas rejected the PTX for {arch}:\n{text}"));
    }
    Ok(text)
}

/// Assemble `ptx` for `arch` with ptxas and read its report: the worst over the
/// module's entries (most registers, most spills). Errors carry ptxas's messages.
pub fn ptxas(ptxas: &Path, ptx: &str, arch: Arch) -> Result<PtxasReport, String> {
    let per = ptxas_entries(ptxas, ptx, arch)?;
    let mut r = PtxasReport::default();
    for (_, e) in per {
        r.registers = r.registers.max(e.registers);
        r.spill_stores = r.spill_stores.max(e.spill_stores);
        r.spill_loads = r.spill_loads.max(e.spill_loads);
        r.stack_frame = r.stack_frame.max(e.stack_frame);
        r.shared_static = r.shared_static.max(e.shared_static);
    }
    Ok(r)
}

/// ptxas's report for each entry of `ptx`, in the order ptxas gives them.
pub fn ptxas_entries(ptxas: &Path, ptx: &str, arch: Arch) -> Result<Vec<(String, PtxasReport)>, String> {
    let text = run_ptxas(ptxas, ptx, arch)?;
    // Each entry's part starts at "Compiling entry function '<name>'".
    let mark = "Compiling entry function '";
    let mut out = Vec::new();
    let parts: Vec<&str> = text.split(mark).skip(1).collect();
    for part in parts {
        let name = part.split('\'').next().unwrap_or_default().to_string();
        out.push((name, parse_report(part)));
    }
    if out.is_empty() {
        out.push((String::new(), parse_report(&text)));
    }
    Ok(out)
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn number_before(text: &str, what: &str) -> u32 {
    text.find(what).and_then(|i| text[..i].split_whitespace().last()).and_then(|n| n.parse().ok()).unwrap_or(0)
}

fn parse_report(text: &str) -> PtxasReport {
    PtxasReport {
        registers: number_before(text, "registers"),
        spill_stores: number_before(text, "bytes spill stores"),
        spill_loads: number_before(text, "bytes spill loads"),
        stack_frame: number_before(text, "bytes stack frame"),
        shared_static: number_before(text, "bytes smem"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in ptxas that answers `--version`, writes a report and counts the
    /// assemblies it runs; rejects PTX containing "bad".
    fn fake_ptxas(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let exe = dir.join("ptxas");
        let script = format!(
            "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'fake ptxas 1.0'; exit 0; fi\n\
             echo run >> {}/runs\n\
             for a in \"$@\"; do case $a in *.ptx) grep -q bad \"$a\" && {{ echo 'error: bad PTX' >&2; exit 1; }};; esac; done\n\
             echo \"ptxas info    : Compiling entry function 'k' for 'sm_90a'\"\n\
             echo 'ptxas info    : Used 40 registers, 0 bytes spill stores, 0 bytes spill loads'\n",
            dir.display()
        );
        std::fs::write(&exe, script).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        exe
    }

    #[test]
    fn ptxas_reports_are_cached_and_rejections_are_not() {
        let dir = std::env::temp_dir().join(format!("ejc-ptxas-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let tool = fake_ptxas(&dir);
        let cache = crate::cache::CodeCache::at(dir.join("cache"));
        let runs = || std::fs::read_to_string(dir.join("runs")).map(|t| t.lines().count()).unwrap_or(0);
        let first = run_ptxas_cached(Some(&cache), &tool, "// ptx one", Arch::Sm90a).unwrap();
        assert!(first.contains("Used 40 registers"), "{first}");
        assert_eq!(runs(), 1);
        // The same PTX and target: from the cache, ptxas not run.
        assert_eq!(run_ptxas_cached(Some(&cache), &tool, "// ptx one", Arch::Sm90a).unwrap(), first);
        assert_eq!(runs(), 1);
        // Another target or other PTX: assembled.
        run_ptxas_cached(Some(&cache), &tool, "// ptx one", Arch::Sm80).unwrap();
        run_ptxas_cached(Some(&cache), &tool, "// ptx two", Arch::Sm90a).unwrap();
        assert_eq!(runs(), 3);
        // A rejection is reported every time, never kept.
        for _ in 0..2 {
            let e = run_ptxas_cached(Some(&cache), &tool, "// bad ptx", Arch::Sm90a).unwrap_err();
            assert!(e.contains("bad PTX"), "{e}");
        }
        assert_eq!(runs(), 5);
        // Without a cache, every call assembles.
        run_ptxas_cached(None, &tool, "// ptx one", Arch::Sm90a).unwrap();
        assert_eq!(runs(), 6);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
