//! What the demo's tests share: seeds, random inputs, tolerances and plain-Rust
//! references (f64).

#![allow(dead_code)] // each test file uses its part

use ejc_ir::tensor::{compare, HostTensor};
use ejc_ir::types::DType;
use rand::rngs::StdRng;
use rand::Rng;

pub fn seed() -> u64 {
    let s = std::env::var("EJC_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    println!("seed = {s} (EJC_TEST_SEED={s} replays)");
    s
}

pub fn random(rng: &mut StdRng, shape: &[usize]) -> HostTensor {
    let n = shape.iter().product();
    HostTensor::from_vec(DType::F32, shape, (0..n).map(|_| rng.random_range(-1.0f32..1.0) as f64).collect())
}

pub fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert!(got.iter().all(|x| x.is_finite()), "{what}: non-finite output");
    let (rel, max_abs) = compare(got, want);
    assert!(rel <= 1e-5, "{what}: rel_err={rel:e} max_abs_err={max_abs:e}");
}

/// Plain Rust: alpha · a·b, then relu. `b` is read through `get`, so views work.
pub fn matmul_ref(a: &HostTensor, b: &HostTensor, alpha: f64, relu: bool) -> Vec<f64> {
    let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|p| a.get(&[i, p]) * b.get(&[p, j])).sum();
            let x = alpha * dot;
            out[i * n + j] = if relu { x.max(0.0) } else { x };
        }
    }
    out
}

/// 16-bit numbers of `dtype` (rounded to it, so the reference sees what the kernel reads).
pub fn random_16(rng: &mut StdRng, dtype: DType, shape: &[usize]) -> HostTensor {
    let n = shape.iter().product();
    HostTensor::from_vec(dtype, shape, (0..n).map(|_| rng.random_range(-1.0f32..1.0) as f64).collect())
}

/// Plain Rust row-wise softmax of a `[R, C]` tensor.
pub fn softmax_ref(x: &HostTensor) -> Vec<f64> {
    let (r, c) = (x.shape[0], x.shape[1]);
    let mut want = Vec::new();
    for i in 0..r {
        let row: Vec<f64> = (0..c).map(|j| x.get(&[i, j])).collect();
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        want.extend(row.iter().map(|v| (v - m).exp() / s));
    }
    want
}

/// Plain Rust RMSNorm of a `[R, C]` tensor scaled by `w` (`[C]`).
pub fn rms_norm_ref(x: &HostTensor, w: &HostTensor, eps: f64) -> Vec<f64> {
    let (r, c) = (x.shape[0], x.shape[1]);
    let mut out = Vec::with_capacity(r * c);
    for i in 0..r {
        let ms: f64 = (0..c).map(|j| x.get(&[i, j]).powi(2)).sum::<f64>() / c as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        out.extend((0..c).map(|j| x.get(&[i, j]) * inv * w.get(&[j])));
    }
    out
}

/// Plain attention in f64 with a mask function and a score function.
pub fn attention_ref(
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    scale: f64,
    mask: &dyn Fn(usize, usize, usize, usize) -> bool,
    score: &dyn Fn(f64, usize, usize, usize, usize) -> f64,
) -> Vec<f64> {
    let (b_n, sq, hq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (sk, hkv) = (k.shape[1], k.shape[2]);
    let mut out = vec![0.0; b_n * sq * hq * d];
    for b in 0..b_n {
        for h in 0..hq {
            let hk = h / (hq / hkv);
            for i in 0..sq {
                let s: Vec<f64> = (0..sk)
                    .map(|j| {
                        if !mask(b, h, i, j) {
                            return f64::NEG_INFINITY;
                        }
                        let dot: f64 = (0..d).map(|x| q.get(&[b, i, h, x]) * k.get(&[b, j, hk, x])).sum();
                        score(dot * scale, b, h, i, j)
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = p.iter().sum();
                for x in 0..d {
                    let o: f64 = (0..sk).map(|j| p[j] * v.get(&[b, j, hk, x])).sum();
                    out[((b * sq + i) * hq + h) * d + x] = o / l;
                }
            }
        }
    }
    out
}

/// Random documents for the `document_causal` mod: per batch entry, token `i`'s document
/// id (nondecreasing, lengths 1..=max_len), `[B, S]` row-major.
pub fn random_documents(rng: &mut StdRng, batch: usize, seq: usize, max_len: usize) -> Vec<i32> {
    let mut ids = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let (mut doc, mut left) = (0, rng.random_range(1..=max_len));
        for _ in 0..seq {
            if left == 0 {
                doc += 1;
                left = rng.random_range(1..=max_len);
            }
            ids.push(doc);
            left -= 1;
        }
    }
    ids
}

/// Per-head ALiBi-like slopes in (0, 0.5).
pub fn random_slopes(rng: &mut StdRng, heads: usize) -> Vec<f32> {
    (0..heads).map(|_| rng.random_range(0.01f32..0.5)).collect()
}

/// A flash call for `flash_document_slopes` (f32, default features): random inputs of
/// `shape`, random documents of up to `max_doc` tokens as `doc [B, S]` and per-head
/// `slopes [H]` among the call's tensors.
pub struct DocumentCall {
    pub shape: ejc_ir::flash::FlashShape,
    pub inputs: ejc_ir::flash::problem::FlashInputs,
    pub rt: ejc_ir::flash::problem::FlashRuntime,
    pub host: ejc_ir::op::HostCall,
    pub doc: Vec<i32>,
    pub slopes: Vec<f32>,
}

pub fn document_call(rng: &mut StdRng, shape: &str, max_doc: usize, seed: u64) -> DocumentCall {
    use ejc_ir::flash::inputs::{default_runtime, random_inputs};
    let f = ejc_ir::flash::Features::default();
    let shape = ejc_ir::flash::FlashShape::parse(shape).unwrap();
    let (b, s, h) = (shape.batch, shape.seq_q, shape.heads_q);
    let doc = random_documents(rng, b, s, max_doc);
    let slopes = random_slopes(rng, h);
    let inputs = random_inputs(&f, DType::F32, &shape, seed);
    let rt = default_runtime(&f, &shape, seed);
    let mut host = ejc_ir::flash::op::host_call(&f, &rt, &inputs);
    let ints = doc.iter().map(|&x| x as f64).collect();
    host.tensors.insert("doc".into(), HostTensor::from_vec(DType::I32, &[b, s], ints));
    let floats = slopes.iter().map(|&x| x as f64).collect();
    host.tensors.insert("slopes".into(), HostTensor::from_vec(DType::F32, &[h], floats));
    DocumentCall { shape, inputs, rt, host, doc, slopes }
}
