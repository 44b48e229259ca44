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
//! with `ejc_runtime::dsl::DslLibrary::open(env!("EJC_DEMO_DIR"))`.

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
        DslBuild { name: name.to_string(), items: Vec::new(), isas: Vec::new(), out_dir: None, quiet: false }
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
            let (id, raw, meta) = match item {
                Item::Kernel(def) => {
                    let k = (def.build)()
                        .map_err(|e| CodegenError::Kernel { kernel: def.name.into(), message: e.to_string() })?;
                    let params = kernel_params(&k);
                    (
                        def.name.to_string(),
                        k,
                        Meta {
                            instance: Instance {
                                variant: def.name.to_string(),
                                dtype: "none".into(),
                                keys: BTreeMap::new(),
                            },
                            features: BTreeMap::new(),
                            config: BTreeMap::new(),
                            params,
                            grid: ["caller".into(), "caller".into(), "caller".into()],
                        },
                    )
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
                    let mut config = BTreeMap::new();
                    config.insert("block_m".to_string(), f.block_m as u32);
                    config.insert("block_n".to_string(), f.block_n as u32);
                    let grid = k.grid.clone().map(|g| g.to_string());
                    let op = &ejc_ir::flash::op::FlashAttentionFwd;
                    let params = params_info(&k, &|n| op.param_doc(n));
                    let keys = BTreeMap::from([("head_dim".to_string(), f.head_dim as u32)]);
                    (
                        name.clone(),
                        k,
                        Meta {
                            instance: Instance { variant: name.clone(), dtype: f.dtype.to_string(), keys },
                            features,
                            config,
                            params,
                            grid,
                        },
                    )
                }
            };
            if !seen.insert(id.clone()) {
                return Err(CodegenError::Empty(format!("build `{}` has two kernels named `{id}`", self.name)));
            }
            let k = run_pipeline(&raw, &pipeline).map_err(|e| super::pipeline_error(&id, e))?;
            kernels.push(k);
            metas.push((id, meta));
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
                    artifact_id: format!("{id}@{target}"),
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
        // Every kernel runs alone: one `single` plan each, like an operation's.
        let plans = metas
            .iter()
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

struct Meta {
    instance: Instance,
    features: BTreeMap<String, serde_json::Value>,
    config: BTreeMap<String, u32>,
    params: Vec<AbiParamInfo>,
    grid: [String; 3],
}
