//! The back ends' generality cases: kernels that belong to no operation
//! (`tests/kernels/*.tir`), each with awkward shapes, checked against the interpreter
//! (`ejc_ir::kernel_case`). The CPU and MLIR tests run them; `tests/ptx.rs` compiles them
//! for every PTX code path and, with `EJC_KERNEL_PACK=DIR`, packs them for
//! `ejc-gpu check-kernels DIR` (scripts/gpu_prepare.sh --kernels).

use std::collections::BTreeMap;

use ejc_ir::interp::Arg;
use ejc_ir::ir::Kernel;
use ejc_ir::kernel_case::KernelCase;
use ejc_ir::types::Type;
use ejc_runtime::cpu::{scalar_slot, HostBuffer};

fn case(
    name: &str,
    text: &str,
    shapes: &[(&str, &[usize])],
    scalars: &[(&str, f64)],
    sizes: &[(&str, i64)],
    outputs: &[&str],
) -> KernelCase {
    KernelCase {
        name: name.into(),
        kernel: text.into(),
        shapes: shapes.iter().map(|(n, s)| (n.to_string(), s.to_vec())).collect(),
        scalars: scalars.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
        sizes: sizes.iter().map(|(n, v)| (n.to_string(), *v)).collect::<BTreeMap<_, _>>(),
        outputs: outputs.iter().map(|s| s.to_string()).collect(),
    }
}

/// Every case: each kernel at a shape whose strides leave its tiles unaligned (the
/// general entry only) and at one where every tensor is aligned (both entries), no
/// size a multiple of the blocks.
pub fn suite() -> Vec<KernelCase> {
    let tn = include_str!("../kernels/tn_gemm.tir");
    let dkdv = include_str!("../kernels/dkdv.tir");
    let dq = include_str!("../kernels/dq.tir");
    // softmax scale 1/sqrt(64), times log2 e (the exp2 domain).
    let scale = 0.125 * std::f64::consts::LOG2_E;
    let red = include_str!("../kernels/col_reduce.tir");
    let few = include_str!("../kernels/few_rows.tir");
    let f32g = include_str!("../kernels/f32_gemm.tir");
    let paged_text = include_str!("../kernels/paged.tir");
    // Pages hold 64 keys; the table's entries are random in [0, 8) (kernel_case's integer
    // tensors), so 8 pages.
    let paged = |rows: usize, context: usize| {
        let blocks = context.div_ceil(64);
        let shapes: [(&str, &[usize]); 5] = [
            ("q", &[rows, 64]),
            ("k_cache", &[8, 64, 64]),
            ("v_cache", &[8, 64, 64]),
            ("table", &[blocks]),
            ("out", &[rows, 64]),
        ];
        let scalars = [("context", context as f64), ("scale", scale)];
        case(&format!("paged_r{rows}_ctx{context}"), paged_text, &shapes, &scalars, &[("rows", rows as i64)], &["out"])
    };
    // Flash attention in f32 (causal, GQA 2:1), as the spec builds it: its products on
    // the CUDA cores, the softmax and masks around them.
    let spec = super::spec();
    let flash = super::kernel(&spec, spec.variant("causal").unwrap(), ejc_ir::types::DType::F32, 64, 64, 64);
    // The same after `scale-fold`: `softmax.update` with its scale operand, on every
    // back end (the PTX target's aligned entries run it on 16-bit kernels).
    let mut folded = ejc_ir::passes::run_pipeline(&flash, &ejc_ir::passes::default_pipeline()).unwrap();
    assert_eq!(ejc_ir::passes::scale_fold(&mut folded).positive, ["softmax_scale"]);
    let flash = ejc_ir::print::print_kernel(&flash);
    let folded = ejc_ir::print::print_kernel(&folded);
    let (b, sq, sk, hq, hk) = (2, 77, 93, 2, 1);
    let flash_shapes: [(&str, &[usize]); 5] = [
        ("q", &[b, sq, hq, 64]),
        ("k", &[b, sk, hk, 64]),
        ("v", &[b, sk, hk, 64]),
        ("out", &[b, sq, hq, 64]),
        ("lse", &[b, hq, sq]),
    ];
    let flash_sizes = [("seq_q", sq as i64), ("heads_q", hq as i64), ("batch", b as i64)];
    let flash_case = case(
        "flash_causal_f32_q77_k93",
        &flash,
        &flash_shapes,
        &[("softmax_scale", 0.125)],
        &flash_sizes,
        &["out", "lse"],
    );
    let folded_case = case(
        "flash_causal_f32_folded_q77_k93",
        &folded,
        &flash_shapes,
        &[("softmax_scale", 0.125)],
        &flash_sizes,
        &["out", "lse"],
    );
    // The soft cap in f32 (a run-time cap of 1.5, so that |s / c| crosses the tanh's
    // two ranges): the precise tanh of the PTX back end (its 16-bit kernels take
    // `tanh.approx`).
    let softcap = super::kernel(&spec, spec.variant("softcap").unwrap(), ejc_ir::types::DType::F32, 64, 64, 64);
    let softcap = ejc_ir::print::print_kernel(&softcap);
    let (sq, sk) = (70, 45);
    let softcap_case = case(
        "flash_softcap_f32_q70_k45",
        &softcap,
        &[
            ("q", &[1, sq, 2, 64]),
            ("k", &[1, sk, 2, 64]),
            ("v", &[1, sk, 2, 64]),
            ("out", &[1, sq, 2, 64]),
            ("lse", &[1, 2, sq]),
        ],
        &[("softmax_scale", 0.125), ("logits_soft_cap", 1.5)],
        &[("seq_q", sq as i64), ("heads_q", 2), ("batch", 1)],
        &["out", "lse"],
    );
    let f32_gemm = |m: usize, n: usize, k: usize| {
        let shapes: [(&str, &[usize]); 6] =
            [("a", &[m, k]), ("b", &[k, n]), ("at", &[k, m]), ("bt", &[n, k]), ("c", &[m, n]), ("d", &[m, n])];
        let sizes = [("m", m as i64), ("n", n as i64)];
        case(&format!("f32_gemm_m{m}_n{n}_k{k}"), f32g, &shapes, &[], &sizes, &["c", "d"])
    };
    let few_rows = |rows: usize, sk: usize| {
        let g = rows.div_ceil(16);
        let shapes: [(&str, &[usize]); 7] = [
            ("q", &[rows, 64]),
            ("k", &[sk, 64]),
            ("v", &[sk, 64]),
            ("out", &[rows, 64]),
            ("lse", &[rows]),
            ("mass", &[g, 64]),
            ("top", &[g]),
        ];
        let name = format!("few_rows_r{rows}_k{sk}");
        case(&name, few, &shapes, &[("scale", scale)], &[("rows", rows as i64)], &["out", "lse", "mass", "top"])
    };
    let attn = |name: &str, text: &str, sq: usize, sk: usize, out: &[&str]| {
        let d = 64;
        let mut shapes: Vec<(&str, Vec<usize>)> = vec![
            ("q", vec![sq, d]),
            ("k", vec![sk, d]),
            ("v", vec![sk, d]),
            ("do", vec![sq, d]),
            ("lse", vec![sq]),
            ("delta", vec![sq]),
        ];
        for o in out {
            shapes.push((o, vec![if *o == "dq" { sq } else { sk }, d]));
        }
        let shapes: Vec<(&str, &[usize])> = shapes.iter().map(|(n, s)| (*n, s.as_slice())).collect();
        let sizes = [("seq_q", sq as i64), ("seq_k", sk as i64)];
        case(&format!("{name}_q{sq}_k{sk}"), text, &shapes, &[("scale", scale)], &sizes, out)
    };
    vec![
        case(
            "tn_gemm_k77_m100_n130",
            tn,
            &[("a", &[77, 100]), ("b", &[77, 130]), ("c", &[100, 130])],
            &[],
            &[("m", 100), ("n", 130)],
            &["c"],
        ),
        case(
            "tn_gemm_k72_m136_n200",
            tn,
            &[("a", &[72, 136]), ("b", &[72, 200]), ("c", &[136, 200])],
            &[],
            &[("m", 136), ("n", 200)],
            &["c"],
        ),
        attn("dkdv", dkdv, 157, 131, &["dk", "dv"]),
        attn("dkdv", dkdv, 40, 200, &["dk", "dv"]),
        attn("dq", dq, 157, 131, &["dq"]),
        attn("dq", dq, 200, 40, &["dq"]),
        f32_gemm(100, 70, 45),
        f32_gemm(64, 128, 96),
        paged(100, 300),
        paged(64, 64),
        flash_case,
        folded_case,
        softcap_case,
        few_rows(40, 150),
        few_rows(16, 64),
        case(
            "col_reduce_r150_n100",
            red,
            &[("x", &[150, 100]), ("sum", &[100]), ("max", &[100]), ("min", &[100]), ("stats", &[2, 2])],
            &[],
            &[("n", 100)],
            &["sum", "max", "min", "stats"],
        ),
        case(
            "col_reduce_r64_n136",
            red,
            &[("x", &[64, 136]), ("sum", &[136]), ("max", &[136]), ("min", &[136]), ("stats", &[3, 2])],
            &[],
            &[("n", 136)],
            &["sum", "max", "min", "stats"],
        ),
    ]
}

/// The kernel of a case after the pass pipeline every build runs.
pub fn pipelined(c: &KernelCase) -> Kernel {
    let k = c.parse().unwrap_or_else(|e| panic!("{e}"));
    ejc_ir::passes::run_pipeline(&k, &ejc_ir::passes::default_pipeline()).unwrap_or_else(|e| panic!("{}: {e}", c.name))
}

/// Run a host kernel (`launch(tensors, scalar slots, grid)`) on `args`; the arguments after.
pub fn run_host(
    k: &Kernel,
    args: &[Arg],
    grid: [i64; 3],
    launch: impl FnOnce(&[ejc_ir::cpu_abi::EjcTensor], &[u64], [i64; 3]) -> Result<(), String>,
) -> Result<Vec<Arg>, String> {
    let mut bufs: Vec<HostBuffer> = args.iter().filter_map(Arg::tensor).map(HostBuffer::from_host).collect();
    let tensors: Vec<_> = bufs.iter_mut().map(|b| b.abi()).collect();
    let scalars: Vec<u64> = k
        .params
        .iter()
        .zip(args)
        .filter_map(|(p, a)| match (&p.ty, a) {
            (Type::Scalar(d), Arg::Scalar(x)) => Some(scalar_slot(*d, *x)),
            _ => None,
        })
        .collect();
    launch(&tensors, &scalars, grid)?;
    let mut it = bufs.iter();
    Ok(args
        .iter()
        .map(|a| match a {
            Arg::Tensor(_) => Arg::Tensor(it.next().expect("one buffer per tensor").to_host()),
            s => s.clone(),
        })
        .collect())
}

/// Check every output of `got` against the interpreter's `want`; panics with the figures.
pub fn assert_matches(c: &KernelCase, k: &Kernel, got: &[Arg], want: &[Arg], label: &str) {
    for r in c.compare(k, got, want).unwrap_or_else(|e| panic!("{e}")) {
        assert!(
            r.passed(),
            "{label}: {} `{}`: rel_err={:e} max_abs_err={:e} (tolerance {:e})",
            c.name,
            r.output,
            r.rel_err,
            r.max_abs_err,
            r.tolerance
        );
    }
}
