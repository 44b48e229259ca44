//! `ejc-gpu`: run the GPU artifacts of a build without LLVM (this binary is what travels
//! to a GPU machine; `ejc build --target ptx:...` writes the artifacts, and
//! `ejc build --target mlir:gpu` the PTX of MLIR's gpu form, which `check` runs too).
//! It works for any operation: the build's manifest names it.
//!
//! ```text
//! ejc-gpu info
//! ejc-gpu check DIR [--filter TEXT] [--seed N] [--shard I/N] [--size NAME=N,... | --shape N,...] [--entry general|aligned] [--scalars NAME=V,...]
//! ejc-gpu bench DIR --variant V --dtype D --size NAME=N,... [--shape ...] [--reps N] [--only TEXT] [--all] [--json FILE] [--scalars NAME=V,...]
//! ejc-gpu check-kernels DIR [--filter TEXT] [--seed N]
//! ejc-gpu tune  DIR --variant V --dtype D --size NAME=N,... [--cache-dir DIR] [--force]
//! ejc-gpu call  DIR --variant V --dtype D --size NAME=N,... [--cache-dir DIR]
//! ```
//!
//! `check-kernels` runs kernels that belong to no operation against the interpreter: the
//! back ends' generality cases, packed by `EJC_KERNEL_PACK=DIR cargo test -p ejc-codegen
//! --test ptx -- the_kernel_suite` (scripts/gpu_prepare.sh --kernels), each case a
//! `DIR/<case>.json` (`ejc_ir::kernel_case::PackedCase`) with its PTX beside it.
//!
//! `check` runs every plan of every instance on the operation's awkward cases against
//! its reference, each artifact at least once (every artifact of a role, with the first
//! artifact of the plan's other roles and the largest value of its run-time axes); both
//! entries of PTX artifacts that have an aligned one. It exits 1 when a result is
//! outside DESIGN.md's tolerance (bf16 1e-2, f16 5e-3, f32 1e-5 by ‖out − ref‖/‖ref‖;
//! NaN never passes). `bench` times every candidate of the instance (each plan, each
//! configuration, each run-time value) with CUDA events and reports the fastest, as the
//! autotuner would pick it. `tune` runs the configuration chain with autotuning and
//! stores the winner in this GPU's tuning cache; `call` runs one call through the
//! runtime (`ejc_runtime::api::Runtime::call`), which takes the cached choice. Without a
//! driver every command says so and exits 0 — after it has checked what it was given:
//! its flags and their values, the build directory, its manifest and every artifact's
//! SHA-256, and that the build has GPU artifacts of what was asked; a mistake there is an
//! error (exit 2) on any machine, not a "skipped" that hides it until a GPU is at hand.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use ejc_ir::op::{
    compare_outputs, parse_dims, parse_shape, tolerance, with_defaults, Features, HostCall, Operation, Sizes,
};
use ejc_ir::types::DType;
use ejc_runtime::call::Call;
use ejc_runtime::cuda::{download_into, runs_on, upload_call, Cuda, CudaError, CudaPlan, EntryChoice};
use ejc_runtime::registry::{Candidate, Family, Platform, Query, Registry};

fn usage() -> ExitCode {
    eprintln!(
        "usage:\n  ejc-gpu info\n  ejc-gpu check DIR [--filter TEXT] [--seed N] [--shard I/N] [--size NAME=N,... | --shape N,...] [--entry general|aligned] [--scalars NAME=V,...]\n  ejc-gpu check-kernels DIR [--filter TEXT] [--seed N]\n  ejc-gpu bench DIR --variant V \
         --dtype D (--size NAME=N,... | --shape N,N,...) [--reps N] [--only TEXT] [--all] [--json FILE] [--scalars NAME=V,...]\n  ejc-gpu tune DIR --variant V \
         --dtype D (--size ... | --shape ...) [--cache-dir DIR] [--force]\n  ejc-gpu call DIR --variant V --dtype D (--size ... | \
         --shape ...) [--cache-dir DIR]"
    );
    ExitCode::from(2)
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

/// A command's arguments: `DIR` first, then only the flags it knows (`valued` take a value,
/// `switches` none). An unknown flag, a missing value or a second `DIR` is an error.
fn check_args(cmd: &str, args: &[String], valued: &[&str], switches: &[&str]) -> Result<(), String> {
    match args.first() {
        None => return Err(format!("{cmd}: the build directory (DIR) is missing")),
        Some(d) if d.starts_with("--") => {
            return Err(format!("{cmd}: the build directory (DIR) comes first, not `{d}`"))
        }
        Some(_) => {}
    }
    let mut i = 1;
    while i < args.len() {
        let a = args[i].as_str();
        if valued.contains(&a) {
            match args.get(i + 1) {
                Some(v) if !v.starts_with("--") => i += 2,
                _ => return Err(format!("{cmd}: {a} needs a value")),
            }
        } else if switches.contains(&a) {
            i += 1;
        } else {
            let mut known: Vec<&str> = valued.iter().chain(switches).copied().collect();
            known.sort();
            return Err(format!("{cmd}: unknown argument `{a}` (flags: {})", known.join(", ")));
        }
    }
    Ok(())
}

/// The value of a numeric flag, if given; a value that does not parse is an error.
fn number<T: std::str::FromStr>(args: &[String], name: &str) -> Result<Option<T>, String>
where
    T::Err: std::fmt::Display,
{
    flag(args, name).map(|v| v.parse::<T>().map_err(|e| format!("{name} `{v}`: {e}"))).transpose()
}

/// `--seed N`, or a fresh seed from the clock.
fn seed_arg(args: &[String]) -> Result<u64, String> {
    Ok(number(args, "--seed")?.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    }))
}

/// A mistake in what the command was given: exit 2, on any machine.
fn bad_input(m: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {m}");
    ExitCode::from(2)
}

fn cuda_or_skip() -> Result<Arc<Cuda>, ExitCode> {
    match Cuda::new() {
        Ok(c) => Ok(Arc::new(c)),
        Err(CudaError::NoDriver) => {
            println!("skipped: no CUDA driver on this machine");
            Err(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Err(ExitCode::FAILURE)
        }
    }
}

fn fail(m: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {m}");
    ExitCode::FAILURE
}

/// The build's operation and registry (its GPU artifacts): the manifest is read and every
/// artifact checked against its SHA-256; a build without GPU artifacts is an error.
fn open(dir: &str) -> Result<(&'static dyn Operation, Registry), String> {
    let loaded = ejc_runtime::manifest::load(PathBuf::from(dir)).map_err(|e| e.to_string())?;
    let op = ejc_ir::ops::get(&loaded.manifest.spec.op)
        .ok_or_else(|| format!("{dir}: operation `{}` is not one this ejc-gpu knows", loaded.manifest.spec.op))?;
    let mut reg = Registry::new();
    reg.load_manifest(dir).map_err(|e| e.to_string())?;
    reg.check_signatures().map_err(|e| e.to_string())?;
    if reg.families(&Query::new(op.name()).platform(Platform::Cuda)).map_or(true, |f| f.is_empty()) {
        return Err(format!(
            "{dir}: the build has no GPU artifacts (build with `ejc build --target ptx` or `--target mlir:gpu`)"
        ));
    }
    Ok((op, reg))
}

/// Run a candidate on a host call (uploaded, run, outputs downloaded); its outputs.
fn run_on_gpu(
    cuda: &Arc<Cuda>,
    op: &dyn Operation,
    f: &Features,
    cand: &Candidate,
    host: &HostCall,
    sizes: &Sizes,
    choice: EntryChoice,
) -> Result<(HostCall, bool), String> {
    let dev = upload_call(cuda, &Call::from_host(host)).map_err(|e| e.to_string())?;
    let plan = CudaPlan::for_candidate_with(cuda, cand, &dev, sizes, choice).map_err(|e| e.to_string())?;
    plan.launch(cuda).map_err(|e| e.to_string())?;
    cuda.synchronize().map_err(|e| e.to_string())?;
    let mut back = Call::default();
    let outs = op.outputs(f);
    download_into(cuda, &dev, &outs, &mut back).map_err(|e| e.to_string())?;
    // Only the outputs: a copy of the inputs would cost as much as the run for large calls.
    let mut got = HostCall { tensors: Default::default(), scalars: host.scalars.clone() };
    for n in outs {
        if let Some(t) = back.host_tensor(n) {
            got.tensors.insert(n.to_string(), t);
        }
    }
    Ok((got, plan.aligned.iter().any(|a| *a)))
}

/// Every family of the build that runs on this GPU.
fn gpu_families<'r>(reg: &'r Registry, op: &dyn Operation, cc: u32) -> Vec<Family<'r>> {
    reg.families(&Query::new(op.name()).platform(Platform::Cuda))
        .map(|fs| fs.into_iter().filter(|f| runs_on(&f.backend, cc)).collect())
        .unwrap_or_default()
}

/// The candidates `check` runs: each artifact of each role at least once.
fn check_candidates<'r>(fam: &Family<'r>) -> Vec<Candidate<'r>> {
    let all = fam.candidates();
    let mut out: Vec<Candidate<'r>> = Vec::new();
    for plan in &fam.plans {
        let of_plan: Vec<&Candidate> = all.iter().filter(|c| std::ptr::eq(c.plan, *plan)).collect();
        // The largest run-time values exercise the most of a plan (empty splits).
        let top = |c: &&Candidate| plan.plan.axes.keys().map(|a| c.config.get(a).copied().unwrap_or(0)).sum::<u32>();
        let max_top = of_plan.iter().map(top).max().unwrap_or(0);
        for (i, launch) in plan.plan.launches.iter().enumerate() {
            let mut seen = Vec::new();
            for c in of_plan.iter().filter(|c| top(c) == max_top) {
                let e = c.launches[i];
                if seen.contains(&e.artifact_id) {
                    continue;
                }
                seen.push(e.artifact_id.clone());
                if !out.iter().any(|o| o.config == c.config) {
                    out.push((*c).clone());
                }
            }
            let _ = launch;
        }
    }
    out
}

/// A check case: inputs, their sizes and the reference outputs.
type Case = std::rc::Rc<(HostCall, Sizes, std::collections::BTreeMap<String, ejc_ir::tensor::HostTensor>)>;

fn check(args: &[String]) -> ExitCode {
    if let Err(e) =
        check_args("check", args, &["--filter", "--seed", "--shard", "--size", "--shape", "--entry", "--scalars"], &[])
    {
        return bad_input(e);
    }
    // --entry general|aligned: only that entry of each candidate (a case past 2^31
    // elements costs minutes of host time per run).
    let entry = match flag(args, "--entry").as_deref() {
        None => None,
        Some("general") => Some(EntryChoice::General),
        Some("aligned") => Some(EntryChoice::Best),
        Some(other) => return bad_input(format!("--entry takes general or aligned, not `{other}`")),
    };
    let dir = &args[0];
    let filter = flag(args, "--filter");
    // --shard I/N: every N-th candidate from the I-th, so N processes check a build in
    // parallel (loading PTX is the driver's JIT compile: CPU-bound, one core each).
    let shard = match flag(args, "--shard")
        .map(|s| s.split_once('/').and_then(|(i, n)| Some((i.parse::<usize>().ok()?, n.parse::<usize>().ok()?))))
    {
        None => (0, 1),
        Some(Some((i, n))) if n > 0 && i < n => (i, n),
        Some(_) => {
            eprintln!("error: --shard takes I/N with 0 <= I < N");
            return ExitCode::from(2);
        }
    };
    let seed = match seed_arg(args) {
        Ok(s) => s,
        Err(e) => return bad_input(e),
    };
    // --scalars NAME=V,...: these run-time scalars instead of the random ones (a window
    // with negative sides, as ring attention's blocks have; a given soft cap).
    let scalars = match scalars_arg(args) {
        Ok(s) => s,
        Err(e) => return bad_input(e),
    };
    // Everything given is checked before the driver is looked for.
    let (op, reg) = match open(dir) {
        Ok(x) => x,
        Err(e) => return bad_input(e),
    };
    // --size / --shape: one case of these sizes (the rest the first check case's)
    // instead of the operation's awkward cases: zero-sized axes, tensors past 2^31
    // elements (scripts/gpu_run.sh --hostile).
    let given: Option<Sizes> = match (flag(args, "--shape"), flag(args, "--size")) {
        (None, None) => None,
        (shape, size) => {
            let mut d = match shape.map(|s| parse_shape(op, &s)) {
                Some(Ok(d)) => d,
                Some(Err(e)) => return bad_input(format!("--shape: {e}")),
                None => Sizes::new(),
            };
            if let Some(s) = size {
                if let Err(e) = parse_dims(op, &s, &mut d) {
                    return bad_input(format!("--size: {e}"));
                }
            }
            Some(d)
        }
    };
    let cuda = match cuda_or_skip() {
        Ok(c) => c,
        Err(code) => return code,
    };
    println!("device: {}   op: {}   seed: {seed} (--seed {seed} replays)", cuda.device_name(), op.name());
    let cc = cuda.compute_capability();
    let (mut pass, mut fail_n) = (0, 0);
    // Inputs and reference outputs per (instance, case): the f64 reference is what a
    // check spends most of its time on.
    let mut cases: HashMap<String, Case> = HashMap::new();
    let mut work = Vec::new();
    for fam in gpu_families(&reg, op, cc) {
        for c in check_candidates(&fam) {
            let label = c.launches.iter().map(|e| e.artifact_id.as_str()).collect::<Vec<_>>().join(" + ");
            let label = match c.config.iter().find(|(k, _)| fam.plans.iter().any(|p| p.plan.axes.contains_key(*k))) {
                Some((k, v)) => format!("{label} [{k}={v}]"),
                None => label,
            };
            if filter.as_ref().is_none_or(|f| label.contains(f.as_str())) {
                // Both entries where a launch has an aligned one: the inputs here are
                // contiguous, so `Best` takes the aligned entry and `General` the other.
                if c.launches.iter().any(|e| e.aligned.is_some()) && entry != Some(EntryChoice::Best) {
                    work.push((fam.clone(), c.clone(), label.clone(), EntryChoice::General));
                }
                if entry != Some(EntryChoice::General) {
                    work.push((fam.clone(), c, label, EntryChoice::Best));
                }
            }
        }
    }
    for (fam, cand, label, choice) in work.into_iter().skip(shard.0).step_by(shard.1) {
        let dtype: DType = match fam.instance.dtype.parse() {
            Ok(d) => d,
            Err(e) => return fail(e),
        };
        let tol = tolerance(dtype);
        let mut worst: Vec<(String, f64)> = Vec::new();
        let mut err = None;
        let mut aligned_ran = false;
        // A case with an empty tensor may launch nothing (a zero grid), or take the
        // general entry (a tensor map cannot describe an empty axis): the aligned entry
        // is then not required to run.
        let mut empty_case = false;
        let mut all_dims = op.check_dims(&fam.instance.keys);
        if let Some(g) = &given {
            // The instance's compile-time keys (head_dim, head_dim_v) stay the
            // artifact's: a size that sets a key is not taken.
            let mut d = all_dims.first().cloned().unwrap_or_default();
            let sets_key = |k: &String, v: i64| op.keys_of(&Sizes::from([(k.clone(), v)])).contains_key(k);
            d.extend(g.iter().filter(|(k, v)| !sets_key(k, **v)).map(|(k, v)| (k.clone(), *v)));
            all_dims = vec![d];
        }
        for (i, dims) in all_dims.iter().enumerate() {
            let key = format!("{:?} {i} {}", fam.instance, ejc_ir::op::dims_text(op, dims));
            let case = match cases.get(&key) {
                Some(c) => c.clone(),
                None => {
                    let made = op
                        .random_call_with(&fam.features, dtype, dims, seed.wrapping_add(i as u64), &scalars)
                        .and_then(|call| {
                            let sizes = op.validate(&fam.features, dtype, &fam.instance.keys, &call)?;
                            let want = op.reference(&fam.features, &call)?;
                            Ok((call, sizes, want))
                        });
                    match made {
                        Ok(c) => {
                            let c = std::rc::Rc::new(c);
                            cases.insert(key, c.clone());
                            c
                        }
                        Err(e) => {
                            err = Some(format!("case {i}: {e}"));
                            break;
                        }
                    }
                }
            };
            let (call, sizes, want) = (&case.0, &case.1, &case.2);
            empty_case |= call.tensors.values().any(|t| t.shape.contains(&0));
            match run_on_gpu(&cuda, op, &fam.features, &cand, call, sizes, choice) {
                Ok((got, aligned)) => {
                    aligned_ran |= aligned;
                    for (name, rel, _) in compare_outputs(op, &fam.features, &got, want) {
                        let r = if rel.is_nan() { f64::INFINITY } else { rel };
                        match worst.iter_mut().find(|(n, _)| *n == name) {
                            Some(w) => w.1 = w.1.max(r),
                            None => worst.push((name.clone(), r)),
                        }
                        // NaN never passes.
                        if rel.is_nan() || rel > tol {
                            // Where the output is wrong (which rows, columns, heads): a bug's shape.
                            let pattern = match (got.tensors.get(&name), want.get(&name)) {
                                (Some(g), Some(w)) => ejc_ir::tensor::mismatch_pattern(g, w, tol),
                                _ => String::new(),
                            };
                            err = Some(format!(
                                "case {}: {name} rel_err {rel:.2e}{}{pattern}",
                                ejc_ir::op::dims_text(op, dims),
                                if pattern.is_empty() { "" } else { "\n       " }
                            ));
                        }
                    }
                }
                Err(e) => err = Some(format!("case {}: {e}", ejc_ir::op::dims_text(op, dims))),
            }
            if err.is_some() {
                break;
            }
        }
        let entry = match (choice, aligned_ran) {
            (_, true) => " [aligned]",
            (EntryChoice::General, false) => " [general]",
            _ => "",
        };
        if choice == EntryChoice::Best
            && !aligned_ran
            && !empty_case
            && cand.launches.iter().any(|e| e.aligned.is_some())
        {
            // The aligned entry was meant to run here: contiguous inputs meet its condition.
            fail_n += 1;
            println!("FAIL {label}: the aligned entry did not run on contiguous inputs");
            continue;
        }
        match err {
            None => {
                pass += 1;
                let w: Vec<String> = worst.iter().map(|(n, r)| format!("{n} {r:.2e}")).collect();
                println!("ok   {label}{entry}  worst rel_err {}", w.join(" "));
            }
            Some(e) => {
                fail_n += 1;
                println!("FAIL {label}{entry}: {e}");
            }
        }
    }
    println!("{pass} passed, {fail_n} failed");
    if fail_n > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The instance a bench/tune/call names: `--variant`, `--dtype`, and sizes.
struct Target<'r> {
    fam: Family<'r>,
    dtype: DType,
    dims: Sizes,
}

/// What a bench/tune/call asks for, checked against the build (no GPU needed): the GPU
/// families of that variant, dtype and keys, and the sizes.
struct Asked<'r> {
    fams: Vec<Family<'r>>,
    dtype: DType,
    dims: Sizes,
    what: String,
}

fn asked<'r>(args: &[String], op: &'static dyn Operation, reg: &'r Registry) -> Result<Asked<'r>, String> {
    let variant = flag(args, "--variant").ok_or("--variant is required")?;
    let dtype: DType =
        flag(args, "--dtype").ok_or("--dtype is required")?.parse().map_err(|e| format!("--dtype: {e}"))?;
    let mut dims = match flag(args, "--shape") {
        Some(s) => parse_shape(op, &s).map_err(|e| format!("--shape: {e}"))?,
        None => Sizes::new(),
    };
    if let Some(s) = flag(args, "--size") {
        parse_dims(op, &s, &mut dims).map_err(|e| format!("--size: {e}"))?;
    }
    let dims = with_defaults(op, &dims);
    let keys = op.keys_of(&dims);
    let fams = reg
        .families(&Query::new(op.name()).platform(Platform::Cuda).variant(&variant).dtype(dtype).keys(&keys))
        .map_err(|e| e.to_string())?;
    if fams.is_empty() {
        return Err(format!("the build has no GPU artifact of variant {variant}, {dtype}, {keys:?}"));
    }
    Ok(Asked { fams, dtype, dims, what: format!("variant {variant}, {dtype}, {keys:?}") })
}

/// The family of `asked` that runs on a GPU of compute capability `cc`.
fn target(asked: Asked<'_>, cc: u32) -> Result<Target<'_>, String> {
    let Asked { fams, dtype, dims, what } = asked;
    let fam = fams
        .into_iter()
        .find(|f| runs_on(&f.backend, cc))
        .ok_or_else(|| format!("no artifact of {what} runs on this GPU (compute capability {cc})"))?;
    Ok(Target { fam, dtype, dims })
}

/// `--scalars NAME=V,...`: run-time scalars in place of a random call's.
fn scalars_arg(args: &[String]) -> Result<ejc_ir::op::Scalars, String> {
    let mut scalars = ejc_ir::op::Scalars::new();
    if let Some(list) = flag(args, "--scalars") {
        for kv in list.split(',') {
            match kv.split_once('=').map(|(k, v)| (k, v.parse::<f64>())) {
                Some((k, Ok(v))) => {
                    scalars.insert(k.to_string(), v);
                }
                _ => return Err(format!("--scalars: `{kv}` is not NAME=NUMBER")),
            }
        }
    }
    Ok(scalars)
}

fn bench(args: &[String]) -> ExitCode {
    let valued = ["--variant", "--dtype", "--size", "--shape", "--reps", "--only", "--json", "--scalars"];
    if let Err(e) = check_args("bench", args, &valued, &["--all"]) {
        return bad_input(e);
    }
    let dir = &args[0];
    let reps: usize = match number(args, "--reps") {
        Ok(Some(0)) => return bad_input("--reps must be at least 1"),
        Ok(r) => r.unwrap_or(20),
        Err(e) => return bad_input(e),
    };
    let only = flag(args, "--only");
    let all = args.iter().any(|a| a == "--all");
    // The call's scalars where given (a run-time window's sides), else the test values.
    let scalars = match scalars_arg(args) {
        Ok(s) => s,
        Err(e) => return bad_input(e),
    };
    let (op, reg) = match open(dir) {
        Ok(x) => x,
        Err(e) => return bad_input(e),
    };
    let a = match asked(args, op, &reg) {
        Ok(a) => a,
        Err(e) => return bad_input(e),
    };
    let cuda = match cuda_or_skip() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let t = match target(a, cuda.compute_capability()) {
        Ok(t) => t,
        Err(e) => return bad_input(e),
    };
    let host = match op.timing_call(&t.fam.features, t.dtype, &t.dims, 7, &scalars) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let sizes = match op.validate(&t.fam.features, t.dtype, &t.fam.instance.keys, &host) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let work = op.work(&t.fam.features, t.dtype, &sizes);
    let dev = match upload_call(&cuda, &Call::from_host(&host)) {
        Ok(d) => d,
        Err(e) => return fail(e),
    };
    println!(
        "device: {}   {} {} {} {}   {}",
        cuda.device_name(),
        op.name(),
        t.fam.instance.describe(),
        ejc_ir::op::dims_text(op, &t.dims),
        t.fam.backend,
        op.describe(&t.fam.features)
    );
    let mut rows = Vec::new();
    let id_of = |c: &ejc_runtime::registry::Candidate| {
        format!(
            "{}{}",
            c.launches.iter().map(|e| e.artifact_id.as_str()).collect::<Vec<_>>().join(" + "),
            c.plan.plan.axes.keys().filter_map(|a| c.config.get(a).map(|v| format!(" [{a}={v}]"))).collect::<String>()
        )
    };
    // The candidates the tuner would time: a plan's all where it has few, a staged search
    // through a plan with many (ejc_runtime::search); `--all` times every one.
    let cands: Vec<_> = t
        .fam
        .candidates()
        .into_iter()
        .filter(|c| only.as_ref().is_none_or(|o| id_of(c).contains(o.as_str())))
        .collect();
    let points: Vec<_> = cands.iter().map(|c| c.point()).collect();
    let mut time = |k: usize| {
        let c = &cands[k];
        let id = id_of(c);
        match CudaPlan::for_candidate(&cuda, c, &dev, &sizes).and_then(|p| p.median_ms(&cuda, 3, reps)) {
            Ok(ms) => {
                let tf = work.flops / (ms * 1e-3) / 1e12;
                let gbs = work.bytes / (ms * 1e-3) / 1e9;
                println!("  {id:<96} {ms:8.4} ms  {tf:7.1} TFLOP/s  {gbs:7.0} GB/s");
                rows.push((id, c.id(), ms, tf, gbs, k));
                Some(ms)
            }
            Err(e) => {
                println!("  {id:<96} {e}");
                None
            }
        }
    };
    if all {
        (0..cands.len()).for_each(|k| {
            time(k);
        });
    } else {
        ejc_runtime::search::staged_search(&points, &mut time);
        println!(
            "timed {} of {} candidates (a staged search through plans of more than {}; --all times every one)",
            rows.len(),
            cands.len(),
            ejc_runtime::search::FULL_SEARCH_LIMIT
        );
    }
    rows.sort_by(|a, b| a.2.total_cmp(&b.2));
    // Where the best candidate's plan runs launches on several streams, the same candidate
    // on one stream, in order (what the streams bought, measured in the same run).
    // And enqueued in the other order (the latest-listed ready launch first).
    let (mut one_stream_ms, mut late_ms, mut launch_ms) = (None, None, None);
    if let Some(best) = rows.first() {
        println!("best: {} {:.4} ms {:.1} TFLOP/s {:.0} GB/s", best.0, best.2, best.3, best.4);
        let c = &cands[best.5];
        let plan = || CudaPlan::for_candidate(&cuda, c, &dev, &sizes);
        if let Ok(p) = plan() {
            if c.launches.len() > 1 {
                // The best plan's launches timed one by one (each alone, after a whole run).
                match p.median_ms_per_launch(&cuda, 3, reps) {
                    Ok(ms) => {
                        let parts: Vec<String> =
                            c.launches.iter().zip(&ms).map(|(e, t)| format!("{} {t:.4} ms", e.artifact_id)).collect();
                        println!("best, each launch alone: {}", parts.join(", "));
                        launch_ms = Some(ms);
                    }
                    Err(e) => println!("best, each launch alone: {e}"),
                }
            }
            let lanes = p.lanes.count;
            if lanes > 1 {
                match p.on_one_stream().median_ms(&cuda, 3, reps) {
                    Ok(ms) => {
                        println!("best on one stream (its {lanes} streams as one, in order): {ms:.4} ms");
                        one_stream_ms = Some(ms);
                    }
                    Err(e) => println!("best on one stream: {e}"),
                }
                match plan().and_then(|p| p.issue_late(&c.plan.plan.launches)).and_then(|p| p.median_ms(&cuda, 3, reps))
                {
                    Ok(ms) => {
                        println!("best on {lanes} streams, enqueued in the late order: {ms:.4} ms");
                        late_ms = Some(ms);
                    }
                    Err(e) => println!("best in the late order: {e}"),
                }
            }
        }
    }
    if let Some(path) = flag(args, "--json") {
        let j = serde_json::json!({
            "device": cuda.device_name(), "op": op.name(), "instance": t.fam.instance, "dims": t.dims,
            "flops": work.flops, "bytes": work.bytes, "best_one_stream_ms": one_stream_ms, "best_late_order_ms": late_ms, "best_launch_ms": launch_ms,
            "candidates": rows.iter().map(|r| serde_json::json!({"artifact": r.0, "config": r.1, "ms": r.2, "tflops": r.3, "gbs": r.4})).collect::<Vec<_>>(),
        });
        if let Err(e) = std::fs::write(&path, serde_json::to_string_pretty(&j).unwrap_or_default()) {
            return fail(format!("--json {path}: {e}"));
        }
    }
    ExitCode::SUCCESS
}

/// `tune` and `call`: one call through the runtime (with the given cache directory).
fn through_runtime(args: &[String], tune: bool) -> ExitCode {
    use ejc_runtime::api::{CallOptions, PlatformChoice, Runtime, RuntimeOptions};
    use ejc_runtime::chain::Policy;
    let (cmd, switches): (&str, &[&str]) = if tune { ("tune", &["--force"]) } else { ("call", &[]) };
    if let Err(e) = check_args(cmd, args, &["--variant", "--dtype", "--size", "--shape", "--cache-dir"], switches) {
        return bad_input(e);
    }
    let dir = &args[0];
    let (op, reg) = match open(dir) {
        Ok(x) => x,
        Err(e) => return bad_input(e),
    };
    let a = match asked(args, op, &reg) {
        Ok(a) => a,
        Err(e) => return bad_input(e),
    };
    let cuda = match cuda_or_skip() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let t = match target(a, cuda.compute_capability()) {
        Ok(t) => t,
        Err(e) => return bad_input(e),
    };
    let policy = if tune {
        Policy { allow_heuristics: false, ..Policy::default() }
    } else {
        // A call takes what the cache has; it does not tune.
        Policy { allow_autotune: false, ..Policy::default() }
    };
    let opts = RuntimeOptions {
        kernels: vec![PathBuf::from(dir)],
        cache_dir: flag(args, "--cache-dir").map(PathBuf::from),
        policy: Some(policy),
        log: true,
    };
    let mut rt = match Runtime::new(opts) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let host = match op.timing_call(&t.fam.features, t.dtype, &t.dims, 11, &Default::default()) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    // The call asks for the variant's features with the call's own values.
    let wanted = op.wanted(&t.fam.features, &host);
    if tune && args.iter().any(|a| a == "--force") {
        if let Some(c) = rt.chain(&cuda.fingerprint()).persistent_mut() {
            let _ = c.clear(None);
        }
    }
    let mut call = Call::from_host(&host);
    let o = CallOptions { platform: PlatformChoice::Cuda, ..Default::default() };
    let started = std::time::Instant::now();
    match rt.call(op.name(), &wanted, &mut call, &o) {
        Ok(r) => {
            println!(
                "{} {} on {}: plan {} {:?} from the {} ({:.2}s)",
                op.name(),
                r.instance.describe(),
                cuda.device_name(),
                r.plan,
                r.config,
                r.source,
                started.elapsed().as_secs_f64()
            );
            // The call's own outputs against the reference.
            let want = match op.reference(&t.fam.features, &host) {
                Ok(w) => w,
                Err(e) => return fail(e),
            };
            let mut got = host.clone();
            for n in op.outputs(&t.fam.features) {
                if let Some(x) = call.host_tensor(n) {
                    got.tensors.insert(n.to_string(), x);
                }
            }
            let tol = tolerance(t.dtype);
            let mut ok = true;
            for (n, rel, _) in compare_outputs(op, &t.fam.features, &got, &want) {
                println!("  {n}: rel_err {rel:.2e} (tolerance {tol:e})");
                ok &= rel <= tol;
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => fail(e),
    }
}

/// A packed case with its kernel parsed and its PTX read.
type Packed = (ejc_ir::kernel_case::PackedCase, ejc_ir::ir::Kernel, Vec<String>);

/// Read every `DIR/*.json` packed case, its kernel and its PTX files, in name order.
fn read_packs(dir: &str) -> Result<Vec<Packed>, String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{dir}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("{dir}: no packed cases (*.json); make them with `bash scripts/gpu_prepare.sh --kernels`"));
    }
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        let pc: ejc_ir::kernel_case::PackedCase =
            serde_json::from_str(&text).map_err(|e| format!("{}: not a packed case: {e}", f.display()))?;
        let k = pc.case.parse()?;
        let mut ptx = Vec::new();
        for a in &pc.artifacts {
            let p = PathBuf::from(dir).join(&a.file);
            ptx.push(std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?);
        }
        out.push((pc, k, ptx));
    }
    Ok(out)
}

/// Run one entry of a packed module on `args`; the arguments after.
fn run_packed(
    cuda: &Cuda,
    k: &ejc_ir::ir::Kernel,
    a: &ejc_ir::kernel_case::PackedPtx,
    ptx: &str,
    entry: &str,
    args: &[ejc_ir::interp::Arg],
    grid: [i64; 3],
) -> Result<Vec<ejc_ir::interp::Arg>, String> {
    use ejc_ir::interp::Arg;
    use ejc_runtime::cpu::HostBuffer;
    use ejc_runtime::cuda::Scalar;
    let mut kernel = cuda.load(ptx, entry, a.threads, a.smem_bytes).map_err(|e| e.to_string())?;
    let aligned = a.aligned_entry.as_deref() == Some(entry);
    if aligned {
        kernel.tensor_maps = a.tensor_maps.clone();
    }
    let mut bufs = Vec::new();
    let mut scalars = Vec::new();
    for (p, x) in k.params.iter().zip(args) {
        match x {
            Arg::Tensor(t) => bufs.push(cuda.upload(&HostBuffer::from_host(t)).map_err(|e| e.to_string())?),
            Arg::Scalar(v) if p.ty == ejc_ir::types::Type::Scalar(DType::F32) => scalars.push(Scalar::F32(*v as f32)),
            Arg::Scalar(v) => scalars.push(Scalar::I32(*v as i64 as u32 as i32)),
        }
    }
    let views: Vec<_> = bufs.iter().map(|b| b.view()).collect();
    let tensor_names: Vec<&str> =
        k.params.iter().filter(|p| matches!(p.ty, ejc_ir::types::Type::Tensor(..))).map(|p| p.name.as_str()).collect();
    let mut maps = Vec::new();
    for m in kernel.tensor_maps.iter() {
        let i = tensor_names.iter().position(|n| *n == m.tensor).ok_or_else(|| format!("no tensor `{}`", m.tensor))?;
        maps.push(ejc_runtime::cuda::encode_tensor_map(&views[i], m).map_err(|e| e.to_string())?);
    }
    // Safety: the tensors are the kernel's tensor parameters in order (the case's shapes,
    // checked against the kernel's ranks), each in its own allocation.
    unsafe { cuda.launch(&kernel, grid, &views, &scalars, &maps) }.map_err(|e| e.to_string())?;
    cuda.synchronize().map_err(|e| e.to_string())?;
    let mut it = bufs.iter();
    args.iter()
        .map(|x| match x {
            Arg::Tensor(_) => {
                let b = it.next().expect("one buffer per tensor");
                Ok(Arg::Tensor(cuda.download(b).map_err(|e| e.to_string())?.to_host()))
            }
            s => Ok(s.clone()),
        })
        .collect()
}

/// `check-kernels DIR`: every packed case on every module of it this GPU runs (both
/// entries where the case's tensors are aligned), against the interpreter.
fn check_kernels(args: &[String]) -> ExitCode {
    if let Err(e) = check_args("check-kernels", args, &["--filter", "--seed"], &[]) {
        return bad_input(e);
    }
    let filter = flag(args, "--filter");
    let seed = match seed_arg(args) {
        Ok(s) => s,
        Err(e) => return bad_input(e),
    };
    let packs = match read_packs(&args[0]) {
        Ok(p) => p,
        Err(e) => return bad_input(e),
    };
    let cuda = match cuda_or_skip() {
        Ok(c) => c,
        Err(code) => return code,
    };
    println!("device: {}   seed: {seed} (--seed {seed} replays)   reference: the interpreter", cuda.device_name());
    let cc = cuda.compute_capability();
    let (mut pass, mut failed, mut skipped) = (0, 0, 0);
    for (pc, k, ptx) in &packs {
        let c = &pc.case;
        let prepared = c.args(k, seed).and_then(|a| Ok((c.reference(k, &a)?, c.grid(k)?, a)));
        let (want, grid, inputs) = match prepared {
            Ok(x) => x,
            Err(e) => return fail(e),
        };
        for (a, text) in pc.artifacts.iter().zip(ptx) {
            let label = format!("{} [{}]", c.name, a.label);
            if filter.as_ref().is_some_and(|f| !label.contains(f.as_str())) {
                continue;
            }
            if !runs_on(&format!("ptx:{}", a.arch), cc) {
                skipped += 1;
                continue;
            }
            // The aligned entry where every tensor it assumes aligned is: the case's
            // tensors are contiguous in their own allocations (256-byte aligned).
            let aligned_ok = a.aligned_tensors.iter().all(|t| {
                c.shapes.get(t).is_some_and(|shape| {
                    let st: Vec<i64> =
                        ejc_ir::tensor::HostTensor::contiguous_strides(shape).iter().map(|s| *s as i64).collect();
                    ejc_ir::manifest::AlignedEntry::tensor_ok(0, &st)
                })
            });
            let positive_ok = a.positive.iter().all(|s| c.scalars.get(s).is_some_and(|v| *v > 0.0));
            let mut entries = vec![("general", a.entry.as_str())];
            if let Some(e) = a.aligned_entry.as_deref().filter(|_| aligned_ok && positive_ok) {
                entries.push(("aligned", e));
            }
            for (which, entry) in entries {
                let verdict =
                    run_packed(&cuda, k, a, text, entry, &inputs, grid).and_then(|got| c.compare(k, &got, &want));
                match verdict {
                    Ok(rs) => {
                        let ok = rs.iter().all(|r| r.passed());
                        let figures: Vec<String> = rs
                            .iter()
                            .map(|r| {
                                format!("{} rel_err={:.2e} max_abs_err={:.2e}", r.output, r.rel_err, r.max_abs_err)
                            })
                            .collect();
                        println!("{} {label} {which}: {}", if ok { "PASS" } else { "FAIL" }, figures.join("  "));
                        if ok {
                            pass += 1;
                        } else {
                            failed += 1;
                        }
                    }
                    Err(e) => {
                        println!("FAIL {label} {which}: {e}");
                        failed += 1;
                    }
                }
            }
        }
    }
    println!("{pass} passed, {failed} failed, {skipped} modules for another GPU skipped (tolerance: DESIGN.md's)");
    if failed > 0 || pass == 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("info") if args.len() > 1 => bad_input(format!("info takes no arguments (got `{}`)", args[1])),
        Some("info") => match cuda_or_skip() {
            Ok(c) => {
                println!("{}", c.device_name());
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Some("check") => check(&args[1..]),
        Some("check-kernels") => check_kernels(&args[1..]),
        Some("bench") => bench(&args[1..]),
        Some("tune") => through_runtime(&args[1..], true),
        Some("call") => through_runtime(&args[1..], false),
        _ => usage(),
    }
}
