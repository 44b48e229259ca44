//! `ejc list SPEC`: the kernels and candidate configurations a spec expands to.

use std::path::Path;

use ejc_ir::op::{instances, spec_plans, AxisKind};
use serde_json::json;

use super::{load_spec, Outcome};

pub fn run(path: &Path, as_json: bool) -> Outcome {
    let spec = match load_spec(path) {
        Ok(s) => s,
        Err(o) => return o,
    };
    let op = spec.operation();
    let all = instances(&spec);
    // The GPU targets' launch configurations (launch axes of the schedule).
    let launch: Vec<&str> = op.axes().iter().filter(|a| a.kind == AxisKind::Launch).map(|a| a.name).collect();
    let configs: Vec<String> = spec
        .schedule
        .points(&launch)
        .iter()
        .map(|c| {
            c.iter()
                .map(|(k, v)| match k.as_str() {
                    "num_warps" => format!("w{v}"),
                    "num_stages" => format!("s{v}"),
                    other => format!("{other}{v}"),
                })
                .collect::<Vec<_>>()
                .join("_")
        })
        .collect();
    if as_json {
        let kernels: Vec<_> = all
            .iter()
            .map(|i| {
                let mut k = json!({
                    "kernel_id": i.id, "variant": i.variant.name, "dtype": i.dtype.to_string(),
                    "keys": i.keys, "role": i.role, "tile": i.tile, "gpu_configs": configs,
                });
                for (n, v) in i.keys.iter().chain(&i.tile) {
                    k[n] = json!(v);
                }
                k
            })
            .collect();
        let plans: Vec<_> = spec
            .variants
            .iter()
            .map(|v| json!({"variant": v.name, "plans": spec_plans(&spec, v).iter().map(|p| p.name).collect::<Vec<_>>()}))
            .collect();
        let doc = json!({
            "spec": spec.name, "op": spec.op, "version": spec.version,
            "targets": spec.targets.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
            "plans": plans,
            "kernels": kernels,
        });
        println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
        return Outcome::Ok;
    }
    println!(
        "spec `{}` ({}@{}: {}), {}",
        spec.name,
        spec.op,
        spec.version,
        op.summary(),
        ejc_ir::limits::escape_controls(&path.display().to_string())
    );
    println!("targets: {}", spec.targets.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", "));
    println!("variants:");
    for v in &spec.variants {
        let plans: Vec<&str> = spec_plans(&spec, v).iter().map(|p| p.name).collect();
        println!("  {:<16} {}   (plans: {})", v.name, op.describe(&v.features), plans.join(", "));
    }
    println!("kernels ({}), each with GPU configurations {} = {}:", all.len(), launch.join(" x "), configs.join(" "));
    for i in &all {
        println!("  {}", i.id);
    }
    let keys: Vec<String> = spec.keys.iter().map(|(k, v)| format!("{} {k}", v.len())).collect();
    let choices: usize = spec.variants.iter().map(|v| ejc_ir::op::plan_choices(&spec, v)).sum::<usize>()
        * spec.dtypes.len()
        * spec.key_points().len();
    println!(
        "{} variants x {} dtypes x {} = {} tile programs; {} candidates (plans x tilings x run-time axes) \
         x {} GPU configurations = {} GPU candidates",
        spec.variants.len(),
        spec.dtypes.len(),
        if keys.is_empty() { "tilings".to_string() } else { format!("{} x tilings and roles", keys.join(" x ")) },
        all.len(),
        choices,
        configs.len(),
        choices * configs.len()
    );
    Outcome::Ok
}
