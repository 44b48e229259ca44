//! NVVM intrinsics the PTX lowering uses, as calls on an [`Ir`] builder. Every name
//! here was checked against LLVM 22's NVPTX back end and ptxas 12.9 (sm_80).

use crate::llvm::{Ir, V};

/// Special registers: `tid.x`, `ctaid.{x,y,z}`.
pub fn tid_x(ir: &Ir) -> V {
    ir.call_intrinsic("llvm.nvvm.read.ptx.sreg.tid.x", &[], &[])
}

pub fn ctaid(ir: &Ir, axis: u8) -> V {
    let name = match axis {
        0 => "llvm.nvvm.read.ptx.sreg.ctaid.x",
        1 => "llvm.nvvm.read.ptx.sreg.ctaid.y",
        _ => "llvm.nvvm.read.ptx.sreg.ctaid.z",
    };
    ir.call_intrinsic(name, &[], &[])
}

/// `bar.sync 0`: every thread of the block.
pub fn barrier(ir: &Ir) {
    ir.call_intrinsic("llvm.nvvm.barrier.cta.sync.aligned.all", &[], &[ir.ci32(0)]);
}

/// `shfl.sync.bfly.b32` over the full warp, for f32.
pub fn shfl_xor_f32(ir: &Ir, x: V, lane_mask: u32) -> V {
    let args = [ir.ci32(-1), x, ir.ci32(lane_mask as i64), ir.ci32(31)];
    ir.call_intrinsic("llvm.nvvm.shfl.sync.bfly.f32", &[], &args)
}

/// `ex2.approx.ftz.f32` (relative error below 2⁻²²; −∞ gives +0).
pub fn ex2(ir: &Ir, x: V) -> V {
    ir.call_intrinsic("llvm.nvvm.ex2.approx.ftz", &[ir.f32()], &[x])
}

/// `tanh.approx.f32` (sm_75+; one MUFU instruction, relative error about 2⁻¹¹).
pub fn tanh_approx(ir: &Ir, x: V) -> V {
    ir.inline_asm(ir.f32(), &[x], "tanh.approx.f32 $0, $1;", "=f,f")
}

/// `rcp.approx.ftz.f32` (within 1 ulp).
pub fn rcp_approx(ir: &Ir, x: V) -> V {
    ir.inline_asm(ir.f32(), &[x], "rcp.approx.ftz.f32 $0, $1;", "=f,f")
}

/// tanh(x) for one f32. `fast`: [`tanh_approx`], for kernels whose tolerance is a
/// 16-bit type's (`ejc_ir::op::kernel_tolerance` ≥ 5e-3). Else within 4e-6 relative:
/// an odd polynomial below |x| = 1/8 and `1 − 2/(2^{2x·log2 e} + 1)` above it, with
/// `ex2.approx` and `rcp.approx` (two MUFU instructions instead of the CPU's polynomial
/// exponential and IEEE division).
pub fn tanh(ir: &Ir, x: V, fast: bool) -> V {
    if fast {
        return tanh_approx(ir, x);
    }
    let c = |v: f64| ir.cf32(v);
    let ax = ir.fabs(x);
    let e = ex2(ir, ir.fmul(ax, c(2.0 * std::f64::consts::LOG2_E)));
    let big = ir.fsub(c(1.0), ir.fmul(c(2.0), rcp_approx(ir, ir.fadd(e, c(1.0)))));
    let big = ir.copysign(big, x);
    let x2 = ir.fmul(x, x);
    // x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835
    let mut p = c(62.0 / 2835.0);
    for k in [-17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0, 1.0] {
        p = ir.fma(p, x2, c(k));
    }
    let small = ir.fmul(p, x);
    // NaN: the compare is false and `big` is NaN.
    ir.select(ir.fcmp(llvm_sys::LLVMRealPredicate::LLVMRealOLT, ax, c(0.125)), small, big)
}

/// `lg2.approx.ftz.f32`.
#[allow(dead_code)]
pub fn lg2(ir: &Ir, x: V) -> V {
    ir.call_intrinsic("llvm.nvvm.lg2.approx.ftz.f", &[], &[x])
}

/// `rcp.approx.ftz.f32` is too coarse for f32 outputs; this is an IEEE division.
pub fn rcp(ir: &Ir, x: V) -> V {
    ir.fdiv(ir.cf32(1.0), x)
}

/// `cp.async.cg.shared.global [dst], [src], 16, src_bytes`: copies `src_bytes` (0..=16)
/// and zero-fills the rest of the 16 bytes.
pub fn cp_async_16(ir: &Ir, dst_shared: V, src_global: V, src_bytes: V) {
    ir.call_intrinsic("llvm.nvvm.cp.async.cg.shared.global.16.s", &[], &[dst_shared, src_global, src_bytes]);
}

pub fn cp_async_commit(ir: &Ir) {
    ir.call_intrinsic("llvm.nvvm.cp.async.commit.group", &[], &[]);
}

/// Wait until at most `n` committed groups are still in flight.
pub fn cp_async_wait(ir: &Ir, n: i64) {
    ir.call_intrinsic("llvm.nvvm.cp.async.wait.group", &[], &[ir.ci32(n)]);
}

/// `ldmatrix.sync.aligned.m8n8.x{2,4}[.trans].shared.b16`: each lane gives a row
/// address (lanes 0-7 matrix 0, 8-15 matrix 1, ...); returns one i32 per matrix.
pub fn ldmatrix(ir: &Ir, addr_shared: V, count: usize, trans: bool) -> Vec<V> {
    let name = match (count, trans) {
        (4, false) => "llvm.nvvm.ldmatrix.sync.aligned.m8n8.x4.b16",
        (4, true) => "llvm.nvvm.ldmatrix.sync.aligned.m8n8.x4.trans.b16",
        (2, false) => "llvm.nvvm.ldmatrix.sync.aligned.m8n8.x2.b16",
        (2, true) => "llvm.nvvm.ldmatrix.sync.aligned.m8n8.x2.trans.b16",
        (_, false) => "llvm.nvvm.ldmatrix.sync.aligned.m8n8.x1.b16",
        (_, true) => "llvm.nvvm.ldmatrix.sync.aligned.m8n8.x1.trans.b16",
    };
    let r = ir.call_intrinsic(name, &[ir.ptr_in(3)], &[addr_shared]);
    if count == 1 {
        return vec![r];
    }
    (0..count as u32).map(|i| ir.extract_value(r, i)).collect()
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}...f32`: `a` four i32 (pairs),
/// `b` two i32, `c` four f32; returns four f32.
pub fn mma_m16n8k16(ir: &Ir, f16: bool, a: [V; 4], b: [V; 2], c: [V; 4]) -> [V; 4] {
    let r = if f16 {
        let h2 = ir.vec(ir.f16(), 2);
        let cast = |x: V| ir.bitcast(x, h2);
        let args = [cast(a[0]), cast(a[1]), cast(a[2]), cast(a[3]), cast(b[0]), cast(b[1]), c[0], c[1], c[2], c[3]];
        ir.call_intrinsic("llvm.nvvm.mma.m16n8k16.row.col.f32.f32", &[], &args)
    } else {
        let args = [a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], c[2], c[3]];
        ir.call_intrinsic("llvm.nvvm.mma.m16n8k16.row.col.bf16", &[], &args)
    };
    [ir.extract_value(r, 0), ir.extract_value(r, 1), ir.extract_value(r, 2), ir.extract_value(r, 3)]
}

// ---- Hopper: warpgroup MMA (sm_90a), as inline PTX: LLVM 22 has no intrinsic ----

/// Run `asm` with every value of `regs` passed through (tied in/out), so that LLVM
/// orders the registers' other uses around it: writes before, reads after. Values are
/// f32 or i32.
fn tied(ir: &Ir, asm: &str, regs: &[V], extra: &[V], extra_constraints: &[&str]) -> Vec<V> {
    if regs.is_empty() {
        let mut cons: Vec<&str> = extra_constraints.to_vec();
        cons.push("~{memory}");
        ir.inline_asm(ir.void(), extra, asm, &cons.join(","));
        return Vec::new();
    }
    let tys: Vec<_> = regs.iter().map(|r| ir.type_of(*r)).collect();
    let letter = |i: usize| if ir.is_float_ty(tys[i]) { "=f" } else { "=r" };
    let mut cons: Vec<String> = (0..regs.len()).map(|i| letter(i).to_string()).collect();
    cons.extend((0..regs.len()).map(|i| i.to_string()));
    cons.extend(extra_constraints.iter().map(|c| c.to_string()));
    // Shared memory is read (wgmma operands) or ordered (fences): never move memory
    // accesses across.
    cons.push("~{memory}".into());
    let mut args = regs.to_vec();
    args.extend_from_slice(extra);
    let r = ir.inline_asm(ir.struct_ty(&tys), &args, asm, &cons.join(","));
    (0..regs.len() as u32).map(|i| ir.extract_value(r, i)).collect()
}

/// `x` (i64) through an empty `mov`: a value LLVM cannot see through, so nothing
/// computed from it is hoisted out of the loop it sits in and held in a register
/// across it (`Lowering::window_access` and `Lowering::load_rows` address their
/// general paths from it). No `memory` clobber: loads and stores still move around it.
pub fn opaque_i64(ir: &Ir, x: V) -> V {
    ir.inline_asm(ir.i64(), &[x], "mov.b64 $0, $1;", "=l,l")
}

/// `fence.proxy.async.shared::cta`: makes this thread's ordinary writes to shared
/// memory visible to the async proxy (what `wgmma` reads through); put it before the
/// barrier that publishes a tile.
pub fn fence_proxy_async(ir: &Ir) {
    tied(ir, "fence.proxy.async.shared::cta;", &[], &[], &[]);
}

/// `wgmma.fence`: orders the register writes of `regs` (accumulators and A fragments
/// of the coming `wgmma`s) before them.
pub fn wgmma_fence(ir: &Ir, regs: &[V]) -> Vec<V> {
    tied(ir, "wgmma.fence.sync.aligned;", regs, &[], &[])
}

/// `wgmma.commit_group`: the `wgmma`s issued since the last commit form one group.
pub fn wgmma_commit(ir: &Ir) {
    tied(ir, "wgmma.commit_group.sync.aligned;", &[], &[], &[]);
}

/// `wgmma.wait_group n`: every committed group but the newest `n` is complete; the
/// accumulators `regs` of the completed groups are final after it.
pub fn wgmma_wait(ir: &Ir, n: usize, regs: &[V]) -> Vec<V> {
    tied(ir, &format!("wgmma.wait_group.sync.aligned {n};"), regs, &[], &[])
}

/// The A operand of a warpgroup MMA.
pub enum WgmmaA {
    /// Four i32 registers per thread: the `mma.m16n8k16` A-fragment layout of the warp's
    /// 16 rows of the 64-row block.
    Regs([V; 4]),
    /// A shared-memory matrix descriptor (i64), K-major.
    Desc(V),
}

/// `wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{bf16,f16}`: `acc` (n/2 f32 per thread,
/// the accumulator layout) += A · B, B from the shared-memory descriptor `b_desc`
/// (`trans_b`: B is stored N-major). Without `acc` the product starts from zero
/// (`scale-d` = 0: no register needs to hold zeros first). Asynchronous: read the
/// result only after [`wgmma_commit`] and a [`wgmma_wait`] that covers its group.
pub fn wgmma_m64k16(ir: &Ir, f16: bool, n: usize, acc: Option<&[V]>, a: &WgmmaA, b_desc: V, trans_b: bool) -> Vec<V> {
    if let Some(acc) = acc {
        assert_eq!(acc.len(), n / 2, "wgmma m64n{n}: {} accumulators", acc.len());
    }
    let ty = if f16 { "f16" } else { "bf16" };
    // LLVM inline asm names operands `$i`; `%` stays PTX's.
    let d: Vec<String> = (0..n / 2).map(|i| format!("${i}")).collect();
    // outputs, then (when accumulating) the tied inputs
    let base = if acc.is_some() { 2 * (n / 2) } else { n / 2 };
    let (a_ops, a_cons, a_vals): (String, Vec<&str>, Vec<V>) = match a {
        WgmmaA::Regs(r) => (
            format!("{{${}, ${}, ${}, ${}}}", base, base + 1, base + 2, base + 3),
            vec!["r", "r", "r", "r"],
            r.to_vec(),
        ),
        WgmmaA::Desc(x) => (format!("${base}"), vec!["l"], vec![*x]),
    };
    let (bd, scale) = (base + a_vals.len(), base + a_vals.len() + 1);
    let trans = match a {
        WgmmaA::Regs(_) => format!("{}", trans_b as u8),
        WgmmaA::Desc(_) => format!("0, {}", trans_b as u8),
    };
    let asm = format!(
        "{{\n\t.reg .pred p;\n\tsetp.ne.b32 p, ${scale}, 0;\n\twgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {{{}}}, {a_ops}, ${bd}, p, 1, 1, {trans};\n\t}}",
        d.join(", ")
    );
    let mut extra = a_vals;
    extra.push(b_desc);
    extra.push(ir.ci32(acc.is_some() as i64));
    let mut cons = a_cons;
    cons.push("l");
    cons.push("r");
    match acc {
        Some(acc) => tied(ir, &asm, acc, &extra, &cons),
        None => {
            // Outputs only.
            let tys = vec![ir.f32(); n / 2];
            let mut all: Vec<String> = (0..n / 2).map(|_| "=f".to_string()).collect();
            all.extend(cons.iter().map(|c| c.to_string()));
            all.push("~{memory}".into());
            let r = ir.inline_asm(ir.struct_ty(&tys), &extra, &asm, &all.join(","));
            (0..(n / 2) as u32).map(|i| ir.extract_value(r, i)).collect()
        }
    }
}

/// A shared-memory matrix descriptor: start address (bytes, i32 in the shared window),
/// leading- and stride-dimension byte offsets, and the layout: no swizzle, or the
/// 128-byte swizzle (ejc's layouts: `lower::SmemLayout`, docs/gpu.md).
pub fn wgmma_desc(ir: &Ir, start: V, lbo: usize, sbo: usize, swizzle128: bool) -> V {
    let addr = ir.zext(ir.and(ir.lshr(start, ir.ci32(4)), ir.ci32(0x3FFF)), ir.i64());
    let mut fixed = (((lbo >> 4) & 0x3FFF) as i64) << 16 | (((sbo >> 4) & 0x3FFF) as i64) << 32;
    if swizzle128 {
        fixed |= 1i64 << 62;
    }
    ir.or(addr, ir.ci64(fixed))
}

// ---- Hopper: bulk tensor copies (TMA), mbarriers, warp specialisation ----
//
// Shared-memory operands are 32-bit addresses in the shared window (`-nvptx-short-ptr`).

/// `bar.sync id, threads`: a named barrier over `threads` threads (a multiple of 32),
/// for the consumer warps of a warp-specialised kernel while the producer runs apart.
pub fn barrier_named(ir: &Ir, id: u32, threads: usize) {
    ir.call_intrinsic("llvm.nvvm.barrier.cta.sync.aligned.count", &[], &[ir.ci32(id as i64), ir.ci32(threads as i64)]);
}

/// `mbarrier.init.shared::cta.b64 [bar], count`.
pub fn mbarrier_init(ir: &Ir, bar: V, count: usize) {
    tied(ir, "mbarrier.init.shared::cta.b64 [$0], $1;", &[], &[bar, ir.ci32(count as i64)], &["r", "r"]);
}

/// Makes the barriers' initialisation visible to the other threads and to the async
/// proxy (the copy engine completes transactions on them); a block barrier follows.
pub fn mbarrier_init_fence(ir: &Ir) {
    tied(ir, "fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;", &[], &[], &[]);
}

/// `mbarrier.arrive.expect_tx`: this thread arrives on `bar` and announces `bytes` of
/// copies that will complete on it in the current phase.
pub fn mbarrier_arrive_expect_tx(ir: &Ir, bar: V, bytes: usize) {
    tied(ir, "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", &[], &[bar, ir.ci32(bytes as i64)], &["r", "r"]);
}

/// `mbarrier.arrive`: this thread arrives on `bar`.
pub fn mbarrier_arrive(ir: &Ir, bar: V) {
    tied(ir, "mbarrier.arrive.shared::cta.b64 _, [$0];", &[], &[bar], &["r"]);
}

/// Wait until the phase of `bar` with parity `parity` (i32, 0 or 1) has completed
/// (`mbarrier.try_wait.parity` in a loop; the label is local to the braces).
pub fn mbarrier_wait(ir: &Ir, bar: V, parity: V) {
    tied(
        ir,
        "{\n\t.reg .pred p;\n\tejc_wait:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n\t@!p bra ejc_wait;\n\t}",
        &[],
        &[bar, parity],
        &["r", "r"],
    );
}

/// `cp.async.bulk.tensor.Nd` (tile mode): the box of tensor map `tmap` (a
/// `__grid_constant__` parameter) at `coords` (i32, innermost first) into shared
/// memory at `dst`, completing its bytes on `bar`. Out-of-bounds elements read as zero.
pub fn tma_load(ir: &Ir, dst: V, tmap: V, coords: &[V], bar: V) {
    let n = coords.len();
    let cs: Vec<String> = (0..n).map(|i| format!("${}", 2 + i)).collect();
    let asm = format!(
        "cp.async.bulk.tensor.{n}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [$0], [$1, {{{}}}], [${}];",
        cs.join(", "),
        2 + n
    );
    let mut args = vec![dst, tmap];
    args.extend_from_slice(coords);
    args.push(bar);
    let mut cons = vec!["r", "l"];
    cons.extend(std::iter::repeat_n("r", n));
    cons.push("r");
    tied(ir, &asm, &[], &args, &cons);
}

/// `setmaxnreg.{inc,dec}.sync.aligned.u32 n`: the warpgroup's register budget per
/// thread becomes `n` (a multiple of 8 in 24..=256).
pub fn setmaxnreg(ir: &Ir, n: usize, inc: bool) {
    let asm = format!("setmaxnreg.{}.sync.aligned.u32 {n};", if inc { "inc" } else { "dec" });
    tied(ir, &asm, &[], &[], &[]);
}
