//! The operation seam: everything the spine (spec front end, build driver, manifest,
//! registry, configuration chain, tuner, command line, GPU runner) needs to know about an
//! operation, behind one trait, [`Operation`]. The spine names no operation; each
//! operation lives in one module of [`crate::ops`].
//!
//! ```
//! let op = ejc_ir::ops::get("mean_pooling").unwrap();
//! assert_eq!(op.name(), "mean_pooling");
//! let dims: Vec<&str> = op.dims().iter().map(|d| d.name).collect();
//! assert!(dims.contains(&"chunk_size"));
//! ```
//!
//! Vocabulary (docs/architecture.md has the picture):
//!
//! - **features**: what a variant computes, in the spec's vocabulary (a JSON map; the
//!   operation reads it back typed). A call is matched to the variant whose features it
//!   asks for ([`Operation::matches`]).
//! - **instance**: variant × dtype × the operation's compile-time **keys** (flash:
//!   `head_dim`): what a call must match exactly ([`crate::manifest::Instance`]).
//! - **dims**: the sizes a user states for a call (`batch`, `seq_q`, ...; `--size` on the
//!   command line); **sizes**: every named size of a validated call, dims and derived
//!   ones (`num_seqs`, `max_seqlen_q`, ...), which grid formulas, temporaries and cache
//!   keys read.
//! - **schedule axes**: named, declared by the operation ([`AxisDecl`]): *tile* axes
//!   change the tile program (`block_m`), *launch* axes are code-generation choices of
//!   GPU targets (`num_warps`), *run-time* axes are values a plan reads at run time and
//!   the autotuner chooses (`num_splits`).
//! - **plan**: how a call runs: one launch or several, with temporaries between them
//!   ([`PlanDecl`]); each launch runs the kernel of a **role** (`main`, `partial`,
//!   `combine`).
//! - **config**: the values of a candidate's axes; a plan other than the operation's
//!   first carries the marker `plan:<name>` = 1 (see [`plan_of`]).

use std::collections::BTreeMap;

use crate::interp::Arg;
use crate::ir::{GridExpr, Kernel};
use crate::manifest::{Instance, Launch, Temporary};
use crate::spec::{Decoder, Fields, ScheduleSpace, Spec, Target, Variant};
use crate::tensor::HostTensor;
use crate::types::{DType, Type};

/// A variant's features in the spec's vocabulary.
pub type Features = BTreeMap<String, serde_json::Value>;
/// An operation's compile-time keys (`head_dim` = 128).
pub type Keys = BTreeMap<String, u32>;
/// A candidate configuration: schedule values, code-path flags, plan marker.
pub type Config = BTreeMap<String, u32>;
/// Named sizes of a call.
pub type Sizes = BTreeMap<String, i64>;
/// Named run-time scalars of a call (`softmax_scale`, `chunk_size`, ...).
pub type Scalars = BTreeMap<String, f64>;

/// The key of a configuration that selects plan `name` (absent for the operation's first
/// plan, so single-kernel configurations read as they always have).
pub fn plan_marker(name: &str) -> String {
    format!("plan:{name}")
}

/// The plan a configuration selects, given the instance's plan names (first = default).
pub fn plan_of<'p>(config: &Config, plans: &[&'p str]) -> Option<&'p str> {
    plans.iter().skip(1).find(|p| config.contains_key(&plan_marker(p))).or(plans.first()).copied()
}

/// `m64_n32` (block sizes) or `key=value` pairs for other configurations.
pub fn config_id(c: &Config) -> String {
    match (c.get("block_m"), c.get("block_n")) {
        (Some(m), Some(n)) if c.len() == 2 => format!("m{m}_n{n}"),
        _ => c.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","),
    }
}

/// What kind of choice a schedule axis is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AxisKind {
    /// Changes the tile program: one kernel per value (`block_m`).
    Tile,
    /// A code-generation choice of GPU targets (`num_warps`, `num_stages`).
    Launch,
    /// Read by a plan at run time; no kernel is compiled per value (`num_splits`).
    Runtime,
}

/// A schedule axis an operation declares, with the spec's rules for its values.
#[derive(Clone, Copy, Debug)]
pub struct AxisDecl {
    pub name: &'static str,
    pub kind: AxisKind,
    /// A spec must list it.
    pub required: bool,
    /// `block size`: what one value is called in messages.
    pub noun: &'static str,
    /// What one value may be, and what the list may be (for messages).
    pub allowed: &'static str,
    pub list_allowed: &'static str,
    /// Why a value is refused, or None when it is fine.
    pub check: fn(i64) -> Option<&'static str>,
}

/// A size a user states for a call.
#[derive(Clone, Copy, Debug)]
pub struct DimDecl {
    pub name: &'static str,
    /// Used by `ejc run` when the user gives no value.
    pub default: i64,
    /// A trailing size that may be left out (of `--shape` too): the operation derives it
    /// from the others (flash's `head_dim_v` is `head_dim`), and `default` is unused.
    pub optional: bool,
    pub doc: &'static str,
}

/// A run-time scalar of an operation's calls.
#[derive(Clone, Copy, Debug)]
pub struct ScalarDecl {
    pub name: &'static str,
    pub doc: &'static str,
}

/// One role of a plan: the kernel it launches is compiled for every combination of
/// `tile_axes` of the spec's schedule; `fixed` sets axes to one value for this role
/// (e.g. the combine kernel of split-KV uses one tiling and warp count).
#[derive(Clone, Debug)]
pub struct RoleDecl {
    pub name: &'static str,
    pub tile_axes: Vec<&'static str>,
    pub fixed: Config,
}

/// How one call of an instance runs: roles (kernels), temporaries, launches in order,
/// and the run-time axes the autotuner chooses among.
#[derive(Clone, Debug)]
pub struct PlanDecl {
    pub name: &'static str,
    pub roles: Vec<RoleDecl>,
    pub temporaries: Vec<Temporary>,
    pub launches: Vec<Launch>,
    pub runtime_axes: Vec<&'static str>,
    /// Tile axes every role of the plan takes the same value of: a candidate pairs only
    /// artifacts that agree on them (a role that writes a table per tile for another
    /// role to read). Empty: each role's tiling is free.
    pub shared_axes: Vec<&'static str>,
}

impl PlanDecl {
    /// The one-kernel plan `single`: role `main` compiled for every combination of
    /// `tile_axes`, launched on the call's tensors.
    pub fn single(tile_axes: &[&'static str]) -> PlanDecl {
        PlanDecl {
            name: "single",
            roles: vec![RoleDecl { name: "main", tile_axes: tile_axes.to_vec(), fixed: Config::new() }],
            temporaries: Vec::new(),
            launches: vec![Launch::of("main")],
            runtime_axes: Vec::new(),
            shared_axes: Vec::new(),
        }
    }
}

/// One tile program a spec expands to: an instance, a role, and the values of the
/// role's tile axes.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelInstance<'s> {
    /// The kernel id (also its entry symbol: a C identifier).
    pub id: String,
    pub variant: &'s Variant,
    pub dtype: DType,
    pub keys: Keys,
    pub role: &'static str,
    /// The role's tile-axis values (and its fixed values).
    pub tile: Config,
}

impl KernelInstance<'_> {
    pub fn instance(&self) -> Instance {
        Instance { variant: self.variant.name.clone(), dtype: self.dtype.to_string(), keys: self.keys.clone() }
    }
}

/// How much work a call is, for benchmarks (GFLOP/s, GB/s).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    pub flops: f64,
    /// Bytes every kernel must move at least (inputs read once, outputs written once).
    pub bytes: f64,
}

/// The metadata of one tensor of a call.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
}

/// A call as an operation validates it: named tensors (wherever they live) and scalars.
pub trait CallView {
    fn tensor(&self, name: &str) -> Option<TensorInfo>;
    /// The elements of a small integer tensor (prefix sums), copied to the host.
    fn int_values(&self, name: &str) -> Result<Vec<i64>, String>;
    fn scalar(&self, name: &str) -> Option<f64>;
}

/// A call on the host: named tensors (inputs and outputs) and scalars.
#[derive(Clone, Debug, Default)]
pub struct HostCall {
    pub tensors: BTreeMap<String, HostTensor>,
    pub scalars: Scalars,
}

impl CallView for HostCall {
    fn tensor(&self, name: &str) -> Option<TensorInfo> {
        self.tensors.get(name).map(|t| TensorInfo {
            dtype: t.dtype,
            shape: t.shape.clone(),
            strides: t.strides.clone(),
        })
    }
    fn int_values(&self, name: &str) -> Result<Vec<i64>, String> {
        let t = self.tensors.get(name).ok_or_else(|| format!("the call has no `{name}`"))?;
        Ok(t.to_vec().into_iter().map(|x| x as i64).collect())
    }
    fn scalar(&self, name: &str) -> Option<f64> {
        self.scalars.get(name).copied()
    }
}

/// DESIGN.md's tolerance on ‖out − ref‖ / ‖ref‖.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 5e-3,
        _ => 1e-2,
    }
}

/// A kernel's tolerance: that of the lowest-precision float tensor it takes (bf16
/// 1e-2, f16 5e-3, f32 1e-5). Back ends may compute within it: the PTX back end takes
/// the hardware `tanh.approx` where it is 5e-3 or looser (docs/semantics.md).
pub fn kernel_tolerance(k: &crate::ir::Kernel) -> f64 {
    k.params
        .iter()
        .filter_map(|p| match p.ty {
            crate::types::Type::Tensor(d, _) if d.is_float() => Some(tolerance(d)),
            _ => None,
        })
        .fold(tolerance(DType::F32), f64::max)
}

/// An operation: one module of [`crate::ops`] implements this, and nothing else in the
/// spine knows what the operation computes.
pub trait Operation: Sync {
    /// The registry key, e.g. `flash_attention_fwd`.
    fn name(&self) -> &'static str;
    /// One line: what it computes.
    fn summary(&self) -> &'static str;

    // ---- the spec ----------------------------------------------------------------

    /// The input dtypes a spec may list.
    fn dtypes(&self) -> &'static [DType];
    /// Why another IR dtype is refused: "cannot be an attention input".
    fn dtype_refusal(&self) -> &'static str;
    /// The operation's own top-level spec fields (flash: `layout`, `head_dims`).
    fn fields(&self) -> &'static [&'static str];
    /// Decode them (reporting problems through `d`), adding the compile-time keys and
    /// the values of each; an operation whose keys come in pairs rather than in every
    /// combination (flash: `head_dim` with `head_dim_v`) also lists the combinations it
    /// builds in `sets`.
    fn decode_fields(&self, d: &mut Decoder, f: &Fields, keys: &mut Vec<(String, Vec<u32>)>, sets: &mut Vec<Keys>);
    /// The fields a variant may have (besides `description`).
    fn variant_fields(&self) -> &'static [&'static str];
    /// What a variant is, for messages: "a mapping of features such as `causal: true`".
    fn variant_allowed(&self) -> &'static str;
    /// One variant's features (problems reported through `d`).
    fn decode_variant(&self, d: &mut Decoder, f: &Fields) -> Features;
    /// A short description of features: `causal + sliding_window=runtime`.
    fn describe(&self, f: &Features) -> String;
    /// The schedule axes, in order.
    fn axes(&self) -> &'static [AxisDecl];
    /// Every plan the operation has (the first is the default).
    fn plan_names(&self) -> &'static [&'static str];
    /// The plans whose results may differ in the last bits from run to run (atomic
    /// adds in no fixed order); a call that asks to be deterministic never gets them.
    fn nondeterministic_plans(&self) -> &'static [&'static str] {
        &[]
    }

    // ---- kernels -------------------------------------------------------------------

    /// The plans of a variant that the spec's schedule allows, first the default.
    fn plans(&self, spec: &Spec, features: &Features) -> Vec<PlanDecl>;
    /// The kernel id of a tile program: a C identifier, unique within a build.
    fn kernel_id(&self, spec_name: &str, k: &KernelInstance) -> String;
    /// The tile IR of one kernel, before any pass.
    fn build(&self, spec: &Spec, k: &KernelInstance) -> Result<Kernel, String>;
    /// What a kernel parameter is, for the manifest (`input: queries [B, Sq, Hq, D]`).
    fn param_doc(&self, name: &str) -> &'static str;

    // ---- calls ---------------------------------------------------------------------

    /// The sizes a user states, in the order of the positional shorthand (`--shape`).
    fn dims(&self) -> &'static [DimDecl];
    /// The call's dtype (an input's: flash's `q`), or an error naming the argument.
    fn call_dtype(&self, call: &dyn CallView) -> Result<DType, String>;
    /// The compile-time keys a call of these dims needs (flash: `head_dim`).
    fn keys_of(&self, dims: &Sizes) -> Keys;
    /// The compile-time keys a call needs, read from its tensors (an error names the
    /// argument that is missing or malformed).
    fn call_keys(&self, call: &dyn CallView) -> Result<Keys, String>;
    /// The dims of a validated call (what [`Operation::random_call`] takes to make a
    /// call like it).
    fn dims_of(&self, sizes: &Sizes) -> Sizes;
    /// The run-time scalars of a variant's calls.
    fn scalars(&self, f: &Features) -> Vec<ScalarDecl>;
    /// Check a call (shapes against each other and against the instance's keys,
    /// dtypes, scalar ranges): every named size, or an error naming the argument.
    fn validate(&self, f: &Features, dtype: DType, keys: &Keys, call: &dyn CallView) -> Result<Sizes, String>;
    /// Whether a variant with features `variant` computes what a call asks for
    /// (`wanted`: the features with the call's values, e.g. a concrete window).
    fn matches(&self, variant: &Features, wanted: &Features) -> bool {
        variant == wanted
    }
    /// The features a call of a variant asks for, with the call's values (flash: a
    /// run-time window becomes the call's `[left, right]`); what a generic caller (a
    /// test, a runner) passes to the runtime for a call made by [`Operation::random_call`].
    fn wanted(&self, f: &Features, _call: &dyn CallView) -> Features {
        f.clone()
    }
    /// The call part of a cache key: sizes bucketed as the operation tunes them,
    /// dtype, features; never array values.
    fn cache_desc(&self, wanted: &Features, dtype: DType, sizes: &Sizes) -> serde_json::Value;

    // ---- reference, test data, work ------------------------------------------------

    /// Fresh random inputs (never zeros), outputs filled with NaN, default scalars.
    fn random_call(&self, f: &Features, dtype: DType, dims: &Sizes, seed: u64) -> Result<HostCall, String>;

    /// [`Operation::random_call`] with `scalars` in place of the random ones where the
    /// call has them (the tuner checks candidates on a small call with the real call's
    /// scalars). An operation whose inputs depend on its scalars (the flash backward's
    /// `out` and `lse`, a forward of the same window and soft cap) overrides this.
    fn random_call_with(
        &self,
        f: &Features,
        dtype: DType,
        dims: &Sizes,
        seed: u64,
        scalars: &Scalars,
    ) -> Result<HostCall, String> {
        let mut call = self.random_call(f, dtype, dims, seed)?;
        for (k, v) in call.scalars.iter_mut() {
            if let Some(x) = scalars.get(k) {
                *v = *x;
            }
        }
        Ok(call)
    }
    /// Inputs for timing alone: [`Operation::random_call_with`] unless an operation
    /// makes some inputs from a reference that would take long at the timed size (the
    /// flash backward's `out` and `lse`); a kernel's speed does not depend on values.
    fn timing_call(
        &self,
        f: &Features,
        dtype: DType,
        dims: &Sizes,
        seed: u64,
        scalars: &Scalars,
    ) -> Result<HostCall, String> {
        self.random_call_with(f, dtype, dims, seed, scalars)
    }
    /// How many elements the tensors of [`Operation::random_call`]'s call hold in all
    /// (inputs and outputs, an upper bound), counted with checked arithmetic so that a
    /// size whose count overflows 64 bits is an error: what `ejc run/bench/tune` judge
    /// a call's memory by before allocating anything.
    fn call_elements(&self, f: &Features, dims: &Sizes) -> Result<u64, String>;
    /// The reference outputs of a call (by output name), from the definition.
    fn reference(&self, f: &Features, call: &HostCall) -> Result<BTreeMap<String, HostTensor>, String>;
    /// The output tensors' names.
    fn outputs(&self, f: &Features) -> Vec<&'static str>;
    /// A small case of a call (the autotuner checks each candidate on it first).
    fn small_dims(&self, sizes: &Sizes) -> Sizes;
    /// Awkward cases for correctness runs of an instance (lengths off the block sizes,
    /// degenerate extents).
    fn check_dims(&self, keys: &Keys) -> Vec<Sizes>;
    fn work(&self, f: &Features, dtype: DType, sizes: &Sizes) -> Work;
    /// A configuration to use without measuring, among `configs` (an index).
    fn heuristic(&self, configs: &[Config]) -> Option<usize> {
        (!configs.is_empty()).then_some(0)
    }
}

// ---- plans: what every executor shares ---------------------------------------------

/// Every value a plan's formulas may name: the call's sizes and the configuration.
pub fn symbols(sizes: &Sizes, config: &Config) -> Sizes {
    let mut s = sizes.clone();
    for (k, v) in config {
        s.entry(k.clone()).or_insert(*v as i64);
    }
    s
}

/// A temporary's dtype for a call: a dtype's name, or `like:<tensor>`, the dtype of the
/// call's tensor of that name (`dtype_of`), so that a plan's temporary may hold an input's
/// values as they are (a copy of an input that needs no rounding).
pub fn temporary_dtype(t: &Temporary, dtype_of: impl Fn(&str) -> Option<DType>) -> Result<DType, String> {
    match t.dtype.strip_prefix("like:") {
        Some(name) => dtype_of(name)
            .ok_or_else(|| format!("temporary `{}`: its dtype is that of `{name}`, which the call lacks", t.name)),
        None => t.dtype.parse(),
    }
}

/// A temporary's dtype ([`temporary_dtype`]) and shape for a call.
pub fn temporary_shape(
    t: &Temporary,
    symbols: &Sizes,
    dtype_of: impl Fn(&str) -> Option<DType>,
) -> Result<(DType, Vec<usize>), String> {
    let dtype = temporary_dtype(t, dtype_of)?;
    let mut shape = Vec::new();
    for e in &t.shape {
        let n = GridExpr::parse(e)?.eval_in(symbols).map_err(|m| format!("temporary `{}`: {m}", t.name))?;
        shape.push(usize::try_from(n).map_err(|_| format!("temporary `{}`: extent {e} = {n} is negative", t.name))?);
    }
    let mut total: usize = 1;
    for d in &shape {
        total = total.checked_mul(*d).ok_or_else(|| format!("temporary `{}`: {shape:?} overflows", t.name))?;
    }
    Ok((dtype, shape))
}

/// What a kernel parameter is bound to in one launch.
#[derive(Clone, Debug, PartialEq)]
pub enum Bound {
    /// A tensor of the call or a temporary, by name.
    Tensor(String),
    Scalar(f64),
}

/// One parameter of a kernel, as a launcher sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSig {
    pub name: String,
    /// Tensors: dtype and rank; scalars: dtype.
    pub ty: Type,
}

impl ParamSig {
    pub fn of_kernel(k: &Kernel) -> Vec<ParamSig> {
        k.params.iter().map(|p| ParamSig { name: p.name.clone(), ty: p.ty.clone() }).collect()
    }
}

/// Bind a kernel's parameters for one launch: a tensor to the temporary or call tensor
/// the launch names (by default the call's tensor of the same name); a scalar to the
/// launch's formula, else the call's scalar, else a size or configuration value of that
/// name (e.g. `num_splits`).
pub fn bind(
    params: &[ParamSig],
    launch: &Launch,
    temporaries: &[Temporary],
    tensors: &dyn Fn(&str) -> Option<TensorInfo>,
    scalars: &Scalars,
    symbols: &Sizes,
) -> Result<Vec<Bound>, String> {
    let mut out = Vec::with_capacity(params.len());
    for p in params {
        let to = launch.bind.get(&p.name);
        match &p.ty {
            Type::Tensor(dtype, rank) => {
                let name = to.cloned().unwrap_or_else(|| p.name.clone());
                if let Some(t) = temporaries.iter().find(|t| t.name == name) {
                    let t_dtype = temporary_dtype(t, |n| tensors(n).map(|x| x.dtype))?;
                    if t_dtype != *dtype || t.shape.len() != *rank {
                        return Err(format!(
                            "`{}` takes a {dtype} tensor of rank {rank}, temporary `{name}` is {} of rank {}",
                            p.name,
                            t_dtype,
                            t.shape.len()
                        ));
                    }
                } else {
                    let t = tensors(&name).ok_or_else(|| {
                        format!("argument `{name}` is missing: the kernel's parameter `{}` needs it", p.name)
                    })?;
                    if t.dtype != *dtype {
                        return Err(format!("argument `{name}` has dtype {}, the kernel takes {dtype}", t.dtype));
                    }
                    if t.shape.len() != *rank || t.strides.len() != *rank {
                        return Err(format!(
                            "argument `{name}` has rank {}, the kernel takes rank {rank}",
                            t.shape.len()
                        ));
                    }
                }
                out.push(Bound::Tensor(name));
            }
            _ => {
                let v = match to {
                    Some(formula) => GridExpr::parse(formula)?.eval_in(symbols)? as f64,
                    None => match scalars.get(&p.name) {
                        Some(v) => *v,
                        None => {
                            *symbols.get(&p.name).ok_or_else(|| format!("scalar argument `{}` is missing", p.name))?
                                as f64
                        }
                    },
                };
                // The value must survive the conversion to the kernel's scalar type:
                // a window of 2^32 would wrap to 0 in an i32, a cap of 1e39 be
                // infinite in an f32.
                if let Type::Scalar(dt) = &p.ty {
                    crate::limits::check_scalar(*dt, v).map_err(|e| format!("scalar argument `{}`: {e}", p.name))?;
                }
                out.push(Bound::Scalar(v));
            }
        }
    }
    Ok(out)
}

/// The spec field `head_dims` as the compile-time key `head_dim` (multiples of 16 from 16
/// to 256, no duplicates): what operations with one head dim share (mean pooling, the
/// decode operations; flash pairs `head_dim` with `head_dim_v` instead).
pub fn decode_head_dims(d: &mut Decoder, f: &Fields, keys: &mut Vec<(String, Vec<u32>)>) {
    let allowed = "a multiple of 16 from 16 to 256";
    let list_allowed = "a non-empty list of multiples of 16 from 16 to 256";
    if let Some(v) = d.required(f, "head_dims", list_allowed) {
        let dims = d.unique_list(v, "head_dims", "head dimension", list_allowed, |d, node, path| {
            let v = d.int(node, path, allowed, |v| {
                if v % 16 != 0 {
                    Some("head dimension is not a multiple of 16")
                } else if !(16..=256).contains(&v) {
                    Some("head dimension is out of range")
                } else {
                    None
                }
            })?;
            u32::try_from(v).ok()
        });
        keys.push(("head_dim".into(), dims));
    }
}

/// Tensor argument `name` of a call with dtype `dtype` and rank `rank`, or an error naming
/// it: missing (with `doc`, what it is), another dtype, or another rank (`what`: its shape
/// in words, `[batch, seq, heads, head_dim]`).
pub fn tensor_arg(
    call: &dyn CallView,
    name: &str,
    doc: &str,
    dtype: DType,
    rank: usize,
    what: &str,
) -> Result<TensorInfo, String> {
    let t = call.tensor(name).ok_or_else(|| format!("argument `{name}` ({doc}) is missing"))?;
    if t.dtype != dtype {
        return Err(format!("argument `{name}` has dtype {}, the kernel takes {dtype}", t.dtype));
    }
    if t.shape.len() != rank || t.strides.len() != rank {
        return Err(format!("argument `{name}` has shape {:?}: it must be {what}", t.shape));
    }
    Ok(t)
}

/// `a · b · …` with every step checked: the element count of a tensor of these extents,
/// or an error naming the sizes when it overflows 64 bits.
pub fn elements(extents: &[usize]) -> Result<u64, String> {
    extents
        .iter()
        .try_fold(1u64, |acc, d| acc.checked_mul(*d as u64))
        .ok_or_else(|| format!("a tensor of {extents:?} has more elements than 64 bits can count"))
}

/// The sum of element counts, checked.
pub fn total_elements(counts: &[u64]) -> Result<u64, String> {
    counts
        .iter()
        .try_fold(0u64, |acc, c| acc.checked_add(*c))
        .ok_or_else(|| "the call's tensors have more elements than 64 bits can count".to_string())
}

/// A kernel's launch grid for a call.
pub fn grid_of(grid: &[GridExpr; 3], symbols: &Sizes) -> Result<[i64; 3], String> {
    let mut g = [0i64; 3];
    for (i, e) in grid.iter().enumerate() {
        g[i] = e.eval_in(symbols)?;
        if g[i] < 0 {
            return Err(format!("grid extent `{e}` is {} (negative)", g[i]));
        }
    }
    Ok(g)
}

/// A plan's temporaries and launches for one call, after the temporaries the call gives
/// (a precomputed layout, [`Temporary::given`]).
#[derive(Clone, Debug)]
pub struct GivenPlan {
    /// The temporaries still to allocate.
    pub temporaries: Vec<Temporary>,
    /// Per launch of the plan: `None` where it is skipped (it only produces given
    /// temporaries), else the launch with its `after` list renumbered over the kept ones.
    pub launches: Vec<Option<Launch>>,
    /// The names of the temporaries the call gives.
    pub given: Vec<String>,
}

/// Which of a plan's temporaries `tensor` (the call's tensors) gives: each one the plan
/// marks `given` and the call holds under its name, checked against the dtype and shape
/// the plan would allocate under `symbols` (sizes and configuration: a layout is built for
/// one tiling); the launches that produce only given temporaries are skipped. An error
/// names what the tiling needs, or a given temporary that a kept launch would overwrite.
pub fn given_temporaries(
    temporaries: &[Temporary],
    launches: &[Launch],
    tensor: &dyn Fn(&str) -> Option<TensorInfo>,
    symbols: &Sizes,
) -> Result<GivenPlan, String> {
    let mut kept = Vec::new();
    let mut given = Vec::new();
    for t in temporaries {
        match (t.given, tensor(&t.name)) {
            (true, Some(info)) => {
                let (dtype, shape) = temporary_shape(t, symbols, |n| tensor(n).map(|x| x.dtype))?;
                if info.dtype != dtype || info.shape != shape {
                    let tiling: Vec<String> = ["block_m", "block_n"]
                        .iter()
                        .filter_map(|k| symbols.get(*k).map(|v| format!("{k}={v}")))
                        .collect();
                    return Err(format!(
                        "argument `{}` (a precomputed layout) is {} of shape {:?}; with this call's sizes and the \
                         tiling {} it must be {dtype} of shape {shape:?}",
                        t.name,
                        info.dtype,
                        info.shape,
                        tiling.join(", ")
                    ));
                }
                given.push(t.name.clone());
            }
            _ => kept.push(t.clone()),
        }
    }
    if given.is_empty() {
        return Ok(GivenPlan { temporaries: kept, launches: launches.iter().cloned().map(Some).collect(), given });
    }
    let skip: Vec<bool> =
        launches.iter().map(|l| !l.produces.is_empty() && l.produces.iter().all(|p| given.contains(p))).collect();
    for (l, s) in launches.iter().zip(&skip) {
        if let (false, Some(p)) = (s, l.produces.iter().find(|p| given.contains(p))) {
            let all = l.produces.join("`, `");
            return Err(format!(
                "the call gives `{p}` but not all of what launch `{}` produces with it (`{all}`): give all of them \
                 or none",
                l.role
            ));
        }
    }
    // A kept launch waiting on a skipped one waits on what that one waited on.
    let waits = crate::manifest::launch_waits(launches)?;
    let mut index = vec![None; launches.len()];
    let mut n = 0;
    for (i, s) in skip.iter().enumerate() {
        if !s {
            index[i] = Some(n);
            n += 1;
        }
    }
    fn resolve(i: usize, skip: &[bool], waits: &[Vec<usize>], index: &[Option<usize>], out: &mut Vec<usize>) {
        if skip[i] {
            for &j in &waits[i] {
                resolve(j, skip, waits, index, out);
            }
        } else if let Some(k) = index[i] {
            if !out.contains(&k) {
                out.push(k);
            }
        }
    }
    let launches = launches
        .iter()
        .zip(&skip)
        .map(|(l, &s)| {
            (!s).then(|| {
                let mut l = l.clone();
                if let Some(after) = &l.after {
                    let mut out = Vec::new();
                    for &j in after {
                        resolve(j, &skip, &waits, &index, &mut out);
                    }
                    out.sort_unstable();
                    l.after = Some(out);
                }
                l
            })
        })
        .collect();
    Ok(GivenPlan { temporaries: kept, launches, given })
}

/// Run a plan on the interpreter: temporaries allocated (NaN-filled, so an element the
/// plan reads before writing shows), kernels launched in order on `call`'s tensors.
pub fn run_plan_interp(
    plan: &PlanDecl,
    kernels: &BTreeMap<String, Kernel>,
    call: &mut HostCall,
    sizes: &Sizes,
    config: &Config,
) -> Result<(), String> {
    run_plan_interp_in(plan, kernels, call, sizes, config, LaunchOrder::Listed)
}

/// The order [`run_plan_interp_in`] runs a plan's launches in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchOrder {
    /// As listed.
    Listed,
    /// [`crate::manifest::late_order`]: the latest-listed ready launch first. Where a plan
    /// declares launches independent (`after`), a launcher may run them at once; a plan
    /// whose declaration is honest gives the same results in both orders.
    Late,
}

/// [`run_plan_interp`] with the launches in `order`.
pub fn run_plan_interp_in(
    plan: &PlanDecl,
    kernels: &BTreeMap<String, Kernel>,
    call: &mut HostCall,
    sizes: &Sizes,
    config: &Config,
    order: LaunchOrder,
) -> Result<(), String> {
    let syms = symbols(sizes, config);
    let info = |n: &str| {
        call.tensors.get(n).map(|t| TensorInfo { dtype: t.dtype, shape: t.shape.clone(), strides: t.strides.clone() })
    };
    let given = given_temporaries(&plan.temporaries, &plan.launches, &info, &syms)?;
    let launches: Vec<Launch> = given.launches.into_iter().flatten().collect();
    let temporaries = given.temporaries;
    let order: Vec<usize> = match order {
        LaunchOrder::Listed => {
            crate::manifest::launch_waits(&launches)?;
            (0..launches.len()).collect()
        }
        LaunchOrder::Late => crate::manifest::late_order(&launches)?,
    };
    let mut temps: BTreeMap<String, HostTensor> = BTreeMap::new();
    for t in &temporaries {
        let (dtype, shape) = temporary_shape(t, &syms, |n| call.tensors.get(n).map(|x| x.dtype))?;
        let fill = if t.fill == "zero" { 0.0 } else { f64::NAN };
        temps.insert(t.name.clone(), HostTensor::full(dtype, &shape, fill));
    }
    for launch in order.iter().map(|&i| &launches[i]) {
        let k = kernels.get(&launch.role).ok_or_else(|| format!("no kernel for role `{}`", launch.role))?;
        let params = ParamSig::of_kernel(k);
        let lookup = |n: &str| {
            call.tensors.get(n).map(|t| TensorInfo {
                dtype: t.dtype,
                shape: t.shape.clone(),
                strides: t.strides.clone(),
            })
        };
        let bound = bind(&params, launch, &temporaries, &lookup, &call.scalars, &syms)?;
        let grid = grid_of(&k.grid, &syms)?;
        let mut args = Vec::new();
        for b in &bound {
            args.push(match b {
                Bound::Tensor(n) => Arg::Tensor(match temps.get(n) {
                    Some(t) => t.clone(),
                    None => call.tensors[n].clone(),
                }),
                Bound::Scalar(v) => Arg::Scalar(*v),
            });
        }
        let g = grid.map(|x| x as usize);
        crate::interp::launch(k, &mut args, g).map_err(|e| format!("interpreter ({}): {e}", launch.role))?;
        for (b, a) in bound.iter().zip(args) {
            if let (Bound::Tensor(n), Arg::Tensor(t)) = (b, a) {
                match temps.get_mut(n) {
                    Some(slot) => *slot = t,
                    None => {
                        call.tensors.insert(n.clone(), t);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Compare a call's outputs with the reference: `(name, rel_err, max_abs_err)` each;
/// NaN never passes (`rel_err` is NaN then).
pub fn compare_outputs(
    op: &dyn Operation,
    f: &Features,
    got: &HostCall,
    want: &BTreeMap<String, HostTensor>,
) -> Vec<(String, f64, f64)> {
    op.outputs(f)
        .into_iter()
        .map(|name| match (got.tensors.get(name), want.get(name)) {
            (Some(g), Some(w)) => {
                let (rel, abs) = crate::tensor::compare(&g.to_vec(), &w.to_vec());
                (name.to_string(), rel, abs)
            }
            _ => (name.to_string(), f64::NAN, f64::NAN),
        })
        .collect()
}

/// Parse `name=value,name=value` (or `name=value` repeated) into dims; each name must
/// be one of the operation's dims.
pub fn parse_dims(op: &dyn Operation, text: &str, into: &mut Sizes) -> Result<(), String> {
    let names: Vec<&str> = op.dims().iter().map(|d| d.name).collect();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}` is not NAME=VALUE (sizes of {}: {})", op.name(), names.join(", ")))?;
        let (k, v) = (k.trim(), v.trim());
        if !names.contains(&k) {
            return Err(format!("`{k}` is not a size of {} (its sizes: {})", op.name(), names.join(", ")));
        }
        let n: i64 = v
            .parse()
            .ok()
            .filter(|n| *n >= 0)
            .ok_or_else(|| format!("size `{k}` (`{v}`) is not a non-negative integer"))?;
        into.insert(k.to_string(), n);
    }
    Ok(())
}

/// Parse the positional shorthand (`2,77,93,4,2,64`): the operation's dims in order.
pub fn parse_shape(op: &dyn Operation, text: &str) -> Result<Sizes, String> {
    let names: Vec<&str> = op.dims().iter().map(|d| d.name).collect();
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    let required = op.dims().iter().filter(|d| !d.optional).count();
    if parts.len() < required || parts.len() > names.len() {
        let expected = if required == names.len() {
            format!("{}: {}", names.len(), names.join(","))
        } else {
            format!("{required} to {}: {}[,{}]", names.len(), names[..required].join(","), names[required..].join(","))
        };
        return Err(format!("shape `{text}` has {} fields; expected {expected}", parts.len()));
    }
    let mut out = Sizes::new();
    for (i, (n, p)) in names.iter().zip(&parts).enumerate() {
        let v: i64 = p
            .parse()
            .ok()
            .filter(|v| *v >= 0)
            .ok_or_else(|| format!("shape field {} (`{p}`) is not a non-negative integer", i + 1))?;
        out.insert(n.to_string(), v);
    }
    Ok(out)
}

/// The dims with the operation's defaults for those not given (optional ones stay
/// absent: the operation derives them).
pub fn with_defaults(op: &dyn Operation, given: &Sizes) -> Sizes {
    let mut out = given.clone();
    for d in op.dims().iter().filter(|d| !d.optional) {
        out.entry(d.name.to_string()).or_insert(d.default);
    }
    out
}

/// `batch=2,seq_q=77,...` in the operation's order.
pub fn dims_text(op: &dyn Operation, dims: &Sizes) -> String {
    op.dims().iter().filter_map(|d| dims.get(d.name).map(|v| format!("{}={v}", d.name))).collect::<Vec<_>>().join(",")
}

/// The schedules one instance (`dtype`, `keys`) of a spec is built with: one per target
/// in `targets` (the spec's overrides applied; equal ones once), or with no target, the
/// schedule for no target in particular.
pub fn instance_schedules(spec: &Spec, dtype: DType, keys: &Keys, targets: &[Target]) -> Vec<ScheduleSpace> {
    let mut out: Vec<ScheduleSpace> = Vec::new();
    let resolved: Vec<ScheduleSpace> = if targets.is_empty() {
        vec![spec.schedule.resolve(None, dtype, keys)]
    } else {
        targets.iter().map(|t| spec.schedule.resolve(Some(t), dtype, keys)).collect()
    };
    for s in resolved {
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// Every tile program a spec expands to: variants × dtypes × keys × plans × roles ×
/// tile-axis values, each once (a kernel shared by two plans, or by two targets whose
/// schedules overlap, is listed once). Each instance's tile axes come from its schedule
/// for each of the spec's targets (the base schedule and the `overrides:` that match).
pub fn instances(spec: &Spec) -> Vec<KernelInstance<'_>> {
    let mut out: Vec<KernelInstance> = Vec::new();
    // The ids listed so far: a spec may declare tens of thousands of kernels (a variant
    // costs two lines), and a linear search per kernel made listing them quadratic.
    let mut seen = std::collections::HashSet::new();
    for variant in &spec.variants {
        let plans = spec_plans(spec, variant);
        for &dtype in &spec.dtypes {
            for keys in spec.key_points() {
                for schedule in instance_schedules(spec, dtype, &keys, &spec.targets) {
                    for plan in &plans {
                        for k in plan_kernels(spec, variant, dtype, &keys, plan, &schedule) {
                            if seen.insert(k.id.clone()) {
                                out.push(k);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// The plans of a spec's variant that the spec asks for (`plans:`; all by default).
pub fn spec_plans(spec: &Spec, variant: &Variant) -> Vec<PlanDecl> {
    spec.operation()
        .plans(spec, &variant.features)
        .into_iter()
        .filter(|p| spec.plans.is_empty() || spec.plans.iter().any(|n| n == p.name))
        .collect()
}

/// How many (plan, tile-axis values, runtime-axis values) choices the autotuner has for
/// one instance of `variant` under `schedule` (the instance's, resolved for a target):
/// per plan, the product of its roles' tile points and its runtime axes' values, summed
/// over the plans the spec asks for. GPU targets multiply this by the launch
/// configurations.
pub fn plan_choices(spec: &Spec, variant: &Variant, schedule: &ScheduleSpace) -> usize {
    spec_plans(spec, variant)
        .iter()
        .map(|p| {
            let tiles: usize = p.roles.iter().map(|r| schedule.points(&r.tile_axes).len()).product();
            let runtime: usize = p.runtime_axes.iter().map(|a| schedule.values(a).len().max(1)).product();
            tiles * runtime
        })
        .sum()
}

/// What a spec offers one target: (tile programs, candidates = plans × tilings ×
/// run-time axes, launch configurations summed over them), over every variant, dtype
/// and key, with the target's schedules. `launch` names the operation's launch axes.
pub fn target_counts(spec: &Spec, target: &Target, launch: &[&str]) -> (usize, usize, usize) {
    let (mut programs, mut choices, mut configs) = (0, 0, 0);
    let mut seen = std::collections::HashSet::new();
    for variant in &spec.variants {
        for &dtype in &spec.dtypes {
            for keys in spec.key_points() {
                let schedule = spec.schedule.resolve(Some(target), dtype, &keys);
                let c = plan_choices(spec, variant, &schedule);
                choices += c;
                configs += c * schedule.points(launch).len();
                for plan in spec_plans(spec, variant) {
                    for k in plan_kernels(spec, variant, dtype, &keys, &plan, &schedule) {
                        if seen.insert(k.id.clone()) {
                            programs += 1;
                        }
                    }
                }
            }
        }
    }
    (programs, choices, configs)
}

/// The kernel instances of one plan's roles for an instance (one per tile point).
pub fn plan_kernels<'s>(
    spec: &'s Spec,
    variant: &'s Variant,
    dtype: DType,
    keys: &Keys,
    plan: &PlanDecl,
    schedule: &ScheduleSpace,
) -> Vec<KernelInstance<'s>> {
    let op = spec.operation();
    let mut out = Vec::new();
    for role in &plan.roles {
        for mut tile in schedule.points(&role.tile_axes) {
            tile.extend(role.fixed.clone());
            let mut k = KernelInstance { id: String::new(), variant, dtype, keys: keys.clone(), role: role.name, tile };
            k.id = op.kernel_id(&spec.name, &k);
            out.push(k);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_temporary_like_a_tensor_takes_its_dtype() {
        let t = Temporary {
            name: "q_packed".into(),
            dtype: "like:queries".into(),
            shape: vec!["heads_kv".into(), "mul(tokens, 2)".into()],
            fill: "zero".into(),
            given: false,
        };
        let sizes = Sizes::from([("heads_kv".to_string(), 3), ("tokens".to_string(), 5)]);
        let bf16 = |n: &str| (n == "queries").then_some(DType::BF16);
        assert_eq!(temporary_shape(&t, &sizes, bf16), Ok((DType::BF16, vec![3, 10])));
        let none = |_: &str| None;
        let e = temporary_shape(&t, &sizes, none).unwrap_err();
        assert!(e.contains("that of `queries`, which the call lacks"), "{e}");
        let f32 = Temporary { dtype: "f32".into(), ..t };
        assert_eq!(temporary_shape(&f32, &sizes, none), Ok((DType::F32, vec![3, 10])));
    }
}
