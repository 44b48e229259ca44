//! `ejc list SPEC`: the kernels and candidate configurations a spec expands to.

use std::path::Path;

use ejc_ir::flash::instances;
use serde_json::json;

use super::{load_spec, Outcome};

pub fn run(path: &Path, as_json: bool) -> Outcome {
    let spec = match load_spec(path) {
        Ok(s) => s,
        Err(o) => return o,
    };
    let all = instances(&spec);
    let configs: Vec<String> = spec
        .schedule
        .num_warps
        .iter()
        .flat_map(|w| spec.schedule.num_stages.iter().map(move |s| format!("w{w}_s{s}")))
        .collect();
    if as_json {
        let kernels: Vec<_> = all
            .iter()
            .map(|i| {
                json!({
                    "kernel_id": i.id, "variant": i.variant.name, "dtype": i.dtype.to_string(),
                    "head_dim": i.head_dim, "block_m": i.block_m, "block_n": i.block_n,
                    "gpu_configs": configs,
                })
            })
            .collect();
        let doc = json!({
            "spec": spec.name, "op": spec.op, "version": spec.version,
            "targets": spec.targets.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
            "kernels": kernels,
        });
        println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        return Outcome::Ok;
    }
    println!("spec `{}` ({}@{}), {}", spec.name, spec.op, spec.version, path.display());
    println!("targets: {}", spec.targets.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", "));
    println!("variants:");
    for v in &spec.variants {
        let f = &v.features;
        let mut parts = Vec::new();
        if f.causal {
            parts.push("causal".to_string());
        }
        match f.sliding_window {
            Some(ejc_ir::spec::Window::Runtime) => parts.push("sliding_window=runtime".into()),
            Some(ejc_ir::spec::Window::Fixed { left, right }) => {
                parts.push(format!("sliding_window=({left}, {right})"))
            }
            None => {}
        }
        match f.logits_soft_cap {
            Some(ejc_ir::spec::SoftCap::Runtime) => parts.push("logits_soft_cap=runtime".into()),
            Some(ejc_ir::spec::SoftCap::Fixed(c)) => parts.push(format!("logits_soft_cap={c}")),
            None => {}
        }
        for (name, on) in [
            ("sinks", f.sinks),
            ("bias", f.bias),
            ("mask", f.mask),
            ("segment_ids", f.segment_ids),
            ("varlen", f.varlen),
            ("dropout", f.dropout),
        ] {
            if on {
                parts.push(name.into());
            }
        }
        let what = if parts.is_empty() { "full attention".to_string() } else { parts.join(" + ") };
        println!("  {:<16} {what}", v.name);
    }
    println!("kernels ({}), each with GPU configurations num_warps x num_stages = {}:", all.len(), configs.join(" "));
    for i in &all {
        println!("  {}", i.id);
    }
    println!(
        "{} variants x {} dtypes x {} head dims x {} tilings = {} tile programs; x {} GPU configurations = {} candidates",
        spec.variants.len(),
        spec.dtypes.len(),
        spec.head_dims.len(),
        spec.schedule.tilings().len(),
        all.len(),
        configs.len(),
        all.len() * configs.len()
    );
    Outcome::Ok
}
