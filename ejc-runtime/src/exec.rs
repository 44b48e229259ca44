//! Running a plan: temporaries allocated from their size formulas, each launch's
//! parameters bound from the manifest (the call's tensors and scalars by name, the
//! plan's temporaries, sizes and configuration values), grids evaluated, kernels
//! launched in order — on the CPU here, on a GPU in [`crate::cuda`].
//!
//! ```no_run
//! # fn demo(reg: &ejc_runtime::registry::Registry, call: &mut ejc_runtime::call::Call, sizes: &ejc_ir::op::Sizes) {
//! use ejc_runtime::exec::{CpuLibs, HostPlan};
//! let q = ejc_runtime::registry::Query::new("mean_pooling");
//! let fam = reg.families(&q).unwrap().remove(0);
//! let cand = &fam.candidates()[0];
//! let mut libs = CpuLibs::default();
//! ejc_runtime::exec::run_cpu(&mut libs, cand, call, sizes, 0).unwrap(); // prepare and run once
//! // Or prepare once, run many times (benchmarks, the autotuner):
//! let (plan, kernels) = HostPlan::for_candidate(&mut libs, cand, call, sizes).unwrap();
//! let mut ready = plan.prepare(&kernels, call, sizes, &cand.config).unwrap();
//! ready.run(call, 0).unwrap();
//! # }
//! ```
//!
//! Preparing (loading kernels, allocating temporaries, checking every binding) is
//! apart from running, so a benchmark or the autotuner prepares once and runs many
//! times.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use ejc_ir::cpu_abi::EjcTensor;
use ejc_ir::ir::GridExpr;
use ejc_ir::manifest::{AbiParamInfo, Launch, Temporary};
use ejc_ir::op::{bind, grid_of, symbols, temporary_shape, Bound, ParamSig, Sizes};
use ejc_ir::types::{DType, Type};

use crate::call::{Call, Tensor};
use crate::cpu::{scalar_slot, CpuError, CpuKernel, CpuLibrary, HostBuffer};
use crate::registry::Candidate;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The call does not fit the kernels (a missing tensor, a wrong dtype or rank, a
    /// size formula that cannot be evaluated).
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Cpu(#[from] CpuError),
}

fn invalid(m: impl Into<String>) -> ExecError {
    ExecError::Invalid(m.into())
}

/// The parameters of a manifest entry, typed.
pub fn param_sigs(params: &[AbiParamInfo]) -> Result<Vec<ParamSig>, String> {
    params
        .iter()
        .map(|p| {
            let dtype: DType = p.dtype.parse()?;
            let ty = match p.kind.as_str() {
                "tensor" => Type::Tensor(dtype, p.rank),
                "scalar" => Type::Scalar(dtype),
                other => return Err(format!("parameter `{}` has kind `{other}` (tensor or scalar)", p.name)),
            };
            Ok(ParamSig { name: p.name.clone(), ty })
        })
        .collect()
}

pub use ejc_ir::cpu_abi::HostLaunch;

impl HostLaunch for CpuKernel {
    unsafe fn launch(
        &self,
        tensors: &[EjcTensor],
        scalars: &[u64],
        grid: [i64; 3],
        threads: usize,
    ) -> Result<(), String> {
        CpuKernel::launch(self, tensors, scalars, grid, threads).map_err(|e| e.to_string())
    }
}

/// One launch of a plan on the host: the kernel, its parameters and grid, and how the
/// plan binds it.
pub struct HostLaunchSpec<'k> {
    pub kernel: &'k dyn HostLaunch,
    pub params: Vec<ParamSig>,
    pub grid: [GridExpr; 3],
    pub launch: Launch,
}

/// One launch, ready: the kernel, its grid, what each parameter is bound to, the scalar
/// slots.
type ReadyLaunch<'k> = (&'k dyn HostLaunch, [i64; 3], Vec<Bound>, Vec<u64>);

/// A plan ready to run on a call: kernels, grids, bindings and temporaries decided.
pub struct HostPlan<'k> {
    launches: Vec<ReadyLaunch<'k>>,
    temps: BTreeMap<String, HostBuffer>,
}

/// Libraries opened so far (a kernel stays valid while its library is open).
#[derive(Default)]
pub struct CpuLibs {
    libs: HashMap<PathBuf, CpuLibrary>,
    kernels: HashMap<(PathBuf, String), CpuKernel>,
}

impl CpuLibs {
    /// The kernel of a CPU registry entry (its library opened once).
    pub fn kernel(&mut self, e: &crate::registry::KernelEntry) -> Result<CpuKernel, CpuError> {
        let key = (e.artifact.clone(), e.entry.clone());
        if let Some(k) = self.kernels.get(&key) {
            return Ok(*k);
        }
        if !self.libs.contains_key(&e.artifact) {
            self.libs.insert(e.artifact.clone(), CpuLibrary::open(&e.artifact)?);
        }
        let k = self.libs[&e.artifact].kernel(&e.entry, e.scratch_bytes as usize)?;
        self.kernels.insert(key, k);
        Ok(k)
    }
}

impl<'k> HostPlan<'k> {
    /// Prepare launches `specs` of a plan with `temporaries` for `call` of `sizes` in
    /// configuration `config` (whose values formulas may name).
    pub fn new(
        specs: &[HostLaunchSpec<'k>],
        temporaries: &[Temporary],
        call: &Call,
        sizes: &Sizes,
        config: &ejc_ir::op::Config,
    ) -> Result<HostPlan<'k>, ExecError> {
        let syms = symbols(sizes, config);
        // Temporaries the call gives (a precomputed layout): not allocated, and the
        // launches that only produce them skipped.
        let info = |n: &str| call.tensors.get(n).map(Tensor::info);
        let launches: Vec<Launch> = specs.iter().map(|s| s.launch.clone()).collect();
        let given = ejc_ir::op::given_temporaries(temporaries, &launches, &info, &syms).map_err(invalid)?;
        let kept: Vec<HostLaunchSpec<'k>> = specs
            .iter()
            .zip(given.launches)
            .filter_map(|(s, l)| {
                l.map(|launch| HostLaunchSpec {
                    kernel: s.kernel,
                    params: s.params.clone(),
                    grid: s.grid.clone(),
                    launch,
                })
            })
            .collect();
        let (specs, temporaries) = (&kept[..], &given.temporaries[..]);
        let mut temps = BTreeMap::new();
        for t in temporaries {
            let (dtype, shape) =
                temporary_shape(t, &syms, |n| call.tensors.get(n).map(|x| x.info().dtype)).map_err(invalid)?;
            temps.insert(t.name.clone(), HostBuffer::try_zeros(dtype, &shape).map_err(invalid)?);
        }
        let lookup = |n: &str| call.tensors.get(n).map(Tensor::info);
        let mut launches = Vec::new();
        for s in specs {
            let bound = bind(&s.params, &s.launch, temporaries, &lookup, &call.scalars, &syms).map_err(invalid)?;
            let grid = grid_of(&s.grid, &syms).map_err(invalid)?;
            let mut slots = Vec::new();
            for (p, b) in s.params.iter().zip(&bound) {
                if let (Type::Scalar(d), Bound::Scalar(v)) = (&p.ty, b) {
                    slots.push(scalar_slot(*d, *v));
                }
            }
            for b in &bound {
                if let Bound::Tensor(n) = b {
                    if !temps.contains_key(n) {
                        match call.tensors.get(n) {
                            Some(Tensor::Host(buf)) => {
                                buf.check_bounds().map_err(|e| invalid(format!("argument `{n}`: {e}")))?
                            }
                            _ => return Err(invalid(format!("argument `{n}` is not in host memory"))),
                        }
                    }
                }
            }
            launches.push((s.kernel, grid, bound, slots));
        }
        Ok(HostPlan { launches, temps })
    }

    /// Prepare a registry candidate (CPU entries) for `call`.
    pub fn for_candidate(
        libs: &mut CpuLibs,
        cand: &Candidate,
        call: &Call,
        sizes: &Sizes,
    ) -> Result<(HostPlanOwned, Vec<CpuKernel>), ExecError> {
        let mut kernels = Vec::new();
        for e in &cand.launches {
            kernels.push(libs.kernel(e)?);
        }
        let mut specs = Vec::new();
        for (e, launch) in cand.launches.iter().zip(&cand.plan.plan.launches) {
            let grid = e.grid.clone().ok_or_else(|| invalid(format!("`{}` has no launch grid", e.entry)))?;
            specs.push((param_sigs(&e.params).map_err(invalid)?, grid, launch.clone()));
        }
        let owned = HostPlanOwned { specs, temporaries: cand.plan.plan.temporaries.clone() };
        // Check the bindings now, so that a bad call fails before anything runs.
        owned.prepare(&kernels, call, sizes, &cand.config)?;
        Ok((owned, kernels))
    }

    /// Run every launch in order on `call`'s tensors.
    pub fn run(&mut self, call: &mut Call, threads: usize) -> Result<(), ExecError> {
        for (kernel, grid, bound, slots) in &self.launches {
            let mut abi = Vec::new();
            for b in bound {
                if let Bound::Tensor(n) = b {
                    let buf = match self.temps.get_mut(n) {
                        Some(t) => t,
                        None => call
                            .tensors
                            .get_mut(n)
                            .and_then(Tensor::host_mut)
                            .ok_or_else(|| invalid(format!("argument `{n}` is not in host memory")))?,
                    };
                    abi.extend(buf.descriptors());
                }
            }
            // Safety: `new` checked each tensor's dtype and rank against the kernel's
            // parameters and its strides against its memory; every buffer is its own
            // allocation, so outputs overlap no input.
            unsafe { kernel.launch(&abi, slots, *grid, threads) }.map_err(ExecError::Invalid)?;
        }
        Ok(())
    }
}

/// A registry candidate's launches, owned (parameters, grids, bindings), to prepare a
/// [`HostPlan`] with its kernels.
pub struct HostPlanOwned {
    specs: Vec<(Vec<ParamSig>, [GridExpr; 3], Launch)>,
    temporaries: Vec<Temporary>,
}

impl HostPlanOwned {
    pub fn prepare<'k>(
        &self,
        kernels: &'k [CpuKernel],
        call: &Call,
        sizes: &Sizes,
        config: &ejc_ir::op::Config,
    ) -> Result<HostPlan<'k>, ExecError> {
        let specs: Vec<HostLaunchSpec<'k>> = self
            .specs
            .iter()
            .zip(kernels)
            .map(|((params, grid, launch), k)| HostLaunchSpec {
                kernel: k as &dyn HostLaunch,
                params: params.clone(),
                grid: grid.clone(),
                launch: launch.clone(),
            })
            .collect();
        HostPlan::new(&specs, &self.temporaries, call, sizes, config)
    }
}

/// Run a registry candidate on the CPU once.
pub fn run_cpu(
    libs: &mut CpuLibs,
    cand: &Candidate,
    call: &mut Call,
    sizes: &Sizes,
    threads: usize,
) -> Result<(), ExecError> {
    let (owned, kernels) = HostPlan::for_candidate(libs, cand, call, sizes)?;
    let mut plan = owned.prepare(&kernels, call, sizes, &cand.config)?;
    plan.run(call, threads)
}
