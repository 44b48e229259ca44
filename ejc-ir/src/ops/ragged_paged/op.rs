//! Ragged paged attention as an [`Operation`]: mixed prefill and decode tokens against a
//! paged KV cache with K and V interleaved on the head axis — the semantics are in
//! docs/semantics.md ("Ragged paged attention").
//!
//! ```
//! use ejc_ir::op::Operation;
//! let op = ejc_ir::ops::get("ragged_page_attention").unwrap();
//! assert_eq!(op.plan_names(), ["packed", "classed", "split_k", "classed_split"]);
//! let dims: Vec<&str> = op.dims().iter().map(|d| d.name).collect();
//! assert_eq!(dims, ["num_seqs", "heads_q", "heads_kv", "head_dim", "page_size", "max_context", "max_q_len", "num_pages",
//!                   "min_context", "prefill_seqs"]);
//! ```

use std::collections::BTreeMap;

use serde_json::json;

use super::kernels::{build, is_large, param_docs, Class, Role, RpaKernel, BLOCK_G, SMALL_ROWS};
use super::reference::{random_inputs, reference, RpaInputs, RpaShape};
use crate::ir::Kernel;
use crate::manifest::{Launch, Temporary};
use crate::op::{
    self, AxisDecl, AxisKind, CallView, Config, DimDecl, HostCall, KernelInstance, Keys, Operation, PlanDecl, RoleDecl,
    ScalarDecl, Sizes, Work,
};
use crate::ops::page_attention::op::{check_soft_cap, scale_of, KEY_BLOCK, SPLITS, STAGES};
use crate::spec::{Decoder, Fields, Spec};
use crate::tensor::HostTensor;
use crate::types::DType;

/// The operation (registered in [`crate::ops`]).
pub struct RaggedPaged;

/// Sink logits per query head in [`Operation::random_call`]'s calls.
const RANDOM_SINKS: usize = 2;

/// What a variant computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RpaFeatures {
    /// A run-time soft cap `logits_soft_cap`.
    pub soft_cap: bool,
    /// A run-time `sliding_window`.
    pub window: bool,
    /// Attention sinks `sinks [QH, num_sinks]`.
    pub sinks: bool,
}

impl RpaFeatures {
    pub fn to_json(self) -> op::Features {
        let mut f = op::Features::new();
        if self.soft_cap {
            f.insert("logits_soft_cap".into(), json!("runtime"));
        }
        if self.window {
            f.insert("sliding_window".into(), json!("runtime"));
        }
        if self.sinks {
            f.insert("sinks".into(), json!(true));
        }
        f
    }

    pub fn from_json(f: &op::Features) -> Result<RpaFeatures, String> {
        let mut out = RpaFeatures::default();
        for (k, v) in f {
            match (k.as_str(), v) {
                ("logits_soft_cap", v) if v.as_str() == Some("runtime") => out.soft_cap = true,
                ("sliding_window", v) if v.as_str() == Some("runtime") => out.window = true,
                ("sinks", v) if v.as_bool().is_some() => out.sinks = v.as_bool() == Some(true),
                _ => return Err(format!("unknown ragged_page_attention feature `{k}` = {v}")),
            }
        }
        Ok(out)
    }
}

fn features(f: &op::Features) -> Result<RpaFeatures, String> {
    RpaFeatures::from_json(f)
}

pub(crate) const AXES: &[AxisDecl] = &[
    AxisDecl {
        name: "block_m",
        kind: AxisKind::Tile,
        required: true,
        noun: "row block",
        allowed: "16, 32, 64 or 128 (packed rows: tokens x the query heads of one KV head)",
        list_allowed: "a non-empty list of row blocks from 16, 32, 64 or 128",
        check: |v| (![16, 32, 64, 128].contains(&v)).then_some("unsupported row block"),
    },
    KEY_BLOCK,
    AxisDecl {
        name: "num_warps",
        kind: AxisKind::Launch,
        required: true,
        noun: "warp count",
        allowed: "1, 2, 4 or 8",
        list_allowed: "a non-empty list of warp counts from 1, 2, 4 or 8",
        check: |v| (![1, 2, 4, 8].contains(&v)).then_some("unsupported warp count"),
    },
    STAGES,
    SPLITS,
];

pub(crate) const DIMS: &[DimDecl] = &[
    DimDecl {
        name: "num_seqs",
        default: 6,
        optional: false,
        doc: "sequences (a prefill chunk, decodes, a single token, an empty one, a mix)",
    },
    DimDecl { name: "heads_q", default: 8, optional: false, doc: "query heads" },
    DimDecl { name: "heads_kv", default: 2, optional: false, doc: "KV heads (divides heads_q)" },
    DimDecl {
        name: "head_dim",
        default: 64,
        optional: false,
        doc: "head dimension (compiled in: one of the spec's head_dims)",
    },
    DimDecl { name: "page_size", default: 16, optional: false, doc: "tokens per page (>= 1)" },
    DimDecl { name: "max_context", default: 300, optional: false, doc: "sequence 0's context (the longest)" },
    DimDecl {
        name: "max_q_len",
        default: 70,
        optional: false,
        doc: "sequence 0's new tokens (a prefill chunk; <= max_context)",
    },
    DimDecl {
        name: "num_pages",
        default: 0,
        optional: true,
        doc: "pages in the cache (default: enough for every sequence, each page used once; fewer shares pages)",
    },
    DimDecl {
        name: "min_context",
        default: 0,
        optional: true,
        doc: "above 0, a serving batch: contexts drawn from [min_context, max_context], `prefill_seqs` chunks of max_q_len new tokens, the rest one decode token each",
    },
    DimDecl {
        name: "prefill_seqs",
        default: 1,
        optional: true,
        doc: "the serving batch's prefill chunks (with min_context > 0; at least 1)",
    },
];

pub(crate) fn shape_of(dims: &Sizes) -> Result<RpaShape, String> {
    let g = |k: &str| -> Result<usize, String> {
        dims.get(k).map(|v| (*v).max(0) as usize).ok_or_else(|| format!("size `{k}` is missing"))
    };
    let s = RpaShape {
        num_seqs: g("num_seqs")?,
        heads_q: g("heads_q")?,
        heads_kv: g("heads_kv")?,
        head_dim: g("head_dim")?,
        page_size: g("page_size")?,
        max_context: g("max_context")?,
        max_q_len: g("max_q_len")?,
        num_pages: dims.get("num_pages").copied().filter(|n| *n > 0).map(|n| n as usize),
        min_context: dims.get("min_context").copied().unwrap_or(0).max(0) as usize,
        prefill_seqs: dims.get("prefill_seqs").copied().unwrap_or(1).max(0) as usize,
    };
    if s.min_context > s.max_context {
        return Err(format!("min_context ({}) is above max_context ({})", s.min_context, s.max_context));
    }
    if s.page_size == 0 {
        return Err("size `page_size` must be at least 1".into());
    }
    if s.heads_kv == 0 || s.heads_q == 0 || !s.heads_q.is_multiple_of(s.heads_kv) {
        return Err(format!("heads_q ({}) must be a positive multiple of heads_kv ({})", s.heads_q, s.heads_kv));
    }
    if s.max_q_len > s.max_context {
        return Err(format!("max_q_len ({}) is above max_context ({})", s.max_q_len, s.max_context));
    }
    Ok(s)
}

/// `<spec>_<variant>_<dtype>_d<D>_m<block_m>_n<block_n>`, `…_pack`, `…_unpack`.
pub(crate) fn kernel_id(spec_name: &str, k: &KernelInstance) -> String {
    let hd = k.keys.get("head_dim").copied().unwrap_or(0);
    let base = format!("{spec_name}_{}_{}_d{hd}", k.variant.name, k.dtype);
    match k.role {
        "pack" => format!("{base}_pack"),
        "unpack" => format!("{base}_unpack"),
        "write" => format!("{base}_write"),
        "combine" => format!("{base}_combine"),
        "combine_small" => format!("{base}_combine_small"),
        "classify" => format!("{base}_classify"),
        _ => {
            let (m, n) = (k.tile.get("block_m").copied().unwrap_or(0), k.tile.get("block_n").copied().unwrap_or(0));
            let suffix = match k.role {
                "partial" => "_split",
                "decode" => "_small",
                "decode_split" => "_small_split",
                "prefill" => "_large",
                _ => "",
            };
            format!("{base}_m{m}_n{n}{suffix}")
        }
    }
}

/// A batch that passed [`check_batch`]: its sizes (what the grids and temporaries name)
/// and the host values the checks read.
pub(crate) struct Batch {
    pub sizes: Sizes,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub page: usize,
    /// The block tables' width.
    pub width: usize,
    /// The sequences the kernels run: all of them (v2), `distribution[2]` (v3).
    pub live: usize,
    pub lens: Vec<i64>,
    pub qsl: Vec<i64>,
    pub table: Vec<i64>,
}

/// The checks v2 and v3 share, before any kernel runs: `queries`, `kv_pages` (K/V pairs on
/// the head axis), the lengths (`lens`: `context_lens` or v3's `kv_lens`), `block_tables`,
/// `query_start_loc` and `out`; the scale, soft cap and window; then, for the sequences
/// `live` keeps (given the lengths and `query_start_loc`), well-formed token ranges of at
/// most their context, contexts inside their table rows and pages inside the cache.
pub(crate) fn check_batch(
    op: &dyn Operation,
    dtype: DType,
    keys: &Keys,
    call: &dyn CallView,
    f: RpaFeatures,
    lens_name: &str,
    live: impl Fn(&[i64], &[i64]) -> Result<usize, String>,
) -> Result<Batch, String> {
    let head_dim = keys.get("head_dim").copied().unwrap_or(0) as usize;
    let get = |n: &str, dt: DType, rank: usize, what: &str| op::tensor_arg(call, n, op.param_doc(n), dt, rank, what);
    let q = get("queries", dtype, 3, "[total_tokens, heads_q, head_dim]")?;
    let kv = get("kv_pages", dtype, 4, "[num_pages, page_size, 2 * heads_kv, head_dim]")?;
    let lens_t = get(lens_name, DType::I32, 1, "[num_seqs]")?;
    let tables = get("block_tables", DType::I32, 2, "[num_seqs, pages_per_seq] (a flat table: reshape it)")?;
    let qsl_t = get("query_start_loc", DType::I32, 1, "[num_seqs + 1]")?;
    let out = get("out", dtype, 3, "[total_tokens, heads_q, head_dim]")?;
    let (t, hq, d) = (q.shape[0], q.shape[1], q.shape[2]);
    if d != head_dim {
        return Err(format!(
            "argument `queries` has head_dim {d}, but this kernel is compiled for head_dim {head_dim}"
        ));
    }
    let (pages, page, two_kvh) = (kv.shape[0], kv.shape[1], kv.shape[2]);
    if kv.shape[3] != d || two_kvh == 0 || !two_kvh.is_multiple_of(2) || page == 0 || pages == 0 {
        return Err(format!(
            "argument `kv_pages` has shape {:?}, expected [num_pages >= 1, page_size >= 1, 2 * heads_kv, {d}] (K at even heads, V at odd)",
            kv.shape
        ));
    }
    let hkv = two_kvh / 2;
    if !hq.is_multiple_of(hkv) {
        return Err(format!("heads_q ({hq}) must be a multiple of `kv_pages`' heads_kv ({hkv})"));
    }
    let s = lens_t.shape[0];
    if tables.shape[0] != s || qsl_t.shape[0] != s + 1 {
        return Err(format!(
            "`block_tables` must be [{s}, pages_per_seq] and `query_start_loc` [{}] for {s} sequences, got {:?} and {:?}",
            s + 1,
            tables.shape,
            qsl_t.shape
        ));
    }
    if out.shape != q.shape {
        return Err(format!("argument `out` has shape {:?}, expected {:?}", out.shape, q.shape));
    }
    scale_of(call)?;
    if f.soft_cap {
        check_soft_cap(call)?;
    }
    let mut window = None;
    if f.window {
        let w = call.scalar("sliding_window").ok_or("scalar argument `sliding_window` is missing")?;
        if !(w >= 1.0 && w.fract() == 0.0 && w <= i32::MAX as f64) {
            return Err(format!("scalar argument `sliding_window` = {w} must be an integer >= 1"));
        }
        window = Some(w as i64);
    }
    let (lens, qsl, table) =
        (call.int_values(lens_name)?, call.int_values("query_start_loc")?, call.int_values("block_tables")?);
    if qsl.first() != Some(&0) {
        return Err(format!("query_start_loc[0] must be 0, got {:?}", qsl.first()));
    }
    let live = live(&lens, &qsl)?;
    let width = tables.shape[1];
    let (mut max_q, mut total_keys) = (0i64, 0i64);
    for i in 0..live {
        let (a, e, c) = (qsl[i], qsl[i + 1], lens[i]);
        if e < a || e > t as i64 {
            return Err(format!(
                "query_start_loc must be non-decreasing and at most the {t} tokens: entries {i}, {} are {a}, {e}",
                i + 1
            ));
        }
        if c < 0 || c > (width * page) as i64 {
            return Err(format!("{lens_name}[{i}] = {c} is outside [0, {}] (pages_per_seq x page_size)", width * page));
        }
        if e - a > c {
            return Err(format!("sequence {i} has {} new tokens but {lens_name}[{i}] = {c}: it counts them", e - a));
        }
        for p in 0..(c as usize).div_ceil(page) {
            let id = table[i * width + p];
            if id < 0 || id >= pages as i64 {
                return Err(format!("block_tables[{i}, {p}] = {id} is not a page of the cache (0..{pages})"));
            }
        }
        max_q = max_q.max(e - a);
        total_keys += c;
    }
    let group = (hq / hkv) as i64;
    // (token, key) pairs a query head scores: token i of sequence s (at position
    // p = ctx − q_len + i) sees p + 1 keys, at most w with a window (for the FLOPs).
    let score_pairs: i64 = (0..live)
        .map(|i| {
            let (q_len, ctx) = (qsl[i + 1] - qsl[i], lens[i]);
            (ctx - q_len..ctx).map(|p| window.map_or(p + 1, |w| (p + 1).min(w))).sum::<i64>()
        })
        .sum();
    // The classed plans' large class (more than SMALL_ROWS packed rows): its launch has a
    // program per large sequence (`classify` lists them on the device by the same rule).
    let large = (0..live).filter(|&i| is_large(qsl[i + 1] - qsl[i], group)).count();
    let sizes = Sizes::from([
        ("num_seqs".to_string(), live as i64),
        ("large_seqs".to_string(), large as i64),
        ("total_tokens".to_string(), t as i64),
        ("heads_q".to_string(), hq as i64),
        ("heads_kv".to_string(), hkv as i64),
        ("group".to_string(), group),
        ("head_dim".to_string(), d as i64),
        ("page_size".to_string(), page as i64),
        ("max_q_len".to_string(), max_q),
        ("max_q_rows".to_string(), max_q * group),
        ("max_context".to_string(), lens[..live].iter().copied().max().unwrap_or(0)),
        ("num_pages".to_string(), pages as i64),
        ("total_keys".to_string(), total_keys),
        ("score_pairs".to_string(), score_pairs),
    ]);
    Ok(Batch { sizes, heads_q: hq, heads_kv: hkv, page, width, live, lens, qsl, table })
}

/// The plans of v2 (`write`: v3, whose plans launch its cache write first): `packed`,
/// `classed`, and where the spec lists `num_splits` `split_k` (main's key blocks cut into
/// that many pieces, merged by a `combine` launch before `unpack`) and `classed_split`
/// (`classed` with the small class split).
pub(crate) fn rpa_plans(spec: &Spec, sinks: bool, write: bool) -> Vec<PlanDecl> {
    let copy = || Config::from([("block_g".to_string(), BLOCK_G as u32), ("num_warps".to_string(), 1)]);
    // Rows of tokens in no sequence are never written: they must read 0.
    let temp = |name: &str, shape: &[&str]| Temporary {
        name: name.into(),
        dtype: "f32".into(),
        shape: shape.iter().map(|s| s.to_string()).collect(),
        fill: "zero".into(),
        given: false,
    };
    let rows = ["heads_kv", "mul(total_tokens, group)", "head_dim"];
    let lens = || {
        if write {
            BTreeMap::from([("context_lens".to_string(), "kv_lens".to_string())])
        } else {
            BTreeMap::new()
        }
    };
    let launch = |role: &str, bind: BTreeMap<String, String>| Launch {
        role: role.into(),
        bind,
        after: None,
        produces: Vec::new(),
    };
    let role = |name: &'static str, tile_axes: Vec<&'static str>, fixed: Config| RoleDecl { name, tile_axes, fixed };
    // `classed` (split = false, classed = true): main twice, sequences of at most SMALL_ROWS
    // packed rows (decodes) on one 16-row warp, the others with the tuned tiling.
    // `classed_split` (both): the small class's key blocks cut into `num_splits` pieces
    // (each sequence's splits in its slot of SMALL_ROWS rows, merged per sequence by
    // `combine_small`), the large class as in `classed`.
    let plan = |split: bool, classed: bool| {
        let mut roles = Vec::new();
        let mut launches = Vec::new();
        if write {
            roles.push(role("write", vec![], Config::from([("num_warps".to_string(), 1)])));
            launches.push(launch("write", lens()));
        }
        roles.push(role("pack", vec![], copy()));
        let p = launches.len();
        launches.push(launch("pack", BTreeMap::new()));
        // The classes' launches wait for `pack` only, not for each other: they write
        // disjoint rows of `o_packed` (each gives the other class's sequences an empty
        // row range), so a GPU launcher runs them on two streams at once; `unpack`
        // waits for both. (The interpreter's tests run them in the other order too.)
        let after = |l: &mut Launch, waits: &[usize]| l.after = Some(waits.to_vec());
        // The packed queries keep the queries' dtype (a copy: nothing to round), so `main`
        // reads them straight into shared memory as a product's operand.
        let q_packed = Temporary { dtype: "like:queries".into(), ..temp("q_packed", &rows) };
        let mut temporaries = vec![q_packed, temp("o_packed", &rows)];
        if sinks {
            temporaries.push(temp("lse_packed", &rows[..2]));
        }
        let small = || Config::from([("block_m".to_string(), SMALL_ROWS as u32), ("num_warps".to_string(), 1)]);
        // The classed plans' list of the large class's sequences (`classify`, reading
        // `query_start_loc` only: it waits for nothing), so that `prefill` has a program
        // per large sequence only; `prefill` waits for it and for `pack`.
        let c = launches.len();
        if classed {
            roles.push(role("classify", vec![], Config::from([("num_warps".to_string(), 1)])));
            let mut l = launch("classify", BTreeMap::new());
            after(&mut l, &[]);
            launches.push(l);
            temporaries.push(Temporary {
                name: "large_ids".into(),
                dtype: "i32".into(),
                shape: vec!["add(num_seqs, 1)".into()],
                fill: "zero".into(),
                given: false,
            });
        }
        if split && classed {
            roles.push(role("decode_split", vec!["block_n"], small()));
            roles.push(role("combine_small", vec![], copy()));
            roles.push(role("prefill", vec!["block_m", "block_n"], Config::new()));
            let mut l = launch("decode_split", lens());
            after(&mut l, &[p]);
            launches.push(l);
            let mut l = launch("combine_small", BTreeMap::new());
            after(&mut l, &[launches.len() - 1]);
            launches.push(l);
            let mut l = launch("prefill", lens());
            after(&mut l, &[p, c]);
            launches.push(l);
            // A sequence's slot: the rows of a small-class sequence's splits; the rest is
            // never read (NaN on the interpreter shows if it were).
            let slots = ["heads_kv", "mul(num_seqs, 16)", "head_dim"];
            temporaries.push(Temporary {
                fill: "nan".into(),
                ..temp("o_split", &["num_splits", slots[0], slots[1], slots[2]])
            });
            temporaries
                .push(Temporary { fill: "nan".into(), ..temp("lse_split", &["num_splits", slots[0], slots[1]]) });
        } else if split {
            roles.push(role("partial", vec!["block_m", "block_n"], Config::new()));
            roles.push(role("combine", vec![], copy()));
            launches.push(launch("partial", lens()));
            launches.push(launch("combine", BTreeMap::new()));
            temporaries.push(temp("o_split", &["num_splits", rows[0], rows[1], rows[2]]));
            temporaries.push(temp("lse_split", &["num_splits", rows[0], rows[1]]));
        } else if classed {
            roles.push(role("decode", vec!["block_n"], small()));
            roles.push(role("prefill", vec!["block_m", "block_n"], Config::new()));
            let mut l = launch("decode", lens());
            after(&mut l, &[p]);
            launches.push(l);
            let mut l = launch("prefill", lens());
            after(&mut l, &[p, c]);
            launches.push(l);
        } else {
            roles.push(role("main", vec!["block_m", "block_n"], Config::new()));
            launches.push(launch("main", lens()));
        }
        roles.push(role("unpack", vec![], copy()));
        let mut l = launch("unpack", BTreeMap::new());
        if classed {
            // The classes' last launches: `prefill` and the one before it.
            let n = launches.len();
            after(&mut l, &[n - 2, n - 1]);
        }
        launches.push(l);
        PlanDecl {
            name: match (split, classed) {
                (true, true) => "classed_split",
                (true, false) => "split_k",
                (false, true) => "classed",
                _ => "packed",
            },
            roles,
            temporaries,
            launches,
            runtime_axes: if split { vec!["num_splits"] } else { vec![] },
            shared_axes: vec![],
        }
    };
    let mut plans = vec![plan(false, false), plan(false, true)];
    if !spec.schedule.values("num_splits").is_empty() {
        plans.push(plan(true, false));
        plans.push(plan(true, true));
    }
    plans
}

/// A v2 or v3 kernel's tile IR from its instance (role by name: `write`, `pack`, `main`,
/// `unpack`); the attributes are printed metadata nothing reads back.
pub(crate) fn build_instance(
    spec: &Spec,
    k: &KernelInstance,
    soft_cap: bool,
    window: bool,
    sinks: bool,
) -> Result<Kernel, String> {
    let head_dim = *k.keys.get("head_dim").ok_or("the instance has no head_dim")? as usize;
    let role = match k.role {
        "write" => Role::Write,
        "pack" => Role::Pack,
        "unpack" => Role::Unpack,
        "partial" | "decode_split" => Role::Partial,
        "combine" | "combine_small" => Role::Combine,
        "classify" => Role::Classify,
        _ => Role::Main,
    };
    let class = match k.role {
        "decode" | "decode_split" | "combine_small" => Class::Small,
        "prefill" => Class::Large,
        _ => Class::All,
    };
    let tile = |axis: &str| k.tile.get(axis).map(|v| *v as usize).ok_or(format!("the instance has no {axis}"));
    let (block_m, block_n) = match role {
        Role::Main | Role::Partial => (tile("block_m")?, tile("block_n")?),
        _ => (0, 0),
    };
    let kernel = RpaKernel { role, soft_cap, window, sinks, dtype: k.dtype, head_dim, block_m, block_n, class };
    let mut built = build(&k.id, &kernel).map_err(|e| e.to_string())?;
    built.attrs = vec![
        ("op".into(), spec.op.clone()),
        ("variant".into(), k.variant.name.clone()),
        ("dtype".into(), k.dtype.to_string()),
        ("head_dim".into(), head_dim.to_string()),
        ("role".into(), k.role.to_string()),
    ];
    if matches!(role, Role::Main | Role::Partial) {
        built.attrs.extend([("block_m".into(), block_m.to_string()), ("block_n".into(), block_n.to_string())]);
    }
    Ok(built)
}

impl Operation for RaggedPaged {
    fn name(&self) -> &'static str {
        "ragged_page_attention"
    }

    fn summary(&self) -> &'static str {
        "mixed prefill and decode attention over a paged KV cache, K and V interleaved (window, soft cap, sinks)"
    }

    fn dtypes(&self) -> &'static [DType] {
        &[DType::BF16, DType::F16, DType::F32]
    }

    fn dtype_refusal(&self) -> &'static str {
        "cannot be an attention input (bf16, f16 and f32 can)"
    }

    fn fields(&self) -> &'static [&'static str] {
        &["head_dims"]
    }

    fn decode_fields(&self, d: &mut Decoder, f: &Fields, keys: &mut Vec<(String, Vec<u32>)>, _sets: &mut Vec<Keys>) {
        op::decode_head_dims(d, f, keys)
    }

    fn variant_fields(&self) -> &'static [&'static str] {
        &["logits_soft_cap", "sliding_window", "sinks"]
    }

    fn variant_allowed(&self) -> &'static str {
        "a mapping such as `sliding_window: runtime`, `logits_soft_cap: runtime`, `sinks: true`; `{}` for plain softmax"
    }

    fn decode_variant(&self, d: &mut Decoder, f: &Fields) -> op::Features {
        let runtime = |d: &mut Decoder, name: &str, noun: &str| match f.value(name) {
            Some(v) => d.choice(v, &f.path(name), noun, &["runtime"]).is_some(),
            None => false,
        };
        let soft_cap = runtime(d, "logits_soft_cap", "soft cap");
        let window = runtime(d, "sliding_window", "window");
        let sinks = match f.value("sinks") {
            Some(v) => d.bool(v, &f.path("sinks")).unwrap_or(false),
            None => false,
        };
        RpaFeatures { soft_cap, window, sinks }.to_json()
    }

    fn describe(&self, f: &op::Features) -> String {
        match features(f) {
            Ok(r) => {
                let mut parts = vec!["causal softmax(scale q.k), queries aligned to the end of their context"];
                if r.window {
                    parts.push("run-time sliding window");
                }
                if r.soft_cap {
                    parts.push("soft-capped at run time");
                }
                if r.sinks {
                    parts.push("sinks");
                }
                parts.join(", ")
            }
            Err(e) => e,
        }
    }

    fn axes(&self) -> &'static [AxisDecl] {
        AXES
    }

    fn plan_names(&self) -> &'static [&'static str] {
        &["packed", "classed", "split_k", "classed_split"]
    }

    fn plans(&self, spec: &Spec, f: &op::Features) -> Vec<PlanDecl> {
        rpa_plans(spec, features(f).unwrap_or_default().sinks, false)
    }

    fn kernel_id(&self, spec_name: &str, k: &KernelInstance) -> String {
        kernel_id(spec_name, k)
    }

    fn build(&self, spec: &Spec, k: &KernelInstance) -> Result<Kernel, String> {
        let f = features(&k.variant.features)?;
        build_instance(spec, k, f.soft_cap, f.window, f.sinks)
    }

    fn param_doc(&self, name: &str) -> &'static str {
        param_docs().iter().find(|(n, _)| *n == name).map(|(_, d)| *d).unwrap_or("")
    }

    fn dims(&self) -> &'static [DimDecl] {
        DIMS
    }

    fn call_dtype(&self, call: &dyn CallView) -> Result<DType, String> {
        call.tensor("queries").map(|t| t.dtype).ok_or_else(|| "argument `queries` is missing".into())
    }

    fn keys_of(&self, dims: &Sizes) -> Keys {
        Keys::from([("head_dim".to_string(), dims.get("head_dim").copied().unwrap_or(0).max(0) as u32)])
    }

    fn call_keys(&self, call: &dyn CallView) -> Result<Keys, String> {
        let q = call.tensor("queries").ok_or("argument `queries` is missing")?;
        if q.shape.len() != 3 {
            return Err(format!("argument `queries`: shape {:?} is not [total_tokens, heads_q, head_dim]", q.shape));
        }
        Ok(Keys::from([("head_dim".to_string(), q.shape[2] as u32)]))
    }

    fn dims_of(&self, sizes: &Sizes) -> Sizes {
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0);
        Sizes::from([
            ("num_seqs".to_string(), g("num_seqs")),
            ("heads_q".to_string(), g("heads_q")),
            ("heads_kv".to_string(), g("heads_kv")),
            ("head_dim".to_string(), g("head_dim")),
            ("page_size".to_string(), g("page_size")),
            ("max_context".to_string(), g("max_context")),
            ("max_q_len".to_string(), g("max_q_len")),
            ("num_pages".to_string(), g("num_pages")),
            ("min_context".to_string(), g("min_context")),
            ("prefill_seqs".to_string(), sizes.get("prefill_seqs").copied().unwrap_or(1)),
        ])
    }

    fn scalars(&self, f: &op::Features) -> Vec<ScalarDecl> {
        let f = features(f).unwrap_or_default();
        let mut out = vec![ScalarDecl { name: "softmax_scale", doc: "multiplies q.k (default 1/sqrt(head_dim))" }];
        if f.soft_cap {
            out.push(ScalarDecl { name: "logits_soft_cap", doc: "soft cap c > 0" });
        }
        if f.window {
            out.push(ScalarDecl {
                name: "sliding_window",
                doc: "w >= 1: the w most recent positions, the query's own included, are seen",
            });
        }
        out
    }

    fn validate(&self, f: &op::Features, dtype: DType, keys: &Keys, call: &dyn CallView) -> Result<Sizes, String> {
        let f = features(f)?;
        let b = check_batch(self, dtype, keys, call, f, "context_lens", |lens, _| Ok(lens.len()))?;
        if f.sinks {
            let sk = op::tensor_arg(call, "sinks", self.param_doc("sinks"), DType::F32, 2, "[heads_q, num_sinks]")?;
            if sk.shape[0] != b.heads_q {
                return Err(format!(
                    "argument `sinks` has shape {:?}: it must be [{}, num_sinks]",
                    sk.shape, b.heads_q
                ));
            }
        }
        Ok(b.sizes)
    }

    fn cache_desc(&self, wanted: &op::Features, dtype: DType, sizes: &Sizes) -> serde_json::Value {
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0);
        let b = |n: i64| (n.max(16) as u64).next_power_of_two();
        json!({
            "num_seqs": b(g("num_seqs")), "tokens": b(g("total_tokens")), "max_q_len": b(g("max_q_len")),
            "context": b(g("max_context")), "heads_q": g("heads_q"), "heads_kv": g("heads_kv"),
            "head_dim": g("head_dim"), "page_size": g("page_size"), "dtype": dtype.to_string(), "features": wanted,
        })
    }

    fn random_call(&self, f: &op::Features, dtype: DType, dims: &Sizes, seed: u64) -> Result<HostCall, String> {
        let p = features(f)?;
        let shape = shape_of(dims)?;
        let x = random_inputs(dtype, &shape, if p.sinks { RANDOM_SINKS } else { 0 }, seed);
        let out = HostTensor::full(dtype, &[x.total_tokens, shape.heads_q, shape.head_dim], f64::NAN);
        let mut tensors = BTreeMap::from([
            ("queries".to_string(), x.queries),
            ("kv_pages".to_string(), x.kv_pages),
            ("context_lens".to_string(), x.context_lens),
            ("block_tables".to_string(), x.block_tables),
            ("query_start_loc".to_string(), x.query_start_loc),
            ("out".to_string(), out),
        ]);
        if let Some(s) = x.sinks {
            tensors.insert("sinks".to_string(), s);
        }
        let mut scalars = BTreeMap::from([("softmax_scale".to_string(), 1.0 / (shape.head_dim.max(1) as f64).sqrt())]);
        if p.soft_cap {
            scalars.insert("logits_soft_cap".to_string(), 2.5);
        }
        if p.window {
            // A third of the longest context: it cuts the prefill chunk's early keys.
            scalars.insert("sliding_window".to_string(), (shape.max_context / 3).max(1) as f64);
        }
        Ok(HostCall { tensors, scalars })
    }

    fn call_elements(&self, _f: &op::Features, dims: &Sizes) -> Result<u64, String> {
        let s = shape_of(dims)?;
        // At most every sequence a prefill of max_q_len tokens, plus the padding.
        let tokens = s.num_seqs.checked_mul(s.max_q_len).and_then(|n| n.checked_add(2)).ok_or("too many tokens")?;
        let q = op::elements(&[tokens, s.heads_q + 1, s.head_dim])?;
        let kv = op::elements(&[s.pages(), s.page_size, 2 * s.heads_kv, s.head_dim])?;
        let tables = op::elements(&[s.num_seqs, s.max_pages()])?;
        op::total_elements(&[q, q, kv, tables, 2 * s.num_seqs as u64 + 1, op::elements(&[s.heads_q, RANDOM_SINKS])?])
    }

    fn reference(&self, f: &op::Features, call: &HostCall) -> Result<BTreeMap<String, HostTensor>, String> {
        let p = features(f)?;
        let t = |n: &str| call.tensors.get(n).cloned().ok_or_else(|| format!("the call has no `{n}`"));
        let queries = t("queries")?;
        let x = RpaInputs {
            total_tokens: queries.shape.first().copied().unwrap_or(0),
            queries,
            kv_pages: t("kv_pages")?,
            context_lens: t("context_lens")?,
            block_tables: t("block_tables")?,
            query_start_loc: t("query_start_loc")?,
            sinks: if p.sinks { Some(t("sinks")?) } else { None },
        };
        let scalar = |n: &str| call.scalars.get(n).copied().ok_or_else(|| format!("the call has no `{n}`"));
        let cap = if p.soft_cap { Some(scalar("logits_soft_cap")?) } else { None };
        let window = if p.window { Some(scalar("sliding_window")? as i64) } else { None };
        let out = reference(&x, scale_of(call)?, cap, window)?;
        Ok(BTreeMap::from([("out".to_string(), out)]))
    }

    fn outputs(&self, _f: &op::Features) -> Vec<&'static str> {
        vec!["out"]
    }

    fn small_dims(&self, sizes: &Sizes) -> Sizes {
        let mut d = self.dims_of(sizes);
        d.insert("num_seqs".into(), d["num_seqs"].clamp(1, 6));
        d.insert("max_context".into(), d["max_context"].min(150));
        d.insert("max_q_len".into(), d["max_q_len"].min(d["max_context"]).min(40));
        d.insert("num_pages".into(), 0);
        d.insert("min_context".into(), d["min_context"].min(d["max_context"]));
        d
    }

    fn check_dims(&self, keys: &Keys) -> Vec<Sizes> {
        let d = keys.get("head_dim").copied().unwrap_or(64) as i64;
        // [num_seqs, heads_q, heads_kv, page_size, max_context, max_q_len, num_pages,
        // min_context, prefill_seqs]: a mixed batch with pages that are not block
        // multiples; GQA 5:1 with a chunk past a block of rows; MHA with shared pages; one
        // sequence of one token; a serving step whose two chunks are exactly 16 packed
        // rows (GQA 4:1, 4 tokens: the `classed` plan's boundary) among decodes.
        [
            [6, 8, 2, 16, 300, 70, 0, 0, 1],
            [5, 10, 2, 5, 133, 41, 0, 0, 1],
            [4, 4, 4, 32, 200, 200, 9, 0, 1],
            [1, 8, 1, 16, 1, 1, 0, 0, 1],
            [5, 8, 2, 16, 90, 4, 0, 50, 2],
        ]
        .iter()
        .map(|[s, hq, hkv, ps, ctx, ql, np, minc, pre]| {
            Sizes::from([
                ("num_seqs".to_string(), *s),
                ("heads_q".to_string(), *hq),
                ("heads_kv".to_string(), *hkv),
                ("head_dim".to_string(), d),
                ("page_size".to_string(), *ps),
                ("max_context".to_string(), *ctx),
                ("max_q_len".to_string(), *ql),
                ("num_pages".to_string(), *np),
                ("min_context".to_string(), *minc),
                ("prefill_seqs".to_string(), *pre),
            ])
        })
        .collect()
    }

    fn work(&self, _f: &op::Features, dtype: DType, sizes: &Sizes) -> Work {
        // Reported as GB/s: the keys and values of every sequence's context read once per
        // KV head, the queries read and the output written once.
        let g = |k: &str| sizes.get(k).copied().unwrap_or(0).max(0) as f64;
        let total = match sizes.get("total_keys") {
            Some(t) => *t as f64,
            None => g("num_seqs") * g("max_context"),
        };
        let kv = 2.0 * total * g("heads_kv") * g("head_dim");
        let qo = 2.0 * g("total_tokens") * g("heads_q") * g("head_dim");
        // Two products of 2·D FLOPs per scored (token, key) pair and query head.
        let flops = 4.0 * g("score_pairs") * g("heads_q") * g("head_dim");
        Work { flops, bytes: (kv + qo) * dtype.size_bytes() as f64 }
    }

    fn heuristic(&self, configs: &[Config]) -> Option<usize> {
        configs
            .iter()
            .position(|c| c.get("block_m") == Some(&64) && c.get("block_n") == Some(&64))
            .or((!configs.is_empty()).then_some(0))
    }
}
