//! The reference flash-attention forward against closed forms and against itself:
//! every feature is checked by an equivalence that must hold exactly (or to rounding)
//! and by the visibility pattern it produces.
//!
//! The "weights" helper reads the attention weights P'_ij directly: with D = Sk and
//! v_j the j-th unit vector, out_i = sum_j P'_ij v_j is row i of P'.

use ejc_ir::flash::inputs::{default_runtime, random_inputs};
use ejc_ir::flash::reference::reference;
use ejc_ir::flash::{Features, SoftCap, Window};
use ejc_ir::flash::{FlashInputs, FlashOutputs, FlashRuntime, FlashShape};
use ejc_ir::philox::dropout_uniform;
use ejc_ir::tensor::{compare, HostTensor};
use ejc_ir::types::DType;

fn shape(batch: usize, seq_q: usize, seq_k: usize, heads_q: usize, heads_kv: usize, head_dim: usize) -> FlashShape {
    FlashShape::new(batch, seq_q, seq_k, heads_q, heads_kv, head_dim)
}

fn run(features: &Features, rt: &FlashRuntime, x: &FlashInputs) -> FlashOutputs {
    reference(features, rt, x).unwrap_or_else(|e| panic!("reference failed: {e}"))
}

/// Bit-for-bit equality (-inf == -inf; NaN never equal).
fn assert_identical(a: &FlashOutputs, b: &FlashOutputs) {
    assert_eq!(a.out.shape, b.out.shape);
    assert_eq!(a.lse.shape, b.lse.shape);
    assert_eq!(a.out.to_vec(), b.out.to_vec(), "out differs");
    assert_eq!(a.lse.to_vec(), b.lse.to_vec(), "lse differs");
}

/// Largest absolute difference of out and lse (infinities must match exactly).
fn max_diff(a: &FlashOutputs, b: &FlashOutputs) -> f64 {
    let (_, out) = compare(&a.out.to_vec(), &b.out.to_vec());
    let (_, lse) = compare(&a.lse.to_vec(), &b.lse.to_vec());
    out.max(lse)
}

fn tensor(dtype: DType, shape: &[usize], data: &[f64]) -> HostTensor {
    HostTensor::from_vec(dtype, shape, data.to_vec())
}

fn only_qkv(q: HostTensor, k: HostTensor, v: HostTensor) -> FlashInputs {
    FlashInputs {
        q,
        k,
        v,
        bias: None,
        mask: None,
        q_segment_ids: None,
        kv_segment_ids: None,
        cu_seqlens_q: None,
        cu_seqlens_k: None,
        sinks: None,
    }
}

fn plain_runtime(scale: f64) -> FlashRuntime {
    FlashRuntime { softmax_scale: scale, window: (0, 0), softcap: 1.0, dropout_p: 0.0, seed: 0 }
}

/// `x` with v replaced by unit vectors (D = Sk, one KV head), so `out[b, i, h, j]` is
/// the attention weight of key j for query row i.
fn with_identity_v(x: &FlashInputs) -> FlashInputs {
    let [b, sk, hkv, d] = <[usize; 4]>::try_from(x.k.shape.as_slice()).unwrap();
    assert_eq!(d, sk, "identity v needs head_dim == seq_k");
    let mut v = HostTensor::zeros(DType::F32, &[b, sk, hkv, d]);
    for bi in 0..b {
        for j in 0..sk {
            for h in 0..hkv {
                v.set(&[bi, j, h, j], 1.0);
            }
        }
    }
    FlashInputs { v, ..x.clone() }
}

// ---------------------------------------------------------------- closed forms

/// B=1, Sq=2, Sk=3, H=1, D=2 with scale 1:
/// q = [[1,0],[0,1]], k = [[1,0],[0,1],[1,1]], v = [[1,2],[3,4],[5,6]].
fn tiny() -> FlashInputs {
    only_qkv(
        tensor(DType::F32, &[1, 2, 1, 2], &[1., 0., 0., 1.]),
        tensor(DType::F32, &[1, 3, 1, 2], &[1., 0., 0., 1., 1., 1.]),
        tensor(DType::F32, &[1, 3, 1, 2], &[1., 2., 3., 4., 5., 6.]),
    )
}

fn assert_row(y: &FlashOutputs, i: usize, out: [f64; 2], lse: f64) {
    for (d, want) in out.iter().enumerate() {
        let got = y.out.get(&[0, i, 0, d]);
        assert!((got - want).abs() < 1e-12, "out[{i}][{d}] = {got}, expected {want}");
    }
    let got = y.lse.get(&[0, 0, i]);
    assert!((got - lse).abs() < 1e-12, "lse[{i}] = {got}, expected {lse}");
}

#[test]
fn hand_computed_tiny_case() {
    let e = std::f64::consts::E;
    let y = run(&Features::default(), &plain_runtime(1.0), &tiny());
    // Row 0: logits [1, 0, 1]; row 1: logits [0, 1, 1].
    let z = 2.0 * e + 1.0;
    assert_row(&y, 0, [(6.0 * e + 3.0) / z, (8.0 * e + 4.0) / z], z.ln());
    assert_row(&y, 1, [(1.0 + 8.0 * e) / z, (2.0 + 10.0 * e) / z], z.ln());
    assert_eq!(y.out.dtype, DType::F64);
    assert_eq!(y.lse.shape, vec![1, 1, 2]);

    // Scale 0.5 halves the logits: row 0 becomes [0.5, 0, 0.5].
    let y = run(&Features::default(), &plain_runtime(0.5), &tiny());
    let s = e.sqrt();
    let z = 2.0 * s + 1.0;
    assert_row(&y, 0, [(6.0 * s + 3.0) / z, (8.0 * s + 4.0) / z], z.ln());
}

#[test]
fn hand_computed_causal_is_bottom_right_aligned() {
    // Sq=2, Sk=3: query i sees keys j <= i + 1, so row 0 sees keys 0 and 1 only.
    let e = std::f64::consts::E;
    let causal = Features { causal: true, ..Features::default() };
    let y = run(&causal, &plain_runtime(1.0), &tiny());
    assert_row(&y, 0, [(e + 3.0) / (e + 1.0), (2.0 * e + 4.0) / (e + 1.0)], (e + 1.0).ln());
    let z = 2.0 * e + 1.0;
    assert_row(&y, 1, [(1.0 + 8.0 * e) / z, (2.0 + 10.0 * e) / z], z.ln());
}

#[test]
fn hand_computed_sink_joins_the_denominator_once() {
    // One sink of logit 0 adds exp(0) = 1 to Z and nothing to the numerator.
    let e = std::f64::consts::E;
    let features = Features { sinks: true, ..Features::default() };
    let x = FlashInputs { sinks: Some(tensor(DType::F32, &[1, 1], &[0.0])), ..tiny() };
    let y = run(&features, &plain_runtime(1.0), &x);
    let z = 2.0 * e + 2.0;
    assert_row(&y, 0, [(6.0 * e + 3.0) / z, (8.0 * e + 4.0) / z], z.ln());

    // Sinks are neither scaled nor soft-capped: with scale 0.5 and cap 1, row 0's
    // logits become tanh(0.5), 0, tanh(0.5) while a sink of 3 stays 3.
    let capped = Features { logits_soft_cap: Some(SoftCap::Fixed(1.0)), ..features };
    let x = FlashInputs { sinks: Some(tensor(DType::F32, &[1, 1], &[3.0])), ..x };
    let y = run(&capped, &plain_runtime(0.5), &x);
    let a = 0.5f64.tanh().exp();
    let z = 2.0 * a + 1.0 + 3f64.exp();
    assert_row(&y, 0, [(6.0 * a + 3.0) / z, (8.0 * a + 4.0) / z], z.ln());
}

#[test]
fn hand_computed_bias_and_soft_cap() {
    // Row 0 logits [1, 0, 1] + bias [0, 1, -1] = [1, 1, 0], then capped at c = 2:
    // 2 tanh(1/2) for the first two, 0 for the last.
    let features = Features { bias: true, logits_soft_cap: Some(SoftCap::Fixed(2.0)), ..Features::default() };
    let x = FlashInputs { bias: Some(tensor(DType::F32, &[1, 1, 2, 3], &[0., 1., -1., 0., 0., 0.])), ..tiny() };
    let y = run(&features, &plain_runtime(1.0), &x);
    let a = (2.0 * 0.5f64.tanh()).exp();
    let z = 2.0 * a + 1.0;
    assert_row(&y, 0, [(a * 1.0 + a * 3.0 + 5.0) / z, (a * 2.0 + a * 4.0 + 6.0) / z], z.ln());
}

#[test]
fn lse_matches_direct_logsumexp() {
    let s = shape(2, 5, 7, 4, 2, 8);
    let features = Features { bias: true, ..Features::default() };
    let x = random_inputs(&features, DType::F32, &s, 11);
    let rt = default_runtime(&features, &s, 11);
    let y = run(&features, &rt, &x);
    let scale = rt.softmax_scale as f32 as f64;
    let bias = x.bias.as_ref().unwrap();
    for b in 0..s.batch {
        for h in 0..s.heads_q {
            for i in 0..s.seq_q {
                let logits: Vec<f64> = (0..s.seq_k)
                    .map(|j| {
                        let dot: f64 =
                            (0..s.head_dim).map(|d| x.q.get(&[b, i, h, d]) * x.k.get(&[b, j, h / 2, d])).sum();
                        scale * dot + bias.get(&[b, h, i, j])
                    })
                    .collect();
                let want = logits.iter().map(|s| s.exp()).sum::<f64>().ln();
                let got = y.lse.get(&[b, h, i]);
                assert!((got - want).abs() < 1e-12, "lse[{b},{h},{i}] = {got}, expected {want}");
            }
        }
    }
}

// ---------------------------------------------------------------- equivalences

#[test]
fn huge_soft_cap_matches_no_cap() {
    let s = shape(2, 5, 7, 2, 1, 8);
    let x = random_inputs(&Features::default(), DType::F32, &s, 3);
    let rt = FlashRuntime { softcap: 1e9, ..default_runtime(&Features::default(), &s, 3) };
    let plain = run(&Features::default(), &rt, &x);
    for cap in [SoftCap::Fixed(1e9), SoftCap::Runtime] {
        let capped = Features { logits_soft_cap: Some(cap), ..Features::default() };
        let d = max_diff(&run(&capped, &rt, &x), &plain);
        assert!(d < 1e-6, "{cap:?}: max diff {d}");
    }
}

#[test]
fn soft_cap_bounds_every_logit() {
    // |s| <= c, so ln(n) - c <= lse <= ln(n) + c for a row of n visible keys.
    let s = shape(1, 6, 9, 2, 2, 16);
    let features = Features { logits_soft_cap: Some(SoftCap::Fixed(0.25)), ..Features::default() };
    let mut x = random_inputs(&features, DType::F32, &s, 5);
    // Large q makes the uncapped logits far larger than the cap.
    x.q.data.iter_mut().for_each(|q| *q *= 50.0);
    let y = run(&features, &default_runtime(&features, &s, 5), &x);
    let ln_n = (s.seq_k as f64).ln();
    for lse in y.lse.to_vec() {
        assert!((ln_n - 0.25..=ln_n + 0.25).contains(&lse), "lse {lse}");
    }
}

#[test]
fn scale_and_soft_cap_are_used_as_f32() {
    let s = shape(1, 4, 6, 2, 1, 8);
    let features = Features { logits_soft_cap: Some(SoftCap::Runtime), ..Features::default() };
    let x = random_inputs(&features, DType::F32, &s, 8);
    let exact = FlashRuntime { softmax_scale: 0.1, softcap: 0.3, ..default_runtime(&features, &s, 8) };
    let rounded = FlashRuntime { softmax_scale: 0.1f32 as f64, softcap: 0.3f32 as f64, ..exact };
    assert_identical(&run(&features, &exact, &x), &run(&features, &rounded, &x));
}

#[test]
fn window_wider_than_sequence_is_no_window() {
    let s = shape(2, 6, 9, 2, 1, 8);
    let x = random_inputs(&Features::default(), DType::F32, &s, 4);
    let rt = FlashRuntime { window: (100, 100), ..default_runtime(&Features::default(), &s, 4) };
    for causal in [false, true] {
        let base = Features { causal, ..Features::default() };
        let expected = run(&base, &rt, &x);
        for window in [Window::Runtime, Window::Fixed { left: 100, right: 100 }] {
            let windowed = Features { sliding_window: Some(window), ..base.clone() };
            assert_identical(&run(&windowed, &rt, &x), &expected);
        }
    }
}

#[test]
fn causal_equals_window_unbounded_left_zero_right() {
    for (sq, sk) in [(6, 6), (4, 9), (9, 4)] {
        let s = shape(2, sq, sk, 2, 1, 8);
        let x = random_inputs(&Features::default(), DType::F32, &s, 9);
        let rt = FlashRuntime { window: ((sq + sk) as i64, 0), ..default_runtime(&Features::default(), &s, 9) };
        let causal = Features { causal: true, ..Features::default() };
        let window = Features { sliding_window: Some(Window::Runtime), ..Features::default() };
        assert_identical(&run(&causal, &rt, &x), &run(&window, &rt, &x));
    }
}

#[test]
fn fixed_window_equals_runtime_window() {
    let s = shape(1, 7, 7, 2, 2, 8);
    let x = random_inputs(&Features::default(), DType::F32, &s, 21);
    let rt = FlashRuntime { window: (2, 1), ..default_runtime(&Features::default(), &s, 21) };
    let fixed = Features { sliding_window: Some(Window::Fixed { left: 2, right: 1 }), ..Features::default() };
    let runtime = Features { sliding_window: Some(Window::Runtime), ..Features::default() };
    assert_identical(&run(&fixed, &rt, &x), &run(&runtime, &rt, &x));
}

#[test]
fn window_is_inclusive_and_bottom_right_aligned() {
    // Sq=4, Sk=7: shift 3, so row i is centred on key i + 3.
    let s = shape(1, 4, 7, 1, 1, 7);
    let rt = FlashRuntime { window: (1, 2), ..default_runtime(&Features::default(), &s, 2) };
    for causal in [false, true] {
        let features = Features { causal, sliding_window: Some(Window::Runtime), ..Features::default() };
        let x = with_identity_v(&random_inputs(&features, DType::F32, &s, 2));
        let y = run(&features, &rt, &x);
        for i in 0..4i64 {
            let right = if causal { 0 } else { 2 };
            for j in 0..7i64 {
                let want = (i + 3 - 1..=i + 3 + right).contains(&j);
                let w = y.out.get(&[0, i as usize, 0, j as usize]);
                assert_eq!(w > 0.0, want, "causal={causal} row {i} key {j}: weight {w}");
            }
        }
    }
}

#[test]
fn gqa_equals_mha_with_repeated_kv() {
    let s = shape(2, 5, 7, 8, 2, 4);
    let features = Features {
        causal: true,
        sinks: true,
        dropout: true,
        logits_soft_cap: Some(SoftCap::Runtime),
        ..Features::default()
    };
    let x = random_inputs(&features, DType::BF16, &s, 12);
    let rt = default_runtime(&features, &s, 12);
    // Query head h reads KV head h / 4; give every query head its own copy of it.
    let repeat = |t: &HostTensor| {
        let mut r = HostTensor::zeros(t.dtype, &[2, 7, 8, 4]);
        for b in 0..2 {
            for j in 0..7 {
                for h in 0..8 {
                    for d in 0..4 {
                        r.set(&[b, j, h, d], t.get(&[b, j, h / 4, d]));
                    }
                }
            }
        }
        r
    };
    let mha = FlashInputs { k: repeat(&x.k), v: repeat(&x.v), ..x.clone() };
    assert_identical(&run(&features, &rt, &x), &run(&features, &rt, &mha));
}

#[test]
fn mask_all_true_equals_no_mask() {
    let s = shape(2, 5, 7, 2, 1, 8);
    let features = Features { mask: true, ..Features::default() };
    let x = FlashInputs {
        mask: Some(HostTensor::full(DType::I1, &[2, 2, 5, 7], 1.0)),
        ..random_inputs(&features, DType::F32, &s, 13)
    };
    let rt = default_runtime(&features, &s, 13);
    assert_identical(&run(&features, &rt, &x), &run(&Features::default(), &rt, &x));
}

#[test]
fn mask_selects_exactly_its_true_elements() {
    let s = shape(2, 5, 7, 2, 1, 7);
    let features = Features { mask: true, ..Features::default() };
    let x = with_identity_v(&random_inputs(&features, DType::F32, &s, 14));
    let y = run(&features, &default_runtime(&features, &s, 14), &x);
    let mask = x.mask.as_ref().unwrap();
    for b in 0..2 {
        for h in 0..2 {
            for i in 0..5 {
                for j in 0..7 {
                    let w = y.out.get(&[b, i, h, j]);
                    assert_eq!(w > 0.0, mask.get(&[b, h, i, j]) != 0.0, "[{b},{h},{i},{j}]");
                }
            }
        }
    }
}

#[test]
fn segment_ids_all_zero_equals_no_segments() {
    let s = shape(2, 5, 7, 2, 1, 8);
    let features = Features { segment_ids: true, ..Features::default() };
    let x = FlashInputs {
        q_segment_ids: Some(HostTensor::zeros(DType::I32, &[2, 5])),
        kv_segment_ids: Some(HostTensor::zeros(DType::I32, &[2, 7])),
        ..random_inputs(&features, DType::F32, &s, 15)
    };
    let rt = default_runtime(&features, &s, 15);
    assert_identical(&run(&features, &rt, &x), &run(&Features::default(), &rt, &x));
}

#[test]
fn segment_ids_attend_within_equal_ids_and_never_for_padding() {
    let s = shape(3, 10, 14, 1, 1, 14);
    let features = Features { segment_ids: true, ..Features::default() };
    let x = with_identity_v(&random_inputs(&features, DType::F32, &s, 16));
    let y = run(&features, &default_runtime(&features, &s, 16), &x);
    let (q_ids, kv_ids) = (x.q_segment_ids.as_ref().unwrap(), x.kv_segment_ids.as_ref().unwrap());
    for b in 0..3 {
        for i in 0..10 {
            let id = q_ids.get(&[b, i]);
            for j in 0..14 {
                let want = id != -1.0 && id == kv_ids.get(&[b, j]);
                assert_eq!(y.out.get(&[b, i, 0, j]) > 0.0, want, "[{b},{i},{j}]");
            }
            if id == -1.0 {
                assert_eq!(y.lse.get(&[b, 0, i]), f64::NEG_INFINITY);
            }
        }
    }
}

#[test]
fn varlen_equals_each_sequence_run_dense() {
    let s = shape(3, 6, 9, 4, 2, 8);
    let features = Features {
        varlen: true,
        causal: true,
        sliding_window: Some(Window::Runtime),
        logits_soft_cap: Some(SoftCap::Runtime),
        sinks: true,
        dropout: true,
        ..Features::default()
    };
    let dense_features = Features { varlen: false, ..features.clone() };
    let x = random_inputs(&features, DType::BF16, &s, 17);
    let rt = default_runtime(&features, &s, 17);
    let y = run(&features, &rt, &x);
    let cu = |t: &Option<HostTensor>, b: usize| t.as_ref().unwrap().get(&[b]) as usize;

    for b in 0..s.batch {
        let (q0, q1) = (cu(&x.cu_seqlens_q, b), cu(&x.cu_seqlens_q, b + 1));
        let (k0, k1) = (cu(&x.cu_seqlens_k, b), cu(&x.cu_seqlens_k, b + 1));
        // Dropout is keyed by the sequence index, so place the sequence at batch entry b
        // of a dense batch (every entry a copy of it).
        let slice = |t: &HostTensor, start: usize, len: usize| {
            let heads = t.shape[2];
            let mut r = HostTensor::zeros(t.dtype, &[b + 1, len, heads, s.head_dim]);
            for bb in 0..=b {
                for row in 0..len {
                    for h in 0..heads {
                        for d in 0..s.head_dim {
                            r.set(&[bb, row, h, d], t.get(&[0, start + row, h, d]));
                        }
                    }
                }
            }
            r
        };
        let dense = FlashInputs {
            q: slice(&x.q, q0, q1 - q0),
            k: slice(&x.k, k0, k1 - k0),
            v: slice(&x.v, k0, k1 - k0),
            cu_seqlens_q: None,
            cu_seqlens_k: None,
            ..x.clone()
        };
        let yd = run(&dense_features, &rt, &dense);
        for h in 0..s.heads_q {
            for i in 0..q1 - q0 {
                for d in 0..s.head_dim {
                    assert_eq!(y.out.get(&[0, q0 + i, h, d]), yd.out.get(&[b, i, h, d]));
                }
                assert_eq!(y.lse.get(&[0, h, q0 + i]), yd.lse.get(&[b, h, i]));
            }
        }
    }
}

#[test]
fn dropout_zero_equals_no_dropout() {
    let s = shape(2, 5, 7, 2, 1, 8);
    let features = Features { dropout: true, causal: true, ..Features::default() };
    let x = random_inputs(&features, DType::F32, &s, 18);
    let rt = FlashRuntime { dropout_p: 0.0, ..default_runtime(&features, &s, 18) };
    let no_dropout = Features { dropout: false, ..features.clone() };
    assert_identical(&run(&features, &rt, &x), &run(&no_dropout, &rt, &x));
}

#[test]
fn dropout_mask_is_philox_and_kept_weights_are_rescaled() {
    // q = 0 makes every weight 1/Sk; with identity v each out element is then either
    // 0 (dropped) or 1 / (Sk (1 - p)) (kept), with p rounded to f32 first.
    // Two query heads share one KV head: dropout is keyed by the query head.
    let s = shape(2, 16, 16, 2, 1, 16);
    let features = Features { dropout: true, ..Features::default() };
    let mut x = with_identity_v(&random_inputs(&features, DType::F32, &s, 19));
    x.q = HostTensor::zeros(DType::F32, &x.q.shape);
    let rt = FlashRuntime { dropout_p: 0.3, ..default_runtime(&features, &s, 19) };
    let y = run(&features, &rt, &x);
    let p = 0.3f32 as f64;
    let kept_weight = (1.0 / 16.0) * (1.0 / (1.0 - p));
    for b in 0..2 {
        for h in 0..2 {
            for i in 0..16 {
                for j in 0..16 {
                    let keep = dropout_uniform(rt.seed, b as u32, h as u32, i as u32, j as u32) >= p;
                    let want = if keep { kept_weight } else { 0.0 };
                    let got = y.out.get(&[b, i, h, j]);
                    assert!((got - want).abs() < 1e-15, "[{b},{h},{i},{j}] {got} vs {want}");
                }
                // LSE ignores dropout: ln(16 * e^0).
                assert!((y.lse.get(&[b, h, i]) - 16f64.ln()).abs() < 1e-15);
            }
        }
    }
}

#[test]
fn dropout_keeps_about_one_minus_p() {
    // q = 0, v = 1: out_i = (kept keys of row i) / (Sk (1 - p)).
    let s = shape(2, 64, 64, 2, 2, 1);
    let features = Features { dropout: true, ..Features::default() };
    let x = random_inputs(&features, DType::F32, &s, 20);
    let x = FlashInputs {
        q: HostTensor::zeros(DType::F32, &x.q.shape),
        v: HostTensor::full(DType::F32, &x.v.shape, 1.0),
        ..x
    };
    for p in [0.2, 0.5] {
        let rt = FlashRuntime { dropout_p: p, ..default_runtime(&features, &s, 20) };
        let out = run(&features, &rt, &x).out.to_vec();
        let kept = out.iter().map(|o| o * (1.0 - (p as f32 as f64))).sum::<f64>() / out.len() as f64;
        // 16384 Bernoulli draws: standard error <= 0.004.
        assert!((kept - (1.0 - p)).abs() < 0.02, "p={p}: kept fraction {kept}");
    }
}

#[test]
fn shared_sinks_equal_per_head_copies() {
    let s = shape(2, 5, 7, 4, 2, 8);
    let features = Features { sinks: true, causal: true, ..Features::default() };
    let x = random_inputs(&features, DType::F32, &s, 22);
    let rt = default_runtime(&features, &s, 22);
    let row = tensor(DType::F32, &[1, 3], &[0.5, -1.0, 2.0]);
    let shared = HostTensor::view(&row, &[4, 3], &[0, 1], 0);
    let copies = tensor(DType::F32, &[4, 3], &[0.5, -1.0, 2.0].repeat(4));
    let with = |sinks: HostTensor| FlashInputs { sinks: Some(sinks), ..x.clone() };
    let y = run(&features, &rt, &with(shared));
    assert_identical(&y, &run(&features, &rt, &with(copies)));
    // And the sinks matter: they only ever raise the LSE.
    let plain = run(&Features { sinks: false, ..features.clone() }, &rt, &x);
    for (a, b) in y.lse.to_vec().iter().zip(plain.lse.to_vec()) {
        assert!(*a > b);
    }
}

// ---------------------------------------------------------------- empty rows

#[test]
fn fully_masked_rows_give_zero_and_neg_inf() {
    // Causal with Sq=6 > Sk=3: row i sees j <= i - 3, so rows 0..3 see nothing.
    let s = shape(1, 6, 3, 2, 1, 4);
    let causal = Features { causal: true, ..Features::default() };
    let x = random_inputs(&causal, DType::F32, &s, 23);
    let rt = default_runtime(&causal, &s, 23);
    let y = run(&causal, &rt, &x);
    for h in 0..2 {
        for i in 0..6 {
            let lse = y.lse.get(&[0, h, i]);
            if i < 3 {
                assert_eq!(lse, f64::NEG_INFINITY);
                assert!((0..4).all(|d| y.out.get(&[0, i, h, d]) == 0.0));
            } else {
                assert!(lse.is_finite());
            }
        }
    }

    // With sinks an empty row still outputs 0, and its LSE is that of the sinks alone.
    let with_sinks = Features { sinks: true, ..causal.clone() };
    let x = random_inputs(&with_sinks, DType::F32, &s, 23);
    let y = run(&with_sinks, &rt, &x);
    let sinks = x.sinks.as_ref().unwrap();
    for h in 0..2 {
        let want = (0..3).map(|t| sinks.get(&[h, t]).exp()).sum::<f64>().ln();
        for i in 0..3 {
            assert!((y.lse.get(&[0, h, i]) - want).abs() < 1e-12);
            assert!((0..4).all(|d| y.out.get(&[0, i, h, d]) == 0.0));
        }
    }
}

#[test]
fn generated_mask_has_an_empty_row_that_yields_neg_inf() {
    let s = shape(2, 8, 8, 3, 1, 4);
    let features = Features { mask: true, ..Features::default() };
    let x = random_inputs(&features, DType::F16, &s, 24);
    let y = run(&features, &default_runtime(&features, &s, 24), &x);
    let empty_rows: Vec<usize> =
        (0..8).filter(|&i| (0..3).all(|h| y.lse.get(&[0, h, i]) == f64::NEG_INFINITY)).collect();
    assert!(!empty_rows.is_empty(), "no fully masked row in batch 0");
    assert!(y.out.to_vec().iter().all(|o| o.is_finite()));
}

#[test]
fn every_feature_combination_is_nan_free() {
    const FLAGS: usize = 8;
    for bits in 0u32..(1 << FLAGS) {
        let on = |n: u32| bits & (1 << n) != 0;
        // Alternate fixed and run-time forms of window and soft cap between combinations.
        let features = Features {
            causal: on(0),
            sliding_window: on(1).then_some(if bits % 2 == 0 {
                Window::Runtime
            } else {
                Window::Fixed { left: 2, right: 0 }
            }),
            logits_soft_cap: on(2).then_some(if bits % 3 == 0 { SoftCap::Runtime } else { SoftCap::Fixed(3.0) }),
            sinks: on(3),
            dropout: on(4),
            bias: on(5),
            mask: on(6),
            segment_ids: on(7),
            varlen: false,
            bias_grad: false,
        };
        let varlen = Features { varlen: true, bias: false, mask: false, segment_ids: false, ..features.clone() };
        for (f, s) in [
            (&features, shape(2, 5, 7, 4, 2, 8)),
            (&features, shape(1, 9, 4, 2, 2, 8)),
            (&varlen, shape(3, 6, 5, 4, 1, 8)),
        ] {
            let seed = u64::from(bits);
            let x = random_inputs(f, DType::BF16, &s, seed);
            let y = reference(f, &default_runtime(f, &s, seed), &x).unwrap_or_else(|e| panic!("{f:?} at {s}: {e}"));
            assert!(y.out.to_vec().iter().all(|o| o.is_finite()), "{f:?} at {s}: out");
            assert!(y.lse.to_vec().iter().all(|l| !l.is_nan() && *l != f64::INFINITY), "{f:?} at {s}: lse");
        }
    }
}

// ---------------------------------------------------------------- random inputs

#[test]
fn random_inputs_exercise_strides_broadcasts_and_padding() {
    let s = shape(2, 20, 30, 4, 2, 8);
    let all = Features { bias: true, mask: true, segment_ids: true, sinks: true, ..Features::default() };
    let x = random_inputs(&all, DType::BF16, &s, 25);
    assert_eq!(x.q.strides, HostTensor::contiguous_strides(&[2, 20, 4, 8]));
    assert_eq!(x.k.shape, vec![2, 30, 2, 8]);
    assert_eq!(x.k.strides, vec![2 * 30 * 8, 8, 30 * 8, 1]);
    assert_eq!(x.v.strides, x.k.strides);
    let bias = x.bias.as_ref().unwrap();
    assert_eq!((bias.shape.clone(), bias.strides[0]), (vec![2, 4, 20, 30], 0));
    let mask = x.mask.as_ref().unwrap();
    assert_eq!((mask.dtype, mask.shape.clone(), mask.strides[1]), (DType::I1, vec![2, 4, 20, 30], 0));
    assert_eq!(x.sinks.as_ref().unwrap().shape, vec![4, 3]);
    for t in [&x.q, &x.k, &x.v, bias] {
        assert!(t.to_vec().iter().all(|&v| v != 0.0 && v == DType::BF16.round(v)));
    }
    // Segment ids: 2-3 segments in order, then a padding tail of ~10%.
    for (ids, len) in [(x.q_segment_ids.as_ref().unwrap(), 20), (x.kv_segment_ids.as_ref().unwrap(), 30)] {
        for b in 0..2 {
            let row: Vec<f64> = (0..len).map(|i| ids.get(&[b, i])).collect();
            let pad = (len as f64 * 0.1).round() as usize;
            assert!(row[len - pad..].iter().all(|&id| id == -1.0), "{row:?}");
            assert!(row[..len - pad].windows(2).all(|w| w[0] <= w[1] && w[0] >= 0.0), "{row:?}");
            assert!(row[len - pad - 1] >= 1.0, "fewer than two segments: {row:?}");
        }
    }
    // Deterministic in the seed.
    let again = random_inputs(&all, DType::BF16, &s, 25);
    assert_eq!(again.k.to_vec(), x.k.to_vec());
    assert_ne!(random_inputs(&all, DType::BF16, &s, 26).k.to_vec(), x.k.to_vec());
}

#[test]
fn random_varlen_inputs_pack_uneven_sequences() {
    let s = shape(5, 12, 20, 2, 1, 8);
    let features = Features { varlen: true, ..Features::default() };
    let x = random_inputs(&features, DType::F16, &s, 27);
    let cu_q = x.cu_seqlens_q.as_ref().unwrap().to_vec();
    let cu_k = x.cu_seqlens_k.as_ref().unwrap().to_vec();
    assert_eq!((cu_q.len(), cu_q[0], cu_q[1], cu_k[1]), (6, 0.0, 12.0, 20.0));
    for (cu, max) in [(&cu_q, 12.0), (&cu_k, 20.0)] {
        assert!(cu.windows(2).all(|w| (1.0..=max).contains(&(w[1] - w[0]))), "{cu:?}");
    }
    assert_eq!(x.q.shape, vec![1, cu_q[5] as usize, 2, 8]);
    assert_eq!(x.k.shape, vec![1, cu_k[5] as usize, 1, 8]);
    let y = run(&features, &default_runtime(&features, &s, 27), &x);
    assert_eq!(y.lse.shape, vec![1, 2, cu_q[5] as usize]);
}

#[test]
fn default_runtime_values() {
    let s = shape(1, 8, 30, 2, 1, 64);
    let rt = default_runtime(&Features::default(), &s, 1);
    assert_eq!(rt.softmax_scale, 0.125);
    assert_eq!((rt.window, rt.softcap, rt.dropout_p), ((10, 6), 5.0, 0.2));
    assert_ne!(rt.seed, 1);
    assert_eq!(default_runtime(&Features::default(), &shape(1, 1, 2, 1, 1, 4), 1).window, (1, 1));
    let fixed = Features {
        sliding_window: Some(Window::Fixed { left: 3, right: 0 }),
        logits_soft_cap: Some(SoftCap::Fixed(30.0)),
        ..Features::default()
    };
    let rt = default_runtime(&fixed, &s, 1);
    assert_eq!((rt.window, rt.softcap), ((3, 0), 30.0));
}

// ---------------------------------------------------------------- errors

fn expect_err(features: &Features, rt: &FlashRuntime, x: &FlashInputs, needle: &str) {
    match reference(features, rt, x) {
        Ok(_) => panic!("expected an error mentioning `{needle}`"),
        Err(e) => assert!(e.contains(needle), "error `{e}` does not mention `{needle}`"),
    }
}

#[test]
fn inconsistent_shapes_are_errors() {
    let f = Features::default();
    let rt = plain_runtime(1.0);
    let x = random_inputs(&f, DType::F32, &shape(1, 4, 5, 3, 3, 8), 30);
    // 3 query heads over 2 KV heads.
    let two_kv = random_inputs(&f, DType::F32, &shape(1, 4, 5, 2, 2, 8), 30);
    expect_err(&f, &rt, &FlashInputs { k: two_kv.k.clone(), v: two_kv.v.clone(), ..x.clone() }, "multiple of heads_kv");
    expect_err(&f, &rt, &FlashInputs { v: two_kv.v, ..x.clone() }, "v has shape");
    expect_err(&f, &rt, &FlashInputs { q: HostTensor::zeros(DType::F32, &[4, 3, 8]), ..x.clone() }, "rank 4");
    expect_err(&f, &rt, &FlashInputs { q: HostTensor::zeros(DType::F32, &[1, 4, 3, 6]), ..x.clone() }, "head_dim");
    expect_err(&f, &rt, &FlashInputs { q: HostTensor::zeros(DType::F32, &[2, 4, 3, 8]), ..x.clone() }, "batch");
    let mut escaped = x.clone();
    escaped.k.offset = 1_000_000;
    expect_err(&f, &rt, &escaped, "outside");
}

#[test]
fn missing_or_misshapen_feature_tensors_are_errors() {
    let rt = plain_runtime(1.0);
    let s = shape(1, 4, 5, 2, 1, 8);
    for (features, needle) in [
        (Features { bias: true, ..Features::default() }, "`bias` tensor"),
        (Features { mask: true, ..Features::default() }, "`mask` tensor"),
        (Features { segment_ids: true, ..Features::default() }, "q_segment_ids"),
        (Features { sinks: true, ..Features::default() }, "`sinks` tensor"),
        (Features { varlen: true, ..Features::default() }, "cu_seqlens_q"),
    ] {
        let x = random_inputs(&Features::default(), DType::F32, &s, 31);
        expect_err(&features, &rt, &x, needle);
    }
    let bias = Features { bias: true, ..Features::default() };
    let x = FlashInputs {
        bias: Some(HostTensor::zeros(DType::F32, &[1, 1, 4, 5])),
        ..random_inputs(&bias, DType::F32, &s, 31)
    };
    expect_err(&bias, &rt, &x, "bias has shape");
    let sinks = Features { sinks: true, ..Features::default() };
    let x =
        FlashInputs { sinks: Some(HostTensor::zeros(DType::F32, &[3])), ..random_inputs(&sinks, DType::F32, &s, 31) };
    expect_err(&sinks, &rt, &x, "sinks has shape");
    let varlen_bias = Features { varlen: true, bias: true, ..Features::default() };
    let x = random_inputs(&varlen_bias, DType::F32, &s, 31);
    expect_err(&varlen_bias, &rt, &x, "varlen cannot be combined");
}

#[test]
fn bad_cu_seqlens_are_errors() {
    let features = Features { varlen: true, ..Features::default() };
    let rt = plain_runtime(1.0);
    let x = random_inputs(&features, DType::F32, &shape(2, 4, 4, 1, 1, 8), 32);
    let total_q = x.q.shape[1] as f64;
    let cu = |v: &[f64]| Some(tensor(DType::I32, &[v.len()], v));
    for (bad, needle) in [
        (vec![1.0, 2.0, total_q], "start at 0"),
        (vec![0.0, 3.0, 2.0], "non-decreasing"),
        (vec![0.0, 2.0, total_q + 1.0], "packed length"),
        (vec![0.0, total_q], "entries"),
        (vec![], "[B + 1]"),
    ] {
        let y = FlashInputs { cu_seqlens_q: cu(&bad), ..x.clone() };
        expect_err(&features, &rt, &y, needle);
    }
    let fractional = FlashInputs { cu_seqlens_q: Some(tensor(DType::F32, &[3], &[0.0, 1.5, 2.0])), ..x.clone() };
    expect_err(&features, &rt, &fractional, "not an integer");
}

#[test]
fn bad_runtime_scalars_are_errors() {
    let s = shape(1, 4, 5, 2, 1, 8);
    let x = random_inputs(&Features::default(), DType::F32, &s, 33);
    let rt = default_runtime(&Features::default(), &s, 33);
    let dropout = Features { dropout: true, ..Features::default() };
    for p in [1.0, -0.1, 0.999_999_999, f64::NAN] {
        expect_err(&dropout, &FlashRuntime { dropout_p: p, ..rt }, &x, "dropout_p");
    }
    let window = Features { sliding_window: Some(Window::Runtime), ..Features::default() };
    // A negative side moves the band past the diagonal (ring attention's blocks):
    // (-1, 0) leaves no key in the band, so every row sees nothing.
    for w in [(-1, 0), (0, -3)] {
        let y = reference(&window, &FlashRuntime { window: w, ..rt }, &x).unwrap();
        assert!(y.out.to_vec().iter().all(|v| *v == 0.0), "{w:?}: a band with no key gives 0");
        assert!(y.lse.to_vec().iter().all(|v| *v == f64::NEG_INFINITY), "{w:?}: and LSE -inf");
    }
    // A window as wide as i64 allows is legal and means "no window".
    let huge = FlashRuntime { window: (i64::MAX, i64::MAX), ..rt };
    assert_identical(&run(&window, &huge, &x), &run(&Features::default(), &huge, &x));
    let runtime_cap = Features { logits_soft_cap: Some(SoftCap::Runtime), ..Features::default() };
    for c in [0.0, -1.0, f64::INFINITY, f64::NAN, 1e-50, 1e39] {
        expect_err(&runtime_cap, &FlashRuntime { softcap: c, ..rt }, &x, "soft cap");
    }
    let fixed_cap = Features { logits_soft_cap: Some(SoftCap::Fixed(0.0)), ..Features::default() };
    expect_err(&fixed_cap, &rt, &x, "soft cap");
    expect_err(&Features::default(), &FlashRuntime { softmax_scale: f64::NAN, ..rt }, &x, "softmax_scale");
}

#[test]
fn value_head_dim_of_its_own_gives_the_first_columns() {
    // A value head dim apart from q/k's (192/128 in DeepSeek-V3) changes nothing but the
    // output's width: with v narrowed to its first Dv columns, out is the full call's
    // first Dv columns and lse is the same, bit for bit, on every feature at once that
    // the reference allows with it (dropout, sinks, window, soft cap, segments).
    let f = Features {
        causal: true,
        sliding_window: Some(Window::Runtime),
        logits_soft_cap: Some(SoftCap::Runtime),
        sinks: true,
        segment_ids: true,
        dropout: true,
        bias: true,
        ..Features::default()
    };
    for (d, dv, narrow) in [(24, 40, 16), (40, 24, 8)] {
        let s = shape(2, 13, 17, 4, 2, d).with_head_dim_v(dv);
        let x = random_inputs(&f, DType::F32, &s, 11);
        assert_eq!(x.v.shape, [2, 17, 2, dv]);
        let rt = default_runtime(&f, &s, 11);
        let wide = run(&f, &rt, &x);
        assert_eq!(wide.out.shape, [2, 13, 4, dv]);
        let v = &x.v;
        let narrowed = HostTensor::view(v, &[v.shape[0], v.shape[1], v.shape[2], narrow], &v.strides, 0);
        let y = run(&f, &rt, &FlashInputs { v: narrowed, ..x.clone() });
        assert_eq!(y.out.shape, [2, 13, 4, narrow]);
        assert_eq!(y.lse.to_vec(), wide.lse.to_vec());
        let first: Vec<f64> = wide.out.to_vec().chunks(dv).flat_map(|r| r[..narrow].to_vec()).collect();
        assert_eq!(y.out.to_vec(), first);
    }
    // k and v must agree but for the head dim.
    let s = shape(1, 3, 5, 2, 1, 16);
    let x = random_inputs(&Features::default(), DType::F32, &s, 1);
    let v = HostTensor::view(&x.v, &[1, 4, 1, 16], &x.v.strides, 0);
    let e = reference(&Features::default(), &default_runtime(&Features::default(), &s, 1), &FlashInputs { v, ..x })
        .unwrap_err();
    assert!(e.contains("must match but for the head dim"), "{e}");
}
