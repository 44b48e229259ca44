//! Mean pooling: the tile programs on the interpreter (after the pass pipeline) against
//! the f64 reference, forward and backward × dense and varlen × f32 / bf16 / f16, over
//! awkward shapes; the reference against closed forms; its errors.
//!
//! Inputs are fresh random numbers; the seed is printed (`EJC_TEST_SEED` replays).
//! Outputs start as NaN, so an element no program writes fails the comparison.

mod common;

use ejc_ir::interp::{launch, Arg};
use ejc_ir::ir::Kernel;
use ejc_ir::ops::mean_pooling::kernels::{build, param_docs, PoolKernel};
use ejc_ir::ops::mean_pooling::reference::{
    grid_symbols, random_inputs, reference_bwd, reference_fwd, PoolInputs, PoolShape,
};
use ejc_ir::passes::{default_pipeline, run_pipeline};
use ejc_ir::tensor::{compare, HostTensor};
use ejc_ir::types::DType;

/// (batch, seq, heads, head_dim, chunk, block_h): T not a multiple of C, C = 1, C > T,
/// H not a multiple of block_h (and smaller than it), H = 1, several head blocks, a
/// chunk size near i32's maximum (no `t0 + C` may overflow).
/// Varlen reads `batch` as the number of sequences: from 3 on, one is empty.
const SHAPES: &[(usize, usize, usize, usize, usize, usize)] = &[
    (2, 13, 5, 16, 4, 16),
    (2, 7, 3, 8, 1, 16),
    (3, 5, 2, 16, 8, 16),
    (1, 20, 1, 32, 6, 16),
    (4, 11, 6, 8, 3, 4),
    (5, 9, 20, 8, 4, 16),
    (2, 12, 4, 8, 4, 4),
    (3, 6, 2, 8, 2_000_000_000, 4),
];

fn tol(d: DType) -> f64 {
    match d {
        DType::F32 => 1e-5,
        DType::F16 => 5e-3,
        _ => 1e-2,
    }
}

/// The kernel after the pass pipeline.
fn kernel(k: &PoolKernel) -> Kernel {
    let name = format!(
        "mean_pooling_{}{}_{}_d{}_h{}",
        if k.backward { "bwd" } else { "fwd" },
        if k.varlen { "_varlen" } else { "" },
        k.dtype,
        k.head_dim,
        k.block_h
    );
    let built = build(&name, k).unwrap_or_else(|e| panic!("{name}: {e}"));
    run_pipeline(&built, &default_pipeline()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The token tensor's shape (x, or dx for the backward).
fn tokens(backward: bool, inputs: &PoolInputs) -> Vec<usize> {
    if backward {
        inputs.out_shape.clone()
    } else {
        inputs.input.shape.clone()
    }
}

/// Run `kernel` on the interpreter with `chunk` and `grid` (None: the kernel's own grid
/// for the call); the output tensor.
fn run(kernel: &Kernel, backward: bool, inputs: &PoolInputs, chunk: usize, grid: Option<[usize; 3]>) -> HostTensor {
    let syms = grid_symbols(&tokens(backward, inputs), inputs.cu_seqlens.as_ref(), chunk);
    let lookup = |s: &str| syms.iter().find(|(n, _)| *n == s).map(|(_, v)| *v);
    let grid = grid.unwrap_or_else(|| {
        let mut g = [0usize; 3];
        for (i, e) in kernel.grid.iter().enumerate() {
            g[i] = e.eval(&lookup).unwrap() as usize;
        }
        g
    });
    let out = HostTensor::full(inputs.input.dtype, &inputs.out_shape, f64::NAN);
    let mut args = vec![Arg::Tensor(inputs.input.clone()), Arg::Tensor(out)];
    args.extend(inputs.cu_seqlens.clone().map(Arg::Tensor));
    args.push(Arg::Scalar(chunk as f64));
    launch(kernel, &mut args, grid).unwrap_or_else(|e| panic!("{}: {e}", kernel.name));
    args[1].tensor().unwrap().clone()
}

fn reference(backward: bool, inputs: &PoolInputs, chunk: usize) -> HostTensor {
    let cu = inputs.cu_seqlens.as_ref();
    if backward {
        reference_bwd(&inputs.input, cu, chunk, &inputs.out_shape).unwrap()
    } else {
        reference_fwd(&inputs.input, cu, chunk).unwrap()
    }
}

#[test]
fn every_kernel_matches_the_reference_on_awkward_shapes() {
    let seed = common::seed();
    let mut checked = 0;
    for backward in [false, true] {
        for varlen in [false, true] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for (i, &(batch, seq, heads, head_dim, chunk, block_h)) in SHAPES.iter().enumerate() {
                    let k = kernel(&PoolKernel { backward, varlen, dtype, head_dim, block_h });
                    let shape = PoolShape { batch, seq, heads, head_dim, chunk };
                    let s = seed.wrapping_add(i as u64);
                    let inputs = random_inputs(backward, varlen, dtype, &shape, s);
                    let got = run(&k, backward, &inputs, chunk, None);
                    let want = reference(backward, &inputs, chunk);
                    let (rel, max_abs) = compare(&got.to_vec(), &want.to_vec());
                    assert!(
                        rel <= tol(dtype),
                        "{} {shape:?} seed={s} cu={:?}: rel_err={rel:e} max_abs_err={max_abs:e}",
                        k.name,
                        inputs.cu_seqlens.as_ref().map(|c| c.to_vec())
                    );
                    checked += 1;
                }
            }
        }
    }
    eprintln!("{checked} calls checked");
}

/// The comparison is not vacuous: a wrong chunk size, or a grid one chunk short (the
/// last chunk's outputs stay NaN), fails it.
#[test]
fn a_wrong_kernel_call_fails_the_comparison() {
    let seed = common::seed();
    for backward in [false, true] {
        for varlen in [false, true] {
            let k = kernel(&PoolKernel { backward, varlen, dtype: DType::F32, head_dim: 8, block_h: 4 });
            let shape = PoolShape { batch: 3, seq: 10, heads: 5, head_dim: 8, chunk: 3 };
            let inputs = random_inputs(backward, varlen, DType::F32, &shape, seed);
            let want = reference(backward, &inputs, 3).to_vec();
            let good = run(&k, backward, &inputs, 3, None);
            assert!(compare(&good.to_vec(), &want).0 <= 1e-5, "{}", k.name);
            let wrong_chunk = run(&k, backward, &inputs, 4, None);
            let rel = compare(&wrong_chunk.to_vec(), &want).0;
            assert!(rel.is_nan() || rel > 1e-5, "{}: chunk 4 passes", k.name);
            // ceil(10 / 3) = 4 chunks (dense) / the longest sequence's 4 (varlen).
            let short = run(&k, backward, &inputs, 3, Some([3, 2, 3]));
            assert!(compare(&short.to_vec(), &want).0.is_nan(), "{}: a missing chunk passes", k.name);
        }
    }
}

/// Forward and backward are each other's transpose: <pool(x), g> = <x, pool_bwd(g)>
/// (f64 inputs, so exactly up to summation order).
#[test]
fn the_backward_reference_is_the_transpose_of_the_forward() {
    let seed = common::seed();
    for varlen in [false, true] {
        let shape = PoolShape { batch: 4, seq: 17, heads: 3, head_dim: 5, chunk: 4 };
        let fwd = random_inputs(false, varlen, DType::F64, &shape, seed);
        let cu = fwd.cu_seqlens.as_ref();
        // The same seed draws the same sequence lengths: g has out's shape.
        let bwd = random_inputs(true, varlen, DType::F64, &shape, seed);
        assert_eq!((&bwd.input.shape, &bwd.cu_seqlens), (&fwd.out_shape, &fwd.cu_seqlens));
        let g = bwd.input;
        let out = reference_fwd(&fwd.input, cu, 4).unwrap();
        let dx = reference_bwd(&g, cu, 4, &fwd.input.shape).unwrap();
        let dot = |a: &HostTensor, b: &HostTensor| a.to_vec().iter().zip(b.to_vec()).map(|(x, y)| x * y).sum::<f64>();
        let (lhs, rhs) = (dot(&out, &g), dot(&fwd.input, &dx));
        assert!((lhs - rhs).abs() <= 1e-9 * lhs.abs().max(1.0), "varlen={varlen}: {lhs} vs {rhs}");
    }
}

#[test]
fn the_reference_on_a_closed_form() {
    // One head, one feature: x = 1..=5 over T = 5, C = 2 → means 1.5, 3.5, 5.
    let x = HostTensor::from_vec(DType::F32, &[1, 5, 1, 1], vec![1., 2., 3., 4., 5.]);
    assert_eq!(reference_fwd(&x, None, 2).unwrap().to_vec(), vec![1.5, 3.5, 5.0]);
    // Varlen [0, 3, 3, 5]: sequences of 3, 0 and 2 tokens → chunks (1, 2), (3), (4, 5).
    let cu = HostTensor::from_vec(DType::I32, &[4], vec![0., 3., 3., 5.]);
    assert_eq!(reference_fwd(&x, Some(&cu), 2).unwrap().to_vec(), vec![1.5, 3.0, 4.5]);
    let dout = HostTensor::from_vec(DType::F32, &[1, 3, 1, 1], vec![2., 6., 10.]);
    let dx = reference_bwd(&dout, Some(&cu), 2, &[1, 5, 1, 1]).unwrap();
    assert_eq!(dx.to_vec(), vec![1., 1., 6., 5., 5.]);
    assert_eq!(
        grid_symbols(&[1, 5, 1, 1], Some(&cu), 2),
        vec![("max_chunks", 2), ("heads", 1), ("num_seqs", 3), ("total_chunks", 3)]
    );
    assert_eq!(
        grid_symbols(&[2, 5, 3, 1], None, 2),
        vec![("num_chunks", 3), ("heads", 3), ("batch", 2), ("total_chunks", 3)]
    );
}

#[test]
fn the_reference_refuses_bad_calls() {
    let x = HostTensor::from_vec(DType::F32, &[1, 5, 1, 1], vec![1., 2., 3., 4., 5.]);
    let cu = |v: Vec<f64>| HostTensor::from_vec(DType::I32, &[v.len()], v);
    let err = |r: Result<HostTensor, String>| r.unwrap_err();
    assert!(err(reference_fwd(&x, None, 0)).contains("at least 1"));
    assert!(err(reference_fwd(&x, Some(&cu(vec![1., 5.])), 2)).contains("must be 0"));
    assert!(err(reference_fwd(&x, Some(&cu(vec![0., 4., 3., 5.])), 2)).contains("decreases"));
    assert!(err(reference_fwd(&x, Some(&cu(vec![0., 4.])), 2)).contains("5 tokens"));
    let f = HostTensor::from_vec(DType::F32, &[2], vec![0., 5.]);
    assert!(err(reference_fwd(&x, Some(&f), 2)).contains("i32"));
    let dout = HostTensor::zeros(DType::F32, &[1, 2, 1, 1]);
    assert!(err(reference_bwd(&dout, None, 2, &[1, 5, 1, 1])).contains("[1, 3, 1, 1]"));
    assert!(err(reference_bwd(&dout, None, 0, &[1, 5, 1, 1])).contains("at least 1"));
    let flat = HostTensor::zeros(DType::F32, &[5]);
    assert!(err(reference_fwd(&flat, None, 2)).contains("rank 4"));
}

#[test]
fn random_inputs_are_strided_and_varlen_batches_are_awkward() {
    let seed = common::seed();
    let shape = PoolShape { batch: 6, seq: 13, heads: 3, head_dim: 8, chunk: 4 };
    let x = random_inputs(false, true, DType::BF16, &shape, seed);
    let cu = x.cu_seqlens.as_ref().unwrap().to_vec();
    let lens: Vec<usize> = cu.windows(2).map(|w| (w[1] - w[0]) as usize).collect();
    assert_eq!(lens[0], 13, "{lens:?}");
    assert!(lens[1..].contains(&0), "{lens:?}");
    assert!(lens[1..].iter().all(|l| *l == 0 || l % 4 != 0), "{lens:?}");
    assert_eq!(x.input.shape, vec![1, lens.iter().sum::<usize>(), 3, 8]);
    assert_ne!(x.input.strides, HostTensor::contiguous_strides(&x.input.shape));
    assert!(x.input.to_vec().iter().all(|v| *v != 0.0));
    let total: usize = lens.iter().map(|l| l.div_ceil(4)).sum();
    assert_eq!(x.out_shape, vec![1, total, 3, 8]);
    let g = random_inputs(true, false, DType::F32, &shape, seed);
    assert_eq!((g.input.shape.clone(), g.out_shape.clone()), (vec![6, 4, 3, 8], vec![6, 13, 3, 8]));
}

#[test]
fn parameters_and_grid() {
    for backward in [false, true] {
        for varlen in [false, true] {
            let k =
                build("k", &PoolKernel { backward, varlen, dtype: DType::BF16, head_dim: 64, block_h: 16 }).unwrap();
            let names: Vec<&str> = k.params.iter().map(|p| p.name.as_str()).collect();
            let mut want = if backward { vec!["dout", "dx"] } else { vec!["x", "out"] };
            if varlen {
                want.push("cu_seqlens");
            }
            want.push("chunk_size");
            assert_eq!(names, want);
            for n in &names {
                assert!(param_docs().iter().any(|(p, _)| p == n), "no doc for {n}");
            }
            let grid: Vec<String> = k.grid.iter().map(|g| g.to_string()).collect();
            let want = if varlen {
                ["max_chunks", "cdiv(heads, 16)", "num_seqs"]
            } else {
                ["num_chunks", "cdiv(heads, 16)", "batch"]
            };
            assert_eq!(grid, want);
        }
    }
}

/// The tile programs after the pass pipeline, printed (a change is reviewed, never
/// accepted blindly); the text round-trips through the parser.
#[test]
fn snapshots_after_the_pipeline() {
    for (backward, varlen) in [(false, false), (false, true), (true, false), (true, true)] {
        let k = kernel(&PoolKernel { backward, varlen, dtype: DType::BF16, head_dim: 64, block_h: 16 });
        let text = ejc_ir::print::print_kernel(&k);
        assert_eq!(ejc_ir::print::print_kernel(&common::parse(&text)), text, "{}", k.name);
        snap!(k.name.replacen("mean_pooling_", "mean_pooling__", 1), text);
    }
}
