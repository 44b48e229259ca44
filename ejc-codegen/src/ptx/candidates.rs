//! The PTX target's candidate policy: which code paths and launch configurations a
//! kernel is compiled in, decided from the kernel itself (its tiles and products), not
//! from what operation it belongs to.
//!
//! ```no_run
//! # fn demo(kernel: &ejc_ir::ir::Kernel) {
//! use ejc_codegen::ptx::{candidates::candidates, Arch};
//! match candidates(kernel, Arch::Sm90a, &[4, 8], &[2, 3], &[]) {
//!     Ok(c) => c.iter().for_each(|c| println!("{}", c.suffix)), // w4_s2, w4_s2_wgmma, w4_s2_wgmma_ws, ...
//!     Err(skip) => println!("not for PTX: {skip}"),
//! }
//! # }
//! ```
//!
//! For each warp count and stage count of the schedule:
//!
//! - the kernel's register tiles must split over the warps (rows a multiple of 16 ×
//!   warps), else that warp count is left out;
//! - stage counts only matter to kernels with products (their operand tiles are
//!   pipelined through shared memory): a kernel without any gets the smallest only;
//! - `mma.sync` always; on `sm_90a` also `wgmma` (warps in whole warpgroups, product rows
//!   in 64-row blocks per warpgroup), and warp specialisation where [`super::ws_applies`];
//! - the softmax sunk into the masks' branch (`sink`) only where the loop-carried
//!   accumulator is at most 64 columns wide: it keeps more registers live, which the H100
//!   measurements show pays at 64 columns and costs at 128 (docs/perf.md);
//! - no Hopper path whose entry would run a loop unrotated over `a` fragments computed in
//!   registers before it ([`super::hopper_hazard`]; docs/gpu.md, "Known hazard");
//! - the serial key loop (no `pipeline-dots` rotation: [`super::Overlap::Serial`]) as well
//!   where the accumulator is more than 128 columns wide (d = 192, 256): the rotated
//!   loop's second score tile is what makes those spill at 240 registers.

use std::collections::BTreeMap;

use ejc_ir::ir::{walk_ops, Kernel, Op, OpKind};
use ejc_ir::types::{DType, Type};

use super::{Arch, CodePath, Overlap, PtxConfig};

/// One candidate: a code-generation configuration, its file-name suffix and the values
/// the manifest records in the artifact's `config`.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub cfg: PtxConfig,
    /// `w4_s2`, `w8_s2_wgmma_ws_sink`.
    pub suffix: String,
    pub config: BTreeMap<String, u32>,
}

impl Candidate {
    /// The code path, as `ejc build --path` names it: `mma`, `wgmma` or `ws`.
    pub fn path(&self) -> &'static str {
        self.cfg.path.name()
    }
}

/// Why a kernel has no PTX candidate at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Products of f32 operands: tensor cores take 16-bit operands (tf32 would miss
    /// f32's 1e-5 tolerance). The PTX back end runs them on the CUDA cores
    /// (`MmaPath::Fma`), an order of magnitude below the tensor cores, so a spec's f32
    /// kernels with products are not offered as GPU candidates; they run on the CPU
    /// targets.
    F32Products,
    /// No warp count of the schedule splits the register tiles (rows).
    NoWarpCount { rows: Vec<usize> },
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skip::F32Products => {
                f.write_str("f32 products (tensor cores take bf16/f16; on the CUDA cores they would be ~10x slower)")
            }
            Skip::NoWarpCount { rows } => {
                write!(f, "no warp count of the schedule splits its register tiles' rows {rows:?} (16 per warp)")
            }
        }
    }
}

fn dots(kernel: &Kernel) -> Vec<&Op> {
    let mut out = Vec::new();
    walk_ops(&kernel.body, &mut |op: &Op| {
        if matches!(op.kind, OpKind::Dot { .. }) {
            out.push(op);
        }
    });
    out
}

/// The rows of every tile the kernel keeps in registers (2-D tiles other than the
/// products' shared-memory operands), deduplicated.
pub fn register_rows(kernel: &Kernel) -> Vec<usize> {
    let smem = super::layout::plan(kernel).map(|p| p.smem_loads).unwrap_or_default();
    let mut rows = Vec::new();
    walk_ops(&kernel.body, &mut |op: &Op| {
        for r in &op.results {
            if let Type::Tile(_, shape) = kernel.ty(*r) {
                if shape.len() == 2 && shape[0] > 1 && !smem.contains(r) && !rows.contains(&shape[0]) {
                    rows.push(shape[0]);
                }
            }
        }
    });
    rows.sort();
    rows
}

/// The rows of the products' results (the `M` of every `tile.dot`), their greatest
/// common divisor; 0 without products.
pub fn product_rows(kernel: &Kernel) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    dots(kernel)
        .iter()
        .filter_map(|op| op.results.first().map(|r| kernel.ty(*r).shape().first().copied().unwrap_or(0)))
        .fold(0, gcd)
}

/// The widest loop-carried accumulator of a product (`acc = dot(a, b, acc)` where acc
/// is not a fresh zero tile): its columns; 0 when there is none.
pub fn accumulator_cols(kernel: &Kernel) -> usize {
    let mut zero_fills = std::collections::HashSet::new();
    walk_ops(&kernel.body, &mut |op: &Op| {
        if matches!(op.kind, OpKind::Splat { .. }) {
            zero_fills.insert(op.results[0]);
        }
    });
    dots(kernel)
        .iter()
        .filter(|op| !zero_fills.contains(&op.operands[2]))
        .map(|op| kernel.ty(op.results[0]).shape().get(1).copied().unwrap_or(0))
        .max()
        .unwrap_or(0)
}

/// The f32 registers per thread a loop-carried accumulator may take in a candidate (when
/// the schedule's warp counts allow it; see [`candidates`]).
pub const MAX_ACC_REGS: usize = 128;

/// Every candidate of `kernel` for `arch` over the schedule's `warps` × `stages`,
/// keeping only the code paths in `paths` (`mma`, `wgmma`, `ws`; empty = all).
pub fn candidates(
    kernel: &Kernel,
    arch: Arch,
    warps: &[u32],
    stages: &[u32],
    paths: &[String],
) -> Result<Vec<Candidate>, Skip> {
    let products = dots(kernel);
    if products.iter().any(|op| kernel.ty(op.operands[0]).dtype() == DType::F32) {
        return Err(Skip::F32Products);
    }
    let rows = register_rows(kernel);
    let fits = |w: u32| rows.iter().all(|r| r.is_multiple_of(16 * w as usize));
    let warps: Vec<u32> = warps.iter().copied().filter(|w| fits(*w)).collect();
    if warps.is_empty() {
        return Err(Skip::NoWarpCount { rows });
    }
    // A loop-carried accumulator a thread holds in more than 128 f32 registers spills
    // (64 rows x d 128 on one warp: 256): where the schedule offers a warp count that
    // avoids that (a spec listing num_warps [1, 4] for block_m [16, 64]), the others go.
    let (widest, acc_cols) = (rows.iter().max().copied().unwrap_or(0), accumulator_cols(kernel));
    let acc_regs = |w: u32| widest / w as usize * acc_cols / 32;
    let roomy: Vec<u32> = warps.iter().copied().filter(|w| acc_regs(*w) <= MAX_ACC_REGS).collect();
    let warps = if roomy.is_empty() { warps } else { roomy };
    let stages: Vec<u32> =
        if products.is_empty() { stages.iter().copied().min().into_iter().collect() } else { stages.to_vec() };
    let sink_pays = acc_cols <= 64;
    // Wide accumulators (more than 128 columns: d = 192, 256) leave no room for the
    // rotated loop's second score tile; the serial loop is a candidate there.
    let serial_pays = acc_cols > 128;
    // Almost every kernel has no such product: then no path is checked further.
    let register_a = super::register_a_before_loop(kernel).is_some();
    let mut out = Vec::new();
    for &w in &warps {
        for &s in &stages {
            let base = PtxConfig { arch, num_warps: w as usize, num_stages: s as usize, path: CodePath::MmaSync };
            let mut cfgs = vec![base];
            if arch == Arch::Sm90a && w % 4 == 0 && !products.is_empty() {
                let wg = PtxConfig { path: CodePath::Wgmma { overlap: Overlap::Rotated }, ..base };
                // Paths whose loop would run unrotated over register fragments computed
                // before it are left out (`super::hopper_hazard`).
                let safe = |c: &PtxConfig| !register_a || super::hopper_hazard(kernel, c).is_none();
                if super::wgmma_applies(kernel, &wg) && safe(&wg) {
                    cfgs.push(wg);
                    let serial = PtxConfig { path: CodePath::Wgmma { overlap: Overlap::Serial }, ..base };
                    if serial_pays && safe(&serial) {
                        cfgs.push(serial);
                    }
                    let ws = PtxConfig { path: CodePath::WarpSpecialised { overlap: Overlap::Rotated }, ..wg };
                    if super::ws_applies(kernel, &ws).is_ok() && safe(&ws) {
                        cfgs.push(ws);
                        if sink_pays {
                            let path = CodePath::WarpSpecialised { overlap: Overlap::Sunk };
                            cfgs.push(PtxConfig { path, ..ws });
                        }
                    }
                    let ws_serial = PtxConfig { path: CodePath::WarpSpecialised { overlap: Overlap::Serial }, ..wg };
                    if serial_pays && super::ws_applies(kernel, &ws_serial).is_ok() && safe(&ws_serial) {
                        cfgs.push(ws_serial);
                    }
                }
            }
            for cfg in cfgs {
                let suffix = format!("w{w}_s{s}{}", cfg.path.suffix());
                let mut config = BTreeMap::from([("num_warps".to_string(), w), ("num_stages".to_string(), s)]);
                for flag in cfg.path.flags() {
                    config.insert(flag.to_string(), 1);
                }
                let c = Candidate { cfg, suffix, config };
                // A path filter chooses how products run: a kernel without one (a layout,
                // a pack) has its one path and stays, so its plans survive the filter.
                if paths.is_empty() || products.is_empty() || paths.iter().any(|p| p == c.path()) {
                    out.push(c);
                }
            }
        }
    }
    Ok(out)
}
