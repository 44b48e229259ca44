//! Tile IR → LLVM IR for NVPTX (one thread's program; `sm_80` instructions).
//!
//! * **Scalars** are uniform SSA values (every thread computes the same).
//! * **Register tiles** follow the accumulator layout of `mma.m16n8k16` (see
//!   [`super::layout`]): each thread holds a small grid of elements, one SSA value
//!   each; element-wise ops are computed element by element, broadcasting along
//!   extent-1 axes; `scf.for` / `scf.if` carry them as phis.
//! * **Register tiles at a moving window** — loaded or stored in a loop where only
//!   their fixed indices move (a token loop over `x[b, t, h0.., :]`) — are addressed
//!   from one pointer per row slot plus constant column offsets when the column axis
//!   has unit stride, so that the loop holds no per-element offsets or flags.
//! * **Shared-memory tiles** are the dot operands loaded from global memory with
//!   `cp.async` (16-byte chunks, zero-filled out of bounds) when the tensor's last
//!   axis is contiguous and aligned, element by element otherwise (the choice is made
//!   at run time, once per load). Rows are padded by 16 bytes, so `ldmatrix` reads
//!   them without bank conflicts.
//! * **`tile.dot`** is a grid of `mma.sync.m16n8k16` per warp: `a` fragments from
//!   shared memory (`ldmatrix`), or straight from registers when `a` is a register
//!   tile (the softmax probabilities: an accumulator fragment pair is an `a`
//!   fragment); `b` fragments by `ldmatrix` (`.trans` for `a·b`, plain for `a·bᵀ`).
//! * **The online softmax** reduces rows inside a thread, then across the four lanes
//!   of a row with two shuffles; `exp2` is `ex2.approx`.
//!
//! Parameters: each tensor is `(ptr, shape[rank] i64, strides[rank] i64)`, each scalar
//! one value (i1 as i32); docs/abi.md states it.

use std::collections::{HashMap, HashSet};

use ejc_ir::defuse::{defined_in, is_scalar_arith, DefUse};
use ejc_ir::ir::{AxisIndex, Block, Kernel, Op, OpKind, ReduceOp, Value};
use ejc_ir::types::{DType, Type};
use llvm_sys::LLVMIntPredicate::*;
use llvm_sys::LLVMRealPredicate::*;

use super::layout::{Orient, Plan};
use super::nvvm;
use crate::arith::Arith;
use crate::llvm::{Ir, B, T, V};
use crate::math;
use crate::CodegenError;

type R<X> = Result<X, CodegenError>;

/// How one axis of a register tile is spread over the threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ax {
    /// Extent 1: every thread holds it.
    One,
    /// The accumulator layout's rows (extent R, split over warps) or columns (extent C).
    Mma(usize),
}

/// A register tile: the calling thread's elements, row slot major.
#[derive(Clone, Debug)]
struct Dist {
    rows: Ax,
    cols: Ax,
    e: Vec<V>,
}

/// How a shared-memory tile is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SmemLayout {
    /// Rows padded by 16 bytes: `ldmatrix` reads them without bank conflicts.
    Padded,
    /// For tiles that only feed Hopper's `wgmma`: 8-row groups of "core matrices" (8
    /// rows × 16 bytes, 128 contiguous bytes each), the canonical layout a descriptor
    /// without swizzling reads (K-major for `[n, k]`/`[m, k]` tiles, N-major for
    /// `[k, n]`). Any multiple of 8 columns.
    CoreMatrix,
    /// The same, with wgmma's 128-byte swizzle, which its shared-memory reads take at
    /// full rate: the columns in blocks of 64 (128 bytes), each block `rows` rows of 128
    /// bytes (8-row atoms of 1024 bytes, 1024-byte aligned), the 16-byte chunk `c` of
    /// row `r` stored at chunk `c ^ (r mod 8)`. Needs a multiple of 64 columns.
    Swizzle128,
}

/// A tile in shared memory: `rows × cols` elements of `dtype` in `layout`.
#[derive(Clone, Debug)]
struct Smem {
    /// Byte offset (i32 value) in the dynamic shared array; varies per iteration for
    /// multi-buffered (pipelined) loads.
    off: V,
    rows: usize,
    cols: usize,
    dtype: DType,
    /// `a` fragments read right after the load: `[m-fragment][k-step]`.
    afrags: Option<Vec<Vec<[V; 4]>>>,
    layout: SmemLayout,
    /// Its `cp.async` copy was committed but not waited for: the first read must wait,
    /// unless a pipelined load of the enclosing loop has waited already (`covered`).
    pending: bool,
}

impl Smem {
    fn new(rows: usize, cols: usize, dtype: DType, layout: SmemLayout, off: V) -> Smem {
        Smem { off, rows, cols, dtype, afrags: None, layout, pending: false }
    }

    /// The layout of a tile that only `wgmma` reads (`for_wgmma`), or `ldmatrix` too.
    fn layout_for(cols: usize, dtype: DType, for_wgmma: bool) -> SmemLayout {
        if !for_wgmma || !cols.is_multiple_of(8) {
            SmemLayout::Padded
        } else if (cols * dtype.size_bytes()).is_multiple_of(128) {
            SmemLayout::Swizzle128
        } else {
            SmemLayout::CoreMatrix
        }
    }

    /// Read by `wgmma` through descriptors (the async proxy): its writers fence.
    fn wgmma_readable(&self) -> bool {
        self.layout != SmemLayout::Padded
    }

    /// Byte alignment its offset needs.
    fn align(&self) -> usize {
        if self.layout == SmemLayout::Swizzle128 {
            1024
        } else {
            128
        }
    }

    fn row_bytes(&self) -> usize {
        self.cols * self.dtype.size_bytes() + 16
    }

    /// Bytes of one 8-row group of core matrices.
    fn group_bytes(&self) -> usize {
        self.cols.div_ceil(8) * 128
    }

    /// Bytes of one 64-column block of the swizzled layout.
    fn block_bytes(&self) -> usize {
        self.rows.div_ceil(8) * 1024
    }

    /// Size of the tile in shared memory.
    fn bytes(&self) -> usize {
        match self.layout {
            SmemLayout::Padded => self.rows * self.row_bytes(),
            SmemLayout::CoreMatrix => self.rows.div_ceil(8) * self.group_bytes(),
            SmemLayout::Swizzle128 => (self.cols * self.dtype.size_bytes()).div_ceil(128) * self.block_bytes(),
        }
    }

    /// Byte offset (from `off`) of the 16-byte chunk `ch` (8 elements) of row `row`.
    fn chunk_off(&self, ir: &Ir, row: V, ch: V) -> V {
        match self.layout {
            SmemLayout::Padded => ir.add(ir.mul(row, ir.ci32(self.row_bytes() as i64)), ir.mul(ch, ir.ci32(16))),
            SmemLayout::CoreMatrix => {
                let g = ir.mul(ir.lshr(row, ir.ci32(3)), ir.ci32(self.group_bytes() as i64));
                ir.add(g, ir.add(ir.mul(ch, ir.ci32(128)), ir.mul(ir.and(row, ir.ci32(7)), ir.ci32(16))))
            }
            SmemLayout::Swizzle128 => {
                let block = ir.mul(ir.lshr(ch, ir.ci32(3)), ir.ci32(self.block_bytes() as i64));
                let within = ir.xor(ir.and(ch, ir.ci32(7)), ir.and(row, ir.ci32(7)));
                ir.add(block, ir.add(ir.mul(row, ir.ci32(128)), ir.shl(within, ir.ci32(4))))
            }
        }
    }

    /// Byte offset (from `off`) of element (`row`, `col`).
    fn elem_off(&self, ir: &Ir, row: V, col: V) -> V {
        let es = self.dtype.size_bytes() as i64;
        match self.layout {
            SmemLayout::Padded => ir.add(ir.mul(row, ir.ci32(self.row_bytes() as i64)), ir.mul(col, ir.ci32(es))),
            _ => {
                let per_chunk = 16 / es;
                let ch = self.chunk_off(ir, row, ir.udiv(col, ir.ci32(per_chunk)));
                ir.add(ch, ir.mul(ir.urem(col, ir.ci32(per_chunk)), ir.ci32(es)))
            }
        }
    }
}

#[derive(Clone, Debug)]
enum GV {
    /// A rematerialisable rank-1 tile, built where used, along the axis the use needs.
    Lazy,
    Scalar(V),
    Tensor(usize),
    Dist(Dist),
    Smem(Smem),
}

struct TensorInfo {
    /// `ptr addrspace(1)` to element [0, …].
    data: V,
    shape: Vec<V>,
    strides: Vec<V>,
    dtype: DType,
}

/// What lowering one kernel produced besides its function.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PtxCode {
    pub entry: String,
    /// Dynamic shared memory the launch must give, in bytes.
    pub smem_bytes: usize,
    pub threads: usize,
    /// Tensors (parameter names) whose tiles go to shared memory with `cp.async` when
    /// they are aligned: data 16-byte aligned, last stride 1, every other stride a
    /// multiple of 8 elements. The aligned entry assumes this of them.
    pub aligned_tensors: Vec<String>,
    /// The second entry of the module, compiled under that assumption (no
    /// element-by-element fallback for those tiles), when there is one.
    pub aligned_entry: Option<String>,
    /// Scalar parameters the aligned entry needs > 0 (its softmax scale is folded into
    /// the exponent: `scale_fold`).
    pub positive_scalars: Vec<String>,
    /// Warp-specialised: the aligned entry's tensor-map parameters (after the ABI's),
    /// one per load the producer copies.
    pub tensor_maps: Vec<super::ws::TmaLoad>,
}

pub struct Lowering<'k> {
    ir: Ir,
    kernel: &'k Kernel,
    plan: Plan,
    warps: usize,
    vals: Vec<Option<GV>>,
    /// Definitions and uses of the kernel's values.
    du: DefUse<'k>,
    tensors: Vec<TensorInfo>,
    pid: [V; 3],
    warp: V,
    lane: V,
    smem: V,
    smem_top: usize,
    /// The most shared memory in use at once (the launch's dynamic size).
    smem_peak: usize,
    /// Pipeline depth for loads in loops (1 = none).
    stages: usize,
    /// Loop nesting depth at the op being lowered.
    depth: usize,
    /// The values defined inside each enclosing loop (region arguments included),
    /// innermost last: what a register tile's access window may not depend on to be
    /// addressed as a moving window (see [`Self::window_moves`]).
    loop_values: Vec<HashSet<Value>>,
    /// Loads of the loop being lowered that are prefetched, by op address.
    prefetch: HashMap<usize, Prefetch<'k>>,
    /// Shared-memory regions by the op (and operand) that owns them, so that an op in
    /// a loop body reuses its region every iteration.
    regions: HashMap<(usize, usize), usize>,
    /// Hopper path (sm_90a, warps in warpgroups of 4): dots whose operands qualify run
    /// as `wgmma`, and the rows of register tiles follow the warpgroup layout (warp w of
    /// warpgroup g owns rows 16·(w mod 4) + 64·(g + G·i) of each 64-row block i).
    wgmma: bool,
    /// Tiles that only ever feed dots: on the Hopper path they are stored in the
    /// core-matrix layout wgmma reads.
    dot_only: std::collections::HashSet<Value>,
    /// Lowering the aligned entry: the tensors of shared-memory tiles are aligned (see
    /// [`PtxCode::aligned_tensors`]).
    assume_aligned: bool,
    /// Tensors (indices) whose shared-memory tiles would take `cp.async` when aligned.
    aligned_tensors: std::collections::BTreeSet<usize>,
    /// `softmax.update` ops (by first result) whose scores arrive unscaled, and their
    /// scale (`scale_fold`).
    scaled_softmax: HashMap<Value, Value>,
    /// In a loop body after a pipelined load's wait and barrier (cp.async only): every
    /// copy committed before the loop is complete and visible.
    covered: bool,
    /// Tiles loaded before a loop whose `a` fragments stay in registers, copied without
    /// waiting (aligned entry): their fragments are read after the next loop's prologue
    /// has issued its copies, so the copies overlap.
    pending_afrags: Vec<Value>,
    /// Warpgroup MMA groups committed and not yet waited for, oldest first: a sequence
    /// number and the IR values (register tiles) they write. A product is waited for
    /// where it is first read, so independent work — the softmax of the next key block,
    /// after `pipeline-dots` — runs while the tensor cores work.
    wg_pending: Vec<(u64, Vec<Value>)>,
    wg_seq: u64,
    /// Loop prologues issued ahead of the loop (by op address): see [`Self::block`].
    early_prologues: HashMap<usize, PipePrologue<'k>>,
    /// Loads of a loop whose tile stream an epilogue load continues (`pipeline-dots`'s
    /// [`ejc_ir::passes::Rotation`]): loop load → epilogue load.
    stream_next: HashMap<Value, Value>,
    /// Epilogue loads whose tile the loop's ring already holds (after the loop): the
    /// tile, and whether the loop took the `cp.async` path (i1; else it was not copied).
    epilogue_tiles: HashMap<Value, EpilogueTile>,
    /// Warp specialisation (`PtxConfig::ws`): a producer warpgroup follows the
    /// `warps` consumer warps; consumers synchronise with a named barrier.
    ws: Option<WsLowering>,
    /// Lowering the producer's program (scalars and bulk tensor copies only).
    producer: bool,
    /// Ping-pong of two consumer warpgroups in a warp-specialised loop body: the first
    /// and last product of the body (op addresses), and whether this is the last
    /// iteration (i1). See [`Self::for_op`].
    pingpong: Option<(usize, usize, V)>,
}

/// What [`Lowering::window_access`] does with element `i` at address `ptr` (i1 `ok`:
/// in bounds): a load's value, or nothing.
type WindowElem<'a, 'k> = dyn FnMut(&mut Lowering<'k>, usize, V, V) -> R<Option<V>> + 'a;

/// An epilogue load's tile in a loop's ring: the tile, whether the loop took the
/// `cp.async` path (i1), and for a producer-copied stream its full mbarrier and parity.
type EpilogueTile = (Smem, V, Option<(V, V)>);

/// What a warp-specialised entry needs besides the consumers' program.
#[derive(Clone, Debug)]
pub struct WsLowering {
    /// The loads the producer copies with the bulk tensor copy engine (aligned entry
    /// only; empty for the general entry, whose producer has nothing to do), in the
    /// order of their tensor-map parameters.
    pub tma: Vec<super::ws::TmaLoad>,
    /// Raise the consumers' registers (and lower the producer's) with `setmaxnreg`.
    pub regs: Option<(usize, usize)>,
    /// Warps of the producer (after the consumers'): a whole warpgroup where
    /// `setmaxnreg` moves its registers to the consumers, else one warp (a smaller
    /// block: more blocks per SM).
    pub producer_warps: usize,
}

fn unsupported(kernel: &Kernel, what: String) -> CodegenError {
    CodegenError::Kernel { kernel: kernel.name.clone(), message: format!("PTX back end: {what}") }
}

impl<'k> Lowering<'k> {
    /// # Safety
    /// `ir` must be positioned in a fresh kernel function with the parameters of
    /// `super::llvm_params` for `kernel`; `smem` the module's dynamic shared array.
    pub unsafe fn new(
        ir: Ir,
        kernel: &'k Kernel,
        plan: Plan,
        warps: usize,
        stages: usize,
        smem: V,
        hopper: bool,
        aligned: Option<&HashMap<Value, Value>>,
        streams: &[(Value, Value)],
    ) -> Lowering<'k> {
        let null = std::ptr::null_mut();
        let du = DefUse::new(kernel);
        let dot_only = du.values_used_only_as(super::wgmma_operand);
        // `hopper`: `super::wgmma_applies` (warpgroups, 64-row blocks of block_m rows).
        let wgmma = hopper;
        Lowering {
            du,
            ir,
            kernel,
            plan,
            warps,
            vals: vec![None; kernel.values.len()],
            tensors: Vec::new(),
            pid: [null; 3],
            warp: null,
            lane: null,
            smem,
            smem_top: 0,
            smem_peak: 0,
            stages: stages.max(1),
            depth: 0,
            loop_values: Vec::new(),
            prefetch: HashMap::new(),
            regions: HashMap::new(),
            wgmma,
            dot_only,
            assume_aligned: aligned.is_some(),
            aligned_tensors: Default::default(),
            scaled_softmax: aligned.cloned().unwrap_or_default(),
            covered: false,
            pending_afrags: Vec::new(),
            wg_pending: Vec::new(),
            wg_seq: 0,
            early_prologues: HashMap::new(),
            stream_next: streams.iter().map(|(epi, in_loop)| (*in_loop, *epi)).collect(),
            epilogue_tiles: HashMap::new(),
            ws: None,
            producer: false,
            pingpong: None,
        }
    }

    /// Make this a warp-specialised entry (see [`WsLowering`]).
    pub fn with_ws(mut self, ws: Option<WsLowering>) -> Self {
        self.ws = ws;
        self
    }

    /// A block barrier over the consumer threads (all threads without warp
    /// specialisation).
    fn sync(&self) {
        match &self.ws {
            Some(_) => nvvm::barrier_named(&self.ir, 1, self.warps * 32),
            None => nvvm::barrier(&self.ir),
        }
    }

    /// Whether load `v` is one the producer copies (TMA), and its index.
    fn tma_index(&self, v: Value) -> Option<usize> {
        self.ws.as_ref().and_then(|w| w.tma.iter().position(|t| t.load == v))
    }

    /// The (full, empty) mbarriers of TMA load `li`, ring slot `slot` (i32): shared
    /// addresses (i32).
    fn tma_bars(&self, li: usize, slot: V) -> (V, V) {
        let n = self.ws.as_ref().map(|w| w.tma.len()).unwrap_or(0);
        let st = self.stages as i64;
        let ir = &self.ir;
        let base = ir.ptr_to_int(self.sptr(ir.ci32(0)), ir.i32());
        let full = ir.add(base, ir.mul(ir.add(ir.ci32(li as i64 * st), slot), ir.ci32(8)));
        let empty = ir.add(base, ir.mul(ir.add(ir.ci32((n + li) as i64 * st), slot), ir.ci32(8)));
        (full, empty)
    }

    /// The shared-memory layout of load `v`'s tile: one of wgmma's when only dots read
    /// it on the Hopper path.
    fn smem_layout(&self, v: Value, cols: usize, dtype: DType) -> SmemLayout {
        Smem::layout_for(cols, dtype, self.wgmma && self.dot_only.contains(&v))
    }

    /// Row (i32, within the tile) of the first of the 16 rows of m-fragment `mf` of this
    /// warp, for tiles of `rows` rows.
    fn mfrag_row0(&self, rows: usize, mf: usize) -> V {
        let ir = &self.ir;
        if self.wgmma {
            let groups = self.warps / 4;
            let g = ir.lshr(self.warp, ir.ci32(2));
            let wi = ir.and(self.warp, ir.ci32(3));
            let block = ir.add(ir.ci32((mf * groups) as i64), g);
            ir.add(ir.mul(block, ir.ci32(64)), ir.mul(wi, ir.ci32(16)))
        } else {
            let per_warp = rows / self.warps;
            ir.add(ir.mul(self.warp, ir.ci32(per_warp as i64)), ir.ci32((mf * 16) as i64))
        }
    }

    fn err(&self, what: String) -> CodegenError {
        unsupported(self.kernel, what)
    }

    fn arith(&self) -> Arith<'_> {
        Arith { ir: &self.ir, soft_f16: false, soft_bf16: false }
    }

    fn ty(&self, v: Value) -> &'k Type {
        self.kernel.ty(v)
    }

    fn compute_ty(&self, d: DType) -> T {
        self.arith().compute_ty(d)
    }

    fn storage_ty(&self, d: DType) -> T {
        match d {
            DType::I1 => self.ir.i8(),
            other => self.compute_ty(other),
        }
    }

    // ---------------------------------------------------------------- entry

    pub fn run(mut self) -> R<PtxCode> {
        let entry = self.ir.block("entry");
        self.ir.at_end(entry);
        let mut pi = 0u32;
        for p in &self.kernel.params {
            match &p.ty {
                Type::Tensor(d, rank) => {
                    let data = self.ir.param(pi);
                    let shape = (0..*rank).map(|a| self.ir.param(pi + 1 + a as u32)).collect();
                    let strides = (0..*rank).map(|a| self.ir.param(pi + 1 + (*rank + a) as u32)).collect();
                    pi += 1 + 2 * *rank as u32;
                    self.vals[p.value.index()] = Some(GV::Tensor(self.tensors.len()));
                    self.tensors.push(TensorInfo { data, shape, strides, dtype: *d });
                }
                Type::Scalar(d) => {
                    let raw = self.ir.param(pi);
                    pi += 1;
                    let v = match d {
                        DType::I1 => self.ir.icmp(LLVMIntNE, raw, self.ir.ci32(0)),
                        DType::F32 | DType::I32 | DType::U32 => raw,
                        other => return Err(self.err(format!("scalar parameters of type {other} are not supported"))),
                    };
                    self.vals[p.value.index()] = Some(GV::Scalar(v));
                }
                Type::Tile(..) => return Err(self.err("tile parameters".into())),
            }
        }
        let ir = &self.ir;
        let tid = nvvm::tid_x(ir);
        self.warp = ir.lshr(tid, ir.ci32(5));
        self.lane = ir.and(tid, ir.ci32(31));
        self.pid = [nvvm::ctaid(ir, 0), nvvm::ctaid(ir, 1), nvvm::ctaid(ir, 2)];
        let body = &self.kernel.body;
        if let Some(ws) = self.ws.clone() {
            self.run_ws(&ws, pi, tid)?;
        } else {
            self.block(body)?;
            self.wg_resolve_all()?;
            self.ir.ret_void();
        }
        let names: Vec<String> =
            self.kernel.params.iter().filter(|p| matches!(p.ty, Type::Tensor(..))).map(|p| p.name.clone()).collect();
        Ok(PtxCode {
            entry: self.kernel.name.clone(),
            smem_bytes: self.smem_peak.max(self.smem_top),
            threads: (self.warps + self.ws.as_ref().map_or(0, |w| w.producer_warps)) * 32,
            aligned_tensors: self.aligned_tensors.iter().map(|t| names[*t].clone()).collect(),
            aligned_entry: None,
            positive_scalars: Vec::new(),
            tensor_maps: self.ws.as_ref().map(|w| w.tma.clone()).unwrap_or_default(),
        })
    }

    /// The warp-specialised entry: barriers, then the consumers' program (the kernel)
    /// and the producer's (see [`super::ws`]). `pi`: the first parameter after the
    /// ABI's (the tensor maps).
    fn run_ws(&mut self, ws: &WsLowering, pi: u32, tid: V) -> R<()> {
        let body = &self.kernel.body;
        let tmaps: Vec<V> = (0..ws.tma.len()).map(|i| self.ir.param(pi + i as u32)).collect();
        if !ws.tma.is_empty() {
            // The mbarriers (full and empty, per load and ring slot) at the bottom of
            // shared memory, initialised by one thread before anyone uses them.
            let bytes = 16 * ws.tma.len() * self.stages;
            self.smem_top = bytes;
            self.smem_peak = bytes;
            let first = self.ir.icmp(LLVMIntEQ, tid, self.ir.ci32(0));
            let n = ws.tma.len();
            let consumers = self.warps * 32;
            self.if_then(first, &mut |cg| {
                for li in 0..n {
                    for slot in 0..cg.stages {
                        let (full, empty) = cg.tma_bars(li, cg.ir.ci32(slot as i64));
                        nvvm::mbarrier_init(&cg.ir, full, 1);
                        nvvm::mbarrier_init(&cg.ir, empty, consumers);
                    }
                }
                nvvm::mbarrier_init_fence(&cg.ir);
                Ok(())
            })?;
            nvvm::barrier(&self.ir);
            // The rings first, below everything else: the producer starts copying at
            // once, so no tile of the consumers may ever share their memory.
            for t in &ws.tma {
                let op = self.du.def(t.load).ok_or_else(|| self.err("a TMA load is not in the kernel".into()))?;
                let tmpl = Smem::new(t.rows, t.cols, t.dtype, SmemLayout::Swizzle128, self.ir.ci32(0));
                let stride = tmpl.bytes().div_ceil(tmpl.align()) * tmpl.align();
                self.region(op, 0, stride * self.stages, tmpl.align());
            }
        }
        let params: Vec<Option<GV>> = self.vals.clone();
        let pb = self.ir.block("producer");
        let cb = self.ir.block("consumer");
        let is_producer = self.ir.icmp(LLVMIntUGE, self.warp, self.ir.ci32(self.warps as i64));
        self.ir.cond_br(is_producer, pb, cb);
        // ---- consumers: the kernel
        self.ir.at_end(cb);
        if let Some((more, _)) = ws.regs {
            nvvm::setmaxnreg(&self.ir, more, true);
        }
        self.block(body)?;
        self.wg_resolve_all()?;
        self.ir.ret_void();
        // ---- producer: one thread issues the copies of the loops' tiles
        self.ir.at_end(pb);
        if let Some((_, fewer)) = ws.regs {
            nvvm::setmaxnreg(&self.ir, fewer, false);
        }
        if !ws.tma.is_empty() {
            self.vals = params;
            self.producer = true;
            let elected = self.ir.icmp(LLVMIntEQ, tid, self.ir.ci32((self.warps * 32) as i64));
            self.if_then(elected, &mut |cg| cg.producer_block(body, &tmaps))?;
            self.producer = false;
        }
        self.ir.ret_void();
        Ok(())
    }

    /// The producer's share of block `b`: the scalars (loop bounds, tile indices) and
    /// the loops' copies.
    fn producer_block(&mut self, b: &'k Block, tmaps: &[V]) -> R<()> {
        for op in &b.ops {
            let scalar_results = op.results.iter().all(|r| matches!(self.ty(*r), Type::Scalar(_)));
            match &op.kind {
                OpKind::ProgramId { .. } | OpKind::TensorDim { .. } | OpKind::Const { .. } => self.op(op)?,
                OpKind::Binary(_) | OpKind::Unary(_) | OpKind::Cmp(_) | OpKind::Select | OpKind::Cast { .. }
                    if scalar_results =>
                {
                    self.op(op)?
                }
                OpKind::Load { axes, .. } if axes.iter().all(|a| matches!(a, AxisIndex::Index)) => self.op(op)?,
                OpKind::For => self.producer_for(op, tmaps)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// The producer's loop for `op`: for each iteration and TMA load, wait until the
    /// consumers are done with the ring slot, then copy the iteration's tile into it.
    fn producer_for(&mut self, op: &'k Op, tmaps: &[V]) -> R<()> {
        let loads: Vec<(&'k Op, usize)> =
            self.prefetchable(op).into_iter().filter_map(|o| self.tma_index(o.results[0]).map(|i| (o, i))).collect();
        if loads.is_empty() {
            return Ok(());
        }
        let tma = self.ws.as_ref().map(|w| w.tma.clone()).unwrap_or_default();
        let lo = self.scalar(op.operands[0])?;
        let hi = self.scalar(op.operands[1])?;
        let step = self.scalar(op.operands[2])?;
        let iv_value = op.regions[0].args[0];
        let st = self.stages as i64;
        let mut infos = Vec::new();
        let mut top = hi;
        for (o, li) in &loads {
            let t = &tma[*li];
            let tmpl = Smem::new(t.rows, t.cols, t.dtype, SmemLayout::Swizzle128, self.ir.ci32(0));
            let stride = tmpl.bytes().div_ceil(tmpl.align()) * tmpl.align();
            let base = *self.regions.get(&(*o as *const Op as usize, 0)).ok_or_else(|| {
                self.err(format!("producer: the ring of load %{} was not allocated", o.results[0].index()))
            })?;
            let lhi = if self.stream_next.contains_key(&o.results[0]) { self.ir.add(hi, step) } else { hi };
            top = self.ir.select(self.ir.icmp(LLVMIntSLT, top, lhi), lhi, top);
            infos.push((*o, *li, base, stride, lhi));
        }
        let pre = self.ir.current();
        let head = self.ir.block("prod.head");
        let body = self.ir.block("prod.body");
        let exit = self.ir.block("prod.exit");
        self.ir.br(head);
        self.ir.at_end(head);
        let iv = self.ir.phi(self.ir.i32());
        self.ir.add_incoming(iv, lo, pre);
        let counter = self.ir.phi(self.ir.i32());
        self.ir.add_incoming(counter, self.ir.ci32(0), pre);
        self.ir.cond_br(self.ir.icmp(LLVMIntSLT, iv, top), body, exit);
        self.ir.at_end(body);
        let slot = self.ir.urem(counter, self.ir.ci32(st));
        let phase = self.ir.and(self.ir.udiv(counter, self.ir.ci32(st)), self.ir.ci32(1));
        for (o, li, base, stride, lhi) in infos {
            let t = tma[li].clone();
            let tmap = tmaps[li];
            let more = self.ir.icmp(LLVMIntSLT, iv, lhi);
            self.if_then(more, &mut |cg| {
                let (full, empty) = cg.tma_bars(li, slot);
                let ir = &cg.ir;
                nvvm::mbarrier_wait(ir, empty, ir.xor(phase, ir.ci32(1)));
                nvvm::mbarrier_arrive_expect_tx(ir, full, t.bytes());
                let acc = cg.load_access(o, Some((iv_value, iv)))?;
                let ir = &cg.ir;
                let buf = ir.add(ir.ci32(base as i64), ir.mul(slot, ir.ci32(stride as i64)));
                // Innermost axis first.
                let mut coords: Vec<V> = acc.coords.iter().rev().copied().collect();
                let col0 = coords[0];
                for c in 0..t.cols / 64 {
                    coords[0] = ir.add(col0, ir.ci32((c * 64) as i64));
                    let dst = ir.add(buf, ir.ci32((c * t.rows * 128) as i64));
                    let dst = ir.ptr_to_int(cg.sptr(dst), ir.i32());
                    nvvm::tma_load(ir, dst, tmap, &coords, full);
                }
                Ok(())
            })?;
        }
        let latch = self.ir.current();
        self.ir.add_incoming(iv, self.ir.add(iv, step), latch);
        self.ir.add_incoming(counter, self.ir.add(counter, self.ir.ci32(1)), latch);
        self.ir.br(head);
        self.ir.at_end(exit);
        Ok(())
    }

    fn block(&mut self, b: &'k Block) -> R<()> {
        let first_seq = self.wg_seq;
        let mut done = HashSet::new();
        for (i, op) in b.ops.iter().enumerate() {
            if done.contains(&i) {
                continue;
            }
            if let Some(j) = self.loop_after(b, i) {
                // The copies of the loop's first tiles start before this op (the
                // prologue of `pipeline-dots`, which computes the loop's first carried
                // values): both wait for memory at once. The scalar ops between give the
                // loop's bounds.
                for k in i + 1..j {
                    self.op(&b.ops[k])?;
                    done.insert(k);
                }
                let pro = self.for_prologue(&b.ops[j])?;
                self.early_prologues.insert(&b.ops[j] as *const Op as usize, pro);
            }
            if matches!(op.kind, OpKind::Yield) {
                // A region hands on final values, and leaves no product of its own in
                // flight (a loop's back edge, an `if`'s join).
                self.wg_resolve(&op.operands)?;
                if self.wg_pending.iter().any(|(seq, _)| *seq >= first_seq) {
                    self.wg_resolve_all()?;
                }
                continue;
            }
            self.wg_before(op)?;
            self.op(op)?;
        }
        Ok(())
    }

    fn set(&mut self, v: Value, g: GV) {
        self.vals[v.index()] = Some(g);
    }

    fn get(&self, v: Value) -> R<&GV> {
        self.vals[v.index()].as_ref().ok_or_else(|| self.err(format!("%{} used before it is defined", v.index())))
    }

    fn scalar(&self, v: Value) -> R<V> {
        match self.get(v)? {
            GV::Scalar(x) => Ok(*x),
            _ => Err(self.err(format!("%{} is not a scalar", v.index()))),
        }
    }

    fn tensor_of(&self, v: Value) -> R<usize> {
        match self.get(v)? {
            GV::Tensor(t) => Ok(*t),
            _ => Err(self.err(format!("%{} is not a tensor parameter", v.index()))),
        }
    }

    // ---------------------------------------------------------------- layouts

    /// The register layout of tile `v`.
    fn axes_of(&self, v: Value) -> R<(Ax, Ax)> {
        let Type::Tile(_, shape) = self.ty(v) else {
            return Err(self.err(format!("%{} is not a tile", v.index())));
        };
        let ax = |n: usize| if n == 1 { Ax::One } else { Ax::Mma(n) };
        let (rows, cols) = match shape.len() {
            2 => (ax(shape[0]), ax(shape[1])),
            1 => match self.plan.orient.get(&v).copied().unwrap_or(Orient::Rows) {
                Orient::Rows => (ax(shape[0]), Ax::One),
                Orient::Cols => (Ax::One, ax(shape[0])),
            },
            _ => return Err(self.err(format!("tiles of rank {} are not supported", shape.len()))),
        };
        if let Ax::Mma(r) = rows {
            if r % (16 * self.warps) != 0 {
                return Err(self.err(format!(
                    "a register tile of {r} rows needs a multiple of 16 × num_warps = {} rows (tile %{})",
                    16 * self.warps,
                    v.index()
                )));
            }
        }
        if let Ax::Mma(c) = cols {
            if c % 8 != 0 {
                return Err(
                    self.err(format!("a register tile of {c} columns needs a multiple of 8 (tile %{})", v.index()))
                );
            }
        }
        Ok((rows, cols))
    }

    fn nrows(&self, a: Ax) -> usize {
        match a {
            Ax::One => 1,
            Ax::Mma(r) => 2 * r / (16 * self.warps),
        }
    }

    fn ncols(a: Ax) -> usize {
        match a {
            Ax::One => 1,
            Ax::Mma(c) => c / 4,
        }
    }

    /// Row index (i32, within the tile) of each of the thread's row slots.
    fn row_coords(&self, a: Ax) -> Vec<V> {
        let ir = &self.ir;
        match a {
            Ax::One => vec![ir.ci32(0)],
            Ax::Mma(r) => {
                let per_warp = r / self.warps;
                let quad = ir.lshr(self.lane, ir.ci32(2));
                let mut out = Vec::new();
                for mf in 0..per_warp / 16 {
                    let base = self.ir.add(self.mfrag_row0(r, mf), quad);
                    for h in 0..2 {
                        out.push(self.ir.add(base, self.ir.ci32((h * 8) as i64)));
                    }
                }
                out
            }
        }
    }

    /// Column index (i32) of each of the thread's column slots.
    fn col_coords(&self, a: Ax) -> Vec<V> {
        let ir = &self.ir;
        match a {
            Ax::One => vec![ir.ci32(0)],
            Ax::Mma(c) => {
                let base = Self::col_base(ir, self.lane);
                Self::col_offsets(c).into_iter().map(|o| ir.add(base, ir.ci32(o))).collect()
            }
        }
    }

    /// The thread's first column in the accumulator layout (i32): `(lane % 4) · 2`.
    fn col_base(ir: &Ir, lane: V) -> V {
        ir.shl(ir.and(lane, ir.ci32(3)), ir.ci32(1))
    }

    /// Column slots of an `Ax::Mma(c)` axis, as offsets from [`Self::col_base`]: two
    /// adjacent columns in every 8-column group.
    fn col_offsets(c: usize) -> Vec<i64> {
        (0..c / 8).flat_map(|nf| [nf * 8, nf * 8 + 1]).map(|o| o as i64).collect()
    }

    /// Tile `v` in registers (shared-memory tiles are read out).
    fn dist(&mut self, v: Value) -> R<Dist> {
        match self.get(v)?.clone() {
            GV::Dist(d) => Ok(d),
            GV::Smem(s) => {
                let d = self.smem_to_dist(v, &s)?;
                Ok(d)
            }
            GV::Lazy => {
                let first = self.plan.orient.get(&v).copied().unwrap_or(Orient::Rows);
                let other = if first == Orient::Rows { Orient::Cols } else { Orient::Rows };
                match self.remat(v, first) {
                    Ok(d) => Ok(d),
                    Err(_) => self.remat(v, other),
                }
            }
            // A scalar broadcasts like a 1 × 1 tile.
            GV::Scalar(x) => Ok(Dist { rows: Ax::One, cols: Ax::One, e: vec![x] }),
            GV::Tensor(_) => Err(self.err(format!("tensor %{} used as a tile", v.index()))),
        }
    }

    /// Rank-1 tile `v` along `o` (rows or columns), computed again if it was built
    /// along the other axis (only rematerialisable tiles can be).
    fn dist_oriented(&mut self, v: Value, o: Orient) -> R<Dist> {
        if matches!(self.get(v)?, GV::Lazy) {
            return self.remat(v, o);
        }
        let d = self.dist(v)?;
        let is_rank1 = matches!(self.ty(v), Type::Tile(_, s) if s.len() == 1);
        let along = if d.rows == Ax::One && d.cols != Ax::One { Orient::Cols } else { Orient::Rows };
        let single = d.rows == Ax::One && d.cols == Ax::One;
        if !is_rank1 || single || along == o {
            return Ok(d);
        }
        if !self.plan.remat.contains(&v) {
            return Err(self.err(format!("rank-1 tile %{} is needed along both axes", v.index())));
        }
        self.remat(v, o)
    }

    fn oriented_axes(&self, v: Value, o: Orient) -> R<(Ax, Ax)> {
        let Type::Tile(_, shape) = self.ty(v) else { return Err(self.err("not a tile".into())) };
        let n = shape[0];
        let a = if n == 1 { Ax::One } else { Ax::Mma(n) };
        Ok(match o {
            Orient::Rows => (a, Ax::One),
            Orient::Cols => (Ax::One, a),
        })
    }

    /// Build rematerialisable rank-1 tile `v` along `o` (recursively).
    fn remat(&mut self, v: Value, o: Orient) -> R<Dist> {
        let op = self.du.def(v).ok_or_else(|| self.err(format!("%{} has no definition", v.index())))?;
        let (rows, cols) = self.oriented_axes(v, o)?;
        match &op.kind {
            OpKind::Arange { .. } => {
                let e = if o == Orient::Cols { self.col_coords(cols) } else { self.row_coords(rows) };
                Ok(Dist { rows, cols, e })
            }
            OpKind::Splat { .. } => {
                let x = self.scalar(op.operands[0])?;
                let n = self.nrows(rows) * Self::ncols(cols);
                Ok(Dist { rows, cols, e: vec![x; n] })
            }
            _ => {
                let dtypes: Vec<DType> = op.operands.iter().map(|x| self.ty(*x).dtype()).collect();
                let dtypes = if matches!(op.kind, OpKind::Select) { dtypes[1..].to_vec() } else { dtypes };
                let mut ins = Vec::new();
                for x in &op.operands {
                    ins.push(if matches!(self.ty(*x), Type::Scalar(_)) { self.dist(*x)? } else { self.remat(*x, o)? });
                }
                let (nr, nc) = (self.nrows(rows), Self::ncols(cols));
                let mut e = Vec::new();
                for ri in 0..nr {
                    for ci in 0..nc {
                        let xs: Vec<V> = ins.iter().map(|d| Self::elem(d, ri, ci, nc)).collect();
                        e.push(self.elem_op(&op.kind, &dtypes, &xs));
                    }
                }
                Ok(Dist { rows, cols, e })
            }
        }
    }

    fn elem(d: &Dist, ri: usize, ci: usize, ncols: usize) -> V {
        let r = if d.rows == Ax::One { 0 } else { ri };
        let c = if d.cols == Ax::One { 0 } else { ci };
        let _ = ncols;
        d.e[r * Self::ncols(d.cols) + c]
    }

    // ---------------------------------------------------------------- ops

    fn op(&mut self, op: &'k Op) -> R<()> {
        let res = |i: usize| op.results[i];
        if op.results.len() == 1 && self.plan.remat.contains(&op.results[0]) {
            self.set(op.results[0], GV::Lazy);
            return Ok(());
        }
        match &op.kind {
            OpKind::ProgramId { axis } => {
                let p = self.pid[*axis as usize];
                self.set(res(0), GV::Scalar(p));
            }
            OpKind::TensorDim { axis } => {
                let t = self.tensor_of(op.operands[0])?;
                let d =
                    self.tensors[t].shape.get(*axis as usize).copied().ok_or_else(|| self.err("bad axis".into()))?;
                let v = self.ir.trunc(d, self.ir.i32());
                self.set(res(0), GV::Scalar(v));
            }
            OpKind::Const { value, dtype } => {
                let v = self.constant(*value, *dtype);
                self.set(res(0), GV::Scalar(v));
            }
            OpKind::Load { axes, pad } => self.load(op, axes, *pad)?,
            OpKind::Store { axes } => self.store(op, axes)?,
            OpKind::Binary(_) | OpKind::Unary(_) | OpKind::Cmp(_) | OpKind::Select | OpKind::Cast { .. } => {
                self.elementwise(op)?
            }
            OpKind::Splat { .. } => {
                let x = self.scalar(op.operands[0])?;
                let (rows, cols) = self.axes_of(res(0))?;
                let n = self.nrows(rows) * Self::ncols(cols);
                self.set(res(0), GV::Dist(Dist { rows, cols, e: vec![x; n] }));
            }
            OpKind::Arange { .. } => {
                let (rows, cols) = self.axes_of(res(0))?;
                let e = if rows == Ax::One { self.col_coords(cols) } else { self.row_coords(rows) };
                self.set(res(0), GV::Dist(Dist { rows, cols, e }));
            }
            OpKind::ExpandDims { axis } => {
                let d = self.dist_oriented(op.operands[0], if *axis == 1 { Orient::Rows } else { Orient::Cols })?;
                let (rows, cols) = self.axes_of(res(0))?;
                if (rows, cols) != (d.rows, d.cols) {
                    return Err(self.err(format!("expand_dims of %{} changes its layout", op.operands[0].index())));
                }
                self.set(res(0), GV::Dist(d));
            }
            OpKind::Broadcast { .. } => {
                let d = self.dist(op.operands[0])?;
                let (rows, cols) = self.axes_of(res(0))?;
                let (nr, nc) = (self.nrows(rows), Self::ncols(cols));
                let mut e = Vec::with_capacity(nr * nc);
                for ri in 0..nr {
                    for ci in 0..nc {
                        e.push(Self::elem(&d, ri, ci, nc));
                    }
                }
                self.set(res(0), GV::Dist(Dist { rows, cols, e }));
            }
            OpKind::Reduce { op: r, axis } => self.reduce(op, *r, *axis)?,
            OpKind::Dot { trans_a, trans_b } => {
                let me = op as *const Op as usize;
                let g = self.ir.lshr(self.warp, self.ir.ci32(2));
                if let Some((first, _, _)) = self.pingpong.filter(|p| p.0 == me) {
                    // My turn to issue: the other warpgroup has issued its products.
                    let _ = first;
                    let id = self.ir.add(self.ir.ci32(2), g);
                    self.ir.call_intrinsic(
                        "llvm.nvvm.barrier.cta.sync.aligned.count",
                        &[],
                        &[id, self.ir.ci32((self.warps * 32) as i64)],
                    );
                }
                self.dot(op, *trans_a, *trans_b)?;
                if let Some((_, _, last)) = self.pingpong.filter(|p| p.1 == me) {
                    // Its turn: warpgroup 1 skips this on the last iteration (warpgroup 0
                    // was let go once before the loop).
                    let other = self.ir.sub(self.ir.ci32(3), g);
                    let skip = self.ir.and(self.ir.icmp(LLVMIntEQ, g, self.ir.ci32(1)), last);
                    let n = self.ir.ci32((self.warps * 32) as i64);
                    let go = self.ir.xor(skip, self.ir.ctrue());
                    self.if_then(go, &mut |cg| {
                        cg.ir.call_intrinsic("llvm.nvvm.barrier.cta.arrive.aligned.count", &[], &[other, n]);
                        Ok(())
                    })?;
                }
            }
            OpKind::SoftmaxUpdate => self.softmax_update(op)?,
            OpKind::SoftmaxRescale => {
                let acc = self.dist(op.operands[0])?;
                let alpha = self.dist(op.operands[1])?;
                let nc = Self::ncols(acc.cols);
                let mut e = Vec::with_capacity(acc.e.len());
                for ri in 0..self.nrows(acc.rows) {
                    let a = Self::elem(&alpha, ri, 0, 1);
                    for ci in 0..nc {
                        e.push(self.ir.fmul(Self::elem(&acc, ri, ci, nc), a));
                    }
                }
                self.set(res(0), GV::Dist(Dist { rows: acc.rows, cols: acc.cols, e }));
            }
            OpKind::SoftmaxFinalize => self.softmax_finalize(op)?,
            OpKind::RandUniform { .. } => self.rand_uniform(op)?,
            OpKind::For => self.for_op(op)?,
            OpKind::If => self.if_op(op)?,
            OpKind::Yield => {}
            other => {
                return Err(self.err(format!(
                    "`{}` is not supported (the pass pipeline lowers mask ops before code generation)",
                    other.name()
                )))
            }
        }
        Ok(())
    }

    fn constant(&self, value: f64, dtype: DType) -> V {
        let ir = &self.ir;
        match dtype {
            DType::F32 | DType::F64 => ir.cf32(value),
            DType::BF16 => ir.cfloat(ir.bf16(), value),
            DType::F16 => ir.cfloat(ir.f16(), value),
            DType::I32 => ir.ci32(value as i64),
            DType::U32 => ir.ci32(value as i64 as u32 as i64),
            DType::I1 => {
                if value != 0.0 {
                    ir.ctrue()
                } else {
                    ir.cfalse()
                }
            }
        }
    }

    /// One element of an element-wise op, with the interpreter's semantics.
    fn elem_op(&self, kind: &OpKind, dtypes: &[DType], xs: &[V]) -> V {
        let a = self.arith();
        match kind {
            OpKind::Binary(b) => a.binary(*b, dtypes[0], xs[0], xs[1]),
            OpKind::Unary(u) => a.unary(*u, dtypes[0], xs[0]),
            OpKind::Cmp(p) => a.compare(*p, dtypes[0], xs[0], xs[1]),
            OpKind::Select => self.ir.select(xs[0], xs[1], xs[2]),
            OpKind::Cast { to } => a.cast(xs[0], dtypes[0], *to),
            _ => self.ir.poison(self.ir.f32()),
        }
    }

    fn elementwise(&mut self, op: &'k Op) -> R<()> {
        let r = op.results[0];
        let dtypes: Vec<DType> = op.operands.iter().map(|o| self.ty(*o).dtype()).collect();
        let dtypes: Vec<DType> = if matches!(op.kind, OpKind::Select) { dtypes[1..].to_vec() } else { dtypes };
        if matches!(self.ty(r), Type::Scalar(_)) {
            let xs: Vec<V> = op.operands.iter().map(|o| self.scalar(*o)).collect::<R<_>>()?;
            let v = self.elem_op(&op.kind, &dtypes, &xs);
            self.set(r, GV::Scalar(v));
            return Ok(());
        }
        let (rows, cols) = self.axes_of(r)?;
        let want = if rows == Ax::One && cols != Ax::One { Orient::Cols } else { Orient::Rows };
        let mut ins = Vec::new();
        for o in &op.operands {
            ins.push(self.dist_oriented(*o, want)?);
        }
        let (nr, nc) = (self.nrows(rows), Self::ncols(cols));
        let mut e = Vec::with_capacity(nr * nc);
        for ri in 0..nr {
            for ci in 0..nc {
                let xs: Vec<V> = ins.iter().map(|d| Self::elem(d, ri, ci, nc)).collect();
                e.push(self.elem_op(&op.kind, &dtypes, &xs));
            }
        }
        self.set(r, GV::Dist(Dist { rows, cols, e }));
        Ok(())
    }

    // ---------------------------------------------------------------- memory

    /// Per tile axis: (tensor axis, start i32, limit, size); plus the fixed-index
    /// byte offset (i64) and its validity.
    fn access(&self, t: usize, axes: &[AxisIndex], operands: &[Value]) -> R<Access> {
        self.access_subst(t, axes, operands, None)
    }

    /// The access of load `op`, with scalar `subst.0` replaced by `subst.1` (a loop's
    /// induction variable by a later iteration's).
    fn load_access(&self, op: &Op, subst: Option<(Value, V)>) -> R<Access> {
        let OpKind::Load { axes, .. } = &op.kind else { return Err(self.err("not a load".into())) };
        let t = self.tensor_of(op.operands[0])?;
        self.access_subst(t, axes, &op.operands[1..], subst)
    }

    fn access_subst(&self, t: usize, axes: &[AxisIndex], operands: &[Value], subst: Option<(Value, V)>) -> R<Access> {
        let ir = &self.ir;
        let info = &self.tensors[t];
        let scalar = |v: Value| -> R<V> {
            match subst {
                Some((from, to)) => self.scalar_at(v, from, to),
                None => self.scalar(v),
            }
        };
        let mut it = operands.iter();
        let mut off = ir.ci64(0);
        let mut valid = ir.ctrue();
        let mut ranges = Vec::new();
        let mut coords = Vec::new();
        for (ta, a) in axes.iter().enumerate() {
            let first = *it.next().ok_or_else(|| self.err("missing index operand".into()))?;
            let x = scalar(first)?;
            coords.push(x);
            let x64 = ir.sext(x, ir.i64());
            match a {
                AxisIndex::Index => {
                    let ok = ir.and(ir.icmp(LLVMIntSGE, x64, ir.ci64(0)), ir.icmp(LLVMIntSLT, x64, info.shape[ta]));
                    valid = ir.and(valid, ok);
                    off = ir.add(off, ir.mul(x64, info.strides[ta]));
                }
                AxisIndex::Range { size, limit } => {
                    let l = if *limit {
                        let lv = *it.next().ok_or_else(|| self.err("missing limit operand".into()))?;
                        Some(ir.sext(scalar(lv)?, ir.i64()))
                    } else {
                        None
                    };
                    ranges.push(RangeAx { axis: ta, start: x64, limit: l, size: *size });
                }
            }
        }
        Ok(Access { off, valid, ranges, coords })
    }

    /// Scalar `v` with the scalar `from` (a loop's induction variable) replaced by
    /// `to`: scalar arithmetic between them is computed again (a load of block `j + s`
    /// after `pipeline-dots`, issued iterations ahead).
    fn scalar_at(&self, v: Value, from: Value, to: V) -> R<V> {
        if v == from {
            return Ok(to);
        }
        let op = self.du.def(v);
        let lowered = self.vals[v.index()].is_some();
        if lowered && !self.scalar_depends_on(v, from) {
            return self.scalar(v);
        }
        match op.map(|o| &o.kind) {
            Some(OpKind::Const { value, dtype }) => Ok(self.constant(*value, *dtype)),
            Some(
                kind @ (OpKind::Binary(_) | OpKind::Unary(_) | OpKind::Cmp(_) | OpKind::Select | OpKind::Cast { .. }),
            ) => {
                let op = op.expect("matched");
                let xs: Vec<V> = op.operands.iter().map(|x| self.scalar_at(*x, from, to)).collect::<R<_>>()?;
                let dtypes: Vec<DType> = op.operands.iter().map(|o| self.ty(*o).dtype()).collect();
                let dtypes = if matches!(kind, OpKind::Select) { dtypes[1..].to_vec() } else { dtypes };
                Ok(self.elem_op(kind, &dtypes, &xs))
            }
            _ => self.scalar(v),
        }
    }

    /// Whether scalar `v` is computed from `from` by scalar arithmetic.
    fn scalar_depends_on(&self, v: Value, from: Value) -> bool {
        if v == from {
            return true;
        }
        match self.du.def(v) {
            Some(op) if is_scalar_arith(op) && matches!(self.ty(v), Type::Scalar(_)) => {
                op.operands.iter().any(|x| self.scalar_depends_on(*x, from))
            }
            _ => false,
        }
    }

    /// Whether tensor index `x` (i64) is inside axis `ta` and under `limit`.
    fn in_range(&self, t: usize, ta: usize, x: V, limit: Option<V>) -> V {
        let ir = &self.ir;
        let ok = ir.and(ir.icmp(LLVMIntSGE, x, ir.ci64(0)), ir.icmp(LLVMIntSLT, x, self.tensors[t].shape[ta]));
        match limit {
            Some(l) => ir.and(ok, ir.icmp(LLVMIntSLT, x, l)),
            None => ok,
        }
    }

    /// `if cond { then() }` (no results).
    fn if_then(&mut self, cond: V, then: &mut dyn FnMut(&mut Self) -> R<()>) -> R<()> {
        let t = self.ir.block("then");
        let j = self.ir.block("join");
        self.ir.cond_br(cond, t, j);
        self.ir.at_end(t);
        then(self)?;
        self.ir.br(j);
        self.ir.at_end(j);
        Ok(())
    }

    /// Load element `idx` (i64 element offset) of tensor `t` if `ok`, else `pad`.
    fn load_elem(&mut self, t: usize, idx: V, ok: V, pad: V) -> V {
        let dtype = self.tensors[t].dtype;
        let st = self.storage_ty(dtype);
        let data = self.tensors[t].data;
        self.load_guarded(dtype, ok, pad, &|ir| ir.gep(st, data, idx))
    }

    /// Load a `dtype` element from the address `addr` builds (in the guarded block) if
    /// `ok`, else `pad`.
    fn load_guarded(&mut self, dtype: DType, ok: V, pad: V, addr: &dyn Fn(&Ir) -> V) -> V {
        let st = self.storage_ty(dtype);
        let pre = self.ir.current();
        let lb = self.ir.block("ld");
        let j = self.ir.block("ld.join");
        self.ir.cond_br(ok, lb, j);
        self.ir.at_end(lb);
        let raw = self.ir.load(st, addr(&self.ir), dtype.size_bytes() as u32);
        let x = if dtype == DType::I1 { self.ir.icmp(LLVMIntNE, raw, self.ir.cint(self.ir.i8(), 0)) } else { raw };
        let lend = self.ir.current();
        self.ir.br(j);
        self.ir.at_end(j);
        let phi = self.ir.phi(self.compute_ty(dtype));
        self.ir.add_incoming(phi, x, lend);
        self.ir.add_incoming(phi, pad, pre);
        phi
    }

    fn load(&mut self, op: &'k Op, axes: &[AxisIndex], pad: f64) -> R<()> {
        let r = op.results[0];
        let t = self.tensor_of(op.operands[0])?;
        let acc = self.access(t, axes, &op.operands[1..])?;
        let dtype = self.tensors[t].dtype;
        let padv = self.constant(pad, dtype);
        if acc.ranges.is_empty() {
            let x = self.load_elem(t, acc.off, acc.valid, padv);
            self.set(r, GV::Scalar(x));
            return Ok(());
        }
        if self.plan.smem_loads.contains(&r) {
            let s = self.load_smem(op, t, &acc, pad)?;
            self.set(r, GV::Smem(s));
            return Ok(());
        }
        // Straight into registers.
        let (rows, cols) = self.axes_of(r)?;
        // A tile at a loop's moving window (only its fixed indices change per iteration):
        // one pointer per row slot plus constant column offsets.
        if self.window_moves(axes, &op.operands[1..]) {
            let e = self.window_access(t, &acc, rows, cols, &mut |cg, _, p, ok| {
                Ok(Some(cg.load_guarded(dtype, ok, padv, &|_| p)))
            })?;
            self.set(r, GV::Dist(Dist { rows, cols, e }));
            return Ok(());
        }
        let e = match (rows, cols, dtype.size_bytes(), acc.ranges.len()) {
            (Ax::Mma(_), Ax::Mma(c), 4, 2) => self.load_rows_32bit(t, &acc, rows, c, padv),
            _ => self.load_elems(t, &acc, rows, cols, padv),
        };
        self.set(r, GV::Dist(Dist { rows, cols, e }));
        Ok(())
    }

    /// A register tile, one predicated load per element (row slot major).
    fn load_elems(&mut self, t: usize, acc: &Access, rows: Ax, cols: Ax, padv: V) -> Vec<V> {
        let (rcs, ccs) = (self.row_coords(rows), self.col_coords(cols));
        let mut e = Vec::new();
        for rc in &rcs {
            for cc in &ccs {
                let (idx, ok) = self.elem_address(t, acc, rows, *rc, *cc);
                e.push(self.load_elem(t, idx, ok, padv));
            }
        }
        e
    }

    /// A 2-D register tile of a 32-bit type (`c` columns), row by row when it can be.
    ///
    /// Element by element, each column slot has its own offset `(start + col) · stride`
    /// and bounds test, both invariant in a loop over the other axes, so LLVM hoists
    /// them out of it: two 64-bit values per column slot stay live across the loop,
    /// more registers than the tile itself at 128 columns (the split-KV combine, which
    /// reads each split's `[block_m, head_dim]` f32 output in a loop, spilled). When the
    /// columns are contiguous and all inside the tensor — checked at run time, once per
    /// load — a row slot needs one offset and one bounds test, and its elements sit at
    /// constant offsets from it. Otherwise the element path, kept from hoisting. Only
    /// 32-bit tiles take this path: the 16-bit and i1 register tiles of the flash
    /// kernels (bias, mask) keep the code they had.
    fn load_rows_32bit(&mut self, t: usize, acc: &Access, rows: Ax, c: usize, padv: V) -> Vec<V> {
        let (ra, ca) = (acc.ranges[0], acc.ranges[1]);
        let whole = self.whole_columns(t, ca, c);
        let ir = &self.ir;
        let (fast, slow, join) = (ir.block("ld.rows"), ir.block("ld.elems"), ir.block("ld.rows.join"));
        ir.cond_br(whole, fast, slow);

        self.ir.at_end(fast);
        let col0 = self.ir.add(ca.start, self.ir.sext(Self::col_base(&self.ir, self.lane), self.ir.i64()));
        let mut fast_e = Vec::new();
        for rc in self.row_coords(rows) {
            let ir = &self.ir;
            let row = ir.add(ra.start, ir.sext(rc, ir.i64()));
            let ok = ir.and(acc.valid, self.in_range(t, ra.axis, row, ra.limit));
            let first = ir.add(ir.add(acc.off, ir.mul(row, self.tensors[t].strides[ra.axis])), col0);
            for o in Self::col_offsets(c) {
                let idx = self.ir.add(first, self.ir.ci64(o));
                fast_e.push(self.load_elem(t, idx, ok, padv));
            }
        }
        let fast_end = self.ir.current();
        self.ir.br(join);

        self.ir.at_end(slow);
        // The element path, with the column start made opaque: its per-column values
        // are then recomputed at each use rather than hoisted (see above).
        let mut cols = ca;
        cols.start = nvvm::opaque_i64(&self.ir, ca.start);
        let slow_acc = Access { off: acc.off, valid: acc.valid, ranges: vec![ra, cols], coords: acc.coords.clone() };
        let slow_e = self.load_elems(t, &slow_acc, rows, Ax::Mma(c), padv);
        let slow_end = self.ir.current();
        self.ir.br(join);

        self.ir.at_end(join);
        let ty = self.compute_ty(self.tensors[t].dtype);
        fast_e
            .into_iter()
            .zip(slow_e)
            .map(|(a, b)| {
                let phi = self.ir.phi(ty);
                self.ir.add_incoming(phi, a, fast_end);
                self.ir.add_incoming(phi, b, slow_end);
                phi
            })
            .collect()
    }

    /// i1: the `c` columns of range `ca` of tensor `t` are contiguous (stride 1) and all
    /// inside the tensor (and under the range's limit).
    fn whole_columns(&self, t: usize, ca: RangeAx, c: usize) -> V {
        let ir = &self.ir;
        let info = &self.tensors[t];
        let end = ir.add(ca.start, ir.ci64(c as i64));
        let mut whole = ir.icmp(LLVMIntEQ, info.strides[ca.axis], ir.ci64(1));
        whole = ir.and(whole, ir.icmp(LLVMIntSGE, ca.start, ir.ci64(0)));
        whole = ir.and(whole, ir.icmp(LLVMIntSLE, end, info.shape[ca.axis]));
        match ca.limit {
            Some(l) => ir.and(whole, ir.icmp(LLVMIntSLE, end, l)),
            None => whole,
        }
    }

    /// A shared-memory region for (op, slot), allocated once, `align`-byte aligned.
    fn region(&mut self, op: &Op, slot: usize, bytes: usize, align: usize) -> usize {
        let key = (op as *const Op as usize, slot);
        if let Some(o) = self.regions.get(&key) {
            return *o;
        }
        let off = self.smem_top.div_ceil(align) * align;
        self.smem_top = off + bytes;
        self.smem_peak = self.smem_peak.max(self.smem_top);
        self.regions.insert(key, off);
        off
    }

    /// `ptr addrspace(3)` at byte `off` (i32) of the dynamic shared array.
    fn sptr(&self, off: V) -> V {
        self.ir.gep(self.ir.i8(), self.smem, self.ir.sext(off, self.ir.i64()))
    }

    fn smem_shape(&self, op: &Op, acc: &Access) -> R<(usize, usize, DType)> {
        let Type::Tile(dtype, shape) = self.ty(op.results[0]).clone() else {
            return Err(self.err("a shared-memory load must give a tile".into()));
        };
        if acc.ranges.len() != 2 || shape.len() != 2 {
            return Err(self.err("dot operands are loaded as 2-D tiles".into()));
        }
        if dtype.size_bytes() != 2 {
            return Err(self.err(format!(
                "dot operands must be bf16 or f16 on the PTX targets (got {dtype}); f32 attention runs on the CPU back end"
            )));
        }
        let (rows, cols) = (shape[0], shape[1]);
        if cols % 8 != 0 {
            return Err(self.err(format!("a dot operand tile needs a multiple of 8 columns (got [{rows}, {cols}])")));
        }
        Ok((rows, cols, dtype))
    }

    fn load_smem(&mut self, op: &'k Op, t: usize, acc: &Access, pad: f64) -> R<Smem> {
        if let Some((s, _, Some((full, parity)))) = self.epilogue_tiles.get(&op.results[0]).cloned() {
            // The producer copied it into the loop's ring.
            self.epilogue_tiles.remove(&op.results[0]);
            nvvm::mbarrier_wait(&self.ir, full, parity);
            return Ok(s);
        }
        if let Some((s, fast, _)) = self.epilogue_tiles.remove(&op.results[0]) {
            // The loop before copied this tile into its ring (cp.async path): make it
            // visible; otherwise copy it here, into the same buffer.
            let ub = self.ir.block("epi.ring");
            let fb = self.ir.block("epi.fill");
            let jb = self.ir.block("epi.done");
            self.ir.cond_br(fast, ub, fb);
            self.ir.at_end(ub);
            if s.wgmma_readable() {
                nvvm::fence_proxy_async(&self.ir);
            }
            self.sync();
            self.ir.br(jb);
            self.ir.at_end(fb);
            self.fill_smem(t, acc, &s, pad)?;
            self.ir.br(jb);
            self.ir.at_end(jb);
            return Ok(s);
        }
        let (rows, cols, dtype) = self.smem_shape(op, acc)?;
        let mut s = Smem::new(rows, cols, dtype, self.smem_layout(op.results[0], cols, dtype), self.ir.ci32(0));
        let key = op as *const Op as usize;
        if let Some(pf) = self.prefetch.get(&key).cloned() {
            s.off = self.pipelined_load(&pf, t, acc, &s, pad)?;
        } else {
            let off = self.region(op, 0, s.bytes(), s.align());
            s.off = self.ir.ci32(off as i64);
            let esize = s.dtype.size_bytes() as i64;
            if self.assume_aligned && self.depth == 0 && {
                let f = self.smem_fast(t, acc, esize, pad);
                self.ir.is_true(f)
            } {
                // The aligned entry copies a tile loaded before a loop (the query tile)
                // without waiting: the loop's first pipelined wait covers it, so its
                // latency overlaps the prologue's copies of the first key/value tiles.
                self.sync();
                self.issue_cp_async(t, acc, &s)?;
                nvvm::cp_async_commit(&self.ir);
                s.pending = true;
            } else {
                self.fill_smem(t, acc, &s, pad)?;
            }
        }
        // Keep an `a` tile in registers when it is small: one m-fragment per warp (the
        // query tile of attention with 16 rows per warp, like FlashAttention-2 with Q
        // in registers). With more rows per warp its fragments would crowd out the
        // accumulators, so it stays in shared memory and `ldmatrix` reads it per use.
        let per_warp_frags = rows / (16 * self.warps).max(1) * cols.div_ceil(16);
        if self.plan.a_only.contains(&op.results[0]) && per_warp_frags * 4 <= 32 && s.layout == SmemLayout::Padded {
            if s.pending && self.depth == 0 {
                // Read after the next loop's prologue (`for_op`); its shared
                // memory stays reserved (the loop's buffers must not reuse it while the
                // copy may still be landing).
                self.pending_afrags.push(op.results[0]);
                return Ok(s);
            }
            self.ready(&mut s);
            let frags = self.a_frags_from_smem(&s)?;
            s.afrags = Some(frags);
            if self.depth == 0 && !self.prefetch.contains_key(&key) {
                // The tile lives on in registers: its shared memory is free again once
                // every warp has read it.
                self.sync();
                if let Some(off) = self.regions.get(&(key, 0)) {
                    self.smem_top = self.smem_top.min(*off);
                }
            }
        }
        Ok(s)
    }

    /// Whether the tile of `acc` can be copied with 16-byte `cp.async`: unit stride on
    /// the column axis, rows a multiple of 8 elements apart, 16-byte aligned start,
    /// zero padding (i1, uniform).
    fn smem_fast(&mut self, t: usize, acc: &Access, esize: i64, pad: f64) -> V {
        let (ra, ca) = (acc.ranges[0], acc.ranges[1]);
        if pad == 0.0 {
            self.aligned_tensors.insert(t);
            if self.assume_aligned && esize >= 2 {
                // Aligned data and strides: the start is aligned when the first column
                // is (a constant in every kernel so far, so the test folds away).
                let ir = &self.ir;
                let col_bytes = ir.mul(ca.start, ir.ci64(esize));
                return ir.icmp(LLVMIntEQ, ir.and(col_bytes, ir.ci64(15)), ir.ci64(0));
            }
        }
        let strides = &self.tensors[t].strides;
        let ir = &self.ir;
        let data_i = ir.ptr_to_int(self.tensors[t].data, ir.i64());
        let start_elems =
            ir.add(ir.add(acc.off, ir.mul(ra.start, strides[ra.axis])), ir.mul(ca.start, strides[ca.axis]));
        let start_bytes = ir.add(data_i, ir.mul(start_elems, ir.ci64(esize)));
        let aligned = ir.icmp(LLVMIntEQ, ir.and(start_bytes, ir.ci64(15)), ir.ci64(0));
        let unit = ir.icmp(LLVMIntEQ, strides[ca.axis], ir.ci64(1));
        let rows8 = ir.icmp(LLVMIntEQ, ir.and(strides[ra.axis], ir.ci64(7)), ir.ci64(0));
        let fast = ir.and(ir.and(aligned, unit), rows8);
        if pad == 0.0 {
            fast
        } else {
            ir.cfalse()
        }
    }

    /// Issue the `cp.async` copies of the tile of `acc` into `s` (16 bytes per thread
    /// per step; chunks outside the tensor are zero-filled). No commit, no wait.
    fn issue_cp_async(&mut self, t: usize, acc: &Access, s: &Smem) -> R<()> {
        let (ra, ca) = (acc.ranges[0], acc.ranges[1]);
        let threads = self.warps * 32;
        let esize = s.dtype.size_bytes() as i64;
        let strides = self.tensors[t].strides.clone();
        let ir = &self.ir;
        let start_elems =
            ir.add(ir.add(acc.off, ir.mul(ra.start, strides[ra.axis])), ir.mul(ca.start, strides[ca.axis]));
        let per_chunk = 16 / esize as usize;
        let chunks_per_row = s.cols.div_ceil(per_chunk);
        let total = s.rows * chunks_per_row;
        if threads.is_multiple_of(chunks_per_row) && total.is_multiple_of(threads) {
            return self.issue_cp_async_rows(t, acc, s, start_elems);
        }
        let ir = &self.ir;
        let tid = ir.add(ir.mul(self.warp, ir.ci32(32)), self.lane);
        // Elements of a row inside the column bound and limit (loop-invariant).
        let mut cend = self.tensors[t].shape[ca.axis];
        if let Some(l) = ca.limit {
            cend = ir.select(ir.icmp(LLVMIntSLT, l, cend), l, cend);
        }
        let mut i = 0usize;
        while i < total {
            let ir = &self.ir;
            let c = ir.add(tid, ir.ci32(i as i64));
            let in_tile = ir.icmp(LLVMIntSLT, c, ir.ci32(total as i64));
            let row = ir.udiv(c, ir.ci32(chunks_per_row as i64));
            let ch = ir.urem(c, ir.ci32(chunks_per_row as i64));
            let gr = ir.add(ra.start, ir.sext(row, ir.i64()));
            let gc = ir.add(ca.start, ir.mul(ir.sext(ch, ir.i64()), ir.ci64(per_chunk as i64)));
            let row_ok = ir.and(acc.valid, self.in_range(t, ra.axis, gr, ra.limit));
            let ir = &self.ir;
            let left = ir.sub(cend, gc);
            let left = ir.select(ir.icmp(LLVMIntSLT, left, ir.ci64(0)), ir.ci64(0), left);
            let left = ir.select(ir.icmp(LLVMIntSGT, left, ir.ci64(per_chunk as i64)), ir.ci64(per_chunk as i64), left);
            let nbytes = ir.mul(ir.trunc(left, ir.i32()), ir.ci32(esize));
            let nbytes = ir.select(ir.and(row_ok, ir.icmp(LLVMIntSGE, gc, ir.ci64(0))), nbytes, ir.ci32(0));
            let idx = ir.add(ir.add(acc.off, ir.mul(gr, strides[ra.axis])), gc);
            // Nothing to read: point at the (aligned) tile start, never outside.
            let idx = ir.select(ir.icmp(LLVMIntSGT, nbytes, ir.ci32(0)), idx, start_elems);
            let src = ir.gep(self.storage_ty(s.dtype), self.tensors[t].data, idx);
            let dst_off = ir.add(s.off, s.chunk_off(ir, row, ch));
            let dst = self.sptr(dst_off);
            if total.is_multiple_of(threads) || i + threads <= total {
                nvvm::cp_async_16(&self.ir, dst, src, nbytes);
            } else {
                self.if_then(in_tile, &mut |cg| {
                    nvvm::cp_async_16(&cg.ir, dst, src, nbytes);
                    Ok(())
                })?;
            }
            i += threads;
        }
        Ok(())
    }

    /// [`Self::issue_cp_async`] when every thread copies the same column chunk of rows
    /// `r0, r0 + R, r0 + 2R, ...` (R = threads / chunks per row): one column bound, and
    /// source addresses as a chain `a + R·stride` — few registers live across a loop.
    fn issue_cp_async_rows(&mut self, t: usize, acc: &Access, s: &Smem, start_elems: V) -> R<()> {
        let (ra, ca) = (acc.ranges[0], acc.ranges[1]);
        let threads = self.warps * 32;
        let esize = s.dtype.size_bytes() as i64;
        let per_chunk = 16 / esize as usize;
        let cpr = s.cols.div_ceil(per_chunk);
        let rstep = threads / cpr;
        let steps = s.rows * cpr / threads;
        let stride_r = self.tensors[t].strides[ra.axis];
        let ir = &self.ir;
        let tid = ir.add(ir.mul(self.warp, ir.ci32(32)), self.lane);
        let cm = s.layout == SmemLayout::CoreMatrix;
        let (r0, ch, rstep) = if cm && cpr.is_multiple_of(4) && self.warps.is_multiple_of(cpr / 4) {
            // Core-matrix layout: the 8 lanes of a quarter-warp write the 8 rows of one
            // core matrix (128 contiguous bytes: no bank conflict), and a warp covers 4
            // chunks of those rows (64 contiguous bytes of each source row).
            let cb = cpr / 4;
            let w = self.warp;
            let r0 = ir.add(ir.mul(ir.udiv(w, ir.ci32(cb as i64)), ir.ci32(8)), ir.and(self.lane, ir.ci32(7)));
            let ch = ir.add(ir.mul(ir.urem(w, ir.ci32(cb as i64)), ir.ci32(4)), ir.lshr(self.lane, ir.ci32(3)));
            (r0, ch, 8 * self.warps / cb)
        } else {
            (ir.udiv(tid, ir.ci32(cpr as i64)), ir.urem(tid, ir.ci32(cpr as i64)), rstep)
        };
        // Bytes of this thread's column chunk inside the tensor (the same on every row).
        let gc = ir.add(ca.start, ir.mul(ir.sext(ch, ir.i64()), ir.ci64(per_chunk as i64)));
        let mut cend = self.tensors[t].shape[ca.axis];
        if let Some(l) = ca.limit {
            cend = ir.select(ir.icmp(LLVMIntSLT, l, cend), l, cend);
        }
        let left = ir.sub(cend, gc);
        let left = ir.select(ir.icmp(LLVMIntSLT, left, ir.ci64(0)), ir.ci64(0), left);
        let left = ir.select(ir.icmp(LLVMIntSGT, left, ir.ci64(per_chunk as i64)), ir.ci64(per_chunk as i64), left);
        let col_ok = ir.and(acc.valid, ir.icmp(LLVMIntSGE, gc, ir.ci64(0)));
        let col_bytes = ir.select(col_ok, ir.mul(ir.trunc(left, ir.i32()), ir.ci32(esize)), ir.ci32(0));
        // Rows: [0, rend) of the tensor axis.
        let mut rend = self.tensors[t].shape[ra.axis];
        if let Some(l) = ra.limit {
            rend = ir.select(ir.icmp(LLVMIntSLT, l, rend), l, rend);
        }
        let gr0 = ir.add(ra.start, ir.sext(r0, ir.i64()));
        let data = self.tensors[t].data;
        let st = self.storage_ty(s.dtype);
        let fallback = ir.gep(st, data, start_elems);
        let mut src = ir.gep(st, data, ir.add(ir.add(acc.off, ir.mul(gr0, stride_r)), gc));
        let delta = ir.mul(stride_r, ir.ci64(rstep as i64));
        let dst0 = ir.add(s.off, s.chunk_off(ir, r0, ch));
        // Rows r0 + k·rstep: a constant step from dst0 when rstep keeps the row's place
        // in its 8-row group (always, for the padded layout).
        let const_step = s.layout == SmemLayout::Padded || rstep.is_multiple_of(8);
        let step_bytes = match s.layout {
            SmemLayout::Padded => rstep * s.row_bytes(),
            SmemLayout::CoreMatrix => rstep / 8 * s.group_bytes(),
            SmemLayout::Swizzle128 => rstep * 128,
        };
        for k in 0..steps {
            let ir = &self.ir;
            let gr = ir.add(gr0, ir.ci64((k * rstep) as i64));
            let row_ok = ir.and(ir.icmp(LLVMIntSGE, gr, ir.ci64(0)), ir.icmp(LLVMIntSLT, gr, rend));
            let nbytes = ir.select(row_ok, col_bytes, ir.ci32(0));
            let from = ir.select(ir.icmp(LLVMIntSGT, nbytes, ir.ci32(0)), src, fallback);
            let dst = if const_step {
                self.sptr(ir.add(dst0, ir.ci32((k * step_bytes) as i64)))
            } else {
                let row = ir.add(r0, ir.ci32((k * rstep) as i64));
                self.sptr(ir.add(s.off, s.chunk_off(ir, row, ch)))
            };
            nvvm::cp_async_16(ir, dst, from, nbytes);
            src = ir.gep(st, src, delta);
        }
        Ok(())
    }

    /// Copy the tile element by element (any strides, any pad), as a loop over the
    /// thread's share. No barriers.
    fn fill_slow(&mut self, t: usize, acc: &Access, s: &Smem, pad: f64) -> R<()> {
        let (ra, ca) = (acc.ranges[0], acc.ranges[1]);
        let threads = (self.warps * 32) as i64;
        let esize = s.dtype.size_bytes() as i64;
        let strides = self.tensors[t].strides.clone();
        let total = (s.rows * s.cols) as i64;
        let padv = self.constant(pad, s.dtype);
        let pre = self.ir.current();
        let head = self.ir.block("smem.el.head");
        let body = self.ir.block("smem.el.body");
        let done = self.ir.block("smem.el.done");
        let tid0 = self.ir.add(self.ir.mul(self.warp, self.ir.ci32(32)), self.lane);
        self.ir.br(head);
        self.ir.at_end(head);
        let c = self.ir.phi(self.ir.i32());
        self.ir.add_incoming(c, tid0, pre);
        self.ir.cond_br(self.ir.icmp(LLVMIntSLT, c, self.ir.ci32(total)), body, done);
        self.ir.at_end(body);
        let ir = &self.ir;
        let row = ir.udiv(c, ir.ci32(s.cols as i64));
        let col = ir.urem(c, ir.ci32(s.cols as i64));
        let gr = ir.add(ra.start, ir.sext(row, ir.i64()));
        let gc = ir.add(ca.start, ir.sext(col, ir.i64()));
        let ok = self.in_range(t, ra.axis, gr, ra.limit);
        let ok = self.ir.and(acc.valid, ok);
        let ok = self.ir.and(ok, self.in_range(t, ca.axis, gc, ca.limit));
        let ir = &self.ir;
        let idx = ir.add(ir.add(acc.off, ir.mul(gr, strides[ra.axis])), ir.mul(gc, strides[ca.axis]));
        let x = self.load_elem(t, idx, ok, padv);
        let ir = &self.ir;
        let dst_off = ir.add(s.off, s.elem_off(ir, row, col));
        ir.store(x, self.sptr(dst_off), esize as u32);
        let next = self.ir.add(c, self.ir.ci32(threads));
        self.ir.add_incoming(c, next, self.ir.current());
        self.ir.br(head);
        self.ir.at_end(done);
        Ok(())
    }

    /// Copy the tile of `acc` into `s`, synchronously (barrier before: previous readers
    /// are done; barrier after: the data is visible to every warp).
    fn fill_smem(&mut self, t: usize, acc: &Access, s: &Smem, pad: f64) -> R<()> {
        self.sync();
        let fast = self.smem_fast(t, acc, s.dtype.size_bytes() as i64, pad);
        let fb = self.ir.block("smem.vec");
        let sb = self.ir.block("smem.scalar");
        let jb = self.ir.block("smem.done");
        self.ir.cond_br(fast, fb, sb);
        self.ir.at_end(fb);
        self.issue_cp_async(t, acc, s)?;
        nvvm::cp_async_commit(&self.ir);
        nvvm::cp_async_wait(&self.ir, 0);
        self.ir.br(jb);
        self.ir.at_end(sb);
        self.fill_slow(t, acc, s, pad)?;
        self.ir.br(jb);
        self.ir.at_end(jb);
        if s.wgmma_readable() {
            nvvm::fence_proxy_async(&self.ir);
        }
        self.sync();
        Ok(())
    }

    /// A prefetched load at its place in the loop body: wait for this iteration's
    /// copy, make it visible, and start the copy `stages - 1` iterations ahead into the
    /// buffer the previous iteration used. Returns the buffer's offset (i32).
    fn pipelined_load(&mut self, pf: &Prefetch<'k>, t: usize, acc: &Access, s: &Smem, pad: f64) -> R<V> {
        let st = self.stages as i64;
        let ir = &self.ir;
        let stage = ir.urem(pf.counter, ir.ci32(st));
        let off = ir.add(ir.ci32(pf.base as i64), ir.mul(stage, ir.ci32(pf.stride as i64)));
        if let Some(li) = pf.tma {
            // The producer copies it: wait for the slot's full barrier.
            let (full, _) = self.tma_bars(li, stage);
            let ir = &self.ir;
            let phase = ir.and(ir.udiv(pf.counter, ir.ci32(st)), ir.ci32(1));
            nvvm::mbarrier_wait(ir, full, phase);
            return Ok(off);
        }
        let fb = ir.block("pipe.fast");
        let sb = ir.block("pipe.slow");
        let jb = ir.block("pipe.done");
        ir.cond_br(pf.fast, fb, sb);
        // ---- cp.async pipeline
        self.ir.at_end(fb);
        nvvm::cp_async_wait(&self.ir, pf.in_flight as i64);
        if s.wgmma_readable() {
            nvvm::fence_proxy_async(&self.ir);
        }
        self.sync();
        let ir = &self.ir;
        let ahead = ir.ci32(st - 1);
        let next_iv = ir.add(pf.iv, ir.mul(pf.step, ahead));
        let next_stage = ir.urem(ir.add(pf.counter, ahead), ir.ci32(st));
        let next_off = ir.add(ir.ci32(pf.base as i64), ir.mul(next_stage, ir.ci32(pf.stride as i64)));
        let more = ir.icmp(LLVMIntSLT, next_iv, pf.hi);
        let (op, iv_value) = (pf.op, pf.iv_value);
        let next = Smem { off: next_off, ..s.clone() };
        self.if_then(more, &mut |cg| {
            let acc = cg.load_access(op, Some((iv_value, next_iv)))?;
            cg.issue_cp_async(t, &acc, &next)
        })?;
        nvvm::cp_async_commit(&self.ir);
        self.ir.br(jb);
        // The slow block below is dead when the fast path is certain (aligned entry):
        // from here on, copies committed before the loop are complete and visible.
        if self.ir.is_true(pf.fast) {
            self.covered = true;
        }
        // ---- element by element, synchronous
        self.ir.at_end(sb);
        self.sync();
        let here = Smem { off, ..s.clone() };
        self.fill_slow(t, acc, &here, pad)?;
        if s.wgmma_readable() {
            nvvm::fence_proxy_async(&self.ir);
        }
        self.sync();
        self.ir.br(jb);
        self.ir.at_end(jb);
        Ok(off)
    }

    /// Make a pending tile (see [`Smem::pending`]) readable: wait for every copy and
    /// barrier, unless a pipelined wait already covers it here.
    fn ready(&mut self, s: &mut Smem) {
        if s.pending && !self.covered {
            nvvm::cp_async_wait(&self.ir, 0);
            if s.wgmma_readable() {
                nvvm::fence_proxy_async(&self.ir);
            }
            self.sync();
            s.pending = false;
        }
    }

    /// Read a shared-memory tile into the register layout.
    fn smem_to_dist(&mut self, v: Value, s: &Smem) -> R<Dist> {
        let mut s = s.clone();
        self.ready(&mut s);
        let s = &s;
        let (rows, cols) = self.axes_of(v)?;
        let rc = self.row_coords(rows);
        let cc = self.col_coords(cols);
        let st = self.storage_ty(s.dtype);
        let mut e = Vec::new();
        for r in &rc {
            for c in &cc {
                let ir = &self.ir;
                let off = ir.add(s.off, s.elem_off(ir, *r, *c));
                e.push(ir.load(st, self.sptr(off), s.dtype.size_bytes() as u32));
            }
        }
        Ok(Dist { rows, cols, e })
    }

    /// Write a register tile (`[rows, cols]`, 16-bit) to a shared-memory region of
    /// `op` (for a `b` operand computed in registers).
    fn dist_to_smem(&mut self, op: &'k Op, slot: usize, v: Value) -> R<Smem> {
        let Type::Tile(dtype, shape) = self.ty(v).clone() else {
            return Err(self.err("not a tile".into()));
        };
        if dtype.size_bytes() != 2 || shape.len() != 2 {
            return Err(
                self.err(format!("dot operands must be 2-D bf16 or f16 tiles on the PTX targets (got {})", self.ty(v)))
            );
        }
        let d = self.dist(v)?;
        let mut s =
            Smem::new(shape[0], shape[1], dtype, Smem::layout_for(shape[1], dtype, self.wgmma), self.ir.ci32(0));
        let off = self.region(op, slot, s.bytes(), s.align());
        s.off = self.ir.ci32(off as i64);
        self.sync();
        let rc = self.row_coords(d.rows);
        let cc = self.col_coords(d.cols);
        let nc = cc.len();
        for (ri, r) in rc.iter().enumerate() {
            for (ci, c) in cc.iter().enumerate() {
                let ir = &self.ir;
                let off = ir.add(s.off, s.elem_off(ir, *r, *c));
                ir.store(Self::elem(&d, ri, ci, nc), self.sptr(off), 2);
            }
        }
        if s.wgmma_readable() {
            nvvm::fence_proxy_async(&self.ir);
        }
        self.sync();
        Ok(s)
    }

    fn store(&mut self, op: &'k Op, axes: &[AxisIndex]) -> R<()> {
        let n = op.operands.len();
        let value = op.operands[n - 1];
        let t = self.tensor_of(op.operands[0])?;
        let acc = self.access(t, axes, &op.operands[1..n - 1])?;
        let dtype = self.tensors[t].dtype;
        let vd = self.ty(value).dtype();
        let st = self.storage_ty(dtype);
        let esize = dtype.size_bytes() as u32;
        let data = self.tensors[t].data;
        if acc.ranges.is_empty() {
            let x = self.scalar(value)?;
            let x = self.to_storage(x, vd, dtype);
            let ir = &self.ir;
            // One thread writes a scalar.
            let first = ir.and(ir.icmp(LLVMIntEQ, self.warp, ir.ci32(0)), ir.icmp(LLVMIntEQ, self.lane, ir.ci32(0)));
            let ok = ir.and(acc.valid, first);
            let p = ir.gep(st, data, acc.off);
            self.if_then(ok, &mut |cg| {
                cg.ir.store(x, p, esize);
                Ok(())
            })?;
            return Ok(());
        }
        let d = self.dist(value)?;
        let (rows, cols) = (d.rows, d.cols);
        // Replicated elements are written by one thread only: rows replicate over the
        // lanes of a quad (lane % 4) when columns are broadcast; columns replicate over
        // lane / 4 and over warps when rows are broadcast.
        let ir = &self.ir;
        let mut owner = ir.ctrue();
        if cols == Ax::One {
            owner = ir.and(owner, ir.icmp(LLVMIntEQ, ir.and(self.lane, ir.ci32(3)), ir.ci32(0)));
        }
        if rows == Ax::One {
            owner = ir.and(owner, ir.icmp(LLVMIntULT, self.lane, ir.ci32(4)));
            owner = ir.and(owner, ir.icmp(LLVMIntEQ, self.warp, ir.ci32(0)));
        }
        if self.window_moves(axes, &op.operands[1..n - 1]) {
            let xs: Vec<V> = d.e.iter().map(|x| self.to_storage(*x, vd, dtype)).collect();
            self.window_access(t, &acc, rows, cols, &mut |cg, i, p, ok| {
                let ok = cg.ir.and(ok, owner);
                cg.if_then(ok, &mut |cg| {
                    cg.ir.store(xs[i], p, esize);
                    Ok(())
                })?;
                Ok(None)
            })?;
            return Ok(());
        }
        let (rcs, ccs) = (self.row_coords(rows), self.col_coords(cols));
        // 16-bit outputs whose columns are contiguous and 4-byte aligned are written two
        // columns at a time (the pair a thread holds), rounded pairwise from f32 when the
        // value was just cast; the choice is made at run time, once.
        let col_axis = match acc.ranges.len() {
            2 => Some(acc.ranges[1]),
            1 if rows == Ax::One => Some(acc.ranges[0]),
            _ => None,
        };
        if let (Some(ca), Ax::Mma(_), 2) = (col_axis, cols, dtype.size_bytes()) {
            let src = match self.du.def(value) {
                Some(o) if matches!(o.kind, OpKind::Cast { .. }) && self.ty(o.operands[0]).dtype() == DType::F32 => {
                    Some(self.dist(o.operands[0])?)
                }
                _ => None,
            };
            let ir = &self.ir;
            let strides = &self.tensors[t].strides;
            let data_i = ir.ptr_to_int(data, ir.i64());
            let first = ir.add(data_i, ir.mul(ir.add(acc.off, ca.start), ir.ci64(2)));
            let mut even = ir.icmp(LLVMIntEQ, ir.and(first, ir.ci64(3)), ir.ci64(0));
            even = ir.and(even, ir.icmp(LLVMIntEQ, strides[ca.axis], ir.ci64(1)));
            if acc.ranges.len() == 2 {
                let ra = acc.ranges[0];
                even = ir.and(even, ir.icmp(LLVMIntEQ, ir.and(strides[ra.axis], ir.ci64(1)), ir.ci64(0)));
            }
            let pb = ir.block("st.pairs");
            let eb = ir.block("st.elems");
            let jb = ir.block("st.done");
            ir.cond_br(even, pb, eb);
            self.ir.at_end(pb);
            let nc = Self::ncols(cols);
            for (ri, rc) in rcs.iter().enumerate() {
                for pair in 0..nc / 2 {
                    let (i0, i1) = (ri * nc + 2 * pair, ri * nc + 2 * pair + 1);
                    let (idx, ok0) = self.elem_address(t, &acc, rows, *rc, ccs[2 * pair]);
                    let (_, ok1) = self.elem_address(t, &acc, rows, *rc, ccs[2 * pair + 1]);
                    let ok1 = self.ir.and(ok1, owner);
                    let ok0 = self.ir.and(ok0, owner);
                    let packed = match &src {
                        Some(f) => self.pack2_f32(f.e[i0], f.e[i1], dtype),
                        None => {
                            let (a, b) = (self.to_storage(d.e[i0], vd, dtype), self.to_storage(d.e[i1], vd, dtype));
                            self.pack2(a, b, dtype)
                        }
                    };
                    let single = self.to_storage(d.e[i0], vd, dtype);
                    let p = self.ir.gep(st, data, idx);
                    self.if_then(ok1, &mut |cg| {
                        cg.ir.store(packed, p, 4);
                        Ok(())
                    })?;
                    let only_first = self.ir.and(ok0, self.ir.not(ok1));
                    self.if_then(only_first, &mut |cg| {
                        cg.ir.store(single, p, esize);
                        Ok(())
                    })?;
                }
            }
            self.ir.br(jb);
            self.ir.at_end(eb);
            self.store_elems(t, &acc, &d, (&rcs, &ccs), owner, vd, dtype)?;
            self.ir.br(jb);
            self.ir.at_end(jb);
            return Ok(());
        }
        self.store_elems(t, &acc, &d, (&rcs, &ccs), owner, vd, dtype)
    }

    /// One predicated store per element.
    #[allow(clippy::too_many_arguments)]
    fn store_elems(
        &mut self,
        t: usize,
        acc: &Access,
        d: &Dist,
        coords: (&[V], &[V]),
        owner: V,
        vd: DType,
        dtype: DType,
    ) -> R<()> {
        let st = self.storage_ty(dtype);
        let esize = dtype.size_bytes() as u32;
        let data = self.tensors[t].data;
        let mut i = 0;
        for rc in coords.0 {
            for cc in coords.1 {
                let (idx, ok) = self.elem_address(t, acc, d.rows, *rc, *cc);
                let x = self.to_storage(d.e[i], vd, dtype);
                i += 1;
                let ok = self.ir.and(ok, owner);
                let p = self.ir.gep(st, data, idx);
                self.if_then(ok, &mut |cg| {
                    cg.ir.store(x, p, esize);
                    Ok(())
                })?;
            }
        }
        Ok(())
    }

    /// Element offset (i64) and in-bounds flag of element (`rc`, `cc`) — a row and a
    /// column coordinate of the thread — of a register tile accessed through `acc`.
    fn elem_address(&self, t: usize, acc: &Access, rows: Ax, rc: V, cc: V) -> (V, V) {
        // Which tile axis each range is: with two ranges, (rows, cols); with one, the
        // non-trivial axis of the layout.
        let (row_rng, col_rng) = match acc.ranges.len() {
            2 => (Some(acc.ranges[0]), Some(acc.ranges[1])),
            _ if rows == Ax::One => (None, Some(acc.ranges[0])),
            _ => (Some(acc.ranges[0]), None),
        };
        let strides = &self.tensors[t].strides;
        let ir = &self.ir;
        let mut idx = acc.off;
        let mut ok = acc.valid;
        for (rng, coord) in [(row_rng, rc), (col_rng, cc)] {
            if let Some(g) = rng {
                let x = ir.add(g.start, ir.sext(coord, ir.i64()));
                ok = ir.and(ok, self.in_range(t, g.axis, x, g.limit));
                idx = ir.add(idx, ir.mul(x, strides[g.axis]));
            }
        }
        (idx, ok)
    }

    /// Whether a register tile's access (`axes`, `operands`: the index operands) is a
    /// *moving window* of the innermost loop: inside a loop, with every range start and
    /// limit defined outside it, so that only its fixed indices change per iteration
    /// (mean pooling's `x[b, t, h0.., :]` for each token `t`).
    ///
    /// Addressed element by element like other accesses, its per-element offsets and
    /// bounds are loop invariants, and LLVM's LICM hoists each of them out of the loop
    /// — one 64-bit offset and one flag per element held over the whole loop, which
    /// spills a `[16, 128]` tile on one warp. [`Self::window_access`] addresses it
    /// from one pointer per row slot instead.
    fn window_moves(&self, axes: &[AxisIndex], operands: &[Value]) -> bool {
        let Some(inside) = self.loop_values.last() else { return false };
        let mut it = operands.iter();
        for a in axes {
            let n = a.operand_count();
            let ops: Vec<&Value> = it.by_ref().take(n).collect();
            if matches!(a, AxisIndex::Range { .. }) && ops.iter().any(|v| inside.contains(v)) {
                return false;
            }
        }
        true
    }

    /// Emit `elem(cg, i, ptr, ok)` for each of the thread's elements `i` (row slot
    /// major) of a register tile in layout (`rows`, `cols`) accessed through `acc` at a
    /// moving window; the values it returns (loads) are merged over the two paths.
    ///
    /// * When the column axis has unit stride and the thread's columns are all inside
    ///   it (uniform in practice: tiles span the head dim), every element is its row's
    ///   pointer plus a constant, which folds into the instruction: the loop holds one
    ///   offset and one flag per row slot.
    /// * Otherwise the column start and stride go through [`nvvm::opaque_i64`] in the
    ///   loop body, so the per-element offsets and flags are computed where they are used
    ///   rather than hoisted out of the loop and held (LICM hoists invariants out of
    ///   branches too).
    fn window_access(
        &mut self,
        t: usize,
        acc: &Access,
        rows: Ax,
        cols: Ax,
        elem: &mut WindowElem<'_, 'k>,
    ) -> R<Vec<V>> {
        let (row_rng, col_rng) = match acc.ranges.len() {
            2 => (Some(acc.ranges[0]), Some(acc.ranges[1])),
            _ if rows == Ax::One => (None, Some(acc.ranges[0])),
            _ => (Some(acc.ranges[0]), None),
        };
        let st = self.storage_ty(self.tensors[t].dtype);
        let data = self.tensors[t].data;
        // Per row slot: the element offset of its column 0 and its flag.
        let mut row_parts = Vec::new();
        for rc in self.row_coords(rows) {
            let ir = &self.ir;
            let (mut idx, mut ok) = (acc.off, acc.valid);
            if let Some(g) = row_rng {
                let x = ir.add(g.start, ir.sext(rc, ir.i64()));
                ok = ir.and(ok, self.in_range(t, g.axis, x, g.limit));
                idx = ir.add(idx, ir.mul(x, self.tensors[t].strides[g.axis]));
            }
            row_parts.push((idx, ok));
        }
        let Some(g) = col_rng else {
            // No column axis in memory: one element per row slot.
            let mut out = Vec::new();
            for (i, (idx, ok)) in row_parts.into_iter().enumerate() {
                let p = self.ir.gep(st, data, idx);
                out.extend(elem(self, i, p, ok)?);
            }
            return Ok(out);
        };
        // Column slots: the thread's first column `c0` plus constant offsets (see
        // `col_coords`).
        let ir = &self.ir;
        let (c0, ks): (V, Vec<i64>) = match cols {
            Ax::One => (ir.ci32(0), vec![0]),
            Ax::Mma(c) => (
                ir.shl(ir.and(self.lane, ir.ci32(3)), ir.ci32(1)),
                (0..c / 8).flat_map(|nf| [(nf * 8) as i64, (nf * 8 + 1) as i64]).collect(),
            ),
        };
        let stride = self.tensors[t].strides[g.axis];
        let x0 = ir.add(g.start, ir.sext(c0, ir.i64()));
        let mut cend = self.tensors[t].shape[g.axis];
        if let Some(l) = g.limit {
            cend = ir.select(ir.icmp(LLVMIntSLT, l, cend), l, cend);
        }
        let last = ks.last().copied().unwrap_or(0);
        let inside = ir.and(ir.icmp(LLVMIntSGE, x0, ir.ci64(0)), ir.icmp(LLVMIntSLT, ir.add(x0, ir.ci64(last)), cend));
        let fast = ir.and(inside, ir.icmp(LLVMIntEQ, stride, ir.ci64(1)));
        let fb = ir.block("win.fast");
        let sb = ir.block("win.general");
        let jb = ir.block("win.done");
        ir.cond_br(fast, fb, sb);
        let mut arms: Vec<(B, Vec<V>)> = Vec::new();
        for general in [false, true] {
            self.ir.at_end(if general { sb } else { fb });
            let ir = &self.ir;
            let (x0, stride) =
                if general { (nvvm::opaque_i64(ir, x0), nvvm::opaque_i64(ir, stride)) } else { (x0, ir.ci64(1)) };
            let mut vals = Vec::new();
            for (ri, (idx, ok)) in row_parts.iter().enumerate() {
                let ir = &self.ir;
                let row = ir.gep(st, data, ir.add(*idx, ir.mul(x0, stride)));
                for (ci, k) in ks.iter().enumerate() {
                    let ir = &self.ir;
                    let (p, ok) = if general {
                        let col_ok = self.in_range(t, g.axis, ir.add(x0, ir.ci64(*k)), g.limit);
                        (ir.gep(st, row, ir.mul(ir.ci64(*k), stride)), self.ir.and(*ok, col_ok))
                    } else {
                        (ir.gep_const(st, row, *k), *ok)
                    };
                    vals.extend(elem(self, ri * ks.len() + ci, p, ok)?);
                }
            }
            arms.push((self.ir.current(), vals));
            self.ir.br(jb);
        }
        self.ir.at_end(jb);
        let mut out = Vec::with_capacity(arms[0].1.len());
        for i in 0..arms[0].1.len() {
            let phi = self.ir.phi(self.ir.type_of(arms[0].1[i]));
            for (bb, vals) in &arms {
                self.ir.add_incoming(phi, vals[i], *bb);
            }
            out.push(phi);
        }
        Ok(out)
    }

    fn to_storage(&self, x: V, from: DType, to: DType) -> V {
        let x = self.arith().cast(x, from, to);
        if to == DType::I1 {
            self.ir.zext(x, self.ir.i8())
        } else {
            x
        }
    }

    // ---------------------------------------------------------------- reductions

    /// Reduce `x` over the four lanes of a quad (the column slots of a row).
    fn quad_reduce(&self, x: V, max: bool) -> V {
        let ir = &self.ir;
        let mut x = x;
        for m in [1, 2] {
            let y = nvvm::shfl_xor_f32(ir, x, m);
            x = if max { ir.maxnum(x, y) } else { ir.fadd(x, y) };
        }
        x
    }

    fn row_fold(&self, d: &Dist, ri: usize, max: bool, f: &dyn Fn(V) -> V) -> V {
        let ir = &self.ir;
        let nc = Self::ncols(d.cols);
        // A balanced tree, not a chain: log2(nc) dependent steps instead of nc - 1.
        let mut xs: Vec<V> = (0..nc).map(|ci| f(Self::elem(d, ri, ci, nc))).collect();
        while xs.len() > 1 {
            let pair = |a: V, b: V| if max { ir.maxnum(a, b) } else { ir.fadd(a, b) };
            xs = xs.chunks(2).map(|p| p.iter().copied().reduce(pair).expect("chunks are not empty")).collect();
        }
        let mut acc = xs[0];
        if d.cols != Ax::One {
            acc = self.quad_reduce(acc, max);
        }
        acc
    }

    fn reduce(&mut self, op: &'k Op, r: ReduceOp, axis: u8) -> R<()> {
        let x = self.dist(op.operands[0])?;
        let dt = self.ty(op.operands[0]).dtype();
        if axis != 1 && !matches!(self.ty(op.operands[0]), Type::Tile(_, s) if s.len() == 1) {
            return Err(self.err("reductions along axis 0 (across warps) are not supported yet".into()));
        }
        if dt != DType::F32 {
            return Err(self.err(format!("reductions of {dt} tiles are not supported yet (f32 only)")));
        }
        let max = matches!(r, ReduceOp::Max);
        if !matches!(r, ReduceOp::Max | ReduceOp::Sum) {
            return Err(self.err(format!("reduction {r:?} is not supported yet")));
        }
        let (rows, cols) = self.axes_of(op.results[0])?;
        if matches!(self.ty(op.operands[0]), Type::Tile(_, s) if s.len() == 1) {
            return Err(self.err("reducing a rank-1 tile to a scalar is not supported yet".into()));
        }
        let mut e = Vec::new();
        for ri in 0..self.nrows(x.rows) {
            e.push(self.row_fold(&x, ri, max, &|v| v));
        }
        self.set(op.results[0], GV::Dist(Dist { rows, cols, e }));
        Ok(())
    }

    fn softmax_update(&mut self, op: &'k Op) -> R<()> {
        let s = self.dist(op.operands[0])?;
        let m = self.dist(op.operands[1])?;
        let l = self.dist(op.operands[2])?;
        let neg_inf = self.ir.cf32(f64::NEG_INFINITY);
        let nr = self.nrows(s.rows);
        let nc = Self::ncols(s.cols);
        let (mut pe, mut ae, mut me, mut le) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut p_all = vec![std::ptr::null_mut(); nr * nc];
        // Unscaled scores (`scale_fold`): m = c · max(s), p = ex2(fma(s, c, −m)).
        let scale = match self.scaled_softmax.get(&op.results[0]) {
            Some(c) => Some(self.scalar(*c)?),
            None => None,
        };
        for ri in 0..nr {
            let rmax = self.row_fold(&s, ri, true, &|v| v);
            let ir = &self.ir;
            let rmax = match scale {
                Some(c) => ir.fmul(rmax, c),
                None => rmax,
            };
            let mi = Self::elem(&m, ri, 0, 1);
            let li = Self::elem(&l, ri, 0, 1);
            let m_new = ir.maxnum(mi, rmax);
            let dead = ir.fcmp(LLVMRealOEQ, m_new, neg_inf);
            let m_use = ir.select(dead, ir.cf32(0.0), m_new);
            let alpha = ir.select(dead, ir.cf32(1.0), nvvm::ex2(ir, ir.fsub(mi, m_use)));
            let neg_m = ir.fneg(m_use);
            for ci in 0..nc {
                let x = Self::elem(&s, ri, ci, nc);
                let e = match scale {
                    Some(c) => ir.fma(x, c, neg_m),
                    None => ir.fsub(x, m_use),
                };
                p_all[ri * nc + ci] = nvvm::ex2(ir, e);
            }
            let prow = Dist { rows: Ax::One, cols: s.cols, e: p_all[ri * nc..(ri + 1) * nc].to_vec() };
            let psum = self.row_fold(&prow, 0, false, &|v| v);
            let ir = &self.ir;
            let l_new = ir.fma(li, alpha, psum);
            ae.push(alpha);
            me.push(m_new);
            le.push(l_new);
        }
        pe.extend(p_all);
        let (rr, rc) = self.axes_of(op.results[1])?;
        self.set(op.results[0], GV::Dist(Dist { rows: s.rows, cols: s.cols, e: pe }));
        self.set(op.results[1], GV::Dist(Dist { rows: rr, cols: rc, e: ae }));
        self.set(op.results[2], GV::Dist(Dist { rows: rr, cols: rc, e: me }));
        self.set(op.results[3], GV::Dist(Dist { rows: rr, cols: rc, e: le }));
        Ok(())
    }

    fn softmax_finalize(&mut self, op: &'k Op) -> R<()> {
        let acc = self.dist(op.operands[0])?;
        let m = self.dist(op.operands[1])?;
        let l = self.dist(op.operands[2])?;
        let nr = self.nrows(acc.rows);
        let nc = Self::ncols(acc.cols);
        let (mut oe, mut lse) = (Vec::new(), Vec::new());
        for ri in 0..nr {
            let ir = &self.ir;
            let mi = Self::elem(&m, ri, 0, 1);
            let li = Self::elem(&l, ri, 0, 1);
            let empty = ir.fcmp(LLVMRealOEQ, li, ir.cf32(0.0));
            let lsafe = ir.select(empty, ir.cf32(1.0), li);
            let lg = math::log2(ir, lsafe);
            let v = ir.fmul(ir.fadd(mi, lg), ir.cf32(std::f64::consts::LN_2));
            lse.push(ir.select(empty, ir.cf32(f64::NEG_INFINITY), v));
            let inv = nvvm::rcp(ir, lsafe);
            for ci in 0..nc {
                let x = ir.fmul(Self::elem(&acc, ri, ci, nc), inv);
                oe.push(ir.select(empty, ir.cf32(0.0), x));
            }
        }
        let (lr, lc) = self.axes_of(op.results[1])?;
        self.set(op.results[0], GV::Dist(Dist { rows: acc.rows, cols: acc.cols, e: oe }));
        self.set(op.results[1], GV::Dist(Dist { rows: lr, cols: lc, e: lse }));
        Ok(())
    }

    fn rand_uniform(&mut self, op: &'k Op) -> R<()> {
        let s: Vec<V> = op.operands.iter().map(|o| self.scalar(*o)).collect::<R<_>>()?;
        let (rows, cols) = self.axes_of(op.results[0])?;
        let rc = self.row_coords(rows);
        let cc = self.col_coords(cols);
        let mut e = Vec::new();
        for r in &rc {
            for c in &cc {
                let ir = &self.ir;
                let row = ir.add(*r, s[4]);
                let col = ir.add(*c, s[5]);
                let x0 = math::philox_first_word(ir, [row, col, s[3], s[2]], [s[0], s[1]]);
                let top = ir.lshr(x0, ir.ci32(8));
                let f = ir.uitofp(top, ir.f32());
                e.push(ir.fmul(f, ir.cf32(1.0 / 16777216.0)));
            }
        }
        self.set(op.results[0], GV::Dist(Dist { rows, cols, e }));
        Ok(())
    }

    // ---------------------------------------------------------------- dot

    /// Lane `l`'s `ldmatrix` row address for an `a` fragment (m-fragment `mf` of this
    /// warp, k-step `ks`) of a shared tile `[M, K]`.
    fn a_frag_ldmatrix(&self, s: &Smem, mf: usize, ks: usize) -> [V; 4] {
        let row0 = self.mfrag_row0(s.rows, mf);
        let ir = &self.ir;
        let row = ir.add(row0, ir.and(self.lane, ir.ci32(15)));
        let chunk = ir.add(ir.ci32((ks * 2) as i64), ir.lshr(self.lane, ir.ci32(4)));
        let off = ir.add(s.off, s.chunk_off(ir, row, chunk));
        let r = nvvm::ldmatrix(ir, self.sptr(off), 4, false);
        [r[0], r[1], r[2], r[3]]
    }

    fn a_frags_from_smem(&mut self, s: &Smem) -> R<Vec<Vec<[V; 4]>>> {
        if !s.rows.is_multiple_of(16 * self.warps) || !s.cols.is_multiple_of(16) {
            return Err(self.err(format!(
                "a dot's `a` tile [{}, {}] needs rows a multiple of 16 × num_warps and a k a multiple of 16",
                s.rows, s.cols
            )));
        }
        let fm = s.rows / (16 * self.warps);
        Ok((0..fm).map(|mf| (0..s.cols / 16).map(|ks| self.a_frag_ldmatrix(s, mf, ks)).collect()).collect())
    }

    /// Pack two 16-bit floats into the i32 an mma fragment register holds.
    fn pack2(&self, lo: V, hi: V, dtype: DType) -> V {
        let ir = &self.ir;
        let et = self.compute_ty(dtype);
        let v = ir.insert(ir.undef(ir.vec(et, 2)), lo, 0);
        let v = ir.insert(v, hi, 1);
        ir.bitcast(v, ir.i32())
    }

    /// Round two f32 to a packed 16-bit pair in one instruction (`cvt.rn.bf16x2.f32`).
    fn pack2_f32(&self, lo: V, hi: V, dtype: DType) -> V {
        let ir = &self.ir;
        let v = ir.insert(ir.undef(ir.vec(ir.f32(), 2)), lo, 0);
        let v = ir.insert(v, hi, 1);
        let h = ir.fptrunc(v, ir.vec(self.compute_ty(dtype), 2));
        ir.bitcast(h, ir.i32())
    }

    fn dot(&mut self, op: &'k Op, trans_a: bool, trans_b: bool) -> R<()> {
        if trans_a {
            return Err(self.err("`tile.dot` with trans_a is not supported yet".into()));
        }
        let (av, bv, cv) = (op.operands[0], op.operands[1], op.operands[2]);
        let Type::Tile(adt, ashape) = self.ty(av).clone() else { return Err(self.err("dot operand".into())) };
        let bdt = self.ty(bv).dtype();
        if adt != bdt || !matches!(adt, DType::BF16 | DType::F16) {
            return Err(self.err(format!(
                "`tile.dot` takes bf16 or f16 operands on the PTX targets (got {adt} · {bdt}); f32 runs on the CPU back end"
            )));
        }
        let f16 = adt == DType::F16;
        let (m, k) = (ashape[0], ashape[1]);
        let acc = self.dist(cv)?;
        let Ax::Mma(n) = acc.cols else { return Err(self.err("dot result must have 8 or more columns".into())) };
        if k % 16 != 0 || n % 8 != 0 || m % (16 * self.warps) != 0 {
            return Err(self.err(format!(
                "`tile.dot` [{m}, {k}] · [{k}, {n}] needs m a multiple of 16 × num_warps, k of 16, n of 8"
            )));
        }
        let fm = m / (16 * self.warps);
        let (nn, ks_n) = (n / 8, k / 16);
        // a fragments: [mf][ks] in registers, or read from shared memory per k-step
        // (fewer registers live).
        let mut a_smem: Option<Smem> = None;
        let afr: Vec<Vec<[V; 4]>> = match self.get(av)?.clone() {
            GV::Smem(s) => match &s.afrags {
                Some(f) => f.clone(),
                None => {
                    if !s.rows.is_multiple_of(16 * self.warps) || !s.cols.is_multiple_of(16) {
                        return Err(self.err(format!(
                            "a dot's `a` tile [{}, {}] needs rows a multiple of 16 × num_warps and k of 16",
                            s.rows, s.cols
                        )));
                    }
                    let mut s = s.clone();
                    self.ready(&mut s);
                    a_smem = Some(s);
                    Vec::new()
                }
            },
            _ => {
                // Registers: the accumulator layout of [m, k] (k in 8-column groups);
                // an a fragment for k-step ks is groups 2ks and 2ks+1. A tile just cast
                // from f32 (the softmax probabilities) is rounded pairwise from the f32.
                let from_f32 = match self.du.def(av) {
                    Some(o)
                        if matches!(o.kind, OpKind::Cast { .. }) && self.ty(o.operands[0]).dtype() == DType::F32 =>
                    {
                        Some(o.operands[0])
                    }
                    _ => None,
                };
                let (d, wide) = match from_f32 {
                    Some(src) => (self.dist(src)?, true),
                    None => (self.dist(av)?, false),
                };
                let pack =
                    |cg: &Self, lo: V, hi: V| if wide { cg.pack2_f32(lo, hi, adt) } else { cg.pack2(lo, hi, adt) };
                let nc = Self::ncols(d.cols);
                let mut out = Vec::new();
                for mf in 0..fm {
                    let mut row = Vec::new();
                    for ks in 0..ks_n {
                        let g = |h: usize, grp: usize, j: usize| Self::elem(&d, mf * 2 + h, grp * 2 + j, nc);
                        let (g0, g1) = (2 * ks, 2 * ks + 1);
                        row.push([
                            pack(self, g(0, g0, 0), g(0, g0, 1)),
                            pack(self, g(1, g0, 0), g(1, g0, 1)),
                            pack(self, g(0, g1, 0), g(0, g1, 1)),
                            pack(self, g(1, g1, 0), g(1, g1, 1)),
                        ]);
                    }
                    out.push(row);
                }
                out
            }
        };
        let bs = match self.get(bv)?.clone() {
            GV::Smem(mut s) => {
                self.ready(&mut s);
                s
            }
            _ => self.dist_to_smem(op, 1, bv)?,
        };
        let mut c = acc.e.clone();
        let ncols = Self::ncols(acc.cols);
        if self.wgmma && bs.wgmma_readable() && n <= 256 && m.is_multiple_of(64 * (self.warps / 4)) {
            // A product that starts from a zero tile needs no zeros in registers.
            let c = (!self.is_zero_splat(cv)).then_some(c);
            let c = self.dot_wgmma(f16, (m, n, k), trans_b, &afr, a_smem.as_ref(), &bs, c, ncols)?;
            self.set(op.results[0], GV::Dist(Dist { rows: acc.rows, cols: acc.cols, e: c }));
            // Asynchronous: the result is waited for where it is first read.
            self.wg_pending.push((self.wg_seq, vec![op.results[0]]));
            self.wg_seq += 1;
            return Ok(());
        }
        for ks in 0..ks_n {
            let a_k: Vec<[V; 4]> = match &a_smem {
                Some(sm) => (0..fm).map(|mf| self.a_frag_ldmatrix(sm, mf, ks)).collect(),
                None => afr.iter().map(|row| row[ks]).collect(),
            };
            // b fragments two n-fragments at a time (one ldmatrix.x4), each pair used
            // right away.
            let mut nf = 0;
            while nf < nn {
                let cnt = if nf + 1 < nn { 4 } else { 2 };
                let ir = &self.ir;
                let l8 = ir.and(self.lane, ir.ci32(7));
                let mi = ir.lshr(self.lane, ir.ci32(3)); // matrix index 0..3
                let off = if trans_b {
                    // b tile is [n, k]: rows n, chunks k. Matrix i: n-group i/2, k-half i%2.
                    let row = ir.add(ir.ci32((nf * 8) as i64), ir.add(ir.mul(ir.lshr(mi, ir.ci32(1)), ir.ci32(8)), l8));
                    let chunk = ir.add(ir.ci32((ks * 2) as i64), ir.and(mi, ir.ci32(1)));
                    bs.chunk_off(ir, row, chunk)
                } else {
                    // b tile is [k, n]: rows k, chunks n. Matrix i: k-half i%2, n-group i/2.
                    let row = ir.add(ir.ci32((ks * 16) as i64), ir.add(ir.mul(ir.and(mi, ir.ci32(1)), ir.ci32(8)), l8));
                    let chunk = ir.add(ir.ci32(nf as i64), ir.lshr(mi, ir.ci32(1)));
                    bs.chunk_off(ir, row, chunk)
                };
                let off = ir.add(off, bs.off);
                let r = nvvm::ldmatrix(ir, self.sptr(off), cnt, !trans_b);
                let mut pairs = vec![(nf, [r[0], r[1]])];
                if cnt == 4 {
                    pairs.push((nf + 1, [r[2], r[3]]));
                }
                for (mf, a) in a_k.iter().enumerate() {
                    for (n, b) in &pairs {
                        let at = |h: usize, j: usize| (mf * 2 + h) * ncols + n * 2 + j;
                        let cin = [c[at(0, 0)], c[at(0, 1)], c[at(1, 0)], c[at(1, 1)]];
                        let d = nvvm::mma_m16n8k16(&self.ir, f16, *a, *b, cin);
                        c[at(0, 0)] = d[0];
                        c[at(0, 1)] = d[1];
                        c[at(1, 0)] = d[2];
                        c[at(1, 1)] = d[3];
                    }
                }
                nf += cnt / 2;
            }
        }
        self.set(op.results[0], GV::Dist(Dist { rows: acc.rows, cols: acc.cols, e: c }));
        Ok(())
    }

    /// Whether `v` is a splat of the constant 0.
    fn is_zero_splat(&self, v: Value) -> bool {
        let Some(op) = self.du.def(v) else { return false };
        let OpKind::Splat { .. } = op.kind else { return false };
        matches!(self.du.def(op.operands[0]).map(|c| &c.kind), Some(OpKind::Const { value, .. }) if *value == 0.0)
    }

    /// A dot on Hopper's warpgroup MMA: per 64-row block of this warpgroup and k-step,
    /// one `wgmma.m64n{n}k16` with B (and A when it is in shared memory) read through
    /// descriptors of a wgmma layout (core matrices, or 128-byte swizzled); the
    /// accumulators stay in the mma layout. `c` = None: the product starts from zero.
    /// The group is committed, not waited for: the caller records it as pending.
    #[allow(clippy::too_many_arguments)]
    fn dot_wgmma(
        &mut self,
        f16: bool,
        (m, n, k): (usize, usize, usize),
        trans_b: bool,
        afr: &[Vec<[V; 4]>],
        a_smem: Option<&Smem>,
        bs: &Smem,
        c: Option<Vec<V>>,
        ncols: usize,
    ) -> R<Vec<V>> {
        let fm = m / (16 * self.warps);
        let ks_n = k / 16;
        let groups = self.warps / 4;
        // A: registers (given, or read from a padded tile) or a descriptor.
        let a_regs: Option<Vec<Vec<[V; 4]>>> = match a_smem {
            Some(sm) if sm.wgmma_readable() => None,
            Some(sm) => {
                Some((0..fm).map(|mf| (0..ks_n).map(|ks| self.a_frag_ldmatrix(sm, mf, ks)).collect()).collect())
            }
            None => Some(afr.to_vec()),
        };
        // Accumulators per 64-row block, in wgmma's register order.
        let slot = |mf: usize, j: usize, r: usize| (mf * 2 + r / 2) * ncols + j * 2 + r % 2;
        let mut accs: Option<Vec<Vec<V>>> = c.as_ref().map(|c| {
            (0..fm)
                .map(|mf| {
                    (0..n / 8).flat_map(|j| (0..4).map(move |r| (j, r))).map(|(j, r)| c[slot(mf, j, r)]).collect()
                })
                .collect()
        });
        // wgmma.fence after every register write the MMAs read.
        let mut regs: Vec<V> = accs.as_ref().map(|a| a.concat()).unwrap_or_default();
        if let Some(a) = &a_regs {
            for row in a {
                for f in row {
                    regs.extend_from_slice(f);
                }
            }
        }
        let fenced = nvvm::wgmma_fence(&self.ir, &regs);
        let mut it = fenced.into_iter();
        if let Some(accs) = accs.as_mut() {
            for acc in accs.iter_mut() {
                for x in acc.iter_mut() {
                    *x = it.next().expect("fenced accumulators");
                }
            }
        }
        let a_regs: Option<Vec<Vec<[V; 4]>>> = a_regs.map(|a| {
            a.iter()
                .map(|row| {
                    row.iter()
                        .map(|_| {
                            let mut f = [std::ptr::null_mut(); 4];
                            for x in f.iter_mut() {
                                *x = it.next().expect("fenced fragments");
                            }
                            f
                        })
                        .collect()
                })
                .collect()
        });
        let ir = &self.ir;
        let i32t = ir.i32();
        let b_base = ir.ptr_to_int(self.sptr(bs.off), i32t);
        let sw = bs.layout == SmemLayout::Swizzle128;
        // B [n, k] is K-major; B [k, n] is N-major (transposed by the instruction).
        let b_desc: Vec<V> = (0..ks_n)
            .map(|ks| {
                let (off, lbo, sbo) = match (bs.layout, trans_b) {
                    (SmemLayout::Swizzle128, true) => (ks / 4 * bs.block_bytes() + ks % 4 * 32, 16, 1024),
                    (SmemLayout::Swizzle128, false) => (ks * 2048, bs.block_bytes(), 1024),
                    (_, true) => (ks * 256, 128, bs.group_bytes()),
                    (_, false) => (ks * 2 * bs.group_bytes(), bs.group_bytes(), 128),
                };
                nvvm::wgmma_desc(ir, ir.add(b_base, ir.ci32(off as i64)), lbo, sbo, sw)
            })
            .collect();
        let a_base = a_smem.filter(|s| s.wgmma_readable()).map(|s| (ir.ptr_to_int(self.sptr(s.off), i32t), s));
        let g = ir.lshr(self.warp, ir.ci32(2));
        let mut out: Vec<Vec<V>> = Vec::new();
        for mf in 0..fm {
            let mut acc: Option<Vec<V>> = accs.as_ref().map(|a| a[mf].clone());
            for (ks, bd) in b_desc.iter().enumerate() {
                let ir = &self.ir;
                let a = match (&a_regs, &a_base) {
                    (Some(r), _) => nvvm::WgmmaA::Regs(r[mf][ks]),
                    (None, Some((base, s))) => {
                        // This warpgroup's 64-row block of the K-major tile.
                        let block = ir.add(ir.ci32((mf * groups) as i64), g);
                        let (block_stride, off, lbo, sbo, sw) = match s.layout {
                            SmemLayout::Swizzle128 => {
                                (64 * 128, ks / 4 * s.block_bytes() + ks % 4 * 32, 16, 1024, true)
                            }
                            _ => (8 * s.group_bytes(), ks * 256, 128, s.group_bytes(), false),
                        };
                        let start =
                            ir.add(*base, ir.add(ir.mul(block, ir.ci32(block_stride as i64)), ir.ci32(off as i64)));
                        nvvm::WgmmaA::Desc(nvvm::wgmma_desc(ir, start, lbo, sbo, sw))
                    }
                    (None, None) => return Err(self.err("wgmma: no A operand".into())),
                };
                acc = Some(nvvm::wgmma_m64k16(ir, f16, n, acc.as_deref(), &a, *bd, !trans_b));
            }
            out.push(acc.expect("k >= 16"));
        }
        nvvm::wgmma_commit(&self.ir);
        let mut c = c.unwrap_or_else(|| vec![std::ptr::null_mut(); 2 * fm * ncols]);
        let mut it = out.concat().into_iter();
        for mf in 0..fm {
            for j in 0..n / 8 {
                for r in 0..4 {
                    c[slot(mf, j, r)] = it.next().expect("wgmma accumulators");
                }
            }
        }
        Ok(c)
    }

    /// Wait for the pending warpgroup MMA groups up to and including `upto` (they
    /// complete in order): `wgmma.wait_group` with the number of newer groups, tied
    /// through the accumulators it makes final.
    fn wg_wait(&mut self, upto: usize) -> R<()> {
        let newer = self.wg_pending.len() - 1 - upto;
        let done: Vec<(u64, Vec<Value>)> = self.wg_pending.drain(..=upto).collect();
        let values: Vec<Value> = done.into_iter().flat_map(|(_, vs)| vs).collect();
        let mut regs = Vec::new();
        for v in &values {
            match self.get(*v)? {
                GV::Dist(d) => regs.extend_from_slice(&d.e),
                _ => return Err(self.err(format!("pending product %{} is not a register tile", v.index()))),
            }
        }
        let waited = nvvm::wgmma_wait(&self.ir, newer, &regs);
        let mut it = waited.into_iter();
        for v in values {
            if let Some(GV::Dist(d)) = self.vals[v.index()].as_mut() {
                for x in d.e.iter_mut() {
                    *x = it.next().expect("waited accumulators");
                }
            }
        }
        Ok(())
    }

    /// Make the pending products among `used` final (and every older one).
    fn wg_resolve(&mut self, used: &[Value]) -> R<()> {
        let newest = self.wg_pending.iter().rposition(|(_, vs)| vs.iter().any(|v| used.contains(v)));
        match newest {
            Some(i) => self.wg_wait(i),
            None => Ok(()),
        }
    }

    fn wg_resolve_all(&mut self) -> R<()> {
        match self.wg_pending.len() {
            0 => Ok(()),
            n => self.wg_wait(n - 1),
        }
    }

    /// For an `scf.if` at `i` followed, with only scalar arithmetic between, by an
    /// `scf.for` with prefetched loads (at `j`): `Some(j)` when the loop's bounds and
    /// loads do not depend on the `if` nor the ops between depend on it.
    fn loop_after(&self, b: &'k Block, i: usize) -> Option<usize> {
        let op = &b.ops[i];
        if !matches!(op.kind, OpKind::If) || self.stages < 2 {
            return None;
        }
        let results: HashSet<Value> = op.results.iter().copied().collect();
        let mut j = i + 1;
        while j < b.ops.len() {
            let o = &b.ops[j];
            if matches!(o.kind, OpKind::For) {
                break;
            }
            let scalar = is_scalar_arith(o) && o.results.iter().all(|r| matches!(self.ty(*r), Type::Scalar(_)));
            if !scalar || o.operands.iter().any(|v| results.contains(v)) {
                return None;
            }
            j += 1;
        }
        let lp = b.ops.get(j)?;
        if lp.operands[..3].iter().any(|v| results.contains(v)) {
            return None;
        }
        let loads = self.prefetchable(lp);
        if loads.is_empty() || loads.iter().any(|l| l.operands.iter().any(|v| results.contains(v))) {
            return None;
        }
        Some(j)
    }

    /// Before lowering `op`: wait for the pending products it reads. An op with
    /// regions waits for every value its regions read, and for everything when they
    /// issue products of their own (the count of groups in flight must not depend on
    /// the branch taken).
    fn wg_before(&mut self, op: &Op) -> R<()> {
        if self.wg_pending.is_empty() {
            return Ok(());
        }
        if op.regions.is_empty() {
            return self.wg_resolve(&op.operands);
        }
        let mut used = Vec::new();
        let mut dots = false;
        fn walk(op: &Op, used: &mut Vec<Value>, dots: &mut bool) {
            used.extend(&op.operands);
            *dots |= matches!(op.kind, OpKind::Dot { .. });
            for r in &op.regions {
                for o in &r.ops {
                    walk(o, used, dots);
                }
            }
        }
        walk(op, &mut used, &mut dots);
        if dots {
            self.wg_resolve_all()
        } else {
            self.wg_resolve(&used)
        }
    }

    // ---------------------------------------------------------------- control flow

    /// The LLVM values a register value is made of (for phis), and a rebuild.
    fn flatten(&mut self, v: Value) -> R<(Vec<V>, Shape)> {
        match self.get(v)?.clone() {
            GV::Scalar(x) => Ok((vec![x], Shape::Scalar)),
            GV::Dist(d) => Ok((d.e.clone(), Shape::Dist(d.rows, d.cols))),
            GV::Smem(_) => {
                let d = self.dist(v)?;
                Ok((d.e.clone(), Shape::Dist(d.rows, d.cols)))
            }
            GV::Lazy => {
                let d = self.dist(v)?;
                Ok((d.e.clone(), Shape::Dist(d.rows, d.cols)))
            }
            GV::Tensor(_) => Err(self.err("tensors cannot be loop-carried".into())),
        }
    }

    /// The layout a value of type `v` has in registers, and across region boundaries:
    /// 16-bit float tiles cross them as pairs packed in 32-bit registers (half the phis;
    /// the pairs a `dot` operand is made of).
    fn shape_of(&self, v: Value) -> R<Shape> {
        match self.ty(v) {
            Type::Scalar(_) => Ok(Shape::Scalar),
            Type::Tile(d, _) => {
                let (r, c) = self.axes_of(v)?;
                let n = self.nrows(r) * Self::ncols(c);
                if matches!(d, DType::BF16 | DType::F16) && n.is_multiple_of(2) {
                    Ok(Shape::Packed(r, c, *d))
                } else {
                    Ok(Shape::Dist(r, c))
                }
            }
            Type::Tensor(..) => Err(self.err("tensors cannot be loop-carried".into())),
        }
    }

    fn shape_len(&self, s: Shape) -> usize {
        match s {
            Shape::Scalar => 1,
            Shape::Dist(r, c) => self.nrows(r) * Self::ncols(c),
            Shape::Packed(r, c, _) => self.nrows(r) * Self::ncols(c) / 2,
        }
    }

    fn rebuild(&self, s: Shape, xs: Vec<V>) -> GV {
        match s {
            Shape::Scalar => GV::Scalar(xs[0]),
            Shape::Dist(rows, cols) => GV::Dist(Dist { rows, cols, e: xs }),
            Shape::Packed(rows, cols, dtype) => {
                let ir = &self.ir;
                let pair = ir.vec(self.compute_ty(dtype), 2);
                let mut e = Vec::with_capacity(2 * xs.len());
                for x in xs {
                    let v = ir.bitcast(x, pair);
                    e.push(ir.extract(v, 0));
                    e.push(ir.extract(v, 1));
                }
                GV::Dist(Dist { rows, cols, e })
            }
        }
    }

    /// Flatten `v` into exactly the layout `want` (broadcast tiles are expanded).
    fn flatten_as(&mut self, v: Value, want: Shape) -> R<Vec<V>> {
        if let Shape::Packed(r, c, dtype) = want {
            let e = self.flatten_as(v, Shape::Dist(r, c))?;
            return Ok(e.chunks(2).map(|p| self.pack2(p[0], p[1], dtype)).collect());
        }
        let (xs, have) = self.flatten(v)?;
        if have == want {
            return Ok(xs);
        }
        match (have, want) {
            (Shape::Dist(hr, hc), Shape::Dist(wr, wc)) => {
                let d = Dist { rows: hr, cols: hc, e: xs };
                let (nr, nc) = (self.nrows(wr), Self::ncols(wc));
                let mut out = Vec::new();
                for ri in 0..nr {
                    for ci in 0..nc {
                        out.push(Self::elem(&d, ri, ci, nc));
                    }
                }
                Ok(out)
            }
            (Shape::Scalar, Shape::Dist(..)) => Ok(vec![xs[0]; self.shape_len(want)]),
            _ => Err(self.err(format!("%{} changes layout across a region boundary", v.index()))),
        }
    }

    /// The shared-memory loads of a loop body worth prefetching: at the body's top level,
    /// indexed by values from outside the loop and the induction variable, or scalar
    /// arithmetic of those (`j + s`).
    fn prefetchable(&self, op: &'k Op) -> Vec<&'k Op> {
        if self.stages < 2 {
            return Vec::new();
        }
        let region = &op.regions[0];
        let iv = region.args[0];
        let inside = defined_in(region);
        region
            .ops
            .iter()
            .filter(|o| matches!(o.kind, OpKind::Load { .. }) && self.plan.smem_loads.contains(&o.results[0]))
            .filter(|o| o.operands.iter().all(|x| self.du.iteration_scalar(self.kernel, *x, iv, &inside)))
            .collect()
    }

    /// A loop's software-pipeline prologue: its buffers, and the copies of the first
    /// `stages - 1` iterations' prefetched tiles, issued. Needs only the loop's bounds
    /// (not its carried values), so [`Self::block`] may issue it before the op that
    /// computes those (the prologue `scf.if` of `pipeline-dots`).
    fn for_prologue(&mut self, op: &'k Op) -> R<PipePrologue<'k>> {
        let lo = self.scalar(op.operands[0])?;
        let hi = self.scalar(op.operands[1])?;
        let step = self.scalar(op.operands[2])?;
        let region = &op.regions[0];
        // Shared memory allocated for the loop (its pipeline buffers, the tiles of its
        // body) is free again after it: tiles never outlive their region, and every
        // later writer starts at a barrier.
        let smem_top = self.smem_top;
        // ---- software pipeline: buffers, and the first `stages - 1` iterations' copies
        let pf_ops = self.prefetchable(op);
        let st = self.stages;
        let mut pf_info = Vec::new();
        let mut fast = self.ir.ctrue();
        for o in &pf_ops {
            let acc = self.load_access(o, Some((region.args[0], lo)))?;
            let (rows, cols, dtype) = self.smem_shape(o, &acc)?;
            let tmpl = Smem::new(rows, cols, dtype, self.smem_layout(o.results[0], cols, dtype), self.ir.ci32(0));
            let stride = tmpl.bytes().div_ceil(tmpl.align()) * tmpl.align();
            let base = self.region(o, 0, stride * st, tmpl.align());
            let t = self.tensor_of(o.operands[0])?;
            let OpKind::Load { pad, .. } = o.kind else { continue };
            let f = self.smem_fast(t, &acc, dtype.size_bytes() as i64, pad);
            fast = self.ir.and(fast, f);
            // A stream that an epilogue continues (`pipeline-dots`) is copied one
            // iteration further: the epilogue finds its tile in the ring.
            let hi = if self.stream_next.contains_key(&o.results[0]) { self.ir.add(hi, step) } else { hi };
            pf_info.push(PfLoad { op: o, tensor: t, tmpl, base, stride, hi });
        }
        let tma = pf_ops.iter().filter(|o| self.tma_index(o.results[0]).is_some()).count();
        if tma > 0 && tma < pf_ops.len() {
            return Err(self.err("a loop mixes tiles the producer copies with tiles it does not".into()));
        }
        if tma > 0 {
            // The producer copies every tile of the loop.
            return Ok(PipePrologue { smem_top, pf_info, fast: self.ir.ctrue() });
        }
        if !pf_ops.is_empty() {
            let fb = self.ir.block("pipe.prologue");
            let jb = self.ir.block("pipe.prologue.done");
            self.ir.cond_br(fast, fb, jb);
            self.ir.at_end(fb);
            // The shared memory may still be read by an earlier part of the program.
            self.sync();
            for k in 0..st - 1 {
                let ivk = self.ir.add(lo, self.ir.mul(step, self.ir.ci32(k as i64)));
                let iv_value = region.args[0];
                for l in pf_info.clone() {
                    let more = self.ir.icmp(LLVMIntSLT, ivk, l.hi);
                    self.if_then(more, &mut |cg| {
                        let acc = cg.load_access(l.op, Some((iv_value, ivk)))?;
                        let dst = Smem { off: cg.ir.ci32((l.base + k * l.stride) as i64), ..l.tmpl.clone() };
                        cg.issue_cp_async(l.tensor, &acc, &dst)
                    })?;
                    // One group per load and iteration, copied or not: the counts the
                    // loop's waits rely on stay uniform.
                    nvvm::cp_async_commit(&self.ir);
                }
            }
            self.ir.br(jb);
            self.ir.at_end(jb);
            // Tiles copied before the loop and kept as fragments: their copies are the
            // oldest groups, so waiting for all but the prologue's is waiting for them.
            if self.depth == 0 && self.ir.is_true(fast) && !self.pending_afrags.is_empty() {
                nvvm::cp_async_wait(&self.ir, ((st - 1) * pf_ops.len()) as i64);
                self.sync();
                for v in std::mem::take(&mut self.pending_afrags) {
                    if let GV::Smem(mut sm) = self.get(v)?.clone() {
                        sm.afrags = Some(self.a_frags_from_smem(&sm)?);
                        sm.pending = false;
                        self.set(v, GV::Smem(sm));
                    }
                }
            }
        }
        Ok(PipePrologue { smem_top, pf_info, fast })
    }

    fn for_op(&mut self, op: &'k Op) -> R<()> {
        let pro = match self.early_prologues.remove(&(op as *const Op as usize)) {
            Some(p) => p,
            None => self.for_prologue(op)?,
        };
        let PipePrologue { smem_top, pf_info, fast } = pro;
        let lo = self.scalar(op.operands[0])?;
        let hi = self.scalar(op.operands[1])?;
        let step = self.scalar(op.operands[2])?;
        let region = &op.regions[0];
        let st = self.stages;
        let n = op.results.len();
        let shapes: Vec<Shape> = op.results.iter().map(|r| self.shape_of(*r)).collect::<R<_>>()?;
        let mut inits = Vec::new();
        for (i, s) in shapes.iter().enumerate() {
            inits.push(self.flatten_as(op.operands[3 + i], *s)?);
        }

        let tma_loop = pf_info.iter().any(|l| self.tma_index(l.op.results[0]).is_some());
        if tma_loop {
            nvvm::cp_async_wait(&self.ir, 0);
            nvvm::fence_proxy_async(&self.ir);
            self.sync();
        }
        // Ping-pong (two consumer warpgroups of a warp-specialised loop; EJC_PTX_PINGPONG=0
        // turns it off, for comparisons): the warpgroups take turns issuing the body's
        // products (named barriers 2 and 3), so one's softmax runs while the other's
        // products occupy the tensor cores. Warpgroup 0 goes first.
        let dots: Vec<usize> = region
            .ops
            .iter()
            .filter(|o| matches!(o.kind, OpKind::Dot { .. }))
            .map(|o| o as *const Op as usize)
            .collect();
        let pingpong = tma_loop
            && self.warps == 8
            && !dots.is_empty()
            && std::env::var("EJC_PTX_PINGPONG").map_or(true, |v| v != "0");
        if pingpong {
            let g = self.ir.lshr(self.warp, self.ir.ci32(2));
            let n = self.ir.ci32((self.warps * 32) as i64);
            let wg1 = self.ir.icmp(LLVMIntEQ, g, self.ir.ci32(1));
            // No iteration: nobody waits, so nobody may arrive.
            let any = self.ir.and(wg1, self.ir.icmp(LLVMIntSLT, lo, hi));
            self.if_then(any, &mut |cg| {
                cg.ir.call_intrinsic("llvm.nvvm.barrier.cta.arrive.aligned.count", &[], &[cg.ir.ci32(2), n]);
                Ok(())
            })?;
        }
        let pre = self.ir.current();
        let head = self.ir.block("for.head");
        let body = self.ir.block("for.body");
        let exit = self.ir.block("for.exit");
        self.ir.br(head);
        self.ir.at_end(head);
        let iv = self.ir.phi(self.ir.i32());
        self.ir.add_incoming(iv, lo, pre);
        let counter = self.ir.phi(self.ir.i32());
        self.ir.add_incoming(counter, self.ir.ci32(0), pre);
        let mut phis = Vec::new();
        for init in inits.iter() {
            let ps: Vec<V> = init
                .iter()
                .map(|x| {
                    let p = self.ir.phi(self.ir.type_of(*x));
                    self.ir.add_incoming(p, *x, pre);
                    p
                })
                .collect();
            phis.push(ps);
        }
        let cond = self.ir.icmp(LLVMIntSLT, iv, hi);
        self.ir.cond_br(cond, body, exit);
        self.ir.at_end(body);
        self.set(region.args[0], GV::Scalar(iv));
        for i in 0..n {
            self.set(region.args[1 + i], self.rebuild(shapes[i], phis[i].clone()));
        }
        let saved = std::mem::take(&mut self.prefetch);
        let p = pf_info.len();
        for l in &pf_info {
            self.prefetch.insert(
                l.op as *const Op as usize,
                Prefetch {
                    op: l.op,
                    iv_value: region.args[0],
                    iv,
                    step,
                    hi: l.hi,
                    counter,
                    fast,
                    base: l.base,
                    stride: l.stride,
                    in_flight: (st - 1) * p - 1,
                    tma: self.tma_index(l.op.results[0]),
                },
            );
        }
        self.depth += 1;
        let saved_pingpong = self.pingpong.take();
        if pingpong {
            let last = self.ir.icmp(LLVMIntSGE, self.ir.add(iv, step), hi);
            self.pingpong = Some((dots[0], dots[dots.len() - 1], last));
        }
        let covered = std::mem::replace(&mut self.covered, false);
        if tma_loop {
            // Copies committed before the loop (the query tile) are complete and visible
            // from here on: waited for once, before the loop's first iteration (below,
            // at the end of the loop's entry block).
            self.covered = true;
        }
        let inside = defined_in(region);
        self.loop_values.push(inside);
        let r = self.block(region);
        self.loop_values.pop();
        self.pingpong = saved_pingpong;
        self.covered = covered;
        self.depth -= 1;
        self.prefetch = saved;
        r?;
        let yields = region.ops.last().map(|y| y.operands.clone()).unwrap_or_default();
        let mut nexts = Vec::new();
        for i in 0..n {
            nexts.push(self.flatten_as(yields[i], shapes[i])?);
        }
        // The iteration's products are complete (its yield waited for them): its tiles
        // go back to the producer.
        for l in &pf_info {
            if let Some(li) = self.tma_index(l.op.results[0]) {
                let slot = self.ir.urem(counter, self.ir.ci32(st as i64));
                let (_, empty) = self.tma_bars(li, slot);
                nvvm::mbarrier_arrive(&self.ir, empty);
            }
        }
        let next_iv = self.ir.add(iv, step);
        let next_counter = self.ir.add(counter, self.ir.ci32(1));
        let latch = self.ir.current();
        self.ir.add_incoming(iv, next_iv, latch);
        self.ir.add_incoming(counter, next_counter, latch);
        for (ps, xs) in phis.iter().zip(&nexts) {
            for (p, x) in ps.iter().zip(xs) {
                self.ir.add_incoming(*p, *x, latch);
            }
        }
        self.ir.br(head);
        self.ir.at_end(exit);
        if !pf_info.is_empty() {
            // Nothing may still be copying into shared memory after the loop.
            nvvm::cp_async_wait(&self.ir, 0);
        }
        // The tiles the epilogue continues with: the `counter`-th of their ring.
        for l in &pf_info {
            if let Some(epi) = self.stream_next.get(&l.op.results[0]).copied() {
                let ir = &self.ir;
                let slot = ir.urem(counter, ir.ci32(st as i64));
                let off = ir.add(ir.ci32(l.base as i64), ir.mul(slot, ir.ci32(l.stride as i64)));
                let bar = self.tma_index(l.op.results[0]).map(|li| {
                    let (full, _) = self.tma_bars(li, slot);
                    let ir = &self.ir;
                    (full, ir.and(ir.udiv(counter, ir.ci32(st as i64)), ir.ci32(1)))
                });
                self.epilogue_tiles.insert(epi, (Smem { off, ..l.tmpl.clone() }, fast, bar));
            }
        }
        self.smem_top = smem_top;
        for i in 0..n {
            self.set(op.results[i], self.rebuild(shapes[i], phis[i].clone()));
        }
        Ok(())
    }

    fn if_op(&mut self, op: &'k Op) -> R<()> {
        let cond = self.scalar(op.operands[0])?;
        // Like loops, branches give their shared memory back.
        let smem_top = self.smem_top;
        let shapes: Vec<Shape> = op.results.iter().map(|r| self.shape_of(*r)).collect::<R<_>>()?;
        let tb = self.ir.block("if.then");
        let eb = self.ir.block("if.else");
        let jb = self.ir.block("if.join");
        self.ir.cond_br(cond, tb, eb);
        let mut arms: Vec<(B, Vec<Vec<V>>)> = Vec::new();
        for (bb, region) in [(tb, &op.regions[0]), (eb, &op.regions[1])] {
            self.ir.at_end(bb);
            // The arms exclude each other: they share the same shared memory.
            self.smem_top = smem_top;
            self.block(region)?;
            let yields = region.ops.last().map(|y| y.operands.clone()).unwrap_or_default();
            let mut vals = Vec::new();
            for (i, s) in shapes.iter().enumerate() {
                vals.push(self.flatten_as(yields[i], *s)?);
            }
            arms.push((self.ir.current(), vals));
            self.ir.br(jb);
        }
        self.ir.at_end(jb);
        // Every phi first (they head the block), then the values built from them.
        let mut phis = Vec::new();
        for i in 0..shapes.len() {
            let mut xs = Vec::new();
            for j in 0..arms[0].1[i].len() {
                let t = self.ir.type_of(arms[0].1[i][j]);
                let p = self.ir.phi(t);
                for (bb, vals) in &arms {
                    self.ir.add_incoming(p, vals[i][j], *bb);
                }
                xs.push(p);
            }
            phis.push(xs);
        }
        for (i, (s, xs)) in shapes.iter().zip(phis).enumerate() {
            self.set(op.results[i], self.rebuild(*s, xs));
        }
        self.smem_top = smem_top;
        Ok(())
    }
}

/// A prefetched load of a loop: the op, its tensor, its tile's template, the first
/// buffer of its ring and the distance between buffers, and the (exclusive) bound of the
/// induction variable up to which its tiles are copied.
#[derive(Clone)]
struct PfLoad<'k> {
    op: &'k Op,
    tensor: usize,
    tmpl: Smem,
    base: usize,
    stride: usize,
    hi: V,
}

/// What [`Lowering::for_prologue`] set up for a loop: the shared-memory top to restore
/// after it, the prefetched loads, and whether they all take the `cp.async` path (i1).
struct PipePrologue<'k> {
    smem_top: usize,
    pf_info: Vec<PfLoad<'k>>,
    fast: V,
}

/// A load of a loop body that is copied `stages - 1` iterations ahead.
#[derive(Clone, Copy)]
struct Prefetch<'k> {
    op: &'k Op,
    /// The loop's induction variable (IR value) and its current value.
    iv_value: Value,
    iv: V,
    step: V,
    hi: V,
    /// Iterations done so far (i32): selects the buffer.
    counter: V,
    /// Whether every prefetched load of the loop takes the cp.async path (uniform).
    fast: V,
    /// First buffer's byte offset and the distance between buffers.
    base: usize,
    stride: usize,
    /// Copy groups that may still be in flight when this load's group must be done.
    in_flight: usize,
    /// The producer copies this load's tiles (warp specialisation): its index.
    tma: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    Scalar,
    Dist(Ax, Ax),
    /// A 16-bit float register tile as packed pairs.
    Packed(Ax, Ax, DType),
}

#[derive(Clone, Copy, Debug)]
struct RangeAx {
    axis: usize,
    /// i64
    start: V,
    limit: Option<V>,
    #[allow(dead_code)]
    size: usize,
}

struct Access {
    /// Element offset (i64) of the fixed indices.
    off: V,
    /// i1: the fixed indices are inside the tensor.
    valid: V,
    ranges: Vec<RangeAx>,
    /// Per tensor axis: the index, or the range's start (i32).
    coords: Vec<V>,
}
