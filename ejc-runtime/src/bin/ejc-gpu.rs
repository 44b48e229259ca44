//! `ejc-gpu`: run PTX artifacts of a build on the GPU, without LLVM (this binary is
//! what travels to a GPU machine; `ejc build --target ptx:...` writes the artifacts, and
//! `ejc build --target mlir:gpu` the PTX of MLIR's gpu form, which `check` runs too).
//!
//! ```text
//! ejc-gpu info
//! ejc-gpu check DIR [--filter TEXT] [--seed N] [--shard I/N]   every artifact vs the reference, awkward shapes
//! ejc-gpu bench DIR --variant V --dtype D --head-dim N --shape B,SQ,SK,HQ,HKV,D [--reps N] [--json FILE]
//! ```
//!
//! `check` exits 1 when any artifact is outside DESIGN.md's tolerance (bf16 1e-2,
//! f16 5e-3 by ‖out − ref‖/‖ref‖; NaN never passes); `bench` times every candidate
//! configuration of the kernel with CUDA events (median of `--reps` after warm-up)
//! and reports the fastest, as the autotuner would pick it. Without a driver both
//! say so and exit 0.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::reference;
use ejc_ir::flash::{FlashInputs, FlashOutputs, FlashRuntime, FlashShape};
use ejc_ir::manifest::Artifact;
use ejc_ir::spec::Features;
use ejc_ir::tensor::compare;
use ejc_ir::types::DType;
use ejc_runtime::cuda::{entry_for, load_entry, median_ms, runs_on, Cuda, CudaError, CudaKernel, FlashDevice};
use ejc_runtime::flash::FlashBuffers;
use ejc_runtime::manifest::{load, Loaded};
use ejc_runtime::registry::features_from_json;

fn usage() -> ExitCode {
    eprintln!(
        "usage:\n  ejc-gpu info\n  ejc-gpu check DIR [--filter TEXT] [--seed N] [--shard I/N]\n  ejc-gpu bench DIR --variant V --dtype D \
         --head-dim N --shape B,SQ,SK,HQ,HKV,D [--reps N] [--json FILE]"
    );
    ExitCode::from(2)
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn cuda_or_skip() -> Result<Cuda, ExitCode> {
    match Cuda::new() {
        Ok(c) => Ok(c),
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

struct Art<'a> {
    a: &'a Artifact,
    features: Features,
    dtype: DType,
}

fn artifacts<'a>(m: &'a Loaded, cc: u32) -> Result<Vec<Art<'a>>, String> {
    let mut out = Vec::new();
    for a in &m.manifest.artifacts {
        if !runs_on(&a.target, cc) {
            continue;
        }
        let features = features_from_json(&a.features)?;
        let dtype: DType = a.dtype.parse()?;
        out.push(Art { a, features, dtype });
    }
    Ok(out)
}

/// Load `entry` of artifact `a` (its `entry`, or its aligned entry).
fn kernel(cuda: &Cuda, m: &Loaded, a: &Artifact, entry: &str) -> Result<CudaKernel, String> {
    load_entry(cuda, m, a, entry).map_err(|e| e.to_string())
}

fn tol(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-5,
        DType::F16 => 5e-3,
        _ => 1e-2,
    }
}

/// Inputs, run-time arguments and reference outputs of one case, shared by every
/// artifact (and entry) of the same features, dtype and shape: the f64 reference is
/// what a check spends most of its time on.
type Case = std::rc::Rc<(FlashInputs, FlashRuntime, FlashOutputs)>;

fn case(cache: &mut HashMap<String, Case>, art: &Art, shape: &FlashShape, seed: u64) -> Result<Case, String> {
    let key = format!("{:?} {} {shape} {seed}", art.features, art.dtype);
    if let Some(c) = cache.get(&key) {
        return Ok(c.clone());
    }
    let f = &art.features;
    let inputs = random_inputs(f, art.dtype, shape, seed);
    let rt = default_runtime(f, shape, seed);
    let want = reference(f, &rt, &inputs)?;
    let c: Case = std::rc::Rc::new((inputs, rt, want));
    cache.insert(key, c.clone());
    Ok(c)
}

/// Run one artifact on one case; returns (rel_err out, rel_err lse).
fn run_one(cuda: &Cuda, k: &CudaKernel, art: &Art, case: &Case) -> Result<(f64, f64), String> {
    let f = &art.features;
    let (inputs, rt, want) = (&case.0, &case.1, &case.2);
    let mut call = FlashBuffers::from_inputs(inputs);
    let bm = art.a.config.get("block_m").copied().unwrap_or(64) as usize;
    let dev = FlashDevice::new(cuda, f, art.dtype, art.a.head_dim, bm, rt, &mut call).map_err(|e| e.to_string())?;
    if let Some(al) = art.a.aligned.as_ref().filter(|al| al.entry == k.entry) {
        if !dev.meets(al) {
            return Err(format!("the inputs do not meet the aligned entry's condition ({})", al.tensors.join(", ")));
        }
    }
    dev.launch(cuda, k).map_err(|e| e.to_string())?;
    cuda.synchronize().map_err(|e| e.to_string())?;
    dev.read_outputs(cuda, &mut call).map_err(|e| e.to_string())?;
    let got = call.outputs();
    let (ro, _) = compare(&got.out.to_vec(), &want.out.to_vec());
    let (rl, _) = compare(&got.lse.to_vec(), &want.lse.to_vec());
    Ok((ro, rl))
}

fn check(args: &[String]) -> ExitCode {
    let Some(dir) = args.first() else { return usage() };
    let filter = flag(args, "--filter");
    // --shard I/N: every N-th artifact from the I-th, so N processes check a build in
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
    let seed: u64 = flag(args, "--seed").and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    let cuda = match cuda_or_skip() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let m = match load(PathBuf::from(dir)) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("device: {}   seed: {seed} (--seed {seed} replays)", cuda.device_name());
    let arts = match artifacts(&m, cuda.compute_capability()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (mut pass, mut fail) = (0, 0);
    let mut cases = HashMap::new();
    let selected = arts.iter().filter(|a| filter.as_ref().is_none_or(|f| a.a.artifact_id.contains(f.as_str())));
    for art in selected.skip(shard.0).step_by(shard.1) {
        let d = art.a.head_dim;
        // s_q ≠ s_k both ways, lengths off the block size, GQA 2:1 and 4:1, MQA, one query row.
        let shapes = [
            format!("2,77,93,4,2,{d}"),
            format!("1,45,21,2,1,{d}"),
            format!("1,19,140,8,2,{d}"),
            format!("2,129,129,4,1,{d}"),
            format!("1,1,23,2,2,{d}"),
        ];
        // Both entries of an artifact: the general one and the aligned one (the
        // inputs here are contiguous, so they meet its condition).
        let mut entries = vec![(art.a.entry.clone(), art.a.artifact_id.clone())];
        if let Some(al) = &art.a.aligned {
            entries.push((al.entry.clone(), format!("{} [aligned]", art.a.artifact_id)));
        }
        for (entry, id) in entries {
            let k = match kernel(&cuda, &m, art.a, &entry) {
                Ok(k) => k,
                Err(e) => {
                    println!("FAIL {id}: {e}");
                    fail += 1;
                    continue;
                }
            };
            let mut worst = (0.0f64, 0.0f64);
            let mut err = None;
            for (i, s) in shapes.iter().enumerate() {
                let shape = match FlashShape::parse(s) {
                    Ok(s) => s,
                    Err(e) => {
                        err = Some(e);
                        break;
                    }
                };
                let ran = case(&mut cases, art, &shape, seed.wrapping_add(i as u64))
                    .and_then(|c| run_one(&cuda, &k, art, &c));
                match ran {
                    Ok((o, l)) => {
                        let ok = |x: f64| x <= tol(art.dtype);
                        if !ok(o) || !ok(l) {
                            err = Some(format!("shape {s}: rel_err out {o:.2e}, lse {l:.2e}"));
                        }
                        worst = (worst.0.max(if o.is_nan() { f64::INFINITY } else { o }), worst.1.max(l));
                    }
                    Err(e) => {
                        err = Some(format!("shape {s}: {e}"));
                    }
                }
                if err.is_some() {
                    break;
                }
            }
            match err {
                None => {
                    pass += 1;
                    println!("ok   {id}  worst rel_err out {:.2e} lse {:.2e}", worst.0, worst.1);
                }
                Some(e) => {
                    fail += 1;
                    println!("FAIL {id}: {e}");
                }
            }
        }
    }
    println!("{pass} passed, {fail} failed");
    if fail > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn bench(args: &[String]) -> ExitCode {
    let Some(dir) = args.first() else { return usage() };
    let (Some(variant), Some(dtype), Some(hd), Some(shape)) =
        (flag(args, "--variant"), flag(args, "--dtype"), flag(args, "--head-dim"), flag(args, "--shape"))
    else {
        return usage();
    };
    let reps: usize = flag(args, "--reps").and_then(|s| s.parse().ok()).unwrap_or(20);
    let cuda = match cuda_or_skip() {
        Ok(c) => c,
        Err(code) => return code,
    };
    let m = match load(PathBuf::from(dir)) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let shape = match FlashShape::parse(&shape) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: --shape: {e}");
            return ExitCode::from(2);
        }
    };
    let arts = match artifacts(&m, cuda.compute_capability()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cands: Vec<&Art> = arts
        .iter()
        .filter(|a| a.a.variant == variant && a.a.dtype == dtype && a.a.head_dim.to_string() == hd)
        .collect();
    if cands.is_empty() {
        eprintln!("error: no artifact for variant {variant}, dtype {dtype}, head_dim {hd} that runs on this GPU");
        return ExitCode::FAILURE;
    }
    let f = &cands[0].features;
    let s = &shape;
    let mut flops = 4.0 * (s.batch * s.heads_q) as f64 * s.seq_q as f64 * s.seq_k as f64 * s.head_dim as f64;
    if f.causal {
        flops /= 2.0;
    }
    let inputs = random_inputs(f, cands[0].dtype, s, 7);
    let rt = default_runtime(f, s, 7);
    println!("device: {}   shape {shape}   {variant} {dtype} d={hd}", cuda.device_name());
    let mut rows = Vec::new();
    for art in &cands {
        let mut call = FlashBuffers::from_inputs(&inputs);
        let bm = art.a.config.get("block_m").copied().unwrap_or(64) as usize;
        let dev = match FlashDevice::new(&cuda, f, art.dtype, art.a.head_dim, bm, &rt, &mut call) {
            Ok(d) => d,
            Err(e) => {
                println!("  {:<60} {e}", art.a.artifact_id);
                continue;
            }
        };
        // The aligned entry where the tensors allow it (what a launcher does).
        let entry = entry_for(art.a, &dev).to_string();
        let k = match kernel(&cuda, &m, art.a, &entry) {
            Ok(k) => k,
            Err(e) => {
                println!("  {:<60} failed to load: {e}", art.a.artifact_id);
                continue;
            }
        };
        match median_ms(&cuda, &dev, &k, 3, reps) {
            Ok(ms) => {
                let tf = flops / (ms * 1e-3) / 1e12;
                println!("  {:<60} {ms:8.3} ms  {tf:7.1} TFLOP/s", art.a.artifact_id);
                rows.push((art.a.artifact_id.clone(), ms, tf));
            }
            Err(e) => println!("  {:<60} {e}", art.a.artifact_id),
        }
    }
    rows.sort_by(|a, b| a.1.total_cmp(&b.1));
    if let Some(best) = rows.first() {
        println!("best: {} {:.3} ms {:.1} TFLOP/s", best.0, best.1, best.2);
    }
    if let Some(path) = flag(args, "--json") {
        let j = serde_json::json!({
            "device": cuda.device_name(), "shape": shape.to_string(), "variant": variant, "dtype": dtype,
            "head_dim": hd, "flops": flops,
            "candidates": rows.iter().map(|r| serde_json::json!({"artifact": r.0, "ms": r.1, "tflops": r.2})).collect::<Vec<_>>(),
        });
        let _ = std::fs::write(path, serde_json::to_string_pretty(&j).unwrap_or_default());
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("info") => match cuda_or_skip() {
            Ok(c) => {
                println!("{}", c.device_name());
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Some("check") => check(&args[1..]),
        Some("bench") => bench(&args[1..]),
        _ => usage(),
    }
}
