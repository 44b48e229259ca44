//! `ejc build`: spec → kernels → pass pipeline → targets → manifest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ejc_ir::flash::abi::abi_params;
use ejc_ir::flash::{instances, KernelInstance};
use ejc_ir::ir::Kernel;
use ejc_ir::manifest::{AbiParamInfo, Artifact, Compiler, Manifest, SpecInfo, FORMAT};
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::spec::{Features, SoftCap, Spec, Target, Window};
use ejc_ir::types::{DType, Type};
use serde_json::json;
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
    /// Only these head dims (empty = all of the spec's).
    pub head_dims: Vec<usize>,
    /// Only these tilings (empty = all of the schedule's).
    pub block_m: Vec<u32>,
    pub block_n: Vec<u32>,
    /// Only these launch configurations of GPU targets (empty = all).
    pub num_warps: Vec<u32>,
    pub num_stages: Vec<u32>,
    /// Only these code paths of PTX targets (empty = all): `mma` (`mma.sync`), `wgmma`
    /// (sm_90a), `ws` (sm_90a, warp-specialised, with or without the sunk softmax).
    pub ptx_paths: Vec<String>,
}

/// Progress events, for a progress bar or log lines.
#[derive(Clone, Debug)]
pub enum Progress<'a> {
    Start { kernels: usize, targets: usize },
    Kernel { done: usize, total: usize, id: &'a str },
    Finished,
}

#[derive(Clone, Debug)]
pub struct BuildReport {
    pub manifest: Manifest,
    pub manifest_path: PathBuf,
    /// Tile programs built.
    pub kernels: usize,
}

/// The instances of `spec` that pass the filters in `opts`; an unknown filter value
/// is an error naming what exists.
pub fn select<'s>(spec: &'s Spec, opts: &BuildOptions) -> Result<Vec<KernelInstance<'s>>, CodegenError> {
    for v in &opts.variants {
        if spec.variant(v).is_none() {
            let names: Vec<&str> = spec.variants.iter().map(|v| v.name.as_str()).collect();
            return Err(CodegenError::Empty(format!(
                "spec `{}` has no variant `{v}` (variants: {})",
                spec.name,
                names.join(", ")
            )));
        }
    }
    for d in &opts.dtypes {
        if !spec.dtypes.contains(d) {
            return Err(CodegenError::Empty(format!(
                "spec `{}` does not declare dtype {d} (dtypes: {})",
                spec.name,
                join(&spec.dtypes)
            )));
        }
    }
    for h in &opts.head_dims {
        if !spec.head_dims.contains(h) {
            return Err(CodegenError::Empty(format!(
                "spec `{}` does not declare head_dim {h} (head_dims: {})",
                spec.name,
                join(&spec.head_dims)
            )));
        }
    }
    Ok(instances(spec)
        .into_iter()
        .filter(|i| opts.variants.is_empty() || opts.variants.contains(&i.variant.name))
        .filter(|i| opts.dtypes.is_empty() || opts.dtypes.contains(&i.dtype))
        .filter(|i| opts.head_dims.is_empty() || opts.head_dims.contains(&i.head_dim))
        .filter(|i| opts.block_m.is_empty() || opts.block_m.contains(&i.block_m))
        .filter(|i| opts.block_n.is_empty() || opts.block_n.contains(&i.block_n))
        .collect())
}

fn join<T: std::fmt::Display>(xs: &[T]) -> String {
    xs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

pub fn build(
    spec: &Spec,
    opts: &BuildOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<BuildReport, CodegenError> {
    if opts.targets.is_empty() {
        return Err(CodegenError::Empty("no target given".into()));
    }
    // Refuse unsupported targets before writing anything.
    for t in &opts.targets {
        check_supported(t)?;
    }
    let selected = select(spec, opts)?;
    std::fs::create_dir_all(&opts.out_dir).map_err(|error| CodegenError::Io { path: opts.out_dir.clone(), error })?;
    progress(Progress::Start { kernels: selected.len(), targets: opts.targets.len() });
    // Tile IR of every kernel, after the pipeline: the input of every target.
    let pipeline = default_pipeline();
    let mut kernels = Vec::with_capacity(selected.len());
    for inst in &selected {
        let kernel_err = |message: String| CodegenError::Kernel { kernel: inst.id.clone(), message };
        let raw = inst.build(spec).map_err(|e| kernel_err(e.to_string()))?;
        kernels.push(run_pipeline(&raw, &pipeline).map_err(|e| kernel_err(e.to_string()))?);
    }
    let mut artifacts = Vec::new();
    let artifact = |inst: &KernelInstance, target: String, file: String, sha256: String, scratch_bytes: u64| Artifact {
        scratch_bytes,
        ..artifact_of(inst, target, file, sha256)
    };
    for target in &opts.targets {
        match target {
            Target::Ir => {
                for (n, (inst, kernel)) in selected.iter().zip(&kernels).enumerate() {
                    progress(Progress::Kernel { done: n, total: selected.len(), id: &inst.id });
                    let (file, text) = crate::ir::write(&opts.out_dir, kernel)?;
                    artifacts.push(artifact(inst, "ir".into(), file, sha256_hex(text.as_bytes()), 0));
                }
            }
            Target::Cpu(isa) => {
                let isa = match isa {
                    Some(name) => name.parse::<Isa>().map_err(CodegenError::Empty)?,
                    None => Isa::host(),
                };
                let file = format!("cpu/{}.{}.so", spec.name, isa.name());
                let path = opts.out_dir.join(&file);
                let codes = compile_cpu_library(&kernels, isa, &path, progress)?;
                let bytes = std::fs::read(&path).map_err(|error| CodegenError::Io { path: path.clone(), error })?;
                let sha = sha256_hex(&bytes);
                for (inst, code) in selected.iter().zip(codes) {
                    artifacts.push(artifact(
                        inst,
                        format!("cpu:{}", isa.name()),
                        file.clone(),
                        sha.clone(),
                        code.scratch_bytes,
                    ));
                }
            }
            Target::Ptx(arch) => {
                let arch: crate::ptx::Arch = arch.parse().map_err(CodegenError::Empty)?;
                artifacts.extend(build_ptx(spec, opts, &selected, &kernels, arch, progress)?);
            }
            Target::Mlir(form) => {
                artifacts.extend(build_mlir(form, opts, &selected, &kernels, progress)?);
            }
        }
    }
    progress(Progress::Finished);
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
        artifacts,
    };
    let manifest_path = opts.out_dir.join("manifest.json");
    write_atomic(&manifest_path, manifest.to_json().as_bytes())?;
    Ok(BuildReport { manifest, manifest_path, kernels: selected.len() })
}

/// The manifest entry of `inst` built for `target` into `file`: the kernel's identity,
/// features, ABI and grid; targets fill in their launch details.
fn artifact_of(inst: &KernelInstance, target: String, file: String, sha256: String) -> Artifact {
    let mut config = BTreeMap::new();
    config.insert("block_m".to_string(), inst.block_m);
    config.insert("block_n".to_string(), inst.block_n);
    Artifact {
        kernel_id: inst.id.clone(),
        variant: inst.variant.name.clone(),
        features: features_json(&inst.variant.features),
        dtype: inst.dtype.to_string(),
        head_dim: inst.head_dim,
        config,
        artifact_id: format!("{}@{target}", inst.id),
        target,
        file,
        sha256,
        entry: inst.id.clone(),
        params: params_info(&inst.variant.features, inst.dtype),
        grid: ejc_ir::flash::abi::grid(&inst.variant.features, inst.block_m as usize).map(|g| g.to_string()),
        block: None,
        dynamic_shared_memory: 0,
        scratch_bytes: 0,
        aligned: None,
    }
}

/// One candidate configuration of a PTX kernel.
struct PtxJob<'a> {
    inst: &'a KernelInstance<'a>,
    kernel: &'a Kernel,
    warps: u32,
    stages: u32,
    wgmma: bool,
    ws: bool,
    sink: bool,
}

/// Every (kernel × num_warps × num_stages) of the schedule for `arch`, compiled in
/// parallel. f32 kernels and configurations whose tiles do not fit the warps are left
/// out (a note says so); everything else must compile.
fn build_ptx(
    spec: &Spec,
    opts: &BuildOptions,
    selected: &[KernelInstance],
    kernels: &[Kernel],
    arch: crate::ptx::Arch,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<Artifact>, CodegenError> {
    let out_dir = &opts.out_dir;
    let mut jobs = Vec::new();
    let mut skipped_f32 = 0;
    for (inst, kernel) in selected.iter().zip(kernels) {
        if inst.dtype == DType::F32 {
            skipped_f32 += 1;
            continue;
        }
        for &warps in &spec.schedule.num_warps {
            if !(inst.block_m as usize).is_multiple_of(16 * warps as usize)
                || !(opts.num_warps.is_empty() || opts.num_warps.contains(&warps))
            {
                continue;
            }
            for &stages in &spec.schedule.num_stages {
                if !(opts.num_stages.is_empty() || opts.num_stages.contains(&stages)) {
                    continue;
                }
                jobs.push(PtxJob { inst, kernel, warps, stages, wgmma: false, ws: false, sink: false });
                // sm_90a: Hopper's warpgroup MMA too, as one more candidate (warps in
                // whole warpgroups); the autotuner picks between the instruction paths.
                if arch == crate::ptx::Arch::Sm90a && warps % 4 == 0 {
                    jobs.push(PtxJob { inst, kernel, warps, stages, wgmma: true, ws: false, sink: false });
                    // And warp-specialised (a producer warpgroup copying with the bulk
                    // tensor copy engine), where it applies (not to varlen's bounded tiles).
                    let cfg = crate::ptx::PtxConfig {
                        arch,
                        num_warps: warps as usize,
                        num_stages: stages as usize,
                        wgmma: true,
                        ws: true,
                        sink: false,
                    };
                    if crate::ptx::ws_applies(kernel, &cfg).is_ok() {
                        jobs.push(PtxJob { inst, kernel, warps, stages, wgmma: true, ws: true, sink: false });
                        // The softmax sunk into the masks' branch: measured faster at
                        // head_dim 64 and slower at 128 on the H100 (registers), so a
                        // candidate only where it can win.
                        if inst.head_dim <= 64 {
                            jobs.push(PtxJob { inst, kernel, warps, stages, wgmma: true, ws: true, sink: true });
                        }
                    }
                }
            }
        }
    }
    if !opts.ptx_paths.is_empty() {
        let path = |j: &PtxJob| {
            if j.ws {
                "ws"
            } else if j.wgmma {
                "wgmma"
            } else {
                "mma"
            }
        };
        jobs.retain(|j| opts.ptx_paths.iter().any(|p| p == path(j)));
    }
    if skipped_f32 > 0 {
        eprintln!(
            "note: ptx:{arch}: {skipped_f32} f32 kernels left out (tensor cores take bf16/f16; f32 attention runs on the cpu target)"
        );
    }
    let dir = out_dir.join("ptx").join(arch.name());
    std::fs::create_dir_all(&dir).map_err(|error| CodegenError::Io { path: dir.clone(), error })?;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Result<crate::ptx::PtxKernel, CodegenError>)>();
    let mut results: Vec<Option<crate::ptx::PtxKernel>> = (0..jobs.len()).map(|_| None).collect();
    std::thread::scope(|scope| -> Result<(), CodegenError> {
        for _ in 0..threads.min(jobs.len().max(1)) {
            let tx = tx.clone();
            let (jobs, next) = (&jobs, &next);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(j) = jobs.get(i) else { break };
                let cfg = crate::ptx::PtxConfig {
                    arch,
                    num_warps: j.warps as usize,
                    num_stages: j.stages as usize,
                    wgmma: j.wgmma,
                    ws: j.ws,
                    sink: j.sink,
                };
                let _ = tx.send((i, crate::ptx::compile(j.kernel, &cfg)));
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
        let Some(k) = r else { continue };
        if k.code.smem_bytes > arch.max_shared_memory() {
            too_big += 1;
            continue;
        }
        let suffix = format!(
            "w{}_s{}{}{}{}",
            j.warps,
            j.stages,
            if j.wgmma { "_wgmma" } else { "" },
            if j.ws { "_ws" } else { "" },
            if j.sink { "_sink" } else { "" }
        );
        let file = format!("ptx/{}/{}_{suffix}.ptx", arch.name(), j.inst.id);
        let path = out_dir.join(&file);
        std::fs::write(&path, &k.ptx).map_err(|error| CodegenError::Io { path: path.clone(), error })?;
        let target = format!("ptx:{}", arch.name());
        let mut a = artifact_of(j.inst, target.clone(), file, sha256_hex(k.ptx.as_bytes()));
        a.config.insert("num_warps".to_string(), j.warps);
        a.config.insert("num_stages".to_string(), j.stages);
        if j.wgmma {
            a.config.insert("wgmma".to_string(), 1);
        }
        if j.ws {
            a.config.insert("ws".to_string(), 1);
        }
        if j.sink {
            a.config.insert("sink".to_string(), 1);
        }
        a.artifact_id = format!("{}@{target}/{suffix}", j.inst.id);
        a.entry = k.code.entry.clone();
        a.block = Some([k.code.threads as u32, 1, 1]);
        a.dynamic_shared_memory = k.code.smem_bytes as u32;
        a.aligned = k.code.aligned_entry.clone().map(|entry| ejc_ir::manifest::AlignedEntry {
            entry,
            tensors: k.code.aligned_tensors.clone(),
            positive: k.code.positive_scalars.clone(),
            tensor_maps: k
                .code
                .tensor_maps
                .iter()
                .map(|t| ejc_ir::manifest::TensorMapParam {
                    tensor: t.tensor.clone(),
                    box_dims: t.box_dims.clone(),
                    swizzle: "128B".into(),
                })
                .collect(),
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
    form: &str,
    opts: &BuildOptions,
    selected: &[KernelInstance],
    kernels: &[Kernel],
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<Artifact>, CodegenError> {
    use crate::mlir::{self, Form, GpuOptions};
    let gpu = match form {
        "cpu" => false,
        "gpu" => true,
        other => return Err(CodegenError::Empty(format!("unknown MLIR form `{other}` (forms: mlir:cpu, mlir:gpu)"))),
    };
    let dir = opts.out_dir.join("mlir").join(form);
    std::fs::create_dir_all(&dir).map_err(|error| CodegenError::Io { path: dir.clone(), error })?;
    let mform = if gpu { Form::Gpu { threads: MLIR_GPU_THREADS } } else { Form::Cpu };
    let base = artifact_of;
    // Text first (fast, and every kernel must verify).
    let mut artifacts = Vec::new();
    for (inst, kernel) in selected.iter().zip(kernels) {
        let (text, info) = mlir::to_mlir(kernel, mform)?;
        let file = format!("mlir/{form}/{}.mlir", inst.id);
        let path = opts.out_dir.join(&file);
        std::fs::write(&path, &text).map_err(|error| CodegenError::Io { path: path.clone(), error })?;
        let mut a = base(inst, format!("mlir:{form}"), file, sha256_hex(text.as_bytes()));
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
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
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
    for (inst, r) in selected.iter().zip(results) {
        let Some(p) = r else { continue };
        let target = format!("mlir:gpu:{MLIR_GPU_CHIP}");
        let file = format!("mlir/gpu/{}.{MLIR_GPU_CHIP}.ptx", inst.id);
        let path = opts.out_dir.join(&file);
        std::fs::write(&path, &p.ptx).map_err(|error| CodegenError::Io { path: path.clone(), error })?;
        let mut a = base(inst, target, file, sha256_hex(p.ptx.as_bytes()));
        a.entry = p.entry;
        a.block = Some([p.threads as u32, 1, 1]);
        a.scratch_bytes = p.scratch_bytes as u64;
        a.config.insert("threads".into(), p.threads as u32);
        artifacts.push(a);
    }
    Ok(artifacts)
}

/// Write through a temporary file and a rename, so a reader never sees half a file.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CodegenError> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, bytes).map_err(|error| CodegenError::Io { path: tmp.clone(), error })?;
    std::fs::rename(&tmp, path).map_err(|error| CodegenError::Io { path: path.to_path_buf(), error })
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The variant's features as JSON, with the spec's vocabulary.
pub fn features_json(f: &Features) -> BTreeMap<String, serde_json::Value> {
    let mut m = BTreeMap::new();
    m.insert("causal".into(), json!(f.causal));
    m.insert(
        "sliding_window".into(),
        match f.sliding_window {
            None => json!(null),
            Some(Window::Runtime) => json!("runtime"),
            Some(Window::Fixed { left, right }) => json!([left, right]),
        },
    );
    m.insert(
        "logits_soft_cap".into(),
        match f.logits_soft_cap {
            None => json!(null),
            Some(SoftCap::Runtime) => json!("runtime"),
            Some(SoftCap::Fixed(c)) => json!(c),
        },
    );
    for (k, v) in [
        ("sinks", f.sinks),
        ("bias", f.bias),
        ("mask", f.mask),
        ("segment_ids", f.segment_ids),
        ("varlen", f.varlen),
        ("dropout", f.dropout),
    ] {
        m.insert(k.into(), json!(v));
    }
    m
}

pub fn params_info(f: &Features, dtype: DType) -> Vec<AbiParamInfo> {
    abi_params(f, dtype)
        .into_iter()
        .map(|p| {
            let (kind, rank) = match p.ty {
                Type::Tensor(_, r) => ("tensor", r),
                _ => ("scalar", 0),
            };
            AbiParamInfo {
                name: p.name.into(),
                kind: kind.into(),
                dtype: p.ty.dtype().to_string(),
                rank,
                meaning: p.meaning.into(),
            }
        })
        .collect()
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
