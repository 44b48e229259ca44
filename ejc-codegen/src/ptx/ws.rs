//! Warp specialisation on Hopper (`CodePath::WarpSpecialised`, `sm_90a`).
//!
//! The block gets one more warpgroup, the **producer**, after the `num_warps` consumer
//! warps. In the aligned entry one of its threads walks the key loop's iterations and
//! copies every tile the loop reads into the loop's shared-memory ring with the bulk
//! tensor copy engine (`cp.async.bulk.tensor`, "TMA"), each copy completing on a *full*
//! mbarrier of its ring slot; before reusing a slot it waits on the slot's *empty*
//! mbarrier, on which every consumer thread arrives once it is done with the tile. The
//! consumers wait on the full barrier instead of copying: no address arithmetic, no
//! `cp.async` groups and no block barrier in the loop. With two consumer warpgroups
//! `setmaxnreg` moves registers from the producer (24) to the consumers (240).
//!
//! A tile is a TMA load when it is a loop's prefetched dot operand with 64-column
//! (128-byte) blocks in the 128-byte swizzle layout — exactly the box layout of a tensor
//! map with `CU_TENSOR_MAP_SWIZZLE_128B` — its column axis the tensor's last, no
//! `limit` on its column range (the copy engine zero-fills only outside the tensor) and
//! zero padding. A `limit` on its row range is kept: the copy fills the whole box, and
//! on a tile the limit cuts the consumers write zeros over the rows past it before the
//! product reads them (`zero_past_limit`; a paged cache's key blocks, cut by the
//! sequence's context). The aligned entry takes one tensor map per such load as a
//! `__grid_constant__` parameter after the ABI's (docs/abi.md, "Tensor maps").

use std::collections::HashSet;

use ejc_ir::defuse::{defined_in, DefUse};
use ejc_ir::ir::{AxisIndex, Kernel, Op, OpKind, Value};
use ejc_ir::types::{DType, Type};

use super::layout::Plan;

/// A load the producer copies with the bulk tensor copy engine.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TmaLoad {
    /// The load's result.
    pub load: Value,
    /// The tensor parameter (name) it reads.
    pub tensor: String,
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    /// The copy box in the tensor's axis order: 1 on indexed axes, `rows` on the row
    /// axis, 64 elements (128 bytes) on the last axis; a tile of `cols` columns takes
    /// `cols / 64` copies side by side.
    pub box_dims: Vec<u32>,
}

impl TmaLoad {
    /// The tensor map the aligned entry takes for this load (docs/abi.md, "Tensor maps").
    pub fn map_param(&self) -> ejc_ir::manifest::TensorMapParam {
        ejc_ir::manifest::TensorMapParam {
            tensor: self.tensor.clone(),
            box_dims: self.box_dims.clone(),
            swizzle: "128B".into(),
        }
    }

    pub fn bytes(&self) -> usize {
        self.rows * self.cols * self.dtype.size_bytes()
    }
}

/// The TMA loads of `kernel` (after `pipeline-dots`), or why warp specialisation does
/// not apply to it.
pub fn tma_loads(kernel: &Kernel, plan: &Plan) -> Result<Vec<TmaLoad>, String> {
    let du = DefUse::new(kernel);
    let mut out = Vec::new();
    for lp in kernel.body.ops.iter().filter(|o| matches!(o.kind, OpKind::For)) {
        let region = &lp.regions[0];
        let iv = region.args[0];
        let inside = defined_in(region);
        let top: HashSet<Value> = region.ops.iter().flat_map(|o| o.results.iter().copied()).collect();
        let mut nested = Vec::new();
        ejc_ir::ir::walk_ops(region, &mut |o: &Op| {
            if matches!(o.kind, OpKind::Load { .. }) && plan.smem_loads.contains(&o.results[0]) {
                nested.push(o.results[0]);
            }
        });
        if let Some(v) = nested.iter().find(|v| !top.contains(v)) {
            return Err(format!("the shared-memory load %{} is nested inside the loop", v.index()));
        }
        for op in region.ops.iter() {
            let OpKind::Load { axes, pad } = &op.kind else { continue };
            let r = op.results[0];
            if !plan.smem_loads.contains(&r) {
                continue;
            }
            let why = |m: &str| format!("load %{}: {m}", r.index());
            let Some(tp) = kernel.params.iter().find(|p| p.value == op.operands[0]) else {
                return Err(why("not from a tensor parameter"));
            };
            let Type::Tensor(_, rank) = tp.ty else { return Err(why("not from a tensor")) };
            let Type::Tile(dtype, shape) = kernel.ty(r).clone() else { return Err(why("not a tile")) };
            if *pad != 0.0 {
                return Err(why("padded with a value other than zero"));
            }
            if dtype.size_bytes() != 2 || shape.len() != 2 {
                return Err(why("not a 2-D tile of 16-bit elements"));
            }
            let (rows, cols) = (shape[0], shape[1]);
            if !cols.is_multiple_of(64) || !rows.is_multiple_of(8) || rows > 256 {
                return Err(why("its tile is not whole 64-column blocks of at most 256 rows"));
            }
            if !du.used_only_as(r, super::wgmma_operand) {
                return Err(why("read by something other than a dot"));
            }
            let ranges: Vec<(usize, bool)> = axes
                .iter()
                .enumerate()
                .filter_map(|(i, a)| match a {
                    AxisIndex::Range { limit, .. } => Some((i, *limit)),
                    AxisIndex::Index => None,
                })
                .collect();
            if ranges.len() != 2 || ranges[1].0 != rank - 1 {
                return Err(why("its columns are not the tensor's last axis"));
            }
            // A limit that is the tensor's own extent on that axis (`span(k0, BK, dim(a, 1))`)
            // is where the copy engine zero-fills anyway.
            let mut slot = 1;
            let mut limit_is_extent = Vec::new();
            for (i, a) in axes.iter().enumerate() {
                if let AxisIndex::Range { limit: true, .. } = a {
                    let l = op.operands[slot + 1];
                    let own = du.def(l).is_some_and(|d| {
                        matches!(d.kind, OpKind::TensorDim { axis } if axis as usize == i)
                            && d.operands[0] == op.operands[0]
                    });
                    limit_is_extent.push((i, own));
                }
                slot += a.operand_count();
            }
            let extent = |axis: usize| limit_is_extent.iter().any(|&(i, own)| i == axis && own);
            if ranges[1].1 && !extent(ranges[1].0) {
                return Err(why("its column range has a limit (the copy engine zero-fills only outside the tensor)"));
            }
            // `#[ej_kernel]` kernels promise nothing about rows past a limit (a product
            // needs them zero): there a row limit must be the tensor's extent too. The
            // flash kernels mask those rows themselves.
            let dsl = kernel.attrs.iter().any(|(k, v)| k == "frontend" && v == "ej_kernel");
            if dsl && ranges[0].1 && !extent(ranges[0].0) {
                return Err(why("its row range has a limit other than the tensor's extent"));
            }
            if !op.operands.iter().all(|x| du.iteration_scalar(kernel, *x, iv, &inside)) {
                return Err(why("its indices are not computed from the loop's induction variable"));
            }
            let box_dims = (0..rank)
                .map(|a| {
                    if a == ranges[0].0 {
                        rows as u32
                    } else if a == ranges[1].0 {
                        64
                    } else {
                        1
                    }
                })
                .collect();
            out.push(TmaLoad { load: r, tensor: tp.name.clone(), rows, cols, dtype, box_dims });
        }
    }
    if out.is_empty() {
        return Err("no loop copies tiles to shared memory".into());
    }
    Ok(out)
}
