//! The fuzz targets, one function per loader, shared by the CI suite (`tests/fuzz.rs`)
//! and the cargo-fuzz targets (`fuzz/fuzz_targets/*.rs`).
//!
//! Each takes any bytes. The contract every loader keeps: it returns (no panic, no hang,
//! no abort) and a refusal is a value with a message that says something. A target
//! panics only when that contract is broken, or when an input the loader accepted breaks
//! what the rest of ejc relies on (a loaded spec's kernels build; a parsed kernel prints
//! and parses back to the same text; a damaged tuning cache still stores new results).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ejc::cli::common::{Problem, ProblemFlags};
use ejc::cli::Outcome;
use ejc::ir::ir::GridExpr;
use ejc::ir::manifest::Manifest;
use ejc::ir::op::{instances, parse_dims, parse_shape, plan_choices, Sizes};
use ejc::ir::parse::parse_kernel;
use ejc::ir::passes::{default_pipeline, run_pipeline};
use ejc::ir::print::print_kernel;
use ejc::ir::spec::{self, SpecError};
use ejc::runtime::cache::{CacheEntry, PersistentCache, Timing};
use ejc::runtime::registry::{config_id, Query, Registry};

/// The longest input a target is given (the loaders read files people write, not
/// gigabytes; a bound keeps every case fast).
pub const MAX_LEN: usize = 64 * 1024;

/// A loaded spec whose kernels may number more than this is only loaded, not expanded.
/// (Expanding 50,000 kernels took `ejc list` 17 s while its dedup was quadratic.)
const MAX_INSTANCES: usize = 100_000;

/// The device fingerprint of the tuning-cache seed (`tests/fuzz/seeds/cache.json`).
pub const CACHE_MACHINE: &str = "Fuzz GPU 80GB|sm_90|driver 570.86";

/// The artifact files the manifest seed (`tests/fuzz/seeds/manifest.json`) names; each
/// holds [`PLACEHOLDER`], the bytes whose SHA-256 the seed records.
pub const MANIFEST_FILES: &[&str] = &[
    "ir/flash_decode_gpt_oss_bf16_d64_m64_n64.tir",
    "ir/flash_decode_gpt_oss_bf16_d64_m64_n64_split.tir",
    "ir/flash_decode_gpt_oss_bf16_d64_combine.tir",
    "ptx/sm_90a/flash_decode_gpt_oss_bf16_d64_m64_n64_split_w4_s2_wgmma_ws_sink.ptx",
    "cpu/flash_decode.avx2.so",
];
pub const PLACEHOLDER: &[u8] = b"fuzz placeholder artifact\n";

/// The repository root (this file is compiled into the root package's tests and into
/// `fuzz/`, one level below it).
pub fn repo_root() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    if dir.join("specs").is_dir() {
        dir.to_path_buf()
    } else {
        dir.parent().map(Path::to_path_buf).unwrap_or_default()
    }
}

/// A private directory for the targets that read files, removed on drop.
pub struct Scratch {
    pub dir: PathBuf,
}

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("ejc-fuzz-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the fuzz scratch directory");
        Scratch { dir }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn assert_message(what: &str, message: &str, input: &[u8]) {
    assert!(!message.trim().is_empty(), "{what}: an error without a message for input {}", head(input));
}

/// The start of an input, for a failure message (the whole input is saved to a file).
pub fn head(data: &[u8]) -> String {
    let text = String::from_utf8_lossy(&data[..data.len().min(400)]).into_owned();
    if data.len() > 400 {
        format!("{text:?}... ({} bytes)", data.len())
    } else {
        format!("{text:?}")
    }
}

fn head_str(text: &str) -> String {
    head(text.as_bytes())
}

/// An FNV-1a hash of the input: which kernels of a loaded spec to build.
fn hash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

// ---------------------------------------------------------------------------------------
// (a) The spec loader, and `ejc check`'s building of what a spec declares.

pub fn spec(data: &[u8], scratch: &Scratch) -> bool {
    let loaded = match std::str::from_utf8(data) {
        Ok(text) => spec::load_str("fuzz.yaml", text),
        // Only a file can hold bytes that are not UTF-8.
        Err(_) => {
            let path = scratch.dir.join("fuzz.yaml");
            std::fs::write(&path, data).expect("write the spec");
            spec::load_file(&path)
        }
    };
    let spec = match loaded {
        Ok(spec) => spec,
        Err(e) => {
            check_spec_error(&e, data);
            return false;
        }
    };
    // What `ejc check` does with a spec that loads, on a budget: count what it declares,
    // and build (front end, pass pipeline, verifier) two of its kernels.
    let op = spec.operation();
    let launch: Vec<&str> =
        op.axes().iter().filter(|a| a.kind == ejc::ir::op::AxisKind::Launch).map(|a| a.name).collect();
    let bound = [spec.variants.len(), spec.dtypes.len(), 4]
        .into_iter()
        .chain([spec.key_points().len()])
        .chain(spec.schedule.axes.iter().map(|(n, _)| spec.schedule.all_values(n).len()))
        // An override may set an axis the schedule does not list.
        .chain(spec.schedule.overrides.iter().flat_map(|o| o.axes.iter().map(|(_, v)| v.len())))
        .chain([spec.targets.len()])
        .fold(1usize, |a, b| a.saturating_mul(b.max(1)));
    if bound > MAX_INSTANCES {
        return true;
    }
    let _ = spec.schedule.points(&launch).len();
    let _: usize = spec.variants.iter().map(|v| plan_choices(&spec, v, &spec.schedule)).sum();
    let all = instances(&spec);
    if all.is_empty() {
        return true;
    }
    let h = hash(data) as usize;
    let pipeline = default_pipeline();
    for inst in [&all[h % all.len()], &all[(h / 7 + 1) % all.len()]] {
        let built = op.build(&spec, inst).and_then(|k| run_pipeline(&k, &pipeline).map_err(|e| e.to_string()));
        if let Err(e) = built {
            panic!("spec loads but kernel `{}` does not build: {e}\n--- spec: {}", inst.id, head(data));
        }
    }
    true
}

fn check_spec_error(e: &SpecError, data: &[u8]) {
    assert!(!e.diagnostics.is_empty(), "a spec error without diagnostics for {}", head(data));
    // Lines as YAML counts them: `\n`, `\r\n` and a lone `\r` end one.
    let lines = 1 + data
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b == b'\n' || (b == b'\r' && data.get(i + 1) != Some(&b'\n')))
        .count();
    for d in &e.diagnostics {
        assert_message("spec", &d.message, data);
        assert!(
            d.line <= lines + 1,
            "diagnostic `{}` points at line {} of a {lines}-line file: {}",
            d.message,
            d.line,
            head(data)
        );
        assert_message("spec", &d.short(), data);
    }
    assert_message("spec", &e.to_string(), data);
}

// ---------------------------------------------------------------------------------------
// (b) The tile-IR text parser.

pub fn ir(data: &[u8]) -> bool {
    let text = String::from_utf8_lossy(data);
    match parse_kernel(&text) {
        Err(e) => {
            assert_message("ir", &e.message, data);
            let _ = e.to_string();
            false
        }
        Ok(k) => {
            let printed = print_kernel(&k);
            let again = parse_kernel(&printed).unwrap_or_else(|e| {
                panic!("the printed form of a parsed kernel does not parse: {e}\n--- printed: {}", head_str(&printed))
            });
            let reprinted = print_kernel(&again);
            assert!(
                reprinted == printed,
                "print(parse(print(k))) != print(k)\n--- printed: {}\n--- reprinted: {}",
                head_str(&printed),
                head_str(&reprinted)
            );
            // The passes take any kernel the verifier accepts.
            let _ = run_pipeline(&k, &default_pipeline());
            true
        }
    }
}

// ---------------------------------------------------------------------------------------
// (c) The manifest: ejc-ir's parser, ejc-runtime's loader (artifact files and hashes),
// the registry, and the size formulas it holds evaluated as a call would.

pub fn manifest(data: &[u8], scratch: &Scratch) -> bool {
    if let Ok(text) = std::str::from_utf8(data) {
        match Manifest::parse(text) {
            Ok(m) => {
                let _ = m.to_json();
            }
            Err(e) => assert_message("manifest", &e, data),
        }
    }
    let dir = scratch.dir.join("build");
    for f in MANIFEST_FILES {
        let p = dir.join(f);
        if !p.exists() {
            std::fs::create_dir_all(p.parent().unwrap()).expect("create the build directory");
            std::fs::write(&p, PLACEHOLDER).expect("write an artifact");
        }
    }
    std::fs::write(dir.join("manifest.json"), data).expect("write the manifest");
    if let Err(e) = ejc::runtime::manifest::load(&dir) {
        assert_message("manifest", &e.to_string(), data);
    }
    let mut registry = Registry::new();
    if let Err(e) = registry.load_manifest(&dir) {
        assert_message("manifest", &e.to_string(), data);
        return false;
    }
    if let Err(e) = registry.check_signatures() {
        assert_message("manifest", &e.to_string(), data);
    }
    let mut ops: Vec<String> = registry.entries().iter().map(|e| e.op.clone()).collect();
    ops.extend(registry.plans().iter().map(|p| p.op.clone()));
    ops.dedup();
    for op in &ops {
        if let Err(e) = registry.families(&Query::new(op)) {
            assert_message("manifest", &e.to_string(), data);
        }
        let _ = registry.describe_op(op);
    }
    // The formulas, as a call evaluates them: grids, temporaries' shapes, bound scalars.
    for values in [symbols(77), symbols(i64::MAX / 3)] {
        for e in registry.entries() {
            for g in e.grid.iter().flatten() {
                let _ = g.eval_in(&values);
            }
        }
        for p in registry.plans() {
            let formulas = p.plan.temporaries.iter().flat_map(|t| t.shape.iter());
            for f in formulas.chain(p.plan.launches.iter().flat_map(|l| l.bind.values())) {
                match GridExpr::parse(f) {
                    Ok(g) => {
                        let _ = g.eval_in(&values);
                    }
                    Err(e) => assert_message("manifest", &e, data),
                }
            }
        }
    }
    true
}

fn symbols(n: i64) -> BTreeMap<String, i64> {
    [
        "batch",
        "seq_q",
        "seq_k",
        "heads_q",
        "heads_kv",
        "head_dim",
        "head_dim_v",
        "num_splits",
        "block_m",
        "block_n",
        "seq",
        "heads",
    ]
    .iter()
    .map(|s| (s.to_string(), n))
    .collect()
}

// ---------------------------------------------------------------------------------------
// (d) The tuning-cache reader: `PersistentCache::open` on a file with these bytes, what
// `ejc cache ls/show` prints of it, and a `put` after it.

pub fn cache(data: &[u8], scratch: &Scratch) -> bool {
    let dir = scratch.dir.join("cache");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the cache directory");
    let path = PersistentCache::open(&dir, CACHE_MACHINE).path().to_path_buf();
    std::fs::write(&path, data).expect("write the cache file");
    let _ = PersistentCache::machines(&dir);
    let cache = PersistentCache::open(&dir, CACHE_MACHINE);
    assert!(cache.is_persistent(), "a damaged cache file made the cache in-memory: {:?}", cache.warnings());
    for w in cache.warnings() {
        assert_message("cache", w, data);
    }
    let cache_ok = cache.warnings().is_empty();
    let n = cache.entries().count();
    for (key, e) in cache.entries() {
        let _ = format!("{key} {} {} {} {}", config_id(&e.config), e.call, e.op, e.created);
        for t in &e.timings {
            let _ = format!("{:<12} {:>10.3?} {}", t.config_id, t.median_ms, t.status);
        }
    }
    for action in [ejc::cli::cache::Action::Ls, ejc::cli::cache::Action::Show(String::new())] {
        let outcome = ejc::cli::cache::run(action, Some(dir.clone()));
        if let Outcome::Error(m) = outcome {
            assert_message("cache", &m, data);
        }
    }
    // Whatever the file held, a new result is stored and read back.
    let entry = CacheEntry {
        config: BTreeMap::from([("block_m".to_string(), 64)]),
        timings: vec![Timing { config_id: "m64".into(), median_ms: Some(0.5), status: "ok".into() }],
        call: "fuzz".into(),
        device: CACHE_MACHINE.into(),
        op: "flash_attention_fwd@v1".into(),
        call_hash: "0".into(),
        candidates: "0".into(),
        compiler: "ejc fuzz".into(),
        created: 0,
    };
    let mut cache = PersistentCache::open(&dir, CACHE_MACHINE);
    let key = "fuzz-key-that-no-seed-has";
    cache.put(key, entry.clone()).unwrap_or_else(|w| panic!("put after a damaged cache file: {w}"));
    let again = PersistentCache::open(&dir, CACHE_MACHINE);
    assert_eq!(again.get(key), Some(&entry), "the new entry is not read back");
    assert!(again.entries().count() <= n + 1);
    cache_ok
}

// ---------------------------------------------------------------------------------------
// (e) The CLI's --shape, --size, --config, --scalar, --window (and --dtype, --variant,
// --plan, --softcap, --dropout, --memory-limit) values, one `--flag value` a line, through
// `Problem::from_flags` as `ejc run/bench/tune` call it, and the size parsers of every
// operation directly.

pub fn cli(data: &[u8]) -> bool {
    // clap refuses an argument that is not UTF-8 before any of these parsers sees it.
    let Ok(text) = std::str::from_utf8(data) else { return false };
    let specs = repo_root().join("specs");
    let mut f = ProblemFlags {
        spec: specs.join("flash.yaml"),
        variants: Vec::new(),
        dtype: "bf16".into(),
        shape: None,
        sizes: Vec::new(),
        config: Vec::new(),
        block_m: None,
        block_n: None,
        plan: None,
        scalars: Vec::new(),
        window: None,
        softcap: None,
        dropout: None,
        isa: None,
        memory_limit: None,
    };
    for line in text.lines().take(64) {
        let (flag, value) = line.split_once(' ').unwrap_or((line, ""));
        match flag {
            "--spec" => {
                f.spec = specs.join(match value {
                    "flash_decode" => "flash_decode.yaml",
                    "mean_pooling" => "mean_pooling.yaml",
                    _ => "flash.yaml",
                })
            }
            "--dtype" => f.dtype = value.into(),
            "--variant" => f.variants.push(value.into()),
            "--shape" => f.shape = Some(value.into()),
            "--size" => f.sizes.push(value.into()),
            "--config" => f.config.push(value.into()),
            "--scalar" => f.scalars.push(value.into()),
            "--window" => f.window = Some(value.into()),
            "--plan" => f.plan = Some(value.into()),
            "--memory-limit" => f.memory_limit = Some(value.into()),
            // clap parses these itself (a value that is not a number never gets here).
            "--softcap" => f.softcap = value.parse().ok(),
            "--dropout" => f.dropout = value.parse().ok(),
            "--block-m" => f.block_m = value.parse().ok(),
            "--block-n" => f.block_n = value.parse().ok(),
            _ => {}
        }
        for op in ejc::ir::ops::all() {
            if let Err(e) = parse_shape(*op, value) {
                assert_message("cli", &e, data);
            }
            let mut sizes = Sizes::new();
            if let Err(e) = parse_dims(*op, value, &mut sizes) {
                assert_message("cli", &e, data);
            }
        }
    }
    match Problem::from_flags(&f) {
        Err(Outcome::Error(m)) => {
            assert_message("cli", &m, data);
            false
        }
        Err(other) => panic!("from_flags gave {other:?} for {}", head(data)),
        Ok(p) => {
            let _ = p.dims_text();
            for v in p.variants() {
                for plan in p.plans(v) {
                    assert!(!p.plan_configs(&plan, true, &spec::Target::Ir).is_empty());
                }
            }
            true
        }
    }
}

// ---------------------------------------------------------------------------------------
// Seeds.

/// Every file of `dir` (sorted), or none when it does not exist.
fn files(dir: &Path, ext: Option<&str>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    out.retain(|p| ext.is_none_or(|x| p.extension().is_some_and(|e| e == x)));
    out.sort();
    out
}

fn read_all(paths: &[PathBuf]) -> Vec<Vec<u8>> {
    paths.iter().map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).collect()
}

/// The seeds of a target (`spec`, `ir`, `manifest`, `cache`, `cli`), then every input
/// that once crashed it (`tests/fuzz/regressions/<target>/`; the big ones are
/// [`big_regressions`]).
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let root = repo_root();
    let mut out = match target {
        "spec" => {
            let mut paths = files(&root.join("specs"), Some("yaml"));
            paths.extend(files(&root.join("tests/specs/broken"), Some("yaml")));
            read_all(&paths)
        }
        "ir" => ir_seeds(&root),
        other => read_all(&files(&root.join("tests/fuzz/seeds").join(other), None)),
    };
    out.extend(read_all(&files(&root.join("tests/fuzz/regressions").join(target), None)));
    out
}

/// Regressions too big to keep as files. Inputs nested thousands deep, which overflowed
/// the stack: the IR parser recursed on attribute lists (found by the fuzzer: 40,000 `[`),
/// grid formulas and regions, the manifest's size-formula parser on formulas. And a spec
/// of 1,500 variants (54,540 kernels), which `instances` listed in quadratic time. Run
/// once each, not mutated.
pub fn big_regressions(target: &str) -> Vec<Vec<u8>> {
    let n = 20_000;
    let nest = |open: &str, inner: &str, close: &str| format!("{}{inner}{}", open.repeat(n), close.repeat(n));
    match target {
        "ir" => vec![
            format!(
                "kernel @k(%n: i32) grid(1, 1, 1) {{\n  %0 = program.id {{axis = {}}} : i32\n}}\n",
                nest("[", "0", "]")
            ),
            format!("kernel @k(%n: i32) grid({}, 1, 1) {{\n}}\n", nest("cdiv(", "n", ", 2)")),
            format!("kernel @k(%c: i1) grid(1, 1, 1) {{\n{}}}\n", nest("scf.if %c {\n", "", "}\n")),
        ],
        "manifest" => {
            let seed = std::fs::read_to_string(repo_root().join("tests/fuzz/seeds/manifest/manifest.json"))
                .expect("the manifest seed");
            vec![
                seed.replacen("\"cdiv(seq_q, 64)\"", &format!("{:?}", nest("cdiv(", "seq_q", ", 64)")), 1),
                seed.replacen("\"num_splits\"", &format!("{:?}", nest("max(", "num_splits", ", 1)")), 1),
            ]
        }
        "spec" => {
            let flash = std::fs::read_to_string(repo_root().join("specs/flash.yaml")).expect("specs/flash.yaml");
            let many: String = (0..1500).map(|i| format!("  v{i}: {{causal: true}}\n")).collect();
            vec![flash.replacen("variants:\n", &format!("variants:\n{many}"), 1)]
        }
        _ => vec![],
    }
    .into_iter()
    .map(String::into_bytes)
    .collect()
}

/// The printed IR of real kernels (each role of each variant of every spec of `specs/`,
/// up to 24), and every IR snapshot.
fn ir_seeds(root: &Path) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for path in files(&root.join("specs"), Some("yaml")) {
        let spec = spec::load_file(&path).expect("the specs of specs/ load");
        let op = spec.operation();
        let mut seen = Vec::new();
        for inst in instances(&spec) {
            if seen.contains(&(inst.role, inst.variant.name.clone())) || out.len() >= 24 {
                continue;
            }
            seen.push((inst.role, inst.variant.name.clone()));
            let k = op.build(&spec, &inst).expect("the kernels of specs/ build");
            out.push(print_kernel(&k).into_bytes());
        }
    }
    for snap in files(&root.join("snapshots"), Some("snap")) {
        let text = std::fs::read_to_string(&snap).unwrap_or_default();
        // An insta snapshot: a `---` header, then the value.
        if let Some(body) = text.splitn(3, "---\n").nth(2) {
            if body.starts_with("kernel @") {
                out.push(body.as_bytes().to_vec());
            }
        }
    }
    out
}
