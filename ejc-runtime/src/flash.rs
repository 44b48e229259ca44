//! The typed front door of the flash-attention forward: ejkernel's `flash_attention`
//! options and tensors, turned into a generic call ([`crate::api::Runtime::call`]).
//!
//! ```no_run
//! use ejc_runtime::flash::{flash_attention, FlashArgs, FlashOptions, SlidingWindow};
//! use ejc_runtime::cpu::HostBuffer;
//! # fn demo(q: HostBuffer, k: HostBuffer, v: HostBuffer) {
//! // Kernels from `ejc build specs/flash.yaml --target cpu -o out` (or $EJC_KERNELS).
//! let opts = FlashOptions { causal: true, sliding_window: Some(SlidingWindow::Size(4096)), ..Default::default() };
//! let r = flash_attention(&FlashArgs::new(&q, &k, &v), &opts).unwrap();
//! println!("{} with {:?} (from the {})", r.kernels.join(" + "), r.config, r.source);
//! # }
//! ```
//!
//! Tensors may be host buffers or (feature `cuda`) GPU buffers: a call whose tensors are
//! on the GPU runs there. Every argument is checked first and a bad one is an error that
//! names it.

use std::sync::{Mutex, OnceLock};

use ejc_ir::flash::op::scalars_of;
use ejc_ir::flash::{CallFeatures, Features, FlashRuntime};
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;

use crate::api::{ApiError, CallOptions, PlatformChoice, Runtime, RuntimeOptions};
use crate::call::{Call, Tensor};
use crate::chain::Source;
use crate::cpu::HostBuffer;
use crate::registry::Config;

/// ejkernel's `sliding_window`: an int or a (left, right) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlidingWindow {
    /// `w` means (w, 0) with causal, (w, w) without.
    Size(i64),
    LeftRight(i64, i64),
}

/// The options of a flash-attention call.
#[derive(Clone, Debug, Default)]
pub struct FlashOptions {
    pub causal: bool,
    pub sliding_window: Option<SlidingWindow>,
    pub logits_soft_cap: Option<f64>,
    /// Default 1/sqrt(head_dim).
    pub softmax_scale: Option<f64>,
    /// Dropout probability (0 or None: no dropout).
    pub dropout_p: Option<f64>,
    pub dropout_seed: u64,
    pub platform: PlatformChoice,
    /// An explicit configuration: always used, never cached.
    pub config: Option<Config>,
    /// Worker threads (0 = all cores).
    pub threads: usize,
}

/// A tensor argument: host memory or (feature `cuda`) GPU memory.
#[derive(Clone, Copy)]
pub enum Arg<'a> {
    Host(&'a HostBuffer),
    #[cfg(feature = "cuda")]
    Cuda(&'a crate::cuda::DeviceBuffer),
}

impl<'a> From<&'a HostBuffer> for Arg<'a> {
    fn from(b: &'a HostBuffer) -> Arg<'a> {
        Arg::Host(b)
    }
}

#[cfg(feature = "cuda")]
impl<'a> From<&'a crate::cuda::DeviceBuffer> for Arg<'a> {
    fn from(b: &'a crate::cuda::DeviceBuffer) -> Arg<'a> {
        Arg::Cuda(b)
    }
}

impl Arg<'_> {
    fn dtype(&self) -> DType {
        match self {
            Arg::Host(b) => b.dtype,
            #[cfg(feature = "cuda")]
            Arg::Cuda(b) => b.dtype,
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            Arg::Host(b) => &b.shape,
            #[cfg(feature = "cuda")]
            Arg::Cuda(b) => &b.shape,
        }
    }
    fn tensor(&self) -> Tensor {
        match self {
            Arg::Host(b) => Tensor::Host((*b).clone()),
            // A view: the kernels read and write the caller's memory.
            #[cfg(feature = "cuda")]
            Arg::Cuda(b) => Tensor::Cuda((*b).clone()),
        }
    }
}

/// The tensors of a call.
#[derive(Clone, Copy)]
pub struct FlashArgs<'a> {
    pub q: Arg<'a>,
    pub k: Arg<'a>,
    pub v: Arg<'a>,
    pub bias: Option<Arg<'a>>,
    pub mask: Option<Arg<'a>>,
    pub q_segment_ids: Option<Arg<'a>>,
    pub kv_segment_ids: Option<Arg<'a>>,
    pub cu_seqlens_q: Option<Arg<'a>>,
    pub cu_seqlens_k: Option<Arg<'a>>,
    /// `[heads_q, n]` or `[n]` (shared by every head).
    pub sinks: Option<Arg<'a>>,
}

impl<'a> FlashArgs<'a> {
    pub fn new(q: impl Into<Arg<'a>>, k: impl Into<Arg<'a>>, v: impl Into<Arg<'a>>) -> Self {
        FlashArgs {
            q: q.into(),
            k: k.into(),
            v: v.into(),
            bias: None,
            mask: None,
            q_segment_ids: None,
            kv_segment_ids: None,
            cu_seqlens_q: None,
            cu_seqlens_k: None,
            sinks: None,
        }
    }
}

/// The result of a call: the output (q's shape) and the log-sum-exp (f32 `[B, Hq, Sq]`,
/// natural log), where the inputs were (host or GPU), and what ran.
pub struct FlashResult {
    pub out: Tensor,
    pub lse: Tensor,
    /// The entry point of each launch (one, or the split-KV plan's two).
    pub kernels: Vec<String>,
    pub plan: String,
    pub config: Config,
    pub source: Source,
}

fn arg(arg: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::Argument { arg, message: message.into() }
}

impl Runtime {
    /// Flash-attention forward: output and log-sum-exp.
    pub fn flash_attention(&mut self, a: &FlashArgs, o: &FlashOptions) -> Result<FlashResult, ApiError> {
        // ---- arguments ----
        let dtype = a.q.dtype();
        if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(arg("q", format!("dtype {dtype}: flash attention takes bf16, f16 or f32")));
        }
        for (name, t) in [("k", a.k), ("v", a.v)] {
            if t.dtype() != dtype {
                return Err(arg(name, format!("dtype {} differs from q's {dtype}", t.dtype())));
            }
        }
        for (name, t) in [("q", a.q), ("k", a.k), ("v", a.v)] {
            if t.shape().len() != 4 {
                return Err(arg(name, format!("shape {:?} is not [batch, seq, heads, head_dim]", t.shape())));
            }
        }
        let (b, sq, hq, d) = (a.q.shape()[0], a.q.shape()[1], a.q.shape()[2], a.q.shape()[3]);
        if a.cu_seqlens_q.is_some() != a.cu_seqlens_k.is_some() {
            return Err(arg(
                if a.cu_seqlens_q.is_some() { "cu_seqlens_k" } else { "cu_seqlens_q" },
                "varlen needs both cu_seqlens_q and cu_seqlens_k",
            ));
        }
        if a.q_segment_ids.is_some() != a.kv_segment_ids.is_some() {
            return Err(arg(
                if a.q_segment_ids.is_some() { "kv_segment_ids" } else { "q_segment_ids" },
                "segment ids need both q_segment_ids and kv_segment_ids",
            ));
        }
        let window = match o.sliding_window {
            None => None,
            Some(SlidingWindow::Size(w)) => Some(if o.causal { (w, 0) } else { (w, w) }),
            Some(SlidingWindow::LeftRight(l, r)) => Some((l, r)),
        };
        if let Some((l, r)) = window {
            if l < 0 || r < 0 {
                return Err(arg("sliding_window", format!("({l}, {r}): both sides must be >= 0")));
            }
        }
        if let Some(c) = o.logits_soft_cap {
            if !(c > 0.0 && c.is_finite()) {
                return Err(arg("logits_soft_cap", format!("{c} must be a positive finite number")));
            }
        }
        let dropout = o.dropout_p.is_some_and(|p| p > 0.0);
        if let Some(p) = o.dropout_p {
            if !(0.0..1.0).contains(&p) {
                return Err(arg("dropout_p", format!("{p} must be in [0, 1)")));
            }
        }
        let wanted = CallFeatures {
            causal: o.causal,
            window,
            softcap: o.logits_soft_cap,
            sinks: a.sinks.is_some(),
            bias: a.bias.is_some(),
            mask: a.mask.is_some(),
            segment_ids: a.q_segment_ids.is_some(),
            varlen: a.cu_seqlens_q.is_some(),
            dropout,
            bias_grad: false,
        };
        // ---- the generic call ----
        let mut call = Call::default();
        let mut put = |name: &str, t: Option<Arg>| {
            if let Some(t) = t {
                call.tensors.insert(name.to_string(), t.tensor());
            }
        };
        put("q", Some(a.q));
        put("k", Some(a.k));
        put("v", Some(a.v));
        put("bias", a.bias);
        put("mask", a.mask);
        put("q_segment_ids", a.q_segment_ids);
        put("kv_segment_ids", a.kv_segment_ids);
        put("cu_seqlens_q", a.cu_seqlens_q);
        put("cu_seqlens_k", a.cu_seqlens_k);
        // Shared sinks `[n]` are the per-head form with a zero stride on the head axis.
        if let Some(s) = a.sinks {
            let mut t = s.tensor();
            let widen = |shape: &mut Vec<usize>, strides: &mut Vec<isize>| {
                if shape.len() == 1 {
                    *shape = vec![hq, shape[0]];
                    *strides = vec![0, strides[0]];
                }
            };
            match &mut t {
                Tensor::Host(b) => widen(&mut b.shape, &mut b.strides),
                #[cfg(feature = "cuda")]
                Tensor::Cuda(b) => widen(&mut b.shape, &mut b.strides),
            }
            call.tensors.insert("sinks".into(), t);
        }
        // Outputs where the inputs are, NaN-filled so an unwritten element shows.
        // The output has v's head dim (which may differ from q's: 192/128).
        let dv = a.v.shape()[3];
        let out = HostBuffer::from_host(&HostTensor::full(dtype, &[b, sq, hq, dv], f64::NAN));
        let lse = HostBuffer::from_host(&HostTensor::full(DType::F32, &[b, hq, sq], f64::NAN));
        let on_device = !matches!(a.q, Arg::Host(_));
        if on_device {
            #[cfg(feature = "cuda")]
            {
                let cuda = self.cuda()?;
                let up = |h: &HostBuffer| cuda.upload(h).map_err(|e| ApiError::Unsupported(e.to_string()));
                call.tensors.insert("out".into(), Tensor::Cuda(up(&out)?));
                call.tensors.insert("lse".into(), Tensor::Cuda(up(&lse)?));
                call.cuda = Some(cuda);
            }
        } else {
            call.tensors.insert("out".into(), Tensor::Host(out));
            call.tensors.insert("lse".into(), Tensor::Host(lse));
        }
        let features = Features {
            causal: o.causal,
            sliding_window: window.map(|_| ejc_ir::flash::Window::Runtime),
            logits_soft_cap: o.logits_soft_cap.map(|_| ejc_ir::flash::SoftCap::Runtime),
            sinks: wanted.sinks,
            bias: wanted.bias,
            mask: wanted.mask,
            segment_ids: wanted.segment_ids,
            varlen: wanted.varlen,
            dropout,
            bias_grad: false,
        };
        let rt = FlashRuntime {
            softmax_scale: o.softmax_scale.unwrap_or(1.0 / (d as f64).sqrt()),
            window: window.unwrap_or((0, 0)),
            softcap: o.logits_soft_cap.unwrap_or(1.0),
            dropout_p: o.dropout_p.unwrap_or(0.0),
            seed: o.dropout_seed,
        };
        call.scalars = scalars_of(&features, &rt);
        let opts = CallOptions {
            platform: o.platform,
            config: o.config.clone(),
            threads: o.threads,
            deterministic: false,
            asynchronous: false,
        };
        let r = self.call("flash_attention_fwd", &wanted.to_json(), &mut call, &opts)?;
        let out = call.tensors.remove("out").ok_or_else(|| ApiError::Call("the call lost `out`".into()))?;
        let lse = call.tensors.remove("lse").ok_or_else(|| ApiError::Call("the call lost `lse`".into()))?;
        Ok(FlashResult { out, lse, kernels: r.kernels, plan: r.plan, config: r.config, source: r.source })
    }
}

fn global() -> &'static Mutex<Option<Runtime>> {
    static RT: OnceLock<Mutex<Option<Runtime>>> = OnceLock::new();
    RT.get_or_init(|| Mutex::new(None))
}

/// [`Runtime::flash_attention`] on a process-wide runtime, made on first use from the
/// environment (`$EJC_KERNELS`, `$EJC_CACHE_DIR`, `$EJC_LOG`).
pub fn flash_attention(a: &FlashArgs, o: &FlashOptions) -> Result<FlashResult, ApiError> {
    let mut g = global().lock().map_err(|_| ApiError::Unsupported("the runtime's lock is poisoned".into()))?;
    if g.is_none() {
        *g = Some(Runtime::new(RuntimeOptions::default())?);
    }
    g.as_mut().expect("set above").flash_attention(a, o)
}
