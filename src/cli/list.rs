//! `ejc list SPEC`: the kernels and candidate configurations a spec expands to.

use std::path::Path;

use ejc_ir::op::{instances, spec_plans, target_counts, AxisKind, KernelInstance};
use ejc_ir::spec::{ScheduleSpace, Spec, Target};
use serde_json::json;

use super::{load_spec, Outcome};

pub fn run(path: &Path, as_json: bool) -> Outcome {
    let spec = match load_spec(path) {
        Ok(s) => s,
        Err(o) => return o,
    };
    let op = spec.operation();
    let all = instances(&spec);
    // The launch configurations (launch axes of the schedule) of each GPU target, per kernel.
    let launch: Vec<&str> = op.axes().iter().filter(|a| a.kind == AxisKind::Launch).map(|a| a.name).collect();
    let config_names = |schedule: &ScheduleSpace| -> Vec<String> {
        schedule
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
            .collect()
    };
    // Per kernel: the targets that build it and, for GPU targets, its configurations there.
    let kernel_targets = |i: &KernelInstance| -> Vec<(String, Option<Vec<String>>)> {
        spec.targets
            .iter()
            .filter_map(|t| {
                let schedule = spec.schedule.resolve(Some(t), i.dtype, &i.keys);
                // Built there when its tile-axis values are in that schedule (a role's fixed
                // values are not the schedule's).
                let builds = i.tile.iter().all(|(a, v)| {
                    schedule.values(a).contains(v)
                        || !op.axes().iter().any(|d| d.name == a.as_str() && d.kind == AxisKind::Tile)
                });
                builds.then(|| (t.to_string(), is_gpu(t).then(|| config_names(&schedule))))
            })
            .collect()
    };
    if as_json {
        let kernels: Vec<_> = all
            .iter()
            .map(|i| {
                let targets = kernel_targets(i);
                let gpu_configs: serde_json::Map<String, serde_json::Value> =
                    targets.iter().filter_map(|(t, c)| c.as_ref().map(|c| (t.clone(), json!(c)))).collect();
                let mut k = json!({
                    "kernel_id": i.id, "variant": i.variant.name, "dtype": i.dtype.to_string(),
                    "keys": i.keys, "role": i.role, "tile": i.tile,
                    "targets": targets.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>(),
                    "gpu_configs": gpu_configs,
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
    // The base schedule's view: every target, the schedule's configurations; a kernel an
    // override treats otherwise says so on its line.
    let base = config_names(&spec.schedule);
    let base_view: Vec<(String, Option<Vec<String>>)> =
        spec.targets.iter().map(|t| (t.to_string(), is_gpu(t).then(|| base.clone()))).collect();
    println!("kernels ({}), each with GPU configurations {} = {}:", all.len(), launch.join(" x "), base.join(" "));
    for i in &all {
        let targets = kernel_targets(i);
        if targets == base_view {
            println!("  {}", i.id);
        } else {
            let parts: Vec<String> = targets
                .iter()
                .map(|(t, c)| match c {
                    Some(c) if *c != base => format!("{t} {}", c.join(" ")),
                    _ => t.clone(),
                })
                .collect();
            println!("  {}  (built for {})", i.id, parts.join(", "));
        }
    }
    let keys = spec.key_terms(false);
    println!(
        "{} variants x {} dtypes x {} = {} tile programs; {}",
        spec.variants.len(),
        spec.dtypes.len(),
        if keys.is_empty() { "tilings".to_string() } else { format!("{} x tilings and roles", keys.join(" x ")) },
        all.len(),
        target_summary(&spec, &launch)
    );
    Outcome::Ok
}

/// GPU targets take launch configurations (warps, stages) on top of a tile program.
fn is_gpu(t: &Target) -> bool {
    matches!(t, Target::Ptx(_)) || *t == Target::Mlir("gpu".into())
}

/// What each target builds: `ir: 720 tile programs; ...; ptx:sm_90a: 1395 tile programs,
/// 1395 candidates (plans x tilings x run-time axes), 4590 with the launch configurations; ...`.
pub fn target_summary(spec: &Spec, launch: &[&str]) -> String {
    spec.targets
        .iter()
        .map(|t| {
            let (programs, choices, configs) = target_counts(spec, t, launch);
            if is_gpu(t) {
                format!("{t}: {programs} tile programs, {choices} candidates (plans x tilings x run-time axes), {configs} with the launch configurations")
            } else {
                format!("{t}: {programs} tile programs")
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}
