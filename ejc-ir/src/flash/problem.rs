//! One flash-attention forward call: its shape, its run-time scalars and its inputs.
//!
//! These are shared by the reference ([`super::reference`]), the random-input
//! generator ([`super::inputs`]) and the kernel ABI binding ([`super::abi`]).

use crate::tensor::HostTensor;

/// Logical problem size. For `varlen` variants `batch` is the number of packed
/// sequences and `seq_q` / `seq_k` are the *maximum* lengths; the real lengths come
/// from `cu_seqlens_q/k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashShape {
    pub batch: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    /// The head dim of q and k.
    pub head_dim: usize,
    /// The head dim of v and of the output (usually `head_dim`; 128 with `head_dim`
    /// 192 in DeepSeek-V3-style attention).
    pub head_dim_v: usize,
}

impl FlashShape {
    /// A shape whose value head dim equals `head_dim`.
    pub fn new(batch: usize, seq_q: usize, seq_k: usize, heads_q: usize, heads_kv: usize, head_dim: usize) -> Self {
        FlashShape { batch, seq_q, seq_k, heads_q, heads_kv, head_dim, head_dim_v: head_dim }
    }

    /// The same shape with value head dim `dv`.
    pub fn with_head_dim_v(self, dv: usize) -> Self {
        FlashShape { head_dim_v: dv, ..self }
    }

    /// Parse `b,sq,sk,hq,hkv,d` or `b,sq,sk,hq,hkv,d,dv`.
    pub fn parse(s: &str) -> Result<FlashShape, String> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        if parts.len() != 6 && parts.len() != 7 {
            return Err(format!(
                "shape `{s}` has {} fields; expected 6 or 7: batch,seq_q,seq_k,heads_q,heads_kv,head_dim[,head_dim_v]",
                parts.len()
            ));
        }
        let mut v = [0usize; 7];
        for (i, p) in parts.iter().enumerate() {
            v[i] = p.parse().map_err(|_| format!("shape field {} (`{p}`) is not a non-negative integer", i + 1))?;
        }
        let dv = if parts.len() == 7 { v[6] } else { v[5] };
        let shape = FlashShape::new(v[0], v[1], v[2], v[3], v[4], v[5]).with_head_dim_v(dv);
        shape.validate()?;
        Ok(shape)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.batch == 0 || self.heads_q == 0 || self.heads_kv == 0 || self.head_dim == 0 || self.head_dim_v == 0 {
            return Err("batch, heads_q, heads_kv, head_dim and head_dim_v must be at least 1".into());
        }
        if !self.heads_q.is_multiple_of(self.heads_kv) {
            return Err(format!(
                "heads_q ({}) must be a multiple of heads_kv ({}) (GQA/MQA groups query heads evenly)",
                self.heads_q, self.heads_kv
            ));
        }
        // Element counts (and their f64 bytes) fit 64-bit arithmetic, so nothing
        // downstream wraps.
        // The score count (never stored) must too: work estimates multiply it.
        let widest = self.head_dim.max(self.head_dim_v);
        crate::op::elements(&[self.batch, self.heads_q, self.seq_q, self.seq_k, widest]).map_err(|_| {
            format!("sizes {self}: batch x heads_q x seq_q x seq_k x head_dim overflows 64-bit arithmetic")
        })?;
        for t in [[self.batch, self.seq_q, self.heads_q, widest], [self.batch, self.seq_k, self.heads_kv, widest]] {
            let n = crate::op::elements(&t).map_err(|e| format!("sizes {self}: {e}"))?;
            if n > (isize::MAX as u64) / 8 {
                return Err(format!("sizes {self}: a tensor of {t:?} is larger than this machine can address"));
            }
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }
}

impl std::fmt::Display for FlashShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{},{},{},{},{},{}", self.batch, self.seq_q, self.seq_k, self.heads_q, self.heads_kv, self.head_dim)?;
        if self.head_dim_v != self.head_dim {
            write!(f, ",{}", self.head_dim_v)?;
        }
        Ok(())
    }
}

/// Run-time scalars of one call. Fields that the variant does not use are ignored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashRuntime {
    /// Multiplies q·k. Default 1/sqrt(head_dim).
    pub softmax_scale: f64,
    /// `(left, right)`, inclusive, both >= 0. Used when the variant has a runtime window.
    pub window: (i64, i64),
    /// Soft cap `c > 0`. Used when the variant has a runtime soft cap.
    pub softcap: f64,
    /// Dropout probability in [0, 1).
    pub dropout_p: f64,
    /// Dropout seed; the kernel takes it as two u32 halves (`seed_lo`, `seed_hi`).
    pub seed: u64,
}

/// Input tensors (already rounded to their element types).
///
/// Dense layout: q `[B, Sq, Hq, D]`, k `[B, Sk, Hkv, D]`, v `[B, Sk, Hkv, Dv]`.
/// Varlen layout: q `[1, total_q, Hq, D]`, k/v `[1, total_k, Hkv, D/Dv]`, with
/// `cu_seqlens_q/k` i32 `[B + 1]` prefix sums of the per-sequence lengths.
#[derive(Clone, Debug)]
pub struct FlashInputs {
    pub q: HostTensor,
    pub k: HostTensor,
    pub v: HostTensor,
    /// Same dtype as q; `[B, Hq, Sq, Sk]` logically, broadcast axes have stride 0.
    pub bias: Option<HostTensor>,
    /// i1 `[B, Hq, Sq, Sk]` logically, broadcast axes have stride 0. True = attend.
    pub mask: Option<HostTensor>,
    /// i32 `[B, Sq]`.
    pub q_segment_ids: Option<HostTensor>,
    /// i32 `[B, Sk]`.
    pub kv_segment_ids: Option<HostTensor>,
    /// i32 `[B + 1]`.
    pub cu_seqlens_q: Option<HostTensor>,
    /// i32 `[B + 1]`.
    pub cu_seqlens_k: Option<HostTensor>,
    /// f32 `[Hq, n_sinks]` logically (stride 0 on the head axis for shared sinks).
    pub sinks: Option<HostTensor>,
}

/// Forward outputs. `out` has q's layout with `Dv` columns, `lse` is f32 `[B, Hq, Sq]` (varlen:
/// `[1, Hq, total_q]`), natural log.
#[derive(Clone, Debug)]
pub struct FlashOutputs {
    pub out: HostTensor,
    pub lse: HostTensor,
}
