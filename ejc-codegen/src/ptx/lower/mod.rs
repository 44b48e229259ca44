//! Tile IR → LLVM IR for NVPTX (one thread's program; `sm_80` instructions), following
//! the schedule of [`super::schedule`]. This file holds the lowering's state, the entry,
//! the op dispatch and element-wise ops; the rest is split by concern: [`layouts`]
//! (register tiles), [`memory`] (global loads and stores), [`smem`] (shared memory, copies,
//! rings), [`reduce`] (reductions, softmax), [`mma`] (products and their waits),
//! [`control`] (loops with their software pipeline, branches), [`producer`] (the
//! warp-specialised entry).
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

use ejc_ir::defuse::{defined_in, is_scalar_arith, DefUse, OpId};
use ejc_ir::ir::{AxisIndex, Block, Kernel, Op, OpKind, ReduceOp, UnOp, Value};
use ejc_ir::types::{DType, Type};
use llvm_sys::LLVMIntPredicate::*;
use llvm_sys::LLVMRealPredicate::*;

use super::layout::{Orient, Plan};
use super::nvvm;
use super::schedule::{self, AOperand, BOperand, Copier, MmaPath, Schedule, SmemLayout};
use crate::arith::Arith;
use crate::llvm::{Ir, B, T, V};
use crate::math;
use crate::CodegenError;

mod control;
mod layouts;
mod memory;
mod mma;
mod producer;
mod reduce;
mod smem;

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
    /// the exponent: `ejc_ir::passes::scale_fold`).
    pub positive_scalars: Vec<String>,
    /// Warp-specialised: the aligned entry's tensor-map parameters (after the ABI's),
    /// one per load the producer copies.
    pub tensor_maps: Vec<super::ws::TmaLoad>,
    /// The schedule each entry followed ([`Schedule::render`]). Not kept in the
    /// compiled-code cache (`super::schedules` makes it).
    #[serde(skip, default)]
    pub schedules: Vec<schedule::EntrySchedule>,
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
    /// The dynamic shared memory's regions ([`smem::SmemAlloc`]).
    alloc: smem::SmemAlloc,
    /// Pipeline depth for loads in loops (1 = none).
    stages: usize,
    /// Loop nesting depth at the op being lowered.
    depth: usize,
    /// The values defined inside each enclosing loop (region arguments included),
    /// innermost last: what a register tile's access window may not depend on to be
    /// addressed as a moving window (see [`Self::window_moves`]).
    loop_values: Vec<HashSet<Value>>,
    /// Loads of the loop being lowered that are prefetched.
    prefetch: HashMap<OpId, Prefetch<'k>>,
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
    /// `tanh` as the hardware's `tanh.approx.f32`: the kernel's tolerance is a 16-bit
    /// type's ([`ejc_ir::op::kernel_tolerance`]).
    fast_tanh: bool,
    /// In a loop body after a pipelined load's wait and barrier (cp.async only): every
    /// copy committed before the loop is complete and visible.
    covered: bool,
    /// Tiles loaded before a loop whose `a` fragments stay in registers, copied without
    /// waiting (aligned entry): their fragments are read after the next loop's prologue
    /// has issued its copies, so the copies overlap.
    pending_afrags: Vec<Value>,
    /// Warpgroup MMA groups committed and not yet waited for ([`mma::WgQueue`]).
    wg: mma::WgQueue,
    /// Loop prologues issued ahead of the loop: see [`Self::block`].
    early_prologues: HashMap<OpId, PipePrologue<'k>>,
    /// Loads of a loop whose tile stream an epilogue load continues (`pipeline-dots`'s
    /// [`ejc_ir::passes::Rotation`]): loop load → epilogue load.
    stream_next: HashMap<Value, Value>,
    /// Epilogue loads whose tile the loop's ring already holds (after the loop): the
    /// tile, and whether the loop took the `cp.async` path (i1; else it was not copied).
    epilogue_tiles: HashMap<Value, EpilogueTile>,
    /// Warp specialisation (`CodePath::WarpSpecialised`): a producer warpgroup follows the
    /// `warps` consumer warps; consumers synchronise with a named barrier.
    ws: Option<WsLowering>,
    /// Lowering the producer's program (scalars and bulk tensor copies only).
    producer: bool,
    /// Ping-pong of two consumer warpgroups in a warp-specialised loop body: the first
    /// and last product of the body, and whether this is the last iteration (i1). See
    /// [`Self::for_op`].
    pingpong: Option<(OpId, OpId, V)>,
    /// The schedule this entry follows (made by [`Self::run`], once warp specialisation
    /// is known).
    sched: Schedule,
    /// The tile streams that epilogue loads continue: (epilogue load, loop load).
    streams: Vec<(Value, Value)>,
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
        aligned: bool,
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
            alloc: Default::default(),
            stages: stages.max(1),
            depth: 0,
            loop_values: Vec::new(),
            prefetch: HashMap::new(),
            wgmma,
            dot_only,
            assume_aligned: aligned,
            aligned_tensors: Default::default(),
            fast_tanh: ejc_ir::op::kernel_tolerance(kernel) >= ejc_ir::op::tolerance(DType::F16),
            covered: false,
            pending_afrags: Vec::new(),
            wg: Default::default(),
            early_prologues: HashMap::new(),
            stream_next: streams.iter().map(|(epi, in_loop)| (*in_loop, *epi)).collect(),
            epilogue_tiles: HashMap::new(),
            ws: None,
            producer: false,
            pingpong: None,
            sched: Schedule::default(),
            streams: streams.to_vec(),
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
        SmemLayout::for_tile(cols, dtype, self.wgmma && self.dot_only.contains(&v))
    }

    /// The warps a register tile of `rows` rows is spread over: every warp, or — a tile
    /// of fewer than 16 × num_warps rows (a decode step's few query rows) — one 16-row
    /// fragment for each of the first `rows / 16` warps, which the others replicate
    /// (warp w holds warp `w mod (rows / 16)`'s rows; only the first ones write them).
    pub(super) fn row_warps(&self, rows: usize) -> usize {
        if rows < 16 * self.warps {
            (rows / 16).max(1)
        } else {
            self.warps
        }
    }

    /// Whether this warp writes the rows it holds of a tile of `rows` rows (`false` in
    /// the warps that replicate another's: [`Self::row_warps`]).
    pub(super) fn row_owner(&self, rows: usize) -> V {
        let ir = &self.ir;
        match self.row_warps(rows) {
            w if w == self.warps => ir.ctrue(),
            w => ir.icmp(LLVMIntULT, self.warp, ir.ci32(w as i64)),
        }
    }

    /// Row (i32, within the tile) of the first of the 16 rows of m-fragment `mf` of this
    /// warp, for tiles of `rows` rows.
    fn mfrag_row0(&self, rows: usize, mf: usize) -> V {
        let ir = &self.ir;
        if rows < 16 * self.warps {
            // Replicated (`row_warps`): one fragment per warp.
            let w = self.row_warps(rows);
            return ir.mul(ir.urem(self.warp, ir.ci32(w as i64)), ir.ci32(16));
        }
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
        let tma: Vec<Value> = self.ws.as_ref().map(|w| w.tma.iter().map(|t| t.load).collect()).unwrap_or_default();
        let inputs = schedule::Inputs {
            warps: self.warps,
            stages: self.stages,
            wgmma: self.wgmma,
            tma: &tma,
            streams: &self.streams,
            pingpong: std::env::var("EJC_PTX_PINGPONG").map_or(true, |v| v != "0"),
        };
        self.sched = schedule::plan(self.kernel, &self.du, &self.plan, &inputs).map_err(|m| self.err(m))?;
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
            self.planned_waits(None)?;
            self.ir.ret_void();
        }
        let names: Vec<String> =
            self.kernel.params.iter().filter(|p| matches!(p.ty, Type::Tensor(..))).map(|p| p.name.clone()).collect();
        Ok(PtxCode {
            entry: self.kernel.name.clone(),
            smem_bytes: self.alloc.bytes(),
            threads: (self.warps + self.ws.as_ref().map_or(0, |w| w.producer_warps)) * 32,
            aligned_tensors: self.aligned_tensors.iter().map(|t| names[*t].clone()).collect(),
            aligned_entry: None,
            positive_scalars: Vec::new(),
            tensor_maps: self.ws.as_ref().map(|w| w.tma.clone()).unwrap_or_default(),
            schedules: vec![schedule::EntrySchedule {
                entry: self.kernel.name.clone(),
                schedule: self.sched.render(self.kernel),
                ir: ejc_ir::print::print_kernel_with_ids(self.kernel),
            }],
        })
    }

    fn block(&mut self, b: &'k Block) -> R<()> {
        let mut done = HashSet::new();
        for (i, op) in b.ops.iter().enumerate() {
            if done.contains(&i) {
                continue;
            }
            let id = self.du.id(op);
            if let Some(lp) = self.sched.hoists.get(&id).copied() {
                // The copies of the loop's first tiles start before this op (the
                // prologue of `pipeline-dots`, which computes the loop's first carried
                // values): both wait for memory at once. The scalar ops between give the
                // loop's bounds.
                let j = (i + 1..b.ops.len())
                    .find(|j| self.du.id(&b.ops[*j]) == lp)
                    .ok_or_else(|| self.err(format!("schedule: loop {lp} does not follow {id}")))?;
                for k in i + 1..j {
                    self.planned_waits(Some(self.du.id(&b.ops[k])))?;
                    self.op(&b.ops[k])?;
                    done.insert(k);
                }
                let pro = self.for_prologue(&b.ops[j])?;
                self.early_prologues.insert(lp, pro);
            }
            self.planned_waits(Some(id))?;
            if !matches!(op.kind, OpKind::Yield) {
                self.op(op)?;
            }
        }
        Ok(())
    }

    fn set(&mut self, v: Value, g: GV) {
        self.vals[v.index()] = Some(g);
    }

    fn get(&self, v: Value) -> R<&GV> {
        if let Some(id) = self.wg.holding(v) {
            // The schedule's waits come before every read of a product.
            return Err(
                self.err(format!("internal error: %{} (product {id}) is read while still in flight", v.index()))
            );
        }
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
            OpKind::Store { axes, accumulate } => self.store(op, axes, *accumulate)?,
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
                let me = self.du.id(op);
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
            // Scalar f32 math with the GPU's special-function unit (one element per
            // call on this back end).
            OpKind::Unary(u @ (UnOp::Tanh | UnOp::Exp2 | UnOp::Exp))
                if dtypes[0] == DType::F32 && self.ir.lanes(xs[0]) == 1 =>
            {
                let x = xs[0];
                match u {
                    UnOp::Tanh => nvvm::tanh(&self.ir, x, self.fast_tanh),
                    UnOp::Exp2 => nvvm::ex2(&self.ir, x),
                    _ => nvvm::ex2(&self.ir, self.ir.fmul(x, self.ir.cf32(std::f64::consts::LOG2_E))),
                }
            }
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
