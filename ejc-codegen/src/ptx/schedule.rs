//! The PTX back end's schedule, decided before any code is emitted: which instruction
//! path each product takes and where its operands live, which loads each loop copies
//! ahead (and by which engine), which loop prologues are issued early, where two
//! warpgroups take turns (ping-pong), and where Hopper's asynchronous products are
//! waited for.
//!
//! [`plan`] computes it from the kernel, the layout plan ([`super::layout`]) and the
//! configuration; the emitter ([`super::lower`]) follows it and checks that the operands
//! it builds are the ones planned (a disagreement is an internal error, never silently
//! different code). Ops are named by their [`OpId`] (`#n`, pre-order), so the plan can
//! be printed ([`Schedule::render`]), compared and snapshot-tested:
//! `EJC_DUMP_SCHEDULE=<dir>` writes each entry's schedule when a kernel is compiled, and
//! `ejc-codegen/tests/ptx.rs` (`the_schedules_are_pinned`) pins them for the flash kernels on every
//! code path.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;

use ejc_ir::defuse::{defined_in, is_scalar_arith, DefUse, OpId};
use ejc_ir::ir::{Block, Kernel, Op, OpKind, Value};
use ejc_ir::types::{DType, Type};

use super::layout::Plan;

/// How a shared-memory tile is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SmemLayout {
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

impl SmemLayout {
    /// The layout of a tile that only `wgmma` reads (`for_wgmma`), or `ldmatrix` too.
    pub fn for_tile(cols: usize, dtype: DType, for_wgmma: bool) -> SmemLayout {
        if !for_wgmma || !cols.is_multiple_of(8) {
            SmemLayout::Padded
        } else if (cols * dtype.size_bytes()).is_multiple_of(128) {
            SmemLayout::Swizzle128
        } else {
            SmemLayout::CoreMatrix
        }
    }

    fn name(self) -> &'static str {
        match self {
            SmemLayout::Padded => "padded",
            SmemLayout::CoreMatrix => "core-matrix",
            SmemLayout::Swizzle128 => "swizzle-128",
        }
    }
}

/// The instructions a product runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmaPath {
    /// `mma.sync.m16n8k16` per warp (sm_80 and later), synchronous.
    MmaSync,
    /// Hopper's warpgroup MMA, `wgmma.mma_async` (sm_90a): committed, and waited for
    /// where [`Schedule::waits`] says.
    Wgmma,
    /// f32 operands, on the CUDA cores (`fma.rn.f32`): tensor cores take 16-bit operands
    /// and tf32 would miss f32's tolerance. Both operands are staged to shared memory.
    Fma,
}

/// Where a product's `a` operand comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AOperand {
    /// A register tile (the softmax probabilities): accumulator fragment pairs.
    Registers,
    /// A shared-memory tile read into registers once, at its load (a small query tile).
    Fragments,
    /// Shared memory at every use: `ldmatrix` when padded, a descriptor for `wgmma`.
    Shared(SmemLayout),
    /// A register tile stored to shared memory before the product (a `trans_a` product
    /// of a register tile: its transpose is read back with `ldmatrix.trans`).
    Staged(SmemLayout),
}

/// Where a product's `b` operand comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BOperand {
    /// A tile loaded into shared memory.
    Shared(SmemLayout),
    /// A register tile, stored to shared memory before the product.
    Staged(SmemLayout),
}

impl BOperand {
    pub fn layout(self) -> SmemLayout {
        match self {
            BOperand::Shared(l) | BOperand::Staged(l) => l,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DotPlan {
    pub path: MmaPath,
    /// `a` is transposed (`trans_a`): its fragments come from `ldmatrix.trans` of the
    /// `[k, m]` tile in shared memory, into registers (also on the `wgmma` path).
    pub trans_a: bool,
    pub a: AOperand,
    pub b: BOperand,
    /// `wgmma` without an accumulator input: the product starts from a zero tile.
    pub from_zero: bool,
}

/// Who copies a loop's prefetched tiles into its shared-memory ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copier {
    /// Nothing is prefetched: loads copy at their use.
    None,
    /// The consumers themselves, with `cp.async` (`stages - 1` iterations ahead; an
    /// element-by-element fallback for unaligned tensors chosen at run time).
    CpAsync,
    /// The producer warp(s) of a warp-specialised block, with the bulk tensor copy
    /// engine (TMA), on full/empty mbarriers per ring slot.
    Tma,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoopPlan {
    /// The loads of the body copied ahead, each into a ring of `stages` buffers.
    pub prefetched: Vec<OpId>,
    pub copier: Copier,
    /// Two consumer warpgroups take turns issuing the body's products, from the first
    /// to the last (named barriers 2 and 3): one's softmax runs while the other's
    /// products occupy the tensor cores.
    pub pingpong: Option<(OpId, OpId)>,
    /// Prefetched loads whose tile stream an epilogue load after the loop continues
    /// (`pipeline-dots`): the ring copies one iteration further and the epilogue finds
    /// its tile there.
    pub continued: Vec<(OpId, OpId)>,
}

/// A `wgmma.wait_group`: the products it completes (oldest first), and how many stay
/// in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wait {
    pub complete: Vec<OpId>,
    pub in_flight: usize,
}

/// One entry's schedule.
#[derive(Clone, Debug, Default)]
pub struct Schedule {
    pub dots: BTreeMap<OpId, DotPlan>,
    pub loops: BTreeMap<OpId, LoopPlan>,
    /// An `scf.if` → the loop after it whose prologue (the first tiles' copies) is
    /// issued before the `if`, so that both wait for memory at once (the prologue
    /// `if` of `pipeline-dots`). Only scalar arithmetic lies between them.
    pub hoists: BTreeMap<OpId, OpId>,
    /// Waits before an op (a region's `yield`: before the region hands its values on).
    pub waits: BTreeMap<OpId, Vec<Wait>>,
    /// Waits at the end of the program.
    pub final_waits: Vec<Wait>,
}

/// One entry's schedule as text, and the tile IR it schedules with each op's id.
#[derive(Clone, Debug, Default)]
pub struct EntrySchedule {
    pub entry: String,
    /// The configuration in words, then [`Schedule::render`].
    pub schedule: String,
    /// [`ejc_ir::print::print_kernel_with_ids`] of the entry's kernel (after
    /// `pipeline-dots` and, in the aligned entry, scale folding).
    pub ir: String,
}

/// What the schedule depends on besides the kernel and its layout plan.
pub struct Inputs<'a> {
    pub warps: usize,
    pub stages: usize,
    /// The Hopper path (`super::wgmma_applies`).
    pub wgmma: bool,
    /// Loads the producer copies (warp-specialised aligned entry), by result.
    pub tma: &'a [Value],
    /// `(epilogue load, loop load)`: the epilogue load continues the loop load's stream.
    pub streams: &'a [(Value, Value)],
    /// Ping-pong is allowed (`EJC_PTX_PINGPONG=0` turns it off, for comparisons).
    pub pingpong: bool,
}

/// The schedule of `kernel` (one entry), or why the kernel cannot be scheduled.
pub fn plan(kernel: &Kernel, du: &DefUse, layout: &Plan, inp: &Inputs) -> Result<Schedule, String> {
    let dot_only = du.values_used_only_as(super::wgmma_operand);
    let tile = |v: Value| match kernel.ty(v) {
        Type::Tile(d, s) if s.len() == 2 => Some((*d, s[0], s[1])),
        _ => None,
    };
    // An epilogue load that continues a stream takes the loop load's buffer.
    let buffer_of = |v: Value| inp.streams.iter().find(|(epi, _)| *epi == v).map_or(v, |(_, l)| *l);
    let smem_layout = |v: Value, cols: usize, dtype: DType| {
        SmemLayout::for_tile(cols, dtype, inp.wgmma && dot_only.contains(&buffer_of(v)))
    };
    let mut s = Schedule::default();
    for op in du.ops() {
        let OpKind::Dot { trans_a, .. } = op.kind else { continue };
        let (a, b, c) = (op.operands[0], op.operands[1], op.operands[2]);
        let (Some((adt, _, _)), Some((bdt, _, bcols)), Some((_, m, n))) = (tile(a), tile(b), tile(op.results[0]))
        else {
            continue; // the emitter says what is wrong with it
        };
        if adt == DType::F32 {
            let staged = SmemLayout::Padded;
            let plan = DotPlan {
                path: MmaPath::Fma,
                trans_a,
                a: AOperand::Staged(staged),
                b: BOperand::Staged(staged),
                from_zero: false,
            };
            s.dots.insert(du.id(op), plan);
            continue;
        }
        let a_op = if trans_a {
            match layout.smem_loads.contains(&a) {
                true => AOperand::Shared(smem_layout(a, tile(a).expect("a 2-D tile").2, adt)),
                false => AOperand::Staged(SmemLayout::for_tile(tile(a).expect("a 2-D tile").2, adt, inp.wgmma)),
            }
        } else if layout.smem_loads.contains(&a) {
            let (_, rows, cols) = tile(a).expect("a 2-D tile");
            let l = smem_layout(a, cols, adt);
            let per_warp_frags = rows.div_ceil(16 * inp.warps.max(1)) * cols.div_ceil(16);
            if layout.a_only.contains(&a) && per_warp_frags * 4 <= 32 && l == SmemLayout::Padded {
                AOperand::Fragments
            } else {
                AOperand::Shared(l)
            }
        } else {
            AOperand::Registers
        };
        let b_op = if layout.smem_loads.contains(&b) {
            BOperand::Shared(smem_layout(b, bcols, bdt))
        } else {
            BOperand::Staged(SmemLayout::for_tile(bcols, bdt, inp.wgmma))
        };
        let wgmma = inp.wgmma
            && b_op.layout() != SmemLayout::Padded
            && n <= 256
            && m.is_multiple_of(64 * (inp.warps / 4).max(1));
        let zero = matches!(du.def(c).map(|o| &o.kind), Some(OpKind::Splat { .. })) && du.constant(c) == Some(0.0);
        s.dots.insert(
            du.id(op),
            DotPlan {
                path: if wgmma { MmaPath::Wgmma } else { MmaPath::MmaSync },
                trans_a,
                a: a_op,
                b: b_op,
                from_zero: wgmma && zero,
            },
        );
    }
    for op in du.ops() {
        if !matches!(op.kind, OpKind::For) {
            continue;
        }
        let prefetched = prefetchable(kernel, du, layout, inp.stages, op);
        let tma = prefetched.iter().filter(|o| inp.tma.contains(&o.results[0])).count();
        if tma > 0 && tma < prefetched.len() {
            return Err("a loop mixes tiles the producer copies with tiles it does not".into());
        }
        let copier = match (prefetched.is_empty(), tma > 0) {
            (true, _) => Copier::None,
            (false, true) => Copier::Tma,
            (false, false) => Copier::CpAsync,
        };
        let dots: Vec<OpId> =
            op.regions[0].ops.iter().filter(|o| matches!(o.kind, OpKind::Dot { .. })).map(|o| du.id(o)).collect();
        let pingpong = (copier == Copier::Tma && inp.warps == 8 && !dots.is_empty() && inp.pingpong)
            .then(|| (dots[0], dots[dots.len() - 1]));
        let continued = prefetched
            .iter()
            .filter_map(|l| {
                let (epi, _) = inp.streams.iter().find(|(_, ll)| *ll == l.results[0])?;
                Some((du.id(l), du.id(du.def(*epi)?)))
            })
            .collect();
        s.loops.insert(
            du.id(op),
            LoopPlan { prefetched: prefetched.iter().map(|o| du.id(o)).collect(), copier, pingpong, continued },
        );
    }
    hoists(kernel, du, layout, inp.stages, &kernel.body, &mut s.hoists);
    let mut sim = WaitSim { du, dots: &s.dots, pending: Vec::new(), seq: 0, waits: BTreeMap::new(), out: Vec::new() };
    sim.block(&kernel.body);
    sim.resolve_all();
    s.final_waits = std::mem::take(&mut sim.out);
    s.waits = sim.waits;
    Ok(s)
}

/// The loads of loop `op`'s body that a software pipeline can copy ahead: shared-memory
/// tiles whose indices are the induction variable and values from outside the loop, by
/// scalar arithmetic.
pub fn prefetchable<'k>(kernel: &Kernel, du: &DefUse<'k>, layout: &Plan, stages: usize, op: &'k Op) -> Vec<&'k Op> {
    if stages < 2 {
        return Vec::new();
    }
    let region = &op.regions[0];
    let iv = region.args[0];
    let inside = defined_in(region);
    region
        .ops
        .iter()
        .filter(|o| matches!(o.kind, OpKind::Load { .. }) && layout.smem_loads.contains(&o.results[0]))
        .filter(|o| o.operands.iter().all(|x| du.iteration_scalar(kernel, *x, iv, &inside)))
        .collect()
}

/// For each `scf.if` followed, with only scalar arithmetic between, by an `scf.for` with
/// prefetched loads, where the loop's bounds and loads depend neither on the `if` nor on
/// the ops between: the loop's prologue may be issued before the `if`.
fn hoists(kernel: &Kernel, du: &DefUse, layout: &Plan, stages: usize, b: &Block, out: &mut BTreeMap<OpId, OpId>) {
    for (i, op) in b.ops.iter().enumerate() {
        for r in &op.regions {
            hoists(kernel, du, layout, stages, r, out);
        }
        if !matches!(op.kind, OpKind::If) || stages < 2 {
            continue;
        }
        let results: HashSet<Value> = op.results.iter().copied().collect();
        let mut j = i + 1;
        let mut ok = true;
        while j < b.ops.len() {
            let o = &b.ops[j];
            if matches!(o.kind, OpKind::For) {
                break;
            }
            let scalar = is_scalar_arith(o) && o.results.iter().all(|r| matches!(kernel.ty(*r), Type::Scalar(_)));
            if !scalar || o.operands.iter().any(|v| results.contains(v)) {
                ok = false;
                break;
            }
            j += 1;
        }
        let Some(lp) = b.ops.get(j).filter(|_| ok) else { continue };
        if lp.operands[..3].iter().any(|v| results.contains(v)) {
            continue;
        }
        let loads = prefetchable(kernel, du, layout, stages, lp);
        if loads.is_empty() || loads.iter().any(|l| l.operands.iter().any(|v| results.contains(v))) {
            continue;
        }
        out.insert(du.id(op), du.id(lp));
    }
}

/// Where the asynchronous products are waited for, found by walking the program in the
/// emitter's order: a product is waited for where it is first read; an op with regions
/// waits for every value its regions read, and for everything when they issue products
/// of their own (the count of groups in flight must not depend on the branch taken); a
/// region's `yield` waits for what it hands on and leaves no product of its own in
/// flight (a loop's back edge, an `if`'s join).
struct WaitSim<'a, 'k> {
    du: &'a DefUse<'k>,
    dots: &'a BTreeMap<OpId, DotPlan>,
    /// Products in flight, oldest first: sequence number, op, result.
    pending: Vec<(u64, OpId, Value)>,
    seq: u64,
    waits: BTreeMap<OpId, Vec<Wait>>,
    /// The waits of the op being visited.
    out: Vec<Wait>,
}

impl WaitSim<'_, '_> {
    fn block(&mut self, b: &Block) {
        let first_seq = self.seq;
        for op in &b.ops {
            let id = self.du.id(op);
            if matches!(op.kind, OpKind::Yield) {
                self.resolve(&op.operands);
                if self.pending.iter().any(|(seq, _, _)| *seq >= first_seq) {
                    self.resolve_all();
                }
                self.flush(id);
                continue;
            }
            self.before(op);
            self.flush(id);
            match op.kind {
                OpKind::Dot { .. } if self.dots.get(&id).is_some_and(|d| d.path == MmaPath::Wgmma) => {
                    self.pending.push((self.seq, id, op.results[0]));
                    self.seq += 1;
                }
                _ => {
                    for r in &op.regions {
                        self.block(r);
                    }
                }
            }
        }
    }

    fn flush(&mut self, id: OpId) {
        if !self.out.is_empty() {
            self.waits.insert(id, std::mem::take(&mut self.out));
        }
    }

    fn before(&mut self, op: &Op) {
        if self.pending.is_empty() {
            return;
        }
        if op.regions.is_empty() {
            return self.resolve(&op.operands);
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
            self.resolve_all()
        } else {
            self.resolve(&used)
        }
    }

    fn resolve(&mut self, used: &[Value]) {
        if let Some(i) = self.pending.iter().rposition(|(_, _, v)| used.contains(v)) {
            self.wait(i);
        }
    }

    fn resolve_all(&mut self) {
        if !self.pending.is_empty() {
            self.wait(self.pending.len() - 1);
        }
    }

    fn wait(&mut self, upto: usize) {
        let in_flight = self.pending.len() - 1 - upto;
        let complete = self.pending.drain(..=upto).map(|(_, id, _)| id).collect();
        self.out.push(Wait { complete, in_flight });
    }
}

impl Schedule {
    /// The schedule as text: one line per product, loop, hoisted prologue and wait, in
    /// op order, each op named by its id, its results and its kind.
    pub fn render(&self, kernel: &Kernel) -> String {
        let du = DefUse::new(kernel);
        let names = ejc_ir::print::value_names(kernel);
        let name = |id: OpId| {
            let op = du.op(id);
            let res: Vec<String> = op.results.iter().map(|r| names.get(r).cloned().unwrap_or_default()).collect();
            if res.is_empty() {
                format!("{id} {}", op.kind.name())
            } else {
                format!("{id} {} = {}", res.join(", "), op.kind.name())
            }
        };
        let mut out = String::new();
        if self.dots.is_empty() && self.loops.is_empty() {
            out.push_str("  (no products, no loops)\n");
        }
        let wait_text = |w: &Wait| {
            let ids: Vec<String> = w.complete.iter().map(|i| i.to_string()).collect();
            format!("wgmma.wait_group {} (completes {})", w.in_flight, ids.join(" "))
        };
        for op in du.ops() {
            let id = du.id(op);
            if let Some(t) = self.hoists.get(&id) {
                let _ = writeln!(out, "{}: the prologue of loop {t} is issued before it", name(id));
            }
            if let Some(ws) = self.waits.get(&id) {
                for w in ws {
                    let _ = writeln!(out, "before {}: {}", name(id), wait_text(w));
                }
            }
            if let Some(d) = self.dots.get(&id) {
                let path = match d.path {
                    MmaPath::MmaSync => "mma.sync".to_string(),
                    MmaPath::Fma => "fma.rn.f32 (CUDA cores)".to_string(),
                    MmaPath::Wgmma if d.from_zero => "wgmma, from zero".to_string(),
                    MmaPath::Wgmma => "wgmma".to_string(),
                };
                let a = match d.a {
                    AOperand::Registers => "registers".to_string(),
                    AOperand::Fragments => "shared, read into registers once".to_string(),
                    AOperand::Shared(l) => format!("shared ({})", l.name()),
                    AOperand::Staged(l) => format!("registers staged to shared ({})", l.name()),
                };
                let a = if d.trans_a { format!("{a}, transposed by ldmatrix.trans") } else { a };
                let b = match d.b {
                    BOperand::Shared(l) => format!("shared ({})", l.name()),
                    BOperand::Staged(l) => format!("registers staged to shared ({})", l.name()),
                };
                let _ = writeln!(out, "{}: {path}; a: {a}; b: {b}", name(id));
            }
            if let Some(l) = self.loops.get(&id) {
                let copier = match l.copier {
                    Copier::None => "nothing copied ahead",
                    Copier::CpAsync => "cp.async ring",
                    Copier::Tma => "TMA ring (producer)",
                };
                let _ = writeln!(out, "{}: {copier}", name(id));
                for p in &l.prefetched {
                    let _ = writeln!(out, "  prefetched: {}", name(*p));
                }
                for (from, to) in &l.continued {
                    let _ = writeln!(out, "  stream {from} continues into epilogue load {to}");
                }
                if let Some((first, last)) = l.pingpong {
                    let _ = writeln!(out, "  ping-pong: warpgroups take turns from {first} to {last}");
                }
            }
        }
        for w in &self.final_waits {
            let _ = writeln!(out, "at the end: {}", wait_text(w));
        }
        out
    }
}
