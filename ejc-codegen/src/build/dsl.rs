//! The build-script helper: compile a crate's `#[ej_kernel]` kernels (and flash
//! kernels with its mask / score mods) to a CPU library and a manifest at build time.
//!
//! ```ignore
//! // build.rs of a user crate (kernels live in src/kernels.rs, compiled here too):
//! #[path = "src/kernels.rs"]
//! mod kernels;
//!
//! fn main() {
//!     println!("cargo:rerun-if-changed=src/kernels.rs");
//!     ejc_codegen::build::dsl::DslBuild::new("demo")
//!         .registered()                       // every #[ej_kernel] kernel linked in
//!         .flash("prefix_alibi", ejc_codegen::build::dsl::FlashKernel {
//!             features: Default::default(), dtype: ejc_ir::types::DType::F32, head_dim: 64,
//!             block_m: 32, block_n: 32,
//!             hooks: ejc_ir::flash::FlashHooks { mask_mod: Some(kernels::prefix_lm::MOD), score_mod: None },
//!         })
//!         .compile()
//!         .unwrap_or_else(|e| panic!("{e}"));
//! }
//! ```
//!
//! `compile` writes `$OUT_DIR/ejc-<name>/manifest.json` and one `.so` per ISA, and
//! tells cargo `EJC_<NAME>_DIR` (upper case, `-` → `_`) so that the crate opens it
//! with `ejc_runtime::dsl::DslLibrary::open(env!("EJC_DEMO_DIR"))`. With
//! [`DslBuild::ptx`] it also writes one `.ptx` per kernel and architecture, which
//! `DslLibrary::gpu_kernel` loads on a GPU (ejc-runtime's `cuda` feature).

use std::collections::BTreeMap;
use std::path::PathBuf;

use ejc_ir::dsl::{registered, KernelDef, Registration};
use ejc_ir::flash::{build_flash_kernel_with, Features, FlashHooks};
use ejc_ir::ir::Kernel;
use ejc_ir::manifest::{AbiParamInfo, Artifact, Compiler, Instance, Launch, Manifest, Plan, SpecInfo, FORMAT};
use ejc_ir::op::Operation;
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::types::{DType, Type};

use super::{compile_cpu_library, params_info, sha256_hex, write_atomic, Progress};
use crate::cpu::Isa;
use crate::ptx::{Arch, CodePath, Overlap, PtxConfig};
use crate::{CodegenError, COMPILER_VERSION};

/// A flash kernel of `specs/flash.yaml`'s family with mods compiled in.
#[derive(Clone, Debug)]
pub struct FlashKernel {
    pub features: Features,
    pub dtype: DType,
    pub head_dim: usize,
    pub block_m: usize,
    pub block_n: usize,
    pub hooks: FlashHooks,
}

enum Item {
    Kernel(KernelDef),
    Flash(String, FlashKernel),
}

/// What to compile; see the module docs.
pub struct DslBuild {
    name: String,
    items: Vec<Item>,
    isas: Vec<Isa>,
    archs: Vec<Arch>,
    mlir: bool,
    out_dir: Option<PathBuf>,
    quiet: bool,
}

/// What `compile` wrote.
#[derive(Clone, Debug)]
pub struct DslBuildReport {
    /// The directory holding `manifest.json` and the libraries.
    pub dir: PathBuf,
    pub manifest: Manifest,
}

fn kernel_params(k: &Kernel) -> Vec<AbiParamInfo> {
    k.params
        .iter()
        .map(|p| {
            let (kind, dtype, rank) = match &p.ty {
                Type::Tensor(d, r) => ("tensor", *d, *r),
                other => ("scalar", other.dtype(), 0),
            };
            AbiParamInfo {
                name: p.name.clone(),
                kind: kind.into(),
                dtype: dtype.to_string(),
                rank,
                meaning: "#[ej_kernel] parameter".into(),
            }
        })
        .collect()
}

impl DslBuild {
    /// A build named `name` (letters, digits, `-`, `_`).
    pub fn new(name: &str) -> DslBuild {
        DslBuild {
            name: name.to_string(),
            items: Vec::new(),
            isas: Vec::new(),
            archs: Vec::new(),
            mlir: false,
            out_dir: None,
            quiet: false,
        }
    }

    /// Add one kernel (`my_kernel::DEF`).
    pub fn kernel(mut self, def: KernelDef) -> DslBuild {
        self.items.push(Item::Kernel(def));
        self
    }

    /// Add every `#[ej_kernel]` kernel linked into the running program (the build
    /// script, which includes the crate's kernel module).
    pub fn registered(mut self) -> DslBuild {
        let mut defs: Vec<KernelDef> = registered()
            .into_iter()
            .filter_map(|r| match r {
                Registration::Kernel(k) => Some(k),
                _ => None,
            })
            .collect();
        defs.sort_by_key(|d| d.name);
        for d in defs {
            if !self.items.iter().any(|i| matches!(i, Item::Kernel(k) if k.name == d.name)) {
                self.items.push(Item::Kernel(d));
            }
        }
        self
    }

    /// Add a flash kernel with mods, under `name`.
    pub fn flash(mut self, name: &str, k: FlashKernel) -> DslBuild {
        self.items.push(Item::Flash(name.to_string(), k));
        self
    }

    /// Compile for `isa` (may be given several times; default: the build machine's).
    pub fn isa(mut self, isa: Isa) -> DslBuild {
        if !self.isas.contains(&isa) {
            self.isas.push(isa);
        }
        self
    }

    /// Also compile every kernel to PTX for `arch` (may be given several times: `sm_80`
    /// code runs on every GPU from Ampere on, `sm_90a` on Hopper only), in the
    /// configuration the PTX target's candidate policy offers ([`crate::ptx::candidates`]):
    /// tensor cores (`mma.sync`, `wgmma` on `sm_90a`) for products of 16-bit tiles, the
    /// CUDA cores for f32 products; the most warps the tiles' rows split over. The CPU
    /// libraries are compiled as well, and flash kernels with mods ([`DslBuild::flash`])
    /// too (`DslLibrary::run_flash_gpu`).
    pub fn ptx(mut self, arch: Arch) -> DslBuild {
        if !self.archs.contains(&arch) {
            self.archs.push(arch);
        }
        self
    }

    /// Also go through the MLIR back end: every kernel's (and point's) verified module as
    /// text (`mlir:cpu` artifacts, `<name>.<entry>.cpu.mlir`, for reading; the CPU runs
    /// the CPU target's libraries) and its PTX through MLIR's NVVM pipeline
    /// (`mlir:gpu:sm_80`, 128 threads a block, tiles in global scratch), which
    /// `DslLibrary::gpu_kernel_on(gpu, name, "mlir:gpu:sm_80")` loads. Flash kernels with
    /// mods stay CPU-only.
    pub fn mlir(mut self) -> DslBuild {
        self.mlir = true;
        self
    }

    /// Write here instead of `$OUT_DIR/ejc-<name>`.
    pub fn out_dir(mut self, dir: impl Into<PathBuf>) -> DslBuild {
        self.out_dir = Some(dir.into());
        self
    }

    /// No `cargo:` lines (for use outside build scripts, e.g. tests).
    pub fn quiet(mut self) -> DslBuild {
        self.quiet = true;
        self
    }

    /// Build every kernel's IR, run the pass pipeline, compile, link, write the manifest.
    pub fn compile(self) -> Result<DslBuildReport, CodegenError> {
        let ok_name =
            !self.name.is_empty() && self.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !ok_name {
            return Err(CodegenError::Empty(format!("build name `{}` must be letters, digits, `-` or `_`", self.name)));
        }
        if self.items.is_empty() {
            return Err(CodegenError::Empty(format!(
                "build `{}` has no kernels (is the module with the #[ej_kernel] functions included in build.rs?)",
                self.name
            )));
        }
        let dir = match &self.out_dir {
            Some(d) => d.clone(),
            None => {
                let out = std::env::var_os("OUT_DIR").ok_or_else(|| {
                    CodegenError::Empty("OUT_DIR is not set: call compile() from build.rs, or set out_dir()".into())
                })?;
                PathBuf::from(out).join(format!("ejc-{}", self.name))
            }
        };
        std::fs::create_dir_all(&dir).map_err(|error| CodegenError::Io { path: dir.clone(), error })?;

        // Tile IR after the pipeline, plus each kernel's manifest fields.
        let pipeline = default_pipeline();
        let mut kernels = Vec::new();
        let mut metas = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for item in &self.items {
            let mut built: Vec<(String, Kernel, Meta)> = Vec::new();
            match item {
                Item::Kernel(def) => {
                    // One kernel per point of the schedule space (the default keeps the
                    // plain name; the others' entries carry the point).
                    let points: Vec<(String, BTreeMap<String, i64>, ejc_ir::dsl::KernelBuildFn)> =
                        if def.points.is_empty() {
                            vec![("default".into(), BTreeMap::new(), def.build)]
                        } else {
                            def.points
                                .iter()
                                .map(|p| {
                                    let consts = p.consts.iter().map(|(n, v)| (n.to_string(), *v)).collect();
                                    (p.suffix(), consts, p.build)
                                })
                                .collect()
                        };
                    for (i, (point, consts, build)) in points.into_iter().enumerate() {
                        let mut k = build()
                            .map_err(|e| CodegenError::Kernel { kernel: def.name.into(), message: e.to_string() })?;
                        if i > 0 {
                            k.name = format!("{}__{point}", def.name);
                        }
                        let params = kernel_params(&k);
                        let config: BTreeMap<String, u32> = consts
                            .iter()
                            .filter(|(_, v)| **v >= 0)
                            .map(|(n, v)| (n.to_lowercase(), *v as u32))
                            .collect();
                        let mut features = BTreeMap::new();
                        if !def.points.is_empty() {
                            features.insert("point".to_string(), serde_json::Value::from(point.clone()));
                            features.insert("consts".to_string(), serde_json::json!(consts));
                        }
                        built.push((
                            def.name.to_string(),
                            k,
                            Meta {
                                instance: Instance {
                                    variant: def.name.to_string(),
                                    dtype: "none".into(),
                                    keys: BTreeMap::new(),
                                },
                                features,
                                config,
                                params,
                                grid: ["caller".into(), "caller".into(), "caller".into()],
                                point,
                                warps: def.warps,
                                stages: def.stages,
                            },
                        ));
                    }
                }
                Item::Flash(name, f) => {
                    let k =
                        build_flash_kernel_with(name, &f.features, f.dtype, f.head_dim, f.block_m, f.block_n, &f.hooks)
                            .map_err(|e| CodegenError::Kernel { kernel: name.clone(), message: e.to_string() })?;
                    let mut features = f.features.to_json();
                    if let Some(m) = f.hooks.mask_mod {
                        features.insert("mask_mod".into(), m.name.into());
                    }
                    if let Some(s) = f.hooks.score_mod {
                        features.insert("score_mod".into(), s.name.into());
                    }
                    // The tensors the mods read, for the runtime's checks of a call.
                    let mut mod_tensors: Vec<ejc_ir::dsl::ModTensorSpec> = Vec::new();
                    for t in f.hooks.mod_tensors() {
                        let spec = ejc_ir::dsl::ModTensorSpec::from(t);
                        match mod_tensors.iter_mut().find(|x| x.name == spec.name) {
                            Some(x) => {
                                for (a, roles) in x.axes.iter_mut().zip(spec.axes) {
                                    a.extend(roles.into_iter().filter(|r| !a.contains(r)).collect::<Vec<_>>());
                                }
                            }
                            None => mod_tensors.push(spec),
                        }
                    }
                    if !mod_tensors.is_empty() {
                        features.insert(
                            "mod_tensors".into(),
                            serde_json::to_value(&mod_tensors).expect("mod tensors serialise"),
                        );
                    }
                    let mut config = BTreeMap::new();
                    config.insert("block_m".to_string(), f.block_m as u32);
                    config.insert("block_n".to_string(), f.block_n as u32);
                    let grid = k.grid.clone().map(|g| g.to_string());
                    let op = &ejc_ir::flash::op::FlashAttentionFwd;
                    let params = params_info(&k, &|n| op.param_doc(n));
                    let keys = BTreeMap::from([("head_dim".to_string(), f.head_dim as u32)]);
                    built.push((
                        name.clone(),
                        k,
                        Meta {
                            instance: Instance { variant: name.clone(), dtype: f.dtype.to_string(), keys },
                            features,
                            config,
                            params,
                            grid,
                            point: "default".into(),
                            warps: &[],
                            stages: &[],
                        },
                    ));
                }
            }
            if !seen.insert(built[0].0.clone()) {
                return Err(CodegenError::Empty(format!(
                    "build `{}` has two kernels named `{}`",
                    self.name, built[0].0
                )));
            }
            for (id, raw, meta) in built {
                let k = run_pipeline(&raw, &pipeline).map_err(|e| super::pipeline_error(&id, e))?;
                kernels.push(k);
                metas.push((id, meta));
            }
        }

        let isas = if self.isas.is_empty() { vec![Isa::host()] } else { self.isas.clone() };
        let mut artifacts = Vec::new();
        for isa in isas {
            let file = format!("{}.{}.so", self.name, isa.name());
            let path = dir.join(&file);
            let codes = compile_cpu_library(&kernels, isa, &path, &mut |_p: Progress| {})?;
            let bytes = std::fs::read(&path).map_err(|error| CodegenError::Io { path: path.clone(), error })?;
            let sha = sha256_hex(&bytes);
            for ((id, m), code) in metas.iter().zip(codes) {
                let target = format!("cpu:{}", isa.name());
                artifacts.push(Artifact {
                    kernel_id: id.clone(),
                    instance: m.instance.clone(),
                    role: "main".into(),
                    features: m.features.clone(),
                    config: m.config.clone(),
                    artifact_id: artifact_id(id, m, &target),
                    target,
                    file: file.clone(),
                    sha256: sha.clone(),
                    entry: code.entry.clone(),
                    params: m.params.clone(),
                    grid: m.grid.clone(),
                    block: None,
                    dynamic_shared_memory: 0,
                    scratch_bytes: code.scratch_bytes,
                    aligned: None,
                });
            }
        }
        for &arch in &self.archs {
            // Kernels, and flash kernels with mods (run by `DslLibrary::run_flash_gpu`).
            for (k, (id, m)) in kernels.iter().zip(&metas) {
                let cfgs = ptx_configs(k, arch, m.warps, m.stages)
                    .map_err(|e| CodegenError::Kernel { kernel: id.clone(), message: e })?;
                let schedule = !m.warps.is_empty() || !m.stages.is_empty();
                let mut too_big = Vec::new();
                for cfg in cfgs {
                    // A kernel whose warps or stages are tuned has one entry per schedule.
                    let point = if schedule {
                        let base = if m.point == "default" { String::new() } else { format!("{}_", m.point) };
                        let ws = if matches!(cfg.path, CodePath::WarpSpecialised { .. }) { "_ws" } else { "" };
                        format!("{base}w{}_s{}{ws}", cfg.num_warps, cfg.num_stages)
                    } else {
                        m.point.clone()
                    };
                    let p = if schedule {
                        let mut renamed = k.clone();
                        renamed.name = format!("{id}__{point}");
                        crate::ptx::compile(&renamed, &cfg)?
                    } else {
                        crate::ptx::compile(k, &cfg)?
                    };
                    if p.code.smem_bytes > arch.max_shared_memory() {
                        too_big.push(format!(
                            "{} warps, {} stages: {} bytes",
                            cfg.num_warps, cfg.num_stages, p.code.smem_bytes
                        ));
                        continue;
                    }
                    let (entry, ptx) = (p.code.entry.clone(), &p.ptx);
                    let file = format!("{}.{entry}.{}.ptx", self.name, arch.name());
                    let path = dir.join(&file);
                    write_atomic(&path, ptx.as_bytes())?;
                    let target = format!("ptx:{}", arch.name());
                    let mut config = m.config.clone();
                    config.insert("num_warps".into(), cfg.num_warps as u32);
                    config.insert("num_stages".into(), cfg.num_stages as u32);
                    let mut features = m.features.clone();
                    if schedule {
                        features.insert("point".into(), serde_json::Value::from(point.clone()));
                        features.entry("consts".to_string()).or_insert_with(|| serde_json::json!({}));
                    }
                    let pm = Meta { point: point.clone(), features: features.clone(), ..m.clone() };
                    artifacts.push(Artifact {
                        kernel_id: id.clone(),
                        instance: m.instance.clone(),
                        role: "main".into(),
                        features,
                        config,
                        artifact_id: artifact_id(id, &pm, &target),
                        target,
                        file,
                        sha256: sha256_hex(ptx.as_bytes()),
                        entry,
                        params: m.params.clone(),
                        grid: m.grid.clone(),
                        block: Some([p.code.threads as u32, 1, 1]),
                        dynamic_shared_memory: p.code.smem_bytes as u32,
                        scratch_bytes: 0,
                        // The launch runs the aligned entry where the tensors allow it
                        // (docs/abi.md, "Aligned entry"), with its tensor maps.
                        aligned: p.code.aligned_entry.clone().map(|entry| ejc_ir::manifest::AlignedEntry {
                            entry,
                            tensors: p.code.aligned_tensors.clone(),
                            positive: p.code.positive_scalars.clone(),
                            tensor_maps: p.code.tensor_maps.iter().map(|t| t.map_param()).collect(),
                        }),
                    });
                }
                if !too_big.is_empty()
                    && !artifacts.iter().any(|a| a.kernel_id == *id && a.target == format!("ptx:{}", arch.name()))
                {
                    return Err(CodegenError::Kernel {
                        kernel: id.clone(),
                        message: format!(
                            "needs more shared memory on {arch} than a block may have ({} bytes): {}",
                            arch.max_shared_memory(),
                            too_big.join("; ")
                        ),
                    });
                }
                for t in &too_big {
                    if !self.quiet {
                        println!(
                            "cargo:warning=ejc: `{id}` point `{}` skipped on {arch}: shared memory ({t})",
                            m.point
                        );
                    }
                }
            }
        }
        if self.mlir {
            use super::{MLIR_GPU_CHIP, MLIR_GPU_THREADS};
            use crate::mlir::{self, Form, GpuOptions};
            let dsl: Vec<(&Kernel, &(String, Meta))> =
                kernels.iter().zip(&metas).filter(|(_, (_, m))| m.instance.dtype == "none").collect();
            // PTX through MLIR's NVVM pipeline on every core (cached on disk by module).
            let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(dsl.len().max(1));
            let next = std::sync::atomic::AtomicUsize::new(0);
            let mut ptx: Vec<Option<Result<mlir::GpuPtx, mlir::MlirError>>> = (0..dsl.len()).map(|_| None).collect();
            std::thread::scope(|scope| {
                let (tx, rx) = std::sync::mpsc::channel();
                for _ in 0..threads {
                    let (tx, next, dsl) = (tx.clone(), &next, &dsl);
                    scope.spawn(move || loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((k, _)) = dsl.get(i) else { break };
                        let o = GpuOptions { chip: MLIR_GPU_CHIP.into(), threads: MLIR_GPU_THREADS };
                        let _ = tx.send((i, mlir::compile_gpu(k, o)));
                    });
                }
                drop(tx);
                for (i, r) in rx {
                    ptx[i] = Some(r);
                }
            });
            for ((k, (id, m)), p) in dsl.iter().zip(ptx) {
                let (text, info) = mlir::to_mlir_cached(k, Form::Cpu)
                    .map_err(|e| CodegenError::Kernel { kernel: id.clone(), message: format!("MLIR: {e}") })?;
                let file = format!("{}.{}.cpu.mlir", self.name, k.name);
                write_atomic(&dir.join(&file), text.as_bytes())?;
                artifacts.push(Artifact {
                    kernel_id: id.clone(),
                    instance: m.instance.clone(),
                    role: "main".into(),
                    features: m.features.clone(),
                    config: m.config.clone(),
                    artifact_id: artifact_id(id, m, "mlir:cpu"),
                    target: "mlir:cpu".into(),
                    file,
                    sha256: sha256_hex(text.as_bytes()),
                    entry: info.entry.clone(),
                    params: m.params.clone(),
                    grid: m.grid.clone(),
                    block: None,
                    dynamic_shared_memory: 0,
                    scratch_bytes: info.scratch_bytes as u64,
                    aligned: None,
                });
                let p = p.expect("every kernel was compiled").map_err(|e| CodegenError::Kernel {
                    kernel: id.clone(),
                    message: format!("MLIR's NVVM pipeline: {e}"),
                })?;
                let target = format!("mlir:gpu:{MLIR_GPU_CHIP}");
                let file = format!("{}.{}.mlir.{MLIR_GPU_CHIP}.ptx", self.name, k.name);
                write_atomic(&dir.join(&file), p.ptx.as_bytes())?;
                let mut config = m.config.clone();
                config.insert("threads".into(), p.threads as u32);
                artifacts.push(Artifact {
                    kernel_id: id.clone(),
                    instance: m.instance.clone(),
                    role: "main".into(),
                    features: m.features.clone(),
                    config,
                    artifact_id: artifact_id(id, m, &target),
                    target,
                    file,
                    sha256: sha256_hex(p.ptx.as_bytes()),
                    entry: p.entry,
                    params: m.params.clone(),
                    grid: m.grid.clone(),
                    block: Some([p.threads as u32, 1, 1]),
                    dynamic_shared_memory: 0,
                    scratch_bytes: p.scratch_bytes as u64,
                    aligned: None,
                });
            }
        }
        // Every kernel runs alone: one `single` plan each, like an operation's.
        let mut planned = std::collections::HashSet::new();
        let plans = metas
            .iter()
            .filter(|(id, _)| planned.insert(id.clone()))
            .map(|(_, m)| Plan {
                name: "single".into(),
                instance: m.instance.clone(),
                features: m.features.clone(),
                temporaries: Vec::new(),
                launches: vec![Launch::of("main")],
                axes: BTreeMap::new(),
                shared: Vec::new(),
            })
            .collect();
        let manifest = Manifest {
            format: FORMAT.into(),
            compiler: Compiler { name: "ejc".into(), version: COMPILER_VERSION.into() },
            spec: SpecInfo {
                name: self.name.clone(),
                file: "#[ej_kernel]".into(),
                sha256: sha256_hex(format!("{:?}", kernels).as_bytes()),
                op: format!("dsl:{}", self.name),
                version: 1,
            },
            plans,
            artifacts,
        };
        write_atomic(&dir.join("manifest.json"), manifest.to_json().as_bytes())?;
        if !self.quiet {
            let var = format!("EJC_{}_DIR", self.name.to_uppercase().replace('-', "_"));
            println!("cargo:rustc-env={var}={}", dir.display());
        }
        Ok(DslBuildReport { dir, manifest })
    }
}

/// The configurations a DSL kernel is compiled in for `arch`. Without a tuned schedule
/// (`warps`, `stages` empty): one, a candidate of the PTX target's policy (the most
/// warps the tiles' rows allow, 8 to 1 — two warpgroups for a 128-row tile measured 2.1x
/// one on the H100, docs/perf.md; two stages; on `sm_90a` `wgmma` where the products
/// allow it), or, for f32 products (which the policy leaves to the CPU targets) and tiles
/// whose rows split over no warp count, `mma.sync`'s path on the CUDA cores with the
/// most warps the tiles allow. With one: one per listed warp count and stage count the
/// tiles allow (the same path choice for each).
fn ptx_configs(k: &Kernel, arch: Arch, warps: &[u32], stages: &[u32]) -> Result<Vec<PtxConfig>, String> {
    use crate::ptx::candidates::{candidates, register_rows};
    let schedule = !warps.is_empty() || !stages.is_empty();
    let ws: &[u32] = if warps.is_empty() { &[8, 4, 2, 1] } else { warps };
    let ss: &[u32] = if stages.is_empty() { &[2] } else { stages };
    let rows = register_rows(k);
    let fits = |w: usize| rows.iter().all(|r| r.is_multiple_of(16 * w));
    let mut out: Vec<PtxConfig> = Vec::new();
    if let Ok(c) = candidates(k, arch, ws, ss, &[]) {
        // On sm_90a the `wgmma` ones without warp specialisation (whose copies run in the
        // aligned entry, which takes tensor maps), else the first, per (warps, stages).
        for &w in ws {
            for &st in ss {
                let of = |c: &&crate::ptx::candidates::Candidate| {
                    c.cfg.num_warps == w as usize && c.cfg.num_stages == st as usize
                };
                let rotated = Overlap::Rotated;
                let wg = c.iter().filter(of).find(|c| c.cfg.path == CodePath::Wgmma { overlap: rotated });
                match wg.or(c.iter().find(of)) {
                    Some(p) => out.push(p.cfg),
                    None => continue,
                }
                // With a schedule, warp specialisation is a point of its own where it
                // applies (TMA copies by a producer warp in the aligned entry).
                let ws = CodePath::WarpSpecialised { overlap: rotated };
                if let Some(p) = c.iter().filter(of).find(|c| c.cfg.path == ws).filter(|_| schedule) {
                    out.push(p.cfg);
                }
            }
        }
    }
    if out.is_empty() {
        // CUDA cores.
        let cuda_ws: Vec<usize> = if schedule {
            ws.iter().map(|&w| w as usize).filter(|&w| w <= 4 && fits(w)).collect()
        } else {
            [4usize, 2, 1].into_iter().find(|&w| fits(w)).into_iter().collect()
        };
        let cuda_ws = if cuda_ws.is_empty() && !schedule { vec![1] } else { cuda_ws };
        for w in cuda_ws {
            for &st in if schedule { ss } else { &[1][..] } {
                out.push(PtxConfig { arch, num_warps: w, num_stages: st as usize, path: CodePath::MmaSync });
            }
        }
    }
    if !schedule {
        out.truncate(1);
    }
    if out.is_empty() {
        return Err(format!(
            "no schedule of warps {ws:?} and stages {ss:?} fits its register tiles (rows {rows:?}: every one must be a \
             multiple of 16 × warps)"
        ));
    }
    Ok(out)
}

/// `name@target` for a kernel without a schedule space, `name[point]@target` with one.
fn artifact_id(id: &str, m: &Meta, target: &str) -> String {
    if m.point == "default" {
        format!("{id}@{target}")
    } else {
        format!("{id}[{}]@{target}", m.point)
    }
}

#[derive(Clone)]
struct Meta {
    instance: Instance,
    features: BTreeMap<String, serde_json::Value>,
    config: BTreeMap<String, u32>,
    params: Vec<AbiParamInfo>,
    grid: [String; 3],
    /// The point of the schedule space (`bm64_bn128`), or `default`.
    point: String,
    warps: &'static [u32],
    stages: &'static [u32],
}
