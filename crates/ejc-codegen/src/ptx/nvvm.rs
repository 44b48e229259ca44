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
