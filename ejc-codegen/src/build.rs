//! `ejc build`: spec → kernels (every plan's roles) → pass pipeline → targets →
//! manifest (plans and artifacts).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ejc_ir::ir::Kernel;
use ejc_ir::manifest::{AbiParamInfo, Artifact, Compiler, Manifest, Plan, SpecInfo, FORMAT};
use ejc_ir::op::{self, KernelInstance, Operation};
use ejc_ir::passes::{default_pipeline, run_pipeline, PassError};
use ejc_ir::spec::{Spec, Target};
use ejc_ir::types::{DType, Type};
use sha2::{Digest, Sha256};

pub mod dsl;

use crate::cpu::{self, lower::KernelCode, Isa};
use crate::targets::check_supported;
use crate::{CodegenError, COMPILER_VERSION};

#[derive(Clone, Debug, Default)]
pub struct BuildOptions {
    pub out_dir: PathBuf,
    /// Targets to generate; each must be supported (see [`check_supported`]).
    pub targets: Vec<Target>,
    /// Only these variants (empty = all).
    pub variants: Vec<String>,
    /// Only these dtypes (empty = all of the spec's).
    pub dtypes: Vec<DType>,
    /// Only these values of the operation's compile-time keys (e.g. `head_dim` → [128]);
    /// a key not named keeps all of the spec's values.
    pub keys: BTreeMap<String, Vec<u32>>,
    /// Only these values of schedule axes (tile axes choose kernels, `num_warps` /
    /// `num_stages` the GPU targets' configurations); an axis not named keeps all.
    pub axes: BTreeMap<String, Vec<u32>>,
    /// Only these plans (empty = the spec's).
    pub plans: Vec<String>,
    /// Only these code paths of PTX targets (empty = all): `mma` (`mma.sync`), `wgmma`
    /// (sm_90a), `ws` (sm_90a, warp-specialised, with or without the sunk softmax).
    /// Kernels without a product have one path and are always kept.
    pub ptx_paths: Vec<String>,
}

impl BuildOptions {
    fn keeps(&self, axis: &str, value: u32) -> bool {
        self.axes.get(axis).is_none_or(|vs| vs.contains(&value))
    }
}

/// Progress events, for a progress bar or log lines.
#[derive(Clone, Debug)]
pub enum Progress<'a> {
    Start {
        kernels: usize,
        targets: usize,
    },
    /// A target's compilations begin: `total` Kernel events follow (`done` counts from 0).
    Target {
        target: &'a str,
        total: usize,
    },
    Kernel {
        done: usize,
        total: usize,
        id: &'a str,
    },
    Finished,
}

#[derive(Clone, Debug)]
pub struct BuildReport {
    pub manifest: Manifest,
    pub manifest_path: PathBuf,
    /// Tile programs built.
    pub kernels: usize,
}

/// What a build compiles: the tile programs, and the plans that launch them.
pub struct Selection<'s> {
    /// Every kernel some target builds, once.
    pub kernels: Vec<KernelInstance<'s>>,
    pub plans: Vec<Plan>,
    /// For each of the options' targets (in order), the indices into `kernels` it
    /// builds: the spec's `overrides:` may give targets different schedules.
    pub by_target: Vec<Vec<usize>>,
}

fn join<T: std::fmt::Display>(xs: &[T]) -> String {
    xs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

/// The kernels and plans of `spec` that pass the filters in `opts`; an unknown filter
/// value is an error naming what exists. A plan is kept only when each of its roles
/// still has a kernel.
pub fn select<'s>(spec: &'s Spec, opts: &BuildOptions) -> Result<Selection<'s>, CodegenError> {
    let op = spec.operation();
    let empty = |m: String| Err(CodegenError::Empty(m));
    for v in &opts.variants {
        if spec.variant(v).is_none() {
            let names: Vec<&str> = spec.variants.iter().map(|v| v.name.as_str()).collect();
            return empty(format!("spec `{}` has no variant `{v}` (variants: {})", spec.name, names.join(", ")));
        }
    }
    for d in &opts.dtypes {
        if !spec.dtypes.contains(d) {
            return empty(format!("spec `{}` does not declare dtype {d} (dtypes: {})", spec.name, join(&spec.dtypes)));
        }
    }
    for (k, vs) in &opts.keys {
        let have = spec.key_values(k);
        if !spec.keys.iter().any(|(n, _)| n == k) {
            let names: Vec<&str> = spec.keys.iter().map(|(n, _)| n.as_str()).collect();
            return empty(format!("{} has no compile-time key `{k}` (keys: {})", op.name(), names.join(", ")));
        }
        if let Some(v) = vs.iter().find(|v| !have.contains(v)) {
            return empty(format!("spec `{}` does not declare {k} {v} ({k}: {})", spec.name, join(have)));
        }
    }
    for (a, vs) in &opts.axes {
        let have = spec.schedule.all_values(a);
        let have = have.as_slice();
        if !op.axes().iter().any(|d| d.name == a) {
            let names: Vec<&str> = op.axes().iter().map(|d| d.name).collect();
            return empty(format!("{} has no schedule axis `{a}` (axes: {})", op.name(), names.join(", ")));
        }
        if let Some(v) = vs.iter().find(|v| !have.contains(v)) {
            return empty(format!("spec `{}` does not list {a} {v} in its schedule ({a}: {})", spec.name, join(have)));
        }
    }
    for p in &opts.plans {
        if !op.plan_names().contains(&p.as_str()) {
            return empty(format!("{} has no plan `{p}` (plans: {})", op.name(), op.plan_names().join(", ")));
        }
    }
    let targets: Vec<Option<&Target>> =
        if opts.targets.is_empty() { vec![None] } else { opts.targets.iter().map(Some).collect() };
    let mut kernels: Vec<KernelInstance> = Vec::new();
    let mut index: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut by_target: Vec<Vec<usize>> = vec![Vec::new(); targets.len()];
    let mut plans: Vec<Plan> = Vec::new();
    for variant in spec.variants.iter().filter(|v| opts.variants.is_empty() || opts.variants.contains(&v.name)) {
        let decls: Vec<_> = op::spec_plans(spec, variant)
            .into_iter()
            .filter(|p| opts.plans.is_empty() || opts.plans.iter().any(|n| n == p.name))
            .collect();
        for &dtype in spec.dtypes.iter().filter(|d| opts.dtypes.is_empty() || opts.dtypes.contains(d)) {
            for keys in spec.key_points() {
                // Every key the options name must be the instance's, with a listed value
                // (`head_dim_v=128` selects the instances whose v has a head dim of its own).
                if !opts.keys.iter().all(|(k, vs)| keys.get(k).is_some_and(|v| vs.contains(v))) {
                    continue;
                }
                for (ti, target) in targets.iter().enumerate() {
                    let schedule = spec.schedule.resolve(*target, dtype, &keys);
                    for decl in &decls {
                        // The plan's kernels at this target's tile points that the filters keep
                        // (on the roles' tile axes: a role's fixed values are not filtered); a
                        // role left without any drops the plan.
                        let these: Vec<KernelInstance> = op::plan_kernels(spec, variant, dtype, &keys, decl, &schedule)
                            .into_iter()
                            .filter(|k| {
                                let role = decl.roles.iter().find(|r| r.name == k.role);
                                k.tile.iter().all(|(a, v)| {
                                    role.is_none_or(|r| !r.tile_axes.contains(&a.as_str())) || opts.keeps(a, *v)
                                })
                            })
                            .collect();
                        if these.is_empty() || decl.roles.iter().any(|r| !these.iter().any(|k| k.role == r.name)) {
                            continue;
                        }
                        let first = &these[0];
                        let mut axes = BTreeMap::new();
                        for a in &decl.runtime_axes {
                            let vs: Vec<u32> =
                                schedule.values(a).iter().copied().filter(|v| opts.keeps(a, *v)).collect();
                            axes.insert(a.to_string(), vs);
                        }
                        if axes.values().any(|v: &Vec<u32>| v.is_empty()) {
                            continue;
                        }
                        let instance = first.instance();
                        // One plan per instance: the run-time values of every target's schedule.
                        match plans.iter_mut().find(|p| p.name == decl.name && p.instance == instance) {
                            Some(p) => {
                                for (a, vs) in axes {
                                    let have = p.axes.entry(a).or_default();
                                    for v in vs {
                                        if !have.contains(&v) {
                                            have.push(v);
                                        }
                                    }
                                }
                            }
                            None => plans.push(Plan {
                                name: decl.name.to_string(),
                                instance,
                                features: variant.features.clone(),
                                temporaries: decl.temporaries.clone(),
                                launches: decl.launches.clone(),
                                axes,
                                shared: decl.shared_axes.iter().map(|a| a.to_string()).collect(),
                            }),
                        }
                        for k in these {
                            let i = match index.get(&k.id) {
                                Some(&i) => i,
                                None => {
                                    index.insert(k.id.clone(), kernels.len());
                                    kernels.push(k);
                                    kernels.len() - 1
                                }
                            };
                            if !by_target[ti].contains(&i) {
                                by_target[ti].push(i);
                            }
                        }
                    }
                }
            }
        }
    }
    if kernels.is_empty() {
        return empty(format!("the filters leave no kernel of spec `{}` to build", spec.name));
    }
    Ok(Selection { kernels, plans, by_target })
}

/// What a build created, so that a failed build takes it back: the directories it made
/// (outermost first) and the files that did not exist before it wrote them. Files that
/// were there before are left (a build never deletes what it did not make).
#[derive(Default)]
struct Created {
    dirs: Vec<PathBuf>,
    files: Vec<PathBuf>,
}

impl Created {
    /// `create_dir_all(dir)`, noting each directory it makes.
    fn mkdir(&mut self, dir: &Path) -> Result<(), CodegenError> {
        let mut missing = Vec::new();
        let mut d = Some(dir);
        while let Some(p) = d.filter(|p| !p.as_os_str().is_empty() && std::fs::symlink_metadata(p).is_err()) {
            missing.push(p.to_path_buf());
            d = p.parent();
        }
        self.dirs.extend(missing.into_iter().rev());
        std::fs::create_dir_all(dir).map_err(|error| CodegenError::Io { path: dir.to_path_buf(), error })
    }

    /// Before writing `file`: note it if it is new.
    fn file(&mut self, file: &Path) {
        if std::fs::symlink_metadata(file).is_err() {
            self.files.push(file.to_path_buf());
        }
    }

    /// Remove what this build made: its new files, then its directories that are empty
    /// now (innermost first). Best effort: the build's error is what gets reported.
    fn undo(&self) {
        for f in self.files.iter().rev() {
            let _ = std::fs::remove_file(f);
        }
        for d in self.dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Build `spec` into `opts.out_dir`: every target's artifacts, then `manifest.json`
/// (written last, atomically). A build that fails leaves no trace: the artifacts and
/// directories it created are removed again (files that were there before are not
/// touched), and no `manifest.json.tmp` stays behind.
pub fn build(
    spec: &Spec,
    opts: &BuildOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<BuildReport, CodegenError> {
    let mut created = Created::default();
    let result = build_into(spec, opts, progress, &mut created);
    if result.is_err() {
        created.undo();
    }
    result
}

fn build_into(
    spec: &Spec,
    opts: &BuildOptions,
    progress: &mut dyn FnMut(Progress),
    created: &mut Created,
) -> Result<BuildReport, CodegenError> {
    if opts.targets.is_empty() {
        return Err(CodegenError::Empty("no target given".into()));
    }
    // Refuse unsupported targets before writing anything.
    for t in &opts.targets {
        check_supported(t)?;
    }
    let op = spec.operation();
    let Selection { kernels: all_selected, plans, by_target } = select(spec, opts)?;
    created.mkdir(&opts.out_dir)?;
    progress(Progress::Start { kernels: all_selected.len(), targets: opts.targets.len() });
    // Tile IR of every kernel, after the pipeline: the input of every target.
    let pipeline = default_pipeline();
    let mut all_kernels = Vec::with_capacity(all_selected.len());
    for inst in &all_selected {
        let kernel_err = |message: String| CodegenError::Kernel { kernel: inst.id.clone(), message };
        let raw = op.build(spec, inst).map_err(kernel_err)?;
        all_kernels.push(run_pipeline(&raw, &pipeline).map_err(|e| pipeline_error(&inst.id, e))?);
    }
    let mut artifacts = Vec::new();
    for (target, these) in opts.targets.iter().zip(&by_target) {
        // This target's kernels (its schedule: the spec's overrides may differ per target).
        let selected: Vec<KernelInstance> = these.iter().map(|&i| all_selected[i].clone()).collect();
        let kernels: Vec<Kernel> = these.iter().map(|&i| all_kernels[i].clone()).collect();
        match target {
            Target::Ir => {
                progress(Progress::Target { target: "ir", total: selected.len() });
                for (n, (inst, kernel)) in selected.iter().zip(&kernels).enumerate() {
                    progress(Progress::Kernel { done: n, total: selected.len(), id: &inst.id });
                    let path = opts.out_dir.join(crate::ir::file_of(kernel));
                    created.mkdir(path.parent().unwrap_or(&opts.out_dir))?;
                    created.file(&path);
                    let (file, text) = crate::ir::write(&opts.out_dir, kernel)?;
                    artifacts.push(artifact_of(op, inst, kernel, "ir".into(), file, sha256_hex(text.as_bytes())));
                }
            }
            Target::Cpu(isa) => {
                let isa = match isa {
                    Some(name) => name.parse::<Isa>().map_err(CodegenError::Empty)?,
                    None => Isa::host(),
                };
                let file = format!("cpu/{}.{}.so", spec.name, isa.name());
                let path = opts.out_dir.join(&file);
                created.mkdir(&opts.out_dir.join("cpu"))?;
                created.file(&path);
                progress(Progress::Target { target: &format!("cpu:{}", isa.name()), total: kernels.len() });
                let codes = compile_cpu_library(&kernels, isa, &path, progress)?;
                let bytes = std::fs::read(&path).map_err(|error| CodegenError::Io { path: path.clone(), error })?;
                let sha = sha256_hex(&bytes);
                for ((inst, kernel), code) in selected.iter().zip(&kernels).zip(codes) {
                    let mut a = artifact_of(op, inst, kernel, format!("cpu:{}", isa.name()), file.clone(), sha.clone());
                    a.scratch_bytes = code.scratch_bytes;
                    artifacts.push(a);
                }
            }
            Target::Ptx(arch) => {
                let arch: crate::ptx::Arch = arch.parse().map_err(CodegenError::Empty)?;
                artifacts.extend(build_ptx(spec, opts, &selected, &kernels, arch, progress, created)?);
            }
            Target::Mlir(form) => {
                artifacts.extend(build_mlir(op, form, opts, &selected, &kernels, progress, created)?);
            }
        }
    }
    progress(Progress::Finished);
    // A build of nothing is an error, not a manifest of zero artifacts (e.g. f32 for a
    // PTX target, whose tensor cores take bf16/f16).
    if artifacts.is_empty() {
        let targets: Vec<String> = opts.targets.iter().map(|t| t.to_string()).collect();
        return Err(CodegenError::Empty(format!(
            "no kernel of the selection can be built for target {}",
            targets.join(", ")
        )));
    }
    // A plan is listed where every role it launches has an artifact.
    let plans: Vec<Plan> = plans
        .into_iter()
        .filter(|p| p.launches.iter().all(|l| artifacts.iter().any(|a| a.instance == p.instance && a.role == l.role)))
        .collect();
    let manifest = Manifest {
        format: FORMAT.into(),
        compiler: Compiler { name: "ejc".into(), version: COMPILER_VERSION.into() },
        spec: SpecInfo {
            name: spec.name.clone(),
            file: spec.file.clone(),
            sha256: spec.hash.clone(),
            op: spec.op.clone(),
            version: spec.version,
        },
        plans,
        artifacts,
    };
    let manifest_path = opts.out_dir.join("manifest.json");
    write_atomic(&manifest_path, manifest.to_json().as_bytes())?;
    Ok(BuildReport { manifest, manifest_path, kernels: all_selected.len() })
}

/// The manifest entry of kernel `inst` built for `target` into `file`: its instance,
/// role, features, tile configuration, and the parameters and grid the kernel declares;
/// targets fill in their launch details.
fn artifact_of(
    op: &dyn Operation,
    inst: &KernelInstance,
    kernel: &Kernel,
    target: String,
    file: String,
    sha256: String,
) -> Artifact {
    Artifact {
        kernel_id: inst.id.clone(),
        instance: inst.instance(),
        role: inst.role.to_string(),
        features: inst.variant.features.clone(),
        config: inst.tile.iter().filter(|(k, _)| *k != "num_warps").map(|(k, v)| (k.clone(), *v)).collect(),
        artifact_id: format!("{}@{target}", inst.id),
        target,
        file,
        sha256,
        entry: inst.id.clone(),
        params: params_info(kernel, &|n| op.param_doc(n)),
        grid: kernel.grid.clone().map(|g| g.to_string()),
        block: None,
        dynamic_shared_memory: 0,
        scratch_bytes: 0,
        aligned: None,
    }
}

/// A kernel's parameters as the manifest lists them, with `doc` saying what each is.
pub fn params_info(kernel: &Kernel, doc: &dyn Fn(&str) -> &str) -> Vec<AbiParamInfo> {
    kernel
        .params
        .iter()
        .map(|p| {
            let (kind, rank) = match p.ty {
                Type::Tensor(_, r) => ("tensor", r),
                _ => ("scalar", 0),
            };
            AbiParamInfo {
                name: p.name.clone(),
                kind: kind.into(),
                dtype: p.ty.dtype().to_string(),
                rank,
                meaning: doc(&p.name).to_string(),
            }
        })
        .collect()
}

/// One candidate configuration of a PTX kernel.
struct PtxJob<'a> {
    inst: &'a KernelInstance<'a>,
    kernel: &'a Kernel,
    cand: crate::ptx::candidates::Candidate,
}

/// Every candidate of every kernel for `arch` (the PTX target's policy:
/// [`crate::ptx::candidates`]), compiled in parallel. Kernels without a candidate are
/// named in a note; everything else must compile.
fn build_ptx(
    spec: &Spec,
    opts: &BuildOptions,
    selected: &[KernelInstance],
    kernels: &[Kernel],
    arch: crate::ptx::Arch,
    progress: &mut dyn FnMut(Progress),
    created: &mut Created,
) -> Result<Vec<Artifact>, CodegenError> {
    use crate::ptx::candidates::{candidates, Skip};
    let op = spec.operation();
    let out_dir = &opts.out_dir;
    let mut jobs = Vec::new();
    let mut skipped: BTreeMap<String, usize> = BTreeMap::new();
    let target = Target::Ptx(arch.name().to_string());
    for (inst, kernel) in selected.iter().zip(kernels) {
        // A role may fix a launch axis (e.g. one warp count for a small kernel); the
        // others come from the kernel's schedule for this target.
        let schedule = spec.schedule.resolve(Some(&target), inst.dtype, &inst.keys);
        let values = |axis: &str| -> Vec<u32> {
            match inst.tile.get(axis) {
                Some(v) => vec![*v],
                None => schedule.values(axis).iter().copied().filter(|v| opts.keeps(axis, *v)).collect(),
            }
        };
        let (warps, stages) = (values("num_warps"), values("num_stages"));
        let stages = if stages.is_empty() { vec![1] } else { stages };
        match candidates(kernel, arch, &warps, &stages, &opts.ptx_paths) {
            Ok(cs) => jobs.extend(cs.into_iter().map(|cand| PtxJob { inst, kernel, cand })),
            Err(skip) => {
                let why = match skip {
                    Skip::F32Products => {
                        "f32 kernels left out (tensor cores take bf16/f16; f32 runs on the cpu target)".into()
                    }
                    other => format!("kernel(s) left out: {other}"),
                };
                *skipped.entry(why).or_default() += 1;
            }
        }
    }
    for (why, n) in &skipped {
        eprintln!("note: ptx:{arch}: {n} {why}");
    }
    let dir = out_dir.join("ptx").join(arch.name());
    created.mkdir(&dir)?;
    progress(Progress::Target { target: &format!("ptx:{}", arch.name()), total: jobs.len() });
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    // Each worker also hashes its PTX for the manifest (a warm build is mostly hashing).
    type Compiled = (crate::ptx::PtxKernel, String);
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Result<Compiled, CodegenError>)>();
    let mut results: Vec<Option<Compiled>> = (0..jobs.len()).map(|_| None).collect();
    std::thread::scope(|scope| -> Result<(), CodegenError> {
        for _ in 0..threads.min(jobs.len().max(1)) {
            let tx = tx.clone();
            let (jobs, next) = (&jobs, &next);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(j) = jobs.get(i) else { break };
                let r = crate::ptx::compile(j.kernel, &j.cand.cfg).map(|k| {
                    let sha = sha256_hex(k.ptx.as_bytes());
                    (k, sha)
                });
                let _ = tx.send((i, r));
            });
        }
        drop(tx);
        for (done, (i, r)) in rx.into_iter().enumerate() {
            progress(Progress::Kernel { done, total: jobs.len(), id: &jobs[i].inst.id });
            results[i] = Some(r?);
        }
        Ok(())
    })?;
    let mut artifacts = Vec::new();
    let mut too_big = 0;
    for (j, r) in jobs.iter().zip(results) {
        let Some((k, sha)) = r else { continue };
        if k.code.smem_bytes > arch.max_shared_memory() {
            too_big += 1;
            continue;
        }
        let suffix = &j.cand.suffix;
        let file = format!("ptx/{}/{}_{suffix}.ptx", arch.name(), j.inst.id);
        let path = out_dir.join(&file);
        created.file(&path);
        std::fs::write(&path, &k.ptx).map_err(|error| CodegenError::Io { path: path.clone(), error })?;
        let target = format!("ptx:{}", arch.name());
        let mut a = artifact_of(op, j.inst, j.kernel, target.clone(), file, sha);
        a.config.extend(j.cand.config.clone());
        a.artifact_id = format!("{}@{target}/{suffix}", j.inst.id);
        a.entry = k.code.entry.clone();
        a.block = Some([k.code.threads as u32, 1, 1]);
        a.dynamic_shared_memory = k.code.smem_bytes as u32;
        a.aligned = k.code.aligned_entry.clone().map(|entry| ejc_ir::manifest::AlignedEntry {
            entry,
            tensors: k.code.aligned_tensors.clone(),
            positive: k.code.positive_scalars.clone(),
            tensor_maps: k.code.tensor_maps.iter().map(|t| t.map_param()).collect(),
        });
        artifacts.push(a);
    }
    if too_big > 0 {
        eprintln!(
            "note: ptx:{arch}: {too_big} configuration(s) left out: they need more than the {} bytes of shared memory a block may have",
            arch.max_shared_memory()
        );
    }
    Ok(artifacts)
}

/// Threads per block of the MLIR gpu form's kernels.
pub const MLIR_GPU_THREADS: usize = 128;

/// The chip MLIR's NVVM target compiles the gpu form for (sm_80 code runs on every GPU
/// from Ampere on).
pub const MLIR_GPU_CHIP: &str = "sm_80";

/// `mlir:cpu`: the verified module of every kernel, as text. `mlir:gpu`: the same for
/// the gpu form, plus its PTX from MLIR's NVVM pipeline (compiled in parallel).
fn build_mlir(
    op: &dyn Operation,
    form: &str,
    opts: &BuildOptions,
    selected: &[KernelInstance],
    kernels: &[Kernel],
    progress: &mut dyn FnMut(Progress),
    created: &mut Created,
) -> Result<Vec<Artifact>, CodegenError> {
    use crate::mlir::{self, Form, GpuOptions};
    let gpu = match form {
        "cpu" => false,
        "gpu" => true,
        other => return Err(CodegenError::Empty(format!("unknown MLIR form `{other}` (forms: mlir:cpu, mlir:gpu)"))),
    };
    let dir = opts.out_dir.join("mlir").join(form);
    created.mkdir(&dir)?;
    let mform = if gpu { Form::Gpu { threads: MLIR_GPU_THREADS } } else { Form::Cpu };
    let base = |inst: &KernelInstance, kernel: &Kernel, target: String, file: String, sha: String| {
        artifact_of(op, inst, kernel, target, file, sha)
    };
    // Text first (every kernel must verify), on every core, through the cache.
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let chunk = kernels.len().div_ceil(threads.max(1)).max(1);
    let texts: Vec<Result<(String, mlir::Translation), mlir::MlirError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = kernels
            .chunks(chunk)
            .map(|part| scope.spawn(move || part.iter().map(|k| mlir::to_mlir_cached(k, mform)).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join().unwrap_or_else(|_| {
                    vec![Err(mlir::MlirError::Gpu {
                        kernel: "?".into(),
                        message: "a translation thread panicked".into(),
                    })]
                })
            })
            .collect()
    });
    let mut artifacts = Vec::new();
    for ((inst, kernel), translated) in selected.iter().zip(kernels).zip(texts) {
        let (text, info) = translated?;
        let file = format!("mlir/{form}/{}.mlir", inst.id);
        let path = opts.out_dir.join(&file);
        created.file(&path);
        std::fs::write(&path, &text).map_err(|error| CodegenError::Io { path: path.clone(), error })?;
        let mut a = base(inst, kernel, format!("mlir:{form}"), file, sha256_hex(text.as_bytes()));
        a.entry = info.entry;
        a.scratch_bytes = info.scratch_bytes as u64;
        if gpu {
            a.block = Some([MLIR_GPU_THREADS as u32, 1, 1]);
        }
        artifacts.push(a);
    }
    if !gpu {
        return Ok(artifacts);
    }
    // PTX through MLIR's NVVM pipeline, on every core.
    progress(Progress::Target { target: &format!("mlir:gpu:{MLIR_GPU_CHIP}"), total: kernels.len() });
    let next = std::sync::atomic::AtomicUsize::new(0);
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Result<mlir::GpuPtx, mlir::MlirError>)>();
    let mut results: Vec<Option<mlir::GpuPtx>> = (0..kernels.len()).map(|_| None).collect();
    std::thread::scope(|scope| -> Result<(), CodegenError> {
        for _ in 0..threads.min(kernels.len().max(1)) {
            let tx = tx.clone();
            let next = &next;
            scope.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(k) = kernels.get(i) else { break };
                let o = GpuOptions { chip: MLIR_GPU_CHIP.into(), threads: MLIR_GPU_THREADS };
                let _ = tx.send((i, mlir::compile_gpu(k, o)));
            });
        }
        drop(tx);
        for (done, (i, r)) in rx.into_iter().enumerate() {
            progress(Progress::Kernel { done, total: kernels.len(), id: &selected[i].id });
            results[i] = Some(r?);
        }
        Ok(())
    })?;
    for ((inst, kernel), r) in selected.iter().zip(kernels).zip(results) {
        let Some(p) = r else { continue };
        let target = format!("mlir:gpu:{MLIR_GPU_CHIP}");
        let file = format!("mlir/gpu/{}.{MLIR_GPU_CHIP}.ptx", inst.id);
        let path = opts.out_dir.join(&file);
        created.file(&path);
        std::fs::write(&path, &p.ptx).map_err(|error| CodegenError::Io { path: path.clone(), error })?;
        let mut a = base(inst, kernel, target, file, sha256_hex(p.ptx.as_bytes()));
        a.entry = p.entry;
        a.block = Some([p.threads as u32, 1, 1]);
        a.scratch_bytes = p.scratch_bytes as u64;
        a.config.insert("threads".into(), p.threads as u32);
        artifacts.push(a);
    }
    Ok(artifacts)
}

/// Write through a temporary file and a rename, so a reader never sees half a file; on
/// failure the temporary file is removed.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CodegenError> {
    let tmp = path.with_extension("json.tmp");
    let written =
        std::fs::write(&tmp, bytes).map_err(|error| CodegenError::Io { path: tmp.clone(), error }).and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|error| CodegenError::Io { path: path.to_path_buf(), error })
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// A pass-pipeline failure as a build error: invalid IR is the kernel's (a compiler bug,
/// named with the kernel), an unwritable `EJC_DUMP_IR` is the environment's.
pub(crate) fn pipeline_error(kernel: &str, e: PassError) -> CodegenError {
    match e {
        PassError::Dump { path, error } => CodegenError::Dump { path, error },
        e => CodegenError::Kernel { kernel: kernel.to_string(), message: e.to_string() },
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Compile kernels for `isa` on every core (one LLVM context per thread, so they
/// compile in parallel), link one shared library, and return each kernel's code info
/// in input order.
pub fn compile_cpu_library(
    kernels: &[Kernel],
    isa: Isa,
    out: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<KernelCode>, CodegenError> {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(kernels.len().max(1));
    // Contiguous chunks, so the library's symbol order follows the manifest's.
    let chunk = kernels.len().div_ceil(threads.max(1)).max(1);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let results: Vec<Result<cpu::CompiledObject, CodegenError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = kernels
            .chunks(chunk)
            .map(|part| {
                let tx = tx.clone();
                scope.spawn(move || {
                    // Small objects per thread: progress per kernel, bounded memory.
                    let mut objs = Vec::new();
                    for k in part {
                        let obj = cpu::compile_object(std::slice::from_ref(k), isa)?;
                        let _ = tx.send(k.name.clone());
                        objs.push(obj);
                    }
                    Ok::<_, CodegenError>(objs)
                })
            })
            .collect();
        drop(tx);
        for (done, name) in rx.into_iter().enumerate() {
            progress(Progress::Kernel { done, total: kernels.len(), id: &name });
        }
        handles
            .into_iter()
            .flat_map(|h| match h.join() {
                Ok(Ok(objs)) => objs.into_iter().map(Ok).collect::<Vec<_>>(),
                Ok(Err(e)) => vec![Err(e)],
                Err(_) => vec![Err(CodegenError::Llvm("a compiler thread panicked".into()))],
            })
            .collect()
    });
    let objs: Vec<cpu::CompiledObject> = results.into_iter().collect::<Result<_, _>>()?;
    let bytes: Vec<&[u8]> = objs.iter().map(|o| o.object.as_slice()).collect();
    cpu::link_shared_library(&bytes, out)?;
    Ok(objs.into_iter().flat_map(|o| o.kernels).collect())
}
