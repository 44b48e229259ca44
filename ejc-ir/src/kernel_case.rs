//! A kernel checked on its own, against the interpreter: a tile IR kernel (text form),
//! the shapes of its tensors, its scalars and the values of its grid's sizes.
//!
//! An operation's kernels are checked against the operation's f64 reference
//! (`ejc_ir::op::Operation::reference`). A kernel that belongs to no operation — the
//! back ends' generality cases (a loop of four products, a transposed `a`), a kernel a
//! user wrote — has the interpreter as its reference instead: it runs the same kernel,
//! op by op, with the IR's semantics (docs/ir.md). `ejc-codegen`'s tests run the CPU and
//! MLIR back ends on such cases, and `ejc-gpu check-kernels` the PTX they compile to.
//!
//! Every tensor starts with fresh values N(0, 1) rounded to its dtype (outputs too, so
//! an element a kernel must not write is compared as well); integer tensors take values
//! in `[0, 8)`. The comparison is DESIGN.md's: ‖out − ref‖ / ‖ref‖ within the tolerance
//! of the lowest-precision floating-point tensor the kernel takes.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use serde::{Deserialize, Serialize};

use crate::interp::{self, Arg};
use crate::ir::Kernel;
use crate::op::kernel_tolerance;
use crate::tensor::{compare, HostTensor};
use crate::types::Type;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelCase {
    /// A name for reports (and the file stem of a packed case).
    pub name: String,
    /// The kernel in the tile IR's text form ([`crate::print::print_kernel`]).
    pub kernel: String,
    /// Each tensor parameter's shape, by parameter name.
    pub shapes: BTreeMap<String, Vec<usize>>,
    /// Each scalar parameter's value, by parameter name.
    pub scalars: BTreeMap<String, f64>,
    /// The values of the size symbols the kernel's grid names.
    pub sizes: BTreeMap<String, i64>,
    /// The tensor parameters the kernel writes: what is compared.
    pub outputs: Vec<String>,
}

/// One output against the interpreter.
#[derive(Clone, Debug, PartialEq)]
pub struct Compared {
    pub output: String,
    pub rel_err: f64,
    pub max_abs_err: f64,
    pub tolerance: f64,
}

impl Compared {
    pub fn passed(&self) -> bool {
        self.rel_err <= self.tolerance
    }
}

impl KernelCase {
    /// The kernel, parsed and verified.
    pub fn parse(&self) -> Result<Kernel, String> {
        crate::parse::parse_kernel(&self.kernel).map_err(|e| format!("case `{}`: {e}", self.name))
    }

    /// The launch grid: the kernel's formulas over [`KernelCase::sizes`].
    pub fn grid(&self, k: &Kernel) -> Result<[i64; 3], String> {
        let mut g = [0; 3];
        for (i, e) in k.grid.iter().enumerate() {
            g[i] = e.eval_in(&self.sizes).map_err(|e| format!("case `{}`: grid: {e}", self.name))?;
        }
        Ok(g)
    }

    /// The arguments in the kernel's parameter order, with fresh values from `seed`.
    pub fn args(&self, k: &Kernel, seed: u64) -> Result<Vec<Arg>, String> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut out = Vec::new();
        for p in &k.params {
            match &p.ty {
                Type::Tensor(dtype, rank) => {
                    let shape = self
                        .shapes
                        .get(&p.name)
                        .ok_or_else(|| format!("case `{}`: no shape for tensor parameter `{}`", self.name, p.name))?;
                    if shape.len() != *rank {
                        return Err(format!(
                            "case `{}`: `{}` is a rank-{rank} tensor, its shape {shape:?} has {} axes",
                            self.name,
                            p.name,
                            shape.len()
                        ));
                    }
                    let n: usize = shape.iter().product();
                    let data = (0..n)
                        .map(|_| match dtype.is_float() {
                            true => rng.sample::<f64, _>(StandardNormal),
                            false => rng.random_range(0..8) as f64,
                        })
                        .collect();
                    out.push(Arg::Tensor(HostTensor::from_vec(*dtype, shape, data)));
                }
                Type::Scalar(_) => {
                    let v = self
                        .scalars
                        .get(&p.name)
                        .ok_or_else(|| format!("case `{}`: no value for scalar parameter `{}`", self.name, p.name))?;
                    out.push(Arg::Scalar(*v));
                }
                other => return Err(format!("case `{}`: parameter `{}` of type {other}", self.name, p.name)),
            }
        }
        for o in &self.outputs {
            if !k.params.iter().any(|p| &p.name == o && matches!(p.ty, Type::Tensor(..))) {
                return Err(format!("case `{}`: output `{o}` is not a tensor parameter of the kernel", self.name));
            }
        }
        Ok(out)
    }

    /// The interpreter's results: `args` after the kernel ran on them.
    pub fn reference(&self, k: &Kernel, args: &[Arg]) -> Result<Vec<Arg>, String> {
        let mut out = args.to_vec();
        interp::launch(k, &mut out, self.grid(k)?.map(|g| g as usize))
            .map_err(|e| format!("case `{}`: the interpreter: {e}", self.name))?;
        Ok(out)
    }

    /// DESIGN.md's tolerance for this kernel: that of the lowest-precision float tensor
    /// it takes (bf16 1e-2, f16 5e-3, f32 1e-5).
    pub fn tolerance(&self, k: &Kernel) -> f64 {
        kernel_tolerance(k)
    }

    /// Each output of `got` (arguments after a back end ran the kernel) against `want`
    /// (after the interpreter did).
    pub fn compare(&self, k: &Kernel, got: &[Arg], want: &[Arg]) -> Result<Vec<Compared>, String> {
        let tol = self.tolerance(k);
        let mut out = Vec::new();
        for o in &self.outputs {
            let i = k.params.iter().position(|p| &p.name == o).ok_or_else(|| format!("no output `{o}`"))?;
            let (Some(g), Some(w)) = (got.get(i).and_then(Arg::tensor), want.get(i).and_then(Arg::tensor)) else {
                return Err(format!("case `{}`: output `{o}` is missing", self.name));
            };
            if g.shape != w.shape {
                return Err(format!("case `{}`: output `{o}` has shape {:?}, not {:?}", self.name, g.shape, w.shape));
            }
            let (rel_err, max_abs_err) = compare(&g.to_vec(), &w.to_vec());
            out.push(Compared { output: o.clone(), rel_err, max_abs_err, tolerance: tol });
        }
        Ok(out)
    }
}

/// A case with the GPU code compiled for it: what `ejc-gpu check-kernels DIR` reads from
/// each `DIR/<name>.json` (the PTX files beside it).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PackedCase {
    pub case: KernelCase,
    pub artifacts: Vec<PackedPtx>,
}

/// One PTX module of a packed case.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PackedPtx {
    /// The configuration, for reports (`sm_90a wgmma w4 s2`).
    pub label: String,
    /// `sm_80` or `sm_90a`: the GPU must be at least that.
    pub arch: String,
    /// The PTX file, relative to the pack's directory.
    pub file: String,
    pub entry: String,
    /// The entry for aligned tensors, when the module has one; it runs when every tensor
    /// of `aligned_tensors` is aligned (`crate::manifest::AlignedEntry::tensor_ok`).
    pub aligned_entry: Option<String>,
    pub aligned_tensors: Vec<String>,
    /// Scalars the aligned entry needs > 0 (a softmax scale folded into the exponent).
    #[serde(default)]
    pub positive: Vec<String>,
    /// The aligned entry's tensor maps (warp-specialised modules: the producer's TMA
    /// copies), passed after the ABI's parameters.
    #[serde(default)]
    pub tensor_maps: Vec<crate::manifest::TensorMapParam>,
    pub threads: u32,
    pub smem_bytes: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::DType;

    const AXPY: &str = "kernel @axpy(%x: tensor<?xf32>, %y: tensor<?xf32>, %a: f32) grid(cdiv(n, 16), 1, 1) {
  %0 = program.id {axis = 0} : i32
  %1 = const 16 : i32
  %2 = arith.mul %0, %1 : i32
  %3 = tile.load %x[%2 +: 16] {pad = 0.0} : tile<16xf32>
  %4 = tile.load %y[%2 +: 16] {pad = 0.0} : tile<16xf32>
  %5 = arith.mul %3, %a : tile<16xf32>
  %6 = arith.add %5, %4 : tile<16xf32>
  tile.store %y[%2 +: 16], %6
}
";

    fn case() -> KernelCase {
        KernelCase {
            name: "axpy".into(),
            kernel: AXPY.into(),
            shapes: [("x".to_string(), vec![37]), ("y".to_string(), vec![37])].into(),
            scalars: [("a".to_string(), 1.5)].into(),
            sizes: [("n".to_string(), 37)].into(),
            outputs: vec!["y".into()],
        }
    }

    #[test]
    fn the_interpreter_is_the_reference_and_a_wrong_result_fails() {
        let c = case();
        let k = c.parse().unwrap();
        assert_eq!(c.grid(&k).unwrap(), [3, 1, 1]);
        let args = c.args(&k, 7).unwrap();
        let want = c.reference(&k, &args).unwrap();
        let (x, y0, y1) = (args[0].tensor().unwrap(), args[1].tensor().unwrap(), want[1].tensor().unwrap());
        for i in 0..37 {
            assert_eq!(y1.get(&[i]), DType::F32.round(1.5 * x.get(&[i]) + y0.get(&[i])));
        }
        let same = c.compare(&k, &want, &want).unwrap();
        assert!(same[0].passed() && same[0].rel_err == 0.0);
        // An element off by 1 %: outside f32's tolerance.
        let mut bad = want.clone();
        if let Arg::Tensor(t) = &mut bad[1] {
            let v = t.get(&[5]);
            t.set(&[5], v * 1.01 + 0.1);
        }
        assert!(!c.compare(&k, &bad, &want).unwrap()[0].passed());
        // Untouched inputs are not outputs; a missing shape is an error naming it.
        let mut c2 = c.clone();
        c2.shapes.remove("x");
        assert!(c2.args(&k, 7).unwrap_err().contains("`x`"));
        let mut c3 = c.clone();
        c3.outputs = vec!["a".into()];
        assert!(c3.args(&k, 7).unwrap_err().contains("not a tensor parameter"));
        // Fresh values: another seed gives other inputs.
        assert_ne!(c.args(&k, 8).unwrap()[0].tensor().unwrap().data, x.data);
    }
}
